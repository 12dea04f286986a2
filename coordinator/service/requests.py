"""The client requests a coordinator answers, and what each does to the job book:
job status, progress, log pieces, job and worker lists, submit, cancel, resume.

Jobs belong to their submitter: an identity that is neither the job's owner nor an admin
is told the job does not exist, exactly as for an id that does not exist. Lists are
answered a page of at most ``MAX_REPLY_BYTES`` at a time. SubmitJob and ResumeJob are
answered on the admission thread (``Admissions``: validating a spec reads files), every
other request on the daemon's I/O thread (roundpipe.coordinator.service.daemon).
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from roundpipe.coordinator.service.admission import (
    SpecValidator,
    ValidationUnavailable,
    validate_spec,
)
from roundpipe.coordinator.service.auth import Peer
from roundpipe.coordinator.service.figures import current_tasks
from roundpipe.coordinator.service.jobs import (
    MAX_TEXT_CHARS,
    BadState,
    JobBook,
    JobRecord,
    bounded_text,
)
from roundpipe.coordinator.service.jobstore import JobStoreError
from roundpipe.coordinator.service.workers import MAX_NAME_CHARS, WorkerTable
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import PathPolicy, check_ownership
from roundpipe.coordinator.training.multinode import NodeGroup, node_microbatches
from roundpipe.protocol import (
    MAX_REPLY_BYTES,
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
    ListJobs,
    ListWorkers,
    Message,
    Progress,
    ProtocolError,
    ResumeJob,
    SubmitJob,
    WorkerInfo,
    WorkerList,
    encode,
    encoded_size,
)

__all__ = ["Admissions", "ClientRequests", "encode_reply"]

log = logging.getLogger("roundpipe.coordinator")

LOG_PIECE_BYTES = 256 * 1024
"""Most bytes of a job's log in one JobLog reply (well under MAX_REPLY_BYTES even if
every byte became a 3-byte replacement character; a small read on the I/O thread)."""
MAX_LISTED_JOBS = 5
"""Most job ids named in a refusal for ``--max-jobs-per-owner`` (the rest are counted)."""
MAX_PENDING_ADMISSIONS = 32
"""Submissions/resumes waiting for the admission thread; more are refused as busy, so a
flood of SubmitJobs cannot grow the coordinator."""


class ClientRequests:
    """Answers client requests from the job book and the worker table (both guarded by
    the daemon's ``lock``)."""

    def __init__(
        self,
        book: JobBook,
        workers: WorkerTable,
        lock: threading.RLock,
        *,
        paths: PathPolicy,
        arena_dir: Path,
        group: NodeGroup | None = None,
        max_jobs_per_owner: int | None = None,
    ) -> None:
        self.book = book
        self.workers = workers
        self._lock = lock
        self.paths = paths
        self.arena_dir = arena_dir
        self.group = group
        """The data-parallel group (None: none): a submission must split evenly over it."""
        self.max_jobs_per_owner = max_jobs_per_owner
        """Most jobs one owner may have queued or running (``--max-jobs-per-owner``; None:
        no limit). A submission or resume beyond it is refused (``busy``, saying why)."""
        # The spec checker child (coordinator.admission), set while the daemon serves,
        # except on a group's followers, which refuse every submission before it would
        # be used; without it (a coordinator driven by tests) specs are validated
        # in-process.
        self.validator: SpecValidator | None = None

    def answer(self, msg: Message, peer: Peer) -> Message:
        """The reply to a client request; never raises (a failure is an ErrorReply)."""
        try:
            return self.handle(msg, peer)
        except Exception as exc:  # a bug in a handler must not kill the daemon
            log.exception("[coordinator] request %s failed", type(msg).__name__)
            return ErrorReply(code="internal_error", message=f"{type(exc).__name__}: {exc}")

    def handle(self, msg: Message, peer: Peer) -> Message:
        """The reply to a client request, as ``peer`` may see it (``answer`` without the
        safety net)."""
        if isinstance(msg, SubmitJob):
            return self._submit(msg, peer)
        if isinstance(msg, GetJobStatus):
            job = self._job_of(msg.job_id, peer)
            if job is None:
                return _unknown(msg.job_id)
            with self._lock:
                return self.book.status(job, None if peer.admin else peer.name)
        if isinstance(msg, GetProgress):
            return self._progress(msg, peer)
        if isinstance(msg, GetJobLog):
            return self._job_log(msg, peer)
        if isinstance(msg, CancelJob):
            return self._cancel(msg.job_id, peer)
        if isinstance(msg, ResumeJob):
            return self._resume(msg.job_id, peer)
        if isinstance(msg, ForgetJob):
            return self._forget(msg.job_id, peer)
        if isinstance(msg, ListJobs):
            with self._lock:
                visible = [j for j in self.book.jobs.values() if peer.admin or j.owner == peer.name]
                total = len(visible)
                viewer = None if peer.admin else peer.name
                # By the jobs' order, not their index: a forget between two pages shifts
                # no job past the next page's start.
                first = bisect.bisect_left(visible, msg.start, key=lambda j: j.order)
                page, more = _page(self.book.status(j, viewer) for j in visible[first:])
            next_start = visible[first + len(page)].order if more else None
            return JobList(jobs=page, next_start=next_start, total=total)
        if isinstance(msg, ListWorkers):
            with self._lock:
                active = self.book.active
                running = current_tasks(active.trainer if active is not None else None)
                workers = sorted(
                    (
                        w
                        for w in self.workers.entries()
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

    def _job_of(self, job_id: str, peer: Peer) -> JobRecord | None:
        """The job, if ``peer`` may see it: its owner or an admin. Anyone else is told
        there is no such job, exactly as for an id that does not exist."""
        with self._lock:
            job = self.book.jobs.get(job_id)
        if job is None or not (peer.admin or job.owner == peer.name):
            return None
        return job

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
        hardware = self.workers.hardware()  # CPU workers (or none): no GPU memory to check
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
        return self._change(job_id, peer, "cancel", "cancelled", self.book.cancel)

    def _forget(self, job_id: str, peer: Peer) -> Message:
        return self._change(job_id, peer, "forget", "forgotten", self.book.forget)

    def _change(
        self, job_id: str, peer: Peer, verb: str, done: str, change: Callable[[JobRecord], None]
    ) -> Message:
        """Cancel or forget one of ``peer``'s jobs: Ack, or why not (its state, or a store
        that could not record it: then nothing changed)."""
        job = self._job_of(job_id, peer)
        if job is None:
            return _unknown(job_id)
        log.info("[coordinator] %s asks to %s job %s", peer.name, verb, job_id)
        try:
            change(job)
        except BadState as exc:
            return ErrorReply(code="bad_state", message=str(exc))
        except JobStoreError as exc:
            return ErrorReply(code="store_error", message=f"the job was not {done}: {exc}")
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
                self.book.validate_stored(
                    job.job_id,
                    job.spec_dict,
                    job.output_dir,
                    lambda spec: self._validated(spec, job.owner, admin=peer.admin),
                )
            except JobSpecError as exc:
                return ErrorReply(code="bad_spec", message=f"it cannot run again: {exc}")
            except ValidationUnavailable as exc:
                return ErrorReply(code="spec_check_failed", message=str(exc))
        try:
            self.book.resume(job)
        except BadState as exc:
            return ErrorReply(code="bad_state", message=str(exc))
        except JobStoreError as exc:
            return ErrorReply(code="store_error", message=f"the job was not resumed: {exc}")
        return Ack()


class Admissions:
    """The admission thread (``rp-admission``): SubmitJob and ResumeJob wait here for
    their answer, so that validating a spec (file checks, reading the data) never holds
    up the I/O thread. The answers go out through the thread's own inproc PUSH socket to
    the I/O thread, which alone sends on the ROUTER."""

    def __init__(self, requests: ClientRequests) -> None:
        self.requests = requests
        # (identity, request, peer); bounded. None: the thread exits.
        self._queue: queue.Queue[tuple[bytes, Message, Peer] | None] = queue.Queue(
            MAX_PENDING_ADMISSIONS
        )

    def offer(self, identity: bytes, msg: SubmitJob | ResumeJob, peer: Peer) -> ErrorReply | None:
        """Queue a submission or resume for the thread; the refusal to send at once
        instead, if the queue is full (a spec over MAX_SPEC_BYTES never gets here: the
        I/O thread refuses it unread, Note [inbound limits])."""
        try:
            self._queue.put_nowait((identity, msg, peer))
        except queue.Full:
            return ErrorReply(
                code="busy",
                message=f"the coordinator is still checking {MAX_PENDING_ADMISSIONS} "
                "submitted jobs; try again in a moment",
            )
        return None

    def wake(self) -> None:
        """Make the thread exit now, rather than at its next look at ``stopping``."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # it sees stopping within its poll interval

    def run(self, ctx: zmq.Context, outbox: str, stopping: threading.Event) -> None:
        """The thread's body: answer what is queued until ``stopping`` is set."""
        push = ctx.socket(zmq.PUSH)
        push.connect(outbox)
        try:
            while not stopping.is_set():
                try:
                    item = self._queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    return
                identity, msg, peer = item
                try:
                    push.send_multipart([identity, *encode_reply(self.requests.answer(msg, peer))])
                except Exception:  # this thread must outlive any one submission
                    log.exception("[coordinator] answering a %s failed", type(msg).__name__)
        finally:
            push.close(linger=1000)


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


def _unknown(job_id: str) -> ErrorReply:
    return ErrorReply(
        code="unknown_job",
        message=f"no job {bounded_text(job_id, MAX_NAME_CHARS)!r} on this coordinator",
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
