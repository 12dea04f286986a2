"""A running job's figures, read off its Trainer at one moment: throughput, step time,
optimizer lag, bubble, per-worker busy share and bytes moved, retried tasks, and the task
each worker runs now.

``roundpipe status`` (roundpipe.coordinator.service.jobs), ``roundpipe workers`` and the
Prometheus metrics (roundpipe.coordinator.service.metrics, through the daemon's snapshot)
all read them here, so they always agree. Nothing is counted on the hot paths for this:
the figures are read when someone asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roundpipe.coordinator.training.timeline import stage_label

if TYPE_CHECKING:
    from roundpipe.coordinator.training.trainer import Trainer

__all__ = ["JobFigures", "current_tasks", "job_figures"]


@dataclass
class JobFigures:
    """A running job's figures, read at one moment."""

    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    """Seconds between the last two reported steps."""
    optimizer_lag_steps: int = 0
    """Steps the pipeline has finished that the optimizer has not yet applied."""
    optimizer_lag_s: float | None = None
    """For the newest step the optimizer applied: seconds from the pipeline finishing
    it to the optimizer finishing it (0 when the optimizer kept up)."""
    bubble_fraction: float | None = None
    """Measured bubble fraction of the newest settled step."""
    busy: dict[int, float] = field(default_factory=dict)
    """Per worker: busy fraction over the newest settled step."""
    upload_bytes: dict[int, int] = field(default_factory=dict)
    download_bytes: dict[int, int] = field(default_factory=dict)
    task_retries: int = 0
    """Tasks sent again: after a failure or with a lost worker's tasks."""
    loss_scale: float | None = None
    """float16 loss scaling: the newest scale, which the next step to be given one gets
    (at staleness 1, the step after the next: Note [dynamic loss scaling]); None: no
    scaling."""
    skipped_steps: int = 0
    """Steps loss scaling skipped in this run (their gradients overflowed)."""


def job_figures(trainer: Trainer) -> JobFigures:
    """Read a trainer's figures (any thread; no locks held long)."""
    spec = trainer.spec
    figures = JobFigures(step=trainer.step, total_steps=spec.train.steps, loss=trainer.last_loss)
    # This run's steps only: a resumed trainer's log starts with the checkpoint's events,
    # and the time between the last of them and its first step is the job's downtime.
    last_two = [e for e in trainer.recent_progress(2) if e.step > trainer.start_step]
    if last_two:
        figures.lr = last_two[-1].lr
        figures.tokens_per_s = last_two[-1].tokens_per_s
        if len(last_two) == 2:
            figures.step_s = max(0.0, last_two[1].time - last_two[0].time)
        elif last_two[-1].tokens_per_s > 0:
            tokens = spec.global_batch_size * spec.data.seq_len
            figures.step_s = tokens / last_two[-1].tokens_per_s
    timeline = trainer.timeline
    if trainer.prepared:
        figures.optimizer_lag_steps = max(0, trainer.step - timeline.optimizer_step)
    figures.optimizer_lag_s = timeline.latest_optimizer_lag_s
    figures.bubble_fraction = timeline.latest_bubble
    figures.busy = dict(timeline.latest_busy)
    for worker, (_, up, down) in timeline.worker_totals().items():
        figures.upload_bytes[worker] = up
        figures.download_bytes[worker] = down
    scaler = trainer.loss_scaler if trainer.prepared else None
    if scaler is not None:  # read without a lock: two ints, each written whole
        figures.loss_scale = float(2**scaler.exponent)
        figures.skipped_steps = scaler.skipped
    tracker = trainer.tracker
    if tracker is not None:
        failures = list(tracker.failures.values())
        recoveries = list(tracker.recoveries)
        figures.task_retries = sum(failures) + sum(len(r["tasks"]) for r in recoveries)
    return figures


def current_tasks(trainer: Trainer | None) -> dict[int, str]:
    """Per worker, the oldest task it was sent and has not finished (the one it runs:
    a worker runs its tasks in order), e.g. ``"step 12 B1 [0:2]"``."""
    if trainer is None or trainer.tracker is None or trainer.layout is None:
        return {}
    tracker = trainer.tracker
    oldest: dict[int, object] = {}
    for entry in list(tracker.in_flight.values()):
        held = oldest.get(entry.worker_id)
        if held is None or entry.task.task_id < held.task.task_id:  # type: ignore[attr-defined]
            oldest[entry.worker_id] = entry
    plan = trainer.plan
    out = {}
    for worker, entry in oldest.items():
        t = entry.task  # type: ignore[attr-defined]
        label = stage_label(plan, t.kind, t.layer_start, t.layer_stop)
        out[worker] = f"step {t.iteration} {label} [{t.layer_start}:{t.layer_stop}]"
    return out
