"""Messages between clients and the coordinator: requests and their replies.

A client (roundpipe.client, the ``roundpipe`` CLI) sends one request and reads one reply.
Field-by-field documentation lives on the classes below, one comment line per field; the
class *is* the schema; the structs some replies hold (WorkerInfo, ProgressEvent) are in
roundpipe.protocol.structs. Direction: K = client, C = coordinator.

Client API (K -> C requests, C -> K replies)
    SubmitJob    K -> C   a job spec;                     reply JobAccepted or ErrorReply
    JobAccepted  C -> K   the new job's id
    GetJobStatus K -> C   one job's state;                reply JobStatus or ErrorReply
    JobStatus    C -> K   state, step, loss of a job
    CancelJob    K -> C   cancel a job;                   reply Ack or ErrorReply
    ResumeJob    K -> C   re-queue a stopped job from its newest checkpoint;
                                                          reply Ack or ErrorReply
    ForgetJob    K -> C   remove an ended job's record, log and history (its output
                          stays, and its owner's);        reply Ack or ErrorReply
    ListJobs     K -> C   one page of jobs, from a position;  reply JobList
    JobList      C -> K   a JobStatus per job of the page, where the next page starts
    ListWorkers  K -> C   one page of workers, after an id;   reply WorkerList
    WorkerList   C -> K   a WorkerInfo per worker of the page, whether more follow
    GetProgress  K -> C   progress events after a seq;    reply Progress or ErrorReply
    Progress     C -> K   a page of ProgressEvents in seq order, whether the job has ended
    GetJobLog    K -> C   a job's log from a byte offset; reply JobLog or ErrorReply
    JobLog       C -> K   up to 256 KiB of the log (whole lines), where the next piece starts

Replies are bounded: the coordinator fills a page up to :data:`MAX_REPLY_BYTES` (at least
one item), so no amount of history, no number of workers and no length of a peer's
strings can make a reply the encoder refuses; the client asks for the next page.
    ErrorReply   C -> K   a request failed: machine-readable code and a message
    Ack          C -> K   a request succeeded and has nothing to return
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from msgspec import field

from roundpipe.protocol.schema import (
    Message,
    Name,
    NonNegFloat,
    NonNegInt,
    declare_message,
)
from roundpipe.protocol.structs import ProgressEvent, WorkerInfo

__all__ = [
    "MAX_REPLY_BYTES",
    "SubmitJob",
    "JobAccepted",
    "GetJobStatus",
    "JobStatus",
    "CancelJob",
    "ResumeJob",
    "ForgetJob",
    "ListJobs",
    "JobList",
    "JobLog",
    "ListWorkers",
    "WorkerList",
    "GetJobLog",
    "GetProgress",
    "Progress",
    "ERROR_CODES",
    "ErrorCode",
    "FINAL_JOB_STATES",
    "JOB_STATES",
    "JobState",
    "STOPPED_JOB_STATES",
    "ErrorReply",
    "Ack",
]

MAX_REPLY_BYTES: int = 1024 * 1024
"""Budget of one page of a list reply (JobList, WorkerList, Progress): the coordinator
adds items while their encoded size fits (always at least one). Far below
DEFAULT_MAX_BODY_BYTES, so a page is always encodable, and small enough to answer fast."""


# --------------------------------------------------------------------------- client API


JobState = Literal["queued", "running", "paused", "succeeded", "failed", "cancelled"]
"""A job's lifecycle state (roundpipe.coordinator.service.jobs draws the state machine)."""
JOB_STATES: tuple[str, ...] = typing.get_args(JobState)
"""Every job state, in lifecycle order; the coordinator, the client and the CLI share it."""
FINAL_JOB_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
"""Job states that never change on their own (a resume can queue a failed or cancelled
job again)."""
STOPPED_JOB_STATES: frozenset[str] = FINAL_JOB_STATES | {"paused"}
"""States in which a job makes no progress until someone acts: the final ones, and
``paused`` (stopped without losing anything, e.g. its checkpoint could not be written)."""


@declare_message
class SubmitJob(Message):
    """Submit a job; the coordinator validates the spec before accepting it."""

    #: the job spec (docs/job-spec.md) as a map
    spec: dict[str, Any]


@declare_message
class JobAccepted(Message):
    """A submitted job was queued."""

    #: its id
    job_id: Name


@declare_message
class GetJobStatus(Message):
    """Ask for one job's status."""

    #: job id
    job_id: Name


@declare_message
class JobStatus(Message):
    """One job's status (also an element of JobList)."""

    #: job id
    job_id: Name
    #: lifecycle state
    state: JobState
    #: optimizer steps completed
    step: NonNegInt
    #: optimizer steps planned
    total_steps: NonNegInt
    #: latest training loss, None before the first step (may be NaN if training diverged)
    loss: float | None
    #: human-readable detail: the error of a failed job, what a queued job waits for
    message: str
    #: where checkpoints and the final model go, once known
    output_dir: str | None
    #: the stage partition in use (Plan string form, e.g. "F[0:4] T[4:6] B[2:4,0:2]"),
    #: empty until the job has been planned
    plan: str = ""
    #: training throughput of the latest step (None: no step yet or not running)
    tokens_per_s: NonNegFloat | None = None
    #: measured share of worker time not computing in the newest settled step
    #: (roundpipe.coordinator.training.timeline); None until measured
    bubble_fraction: NonNegFloat | None = None
    #: steps the pipeline has finished that the optimizer has not applied yet
    optimizer_lag_steps: NonNegInt = 0
    #: per worker id (as a string): share of the newest settled step spent computing
    worker_busy: dict[str, NonNegFloat] = field(default_factory=dict)


@declare_message
class CancelJob(Message):
    """Cancel a job (queued or running)."""

    #: job id
    job_id: Name


@declare_message
class ForgetJob(Message):
    """Forget a job that has ended: its record, log and progress history go; its output
    stays, and no other owner's job may write there."""

    #: job id
    job_id: Name


@declare_message
class ResumeJob(Message):
    """Re-queue a paused, failed or cancelled job; it continues from its newest
    checkpoint (from the start if it has none)."""

    #: job id
    job_id: Name


@declare_message
class ListJobs(Message):
    """Ask for one page of the jobs' statuses, in submission order."""

    #: place in the listing order (0 = the oldest job) of the first job wanted:
    #: JobList.next_start of the previous page (a forgotten job leaves a gap, so a
    #: forget between two pages skips no job)
    start: NonNegInt = 0


@declare_message
class JobList(Message):
    """One page of the jobs the coordinator knows (at most MAX_REPLY_BYTES of them)."""

    #: one status per job, oldest first, from ListJobs.start on
    jobs: list[JobStatus]
    #: ListJobs.start of the next page; None when this page holds the last job
    next_start: NonNegInt | None = None
    #: how many jobs the coordinator knows in all
    total: NonNegInt = 0


@declare_message
class ListWorkers(Message):
    """Ask for one page of the workers, by worker id."""

    #: only workers with a larger worker_id (None: from the first): the last worker_id
    #: of the previous page
    after: NonNegInt | None = None


@declare_message
class WorkerList(Message):
    """One page of the workers the coordinator knows (at most MAX_REPLY_BYTES of them)."""

    #: one entry per worker, by worker_id, ids > ListWorkers.after
    workers: list[WorkerInfo]
    #: True if workers with larger ids follow: ask again with after = the last id here
    more: bool = False


@declare_message
class GetProgress(Message):
    """Ask for a job's progress events newer than `after_seq` (long-poll friendly)."""

    #: job id
    job_id: Name
    #: return events with seq > after_seq; 0 for all (seqs start at 1)
    after_seq: NonNegInt


@declare_message
class GetJobLog(Message):
    """Ask for a piece of a job's log (the coordinator's log lines of that job); only its
    owner or an admin gets it."""

    #: job id
    job_id: Name
    #: byte offset in the log to read from; 0 for the beginning
    offset: NonNegInt = 0


@declare_message
class JobLog(Message):
    """A piece of a job's log, at most MAX_REPLY_BYTES; ask again from `next_offset`."""

    #: job id
    job_id: Name
    #: byte offset of `text` in the log
    offset: NonNegInt
    #: the log from `offset`, whole lines where a line fits (UTF-8; bad bytes replaced)
    text: str
    #: where the next piece starts: `offset` plus the bytes `text` was decoded from
    next_offset: NonNegInt
    #: True if the log held more than this piece when it was read
    more: bool = False


@declare_message
class Progress(Message):
    """Progress events of a job, oldest first."""

    #: job id
    job_id: Name
    #: events with seq > GetProgress.after_seq, in seq order; a page of at most
    #: MAX_REPLY_BYTES: ask again after the last seq for the rest
    events: list[ProgressEvent]
    #: True once the job has ended and this page holds its last event
    done: bool


ErrorCode = Literal[
    "bad_hello",  # a worker's Hello reports impossible hardware
    "bad_spec",  # the job spec is invalid (or does not fit the machine); the message lists why
    "bad_state",  # the job is in a state that does not allow the request (resume a success)
    "busy",  # the coordinator cannot take the request now; try again
    "forbidden",  # the sender's role may not send this request
    "internal_error",  # a bug in the coordinator; the message says what failed
    "protocol_error",  # the request could not be decoded (version, type, body)
    "spec_check_failed",  # the spec could not be checked (the checking process died)
    "store_error",  # the job store could not record the request
    "unexpected_message",  # a message type the coordinator does not take from this peer
    "unknown_job",  # no such job (or not one the sender may see)
    "unknown_worker",  # the coordinator does not know this worker (it restarted)
]
"""Every ``ErrorReply.code``: one closed set for the coordinator, the client and the CLI."""

ERROR_CODES: frozenset[str] = frozenset(typing.get_args(ErrorCode))


@declare_message
class ErrorReply(Message):
    """A request failed."""

    #: machine-readable, one of ErrorCode
    code: ErrorCode
    #: human-readable explanation
    message: str


@declare_message
class Ack(Message):
    """A client request succeeded and has nothing to return."""
