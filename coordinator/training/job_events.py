"""The seam between a job's trainer and the daemon around it: typed events both ways.

A ``Trainer`` (roundpipe.coordinator.training.trainer) is socket-free. What it needs from the
outside world, and what it tells it, crosses here and nowhere else:

* into the trainer, through its ``inbox``: the workers' results (``TaskDone``,
  ``TaskFailed``, protocol messages) and the ``InboxEvent``s below (a worker joined or
  was lost, a wake-up, a background checkpoint settled);
* out of the trainer: the ``JobEvent``s below, given to the one ``on_event`` callable
  the trainer was built with (the plan chosen, a checkpoint written);
* the actions the trainer takes on workers go through a ``WorkerPort`` that ``run``
  receives: send a task, list the live workers, fence a worker that stopped making
  progress.

The service's job thread (roundpipe.coordinator.service.job_runner) implements the port with
the daemon's sockets; tests
and benchmarks implement it with in-process workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from roundpipe.protocol import StageTask
    from roundpipe.shared.plan import Plan

__all__ = [
    "CheckpointSettled",
    "CheckpointWritten",
    "InboxEvent",
    "JobEvent",
    "PlanChosen",
    "Wakeup",
    "WorkerJoined",
    "WorkerLost",
    "WorkerPort",
]


# --------------------------------------------------------------------- into the trainer


@dataclass(frozen=True)
class WorkerJoined:
    """A worker registered (and received the job's setup): parked tasks can go out."""

    worker_id: int


@dataclass(frozen=True)
class WorkerLost:
    """A worker is gone (process exited, heartbeats stopped, fenced): its tasks are sent
    again to the others (roundpipe.coordinator.training.recovery)."""

    worker_id: int
    reason: str


@dataclass(frozen=True)
class Wakeup:
    """Nothing to handle: the run loop looks again at what it checks between messages
    (a cancel request, an optimizer error). ``why`` is for the reader of a debugger."""

    why: str


@dataclass(frozen=True)
class CheckpointSettled:
    """A background checkpoint was written or could not be (roundpipe.coordinator.training.snapshot;
    sent by its writer thread): the run loop announces it (``CheckpointWritten``) or
    stops the job with the reason."""


InboxEvent = WorkerJoined | WorkerLost | Wakeup | CheckpointSettled


# ------------------------------------------------------------------- out of the trainer


@dataclass(frozen=True)
class PlanChosen:
    """The job's plan, when it is first chosen and whenever it changes."""

    plan: Plan
    why: str


@dataclass(frozen=True)
class CheckpointWritten:
    """A checkpoint after ``step`` is published (atomically, verified) at ``path``."""

    step: int
    path: Path
    loss: float | None


JobEvent = PlanChosen | CheckpointWritten


class WorkerPort(Protocol):
    """What a trainer does to workers; implemented by whoever owns them."""

    def send_task(self, task: StageTask, worker_id: int) -> None:
        """Send ``task`` to ``worker_id``. A worker that is gone by now is not an error:
        its loss arrives as ``WorkerLost`` and its tasks are sent again."""

    def live_workers(self) -> list[int]:
        """The ids of the workers connected now."""

    def fence(self, worker_id: int, reason: str) -> None:
        """Make sure a worker that stopped making progress is dead and no longer listed."""

    def stalled_s(self) -> float:
        """Seconds the owner's message loop has stalled so far (frozen, paused, starved):
        the trainer does not count them as its workers' lack of progress."""
