"""``roundpipe-coordinator``: the ZeroMQ daemon around the job queue and the Trainer.

Threads (only the I/O thread touches the ROUTER socket):

    rp-coordinator (I/O)   polls the ROUTER (workers and clients) and an inproc PULL
                           socket (outgoing messages from other threads); answers client
                           requests; tracks workers; forwards task results to the job.
                           Only cheap work runs here, so heartbeats are never starved
    rp-admission           answers SubmitJob / ResumeJob through its own inproc PUSH; the
                           validation itself (file checks, reading the data) runs in a
                           child process (coordinator.admission), so not even the GIL
                           ties it to the I/O thread
    rp-job                 runs queued jobs one at a time through a Trainer; sends
                           JobSetup / StageTask / JobTeardown through its own inproc PUSH
    rp-optimizer-<job>     the Trainer's layer-wise AdamW
    rp-checkpoints-<job>   the Trainer's background checkpoint writer (coordinator.snapshot)

One ROUTER socket at ``--address`` serves both workers and clients (both use DEALER
sockets): a worker introduces itself with ``Hello``; anything else is a client request
and gets exactly one reply. Signal handlers only set a flag.

Every connection is authenticated before its first message (roundpipe.coordinator.service.auth:
CurveZMQ keys, or ipc:// peer credentials; the ZAP handler runs on the I/O thread).
Each message is handled as its sender's identity and role allow: jobs belong to their
submitter (others, unless admin, are told the job does not exist); ``Hello`` and
heartbeats need a worker role; ``TaskDone``/``TaskFailed`` count only from the
registered worker they name, on its connection, for a task dispatched to it; a lost
worker is SIGKILLed only if its process is provably the worker's
(Note [no fencing by hearsay]).

Nothing a peer sends can end the I/O loop: the socket refuses frames over
``MAX_FRAME_BYTES`` before reading them (ZMQ_MAXMSGSIZE); lists are answered a page of
at most ``MAX_REPLY_BYTES`` at a time and free texts are cut to ``MAX_TEXT_CHARS`` (with
a count of what was cut), so every reply is encodable; a reply that still cannot be
encoded becomes an ErrorReply; and any exception while handling one message is logged
and the loop goes on with the next.

Jobs are durable (roundpipe.coordinator.service.jobstore): every job and state change goes to
``<state-dir>/jobs.sqlite3``. On start the coordinator loads them; jobs that were running
are queued again and, like every job, resume from their newest checkpoint
(docs/checkpoints.md). A job whose checkpoint or final model cannot be written is
``paused`` with the reason; ``ResumeJob`` (``roundpipe resume JOB``) queues a paused,
failed or cancelled job again. Stopping the coordinator (SIGTERM) interrupts the running
job without cancelling it: it stays queued and resumes on the next start.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import logging
import os
import queue
import resource
import secrets
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from roundpipe.coordinator.planning.hardware import HardwareSpec, cpu_hardware, gpu_hardware
from roundpipe.coordinator.service.admission import (
    SpecValidator,
    ValidationUnavailable,
    validate_spec,
)
from roundpipe.coordinator.service.auth import (
    ZAP_ENDPOINT,
    Authenticator,
    AuthSetupError,
    Peer,
    RateLimitedLog,
    request_reload,
)
from roundpipe.coordinator.service.jobs import (
    MAX_TEXT_CHARS,
    BadState,
    JobBook,
    JobRecord,
    bounded_text,
    outcome,
)
from roundpipe.coordinator.service.jobstore import JobStore, JobStoreError
from roundpipe.coordinator.service.metrics import MetricsServer, current_tasks
from roundpipe.coordinator.service.sdnotify import Notifier
from roundpipe.coordinator.spec.jobspec import MAX_SPEC_BYTES, JobSpec, JobSpecError
from roundpipe.coordinator.spec.paths import (
    GROUP_MODES,
    PRIVATE_MODES,
    PathPolicy,
    check_ownership,
    modes,
    set_modes,
    set_strict_reads,
)
from roundpipe.coordinator.training.job_events import (
    CheckpointWritten,
    JobEvent,
    PlanChosen,
    WorkerJoined,
    WorkerLost,
)
from roundpipe.coordinator.training.memory import release_freed_memory
from roundpipe.coordinator.training.multinode import (
    DEFAULT_DIST_TIMEOUT_S,
    GroupError,
    JobAnnouncement,
    JobGroup,
    NodeGroup,
    node_microbatches,
    settings_from_args,
)
from roundpipe.coordinator.training.trainer import JobCancelled, JobFailed, JobPaused, Trainer
from roundpipe.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    STOPPED_JOB_STATES,
    Ack,
    CancelJob,
    ErrorReply,
    GetJobLog,
    GetJobStatus,
    GetProgress,
    Heartbeat,
    Hello,
    JobAccepted,
    JobList,
    JobLog,
    JobState,
    JobTeardown,
    ListJobs,
    ListWorkers,
    Message,
    Progress,
    ProtocolError,
    ProtocolVersionError,
    Reject,
    ResumeJob,
    StageTask,
    SubmitJob,
    TaskDone,
    TaskFailed,
    Welcome,
    WorkerInfo,
    WorkerList,
    decode,
    encode,
    encoded_size,
)
from roundpipe.shared.arena import (
    ArenaError,
    check_arena_root,
    default_arena_dir,
    remove_stale_arenas,
)
from roundpipe.shared.keys import KeyFileError
from roundpipe.shared.polling import poll_spinning

__all__ = ["Coordinator", "main"]

log = logging.getLogger("roundpipe.coordinator")

HEARTBEAT_INTERVAL_S = 1.0
WORKER_LOST_AFTER_S = 5.0  # default --worker-timeout: heartbeats missed before "lost"
_OUTBOX = "inproc://rp-coordinator-outbox"

MAX_FRAME_BYTES = DEFAULT_MAX_BODY_BYTES + 256
"""ZMQ_MAXMSGSIZE of the ROUTER: libzmq drops the connection of a peer sending a larger
frame instead of reading it into memory first (decode would refuse its body anyway;
256 bytes cover header and type name)."""
MAX_NAME_CHARS = 256
"""Longest worker name or device name shown in WorkerInfo (they come from the worker's
Hello, whose only bound is the frame size)."""
LOG_PIECE_BYTES = 256 * 1024
"""Most bytes of a job's log in one JobLog reply (well under MAX_REPLY_BYTES even if
every byte became a 3-byte replacement character; a small read on the I/O thread)."""
MAX_PENDING_ADMISSIONS = 32
"""Submissions/resumes waiting for the admission thread; more are refused as busy, so a
flood of SubmitJobs cannot grow the coordinator."""
MAX_LISTED_JOBS = 5
"""Most job ids named in a refusal for ``--max-jobs-per-owner`` (the rest are counted)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""ZMQ_HANDSHAKE_IVL of the ROUTER: a connection that has not completed its handshake by
then is closed (libzmq's default is 30 s). Note [connection budget]."""
FD_RESERVE = 128
"""File descriptors kept out of the connection budget, besides those open when the
coordinator starts: a running job's files (arenas, checkpoint files, its log, the model
and data it reads, TensorBoard), the job store, the spec checker. A job on the tiny test
model holds about 12 more than an idle coordinator."""
MAX_CONNECTIONS = 4096
"""The connection budget's ceiling, whatever RLIMIT_NOFILE allows: every connection costs
libzmq buffers too."""
MIN_CONNECTIONS = 8
"""The connection budget's floor (with a warning) when RLIMIT_NOFILE leaves less."""
WANTED_OPEN_FILES = 65536
"""The soft RLIMIT_NOFILE ``main`` raises to (at most the hard limit)."""


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
    state: str = "idle"
    tasks_done: int = 0


class AddressInUse(RuntimeError):
    pass


class Coordinator:
    """The daemon's state and loops. ``serve()`` blocks until ``stop()``."""

    def __init__(
        self,
        address: str,
        state_dir: str | Path,
        arena_dir: str | Path | None = None,
        *,
        namespace: str | None = None,
        wait_timeout_s: float = 600.0,
        worker_timeout_s: float = WORKER_LOST_AFTER_S,
        paths: PathPolicy | None = None,
        keys_dir: str | Path | None = None,
        group: NodeGroup | None = None,
        max_jobs_per_owner: int | None = None,
    ):
        self.address = address
        self.max_jobs_per_owner = max_jobs_per_owner
        """Most jobs one owner may have queued or running (``--max-jobs-per-owner``; None:
        no limit). A submission or resume beyond it is refused (``busy``, saying why)."""
        self.group = group
        """The data-parallel group this coordinator is a node of (coordinator.multinode):
        rank 0 takes jobs and runs them on every node; the others run what it announces."""
        self.group_lost: str | None = None
        """Why a follower lost rank 0 (it then stops, to be restarted and join again)."""
        # Default: <state-dir>/keys (roundpipe.shared.keys); read at bind().
        self.keys_dir = Path(keys_dir) if keys_dir is not None else Path(state_dir) / "keys"
        self.auth: Authenticator | None = None
        self._noisy = RateLimitedLog()  # log lines a peer can provoke at will
        self.worker_timeout_s = worker_timeout_s
        self.state_dir = Path(state_dir)
        # Where job specs may read and write (coordinator.paths); by default only the
        # job outputs in the state directory and the shipped demo data.
        self.paths = paths or PathPolicy.for_coordinator(self.state_dir)
        # The arena root: each job's arenas go to a private directory in it (Note [private
        # arena directory] in roundpipe.shared.arena).
        self.arena_dir = Path(arena_dir) if arena_dir is not None else default_arena_dir()
        # Arena files carry the namespace: coordinators on different addresses never
        # clean up each other's leftovers.
        self.namespace = namespace or _namespace_for(address)
        self.wait_timeout_s = wait_timeout_s
        self.coordinator_id = secrets.token_hex(4)
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        # Re-entrant: status/progress code called under it may ask the trainer, whose
        # callbacks (e.g. the live-worker list) take it again.
        self._lock = threading.RLock()  # guards workers and jobs
        self.workers: dict[int, WorkerEntry] = {}
        self._by_identity: dict[bytes, int] = {}
        self._worker_ids = itertools.count(1)
        # Every job and the state machine they follow (socket-free: coordinator.jobs);
        # its store is opened by bind().
        self.book = JobBook(self.state_dir, self.paths, self._lock)
        # Which worker each dispatched task went to: (job id, task id) -> worker id. A
        # TaskDone/TaskFailed is accepted only from that worker.
        self._assigned: dict[tuple[str, int], int] = {}
        # (identity, request, peer) for the admission thread; bounded.
        self._admissions: queue.Queue[tuple[bytes, Message, Peer] | None] = queue.Queue(
            MAX_PENDING_ADMISSIONS
        )
        # Set by serve(); without it (a coordinator driven by tests) specs are validated
        # in-process.
        self.validator: SpecValidator | None = None

    # -- lifecycle --------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the ROUTER; refuse an address another coordinator is serving."""
        self.state_dir.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        (self.state_dir / "jobs").mkdir(mode=modes().dir, exist_ok=True)
        log.info("[coordinator] job paths: %s", self.paths.describe())
        self.paths.warn_about_open_roots()
        self.book.store = JobStore.in_state_dir(self.state_dir)
        check_arena_root(self.arena_dir)  # ArenaError: missing, or others could tamper
        self.auth = Authenticator(self.address, self.keys_dir)  # AuthSetupError: no keys
        if self.address.startswith("ipc://") and _someone_listens(self.address):
            # ZeroMQ would silently take over an ipc path; check for a live owner first.
            raise AddressInUse(f"another coordinator is already serving {self.address}")
        # The ZAP handler must be bound before any peer connects: libzmq refuses every
        # handshake while ZAP_DOMAIN is set and no handler listens.
        self.zap = self.ctx.socket(zmq.ROUTER)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.auth.configure(self.router)
        # Note [connection budget]: an idle or slow handshake is closed after a while.
        self.router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))
        # The ROUTER's monitor: each connection accepted and closed (with its descriptor:
        # Note [connection budget]), and each peer that fails the handshake before the
        # ZAP handler is asked (no key at all: the wrong mechanism; garbage instead of a
        # greeting; silence past HANDSHAKE_TIMEOUT_S), which shows up only here. Its
        # queue is unbounded (RCVHWM 0): an event dropped would miscount connections.
        monitor_address = f"inproc://rp-router-monitor-{self.coordinator_id}"
        self.router.monitor(monitor_address, _ROUTER_EVENTS)
        self.handshake_events = self.ctx.socket(zmq.PAIR)
        self.handshake_events.setsockopt(zmq.RCVHWM, 0)
        self.handshake_events.setsockopt(zmq.LINGER, 0)
        self.handshake_events.connect(monitor_address)
        try:
            self.router.bind(self.address)
            if self.address.startswith("ipc://"):
                # Owner and group may connect, whatever the umask (docs/deploy.md).
                os.chmod(self.address[len("ipc://") :], 0o660)
        except zmq.ZMQError as exc:
            self.router.disable_monitor()
            self.handshake_events.close()
            self.router.close()
            self.zap.close()
            if exc.errno == zmq.EADDRINUSE:
                raise AddressInUse(
                    f"address {self.address} is in use (another coordinator?); stop it or "
                    "pass a different --address"
                ) from None
            raise
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(_OUTBOX + self.coordinator_id)
        removed = remove_stale_arenas(self.arena_dir, self.namespace)
        if removed:
            log.info("[coordinator] removed %d arena(s) left by a dead coordinator", len(removed))
        self.book.load()
        self.connections = _ConnectionBudget(
            connection_budget(), _local_identity(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        )
        log.info(
            "[coordinator] at most %d connections at a time (RLIMIT_NOFILE %s, %d open files, "
            "%d kept for jobs); handshakes time out after %gs",
            self.connections.budget,
            _soft_open_files_limit(),
            _open_files(),
            FD_RESERVE,
            HANDSHAKE_TIMEOUT_S,
        )

    def stop(self) -> None:
        self._stop.set()
        self.book.wake()

    def serve(self) -> None:
        follower = self.group is not None and not self.group.leader
        job_thread = threading.Thread(
            target=self._follower_loop if follower else self._job_loop, name="rp-job", daemon=True
        )
        job_thread.start()
        self.validator = SpecValidator(self.arena_dir, strict_reads=True)
        self.validator.start()
        admission_thread = threading.Thread(
            target=self._admission_loop, name="rp-admission", daemon=True
        )
        admission_thread.start()
        log.info(
            "[coordinator] roundpipe-coordinator ready on %s (authentication: %s)",
            self.address,
            self.auth.mode if self.auth else "none",
        )
        notifier = Notifier()  # systemd Type=notify; a no-op elsewhere (coordinator.sdnotify)
        notifier.ready(f"listening on {self.address}")
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        poller.register(self.zap, zmq.POLLIN)
        poller.register(self.handshake_events, zmq.POLLIN)
        next_check = time.monotonic() + HEARTBEAT_INTERVAL_S
        try:
            while not self._stop.is_set():
                notifier.watchdog_tick()  # from this loop: a wedged loop gets restarted
                for sock, _ in poll_spinning(poller, 100):
                    try:
                        if sock is self.router:
                            self._on_router()
                        elif sock is self.zap:
                            assert self.auth is not None
                            self.auth.handle_zap(self.zap)
                        elif sock is self.handshake_events:
                            self._on_connection_events()
                        else:
                            frames = self.outbox.recv_multipart()
                            self._send(frames[0], frames[1:])
                    except Exception:
                        # Whatever one message did, the loop must go on: it alone
                        # answers every client and keeps every worker alive.
                        log.exception("[coordinator] handling a message failed; it is dropped")
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + HEARTBEAT_INTERVAL_S
                    try:
                        assert self.auth is not None
                        self.auth.reload()  # a removed key is refused from now on
                    except Exception:  # e.g. out of descriptors: the workers still count
                        log.exception("[coordinator] re-reading the authorised keys failed")
                    try:
                        self._check_workers()
                    except Exception:
                        log.exception("[coordinator] checking the workers failed")
        finally:
            notifier.stopping()
            self._stop.set()
            active = self.book.active
            if active is not None and active.trainer is not None:
                active.trainer.cancel()
            try:
                self._admissions.put_nowait(None)  # wakes the admission thread to exit
            except queue.Full:
                pass  # it sees _stop within its poll interval
            admission_thread.join(timeout=60)
            self.validator.close()
            job_thread.join(timeout=60)
            self.router.disable_monitor()
            self.handshake_events.close()
            self.router.close()
            self.outbox.close()
            self.zap.close()
            self.ctx.term()
            notifier.close()
            log.info("[coordinator] stopped")

    # -- I/O thread -------------------------------------------------------------------

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        # Never block the I/O thread: with ROUTER_MANDATORY a send to a peer whose pipe is
        # full (a frozen worker stops reading) would block every client and worker. Such
        # a message is dropped; liveness checks then recover the peer's tasks.
        try:
            self.router.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            # Rate-limited: a peer that floods requests and never reads would otherwise
            # write a log line per request.
            self._noisy.warning("not-reading", "peer %r is not reading; message dropped", identity)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): its loss is handled
            self._noisy.warning("unreachable", "cannot reach peer %r: %s", identity, exc)

    def _on_connection_events(self) -> None:
        """Read every event the ROUTER's monitor has queued (connections accepted and
        closed, failed handshakes), then hang up what exceeds the connection budget
        (Note [connection budget])."""
        assert self.auth is not None
        budget = self.connections
        while True:
            try:
                event = recv_monitor_message(self.handshake_events, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                budget.accepted(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                budget.closed(value)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.auth.refusals.warning(
                    "no-key",
                    "refused a connection that failed the handshake: it offered another "
                    "security mechanism (no key?)",
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.auth.refusals.warning(
                    "no-key",
                    "closed a connection that failed the handshake: it does not speak ZMTP, "
                    "or did not finish its handshake within %gs",
                    HANDSHAKE_TIMEOUT_S,
                )
        silent, waiting = budget.enforce()
        if silent or waiting:
            self._noisy.warning(
                "budget",
                "connection budget of %d reached: hung up %d connection(s) that had sent "
                "nothing and %d still in their handshake, oldest first (%d so far); a flood "
                "of connections? (docs/deploy.md, threat model)",
                budget.budget,
                silent,
                waiting,
                budget.hung_up,
            )

    def _reply(self, identity: bytes, reply: Message) -> None:
        """Send a reply; one that cannot be encoded becomes an ErrorReply saying so."""
        self._send(identity, encode_reply(reply))

    def _on_router(self) -> None:
        parts = self.router.recv_multipart(copy=False)
        identity = parts[0].bytes
        assert self.auth is not None
        peer = self.auth.peer(parts[-1])
        if peer is None:
            # Authenticated at connect time, but its key has since been removed.
            self.auth.refusals.warning(
                "revoked", "dropped a message from an identity no longer authorised"
            )
            return
        frames = [p.bytes for p in parts[1:]]
        try:
            msg = decode(frames)
        except ProtocolVersionError as exc:
            self._noisy.warning(
                "version", "rejected a peer speaking protocol %s: %s", exc.seen_version, exc
            )
            self._send(
                identity,
                encode(
                    Reject(
                        reason=f"protocol version mismatch: this coordinator speaks version "
                        f"{PROTOCOL_VERSION}, the peer {exc.seen_version}; install the same "
                        "roundpipe version on coordinator, workers and clients",
                        expected_version=PROTOCOL_VERSION,
                    )
                ),
            )
            return
        except ProtocolError as exc:
            self.auth.refusals.warning(
                "malformed", "malformed message from %s dropped: %s", peer.name, exc
            )
            self._reply(identity, ErrorReply(code="protocol_error", message=str(exc)))
            return
        if isinstance(msg, (Hello, Heartbeat, TaskDone, TaskFailed)):
            self._on_worker_message(identity, peer, msg)
        elif not peer.client:
            self._forbid(identity, peer, msg)
        elif isinstance(msg, (SubmitJob, ResumeJob)) and self.group and not self.group.leader:
            self._reply(
                identity,
                ErrorReply(
                    code="unexpected_message",
                    message=f"this coordinator is rank {self.group.rank} of a data-parallel "
                    f"group; submit and resume jobs at rank 0 ({self.group.settings.host}), "
                    "which runs them on every node",
                ),
            )
        elif isinstance(msg, (SubmitJob, ResumeJob)):
            self._admit(identity, msg, peer, len(frames[0]) if len(frames) == 1 else 0)
        else:
            self._reply(identity, self._answer(msg, peer))

    def _forbid(self, identity: bytes, peer: Peer, msg: Message) -> None:
        self.auth.refusals.warning(  # type: ignore[union-attr]
            "forbidden",
            "refused a %s from %s (role %s)",
            type(msg).__name__,
            peer.name,
            "/".join(sorted(peer.roles)),
        )
        needs = "worker" if isinstance(msg, (Hello, Heartbeat)) else "client or admin"
        self._reply(
            identity,
            ErrorReply(
                code="forbidden",
                message=f"identity {peer.name!r} may not send {type(msg).__name__}: that "
                f"needs a {needs} key (`roundpipe keys add NAME --role ...` on the "
                "coordinator's host)",
            ),
        )

    def _on_worker_message(
        self, identity: bytes, peer: Peer, msg: Hello | Heartbeat | TaskDone | TaskFailed
    ) -> None:
        """Worker-only messages: from a worker-role identity, and (except Hello) from the
        registered worker on its own connection."""
        if not peer.worker:
            if isinstance(msg, (Hello, Heartbeat)):
                self._forbid(identity, peer, msg)
            else:  # results get no reply: just drop them
                self.auth.refusals.warning(  # type: ignore[union-attr]
                    "forged-result",
                    "dropped a %s from non-worker %s",
                    type(msg).__name__,
                    peer.name,
                )
            return
        if isinstance(msg, Hello):
            self._on_hello(identity, peer, msg)
            return
        with self._lock:
            wid = self._by_identity.get(identity)
            entry = self.workers.get(wid) if wid is not None else None
            if entry is not None and entry.peer_name != peer.name:
                entry = None
            if entry is not None:
                entry.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            if entry is None:
                # A worker of a previous coordinator instance (its socket reconnected by
                # itself): make it shake hands again so it gets a worker id and the jobs.
                reply: Message = ErrorReply(
                    code="unknown_worker", message="unknown worker: send Hello again"
                )
            else:
                # Answer, so the worker can tell a lost coordinator from a quiet one.
                reply = Heartbeat(sender="coordinator", seq=msg.seq, sent_at=time.time())
            self._reply(identity, reply)
            return
        self._on_task_result(entry, msg)

    def _answer(self, msg: Message, peer: Peer) -> Message:
        try:
            return self._on_request(msg, peer)
        except Exception as exc:  # a bug in a handler must not kill the daemon
            log.exception("[coordinator] request %s failed", type(msg).__name__)
            return ErrorReply(code="internal_error", message=f"{type(exc).__name__}: {exc}")

    def _admit(self, identity: bytes, msg: SubmitJob | ResumeJob, peer: Peer, size: int) -> None:
        """Hand a submission or resume to the admission thread: validating a spec reads
        files (the data, the model's config) and must not hold up this loop."""
        if isinstance(msg, SubmitJob) and size > MAX_SPEC_BYTES:
            self._reply(
                identity,
                ErrorReply(
                    code="bad_spec",
                    message=f"the job spec is {size} bytes, more than the limit of "
                    f"{MAX_SPEC_BYTES}; a spec names files, it does not hold data",
                ),
            )
            return
        try:
            self._admissions.put_nowait((identity, msg, peer))
        except queue.Full:
            self._reply(
                identity,
                ErrorReply(
                    code="busy",
                    message=f"the coordinator is still checking {MAX_PENDING_ADMISSIONS} "
                    "submitted jobs; try again in a moment",
                ),
            )

    def _admission_loop(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(_OUTBOX + self.coordinator_id)
        try:
            while not self._stop.is_set():
                try:
                    item = self._admissions.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    return
                identity, msg, peer = item
                try:
                    push.send_multipart([identity, *encode_reply(self._answer(msg, peer))])
                except Exception:  # this thread must outlive any one submission
                    log.exception("[coordinator] answering a %s failed", type(msg).__name__)
        finally:
            push.close(linger=1000)

    def _on_hello(self, identity: bytes, peer: Peer, hello: Hello) -> None:
        problem = implausible_hardware(hello)
        if problem is not None:
            self.auth.refusals.warning(  # type: ignore[union-attr]
                "bad-hello", "refused worker %s: %s", peer.name, problem
            )
            self._reply(
                identity,
                ErrorReply(code="bad_hello", message=f"this worker was refused: {problem}"),
            )
            return
        process = _provable_worker_process(hello, peer)
        with self._lock:
            wid = self._by_identity.get(identity) or next(self._worker_ids)
            self.workers[wid] = WorkerEntry(
                wid, identity, hello, time.monotonic(), peer_name=peer.name, process=process
            )
            self._by_identity[identity] = wid
            active = self.book.active
        log.info(
            "[coordinator] worker %d joined: %s (%s %s, pid %d on %s, identity %s; %s)",
            wid,
            bounded_text(hello.worker_name, MAX_NAME_CHARS),
            hello.device,
            bounded_text(hello.device_name, MAX_NAME_CHARS),
            hello.pid,
            bounded_text(hello.hostname, MAX_NAME_CHARS),
            peer.name,
            "process verified" if process is not None else "process not provable: never signalled",
        )
        self._send(
            identity,
            encode(
                Welcome(
                    worker_id=wid,
                    coordinator_id=self.coordinator_id,
                    heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                    arena_dir=str(self.arena_dir),
                )
            ),
        )
        # A worker joining mid-job gets the job's setup and then its share of tasks
        # (including tasks parked while no worker was connected).
        if active is not None and active.trainer is not None and active.trainer.layout:
            self._send(identity, encode(active.trainer.job_setup()))
            active.trainer.inbox.put(WorkerJoined(wid))

    def _on_task_result(self, entry: WorkerEntry | None, msg: TaskDone | TaskFailed) -> None:
        """Forward a result to the job, if it comes from the registered worker the task
        was assigned to (on that worker's connection) and names that worker."""
        with self._lock:
            assigned = self._assigned.get((msg.job_id, msg.task_id))
            if entry is None or msg.worker_id != entry.worker_id or assigned != entry.worker_id:
                accepted = False
            else:
                accepted = True
                if isinstance(msg, TaskDone):
                    entry.tasks_done += 1
                    del self._assigned[(msg.job_id, msg.task_id)]
            active = self.book.active
        if not accepted:
            self.auth.refusals.warning(  # type: ignore[union-attr]
                "stray-result",
                "dropped a %s for task %d of %s: not from the worker it was assigned to",
                type(msg).__name__,
                msg.task_id,
                bounded_text(msg.job_id, MAX_NAME_CHARS),
            )
            return
        if active is not None and active.trainer is not None and active.job_id == msg.job_id:
            active.trainer.inbox.put(msg)

    def _check_workers(self) -> None:
        """Declare workers lost: process gone (same host, checked by pid + start time),
        or no heartbeat for ``worker_timeout_s``. See docs/fault-tolerance.md."""
        now = time.monotonic()
        lost: list[tuple[WorkerEntry, str]] = []
        with self._lock:
            for wid, entry in list(self.workers.items()):
                if _process_gone(entry.process):
                    reason = "process exited"
                elif now - entry.last_seen > self.worker_timeout_s:
                    reason = f"no heartbeat for {self.worker_timeout_s:.0f}s"
                else:
                    continue
                lost.append((entry, reason))
                del self.workers[wid]
                self._by_identity.pop(entry.identity, None)
            active = self.book.active
        for entry, reason in lost:
            log.warning(
                "[coordinator] worker %d (%s) lost: %s",
                entry.worker_id,
                entry.hello.worker_name,
                reason,
            )
            _fence(entry)  # a frozen process must never wake up and write
            if active is not None and active.trainer is not None:
                active.trainer.inbox.put(WorkerLost(entry.worker_id, reason))

    def fence_worker(self, worker_id: int, reason: str) -> None:
        """Called by the trainer for a worker that stopped making progress."""
        with self._lock:
            entry = self.workers.pop(worker_id, None)
            if entry is not None:
                self._by_identity.pop(entry.identity, None)
        if entry is not None:
            log.warning(
                "[coordinator] worker %d (%s) fenced: %s",
                worker_id,
                entry.hello.worker_name,
                reason,
            )
            _fence(entry)

    def _job_of(self, job_id: str, peer: Peer) -> JobRecord | None:
        """The job, if ``peer`` may see it: its owner or an admin. Anyone else is told
        there is no such job, exactly as for an id that does not exist."""
        with self._lock:
            job = self.book.jobs.get(job_id)
        if job is None or not (peer.admin or job.owner == peer.name):
            return None
        return job

    def _on_request(self, msg: Message, peer: Peer) -> Message:
        if isinstance(msg, SubmitJob):
            return self._submit(msg, peer)
        if isinstance(msg, GetJobStatus):
            job = self._job_of(msg.job_id, peer)
            if job is None:
                return _unknown(msg.job_id)
            with self._lock:
                return job.status()
        if isinstance(msg, GetProgress):
            return self._progress(msg, peer)
        if isinstance(msg, GetJobLog):
            return self._job_log(msg, peer)
        if isinstance(msg, CancelJob):
            return self._cancel(msg.job_id, peer)
        if isinstance(msg, ResumeJob):
            return self._resume(msg.job_id, peer)
        if isinstance(msg, ListJobs):
            with self._lock:
                visible = [j for j in self.book.jobs.values() if peer.admin or j.owner == peer.name]
                total = len(visible)
                page, more = _page(j.status() for j in visible[msg.start :])
            next_start = msg.start + len(page) if more else None
            return JobList(jobs=page, next_start=next_start, total=total)
        if isinstance(msg, ListWorkers):
            with self._lock:
                active = self.book.active
                running = current_tasks(active.trainer if active is not None else None)
                workers = sorted(
                    (
                        w
                        for w in self.workers.values()
                        if msg.after is None or w.worker_id > msg.after
                    ),
                    key=lambda w: w.worker_id,
                )
                page, more = _page(
                    WorkerInfo(
                        worker_id=w.worker_id,
                        name=bounded_text(w.hello.worker_name, MAX_NAME_CHARS),
                        device=w.hello.device,
                        device_name=bounded_text(w.hello.device_name, MAX_NAME_CHARS),
                        memory_bytes=w.hello.memory_bytes,
                        state="busy" if w.worker_id in running else "idle",
                        tasks_done=w.tasks_done,
                        h2d_bytes_per_s=w.hello.h2d_bytes_per_s,
                        d2h_bytes_per_s=w.hello.d2h_bytes_per_s,
                        current_task=running.get(w.worker_id, ""),
                    )
                    for w in workers
                )
            return WorkerList(workers=page, more=more)
        return ErrorReply(
            code="unexpected_message",
            message=f"{type(msg).__name__} is not a request a coordinator answers",
        )

    def _progress(self, msg: GetProgress, peer: Peer) -> Message:
        job = self._job_of(msg.job_id, peer)
        if job is None:
            return _unknown(msg.job_id)
        with self._lock:
            done = job.state in STOPPED_JOB_STATES
            page, more = job.progress_page(msg.after_seq)
        return Progress(job_id=job.job_id, events=page, done=done and not more)

    def _job_log(self, msg: GetJobLog, peer: Peer) -> Message:
        """A piece of the job's log file, for its owner or an admin: the way a user who
        may not read the coordinator's files reads the log of a job of theirs."""
        job = self._job_of(msg.job_id, peer)
        if job is None:
            return _unknown(msg.job_id)
        if job.log_path is None:
            return JobLog(job_id=job.job_id, offset=msg.offset, text="", next_offset=msg.offset)
        try:
            with open(job.log_path, "rb") as f:
                f.seek(msg.offset)
                data = f.read(LOG_PIECE_BYTES + 1)
        except FileNotFoundError:
            data = b""  # a queued job has no log yet
        more = len(data) > LOG_PIECE_BYTES
        data = data[:LOG_PIECE_BYTES]
        if more and b"\n" in data:
            data = data[: data.rindex(b"\n") + 1]  # whole lines: no character cut in two
        return JobLog(
            job_id=job.job_id,
            offset=msg.offset,
            text=data.decode("utf-8", errors="replace"),
            next_offset=msg.offset + len(data),
            more=more,
        )

    def _validated(
        self, spec: dict, owner: str | None = None, *, admin: bool = False
    ) -> tuple[JobSpec | None, dict]:
        """(the JobSpec if it was built here, the normalised spec dict). Raises
        JobSpecError or ValidationUnavailable. Paths outside the allowed roots, and
        (with ``owner``) paths into another owner's jobs, are refused first, before
        anything is opened."""
        spec = self.paths.confine_spec(spec)
        if owner is not None:
            check_ownership(spec, owner, admin=admin, owned=self.book.owned_dirs())
        hardware = self._hardware()  # CPU workers (or none): no GPU memory to check
        if self.validator is not None:
            return None, self.validator.validate(spec, hardware)
        built = validate_spec(spec, str(self.arena_dir), hardware)
        return built, built.to_dict()

    def _owner_limit_refusal(self, owner: str, resuming: str | None = None) -> ErrorReply | None:
        """An ErrorReply if ``owner`` already has ``max_jobs_per_owner`` jobs queued or
        running (another one, submitted or ``resuming``, would exceed it), else None.
        SubmitJob and ResumeJob are answered one at a time (the admission thread), so no
        other submission of theirs can slip in between this count and the queueing."""
        limit = self.max_jobs_per_owner
        if limit is None:
            return None
        with self._lock:
            active = [
                j.job_id
                for j in self.book.jobs.values()
                if j.owner == owner and j.state in ("queued", "running")
            ]
        if len(active) < limit:
            return None
        shown = ", ".join(active[:MAX_LISTED_JOBS]) + (
            f" and {len(active) - MAX_LISTED_JOBS} more" if len(active) > MAX_LISTED_JOBS else ""
        )
        who = bounded_text(owner, MAX_NAME_CHARS)
        if resuming is None:
            head, again = f"{who} already has", "submit again"
        else:
            head = f"job {resuming} cannot be queued again: its owner {who} already has"
            again = f"resume it again (`roundpipe resume {resuming}`)"
        return ErrorReply(
            code="busy",  # ErrorCode: "cannot take the request now; try again"
            message=f"{head} {len(active)} jobs queued or running ({shown}), the limit of "
            f"{limit} per owner on this coordinator (--max-jobs-per-owner): wait for one of "
            f"them to finish, or cancel one (`roundpipe cancel JOB`), then {again}",
        )

    def _submit(self, msg: SubmitJob, peer: Peer) -> Message:
        refusal = self._owner_limit_refusal(peer.name)  # before any file is read
        if refusal is not None:
            return refusal
        try:
            spec, spec_dict = self._validated(dict(msg.spec), peer.name, admin=peer.admin)
        except JobSpecError as exc:
            return ErrorReply(code="bad_spec", message=str(exc))
        except ValidationUnavailable as exc:
            return ErrorReply(code="spec_check_failed", message=str(exc))
        if self.group is not None and self.group.broken is None:
            try:  # each node trains an equal share: refuse now, not when it starts
                node_microbatches(spec_dict["batch"]["num_microbatches"], 0, self.group.world_size)
            except ValueError as exc:
                return ErrorReply(code="bad_spec", message=str(exc))
        try:
            job = self.book.submit(spec, spec_dict, owner=peer.name, admin=peer.admin)
        except JobSpecError as exc:  # another owner's job took the output meanwhile
            return ErrorReply(code="bad_spec", message=str(exc))
        except JobStoreError as exc:
            log.error("[coordinator] job not accepted: %s", exc)
            return ErrorReply(code="store_error", message=f"the job was not accepted: {exc}")
        return JobAccepted(job_id=job.job_id)

    def _cancel(self, job_id: str, peer: Peer) -> Message:
        job = self._job_of(job_id, peer)
        if job is None:
            return _unknown(job_id)
        log.info("[coordinator] %s asks to cancel job %s", peer.name, job_id)
        self.book.cancel(job)
        return Ack()

    def _resume(self, job_id: str, peer: Peer) -> Message:
        job = self._job_of(job_id, peer)
        if job is None:
            return _unknown(job_id)
        if job.state in STOPPED_JOB_STATES and job.state != "succeeded":
            # It would be queued again: it counts against its owner's limit.
            refusal = self._owner_limit_refusal(job.owner, resuming=job.job_id)
            if refusal is not None:
                return refusal
        if self.book.needs_spec_check_to_resume(job):  # outside the lock: reads its files
            try:
                self._validated(job.spec_dict, job.owner, admin=peer.admin)
            except JobSpecError as exc:
                return ErrorReply(code="bad_spec", message=f"job {job_id} cannot run again: {exc}")
            except ValidationUnavailable as exc:
                return ErrorReply(code="spec_check_failed", message=str(exc))
        try:
            self.book.resume(job)
        except BadState as exc:
            return ErrorReply(code="bad_state", message=str(exc))
        return Ack()

    # -- job thread -------------------------------------------------------------------

    def _job_loop(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(_OUTBOX + self.coordinator_id)
        try:
            while (job := self.book.take_next(self._stop)) is not None:
                try:
                    self._run_job(job, push)
                except Exception as exc:  # this thread must outlive any one job
                    log.exception("[coordinator] running job %s failed", job.job_id)
                    if job.state == "running":
                        self.book.finish(job, *_stopped_by(job, exc))
        finally:
            push.close(linger=1000)

    def _follower_loop(self) -> None:
        """Ranks other than 0: run the jobs rank 0 announces, one at a time. If rank 0's
        store stops answering the group is gone: stop the daemon (exit status 3) so that
        systemd restarts it and it joins the new group (docs/multi-node.md)."""
        assert self.group is not None
        push = self.ctx.socket(zmq.PUSH)
        push.connect(_OUTBOX + self.coordinator_id)
        try:
            while not self._stop.is_set():
                try:
                    announcement = self.group.next_job(self._stop.is_set)
                except GroupError as exc:
                    self.group_lost = str(exc)
                    log.error("[coordinator] the data-parallel group is gone: %s; stopping", exc)
                    self.stop()
                    return
                if announcement is None:
                    return
                job = self._follower_job(announcement)
                with self._lock:
                    self.book.jobs[job.job_id] = job
                    self.book.active = job
                self._run_job(job, push, announcement)
        finally:
            push.close(linger=1000)

    def _follower_job(self, announcement: JobAnnouncement) -> JobRecord:
        """The record of a job rank 0 announced: its outputs (none but the log: rank 0
        writes checkpoints and the model) go below this node's state directory."""
        job_dir = self.book.job_dir(announcement.job_id)
        job_dir.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        output = Path(os.path.realpath(job_dir)) / "node-output"
        spec = dict(announcement.spec)
        spec["output"] = {**dict(spec.get("output") or {}), "dir": str(output)}
        steps = int(spec.get("train", {}).get("steps", 0))
        return JobRecord(
            announcement.job_id,
            None,
            spec_dict=spec,
            state="running",
            total_steps=steps,
            output_dir=str(output),
            log_path=job_dir / "job.log",
            owner="rank-0",
            stored=False,
            message=f"run for rank 0 ({self.group.settings.host if self.group else ''})",
        )

    def _job_group(self, job: JobRecord, announcement: JobAnnouncement | None) -> JobGroup | None:
        """The job's share of the data-parallel group: rank 0 announces it, the others
        join the announced one. None: this coordinator runs it alone."""
        group = self.group
        if group is None:
            return None
        if announcement is not None:
            return group.join_job(announcement)
        if group.broken is not None:
            log.warning(
                "[coordinator] job %s runs on this node alone: %s", job.job_id, group.broken
            )
            return None
        return group.announce(job.job_id, job.spec_dict)

    def _live_workers(self) -> list[int]:
        with self._lock:
            return sorted(self.workers)

    def _hardware(self) -> HardwareSpec:
        """What the planner plans for: the connected workers (GPU workers: the smallest
        GPU's memory; CPU workers otherwise)."""
        with self._lock:
            hellos = [w.hello for w in self.workers.values()]
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

    def _identity(self, worker_id: int) -> bytes | None:
        with self._lock:
            entry = self.workers.get(worker_id)
            return entry.identity if entry else None

    def _broadcast(self, push: zmq.Socket, message: Message) -> None:
        frames = encode(message)
        with self._lock:
            identities = [w.identity for w in self.workers.values()]
        for identity in identities:
            push.send_multipart([identity, *frames])

    def _run_job(
        self, job: JobRecord, push: zmq.Socket, announcement: JobAnnouncement | None = None
    ) -> None:
        """Run one job on the job thread: build its trainer, prepare, train, export; the
        book (coordinator.jobs) records the state it ends in. ``announcement``: a job
        rank 0 of the data-parallel group announced (this node is a follower)."""
        try:
            handler = _job_log_handler(job)
        except OSError as exc:  # e.g. out of descriptors: the job never started
            self.book.finish(job, *_stopped_by(job, exc))
            return
        try:
            job_group = self._job_group(job, announcement)
        except (GroupError, RuntimeError) as exc:
            self.book.finish(job, "paused", f"the data-parallel group cannot run it: {exc}")
            logging.getLogger("roundpipe").removeHandler(handler)
            handler.close()
            return
        if job.spec is None:
            # Validated at submission, in the admission child; built (and so checked
            # again: its files may have changed since) here, off the I/O thread.
            try:
                job.spec = JobSpec.from_dict(self.paths.confine_spec(job.spec_dict))
            except JobSpecError as exc:
                self.book.finish(job, "failed", f"the job's spec is no longer valid: {exc}")
                if job_group is not None:  # the other nodes stop waiting for this one
                    job_group.leave(f"failed: {job.message}")
                    job_group.close()
                logging.getLogger("roundpipe").removeHandler(handler)
                handler.close()
                return

        def on_event(event: JobEvent) -> None:
            if isinstance(event, PlanChosen):
                self.book.record_plan(job, str(event.plan))
            elif isinstance(event, CheckpointWritten):
                self.book.record_checkpoint(job, event.step, event.loss)

        trainer = Trainer(
            job.job_id,
            job.spec,
            arena_dir=self.arena_dir,
            namespace=self.namespace,
            output_dir=Path(job.output_dir or "."),
            wait_timeout_s=self.wait_timeout_s,
            paths=self.paths,
            on_event=on_event,
            group=job_group,
        )
        job.trainer = trainer
        # Replaced by None when the run finishes, or by what it raised.
        error: BaseException | None = RuntimeError("the job thread stopped unexpectedly")
        try:
            with self._lock:
                if job.cancel_requested:
                    raise JobCancelled("cancelled")
            if not self._live_workers():
                log.info("[coordinator] job %s waits for a worker to connect", job.job_id)
                if job_group is not None:  # the other nodes wait for this one: say why
                    job_group.set_note("no worker connected to its coordinator")
                while not self._live_workers():
                    if self._stop.wait(0.2) or job.cancel_requested:
                        raise JobCancelled("cancelled before any worker connected")
                    trainer.check_group()  # e.g. rank 0 cancelled it meanwhile
                if job_group is not None:
                    job_group.set_note(None)
            trainer.prepare(len(self._live_workers()), self._hardware())
            if trainer.resumed_from is not None:
                job.checkpoint_step = trainer.checkpoint_step
                self.book.set_state(
                    job,
                    "running",
                    f"resumed from {trainer.resumed_from.path} (step {trainer.start_step})",
                    checkpoint_step=trainer.checkpoint_step,
                )
            elif job.message:
                self.book.set_state(job, "running", "")  # e.g. "resume requested": started
            self._broadcast(push, trainer.job_setup())
            trainer.run(_SocketPort(self, push))
            if job_group is None or job_group.leader:  # rank 0 alone writes the model
                trainer.export(Path(job.output_dir or "."))
            error = None
        except Exception as exc:
            error = exc
            if not isinstance(exc, (JobCancelled, JobPaused, JobFailed)):
                log.error("[coordinator] job %s failed:\n%s", job.job_id, traceback.format_exc())
            if isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES:
                error = JobPaused(_stopped_by(job, exc)[1])  # the coordinator's, not the job's
        finally:
            state, message = outcome(job, error, stopping=self._stop.is_set())
            if state == "succeeded" and job_group is not None and not job_group.leader:
                message = "trained its share; rank 0 wrote the model"
            if isinstance(error, (JobPaused, JobFailed)):
                log.error("[coordinator] job %s %s: %s", job.job_id, state, error)
            if job_group is not None:
                self._leave_job_group(job_group, state, message)
            self._broadcast(push, JobTeardown(job_id=job.job_id))
            trainer.close()
            if job_group is not None:
                job_group.close()
            # Release the job's memory (masters, AdamW moments, checkpoint staging, dataset,
            # model) before its end is announced: a client that sees the final state sees
            # the memory given back too. Only its step, loss and progress events stay.
            self.book.let_go(job)
            trainer = None
            release_freed_memory()
            self.book.finish(job, state, message)
            with self._lock:
                for key in [k for k in self._assigned if k[0] == job.job_id]:
                    del self._assigned[key]
            log.info("[coordinator] job %s %s: %s", job.job_id, job.state, job.message)
            logging.getLogger("roundpipe").removeHandler(handler)
            handler.close()

    def _leave_job_group(self, job_group: JobGroup, state: str, message: str) -> None:
        """The end of a job's run on this node, as the group must know it: a run that did
        not succeed leaves (the other nodes stop waiting for this one); rank 0 that lost
        a node runs later jobs alone until the coordinators are restarted."""
        if state != "succeeded":
            job_group.leave(f"{state}: {message}")
        if job_group.lost is not None and self.group is not None and self.group.leader:
            self.group.broken = (
                f"the data-parallel group lost a node ({job_group.lost}); restart "
                "the coordinators with the remaining nodes' --world-size to use them"
            )


class _SocketPort:
    """The trainer's WorkerPort (coordinator.job_events) over the coordinator's sockets:
    tasks go out through the job thread's PUSH socket to the I/O thread."""

    def __init__(self, coordinator: Coordinator, push: zmq.Socket) -> None:
        self.coordinator = coordinator
        self.push = push

    def send_task(self, task: StageTask, worker_id: int) -> None:
        c = self.coordinator
        identity = c._identity(worker_id)
        if identity is None:
            # The worker was declared lost between the trainer's look at the worker
            # list and now; its WorkerLost is queued for the trainer, which then
            # re-dispatches this task with the worker's others.
            log.info("[coordinator] task %d not sent: worker %d is gone", task.task_id, worker_id)
            return
        with c._lock:
            c._assigned[(task.job_id, task.task_id)] = worker_id
        self.push.send_multipart([identity, *encode(task)])

    def live_workers(self) -> list[int]:
        return self.coordinator._live_workers()

    def fence(self, worker_id: int, reason: str) -> None:
        self.coordinator.fence_worker(worker_id, reason)


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


def _provable_worker_process(hello: Hello, peer: Peer) -> psutil.Process | None:
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


def _process_gone(proc: psutil.Process | None) -> bool:
    if proc is None:
        return False  # not provably ours: heartbeats decide
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def _fence(entry: WorkerEntry) -> None:
    """SIGKILL a lost worker that still runs, if its process is provably the worker's
    (Note [no fencing by hearsay]); otherwise it is only dropped."""
    proc = entry.process
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


_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT}
"""I/O errors that say the coordinator's host ran out of something (descriptors, memory,
space): a job that meets one is paused, to be resumed, never failed."""


def _stopped_by(job: JobRecord, exc: Exception) -> tuple[JobState, str]:
    """The state and message of a job whose run raised ``exc`` outside the trainer's own
    handling: paused for an I/O error (descriptors, memory, space: the host's, not the
    job's), failed otherwise."""
    if not isinstance(exc, OSError):
        return "failed", f"{type(exc).__name__}: {exc}"
    where = (
        f"its checkpoint step {job.checkpoint_step}"
        if job.checkpoint_step
        else "the start (it has no checkpoint)"
    )
    why = {
        errno.EMFILE: "the coordinator had too many files open (a flood of connections? "
        "see its log)",
        errno.ENFILE: "the system had too many files open",
        errno.ENOMEM: "the coordinator ran out of memory",
        errno.ENOSPC: "a file system is full",
        errno.EDQUOT: "a disk quota is exceeded",
    }.get(exc.errno or 0, "an I/O error")
    return (
        "paused",
        f"{exc}. The job is paused ({why}) and continues from {where}: once that is "
        f"fixed, run `roundpipe resume {job.job_id}`",
    )


def _unknown(job_id: str) -> ErrorReply:
    return ErrorReply(
        code="unknown_job",
        message=f"no job {bounded_text(job_id, MAX_NAME_CHARS)!r} on this coordinator",
    )


def encode_reply(reply: Message) -> list[bytes]:
    """``encode(reply)``, with error texts bounded; a reply that cannot be encoded (a bug:
    every list reply is paged) becomes an ErrorReply that says what happened."""
    if isinstance(reply, ErrorReply) and len(reply.message) > MAX_TEXT_CHARS:
        reply = ErrorReply(code=reply.code, message=bounded_text(reply.message))
    try:
        return encode(reply)
    except ProtocolError as exc:
        log.error("[coordinator] cannot send a %s: %s", type(reply).__name__, exc)
        return encode(
            ErrorReply(
                code="internal_error",
                message=bounded_text(
                    f"the coordinator could not encode its {type(reply).__name__} reply: {exc}"
                ),
            )
        )


def _page(items) -> tuple[list, bool]:
    """The items that fit into one reply of MAX_REPLY_BYTES (at least one, so a page
    always advances), and whether any are left."""
    page: list = []
    used = 0
    for item in items:
        size = encoded_size(item)
        if page and used + size > MAX_REPLY_BYTES:
            return page, True
        page.append(item)
        used += size
    return page, False


def _namespace_for(address: str) -> str:
    import hashlib

    return "c" + hashlib.sha1(address.encode()).hexdigest()[:10]


def _someone_listens(address: str) -> bool:
    """Whether a process accepts connections on an ipc:// path (asked of the kernel, not
    with a request: a coordinator with keys would not answer an unauthenticated one)."""
    path = address[len("ipc://") :]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


# Note [connection budget]
# Every connection the ROUTER accepts holds a file descriptor from the moment it is
# accepted, long before its handshake says who is on the other end. 1,100 idle TCP
# connections against a coordinator limited to 1,024 open files left it unable to open
# anything: libzmq could no longer accept the admin's connection, and the running job's
# checkpoint could not open its files. So:
# - ``main`` raises the soft RLIMIT_NOFILE towards the hard one (WANTED_OPEN_FILES);
# - the ROUTER closes a connection whose handshake is not complete after
#   HANDSHAKE_TIMEOUT_S (ZMQ_HANDSHAKE_IVL);
# - the connections are bounded by a budget: the soft limit less the descriptors open at
#   start and FD_RESERVE (a job's files), at most MAX_CONNECTIONS. The ROUTER's monitor
#   reports each accepted connection with its descriptor and each closed one. Beyond the
#   budget the coordinator hangs up (shutdown(2): libzmq then closes the connection as it
#   would a peer's hang-up) connections that can still be in their handshake, i.e. that
#   were accepted less than HANDSHAKE_TIMEOUT_S ago (an older one has finished it, or
#   libzmq would have closed it): first those that have not sent a byte (TCP_INFO: an
#   idle flood), oldest first, then the others, oldest first. A legitimate peer sends
#   its greeting at once, so an idle flood never costs it its connection; an
#   authenticated connection older than the handshake limit is never hung up.
# - A descriptor is touched only after every event queued so far has been read, and only
#   if it still is a connection on the coordinator's own address (its local port or ipc
#   path; not a listener): a number libzmq has closed and reused for anything else is
#   left alone.
# ZMQ_MAX_SOCKETS bounds a context's ZeroMQ sockets, not the connections of one socket;
# ZMQ_BACKLOG only the kernel's queue of connections not yet accepted: neither helps.

_ROUTER_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_TCP_INFO_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (a u64) in Linux's ``struct tcp_info`` (4.1+)."""


class _ConnectionBudget:
    """The ROUTER's open connections by descriptor, and the hang-ups that keep them within
    ``budget`` (Note [connection budget]). Used on the I/O thread only."""

    def __init__(self, budget: int, local: str | bytes | int | None) -> None:
        self.budget = budget
        self.local = local  # the ROUTER's TCP port or ipc path; None: not checkable
        self._open: dict[int, float] = {}  # descriptor -> when accepted, oldest first
        self.hung_up = 0

    def __len__(self) -> int:
        return len(self._open)

    def accepted(self, fd: int) -> None:
        self._open.pop(fd, None)
        self._open[fd] = time.monotonic()

    def closed(self, fd: int) -> None:
        self._open.pop(fd, None)

    def enforce(self) -> tuple[int, int]:
        """Hang up connections beyond the budget; returns how many of them had sent
        nothing and how many had (but could still be in their handshake)."""
        excess = len(self._open) - self.budget
        if excess <= 0 or self.local is None:
            return 0, 0
        young_since = time.monotonic() - HANDSHAKE_TIMEOUT_S - 1.0
        silent: list[int] = []
        spoken: list[int] = []
        for fd, since in list(self._open.items()):  # oldest first
            if len(silent) >= excess:
                break
            if since < young_since:
                continue  # its handshake is over: authenticated
            received = _received_bytes(fd, self.local)
            if received is None:  # not our connection any more: a stale entry
                self._open.pop(fd, None)
                excess -= 1
                continue
            (silent if received == 0 else spoken).append(fd)
        victims = (silent + spoken)[: max(excess, 0)]
        hung = [fd for fd in victims if _hang_up(fd, self.local)]
        for fd in victims:
            self._open.pop(fd, None)  # its DISCONNECTED event, if any, finds nothing
        self.hung_up += len(hung)
        quiet = len(set(hung) & set(silent))
        return quiet, len(hung) - quiet


def _our_connection(fd: int, local: str | bytes | int) -> socket.socket | None:
    """A socket object over ``fd`` if it is a connection accepted on the ROUTER's address
    (else None); the caller must ``detach()`` it, never close it: libzmq owns ``fd``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError("a listener")
        name = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            ours = name == local
        elif sock.family in (socket.AF_INET, socket.AF_INET6):
            ours = name[1] == local
            sock.getpeername()  # connected
        else:
            ours = False
        if ours:
            return sock
    except OSError:
        pass
    sock.detach()
    return None


def _received_bytes(fd: int, local: str | bytes | int) -> int | None:
    """Bytes received so far on connection ``fd`` (-1: cannot tell, e.g. ipc://), or None
    if ``fd`` is not a connection on the ROUTER's address."""
    sock = _our_connection(fd, local)
    if sock is None:
        return None
    try:
        if sock.family == socket.AF_UNIX or not hasattr(socket, "TCP_INFO"):
            return -1
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
            return -1
        return struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)[0]
    except OSError:
        return -1
    finally:
        sock.detach()


def _hang_up(fd: int, local: str | bytes | int) -> bool:
    """shutdown(2) connection ``fd`` if it is one on the ROUTER's address: libzmq sees
    the hang-up and closes it (the descriptor stays libzmq's to close)."""
    sock = _our_connection(fd, local)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def _local_identity(endpoint: str) -> str | bytes | int | None:
    """What ``getsockname()`` says for a connection accepted on ``endpoint`` (the
    ROUTER's bound address): its TCP port, or its ipc path (bytes for an abstract one)."""
    if endpoint.startswith("tcp://"):
        try:
            return int(endpoint.rsplit(":", 1)[1])
        except ValueError:
            return None
    if endpoint.startswith("ipc://@"):
        return b"\0" + endpoint[len("ipc://@") :].encode()
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    return None


def _soft_open_files_limit() -> int | None:
    """The soft RLIMIT_NOFILE (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return psutil.Process().num_fds()


def raise_open_files_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one, at most WANTED_OPEN_FILES (systemd
    starts services at 1,024): more room for connections and job files alike."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("[coordinator] cannot raise RLIMIT_NOFILE from %d: %s", soft, exc)


def connection_budget() -> int:
    """How many connections the ROUTER may hold (Note [connection budget]): the soft
    RLIMIT_NOFILE less the descriptors open now and FD_RESERVE, within
    [MIN_CONNECTIONS, MAX_CONNECTIONS]."""
    soft = _soft_open_files_limit()
    if soft is None:
        return MAX_CONNECTIONS
    budget = soft - _open_files() - FD_RESERVE
    if budget < MIN_CONNECTIONS:
        log.warning(
            "[coordinator] RLIMIT_NOFILE is %d: with %d files open and %d kept for jobs, "
            "that leaves room for only %d connections; allowing %d. Raise the limit "
            "(LimitNOFILE= in the systemd unit, `ulimit -n`)",
            soft,
            _open_files(),
            FD_RESERVE,
            budget,
            MIN_CONNECTIONS,
        )
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, budget))


class _JobThreads(logging.Filter):
    def __init__(self, job_id: str):
        super().__init__()
        self.job_id = job_id

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName in (
            "rp-job",
            f"rp-optimizer-{self.job_id}",
            f"rp-checkpoints-{self.job_id}",  # background checkpoints (coordinator.snapshot)
        )


def _job_log_handler(job: JobRecord) -> logging.Handler:
    assert job.log_path is not None
    # Created with the private mode whatever the umask: a job log names the job's files.
    os.close(os.open(job.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, modes().file))
    handler = logging.FileHandler(job.log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(_JobThreads(job.job_id))
    logging.getLogger("roundpipe").addHandler(handler)
    return handler


def main(argv: list[str] | None = None) -> int:
    from roundpipe.shared.defaults import DEFAULT_ADDRESS, default_state_dir

    # SIGHUP: re-read the authorised keys (only counted here; the I/O loop's next key
    # check re-reads). Set first, so a SIGHUP while starting up does not end the process.
    signal.signal(signal.SIGHUP, request_reload)

    parser = argparse.ArgumentParser(
        prog="roundpipe-coordinator",
        description="RoundPipe coordinator: owns training state, schedules stage tasks.",
    )
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help="ZeroMQ address to bind (default %(default)s)"
    )
    parser.add_argument("--state-dir", default=None, help="jobs, logs, outputs")
    parser.add_argument(
        "--arena-dir",
        default=None,
        help="RAM-backed directory for shared-memory arenas (default /dev/shm)",
    )
    parser.add_argument(
        "--keys-dir",
        default=None,
        help="CurveZMQ keys: coordinator.key_secret and authorized/ (default "
        "$ROUNDPIPE_KEYS_DIR, else STATE_DIR/keys; create with `roundpipe keys init`); "
        "required for tcp://, optional for ipc:// (see docs/deploy.md)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=WORKER_LOST_AFTER_S,
        help="seconds without a worker heartbeat before the worker is declared lost and "
        "its tasks go to the others (default %(default)s)",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=600.0,
        help="seconds a task may wait for an input before failing",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the optimizer (default: half the cores, leaving the "
        "rest to the workers' host-side work); a job's optimizer.threads overrides it",
    )
    parser.add_argument(
        "--allow-read",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory below which job specs may name data, models, tokenizers and "
        "checkpoints (repeatable; also $ROUNDPIPE_ALLOW_READ, ':'-separated). Always "
        "allowed: write roots, STATE_DIR/jobs and the shipped demo data",
    )
    parser.add_argument(
        "--allow-write",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory below which job specs may name output directories (repeatable; "
        "also $ROUNDPIPE_ALLOW_WRITE). Always allowed: STATE_DIR/jobs",
    )
    parser.add_argument(
        "--group-access",
        action="store_true",
        default=os.environ.get("ROUNDPIPE_GROUP_ACCESS", "") not in ("", "0"),
        help="write files 0640 and directories 0750 (the coordinator's group may read "
        "results) instead of 0600/0700 (also $ROUNDPIPE_GROUP_ACCESS=1)",
    )
    parser.add_argument(
        "--metrics-address",
        default=os.environ.get("ROUNDPIPE_METRICS_ADDRESS") or None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics (default: "
        "$ROUNDPIPE_METRICS_ADDRESS, else off; see docs/observability.md)",
    )
    parser.add_argument(
        "--dist-init",
        default=None,
        metavar="tcp://HOST:PORT",
        help="join a data-parallel group of coordinators (one per server) whose rank 0 "
        "listens at HOST:PORT; with --rank and --world-size. Without it, torchrun's "
        "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are used when set (docs/multi-node.md). "
        "The group's traffic is not authenticated: a private network only",
    )
    parser.add_argument("--rank", type=int, default=None, help="this coordinator's rank")
    parser.add_argument(
        "--world-size", type=int, default=None, help="number of coordinators in the group"
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_DIST_TIMEOUT_S,
        help="seconds to wait for the other coordinators to join, and for a silent or "
        "stuck node before the job pauses (default %(default)s)",
    )
    parser.add_argument(
        "--max-jobs-per-owner",
        type=int,
        default=None,
        metavar="N",
        help="most jobs one identity may have queued or running at once; a submission or "
        "resume beyond it is refused, saying to wait or cancel one (default: no limit)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.max_jobs_per_owner is not None and args.max_jobs_per_owner < 1:
        parser.error(f"--max-jobs-per-owner must be at least 1, got {args.max_jobs_per_owner}")
    try:
        group_settings = settings_from_args(
            args.dist_init, args.rank, args.world_size, args.dist_timeout
        )
    except ValueError as exc:
        parser.error(str(exc))
    # Everything this process writes (state, checkpoints, exports, logs) is private by
    # default; spec paths were resolved when accepted, so reads follow no new links.
    set_modes(GROUP_MODES if args.group_access else PRIVATE_MODES)
    set_strict_reads(True)
    import torch

    from roundpipe.coordinator.training.optimizer import default_threads

    torch.set_num_threads(args.threads or default_threads())
    # Models, tokenizers and data are local by design: never wait on the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threading.current_thread().name = "rp-coordinator"
    raise_open_files_limit()  # Note [connection budget]
    # Job specs are validated on the I/O thread; import transformers (seconds) now, not
    # inside the first client request, which would then miss the client's timeout.
    import transformers  # noqa: F401

    state_dir = args.state_dir or default_state_dir()
    keys_dir = args.keys_dir or os.environ.get("ROUNDPIPE_KEYS_DIR") or Path(state_dir) / "keys"
    coordinator = Coordinator(
        args.address,
        state_dir,
        args.arena_dir,
        wait_timeout_s=args.wait_timeout,
        worker_timeout_s=args.worker_timeout,
        paths=PathPolicy.for_coordinator(state_dir, args.allow_read, args.allow_write),
        keys_dir=keys_dir,
        max_jobs_per_owner=args.max_jobs_per_owner,
    )
    try:
        coordinator.bind()
    except (
        AddressInUse,
        ArenaError,
        AuthSetupError,
        FileNotFoundError,
        JobStoreError,
        KeyFileError,
        zmq.ZMQError,
    ) as exc:
        print(f"roundpipe-coordinator: {exc}", file=sys.stderr)
        return 2
    group = None
    if group_settings is not None:
        try:
            group = NodeGroup.join(group_settings)
        except GroupError as exc:
            print(f"roundpipe-coordinator: {exc}", file=sys.stderr)
            return 2
        coordinator.group = group
    metrics = None
    if args.metrics_address:  # observability (coordinator.metrics)
        try:
            metrics = MetricsServer(coordinator, args.metrics_address)
        except (ValueError, OSError) as exc:
            print(f"roundpipe-coordinator: --metrics-address: {exc}", file=sys.stderr)
            return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: coordinator.stop())
    coordinator.serve()
    if metrics is not None:
        metrics.close()
    if group is not None:
        group.close()
    if coordinator.group_lost is not None:
        print(f"roundpipe-coordinator: {coordinator.group_lost}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
