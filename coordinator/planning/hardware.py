"""The workers a plan is for: how many, their memory, bus, speed and the host's optimizer rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from roundpipe.shared.units import GiB

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class HardwareSpec:
    """The workers a plan is for."""

    num_workers: int
    memory_limit_bytes: int
    """GPU memory of one worker (the smallest, for mixed GPUs)."""
    bandwidth_bytes_per_s: float = 25e9
    """Effective host<->device bandwidth per worker and direction (PCIe 4.0 x16: ~25 GB/s)."""
    speeds: tuple[float, ...] | None = None
    """Relative compute speed of each worker, in the order the trainer's worker list
    has them (task j goes to worker j mod N); None = all 1.0. Costs are for speed 1.0."""
    reserved_bytes: int = GiB
    """Per worker, not available to stages: CUDA context, allocator slack."""
    task_overhead_s: float = 0.0
    """Fixed cost per task (launch, synchronisation, Python)."""
    optimizer_params_per_s: float | None = None
    """CPU optimizer throughput (parameters per second) for the simulation; None = free."""
    shared_launch_s: float = 0.0
    """Host seconds per kernel when one process issues every worker's kernels (the
    paper's library: a thread per GPU under one interpreter lock), so that the kernels of
    an iteration, all workers together, take at least this much each; 0 for RoundPipe's
    process per worker (Note [kernels and the host] in
    roundpipe.coordinator.planning.shape_costs)."""
    flops_per_s: float = 82.6e12
    """Peak dense matmul throughput of one worker, for cold-start cost estimates
    (``estimate_costs``); the default is an RTX 4090's bf16 peak."""
    gpu_workers: bool = True
    """GPU workers; False for CPU workers, whose chunked LM head holds fewer tokens of
    logits at a time (``shared.logits_chunks``)."""
    host_views: bool = False
    """CPU workers: a task's weights and inputs are views of the host arenas, so nothing
    is uploaded or prefetched and a worker's own memory is what its task allocates
    (``CostModel.memory_parts``)."""

    @property
    def gpu_memory_limited(self) -> bool:
        """Whether stages must fit a memory limit (GPU workers; CPU workers have none)."""
        return self.memory_limit_bytes < _NO_LIMIT

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s}"
            )
        if self.speeds is not None:
            speeds = tuple(float(v) for v in self.speeds)
            if len(speeds) != self.num_workers:
                raise ValueError(
                    f"speeds lists {len(speeds)} workers but num_workers is {self.num_workers}"
                )
            if any(not v > 0 for v in speeds):
                raise ValueError(f"worker speeds must be positive, got {list(speeds)}")
            object.__setattr__(self, "speeds", speeds)
        if self.reserved_bytes < 0 or self.task_overhead_s < 0 or self.shared_launch_s < 0:
            raise ValueError("reserved_bytes, task_overhead_s and shared_launch_s must be >= 0")
        if self.optimizer_params_per_s is not None and not self.optimizer_params_per_s > 0:
            raise ValueError("optimizer_params_per_s must be positive")
        if not self.flops_per_s > 0:
            raise ValueError(f"flops_per_s must be positive, got {self.flops_per_s}")

    @property
    def speed_list(self) -> list[float]:
        return list(self.speeds) if self.speeds is not None else [1.0] * self.num_workers

    @property
    def min_speed(self) -> float:
        return min(self.speed_list)

    @property
    def mixed(self) -> bool:
        return len(set(self.speed_list)) > 1

    @property
    def usable_bytes(self) -> int:
        return self.memory_limit_bytes - self.reserved_bytes


# CPU workers compute on the arena views themselves: nothing crosses a bus, memory is the
# host's, and a task costs a few milliseconds of messages, waits and Python around it.
_CPU_FLOPS_PER_S = 2e10
_CPU_TASK_OVERHEAD_S = 2e-3
_NO_LIMIT = 1 << 60


def cpu_hardware(
    num_workers: int,
    bandwidth_bytes_per_s: float | None = None,
    *,
    memory_limit_bytes: int | None = None,
    reserved_bytes: int = 0,
) -> HardwareSpec:
    """The planner's view of ``num_workers`` CPU workers (behind an emulated bus of
    ``bandwidth_bytes_per_s``, if they run with ``--emulate-pcie``). With
    ``memory_limit_bytes`` (a worker's ``--memory-limit``: Note [CPU memory cap] in
    roundpipe.worker.memory_cap) stages must fit it, ``reserved_bytes`` (the worker
    process's own memory) included, counted as the worker's own memory (``host_views``:
    a plain CPU worker computes on the arenas' views; an emulated bus copies like a
    GPU's). Without a cap memory is not planned and its figures stay the device-style
    bound."""
    return HardwareSpec(
        num_workers=num_workers,
        memory_limit_bytes=memory_limit_bytes or _NO_LIMIT,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s or 1e15,
        reserved_bytes=reserved_bytes,
        task_overhead_s=_CPU_TASK_OVERHEAD_S,
        flops_per_s=_CPU_FLOPS_PER_S,
        gpu_workers=False,
        host_views=memory_limit_bytes is not None and bandwidth_bytes_per_s is None,
    )


GPU_TASK_OVERHEAD_S = 2e-4
"""What a GPU worker's task costs beyond its compute and copies (launches, events,
Python), as the coordinator and ``roundpipe plan`` both price it."""


def gpu_hardware(
    num_workers: int, memory_bytes: int, bandwidth_bytes_per_s: float | None = None
) -> HardwareSpec:
    """``num_workers`` GPU workers with ``memory_bytes`` each (the smallest, if mixed),
    behind the bus the workers measured at start-up (``Hello.h2d_bytes_per_s`` /
    ``d2h_bytes_per_s``, the slowest), else PCIe 4.0 x16."""
    extra = (
        {} if bandwidth_bytes_per_s is None else {"bandwidth_bytes_per_s": bandwidth_bytes_per_s}
    )
    return HardwareSpec(
        num_workers=num_workers,
        memory_limit_bytes=memory_bytes,
        task_overhead_s=GPU_TASK_OVERHEAD_S,
        **extra,
    )
