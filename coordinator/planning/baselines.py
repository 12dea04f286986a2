"""The paper's bound baseline: each GPU owns a fixed contiguous slice of layers (what the
plan is compared with)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roundpipe.coordinator.planning.costs import (
    LayerCost,
)
from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.simulator import (
    BoundStage,
    SimResult,
    simulate_bound,
)

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class BoundBaseline:
    """GPipe or 1F1B with one stage bound to each GPU, same costs and hardware."""

    schedule: str
    split: tuple[tuple[int, int], ...]
    simulation: SimResult
    stage_memory: tuple[int, ...]
    """Per GPU: resident weights, fp32 gradients, fp32 master + AdamW moments, the
    activations of in-flight microbatches, the reserve."""
    memory_limit_bytes: int

    @property
    def oom(self) -> bool:
        return max(self.stage_memory) > self.memory_limit_bytes

    @property
    def iteration_s(self) -> float:
        return self.simulation.iteration_s


def _balanced_split(weights: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into exactly ``parts`` ranges minimising the max sum."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    pre = [0.0]
    for x in weights:
        pre.append(pre[-1] + x)
    # best[k][i]: min max-sum splitting the first i layers into k ranges.
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    out, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        out.append((j, i))
        i = j
    return out[::-1]


def bound_baseline(
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    schedule: str = "1f1b",
    recompute: bool = False,
    tokens_per_iteration: int | None = None,
    iterations: int = 2,
) -> BoundBaseline:
    """Simulate GPipe/1F1B with the layers split into N stages bound to the N GPUs.

    The split is the best balanced one for the bound schedule (min over splits of the
    slowest stage's forward + backward), so the comparison is as kind to the bound
    schedules as it can be; what they cannot avoid is that the stage holding the LM head
    is as slow as it is. Weights stay resident (no uploads); without ``recompute`` the
    backward skips the recompute and every in-flight microbatch keeps its activations.
    """
    n_gpus = hw.num_workers
    n = len(costs)
    back = [c.backward_s if recompute else max(c.backward_s - c.forward_s, 0.0) for c in costs]
    weights = [c.forward_s + b for c, b in zip(costs, back)]
    split = _balanced_split(weights, min(n_gpus, n))
    stages, memory = [], []
    m = num_microbatches
    for i, (a, b) in enumerate(split):
        fwd = sum(c.forward_s for c in costs[a:b])
        bwd = sum(back[a:b])
        handoff = costs[b].activation_bytes / hw.bandwidth_bytes_per_s if b < n else 0.0
        stages.append(BoundStage(fwd, bwd, a, b, handoff))
        params = sum(c.param_bytes for c in costs[a:b])
        grads = sum(c.grad_bytes for c in costs[a:b])
        in_flight = m if schedule == "gpipe" else min(len(split) - i, m)
        work = sum(c.work_bytes for c in costs[a:b])
        acts = (
            in_flight * costs[a].activation_bytes + work
            if recompute
            else in_flight * work + costs[a].activation_bytes
        )
        memory.append(params + 4 * grads + acts + hw.reserved_bytes)
    speeds = hw.speed_list[: len(split)]
    sim = simulate_bound(
        stages,
        schedule=schedule,  # type: ignore[arg-type]
        num_microbatches=m,
        iterations=iterations,
        speeds=speeds,
        tokens_per_iteration=tokens_per_iteration,
    )
    return BoundBaseline(schedule, tuple(split), sim, tuple(memory), hw.memory_limit_bytes)
