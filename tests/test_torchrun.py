"""A group of coordinators launched by a real ``torchrun`` (docs/multi-node.md, "Under
torchrun or Slurm").

torchrun's elastic agent starts both coordinators, sets ``MASTER_ADDR``/``MASTER_PORT``/
``RANK``/``WORLD_SIZE`` and hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``),
which rank 0 then joins instead of hosting a store of its own. A job submitted to rank 0
trains on both nodes to the end and equals the single-process oracle over the global
batch; on SIGTERM both coordinators exit cleanly, so the agent reports success.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from runtime_helpers import assert_params_match, load_output, oracle_train, tiny_spec

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.paths import spec_read_dirs

NODES = 2


def _coordinators(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The coordinator processes under torchrun's agent, by rank."""
    matches = []
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
            env = child.environ()
        except psutil.Error:
            continue
        if "roundpipe.coordinator.service.main" in cmdline and "RANK" in env:
            matches.append((child, env))
    found = {}
    pids = {child.pid for child, _ in matches}
    for child, env in matches:
        if child.ppid() in pids:
            continue  # a coordinator's forked spec checker (Note [forked spec checker])
        # Rank 0 joined the agent's store rather than hosting one (multinode.py).
        assert env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", env
        found[int(env["RANK"])] = child
    return [found[r] for r in sorted(found)]


def test_a_group_launched_by_torchrun_trains_a_job_to_the_end(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path / "out", steps=3, num_microbatches=4)
    arena_dirs = [Path("/dev/shm") / f"rp-torchrun-{os.getpid()}-{r}" for r in range(NODES)]
    nodes: list[LocalCluster] = []
    log_path = tmp_path / "torchrun.log"
    launcher = None
    try:
        for rank, arena_dir in enumerate(arena_dirs):
            arena_dir.mkdir()
            nodes.append(
                LocalCluster(
                    tmp_path / f"node{rank}",
                    arena_dir,
                    coordinator_args=["--wait-timeout", "120", "--dist-timeout", "60"],
                    allow_read=spec_read_dirs(spec),
                    allow_write=[tmp_path],
                    start=False,
                )
            )
        # One command for every rank, as a launcher runs it: the rank (from torchrun's
        # environment) picks its node's command line, as each server's own would differ.
        cases = " ".join(
            f"{rank}) exec {shlex.join([sys.executable, *node.coordinator_argv()])} ;;"
            for rank, node in enumerate(nodes)
        )
        script = f'case "$RANK" in {cases} *) exit 2 ;; esac'
        with open(log_path, "w") as log:
            launcher = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nnodes",
                    "1",
                    "--nproc-per-node",
                    str(NODES),
                    "--max-restarts",
                    "0",
                    "--no-python",
                    "sh",
                    "-c",
                    script,
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        for rank, node in enumerate(nodes):
            node.add_worker(f"n{rank}w1")
        for node in nodes:
            node.wait_for_workers(1)
        handle = nodes[0].client.submit(spec)
        status = handle.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{log_path.read_text()[-4000:]}"
        # Node 1 records the end of its share a moment after rank 0 reports the job's.
        deadline = time.monotonic() + 30
        while (ran := {j.job_id: j.state for j in nodes[1].client.jobs()}) != {
            handle.job_id: "succeeded"
        } and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ran == {handle.job_id: "succeeded"}, log_path.read_text()[-4000:]

        coordinators = _coordinators(launcher)
        assert len(coordinators) == NODES, log_path.read_text()[-4000:]
        for proc in reversed(coordinators):  # rank 0 last: the others leave its group
            proc.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 0, log_path.read_text()[-4000:]
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
        for node in nodes:
            node.stop()
        for arena_dir in arena_dirs:
            shutil.rmtree(arena_dir, ignore_errors=True)
    reference = oracle_train(spec)
    assert_params_match(load_output(Path(spec.output.dir), False), reference)
