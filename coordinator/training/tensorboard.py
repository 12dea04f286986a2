"""TensorBoard scalars of a job (``output.tensorboard: true``).

Written with ``torch.utils.tensorboard.SummaryWriter`` to ``<output>/tensorboard``, so
``tensorboard --logdir <output>`` shows the run as other fine-tuning tools do. Tags:

    train/loss, train/learning_rate, train/tokens_per_s   every step (ProgressEvent)
    train/grad_norm                                       every step: the global L2 norm
                                                          of the step's gradients
    pipeline/bubble_fraction                              every step, once measured
                                                          (roundpipe.coordinator.training.timeline)

The writer flushes in the background every few seconds (SummaryWriter's own thread);
nothing here blocks the training loop on the disk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from roundpipe.protocol import ProgressEvent

__all__ = ["ScalarWriter"]

log = logging.getLogger(__name__)


class ScalarWriter:
    """Scalars to one TensorBoard event file directory. An aid, like the trace: a write
    that fails (a full disk) is logged once and the scalars stop; the job goes on (its
    checkpoints report a full disk themselves)."""

    def __init__(
        self,
        directory: Path,
        flush_secs: float = 5.0,
        first_step: int = 1,
        *,
        job_id: str = "",
        shown: Callable[[object], str] = str,
    ) -> None:
        """``first_step``: the run's first step. A resumed run starts after its
        checkpoint (or at 1 without one; a new job may write where an old one did), and
        the run before logged steps from there: TensorBoard hides those (SummaryWriter's
        ``purge_step``), else each showed twice and curves went back. ``shown``: a path
        or message as the user knows it (JobOutput.shown)."""
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self.job_id = job_id
        self._shown = shown
        self._lock = threading.Lock()
        self._writer: SummaryWriter | None = SummaryWriter(
            log_dir=str(directory),
            flush_secs=int(flush_secs),
            purge_step=first_step,
        )

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars({tag: value}, step)

    def progress(self, event: ProgressEvent) -> None:
        self.scalars(
            {
                "train/loss": event.loss,
                "train/learning_rate": event.lr,
                "train/tokens_per_s": event.tokens_per_s,
            },
            event.step,
        )

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Several scalars of one step, under one taking of the lock."""
        # The run loop and the optimizer thread both write: one lock, so that one of them
        # failing stops the writer once, under the other too.
        with self._lock:
            for tag, value in values.items():
                if self._writer is None:
                    return
                try:
                    # SummaryWriter writes in a thread of its own; the OSError it met
                    # there is raised here, at the next scalar (or at close)
                    self._writer.add_scalar(tag, float(value), global_step=step)
                except OSError as exc:
                    self._stop(exc)

    def close(self) -> None:
        with self._lock:
            writer, self._writer = self._writer, None
            if writer is None:
                return
            try:
                writer.close()
            except OSError as exc:
                self._warn(exc)

    def _stop(self, exc: OSError) -> None:
        """Under the lock: log once, and stop writing."""
        self._warn(exc)
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()  # its thread's error again, or the last events' flush
        except OSError:
            pass

    def _warn(self, exc: OSError) -> None:
        log.warning(
            "[timeline] job %s: cannot write TensorBoard scalars to %s (%s); the job goes on "
            "without them",
            self.job_id,
            self._shown(self.directory),
            self._shown(exc),
        )
