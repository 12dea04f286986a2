"""Every job the coordinator knows, and the state machine they follow, without sockets.

A job's state is one of ``JOB_STATES`` (roundpipe.protocol, shared with the client)::

    submit ──> queued ──> running ──> succeeded
                 ^  │        │  ├──> failed ──────┐
                 │  │        │  ├──> cancelled ───┤ (resume: queued again)
                 │  │        │  └──> paused ──────┤
                 │  └──> cancelled (cancel)       │
                 └────────────────────────────────┘

A coordinator shutdown puts a running job back to ``queued``: it continues from its
newest checkpoint when the coordinator comes back. ``JobBook`` holds the records, the
queue the job thread takes them from and the store (roundpipe.coordinator.service.jobstore) that
makes them survive a restart; every change goes to the store first. ``outcome`` says
which state a run ends in. The daemon (roundpipe.coordinator.service.daemon) does the I/O around
it: it authenticates and validates requests, answers them, and runs the job thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from roundpipe.coordinator.service.figures import job_figures
from roundpipe.coordinator.service.jobstore import (
    JobStore,
    JobStoreError,
    StoredJob,
    interrupted_message,
)
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import OwnedDir, PathPolicy, check_ownership, modes
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.progress_log import ProgressLog, StoredProgress
from roundpipe.protocol import (
    FINAL_JOB_STATES,
    MAX_REPLY_BYTES,
    JobState,
    JobStatus,
    ProgressEvent,
)

if TYPE_CHECKING:
    from roundpipe.coordinator.training.trainer import Trainer

__all__ = [
    "MAX_TEXT_CHARS",
    "BadState",
    "JobBook",
    "JobRecord",
    "bounded_text",
    "outcome",
]

# What a stored job's spec is validated into (JobBook.validate_stored).
Validated = TypeVar("Validated")

log = logging.getLogger("roundpipe.coordinator")

PROGRESS_FILE = "progress.f64"
"""A job's history of its last run, in its job directory (``ProgressLog.write``)."""

MAX_TEXT_CHARS = 16 * 1024
"""Longest free text (an error, a job's message) in a reply; the rest is cut, and the
cut says how much was left out. A JobSpecError with 160,000 problems is 20 MB."""
PROGRESS_EVENT_BYTES = 64
"""Upper bound of one ProgressEvent's encoded size (six numbers: at most 55 bytes), so
a Progress page holds MAX_REPLY_BYTES // PROGRESS_EVENT_BYTES events."""


def bounded_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` if it has at most ``limit`` characters, else its beginning (cut at a line
    end where there is one) and a note of how many lines and characters were left out."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    cut = head.rfind("\n")
    if cut > limit // 2:
        head = head[:cut]
    rest = text[len(head) :]
    lines = rest.count("\n")
    what = f"{len(rest)} more characters" + (f", {lines} more lines" if lines else "")
    return f"{head}\n... ({what} not shown)"


@dataclass
class JobRecord:
    job_id: str
    # None: not built yet (validated in the admission child; the job thread builds it),
    # or a stored spec that no longer validates (see message)
    spec: JobSpec | None
    spec_dict: dict = field(default_factory=dict)
    state: JobState = "queued"
    message: str = ""
    output_dir: str | None = None
    trainer: Trainer | None = None
    total_steps: int = 0
    step: int = 0  # as of the last run / store update; the trainer's while running
    loss: float | None = None
    checkpoint_step: int | None = None
    plan: str | None = None  # the partition in use, as stored
    cancel_requested: bool = False
    log_path: Path | None = None
    submitted_at: float = field(default_factory=time.time)
    # The identity that submitted it: only it (and admins) may see or change the job.
    owner: str = ""
    # The events of the job's last run (the trainer's own log while it runs), in its
    # job directory once the run ended (PROGRESS_FILE; Note [compact progress history]).
    progress: ProgressLog | StoredProgress = field(default_factory=ProgressLog)
    # False for a job another node announced (coordinator.multinode): rank 0's store
    # holds it; this node shows it while it lives and never queues it on a restart.
    stored: bool = True
    # Its place among the jobs this coordinator lists (``JobBook.add``): ListJobs pages
    # by it, so that a job forgotten between two pages shifts no other.
    order: int = 0

    def status(self, waits_for: str = "") -> JobStatus:
        """``waits_for``: for a queued job, the jobs it waits for (JobBook.status)."""
        t = self.trainer
        # Until the trainer has restored its checkpoint, its step is 0: show the step the
        # job resumes from (kept in self.step) instead.
        live = t is not None and t.prepared
        # observability: throughput, bubble, optimizer lag, busy workers (service.figures)
        figures = job_figures(t) if live else None
        return JobStatus(
            job_id=self.job_id,
            state=self.state,
            step=t.step if live else self.step,
            total_steps=self.total_steps,
            loss=t.last_loss if live else self.loss,
            message=bounded_text(self._live_message(live, waits_for)),
            output_dir=self.output_dir,
            plan=self.plan or "",
            tokens_per_s=figures.tokens_per_s if figures else None,
            bubble_fraction=figures.bubble_fraction if figures else None,
            optimizer_lag_steps=figures.optimizer_lag_steps if figures else 0,
            worker_busy={str(w): b for w, b in figures.busy.items()} if figures else {},
        )

    def _live_message(self, live: bool, waits_for: str) -> str:
        """The status message: what a running or queued job waits for, if anything,
        else the job's message."""
        t = self.trainer
        if self.state == "queued" and waits_for:
            return f"{waits_for}; {self.message}" if self.message else waits_for
        if t is None or self.state != "running":
            return self.message
        if live and t.waiting_for_workers:
            return "waiting for a worker to connect (tasks parked)"
        # With a data-parallel group: the nodes it has been waiting for (and why).
        return t.waiting_on_group or self.message

    def progress_page(self, after_seq: int) -> tuple[list[ProgressEvent], bool]:
        """One reply's worth of progress events after ``after_seq``; whether more follow."""
        limit = MAX_REPLY_BYTES // PROGRESS_EVENT_BYTES
        t = self.trainer
        if t is not None:
            return t.progress_page(after_seq, limit)
        return self.progress.page(after_seq, limit)


class BadState(Exception):
    """A request that the job's state does not allow (e.g. resuming a succeeded job)."""


class JobBook:
    """The coordinator's jobs: records, the run queue, the store.

    Shares the daemon's lock (``lock``: it also guards the workers), so a request sees
    jobs and workers in one consistent state."""

    def __init__(
        self,
        state_dir: Path,
        paths: PathPolicy,
        lock: threading.RLock,
        store: JobStore | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.paths = paths
        self.store = store
        self._lock = lock
        self._wakeup = threading.Condition(lock)
        self._submitting = threading.Lock()
        self.jobs: dict[str, JobRecord] = {}
        self.queue: list[str] = []
        self.active: JobRecord | None = None
        """The job the job thread runs now."""
        self._next_order = 0
        self._forgotten: list[OwnedDir] = []
        """Directories of forgotten jobs, still their owners' (``forget``)."""

    def add(self, job: JobRecord) -> None:
        """List ``job`` after every job listed so far (a group follower's record of a job
        announced again goes to the end: ListJobs pages by the order). Under the lock."""
        job.order = self._next_order
        self._next_order += 1
        self.jobs.pop(job.job_id, None)  # assigning keeps a key's old place in the dict
        self.jobs[job.job_id] = job

    def status(self, job: JobRecord, viewer: str | None = None) -> JobStatus:
        """``job.status()``, saying what a queued job waits for: one job runs at a time.
        The job ahead is named only to ``viewer`` if it is theirs (None: an admin, who
        sees every job); another owner's is "another owner's job", as ``roundpipe jobs``
        does not list it to them either. Under the lock."""
        if job.state != "queued" or job.job_id not in self.queue:
            return job.status()
        ahead = self.queue.index(job.job_id)
        # Not the active job once it has ended (``finish`` sets its state first) or a
        # shutdown put it back in the queue.
        running = self.active if self.active and self.active.state == "running" else None
        if running is None and not ahead:
            return job.status("starts next")
        first = running or self.jobs[self.queue[0]]
        shown = (
            f"job {first.job_id}"
            if viewer is None or first.owner == viewer
            else "another owner's job"
        )
        others = ahead - (running is None)
        also = f" and {others} queued before it" if others else ""
        verb = "running" if running else "queued"
        return job.status(f"waits for {shown} ({verb}){also}: one job runs at a time")

    # -- loading ----------------------------------------------------------------------

    def load(self) -> None:
        """Jobs from the store: the one a restart or a stop cut off queued first, then
        the queued ones in the order they were queued (submitted, or resumed: a job's
        latest change of state is its move to the queue)."""
        assert self.store is not None
        interrupted = self.store.recover()
        self._forgotten = [OwnedDir(*row) for row in self.store.forgotten_dirs()]
        order: dict[str, tuple[bool, float, int]] = {}
        for seq, stored in enumerate(self.store.all()):
            cut_off = stored.job_id in interrupted or stored.message.startswith(SHUT_DOWN)
            order[stored.job_id] = (not cut_off, stored.updated_at, seq)
            job = self._record_from_store(stored)
            # (A queued job whose spec no longer validates fails below, with that reason;
            # a resume catches its checkpoint up.)
            if job.state == "queued" and job.spec is not None:
                # Interrupted by a crash, or stopped (SIGTERM) while a background
                # checkpoint was being written: that write may have completed after the
                # store last heard of one.
                self._catch_up_checkpoint(job)
                # (the stored step may be later, from a shutdown between checkpoints)
                self._back_to_checkpoint(job)
            self.add(job)
            if job.state == "queued":
                if job.spec is None:
                    self.set_state(job, "failed", job.message)
                else:
                    self.queue.append(job.job_id)
        self.queue.sort(key=order.__getitem__)
        if self.jobs:
            log.info(
                "[coordinator] job store %s: %d job(s), %d queued (%d interrupted by a restart)",
                self.store.path,
                len(self.jobs),
                len(self.queue),
                len(interrupted),
            )

    def _catch_up_checkpoint(self, job: JobRecord) -> None:
        """Take the checkpoint the trainer will resume from as the job's
        (``_checkpoint_on_disk``, then ``_take_checkpoint``)."""
        self._take_checkpoint(job, self._checkpoint_on_disk(job.job_id, job.output_dir))

    def build_spec(self, job_id: str, spec_dict: dict, output_dir: str | None) -> JobSpec:
        """A stored job's spec, built (its files checked again, as they may have changed
        since it was accepted); JobSpecError if it no longer validates. Built by
        ``validate_stored``'s rule for a spent ``model.resume_from``."""
        return self.validate_stored(
            job_id,
            spec_dict,
            output_dir,
            lambda spec: JobSpec.from_dict(self.paths.confine_spec(spec)),
        )

    def validate_stored(
        self,
        job_id: str,
        spec_dict: dict,
        output_dir: str | None,
        validate: Callable[[dict], Validated],
    ) -> Validated:
        """``validate(spec_dict)`` for a stored job; if that raises JobSpecError and the
        job has a checkpoint of its own, ``validate`` of the spec without its spent
        ``model.resume_from`` (``spent_resume_from``) instead. The job thread builds a
        job this way, and a resume checks one this way, so the two agree."""
        try:
            return validate(spec_dict)
        except JobSpecError:
            spent = self.spent_resume_from(job_id, spec_dict, output_dir)
            if spent is None:
                raise
        validated = validate(spent)
        log.warning(
            "[coordinator] job %s: its model.resume_from no longer validates, but it "
            "resumes from a checkpoint of its own and never reads that one again",
            job_id,
        )
        return validated

    def spent_resume_from(
        self, job_id: str, spec_dict: dict, output_dir: str | None
    ) -> dict | None:
        """``spec_dict`` without ``model.resume_from``, for a job that has a checkpoint of
        its own: the trainer resumes from that first (``Checkpointer.resume_source``), so
        the checkpoint the job started from was read and may have been removed or
        replaced since; its checks no longer apply. None: the spec has no
        ``resume_from``, or the job no intact checkpoint of its own. Reads every byte of
        its newest checkpoint: called only for a spec that failed to validate."""
        model = spec_dict.get("model")
        if not isinstance(model, dict) or not model.get("resume_from") or not output_dir:
            return None
        # By the trainer's own rule, checksums read (not ``likely_resume``'s sizes): with
        # every checkpoint of its own damaged, a job built without its source would
        # train from step 0 and succeed; it fails on that source instead.
        try:
            own = CheckpointDir(Path(output_dir) / "checkpoints").find_latest(job_id)
        except OSError as exc:
            log.warning("[coordinator] cannot look at %s's checkpoints: %s", job_id, exc)
            return None
        if own is None:
            return None
        return {**spec_dict, "model": {**model, "resume_from": None}}

    def _checkpoint_on_disk(self, job_id: str, output_dir: str | None) -> int | None:
        """The step of the checkpoint the trainer will resume ``job`` from, where the
        record may be behind or ahead of the disk: a crash can fall between a
        checkpoint's completion and its step reaching the store, a cancel can come
        before a finished background write is announced, and the newest can be damaged.
        By the trainer's rule (``CheckpointDir.find_latest``: the one ``latest`` names if
        it is this job's and intact, else the newest intact one of this job's), with
        files checked by size only (``likely_resume``; the trainer verifies checksums),
        so that the status and message name the step the job really resumes from, and a
        resumed job's progress is cut there (``resume``). None if none is found. Reads
        the disk: not under the lock, which the I/O thread shares."""
        if not output_dir:
            return None
        checkpoints = CheckpointDir(Path(output_dir) / "checkpoints")
        try:
            chosen = checkpoints.likely_resume(job_id)
        except OSError as exc:
            log.warning("[coordinator] cannot look at %s's checkpoints: %s", job_id, exc)
            return None
        return None if chosen is None else chosen.step

    def _take_checkpoint(self, job: JobRecord, step: int | None) -> None:
        """Record checkpoint ``step`` (from ``_checkpoint_on_disk``) as ``job``'s."""
        if step is None or step == job.checkpoint_step:
            return
        job.checkpoint_step = step
        job.message = interrupted_message(step)
        if self.store is None:
            return
        try:
            self.store.update(job.job_id, checkpoint_step=step, message=job.message)
        except JobStoreError as exc:
            log.error("[coordinator] cannot record checkpoint of %s: %s", job.job_id, exc)

    def _record_from_store(self, stored: StoredJob) -> JobRecord:
        spec, message = None, stored.message
        # A job in a final state never runs unless resumed, and a resume validates its
        # spec then: validating (reading the data of) every old job here would make a
        # long history cost minutes at every start.
        if stored.state not in FINAL_JOB_STATES:
            try:
                spec = self.build_spec(stored.job_id, stored.spec, stored.output_dir)
            except JobSpecError as exc:
                message = f"the job's spec is no longer valid: {exc}"
        return JobRecord(
            stored.job_id,
            spec,
            spec_dict=stored.spec,
            state=stored.state,  # type: ignore[arg-type]
            message=message,
            output_dir=stored.output_dir,
            total_steps=stored.total_steps,
            step=stored.step,
            loss=stored.loss,
            checkpoint_step=stored.checkpoint_step,
            plan=stored.plan,
            log_path=self.job_dir(stored.job_id) / "job.log",
            submitted_at=stored.created_at,
            owner=stored.owner,
            progress=StoredProgress(self.job_dir(stored.job_id) / PROGRESS_FILE),
        )

    def _back_to_checkpoint(self, job: JobRecord) -> None:
        """A job queued to continue from its checkpoint (resumed, or cut off by a
        restart): until it runs it shows that step and that step's loss (it showed a
        later step's beside the checkpoint's step), and its history ends there: the
        steps after it are trained again, and a client following the job from there
        (``roundpipe resume --wait``) sees them anew, under the same seq."""
        step = job.checkpoint_step or 0
        job.progress = job.progress.up_to(step)
        loss = job.progress.loss_at(step)
        if loss is None and job.step == step:
            # No history of that run (a crash writes none): the store's loss is that
            # step's when its step is (record_checkpoint)
            loss = job.loss
        job.step, job.loss = step, loss

    def job_dir(self, job_id: str) -> Path:
        return self.state_dir / "jobs" / job_id

    # -- transitions ------------------------------------------------------------------

    def set_state(
        self, job: JobRecord, state: JobState, message: str, *, strict: bool = False, **extra
    ) -> None:
        """Change a job's state in the store, then in memory. ``strict`` (a change a
        client asked for): if the store refuses it, JobStoreError and nothing changes;
        else the run goes on with the change logged as unrecorded."""
        t = job.trainer
        if t is not None and t.prepared:  # before, its step is 0, not the job's
            job.step, job.loss = t.step, t.last_loss
        if self.store is not None and job.stored:
            try:
                self.store.update(
                    job.job_id, state=state, message=message, step=job.step, loss=job.loss, **extra
                )
            except JobStoreError as exc:
                if strict:
                    raise
                log.error("[coordinator] cannot record job %s as %s: %s", job.job_id, state, exc)
        job.state, job.message = state, message

    def owned_dirs(self) -> list[OwnedDir]:
        """The directories each known job owns: its job directory (its log; the default
        output lies inside) and its output directory; and those forgotten jobs owned.
        Resolved now: a directory moved and linked from its old path stays protected."""
        with self._lock:
            jobs = list(self.jobs.values())
            forgotten = list(self._forgotten)
        # Reads the disk: not under the lock, which the I/O thread shares.
        out = [OwnedDir(os.path.realpath(d.path), d.owner, d.job_id) for d in forgotten]
        for job in jobs:
            out.append(OwnedDir(os.path.realpath(self.job_dir(job.job_id)), job.owner, job.job_id))
            if job.output_dir:
                out.append(OwnedDir(os.path.realpath(job.output_dir), job.owner, job.job_id))
        return out

    def submit(
        self, spec: JobSpec | None, spec_dict: dict, owner: str, *, admin: bool = False
    ) -> JobRecord:
        """A new queued job. Raises JobSpecError if its paths reach into another owner's
        job (coordinator.paths.check_ownership; ``admin``: the submitter may read those),
        JobStoreError if the store cannot record it (then it does not exist either)."""
        job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        job_dir = self.job_dir(job_id)
        out_dir = spec_dict["output"]["dir"]
        # Resolved, as the spec's paths are: the output must lie below a write root
        # even where the state directory is reached through a link.
        output = Path(out_dir) if out_dir else Path(os.path.realpath(job_dir)) / "output"
        steps = spec_dict["train"]["steps"]
        record = JobRecord(
            job_id,
            spec,
            spec_dict=spec_dict,
            total_steps=steps,
            output_dir=str(output),
            log_path=job_dir / "job.log",
            owner=owner,
        )
        assert self.store is not None
        # One submission at a time from the ownership check to the record: two owners
        # submitting the same output directory at once cannot both be accepted. (Not
        # the shared lock: the I/O thread must not wait for the store's disk write.)
        with self._submitting:
            check_ownership(spec_dict, owner, admin=admin, owned=self.owned_dirs())
            job_dir.mkdir(mode=modes().dir, parents=True, exist_ok=True)
            self.store.add(
                job_id, spec_dict, output_dir=str(output), total_steps=steps, owner=owner
            )
            with self._lock:
                self.add(record)
                self.queue.append(job_id)
                self._wakeup.notify_all()
        log.info("[coordinator] job %s of %s queued (%d steps)", job_id, owner, steps)
        return record

    def cancel(self, job: JobRecord) -> None:
        """Cancel: at once if the job waits (queued, paused); a running job's trainer is
        asked to stop and the job ends ``cancelled`` when it has. A job that has ended
        stays as it is, and BadState says so (docs/client.md: the caller is told, not
        answered as if a running job were stopping)."""
        with self._lock:
            if job.state in FINAL_JOB_STATES:
                raise BadState(
                    f"job {job.job_id} has already ended ({job.state}); nothing to cancel"
                )
            if job.state in ("queued", "paused"):
                where = "before it started" if job.state == "queued" else "while paused"
                # The store first (JobStoreError: nothing changed): recorded queued, it
                # would run after a restart though its owner was told it was cancelled.
                self.set_state(job, "cancelled", f"cancelled {where}", strict=True)
                job.cancel_requested = True
                if job.job_id in self.queue:
                    self.queue.remove(job.job_id)
                return
            job.cancel_requested = True
            trainer = job.trainer
        if trainer is not None:
            trainer.cancel()

    def forget(self, job: JobRecord) -> None:
        """Remove a job that has ended (succeeded, failed, cancelled) from the jobs the
        coordinator keeps: its record, its log and its progress history. Its output, and
        its job directory, stay its owner's (the store's ``forgotten_dirs``, resolved at
        every check as a listed job's are): another owner's job may not write there.
        Raises BadState for a job that has not ended, JobStoreError when the store
        cannot record it (then nothing changed)."""
        job_dir = self.job_dir(job.job_id)
        owned = [(str(job_dir), job.owner)]
        if job.output_dir:
            owned.append((job.output_dir, job.owner))
        assert self.store is not None
        # Under the lock from the check to the record's removal: a resume (the admission
        # thread) may not queue it in between.
        with self._lock:
            if self.jobs.get(job.job_id) is not job:
                raise BadState(f"job {job.job_id} was forgotten already")
            if job.state not in FINAL_JOB_STATES or self.active is job:
                raise BadState(_not_ended(job))
            # A follower's record is not in this node's store (rank 0's holds the job).
            self.store.forget(job.job_id, owned, stored=job.stored)  # a failure: no change
            del self.jobs[job.job_id]
            self._forgotten.extend(OwnedDir(path, owner, job.job_id) for path, owner in owned)
        for name in ("job.log", PROGRESS_FILE):
            with contextlib.suppress(OSError):
                (job_dir / name).unlink()
        with contextlib.suppress(OSError):  # not empty (the default output): it stays
            job_dir.rmdir()
        log.info("[coordinator] job %s forgotten (its output %s stays)", job.job_id, job.output_dir)

    def needs_spec_check_to_resume(self, job: JobRecord) -> bool:
        """Whether resuming ``job`` must validate its spec first (a stored job whose
        spec was not built: it may no longer be valid)."""
        with self._lock:
            return job.spec is None and job.state not in ("queued", "running", "succeeded")

    def resume(self, job: JobRecord) -> str | None:
        """Queue a stopped job again; returns where it continues (None: it is queued or
        running already, nothing to do). Raises BadState for a succeeded job."""
        on_disk = self._checkpoint_on_disk(job.job_id, job.output_dir)  # reads the disk:
        # before the lock
        with self._lock:
            if self.jobs.get(job.job_id) is not job:  # forgotten meanwhile
                raise BadState(f"job {job.job_id} was forgotten; submit it again")
            if job.state == "running" and job.cancel_requested:
                # Stopping, not going on: acknowledged, the resume was lost and the job
                # ended cancelled.
                raise BadState(
                    f"job {job.job_id} is being cancelled; resume it once it is cancelled "
                    f"(roundpipe status {job.job_id})"
                )
            if job.state in ("queued", "running"):
                # What the caller wants is already happening: a no-op, not an error (a
                # job resumed automatically after a coordinator restart is "queued" or
                # "running" before its owner thinks of resuming it).
                return None
            if job.state == "succeeded":
                raise BadState(
                    f"job {job.job_id} has already succeeded; to train further, submit a "
                    f"new job with model.resume_from: {job.output_dir} and a larger train.steps"
                )
            self._take_checkpoint(job, on_disk)
            where = (
                f"from checkpoint step {job.checkpoint_step}"
                if job.checkpoint_step
                else "from the start (it has no checkpoint)"
            )
            before = (job.cancel_requested, job.trainer, job.step, job.loss, job.progress)
            job.cancel_requested = False
            job.trainer = None
            self._back_to_checkpoint(job)
            try:  # the store first, as for a cancel
                self.set_state(job, "queued", f"resume requested; continues {where}", strict=True)
            except JobStoreError:
                job.cancel_requested, job.trainer, job.step, job.loss, job.progress = before
                raise
            self.queue.append(job.job_id)
            self._wakeup.notify_all()
        log.info("[coordinator] job %s queued again; it continues %s", job.job_id, where)
        return where

    def take_next(self, stop: threading.Event) -> JobRecord | None:
        """Block until a job is queued (None once ``stop`` is set); mark it running and
        active."""
        with self._lock:
            while not self.queue and not stop.is_set():
                self._wakeup.wait(timeout=1.0)
            if stop.is_set():
                return None
            job = self.jobs[self.queue.pop(0)]
            self.set_state(job, "running", job.message)
            self.active = job
            return job

    def wake(self) -> None:
        """Wake a ``take_next`` waiting for a job (e.g. to see its stop event)."""
        with self._lock:
            self._wakeup.notify_all()

    def record_plan(self, job: JobRecord, plan: str) -> None:
        job.plan = plan  # the trainer has logged it, with why
        if self.store is not None and job.stored:
            try:
                self.store.update(job.job_id, plan=job.plan)
            except JobStoreError as exc:
                log.error("[coordinator] cannot record the plan of %s: %s", job.job_id, exc)

    def record_checkpoint(self, job: JobRecord, step: int, loss: float | None) -> None:
        job.checkpoint_step = step
        job.step, job.loss = step, loss
        if self.store is not None and job.stored:
            try:
                self.store.update(job.job_id, checkpoint_step=step, step=job.step, loss=job.loss)
            except JobStoreError as exc:
                log.error("[coordinator] cannot record checkpoint of %s: %s", job.job_id, exc)

    def _store_progress(self, job: JobRecord) -> None:
        """Move the history of the run that ended from memory to the job's directory
        (Note [compact progress history]). If it cannot be written (a full disk), it
        stays in memory: nothing is lost until a restart."""
        history = job.progress
        job_dir = self.job_dir(job.job_id)
        if not isinstance(history, ProgressLog) or not job_dir.is_dir():
            return
        try:
            stored = history.write(job_dir / PROGRESS_FILE)
        except OSError as exc:
            log.warning(
                "[coordinator] job %s: cannot write its progress history to %s (%s); it "
                "is kept in memory until the coordinator restarts",
                job.job_id,
                job_dir,
                exc,
            )
            # An earlier run's file would be shown for this one after a restart.
            with contextlib.suppress(OSError):
                (job_dir / PROGRESS_FILE).unlink(missing_ok=True)
            return
        with self._lock:
            if job.progress is history:
                job.progress = stored

    def let_go(self, job: JobRecord) -> None:
        """Drop the job's trainer (and with it the run's memory); only its step, loss and
        progress events stay."""
        with self._lock:
            trainer = job.trainer
            if trainer is not None:
                if trainer.prepared:
                    job.step, job.loss = trainer.step, trainer.last_loss
                job.progress = trainer.progress_log
            job.trainer = None

    def finish(self, job: JobRecord, state: JobState, message: str) -> None:
        """The end of a run: the trainer let go (``let_go``), its history to its file
        (``_store_progress``), then its final state."""
        self.let_go(job)
        self._store_progress(job)
        self.set_state(job, state, message)
        with self._lock:
            if self.active is job:
                self.active = None


def _not_ended(job: JobRecord) -> str:
    """Why ``job`` cannot be forgotten yet, and what to do."""
    if job.state in FINAL_JOB_STATES:  # its run is still letting go
        return f"job {job.job_id} is just ending ({job.state}); forget it in a moment"
    if job.cancel_requested:
        return f"job {job.job_id} is being cancelled; forget it once it is cancelled"
    return (
        f"job {job.job_id} is {job.state}: only a job that has ended (succeeded, failed, "
        f"cancelled) can be forgotten; cancel it first (roundpipe cancel {job.job_id})"
    )


SHUT_DOWN = "interrupted by a coordinator shutdown"
"""How the message of a job a shutdown cut off begins (it runs first after the restart)."""


def outcome(job: JobRecord, error: BaseException | None, *, stopping: bool) -> tuple[JobState, str]:
    """The state a run of ``job`` ends in, and why: ``error`` is what the run raised
    (None: it finished), ``stopping`` whether the coordinator is shutting down."""
    if error is None:
        return "succeeded", f"model written to {job.output_dir}"
    if isinstance(error, JobCancelled):
        if job.cancel_requested or not stopping:
            return "cancelled", "cancelled by request"
        # The coordinator is stopping: the job is interrupted, not cancelled.
        where = (
            f"from checkpoint step {job.checkpoint_step}"
            if job.checkpoint_step
            else "from the start"
        )
        return "queued", f"{SHUT_DOWN}; resumes {where} on restart"
    if isinstance(error, JobPaused):
        return "paused", str(error)
    if isinstance(error, JobFailed):
        return "failed", str(error)
    return "failed", f"{type(error).__name__}: {error}"
