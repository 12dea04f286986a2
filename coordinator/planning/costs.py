"""What a layer and a stage cost: cold-start estimates from a FLOP model, and the cost model
the search and the simulator share (compute, transfers, memory per stage)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.model_flops import (
    MoeShape,
    active_matmul_params,
    attention_widths,
    token_mixer_flops,
)
from roundpipe.coordinator.planning.simulator import (
    SimStage,
)
from roundpipe.shared.logits_chunks import logits_chunk_tokens
from roundpipe.shared.long_rows import mlp_chunk_tokens
from roundpipe.shared.plan import RECOMPUTE_GRAINS, Plan

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


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
    forward_kernels: int = 0
    """Kernels the forward issues per microbatch (the shape-aware model's count; 0 when
    unknown): the host's share of the work (Note [kernels and the host])."""
    backward_kernels: int = 0
    """Kernels the recompute and backward issue per microbatch (0 when unknown)."""

    @property
    def trainable_params(self) -> int:
        return self.grad_bytes // 4

    def scaled(self, factor: float) -> LayerCost:
        """The same layer with times multiplied by ``factor``."""
        return replace(self, forward_s=self.forward_s * factor, backward_s=self.backward_s * factor)


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


def dtype_bytes(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(
            f"unsupported compute dtype {dtype!r}: expected float32, bfloat16, float16"
        )
    return _DTYPE_BYTES[name]


def stored_param_bytes(model: Any, name: str, shape: tuple[int, ...], compute_bytes: int) -> int:
    """Bytes parameter ``name`` takes in the params arena and on the bus: the compute
    dtype, or its quantised parts (``lora.base_quantization``)."""
    quantized = model.quantized_base
    if quantized is not None:
        return quantized.stored_nbytes(name, shape, compute_bytes)
    return math.prod(shape) * compute_bytes


def estimate_costs(
    model: LayeredModel,
    *,
    microbatch_rows: int,
    seq_len: int,
    compute_dtype: Any = "bfloat16",
    flops_per_s: float,
    efficiency: float = 0.7,
    memory_bandwidth: float = 1.0e12,
    on_gpu: bool = True,
) -> list[LayerCost]:
    """Cold-start ``LayerCost`` per layer from parameter counts and a FLOP model.

    ``flops_per_s`` is the GPU's peak dense matmul rate in the compute dtype (RTX 4090,
    bf16 with fp32 accumulation: 82.6e12); ``efficiency`` the fraction matmuls achieve.
    ``memory_bandwidth`` (bytes/s of GPU memory) prices the memory-bound parts: the
    embedding gather and its dense gradient, norms and activations, the cross-entropy
    passes over the chunked logits. Per layer, with ``T = rows x seq`` tokens:

    * decoder: ``2 T P`` matmul FLOPs forward (P = matmul parameters; routed experts
      count ``top_k / num_experts`` of theirs) plus the token mixer: causal attention
      ``2 T seq (heads x head_dim)`` (sliding-window layers attend to at most the
      window) or linear attention, linear in seq (``model_flops``, per family); backward
      ``2 T P`` for input gradients, ``2 T P_trainable`` for weight gradients and 2.5x the
      attention forward;
    * prefix (embedding): a gather; its backward writes a dense ``vocab x hidden``
      gradient (none with LoRA);
    * tail: LM head ``2 T V H`` forward, twice that backward (input and weight
      gradients), plus about six fp32 passes over ``T x V`` logits for the chunked loss.

    ``on_gpu``: whether the workers are GPUs, whose chunked LM head holds 4,096 tokens of
    logits at a time, or CPU workers, which hold 128 MiB (``shared.logits_chunks``).
    """
    if microbatch_rows < 1 or seq_len < 1:
        raise ValueError("microbatch_rows and seq_len must be >= 1")
    if not flops_per_s > 0 or not 0 < efficiency <= 1 or not memory_bandwidth > 0:
        raise ValueError("flops_per_s and memory_bandwidth must be positive, efficiency in (0, 1]")
    d = dtype_bytes(compute_dtype)
    cfg = model.config
    tokens = microbatch_rows * seq_len
    hidden = int(cfg.hidden_size)
    vocab = int(cfg.vocab_size)
    q_width, kv_width = attention_widths(cfg)
    experts = MoeShape(cfg)
    flops = flops_per_s * efficiency
    mem_bw = memory_bandwidth * 0.8
    n = model.num_layers
    out: list[LayerCost] = []
    quantized = model.quantized_base
    for layer in range(n):
        specs = model.layer_params(layer)
        # What the layer's weights take on the bus and resident on the worker: a
        # quantised base's parts (Note [quantised base] in roundpipe.shared.quantized_base),
        # plus, while the layer runs, its weights dequantised into the compute dtype.
        param_bytes = sum(stored_param_bytes(model, s.name, s.shape, d) for s in specs)
        dequantized = 0
        if quantized is not None:
            dequantized = sum(s.numel for s in specs if s.name in quantized.shapes) * d
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
            fwork = tokens * hidden * d
        elif layer == n - 1:
            head = [s for s in specs if len(s.shape) >= 2]
            head_params = sum(s.numel for s in head)
            head_trainable = any(s.trainable for s in head)
            ce_bytes = tokens * vocab * 4 * 6
            norm_bytes = tokens * hidden * (12 + 2 * d)
            fwd = 2 * tokens * head_params / flops + (ce_bytes / 2 + norm_bytes) / mem_bw
            bwd_flops = 2 * tokens * head_params * (2 if head_trainable else 1)
            bwd_only = bwd_flops / flops + (ce_bytes / 2 + 2 * norm_bytes) / mem_bw
            # One chunk's fp32 logits (no more than the tokens have), plus in a 16-bit
            # dtype the matmul's own output and the gradient cast back (Note [chunked
            # LM head]); in fp32 the matmul writes into the fp32 buffer.
            logits = min(logits_chunk_tokens(vocab, on_gpu=on_gpu), tokens) * vocab * 4
            chunk = logits + (logits * d // 4 if d != 4 else 0)
            backward = fwd + bwd_only
            work = chunk + tokens * hidden * (3 * d + 8)
            fwork = chunk + tokens * hidden * (2 * d + 4)
            name = "model.norm+lm_head"
        else:  # Decoder layer.
            # Per family: active experts only, linear attention (planning.model_flops).
            matmul, moe = active_matmul_params(specs, experts)
            trainable_matmul, _ = active_matmul_params(specs, experts, trainable_only=True)
            if moe:
                inter = experts.top_k * experts.expert_intermediate
            else:
                inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
            attn = token_mixer_flops(model, layer, tokens, seq_len)
            fwd_flops = 2 * tokens * matmul + attn
            bwd_flops = 2 * tokens * matmul + 2 * tokens * trainable_matmul + 2.5 * attn
            elementwise = tokens * d * (10 * hidden + 4 * inter)
            fwd = fwd_flops / flops + elementwise / mem_bw
            backward = fwd + bwd_flops / flops + 2 * elementwise / mem_bw
            qk_norm = any(".q_norm." in s.name for s in specs)
            # The MLP's intermediate: whole, or (a long row's dense MLP, Note
            # [sequence-chunked MLP]) its input kept and one chunk's worth, recomputed
            # and backpropagated, at a time.
            chunk = None if moe else mlp_chunk_tokens(seq_len)
            if chunk is None:
                mlp_work, mlp_fwork = tokens * d * 4 * inter, tokens * d * 3 * inter
            else:
                rows = microbatch_rows
                mlp_work = tokens * d * hidden + rows * chunk * d * 8 * inter
                mlp_fwork = rows * chunk * d * 3 * inter
            work = mlp_work + tokens * (
                d * (2 * hidden + 3 * q_width + 4 * kv_width)
                + 8 * hidden
                + (4 * (q_width + kv_width) if qk_norm else 0)
                + (4 * experts.num_experts if moe else 0)
                # Each token's top_k copies of the hidden state, routed to the experts:
                # the gathered inputs and the expert outputs saved for backward, and
                # their gradients (measured under a worker's memory cap: 4 such).
                + (4 * d * experts.top_k * hidden if moe else 0)
            )
            fwork = mlp_fwork + tokens * (d * (q_width + 2 * kv_width + hidden) + 4 * hidden)
            work += dequantized
            fwork += dequantized
            name = f"model.layers.{layer - 1}"
        out.append(
            LayerCost(
                forward_s=fwd,
                backward_s=backward,
                param_bytes=param_bytes,
                grad_bytes=grad_bytes,
                activation_bytes=act,
                work_bytes=work,
                forward_work_bytes=fwork,
                name=name,
            )
        )
    return out


class CostModel:
    """Stage costs from per-layer costs, with prefix sums (O(1) per stage)."""

    def __init__(
        self,
        costs: Sequence[LayerCost],
        hw: HardwareSpec,
        num_microbatches: int,
        recompute: str = "stage",
    ):
        if not costs:
            raise ValueError("no layer costs")
        if recompute not in RECOMPUTE_GRAINS:
            raise ValueError(f"recompute must be one of {RECOMPUTE_GRAINS}, got {recompute!r}")
        self.recompute = recompute
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
        # Peak forward transient and largest working set over [a, b): tables, n is at
        # most a few hundred.
        self._fmax = [[0] * (n + 1) for _ in range(n + 1)]
        self._wmax = [[0] * (n + 1) for _ in range(n + 1)]
        for a in range(n):
            peak = work = 0
            for b in range(a + 1, n + 1):
                peak = max(peak, costs[b - 1].forward_work_bytes)
                work = max(work, costs[b - 1].work_bytes)
                self._fmax[a][b] = peak
                self._wmax[a][b] = work
        self._acts = prefix([float(x) for x in self.act])
        self.labels_bytes = self.act[0]  # labels travel like token ids

    def name(self, layer: int) -> str:
        nm = self.costs[layer].name
        return f"layer {layer} ({nm})" if nm else f"layer {layer}"

    def memory_parts(self, kind: str, a: int, b: int) -> dict[str, int]:
        """What a stage holds while running, by kind of memory (their sum is the
        ``run`` of :meth:`parts`): its weights, fp32 gradients, working memory (the
        saved tensors of autograd and the kernels' workspace: attention, the loss
        chunks), and the activations it reads and writes."""
        act = self.act
        # A CPU worker's task reads its weights and inputs where they are, in the host
        # arenas (``HardwareSpec.host_views``): what it holds of its own is what it makes.
        views = self.hw.host_views
        p = 0 if views else int(self._p[b] - self._p[a])
        if kind == "F":
            return {
                "weights": p,
                "working memory": self._fmax[a][b],
                "activations": 2 * act[b] if views else 2 * (act[a] + act[b]),
            }
        g = int(self._g[b] - self._g[a])
        work = int(self._w[b] - self._w[a])
        parts = {"weights": p, "gradients": g}
        if kind == "B":
            if self.recompute == "layer":
                # Note [recompute grain]: one layer's saved tensors (or the no-grad
                # forward's transient) and every layer's input.
                parts["working memory"] = max(self._wmax[a][b], self._fmax[a][b])
                parts["layer inputs"] = int(self._acts[b] - self._acts[a + 1])
            else:
                parts["working memory"] = work
            # The input gradient and the one flowing between layers (the stage's input
            # and its output gradient are views on a CPU worker).
            parts["activations"] = 2 * act[b] if views else 3 * act[a] + 2 * act[b]
        else:  # tail
            parts["working memory"] = work
            parts["activations"] = act[a] if views else 3 * act[a]
        return parts

    def parts(self, kind: str, a: int, b: int) -> tuple[float, int, int, int, int]:
        """(compute_s at speed 1, upload bytes, download bytes, resident, run) of a stage."""
        m, act = self.m, self.act
        p = int(self._p[b] - self._p[a])
        run = sum(self.memory_parts(kind, a, b).values())
        if kind == "F":
            compute = m * (self._f[b] - self._f[a])
            up = p + m * act[a]
            down = m * act[b]
            resident = p
        else:
            g = int(self._g[b] - self._g[a])
            compute = m * (self._b[b] - self._b[a])
            if kind == "B":
                up = p + m * (act[a] + act[b])
                down = g + (m * act[a] if a > 0 else 0)
                if self.recompute == "layer":  # one more forward of the range
                    compute += m * (self._f[b] - self._f[a])
            else:  # tail
                up = p + m * (act[a] + self.labels_bytes)
                down = g + (m * act[a] if a > 0 else 0)
            resident = p + g
        if self.hw.host_views:
            resident = 0  # nothing is uploaded ahead of a task: weights stay in the arenas
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


def plan_estimates(cm: CostModel, plan: Plan) -> list[StageEstimate]:
    ests = [cm.estimate("F", a, b, f"F{i}") for i, (a, b) in enumerate(plan.forward)]
    ests.append(cm.estimate("T", plan.tail[0], plan.tail[1], "T"))
    ests += [cm.estimate("B", a, b, f"B{i}") for i, (a, b) in enumerate(plan.backward)]
    # Memory: running stage + the largest stage's weights and gradients (the prefetched
    # next task; with S <= N it can be the same stage of the next iteration) + reserve.
    largest = max(e.resident_bytes for e in ests)
    return [replace(e, memory_bytes=e.run_bytes + largest + cm.hw.reserved_bytes) for e in ests]


def plan_sim_stages(cm: CostModel, plan: Plan, ests: Sequence[StageEstimate]) -> list[SimStage]:
    """One ``SimStage`` per task of ``plan`` (``ests`` are its stages): a split stage
    (Note [microbatch-split stages] in roundpipe.shared.plan) is two tasks over its two
    microbatch ranges, each uploading the stage's weights and, for a gradient stage,
    downloading its gradient part; the optimizer's work falls on the second part, the
    one it waits for last."""
    out = []
    for stage, est in zip(plan.stages(), ests):
        sim = cm.sim_stage(est)
        if not stage.split:
            out.append(sim)
            continue
        mbs = tuple(range(cm.m))
        out.append(
            replace(sim, microbatches=mbs[: stage.split], optimizer_s=0.0, label=f"{est.label}a")
        )
        out.append(replace(sim, microbatches=mbs[stage.split :], label=f"{est.label}b"))
    return out


def task_estimates(plan: Plan, ests: Sequence[StageEstimate]) -> list[StageEstimate]:
    """``ests`` (one per stage) repeated per task: a split stage's two tasks need the
    stage's memory each."""
    return [est for stage, est in zip(plan.stages(), ests) for _ in range(1 + bool(stage.split))]


def per_worker_memory(
    cm: CostModel, ests: Sequence[StageEstimate], iterations: int, counter_start: int = 0
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
