"""A job whose training diverged stops, keeping the checkpoints from before it.

Note [diverged training]
~~~~~~~~~~~~~~~~~~~~~~~~
A loss or a weight that is not finite (nan, inf) never comes back: every later step
trains on it. Unchecked, a diverged job (a learning rate too high, an overflow) ran on to
its last step, wrote each later checkpoint with nan weights, pruned the good ones to
``output.keep_last``, exported a nan model and reported success; on a run of days, all
of it after the step that diverged was lost, the last good checkpoint included. So the
job fails at the first sign, and the checkpoints it keeps are all finite:

* a step whose loss is not finite fails the job as it is reported (the loss is the
  group's: every node stops at the same step), before the background writer may write
  that step's checkpoint (it waits for the report), and after one of an earlier step
  that it is writing (``Diverged``); with a group, every node waits there until rank 0
  has written it (``kept_after_divergence``: a node that left at once made rank 0 pause
  the job and abandon that write);
* a checkpoint whose fp32 masters are not all finite is not written: a gradient that
  overflowed while the loss stayed finite (``float16`` with ``train.loss_scale: none``;
  or one outsized batch) is found at the next checkpoint at the latest, and the final
  checkpoint comes before the export. Its cost is one read of the masters per
  checkpoint, which writes them anyway.

The message names the step, the checkpoint kept (the newest this run wrote or resumed
from) and what to change before continuing from it with ``model.resume_from``, where the
learning rate and clipping may differ from the checkpoint's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.job_errors import JobFailed, JobPaused
from roundpipe.coordinator.training.job_output import JobOutput
from roundpipe.coordinator.training.multinode import GroupError
from roundpipe.coordinator.training.snapshot import BackgroundCheckpoints, LayerState

if TYPE_CHECKING:
    from roundpipe.coordinator.training.multinode import JobGroup

__all__ = ["Diverged", "check_loss", "check_masters", "kept_after_divergence"]


class Diverged(Exception):
    """Step ``step``'s loss is not finite. Raised as the step is reported; the run loop
    lets a checkpoint of an earlier step that is being written finish (the newest good
    state), then fails the job with ``message``."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"step {step}'s loss is {loss}")
        self.step, self.loss = step, loss

    def message(self, spec: JobSpec, kept: tuple[int, Path] | None) -> str:
        """The job's failure: ``kept`` is the checkpoint it can continue from (step,
        path), or None."""
        return (
            f"step {self.step}'s loss is {self.loss}: training diverged, and every later "
            "step would train on weights that are not finite. The job stops here; "
            + _continue_from(spec, kept)
        )


def check_loss(step: int, loss: float) -> None:
    """Raise Diverged if ``step``'s reported loss is not finite."""
    if not math.isfinite(loss):
        raise Diverged(step, loss)


class Settling(Protocol):
    """What ``kept_after_divergence`` needs of the Checkpointer (which calls
    ``check_masters``: typed here without importing it)."""

    background: BackgroundCheckpoints | None
    output: JobOutput

    def settle_background(self) -> None: ...


def kept_after_divergence(
    step: int,
    checkpointer: Settling,
    handle_next: Callable[[], None],
    group: JobGroup | None,
) -> tuple[int, Path] | None:
    """In the run loop, once step ``step``'s loss diverged: let a checkpoint of an earlier
    step that is being written finish (``handle_next`` drives the pipeline and the
    optimizer meanwhile), and return the checkpoint the job keeps (step, path).

    With a group, every node stops at this step (the loss is the group's) and the nodes
    wait for each other here before any leaves: a node that left at once would stop
    rank 0 in the middle of writing its checkpoint (the group pauses when a node
    leaves). Rank 0 writes the checkpoints, so every node names rank 0's. The job fails
    whatever happens meanwhile (a full disk, a lost node): resumed, it would diverge
    again."""
    background = checkpointer.background
    try:
        while background is not None and background.busy_before(step):
            handle_next()
        checkpointer.settle_background()
    except (JobPaused, JobFailed):  # logged where raised; the divergence is the failure
        pass
    kept = checkpointer.output.kept()
    if group is None:
        return kept
    mine = json.dumps(None if kept is None else [kept[0], str(kept[1])])
    try:
        told = group.exchange(f"diverged/{step}", mine, f"every node stopping at step {step}")
    except (GroupError, InterruptedError):  # a node lost meanwhile: this node's own record
        return kept
    leader = json.loads(told[0])
    return None if leader is None else (int(leader[0]), Path(leader[1]))


def check_masters(
    step: int, state: LayerState, spec: JobSpec, kept: tuple[int, Path] | None
) -> None:
    """Raise JobFailed, naming the first tensor, if the fp32 masters (``master/NAME``)
    of checkpoint ``step``'s ``state`` are not all finite."""
    for layer in sorted(state):
        for name, tensor in state[layer].items():
            if name.startswith("master/") and not bool(torch.isfinite(tensor).all()):
                raise JobFailed(
                    f"the weights after step {step} are not finite (layer {layer}, {name}) "
                    "though every loss so far was: a gradient overflowed, so the job stops "
                    f"without writing checkpoint step {step}; " + _continue_from(spec, kept)
                )


def _continue_from(spec: JobSpec, kept: tuple[int, Path] | None) -> str:
    """What is kept and what to change before going on."""
    fixes = [f"lower optimizer.lr (now {spec.optimizer.lr:g})"]
    if spec.optimizer.grad_clip is None:
        fixes.append("set optimizer.grad_clip (1.0 is usual)")
    if spec.train.dtype == "float16":
        fixes.append(
            "train in bfloat16 (float32's range)"
            if spec.loss_scaling
            else "set train.loss_scale to dynamic or train in bfloat16"
        )
    fix = ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
    fix = fix[0].upper() + fix[1:]
    if kept is None:
        return f"no checkpoint was written before it. {fix}, and start again"
    step, path = kept
    return (
        f"checkpoint step {step} ({path}) is kept, from before it. {fix}, "
        f"and continue from it with model.resume_from: {path}"
    )
