"""The coordinator forks its spec checker at start-up, and spawns any replacement.

A spawned checker re-imports torch and transformers (seconds of CPU for each coordinator,
and the first submission waited for it); ``roundpipe-coordinator`` forks its first one
while it is still single-threaded (Note [forked spec checker] in
roundpipe.coordinator.service.admission). Forked, the checker runs the coordinator's own
command line; spawned, multiprocessing's ``spawn_main``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import psutil
import pytest
from runtime_helpers import tiny_spec

from roundpipe import forkserver
from roundpipe.client import JobRejected
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.service.admission import SpecValidator


def _checkers(coordinator: psutil.Process) -> list[psutil.Process]:
    """The coordinator's children but multiprocessing's resource tracker (which a spawn
    context starts alongside a spawned checker)."""
    return [
        child
        for child in coordinator.children()
        if "resource_tracker" not in " ".join(child.cmdline())
    ]


def _submit_and_cancel(cluster: LocalCluster, out: Path) -> None:
    """A job accepted (its spec was checked by the checker), then cancelled."""
    handle = cluster.client.submit(tiny_spec(out, steps=2))
    cluster.client.cancel(handle.job_id)
    assert handle.wait(timeout_s=60).state == "cancelled", cluster.logs()


def test_a_forked_coordinator_forks_its_checker_and_spawns_a_replacement(
    tmp_path: Path, arena_dir: Path
) -> None:
    cluster = LocalCluster(tmp_path / "c", arena_dir)
    try:
        # Forked from the fork server: single-threaded when its main() starts.
        assert isinstance(cluster.coordinator.proc, forkserver.ForkedProcess)
        coordinator = psutil.Process(cluster.coordinator.proc.pid)
        # A spec the checker refuses after reading its data (a token id the model lacks):
        # the checker logs as a spawned one does, warnings only, not into the
        # coordinator's log at its level (its data summary, as if a job had read it).
        bad = tmp_path / "ids.jsonl"
        bad.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, 700, 6]}\n')
        spec = tiny_spec(tmp_path / "out0").to_dict()
        spec["data"].update(path=str(bad), format="jsonl_tokens")
        with pytest.raises(JobRejected, match="vocab_size is"):
            cluster.client.submit(spec)
        assert "[data]" not in cluster.coordinator.tail(100_000), cluster.logs()
        _submit_and_cancel(cluster, tmp_path / "out1")
        checkers = _checkers(coordinator)
        assert len(checkers) == 1, (checkers, cluster.logs())
        checker = checkers[0]
        # Forked from the coordinator: its command line, not multiprocessing's spawn_main
        # (and no resource tracker, which only the spawn context starts).
        assert checker.cmdline() == coordinator.cmdline(), cluster.logs()
        assert "spawn_main" not in " ".join(checker.cmdline())
        assert len(coordinator.children()) == 1
        # Killed (the OOM killer, an operator): the next submission is checked by a
        # spawned replacement.
        checker.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs([checker], timeout=30)
        assert not alive
        _submit_and_cancel(cluster, tmp_path / "out2")
        replacements = _checkers(coordinator)
        assert len(replacements) == 1, (replacements, cluster.logs())
        assert replacements[0].pid != checker.pid
        assert "multiprocessing.spawn" in " ".join(replacements[0].cmdline())
    finally:
        cluster.stop()
    assert cluster.coordinator.proc.returncode == 0, cluster.logs()


def test_a_process_with_threads_spawns_its_checker() -> None:
    """Where another thread runs, forking could leave a lock held in the child forever:
    ``start(fork=True)`` spawns instead."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    validator = SpecValidator()
    try:
        assert validator.start(fork=True) is False
        assert validator._pool is not None
        assert validator._pool._mp_context.get_start_method() == "spawn"
    finally:
        validator.close()  # before the child's imports are done: it is killed
        stop.set()
        thread.join()
