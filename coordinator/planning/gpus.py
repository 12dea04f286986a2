"""What a GPU model can do, from its data sheet, for the shape-aware cost model.

One ``GpuModel`` describes a GPU the same way for every model, shape and job: its peaks
come from the vendor's data sheet; the few "how close do real kernels come" figures are
properties of the GPU and its software stack, never of a particular model (Note [one
description per GPU] in roundpipe.coordinator.planning.shape_costs).
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.shared.units import GiB

__all__ = ["GPUS", "GpuModel", "gpu_model"]


@dataclass(frozen=True)
class GpuModel:
    """One GPU model, as the shape-aware cost model sees it."""

    name: str
    tensor_flops: float
    """Dense fp16/bf16 tensor-core peak with fp32 accumulation (FLOP/s)."""
    fp16_accumulation_flops: float
    """Dense fp16 peak with fp16 accumulation (``allow_fp16_accumulation``); GeForce
    parts double their rate there, data-centre parts do not."""
    memory_bandwidth: float
    """DRAM bytes per second."""
    sms: int
    """Streaming multiprocessors: a GEMM's tiles run in waves of this many."""
    memory_bytes: int
    gemm_efficiency: float = 0.8
    """The fraction of the tensor peak a large, well-shaped GEMM sustains (full waves,
    long reductions)."""
    attention_efficiency: float = 0.55
    """The fraction of ``tensor_flops`` fused (flash) attention sustains, forward and
    backward; it accumulates in fp32 whatever the matmuls do."""
    memory_efficiency: float = 0.8
    """The fraction of ``memory_bandwidth`` a streaming elementwise kernel sustains."""


# Data-sheet figures (dense, no sparsity).
GPUS: dict[str, GpuModel] = {
    "rtx4090": GpuModel(
        name="RTX 4090",
        tensor_flops=165.2e12,
        fp16_accumulation_flops=330.3e12,
        memory_bandwidth=1008e9,
        sms=128,
        memory_bytes=24 * GiB,
    ),
    "a100": GpuModel(
        name="A100 80GB",
        tensor_flops=312e12,
        fp16_accumulation_flops=312e12,
        memory_bandwidth=2039e9,
        sms=108,
        memory_bytes=80 * GiB,
    ),
    "h100": GpuModel(
        name="H100 SXM",
        tensor_flops=989e12,
        fp16_accumulation_flops=989e12,
        memory_bandwidth=3350e9,
        sms=132,
        memory_bytes=80 * GiB,
    ),
}
# The A800 is the A100 with a slower NVLink, which no part of this model uses.
GPUS["a800"] = GPUS["a100"]


def gpu_model(name: str) -> GpuModel:
    """The ``GpuModel`` called ``name`` (``roundpipe plan --gpu``), or a ValueError that
    lists the known ones."""
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: known ones are {', '.join(sorted(GPUS))}")
    return GPUS[key]
