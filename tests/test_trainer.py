"""The coordinator's trainer with in-process workers equals the single-process oracle.

These tests exercise the whole schedule (layout, tasks, event-table ordering, optimizer
thread, staleness) on threads in one process; tests/test_end_to_end.py runs the same
jobs through real daemons and sockets.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    TINY_QWEN3,
    InProcessWorkers,
    assert_params_match,
    load_output,
    oracle_train,
    tiny_spec,
    trained_in_process,
)

from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.shared.plan import Plan


def new_trainer(spec, arena_dir) -> Trainer:
    return Trainer(
        "job-test",
        spec,
        arena_dir=arena_dir,
        namespace="trainertest",
        output_dir=Path(spec.output.dir),
        wait_timeout_s=60,
    )


def train_in_process(spec, arena_dir, num_workers: int) -> dict[str, torch.Tensor]:
    with trained_in_process(
        spec, arena_dir, num_workers, job_id="job-test", namespace="trainertest"
    ) as trainer:
        assert [e.step for e in trainer.progress] == list(range(1, spec.train.steps + 1))
        # The optimizer's busy time reaches the progress (0 only before its first step).
        assert trainer.progress[-1].optimizer_s > 0
        return {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}


@functools.cache
def cached_oracle(staleness: int) -> dict[str, torch.Tensor]:
    # The oracle does not depend on the worker count (nor on the output directory).
    return oracle_train(tiny_spec(Path("unused"), staleness=staleness))


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_full_finetune_matches_oracle(tmp_path, arena_dir, staleness, num_workers) -> None:
    spec = tiny_spec(tmp_path, staleness=staleness)
    assert_params_match(train_in_process(spec, arena_dir, num_workers), cached_oracle(staleness))


def test_grad_clipping_and_uneven_plan_match_oracle(tmp_path, arena_dir) -> None:
    spec = tiny_spec(tmp_path, staleness=1, grad_clip=0.5, plan="F[0:1,1:4] T[4:6] B[3:4,2:3,0:2]")
    assert_params_match(train_in_process(spec, arena_dir, 2), oracle_train(spec), rtol=1e-5)


def test_lora_matches_peft_oracle(tmp_path, arena_dir) -> None:
    spec = tiny_spec(
        tmp_path, staleness=0, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    )
    runtime = train_in_process(spec, arena_dir, 2)
    oracle = oracle_train(spec)
    assert any(".lora_A." in n for n in runtime)
    assert_params_match(runtime, oracle)


def test_a_model_of_the_other_kind_in_the_output_directory_is_replaced(tmp_path, arena_dir) -> None:
    """A full fine-tune exported where a LoRA job had exported: the adapter's files
    stayed beside the new weights, and from_pretrained (peft installed) loaded the old
    base and adapter instead. An adapter exported after a full model leaves no stale
    model.safetensors beside it either."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    for i, lora in enumerate(({"r": 4, "target_modules": ["q_proj"]}, None, {"r": 4})):
        spec = tiny_spec(out, steps=2, lora=lora)
        with trained_in_process(spec, arena_dir, job_id=f"job-{i}") as trainer:
            trainer.export()
        names = {p.name for p in out.iterdir()}
        if lora is None:
            assert not names & {"adapter_config.json", "adapter_model.safetensors"}
            loaded = AutoModelForCausalLM.from_pretrained(str(out))
            assert not hasattr(loaded, "peft_config")
            saved = safetensors.torch.load_file(str(out / "model.safetensors"))
            params = dict(loaded.named_parameters())
            assert all(torch.equal(params[n], t) for n, t in saved.items() if n in params)
        else:
            assert not names & {"model.safetensors", "config.json"}, names
            assert load_output(out, lora=True)  # the adapter of this job, on its base


def test_an_earlier_models_files_in_the_output_directory_all_go(tmp_path, arena_dir) -> None:
    """A full fine-tune exported where an earlier job left a sharded model and a
    tokenizer with a chat template: the shards' index stayed (transformers removes old
    shards, not their index), naming files that were gone, and a job taking the output
    as its ``model.path`` failed (this runtime reads the index first); the old chat
    template stayed beside a tokenizer that has none."""
    from transformers import AutoTokenizer

    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared.model import LayeredModel

    out = tmp_path / "out"
    layered = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"))
    layered.to_hf_model(layered.init_weights(1)).save_pretrained(str(out), max_shard_size="40KB")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    assert (out / "model.safetensors.index.json").is_file()
    with trained_in_process(tiny_spec(out, steps=2), arena_dir) as trainer:
        trainer.export()
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "chat_template.jinja" not in names, names
    assert not {n for n in names if n.startswith("model-") or n.endswith(".index.json")}, names
    assert AutoTokenizer.from_pretrained(str(out)).chat_template is None
    further = tiny_spec(tmp_path / "further", steps=2).to_dict()
    further["model"] = {"path": str(out)}
    with trained_in_process(JobSpec.from_dict(further), arena_dir, job_id="job-2") as trainer:
        assert trainer.step == 2


def test_a_tokenizer_and_template_in_the_output_directory_are_kept(tmp_path, arena_dir) -> None:
    """The job's tokenizer and chat template files are in its output directory: they
    were removed as an earlier model's before the export read them, and the job that had
    trained to its end failed there (its tokenizer gone, so a resume failed too)."""
    import shutil

    from transformers import AutoTokenizer

    from roundpipe.coordinator.spec.jobspec import JobSpec

    out = tmp_path / "out"
    spec = tiny_spec(out, steps=2).to_dict()
    shutil.copytree(spec["model"]["tokenizer"], out)
    (out / "chat_template.jinja").write_text(
        "{%- for m in messages %}{{- m.role ~ ': ' ~ m.content ~ '\\n' }}{%- endfor %}"
    )
    spec["model"]["tokenizer"] = str(out)
    spec["data"]["chat_template"] = str(out / "chat_template.jinja")
    with trained_in_process(JobSpec.from_dict(spec), arena_dir) as trainer:
        trainer.export()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template and "m.role" in tokenizer.chat_template
    assert (out / "model.safetensors").is_file()


def test_a_full_fine_tune_keeps_its_models_generation_settings(tmp_path, arena_dir) -> None:
    """The model trained from lists two stop tokens and sampling defaults in its
    generation_config.json (as instruct models do); the export and each checkpoint
    carry them. A model built from its config alone wrote one EOS id and no sampling
    settings: the exported model generated past its turn's end."""
    from transformers import GenerationConfig

    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared.model import LayeredModel

    base = tmp_path / "base"
    layered = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"))
    layered.to_hf_model(layered.init_weights(1)).save_pretrained(str(base))
    settings = dict(eos_token_id=[5, 7], do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    GenerationConfig(bos_token_id=1, **settings).save_pretrained(str(base))
    spec = tiny_spec(tmp_path / "out", steps=2).to_dict()
    spec["model"] = {"path": str(base), "tokenizer": spec["model"]["tokenizer"]}
    spec["output"]["checkpoint_every"] = 1
    with trained_in_process(JobSpec.from_dict(spec), arena_dir) as trainer:
        out = trainer.export()
    for directory in (out, out / "checkpoints" / "step-00000002"):
        written = GenerationConfig.from_pretrained(str(directory))
        assert {k: getattr(written, k) for k in settings} == settings, directory


# Tiny configs of the other architectures, shaped like TINY_QWEN3 (runtime_helpers).
_TINY = {
    "qwen3": TINY_QWEN3,
    "llama": {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}
    | {"tie_word_embeddings": True},
    "qwen3_moe": {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}
    | {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize(
    "arch",
    # qwen3_moe's peft export alone takes about a minute on 2 cores: out of the quick suite
    [pytest.param(a, marks=pytest.mark.slow) if a == "qwen3_moe" else a for a in sorted(_TINY)],
)
def test_lora_default_targets_train_and_export(tmp_path, arena_dir, arch) -> None:
    """A lora section without target_modules means all-linear (the documented default):
    the job trains every linear layer of the decoder, equals the peft oracle, and its
    exported adapter loads with peft's AutoPeftModelForCausalLM."""
    from peft import AutoPeftModelForCausalLM

    spec = tiny_spec(
        tmp_path, steps=3, staleness=1, architecture=arch, config=_TINY[arch], lora={"r": 4}
    )
    assert spec.lora is not None and spec.lora.target_modules == "all-linear"
    trainer = new_trainer(spec, arena_dir)
    pool = None
    try:
        trainer.prepare(2)
        pool = InProcessWorkers(trainer, 2)
        trainer.run(pool)
        runtime = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
        trainer.export(tmp_path / "export")
    finally:
        if pool is not None:
            pool.close()
        trainer.close()
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in runtime if ".lora_A." in n}
    expected = {"q_proj", "k_proj", "v_proj", "o_proj"} | (
        {"gate", "experts", "base_layer"}  # peft: router and fused experts on transformers 5
        if arch == "qwen3_moe"
        else {"gate_proj", "up_proj", "down_proj"}
    )
    assert adapted == expected
    assert not any("lm_head" in n and ".lora_" in n for n in runtime)
    oracle = oracle_train(spec)
    lora_only = {n: t for n, t in runtime.items() if ".lora_" in n}
    # LoRA B starts at 0, so Adam's first steps move each element by about lr * sign(g)
    # whatever |g|; on the MoE experts some elements have gradients near eps (1e-8),
    # where float-reordering noise shows: 1.2e-5 relative on an expert's B after 3 steps
    # (test_model_oracle checks these gradients themselves to 1e-5).
    rtol = 3e-5 if arch == "qwen3_moe" else 1e-5
    assert_params_match(lora_only, oracle, rtol=rtol)
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    exported = {n: p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
    assert exported.keys() == lora_only.keys()
    assert_params_match(exported, lora_only, rtol=0)  # the export is exactly the weights


def test_model_dir_without_tokenizer_trains_token_data_and_exports_no_tokenizer(
    tmp_path, arena_dir
) -> None:
    """A model directory without tokenizer files and pre-tokenised data: the documents
    are concatenated without a separator (no token 0 between them), and the exported
    model carries no (empty) tokenizer."""
    import json

    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.coordinator.spec.tokenizers import TOKENIZER_FILES
    from roundpipe.shared.model import LayeredModel

    layered = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"))
    layered.to_hf_model(layered.init_weights(0)).save_pretrained(str(tmp_path / "model"))
    docs = [[1 + (7 * i + j) % 500 for j in range(20 + i)] for i in range(12)]
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    spec = JobSpec.from_dict(
        {
            "model": {"path": str(tmp_path / "model")},
            "data": {"path": str(data), "seq_len": 32, "shuffle": False},
            "batch": {"microbatch_size": 2, "num_microbatches": 2},
            "train": {"steps": 2, "staleness": 0, "dtype": "float32"},
            "output": {"dir": str(tmp_path / "out")},
        }
    )
    trainer = new_trainer(spec, arena_dir)
    pool = None
    try:
        trainer.prepare(2)
        stream = [t for d in docs for t in d]
        rows = trainer.dataset.tokens[:, :32].reshape(-1)[: len(stream)].tolist()
        assert rows == stream  # no separator anywhere
        pool = InProcessWorkers(trainer, 2)
        trainer.run(pool)
        out = trainer.export()
    finally:
        if pool is not None:
            pool.close()
        trainer.close()
    assert (out / "model.safetensors").is_file()
    assert not [f for f in TOKENIZER_FILES if (out / f).exists()]


# -- planning (Note [re-planning], Note [slot pools]) ---------------------------------


def _run_with(trainer: Trainer, num_workers: int) -> dict[str, torch.Tensor]:
    pool = InProcessWorkers(trainer, num_workers)
    try:
        trainer.run(pool)
    finally:
        pool.close()
    return {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}


def test_slot_pools_take_any_plan_that_fits(tmp_path, arena_dir) -> None:
    spec = tiny_spec(tmp_path)
    trainer = new_trainer(spec, arena_dir)
    try:
        trainer.prepare(2)
        layout = trainer.layout
        assert trainer.planner.profile is not None  # no train.plan: the trainer may re-plan
        assert layout.act_capacity >= len(layout.activation_boundaries(trainer.plan)) + 2
        wide = Plan.parse("F[0:1,1:2,2:3,3:4,4:5] T[5:6] B[4:5,3:4,2:3,1:2,0:1]")
        assert not layout.fits(wide)  # 5 boundaries of each kind, more than the pools
        with pytest.raises(ValueError, match="slot pools hold"):
            layout.assign(wide)
        narrow = Plan.parse("F[0:2] T[2:6] B[0:2]")
        assert layout.fits(narrow)
        layout.assign(narrow)
        assert layout.plan == narrow
        assert {b for b, _, _ in layout.acts} == {2} and {b for b, _, _ in layout.dacts} == {2}
        slots = list(layout.acts.values())
        assert len({(r.arena, r.offset) for r in slots}) == len(slots)  # no slot shared
        assert all(r in layout.act_slots for r in slots)
    finally:
        trainer.close()


def test_a_pinned_plan_is_never_replanned(tmp_path, arena_dir) -> None:
    spec = tiny_spec(tmp_path, plan="F[0:2,2:4] T[4:6] B[2:4,0:2]")
    trainer = new_trainer(spec, arena_dir)
    try:
        trainer.prepare(2)
        assert trainer.planner.profile is None
        assert trainer.layout.act_capacity == 2  # exactly what the plan needs
        assert trainer.plan_history == [(1, str(trainer.plan), "set by train.plan in the job spec")]
    finally:
        trainer.close()


def test_sgd_with_momentum_matches_oracle(tmp_path, arena_dir) -> None:
    """optimizer.name: sgd through the same layer-wise path, against torch.optim.SGD."""
    sgd = {"name": "sgd", "momentum": 0.9, "nesterov": True, "lr": 0.05}
    spec = tiny_spec(tmp_path, staleness=1, steps=4, optimizer=sgd)
    assert_params_match(train_in_process(spec, arena_dir, 2), oracle_train(spec))


@pytest.mark.parametrize("staleness", [0, 1])
def test_switching_plan_mid_run_matches_oracle(tmp_path, arena_dir, staleness) -> None:
    """The switch itself (drain, re-assign the pools, new tasks) changes no number."""
    spec = tiny_spec(tmp_path, staleness=staleness)
    target = Plan.parse("F[0:2] T[2:6] B[0:2]")
    trainer = new_trainer(spec, arena_dir)
    try:
        trainer.prepare(2)
        assert trainer.plan != target and trainer.layout.fits(target)
        calls = iter(range(1, 100))
        trainer.planner.replan_candidate = lambda _layout: (
            (target, "test") if next(calls) == 3 else None
        )
        runtime = _run_with(trainer, 2)
        history = trainer.plan_history
        assert [(k, p) for k, p, _ in history][1:] == [(3, str(target))]
    finally:
        trainer.close()
    assert_params_match(runtime, cached_oracle(staleness))


def test_replanner_acts_on_settled_measurements(tmp_path, arena_dir, monkeypatch) -> None:
    """Measured costs (here: the prior with layer 1 five times slower, so the outcome does
    not depend on this machine's timing noise) make the real planner pick another plan,
    and the trainer switches to it mid-run without changing any number."""
    from roundpipe.coordinator.planning.search import replan_if_better

    spec = tiny_spec(tmp_path, staleness=1, steps=8)
    trainer = new_trainer(spec, arena_dir)
    try:
        trainer.prepare(2)
        profile = trainer.planner.profile
        skewed = [c.scaled(5.0) if i == 1 else c for i, c in enumerate(profile.prior)]
        expected = replan_if_better(
            trainer.plan,
            skewed,
            trainer.hardware,
            spec.batch.num_microbatches,
            staleness=1,
            fits=trainer.layout.fits,
        )
        assert expected is not None and expected.plan != trainer.plan
        profile.settle_tolerance = float("inf")  # settled after warm-up + 2 iterations
        monkeypatch.setattr(profile, "costs", lambda: skewed)
        runtime = _run_with(trainer, 2)
        assert profile.folded_iterations >= 2 and profile.covered
        assert trainer.planner.replan_attempts >= 1
        assert trainer.plan == expected.plan
        assert len(trainer.plan_history) == 2
        assert "re-planned from measured layer times" in trainer.plan_history[1][2]
    finally:
        trainer.close()
    assert_params_match(runtime, oracle_train(spec))


def test_layer_grain_recompute_trains_bitwise_what_stage_grain_trains(
    tmp_path, arena_dir, monkeypatch
) -> None:
    """train.recompute: layer (Note [recompute grain]): the job's backward tasks ask the
    workers for layer grain, and the trained weights are bitwise those of stage grain."""
    from roundpipe.worker.executor import StageExecutor

    grains: list[str] = []
    backward = StageExecutor.backward

    def spy(self, *args, recompute: str = "stage", **kwargs):
        grains.append(recompute)
        return backward(self, *args, recompute=recompute, **kwargs)

    monkeypatch.setattr(StageExecutor, "backward", spy)
    plan = "F[0:2,2:4] T[4:6] B[2:4,0:2]"
    runs = {}
    for grain in ("stage", "layer"):
        grains.clear()
        spec = tiny_spec(tmp_path / grain, plan=plan, train={"recompute": grain})
        runs[grain] = train_in_process(spec, arena_dir, 2)
        assert grains and set(grains) == {grain}
    assert runs["stage"].keys() == runs["layer"].keys()
    for name, t in runs["stage"].items():
        assert torch.equal(t, runs["layer"][name]), name


def test_a_profile_that_cannot_be_written_is_logged_once_and_leaves_nothing(
    tmp_path, arena_dir, caplog
) -> None:
    """profile.json is observability: a write that fails at every step (here the name is
    taken by a directory; a full disk alike) is logged once with its path, and leaves
    no temporary file (28 warnings in a 30-step job, no path, and an empty
    .profile.json.tmp)."""
    from roundpipe.coordinator.planning.profile import PROFILE_FILE

    spec = tiny_spec(tmp_path / "out", staleness=1, steps=6)
    (tmp_path / "out" / PROFILE_FILE).mkdir(parents=True)
    trainer = new_trainer(spec, arena_dir)
    try:
        with caplog.at_level("WARNING"):
            trainer.prepare(2)
            _run_with(trainer, 2)
    finally:
        trainer.close()
    warned = [r.getMessage() for r in caplog.records if "profile" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "out" / PROFILE_FILE) in warned[0], warned
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if "profile" in p.name) == [
        PROFILE_FILE
    ]


def test_the_measured_profile_is_written_and_roundpipe_plan_predicts_from_it(
    tmp_path, arena_dir, capsys
) -> None:
    """Once every layer has a measurement the job's output directory holds profile.json:
    its measured layer times, its shape and the workers it planned for. `roundpipe plan
    --profile` predicts a step from it, for the shape it was measured at only."""
    from roundpipe.coordinator.planning.profile import PROFILE_FILE, load_profile
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec
    from roundpipe.plan_command import plan_main

    spec = tiny_spec(tmp_path / "out", staleness=1, steps=4)
    trainer = new_trainer(spec, arena_dir)
    try:
        trainer.prepare(2)
        _run_with(trainer, 2)
        measured = trainer.planner.profile.costs()
        plan = str(trainer.plan)
    finally:
        trainer.close()
    path = Path(spec.output.dir) / PROFILE_FILE
    costs, about = load_profile(path)
    assert costs == measured
    assert about["plan"] == plan and about["seq_len"] == spec.data.seq_len
    assert about["num_microbatches"] == spec.batch.num_microbatches
    assert about["hardware"]["num_workers"] == 2 and about["hardware"]["gpu_workers"] is False

    config = tmp_path / "config.json"
    model_config_from_spec(spec.model).to_json_file(config)
    args = ["--model-config", str(config), "--workers", "2", "--plan", plan, "--dtype", "float32"]
    args += ["--microbatches", str(spec.batch.num_microbatches), "--profile", str(path)]
    rows = ["--microbatch-size", str(spec.batch.microbatch_size)]
    assert plan_main([*args, *rows, "--seq-len", str(spec.data.seq_len)]) == 0
    assert f"layer times measured by job {about['job']}" in capsys.readouterr().out
    assert plan_main([*args, *rows, "--seq-len", str(2 * spec.data.seq_len)]) == 2
    assert f"give --seq-len {spec.data.seq_len}" in capsys.readouterr().err
    path.write_text("{}")
    assert plan_main([*args, *rows, "--seq-len", str(spec.data.seq_len)]) == 2
    assert "is not a profile" in capsys.readouterr().err


def test_a_job_with_no_worker_waits_for_one_instead_of_failing(tmp_path, arena_dir) -> None:
    """Its tasks are parked while no worker is connected (docs/fault-tolerance.md): the
    optimizer's wait for their gradients has no deadline of its own. It had one, four
    times --wait-timeout, and failed the job "optimizer failed: timed out" (40 minutes
    at the default; 2 s here). The job still stops when it is cancelled."""
    import threading

    from roundpipe.coordinator.training.job_errors import JobCancelled

    class NoWorkers:
        def send_task(self, task, worker_id):
            raise AssertionError("there is no worker to send to")

        def live_workers(self):
            return []

        def fence(self, worker_id, reason):
            pass

        def stalled_s(self):
            return 0.0

    spec = tiny_spec(tmp_path / "out", steps=2)
    trainer = Trainer(
        "job-parked",
        spec,
        arena_dir=arena_dir,
        namespace="parked",
        output_dir=tmp_path / "out",
        wait_timeout_s=0.5,
    )
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            trainer.run(NoWorkers())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            outcome.append(exc)

    try:
        trainer.prepare(1)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(3.0)  # past 4 x wait_timeout_s: the old deadline
        assert not outcome and trainer.waiting_for_workers, outcome
        trainer.cancel()
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], JobCancelled), outcome
    finally:
        trainer.close()


def test_the_coordinators_own_stall_is_no_workers_hang() -> None:
    """The progress deadline gets the credit the I/O loop gives its workers' heartbeats
    for its stalls (WorkerPort.stalled_s): a coordinator paused past --task-deadline
    SIGKILLed every busy worker, their completions waiting unread in the socket. The
    trainer's check alone, on a task in flight for 11 s of which 6 were a stall."""
    import time

    from protocol_helpers import sample_stage_task

    from roundpipe.coordinator.training.recovery import RecoveryPolicy, TaskTracker

    fenced: list[int] = []

    class Port:
        stalled = 0.0

        def send_task(self, task, worker_id):
            pass

        def live_workers(self):
            return [1]

        def fence(self, worker_id, reason):
            fenced.append(worker_id)

        def stalled_s(self):
            return self.stalled

    port = Port()
    tracker = TaskTracker(port.send_task, port.live_workers, RecoveryPolicy(deadline_floor_s=10))
    tracker.dispatch(sample_stage_task(job_id="j", task_id=0))
    tracker._last_progress[1] = time.monotonic() - 11  # its last completion
    trainer = Trainer.__new__(Trainer)  # only the progress check's parts
    trainer.tracker, trainer._port, trainer._stall_seen = tracker, port, 0.0
    port.stalled = 6.0
    trainer._check_progress()
    assert fenced == []
    tracker._last_progress[1] -= 6  # 17 s, 6 of them excused: a hang
    trainer._check_progress()
    assert fenced == [1]


def test_no_master_is_a_view_of_the_model_file(tmp_path, arena_dir) -> None:
    """A full fine-tune from an fp32 model directory kept safetensors' tensors as its
    masters: copy-on-write views of the file's mapping, so the model file rewritten in
    place before the first optimizer step changed the job's weights (or SIGBUS)."""
    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared.model import LayeredModel

    layered = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"))
    layered.to_hf_model(layered.init_weights(0)).save_pretrained(str(tmp_path / "model"))
    raw = tiny_spec(tmp_path / "out", steps=2).to_dict()
    raw["model"] = {"path": str(tmp_path / "model"), "tokenizer": raw["model"]["tokenizer"]}
    trainer = new_trainer(JobSpec.from_dict(raw), arena_dir)
    try:
        trainer.prepare(2)
        files = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                files.append((lo, hi))
        masters = [t for per in trainer.masters.values() for t in per.values()]
        assert len(masters) > 10
        inside = [
            t for t in masters if any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in files)
        ]
        assert not inside, f"{len(inside)} of {len(masters)} masters map the model file"
    finally:
        trainer.close()
