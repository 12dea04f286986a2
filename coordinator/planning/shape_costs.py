"""Layer costs on a described GPU from the shapes of the work: the shape-aware cost model.

``estimate_costs`` prices every matmul at one ``--flops x --efficiency``. That cannot say
why a small model reaches a lower fraction of a GPU's peak than a large one, or why an MoE
with many small experts reaches less still. This module prices each kind of work by what
bounds it on the GPU described by a ``GpuModel`` (Note [one description per GPU]):

* each GEMM by its shape (Note [GEMM shapes]);
* fused attention by its FLOPs at the fp32-accumulating tensor rate;
* the elementwise work around them (norms, rotary embedding, activations, residual
  adds, MoE routing, the chunked cross-entropy) by the bytes it streams;
* and every kernel by the host time it takes to issue (Note [kernels and the host]).

``estimate_costs_on_gpu`` returns the same ``LayerCost`` list as ``estimate_costs``
(memory figures unchanged), with these times and each layer's kernel counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.planning.costs import LayerCost, dtype_bytes, estimate_costs
from roundpipe.coordinator.planning.gpus import GpuModel
from roundpipe.coordinator.planning.model_flops import (
    MoeShape,
    attention_widths,
    token_mixer_flops,
)

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel, ParamSpec

__all__ = ["EAGER_KERNEL_S", "Work", "estimate_costs_on_gpu", "gemm_seconds", "layer_work"]

# Note [one description per GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every figure of a ``GpuModel`` is a property of the GPU: the data sheet's peaks, and how
# close a large GEMM, flash attention and a streaming kernel come to them. Nothing is set
# per model, per shape or per published run: what makes a 1.7B model reach a smaller
# fraction of the peak than an 8B one (more elementwise bytes per FLOP, a larger LM head
# relative to the body) or 128 experts less still (tiny GEMMs, thousands of kernels) must
# come out of the shapes. benchmarks/paper_table.py holds the model to that: five
# published runs, one description, within 15%.

# Note [GEMM shapes]
# ~~~~~~~~~~~~~~~~~~
# A GEMM of an m x k by a k x n matrix runs as ceil(m/128) x ceil(n/128) output tiles in
# waves of one tile per SM. Three things keep it below ``gemm_efficiency`` of the peak:
# the padding of the last tile row and column, the idle SMs of the last wave (an MoE
# expert's few hundred tokens fill a fraction of one wave), and each tile's fixed
# prologue and epilogue, worth about K_PIPELINE elements of its reduction (a short k
# wastes more). It can never beat the memory roofline either: reading both operands and
# writing the result at ``memory_efficiency`` of the bandwidth. Every layer's GEMMs are
# listed with their real shapes (experts at their tokens per expert), so the same GPU
# description prices a 2,048-wide model, an 8,192-wide one and 128 small experts.
TILE = 128
K_PIPELINE = 128

# Note [kernels and the host]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager PyTorch issues one kernel per op, and each costs the host a few microseconds of
# Python, dispatch and launch whatever its size. A layer takes the longer of its GPU time
# and its host time (the launch queue lets one hide the other). Dense layers at large
# microbatches never notice; a layer of 128 experts, each a dozen small kernels per
# microbatch, does. When every GPU's kernels are issued from one process (the paper's
# library: a Python thread per GPU under one interpreter lock), the host time of all
# workers adds up: ``HardwareSpec.shared_launch_s`` puts that floor under an iteration
# (roundpipe.coordinator.planning.search). RoundPipe runs a process per worker, so its
# workers' host time does not add up.
EAGER_KERNEL_S = 6e-6
"""Host seconds to issue one eager kernel (Python, dispatch, launch)."""

# Bytes streamed per element of the elementwise work, forward, as Hugging Face's eager
# code runs it in compute dtype ``d`` (norms compute in fp32), and the kernels it takes.
#   RMSNorm: cast up, square, mean, rsqrt-scale, cast down, weight: 4d + 28 bytes.
#   Rotary embedding (q and k): two multiplies, the half rotation (negate, concatenate),
#   an add: 9d.  SwiGLU: SiLU then multiply: 5d.  A residual add: 3d.
_NORM_KERNELS, _ROTARY_KERNELS, _GLU_KERNELS = 7, 6, 2
_BACKWARD_BYTES = 2.0
"""Backward streams about twice the forward's bytes (the upstream gradient, the saved
inputs, the input gradient) and issues about twice its kernels (autograd's nodes)."""
LOSS_CHUNK_TOKENS = 4096
"""Tokens per chunk of the LM head and cross-entropy (one GEMM and loss per chunk)."""


@dataclass
class Work:
    """What one layer does for one microbatch, forward or backward."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    kernels: int = 0

    @property
    def gpu_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s

    def seconds(self, kernel_s: float) -> float:
        """The layer's time: its GPU time or its host time, whichever is longer."""
        return max(self.gpu_s, self.kernels * kernel_s)

    def add(self, other: Work) -> Work:
        return Work(
            self.gemm_s + other.gemm_s,
            self.attention_s + other.attention_s,
            self.memory_s + other.memory_s,
            self.kernels + other.kernels,
        )


def gemm_seconds(
    gpu: GpuModel, m: float, n: int, k: int, *, dtype_size: int, fp16_accumulation: bool
) -> float:
    """One ``m x k`` by ``k x n`` GEMM on ``gpu`` (Note [GEMM shapes])."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    peak = gpu.fp16_accumulation_flops if fp16_accumulation else gpu.tensor_flops
    tiles_m, tiles_n = math.ceil(m / TILE), math.ceil(n / TILE)
    tiles = tiles_m * tiles_n
    waves = math.ceil(tiles / gpu.sms)
    filled = (m * n) / (tiles_m * TILE * tiles_n * TILE) * tiles / (waves * gpu.sms)
    compute = 2 * m * n * k / (peak * gpu.gemm_efficiency * filled * k / (k + K_PIPELINE))
    memory = (m * k + k * n + m * n) * dtype_size / (gpu.memory_bandwidth * gpu.memory_efficiency)
    return max(compute, memory)


@dataclass(frozen=True)
class _Gemm:
    """A weight as GEMMs: ``count`` of them, ``m`` tokens each, ``n`` outputs, ``k`` inputs."""

    m: float
    n: int
    k: int
    count: int
    trainable: bool


def _layer_gemms(specs: list[ParamSpec], tokens: int, hidden: int, moe: MoeShape) -> list[_Gemm]:
    """The GEMMs of a decoder layer's weights: dense weights over every token, routed
    experts (and their adapters) as one GEMM per expert over its share of the tokens."""
    out = []
    for s in specs:
        if len(s.shape) < 2 or s.name.endswith("conv1d.weight"):
            continue
        routed = moe.num_experts > 0 and ".experts." in f"{s.name}."
        if routed and len(s.shape) == 2 and s.shape[0] == moe.num_experts:
            continue  # a per-expert bias
        if routed:
            per_expert = max(1.0, tokens * moe.top_k / moe.num_experts)
            dims = s.shape[1:] if len(s.shape) >= 3 else s.shape
            a, b = int(dims[0]), int(dims[1])
            if len(s.shape) < 3:  # an adapter over all experts: E slices of its rows
                a = max(1, a // moe.num_experts) if a % moe.num_experts == 0 else a
            # Which side is the input: a projection out of the hidden state reads it
            # (gate/up), one into it writes it (down).
            k_in, n_out = (a, b) if (a == hidden) != ("down" in s.name) else (b, a)
            out.append(_Gemm(per_expert, n_out, k_in, moe.num_experts, s.trainable))
        else:
            out.append(_Gemm(tokens, int(s.shape[0]), int(s.shape[1]), 1, s.trainable))
    return out


def _memory_s(gpu: GpuModel, nbytes: float) -> float:
    return nbytes / (gpu.memory_bandwidth * gpu.memory_efficiency)


def layer_work(
    model: LayeredModel,
    layer: int,
    gpu: GpuModel,
    *,
    microbatch_rows: int,
    seq_len: int,
    compute_dtype: Any,
    fp16_accumulation: bool,
) -> tuple[Work, Work]:
    """(forward, backward without the recompute) of ``layer`` for one microbatch."""
    d = dtype_bytes(compute_dtype)
    cfg = model.config
    tokens = microbatch_rows * seq_len
    hidden = int(cfg.hidden_size)
    specs = model.layer_params(layer)
    fp16 = fp16_accumulation and d == 2

    def gemm(m: float, n: int, k: int) -> float:
        return gemm_seconds(gpu, m, n, k, dtype_size=d, fp16_accumulation=fp16)

    trainable = any(s.trainable for s in specs)
    if layer == 0:  # the embedding: a gather; a dense [vocab, hidden] gradient if trained
        vocab = int(cfg.vocab_size)
        fwd = Work(memory_s=_memory_s(gpu, tokens * hidden * 2 * d), kernels=1)
        bwd = Work()
        if trainable:
            dense = vocab * hidden * (d + 8) + tokens * hidden * d
            bwd = Work(memory_s=_memory_s(gpu, dense), kernels=3)
        return fwd, bwd
    if layer == model.num_layers - 1:  # final norm, LM head and loss, chunk by chunk
        head = next(s for s in specs if len(s.shape) >= 2)
        vocab = int(head.shape[0])
        chunks = math.ceil(tokens / LOSS_CHUNK_TOKENS)
        per = tokens / chunks
        norm = (4 * d + 28) * hidden * tokens
        # Logits written in d, cast to fp32, log-softmax (two passes), the loss picks
        # one; backward: softmax minus one-hot, cast down: about 8 passes of 4 bytes.
        loss = tokens * vocab * (d + 4 + 8 + 8)
        fwd = Work(
            gemm_s=chunks * gemm(per, vocab, hidden),
            memory_s=_memory_s(gpu, norm + loss),
            kernels=_NORM_KERNELS + 8 * chunks,
        )
        head_grad = chunks * gemm(per, hidden, vocab)
        if head.trainable:
            head_grad += chunks * gemm(hidden, vocab, per)
        bwd = Work(
            gemm_s=head_grad,
            memory_s=_memory_s(gpu, _BACKWARD_BYTES * norm + tokens * vocab * (4 + 4 + d)),
            kernels=2 * _NORM_KERNELS + 10 * chunks,
        )
        return fwd, bwd
    # A decoder layer.
    moe = MoeShape(cfg)
    q_width, kv_width = attention_widths(cfg)
    gemms = _layer_gemms(specs, tokens, hidden, moe)
    forward_gemm = sum(g.count * gemm(g.m, g.n, g.k) for g in gemms)
    input_grads = sum(g.count * gemm(g.m, g.k, g.n) for g in gemms)
    weight_grads = sum(g.count * gemm(g.k, g.n, g.m) for g in gemms if g.trainable)
    gemm_kernels = sum(g.count for g in gemms)
    trained_gemm_kernels = sum(g.count for g in gemms if g.trainable)
    # LoRA: each adapted weight also scales its adapter's output and adds it (per expert
    # for adapted experts).
    adapters = sum(
        (moe.num_experts if ".experts." in f"{s.name}." else 1)
        for s in specs
        if ".lora_B." in f"{s.name}."
    )
    attention_flops = token_mixer_flops(model, layer, tokens, seq_len)
    attention_s = attention_flops / (gpu.tensor_flops * gpu.attention_efficiency)
    qk_norm = any(".q_norm." in s.name for s in specs)
    norm = 2 * (4 * d + 28) * hidden + ((4 * d + 28) * (q_width + kv_width) if qk_norm else 0)
    rotary = 9 * d * (q_width + kv_width)
    residual = 2 * 3 * d * hidden + 2 * d * q_width  # two adds; attention output reshaped
    kernels = gemm_kernels + 2 * _NORM_KERNELS + 2 * _ROTARY_KERNELS + 4 + 4 * adapters
    if qk_norm:
        kernels += 2 * _NORM_KERNELS
    if moe.num_experts:
        top_k, experts = moe.top_k, moe.num_experts
        inter = moe.expert_intermediate
        # Router softmax and top-k in fp32; per routed copy of a token: the gather of its
        # hidden state, the activation over the expert's intermediate, the weighting and
        # the scatter-add back.
        glu_ops = 7 if "gpt_oss" in str(getattr(cfg, "model_type", "")) else _GLU_KERNELS
        act = (5 * d if glu_ops == _GLU_KERNELS else 3 * d * glu_ops) * inter
        routing = 16 * experts + top_k * (8 * d * hidden + act)
        kernels += 6 + experts * (6 + glu_ops)
    else:
        inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
        routing = 5 * d * inter
        kernels += _GLU_KERNELS
    elementwise = tokens * (norm + rotary + residual + routing)
    adapter_bytes = sum(
        tokens * 6 * d * (int(s.shape[0]) if ".experts." not in f"{s.name}." else hidden)
        for s in specs
        if ".lora_B." in f"{s.name}."
    )
    elementwise += adapter_bytes
    fwd = Work(
        gemm_s=forward_gemm,
        attention_s=attention_s,
        memory_s=_memory_s(gpu, elementwise),
        kernels=kernels,
    )
    bwd = Work(
        gemm_s=input_grads + weight_grads,
        attention_s=2.5 * attention_s,
        memory_s=_memory_s(gpu, _BACKWARD_BYTES * elementwise),
        kernels=int(_BACKWARD_BYTES * (kernels - gemm_kernels))
        + gemm_kernels
        + trained_gemm_kernels,
    )
    return fwd, bwd


def estimate_costs_on_gpu(
    model: LayeredModel,
    gpu: GpuModel,
    *,
    microbatch_rows: int,
    seq_len: int,
    compute_dtype: Any = "bfloat16",
    fp16_accumulation: bool = False,
    kernel_s: float = EAGER_KERNEL_S,
) -> list[LayerCost]:
    """Per-layer costs of ``model`` on ``gpu``: ``estimate_costs``'s memory figures with
    times from the shapes of the work (the module docstring) and each layer's kernels.

    ``fp16_accumulation``: GEMMs in float16 accumulate in float16
    (``torch.backends.cuda.matmul.allow_fp16_accumulation``), at the GPU's
    ``fp16_accumulation_flops``; attention still accumulates in fp32."""
    if fp16_accumulation and dtype_bytes(compute_dtype) != 2:
        raise ValueError("fp16 accumulation needs a 16-bit compute dtype (float16)")
    base = estimate_costs(
        model,
        microbatch_rows=microbatch_rows,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        flops_per_s=gpu.tensor_flops,
        memory_bandwidth=gpu.memory_bandwidth,
    )
    out = []
    for layer, cost in enumerate(base):
        fwd, bwd = layer_work(
            model,
            layer,
            gpu,
            microbatch_rows=microbatch_rows,
            seq_len=seq_len,
            compute_dtype=compute_dtype,
            fp16_accumulation=fp16_accumulation,
        )
        has_backward = cost.backward_s > 0
        forward_s = fwd.seconds(kernel_s)
        backward = fwd.add(bwd) if has_backward else Work()
        out.append(
            replace(
                cost,
                forward_s=forward_s,
                backward_s=backward.seconds(kernel_s),
                forward_kernels=fwd.kernels,
                backward_kernels=backward.kernels,
            )
        )
    return out
