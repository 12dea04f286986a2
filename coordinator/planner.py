"""Profile-driven asymmetric partitioner: which layers go in which stage.

A plan (roundpipe.shared.plan.Plan) cuts the model into forward stages, a fused tail and
backward stages. This module chooses one from per-layer costs, the workers' memory and the
PCIe bandwidth, and predicts what it will do with the discrete-event simulator
(roundpipe.coordinator.simulator). docs/planning.md explains the model; in short:

* ``LayerCost``: per layer and per microbatch, forward seconds and backward seconds
  (backward = recompute forward + backward, which is also what a layer costs inside the
  fused tail), the bytes a task uploads (compute-dtype weights) and downloads (fp32
  gradients), the layer's input activation and its working memory.
* ``estimate_costs``: cold-start costs from parameter counts and a FLOP model.
* ``ProfileAggregator``: measured per-layer times from ``TaskDone.layer_times``
  (exponential average, warm-up dropped) turned back into ``LayerCost``s.
* ``plan_stages``: the search. A stage's time is
  ``max(compute of M microbatches + one microbatch's activation upload, host->device bytes
  / bandwidth, device->host bytes / bandwidth)``: what the worker's transfer engine
  overlaps (roundpipe.worker.transfer): the weights are prefetched during the previous
  task, microbatch m + 1 goes up while m computes and downloads run behind compute, so
  only the first microbatch's input waits on the bus; a stage fits when its
  weights, gradients and working set plus the largest other stage's weights and
  gradients (the prefetched one) fit the memory limit. The search minimises
  ``max(stages, N) x slowest stage`` over stage-time caps (exact min-max partitions for
  every stage count, greedy packing), tail lengths and weight budgets, then simulates the
  best candidates and keeps the fastest.
* ``describe`` / ``plan_main``: the ``roundpipe plan`` command.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.simulator import (
    BoundStage,
    SimResult,
    SimStage,
    simulate_bound,
    simulate_roundpipe,
)
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import GiB, MiB, format_bytes, parse_quantity

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel

__all__ = [
    "BoundBaseline",
    "HardwareSpec",
    "LayerCost",
    "PlanResult",
    "ProfileAggregator",
    "StageEstimate",
    "bound_baseline",
    "build_plan_parser",
    "cpu_hardware",
    "describe",
    "estimate_costs",
    "evaluate_plan",
    "format_bytes",
    "gpu_hardware",
    "initial_plan",
    "parse_quantity",
    "plan_main",
    "plan_stages",
    "replan_if_better",
    "run_plan_command",
]


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


# ============================================================================ data types


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, per microbatch, on a worker of relative speed 1.0."""

    forward_s: float
    """Forward without autograd (a forward stage)."""
    backward_s: float
    """Recompute forward + backward (a backward stage); also the layer's time inside the
    fused tail (forward with autograd + backward, no recompute). 0 for a layer with
    nothing to backpropagate (LoRA's prefix: no adapters, no input gradient)."""
    param_bytes: int
    """Weights a task uploads for this layer, compute dtype (tied aliases included: the
    task receives the owner's tensor)."""
    grad_bytes: int
    """fp32 weight gradients a backward/tail task downloads (trainable parameters)."""
    activation_bytes: int
    """The layer's input for one microbatch: hidden states ``[rows, seq, hidden]`` in
    the compute dtype (token ids for layer 0)."""
    work_bytes: int
    """Working memory for one microbatch under autograd (saved tensors of a backward or
    tail stage); a stage holds the sum over its layers."""
    forward_work_bytes: int = 0
    """Peak transient memory of the layer's forward without autograd."""
    name: str = ""
    """Human name for messages (``model.layers.11``)."""

    @property
    def trainable_params(self) -> int:
        return self.grad_bytes // 4

    def scaled(self, factor: float) -> LayerCost:
        """The same layer with times multiplied by ``factor``."""
        return replace(self, forward_s=self.forward_s * factor, backward_s=self.backward_s * factor)


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
    flops_per_s: float = 82.6e12
    """Peak dense matmul throughput of one worker, for cold-start cost estimates
    (``estimate_costs``); the default is an RTX 4090's bf16 peak."""

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
        if self.reserved_bytes < 0 or self.task_overhead_s < 0:
            raise ValueError("reserved_bytes and task_overhead_s must be >= 0")
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


def cpu_hardware(num_workers: int, bandwidth_bytes_per_s: float | None = None) -> HardwareSpec:
    """The planner's view of ``num_workers`` CPU workers (behind an emulated bus of
    ``bandwidth_bytes_per_s``, if they run with ``--emulate-pcie``)."""
    return HardwareSpec(
        num_workers=num_workers,
        memory_limit_bytes=_NO_LIMIT,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s or 1e15,
        reserved_bytes=0,
        task_overhead_s=_CPU_TASK_OVERHEAD_S,
        flops_per_s=_CPU_FLOPS_PER_S,
    )


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
        num_workers=num_workers, memory_limit_bytes=memory_bytes, task_overhead_s=2e-4, **extra
    )


@dataclass(frozen=True)
class StageEstimate:
    """One stage of a plan under the cost model (one task: all M microbatches)."""

    kind: str
    """``F``, ``T`` or ``B``."""
    start: int
    stop: int
    label: str
    """``F0`` .. , ``T``, ``B0`` ..."""
    compute_s: float
    """M microbatches of compute on a worker of speed 1.0."""
    upload_bytes: int
    """Host -> device: weights + input activations (+ output gradients for backward)."""
    download_bytes: int
    """Device -> host: output activations or input gradients + weight gradients."""
    upload_s: float
    download_s: float
    time_s: float
    """max(compute, upload, download) + per-task overhead."""
    resident_bytes: int
    """What the stage occupies as the prefetched one: weights (+ gradient buffers for
    tail/backward stages)."""
    run_bytes: int
    """While running: weights, gradients, working memory of one microbatch, I/O buffers."""
    memory_bytes: int
    """run_bytes + the largest resident_bytes of any stage of the plan + the reserve: a
    bound on the peak of a worker running this stage with its next task prefetched."""

    @property
    def bound(self) -> str:
        """What limits the stage: ``compute``, ``upload`` or ``download``."""
        top = max(self.compute_s, self.upload_s, self.download_s)
        if top == self.compute_s:
            return "compute"
        return "upload" if top == self.upload_s else "download"


@dataclass(frozen=True)
class PlanResult:
    """A plan with what the cost model and the simulator predict for it."""

    plan: Plan
    predicted_iteration_s: float
    """Simulated steady-state seconds per iteration (optimizer step)."""
    stage_times: tuple[float, ...]
    """Per stage in task order (F..., T, B...): ``StageEstimate.time_s``."""
    per_stage_memory: tuple[int, ...]
    """Per stage in task order: ``StageEstimate.memory_bytes`` (reserve included)."""
    notes: tuple[str, ...]
    stages: tuple[StageEstimate, ...]
    objective_s: float
    """The search's objective: max(stages, N) x the slowest stage's time on the slowest
    worker (speed-matched plans: N x the busiest worker's time per iteration)."""
    num_workers: int
    num_microbatches: int
    memory_limit_bytes: int
    per_worker_memory: tuple[int, ...]
    """Peak per worker in the simulated task order (reserve included)."""
    simulation: SimResult = field(repr=False)
    sim_stages: tuple[SimStage, ...] = field(repr=False)
    tokens_per_iteration: int | None = None
    costs: tuple[LayerCost, ...] = field(default=(), repr=False)
    """The per-layer costs the prediction used (the prior for ``ProfileAggregator``)."""
    hardware: HardwareSpec | None = field(default=None, repr=False)
    replaces_iteration_s: float | None = None
    """Set by ``replan_if_better``: the predicted seconds per iteration of the plan this
    one would replace, under the same costs."""

    @property
    def predicted_tokens_per_s(self) -> float | None:
        if self.tokens_per_iteration is None or self.predicted_iteration_s <= 0:
            return None
        return self.tokens_per_iteration / self.predicted_iteration_s

    @property
    def bubble_fraction(self) -> float:
        return self.simulation.bubble_fraction

    @property
    def slowest_stage_s(self) -> float:
        return max(self.stage_times)


# =============================================================================== parsing


def _format_s(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _dtype_bytes(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(
            f"unsupported compute dtype {dtype!r}: expected float32, bfloat16, float16"
        )
    return _DTYPE_BYTES[name]


# ======================================================================= cold-start costs


def estimate_costs(
    model: LayeredModel,
    *,
    microbatch_rows: int,
    seq_len: int,
    compute_dtype: Any = "bfloat16",
    flops_per_s: float,
    efficiency: float = 0.7,
    memory_bandwidth: float = 1.0e12,
    logits_chunk_bytes: int = 128 * MiB,
) -> list[LayerCost]:
    """Cold-start ``LayerCost`` per layer from parameter counts and a FLOP model.

    ``flops_per_s`` is the GPU's peak dense matmul rate in the compute dtype (RTX 4090,
    bf16 with fp32 accumulation: 82.6e12); ``efficiency`` the fraction matmuls achieve.
    ``memory_bandwidth`` (bytes/s of GPU memory) prices the memory-bound parts: the
    embedding gather and its dense gradient, norms and activations, the cross-entropy
    passes over the chunked logits. Per layer, with ``T = rows x seq`` tokens:

    * decoder: ``2 T P`` matmul FLOPs forward (P = matmul parameters; MoE experts count
      ``top_k / num_experts`` of theirs) plus causal attention ``2 T seq (heads x
      head_dim)`` (sliding-window layers attend to at most the window); backward
      ``2 T P`` for input gradients, ``2 T P_trainable`` for weight gradients and 2.5x the
      attention forward;
    * prefix (embedding): a gather; its backward writes a dense ``vocab x hidden``
      gradient (none with LoRA);
    * tail: LM head ``2 T V H`` forward, twice that backward (input and weight
      gradients), plus about six fp32 passes over ``T x V`` logits for the chunked loss.
    """
    if microbatch_rows < 1 or seq_len < 1:
        raise ValueError("microbatch_rows and seq_len must be >= 1")
    if not flops_per_s > 0 or not 0 < efficiency <= 1 or not memory_bandwidth > 0:
        raise ValueError("flops_per_s and memory_bandwidth must be positive, efficiency in (0, 1]")
    d = _dtype_bytes(compute_dtype)
    cfg = model.config
    tokens = microbatch_rows * seq_len
    hidden = int(cfg.hidden_size)
    vocab = int(cfg.vocab_size)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    window = getattr(cfg, "sliding_window", None)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    num_experts = int(getattr(cfg, "num_experts", 0) or 0)
    flops = flops_per_s * efficiency
    mem_bw = memory_bandwidth * 0.8
    n = model.num_layers
    out: list[LayerCost] = []
    for layer in range(n):
        specs = model.layer_params(layer)
        param_bytes = sum(s.numel for s in specs) * d
        grad_bytes = sum(s.numel for s in specs if s.trainable) * 4
        act = tokens * 8 if layer == 0 else tokens * hidden * d
        if layer == 0:
            name = "model.embed_tokens"
            trainable = any(s.trainable for s in specs)
            fwd = tokens * hidden * d * 2 / mem_bw
            if trainable:
                # Dense [vocab, hidden] gradient per microbatch, then fp32 accumulation.
                bwd_only = (vocab * hidden * (2 * d + 8) + tokens * hidden * d) / mem_bw
                backward = fwd + bwd_only
                work = vocab * hidden * d + tokens * hidden * d
            else:
                backward, work = 0.0, 0
            out.append(
                LayerCost(
                    forward_s=fwd,
                    backward_s=backward,
                    param_bytes=param_bytes,
                    grad_bytes=grad_bytes,
                    activation_bytes=act,
                    work_bytes=work,
                    forward_work_bytes=tokens * hidden * d,
                    name=name,
                )
            )
            continue
        if layer == n - 1:
            head = [s for s in specs if len(s.shape) >= 2]
            head_params = sum(s.numel for s in head)
            head_trainable = any(s.trainable for s in head)
            ce_bytes = tokens * vocab * 4 * 6
            norm_bytes = tokens * hidden * (12 + 2 * d)
            fwd = 2 * tokens * head_params / flops + (ce_bytes / 2 + norm_bytes) / mem_bw
            bwd_flops = 2 * tokens * head_params * (2 if head_trainable else 1)
            bwd_only = bwd_flops / flops + (ce_bytes / 2 + 2 * norm_bytes) / mem_bw
            chunk = logits_chunk_bytes + logits_chunk_bytes * d // 4
            out.append(
                LayerCost(
                    forward_s=fwd,
                    backward_s=fwd + bwd_only,
                    param_bytes=param_bytes,
                    grad_bytes=grad_bytes,
                    activation_bytes=act,
                    work_bytes=chunk + tokens * hidden * (3 * d + 8),
                    forward_work_bytes=chunk + tokens * hidden * (2 * d + 4),
                    name="model.norm+lm_head",
                )
            )
            continue
        # Decoder layer.
        matmul = trainable_matmul = 0.0
        moe = False
        for s in specs:
            if len(s.shape) < 2:
                continue
            share = 1.0
            if len(s.shape) >= 3 and ".experts." in f"{s.name}.":
                moe = True
                share = top_k / num_experts if num_experts else 1.0
            matmul += s.numel * share
            if s.trainable:
                trainable_matmul += s.numel * share
        if moe:
            inter = top_k * int(getattr(cfg, "moe_intermediate_size", 0) or 0)
        else:
            inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
        if model.mask_kind(layer) == "sliding" and window:
            w = min(int(window), seq_len)
            span = w * (1 - w / (2 * seq_len)) if seq_len > w else seq_len / 2
        else:
            span = seq_len / 2
        attn = 4 * tokens * span * q_width
        fwd_flops = 2 * tokens * matmul + attn
        bwd_flops = 2 * tokens * matmul + 2 * tokens * trainable_matmul + 2.5 * attn
        elementwise = tokens * d * (10 * hidden + 4 * inter)
        fwd = fwd_flops / flops + elementwise / mem_bw
        backward = fwd + bwd_flops / flops + 2 * elementwise / mem_bw
        qk_norm = any(".q_norm." in s.name for s in specs)
        work = tokens * (
            d * (2 * hidden + 3 * q_width + 4 * kv_width + 4 * inter)
            + 8 * hidden
            + (4 * (q_width + kv_width) if qk_norm else 0)
            + (4 * num_experts if moe else 0)
        )
        fwork = tokens * (d * (3 * inter + q_width + 2 * kv_width + hidden) + 4 * hidden)
        out.append(
            LayerCost(
                forward_s=fwd,
                backward_s=backward,
                param_bytes=param_bytes,
                grad_bytes=grad_bytes,
                activation_bytes=act,
                work_bytes=work,
                forward_work_bytes=fwork,
                name=f"model.layers.{layer - 1}",
            )
        )
    return out


# ============================================================================ cost model


class _CostModel:
    """Stage costs from per-layer costs, with prefix sums (O(1) per stage)."""

    def __init__(self, costs: Sequence[LayerCost], hw: HardwareSpec, num_microbatches: int):
        if not costs:
            raise ValueError("no layer costs")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.costs = list(costs)
        self.hw = hw
        self.m = num_microbatches
        self.n = n = len(costs)
        self.bw = hw.bandwidth_bytes_per_s

        def prefix(values: Sequence[float]) -> list[float]:
            acc, out = 0.0, [0.0]
            for v in values:
                acc += v
                out.append(acc)
            return out

        self._f = prefix([c.forward_s for c in costs])
        self._b = prefix([c.backward_s for c in costs])
        self._p = prefix([c.param_bytes for c in costs])
        self._g = prefix([c.grad_bytes for c in costs])
        self._w = prefix([c.work_bytes for c in costs])
        self.act = [c.activation_bytes for c in costs] + [0]
        # Peak forward transient over [a, b): a table, n is at most a few hundred.
        self._fmax = [[0] * (n + 1) for _ in range(n + 1)]
        for a in range(n):
            peak = 0
            for b in range(a + 1, n + 1):
                peak = max(peak, costs[b - 1].forward_work_bytes)
                self._fmax[a][b] = peak
        self.labels_bytes = self.act[0]  # labels travel like token ids

    def name(self, layer: int) -> str:
        nm = self.costs[layer].name
        return f"layer {layer} ({nm})" if nm else f"layer {layer}"

    def parts(self, kind: str, a: int, b: int) -> tuple[float, int, int, int, int]:
        """(compute_s at speed 1, upload bytes, download bytes, resident, run) of a stage."""
        m, act = self.m, self.act
        p = int(self._p[b] - self._p[a])
        if kind == "F":
            compute = m * (self._f[b] - self._f[a])
            up = p + m * act[a]
            down = m * act[b]
            resident = p
            run = p + self._fmax[a][b] + 2 * (act[a] + act[b])
        else:
            g = int(self._g[b] - self._g[a])
            compute = m * (self._b[b] - self._b[a])
            work = int(self._w[b] - self._w[a])
            if kind == "B":
                up = p + m * (act[a] + act[b])
                down = g + (m * act[a] if a > 0 else 0)
                run = p + g + work + 3 * act[a] + 2 * act[b]
            else:  # tail
                up = p + m * (act[a] + self.labels_bytes)
                down = g + (m * act[a] if a > 0 else 0)
                run = p + g + work + 3 * act[a]
            resident = p + g
        return compute, up, down, resident, run

    def estimate(self, kind: str, a: int, b: int, label: str) -> StageEstimate:
        compute, up, down, resident, run = self.parts(kind, a, b)
        up_s, down_s = up / self.bw, down / self.bw
        # The first microbatch's input is the one upload compute waits for; the weights
        # came during the previous task, later microbatches during earlier ones.
        first_input_s = (up - int(self._p[b] - self._p[a])) / self.m / self.bw
        return StageEstimate(
            kind=kind,
            start=a,
            stop=b,
            label=label,
            compute_s=compute,
            upload_bytes=up,
            download_bytes=down,
            upload_s=up_s,
            download_s=down_s,
            time_s=max(compute + first_input_s, up_s, down_s) + self.hw.task_overhead_s,
            resident_bytes=resident,
            run_bytes=run,
            memory_bytes=0,  # filled in once the whole plan is known
        )

    def sim_stage(self, est: StageEstimate) -> SimStage:
        a, b = est.start, est.stop
        per_mb = est.compute_s / self.m
        weights = int(self._p[b] - self._p[a])
        grads = int(self._g[b] - self._g[a]) if est.kind != "F" else 0
        # The hand-off of each microbatch: the producer's copy to host memory plus this
        # stage's copy to the device, of the tensor crossing the boundary.
        boundary = a if est.kind in ("F", "T") else b
        handoff = 2 * self.act[boundary] / self.bw
        opt = 0.0
        if est.kind != "F" and self.hw.optimizer_params_per_s:
            opt = (grads // 4) / self.hw.optimizer_params_per_s
        return SimStage(
            kind=est.kind,  # type: ignore[arg-type]
            start=a,
            stop=b,
            compute_s=per_mb,
            upload_s=weights / self.bw,
            download_s=grads / self.bw,
            handoff_s=handoff,
            overhead_s=self.hw.task_overhead_s,
            optimizer_s=opt,
            label=est.label,
        )


def _plan_estimates(cm: _CostModel, plan: Plan) -> list[StageEstimate]:
    ests = [cm.estimate("F", a, b, f"F{i}") for i, (a, b) in enumerate(plan.forward)]
    ests.append(cm.estimate("T", plan.tail[0], plan.tail[1], "T"))
    ests += [cm.estimate("B", a, b, f"B{i}") for i, (a, b) in enumerate(plan.backward)]
    # Memory: running stage + the largest stage's weights and gradients (the prefetched
    # next task; with S <= N it can be the same stage of the next iteration) + reserve.
    largest = max(e.resident_bytes for e in ests)
    return [replace(e, memory_bytes=e.run_bytes + largest + cm.hw.reserved_bytes) for e in ests]


def _per_worker_memory(
    cm: _CostModel, ests: Sequence[StageEstimate], iterations: int, counter_start: int = 0
) -> list[int]:
    n, s_count = cm.hw.num_workers, len(ests)
    total = iterations * s_count
    peak = [0] * n
    for j in range(total):
        w = (counter_start + j) % n
        cur = ests[j % s_count]
        prefetched = ests[(j + n) % s_count].resident_bytes  # the worker's next task
        peak[w] = max(peak[w], cur.run_bytes + prefetched + cm.hw.reserved_bytes)
    return peak


def _evaluate(
    cm: _CostModel,
    plan: Plan,
    *,
    staleness: int,
    iterations: int,
    tokens_per_iteration: int | None,
    notes: Sequence[str] = (),
    objective: float | None = None,
) -> PlanResult:
    ests = _plan_estimates(cm, plan)
    sims = [cm.sim_stage(e) for e in ests]
    # Task j runs on worker j mod N: the assignment repeats every N / gcd(S, N)
    # iterations; simulate at least one full period after the first iteration.
    n_workers = cm.hw.num_workers
    iterations = max(iterations, 1 + n_workers // math.gcd(len(sims), n_workers))
    sim = simulate_roundpipe(
        sims,
        num_workers=cm.hw.num_workers,
        num_microbatches=cm.m,
        iterations=iterations,
        speeds=cm.hw.speeds,
        staleness=staleness,
        tokens_per_iteration=tokens_per_iteration,
    )
    times = tuple(e.time_s for e in ests)
    slowest = max(times)
    if objective is None:
        objective = max(len(ests), cm.hw.num_workers) * slowest / cm.hw.min_speed
    all_notes = list(notes) + _auto_notes(cm, ests, sims, sim)
    return PlanResult(
        plan=plan,
        predicted_iteration_s=sim.iteration_s,
        stage_times=times,
        per_stage_memory=tuple(e.memory_bytes for e in ests),
        notes=tuple(all_notes),
        stages=tuple(ests),
        objective_s=objective,
        num_workers=cm.hw.num_workers,
        num_microbatches=cm.m,
        memory_limit_bytes=cm.hw.memory_limit_bytes,
        per_worker_memory=tuple(_per_worker_memory(cm, ests, iterations)),
        simulation=sim,
        sim_stages=tuple(sims),
        tokens_per_iteration=tokens_per_iteration,
        costs=tuple(cm.costs),
        hardware=cm.hw,
    )


def _auto_notes(
    cm: _CostModel, ests: Sequence[StageEstimate], sims: Sequence[SimStage], sim: SimResult
) -> list[str]:
    notes = []
    hw = cm.hw
    if cm.m < hw.num_workers + 1 and len(ests) > 1:
        notes.append(
            f"{cm.m} microbatches for {hw.num_workers} workers: with fewer than N+1 = "
            f"{hw.num_workers + 1} the pipeline idles between tasks; raise the microbatch count"
        )
    limited = [e.label for e in ests if e.bound != "compute"]
    if limited:
        notes.append(
            "transfer-bound stages (PCIe time exceeds compute): "
            + ", ".join(limited[:8])
            + (" ..." if len(limited) > 8 else "")
        )
    worst = max(ests, key=lambda e: e.memory_bytes)
    if worst.memory_bytes > hw.memory_limit_bytes:
        notes.append(
            f"stage {worst.label} needs {format_bytes(worst.memory_bytes)}, over the "
            f"{format_bytes(hw.memory_limit_bytes)} limit"
        )
    opt = sum(s.optimizer_s for s in sims)
    if opt > 0.9 * sim.iteration_s:
        notes.append(
            f"the CPU optimizer needs {_format_s(opt)} per step, about the iteration time "
            f"({_format_s(sim.iteration_s)}): it throttles the pipeline; raise the "
            "microbatch count (a bigger global batch) or use a faster optimizer"
        )
    if hw.mixed:
        notes.append(
            "mixed worker speeds "
            + ",".join(f"{v:g}" for v in hw.speed_list)
            + f"; {len(ests)} stages"
            + (
                f" = {len(ests) // hw.num_workers} x {hw.num_workers} workers: stage i always "
                "runs on worker i mod N (sized to its speed)"
                if len(ests) % hw.num_workers == 0
                else ": stages rotate over the workers (sized for the slowest)"
            )
        )
    return notes


# ================================================================================ search


_INF = float("inf")


@dataclass(order=True)
class _Candidate:
    objective: float
    num_stages: int
    plan: Plan = field(compare=False)
    note: str = field(compare=False, default="")


class _Search:
    """The partition search for one cost model."""

    def __init__(self, cm: _CostModel, fits: Callable[[Plan], bool] | None = None):
        self.cm = cm
        self.fits = fits  # candidate filter (plan_stages' ``fits``)
        n = cm.n
        self.speed = cm.hw.min_speed  # rotating stages may land on the slowest worker
        # Segment tables for every a < b <= n-1 (the tail always holds layer n-1).
        self.t_f = [[_INF] * n for _ in range(n)]
        self.t_b = [[_INF] * n for _ in range(n)]
        self.res_f = [[0] * n for _ in range(n)]
        self.res_b = [[0] * n for _ in range(n)]
        self.run_f = [[0] * n for _ in range(n)]
        self.run_b = [[0] * n for _ in range(n)]
        self.comp_f = [[0.0] * n for _ in range(n)]
        self.comp_b = [[0.0] * n for _ in range(n)]
        self.xfer_f = [[0.0] * n for _ in range(n)]
        self.xfer_b = [[0.0] * n for _ in range(n)]
        bw, ovh = cm.bw, cm.hw.task_overhead_s
        for a in range(n - 1):
            for b in range(a + 1, n):
                for kind, tt, rr, uu, cc, xx in (
                    ("F", self.t_f, self.res_f, self.run_f, self.comp_f, self.xfer_f),
                    ("B", self.t_b, self.res_b, self.run_b, self.comp_b, self.xfer_b),
                ):
                    compute, up, down, resident, run = cm.parts(kind, a, b)
                    cc[a][b] = compute
                    xx[a][b] = max(up, down) / bw
                    tt[a][b] = max(compute / self.speed, xx[a][b]) + ovh
                    rr[a][b] = resident
                    uu[a][b] = run

    # -- greedy packing -----------------------------------------------------------------

    def _ok(self, kind: str, a: int, b: int, cap: float, budget: int, room: int) -> bool:
        if kind == "F":
            t, res, run = self.t_f[a][b], self.res_f[a][b], self.run_f[a][b]
        else:
            t, res, run = self.t_b[a][b], self.res_b[a][b], self.run_b[a][b]
        return t <= cap and res <= budget and run <= room

    def greedy_f(self, t: int, cap: float, budget: int, room: int) -> list[tuple[int, int]] | None:
        out, a = [], 0
        while a < t:
            if not self._ok("F", a, a + 1, cap, budget, room):
                return None
            b = a + 1
            while b < t and self._ok("F", a, b + 1, cap, budget, room):
                b += 1
            out.append((a, b))
            a = b
        return out

    def greedy_b(self, t: int, cap: float, budget: int, room: int) -> list[tuple[int, int]] | None:
        out, b = [], t
        while b > 0:
            if not self._ok("B", b - 1, b, cap, budget, room):
                return None
            a = b - 1
            while a > 0 and self._ok("B", a - 1, b, cap, budget, room):
                a -= 1
            out.append((a, b))
            b = a
        return out

    def pareto(
        self, kind: str, t: int, budget: int, room: int, floor: float
    ) -> list[tuple[int, float]]:
        """(stage count, minimal slowest-stage time) for every useful count, ascending count.

        Exact min-max partitions: for each count the smallest cap whose greedy packing
        needs at most that many stages (binary search over all segment times).
        """
        tt = self.t_f if kind == "F" else self.t_b
        rr = self.res_f if kind == "F" else self.res_b
        uu = self.run_f if kind == "F" else self.run_b
        caps = sorted(
            {
                tt[a][b]
                for a in range(t)
                for b in range(a + 1, t + 1)
                if rr[a][b] <= budget and uu[a][b] <= room
            }
        )
        if not caps:
            return []
        greedy = self.greedy_f if kind == "F" else self.greedy_b
        memo: dict[int, float] = {}

        def count(i: int) -> float:
            if i not in memo:
                parts = greedy(t, caps[i], budget, room)
                memo[i] = _INF if parts is None else len(parts)
            return memo[i]

        hi = len(caps) - 1
        p = count(hi)
        if p == _INF:
            return []
        out: list[tuple[int, float]] = []
        while True:
            lo, top = 0, hi
            while lo < top:
                mid = (lo + top) // 2
                if count(mid) <= p:
                    top = mid
                else:
                    lo = mid + 1
            out.append((int(count(lo)), caps[lo]))
            if caps[lo] <= floor or lo == 0 or count(lo - 1) == _INF:
                break
            hi = lo - 1
            p = count(hi)
        return out

    # -- one tail / budget --------------------------------------------------------------

    def candidates_for(
        self, t: int, tail_time: float, budget: int, room: int, keep: list[_Candidate], k: int
    ) -> None:
        n_workers = self.cm.hw.num_workers
        singles_f = max(self.t_f[a][a + 1] for a in range(t))
        singles_b = max(self.t_b[a][a + 1] for a in range(t))
        floor = max(tail_time, singles_f, singles_b)
        fwd = self.pareto("F", t, budget, room, floor)
        bwd = self.pareto("B", t, budget, room, floor)
        n = self.cm.n
        for p, fcap in fwd:
            for q, bcap in bwd:
                cap = max(fcap, bcap, tail_time)
                stages = p + 1 + q
                obj = max(stages, n_workers) * cap
                if len(keep) >= k and -keep[0].objective <= obj:
                    continue
                fparts = self.greedy_f(t, fcap, budget, room)
                bparts = self.greedy_b(t, bcap, budget, room)
                assert fparts is not None and bparts is not None
                plan = Plan(forward=fparts, tail=(t, n), backward=bparts)
                _push(keep, _Candidate(obj, stages, plan), k, self.fits)

    # -- mixed speeds: stage i always on worker i mod N -----------------------------------

    def _seg_time(self, kind: str, a: int, b: int, speed: float) -> float:
        cc = self.comp_f if kind == "F" else self.comp_b
        xx = self.xfer_f if kind == "F" else self.xfer_b
        return max(cc[a][b] / speed, xx[a][b]) + self.cm.hw.task_overhead_s

    def _pack_positions(
        self, kind: str, t: int, cap: float, budget: int, room: int, first_pos: int
    ) -> list[tuple[int, int]] | None:
        """Greedy packing where stage i (task position first_pos + i) runs on worker
        position mod N, so its cap is met at that worker's speed."""
        speeds = self.cm.hw.speed_list
        n_workers = len(speeds)
        res = self.res_f if kind == "F" else self.res_b
        run = self.run_f if kind == "F" else self.run_b

        def good(x: int, y: int, speed: float) -> bool:
            return (
                self._seg_time(kind, x, y, speed) <= cap
                and res[x][y] <= budget
                and run[x][y] <= room
            )

        out: list[tuple[int, int]] = []
        if kind == "F":
            a = 0
            while a < t:
                speed = speeds[(first_pos + len(out)) % n_workers]
                if not good(a, a + 1, speed):
                    return None
                b = a + 1
                while b < t and good(a, b + 1, speed):
                    b += 1
                out.append((a, b))
                a = b
        else:
            b = t
            while b > 0:
                speed = speeds[(first_pos + len(out)) % n_workers]
                if not good(b - 1, b, speed):
                    return None
                a = b - 1
                while a > 0 and good(a - 1, b, speed):
                    a -= 1
                out.append((a, b))
                b = a
        return out

    def _pad_backward(
        self,
        bparts: list[tuple[int, int]],
        first_pos: int,
        extra: int,
        cap: float,
        budget: int,
        room: int,
    ) -> list[tuple[int, int]] | None:
        """Split backward stages (from the last) until there are ``extra`` more, every
        stage still meeting ``cap`` at the speed of the worker its position maps to."""
        speeds = self.cm.hw.speed_list
        n_workers = len(speeds)

        def fits(parts: list[tuple[int, int]]) -> bool:
            return all(
                self._seg_time("B", a, b, speeds[(first_pos + i) % n_workers]) <= cap
                and self.res_b[a][b] <= budget
                and self.run_b[a][b] <= room
                for i, (a, b) in enumerate(parts)
            )

        parts = list(bparts)
        for _ in range(extra):
            done = False
            for i in range(len(parts) - 1, -1, -1):
                a, b = parts[i]
                for cut in range(b - 1, a, -1):
                    trial = parts[:i] + [(cut, b), (a, cut)] + parts[i + 1 :]
                    if fits(trial):
                        parts, done = trial, True
                        break
                if done:
                    break
            if not done:
                return None
        return parts

    def speed_matched(
        self,
        t: int,
        budget: int,
        room: int,
        keep: list[_Candidate],
        k: int,
        tail_parts: tuple[float, float],
    ) -> None:
        """Stages sized to the worker they always land on (stage count a multiple of N).

        With S = c x N stages per iteration, task j = k S + i runs on worker i mod N in
        every iteration, so stage i may take as long on its worker as the others take
        on theirs. Sweeps a geometric grid of caps; keeps plans with S a multiple of N.
        """
        hw = self.cm.hw
        n_workers, speeds = hw.num_workers, hw.speed_list
        ovh = hw.task_overhead_s
        n = self.cm.n
        tail_compute, tail_xfer = tail_parts
        fastest = max(speeds)
        lo = max(
            max(self._seg_time("F", a, a + 1, fastest) for a in range(t)),
            max(self._seg_time("B", a, a + 1, fastest) for a in range(t)),
            max(tail_compute / fastest, tail_xfer) + ovh,
        )
        hi = (self.comp_f[0][t] + self.comp_b[0][t] + tail_compute) / min(speeds) + ovh
        hi = max(hi, lo)
        steps = 120
        seen: set[Plan] = set()
        for i in range(steps + 1):
            cap = lo * (hi / lo) ** (i / steps)
            fparts = self._pack_positions("F", t, cap, budget, room, 0)
            if fparts is None:
                continue
            tpos = len(fparts)
            tail_t = max(tail_compute / speeds[tpos % n_workers], tail_xfer) + ovh
            if tail_t > cap:
                continue
            bparts = self._pack_positions("B", t, cap, budget, room, tpos + 1)
            if bparts is None:
                continue
            stages = len(fparts) + 1 + len(bparts)
            if stages % n_workers:
                padded = self._pad_backward(
                    bparts, tpos + 1, n_workers - stages % n_workers, cap, budget, room
                )
                if padded is None:
                    continue
                bparts = padded
                stages = len(fparts) + 1 + len(bparts)
            plan = Plan(forward=fparts, tail=(t, n), backward=bparts)
            if plan in seen:
                continue
            seen.add(plan)
            times = [
                self._seg_time("F", x, y, speeds[j % n_workers]) for j, (x, y) in enumerate(fparts)
            ]
            times.append(tail_t)
            times += [
                self._seg_time("B", x, y, speeds[(tpos + 1 + j) % n_workers])
                for j, (x, y) in enumerate(bparts)
            ]
            load = [0.0] * n_workers
            for j, tm in enumerate(times):
                load[j % n_workers] += tm
            _push(
                keep, _Candidate(n_workers * max(load), stages, plan, "speed-matched"), k, self.fits
            )


def _push(
    keep: list[_Candidate], cand: _Candidate, k: int, fits: Callable[[Plan], bool] | None = None
) -> None:
    """Keep the k best candidates (a max-heap on the objective via negation) among those
    ``fits`` accepts."""
    if fits is not None and not fits(cand.plan):
        return
    for c in keep:
        if c.plan == cand.plan:
            return
    item = _Candidate(-cand.objective, -cand.num_stages, cand.plan, cand.note)
    if len(keep) < k:
        heapq.heappush(keep, item)
    elif item > keep[0]:
        heapq.heapreplace(keep, item)


def _check_single_layers(cm: _CostModel) -> None:
    """Raise ValueError if a layer cannot run on one GPU even in a stage of its own."""
    hw = cm.hw
    n = cm.n
    for layer in range(n):
        c = cm.costs[layer]
        if layer == n - 1:
            *_, run = cm.parts("T", layer, n)
            kind = "in the tail"
        else:
            *_, run = cm.parts("B", layer, layer + 1)
            kind = "in a backward stage"
        need = run + hw.reserved_bytes
        if need > hw.memory_limit_bytes:
            raise ValueError(
                f"{cm.name(layer)} does not fit one GPU: {kind} it needs "
                f"{format_bytes(need)} (weights {format_bytes(c.param_bytes)}, fp32 gradients "
                f"{format_bytes(c.grad_bytes)}, working memory {format_bytes(c.work_bytes)} "
                f"for one microbatch, I/O buffers, {format_bytes(hw.reserved_bytes)} reserved) "
                f"but the memory limit is {format_bytes(hw.memory_limit_bytes)}; use a "
                "shorter sequence or smaller microbatches, LoRA, or GPUs with more memory"
            )


def plan_stages(
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    max_tail_layers: int | None = None,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    candidates: int = 12,
    sim_iterations: int = 4,
    select: str = "simulation",
    fits: Callable[[Plan], bool] | None = None,
) -> PlanResult:
    """Choose forward stages, fused tail and backward stages for ``costs`` on ``hw``.

    Minimises ``max(stages, N) x slowest stage`` (stage time = max of compute over M
    microbatches at the slowest worker's speed and the PCIe time of its uploads and
    downloads) subject to the memory limit, over tails of 1..``max_tail_layers`` layers
    (default: all, pruned once the tail alone is too slow) and weight budgets; the best
    ``candidates`` plans are then simulated and the fastest in simulation is returned
    (``select="objective"``: the best by the objective alone, fewest stages on ties).
    With mixed worker speeds, plans whose stage count is a multiple of N (stage i always
    on worker i mod N) with stages sized to their worker's speed are candidates too.

    ``fits``: only plans it accepts are candidates (the trainer's re-planner passes the
    slot-pool check, Note [slot pools] in roundpipe.coordinator.layout).

    Raises ValueError when a single layer cannot fit the memory limit (naming it and the
    numbers) or when no plan fits at all.
    """
    if select not in ("simulation", "objective"):
        raise ValueError(f"select must be 'simulation' or 'objective', got {select!r}")
    cm = _CostModel(costs, hw, num_microbatches)
    _check_single_layers(cm)
    n = cm.n
    search = _Search(cm, fits)
    room_total = hw.usable_bytes
    kmax = n if max_tail_layers is None else max(1, min(n, max_tail_layers))
    keep: list[_Candidate] = []
    best_obj = _INF
    tried_tails = 0
    for tail_len in range(1, kmax + 1):
        t = n - tail_len
        compute, up, down, tail_res, tail_run = cm.parts("T", t, n)
        tail_time = max(compute / search.speed, up / cm.bw, down / cm.bw) + hw.task_overhead_s
        if tail_run > room_total:
            break  # longer tails only need more memory
        if max(1, hw.num_workers) * tail_time >= best_obj:
            break  # the tail alone already costs more than the best plan so far
        tried_tails += 1
        if t == 0:
            obj = max(1, hw.num_workers) * tail_time
            single = Plan(forward=(), tail=(0, n), backward=())
            _push(keep, _Candidate(obj, 1, single), candidates, fits)
            best_obj = min(best_obj, obj)
            continue
        lo = max(
            tail_res,
            max(search.res_b[a][a + 1] for a in range(t)),
        )
        lo_run = max(
            tail_run,
            max(search.run_b[a][a + 1] for a in range(t)),
            max(search.run_f[a][a + 1] for a in range(t)),
        )
        hi = room_total - lo_run
        lo = max(lo, 1)
        if hi < lo:
            continue
        # Weight budgets: the largest stage's weights+grads is what every other stage must
        # leave room for (it may be the prefetched one). If the whole range fits as one
        # stage of each kind, memory never binds and one budget is enough.
        full_res = max(search.res_b[0][t], tail_res)
        full_run = max(search.run_b[0][t], search.run_f[0][t], tail_run)
        if full_res + full_run <= room_total:
            budgets = [full_res]
        else:
            steps = 6
            budgets = sorted({int(lo * (hi / lo) ** (i / (steps - 1))) for i in range(steps)})
            budgets[-1] = hi
        for budget in budgets:
            room = room_total - budget
            if tail_res > budget or tail_run > room:
                continue
            search.candidates_for(t, tail_time, budget, room, keep, candidates)
            if hw.mixed and hw.num_workers > 1:
                search.speed_matched(
                    t, budget, room, keep, candidates, (compute, max(up, down) / cm.bw)
                )
        if keep:
            best_obj = min(best_obj, min(-c.objective for c in keep))
    if not keep:
        worst = max(range(n - 1), key=lambda i: search.run_b[i][i + 1] + search.res_b[i][i + 1])
        need = search.run_b[worst][worst + 1] + search.res_b[worst][worst + 1] + hw.reserved_bytes
        raise ValueError(
            f"no plan fits {format_bytes(hw.memory_limit_bytes)} per GPU: every stage must "
            "hold its own weights, gradients and working memory plus the prefetched next "
            f"stage's weights and gradients; {cm.name(worst)} alone needs about "
            f"{format_bytes(need)} that way. Use a shorter sequence or smaller microbatches, "
            "LoRA, or GPUs with more memory"
        )
    results = []
    for cand in sorted(keep, key=lambda c: (-c.objective, -c.num_stages)):
        notes = [f"tail of {n - cand.plan.tail[0]} layer(s)"]
        if cand.note:
            notes.append(cand.note)
        res = _evaluate(
            cm,
            cand.plan,
            staleness=staleness,
            iterations=sim_iterations,
            tokens_per_iteration=tokens_per_iteration,
            notes=notes,
            objective=-cand.objective,
        )
        results.append(res)
    if select == "objective":
        best = min(results, key=lambda r: (r.objective_s, len(r.stages)))
    else:
        best = min(results, key=lambda r: (r.predicted_iteration_s, len(r.stages)))
    extra = (
        f"searched {tried_tails} tail length(s), simulated {len(results)} candidate plans; "
        f"search objective max(stages, N) x slowest = {_format_s(best.objective_s)}"
    )
    return replace(best, notes=best.notes + (extra,))


def evaluate_plan(
    plan: Plan,
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    sim_iterations: int = 4,
) -> PlanResult:
    """Predict what a given plan does under ``costs`` (no search; memory not enforced,
    an over-limit stage is named in the notes)."""
    plan.validate(len(costs))
    cm = _CostModel(costs, hw, num_microbatches)
    return _evaluate(
        cm,
        plan,
        staleness=staleness,
        iterations=sim_iterations,
        tokens_per_iteration=tokens_per_iteration,
    )


def replan_if_better(
    current: Plan,
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    min_gain: float = 0.05,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    max_tail_layers: int | None = None,
    fits: Callable[[Plan], bool] | None = None,
) -> PlanResult | None:
    """A new plan if it is predicted at least ``min_gain`` (relative) faster than
    ``current`` under the same (measured) costs, else None. Both are simulated alike.
    ``fits`` restricts the candidates as in :func:`plan_stages`; None is also the answer
    when no candidate passes it."""
    try:
        new = plan_stages(
            costs,
            hw,
            num_microbatches,
            max_tail_layers=max_tail_layers,
            staleness=staleness,
            tokens_per_iteration=tokens_per_iteration,
            fits=fits,
        )
    except ValueError:
        if fits is None:
            raise
        return None  # nothing better fits the job's slot pools
    if new.plan == current:
        return None
    old = evaluate_plan(
        current,
        costs,
        hw,
        num_microbatches,
        staleness=staleness,
        tokens_per_iteration=tokens_per_iteration,
    )
    if new.predicted_iteration_s < old.predicted_iteration_s * (1 - min_gain):
        return replace(new, replaces_iteration_s=old.predicted_iteration_s)
    return None


def initial_plan(
    model: LayeredModel,
    *,
    num_workers: int,
    microbatch_rows: int,
    seq_len: int,
    num_microbatches: int,
    compute_dtype: Any = "bfloat16",
    memory_limit_bytes: int | None = None,
    flops_per_s: float = 82.6e12,
    bandwidth_bytes_per_s: float = 25e9,
    speeds: Sequence[float] | None = None,
    staleness: int = 1,
) -> PlanResult:
    """Cold-start plan for a job: ``estimate_costs`` + ``plan_stages`` in one call.

    ``memory_limit_bytes=None`` means no GPU limit (CPU workers). The result's
    ``costs`` are the prior to give ``ProfileAggregator`` for re-planning.
    """
    limit = memory_limit_bytes if memory_limit_bytes is not None else 1 << 60
    hw = HardwareSpec(
        num_workers=num_workers,
        memory_limit_bytes=limit,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        speeds=tuple(speeds) if speeds is not None else None,
        reserved_bytes=GiB if memory_limit_bytes is not None else 0,
    )
    costs = estimate_costs(
        model,
        microbatch_rows=microbatch_rows,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        flops_per_s=flops_per_s,
    )
    return plan_stages(
        costs,
        hw,
        num_microbatches,
        staleness=staleness,
        tokens_per_iteration=num_microbatches * microbatch_rows * seq_len,
    )


# ===================================================================== bound baselines


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
    best = [[_INF] * (n + 1) for _ in range(parts + 1)]
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


# ==================================================================== measured profiles


def _parse_key(key: str) -> tuple[int, str] | None:
    layer, _, phase = key.partition(".")
    if not layer.isdigit():
        return None
    return int(layer), phase


_KINDS = {"forward": "F", "F": "F", "backward": "B", "B": "B", "tail": "T", "T": "T"}


class ProfileAggregator:
    """Measured per-layer times -> ``LayerCost``s for re-planning.

    Feed it every ``TaskDone`` (``record_done``, or ``record`` with the task's kind) and
    call ``end_iteration(k)`` once iteration k's tasks are all done. ``layer_times`` keys
    are ``"<layer>"`` or ``"<layer>.<phase>"`` with seconds for the whole task (all its
    microbatches):

    * forward task: the layer's forward (``"12.fwd"``, or ``"12"``);
    * backward task: recompute + backward of the layer (``"12"``, or the sum of its
      phases, e.g. ``"12.fwd"`` (recompute) + ``"12.bwd"``);
    * tail task: forward + backward of the layer, same keys as backward.

    Samples are divided by the task's microbatch count and multiplied by the worker's
    relative speed (so a half-speed worker's times count as a reference worker's), then
    averaged per iteration (re-runs of a task), and folded into an exponential moving
    average with weight ``alpha`` for the newest iteration. The first
    ``warmup_iterations`` iterations seen are dropped (allocator warm-up, cuDNN/cuBLAS
    autotuning, first uploads). ``settled`` turns true once every layer has a backward
    (or tail) measurement and, for ``settle_iterations`` consecutive folded iterations,
    the averages moved by less than ``settle_tolerance`` of their total (sum of absolute
    changes over sum of averages).

    ``costs()`` returns the prior (cold-start) costs with measured times: a layer only
    ever measured in the tail gets its forward time from its measured tail time and the
    prior's forward/backward ratio; a layer with no measurement is scaled by the median
    measured/prior ratio. Byte counts always come from the prior.
    """

    def __init__(
        self,
        prior: Sequence[LayerCost],
        num_microbatches: int,
        *,
        alpha: float = 0.5,
        warmup_iterations: int = 1,
        settle_tolerance: float = 0.05,
        settle_iterations: int = 2,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.prior = list(prior)
        self.num_microbatches = num_microbatches
        self.alpha = alpha
        self.warmup_iterations = warmup_iterations
        self.settle_tolerance = settle_tolerance
        self.settle_iterations = settle_iterations
        self.ema: dict[tuple[int, str], float] = {}  # (layer, "fwd"|"bwd") -> s per microbatch
        self._pending: dict[int, dict[tuple[int, str], list[float]]] = {}
        self._first_iteration: int | None = None
        self._calm = 0
        self.folded_iterations = 0
        self.last_change: float | None = None
        """How much the averages moved at the last folded iteration, relative to their
        total (infinite when a layer was measured for the first time)."""

    def record(
        self,
        iteration: int,
        kind: str,
        layer_times: Mapping[str, float],
        *,
        worker_speed: float = 1.0,
        num_microbatches: int | None = None,
    ) -> None:
        """One task's measurements (kind: forward/backward/tail or F/B/T)."""
        if kind not in _KINDS:
            raise ValueError(f"unknown task kind {kind!r}: expected forward, tail or backward")
        k = _KINDS[kind]
        if self._first_iteration is None or iteration < self._first_iteration:
            self._first_iteration = iteration
        m = num_microbatches or self.num_microbatches
        scale = worker_speed / m
        total: dict[int, float] = {}
        bare: dict[int, float] = {}
        for key, seconds in layer_times.items():
            parsed = _parse_key(key)
            if parsed is None or not 0 <= parsed[0] < len(self.prior):
                continue
            layer, phase = parsed
            if k == "F" and phase not in ("", "fwd"):
                continue
            if phase == "":
                bare[layer] = float(seconds)
            else:
                total[layer] = total.get(layer, 0.0) + float(seconds)
        total.update(bare)  # a bare "<layer>" key is the layer's total
        bucket = self._pending.setdefault(iteration, {})
        phase_name = "fwd" if k == "F" else "bwd"
        for layer, seconds in total.items():
            bucket.setdefault((layer, phase_name), []).append(seconds * scale)

    def record_done(self, task: Any, done: Any, *, worker_speed: float = 1.0) -> None:
        """Convenience: a ``StageTask`` and its ``TaskDone``."""
        self.record(
            task.iteration,
            task.kind,
            done.layer_times,
            worker_speed=worker_speed,
            num_microbatches=task.num_microbatches,
        )

    def end_iteration(self, iteration: int) -> None:
        """Fold the samples of ``iteration`` (and any earlier ones still pending)."""
        for k in sorted(i for i in self._pending if i <= iteration):
            samples = self._pending.pop(k)
            assert self._first_iteration is not None
            if k < self._first_iteration + self.warmup_iterations:
                continue
            moved = before = 0.0
            fresh = False
            for key, values in samples.items():
                x = sum(values) / len(values)
                old = self.ema.get(key)
                if old is None:
                    self.ema[key] = x
                    fresh = True
                    continue
                new = self.alpha * x + (1 - self.alpha) * old
                self.ema[key] = new
                moved += abs(new - old)
                before += old
            # The share of the measured time that moved: big layers, which decide the
            # plan, count most; a tiny layer's jitter (large relative, small absolute)
            # does not hold settling back.
            if fresh:
                change = _INF
            elif before > 0:
                change = moved / before
            else:
                change = _INF if moved > 0 else 0.0
            self.folded_iterations += 1
            self.last_change = change
            self._calm = self._calm + 1 if change < self.settle_tolerance else 0

    @property
    def covered(self) -> bool:
        """Every layer with backward work has a backward/tail measurement (forward times
        can be inferred; LoRA's prefix has no backward to measure)."""
        return all(
            (layer, "bwd") in self.ema for layer, p in enumerate(self.prior) if p.backward_s > 0
        )

    @property
    def settled(self) -> bool:
        return self.covered and self._calm >= self.settle_iterations

    def restart_settling(self) -> None:
        """Keep the averages but require ``settle_iterations`` calm iterations again
        before ``settled`` (the trainer calls it after each re-planning attempt)."""
        self._calm = 0

    def costs(self) -> list[LayerCost]:
        ratios = []
        for (layer, phase), v in self.ema.items():
            p = self.prior[layer]
            ref = p.forward_s if phase == "fwd" else p.backward_s
            if ref > 0:
                ratios.append(v / ref)
        ratios.sort()
        global_scale = ratios[len(ratios) // 2] if ratios else 1.0
        out = []
        for layer, p in enumerate(self.prior):
            fwd = self.ema.get((layer, "fwd"))
            bwd = self.ema.get((layer, "bwd"))
            if fwd is None and bwd is not None and p.backward_s > 0:
                fwd = p.forward_s * bwd / p.backward_s
            if bwd is None and fwd is not None and p.forward_s > 0:
                bwd = p.backward_s * fwd / p.forward_s
            if fwd is None:
                fwd = p.forward_s * global_scale
            if bwd is None:
                bwd = p.backward_s * global_scale
            out.append(replace(p, forward_s=fwd, backward_s=bwd))
        return out


# ================================================================== describe / CLI


def describe(result: PlanResult) -> str:
    """A printable table of a plan: stage, layers, times, transfers, memory."""
    hw_line = (
        f"plan {result.plan}   ({len(result.plan.forward)} forward, 1 tail, "
        f"{len(result.plan.backward)} backward stages; {result.num_workers} workers, "
        f"{result.num_microbatches} microbatches)"
    )
    headers = ("stage", "layers", "compute", "upload", "download", "time", "bound", "memory")
    rows = []
    for e in result.stages:
        rows.append(
            (
                e.label,
                f"{e.start}:{e.stop}",
                _format_s(e.compute_s),
                _format_s(e.upload_s),
                _format_s(e.download_s),
                _format_s(e.time_s),
                e.bound,
                format_bytes(e.memory_bytes),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [hw_line, line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    sim = result.simulation
    summary = (
        f"predicted iteration {_format_s(result.predicted_iteration_s)}, bubble "
        f"{100 * sim.bubble_fraction:.1f}%, slowest stage {_format_s(result.slowest_stage_s)}"
    )
    tps = result.predicted_tokens_per_s
    if tps is not None:
        summary += f", {tps:,.0f} tokens/s"
    out.append(summary)
    out.append(
        "peak memory per worker: "
        + " ".join(f"w{i} {format_bytes(b)}" for i, b in enumerate(result.per_worker_memory))
        + f" (limit {format_bytes(result.memory_limit_bytes)})"
    )
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _build_model(args: argparse.Namespace) -> LayeredModel:
    from roundpipe.shared.model import LayeredModel

    overrides = _parse_set(args.set or [])
    lora = None
    if args.lora_rank:
        lora = {
            "r": args.lora_rank,
            "alpha": args.lora_alpha,
            "target_modules": args.lora_targets.split(","),
        }
    if args.model_config:
        path = Path(args.model_config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read model config {str(path)!r}: {e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {str(path)!r} is not JSON: {e}") from e
        config.update(overrides)
        for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
            config.pop(key, None)
        return LayeredModel.from_config(config, lora)
    return LayeredModel.from_config({"model_type": args.architecture, **overrides}, lora)


def _host_memory(
    model: LayeredModel, plan: Plan, args: argparse.Namespace, num_microbatches: int
) -> tuple[Any, int]:
    """The job's host memory under ``plan`` (what admission control checks) and the
    model's parameter count."""
    import torch

    from roundpipe.coordinator.layout import JobLayout
    from roundpipe.coordinator.memory import host_memory_needed

    layout = JobLayout.plan_layout(
        model,
        plan,
        compute_dtype=getattr(torch, args.dtype),
        microbatch_rows=args.microbatch_size,
        seq_len=args.seq_len,
        num_microbatches=num_microbatches,
    )
    return host_memory_needed(layout), max(1, model.parameter_count())


def build_plan_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of ``roundpipe plan`` (on ``parser``, e.g. a CLI sub-parser)."""
    p = parser or argparse.ArgumentParser(
        prog="roundpipe plan",
        description="Choose a RoundPipe plan for a model on hypothetical hardware and predict "
        "its throughput, bubble fraction and memory with the schedule simulator "
        "(a prediction, not a measurement).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model-config", metavar="CONFIG.json", help="a HF config.json (or its directory)"
    )
    src.add_argument(
        "--architecture", choices=("llama", "qwen3", "qwen3_moe"), help="random-init architecture"
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="config override (JSON value)"
    )
    p.add_argument("--lora-rank", type=int, default=0, metavar="R", help="plan for LoRA of rank R")
    p.add_argument("--lora-alpha", type=float, default=16.0, metavar="A")
    p.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        metavar="NAMES",
    )
    p.add_argument("--workers", type=int, required=True, metavar="N")
    p.add_argument(
        "--memory-limit", default="24GiB", metavar="BYTES", help="per GPU (default 24GiB)"
    )
    p.add_argument("--seq-len", type=int, required=True, metavar="TOKENS")
    p.add_argument("--microbatch-size", type=int, default=1, metavar="ROWS")
    p.add_argument("--microbatches", type=int, default=None, metavar="M", help="default N+1")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--bandwidth", default="25GB/s", metavar="RATE", help="PCIe per GPU and direction"
    )
    p.add_argument(
        "--flops", default="82.6T", metavar="RATE", help="peak dense matmul FLOP/s per GPU"
    )
    p.add_argument("--efficiency", type=float, default=0.7, help="fraction of --flops achieved")
    p.add_argument(
        "--memory-bandwidth", default="1TB/s", metavar="RATE", help="GPU memory bandwidth"
    )
    p.add_argument("--speeds", default=None, metavar="V,V,...", help="relative speed per worker")
    p.add_argument("--reserve", default="1GiB", metavar="BYTES", help="per GPU, not for stages")
    p.add_argument("--staleness", type=int, default=1, choices=(0, 1))
    p.add_argument("--optimizer-rate", default=None, metavar="PARAMS/S", help="CPU AdamW rate")
    p.add_argument("--max-tail-layers", type=int, default=None, metavar="K")
    p.add_argument(
        "--plan", default=None, metavar="PLAN", help="evaluate this plan instead of searching"
    )
    p.add_argument("--compare", action="store_true", help="also simulate GPipe/1F1B, stages bound")
    p.add_argument("--grid", action="store_true", help="print the simulated schedule per worker")
    p.add_argument(
        "--timeline",
        default=None,
        metavar="FILE.png",
        help="draw the simulated schedule as `roundpipe timeline` draws a measured one",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--nodes", type=int, default=1, metavar="W", help="servers in a data-parallel group"
    )
    p.add_argument(
        "--network-bandwidth",
        default="1.25GB/s",
        metavar="BYTES/S",
        help="between the servers, per direction (default 10 GbE: %(default)s)",
    )
    return p


def run_plan_command(args: argparse.Namespace) -> int:
    """``roundpipe plan`` on parsed arguments; prints to stdout. Raises ValueError on bad input."""
    if args.workers < 1 or args.seq_len < 1 or args.microbatch_size < 1:
        raise ValueError("--workers, --seq-len and --microbatch-size must be >= 1")
    m = args.microbatches or args.workers + 1
    if m < 1:
        raise ValueError("--microbatches must be >= 1")
    speeds = None
    if args.speeds:
        speeds = tuple(float(x) for x in args.speeds.split(","))
    hw = HardwareSpec(
        num_workers=args.workers,
        memory_limit_bytes=int(parse_quantity(args.memory_limit, what="--memory-limit")),
        bandwidth_bytes_per_s=parse_quantity(args.bandwidth, what="--bandwidth"),
        speeds=speeds,
        reserved_bytes=int(parse_quantity(args.reserve, what="--reserve")),
        optimizer_params_per_s=parse_quantity(args.optimizer_rate, what="--optimizer-rate")
        if args.optimizer_rate
        else None,
    )
    model = _build_model(args)
    flops = parse_quantity(args.flops, what="--flops")
    costs = estimate_costs(
        model,
        microbatch_rows=args.microbatch_size,
        seq_len=args.seq_len,
        compute_dtype=args.dtype,
        flops_per_s=flops,
        efficiency=args.efficiency,
        memory_bandwidth=parse_quantity(args.memory_bandwidth, what="--memory-bandwidth"),
    )
    tokens = m * args.microbatch_size * args.seq_len
    if args.plan:
        result = evaluate_plan(
            Plan.parse(args.plan),
            costs,
            hw,
            m,
            staleness=args.staleness,
            tokens_per_iteration=tokens,
        )
    else:
        result = plan_stages(
            costs,
            hw,
            m,
            max_tail_layers=args.max_tail_layers,
            staleness=args.staleness,
            tokens_per_iteration=tokens,
        )
    baselines = []
    if args.compare:
        for schedule in ("gpipe", "1f1b"):
            baselines.append(
                bound_baseline(costs, hw, m, schedule=schedule, tokens_per_iteration=tokens)
            )
    host, params = _host_memory(model, result.plan, args, m)
    drawn = None
    if args.timeline:  # observability: the prediction as a picture (roundpipe.timeline_plot)
        from roundpipe.timeline_plot import draw_plan_timeline

        what = f"{model.architecture}, {hw.num_workers} workers, {m} microbatches"
        drawn = draw_plan_timeline(result, args.timeline, describe=what)
    header = (
        f"SIMULATED PREDICTION (cost model + schedule simulator, not a measurement): "
        f"{model.architecture}, {model.num_layers} layers"
        f"{' (LoRA r=' + str(args.lora_rank) + ')' if args.lora_rank else ''}, "
        f"{hw.num_workers} workers x {format_bytes(hw.memory_limit_bytes)}, "
        f"PCIe {hw.bandwidth_bytes_per_s / 1e9:g} GB/s, {flops / 1e12:g} TFLOPS x "
        f"{args.efficiency:g}, {args.dtype}, {m} microbatches x {args.microbatch_size} x "
        f"{args.seq_len} tokens"
    )
    multinode = _multinode_prediction(model, result, args, tokens)
    if args.json:
        doc = {
            "prediction": "simulated",
            "plan": str(result.plan),
            "predicted_iteration_s": result.predicted_iteration_s,
            "predicted_tokens_per_s": result.predicted_tokens_per_s,
            "bubble_fraction": result.bubble_fraction,
            "per_worker_memory": list(result.per_worker_memory),
            "stages": [asdict(e) for e in result.stages],
            "notes": list(result.notes),
            "host_memory": {
                "arenas": host.arenas,
                "masters": host.masters,
                "moments": host.moments,
                "total": host.total,
                "bytes_per_parameter": host.total / params,
            },
            "baselines": [
                {
                    "schedule": b.schedule,
                    "split": [list(r) for r in b.split],
                    "iteration_s": b.iteration_s,
                    "tokens_per_s": b.simulation.tokens_per_s,
                    "bubble_fraction": b.simulation.bubble_fraction,
                    "stage_memory": list(b.stage_memory),
                    "oom": b.oom,
                }
                for b in baselines
            ],
        }
        if multinode is not None:
            doc["multinode"] = asdict(multinode)
        print(json.dumps(doc, indent=2))
        return 0
    print(header)
    print(describe(result))
    print(
        f"this job needs {host.describe()}, {host.total / params:.1f} bytes per parameter "
        f"({params:,} parameters); the coordinator refuses a job that does not fit"
    )
    for b in baselines:
        tps = b.simulation.tokens_per_s or 0.0
        print(
            f"{b.schedule} with stages bound to GPUs (balanced split, weights resident, no "
            f"recompute): {tps:,.0f} tokens/s, bubble {100 * b.simulation.bubble_fraction:.1f}%, "
            f"peak memory {format_bytes(max(b.stage_memory))}" + (" -> OOM" if b.oom else "")
        )
    if multinode is not None:
        bandwidth = parse_quantity(args.network_bandwidth, what="--network-bandwidth")
        print(multinode.describe(bandwidth))
    if args.grid:
        print("schedule (one line per worker; '|' separates tasks):")
        print(result.simulation.grid(iteration=result.simulation.iterations))
    if drawn is not None:
        print(f"timeline drawn to {drawn}")
    return 0


def _multinode_prediction(model: LayeredModel, result, args: argparse.Namespace, tokens: int):
    """``--nodes`` > 1: the data-parallel step (coordinator.multinode), else None."""
    if args.nodes == 1:
        return None
    from roundpipe.coordinator.multinode import predict_data_parallel

    return predict_data_parallel(
        iteration_s=result.predicted_iteration_s,
        tokens_per_iteration=tokens,
        trainable_params=model.parameter_count(trainable_only=True),
        nodes=args.nodes,
        bandwidth_bytes_per_s=parse_quantity(args.network_bandwidth, what="--network-bandwidth"),
        staleness=args.staleness,
    )


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``roundpipe plan ...``: 0 ok, 2 usage or input error (message on stderr)."""
    parser = build_plan_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return run_plan_command(args)
    except ValueError as exc:
        print(f"roundpipe plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(plan_main())
