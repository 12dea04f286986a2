"""The coordinator daemon's I/O loop: the one ROUTER socket every worker and client
talks to, and where each message goes. ``roundpipe-coordinator`` starts it
(roundpipe.coordinator.service.main).

Threads (only the I/O thread touches the ROUTER socket):

    rp-coordinator (I/O)   polls the ROUTER (workers and clients) and an inproc PULL
                           socket (outgoing messages from other threads); answers client
                           requests; tracks workers; forwards task results to the job.
                           Only cheap work runs here, so heartbeats are never starved
    rp-admission           answers SubmitJob / ResumeJob through its own inproc PUSH
                           (coordinator.requests); the validation itself (file checks,
                           reading the data) runs in a child process
                           (coordinator.admission), so not even the GIL ties it to the
                           I/O thread
    rp-job                 runs queued jobs one at a time through a Trainer
                           (coordinator.job_runner); sends JobSetup / StageTask /
                           JobTeardown through its own inproc PUSH
    rp-optimizer-<job>     the Trainer's layer-wise AdamW
    rp-checkpoints-<job>   the Trainer's background checkpoint writer (coordinator.snapshot)

One ROUTER socket at ``--address`` serves both workers and clients (both use DEALER
sockets): a worker introduces itself with ``Hello``; anything else is a client request
and gets exactly one reply. Signal handlers only set a flag.

Every connection is authenticated before its first message (roundpipe.coordinator.service.auth:
CurveZMQ keys, or ipc:// peer credentials; the ZAP handler runs on the I/O thread), and
the connections are kept within a budget (coordinator.connections). Each message is
handled as its sender's identity and role allow: jobs belong to their submitter (others,
unless admin, are told the job does not exist); ``Hello`` and heartbeats need a worker
role; ``TaskDone``/``TaskFailed`` count only from the registered worker they name, on its
connection, for a task dispatched to it; a lost worker is SIGKILLed only if its process
is provably the worker's (coordinator.workers, Note [no fencing by hearsay]).

Nothing a peer sends can end the I/O loop: the socket refuses frames over
``MAX_FRAME_BYTES`` before reading them (ZMQ_MAXMSGSIZE); a message is read a frame at
a time and a frame over its type's limit is answered unread (Note [inbound limits],
coordinator.inbound, which also makes the ROUTER's routing ids unpredictable); lists
are answered a page of at most ``MAX_REPLY_BYTES`` at a time and free texts are cut to
``MAX_TEXT_CHARS`` (with
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

import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import zmq

from roundpipe.coordinator.service.admission import SpecValidator
from roundpipe.coordinator.service.auth import (
    ZAP_ENDPOINT,
    Authenticator,
    Peer,
    RateLimitedLog,
)
from roundpipe.coordinator.service.connections import (
    HANDSHAKE_TIMEOUT_S,
    ROUTER_EVENTS,
    ConnectionBudget,
    handle_monitor_events,
)
from roundpipe.coordinator.service.figures import current_tasks, job_figures
from roundpipe.coordinator.service.inbound import (
    Received,
    frame_limit,
    receive,
    unpredictable_routing_ids,
)
from roundpipe.coordinator.service.job_runner import JobRunner
from roundpipe.coordinator.service.jobs import JobBook, bounded_text
from roundpipe.coordinator.service.jobstore import JobStore
from roundpipe.coordinator.service.metrics import MetricsSnapshot, WorkerFigures
from roundpipe.coordinator.service.requests import Admissions, ClientRequests, encode_reply
from roundpipe.coordinator.service.sdnotify import Notifier
from roundpipe.coordinator.service.workers import (
    MAX_NAME_CHARS,
    WorkerEntry,
    WorkerTable,
    fence_process,
    implausible_hardware,
    provable_worker_process,
)
from roundpipe.coordinator.spec.jobspec import MAX_SPEC_BYTES
from roundpipe.coordinator.spec.paths import PathPolicy, modes
from roundpipe.coordinator.training.job_events import WorkerJoined, WorkerLost
from roundpipe.coordinator.training.multinode import NodeGroup
from roundpipe.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    NUM_FRAMES,
    PROTOCOL_VERSION,
    ErrorReply,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    ProtocolVersionError,
    Reject,
    ResumeJob,
    SubmitJob,
    TaskDone,
    TaskFailed,
    Welcome,
    decode,
    encode,
    message_type,
)
from roundpipe.shared.arena import check_arena_root, default_arena_dir, remove_stale_arenas
from roundpipe.shared.polling import poll_spinning

__all__ = ["AddressInUse", "Coordinator"]

log = logging.getLogger("roundpipe.coordinator")

HEARTBEAT_INTERVAL_S = 1.0

LOOP_STALL_S = 0.5
"""A turn of the coordinator's loop longer than this (it normally turns at least every
0.1 s) is a stall of the loop itself; see Note [a stalled loop hears no heartbeat]."""

# Note [a stalled loop hears no heartbeat]
# Workers are declared lost after --worker-timeout seconds without a heartbeat, counted
# from the moment this loop last read one. If the loop itself does not run (the machine
# is overloaded, or another thread of the coordinator holds the interpreter lock while a
# job is prepared: building the model, compiling the optimizer's kernel), the workers'
# heartbeats wait unread in the socket, and the first check after the stall found every
# healthy worker silent: all of them were declared lost and killed at once (seen on a
# loaded 2-core machine, a job's preparation stalling the loop for 2.3 s with a 2 s
# timeout). So silence is counted only while the loop runs: a turn that took longer
# than LOOP_STALL_S credits every worker with its excess over LOOP_STALL_S (not its
# whole length: were every turn slow, a whole credit would keep a frozen worker alive).
# A worker that really died meanwhile is found one stall later by its heartbeats, or at
# once by its process (on this host). The stall is measured again right before the
# workers are judged (the once-a-second checks wait for the shared lock and read the
# keys from disk: a stall there declared a healthy worker lost in the same turn), and the
# jobs' progress deadline gets the same credit (WorkerTable.stalled_s): a coordinator
# paused past --task-deadline SIGKILLed every busy worker, its completions unread.
WORKER_LOST_AFTER_S = 5.0  # default --worker-timeout: heartbeats missed before "lost"
_OUTBOX = "inproc://rp-coordinator-outbox"

MAX_FRAME_BYTES = DEFAULT_MAX_BODY_BYTES + 256
"""ZMQ_MAXMSGSIZE of the ROUTER: libzmq drops the connection of a peer sending a larger
frame instead of reading it into memory first. Smaller frames are read, and one over its
type's limit is answered unread (Note [inbound limits]): a spec of a few MiB then gets
a reply saying why, not silence."""


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
        task_deadline_s: float = 60.0,
        worker_timeout_s: float = WORKER_LOST_AFTER_S,
        paths: PathPolicy | None = None,
        keys_dir: str | Path | None = None,
        group: NodeGroup | None = None,
        max_jobs_per_owner: int | None = None,
        spec_validator: SpecValidator | None = None,
    ):
        self.address = address
        self._spec_validator = spec_validator
        """The spec checker ``main`` started before this object existed, while the process
        was single-threaded and could fork it (Note [forked spec checker] in
        coordinator.service.admission); None: serve() spawns one. Owned from now on."""
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
        self.task_deadline_s = task_deadline_s
        """The floor of the progress deadline (RecoveryPolicy.deadline_floor_s)."""
        self.coordinator_id = secrets.token_hex(4)
        # The I/O thread's inproc PULL: the other threads' messages to peers come in here.
        self._outbox_address = _OUTBOX + self.coordinator_id
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        # Re-entrant: status/progress code called under it may ask the trainer, whose
        # callbacks (e.g. the live-worker list) take it again.
        self._lock = threading.RLock()  # guards workers and jobs
        # The connected workers, their tasks, liveness and fencing (coordinator.workers).
        self.workers = WorkerTable(self._lock)
        # Every job and the state machine they follow (socket-free: coordinator.jobs);
        # its store is opened by bind().
        self.book = JobBook(self.state_dir, self.paths, self._lock)
        # What each client request does to the book (coordinator.requests).
        self.requests = ClientRequests(
            self.book,
            self.workers,
            self._lock,
            paths=self.paths,
            arena_dir=self.arena_dir,
            group=group,
            max_jobs_per_owner=max_jobs_per_owner,
        )
        # SubmitJob / ResumeJob wait here for the admission thread (coordinator.requests).
        self.admissions = Admissions(self.requests)

    def join_group(self, group: NodeGroup) -> None:
        """Become a node of data-parallel ``group`` (``main`` joins it after bind())."""
        self.group = group
        self.requests.group = group

    def _lose_group(self, reason: str) -> None:
        """A follower lost rank 0 (the job thread's call): stop, to be restarted."""
        self.group_lost = reason
        self.stop()

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
        unpredictable_routing_ids()  # Note [inbound limits]
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
        self.router.monitor(monitor_address, ROUTER_EVENTS)
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
        self.outbox.bind(self._outbox_address)
        removed = remove_stale_arenas(self.arena_dir, self.namespace)
        if removed:
            log.info("[coordinator] removed %d arena(s) left by a dead coordinator", len(removed))
        self.book.load()
        self.connections = ConnectionBudget.for_router(self.router)

    def stop(self) -> None:
        self._stop.set()
        self.book.wake()

    def serve(self) -> None:
        runner = JobRunner(
            self.book,
            self.workers,
            self._lock,
            ctx=self.ctx,
            outbox=self._outbox_address,
            stopping=self._stop,
            on_group_lost=self._lose_group,
            group=self.group,
            paths=self.paths,
            arena_dir=self.arena_dir,
            namespace=self.namespace,
            wait_timeout_s=self.wait_timeout_s,
            task_deadline_s=self.task_deadline_s,
        )
        job_thread = threading.Thread(target=runner.run, name="rp-job", daemon=True)
        job_thread.start()
        # A follower of a data-parallel group takes no submissions (rank 0 checks every
        # spec and announces the job to the others): it starts no checking process, so
        # pays neither its imports (seconds of CPU) nor its memory.
        validator, self._spec_validator = self._spec_validator, None
        if self.group is None or self.group.leader:
            if validator is None:
                validator = SpecValidator(strict_reads=True)
            validator.arena_dir = os.fspath(self.arena_dir)
            self.requests.validator = validator
            validator.start()  # nothing to do if main forked it already
        elif validator is not None:
            validator.close()
            validator = None
        admission_thread = threading.Thread(
            target=self.admissions.run,
            args=(self.ctx, self._outbox_address, self._stop),
            name="rp-admission",
            daemon=True,
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
        turn_at = time.monotonic()
        last_status = ""
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
                            assert self.auth is not None
                            handle_monitor_events(
                                self.handshake_events,
                                self.connections,
                                self.auth.refusals,
                                self._noisy,
                            )
                        else:
                            frames = self.outbox.recv_multipart()
                            self._send(frames[0], frames[1:])
                    except Exception:
                        # Whatever one message did, the loop must go on: it alone
                        # answers every client and keeps every worker alive.
                        log.exception("[coordinator] handling a message failed; it is dropped")
                # Before any check: a turn this long was a stall of the loop, heard
                # nothing, and is not the workers' silence (Note [a stalled loop hears
                # no heartbeat]).
                turn_at = self._excuse_stall(turn_at)
                now = turn_at
                if now >= next_check:
                    next_check = time.monotonic() + HEARTBEAT_INTERVAL_S
                    status = self.status_line()
                    if status != last_status:  # systemctl status shows it
                        notifier.status(status)
                        last_status = status
                    try:
                        assert self.auth is not None
                        self.auth.reload()  # a removed key is refused from now on
                    except Exception:  # e.g. out of descriptors: the workers still count
                        log.exception("[coordinator] re-reading the authorised keys failed")
                    # The status line waits for the shared lock and the keys are read
                    # from disk: a stall there is excused too, before anyone is judged.
                    turn_at = self._excuse_stall(turn_at)
                    try:
                        self._check_workers()
                    except Exception:
                        log.exception("[coordinator] checking the workers failed")
        finally:
            notifier.stopping()
            with self._lock:  # against the job thread's start (job_runner, _run_job)
                self._stop.set()
                active = self.book.active
                if active is not None and active.trainer is not None:
                    active.trainer.cancel()
            self.admissions.wake()  # the admission thread exits
            admission_thread.join(timeout=60)
            if validator is not None:
                validator.close()
            job_thread.join(timeout=60)
            self.router.disable_monitor()
            self.handshake_events.close()
            self.router.close()
            if self.address.startswith("ipc://"):
                # libzmq leaves the socket file; a stopped coordinator leaves nothing (the
                # bind refused to take over a live one, so the file is this daemon's).
                Path(self.address[len("ipc://") :]).unlink(missing_ok=True)
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

    def _reply(self, identity: bytes, reply: Message) -> None:
        """Send a reply; one that cannot be encoded becomes an ErrorReply saying so."""
        self._send(identity, encode_reply(reply))

    def _on_router(self) -> None:
        got = receive(self.router)  # Note [inbound limits]
        identity = got.identity
        assert self.auth is not None
        peer = self.auth.peer(got.last)
        if peer is None:
            # Authenticated at connect time, but its key has since been removed.
            self.auth.refusals.warning(
                "revoked", "dropped a message from an identity no longer authorised"
            )
            return
        refusal = self._oversized(got, peer)
        if refusal is not None:
            self._reply(identity, refusal)
            return
        frames = [f.bytes for f in got.frames]  # within their type's limit (_oversized)
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
            # Answered on the admission thread: validating a spec reads files (the data,
            # the model's config) and must not hold up this loop.
            refusal = self.admissions.offer(identity, msg, peer)
            if refusal is not None:
                self._reply(identity, refusal)
        else:
            self._reply(identity, self.requests.answer(msg, peer))

    def _oversized(self, got: Received, peer: Peer) -> ErrorReply | None:
        """The refusal of a message with frames beyond its one, or a frame over its
        type's limit, before any of it is decoded (Note [inbound limits])."""
        if got.dropped or len(got.frames) != NUM_FRAMES:
            problem = f"a message has {NUM_FRAMES} frame, this one {len(got.frames) + got.dropped}"
        else:
            size = len(got.frames[0].buffer)
            cls = message_type(got.frames[0].buffer)
            if size <= frame_limit(cls):
                return None
            if cls is SubmitJob:
                return ErrorReply(
                    code="bad_spec",
                    message=f"the job spec is {size} bytes, more than the limit of "
                    f"{MAX_SPEC_BYTES}; a spec names files, it does not hold data",
                )
            what = cls.__name__ if cls is not None else "a message of no known type"
            problem = f"{what} of {size} bytes is over the limit of {frame_limit(cls)}"
        assert self.auth is not None
        self.auth.refusals.warning("malformed", "refused from %s unread: %s", peer.name, problem)
        return ErrorReply(code="protocol_error", message=f"refused unread: {problem}")

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
        entry = self.workers.heard_from(identity, peer.name)
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
        process = provable_worker_process(hello, peer)
        with self._lock:
            wid = self.workers.register(identity, hello, peer.name, process)
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
            accepted = self.workers.accept_result(entry, msg)
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

    def _excuse_stall(self, since: float) -> float:
        """Excuse the workers' silence for what of the time since ``since`` (the last
        time the loop read its socket, or was last excused) was a stall of this loop
        (Note [a stalled loop hears no heartbeat]); return now."""
        now = time.monotonic()
        if now - since > LOOP_STALL_S:
            # Only the excess: under a sustained load where every turn is a little slow,
            # heartbeats are still heard each turn, and a frozen worker must still be
            # found (a little later).
            self.workers.excuse_silence(now - since - LOOP_STALL_S)
            if now - since > 1.0:
                log.info(
                    "[coordinator] this loop stalled for %.1fs: the workers' silence "
                    "during it is not counted against them",
                    now - since,
                )
        return now

    def _check_workers(self) -> None:
        """Declare workers lost (coordinator.workers: process gone, or no heartbeat for
        ``worker_timeout_s``), fence them and tell the job. See docs/fault-tolerance.md."""
        with self._lock:
            lost = self.workers.take_lost(self.worker_timeout_s)
            active = self.book.active
        for entry, reason, fence in lost:
            log.warning(
                "[coordinator] worker %d (%s) lost: %s",
                entry.worker_id,
                bounded_text(entry.hello.worker_name, MAX_NAME_CHARS),
                reason,
            )
            if fence:
                fence_process(entry)  # a frozen process must never wake up and write
            if active is not None and active.trainer is not None:
                active.trainer.inbox.put(WorkerLost(entry.worker_id, reason))

    # -- metrics ----------------------------------------------------------------------

    def status_line(self) -> str:
        """One line on the workers and jobs, for systemd's STATUS= (``systemctl status``),
        e.g. ``2 workers; running job-... step 14/100; 1 queued``."""
        with self._lock:
            workers = len(self.workers.live())
            active = self.book.active
            queued = len(self.book.queue)
        parts = [f"{workers} worker{'s' if workers != 1 else ''}"]
        if active is not None:
            t = active.trainer
            step = t.step if t is not None and t.prepared else active.step
            parts.append(f"running {active.job_id} step {step}/{active.total_steps}")
        else:
            parts.append("no job running")
        if queued:
            parts.append(f"{queued} queued")
        return f"listening on {self.address}; " + "; ".join(parts)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """What the Prometheus metrics show (coordinator.metrics), read now: the book and
        the workers under the lock, the running job's figures from its trainer."""
        with self._lock:
            states = [j.state for j in self.book.jobs.values()]
            active = self.book.active
            trainer = active.trainer if active is not None else None
            workers = [
                (w.worker_id, w.hello.worker_name, w.last_seen, w.tasks_done)
                for w in self.workers.entries()
            ]
        now = time.monotonic()
        layout = trainer.layout if trainer is not None else None
        figures = job_figures(trainer) if trainer is not None and trainer.prepared else None
        busy = figures.busy if figures is not None else {}
        running = current_tasks(trainer)
        return MetricsSnapshot(
            jobs_by_state={state: states.count(state) for state in set(states)},
            arena_bytes=layout.total_bytes if layout is not None else 0,
            job_id=active.job_id if figures is not None and active is not None else None,
            job=figures,
            workers=tuple(
                WorkerFigures(
                    worker_id=worker_id,
                    name=name,
                    heartbeat_age_s=max(0.0, now - last_seen),
                    tasks_done=tasks_done,
                    busy_fraction=busy.get(worker_id, 0.0),
                    state="busy" if worker_id in running else "idle",
                )
                for worker_id, name, last_seen, tasks_done in sorted(workers)
            ),
        )


def _namespace_for(address: str) -> str:
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
