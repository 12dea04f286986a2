"""Checkpoints written in the background (coordinator/training/snapshot.py, Note [background
checkpoint]): training is bitwise the same with and without them, each holds exactly
what a drained checkpoint of its step holds, memory is bounded, and a process killed
while one is being written resumes exactly.

The SIGKILL-during-save trials, the coordinator-kill resume and the full-disk pause in
tests/test_resume.py run with background checkpoints too (their jobs checkpoint more
often than they end).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import tiny_spec, trained_in_process
from safetensors.torch import load_file

from roundpipe.coordinator.spec.checkpoint_format import MANIFEST, step_name
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.training import checkpointer as checkpointer_module
from roundpipe.coordinator.training import job_planner as job_planner_module
from roundpipe.coordinator.training.checkpoint import (
    PROGRESS_FILE,
    STATE_FILE,
    CheckpointDir,
    load_tensors,
    verify_checkpoint,
)
from roundpipe.coordinator.training.job_errors import JobPaused
from roundpipe.coordinator.training.memory import InsufficientMemory, host_memory_needed
from roundpipe.coordinator.training.snapshot import BackgroundCheckpoints
from roundpipe.shared.model import LayeredModel

STEPS = 5


def spec_for(output: Path, every: int, staging: str | int = "auto", **kw) -> JobSpec:
    d = tiny_spec(output, steps=STEPS, staleness=1, **kw).to_dict()
    d["output"].update(checkpoint_every=every, keep_last=0, checkpoint_staging=staging)
    return JobSpec.from_dict(d)


def train(spec: JobSpec, arena_dir: Path, job_id: str = "job-bg"):
    """(staging bytes, final weights by name, [(step, loss)])."""
    with trained_in_process(spec, arena_dir, 2, job_id=job_id) as trainer:
        weights = {n: t for per in trainer.final_weights().values() for n, t in per.items()}
        return trainer.staging_bytes, weights, [(e.step, e.loss) for e in trainer.progress]


def assert_same_training(a, b) -> None:
    (_, wa, pa), (_, wb, pb) = a, b
    assert wa.keys() == wb.keys()
    assert [n for n in wa if not torch.equal(wa[n], wb[n])] == []
    assert pa == pb


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {f"state:{k}": t for k, t in load_tensors(step_dir / STATE_FILE)}
    out.update({f"model:{k}": t for k, t in load_tensors(step_dir / "model.safetensors")})
    return out


def test_background_checkpoints_change_no_bit_and_equal_drained_ones(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A checkpoint after every step, written in the background, leaves the training
    bitwise as without checkpoints; every checkpoint holds the very tensors (and the
    cursor and history) of the drained checkpoint of its step."""
    none = train(spec_for(tmp_path / "none", every=0), arena_dir)
    background = train(spec_for(tmp_path / "bg", every=1), arena_dir)
    drained = train(spec_for(tmp_path / "drained", every=1, staging=0), arena_dir)
    assert none[0] == 0 and drained[0] == 0
    # fp32 masters, two AdamW moments, fp32 prev: 16 bytes per trainable parameter.
    numel = sum(t.numel() for t in background[1].values())
    assert background[0] == 16 * numel
    assert_same_training(background, none)
    assert_same_training(drained, none)
    for step in range(1, STEPS + 1):
        bg_dir = tmp_path / "bg" / "checkpoints" / step_name(step)
        dr_dir = tmp_path / "drained" / "checkpoints" / step_name(step)
        verify_checkpoint(bg_dir)
        bg, dr = checkpoint_tensors(bg_dir), checkpoint_tensors(dr_dir)
        assert bg.keys() == dr.keys()
        # In-process workers reseed this process's generator for every task (in their
        # threads), so its state here is not the job's; in a coordinator nothing else
        # draws from it (nothing does in the loop either).
        assert [k for k in bg if k != "state:rng/torch_cpu" and not torch.equal(bg[k], dr[k])] == []
        bg_manifest = json.loads((bg_dir / MANIFEST).read_text())
        dr_manifest = json.loads((dr_dir / MANIFEST).read_text())
        assert bg_manifest["data_cursor"] == dr_manifest["data_cursor"]
        bg_history = load_file(bg_dir / PROGRESS_FILE)["progress"]
        dr_history = load_file(dr_dir / PROGRESS_FILE)["progress"]
        assert torch.equal(bg_history[:, :2], dr_history[:, :2])  # steps and losses
        assert bg_history[-1, 0] == step  # later steps ran meanwhile
        assert bg_manifest["masters"] == "model files"


def test_slow_writer_delays_the_next_checkpoint_and_changes_nothing(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A writer slower than a step: each checkpoint waits for the previous one (one
    staging copy, never two), every checkpoint is still written, the weights are those
    of the run without checkpoints."""
    real_save = checkpointer_module.save_tensors

    def slow_save(path, tensors, metadata=None):
        time.sleep(0.5)
        real_save(path, tensors, metadata)

    monkeypatch.setattr(checkpointer_module, "save_tensors", slow_save)
    caplog.set_level(logging.INFO, logger="roundpipe.coordinator")
    spec = spec_for(tmp_path / "bg", every=1, plan="F[0:2] T[2:6] B[0:2]")
    background = train(spec, arena_dir)
    assert background[0] > 0
    assert re.search(r"checkpoint step \d+ waited [0-9.]+s for the previous one", caplog.text)
    ckpts = CheckpointDir(tmp_path / "bg" / "checkpoints")
    assert [c.step for c in ckpts.complete("job-bg")] == list(range(1, STEPS + 1))
    monkeypatch.setattr(checkpointer_module, "save_tensors", real_save)
    none = train(spec_for(tmp_path / "none", every=0, plan="F[0:2] T[2:6] B[0:2]"), arena_dir)
    assert_same_training(background, none)


def test_staging_is_counted_and_bounded_by_the_setting(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The staging copy is part of the host-memory figure; a limit below one
    checkpoint, or (auto) a machine without the memory to spare, means drained
    checkpoints, with the reason in the log."""
    from roundpipe.coordinator.training.trainer import Trainer

    caplog.set_level(logging.INFO, logger="roundpipe.coordinator.training.job_planner")

    def prepared(spec: JobSpec) -> int:
        t = Trainer("job-mem", spec, arena_dir=arena_dir, namespace="bgmem", output_dir=tmp_path)
        try:
            t.prepare(1)
            need = host_memory_needed(t.layout, spec, checkpoint_staging=t.staging_bytes)
            assert need.total == host_memory_needed(t.layout, spec).total + t.staging_bytes
            assert need.components()["checkpoint_staging"] == t.staging_bytes
            assert "checkpoint staging" in need.describe()
            return t.staging_bytes
        finally:
            t.close()

    auto = prepared(spec_for(tmp_path, every=2))
    assert auto > 0
    assert prepared(spec_for(tmp_path, every=2, staging=auto)) == auto
    assert prepared(spec_for(tmp_path, every=2, staging=auto - 1)) == 0
    assert f"output.checkpoint_staging is {auto - 1} bytes" in caplog.text
    assert prepared(spec_for(tmp_path, every=0)) == 0  # the final checkpoint only

    real_check = job_planner_module.check_host_memory

    def tight(need, arena, **kw):  # room for the job, not for the staging copy
        if need.checkpoint_staging:
            raise InsufficientMemory("no room")
        real_check(need, arena, **kw)

    monkeypatch.setattr(job_planner_module, "check_host_memory", tight)
    assert prepared(spec_for(tmp_path, every=2)) == 0
    assert "does not have that much memory to spare" in caplog.text


def test_explicit_staging_is_counted_at_submit(tmp_path: Path, monkeypatch) -> None:
    """Admission (coordinator.admission, ``least_host_memory``) counts the staging an
    explicit ``output.checkpoint_staging`` commits the job to: a machine with room for
    the job but not for its staging refuses it at submit, naming the staging; "auto", a
    size too small for one checkpoint (drained checkpoints) or no periodic checkpoints
    add nothing, and are accepted on the same machine."""
    from roundpipe.coordinator.service.admission import validate_spec
    from roundpipe.coordinator.spec.errors import JobSpecError
    from roundpipe.coordinator.training import memory

    def spec(every: int, staging: str | int) -> dict:
        return spec_for(tmp_path / "out", every=every, staging=staging).to_dict()

    def least(d: dict) -> memory.HostMemory:
        job = JobSpec.from_dict(d)
        model = LayeredModel(model_config_from_spec(job.model))
        return memory.least_host_memory(model, job)

    auto = least(spec(2, "auto"))
    assert auto.checkpoint_staging == 0
    plenty = least(spec(2, "1GiB"))
    assert plenty.checkpoint_staging > 0
    assert plenty.total == auto.total + plenty.checkpoint_staging
    need = plenty.checkpoint_staging
    assert least(spec(2, need - 1)).checkpoint_staging == 0  # drained: nothing staged
    assert least(spec(0, "1GiB")).checkpoint_staging == 0  # only the final checkpoint

    # A machine with room for the job and half its staging.
    available = auto.total + need // 2
    monkeypatch.setattr(
        memory.psutil, "virtual_memory", lambda: type("VM", (), {"available": available})()
    )
    for accepted in (spec(2, "auto"), spec(2, need - 1), spec(0, "1GiB")):
        validate_spec(accepted)
    with pytest.raises(JobSpecError) as refused:
        validate_spec(spec(2, "1GiB"))
    assert "whatever its plan" in str(refused.value)
    assert "checkpoint staging" in str(refused.value)


def test_writer_fault_point_setting_is_parsed_strictly() -> None:
    """ROUNDPIPE_CHECKPOINT_FAULT: stall/hold/kill, optional step, marker last (its path may
    hold commas); anything else is refused with the setting's name."""
    from roundpipe.coordinator.training.snapshot import WriterFault, parse_writer_fault

    assert parse_writer_fault("") is None
    assert parse_writer_fault("stall") == WriterFault("stall")
    assert parse_writer_fault("kill@step=3") == WriterFault("kill", step=3)
    assert parse_writer_fault("stall@step=2,marker=/tmp/a,b") == WriterFault(
        "stall", step=2, marker=Path("/tmp/a,b")
    )
    assert parse_writer_fault("hold@step=2,marker=/tmp/m") == WriterFault(
        "hold", step=2, marker=Path("/tmp/m")
    )
    for bad in (
        "raise@step=1",
        "stall@step=x",
        "stall@iteration=1",
        "kill@step=1,when=end",
        "hold@step=2",  # held until its marker is removed: it needs one
    ):
        with pytest.raises(ValueError, match="ROUNDPIPE_CHECKPOINT_FAULT"):
            parse_writer_fault(bad)


# --------------------------------------------------------------------------- SIGKILL

CHILD = Path(__file__).parent / "procs" / "bg_trainer.py"


@pytest.mark.slow
def test_sigkill_while_a_background_write_is_in_flight_resumes_exactly(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A trainer process checkpointing every step in the background is SIGKILLed while
    a write is provably in flight: the writer's fault point (ROUNDPIPE_CHECKPOINT_FAULT,
    coordinator/training/snapshot.py), between the model files and the training state of
    checkpoint ``kill_at``, creates a marker and then stalls (the test kills on the
    marker) or kills the process itself. Each time ``latest`` names the checkpoint
    before it, the killed write's temporary directory is the only one left, and the
    resumed job equals the uninterrupted one bitwise. No timing decides anything: the
    kill cannot land before or after the write."""
    steps = 8
    out = tmp_path / "out"
    spec = _long_spec(out, steps)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    ckpts = CheckpointDir(out / "checkpoints")
    # The first run stalls at checkpoint 3 and the test kills it; the second resumes
    # from step 2 and kills itself at the point in checkpoint 6.
    for trial, (kill_at, action) in enumerate(((3, "stall"), (6, "kill"))):
        marker = tmp_path / f"reached-{trial}"
        fault = f"{action}@step={kill_at},marker={marker}"
        # The child trains with this process's thread count: the in-process runs below
        # must make the same bits (a CPU matmul's reduction order depends on it).
        env = dict(
            os.environ,
            ROUNDPIPE_CHECKPOINT_FAULT=fault,
            OMP_NUM_THREADS=str(torch.get_num_threads()),
        )
        log_file = tmp_path / f"child-{trial}.log"  # not a pipe: a stalled reader blocks no one
        with log_file.open("w") as log_out:
            child = subprocess.Popen(
                [sys.executable, str(CHILD), str(spec_file), str(arena_dir), f"kill{trial}"],
                stdout=log_out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            deadline = time.monotonic() + 300
            while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if not marker.exists():
                pytest.fail(f"trial {trial}: fault point not reached\n{log_file.read_text()}")
            in_flight = [p.name for p in _entries(ckpts.root) if p.name.startswith(".tmp-step-")]
            assert in_flight and all(
                n.startswith(f".tmp-{step_name(kill_at)}-{child.pid}-") for n in in_flight
            ), in_flight
            assert not (ckpts.root / step_name(kill_at)).exists()
            if action == "stall":
                child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == -signal.SIGKILL, f"trial {trial}: {log_file.read_text()}"
        assert marker.read_text() == f"{kill_at}\n"
        leftovers = [p.name for p in _entries(ckpts.root) if p.name.startswith(".tmp-")]
        assert leftovers == in_flight  # the resumed run removed the earlier one
        latest = ckpts.find_latest("job-kill")
        print(f"background-write SIGKILL trial {trial}: latest {ckpts.pointer()}, {leftovers}")
        assert latest is not None and latest.path.name == ckpts.pointer()
        assert latest.step == kill_at - 1
    resumed = train(spec, arena_dir, job_id="job-kill")
    assert [p.name for p in _entries(ckpts.root) if p.name.startswith(".tmp-")] == []
    uninterrupted = train(_long_spec(tmp_path / "ref2", steps), arena_dir, job_id="job-ref")
    assert_same_training(resumed, uninterrupted)


def _entries(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        return []


def _long_spec(out: Path, steps: int) -> JobSpec:
    d = tiny_spec(out, steps=steps, staleness=1).to_dict()
    d["output"].update(checkpoint_every=1, keep_last=2)
    return JobSpec.from_dict(d)


def test_full_disk_while_the_next_checkpoint_waits_pauses_the_job(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of checkpoint 2 fails (ENOSPC) late, while checkpoint 4, the last
    step's, waits for its staging: the job pauses with the reason, nothing hangs, and
    no temporary directory is left."""

    # No timing decides the order: the write of checkpoint 2 fails only once checkpoint 4
    # has been begun, which then waits for the staging that write holds.
    last_begun = threading.Event()
    real_begin = BackgroundCheckpoints.begin

    def begin(self, step, context):
        real_begin(self, step, context)
        if step == 4:
            last_begun.set()

    def full_disk(path, tensors, metadata=None):
        assert last_begun.wait(timeout=120), "checkpoint 4 was never begun"
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(BackgroundCheckpoints, "begin", begin)
    monkeypatch.setattr(checkpointer_module, "save_tensors", full_disk)
    d = spec_for(tmp_path / "out", every=2).to_dict()
    d["train"]["steps"] = 4
    with pytest.raises(JobPaused) as info:
        train(JobSpec.from_dict(d), arena_dir)
    message = str(info.value)
    for part in ("cannot write checkpoint step 2", "No space left", "ENOSPC", "roundpipe resume"):
        assert part in message, message
    root = tmp_path / "out" / "checkpoints"
    assert [p.name for p in root.iterdir()] == []
