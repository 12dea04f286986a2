"""The worker table: which workers are connected, what each was sent, whether each is
still alive, and fencing (putting a lost worker down).

A worker registers with ``Hello`` (``WorkerTable.register``, after
``implausible_hardware`` found nothing absurd in its report); its heartbeats and results
count only from the identity that registered it, on its own connection
(``WorkerTable.heard_from``), and a result only for a task dispatched to it
(``WorkerTable.accept_result``). A worker is lost when its process is gone (same host,
checked by pid and start time) or its heartbeats stop (``WorkerTable.take_lost``), or when
the trainer says it stopped making progress (``WorkerTable.fence``). A lost worker is
fenced: SIGKILLed if its process is provably the worker's (Note [no fencing by hearsay]
below), else only dropped. A registration is also lost, never fenced, when its own
process registers again on a new connection (a worker that gave up on a stalled
coordinator and reconnected). See docs/fault-tolerance.md.

The table shares the daemon's lock (it guards the job book too), so a request sees jobs
and workers in one consistent state.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import psutil

from roundpipe.coordinator.planning.hardware import HardwareSpec, cpu_hardware, gpu_hardware
from roundpipe.coordinator.service.auth import Peer
from roundpipe.coordinator.service.jobs import bounded_text
from roundpipe.protocol import Hello, TaskDone, TaskFailed

__all__ = [
    "MAX_NAME_CHARS",
    "WorkerEntry",
    "WorkerTable",
    "fence_process",
    "implausible_hardware",
    "process_gone",
    "provable_worker_process",
]

log = logging.getLogger("roundpipe.coordinator")

MAX_NAME_CHARS = 256
"""Longest worker name or device name shown in WorkerInfo (they come from the worker's
Hello, whose only bound is the frame size); job ids and owner names a peer sends are cut
to it in replies and logs too."""


@dataclass
class WorkerEntry:
    worker_id: int
    identity: bytes
    hello: Hello
    last_seen: float
    # The authenticated identity (key name) that registered it: its messages must come
    # from that identity on this connection.
    peer_name: str = ""
    # The worker's process, when the kernel says which one it is (the pid at the other
    # end of its ipc:// connection); only such a process is ever signalled. See Note
    # [no fencing by hearsay].
    process: psutil.Process | None = None
    tasks_done: int = 0


class WorkerTable:
    """The connected workers by worker id, and which worker each dispatched task went to.
    Every method takes the shared lock; callers may hold it already (it is re-entrant)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._workers: dict[int, WorkerEntry] = {}
        self._by_identity: dict[bytes, int] = {}
        self._worker_ids = itertools.count(1)
        self.stalled_s = 0.0
        """Seconds the coordinator's loop has stalled so far (``excuse_silence``): the
        job's progress deadline does not count them either."""
        # Which worker each dispatched task went to: (job id, task id) -> worker id. A
        # TaskDone/TaskFailed is accepted only from that worker.
        self._assigned: dict[tuple[str, int], int] = {}
        # Registrations replaced by their own process reconnecting: lost, never fenced.
        self._superseded: list[tuple[WorkerEntry, str]] = []

    # -- joining and being heard ------------------------------------------------------

    def register(
        self, identity: bytes, hello: Hello, peer_name: str, process: psutil.Process | None
    ) -> int:
        """Enter (or re-enter, for a Hello again on the same connection) the worker on
        connection ``identity``; returns its worker id."""
        with self._lock:
            wid = self._by_identity.get(identity) or next(self._worker_ids)
            if process is not None:
                # The same process on a new connection: a worker that reconnected (it
                # gave up on a coordinator whose loop stalled). Its old registration is
                # lost, its tasks re-dispatched, and its process, alive and registered
                # again, is not fenced.
                for old in [e for e in self._workers.values() if e.process == process]:
                    if old.worker_id != wid:
                        del self._workers[old.worker_id]
                        self._by_identity.pop(old.identity, None)
                        self._superseded.append((old, f"reconnected as worker {wid}"))
            self._workers[wid] = WorkerEntry(
                wid, identity, hello, time.monotonic(), peer_name=peer_name, process=process
            )
            self._by_identity[identity] = wid
        return wid

    def heard_from(self, identity: bytes, peer_name: str) -> WorkerEntry | None:
        """The registered worker on connection ``identity``, if ``peer_name`` (the
        authenticated sender) registered it; marks it as heard from now."""
        with self._lock:
            wid = self._by_identity.get(identity)
            entry = self._workers.get(wid) if wid is not None else None
            if entry is not None and entry.peer_name != peer_name:
                entry = None
            if entry is not None:
                entry.last_seen = time.monotonic()
        return entry

    def accept_result(self, entry: WorkerEntry | None, msg: TaskDone | TaskFailed) -> bool:
        """Whether a result counts: from the registered worker the task was assigned to
        (``entry``, found by its connection), naming that worker. A TaskDone counts
        towards the worker's tasks done and ends the assignment."""
        with self._lock:
            assigned = self._assigned.get((msg.job_id, msg.task_id))
            if entry is None or msg.worker_id != entry.worker_id or assigned != entry.worker_id:
                return False
            if isinstance(msg, TaskDone):
                entry.tasks_done += 1
                del self._assigned[(msg.job_id, msg.task_id)]
            return True

    # -- tasks ------------------------------------------------------------------------

    def assign(self, job_id: str, task_id: int, worker_id: int) -> None:
        """Record that task ``task_id`` of ``job_id`` was sent to ``worker_id``."""
        with self._lock:
            self._assigned[(job_id, task_id)] = worker_id

    def forget_job(self, job_id: str) -> None:
        """Drop the assignments of a job whose run ended."""
        with self._lock:
            for key in [k for k in self._assigned if k[0] == job_id]:
                del self._assigned[key]

    # -- reading ----------------------------------------------------------------------

    def entries(self) -> list[WorkerEntry]:
        with self._lock:
            return list(self._workers.values())

    def live(self) -> list[int]:
        """The connected workers' ids, in order."""
        with self._lock:
            return sorted(self._workers)

    def identity(self, worker_id: int) -> bytes | None:
        """The connection of worker ``worker_id`` (None: not connected)."""
        with self._lock:
            entry = self._workers.get(worker_id)
            return entry.identity if entry else None

    def identities(self) -> list[bytes]:
        with self._lock:
            return [w.identity for w in self._workers.values()]

    def hardware(self) -> HardwareSpec:
        """What the planner plans for: the connected workers (GPU workers: the smallest
        GPU's memory; CPU workers otherwise)."""
        with self._lock:
            hellos = [w.hello for w in self._workers.values()]
        gpus = [h.memory_bytes for h in hellos if h.device == "cuda"]
        # The slowest direction of the slowest bus any worker measured (None: no bus).
        buses = [
            min(h.h2d_bytes_per_s, h.d2h_bytes_per_s)
            for h in hellos
            if h.h2d_bytes_per_s is not None and h.d2h_bytes_per_s is not None
        ]
        bandwidth = min(buses) if buses else None
        if gpus:
            return gpu_hardware(len(hellos), min(gpus), bandwidth)
        return cpu_hardware(max(1, len(hellos)), bandwidth)

    # -- losing workers ---------------------------------------------------------------

    def excuse_silence(self, seconds: float) -> None:
        """The coordinator's loop did not run for ``seconds``: no worker could be heard
        meanwhile, so that time does not count as their silence (Note [a stalled loop
        hears no heartbeat])."""
        now = time.monotonic()
        with self._lock:
            self.stalled_s += seconds
            for entry in self._workers.values():
                entry.last_seen = min(now, entry.last_seen + seconds)

    def take_lost(self, timeout_s: float) -> list[tuple[WorkerEntry, str, bool]]:
        """Remove and return the workers that are lost, with why and whether to fence
        them: process gone (same host, checked by pid + start time), or no heartbeat for
        ``timeout_s`` (fence); or registered again by the same process on a new
        connection (not fenced: the process is a live worker). The caller fences
        (``fence_process``) and tells the job."""
        now = time.monotonic()
        with self._lock:
            lost = [(entry, reason, False) for entry, reason in self._superseded]
            self._superseded.clear()
            for wid, entry in list(self._workers.items()):
                if process_gone(entry.process):
                    reason = "process exited"
                elif now - entry.last_seen > timeout_s:
                    reason = f"no heartbeat for {timeout_s:.0f}s"
                else:
                    continue
                lost.append((entry, reason, True))
                del self._workers[wid]
                self._by_identity.pop(entry.identity, None)
        return lost

    def fence(self, worker_id: int, reason: str) -> None:
        """Put down a worker that stopped making progress (the trainer's call): it is
        dropped from the table and fenced."""
        with self._lock:
            entry = self._workers.pop(worker_id, None)
            if entry is not None:
                self._by_identity.pop(entry.identity, None)
        if entry is not None:
            log.warning(
                "[coordinator] worker %d (%s) fenced: %s",
                worker_id,
                entry.hello.worker_name,
                reason,
            )
            fence_process(entry)


# Note [no fencing by hearsay]
# A lost worker that still runs must never wake up and write into a job's arenas, so the
# coordinator SIGKILLs it. But a Hello's pid is only what the peer claims: a fake Hello
# naming another process (a root daemon, a real worker, the coordinator itself) made the
# coordinator kill that process. So did a Hello naming one of the coordinator's own
# children (the spec checker, multiprocessing's resource tracker), while "our own child"
# still counted as proof: every later submission then failed. The coordinator starts no
# workers (LocalCluster, `roundpipe demo` and systemd start them beside it), so only the
# kernel's word proves a worker's process: the pid at the other end of the worker's
# ipc:// connection (SO_PEERCRED), when the Hello names that same pid and its start time.
# Even then the coordinator itself and its descendants (its helpers) are never
# candidates. A lost worker on tcp:// is dropped by identity and connection (its
# connection forgotten, its tasks re-dispatched), never signalled. The start time, read
# by the coordinator itself, rules out a pid reused later.

CREATE_TIME_SLACK_S = 1.0
"""How far a Hello's ``process_create_time`` may be from the start time the coordinator
reads for the kernel's pid (both come from psutil on the same host: normally equal)."""


def provable_worker_process(hello: Hello, peer: Peer) -> psutil.Process | None:
    """The worker's process if the kernel says which it is, else None (Note [no fencing
    by hearsay]): the pid of the peer's ipc:// connection, named by the Hello too, with
    the Hello's start time, and neither this process nor one it started."""
    if peer.pid is None or peer.pid != hello.pid:
        return None  # tcp:// (no peer credentials), or a pid the peer only claims
    try:
        proc = psutil.Process(peer.pid)
        # Cached by psutil: is_running() later compares against it.
        if abs(proc.create_time() - hello.process_create_time) > CREATE_TIME_SLACK_S:
            return None  # not the process that connected (its pid was reused since)
        if _own_process(proc):
            return None
    except psutil.Error:
        return None
    return proc


def _own_process(proc: psutil.Process) -> bool:
    """Whether ``proc`` is this coordinator or one of its descendants (the spec checker,
    the resource tracker, ...): never a worker's process. True when it cannot be told."""
    me = os.getpid()
    try:
        return proc.pid == me or any(p.pid == me for p in proc.parents())
    except psutil.Error:
        return True


def process_gone(proc: psutil.Process | None) -> bool:
    if proc is None:
        return False  # not provably ours: heartbeats decide
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def fence_process(entry: WorkerEntry) -> None:
    """SIGKILL a lost worker that still runs, if its process is provably the worker's
    (Note [no fencing by hearsay]); otherwise it is only dropped."""
    proc = entry.process
    if proc is not None and process_gone(proc):
        return  # it exited already: nothing to kill, and nothing to warn about
    if proc is None or _own_process(proc):
        log.warning(
            "[coordinator] worker %d (%s) dropped, not killed: the kernel did not say "
            "which process it is (only an ipc:// connection's peer pid proves that)",
            entry.worker_id,
            bounded_text(entry.hello.worker_name, MAX_NAME_CHARS),
        )
        return
    try:
        if proc.is_running():  # same pid and start time: the same process
            proc.send_signal(signal.SIGKILL)
            log.warning(
                "[coordinator] fenced worker process %d (%s) with SIGKILL",
                proc.pid,
                bounded_text(entry.hello.worker_name, MAX_NAME_CHARS),
            )
    except psutil.Error:
        pass


MIN_WORKER_MEMORY_BYTES = 64 * 2**20
MAX_WORKER_MEMORY_BYTES = 2**50  # 1 PiB
MIN_BUS_BYTES_PER_S = 1e6
MAX_BUS_BYTES_PER_S = 1e13


def implausible_hardware(hello: Hello) -> str | None:
    """Why a worker's hardware report cannot be true (None if it can): the planner plans
    every job for the smallest worker, so one absurd report would make every job
    unplannable or over-committed."""
    if not MIN_WORKER_MEMORY_BYTES <= hello.memory_bytes <= MAX_WORKER_MEMORY_BYTES:
        return (
            f"it reports {hello.memory_bytes} bytes of {hello.device} memory; a worker "
            f"needs between {MIN_WORKER_MEMORY_BYTES} and {MAX_WORKER_MEMORY_BYTES}"
        )
    for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
        value = getattr(hello, name)
        if value is not None and not MIN_BUS_BYTES_PER_S <= value <= MAX_BUS_BYTES_PER_S:
            return (
                f"it reports {name} = {value:g}; a real bus moves between "
                f"{MIN_BUS_BYTES_PER_S:g} and {MAX_BUS_BYTES_PER_S:g} bytes/s"
            )
    return None
