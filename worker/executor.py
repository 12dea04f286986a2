"""Stage execution: run a layer range of a ``LayeredModel`` over M microbatches.

Three task kinds, each over microbatches 0..M-1 in order (the stages of a plan:
roundpipe.shared.plan; docs/model-execution.md):

- ``forward``: no autograd; returns each microbatch's output and keeps the input of every
  layer in ``save_layers`` (the backward boundaries) for the activation arena.
- ``backward``: recomputes its range's forward from the saved input, backpropagates the
  incoming activation gradient, sums weight gradients over all microbatches (fp32) and
  returns them once, with the activation gradient for the previous stage.
- ``tail``: forward + loss + backward of the last range in one go, no recompute.

Weights arrive per task as ``name -> tensor`` (read-only views of shared memory on the
CPU, device copies made by the worker's transfer engine on a GPU: roundpipe.worker.transfer
moves data, this module only computes). They are bound to the meta-device skeleton only for the
duration of a call through ``torch.func.functional_call``; nothing is written into them
and the skeleton holds no weights between tasks.

Note [dropout replay]
    Every (layer, microbatch) runs right after the CPU (and current CUDA) generator is
    seeded from (job seed, iteration, layer, microbatch). Forward, recompute and a rerun
    of the task on another worker therefore draw the same dropout masks, without storing
    any RNG state, and a task stays idempotent. The caller's RNG state is restored after
    the task.

Note [global loss normalisation]
    Each microbatch's loss is sum(token cross-entropy) / N, where N is the number of label
    tokens (after the causal shift, ignoring -100) in the *whole global batch*. Summed
    over microbatches this is HF's mean loss of the full batch, and gradients equal one
    full-batch step.

Note [packed documents]
    Each microbatch may come with position ids ``[rows, seq]`` (None: 0..seq-1). They
    restart at 0 where a packed document starts (roundpipe.coordinator.spec.data), and every
    decoder layer gets them twice: as rotary positions, so a document's positions are
    those it would have alone, and through transformers' ``create_causal_mask``, whose
    packed-sequence detection (a position that does not follow its predecessor starts a
    new sequence) turns them into a block-diagonal causal mask for the model's own
    attention implementation (SDPA, eager, flash). Together a document's hidden states
    equal those of the same document alone in a row, so a packed run equals the
    unpacked one. Plain 0..seq-1 positions give no mask at all (SDPA's is_causal).

Note [chunked LM head]
    The LM head and cross-entropy run over chunks of (label-carrying) tokens: the chunk's
    logits are computed, reduced to its loss, turned in place into d(loss)/d(logits), and
    multiplied back into the hidden-state and weight gradients before the next chunk. The
    full [tokens, vocab] logits never exist, and because the tail is fused no logits are
    kept for a later backward.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from roundpipe.shared.logits_chunks import CPU_LOGITS_CHUNK_BYTES, GPU_LOGITS_CHUNK_TOKENS
from roundpipe.shared.logits_chunks import logits_chunk_tokens as chunk_rule
from roundpipe.shared.model import IGNORE_INDEX, LayeredModel, shift_labels
from roundpipe.shared.plan import RECOMPUTE_GRAINS
from roundpipe.worker import document_attention, mlp_chunks
from roundpipe.worker.document_attention import long_rows
from roundpipe.worker.lm_head_loss import chunked_lm_head_loss
from roundpipe.worker.stage_context import StageContext, rotary_reset
from roundpipe.worker.transfer import Stopwatch

__all__ = [
    "DEFAULT_LOGITS_CHUNK_BYTES",
    "GPU_LOGITS_CHUNK_TOKENS",
    "BackwardResult",
    "ForwardResult",
    "RngKey",
    "StageExecutor",
    "TailLabels",
    "TailResult",
    "chunked_lm_head_loss",
    "tail_labels",
]

# The chunk rule is shared with the planner, which prices its memory.
DEFAULT_LOGITS_CHUNK_BYTES = CPU_LOGITS_CHUNK_BYTES

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Note [recompute grain]
# ~~~~~~~~~~~~~~~~~~~~~~
# A backward task recomputes its range from the stage input the forward kept. At stage
# grain it runs the whole range under autograd, so every layer's saved tensors (q, k, v,
# the attention output, the MLP's gate, up and product, fp32 norm copies: about ten
# hidden-sized tensors per layer and token) are alive together before backward starts;
# at a long sequence that is what does not fit. At layer grain it first runs the range
# without autograd keeping only each layer's input (one hidden-sized tensor per layer),
# then, last layer first, recomputes one layer under autograd and backpropagates it at
# once: the saved tensors of one layer at a time, for one more forward of the range.
# Each layer runs the same ops on the same input with the same dropout seed
# (``_seed(rng, layer, m)``), so the gradients are bitwise those of stage grain
# (tests/test_model_executor.py). The planner picks layer grain when a stage-grain plan
# does not fit (roundpipe.coordinator.planning.costs, ``recompute``); the router's
# auxiliary loss needs the whole range's statistics, so MoE layers with one keep stage
# grain.


@dataclass(frozen=True, slots=True)
class RngKey:
    """Identifies a task's randomness. Note [dropout replay]."""

    seed: int = 0
    """Job seed."""
    iteration: int = 0
    microbatches: tuple[int, ...] = ()
    """The iteration's index of the task's m-th microbatch (empty: m itself). A
    microbatch-split stage's second task starts past 0 (Note [microbatch-split stages] in
    roundpipe.shared.plan), and its masks must be the unsplit task's."""

    def layer_seed(self, layer: int, microbatch: int) -> int:
        if self.microbatches:
            microbatch = self.microbatches[microbatch]
        h = hashlib.blake2b(digest_size=8)
        for part in (self.seed, self.iteration, layer, microbatch):
            h.update(int(part).to_bytes(16, "little", signed=True))
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@dataclass
class ForwardResult:
    outputs: list[torch.Tensor]
    """Hidden states leaving the stage, one per microbatch (empty if streamed)."""
    saved: dict[int, list[torch.Tensor]]
    """Layer -> its input per microbatch, for each saved layer (empty if streamed).

    Layer 0's "input" is the microbatch's input_ids."""
    router_stats: list[torch.Tensor] = field(default_factory=list)
    """With a router auxiliary loss: per microbatch fp32 ``[2, experts]``, the top-k
    pick counts and the router-probability sums over this stage's MoE layers. Note
    [router auxiliary loss] (roundpipe.shared.model)."""


@dataclass
class BackwardResult:
    grad_inputs: list[torch.Tensor] | None
    """d(loss)/d(stage input) per microbatch; None for a stage starting at layer 0."""
    weight_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """fp32 gradient of every trainable parameter of the range, summed over microbatches."""


@dataclass
class TailResult:
    losses: torch.Tensor
    """fp32 ``[M]`` on the device: each microbatch's normalised loss (Note [global loss
    normalisation]). Reading it as numbers synchronises; the runtime downloads it."""
    grad_inputs: list[torch.Tensor] | None
    weight_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_losses: torch.Tensor | None = None
    """fp32 ``[M]``: each microbatch's weighted router auxiliary loss, already included
    in ``losses`` (None without one)."""
    router_counts: list[torch.Tensor] = field(default_factory=list)
    """Per microbatch fp32 ``[experts]``: the top-k counts over every MoE layer, which the
    backward stages need. Note [router auxiliary loss]."""

    @property
    def microbatch_losses(self) -> list[float]:
        return self.losses.tolist()

    @property
    def loss_sum(self) -> float:
        return float(sum(self.microbatch_losses))


@dataclass(frozen=True)
class TailLabels:
    """A microbatch's labels prepared on the host for the tail (no device sync needed).

    ``shifted`` is ``[rows * seq]`` (next-token labels, -100 = no loss) and ``positions``
    the indices where it is not -100, both on the compute device."""

    shifted: torch.Tensor
    positions: torch.Tensor
    shape: tuple[int, int]


def tail_labels(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(shifted labels, label positions) of unshifted ``[rows, seq]`` labels, computed
    where ``labels`` lives: the worker does it on the host views, so the GPU never waits
    for a ``nonzero()`` whose size it must report back."""
    shifted = shift_labels(labels).reshape(-1)
    return shifted, (shifted != IGNORE_INDEX).nonzero().squeeze(1)


@dataclass
class _Bound:
    """A task's weights, split per layer and relative to each layer's module."""

    per_layer: dict[int, dict[str, torch.Tensor]]
    trainable: list[tuple[str, torch.Tensor]]
    """(full name, leaf) pairs that need gradients in this task."""
    head: torch.Tensor | None = None
    quantized: dict[int, dict[str, tuple[str, dict[str, torch.Tensor]]]] = field(
        default_factory=dict
    )
    """layer -> relative name -> (full name, its quantised parts on the device): weights
    dequantised just before their layer runs (Note [quantised base] in
    roundpipe.shared.quantized_base)."""
    dequantize: Callable[[dict[str, torch.Tensor], str, torch.dtype], torch.Tensor] | None = None
    """The model's ``QuantizedBase.dequantize`` when it has quantised weights."""

    def layer_params(self, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What ``functional_call`` binds for ``layer``: its weights, the quantised ones
        dequantised into ``dtype`` now (fresh tensors, dropped after the layer unless
        autograd saves them)."""
        quantized = self.quantized.get(layer)
        if not quantized:
            return self.per_layer[layer]
        out = dict(self.per_layer[layer])
        assert self.dequantize is not None
        for rel, (name, parts) in quantized.items():
            out[rel] = self.dequantize(parts, name, dtype)
        return out


class StageExecutor:
    """Runs forward, backward and fused-tail tasks of one model on one device."""

    def __init__(
        self,
        model: LayeredModel,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        *,
        logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
        logits_chunk_tokens: int | None = None,
    ) -> None:
        if compute_dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {_SUPPORTED_DTYPES}, got {compute_dtype}"
            )
        if logits_chunk_bytes < 1:
            raise ValueError(f"logits_chunk_bytes must be positive, got {logits_chunk_bytes}")
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = compute_dtype
        if logits_chunk_tokens is not None:
            if logits_chunk_tokens < 1:
                raise ValueError(f"logits_chunk_tokens must be positive, got {logits_chunk_tokens}")
            self.chunk_tokens = logits_chunk_tokens
        else:  # the rule the planner prices (shared.logits_chunks)
            self.chunk_tokens = chunk_rule(
                model.vocab_size,
                on_gpu=self.device.type == "cuda",
                cpu_chunk_bytes=logits_chunk_bytes,
            )
        self._rotary = model.make_rotary(self.device)
        self._rotary_reset = rotary_reset(self._rotary)  # Note [dynamic rotary]
        self._install_router_hooks()
        # Note [sequence-chunked MLP]: the dense MLPs' forward wrapped once per skeleton.
        for layer in range(1, model.num_layers - 1):
            mlp = getattr(model.decoder_part(layer)[0], "mlp", None)
            if isinstance(mlp, torch.nn.Module):
                mlp_chunks.install(mlp)
        # Declared non-rotary buffers (Gemma 3's embedding scale), made once per executor.
        self._part_buffers: dict[int, dict[str, torch.Tensor]] = {}
        # Times each layer's forward (the planner's profile) when the caller sets it per
        # task: host clock on the CPU, CUDA events on a GPU (roundpipe.worker.transfer).
        self.stopwatch: Stopwatch | None = None
        # Called before every layer's compute (forward, recompute, tail) when set: the
        # worker raises from it to stop a task whose job was torn down.
        self.before_layer: Callable[[], None] | None = None

    # ---------------------------------------------------------------- tasks

    def forward(
        self,
        start: int,
        stop: int,
        weights: Mapping[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
        save_layers: Sequence[int] | frozenset[int] | set[int] = (),
        *,
        rng: RngKey = RngKey(),
        position_ids: Sequence[torch.Tensor | None] | None = None,
        on_output: Callable[[int, torch.Tensor], None] | None = None,
        on_saved: Callable[[int, int, torch.Tensor], None] | None = None,
        on_router_stats: Callable[[int, torch.Tensor], None] | None = None,
        row_tokens: Sequence[Sequence[int]] | None = None,
    ) -> ForwardResult:
        """Run layers [start, stop) over every microbatch, without autograd.

        ``inputs[m]`` is input_ids ``[rows, seq]`` when start == 0, else hidden states
        ``[rows, seq, hidden]`` in the compute dtype. The input of each layer of the range
        that is in ``save_layers`` is kept. With ``on_output(m, t)`` / ``on_saved(layer,
        m, t)`` tensors are handed over as soon as they exist instead of being returned.
        ``position_ids[m]`` are microbatch m's position ids (Note [packed documents]).
        ``on_router_stats(m, t)`` receives microbatch m's router statistics (before its
        output) instead of ``router_stats``; ``row_tokens[m]`` are the real tokens of
        each of its rows, the padding after them left out of those statistics (None:
        every token is real).
        """
        self._check_range(start, stop, tail=False)
        keep = sorted(layer for layer in set(save_layers) if start <= layer < stop)
        bound = self._bind(start, stop, weights, grad=False)
        result = ForwardResult(outputs=[], saved={layer: [] for layer in keep})
        with self._task_scope(), torch.no_grad():
            for m, x in enumerate(inputs):
                x = self._input(x, start)
                real = self._real_tokens(row_tokens, m, x)
                ctx: StageContext | None = None
                self._start_capture()
                for layer in range(start, stop):
                    if layer in result.saved:
                        if on_saved is not None:
                            on_saved(layer, m, x)
                        else:
                            result.saved[layer].append(x)
                    x, ctx = self._run_layer(layer, x, bound, ctx, rng, m, position_ids)
                stats = self._router_stats(real)
                if stats is not None:
                    packed = torch.stack([stats[0], stats[1]])
                    if on_router_stats is not None:
                        on_router_stats(m, packed)
                    else:
                        result.router_stats.append(packed)
                if on_output is not None:
                    on_output(m, x)
                else:
                    result.outputs.append(x)
        if on_saved is not None:
            result.saved = {}
        return result

    def backward(
        self,
        start: int,
        stop: int,
        weights: Mapping[str, torch.Tensor],
        saved_inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        *,
        rng: RngKey = RngKey(),
        position_ids: Sequence[torch.Tensor | None] | None = None,
        on_grad_input: Callable[[int, torch.Tensor], None] | None = None,
        router_counts: Sequence[torch.Tensor] | None = None,
        batch_tokens: int | None = None,
        row_tokens: Sequence[Sequence[int]] | None = None,
        recompute: str = "stage",
        loss_scale: float = 1.0,
    ) -> BackwardResult:
        """Recompute [start, stop) from its saved inputs and backpropagate ``grad_outputs``.

        ``saved_inputs[m]`` is the stage input the forward pass kept (input_ids when start
        == 0); ``grad_outputs[m]`` is d(loss)/d(output of layer stop-1). Returns the input
        gradients (None for start == 0) and fp32 weight gradients summed over microbatches.
        With ``on_grad_input(m, t)`` each input gradient is handed over as soon as it
        exists (so the previous stage can start) and ``grad_inputs`` comes back empty.
        With a router auxiliary loss, ``router_counts[m]`` (the tail's) and
        ``batch_tokens`` (real tokens of the global batch; ``row_tokens`` as in
        ``forward``) give its gradient. Note [router auxiliary loss]
        (roundpipe.shared.model). ``recompute="layer"`` keeps only each
        layer's input and recomputes one layer at a time (Note [recompute grain]); the
        same gradients, bitwise. ``loss_scale``: the float16 loss scale the tail seeded
        ``grad_outputs`` with, which the router auxiliary loss's own seed takes too
        (Note [dynamic loss scaling] in roundpipe.coordinator.training.loss_scale).
        """
        if recompute not in RECOMPUTE_GRAINS:
            raise ValueError(f"recompute must be one of {RECOMPUTE_GRAINS}, got {recompute!r}")
        self._check_range(start, stop, tail=False)
        self._check_aux("backward", router_counts, batch_tokens, len(saved_inputs))
        if len(saved_inputs) != len(grad_outputs):
            raise ValueError(
                f"backward {start}:{stop}: {len(saved_inputs)} saved inputs but "
                f"{len(grad_outputs)} output gradients"
            )
        bound = self._bind(start, stop, weights, grad=True)
        acc: dict[str, torch.Tensor] = {}
        grad_inputs: list[torch.Tensor] | None = [] if start > 0 else None
        if start == 0 and not bound.trainable:
            # Nothing upstream of this stage and nothing to learn in it (LoRA prefix).
            return BackwardResult(None, {})
        if recompute == "layer" and router_counts is None:
            with self._task_scope():
                for m, (x, g) in enumerate(zip(saved_inputs, grad_outputs)):
                    g = self._hidden(g, "grad_outputs")
                    gx = self._backward_by_layer(
                        x, g, start, stop, bound, acc, rng, m, position_ids
                    )
                    _emit(grad_inputs, on_grad_input, m, gx)
                    del gx, g  # not alive through the next microbatch
            return BackwardResult(grad_inputs, acc)
        with self._task_scope(), torch.enable_grad():
            for m, (x, g) in enumerate(zip(saved_inputs, grad_outputs)):
                g = self._hidden(g, "grad_outputs")
                real = self._real_tokens(row_tokens, m, x)
                x, out = self._run_with_grad(x, start, stop, bound, rng, m, position_ids)
                extra = None
                stats = self._router_stats(real)
                if stats is not None:
                    assert router_counts is not None and batch_tokens is not None
                    counts = router_counts[m].to(self.device, torch.float32)
                    scale = self._aux_scale(x, batch_tokens, real)
                    extra = scale * (counts * stats[1]).sum()
                gx = self._backprop(
                    out, g, x if start > 0 else None, bound, acc, extra=extra, seed=loss_scale
                )
                _emit(grad_inputs, on_grad_input, m, gx)
                del out, gx, g
        return BackwardResult(grad_inputs, acc)

    def tail(
        self,
        start: int,
        stop: int,
        weights: Mapping[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        num_label_tokens: int,
        *,
        rng: RngKey = RngKey(),
        position_ids: Sequence[torch.Tensor | None] | None = None,
        on_grad_input: Callable[[int, torch.Tensor], None] | None = None,
        router_stats: Sequence[torch.Tensor] | None = None,
        batch_tokens: int | None = None,
        on_router_counts: Callable[[int, torch.Tensor], None] | None = None,
        row_tokens: Sequence[Sequence[int]] | None = None,
        loss_scale: float = 1.0,
    ) -> TailResult:
        """Fused forward + loss + backward of the last range [start, num_layers).

        ``labels[m]`` are unshifted token labels ``[rows, seq]`` (-100 = no loss), as
        passed to HF's ``model(input_ids, labels=...)``, or the same prepared on the host
        (``TailLabels``, what a GPU worker passes). ``num_label_tokens`` is the
        global batch's count (``count_label_tokens`` summed over all microbatches).
        ``on_grad_input`` streams input gradients as in ``backward``. With a router
        auxiliary loss, ``router_stats[m]`` (the forward stages' summed
        ``ForwardResult.router_stats``; None when the tail starts at layer 0) and
        ``batch_tokens`` (real tokens of the global batch; ``row_tokens`` as in
        ``forward``) complete it here;
        ``on_router_counts(m, t)`` receives microbatch m's complete counts before its
        input gradient (they are in ``router_counts`` either way). Note [router
        auxiliary loss] (roundpipe.shared.model). ``loss_scale`` multiplies the seed of
        the backward (the float16 loss scale, a power of two: Note [dynamic loss scaling]
        in roundpipe.coordinator.training.loss_scale); the losses come back unscaled.
        """
        self._check_range(start, stop, tail=True)
        if router_stats is not None or start > 0:
            self._check_aux("tail", router_stats, batch_tokens, len(inputs))
        elif self.model.router_aux is not None and batch_tokens is None:
            raise ValueError("tail: the router auxiliary loss needs batch_tokens")
        if len(inputs) != len(labels):
            raise ValueError(f"tail: {len(inputs)} inputs but {len(labels)} label tensors")
        if not inputs:
            raise ValueError("tail: no microbatches")
        if num_label_tokens < 1:
            raise ValueError(
                f"num_label_tokens must be >= 1 (the global batch has no label tokens?), "
                f"got {num_label_tokens}"
            )
        bound = self._bind(start, stop, weights, grad=True)
        assert bound.head is not None
        head_name = self.model.lm_head_name
        head_trainable = any(n == head_name for n, _ in bound.trainable)
        norm_layer = self.model.num_layers - 1
        acc: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []  # kept on the device: one sync at the end
        aux_losses: list[torch.Tensor] = []
        router_counts: list[torch.Tensor] = []
        grad_inputs: list[torch.Tensor] | None = [] if start > 0 else None
        with self._task_scope(), torch.enable_grad():
            for m, (x, y) in enumerate(zip(inputs, labels)):
                real = self._real_tokens(row_tokens, m, x)
                x, h = self._run_with_grad(x, start, norm_layer, bound, rng, m, position_ids)
                extra = None
                stats = self._router_stats(real)
                if stats is not None:
                    assert batch_tokens is not None
                    counts, probs = stats
                    if router_stats is not None:
                        upstream = router_stats[m].to(self.device, torch.float32)
                        counts = counts + upstream[0]
                        total_probs = probs.detach() + upstream[1]
                    else:
                        total_probs = probs.detach()
                    scale = self._aux_scale(x, batch_tokens, real)
                    aux_losses.append(scale * (counts * total_probs).sum())
                    router_counts.append(counts)
                    if on_router_counts is not None:
                        on_router_counts(m, counts)
                    extra = scale * (counts * probs).sum()
                watch = self.stopwatch
                if watch is not None:  # norm + chunked head and loss (forward and backward)
                    watch.start(norm_layer)
                self._seed(rng, norm_layer, m)
                norm_mod, _ = self.model.norm_part()
                h = functional_call(
                    norm_mod, bound.layer_params(norm_layer, self.compute_dtype), (h,)
                )
                if isinstance(y, TailLabels):
                    shape, shifted, positions = y.shape, y.shifted, y.positions
                else:
                    shape = tuple(y.shape)
                    shifted, positions = tail_labels(y.to(self.device, non_blocking=True))
                if tuple(shape) != tuple(h.shape[:2]):
                    raise ValueError(
                        f"tail: labels of microbatch {m} have shape {tuple(shape)}, "
                        f"hidden states {tuple(h.shape[:2])}"
                    )
                loss, grad_h, grad_w = chunked_lm_head_loss(
                    h.detach().reshape(-1, h.shape[-1]),
                    bound.head,
                    shifted,
                    num_label_tokens=num_label_tokens,
                    chunk_tokens=self.chunk_tokens,
                    need_hidden_grad=h.requires_grad,
                    need_weight_grad=head_trainable,
                    positions=positions,
                    grad_scale=loss_scale,
                )
                losses.append(loss if extra is None else loss + aux_losses[-1].detach())
                if watch is not None:
                    watch.stop(norm_layer)
                if grad_w is not None:
                    _accumulate(acc, head_name, grad_w)
                gx = None
                if grad_h is not None:
                    gx = self._backprop(
                        h,
                        grad_h.view_as(h),
                        x if start > 0 else None,
                        bound,
                        acc,
                        skip=head_name,
                        extra=extra,
                        seed=loss_scale,
                    )
                elif start > 0:
                    gx = torch.zeros_like(x)
                _emit(grad_inputs, on_grad_input, m, gx)
                # Nothing of this microbatch lives through the next one's forward: its
                # input and hidden gradients are a hidden-sized tensor each.
                del h, gx, grad_h, grad_w
        for name, _ in bound.trainable:
            # A trainable weight no token reached still gets its (zero) gradient.
            if name not in acc:
                acc[name] = torch.zeros(
                    self._shape_of(name), dtype=torch.float32, device=self.device
                )
        aux = torch.stack(aux_losses).detach() if aux_losses else None
        return TailResult(torch.stack(losses), grad_inputs, acc, aux, router_counts)

    # -------------------------------------------------------------- internals

    def _check_range(self, start: int, stop: int, *, tail: bool) -> None:
        n = self.model.num_layers
        if tail:
            if not (0 <= start < stop == n):
                raise ValueError(f"tail range {start}:{stop} must be non-empty and end at {n}")
        elif not (0 <= start < stop <= n - 1):
            raise ValueError(
                f"stage range {start}:{stop} must be non-empty and stop at or before layer "
                f"{n - 1} (layer {n - 1}, the loss, runs only in the fused tail)"
            )

    def _bind(
        self, start: int, stop: int, weights: Mapping[str, torch.Tensor], *, grad: bool
    ) -> _Bound:
        model = self.model
        per_layer: dict[int, dict[str, torch.Tensor]] = {}
        trainable: list[tuple[str, torch.Tensor]] = []
        head: torch.Tensor | None = None
        missing: list[str] = []
        quantized = model.quantized_base
        pending: dict[int, dict[str, tuple[str, dict[str, torch.Tensor]]]] = {}
        for layer in range(start, stop):
            prefix = model.part_prefix(layer)
            rel: dict[str, torch.Tensor] = self._buffers(layer)
            for spec in model.layer_params(layer):
                if quantized is not None and spec.name in quantized.shapes:
                    parts = quantized.get_parts(weights, spec.name)
                    if parts is None:
                        missing.append(spec.name)
                        continue
                    on_device = {p: t.to(self.device, non_blocking=True) for p, t in parts.items()}
                    pending.setdefault(layer, {})[spec.name[len(prefix) :]] = (
                        spec.name,
                        on_device,
                    )
                    continue
                t = weights.get(spec.name)
                if t is None:
                    missing.append(spec.name)
                    continue
                if t.dtype != self.compute_dtype:
                    raise TypeError(
                        f"weight {spec.name} is {t.dtype}, the executor computes in "
                        f"{self.compute_dtype}; hand weights over in the compute dtype"
                    )
                if tuple(t.shape) != spec.shape:
                    raise ValueError(
                        f"weight {spec.name} has shape {tuple(t.shape)}, expected {spec.shape}"
                    )
                # A fresh alias per task: never touches the caller's tensor (its
                # requires_grad flag or its read-only storage).
                leaf = _own_version(t.to(self.device, non_blocking=True))
                if grad and spec.trainable:
                    leaf.requires_grad_(True)
                    trainable.append((spec.name, leaf))
                if spec.name == model.lm_head_name:
                    head = leaf
                else:
                    rel[spec.name[len(prefix) :]] = leaf
            per_layer[layer] = rel
        if missing:
            raise KeyError(
                f"task {start}:{stop} is missing {len(missing)} weight(s), e.g. {missing[:5]}"
            )
        return _Bound(
            per_layer,
            trainable,
            head,
            quantized=pending,
            dequantize=quantized.dequantize if quantized is not None else None,
        )

    def _buffers(self, layer: int) -> dict[str, torch.Tensor]:
        bufs = self._part_buffers.get(layer)
        if bufs is None:
            bufs = self._part_buffers[layer] = self.model.part_buffers(layer, self.device)
        return dict(bufs)

    def _shape_of(self, name: str) -> tuple[int, ...]:
        layer = self.model.layer_of(name)
        return next(s.shape for s in self.model.layer_params(layer) if s.name == name)

    def _input(self, x: torch.Tensor, start: int) -> torch.Tensor:
        if start == 0:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise TypeError(
                    f"layer 0 takes input_ids [rows, seq] of an integer dtype, got "
                    f"{x.dtype} {tuple(x.shape)}"
                )
            return x.to(self.device, non_blocking=True)
        return self._hidden(x, "inputs")

    def _hidden(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.model.hidden_size:
            raise ValueError(
                f"{what}: expected hidden states [rows, seq, {self.model.hidden_size}], "
                f"got {tuple(x.shape)}"
            )
        if x.dtype != self.compute_dtype:
            raise TypeError(f"{what}: expected {self.compute_dtype}, got {x.dtype}")
        return x.to(self.device, non_blocking=True)

    def _run_with_grad(
        self,
        x: torch.Tensor,
        start: int,
        stop: int,
        bound: _Bound,
        rng: RngKey,
        m: int,
        positions: Sequence[torch.Tensor | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run microbatch m through layers [start, stop) with autograd, from its stage input
        ``x``. Returns the input as placed on the device (a leaf that requires grad when it
        is hidden states, so the previous stage gets its gradient) and the output."""
        x = self._input(x, start)
        if start > 0:
            x = x.detach().requires_grad_(True)
        out = x
        ctx: StageContext | None = None
        self._start_capture()
        for layer in range(start, stop):
            out, ctx = self._run_layer(layer, out, bound, ctx, rng, m, positions)
        return x, out

    def _backward_by_layer(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        start: int,
        stop: int,
        bound: _Bound,
        acc: dict[str, torch.Tensor],
        rng: RngKey,
        m: int,
        positions: Sequence[torch.Tensor | None] | None,
    ) -> torch.Tensor | None:
        """Microbatch m of a backward task at layer grain (Note [recompute grain]): the
        range forward without autograd keeping each layer's input, then each layer, last
        first, recomputed with autograd from its input and backpropagated at once."""
        h = self._input(x, start)
        ctx: StageContext | None = None
        inputs: list[torch.Tensor | None] = []
        with torch.no_grad():
            for layer in range(start, stop):
                inputs.append(h)
                h, ctx = self._run_layer(layer, h, bound, ctx, rng, m, positions)
        del h
        names = {n for n, _ in bound.trainable}
        g: torch.Tensor | None = grad_out
        for layer in reversed(range(start, stop)):
            inp = inputs[layer - start]
            inputs[layer - start] = None  # freed as soon as its layer is done
            assert inp is not None and g is not None
            leaf = inp.detach().requires_grad_(True) if layer > 0 else inp
            with torch.enable_grad():
                out, _ = self._run_layer(layer, leaf, bound, ctx, rng, m, positions)
            mine = {self.model.part_prefix(layer) + k for k in bound.per_layer[layer]}
            only = _Bound(
                bound.per_layer,
                [(n, t) for n, t in bound.trainable if n in mine and n in names],
                bound.head,
            )
            g = self._backprop(out, g, leaf if layer > 0 else None, only, acc)
            del out
        return g

    def _run_layer(
        self,
        layer: int,
        x: torch.Tensor,
        bound: _Bound,
        ctx: StageContext | None,
        rng: RngKey,
        m: int,
        positions: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, StageContext | None]:
        if self.before_layer is not None:
            self.before_layer()
        watch = self.stopwatch
        if watch is not None:
            watch.start(layer)
        self._seed(rng, layer, m)
        model = self.model
        params = bound.layer_params(layer, self.compute_dtype)
        if layer == 0:
            mod, _ = model.embed_part()
            out = functional_call(mod, params, (x,))
        else:
            if ctx is None:
                ctx = StageContext(self, x, None if positions is None else positions[m])
            mod, _ = model.decoder_part(layer)
            layer_type = model.layer_type(layer)
            kind = model.mask_kind(layer)
            spans = ctx.spans_for(kind)
            # Note [sequence-chunked MLP]: rows from LONG_ROW_TOKENS on.
            chunk = (
                mlp_chunks.MLP_CHUNK_TOKENS
                if x.shape[1] >= document_attention.LONG_ROW_TOKENS
                else None
            )
            with (
                long_rows(spans) if spans is not None else contextlib.nullcontext(),
                mlp_chunks.chunked_mlp(chunk) if chunk else contextlib.nullcontext(),
            ):
                out = functional_call(
                    mod,
                    params,
                    (x,),
                    {
                        "attention_mask": ctx.mask(kind),
                        "position_embeddings": ctx.position_embeddings(layer_type),
                        "position_ids": ctx.position_ids,
                        "use_cache": False,
                    },
                )
            if isinstance(out, tuple):  # older layer signatures returned (hidden, ...)
                out = out[0]
        if watch is not None:
            watch.stop(layer)
        return out, ctx

    def _backprop(
        self,
        out: torch.Tensor,
        grad_out: torch.Tensor,
        x: torch.Tensor | None,
        bound: _Bound,
        acc: dict[str, torch.Tensor],
        skip: str | None = None,
        extra: torch.Tensor | None = None,
        seed: float = 1.0,
    ) -> torch.Tensor | None:
        """Backpropagate ``grad_out`` through ``out`` (plus the scalar loss term ``extra``:
        the router auxiliary loss of this range, seeded with ``seed``: the loss scale
        ``grad_out`` carries) into ``x`` and the trainable weights."""
        leaves = [(n, t) for n, t in bound.trainable if n != skip]
        targets = ([x] if x is not None else []) + [t for _, t in leaves]
        if not targets:
            return None
        outputs, grad_outputs = [out], [grad_out]
        if extra is not None and extra.requires_grad:
            outputs.append(extra)
            grad_outputs.append(torch.full_like(extra, seed))
        grads = torch.autograd.grad(
            outputs, targets, grad_outputs=grad_outputs, allow_unused=True, materialize_grads=True
        )
        off = 0
        gx = None
        if x is not None:
            gx = grads[0]
            off = 1
        for (name, _), g in zip(leaves, grads[off:]):
            _accumulate(acc, name, g)
        return gx

    # -- router auxiliary loss: Note [router auxiliary loss] (roundpipe.shared.model) --

    def _install_router_hooks(self) -> None:
        aux = self.model.router_aux
        if aux is None:
            return
        for layer in aux.moe_layers:
            router = self.model.router_module(layer)
            assert router is not None
            # Once per skeleton module, however many executors share the model.
            if not hasattr(router, "_roundpipe_capture"):
                router._roundpipe_capture = router.register_forward_hook(_capture_router_logits)

    def _start_capture(self) -> None:
        """Collect the router logits of the layers this thread runs from now on (one
        microbatch); thread-local, as in-process workers share one skeleton."""
        if self.model.router_aux is not None:
            _ROUTER_LOGITS.captured = []

    def _real_tokens(
        self, row_tokens: Sequence[Sequence[int]] | None, m: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, int] | None:
        """Microbatch m's real-token mask (fp32 ``[rows * seq]``, row-major like the
        router's logits) and count, its stage input being ``x``; None when every token
        is real or the model has no router auxiliary loss."""
        if self.model.router_aux is None or row_tokens is None:
            return None
        rows, seq = x.shape[0], x.shape[1]
        lengths = row_tokens[m]
        if len(lengths) != rows or not all(1 <= n <= seq for n in lengths):
            raise ValueError(
                f"microbatch {m}: real tokens per row {list(lengths)} do not fit its "
                f"{rows} rows of {seq} tokens"
            )
        mask = torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return mask.reshape(-1).to(self.device, torch.float32), sum(lengths)

    def _router_stats(
        self, real: tuple[torch.Tensor, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(top-k counts, router-probability sums), fp32 ``[experts]`` each, over the
        logits captured since ``_start_capture``, as transformers' load-balancing loss
        forms them; the sums keep their autograd graph. ``real`` (``_real_tokens``):
        padding counts in neither, as transformers leaves out what its attention mask
        does."""
        aux = self.model.router_aux
        if aux is None:
            return None
        captured = getattr(_ROUTER_LOGITS, "captured", None) or []
        _ROUTER_LOGITS.captured = None
        counts = torch.zeros(aux.num_experts, dtype=torch.float32, device=self.device)
        probs = torch.zeros(aux.num_experts, dtype=torch.float32, device=self.device)
        for logits in captured:
            p = torch.softmax(logits.reshape(-1, aux.num_experts), dim=-1)
            picked = torch.topk(p, aux.top_k, dim=-1).indices.reshape(-1)
            # A scatter of ones (or of the mask), not bincount: no device sync for the
            # output size.
            if real is None:
                ones = torch.ones_like(picked, dtype=torch.float32)
                counts = counts.index_add(0, picked, ones)
                probs = probs + p.float().sum(dim=0)
            else:
                mask = real[0]
                counts = counts.index_add(0, picked, mask.repeat_interleave(aux.top_k))
                probs = probs + (p.float() * mask.unsqueeze(1)).sum(dim=0)
        return counts, probs

    def _aux_scale(
        self, x: torch.Tensor, batch_tokens: int, real: tuple[torch.Tensor, int] | None = None
    ) -> float:
        """``coef * w_m * E / R^2`` of the microbatch whose stage input is ``x``: its real
        tokens (``real``, else all) over ``batch_tokens``, and R layers x its tokens."""
        aux = self.model.router_aux
        assert aux is not None
        tokens = x.shape[0] * x.shape[1] if real is None else real[1]
        rows = len(aux.moe_layers) * tokens
        return aux.coef * (tokens / batch_tokens) * aux.num_experts / rows**2

    def _check_aux(
        self,
        what: str,
        per_microbatch: Sequence[torch.Tensor] | None,
        batch_tokens: int | None,
        num_microbatches: int,
    ) -> None:
        if self.model.router_aux is None:
            if per_microbatch is not None:
                raise ValueError(
                    f"{what}: router statistics given, but the model has no router loss"
                )
            return
        if per_microbatch is None or batch_tokens is None:
            raise ValueError(
                f"{what}: the router auxiliary loss (output_router_logits) needs the router "
                "statistics of every microbatch and batch_tokens"
            )
        if len(per_microbatch) != num_microbatches:
            raise ValueError(
                f"{what}: {len(per_microbatch)} router statistics for {num_microbatches} microbatches"
            )

    def _seed(self, rng: RngKey, layer: int, m: int) -> None:
        s = rng.layer_seed(layer, m)
        torch.default_generator.manual_seed(s)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(s)

    @contextlib.contextmanager
    def _task_scope(self) -> Iterator[None]:
        """Around a task's microbatches: the caller's RNG state forked (each layer seeds
        its own), and the router-logit capture dropped however the task ends. A task
        interrupted or failed mid-microbatch would otherwise leave the logits, with their
        autograd graph and activations, on this long-lived thread until the next MoE
        task: device memory no cache release returns, past the job's end."""
        devices = [self.device.index] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            _ROUTER_LOGITS.captured = None


_ROUTER_LOGITS = threading.local()
"""``captured``: the list the current thread's router logits go to, or None."""


def _capture_router_logits(module: object, args: object, output: object) -> None:
    captured = getattr(_ROUTER_LOGITS, "captured", None)
    if captured is not None:
        captured.append(output[0] if isinstance(output, tuple) else output)


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t``'s memory with its own autograd version counter.

    Weights arrive as views of one arena buffer, and views share their base's version
    counter. peft's LoRA on a parameter (fused MoE experts, the router; what all-linear
    picks on Qwen3-MoE) registers a parametrization at every forward, which calls
    ``set_`` on the weight: a version bump that, through the shared counter, would
    invalidate every other weight autograd saved earlier in the same pass ("modified by
    an inplace operation"). A tensor made by ``set_`` onto the storage is not a view, so
    a bump stays with that one weight. No data is copied.
    """
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return alias


def _emit(
    out: list[torch.Tensor] | None,
    callback: Callable[[int, torch.Tensor], None] | None,
    m: int,
    grad: torch.Tensor | None,
) -> None:
    if out is None or grad is None:  # the stage starts at layer 0: no input gradient
        return
    if callback is not None:
        callback(m, grad)
    else:
        out.append(grad)


def _accumulate(acc: dict[str, torch.Tensor], name: str, g: torch.Tensor) -> None:
    cur = acc.get(name)
    if cur is None:
        acc[name] = g.to(torch.float32, copy=True)
    else:
        cur.add_(g)
