"""``roundpipe-worker``: a stateless worker process around ``WorkerCore``.

Threads (only the I/O thread touches the DEALER socket):

    rp-worker-<name> (I/O)   handshake, heartbeats, receives JobSetup / StageTask /
                             JobTeardown / Shutdown, sends results queued by compute
    rp-compute               runs tasks one at a time (WorkerCore); results go back
                             through an inproc PUSH socket

Heartbeats come from the I/O thread, so a long task never makes the worker look dead.
Exit codes: 0 after SIGTERM/SIGINT or a Shutdown message, 2 when the coordinator rejects
the worker (e.g. protocol version mismatch) or does not answer the handshake in time.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
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
from roundpipe.worker.runtime import TaskAborted, WorkerCore

__all__ = ["WorkerDaemon", "main", "run"]

log = logging.getLogger("roundpipe.worker")


class HandshakeError(RuntimeError):
    pass


class WorkerDaemon:
    def __init__(
        self,
        coordinator: str,
        *,
        device: str = "cpu",
        name: str | None = None,
        handshake_timeout_s: float = 30.0,
    ):
        self.coordinator = coordinator
        self.device = torch.device(device)
        self.name = name or f"{socket.gethostname()}-{self.device}".replace(":", "")
        self.handshake_timeout_s = handshake_timeout_s
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._tasks: queue.Queue[Message | None] = queue.Queue()
        self._outbox_address = f"inproc://rp-worker-outbox-{id(self)}"
        self.core: WorkerCore | None = None

    def stop(self) -> None:
        self._stop.set()

    # -- handshake --------------------------------------------------------------------

    def _hello(self) -> Hello:
        proc = psutil.Process()
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return Hello(
                worker_name=self.name,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                process_create_time=proc.create_time(),
                device="cuda",
                device_index=self.device.index or 0,
                device_name=props.name,
                memory_bytes=props.total_memory,
                compute_capability=f"{props.major}.{props.minor}",
            )
        return Hello(
            worker_name=self.name,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            process_create_time=proc.create_time(),
            device="cpu",
            device_index=None,
            device_name=f"cpu ({psutil.cpu_count()} cores)",
            memory_bytes=psutil.virtual_memory().total,
            compute_capability=None,
        )

    def connect(self) -> Welcome:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.coordinator)
        self.sock.send_multipart(encode(self._hello()))
        deadline = time.monotonic() + self.handshake_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            frames = self.sock.recv_multipart()
            try:
                msg = decode(frames)
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
                raise HandshakeError(f"the coordinator rejected this worker: {msg.reason}")
            if isinstance(msg, ErrorReply):
                raise HandshakeError(f"the coordinator refused the handshake: {msg.message}")
        raise HandshakeError(
            f"no answer from a coordinator at {self.coordinator} within "
            f"{self.handshake_timeout_s:.0f}s; is roundpipe-coordinator running there? "
            "(--coordinator / ROUNDPIPE_ADDRESS; --handshake-timeout)"
        )

    # -- loops ------------------------------------------------------------------------

    def serve(self) -> None:
        welcome = self.connect()
        self.core = WorkerCore(welcome.worker_id, self.device)
        self.core.should_abort = self._stop.is_set
        threading.current_thread().name = f"rp-worker-{welcome.worker_id}"
        log.info(
            "[worker] %s joined coordinator %s as worker %d",
            self.name,
            welcome.coordinator_id,
            welcome.worker_id,
        )
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(self._outbox_address)
        compute = threading.Thread(target=self._compute_loop, name="rp-compute", daemon=True)
        compute.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        interval = welcome.heartbeat_interval_s
        next_beat = 0.0
        seq = 0
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is outbox:
                        self.sock.send_multipart(outbox.recv_multipart())
                    else:
                        self._on_message(self.sock.recv_multipart())
                if time.monotonic() >= next_beat:
                    seq += 1
                    self.sock.send_multipart(
                        encode(Heartbeat(sender=self.name, seq=seq, sent_at=time.time()))
                    )
                    next_beat = time.monotonic() + interval
        finally:
            self._stop.set()
            self._tasks.put(None)
            compute.join(timeout=30)
            outbox.close()
            self.sock.close()
            self.ctx.term()
            if self.core is not None:
                self.core.close()
            log.info("[worker] %s stopped", self.name)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            log.warning("[worker] malformed message dropped: %s", exc)
            return
        if isinstance(msg, Shutdown):
            log.info("[worker] shutdown requested: %s", msg.reason)
            self._stop.set()
        elif isinstance(msg, (JobSetup, StageTask, JobTeardown)):
            self._tasks.put(msg)
        elif isinstance(msg, Heartbeat):
            pass  # liveness of the coordinator: issue 6 acts on it
        else:
            log.warning("[worker] unexpected %s ignored", type(msg).__name__)

    def _compute_loop(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(self._outbox_address)
        core = self.core
        assert core is not None
        try:
            while (msg := self._tasks.get()) is not None:
                if isinstance(msg, JobSetup):
                    try:
                        core.setup_job(msg)
                    except Exception:
                        log.error(
                            "[worker] setup of job %s failed:\n%s",
                            msg.job_id,
                            traceback.format_exc(),
                        )
                elif isinstance(msg, JobTeardown):
                    core.teardown_job(msg.job_id)
                else:
                    push.send_multipart(encode(self._run(core, msg)))
        finally:
            push.close(linger=1000)

    def _run(self, core: WorkerCore, task: StageTask) -> Message:
        try:
            return core.run_task(task)
        except TaskAborted as exc:
            return self._failed(core, task, exc, retryable=True)
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
            return self._failed(core, task, exc, retryable=False)

    @staticmethod
    def _failed(core: WorkerCore, task: StageTask, exc: BaseException, *, retryable: bool):
        return TaskFailed(
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=task.attempt,
            worker_id=core.worker_id,
            error_type=type(exc).__name__,
            message=str(exc),
            traceback=traceback.format_exc(),
            retryable=retryable,
        )


def main(argv: list[str] | None = None) -> int:
    from roundpipe.defaults import DEFAULT_ADDRESS

    parser = argparse.ArgumentParser(
        prog="roundpipe-worker", description="RoundPipe stateless worker (one per GPU)."
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", type=int, metavar="N", help="run on CUDA device N")
    where.add_argument("--cpu", action="store_true", help="run on the CPU")
    parser.add_argument(
        "--coordinator", default=DEFAULT_ADDRESS, help="coordinator address (default %(default)s)"
    )
    parser.add_argument("--name", default=None, help="worker name shown in `roundpipe workers`")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for compute (default for --cpu: half the cores, which suits "
        "two CPU workers per machine; oversubscribed cores slow CPU training down many times)",
    )
    parser.add_argument("--handshake-timeout", type=float, default=30.0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
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
    else:
        device = "cpu"
    threads = args.threads
    if threads is None and device == "cpu":
        threads = max(1, (os.cpu_count() or 2) // 2)
    if threads:
        torch.set_num_threads(threads)
    daemon = WorkerDaemon(
        args.coordinator, device=device, name=args.name, handshake_timeout_s=args.handshake_timeout
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    try:
        daemon.serve()
    except HandshakeError as exc:
        print(f"roundpipe-worker: {exc}", file=sys.stderr)
        return 2
    return 0


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
