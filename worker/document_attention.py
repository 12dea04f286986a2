"""Attention over long rows without a ``seq x seq`` mask (Note [long-row attention]).

Plain causal attention never builds the score matrix: SDPA's flash and memory-efficient
kernels (CUDA) and its flash kernel (CPU) stream over keys when given ``is_causal`` and no
mask. What builds ``seq x seq`` tensors is the mask itself: Hugging Face makes a 4-D
mask for packed documents (Note [packed documents]) and for sliding-window layers, 5 GB
of booleans for one 73K-token row before any attention runs. For rows of at least
LONG_ROW_TOKENS tokens the executor therefore passes no mask and declares the row's
documents here (``long_rows``); the function registered below then attends document by
document, and within a sliding-window layer query block by query block, each call with
``is_causal`` or a mask no larger than ``block x (block + window)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from roundpipe.shared.long_rows import LONG_ROW_TOKENS as _SHARED_LONG_ROW_TOKENS

__all__ = ["LONG_ROW_TOKENS", "document_spans", "long_rows"]

# Note [long-row attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# From LONG_ROW_TOKENS tokens per row on, the executor asks transformers for no attention
# mask and instead sets the microbatch's document spans (from its position ids: a
# document starts where the positions restart) for the duration of the layer calls.
# SDPA in this process is wrapped: with a mask, or with no declared spans, it is exactly
# transformers' SDPA; with spans and no mask it attends each document alone with
# ``is_causal`` (a document sees only itself, as the packed-document mask says), and a
# sliding-window layer attends each block of WINDOW_BLOCK queries to the keys within its
# window, with a mask of that block only. Shorter rows keep transformers' masks, so
# everything below the threshold runs exactly as before; above it the results equal the
# masked computation up to float rounding (the kernels sum over fewer masked keys).
#
# Grouped-query heads in fp32 on CUDA: transformers asks SDPA for ``enable_gqa`` when there
# is no mask, and of CUDA's streaming kernels only flash and cuDNN take it, in fp16/bf16
# only; fp32 with ``enable_gqa`` falls to the math kernel, which does build the
# ``seq x seq`` scores (tens of GB at 73K tokens). There, when no mask is given (long rows
# and plain causal rows alike), the keys and values are repeated to every query head
# first (``_full_heads``), which the memory-efficient kernel streams: 2 x (query heads /
# key heads - 1) x the row's keys more memory, not a square.
LONG_ROW_TOKENS = _SHARED_LONG_ROW_TOKENS
WINDOW_BLOCK = 1024

_spans = threading.local()


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, stop)`` of each document: a new one starts at the row's
    beginning and wherever the position does not follow the previous one."""
    p = position_ids.to("cpu")
    out = []
    for row in p:
        starts = [0] + (torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()
        stops = starts[1:] + [int(row.numel())]
        out.append(list(zip(starts, stops)))
    return out


@contextlib.contextmanager
def long_rows(spans: list[list[tuple[int, int]]]) -> Iterator[None]:
    """Declare the documents of the rows the layers run on next (this thread only)."""
    previous = getattr(_spans, "value", None)
    _spans.value = spans
    try:
        yield
    finally:
        _spans.value = previous


def _window_mask(q0: int, q1: int, k0: int, k1: int, window: int, device: Any) -> torch.Tensor:
    """Query i sees key j when i - window < j <= i (transformers' sliding window)."""
    q = torch.arange(q0, q1, device=device).unsqueeze(1)
    k = torch.arange(k0, k1, device=device).unsqueeze(0)
    return (k <= q) & (k > q - window)


class _FullHeads:
    """``module`` as transformers' SDPA sees it once keys and values carry every query
    head: no groups left to repeat or to ask the kernel for."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self.is_causal = getattr(module, "is_causal", True)


def _needs_full_heads(module: torch.nn.Module, query: torch.Tensor) -> bool:
    """Whether SDPA would meet grouped heads with no kernel but the ``seq x seq`` math
    one (Note [long-row attention])."""
    groups = getattr(module, "num_key_value_groups", 1)
    return groups > 1 and query.device.type == "cuda" and query.dtype == torch.float32


def _full_heads(module, key, value):
    groups = module.num_key_value_groups
    return _FullHeads(module), repeat_kv(key, groups), repeat_kv(value, groups)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    spans = getattr(_spans, "value", None)
    if attention_mask is None and _needs_full_heads(module, query):
        module, key, value = _full_heads(module, key, value)  # (with a mask, SDPA repeats)
    if attention_mask is not None or spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("is_causal", None)  # each call below says whether it is
    # Documents are cut with ``split`` and the pieces joined by ``cat``, not sliced out
    # and written into one output: under autograd each slice (and each slice assignment)
    # would make a whole row's gradient in backward, once per document: quadratic in a
    # row's documents.
    per_row = []
    for b, documents in enumerate(spans):
        sizes = [stop - start for start, stop in documents]
        q_docs = query[b : b + 1].split(sizes, dim=2)
        k_docs = key[b : b + 1].split(sizes, dim=2)
        v_docs = value[b : b + 1].split(sizes, dim=2)
        pieces = []
        for q, k, v in zip(q_docs, k_docs, v_docs):
            n = q.shape[2]
            if window is None or n <= window:
                piece, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
                pieces.append(piece)
                continue
            for q0 in range(0, n, WINDOW_BLOCK):
                q1 = min(q0 + WINDOW_BLOCK, n)
                k0 = max(0, q0 - window + 1)
                mask = _window_mask(q0, q1, k0, q1, window, query.device)
                piece, _ = sdpa_attention_forward(
                    module,
                    q[:, :, q0:q1],
                    k[:, :, k0:q1],
                    v[:, :, k0:q1],
                    mask[None, None],
                    is_causal=False,
                    **kwargs,
                )
                pieces.append(piece)
        per_row.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
    out = per_row[0] if len(per_row) == 1 else torch.cat(per_row, dim=0)
    return out, None


# Every layer that asks for "sdpa" in this process gets the wrapper; it is transformers'
# own function whenever no spans are declared (Note [long-row attention]).
AttentionInterface.register("sdpa", _attention)
