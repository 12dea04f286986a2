"""The longest sequence a model trains with on given workers (``roundpipe plan
--max-seq-len``), and where its memory goes.

A sequence fits when the planner finds a plan whose every stage fits the workers' memory
(``plan_stages``: the running stage, the prefetched next one and the reserve). That only
gets harder as the sequence grows (activations, saved tensors and the loss chunks grow
with it; weights do not), so a bisection over the sequence length finds the longest one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from roundpipe.coordinator.planning.costs import CostModel, LayerCost
from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.search import PlanResult, evaluate_plan, plan_stages
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import format_bytes

__all__ = ["SequenceFit", "longest_sequence"]


@dataclass(frozen=True)
class SequenceFit:
    """The longest sequence that fits, with its plan and the memory of its fullest stage."""

    seq_len: int
    result: PlanResult
    stage: str
    """Label of the stage that needs the most memory (``B3``)."""
    parts: dict[str, int]
    """That stage's running memory by kind (``CostModel.memory_parts``), plus the
    prefetched next stage and the reserve: their sum is what it needs."""
    limit: int
    """Bytes per worker."""

    @property
    def needed(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        return (
            f"the longest sequence that fits is {self.seq_len:,} tokens per row "
            f"(recompute at {self.result.recompute} grain); its fullest stage, "
            f"{self.stage}, needs {format_bytes(self.needed)} of the "
            f"{format_bytes(self.limit)} per worker: {shown}"
        )


def longest_sequence(
    costs_for: Callable[[int], Sequence[LayerCost]],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    rows: int,
    lo: int = 2,
    hi: int,
    recompute: str = "auto",
    plan: Plan | None = None,
    staleness: int = 1,
) -> SequenceFit | None:
    """The longest sequence in ``[lo, hi]`` whose costs (``costs_for(seq_len)``) have a
    plan on ``hw`` (``plan``: whose every worker fits with that plan; ``recompute`` then
    ``stage`` or ``layer``) at ``staleness``, or None when not even ``lo`` fits."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got {lo} and {hi}")

    def search(seq_len: int, select: str) -> PlanResult:
        tokens = num_microbatches * rows * seq_len
        if plan is not None:
            result = evaluate_plan(
                plan,
                costs_for(seq_len),
                hw,
                num_microbatches,
                staleness=staleness,
                tokens_per_iteration=tokens,
                recompute=recompute,
            )
            if max(result.per_worker_memory) > hw.memory_limit_bytes:
                raise ValueError("does not fit")
            return result
        return plan_stages(
            costs_for(seq_len),
            hw,
            num_microbatches,
            staleness=staleness,
            tokens_per_iteration=tokens,
            recompute=recompute,
            select=select,
        )

    def fits(seq_len: int) -> PlanResult | None:
        try:
            return search(seq_len, "objective")  # only whether one fits matters until the end
        except ValueError:
            return None

    if fits(lo) is None:
        return None
    good, bad = lo, hi + 1
    if fits(hi) is not None:
        good = hi
    else:
        bad = hi
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid) is not None:
                good = mid
            else:
                bad = mid
    costs = costs_for(good)
    result = search(good, "simulation")
    worst = max(result.stages, key=lambda e: e.memory_bytes)
    cm = CostModel(costs, hw, num_microbatches, result.recompute)
    parts = dict(cm.memory_parts(worst.kind, worst.start, worst.stop))
    parts["prefetched next stage"] = max(e.resident_bytes for e in result.stages)
    parts["reserve"] = hw.reserved_bytes
    return SequenceFit(good, result, worst.label, parts, hw.memory_limit_bytes)
