"""The job thread (``rp-job``): runs the queued jobs one at a time, each through a
Trainer, and turns how each run ended into the job book's states
(roundpipe.coordinator.service.jobs).

A run: the job's log file opened, its share of the data-parallel group taken (if the
coordinator is a node of one), its spec built, a Trainer made; then it waits for a
worker, prepares, sends every worker the JobSetup, trains (tasks go out through
``_SocketPort``: the thread's PUSH socket to the I/O thread, which alone owns the
ROUTER), and exports the model. Whatever happens, the run ends with JobTeardown to every
worker, the run's memory released, and the job's final state in the book: ``outcome``
for what the trainer raised, ``_stopped_by`` for an error outside its own handling (an I/O
error that says the host ran out of something pauses the job instead of failing it).

On ranks other than 0 of a data-parallel group the thread runs what rank 0 announces
instead of the queue (docs/multi-node.md).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import zmq

from roundpipe.coordinator.service.jobs import JobBook, JobRecord, outcome
from roundpipe.coordinator.service.workers import WorkerTable
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.paths import PathPolicy, modes
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.job_events import (
    CheckpointWritten,
    JobEvent,
    PlanChosen,
)
from roundpipe.coordinator.training.memory import release_freed_memory
from roundpipe.coordinator.training.multinode import (
    GroupError,
    JobAnnouncement,
    JobGroup,
    NodeGroup,
)
from roundpipe.coordinator.training.recovery import RecoveryPolicy
from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.protocol import JobState, JobTeardown, Message, StageTask, encode

__all__ = ["JobRunner"]

log = logging.getLogger("roundpipe.coordinator")


class JobRunner:
    """What the job thread needs of the coordinator, and the thread's loops. ``run`` is
    the thread's body; it returns when the coordinator stops."""

    def __init__(
        self,
        book: JobBook,
        workers: WorkerTable,
        lock: threading.RLock,
        *,
        ctx: zmq.Context,
        outbox: str,
        stopping: threading.Event,
        on_group_lost: Callable[[str], None],
        group: NodeGroup | None,
        paths: PathPolicy,
        arena_dir: Path,
        namespace: str,
        wait_timeout_s: float,
        task_deadline_s: float = 60.0,
    ) -> None:
        self.book = book
        self.workers = workers
        self._lock = lock  # the daemon's: guards the book and the workers
        self.ctx = ctx
        self.outbox = outbox
        """The I/O thread's inproc PULL address: messages to workers go through it."""
        self._stop = stopping
        self.on_group_lost = on_group_lost
        """Called (with why) when a follower loses rank 0: the daemon then stops."""
        self.group = group
        self.paths = paths
        self.arena_dir = arena_dir
        self.namespace = namespace
        self.wait_timeout_s = wait_timeout_s
        self.task_deadline_s = task_deadline_s

    def run(self) -> None:
        if self.group is not None and not self.group.leader:
            self._follower_loop()
        else:
            self._job_loop()

    def _job_loop(self) -> None:
        """Rank 0, or a coordinator alone: run the queued jobs one at a time."""
        push = self.ctx.socket(zmq.PUSH)
        push.connect(self.outbox)
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
        push.connect(self.outbox)
        try:
            while not self._stop.is_set():
                try:
                    announcement = self.group.next_job(self._stop.is_set)
                except GroupError as exc:
                    log.error("[coordinator] the data-parallel group is gone: %s; stopping", exc)
                    self.on_group_lost(str(exc))
                    return
                if announcement is None:
                    return
                try:
                    job = self._follower_job(announcement)
                except Exception as exc:  # e.g. its directory cannot be made
                    log.exception("[coordinator] job %s cannot run here", announcement.job_id)
                    self._refuse_announcement(announcement, exc)
                    continue
                with self._lock:
                    self.book.add(job)
                    self.book.active = job
                try:
                    self._run_job(job, push, announcement)
                except Exception as exc:  # this thread must outlive any one job
                    log.exception("[coordinator] running job %s failed", job.job_id)
                    if job.state == "running":
                        self.book.finish(job, *_stopped_by(job, exc))
        finally:
            push.close(linger=1000)

    def _refuse_announcement(self, announcement: JobAnnouncement, exc: BaseException) -> None:
        """A job this node cannot even start: it still joins the job's group, then leaves
        it. Every node must create each job's process groups in the same order (torch
        pairs them by count): a node that skipped one would pair every later job's groups
        with the wrong ones, and every later job would pause."""
        assert self.group is not None
        try:
            job_group = self.group.join_job(announcement)
        except (GroupError, RuntimeError) as join_exc:
            log.error(
                "[coordinator] job %s: cannot join its group: %s", announcement.job_id, join_exc
            )
            return
        job_group.leave(f"failed: node {self.group.rank} cannot run it: {exc}")
        job_group.close()

    def _follower_job(self, announcement: JobAnnouncement) -> JobRecord:
        """The record of a job rank 0 announced: its outputs (none but the log: rank 0
        writes checkpoints and the model) go below this node's state directory."""
        job_dir = self.book.job_dir(announcement.job_id)
        job_dir.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        output = Path(os.path.realpath(job_dir)) / "node-output"
        spec = dict(announcement.spec)
        spec["output"] = {**dict(spec.get("output") or {}), "dir": str(output)}
        # Rank 0 alone restores a checkpoint and sends the others its state
        # (Trainer.prepare): a follower never reads model.resume_from, which need not
        # be on this node (or anywhere, once the job has checkpoints of its own).
        spec["model"] = {**dict(spec.get("model") or {}), "resume_from": None}
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

    def _broadcast(self, push: zmq.Socket, message: Message) -> None:
        frames = encode(message)
        for identity in self.workers.identities():
            push.send_multipart([identity, *frames])

    def _run_job(
        self, job: JobRecord, push: zmq.Socket, announcement: JobAnnouncement | None = None
    ) -> None:
        """Run one job on the job thread: build its trainer, prepare, train, export; the
        book (coordinator.jobs) records the state it ends in. ``announcement``: a job
        rank 0 of the data-parallel group announced (this node is a follower)."""
        # The group first: every node creates each job's process groups in the same
        # order, whatever happens to the job on this node (_refuse_announcement).
        try:
            job_group = self._job_group(job, announcement)
        except (GroupError, RuntimeError) as exc:
            self.book.finish(job, "paused", f"the data-parallel group cannot run it: {exc}")
            return
        try:
            handler = _job_log_handler(job)
        except OSError as exc:  # e.g. out of descriptors: the job never started
            self.book.finish(job, *_stopped_by(job, exc))
            if job_group is not None:  # the other nodes stop waiting for this one
                job_group.leave(f"{job.state}: {job.message}")
                job_group.close()
            return

        def on_event(event: JobEvent) -> None:
            if isinstance(event, PlanChosen):
                self.book.record_plan(job, str(event.plan))
            elif isinstance(event, CheckpointWritten):
                self.book.record_checkpoint(job, event.step, event.loss)

        try:
            if job.spec is None:
                # Validated at submission, in the admission child; built (and so checked
                # again: its files may have changed since) here, off the I/O thread.
                job.spec = self.book.build_spec(job.job_id, job.spec_dict, job.output_dir)
            trainer = Trainer(
                job.job_id,
                job.spec,
                arena_dir=self.arena_dir,
                namespace=self.namespace,
                output_dir=Path(job.output_dir or "."),
                wait_timeout_s=self.wait_timeout_s,
                recovery_policy=RecoveryPolicy(deadline_floor_s=self.task_deadline_s),
                paths=self.paths,
                on_event=on_event,
                group=job_group,
            )
        except Exception as exc:  # the job never started
            if isinstance(exc, JobSpecError):
                self.book.finish(job, "failed", f"the job's spec is no longer valid: {exc}")
            else:
                log.exception("[coordinator] job %s could not start", job.job_id)
                self.book.finish(job, *_stopped_by(job, exc))
            if job_group is not None:  # the other nodes stop waiting for this one
                job_group.leave(f"{job.state}: {job.message}")
                job_group.close()
            logging.getLogger("roundpipe").removeHandler(handler)
            handler.close()
            return
        # Replaced by None when the run finishes, or by what it raised.
        error: BaseException | None = RuntimeError("the job thread stopped unexpectedly")
        try:
            # Under the lock the daemon's stop takes too: a stop (SIGTERM) while the spec
            # was built (its data read: minutes) either sees this trainer and cancels it,
            # or is seen here. Before, the job trained on after the I/O loop had ended,
            # and the coordinator hung on its socket until systemd killed it.
            with self._lock:
                job.trainer = trainer
                if job.cancel_requested or self._stop.is_set():
                    raise JobCancelled("cancelled")
            if not self.workers.live():
                log.info("[coordinator] job %s waits for a worker to connect", job.job_id)
                # Its status says so (it showed "running 0/N" and nothing more); cleared,
                # or replaced by where it resumed from, once it starts.
                self.book.set_state(job, "running", "waiting for a worker to connect")
                if job_group is not None:  # the other nodes wait for this one: say why
                    job_group.set_note("no worker connected to its coordinator")
                while not self.workers.live():
                    if self._stop.wait(0.2) or job.cancel_requested:
                        raise JobCancelled("cancelled before any worker connected")
                    trainer.check_group()  # e.g. rank 0 cancelled it meanwhile
                if job_group is not None:
                    job_group.set_note(None)
            trainer.prepare(len(self.workers.live()), self.workers.hardware())
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
            trainer.run(_SocketPort(self.workers, push))
            if job_group is None or job_group.leader:  # rank 0 alone writes the model
                trainer.export(Path(job.output_dir or "."))
            trainer.end_with_group()  # the others succeed once rank 0 has
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
            try:  # it lets go of each part and logs what failed; nothing may skip the rest
                trainer.close()
            except Exception:
                log.exception("[coordinator] job %s: closing its trainer failed", job.job_id)
            if job_group is not None:
                job_group.close()
            # Release the job's memory (masters, AdamW moments, checkpoint staging, dataset,
            # model) before its end is announced: a client that sees the final state sees
            # the memory given back too. Only its step, loss and progress events stay.
            self.book.let_go(job)
            trainer = None
            _drop_tracebacks(error)  # their frames hold the job's tensors and arena views
            release_freed_memory()
            self.book.finish(job, state, message)
            self.workers.forget_job(job.job_id)
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

    def __init__(self, workers: WorkerTable, push: zmq.Socket) -> None:
        self.workers = workers
        self.push = push

    def send_task(self, task: StageTask, worker_id: int) -> None:
        identity = self.workers.identity(worker_id)
        if identity is None:
            # The worker was declared lost between the trainer's look at the worker
            # list and now; its WorkerLost is queued for the trainer, which then
            # re-dispatches this task with the worker's others.
            log.info("[coordinator] task %d not sent: worker %d is gone", task.task_id, worker_id)
            return
        self.workers.assign(task.job_id, task.task_id, worker_id)
        self.push.send_multipart([identity, *encode(task)])

    def live_workers(self) -> list[int]:
        return self.workers.live()

    def fence(self, worker_id: int, reason: str) -> None:
        self.workers.fence(worker_id, reason)

    def stalled_s(self) -> float:
        return self.workers.stalled_s


def _drop_tracebacks(error: BaseException | None) -> None:
    """Cut the tracebacks of ``error`` and the exceptions it chains: their frames hold a
    failed job's trainer, its tensors and its arenas' views, which would otherwise stay
    (the arenas' pages in /dev/shm too) while the error is kept for the job's end."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


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
