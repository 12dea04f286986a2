"""Checkpoints and exact resume, in process and through real, killed processes.

* In process (Trainer + WorkerCore threads): a job stopped right after checkpoint s and
  resumed by a fresh Trainer equals the uninterrupted job bitwise (CPU, fp32), with
  staleness 0 and 1, with fewer workers than it was checkpointed with, for LoRA, and
  after a failed save paused it; checkpoints load with transformers / peft; a new job
  starts from another job's checkpoint.
* SIGKILL trials: a child writes checkpoints in a loop and is killed at random times
  (seeds printed); ``latest`` always names a complete checkpoint and the next run
  resumes from it.
* Real daemons: the coordinator is SIGKILLed mid-job and restarted: the running job
  resumes from its checkpoint (with one worker fewer) and the queued job runs after it;
  a full output file system pauses a job, and ``roundpipe resume`` finishes it.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from runtime_helpers import (
    InProcessWorkers,
    assert_params_match,
    load_output,
    oracle_train,
    tiny_spec,
)
from safetensors.torch import load_file

from roundpipe.client import RoundPipeError
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.checkpoint_format import LATEST, MANIFEST, sealed, step_name
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.training import checkpointer as checkpointer_module
from roundpipe.coordinator.training.checkpoint import (
    PROGRESS_FILE,
    STATE_FILE,
    CheckpointDir,
    load_tensors,
    verify_checkpoint,
)
from roundpipe.coordinator.training.hold_point import hold_env
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.job_events import CheckpointWritten, JobEvent
from roundpipe.coordinator.training.snapshot import CHECKPOINT_FAULT_ENV
from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.protocol import ProgressEvent
from roundpipe.shared.model import LayeredModel

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
HOLD_STEP = 12  # where the cluster fixture's jobs wait while its release file is absent


def roundpipe_resume(
    cluster: LocalCluster, job_id: str, *flags: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``roundpipe resume JOB FLAGS`` against the cluster, as its admin, in a fresh
    interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "roundpipe.cli", "resume", job_id, *flags]
        + ["--address", cluster.address],
        env={**os.environ, **cluster.key_env("admin")},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def make_spec(output: Path, *, every: int = 2, steps: int = 5, **kw) -> JobSpec:
    d = tiny_spec(output, steps=steps, **kw).to_dict()
    d["output"].update(checkpoint_every=every, keep_last=2)
    return JobSpec.from_dict(d)


def train(
    spec: JobSpec,
    arena_dir: Path,
    *,
    job_id: str = "job-r",
    workers: int = 2,
    stop_after: int | None = None,
    events: list[ProgressEvent] | None = None,
) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]] | None:
    """Run the job through a Trainer; with ``stop_after``, cancel it right after the
    checkpoint of that step and return None. Else (weights by name, [(step, loss)]),
    and its progress events appended to ``events``."""

    def on_event(event: JobEvent) -> None:
        if isinstance(event, CheckpointWritten):
            if stop_after is not None and event.step >= stop_after:
                trainer.cancel()

    trainer = Trainer(
        job_id,
        spec,
        arena_dir=arena_dir,
        namespace="resumetest",
        output_dir=Path(spec.output.dir),
        wait_timeout_s=60,
        on_event=on_event,
    )
    pool = None

    try:
        trainer.prepare(workers)
        pool = InProcessWorkers(trainer, workers)
        try:
            trainer.run(pool)
        except JobCancelled:
            assert stop_after is not None
            return None
        weights = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
        if events is not None:
            events.extend(trainer.progress)
        return weights, [(e.step, e.loss) for e in trainer.progress]
    finally:
        if pool is not None:
            pool.close()
        trainer.close()


@functools.cache
def reference(staleness: int, workers: int, lora: bool = False, steps: int = 5):
    """The uninterrupted job (its checkpoints go to a throwaway directory)."""
    out = (
        Path(os.environ.get("TMPDIR", "/tmp"))
        / f"rp-ref-{os.getpid()}-{staleness}-{workers}-{lora}-{steps}"
    )
    arena = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else out
    arena = arena / f"rp-ref-arena-{os.getpid()}"
    arena.mkdir(parents=True, exist_ok=True)
    try:
        spec = make_spec(out, staleness=staleness, lora=LORA if lora else None, steps=steps)
        result = train(spec, arena, job_id="job-ref", workers=workers)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(arena, ignore_errors=True)
    assert result is not None
    return result


def assert_bitwise(result, ref) -> None:
    weights, progress = result
    ref_weights, ref_progress = ref
    assert weights.keys() == ref_weights.keys()
    different = [n for n in weights if not torch.equal(weights[n], ref_weights[n])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert progress == ref_progress  # same steps, bitwise-equal losses


# --------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("stop_after", [2, 4])
def test_stopped_and_resumed_job_equals_uninterrupted_bitwise(
    tmp_path: Path, arena_dir: Path, staleness: int, stop_after: int
) -> None:
    spec = make_spec(tmp_path / "out", staleness=staleness)
    assert train(spec, arena_dir, stop_after=stop_after) is None
    ckpts = CheckpointDir(tmp_path / "out" / "checkpoints")
    assert ckpts.find_latest("job-r").step == stop_after
    resumed = train(spec, arena_dir)
    assert_bitwise(resumed, reference(staleness, 2))
    # Final checkpoint written, pruned to keep_last = 2.
    assert [c.step for c in ckpts.complete("job-r")] == [4, 5]


def test_the_progress_history_is_a_file_of_its_own_and_resumes_exactly(
    tmp_path: Path, arena_dir: Path
) -> None:
    """Note [compact progress history]: every save reads every manifest of the
    directory (to prune), so the history is not in the manifest, which stays the same
    size however long the job has run; a resumed job's events up to its checkpoint are
    the ones written, every field."""
    spec = make_spec(tmp_path / "out", steps=8)
    assert train(spec, arena_dir, stop_after=6) is None
    root = tmp_path / "out" / "checkpoints"
    sizes = [len((root / step_name(s) / MANIFEST).read_bytes()) for s in (4, 6)]
    assert abs(sizes[1] - sizes[0]) < 40, sizes  # two more steps: ~300 bytes in the manifest
    manifest = json.loads((root / step_name(6) / MANIFEST).read_text())
    assert "progress" not in manifest and manifest["progress_file"] == PROGRESS_FILE
    table = load_file(root / step_name(6) / PROGRESS_FILE)["progress"]
    assert table.dtype == torch.float64 and table[:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    events: list[ProgressEvent] = []
    train(spec, arena_dir, events=events)
    assert [e.step for e in events] == list(range(1, 9))
    fields = [[e.step, e.loss, e.tokens_per_s, e.lr, e.time, e.optimizer_s] for e in events]
    assert fields[:6] == table.tolist()


def test_a_checkpoint_with_its_history_in_the_manifest_resumes_exactly(
    tmp_path: Path, arena_dir: Path
) -> None:
    """Checkpoints written before the progress file held the history in the manifest
    (``progress``: a list of rows); they still resume, history included."""
    spec = make_spec(tmp_path / "out", staleness=1)
    assert train(spec, arena_dir, stop_after=4) is None
    step_dir = tmp_path / "out" / "checkpoints" / step_name(4)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    rows = load_file(step_dir / PROGRESS_FILE)["progress"].tolist()
    manifest["progress"] = [row[:5] for row in rows]  # the oldest lacked optimizer_s
    del manifest["progress_file"], manifest["files"][PROGRESS_FILE]
    (step_dir / PROGRESS_FILE).unlink()
    (step_dir / MANIFEST).write_text(json.dumps(sealed(manifest)))
    assert_bitwise(train(spec, arena_dir), reference(1, 2))


def test_an_int8_checkpoint_from_before_root_second_moments_resumes(
    tmp_path: Path, arena_dir: Path, caplog
) -> None:
    """Note [8-bit second moment]: 8-bit states once stored the second moment itself
    (kind ``exp_avg_sq``), now its root. A checkpoint of the old kind resumes, converted
    (not bitwise: the conversion rounds), and ends near the new kind's own resume."""
    import hashlib

    from safetensors import safe_open

    from roundpipe.coordinator.training.checkpoint import STATE_FILE, save_tensors
    from roundpipe.coordinator.training.quantized_state import (
        UNSIGNED_MAP,
        dequantize_,
        quantize_,
    )

    results = {}
    for kind in ("new", "old"):
        spec = make_spec(tmp_path / kind, staleness=1, optimizer={"state_dtype": "int8"})
        assert train(spec, arena_dir, stop_after=2) is None
        if kind == "old":  # rewrite step 2's second moments as they used to be stored
            path = CheckpointDir(tmp_path / kind / "checkpoints").find_latest("job-r").path
            with safe_open(str(path / STATE_FILE), framework="pt") as f:
                tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # not the mmap
                metadata = f.metadata()
            for key in [k for k in tensors if k.startswith("exp_avg_sqrt/")]:
                name = key.split("/", 1)[1]
                codes, absmax = tensors.pop(key), tensors.pop(f"exp_avg_sqrt_absmax/{name}")
                v = torch.empty(codes.numel())
                dequantize_(codes, absmax, UNSIGNED_MAP, v)
                quantize_(v.square_(), codes, absmax, UNSIGNED_MAP)
                tensors[f"exp_avg_sq/{name}"] = codes
                tensors[f"exp_avg_sq_absmax/{name}"] = absmax
            save_tensors(path / STATE_FILE, tensors, metadata)
            manifest = json.loads((path / MANIFEST).read_text())  # still an intact checkpoint
            data = (path / STATE_FILE).read_bytes()
            manifest["files"][STATE_FILE] = {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            (path / MANIFEST).write_text(json.dumps(sealed(manifest)))
        caplog.clear()
        with caplog.at_level("INFO"):
            results[kind] = train(spec, arena_dir)
        converted = "8-bit second moments converted to their roots" in caplog.text
        assert converted == (kind == "old"), caplog.text
    (new, new_progress), (old, old_progress) = results["new"], results["old"]
    assert [s for s, _ in old_progress] == [s for s, _ in new_progress]
    for name, w in new.items():
        assert torch.allclose(old[name], w, rtol=0, atol=1e-3), name  # lr 3e-4


def test_a_resumed_jobs_figures_are_its_own_run_s(tmp_path: Path, arena_dir: Path) -> None:
    """After a resume the progress log starts with the checkpoint's events: the time
    between the last of them and the run's first step (the downtime) was reported as
    a step's seconds (roundpipe_job_step_seconds), and the old run's figures until then.
    Nor is the optimizer lag its checkpoint's step (thousands, for a long job) between
    prepare() and run(): the run's recorder had seen no step applied."""
    from roundpipe.coordinator.service.figures import job_figures

    spec = make_spec(tmp_path / "out", staleness=1)
    assert train(spec, arena_dir, stop_after=2) is None
    trainer = Trainer(
        "job-r", spec, arena_dir=arena_dir, namespace="resumefig", output_dir=tmp_path / "out"
    )
    try:
        trainer.prepare(1)
        assert trainer.start_step == 2 and len(trainer.recent_progress(2)) == 2
        before = job_figures(trainer)
        assert before.step_s is None and before.tokens_per_s is None and before.lr is None
        assert before.optimizer_lag_steps == 0
        pool = InProcessWorkers(trainer, 1)
        try:
            trainer.run(pool)
        finally:
            pool.close()
        after = job_figures(trainer)
        newest = trainer.recent_progress(2)
        assert after.step_s == newest[1].time - newest[0].time  # steps 4 and 5: this run's
    finally:
        trainer.close()


def test_checkpoint_from_three_workers_resumes_with_one_or_two(
    tmp_path: Path, arena_dir: Path
) -> None:
    for workers in (1, 2):
        spec = make_spec(tmp_path / f"out{workers}", staleness=1)
        assert train(spec, arena_dir, workers=3, stop_after=2) is None
        assert_bitwise(train(spec, arena_dir, workers=workers), reference(1, 3))


def test_lora_checkpoint_is_a_peft_adapter_and_resumes_exactly(
    tmp_path: Path, arena_dir: Path
) -> None:
    from peft import AutoPeftModelForCausalLM

    spec = make_spec(tmp_path / "out", staleness=1, lora=LORA)
    assert train(spec, arena_dir, stop_after=2) is None
    step2 = tmp_path / "out" / "checkpoints" / step_name(2)
    assert (step2 / "adapter_config.json").is_file()
    assert (tmp_path / "out" / "base_model" / "config.json").is_file()
    model = AutoPeftModelForCausalLM.from_pretrained(str(step2))
    saved = _saved_masters(step2, spec)
    params = dict(model.named_parameters())
    assert saved and all(torch.equal(params[n], t) for n, t in saved.items())
    assert_bitwise(train(spec, arena_dir), reference(1, 2, lora=True))


def _saved_masters(step_dir: Path, spec: JobSpec) -> dict[str, torch.Tensor]:
    """The fp32 master weights a checkpoint holds, by parameter name: in its model files
    only (the training state does not repeat them)."""
    state_keys = [k for k, _ in load_tensors(step_dir / STATE_FILE)]
    assert state_keys and not any(k.startswith("master/") for k in state_keys)
    lora = spec.lora.model_settings() if spec.lora is not None else None
    model = LayeredModel(model_config_from_spec(spec.model), lora)
    saved = model.read_exported(step_dir, model.trainable_names)
    assert saved.keys() == set(model.trainable_names)
    return saved


def test_full_checkpoint_loads_with_transformers_and_as_a_new_jobs_model(
    tmp_path: Path, arena_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    spec = make_spec(tmp_path / "out", staleness=0)
    assert train(spec, arena_dir, stop_after=2) is None
    step2 = tmp_path / "out" / "checkpoints" / step_name(2)
    model = AutoModelForCausalLM.from_pretrained(str(step2))
    saved = _saved_masters(step2, spec)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in saved.items())
    # A new job whose model.path is the checkpoint starts from those weights (fresh
    # optimizer): the HF files at the top of the checkpoint are all it reads.
    d = spec.to_dict()
    d["model"] = {"path": str(step2)}
    d["output"]["dir"] = str(tmp_path / "fresh")
    fresh = Trainer(
        "job-fresh",
        JobSpec.from_dict(d),
        arena_dir=arena_dir,
        namespace="resumetest",
        output_dir=tmp_path / "fresh",
    )
    try:
        fresh.prepare(2)
        assert fresh.start_step == 0
        masters = {n: t for layer in fresh.masters.values() for n, t in layer.items()}
        assert all(torch.equal(masters[n], t) for n, t in saved.items())
    finally:
        fresh.close()


def test_new_job_continues_from_another_jobs_checkpoint(tmp_path: Path, arena_dir: Path) -> None:
    spec = make_spec(tmp_path / "first", staleness=1, every=3, steps=5)
    assert train(spec, arena_dir, job_id="job-first", stop_after=3) is None
    d = spec.to_dict()
    d["model"]["resume_from"] = str(tmp_path / "first")  # an output dir will do
    d["output"]["dir"] = str(tmp_path / "second")
    assert_resume_refused_at_validation(d, tmp_path)
    # A checkpoint whose data cursor is not at its step (a manifest sealed after the
    # damage) is refused by name, not resumed into the wrong batches.
    manifest_file = tmp_path / "first" / "checkpoints" / step_name(3) / MANIFEST
    good_manifest = manifest_file.read_text()
    damaged = json.loads(good_manifest)
    damaged["data_cursor"]["next_step"] = 6
    manifest_file.write_text(json.dumps(sealed(damaged)))
    with pytest.raises(JobFailed, match=r"is damaged: it is at step 3, but its data cursor"):
        train(JobSpec.from_dict(d), arena_dir, job_id="job-second")
    manifest_file.write_text(good_manifest)
    second = train(JobSpec.from_dict(d), arena_dir, job_id="job-second")
    assert_bitwise(second, reference(1, 2))
    info = CheckpointDir(tmp_path / "second" / "checkpoints").find_latest("job-second")
    assert info.step == 5 and info.manifest["resumed_from"].endswith(step_name(3))


@pytest.mark.parametrize(
    "quant, change",
    [("nf4", {"double_quantization": False}), ("int8", {"int8_scales": "per_block"})],
)
def test_resume_from_refuses_another_storage_of_the_quantised_base(
    tmp_path: Path, arena_dir: Path, quant: str, change: dict
) -> None:
    """How a quantised base's scales are stored changes the base the adapters were
    trained against, as the format does: a continuation with another double
    quantisation or other int8 scales was accepted and trained a different job."""
    spec = make_spec(tmp_path / "first", every=1, steps=3, lora=dict(LORA, base_quantization=quant))
    assert train(spec, arena_dir, job_id="job-first", stop_after=1) is None
    d = spec.to_dict()
    d["model"]["resume_from"] = str(tmp_path / "first")
    d["output"]["dir"] = str(tmp_path / "second")
    JobSpec.from_dict(d)  # the same settings continue it
    d["lora"].update(change)
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(d)
    (key,) = change
    assert any(
        e.path == "lora.base_quantization"
        and "but the adapters of" in e.message
        and ("double quantisation on" if quant == "nf4" else "per_channel scales") in e.message
        for e in err.value.errors
    ), err.value


def test_a_lora_resume_on_a_random_base_refuses_another_base(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A LoRA checkpoint holds only the adapters; a random base is made again from its
    architecture, config and seed. A continuation with another seed (a changed
    train.seed, where the init seed follows it), config or lora.alpha was accepted and
    trained the adapters on as another model, rewriting the base_model the first job's
    checkpoints name."""
    spec = make_spec(tmp_path / "first", every=1, steps=3, lora=LORA)
    assert train(spec, arena_dir, job_id="job-first", stop_after=1) is None
    good = spec.to_dict()
    good["model"]["resume_from"] = str(tmp_path / "first")
    good["output"]["dir"] = str(tmp_path / "second")

    def problems(section: str, **fields) -> dict[str, str]:
        d = copy.deepcopy(good)
        d[section].update(fields)
        try:
            JobSpec.from_dict(d)
        except JobSpecError as exc:
            return {e.path: e.message for e in exc.errors}
        return {}

    assert problems("train", seed=4) == {}  # another dropout; the init seed is set
    assert problems("lora", dropout=0.1) == {}
    errs = problems("model", init_seed=None)  # the seed is train.seed's now: 3
    assert "set model.init_seed: 1234" in errs["model.init_seed"], errs
    assert "seed 999" in problems("model", init_seed=999)["model.init_seed"]
    config = dict(good["model"]["config"], intermediate_size=256)
    assert "intermediate_size differ" in problems("model", config=config)["model.config"]
    same = dict(good["model"]["config"], hidden_act="silu", rope_scaling=None)  # defaults
    assert problems("model", config=same) == {}
    assert "got 64.0, but the adapters" in problems("lora", alpha=64.0)["lora.alpha"]
    base = str(tmp_path / "first" / "base_model")  # the random base, written out: the same
    assert problems("model", architecture=None, config={}, init_seed=None, path=base) == {}


def assert_resume_refused_at_validation(good: dict, tmp_path: Path) -> None:
    """A resume that cannot continue the checkpoint (step 3 of 2 x 3 rows, shuffled with
    seed 7, full fine-tuning) is refused by validation, so `roundpipe submit`
    reports it before anything is sent; another split of the same 6 rows is fine."""
    from roundpipe import cli

    def problems(**changes: dict) -> dict[str, str]:
        d = copy.deepcopy(good)
        for section, fields in changes.items():
            d[section] = None if fields is None else {**(d.get(section) or {}), **fields}
        try:
            JobSpec.from_dict(d)
        except JobSpecError as exc:
            return {e.path: e.message for e in exc.errors}
        return {}

    assert problems(batch={"microbatch_size": 3, "num_microbatches": 2}) == {}
    errs = problems(train={"steps": 2}, batch={"num_microbatches": 4})
    assert "expected at least 3" in errs["train.steps"]
    assert "2 x num_microbatches 4 = 8 rows per step" in errs["batch"]
    assert "trained with 2 x 3 = 6" in errs["batch"]
    errs = problems(data={"seq_len": 64, "seed": 8})
    assert "got 64, but checkpoint" in errs["data.seq_len"]
    assert "set data.seed: 7" in errs["data.seed"]
    errs = problems(lora=LORA)
    assert "holds a fully fine-tuned model" in errs["model.resume_from"]
    assert problems(data={"packing": "documents"}) == {}  # the same as true
    assert "trained with 'documents'" in problems(data={"packing": "concat"})["data.packing"]
    # Another optimizer state is named at submission (it failed once the model was
    # loaded, saying the checkpoint did not fit the model).
    held = "holds AdamW's moments in float32"
    assert held in problems(optimizer={"state_dtype": "int8"})["optimizer"]
    errs = problems(optimizer={"name": "sgd", "momentum": 0.9})
    assert "keeps SGD's momentum buffers" in errs["optimizer"] and held in errs["optimizer"]
    assert problems(optimizer={"lr": 1e-2, "weight_decay": 0.5}) == {}  # the spec's own

    bad = copy.deepcopy(good)
    bad["batch"]["num_microbatches"] = 4
    spec_file = tmp_path / "resume.yaml"
    spec_file.write_text(yaml.safe_dump(bad))
    rc = cli.main(["submit", str(spec_file), "--address", "ipc:///nonexistent/rp.sock"])
    assert rc == 2  # refused by validation: no coordinator was needed to say why


def test_failed_save_pauses_keeps_previous_and_resumes_exactly(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(tmp_path / "out", staleness=1)
    real_save = checkpointer_module.save_tensors
    calls = []

    def full_disk(path, tensors, metadata=None):
        if path.name == Path(STATE_FILE).name:  # not the progress file beside it
            calls.append(path)
        if len(calls) == 2:  # the checkpoint of step 4
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(path, tensors, metadata)

    monkeypatch.setattr(checkpointer_module, "save_tensors", full_disk)
    with pytest.raises(JobPaused) as info:
        train(spec, arena_dir)
    message = str(info.value)
    root = tmp_path / "out" / "checkpoints"
    for part in ("checkpoint step 4", "No space left", "ENOSPC", step_name(2), "roundpipe resume"):
        assert part in message, message
    assert sorted(p.name for p in root.iterdir()) == [LATEST, step_name(2)]
    verify_checkpoint(root / step_name(2))
    monkeypatch.setattr(checkpointer_module, "save_tensors", real_save)
    assert_bitwise(train(spec, arena_dir), reference(1, 2))


def test_a_paused_job_names_the_checkpoint_it_resumes_from_even_another_jobs(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job started from another job's checkpoint (``model.resume_from``) whose first
    own checkpoint finds the disk full resumes from that other checkpoint: the message
    said a checkpoint of the same step in its own directory, which never existed."""
    train(make_spec(tmp_path / "a", steps=2), arena_dir, job_id="job-a")
    source = tmp_path / "a" / "checkpoints" / step_name(2)
    doc = make_spec(tmp_path / "b", steps=5).to_dict()
    doc["model"]["resume_from"] = str(source)
    real_save = checkpointer_module.save_tensors

    def full_disk(path, tensors, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpointer_module, "save_tensors", full_disk)
    with pytest.raises(JobPaused) as info:
        train(JobSpec.from_dict(doc), arena_dir, job_id="job-b")
    monkeypatch.setattr(checkpointer_module, "save_tensors", real_save)
    message = str(info.value)
    assert f"checkpoint step 2 ({source}) is kept and the job resumes from it" in message, message
    assert str(tmp_path / "b" / "checkpoints" / step_name(2)) not in message


def test_a_disk_still_full_at_resume_names_the_checkpoint_kept(
    tmp_path: Path, arena_dir: Path, monkeypatch
) -> None:
    """A job paused with checkpoint 2 kept, resumed while its disk is still full, pauses
    again saying that it resumes from checkpoint 2 and naming its checkpoints directory:
    it said "no checkpoint has been written yet, so the job resumes from the start"
    (inviting the user to delete work) and named the write probe, gone by then."""
    from roundpipe.coordinator.training import checkpoint as checkpoint_module

    spec = make_spec(tmp_path / "out", steps=5, every=2)
    assert train(spec, arena_dir, job_id="job-full", stop_after=2) is None
    real_write = checkpoint_module._write_synced

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_module, "_write_synced", full_disk)
    with pytest.raises(JobPaused) as info:
        train(spec, arena_dir, job_id="job-full")
    monkeypatch.setattr(checkpoint_module, "_write_synced", real_write)
    message = str(info.value)
    kept = tmp_path / "out" / "checkpoints" / step_name(2)
    assert f"checkpoint step 2 ({kept}) is kept and the job resumes from it" in message, message
    assert f"{tmp_path / 'out' / 'checkpoints'}: No space left on device" in message, message
    assert ".tmp-probe" not in message


def test_unwritable_output_pauses_before_any_work(tmp_path: Path, arena_dir: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output directory should go")
    spec = make_spec(blocker / "out")
    with pytest.raises(JobPaused, match="not writable.*roundpipe resume"):
        train(spec, arena_dir)


# --------------------------------------------------------------------------- SIGKILL trials

WRITER = Path(__file__).parent / "procs" / "ckpt_writer.py"
TRIALS = 12


def test_sigkill_during_checkpoint_writes_never_corrupts_latest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    ckpts = CheckpointDir(root)
    last_saved = 0
    mid_write = 0
    for seed in range(TRIALS):
        rng = random.Random(seed)
        child = subprocess.Popen(
            [sys.executable, str(WRITER), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = child.stdout.readline().split()
            assert line[:1] == ["start"], f"seed {seed}: {line} {child.stderr.read()}"
            started = int(line[1])
            # Resume uses the newest checkpoint the previous (killed) writer completed.
            assert started >= last_saved, f"seed {seed}: resumed at {started} < {last_saved}"
            delay = rng.uniform(0.05, 0.6)
            time.sleep(delay)
            child.send_signal(signal.SIGKILL)
            out, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        saved = [int(w.split()[1]) for w in out.splitlines() if w.startswith("saved")]
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
        mid_write += bool(leftovers)
        latest = ckpts.pointer()
        print(
            f"SIGKILL trial seed={seed}: killed after {delay:.3f}s, saved {saved[-1:] or 'none'}, "
            f"latest={latest}, temporary leftovers={leftovers}"
        )
        if saved:
            last_saved = saved[-1]
        if latest is None:
            assert not saved, f"seed {seed}: no latest after saving {saved}"
            continue
        # The pointer names a complete, undamaged checkpoint holding its own step.
        info = verify_checkpoint(root / latest)
        assert last_saved <= info.step <= last_saved + 1, (seed, info.step, last_saved)
        for name, t in load_tensors(info.path / STATE_FILE):
            # The step as the tensor's dtype holds it: bfloat16 rounds 263 to 264.
            assert bool((t == torch.full_like(t, float(info.step))).all()), (seed, name)
        last_saved = info.step
    print(f"{mid_write} of {TRIALS} kills left a checkpoint write half done")
    assert last_saved > 0
    # A last run cleans up after the dead writers and resumes from the newest one.
    child = subprocess.Popen(
        [sys.executable, str(WRITER), str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().split() == ["start", str(last_saved)]
    finally:
        child.kill()
        child.communicate()


# --------------------------------------------------------------------------- real daemons


def wait_for(cluster: LocalCluster, what: str, predicate, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except RoundPipeError:
            pass  # e.g. the coordinator is still starting
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")


@pytest.fixture
def cluster(tmp_path: Path):
    arena_dir = Path("/dev/shm") / f"rp-resume-{os.getpid()}"
    arena_dir.mkdir()
    release = tmp_path / "go"  # while it exists, no job is held (ROUNDPIPE_TRAIN_HOLD)
    release.touch()
    c = LocalCluster(
        tmp_path / "cluster",
        arena_dir,
        coordinator_args=["--wait-timeout", "120"],
        env=hold_env(HOLD_STEP, release),
    )
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)


def test_submit_wait_says_what_the_job_waits_for_and_survives_losing_the_coordinator(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """`roundpipe submit --wait` with no worker connected printed the job id and then
    nothing until Ctrl-C; it says what the job waits for now. Once the job trains, the
    coordinator is stopped: the watch ended with "its answer is lost. Look at `roundpipe
    jobs` before sending it again", as if the job might not exist; it names the job,
    kept, and how to follow it again."""
    import threading

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(make_spec(tmp_path / "out", every=4, steps=20).to_dict()))
    (tmp_path / "go").unlink()  # the job holds at HOLD_STEP
    watcher = subprocess.Popen(
        [sys.executable, "-m", "roundpipe.cli", "submit", str(spec_file), "--wait"]
        + ["--address", cluster.address],
        env={**os.environ, **cluster.key_env("admin"), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(watcher.stderr), daemon=True)
    reader.start()
    try:
        job_id = watcher.stdout.readline().strip()
        wait_for(cluster, "the watch to say why", lambda: "waiting for a worker" in "".join(said))
        cluster.add_worker("w1")
        job = cluster.client.job(job_id)
        wait_for(cluster, f"step {HOLD_STEP}", lambda: job.status().step >= HOLD_STEP - 1)
        cluster.coordinator.proc.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=120) == 1
    finally:
        if watcher.poll() is None:
            watcher.kill()
        (tmp_path / "go").touch()
    reader.join(timeout=30)
    shown = "".join(said)
    assert f"job {job_id} running: waiting for a worker to connect" in shown, shown
    assert f"lost the coordinator while watching job {job_id}" in shown, shown
    assert f"roundpipe resume {job_id} --wait" in shown and "Traceback" not in shown, shown


@pytest.mark.slow
def test_coordinator_sigkill_resumes_running_job_and_runs_queued_one(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    cluster.wait_for_workers(2)
    # A checkpoint after every step: the coordinator spends much of its time writing
    # them, so the kill (at a random moment after checkpoint 2) often lands in a write.
    long = make_spec(tmp_path / "long", staleness=1, every=1, steps=24)
    short = make_spec(tmp_path / "short", staleness=0, every=0, steps=3)
    # The long job is held before iteration HOLD_STEP until the coordinator is back, so
    # it cannot end before the kill on any machine (checkpoints 2.. are written first).
    release = tmp_path / "go"
    release.unlink()
    long_job = cluster.client.submit(long)
    short_job = cluster.client.submit(short)
    ckpts = CheckpointDir(tmp_path / "long" / "checkpoints")
    wait_for(cluster, "checkpoint 2", lambda: (ckpts.pointer() or "") >= step_name(2))
    seed = int(os.environ.get("RP_TEST_SEED", time.time_ns() % 10_000))
    delay = random.Random(seed).uniform(0.0, 0.5)
    time.sleep(delay)
    cluster.coordinator.proc.send_signal(signal.SIGKILL)
    cluster.coordinator.proc.wait(timeout=30)
    latest = ckpts.find_latest(long_job.job_id)
    leftovers = [p.name for p in ckpts.root.iterdir() if p.name.startswith(".tmp-")]
    print(
        f"coordinator SIGKILL seed={seed} (RP_TEST_SEED) after {delay:.3f}s: latest "
        f"{ckpts.pointer()}, temporary leftovers {leftovers}"
    )
    assert latest is not None and latest.path.name == ckpts.pointer()
    cluster.signal_worker("w1", signal.SIGKILL)  # it resumes with one worker fewer
    release.touch()
    cluster.start_coordinator()
    wait_for(cluster, "the worker to rejoin", lambda: len(cluster.client.workers()) == 1)
    jobs = {j.job_id: j.state for j in cluster.client.jobs()}
    assert jobs.keys() == {long_job.job_id, short_job.job_id}
    assert jobs[long_job.job_id] in ("queued", "running")
    status = long_job.wait(timeout_s=240)
    assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
    assert short_job.wait(timeout_s=120).state == "succeeded", cluster.logs()
    log = (cluster.state_dir / "jobs" / long_job.job_id / "job.log").read_text()
    assert "resumes from" in log
    assert [e.step for e in long_job.progress(timeout_s=30)] == list(range(1, 25))
    assert_params_match(load_output(tmp_path / "long"), oracle_train(long))
    assert_params_match(load_output(tmp_path / "short"), oracle_train(short))


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 1 MiB tmpfs (real ENOSPC) where mounting is allowed, else skip."""
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_output_fs_pauses_job_and_cli_resume_finishes_it(
    cluster: LocalCluster, tmp_path: Path, small_fs: Path
) -> None:
    cluster.add_worker("w1")
    cluster.wait_for_workers(1)
    spec = make_spec(small_fs / "out", staleness=0, every=2, steps=4)
    job = cluster.client.submit(spec)
    status = job.wait(timeout_s=120)
    assert status.state == "paused", f"{status}\n{cluster.logs()}"
    assert "No space left" in status.message and "roundpipe resume" in status.message
    assert not any(p.name.startswith(".tmp-") for p in (small_fs / "out" / "checkpoints").iterdir())
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
    result = roundpipe_resume(cluster, job.job_id, "--wait", timeout=240)
    assert result.returncode == 0, result.stderr + cluster.logs()
    assert "succeeded" in result.stderr
    assert_params_match(load_output(small_fs / "out"), oracle_train(spec))
    again = roundpipe_resume(cluster, job.job_id, timeout=60)
    assert again.returncode == 1 and "already succeeded" in again.stderr
    manifest = json.loads(
        (small_fs / "out" / "checkpoints" / step_name(4) / "checkpoint.json").read_text()
    )
    assert manifest["job_id"] == job.job_id


@pytest.mark.slow
def test_restarted_coordinator_shows_resumed_step_and_resume_is_a_no_op(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """After a coordinator crash the interrupted job is resumed automatically. While it
    waits (here: for a worker) its status shows the checkpoint step it resumes from (it
    showed 0), and `roundpipe resume` on it succeeds without doing anything (it said
    "already running (bad_state)" with rc 1)."""
    cluster.add_worker("w1")
    cluster.wait_for_workers(1)
    spec = make_spec(tmp_path / "out", every=2, steps=10, staleness=0)
    job = cluster.client.submit(spec)
    ckpts = CheckpointDir(tmp_path / "out" / "checkpoints")
    wait_for(cluster, "checkpoint 2", lambda: (ckpts.pointer() or "") >= step_name(2))
    cluster.coordinator.proc.send_signal(signal.SIGKILL)
    cluster.coordinator.proc.wait(timeout=30)
    cluster.signal_worker("w1", signal.SIGKILL)  # no worker: the job waits before running
    cluster.workers["w1"].proc.wait(timeout=30)
    latest = ckpts.find_latest(job.job_id)
    assert latest is not None
    cluster.start_coordinator()
    wait_for(cluster, "the job to be resumed", lambda: job.status().state == "running")
    status = job.status()
    assert status.step == latest.step >= 2, status
    result = roundpipe_resume(cluster, job.job_id, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"job {job.job_id} running" in result.stderr
    assert job.status().step == latest.step
    # A worker arrives: the job continues from that step and finishes.
    cluster.add_worker("w2")
    assert job.wait(timeout_s=240).state == "succeeded", cluster.logs()
    steps = [e.step for e in job.progress(timeout_s=30)]
    assert steps == list(range(1, 11))


def test_a_finished_jobs_history_is_in_its_directory_and_outlives_a_restart(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Note [compact progress history]: a finished job's history is written to its job
    directory and read from there, so the coordinator holds none of it (a coordinator
    held every finished job's history in memory until it restarted, and then lost it:
    progress() replayed nothing). After a clean restart every event is the same."""
    cluster.add_worker("w1")
    cluster.wait_for_workers(1)
    job = cluster.client.submit(make_spec(tmp_path / "out", every=3, steps=6, staleness=0))
    assert job.wait(timeout_s=240).state == "succeeded", cluster.logs()
    before = list(job.progress(timeout_s=30))
    assert [e.step for e in before] == list(range(1, 7))
    stored = cluster.state_dir / "jobs" / job.job_id / "progress.f64"
    assert stored.stat().st_size == 6 * 6 * 8  # six float64 numbers a step
    cluster.coordinator.proc.send_signal(signal.SIGTERM)
    assert cluster.coordinator.proc.wait(timeout=60) == 0
    cluster.start_coordinator()
    assert list(job.progress(timeout_s=30)) == before


@pytest.mark.slow
def test_a_continuation_with_checkpoints_of_its_own_outlives_its_source(
    cluster: LocalCluster, tmp_path: Path, arena_dir: Path
) -> None:
    """Jobs that started from job A's checkpoint (``model.resume_from``) and have written
    checkpoints of their own resume from those; once A's output is removed, a coordinator
    restart failed the running one ("interrupted by a coordinator restart; resumes from
    checkpoint step 10", the real reason hidden) and `roundpipe resume` refused the
    cancelled one ("model.resume_from ... does not exist"), though neither reads A's
    checkpoint again."""
    assert train(make_spec(tmp_path / "a", steps=4), arena_dir, job_id="job-a") is not None
    source = tmp_path / "a" / "checkpoints" / step_name(4)

    def continuation(name: str) -> JobSpec:
        d = make_spec(tmp_path / name, steps=14).to_dict()
        d["model"]["resume_from"] = str(source)
        return JobSpec.from_dict(d)

    cluster.add_worker("w1")
    cluster.wait_for_workers(1)
    release = tmp_path / "go"
    release.unlink()  # each job is held before step HOLD_STEP
    cancelled = cluster.client.submit(continuation("cancelled"))
    mine = CheckpointDir(tmp_path / "cancelled" / "checkpoints")
    wait_for(cluster, "its checkpoint 10", lambda: (mine.pointer() or "") >= step_name(10))
    cancelled.cancel()
    wait_for(cluster, "the cancel", lambda: cancelled.status().state == "cancelled")
    running = cluster.client.submit(continuation("running"))
    mine = CheckpointDir(tmp_path / "running" / "checkpoints")
    wait_for(cluster, "its checkpoint 10", lambda: (mine.pointer() or "") >= step_name(10))
    shutil.rmtree(tmp_path / "a")
    cluster.coordinator.proc.send_signal(signal.SIGTERM)  # the running job stays queued
    assert cluster.coordinator.proc.wait(timeout=60) == 0
    release.touch()
    cluster.start_coordinator()
    status = running.wait(timeout_s=240)
    assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
    result = roundpipe_resume(cluster, cancelled.job_id, "--wait", timeout=240)
    assert result.returncode == 0, result.stderr + cluster.logs()
    assert cancelled.status().state == "succeeded"
    assert_params_match(load_output(tmp_path / "running"), load_output(tmp_path / "cancelled"))


@pytest.mark.slow
def test_cli_resume_wait_shows_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    """A job whose background checkpoint 10 finished only once the run was held before
    step HOLD_STEP (the writer's ``hold`` fault point; step 11 trained, no task in
    flight, so the run loop never heard of it) is cancelled, then resumed with
    `roundpipe resume JOB --wait`: it continues from checkpoint 10, as the trainer does,
    and the progress shown starts at step 11, trained again. It said checkpoint 8 and
    showed steps 9 and 10 as trained again; before that it replayed the history from
    step 1 as if training had started over, and a client watching from the checkpoint
    missed the new step 11 (its old event stood in its place until the run began)."""
    release, writing = tmp_path / "go", tmp_path / "writing-10"
    arena_dir = Path("/dev/shm") / f"rp-resume-wait-{os.getpid()}"
    arena_dir.mkdir()
    env = {**hold_env(HOLD_STEP, release), CHECKPOINT_FAULT_ENV: f"hold@step=10,marker={writing}"}
    cluster = LocalCluster(tmp_path / "cluster", arena_dir, env=env)
    try:
        cluster.add_worker("w1")
        cluster.wait_for_workers(1)
        spec = make_spec(tmp_path / "out", every=2, steps=HOLD_STEP + 2, staleness=0)
        job = cluster.client.submit(spec)
        wait_for(cluster, "step 11", lambda: job.status().step == HOLD_STEP - 1)
        wait_for(cluster, "checkpoint 10's held write", writing.exists)  # in its own time
        writing.unlink()  # checkpoint 10's write goes on, and ends on disk
        checkpoints = CheckpointDir(tmp_path / "out" / "checkpoints")
        wait_for(cluster, "checkpoint 10", lambda: checkpoints.pointer() == step_name(10))
        cluster.client.cancel(job.job_id)
        assert job.wait(timeout_s=60).state == "cancelled", cluster.logs()
        release.touch()
        result = roundpipe_resume(cluster, job.job_id, "--wait", timeout=240)
        assert result.returncode == 0, result.stderr + cluster.logs()
        assert "continues from checkpoint step 10" in result.stderr, result.stderr
        shown = [int(m) for m in re.findall(r"^step (\d+)/", result.stderr, re.MULTILINE)]
        assert shown and shown[0] == 11 and shown[-1] == HOLD_STEP + 2, result.stderr
        assert [e.step for e in job.progress(timeout_s=30)] == list(range(1, HOLD_STEP + 3))
    finally:
        cluster.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_quantised_base_job_resumes_exactly(
    tmp_path: Path, arena_dir: Path, quantization: str
) -> None:
    """LoRA on an NF4 / int8 base (issue 37): the checkpoint holds the adapters and the
    training state, the base is quantised again on resume, and the resumed job equals
    the uninterrupted one bit for bit."""
    lora = {**LORA, "base_quantization": quantization}
    spec = make_spec(tmp_path / "out", staleness=1, lora=lora)
    assert train(spec, arena_dir, stop_after=2) is None
    step2 = tmp_path / "out" / "checkpoints" / step_name(2)
    assert (step2 / "adapter_config.json").is_file()
    resumed = train(spec, arena_dir)
    whole = train(make_spec(tmp_path / "whole", staleness=1, lora=lora), arena_dir)
    assert_bitwise(resumed, whole)
