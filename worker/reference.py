"""The reference driver: one iteration of a plan run in this process, stage by stage.

It runs the F stages, the tail, then the B stages through a :class:`StageExecutor` exactly
as the runtime schedules them, with the data moving as it moves between workers, but no
arenas, sockets or counters. Tests compare it with transformers and with the distributed
runtime; benchmarks use it to time the compute of an iteration alone
(docs/model-execution.md, "Reference driver").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from roundpipe.shared.model import LayeredModel, count_label_tokens
from roundpipe.shared.plan import Plan
from roundpipe.worker.executor import RngKey, StageExecutor

__all__ = ["IterationResult", "run_iteration"]


@dataclass
class IterationResult:
    loss: float
    microbatch_losses: list[float]
    grads: dict[str, torch.Tensor]
    """fp32 gradient per trainable parameter, tied contributions summed into the owner."""


def run_iteration(
    model: LayeredModel,
    plan: Plan,
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    executor: StageExecutor,
    *,
    rng: RngKey | None = None,
    position_ids: Sequence[torch.Tensor] | None = None,
    row_tokens: Sequence[Sequence[int]] | None = None,
) -> IterationResult:
    """Reference driver: one iteration's F stages, T, then B stages, in order.

    Data moves as in the distributed runtime: the forward keeps only backward-boundary
    inputs (plus the hidden states handed to the next stage), backward stages start from
    those, and each task gets only its range's weights (cast to the compute dtype, as the
    params arena holds them). Tied gradients are summed into their owner.
    ``position_ids[m]``: microbatch m's position ids (Note [packed documents]);
    ``row_tokens[m]``: the real tokens of each of its rows, the padding after them left
    out of the router auxiliary loss (None: every token is real).
    """
    rng = rng if rng is not None else RngKey()
    plan.validate(model.num_layers)
    if not microbatches:
        raise ValueError("run_iteration needs at least one microbatch")
    dtype = executor.compute_dtype
    cast = {layer: {n: t.to(dtype) for n, t in per.items()} for layer, per in weights.items()}
    ids = [mb[0] for mb in microbatches]
    labels = [mb[1] for mb in microbatches]
    num_tokens = sum(count_label_tokens(y) for y in labels)
    boundaries = plan.backward_boundaries()

    acts: dict[int, list[torch.Tensor]] = {}  # the activation arena: layer -> per microbatch
    # Router auxiliary loss: forward stages' (counts, prob sums) summed per microbatch for
    # the tail; the tail's counts for the backward stages.
    aux = model.router_aux is not None
    if not aux:
        batch_tokens = None
    elif row_tokens is None:
        batch_tokens = sum(t.numel() for t in ids)
    else:
        batch_tokens = sum(sum(rows) for rows in row_tokens)
    router_stats: list[torch.Tensor] | None = None
    x: list[torch.Tensor] = ids
    for a, b in plan.forward:
        res = executor.forward(
            a,
            b,
            model.range_weights(cast, a, b),
            x,
            boundaries,
            rng=rng,
            position_ids=position_ids,
            row_tokens=row_tokens,
        )
        acts.update(res.saved)
        x = res.outputs
        if aux:
            if router_stats is None:
                router_stats = res.router_stats
            else:
                router_stats = [s + t for s, t in zip(router_stats, res.router_stats)]
    grads: dict[str, torch.Tensor] = {}

    def collect(part: Mapping[str, torch.Tensor]) -> None:
        for n, g in part.items():
            if n in grads:
                raise AssertionError(f"two tasks returned a gradient for {n}")
            grads[n] = g

    t0, t1 = plan.tail
    tail = executor.tail(
        t0,
        t1,
        model.range_weights(cast, t0, t1),
        x,
        labels,
        num_tokens,
        rng=rng,
        position_ids=position_ids,
        router_stats=router_stats,
        batch_tokens=batch_tokens,
        row_tokens=row_tokens,
    )
    collect(tail.weight_grads)
    dx = tail.grad_inputs
    for a, b in plan.backward:
        saved = ids if a == 0 else acts[a]
        assert dx is not None
        res = executor.backward(
            a,
            b,
            model.range_weights(cast, a, b),
            saved,
            dx,
            rng=rng,
            position_ids=position_ids,
            router_counts=tail.router_counts if aux else None,
            batch_tokens=batch_tokens,
            row_tokens=row_tokens,
        )
        collect(res.weight_grads)
        dx = res.grad_inputs
    for tied, owner in model.tied_params.items():
        g = grads.pop(tied, None)
        if g is not None:
            grads[owner] = grads[owner] + g if owner in grads else g
    return IterationResult(tail.loss_sum, tail.microbatch_losses, grads)
