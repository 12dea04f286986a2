"""The MLP of a long row over sequence chunks (Note [sequence-chunked MLP]): its
``tokens x intermediate_size`` activations exist for one chunk at a time, in the forward
and in the backward's recompute."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.func import functional_call

from roundpipe.shared.long_rows import MLP_CHUNK_TOKENS as _SHARED_MLP_CHUNK_TOKENS

__all__ = ["MLP_CHUNK_TOKENS", "chunked_mlp", "install"]

# Note [sequence-chunked MLP]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dense MLP is token-wise, so it can run over slices of the sequence. At 73K tokens the
# 1.7B's gate, up, activation and product are four 73K x 6,144 tensors (3.6 GB in bf16)
# that autograd would keep per layer; the layer's own input is 0.3 GB. For rows of at
# least LONG_ROW_TOKENS tokens (Note [long-row attention], the same threshold, so short
# rows run exactly as before) the executor sets a chunk size for the thread and the
# wrapped MLP forward runs chunk by chunk: without autograd, each chunk's output is
# written into the whole output and its intermediates freed; with autograd, one
# function keeps only the MLP's input and, in backward, recomputes each chunk's gate and
# up under autograd and backpropagates that chunk at once (one more forward of the MLP's
# matmuls, the price of never holding the whole intermediate). The weight gradients are
# summed over the chunks in fp32, so the result equals the unchunked MLP up to the order
# of that sum (tests/test_long_context.py).
#
# The chunk is MLP_CHUNK_TOKENS = 4,096 tokens: at that height the GEMMs run at the
# same rate as the whole row's (the LM head's GPU chunk is 4,096 tokens for the same
# reason), while the intermediate is bounded by the chunk, not the row: 4 x 4,096 x
# 6,144 x 2 bytes = 0.2 GB for the 1.7B however long the sequence. A row is chunked only
# when it is longer than one chunk. An MLP with an active dropout (a LoRA dropout) is
# left whole: its recompute would have to replay the chunks' masks.
MLP_CHUNK_TOKENS = _SHARED_MLP_CHUNK_TOKENS

_chunk = threading.local()

_DENSE = frozenset({"gate_proj", "up_proj", "down_proj"})


@contextlib.contextmanager
def chunked_mlp(tokens: int | None) -> Iterator[None]:
    """Run installed MLPs over chunks of ``tokens`` on this thread (None: whole)."""
    previous = getattr(_chunk, "tokens", None)
    _chunk.tokens = tokens
    try:
        yield
    finally:
        _chunk.tokens = previous


def install(mlp: torch.nn.Module) -> bool:
    """Wrap a dense (gate / up / down) MLP's forward, once per module; whether it is."""
    if getattr(mlp, "_roundpipe_chunked", False):
        return True
    if not _DENSE <= {name for name, _ in mlp.named_children()}:
        return False
    original = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = getattr(_chunk, "tokens", None)
        if tokens is None or x.dim() != 3 or x.shape[1] <= tokens or _dropout(mlp):
            return original(x)
        return _chunked(mlp, original, x, tokens)

    mlp.forward = forward
    mlp._roundpipe_chunked = True
    return True


def _dropout(mlp: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in mlp.modules())


def _chunked(
    mlp: torch.nn.Module, original: Callable[..., torch.Tensor], x: torch.Tensor, tokens: int
) -> torch.Tensor:
    """The MLP over ``x`` ``[rows, seq, hidden]``, ``tokens`` positions at a time."""
    named = list(mlp.named_parameters()) + list(mlp.named_buffers())
    names = [n for n, _ in named]
    tensors = [t for _, t in named]
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors)):
        return _ChunkedMlp.apply(x, tokens, mlp, names, *tensors)
    return _forward(lambda piece: original(piece), x, tokens)


def _forward(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens: int):
    out: torch.Tensor | None = None
    for a in range(0, x.shape[1], tokens):
        piece = run(x[:, a : a + tokens])
        if out is None:
            out = piece.new_empty(x.shape[:2] + piece.shape[2:])
        out[:, a : a + tokens] = piece
        del piece
    assert out is not None
    return out


class _ChunkedMlp(torch.autograd.Function):
    """Keeps the MLP's input; backward recomputes and backpropagates chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        tokens: int,
        mlp: torch.nn.Module,
        names: Sequence[str],
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        ctx.tokens, ctx.mlp, ctx.names = tokens, mlp, list(names)
        ctx.save_for_backward(x, *tensors)
        with torch.no_grad():
            return _forward(lambda piece: _call(mlp, names, tensors, piece), x, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *tensors = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need = ctx.needs_input_grad[4:]
        gx = torch.empty_like(x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(tensors)
        for a in range(0, x.shape[1], ctx.tokens):
            b = a + ctx.tokens
            with torch.enable_grad():
                piece = x[:, a:b].detach().requires_grad_(need_x)
                leaves = [t.detach().requires_grad_(n) for t, n in zip(tensors, need)]
                y = _call(ctx.mlp, ctx.names, leaves, piece)
            wanted = [i for i, n in enumerate(need) if n]
            targets = ([piece] if need_x else []) + [leaves[i] for i in wanted]
            grads = torch.autograd.grad(y, targets, grad[:, a:b], allow_unused=True)
            del y
            if need_x:
                gx[:, a:b] = grads[0]
                grads = grads[1:]
            for i, g in zip(wanted, grads):
                if g is None:
                    continue
                if sums[i] is None:
                    sums[i] = g.to(torch.float32, copy=True)
                else:
                    sums[i].add_(g)
        out = [None if s is None else s.to(t.dtype) for s, t in zip(sums, tensors)]
        for i, n in enumerate(need):
            if n and out[i] is None:
                out[i] = torch.zeros_like(tensors[i])
        return (gx, None, None, None, *out)


def _call(
    mlp: torch.nn.Module,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    x: torch.Tensor,
) -> torch.Tensor:
    """The MLP's original forward on ``x`` with ``tensors`` bound (the module's own are
    the meta skeleton's outside a layer call: a backward runs after it)."""
    with chunked_mlp(None):
        return functional_call(mlp, dict(zip(names, tensors)), (x,))
