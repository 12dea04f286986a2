"""A job releases its memory when it ends: back-to-back jobs leave the coordinator's RSS
flat (issue 15: every finished job's masters and AdamW moments stayed, ~12 bytes per
parameter per job). The long soak is ``benchmarks/soak.py``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest
from runtime_helpers import TINY_QWEN3, tiny_spec

from roundpipe.cluster import LocalCluster

pytestmark = pytest.mark.slow

# ~2.6M parameters: a job that kept its optimizer state would add ~32 MiB.
MODEL = {**TINY_QWEN3, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
JOBS = 6
KEPT_PER_JOB_MIB = 12.4 * 2.6e6 / 2**20


def test_back_to_back_jobs_leave_coordinator_rss_flat(tmp_path: Path) -> None:
    arena_dir = Path("/dev/shm") / f"rp-memory-{os.getpid()}"
    arena_dir.mkdir()
    cluster = LocalCluster(tmp_path / "cluster", arena_dir)
    try:
        cluster.add_worker("w1")
        cluster.add_worker("w2")
        cluster.wait_for_workers(2)
        coordinator = psutil.Process(cluster.coordinator.proc.pid)
        rss_mib = []
        for i in range(JOBS):
            spec = tiny_spec(tmp_path / f"out{i}", steps=2, config=MODEL, num_microbatches=2)
            status = cluster.client.submit(spec).wait(timeout_s=120)
            assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
            rss_mib.append(coordinator.memory_info().rss / 2**20)
        # The first jobs warm up caches (imports, allocator pools); after that, flat.
        growth = rss_mib[-1] - rss_mib[2]
        print(f"coordinator RSS after each job (MiB): {[round(r, 1) for r in rss_mib]}")
        assert growth < KEPT_PER_JOB_MIB, (
            f"coordinator RSS grew {growth:.1f} MiB over {JOBS - 3} jobs ({rss_mib}); one "
            f"job's kept optimizer state is ~{KEPT_PER_JOB_MIB:.0f} MiB"
        )
        # A finished job's history is still there for progress() and status.
        done = cluster.client.jobs()[-1]
        assert done.step == 2 and done.loss is not None
        events = list(cluster.client.job(done.job_id).progress(timeout_s=30))
        assert [e.step for e in events] == [1, 2]
    finally:
        leaked = cluster.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)
    assert leaked == []
