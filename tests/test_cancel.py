"""Cancelling a job frees its workers within seconds, even in the middle of a long task.

Before, `cancel` tore the job down on the coordinator while the worker finished the task
(minutes for a long-context job). Now the worker's JobTeardown interrupts the running
task at its next layer, and the next job runs at once. The long task is a fault point
(`hold@...`, worker.faults) that keeps the first task running until the teardown
arrives, so no timing decides whether the cancel lands inside the task. A job that has
ended can then be forgotten (`roundpipe forget`), and only then.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runtime_helpers import tiny_spec

from roundpipe.cluster import LocalCluster


def _wait_for(predicate, timeout_s: float, what: str, cluster: LocalCluster) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"timed out: {what}\n{cluster.logs()}"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.slow
def test_cancel_interrupts_the_running_task(tmp_path: Path, arena_dir: Path) -> None:
    cluster = LocalCluster(tmp_path / "c", arena_dir)
    try:
        cluster.add_worker("w1", fault="hold@iteration=1")
        cluster.wait_for_workers(1)
        job = cluster.client.submit(tiny_spec(tmp_path / "long", steps=20))
        worker_log = cluster.workers["w1"].log_path
        _wait_for(
            lambda: "held by ROUNDPIPE_FAULT" in worker_log.read_text(),
            120,
            "the first task to be running",
            cluster,
        )
        job.cancel()
        interrupted_after = _wait_for(
            lambda: "was torn down" in worker_log.read_text(),
            60,
            "the running task's interruption",
            cluster,
        )
        # The worker may stop the task before the coordinator has recorded the cancel.
        assert job.wait(timeout_s=60).state == "cancelled", cluster.logs()
        # The worker is free: a short job runs to the end on it.
        short = cluster.client.submit(tiny_spec(tmp_path / "short", steps=2))
        status = short.wait(timeout_s=120)
        assert status.state == "succeeded", cluster.logs()
        print(f"task interrupted {interrupted_after:.1f}s after cancel")
        assert cluster.workers["w1"].alive()
    finally:
        cluster.stop()


def test_a_job_waiting_for_its_first_worker_says_so(tmp_path: Path) -> None:
    """Submitted where no worker has connected, a job showed "running 0/N" and nothing
    more (`submit --wait` sat silent). Its status says what it waits for; cancelled, it
    ends at once; a job that has ended is not cancelled again, and the caller is told."""
    from runtime_helpers import coordinator_only

    from roundpipe.client import RoundPipeError

    with coordinator_only(tmp_path / "c", "no-workers") as cluster:
        job = cluster.client.submit(tiny_spec(tmp_path / "out", steps=2))
        _wait_for(
            lambda: job.status().message == "waiting for a worker to connect",
            60,
            "the job's status to say it waits for a worker",
            cluster,
        )
        assert job.status().state == "running"
        job.cancel()
        assert job.wait(timeout_s=60).state == "cancelled"
        with pytest.raises(RoundPipeError, match="has already ended \\(cancelled\\)") as info:
            job.cancel()
        assert info.value.code == "bad_state"


def test_roundpipe_forget_removes_an_ended_job_only(tmp_path: Path) -> None:
    """`roundpipe forget JOB` as a user runs it: refused while the job runs (it names
    what to do), then the ended job is gone from the coordinator, its output kept."""
    import os
    import subprocess
    import sys

    from runtime_helpers import coordinator_only

    with coordinator_only(tmp_path / "c", "forget") as cluster:

        def roundpipe(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "roundpipe.cli", *args, "--address", cluster.address],
                env={**os.environ, **cluster.key_env("admin")},
                capture_output=True,
                text=True,
                timeout=120,
            )

        job = cluster.client.submit(tiny_spec(tmp_path / "out", steps=2))
        _wait_for(lambda: job.status().state == "running", 60, "the job to run", cluster)
        refused = roundpipe("forget", job.job_id)
        assert refused.returncode == 1, refused.stderr
        assert "is running: only a job that has ended" in refused.stderr, refused.stderr
        assert f"roundpipe cancel {job.job_id}" in refused.stderr, refused.stderr
        job.cancel()
        assert job.wait(timeout_s=60).state == "cancelled"
        done = roundpipe("forget", job.job_id)
        assert done.returncode == 0, done.stderr
        assert (
            done.stdout == f"job {job.job_id} forgotten; its output stays in {tmp_path / 'out'}\n"
        )
        listed = roundpipe("jobs")
        assert listed.returncode == 0 and job.job_id not in listed.stdout, listed.stdout
        gone = roundpipe("status", job.job_id)
        assert gone.returncode == 1 and "unknown job" in gone.stderr, gone.stderr
