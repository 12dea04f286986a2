"""float16 loss scaling: which scale each step seeds its backward with, and what an
overflow does (``train.loss_scale``; docs/job-spec.md).

Note [dynamic loss scaling]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
float16 holds nothing below 6e-8. A token's share of the loss gradient is about
``softmax / tokens``: at thousands of tokens per step and a vocabulary of 10^5, most of
the logits' gradient, and the activation gradients behind it, round to zero. So the
backward is seeded with ``S`` times the loss (the tail scales d loss / d logits, and the
router auxiliary loss's seed); every gradient a worker computes, the fp32 weight
gradients in the grads arena included, is S times the true one. The optimizer thread
waits for the whole step, as clipping does, and takes the global norm of the scaled
gradients:

* not finite: some gradient overflowed. The step is skipped: no master, moment or
  weight changes (the step still publishes its versions: the weights of version k are
  those of k-1), the step's learning rate is not consumed, and S halves;
* finite: the gradients are multiplied by 1/S (folded into the clipping coefficient,
  which is taken on the norm / S), the update is applied, and after
  ``train.loss_scale_growth_interval`` such steps in a row S doubles.

That is torch's ``GradScaler`` with its defaults (2**16, x2, x0.5, 2000), the oracle the
tests compare against (a plain loop over fp32 masters and a float16 copy), with these
differences, all outside what a sane run reaches: overflow is read off the norm, so
gradients whose squares sum past float32's range (a norm above 1.8e19 times S) count as
an overflow; S stays within 2**0..2**64; and a step that overflows at S = 1 fails the
job (its gradient is not finite unscaled: the training diverged), where GradScaler would
go on halving and skipping.

S is a power of two, so scaling and unscaling change no bit of a gradient that neither
overflows nor falls below float16's range. The AdamW bias correction and the
learning-rate schedule count the updates applied (``updates``), not the steps, as the
Hugging Face Trainer does when GradScaler skips one.

Workers learn S from the event table, not from the task: a step's tasks are sent before
the step before it has been decided. Counter ``loss_scale(k)`` (one per step parity)
holds ``(k, log2 S)`` (``loss_scale_value``); a tail or backward task of step k waits
until it names step k. Step k's scale is decided once step ``k - 1 - staleness`` has
been: at staleness 0 the outcome of the step before, exactly GradScaler; at staleness 1
the one before that (a step whose gradient was taken on W_{k-2} uses the scale that was
current then). Nodes of a group decide alike: the norm is the group's.

A checkpoint after step s stores the scales of steps s+1 .. s+1+staleness, the count of
steps since the last change, and ``updates`` (manifest ``loss_scale``), so a resume goes
on as the uninterrupted run would have.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.job_errors import JobFailed
from roundpipe.shared.events import (
    LOSS_SCALE_EXP_MAX,
    LOSS_SCALE_EXP_MIN,
    Counters,
    EventTable,
    loss_scale_value,
)

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
_KEPT_SNAPSHOTS = 16
"""Checkpoint states kept for steps whose checkpoint may still be written in the
background (a later one is taken while an earlier one is written)."""


class LossScaler:
    """One job's dynamic loss scale (Note [dynamic loss scaling]). The optimizer thread
    decides each step (``decide``); the trainer publishes the first steps' scales
    (``publish``) and a checkpoint stores ``checkpoint_state(step)``."""

    def __init__(self, *, initial: int, growth_interval: int, staleness: int) -> None:
        exponent = _exponent(initial)
        self.growth_interval = growth_interval
        self.staleness = staleness
        self.exponent = exponent
        """log2 of the scale the next step to be assigned one gets."""
        self.tracker = 0
        """Steps without an overflow since the scale last changed."""
        self.updates = 0
        """Optimizer updates applied (steps not skipped)."""
        self.skipped = 0
        """Steps skipped by this run."""
        self._pending = self._steps_after(0, {})
        """Step -> log2 of the scale it seeds its backward with, for the steps not yet
        decided whose scale is known."""
        self._snapshots: dict[int, dict[str, Any]] = {}

    @classmethod
    def from_spec(cls, spec: JobSpec, job_id: str) -> LossScaler | None:
        """Job ``job_id``'s scaler, or None without loss scaling (a float16 job's log
        warns)."""
        if not spec.loss_scaling:
            if spec.train.dtype == "float16":
                log.warning(
                    "[trainer] job %s: train.dtype float16 with train.loss_scale none: its "
                    "gradients lose precision as the tokens per step and the vocabulary "
                    "grow (small ones flush to zero); loss scaling or bfloat16 does not "
                    "(docs/job-spec.md)",
                    job_id,
                )
            return None
        return cls(
            initial=spec.train.loss_scale_initial,
            growth_interval=spec.train.loss_scale_growth_interval,
            staleness=spec.train.staleness,
        )

    def scale_of(self, step: int) -> float:
        """The scale step ``step`` seeded its backward with."""
        return float(2 ** self._pending[step])

    def decide(self, step: int, finite: bool) -> bool:
        """Record step ``step``'s outcome (whether its scaled gradients are all finite)
        and assign the next step its scale. Returns whether the step is applied. Raises
        JobFailed when it overflowed at scale 1."""
        exponent = self._pending.pop(step)
        if finite:
            self.updates += 1
            self.tracker += 1
            if self.tracker >= self.growth_interval:
                self.exponent = min(self.exponent + 1, LOSS_SCALE_EXP_MAX)
                self.tracker = 0
        else:
            if exponent == LOSS_SCALE_EXP_MIN:
                raise JobFailed(
                    f"step {step}'s gradients are not finite at loss scale 1: they "
                    "overflow unscaled, so the training diverged. Continue from the last "
                    "checkpoint with a lower optimizer.lr, optimizer.grad_clip set, or "
                    "train.dtype bfloat16 (float32's range)"
                )
            self.skipped += 1
            self.exponent = max(self.exponent - 1, LOSS_SCALE_EXP_MIN)
            self.tracker = 0
        self._pending[step + 1 + self.staleness] = self.exponent
        return finite

    def publish(self, events: EventTable, counters: Counters) -> None:
        """Store every known step's scale in its counter (after ``decide``, and for the
        first steps of a run: the table is fresh, or restored from a checkpoint)."""
        for step, exponent in sorted(self._pending.items()):
            events.signal(counters.loss_scale(step), loss_scale_value(step, exponent))

    def snapshot(self, step: int) -> None:
        """Keep the state after step ``step`` for its checkpoint (called once the step is
        decided, for steps a checkpoint is due after)."""
        self._snapshots[step] = self.state_dict()
        for old in sorted(self._snapshots)[:-_KEPT_SNAPSHOTS]:
            del self._snapshots[old]

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """The state a checkpoint after step ``step`` stores (the live one when no
        snapshot was taken: a checkpoint at the cut, before training on)."""
        return self._snapshots.get(step) or self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "scales": {str(step): 2**e for step, e in sorted(self._pending.items())},
            "scale": 2**self.exponent,
            "steps_since_change": self.tracker,
            "updates": self.updates,
        }

    def restart_after(self, step: int, updates: int) -> None:
        """Continue after step ``step`` of a checkpoint without a loss scale state (it
        was trained in another dtype, or without scaling): from the initial scale, with
        ``updates`` applied."""
        self.updates = updates
        self._pending = self._steps_after(step, {})

    def load_state_dict(self, state: Mapping[str, Any], step: int) -> None:
        """Continue after step ``step`` from a checkpoint's ``state``. Steps whose scale it
        does not hold (resumed at a higher staleness) get its current one."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loss scale state version {state.get('version')!r} is not supported")
        scales = {int(k): _exponent(v) for k, v in state["scales"].items()}
        self.exponent = _exponent(state["scale"])
        self.tracker = int(state["steps_since_change"])
        self.updates = int(state["updates"])
        if not 0 <= self.updates <= step:
            raise ValueError(f"{self.updates} updates applied in {step} steps")
        self._pending = self._steps_after(step, scales)

    def _steps_after(self, step: int, scales: Mapping[int, int]) -> dict[int, int]:
        """The scales of the steps after ``step`` whose scale is known (1 + staleness of
        them): from ``scales``, else the current one."""
        return {k: scales.get(k, self.exponent) for k in range(step + 1, step + 2 + self.staleness)}


def _exponent(scale: object) -> int:
    if not isinstance(scale, int) or scale < 1 or scale & (scale - 1):
        raise ValueError(f"loss scale {scale!r} is not a power of two")
    exponent = scale.bit_length() - 1
    if exponent > LOSS_SCALE_EXP_MAX:
        raise ValueError(f"loss scale {scale} is above 2**{LOSS_SCALE_EXP_MAX}")
    return exponent
