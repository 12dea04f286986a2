"""A diverged job stops and keeps only finite checkpoints (Note [diverged training] in
roundpipe.coordinator.training.divergence).

The oracle is the job itself: at lr 1e6 the tiny model's weights stop being finite after
step 3 (its loss is still finite there) and its loss at step 4. Unchecked, the job ran on
to its last step, wrote nan checkpoints, pruned the good ones and succeeded."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import tiny_spec, trained_in_process

from roundpipe.cluster import LocalCluster, local_group
from roundpipe.coordinator.spec.checkpoint_format import step_name
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.checkpoint import CheckpointDir, load_tensors
from roundpipe.coordinator.training.divergence import Diverged
from roundpipe.coordinator.training.job_errors import JobFailed
from roundpipe.coordinator.training.snapshot import CHECKPOINT_FAULT_ENV

DIVERGING_LR = 1e6


def diverging_spec(out: Path, *, every: int, staging: str | int, **kw) -> JobSpec:
    d = tiny_spec(out, steps=8, lr=DIVERGING_LR, **kw).to_dict()
    d["output"].update(checkpoint_every=every, keep_last=2, checkpoint_staging=staging)
    return JobSpec.from_dict(d)


def finite_checkpoints(root: Path) -> list[int]:
    """Steps of the checkpoints under ``root``; each must hold finite tensors only."""
    steps = []
    for info in CheckpointDir(root).complete():
        for name, tensor in load_tensors(info.path / "model.safetensors"):
            assert torch.isfinite(tensor).all(), (info.step, name)
        steps.append(info.step)
    return steps


def failure_of(spec: JobSpec, arena_dir: Path) -> str:
    """The message of the JobFailed that training ``spec`` in process ends with."""
    with pytest.raises(JobFailed) as failed:
        with trained_in_process(spec, arena_dir, 2, job_id="job-diverging"):
            pass
    return str(failed.value)


def test_the_advice_fits_the_spec(tmp_path: Path) -> None:
    """Clipping is suggested only where it is off, bfloat16 only to a float16 job; with
    no checkpoint the job starts again."""
    fp16 = tiny_spec(tmp_path, lr=0.5, dtype="float16")
    message = Diverged(7, float("inf")).message(fp16, None)
    assert message.startswith("step 7's loss is inf: training diverged"), message
    assert message.endswith(
        "no checkpoint was written before it. Lower optimizer.lr (now 0.5), set "
        "optimizer.grad_clip (1.0 is usual) or train in bfloat16 (float32's range), and "
        "start again"
    ), message
    unscaled = tiny_spec(tmp_path, lr=0.5, dtype="float16", train={"loss_scale": "none"})
    assert (
        Diverged(7, float("inf"))
        .message(unscaled, None)
        .endswith("or set train.loss_scale to dynamic or train in bfloat16, and start again")
    )
    clipped = tiny_spec(tmp_path, grad_clip=1.0)
    message = Diverged(7, float("nan")).message(clipped, (6, Path("/out/step-6")))
    assert message.endswith(
        "checkpoint step 6 (/out/step-6) is kept, from before it. Lower optimizer.lr (now "
        "0.0003), and continue from it with model.resume_from: /out/step-6"
    ), message


@pytest.mark.parametrize("staging", ["auto", 0], ids=["background", "drained"])
def test_a_nan_loss_stops_the_job_keeping_the_checkpoint_before_it(
    tmp_path: Path, arena_dir: Path, staging
) -> None:
    """Checkpoints every 2 steps: step 4's loss is nan. The job fails at step 4 naming
    the checkpoint of step 2 and what to change; no nan checkpoint is written (the
    background writer's step-4 checkpoint waited for a report that never came), and
    step 2 is not pruned."""
    spec = diverging_spec(tmp_path / "out", every=2, staging=staging)
    message = failure_of(spec, arena_dir)
    kept = tmp_path / "out" / "checkpoints" / step_name(2)
    assert message.startswith("step 4's loss is nan: training diverged"), message
    assert f"checkpoint step 2 ({kept}) is kept" in message, message
    assert "lower optimizer.lr (now 1e+06) or set optimizer.grad_clip" in message.lower()
    assert f"model.resume_from: {kept}" in message
    assert finite_checkpoints(tmp_path / "out" / "checkpoints") == [2]
    assert CheckpointDir(tmp_path / "out" / "checkpoints").pointer() == step_name(2)


@pytest.mark.parametrize("staging", ["auto", 0], ids=["background", "drained"])
def test_weights_that_overflowed_under_a_finite_loss_are_never_checkpointed(
    tmp_path: Path, arena_dir: Path, staging
) -> None:
    """Checkpoints every step: step 3's loss is finite but its update leaves nan
    weights. Checkpoint step 3 is not written and the job fails there, keeping step 2;
    the advice leaves out clipping, which is set."""
    spec = diverging_spec(tmp_path / "out", every=1, staging=staging, grad_clip=1.0)
    message = failure_of(spec, arena_dir)
    kept = tmp_path / "out" / "checkpoints" / step_name(2)
    assert message.startswith("the weights after step 3 are not finite (layer "), message
    assert "though every loss so far was" in message
    assert f"without writing checkpoint step 3; checkpoint step 2 ({kept}) is kept" in message
    assert "grad_clip" not in message  # it is set
    assert finite_checkpoints(tmp_path / "out" / "checkpoints") == [1, 2]


@pytest.mark.slow
def test_a_diverged_job_fails_in_the_cli_and_its_advice_continues_it(tmp_path: Path) -> None:
    """Through the daemons and the CLI, as a user meets it: at lr 1000 the tiny model's
    losses stay finite (its predictions collapse to uniform) but its last update leaves
    weights that are not: ``roundpipe submit --wait`` exits 1 with the message, the
    final checkpoint and model are not written, and a new job that follows the advice (a
    lower learning rate, ``model.resume_from`` the checkpoint named) trains on from it."""
    arena = Path(tempfile.mkdtemp(prefix="rp-diverge-", dir="/dev/shm"))
    cluster = LocalCluster(tmp_path / "cluster", arena, allow_write=[tmp_path])
    try:
        cluster.add_worker("w1", device=["--cpu", "--threads", "1"])
        cluster.wait_for_workers(1)
        d = tiny_spec(tmp_path / "out", steps=12, lr=1000.0).to_dict()
        d["output"].update(checkpoint_every=2, keep_last=2)
        spec_file = tmp_path / "diverging.json"
        spec_file.write_text(json.dumps(d))
        submitted = subprocess.run(
            [sys.executable, "-m", "roundpipe.cli", "submit", str(spec_file), "--wait"]
            + ["--address", cluster.address],
            env={**os.environ, **cluster.key_env("admin")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert submitted.returncode == 1, submitted.stderr + cluster.logs()
        kept = tmp_path / "out" / "checkpoints" / step_name(10)
        assert "failed at 12/12 steps: the weights after step 12 are not finite" in (
            submitted.stderr
        ), submitted.stderr
        assert f"checkpoint step 10 ({kept}) is kept" in submitted.stderr
        assert f"model.resume_from: {kept}" in submitted.stderr
        assert finite_checkpoints(tmp_path / "out" / "checkpoints") == [8, 10]
        assert not (tmp_path / "out" / "model.safetensors").exists()

        d["optimizer"]["lr"] = 3e-4
        d["model"]["resume_from"] = str(kept)
        d["output"]["dir"] = str(tmp_path / "again")
        d["train"]["steps"] = 14
        job = cluster.client.submit(JobSpec.from_dict(d))
        status = job.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
        losses = {e.step: e.loss for e in job.progress(timeout_s=30)}
        assert list(losses)[-4:] == [11, 12, 13, 14]
        assert all(math.isfinite(losses[step]) for step in (11, 12, 13, 14)), losses
        assert finite_checkpoints(tmp_path / "again" / "checkpoints") == [12, 14]
    finally:
        cluster.stop()
        shutil.rmtree(arena, ignore_errors=True)


@pytest.mark.slow
def test_every_node_of_a_group_fails_after_rank_0_finishes_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Two nodes: rank 0's background writer is held in the middle of checkpoint step 2
    (``hold`` fault point) while both nodes train on to step 4, whose loss (the group's)
    is nan. Every node waits for rank 0's write before leaving: a node that left at
    once made rank 0 pause the job ("the data-parallel group stopped"), telling the user
    to resume (to diverge again), and abandon checkpoint 2. Every node fails naming rank
    0's checkpoint 2, which is written."""
    marker = tmp_path / "writing-2"
    # Replicated state: only rank 0 writes (with sharded state the others take part in
    # its gathers, so they are held as long as it is, up to its last file)
    spec = diverging_spec(
        tmp_path / "out",
        every=2,
        staging="auto",
        num_microbatches=4,
        train={"optimizer_sharding": "replicated"},
    )
    hold = {CHECKPOINT_FAULT_ENV: f"hold@step=2,marker={marker}"}
    with local_group(tmp_path, "diverge", env={0: hold}, check_exit=False) as (rank0, rank1):
        job = rank0.client.submit(spec)
        leader = status_when(rank0, job.job_id, lambda s: s.step >= 4)
        assert leader.step == 4 and math.isnan(leader.loss), leader
        # rank 0's writer reaches the held point in its own time (on a loaded machine
        # after step 4): the job cannot end before it does, as it waits for that write
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline, rank0.logs()
            time.sleep(0.05)
        follower = status_when(rank1, job.job_id, lambda s: s.step >= 4)  # nan there too
        time.sleep(2)  # a follower that did not wait has left by now (about 1 s)
        assert rank1.client.status(job.job_id).state == "running", rank1.logs()
        marker.unlink()  # rank 0's write goes on
        kept = tmp_path / "out" / "checkpoints" / step_name(2)
        status = job.wait(timeout_s=120)
        assert status.state == "failed", f"{status.message}\n{rank0.logs()}"
        assert status.message.startswith("step 4's loss is nan"), status.message
        assert f"checkpoint step 2 ({kept}) is kept" in status.message
        follower = status_when(rank1, job.job_id, lambda s: s.state != "running")
        assert follower.state == "failed", (follower.state, follower.message)
        assert f"checkpoint step 2 ({kept}) is kept" in follower.message, follower.message
    assert finite_checkpoints(tmp_path / "out" / "checkpoints") == [2]


def status_when(node: LocalCluster, job_id: str, predicate, timeout_s: float = 240):
    """``node``'s status of ``job_id`` once ``predicate`` holds for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = {j.job_id: j for j in node.client.jobs()}
        if job_id in jobs and predicate(jobs[job_id]):
            return jobs[job_id]
        assert time.monotonic() < deadline, node.logs()
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["sharded", "replicated"])
def test_every_node_fails_when_rank_0_finds_weights_that_are_not_finite(
    tmp_path: Path, sharding: str
) -> None:
    """Two nodes; at lr 1000 the losses stay finite but the last update leaves weights
    that are not (as in the CLI test above). Only rank 0 checks the whole masters, as it
    writes the final checkpoint. Every node fails naming the checkpoint kept: the
    follower was paused, telling the user to resume a job that would diverge again."""
    d = tiny_spec(tmp_path / "out", steps=12, lr=1000.0, num_microbatches=4).to_dict()
    d["output"].update(checkpoint_every=2, keep_last=2)
    d["train"]["optimizer_sharding"] = sharding
    with local_group(tmp_path, f"weights-{sharding}", check_exit=False) as (rank0, rank1):
        job = rank0.client.submit(JobSpec.from_dict(d))
        status = job.wait(timeout_s=300)
        kept = tmp_path / "out" / "checkpoints" / step_name(10)
        assert status.state == "failed", f"{status.message}\n{rank0.logs()}"
        assert status.message.startswith("the weights after step 12 are not finite")
        follower = status_when(rank1, job.job_id, lambda s: s.state != "running")
        assert follower.state == "failed", (follower.state, follower.message)
        assert "the weights after step 12 are not finite" in follower.message, follower
        assert f"checkpoint step 10 ({kept}) is kept" in follower.message, follower.message
        assert "resume" not in follower.message.replace("model.resume_from", ""), follower
