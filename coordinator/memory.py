"""Host memory a job needs, checked against the machine before anything is allocated.

A job's host memory is known before it exists (ARCHITECTURE.md section 9: "a job's
memory is checked against the machine before anything is allocated"):

* its arenas (``JobLayout.sizes``: weights in both parities, fp32 gradients, activation
  and gradient slots, the io arena, the event table), files under ``--arena-dir`` that
  take RAM (/dev/shm); GPU workers pin these same pages, so pinning adds nothing;
* the fp32 master weights of its trainable parameters and the two AdamW moments: 12
  bytes per trainable parameter, in the coordinator's own memory;
* the staging copy of one checkpoint's state, when checkpoints are written in the
  background (coordinator.snapshot; the trainer passes its size).

:func:`host_memory_needed` adds them up from a layout that has been planned but not
created; :func:`check_host_memory` refuses a job that does not fit what the machine has
available now (``psutil.virtual_memory().available``) or whose arenas do not fit the
arena directory's free space, with a message giving every figure. The trainer checks
before it creates the arenas; the coordinator's admission child checks the least any
plan needs (the whole model as one tail stage) at submit, so a hopeless job is refused
at once.

Not counted: a CPU worker's working memory while it runs a task (autograd's saved
tensors, in the worker process), and the weights the trainer loads once at start.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from roundpipe.coordinator.layout import JobLayout

__all__ = ["HostMemory", "InsufficientMemory", "check_host_memory", "host_memory_needed"]


class InsufficientMemory(RuntimeError):
    """The job needs more host memory (or arena space) than the machine has."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory one job takes while it runs."""

    arenas: int
    """Shared-memory arenas under the arena directory (all of ``JobLayout.sizes``)."""
    masters: int
    """fp32 master weights of the trainable parameters."""
    moments: int
    """AdamW exp_avg and exp_avg_sq of the trainable parameters."""
    staging: int = 0
    """One checkpoint's state, copied for the background writer (0: none)."""

    @property
    def total(self) -> int:
        return self.arenas + self.masters + self.moments + self.staging

    def describe(self) -> str:
        staging = f", checkpoint staging {_gib(self.staging)}" if self.staging else ""
        return (
            f"{_gib(self.total)} of host memory (arenas {_gib(self.arenas)}, fp32 masters "
            f"{_gib(self.masters)}, AdamW moments {_gib(self.moments)}{staging})"
        )


def host_memory_needed(layout: JobLayout, *, staging: int = 0) -> HostMemory:
    """What a job with this (planned, not yet created) layout takes in host memory, with
    ``staging`` bytes for background checkpoints."""
    trainable = layout.model.parameter_count(trainable_only=True)
    return HostMemory(
        arenas=layout.total_bytes, masters=4 * trainable, moments=8 * trainable, staging=staging
    )


def check_host_memory(
    need: HostMemory, arena_dir: str | os.PathLike[str] | None, *, what: str = "this job"
) -> None:
    """Raise InsufficientMemory unless ``need`` fits the memory available now and its
    arenas fit the free space of ``arena_dir`` (None: not checked)."""
    available = psutil.virtual_memory().available
    fix = (
        "use a shorter data.seq_len, a smaller batch.microbatch_size or fewer "
        "batch.num_microbatches, LoRA, or a machine with more memory"
    )
    if need.total > available:
        raise InsufficientMemory(
            f"{what} needs {need.describe()}, but only {_gib(available)} is available on "
            f"this machine; {fix}"
        )
    if arena_dir is None:
        return
    arena_free = shutil.disk_usage(Path(arena_dir)).free
    if need.arenas > arena_free:
        raise InsufficientMemory(
            f"{what} needs {_gib(need.arenas)} of arenas in {arena_dir}, which has "
            f"{_gib(arena_free)} free; {fix}, or give the arena directory more space"
        )
