"""Cancelling a job frees its workers within seconds, even in the middle of a long task.

A job with long attention (16k-token rows) makes each stage task take about a minute on a
one-thread CPU worker. Before, `cancel` tore the job down on the coordinator while the
worker finished the task (minutes at a larger seq_len). Now the worker's JobTeardown
interrupts the running task at its next layer, and the next job runs at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runtime_helpers import TINY_QWEN3, tiny_spec

from roundpipe.cluster import LocalCluster

LONG_SEQ = 16384


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
        cluster.add_worker("w1")
        cluster.wait_for_workers(1)
        long_job = tiny_spec(
            tmp_path / "long",
            steps=20,
            seq_len=LONG_SEQ,
            microbatch_size=2,
            num_microbatches=2,
            config={**TINY_QWEN3, "max_position_embeddings": LONG_SEQ},
        )
        job = cluster.client.submit(long_job)
        worker_log = cluster.workers["w1"].log_path
        # The worker logs each job's setup; the first task starts right after.
        _wait_for(lambda: "set up" in worker_log.read_text(), 120, "the long job's setup", cluster)
        time.sleep(2.0)  # well inside the first task (tens of seconds)
        job.cancel()
        interrupted_after = _wait_for(
            lambda: "was torn down" in worker_log.read_text(),
            60,
            "the running task's interruption",
            cluster,
        )
        assert job.status().state == "cancelled"
        # The worker is free: a short job runs to the end on it.
        short = cluster.client.submit(tiny_spec(tmp_path / "short", steps=2))
        status = short.wait(timeout_s=120)
        assert status.state == "succeeded", cluster.logs()
        print(f"task interrupted {interrupted_after:.1f}s after cancel")
        assert cluster.workers["w1"].alive()
    finally:
        cluster.stop()
