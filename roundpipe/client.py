"""Python client of the RoundPipe coordinator: submit jobs, watch them, cancel them.

::

    from roundpipe import Client

    with Client() as client:                      # $ROUNDPIPE_ADDRESS or tcp://127.0.0.1:7420
        job = client.submit("job.yaml")           # validated here, before anything is sent
        for event in job.progress():              # one ProgressEvent per optimizer step
            print(event.step, event.loss)
        status = job.wait()                       # final JobStatus (or paused)
        print(status.state, status.output_dir)
        if status.state == "paused":              # e.g. the output disk was full
            job.resume()                          # continue from the newest checkpoint

Transport. The coordinator binds one ZeroMQ ROUTER socket; a client connects one DEALER
socket to it and sends one request (the single frame of
:func:`roundpipe.protocol.encode`) at a time, each answered by exactly one reply, in order.
A request that gets no reply within ``timeout_s`` raises :class:`CoordinatorUnavailable`;
the socket is then closed and a fresh one connected, so a reply that arrives late can
never be taken for the answer to a later request. ``submit`` and ``resume`` wait at least
:data:`~roundpipe.shared.defaults.SUBMIT_TIMEOUT_S` (360 s, longer than the coordinator's
check may take): the coordinator reads the job's whole data file before it answers; past
that wait they raise :class:`StillChecking`, since the coordinator answered a ping just
before and may yet accept the job.

Errors. An :class:`~roundpipe.protocol.ErrorReply` from the coordinator becomes a typed
exception, all subclasses of :class:`RoundPipeError`: :class:`UnknownJob`,
:class:`JobRejected`, or :class:`RoundPipeError` itself (with ``code``) for anything
else. A spec that fails validation on the client raises
:class:`~roundpipe.coordinator.spec.jobspec.JobSpecError` before any request is sent.

Authentication. A coordinator with keys (every tcp:// one) accepts only clients whose
CurveZMQ key it has authorised (docs/deploy.md, "Keys and access"). The client connects
with ``key`` / ``$ROUNDPIPE_KEY`` (default ``~/.config/roundpipe/client.key_secret``) and
the coordinator's public key ``coordinator_key`` / ``$ROUNDPIPE_COORDINATOR_KEY``
(default ``~/.config/roundpipe/coordinator.key``); see :mod:`roundpipe.shared.keys`. A
refused handshake raises :class:`NotAuthorized` at once, not a timeout. Jobs belong to
the identity that submitted them: another client (not an admin) is told they do not
exist.

A :class:`Client` may be shared between threads (requests are serialised by a lock), but
it must not be used across ``fork()``: create a new one in the child.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from roundpipe.coordinator.spec.errors import FieldError, JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec
from roundpipe.protocol import (
    FINAL_JOB_STATES,
    NUM_FRAMES,
    STOPPED_JOB_STATES,
    Ack,
    CancelJob,
    ErrorReply,
    ForgetJob,
    GetJobLog,
    GetJobStatus,
    GetProgress,
    JobAccepted,
    JobList,
    JobLog,
    JobStatus,
    ListJobs,
    ListWorkers,
    Message,
    Progress,
    ProgressEvent,
    ProtocolError,
    ProtocolVersionError,
    ResumeJob,
    SubmitJob,
    WorkerInfo,
    WorkerList,
    decode,
    encode,
)
from roundpipe.shared.defaults import (
    CLIENT_TIMEOUT_S,
    ENDPOINT_EXAMPLES,
    SUBMIT_TIMEOUT_S,
    default_address,
    endpoint_problem,
)
from roundpipe.shared.keys import ConnectKeys, apply_connect_keys, connect_keys

__all__ = [
    "FINAL_STATES",
    "Client",
    "ConnectionLost",
    "CoordinatorUnavailable",
    "JobHandle",
    "JobRejected",
    "JobSpecError",
    "NotAuthorized",
    "RoundPipeError",
    "STOPPED_STATES",
    "StillChecking",
    "UnknownJob",
]

# The job states the coordinator uses (roundpipe.protocol), under the client's names.
FINAL_STATES = FINAL_JOB_STATES
STOPPED_STATES = STOPPED_JOB_STATES

# ErrorReply codes the coordinator uses for "no such job" (the contract names the first;
# the protocol docstring's example the second).
_UNKNOWN_JOB_CODES = frozenset({"unknown_job", "not_found"})

_M = TypeVar("_M", bound=Message)


# --------------------------------------------------------------------------- errors


class RoundPipeError(Exception):
    """Base of every error the client raises about the coordinator or a job.

    ``code`` is the coordinator's machine-readable ErrorReply code when the error came
    from one (e.g. ``"internal"``), else ``None``.
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class CoordinatorUnavailable(RoundPipeError):
    """No reply from the coordinator within the client's timeout."""

    def __init__(
        self, address: str, timeout_s: float, *, sent: bool = True, message: str | None = None
    ) -> None:
        self.sent = sent
        """Whether the request left this client (False: no connection took it)."""
        super().__init__(
            message
            or f"no reply from the RoundPipe coordinator at {address} within {timeout_s:g} s; "
            f"is it running? Start one with `roundpipe-coordinator --address {address}`, "
            "or point the client at the running one (--address, or ROUNDPIPE_ADDRESS)"
        )
        self.address = address
        self.timeout_s = timeout_s


class StillChecking(CoordinatorUnavailable):
    """The coordinator answered a ping, then not a submission (or resume) within the
    wait: it is busy checking specs, and may still accept the job."""

    def __init__(self, address: str, timeout_s: float, what: str) -> None:
        super().__init__(
            address,
            timeout_s,
            message=f"the RoundPipe coordinator at {address} is running (it answered just "
            f"before) but did not answer the {what} within {timeout_s:g} s: it is still "
            "checking this spec or others submitted before it (reading and tokenizing "
            "their data). The job may yet be accepted: look at `roundpipe jobs` before "
            "submitting again",
        )


class ConnectionLost(CoordinatorUnavailable):
    """The connection to the coordinator dropped while it handled a request (it crashed
    or was restarted): the reply will never come."""


class NotAuthorized(RoundPipeError):
    """The coordinator refused this client's handshake (no key, or a key it has not
    authorised) or its role (code ``"forbidden"``)."""


_MONITORED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)
"""What the client's socket monitor reports. A refusal by the coordinator's key check
is ``_AUTH``; a client without a key meets ``_PROTOCOL`` (the wrong mechanism);
``_NO_DETAIL`` is a peer that closed mid-handshake: the wrong coordinator key, a
crashed or overloaded coordinator, or no coordinator at all."""
HANDSHAKE_DROPS = 3
"""Handshakes closed without a word, in a row, after which the client gives up (libzmq
reconnects after each): one may be a coordinator restarting, three are not."""


class UnknownJob(RoundPipeError):
    """The coordinator knows no job with this id."""

    def __init__(self, job_id: str, detail: str = "", *, code: str | None = None) -> None:
        text = f"unknown job {job_id!r}"
        if detail:
            text += f": {detail}"
        super().__init__(text, code=code)
        self.job_id = job_id


class JobRejected(RoundPipeError):
    """The coordinator refused a submitted job; ``message`` is its reason (for
    ``code == "bad_spec"``, what is wrong with the spec)."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(f"the coordinator rejected the job: {message}", code=code)
        self.message = message


# --------------------------------------------------------------------------- client


def _check_address(address: str) -> str:
    problem = (
        endpoint_problem(address)
        if isinstance(address, str)
        else f"expected a ZeroMQ endpoint such as {ENDPOINT_EXAMPLES}"
    )
    if problem is not None:
        raise ValueError(f"invalid coordinator address {address!r}: {problem}")
    return address


class Client:
    """A connection to the RoundPipe coordinator.

    ``address`` is the coordinator's ZeroMQ endpoint; ``None`` means
    :func:`roundpipe.shared.defaults.default_address` (``$ROUNDPIPE_ADDRESS``, else
    ``tcp://127.0.0.1:7420``). ``timeout_s`` bounds the wait for each reply.

    Connecting does not talk to the coordinator: the first request does, and raises
    :class:`CoordinatorUnavailable` if nothing answers. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = CLIENT_TIMEOUT_S,
        key: str | os.PathLike[str] | None = None,
        coordinator_key: str | os.PathLike[str] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._address = _check_address(default_address() if address is None else address)
        # KeyFileError (a ValueError) for a configured key file that is missing or broken.
        self._keys: ConnectKeys | None = connect_keys(key, coordinator_key)
        self._monitor: zmq.Socket | None = None
        self._timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._closed = False
        self._pid = os.getpid()
        self._connect()

    # -- lifecycle --

    @property
    def address(self) -> str:
        """The coordinator endpoint this client talks to."""
        return self._address

    @property
    def timeout_s(self) -> float:
        """Seconds to wait for each reply."""
        return self._timeout_s

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        # Never block close() on unsent requests: a request the coordinator did not take
        # is reported as a timeout, not retried behind the caller's back.
        sock.setsockopt(zmq.LINGER, 0)
        apply_connect_keys(sock, self._keys)
        # A refused handshake is silent on the socket itself; its monitor tells.
        self._monitor = sock.get_monitor_socket(_MONITORED)
        self._drops = 0  # handshakes closed without a word, in a row
        self._after_failure = False  # a DISCONNECTED event ends that failed handshake
        try:
            sock.connect(self._address)
        except zmq.ZMQError as exc:
            self._close_socket(sock)
            raise ValueError(f"invalid coordinator address {self._address!r}: {exc}") from None
        self._socket = sock

    def _close_socket(self, sock: zmq.Socket[bytes]) -> None:
        if self._monitor is not None:
            sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        sock.close(linger=0)

    def _replace_socket(self, sock: zmq.Socket[bytes]) -> None:
        self._close_socket(sock)
        self._socket = None
        self._connect()

    def _monitor_event(self, *, sent: bool) -> None:
        """Act on one event of the socket's monitor: raise for a refused handshake, for
        HANDSHAKE_DROPS silent ones in a row, and (``sent``: a request is awaited on a
        connection that had finished its handshake) for a dropped connection."""
        assert self._monitor is not None
        kind = recv_monitor_message(self._monitor)["event"]
        if kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            raise NotAuthorized(self._refused_text())
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._drops += 1
            self._after_failure = True
            if self._drops >= HANDSHAKE_DROPS:
                raise NotAuthorized(self._dropped_text())
        elif kind == zmq.EVENT_DISCONNECTED:
            if self._after_failure:  # the end of the failed handshake just reported
                self._after_failure = False
            elif sent:
                raise ConnectionLost(
                    self._address,
                    0,
                    message=f"the connection to the RoundPipe coordinator at "
                    f"{self._address} dropped while it handled this request (it stopped, "
                    "crashed or was restarted); its answer is lost. Look at `roundpipe "
                    "jobs` (or the coordinator's log) before sending it again",
                )

    def _wait_reply(
        self, sock: zmq.Socket[bytes] | None, timeout_s: float, *, lost: bool = False
    ) -> list[bytes] | None:
        """The reply frames on ``sock`` within ``timeout_s``; None on timeout. Raises
        NotAuthorized as soon as the coordinator refuses the handshake, and with ``lost``
        ConnectionLost as soon as the connection drops. ``sock`` None: nothing was sent,
        only a refusal is waited for."""
        poller = zmq.Poller()
        if sock is not None:
            poller.register(sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            # In slices: a timeout of a month (or inf: no limit) is no C int of ms.
            ready = dict(poller.poll(timeout=max(1, int(min(left, 60.0) * 1000))))
            if sock is not None and sock in ready:
                self._drops = 0
                return sock.recv_multipart(flags=zmq.NOBLOCK)
            if self._monitor is not None and self._monitor in ready:
                self._monitor_event(sent=lost and sock is not None)
        return None

    def _stale_events(self) -> None:
        """Before a request: act on the monitor's queued events (a refusal raises now);
        a drop reported before this request concerns an earlier connection."""
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor_event(sent=False)
        self._after_failure = False

    def _dropped_text(self) -> str:
        said = (
            f"the peer at {self._address} closed the connection during the handshake "
            f"{self._drops} times in a row without saying why"
        )
        if self._keys is None:  # a coordinator with keys may close a keyless one so
            return (
                f"{self._refused_text()}. ({said}: if it needs no key, it is not a "
                "RoundPipe coordinator, or it is out of file descriptors: see its log)"
            )
        return (
            f"{said}: most likely {self._keys.server_key_path} is not that coordinator's "
            "public key (copy its coordinator.key again); else it is not a RoundPipe "
            "coordinator, or it is out of file descriptors (see its log)"
        )

    def _refused_text(self) -> str:
        if self._keys is None:
            return (
                f"the coordinator at {self._address} refused this client: it needs a key. "
                "Create one with `roundpipe keys new`, have the coordinator's admin authorise "
                "it (`roundpipe keys add NAME --role client --public-key FILE`), and put the "
                "coordinator's public key at ~/.config/roundpipe/coordinator.key (or set "
                "ROUNDPIPE_KEY / ROUNDPIPE_COORDINATOR_KEY)"
            )
        return (
            f"the coordinator at {self._address} refused this client's key "
            f"{self._keys.key_path} (public key {self._keys.public_key.decode()[:12]}...): it "
            "is not authorised there, or " + str(self._keys.server_key_path) + " is not that "
            "coordinator's public key; ask its admin to `roundpipe keys add` yours"
        )

    def close(self) -> None:
        """Close the socket. Idempotent; the client cannot be used afterwards."""
        with self._lock:
            self._closed = True
            if self._socket is not None:
                self._close_socket(self._socket)
                self._socket = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Client {self._address}{state}>"

    # -- one request, one reply --

    def _request(
        self,
        request: Message,
        *expected: type[_M],
        timeout_s: float | None = None,
        frames: list[bytes] | None = None,
    ) -> _M | ErrorReply:
        """Send `request`, return its reply (one of `expected`, or an ErrorReply) within
        ``timeout_s`` (default: the client's). ``frames``: `request` already encoded
        (``submit`` encodes its spec first, to name a value the protocol cannot carry)."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        if frames is None:
            try:
                frames = encode(request)
            except ProtocolError as exc:  # e.g. a spec too large for one message
                raise RoundPipeError(f"cannot send {type(request).__name__}: {exc}") from None
        with self._lock:
            if self._closed:
                raise RoundPipeError("this Client is closed")
            if os.getpid() != self._pid:
                raise RoundPipeError(
                    "a Client cannot be used after fork(); create a new one in the child"
                )
            if self._socket is None:  # a previous _connect after a timeout failed
                self._connect()
            sock = self._socket
            assert sock is not None
            try:
                self._stale_events()
                sent = True
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    sent = False
                    # No connection to queue it on. libzmq ends a connection whose
                    # handshake the coordinator refused, and does not reconnect it: under
                    # load the refusal can come before this send. Its monitor tells.
                    reply_frames = self._wait_reply(None, timeout_s)
                else:
                    reply_frames = self._wait_reply(sock, timeout_s, lost=True)
            except BaseException:
                # Interrupted (Ctrl-C) or failed between request and reply: the reply may
                # still come, so this socket must not be used for another request.
                self._replace_socket(sock)
                raise
            if reply_frames is None:
                # The request (or its late reply) is still queued on this socket; start
                # over with a fresh one so the next request cannot read a stale reply.
                self._replace_socket(sock)
                raise CoordinatorUnavailable(self._address, timeout_s, sent=sent)
        # A DEALER gets no routing envelope, but tolerate an empty delimiter frame from a
        # coordinator that replies REQ-style.
        if len(reply_frames) == NUM_FRAMES + 1 and len(reply_frames[0]) == 0:
            reply_frames = reply_frames[1:]
        req_name = type(request).__name__
        try:
            reply = decode(reply_frames)
        except ProtocolVersionError as exc:
            raise RoundPipeError(
                f"cannot talk to the coordinator at {self._address}: {exc}"
            ) from None
        except ProtocolError as exc:
            raise RoundPipeError(
                f"malformed reply from the coordinator at {self._address} to {req_name}: {exc}"
            ) from None
        if isinstance(reply, ErrorReply) and reply.code == "forbidden":
            raise NotAuthorized(reply.message, code=reply.code)
        if isinstance(reply, ErrorReply) or isinstance(reply, expected):
            return reply
        names = " or ".join(t.__name__ for t in expected)
        raise RoundPipeError(
            f"unexpected reply from the coordinator at {self._address} to {req_name}: "
            f"expected {names} or ErrorReply, got {type(reply).__name__}"
        )

    def _checked_request(
        self,
        request: Message,
        expected: type[_M],
        *,
        what: str,
        frames: list[bytes] | None = None,
    ) -> _M | ErrorReply:
        """A SubmitJob or ResumeJob, which the coordinator answers once it has checked the
        spec: waited for at least SUBMIT_TIMEOUT_S, then StillChecking (it answered the
        ping just before, so it may yet accept the job)."""
        wait_s = max(self._timeout_s, SUBMIT_TIMEOUT_S)
        try:
            return self._request(request, expected, timeout_s=wait_s, frames=frames)
        except CoordinatorUnavailable as exc:
            if not exc.sent or isinstance(exc, ConnectionLost):
                raise
            raise StillChecking(self._address, wait_s, what) from None

    def _ping(self) -> None:
        """A cheap request with the client's own timeout, before one that may take long
        to answer: a coordinator that is not running is reported as fast as ever."""
        self._request(ListWorkers(after=2**62), WorkerList)

    @staticmethod
    def _job_error(reply: ErrorReply, job_id: str) -> RoundPipeError:
        if reply.code in _UNKNOWN_JOB_CODES:
            return UnknownJob(job_id, reply.message, code=reply.code)
        return RoundPipeError(f"job {job_id}: {reply.message} ({reply.code})", code=reply.code)

    # -- API --

    def submit(self, spec: JobSpec | Mapping[str, Any] | str | os.PathLike[str]) -> JobHandle:
        """Validate `spec` and submit it; return a handle to the queued job.

        `spec` is a :class:`JobSpec`, a dict in its form (relative paths are relative to
        the current directory), or the path of a YAML spec file (relative paths are
        relative to the file). Raises :class:`JobSpecError` for an invalid spec (nothing
        is sent) and :class:`JobRejected` if the coordinator refuses it.
        """
        job_spec = _as_job_spec(spec)
        try:  # before anything is sent: a value the protocol cannot carry
            request = SubmitJob(spec=job_spec.to_dict())
            frames = encode(request)
        except ProtocolError as exc:
            raise _unsendable_spec(exc) from None
        self._ping()
        # The coordinator checks the whole data file before it answers (SUBMIT_TIMEOUT_S).
        reply = self._checked_request(request, JobAccepted, what="submission", frames=frames)
        if isinstance(reply, ErrorReply):
            raise JobRejected(reply.message, code=reply.code)
        return JobHandle(self, reply.job_id)

    def job(self, job_id: str) -> JobHandle:
        """A handle to an existing job. Sends nothing: an unknown id surfaces as
        :class:`UnknownJob` from the handle's first request."""
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        return JobHandle(self, job_id)

    def status(self, job_id: str) -> JobStatus:
        """One job's current status."""
        reply = self._request(GetJobStatus(job_id=job_id), JobStatus)
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)
        return reply

    def get_progress(self, job_id: str, after_seq: int = 0) -> Progress:
        """One poll of a job's progress: the events with ``seq > after_seq`` the
        coordinator returns, and whether the job has ended. :meth:`JobHandle.progress`
        is the convenient form."""
        reply = self._request(GetProgress(job_id=job_id, after_seq=after_seq), Progress)
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)
        return reply

    def job_log(self, job_id: str, offset: int = 0) -> JobLog:
        """One piece of a job's log from byte ``offset`` (at most 256 KiB; ask again
        from ``next_offset`` while ``more``). Only the job's owner or an admin gets it."""
        reply = self._request(GetJobLog(job_id=job_id, offset=offset), JobLog)
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)
        return reply

    def jobs(self) -> list[JobStatus]:
        """Every job the coordinator knows, oldest first (asked for page by page: each
        reply holds at most MAX_REPLY_BYTES of them)."""
        jobs: list[JobStatus] = []
        start: int | None = 0
        while start is not None:
            reply = self._request(ListJobs(start=start), JobList)
            if isinstance(reply, ErrorReply):
                raise RoundPipeError(f"cannot list jobs: {reply.message}", code=reply.code)
            jobs.extend(reply.jobs)
            if reply.next_start is not None and reply.next_start <= start:
                raise RoundPipeError(
                    f"the coordinator at {self._address} sent a job page that does not "
                    f"advance (from {start} to {reply.next_start})"
                )
            start = reply.next_start
        return jobs

    def workers(self) -> list[WorkerInfo]:
        """Every worker the coordinator knows, by worker id (page by page, like jobs)."""
        workers: list[WorkerInfo] = []
        after: int | None = None
        while True:
            reply = self._request(ListWorkers(after=after), WorkerList)
            if isinstance(reply, ErrorReply):
                raise RoundPipeError(f"cannot list workers: {reply.message}", code=reply.code)
            page = [w for w in reply.workers if after is None or w.worker_id > after]
            workers.extend(page)
            if not (reply.more and page):  # a page that does not advance ends the walk
                return workers
            after = page[-1].worker_id

    def cancel(self, job_id: str) -> None:
        """Ask the coordinator to cancel a job. Returns once the request is accepted;
        :meth:`JobHandle.wait` tells when the job has actually stopped."""
        reply = self._request(CancelJob(job_id=job_id), Ack)
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)

    def forget(self, job_id: str) -> None:
        """Remove a job that has ended (succeeded, failed, cancelled) from the jobs the
        coordinator keeps: its record, log and progress history. Its output directory
        stays, and stays the owner's. Raises :class:`RoundPipeError` (code
        ``"bad_state"``) for a job that has not ended."""
        reply = self._request(ForgetJob(job_id=job_id), Ack)
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)

    def resume(self, job_id: str) -> None:
        """Queue a paused, failed or cancelled job again; it continues from its newest
        checkpoint (from the start if it has none). A queued or running job is left as it
        is (nothing to do). Raises :class:`RoundPipeError` (code ``"bad_state"``) for a
        job that has succeeded."""
        self._ping()
        reply = self._checked_request(ResumeJob(job_id=job_id), Ack, what=f"resume of {job_id}")
        if isinstance(reply, ErrorReply):
            raise self._job_error(reply, job_id)


def _unsendable_spec(exc: ProtocolError) -> JobSpecError:
    """A spec that validated but holds a value the protocol cannot carry (an integer past
    64 bits where any number is accepted, as in ``model.config``; a path that is not
    UTF-8), as the spec's own
    error, naming its field: ``spec['model']['config']['x']`` is ``model.config.x``."""
    field = exc.field or ""
    path = ".".join(re.findall(r"\['([^']*)'\]", field)) or field.removeprefix("spec")
    advice = "; use a smaller value" if "msgpack's range" in str(exc) else ""
    return JobSpecError([FieldError(path, f"cannot be sent to the coordinator: {exc}{advice}")])


def _as_job_spec(spec: JobSpec | Mapping[str, Any] | str | os.PathLike[str]) -> JobSpec:
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, Mapping):
        return JobSpec.from_dict(spec)
    if isinstance(spec, str | os.PathLike):
        return load_job_spec(Path(spec))
    raise TypeError(
        f"spec must be a JobSpec, a mapping or a YAML file path, got {type(spec).__name__}"
    )


# --------------------------------------------------------------------------- job handle


class JobHandle:
    """One job on the coordinator, addressed by id. Cheap: it holds no state besides the
    id and the client, and every method asks the coordinator afresh."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.job_id = job_id

    def __repr__(self) -> str:
        return f"<JobHandle {self.job_id} at {self.client.address}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JobHandle):
            return NotImplemented
        return self.job_id == other.job_id and self.client.address == other.client.address

    def __hash__(self) -> int:
        return hash((self.job_id, self.client.address))

    def status(self) -> JobStatus:
        """The job's current status."""
        return self.client.status(self.job_id)

    def cancel(self) -> None:
        """Ask the coordinator to cancel the job (see :meth:`Client.cancel`)."""
        self.client.cancel(self.job_id)

    def forget(self) -> None:
        """Remove the ended job from the coordinator's jobs (:meth:`Client.forget`)."""
        self.client.forget(self.job_id)

    def resume(self) -> None:
        """Queue the stopped job again from its newest checkpoint (:meth:`Client.resume`)."""
        self.client.resume(self.job_id)

    def progress(
        self, poll_s: float = 0.2, timeout_s: float | None = None, *, after_seq: int = 0
    ) -> Iterator[ProgressEvent]:
        """Yield the job's progress events (one per optimizer step) as they happen.

        Starts after event ``after_seq`` (0: from the first event, so a finished job
        replays its whole history), polls every ``poll_s`` seconds while nothing new has
        happened, and returns once the job has stopped (a final state, or ``paused``) and
        every event has been yielded. Raises :class:`TimeoutError` if that takes longer than
        ``timeout_s`` (``None``: no limit). Ask :meth:`status` afterwards for how the
        job ended.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = after_seq
        while True:
            reply = self.client.get_progress(self.job_id, last)
            fresh = False
            for event in reply.events:
                if event.seq <= last:
                    continue  # never repeat an event, whatever the coordinator sends
                last = event.seq
                fresh = True
                yield event
            if reply.done and not fresh:
                return
            if fresh:
                # More may be waiting (a coordinator may cap the events per reply, and
                # always does report the rest on the next poll): ask again at once.
                continue
            _sleep_or_timeout(deadline, poll_s, self.job_id, timeout_s, f"(last event {last})")

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.2) -> JobStatus:
        """Block until the job is succeeded, failed, cancelled or paused (it needs
        :meth:`resume` then); return that status.

        Raises :class:`TimeoutError` naming the job if it has not ended within
        ``timeout_s`` seconds (``None``: wait forever). A failed job is not an exception
        here: look at ``status.state`` and ``status.message``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status.state in STOPPED_STATES:
                return status
            _sleep_or_timeout(
                deadline,
                poll_s,
                self.job_id,
                timeout_s,
                f"(state {status.state}, step {status.step}/{status.total_steps})",
            )


def _sleep_or_timeout(
    deadline: float | None, poll_s: float, job_id: str, timeout_s: float | None, detail: str
) -> None:
    if deadline is None:
        time.sleep(poll_s)
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"job {job_id} did not finish within {timeout_s:g} s {detail}")
    time.sleep(min(poll_s, remaining))
