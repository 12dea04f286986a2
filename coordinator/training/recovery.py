"""Task bookkeeping that survives worker loss: dispatch, re-dispatch, retries, deadlines.

Workers hold no state, and every task is idempotent (Note [no rewrite after signal] in
roundpipe.worker.runtime), so losing a worker costs only the tasks it had not finished:
``TaskTracker`` re-sends them, as new attempts, to the workers that are left, and the job
continues. Why that cannot deadlock: workers run their queued tasks in task-id order and
yield a blocked task to a lower-numbered one (roundpipe.worker.daemon._TaskQueue), and the
task-id order is a topological order of the schedule's dependencies.

Three separate signals decide that a worker is gone (docs/fault-tolerance.md):

- its process is gone (same host: pid + start time checked every poll) -> at once;
- no heartbeat for ``worker_timeout_s`` (liveness; heartbeats come from the worker's I/O
  thread, so a long task never looks dead) -> lost, and fenced with SIGKILL when local;
- no task completed for the progress deadline while it has tasks in flight (a stuck
  kernel with a live I/O thread) -> lost and fenced. The deadline is ``deadline_factor`` x
  the slowest task time measured so far, never below ``deadline_floor_s``, counted from
  the worker's last completion or, if it was idle, from the task that ended its idleness.

A task that *fails* (the worker reports an exception) is retried on another worker (on
the same one when it is the only one) up to ``max_attempts`` times in all; then the job
fails with the task's error (e.g. out of memory for its stage), instead of retrying
forever. A failure the worker marks retryable is not the task's own: its worker was
stopping (a rolling restart of the workers), an input's producer died, a copy failed and
the worker exits. Those count against ``max_retryable_attempts`` instead, a bound against
a loop, not a verdict: three such in a row (a worker restarted under the same task three
times) failed a job that only waited on its workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from roundpipe.protocol import StageTask, TaskDone, TaskFailed, replace

__all__ = ["RecoveryPolicy", "TaskTracker", "TaskGaveUp"]

log = logging.getLogger(__name__)


class TaskGaveUp(RuntimeError):
    """A task failed ``max_attempts`` times; the message carries its last error."""


@dataclass(frozen=True)
class RecoveryPolicy:
    max_attempts: int = 3
    """Attempts per task when it *fails* (raises). Re-dispatch after worker loss is free."""
    max_retryable_attempts: int = 20
    """Failures per task that its worker marked retryable (TaskFailed.retryable: not the
    task's fault), counted apart from ``max_attempts``."""
    deadline_floor_s: float = 60.0
    """A worker with tasks in flight must complete one at least this often."""
    deadline_factor: float = 20.0
    """... or within this many times the slowest task measured so far, if larger."""


@dataclass
class _Entry:
    task: StageTask
    worker_id: int
    sent_at: float


@dataclass
class TaskTracker:
    """In-flight tasks of one job and where they run."""

    send: Callable[[StageTask, int], None]
    live_workers: Callable[[], list[int]]
    policy: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    in_flight: dict[int, _Entry] = field(default_factory=dict)
    parked: list[StageTask] = field(default_factory=list)
    failures: dict[int, int] = field(default_factory=dict)
    retryable_failures: dict[int, int] = field(default_factory=dict)
    slowest_task_s: float = 0.0
    recoveries: list[dict] = field(default_factory=list)
    _round_robin: int = 0
    _last_progress: dict[int, float] = field(default_factory=dict)

    # -- dispatch ---------------------------------------------------------------------

    def dispatch(self, task: StageTask) -> None:
        """Send ``task`` to the next live worker round-robin (park it if none is live)."""
        self._assign(task, self.live_workers())

    def dispatch_parked(self) -> int:
        """Send parked tasks once a worker is back; return how many went out."""
        if not self.parked or not self.live_workers():
            return 0
        parked, self.parked = self.parked, []
        for task in sorted(parked, key=lambda t: t.task_id):
            self.dispatch(task)
        return len(parked)

    @property
    def waiting_for_workers(self) -> bool:
        """Tasks are parked (no worker was live when they were to be sent).

        Deliberately does not call ``live_workers``: the daemon asks this while holding
        the lock that ``live_workers`` takes."""
        return bool(self.parked)

    # -- results ----------------------------------------------------------------------

    def completed(self, msg: TaskDone) -> _Entry | None:
        """Record a completion; None for a duplicate (a re-run finishing late)."""
        entry = self.in_flight.pop(msg.task_id, None)
        if entry is None:
            return None
        now = time.monotonic()
        self._last_progress[msg.worker_id] = now
        self.slowest_task_s = max(self.slowest_task_s, msg.seconds)
        for rec in self.recoveries:
            if rec.get("next_task_after_s") is None:
                rec["next_task_after_s"] = now - rec["lost_at"]
                # Parsed by the chaos harness (roundpipe.chaos): keep the wording.
                log.info(
                    "[recovery] first task completed %.3fs after worker %d was lost (%s)",
                    rec["next_task_after_s"],
                    rec["worker_id"],
                    rec["reason"],
                )
        return entry

    def failed(self, msg: TaskFailed) -> None:
        """Retry a failed task on another worker (the same one if it is the only one
        live), or raise TaskGaveUp after max_attempts."""
        entry = self.in_flight.pop(msg.task_id, None)
        if entry is None:
            return
        counts = self.retryable_failures if msg.retryable else self.failures
        limit = self.policy.max_retryable_attempts if msg.retryable else self.policy.max_attempts
        count = counts.get(msg.task_id, 0) + 1
        counts[msg.task_id] = count
        task = entry.task
        if count >= limit:
            kind = " in ways its workers called retryable" if msg.retryable else ""
            raise TaskGaveUp(
                f"task {task.task_id} ({task.kind} layers {task.layer_start}:{task.layer_stop}, "
                f"iteration {task.iteration}) failed {count} times{kind}; last on worker "
                f"{msg.worker_id}: {msg.error_type}: {msg.message}"
            )
        log.warning(
            "[recovery] task %d failed on worker %d (%s: %s%s); retry %d of %d",
            task.task_id,
            msg.worker_id,
            msg.error_type,
            msg.message,
            ", retryable" if msg.retryable else "",
            count,
            limit - 1,
        )
        # Another worker if there is one; the same one if it is the only one left (a
        # one-GPU job must still retry, or the task would wait for a worker that never
        # joins).
        self._redispatch([task], avoid=msg.worker_id, or_else_same=True)

    # -- worker loss ------------------------------------------------------------------

    def worker_lost(self, worker_id: int, reason: str) -> list[int]:
        """Re-dispatch the tasks ``worker_id`` had not finished; return their ids."""
        stranded = sorted(
            (e.task for e in self.in_flight.values() if e.worker_id == worker_id),
            key=lambda t: t.task_id,
        )
        for task in stranded:
            del self.in_flight[task.task_id]
        self._last_progress.pop(worker_id, None)
        self.recoveries.append(
            {
                "worker_id": worker_id,
                "reason": reason,
                "lost_at": time.monotonic(),
                "tasks": [t.task_id for t in stranded],
                "next_task_after_s": None,
            }
        )
        if stranded:
            log.warning(
                "[recovery] worker %d lost (%s): re-dispatching %d task(s): %s",
                worker_id,
                reason,
                len(stranded),
                [t.task_id for t in stranded],
            )
        self._redispatch(stranded, avoid=worker_id)
        return [t.task_id for t in stranded]

    def _redispatch(
        self, tasks: list[StageTask], *, avoid: int, or_else_same: bool = False
    ) -> None:
        for task in tasks:
            retry = replace(task, attempt=task.attempt + 1)
            live = self.live_workers()
            others = [w for w in live if w != avoid]
            self._assign(retry, others or ([avoid] if or_else_same and avoid in live else []))

    def _assign(self, task: StageTask, candidates: list[int]) -> None:
        """Send to the next candidate round-robin, or park the task if there is none."""
        if not candidates:
            self.parked.append(task)
            return
        worker_id = candidates[self._round_robin % len(candidates)]
        self._round_robin += 1
        now = time.monotonic()
        if not any(e.worker_id == worker_id for e in self.in_flight.values()):
            # Idle until now: its deadline runs from this task, not from its last
            # completion (a pause between iterations, a drained checkpoint, is no hang).
            self._last_progress[worker_id] = now
        self.in_flight[task.task_id] = _Entry(task, worker_id, now)
        self.send(task, worker_id)

    def excuse(self, seconds: float, now: float | None = None) -> None:
        """The coordinator stalled for ``seconds`` (Note [a stalled loop hears no
        heartbeat] in roundpipe.coordinator.service.daemon): completions waiting unread
        meanwhile are no worker's hang, so that time does not count against them."""
        now = time.monotonic() if now is None else now
        for worker, last in self._last_progress.items():
            self._last_progress[worker] = min(now, last + seconds)

    def hung_workers(self, now: float | None = None) -> list[int]:
        """Workers with tasks in flight that have not completed one within the deadline."""
        now = time.monotonic() if now is None else now
        deadline = max(
            self.policy.deadline_floor_s, self.policy.deadline_factor * self.slowest_task_s
        )
        busy = {e.worker_id for e in self.in_flight.values()}
        return [w for w in busy if now - self._last_progress.get(w, now) > deadline]
