"""``roundpipe-worker``: a stateless worker process around ``WorkerCore``.

Threads (only the I/O thread touches the DEALER socket):

    rp-worker-<name> (I/O)   handshake, heartbeats, receives JobSetup / StageTask /
                             JobTeardown / Shutdown, sends results queued by compute
    rp-compute               runs tasks one at a time (WorkerCore); results go back
                             through an inproc PUSH socket
    rp-h2d / rp-d2h          the transfer engine's links (roundpipe.worker.transfer):
                             copies, and the TaskDone of a task whose last copy landed
                             (through the same PUSH socket, under a lock)
    rp-prefetch-<task>       uploads the next queued task's weights

Heartbeats come from the I/O thread, so a long task never makes the worker look dead.
Exit codes: 0 after SIGTERM/SIGINT or a Shutdown message, 2 when the coordinator rejects
the worker (e.g. protocol version mismatch) or does not answer the handshake in time.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

import psutil
import torch
import zmq

from roundpipe.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Heartbeat,
    Hello,
    JobSetup,
    JobTeardown,
    Message,
    ProtocolError,
    ProtocolVersionError,
    Reject,
    Shutdown,
    StageTask,
    TaskFailed,
    Welcome,
    decode,
    encode,
)
from roundpipe.protocol.worker_messages import MAX_FAILURE_TEXT_CHARS
from roundpipe.shared.handoff import HandoffLost
from roundpipe.shared.keys import ConnectKeys, KeyFileError, apply_connect_keys, connect_keys
from roundpipe.shared.polling import poll_spinning
from roundpipe.worker.faults import FAULT_ENV, Fault, parse_fault
from roundpipe.worker.memory_cap import apply_cpu_memory_cap, describe_failure
from roundpipe.worker.runtime import TaskAborted, TaskInterrupted, WorkerCore
from roundpipe.worker.transfer import TransferEngine, make_engine, parse_duration

__all__ = ["WorkerDaemon", "main", "run"]

log = logging.getLogger("roundpipe.worker")


class HandshakeError(RuntimeError):
    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered
        """False when no coordinator answered at all (silence, not a refusal)."""


def apply_memory_limit(device: torch.device, limit_bytes: int) -> int:
    """Cap this process's CUDA allocations on ``device`` at ``limit_bytes`` (the caching
    allocator raises OutOfMemoryError beyond it), so one large GPU can stand in for a
    24 GB card, or several workers can share one GPU. Returns the cap.

    Raises ValueError if the cap is not positive or exceeds the device's memory.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < limit_bytes <= total:
        raise ValueError(
            f"--memory-limit {limit_bytes / 2**30:.2f} GiB: {device} has "
            f"{total / 2**30:.2f} GiB; give a positive size no larger than that"
        )
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, device)
    return limit_bytes


class CoordinatorLost(RuntimeError):
    """No message from the coordinator within the liveness deadline."""


class WorkerDaemon:
    """Connects, serves tasks, and reconnects with back-off when the coordinator is lost."""

    def __init__(
        self,
        coordinator: str,
        *,
        device: str = "cpu",
        name: str | None = None,
        handshake_timeout_s: float = 30.0,
        coordinator_timeout_s: float = 10.0,
        fault: Fault | None = None,
        memory_limit_bytes: int | None = None,
        engine: TransferEngine | None = None,
        keys: ConnectKeys | None = None,
    ):
        self.coordinator = coordinator
        self.keys = keys
        """CurveZMQ keys (a worker-role key and the coordinator's public key); None for
        an ipc:// coordinator without keys."""
        self.device = torch.device(device)
        self.memory_limit_bytes = memory_limit_bytes
        """GPU memory cap (``--memory-limit``) already applied; reported in Hello so the
        coordinator plans for it."""
        self.engine = engine if engine is not None else make_engine(self.device)
        """One transfer engine for the worker's life (streams, links, pinned arenas)."""
        self.bandwidth = self.engine.measure_bandwidth()
        """(host-to-device, device-to-host) bytes/s, measured once at start-up."""
        self.name = name or f"{socket.gethostname()}-{self.device}".replace(":", "")
        self.handshake_timeout_s = handshake_timeout_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.fault = fault
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self.core: WorkerCore | None = None
        self.exit_code = 0
        """3 when the transfer engine broke (Note [dead producers and imported events] in
        roundpipe.shared.handoff): the supervisor restarts the worker."""

    def stop(self) -> None:
        self._stop.set()

    def _exit_if_broken(self, core: WorkerCore) -> None:
        """A CUDA stream that waited on a dead producer's event cannot be trusted: stop,
        so the process (and its CUDA context) goes away; its failure is reported first."""
        broken = core.engine.broken
        if broken is not None and not self._stop.is_set():
            log.error("[worker] stopping: %s", broken)
            self.exit_code = 3
            self.stop()

    # -- handshake --------------------------------------------------------------------

    def _hello(self) -> Hello:
        identity = dict(
            worker_name=self.name,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            process_create_time=psutil.Process().create_time(),
            h2d_bytes_per_s=self.bandwidth[0],
            d2h_bytes_per_s=self.bandwidth[1],
        )
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return Hello(
                **identity,
                device="cuda",
                device_index=self.device.index or 0,
                device_name=props.name,
                memory_bytes=self.memory_limit_bytes or props.total_memory,
                compute_capability=f"{props.major}.{props.minor}",
            )
        return Hello(
            **identity,
            device="cpu",
            device_index=None,
            device_name=f"cpu ({psutil.cpu_count()} cores)",
            memory_bytes=psutil.virtual_memory().total,
            compute_capability=None,
        )

    def connect(self, timeout_s: float) -> Welcome:
        """Open a fresh DEALER socket and shake hands; raise HandshakeError on failure."""
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        apply_connect_keys(self.sock, self.keys)
        self.sock.connect(self.coordinator)
        self.sock.send_multipart(encode(self._hello()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            try:
                msg = decode(self.sock.recv_multipart())
            except ProtocolVersionError as exc:
                raise HandshakeError(
                    f"the coordinator at {self.coordinator} speaks protocol version "
                    f"{exc.seen_version}, this worker {PROTOCOL_VERSION}: install the same "
                    "roundpipe version on both"
                ) from None
            except ProtocolError as exc:
                raise HandshakeError(f"malformed handshake reply: {exc}") from None
            if isinstance(msg, Welcome):
                return msg
            if isinstance(msg, Reject):
                self.sock.close()
                raise HandshakeError(f"the coordinator rejected this worker: {msg.reason}")
            if isinstance(msg, ErrorReply):
                self.sock.close()
                raise HandshakeError(f"the coordinator refused the handshake: {msg.message}")
        self.sock.close()
        raise HandshakeError(
            answered=False,
            message=f"no answer from a coordinator at {self.coordinator} within {timeout_s:.0f}s; "
            "is roundpipe-coordinator running there? (--coordinator / ROUNDPIPE_ADDRESS; "
            "--handshake-timeout) Does it know this worker's key? "
            + (
                f"(using {self.keys.key_path}; it must be authorised with role worker)"
                if self.keys is not None
                else "(none configured: --key / ROUNDPIPE_KEY)"
            ),
        )

    # -- sessions ---------------------------------------------------------------------

    def serve(self) -> None:
        """First connection must succeed within the handshake timeout; after that a lost
        coordinator means: drop all state, reconnect with back-off, forever."""
        welcome = self.connect(self.handshake_timeout_s)
        backoff_s = 0.5
        try:
            while not self._stop.is_set():
                try:
                    self._session(welcome)
                    return  # stopped
                except CoordinatorLost as exc:
                    log.warning("[worker] %s; dropping all job state and reconnecting", exc)
                silent_tries = 0
                while not self._stop.is_set():
                    try:
                        welcome = self.connect(min(5.0, self.handshake_timeout_s))
                        backoff_s = 0.5
                        break
                    except HandshakeError as exc:
                        if not exc.answered:
                            silent_tries += 1
                            if silent_tries & (silent_tries - 1) == 0:  # 1, 2, 4, ...: a
                                # coordinator down for days does not fill the journal
                                log.info(
                                    "[worker] reconnect failed %d time(s) (%s); trying again",
                                    silent_tries,
                                    exc,
                                )
                            # Silence: ask again at once, so that a Hello is always
                            # waiting. A coordinator whose loop only stalled then hears
                            # this process again as soon as it runs, before its old
                            # registration times out (a Hello arriving after that found
                            # the process fenced as a lost worker). The wait for an
                            # answer paces the tries; libzmq redials underneath.
                            continue
                        log.info(
                            "[worker] reconnect failed (%s); retrying in %.1fs", exc, backoff_s
                        )
                        self._stop.wait(backoff_s)
                        backoff_s = min(backoff_s * 2, 8.0)
        finally:
            self.engine.close()
            self.ctx.term()
            log.info("[worker] %s stopped", self.name)

    def _session(self, welcome: Welcome) -> None:
        core = WorkerCore(welcome.worker_id, self.device, self.engine)
        core.fault = self.fault
        self.core = core
        threading.current_thread().name = f"rp-worker-{welcome.worker_id}"
        log.info(
            "[worker] %s joined coordinator %s as worker %d",
            self.name,
            welcome.coordinator_id,
            welcome.worker_id,
        )
        session_over = threading.Event()
        queue_ = _TaskQueue()
        core.should_abort = lambda: (
            self._stop.is_set() or session_over.is_set() or queue_.has_lower_than_running()
        )
        core.session_ended = lambda: self._stop.is_set() or session_over.is_set()
        core.peek_next = queue_.peek_task
        outbox_address = f"inproc://rp-worker-outbox-{id(self)}-{welcome.worker_id}"
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(outbox_address)
        compute = threading.Thread(
            target=self._compute_loop,
            args=(core, queue_, outbox_address, session_over),
            name="rp-compute",
            daemon=True,
        )
        compute.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        interval = welcome.heartbeat_interval_s
        next_beat = 0.0
        seq = 0
        heard_beat = False  # liveness checking starts once the coordinator sends beats
        last_heard = time.monotonic()
        try:
            while not self._stop.is_set():
                for sock, _ in poll_spinning(poller, 100):
                    if sock is outbox:
                        self.sock.send_multipart(outbox.recv_multipart())
                    else:
                        last_heard = time.monotonic()
                        if self._on_message(self.sock.recv_multipart(), queue_):
                            if not heard_beat:
                                log.info(
                                    "[worker] heard the coordinator's heartbeat: it counts as "
                                    "lost after %.0fs of silence from now on",
                                    self.coordinator_timeout_s,
                                )
                            heard_beat = True
                now = time.monotonic()
                if now >= next_beat:
                    seq += 1
                    self.sock.send_multipart(
                        encode(Heartbeat(sender=self.name, seq=seq, sent_at=time.time()))
                    )
                    next_beat = now + interval
                if heard_beat and now - last_heard > self.coordinator_timeout_s:
                    raise CoordinatorLost(
                        f"no message from the coordinator for {now - last_heard:.1f}s"
                    )
        finally:
            session_over.set()
            queue_.close()
            # The running task stops at its next layer (core.session_ended).
            compute.join(timeout=COMPUTE_STOP_TIMEOUT_S)
            outbox.close()
            self.sock.close()
            if compute.is_alive():
                # Stuck inside one layer: unmapping its job, or a new session's compute
                # thread beside it, would corrupt both. Only the process's end frees it;
                # the coordinator re-runs its tasks as for any lost worker. A stop that
                # was asked for still exits 0 (a supervisor restarts a failure).
                if not self._stop.is_set():
                    self.exit_code = 3
                self.stop()
                _exit_when_broken(
                    f"the compute thread did not stop within {COMPUTE_STOP_TIMEOUT_S:.0f}s "
                    "of the session's end",
                    self.exit_code,
                )
            else:
                core.close()
            self.core = None

    def _on_message(self, frames: list[bytes], queue_: _TaskQueue) -> bool:
        """Handle one message; return True if it was a coordinator heartbeat."""
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            log.warning("[worker] malformed message dropped: %s", exc)
            return False
        if isinstance(msg, Shutdown):
            log.info("[worker] shutdown requested: %s", msg.reason)
            self._stop.set()
        elif isinstance(msg, StageTask):
            queue_.put_task(msg)
        elif isinstance(msg, JobTeardown):
            # Stop the job now, not after its running task: drop its queued tasks and
            # interrupt the running one (cancel frees workers within a layer's compute).
            # Tasks arriving after this belong to a later setup of the job (a resume).
            queue_.drop_job(msg.job_id)
            if self.core is not None:
                self.core.interrupt_job(msg.job_id)
            queue_.put_control(msg)
        elif isinstance(msg, JobSetup):
            queue_.put_control(msg)
        elif isinstance(msg, Heartbeat):
            return True
        elif isinstance(msg, ErrorReply) and msg.code == "unknown_worker":
            raise CoordinatorLost("the coordinator restarted and no longer knows this worker")
        else:
            log.warning("[worker] unexpected %s ignored", type(msg).__name__)
        return False

    def _compute_loop(
        self,
        core: WorkerCore,
        queue_: _TaskQueue,
        outbox_address: str,
        session_over: threading.Event,
    ) -> None:
        outbox = _Outbox(self.ctx, outbox_address)
        try:
            while (item := queue_.next()) is not None:
                if isinstance(item, JobSetup):
                    try:
                        core.setup_job(item)
                    except Exception:
                        log.error(
                            "[worker] setup of job %s failed:\n%s",
                            item.job_id,
                            traceback.format_exc(),
                        )
                    continue
                if isinstance(item, JobTeardown):
                    core.teardown_job(item.job_id)
                    continue
                task = item
                try:
                    # TaskDone goes out when the task's last copy has landed, perhaps from
                    # a transfer thread after this returns; compute moves on meanwhile.
                    core.start_task(
                        task, lambda r, task=task: outbox.send(self._result(core, task, r))
                    )
                except TaskInterrupted as exc:
                    log.info("[worker] %s", exc)  # nobody waits for its result
                    continue
                except TaskAborted as exc:
                    if self._stop.is_set() or session_over.is_set():
                        outbox.send(self._failed(core, task, exc, retryable=True))
                        continue
                    # A lower-numbered task arrived while this one waited for inputs (a
                    # re-dispatched task of a dead worker, most likely). Run it first; this
                    # task is idempotent and simply runs again afterwards.
                    log.info("[worker] task %d yields to an earlier task", task.task_id)
                    queue_.put_task(task)
                    continue
                except Exception as exc:
                    log.error(
                        "[worker] task %d (%s %d:%d, iteration %d) failed:\n%s",
                        task.task_id,
                        task.kind,
                        task.layer_start,
                        task.layer_stop,
                        task.iteration,
                        traceback.format_exc(),
                    )
                    retry = isinstance(exc, HandoffLost)  # its producer died: not this task's fault
                    outbox.send(self._failed(core, task, exc, retryable=retry))
                    self._exit_if_broken(core)
                finally:
                    queue_.done_running()
        finally:
            outbox.close()

    def _result(self, core: WorkerCore, task: StageTask, result) -> Message:
        if isinstance(result, BaseException):
            log.error("[worker] a copy of task %d failed: %r", task.task_id, result)
            self._exit_if_broken(core)
            return self._failed(core, task, result, retryable=True)
        return result

    @staticmethod
    def _failed(core: WorkerCore, task: StageTask, exc: BaseException, *, retryable: bool):
        return TaskFailed(
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=task.attempt,
            worker_id=core.worker_id,
            error_type=type(exc).__name__,
            message=_cut(describe_failure(exc), keep="start"),
            traceback=_cut(traceback.format_exc(), keep="end"),
            retryable=retryable,
        )


def _cut(text: str, keep: str) -> str:
    """``text`` within MAX_FAILURE_TEXT_CHARS (the coordinator refuses a larger
    TaskFailed): its start or its end, and how much was left out."""
    if len(text) <= MAX_FAILURE_TEXT_CHARS:
        return text
    note = f"[... {len(text) - MAX_FAILURE_TEXT_CHARS + 64:,} characters left out ...]"
    room = MAX_FAILURE_TEXT_CHARS - 64
    return f"{text[:room]}\n{note}" if keep == "start" else f"{note}\n{text[-room:]}"


class _Outbox:
    """The compute side's PUSH socket to the I/O thread, shared by the compute thread and
    the transfer threads that deliver TaskDone. A ZeroMQ socket is not thread-safe; a
    lock serialises its use (and is the full memory barrier ZeroMQ asks for when a socket
    changes threads)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._lock = threading.Lock()
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(address)
        self._closed = False

    def send(self, msg: Message) -> None:
        frames = encode(msg)
        with self._lock:
            if self._closed:
                log.info("[worker] %s dropped: the session is over", type(msg).__name__)
                return
            self._push.send_multipart(frames)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=1000)


class _TaskQueue:
    """Tasks ordered by task id (the global schedule order), control messages first.

    Running the lowest task id first keeps any assignment of tasks to workers deadlock
    free, including re-dispatched tasks of a dead worker that arrive after later ones
    (see docs/fault-tolerance.md).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._control: list[Message] = []
        self._heap: list[tuple[int, int, StageTask]] = []
        self._seq = 0
        self._running: int | None = None
        self._closed = False

    def put_task(self, task: StageTask) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (task.task_id, self._seq, task))
            self._cv.notify()

    def put_control(self, msg: Message) -> None:
        with self._cv:
            self._control.append(msg)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def next(self) -> Message | None:
        with self._cv:
            while not self._closed and not self._control and not self._heap:
                self._cv.wait()
            if self._closed:
                return None
            if self._control:
                return self._control.pop(0)
            task = heapq.heappop(self._heap)[2]
            self._running = task.task_id
            return task

    def peek_task(self) -> StageTask | None:
        """The task that would run next, without taking it (for the weight prefetch)."""
        with self._cv:
            return self._heap[0][2] if self._heap and not self._control else None

    def done_running(self) -> None:
        with self._cv:
            self._running = None

    def has_lower_than_running(self) -> bool:
        with self._cv:
            return (
                self._running is not None and bool(self._heap) and self._heap[0][0] < self._running
            )

    def drop_job(self, job_id: str) -> None:
        with self._cv:
            self._heap = [e for e in self._heap if e[2].job_id != job_id]
            heapq.heapify(self._heap)


def main(argv: list[str] | None = None) -> int:
    from roundpipe.shared.defaults import DEFAULT_ADDRESS, endpoint_arg

    parser = argparse.ArgumentParser(
        prog="roundpipe-worker", description="RoundPipe stateless worker (one per GPU)."
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", type=int, metavar="N", help="run on CUDA device N")
    where.add_argument("--cpu", action="store_true", help="run on the CPU")
    parser.add_argument(
        "--coordinator",
        default=DEFAULT_ADDRESS,
        type=endpoint_arg,
        help="coordinator address (default %(default)s)",
    )
    parser.add_argument("--name", default=None, help="worker name shown in `roundpipe workers`")
    parser.add_argument(
        "--key",
        default=None,
        help="this worker's key pair (a *.key_secret authorised with role worker; default "
        "$ROUNDPIPE_KEY, else ~/.config/roundpipe/client.key_secret)",
    )
    parser.add_argument(
        "--coordinator-key",
        default=None,
        help="the coordinator's public key (default $ROUNDPIPE_COORDINATOR_KEY, else "
        "~/.config/roundpipe/coordinator.key, else $ROUNDPIPE_KEYS_DIR/coordinator.key)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for compute (default for --cpu: half the cores, which suits "
        "two CPU workers per machine; oversubscribed cores slow CPU training down many times)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the first Welcome before exiting (status 2)",
    )
    parser.add_argument(
        "--coordinator-timeout",
        type=float,
        default=10.0,
        help="seconds of coordinator silence after which the worker drops its state and reconnects",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="with --gpu: cap this worker's GPU memory, e.g. 24GiB (emulate a smaller card, "
        "or share one GPU between workers); the coordinator plans stages to fit it. With "
        "--cpu: cap the worker's private memory (RLIMIT_DATA); a task that needs more fails "
        "naming the cap",
    )
    parser.add_argument(
        "--emulate-pcie",
        default=None,
        metavar="BANDWIDTH",
        help="with --cpu: move data through an emulated bus of this bandwidth per direction "
        "(e.g. 2GB/s): copy threads, priorities, prefetch and completion events exactly as "
        "on a GPU, for tests and benchmarks on machines without one",
    )
    parser.add_argument(
        "--emulate-latency",
        default="10us",
        metavar="DURATION",
        help="with --emulate-pcie: fixed cost of each copy (default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    emulate = None
    if args.emulate_pcie is not None:
        from roundpipe.shared.units import parse_quantity

        if args.gpu is not None:
            print(
                "roundpipe-worker: --emulate-pcie emulates a bus for a --cpu worker; a GPU "
                "worker uses its real one",
                file=sys.stderr,
            )
            return 2
        try:
            emulate = parse_quantity(args.emulate_pcie, what="--emulate-pcie")
            latency = parse_duration(args.emulate_latency)
            if not emulate > 0:
                raise ValueError(f"--emulate-pcie must be positive, got {args.emulate_pcie!r}")
        except ValueError as exc:
            print(f"roundpipe-worker: {exc}", file=sys.stderr)
            return 2
    memory_limit = None
    if args.memory_limit is not None:
        from roundpipe.shared.units import parse_quantity

        try:
            memory_limit = int(parse_quantity(args.memory_limit, what="--memory-limit"))
            if args.gpu is None:
                # Note [CPU memory cap]: the worker's private memory, not the arenas.
                apply_cpu_memory_cap(memory_limit)
                memory_limit = None  # the coordinator plans CPU workers without a limit
        except ValueError as exc:
            print(f"roundpipe-worker: {exc}", file=sys.stderr)
            return 2
    # Models, tokenizers and data are local by design: never wait on the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.gpu is not None:
        if not torch.cuda.is_available() or args.gpu >= torch.cuda.device_count():
            print(
                f"roundpipe-worker: no CUDA device {args.gpu} on this machine "
                f"({torch.cuda.device_count()} visible); use --cpu",
                file=sys.stderr,
            )
            return 2
        device = f"cuda:{args.gpu}"
        if memory_limit is not None:
            try:
                apply_memory_limit(torch.device(device), memory_limit)
            except ValueError as exc:
                print(f"roundpipe-worker: {exc}", file=sys.stderr)
                return 2
            log.info("[worker] GPU memory capped at %.2f GiB", memory_limit / 2**30)
    else:
        device = "cpu"
    threads = args.threads
    if threads is None and device == "cpu":
        threads = max(1, (os.cpu_count() or 2) // 2)
    if threads:
        torch.set_num_threads(threads)
    try:
        keys = connect_keys(args.key, args.coordinator_key)
    except KeyFileError as exc:
        print(f"roundpipe-worker: {exc}", file=sys.stderr)
        return 2
    try:
        fault = parse_fault(os.environ.get(FAULT_ENV))
    except ValueError as exc:
        print(f"roundpipe-worker: {exc}", file=sys.stderr)
        return 2
    if fault is not None:
        log.warning("[worker] fault injection armed: %s=%s", FAULT_ENV, os.environ[FAULT_ENV])
    try:
        engine = make_engine(
            device,
            emulate_bandwidth=emulate,
            emulate_latency_s=latency if emulate is not None else 0.0,
            memory_limit_bytes=memory_limit,
        )
    except Exception as exc:  # noqa: BLE001 - e.g. no CUDA streams: say so and exit 2
        print(f"roundpipe-worker: cannot start the transfer engine: {exc}", file=sys.stderr)
        return 2
    engine.on_broken = _exit_when_broken
    daemon = WorkerDaemon(
        args.coordinator,
        device=device,
        engine=engine,
        name=args.name,
        handshake_timeout_s=args.handshake_timeout,
        coordinator_timeout_s=args.coordinator_timeout,
        fault=fault,
        memory_limit_bytes=memory_limit,
        keys=keys,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    try:
        daemon.serve()
    except HandshakeError as exc:
        print(f"roundpipe-worker: {exc}", file=sys.stderr)
        return 2
    return daemon.exit_code


COMPUTE_STOP_TIMEOUT_S = 30.0
"""How long a session's end waits for its running task to stop (at its next layer)."""

BROKEN_EXIT_GRACE_S = 1.0
"""How long a worker whose engine broke waits for its own orderly stop before it exits."""


def _exit_when_broken(why: str, code: int = 3) -> None:
    """The transfer engine broke (Note [dead producers and imported events] in
    roundpipe.shared.handoff): give the orderly stop (the task's failure reported, exit
    status 3) a moment, then exit anyway. Threads stuck on the CUDA stream that waits for
    a dead process's event can never finish, so only the process's end frees them; the
    coordinator re-runs this worker's tasks as for any lost worker."""
    log.error("[worker] exiting in %.0f s: %s", BROKEN_EXIT_GRACE_S, why)
    timer = threading.Timer(BROKEN_EXIT_GRACE_S, _exit_now, (code,))
    timer.daemon = True
    timer.start()


def _exit_now(code: int) -> None:
    """Exit without interpreter teardown once the worker has stopped cleanly.

    Everything the worker owns is closed by then (arena mappings, sockets); what is
    left is library teardown (torch, zmq atexit hooks) that can take seconds, during
    which a supervisor's SIGTERM would kill a process that has already said "stopped".
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> None:
    """Console-script entry point (``roundpipe-worker``)."""
    _exit_now(main())


if __name__ == "__main__":
    run()
