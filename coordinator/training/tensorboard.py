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
from pathlib import Path

from roundpipe.protocol import ProgressEvent

__all__ = ["ScalarWriter"]

log = logging.getLogger(__name__)


class ScalarWriter:
    """Scalars to one TensorBoard event file directory."""

    def __init__(self, directory: Path, flush_secs: float = 5.0, first_step: int = 1) -> None:
        """``first_step``: the run's first step. A resumed run starts after its
        checkpoint (or at 1 without one; a new job may write where an old one did), and
        the run before logged steps from there: TensorBoard hides those (SummaryWriter's
        ``purge_step``), else each showed twice and curves went back."""
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(
            log_dir=str(directory),
            flush_secs=int(flush_secs),
            purge_step=first_step,
        )

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, float(value), global_step=step)

    def progress(self, event: ProgressEvent) -> None:
        self.scalar("train/loss", event.loss, event.step)
        self.scalar("train/learning_rate", event.lr, event.step)
        self.scalar("train/tokens_per_s", event.tokens_per_s, event.step)

    def close(self) -> None:
        self._writer.close()
