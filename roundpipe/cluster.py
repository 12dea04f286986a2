"""A coordinator and CPU/GPU workers as local child processes: for the chaos harness,
benchmarks and tests (``roundpipe demo`` has its own launcher with progress display).

:func:`cpu_cluster` is one such cluster with CPU workers, connected and cleaned up after;
:func:`local_group` is several, one data-parallel group over loopback (docs/multi-node.md).

Every daemon is a real process running its console script's entry point and logging to
a file in ``root``: forked from this process's :mod:`roundpipe.forkserver`, which has
the daemons' modules imported already (``ps`` shows the server's command line for them),
or, with ``fork_daemons=False`` and for a GPU worker, ``sys.executable -m ...``.
Workers can be added, killed (SIGKILL), frozen (SIGSTOP) and thawed at any time;
``stop()`` terminates everything with deadlines and reports arenas left behind.

Authentication is on, as in production: the cluster makes a throwaway key set in
``root/keys`` (``roundpipe keys init``: the coordinator's pair and a ``worker`` key, plus
an ``admin`` key that ``client`` uses). :meth:`LocalCluster.add_key` authorises more
identities; :meth:`LocalCluster.key_env` gives the environment a ``roundpipe`` command
needs to connect as one of them. ``keys=False`` runs the coordinator without keys (its
ipc:// socket then authenticates peers by their uid).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from roundpipe import forkserver
from roundpipe.client import Client, CoordinatorUnavailable
from roundpipe.shared.defaults import MAX_IPC_PATH
from roundpipe.shared.keys import (
    COORDINATOR,
    ConnectKeys,
    add_key,
    apply_connect_keys,
    connect_keys,
    init_keys,
)

log = logging.getLogger(__name__)

__all__ = ["Daemon", "LocalCluster", "cpu_cluster", "free_port", "group_args", "local_group"]


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen | forkserver.ForkedProcess
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class LocalCluster:
    def __init__(
        self,
        root: Path,
        arena_dir: Path,
        *,
        coordinator_args: list[str] | None = None,
        client_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        worker_args: Sequence[str] = (),
        allow_read: Sequence[str | os.PathLike[str]] = (),
        allow_write: Sequence[str | os.PathLike[str]] = (),
        keys: bool = True,
        start: bool = True,
        fork_daemons: bool = True,
    ):
        """``allow_read`` / ``allow_write``: the coordinator's ``--allow-read`` /
        ``--allow-write`` roots (docs/deploy.md), besides ``$ROUNDPIPE_ALLOW_READ`` /
        ``$ROUNDPIPE_ALLOW_WRITE`` and its own ``state/jobs``. ``start=False``: the
        coordinator is started by someone else (a launcher such as torchrun) with
        :meth:`coordinator_argv`; the cluster only starts workers and clients.
        ``fork_daemons``: fork the coordinator and CPU workers from the fork server
        (seconds of imports saved per daemon) where their environment allows it."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.arena_dir = Path(arena_dir)
        sock = self.root / "coordinator.sock"
        self._sock_dir: Path | None = None
        if len(str(sock).encode()) > MAX_IPC_PATH:
            # A Unix socket's path holds about 107 bytes (sun_path): a deep root (a test's
            # tmp_path under xdist, a benchmark's work folder) gets a short private one.
            self._sock_dir = Path(tempfile.mkdtemp(prefix="rp-sock-", dir="/tmp"))
            sock = self._sock_dir / "coordinator.sock"
        self.address = f"ipc://{sock}"
        self.state_dir = self.root / "state"
        roots = [("--allow-read", p) for p in allow_read] + [
            ("--allow-write", p) for p in allow_write
        ]
        self.coordinator_args = [str(x) for pair in roots for x in pair]
        self.coordinator_args += list(coordinator_args or [])
        self.env = dict(env or {})  # for every daemon, over OMP_NUM_THREADS=1
        self.worker_args = list(worker_args)
        """Options for every CPU worker, e.g. ``["--emulate-pcie", "2GB/s"]``."""
        self.fork_daemons = fork_daemons
        self.daemons: list[Daemon] = []
        self.workers: dict[str, Daemon] = {}
        self.keys_dir: Path | None = self.root / "keys" if keys else None
        try:
            if self.keys_dir is not None and not (self.keys_dir / f"{COORDINATOR}.key").exists():
                init_keys(self.keys_dir)
                add_key(self.keys_dir, "admin", "admin", out_dir=self.keys_dir)
            self.coordinator: Daemon | None = self.start_coordinator() if start else None
            self.client = self.client_as("admin", timeout_s=client_timeout_s)
        except BaseException:
            if self._sock_dir is not None:  # no one gets a cluster to stop()
                shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise

    def add_key(self, name: str, role: str) -> Path:
        """Authorise a new identity; returns its key pair (``*.key_secret``)."""
        assert self.keys_dir is not None, "this cluster runs without keys"
        return add_key(self.keys_dir, name, role, out_dir=self.keys_dir)

    def key_env(self, name: str) -> dict[str, str]:
        """Environment variables that make a client or worker connect as ``name``."""
        if self.keys_dir is None:
            return {}
        return {
            "ROUNDPIPE_KEY": str(self.keys_dir / f"{name}.key_secret"),
            "ROUNDPIPE_COORDINATOR_KEY": str(self.keys_dir / f"{COORDINATOR}.key"),
        }

    def dealer(self, name: str | None = "admin") -> zmq.Socket:
        """A raw DEALER socket connected as identity ``name`` (None: with no key), for
        tests that send hand-made frames."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if name is not None and self.keys_dir is not None:
            apply_connect_keys(sock, self._keys(name))
        sock.connect(self.address)
        return sock

    def _keys(self, name: str) -> ConnectKeys | None:
        env = self.key_env(name)
        if not env:
            return None
        return connect_keys(env["ROUNDPIPE_KEY"], env["ROUNDPIPE_COORDINATOR_KEY"])

    def client_as(self, name: str, timeout_s: float = 30.0) -> Client:
        """A Client connecting as identity ``name`` (see :meth:`add_key`)."""
        if self.keys_dir is None:
            return Client(self.address, timeout_s=timeout_s)
        return Client(
            self.address,
            timeout_s=timeout_s,
            key=self.keys_dir / f"{name}.key_secret",
            coordinator_key=self.keys_dir / f"{COORDINATOR}.key",
        )

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        forkable: bool = True,
    ) -> Daemon:
        """Start ``python -m <module> ...`` (``args``), forked from the fork server
        where allowed, else as a new interpreter."""
        log_path = self.root / f"{name}.log"
        args = [os.fspath(a) for a in args]  # a Path among them: the fork server takes JSON
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, **(env or {})}
        proc = self._fork(name, args, env, log_path) if forkable else None
        if proc is None:
            with open(log_path, "a") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, *args], stdout=log_file, stderr=subprocess.STDOUT, env=env
                )
        daemon = Daemon(name, proc, log_path)
        self.daemons.append(daemon)
        return daemon

    def _fork(
        self, name: str, args: list[str], env: dict[str, str], log_path: Path
    ) -> forkserver.ForkedProcess | None:
        """``python -m <module> ...`` forked from the fork server; None where it may not
        be (see :mod:`roundpipe.forkserver`) or the fork failed."""
        module = args[1] if args[:1] == ["-m"] else None
        if not self.fork_daemons or module not in forkserver.ENTRY_POINTS:
            return None
        server = forkserver.shared_server()
        if server is None or not server.can_start(env):
            return None
        try:
            return server.start(module, args[2:], env=env, log_path=log_path)
        except forkserver.ForkServerError as exc:  # e.g. fork() out of memory
            log.warning("%s starts as a new interpreter: %s", name, exc)
            return None

    def coordinator_argv(self) -> list[str]:
        """The coordinator's command line (after the Python interpreter)."""
        return [
            "-m",
            "roundpipe.coordinator.service.main",
            "--address",
            self.address,
            "--state-dir",
            str(self.state_dir),
            "--arena-dir",
            str(self.arena_dir),
            "--threads",
            "1",
            *(["--keys-dir", str(self.keys_dir)] if self.keys_dir is not None else []),
            *self.coordinator_args,
        ]

    def start_coordinator(self) -> Daemon:
        daemon = self._spawn("coordinator", self.coordinator_argv())
        self.coordinator = daemon
        return daemon

    def add_worker(
        self,
        name: str,
        *,
        fault: str | None = None,
        threads: int = 1,
        device: Sequence[str] | None = None,
        fork: bool | None = None,
    ) -> Daemon:
        """Start a worker: a CPU worker of ``threads`` threads, or on ``device`` given as
        worker options (e.g. ``["--gpu", "0", "--memory-limit", "24GiB"]``). ``fork``:
        fork it from the fork server (by default a CPU worker, ``--cpu``, is forked;
        a GPU worker starts as deployed, a new interpreter, so that its CUDA path is
        measured as users run it)."""
        env = {"ROUNDPIPE_FAULT": fault} if fault else {}
        env.update(self.key_env("worker"))
        where = (
            list(device)
            if device is not None
            else ["--cpu", "--threads", str(threads), *self.worker_args]
        )
        daemon = self._spawn(
            name,
            [
                "-m",
                "roundpipe.worker.daemon",
                *where,
                "--coordinator",
                self.address,
                "--name",
                name,
            ],
            env,
            forkable="--cpu" in where if fork is None else fork,
        )
        self.workers[name] = daemon
        return daemon

    def signal_worker(self, name: str, sig: int) -> None:
        self.workers[name].proc.send_signal(sig)

    def wait_for_workers(
        self, count: int, timeout_s: float = 120.0, *, exactly: Iterable[str] | None = None
    ) -> None:
        """Wait until the coordinator lists ``count`` workers; with ``exactly``, until it
        lists those names and no other. A worker that exited stays listed until the
        coordinator's next liveness check, so a count alone can be met by a worker just
        stopped while its replacement has not joined yet: a test that needs a particular
        worker to get tasks from the first one names it."""
        wanted = None if exactly is None else sorted(exactly)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                listed = self.client.workers()
                if wanted is None and len(listed) >= count:
                    return
                if wanted is not None and sorted(w.name for w in listed) == wanted:
                    return
            except CoordinatorUnavailable:
                # A coordinator just started may not answer yet: on a loaded machine its
                # imports alone can outlast one request's timeout. Ask again until ours.
                continue
            time.sleep(0.1)
        which = f"workers {sorted(wanted)} (and no other)" if wanted else f"{count} workers"
        raise TimeoutError(f"{which} did not connect within {timeout_s:.0f}s\n{self.logs()}")

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {d.name} ({d.log_path})\n{d.tail(chars)}" for d in self.daemons)

    def stop(self, timeout_s: float = 30.0) -> list[Path]:
        """Terminate every daemon (SIGCONT first for frozen ones); return leftover arenas
        (and arena directories)."""
        for daemon in reversed(self.daemons):
            if daemon.alive():
                daemon.proc.send_signal(signal.SIGCONT)
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                daemon.proc.wait()
        self.client.close()
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        # Arena files, and the coordinator's private arena directory with what is in it
        # (roundpipe.shared.arena: rp.<namespace>.<pid>.<start>.<random>.d).
        leftovers = []
        for path in sorted(self.arena_dir.iterdir()):
            if path.name.startswith("rp."):
                leftovers.append(path)
                if path.is_dir() and not path.is_symlink():
                    leftovers.extend(sorted(path.iterdir()))
        return leftovers


def _check_exit(cluster: LocalCluster) -> None:
    code = cluster.coordinator.proc.returncode
    if code != 0:
        raise RuntimeError(f"the coordinator exited with {code}:\n{cluster.logs()}")


@contextlib.contextmanager
def cpu_cluster(
    root: Path,
    name: str,
    coordinator_args: Sequence[str] = (),
    *,
    num_workers: int = 0,
    worker_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[LocalCluster]:
    """A LocalCluster with ``num_workers`` CPU workers, connected (arenas in a private
    /dev/shm folder), stopped and cleaned up afterwards; the coordinator must exit 0.
    ``env``: variables for every daemon (LocalCluster's)."""
    arena_dir = Path("/dev/shm") / f"rp-{name}-{os.getpid()}"
    arena_dir.mkdir()
    cluster = LocalCluster(
        root,
        arena_dir,
        coordinator_args=list(coordinator_args),
        worker_args=worker_args,
        env=env,
    )
    try:
        for i in range(num_workers):
            cluster.add_worker(f"w{i + 1}")
        cluster.wait_for_workers(num_workers)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)
    _check_exit(cluster)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_args(port: int, rank: int, world_size: int, timeout_s: float) -> list[str]:
    """``roundpipe-coordinator`` arguments that make it rank ``rank`` of a loopback group."""
    return [
        "--dist-init",
        f"tcp://127.0.0.1:{port}",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--dist-timeout",
        str(timeout_s),
    ]


@contextlib.contextmanager
def local_group(
    root: Path,
    name: str,
    *,
    num_nodes: int = 2,
    workers_per_node: int | Sequence[int] = 1,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = ("--wait-timeout", "120"),
    check_exit: bool = True,
    faults: dict[int, str] | None = None,
    env: dict[int, dict[str, str]] | None = None,
    client_timeout_s: float = 30.0,
) -> Iterator[list[LocalCluster]]:
    """``num_nodes`` coordinators (rank i is element i), each with ``workers_per_node``
    CPU workers (or a count per rank; ``faults``: rank -> ROUNDPIPE_FAULT for its first
    worker; ``env``: rank -> environment for its daemons); stopped afterwards (rank 0
    last: it hosts the group's store)."""
    port = free_port()
    nodes: list[LocalCluster] = []
    arena_dirs = []
    try:
        for rank in range(num_nodes):
            arena_dir = Path("/dev/shm") / f"rp-{name}-{os.getpid()}-{rank}"
            arena_dir.mkdir()
            arena_dirs.append(arena_dir)
            nodes.append(
                LocalCluster(
                    root / f"node{rank}",
                    arena_dir,
                    coordinator_args=[
                        *group_args(port, rank, num_nodes, timeout_s),
                        *extra_args,
                    ],
                    env=(env or {}).get(rank),
                    client_timeout_s=client_timeout_s,
                )
            )
        counts = (
            [workers_per_node] * num_nodes
            if isinstance(workers_per_node, int)
            else list(workers_per_node)
        )
        for rank, node in enumerate(nodes):
            for i in range(counts[rank]):
                fault = (faults or {}).get(rank) if i == 0 else None
                node.add_worker(f"n{rank}w{i + 1}", fault=fault)
        for node, count in zip(nodes, counts):
            node.wait_for_workers(count)
        yield nodes
    finally:
        for node in reversed(nodes[1:]):
            node.stop()
        if nodes:
            nodes[0].stop()
        for arena_dir in arena_dirs:
            shutil.rmtree(arena_dir, ignore_errors=True)
    if check_exit:
        for node in nodes:
            _check_exit(node)
