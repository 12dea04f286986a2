"""A job's progress events (one per step reported), shared between the threads that
read them.

The run loop appends; the service pages through them from its own threads; a checkpoint
stores them in its manifest as rows (``rows``) and a resumed job, or a node of a group
starting from rank 0's state, reads them back (``replace``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from roundpipe.coordinator.training.job_events import progress_page
from roundpipe.protocol import ProgressEvent

__all__ = ["ProgressLog"]


class ProgressLog:
    """The progress events of one job, in step order; every method is thread-safe."""

    def __init__(self) -> None:
        self.events: list[ProgressEvent] = []
        """Appended under the lock; read with ``page`` / ``recent`` from other threads."""
        self._lock = threading.Lock()

    def append(self, event: ProgressEvent) -> None:
        with self._lock:
            self.events.append(event)

    def replace(self, rows: Iterable[Sequence[float]]) -> None:
        """Start over from ``rows`` (as ``rows`` gives them: a checkpoint's, rank 0's)."""
        events = _events_from_rows(rows)
        with self._lock:
            self.events = events

    @property
    def last_loss(self) -> float | None:
        """The loss of the newest event (None: no step reported yet)."""
        with self._lock:
            return self.events[-1].loss if self.events else None

    def page(self, after_seq: int, limit: int) -> tuple[list[ProgressEvent], bool]:
        """Up to ``limit`` events after ``after_seq``, in seq order, and whether more
        follow."""
        with self._lock:
            return progress_page(self.events, after_seq, limit)

    def recent(self, n: int) -> list[ProgressEvent]:
        """The newest ``n`` events."""
        with self._lock:
            return self.events[-n:]

    def loss_at(self, step: int) -> float | None:
        """The loss reported for ``step`` (a background checkpoint is announced after
        later steps have run)."""
        with self._lock:
            for event in reversed(self.events):
                if event.step == step:
                    return event.loss
        return None

    def rows(self, up_to: int | None = None) -> list[list[float]]:
        """The events (of steps up to ``up_to``) as a checkpoint manifest stores them
        (one list per step)."""
        with self._lock:
            return [
                [e.step, e.loss, e.tokens_per_s, e.lr, e.time, e.optimizer_s]
                for e in self.events
                if up_to is None or e.step <= up_to
            ]


def _events_from_rows(rows: Iterable[Sequence[float]]) -> list[ProgressEvent]:
    """``ProgressLog.rows`` read back (from a checkpoint, or from rank 0)."""
    return [
        ProgressEvent(
            seq=int(p[0]),
            step=int(p[0]),
            loss=p[1],
            tokens_per_s=p[2],
            lr=p[3],
            time=p[4],
            optimizer_s=p[5] if len(p) > 5 else 0.0,  # older checkpoints: not recorded
        )
        for p in rows
    ]
