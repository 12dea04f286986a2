"""What ``roundpipe plan --nodes W --network-bandwidth B`` predicts: the step of W servers
in a data-parallel group (roundpipe.coordinator.training.multinode), each running the one-node plan.

The cost model is a ring all-reduce of the gradients of the trainable parameters over the
servers' network (sharded optimizer state: the same, as gloo has no reduce-scatter of its
own, Note [sharded collectives over gloo], and an all-gather of the updated weights),
overlapped with the step as docs/multi-node.md describes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataParallelPrediction", "predict_data_parallel"]


@dataclass(frozen=True)
class DataParallelPrediction:
    """What ``roundpipe plan --nodes W --network-bandwidth B`` adds to a one-node plan."""

    nodes: int
    gradient_bytes: int
    """Bytes reduced per step (the gradients of the trainable parameters, in the
    transport dtype)."""
    allreduce_s: float
    """The network time per step: a ring all-reduce sends and receives 2 (W-1)/W of the
    gradient bytes per node; sharded, the gradients' reduce-scatter moves as much (on
    gloo it is an all-reduce) and the all-gather of the weights (W-1)/W of their
    bytes."""
    step_s: float
    tokens_per_s: float
    sharded: bool = False

    def describe(self, bandwidth: float) -> str:
        how = (
            "reduce-scatter of the gradients and all-gather of the weights"
            if self.sharded
            else "all-reduce"
        )
        return (
            f"{self.nodes} nodes over {bandwidth / 1e9:g} GB/s: {how} of "
            f"{self.gradient_bytes / 2**20:,.1f} MiB of gradients per step takes "
            f"{self.allreduce_s:.3g}s; predicted {self.step_s:.3g}s per step, "
            f"{self.tokens_per_s:,.0f} tokens/s for all nodes (global batch = {self.nodes} x "
            "the per-node batch)"
        )


def predict_data_parallel(
    *,
    iteration_s: float,
    tokens_per_iteration: int,
    trainable_params: int,
    nodes: int,
    bandwidth_bytes_per_s: float,
    staleness: int,
    sharded: bool = False,
    weight_bytes: int = 2,
    grad_bytes: int = 4,
    shared_cores: bool = False,
) -> DataParallelPrediction:
    """The step time of ``nodes`` coordinators, each running the one-node plan whose step
    takes ``iteration_s``. Per-layer all-reduces overlap the rest of the backward; with
    staleness 1 the optimizer (and so the all-reduce) also has the whole next iteration,
    so the step is the slower of the two; with staleness 0 the next forward needs the
    reduced first layers, and no overlap is credited (an upper bound). The gradients
    cross in ``grad_bytes`` per parameter (``train.grad_transport``). ``sharded``
    (``train.optimizer_sharding``): their reduce-scatter, which moves what the all-reduce
    moves (Note [sharded collectives over gloo]), and an all-gather of the weights
    (``weight_bytes`` per parameter: the compute dtype).
    ``shared_cores``: the collectives move their bytes on the cores the workers compute
    on (CPU workers; on one host, loopback is a memory copy by the CPU), so nothing
    overlaps them and the step is the iteration plus the network time, whatever the
    staleness."""
    if nodes < 1 or bandwidth_bytes_per_s <= 0:
        raise ValueError("--nodes must be >= 1 and --network-bandwidth > 0")
    nbytes = grad_bytes * trainable_params
    moved = 2 * (nodes - 1) / nodes * nbytes  # a ring all-reduce of the gradients
    if sharded:  # and an all-gather of the weights
        moved += (nodes - 1) / nodes * weight_bytes * trainable_params
    allreduce_s = moved / bandwidth_bytes_per_s
    overlapped = staleness and not shared_cores
    step_s = max(iteration_s, allreduce_s) if overlapped else iteration_s + allreduce_s
    return DataParallelPrediction(
        nodes, nbytes, allreduce_s, step_s, nodes * tokens_per_iteration / step_s, sharded
    )
