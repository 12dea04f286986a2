"""The fork server (roundpipe.forkserver) that LocalCluster starts its daemons from.

A forked daemon must be what ``python -m <module>`` would have been: its arguments,
environment, working directory, log file, signals and exit status. These tests drive the
server directly with real daemons; every system test in the suite drives it through
LocalCluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from roundpipe import forkserver
from roundpipe.cluster import LocalCluster
from roundpipe.forkserver import ForkedProcess, ForkServer, ForkServerError
from roundpipe.shared.keys import COORDINATOR, init_keys

WORKER = "roundpipe.worker.daemon"
COORD = "roundpipe.coordinator.service.main"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


@pytest.fixture
def worker_env(tmp_path: Path, server: ForkServer) -> dict[str, str]:
    keys = tmp_path / "keys"
    init_keys(keys)
    return {
        **server.env,
        "ROUNDPIPE_KEY": str(keys / "worker.key_secret"),
        "ROUNDPIPE_COORDINATOR_KEY": str(keys / f"{COORDINATOR}.key"),
    }


def test_the_server_is_single_threaded_when_it_forks(server: ForkServer) -> None:
    """Forking is safe only from one thread: importing torch under the server's
    OMP_NUM_THREADS=1 starts none (a thread holding a lock at fork would leave the
    child deadlocked on it)."""
    assert psutil.Process(server._proc.pid).num_threads() == 1


def test_a_forked_worker_gets_its_arguments_environment_and_log(
    server: ForkServer, worker_env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "w.log"
    env = {**worker_env, "ROUNDPIPE_FAULT": "explode@when=start"}
    proc = server.start(
        WORKER, ["--cpu", "--coordinator", "ipc:///nonexistent/rp.sock"], env=env, log_path=log
    )
    assert proc.wait(timeout=60) == 2
    # The environment variable the worker parsed, reported on its stderr, in the log.
    assert "ROUNDPIPE_FAULT: action 'explode' must be one of" in log.read_text()

    proc = server.start(WORKER, ["--cpu", "--no-such-option"], env=worker_env, log_path=log)
    assert proc.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-option" in log.read_text()


def test_signals_reach_the_daemon_and_its_status_comes_back(
    server: ForkServer, worker_env: dict[str, str], tmp_path: Path
) -> None:
    # A worker whose coordinator never answers waits out its handshake timeout.
    args = ["--cpu", "--coordinator", f"ipc://{tmp_path}/none.sock", "--handshake-timeout", "600"]
    proc = server.start(WORKER, args, env=worker_env, log_path=tmp_path / "w.log")
    assert psutil.Process(proc.pid).ppid() == server._proc.pid
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    # Ctrl-C in a terminal reaches the server too: it lives on to stop its daemons.
    os.kill(server._proc.pid, signal.SIGINT)
    assert proc.poll() is None and server.alive()
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # reaped: not signalled again (its pid may belong to another process)


def test_a_coordinator_stopped_as_its_socket_appears_exits_cleanly(
    server: ForkServer, tmp_path: Path
) -> None:
    """SIGTERM the moment the socket file exists (systemd stopping a coordinator that is
    still starting up): it exits 0 and removes the file. Its handler was set only after
    bind() returned, so half of such stops killed it with the default action (status
    -15, the socket left behind)."""
    for trial in range(6):
        sock = f"/tmp/rp-fs-stop-{os.getpid()}-{trial}.sock"
        proc = server.start(
            COORD,
            ["--address", f"ipc://{sock}", "--state-dir", str(tmp_path / f"state{trial}")]
            + ["--arena-dir", str(tmp_path)],
            env=server.env,
            log_path=tmp_path / f"c{trial}.log",
        )
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(sock) and proc.poll() is None:
                assert time.monotonic() < deadline, (tmp_path / f"c{trial}.log").read_text()
                time.sleep(0.001)
        finally:
            proc.terminate()
            code = proc.wait(timeout=60)
            left_behind = os.path.exists(sock)
            Path(sock).unlink(missing_ok=True)
        assert code == 0 and not left_behind, (
            trial,
            code,
            (tmp_path / f"c{trial}.log").read_text(),
        )


def test_a_forked_coordinator_runs_in_the_working_directory_it_was_given(
    server: ForkServer, tmp_path: Path
) -> None:
    """Relative paths resolve against the caller's directory, as they would for a
    coordinator started there; SIGTERM stops it with status 0, its socket file removed."""
    sock = f"/tmp/rp-fs-{os.getpid()}.sock"
    proc = server.start(
        COORD,
        ["--address", f"ipc://{sock}", "--state-dir", "state", "--arena-dir", str(tmp_path)],
        env=server.env,
        log_path=tmp_path / "c.log",
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "c.log").read_text()
        assert (tmp_path / "state").is_dir()
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
        left_behind = os.path.exists(sock)
        Path(sock).unlink(missing_ok=True)
    assert code == 0, (tmp_path / "c.log").read_text()
    assert not left_behind, "a stopped coordinator removes its ipc socket file"


def test_only_the_daemons_entry_points_and_import_time_variables_it_shares_are_forked(
    server: ForkServer, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="cannot fork 'os'"):
        server.start("os", [], env=server.env, log_path=tmp_path / "x.log")
    # Read at run time, or by nothing that is imported: may differ.
    assert server.can_start({**server.env, "ROUNDPIPE_FAULT": "kill@when=start"})
    assert server.can_start({**server.env, "PYTEST_CURRENT_TEST": "another test (call)"})
    # Read when the interpreter started or a library was imported: a daemon needing
    # another value must import afresh.
    assert not server.can_start({**server.env, "OMP_NUM_THREADS": "4"})
    assert not server.can_start({**server.env, "PYTHONHASHSEED": "7"})
    assert not server.can_start({**server.env, "HOME": str(tmp_path)})
    assert not server.can_start({**server.env, "HF_HUB_OFFLINE": "0"})
    assert not server.can_start({k: v for k, v in server.env.items() if k != "PATH"})


def test_a_cluster_forks_its_cpu_daemons_unless_their_environment_forbids(
    tmp_path: Path,
) -> None:
    arena_dir = tmp_path / "arenas"
    arena_dir.mkdir()
    # Under pytest (PYTEST_CURRENT_TEST changes with every test) and with the fault and
    # key variables each worker gets: forked.
    cluster = LocalCluster(tmp_path / "a", arena_dir, start=False)
    try:
        assert isinstance(cluster.add_worker("w1", fault="kill@when=start").proc, ForkedProcess)
        # a CPU worker given as device options (as benchmarks give them) too; a GPU
        # worker, or one asked not to, starts afresh
        cpu = ["--cpu", "--threads", "1", "--memory-limit", "1GiB"]
        assert isinstance(cluster.add_worker("w2", device=cpu).proc, ForkedProcess)
        assert isinstance(cluster.add_worker("w3", device=cpu, fork=False).proc, subprocess.Popen)
        for i, gpu in enumerate((["--gpu", "0"], ["--gpu=0"])):  # exit at once without one
            assert isinstance(cluster.add_worker(f"w{4 + i}", device=gpu).proc, subprocess.Popen)
    finally:
        cluster.stop()
    cluster = LocalCluster(tmp_path / "b", arena_dir, env={"OMP_NUM_THREADS": "2"}, start=False)
    try:
        assert isinstance(cluster.add_worker("w1").proc, subprocess.Popen)
    finally:
        cluster.stop()


def test_the_server_exits_when_its_owner_is_killed(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import time
                from roundpipe.forkserver import ForkServer
                s = ForkServer()
                print(s._proc.pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(server_pid)
    finally:
        owner.kill()
        owner.wait()
    # Its stdin closed with its owner: it leaves on its own, without being signalled
    # (once orphaned, it is reaped by whoever adopted it, or stays a zombie until then).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(server_pid):
        time.sleep(0.05)
    assert not _running(server_pid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_request_to_a_closed_server_says_so(tmp_path: Path) -> None:
    s = ForkServer()
    s.close()
    with pytest.raises(ForkServerError, match="fork server"):
        s.exit_status(1)


def test_a_server_whose_imports_start_a_thread_refuses_and_clusters_start_daemons_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenBLAS (under numpy, which transformers imports) starts its threads at load when
    told to use two: such a server would fork from more than one thread."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    with pytest.raises(ForkServerError, match="2 threads after the imports, not 1"):
        ForkServer()
    # This process's shared server is refused the same way; the cluster still runs.
    monkeypatch.setattr(forkserver, "_shared", None)
    monkeypatch.setattr(forkserver, "_shared_owner", 0)
    monkeypatch.setattr(forkserver, "_shared_failed", False)  # all three restored after
    arena_dir = tmp_path / "arenas"
    arena_dir.mkdir()
    cluster = LocalCluster(tmp_path / "c", arena_dir, start=False)
    try:
        assert isinstance(cluster.add_worker("w1").proc, subprocess.Popen)
    finally:
        cluster.stop()
    assert forkserver.shared_server() is None  # tried once, not at every daemon
    # The refusal was that server's: with the environment back, this process forks again.
    monkeypatch.undo()
    cluster = LocalCluster(tmp_path / "d", arena_dir, start=False)
    try:
        assert isinstance(cluster.add_worker("w1").proc, ForkedProcess)
    finally:
        cluster.stop()


def test_daemons_of_a_dead_server_are_still_stopped(
    worker_env: dict[str, str], tmp_path: Path
) -> None:
    """The server killed (an OOM kill, its own 60 s "wedged" kill) while its daemon ran:
    polling and signalling it raised ForkServerError, so LocalCluster.stop left every
    daemon running. They are now reached by pid and start time."""
    s = ForkServer()
    args = ["--cpu", "--coordinator", f"ipc://{tmp_path}/none.sock", "--handshake-timeout", "600"]
    proc = s.start(WORKER, args, env=worker_env, log_path=tmp_path / "w.log")
    s._proc.kill()
    s._proc.wait()
    assert proc.poll() is None  # orphaned, running on
    proc.terminate()
    deadline = time.monotonic() + 60
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the orphaned daemon did not stop"
        time.sleep(0.05)
    assert proc.returncode == forkserver.UNKNOWN_STATUS  # its parent, which knew, is gone
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == "zombie"
    proc.kill()  # gone: not signalled again
    s.close()
