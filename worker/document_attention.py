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
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

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
LONG_ROW_TOKENS = 4096
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


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    spans = getattr(_spans, "value", None)
    if attention_mask is not None or spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("is_causal", None)  # each call below says whether it is
    rows, heads, seq, dim = query.shape
    out = query.new_empty(rows, seq, heads, value.shape[-1])
    for b, documents in enumerate(spans):
        for start, stop in documents:
            if window is None or stop - start <= window:
                piece, _ = sdpa_attention_forward(
                    module,
                    query[b : b + 1, :, start:stop],
                    key[b : b + 1, :, start:stop],
                    value[b : b + 1, :, start:stop],
                    None,
                    is_causal=True,
                    **kwargs,
                )
                out[b : b + 1, start:stop] = piece
                continue
            for q0 in range(start, stop, WINDOW_BLOCK):
                q1 = min(q0 + WINDOW_BLOCK, stop)
                k0 = max(start, q0 - window + 1)
                mask = _window_mask(q0, q1, k0, q1, window, query.device)
                piece, _ = sdpa_attention_forward(
                    module,
                    query[b : b + 1, :, q0:q1],
                    key[b : b + 1, :, k0:q1],
                    value[b : b + 1, :, k0:q1],
                    mask[None, None],
                    is_causal=False,
                    **kwargs,
                )
                out[b : b + 1, q0:q1] = piece
    return out, None


# Every layer that asks for "sdpa" in this process gets the wrapper; it is transformers'
# own function whenever no spans are declared (Note [long-row attention]).
AttentionInterface.register("sdpa", _attention)
