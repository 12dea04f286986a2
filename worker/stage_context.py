"""What the layers of one microbatch share inside a stage task: position ids, rotary
tables and attention masks, built on first use (Note [packed documents] and Note
[long-row attention])."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.worker import document_attention
from roundpipe.worker.document_attention import document_spans

__all__ = ["StageContext", "rotary_reset"]

# Note [dynamic rotary]
# transformers' dynamic NTK rotary (rope_type "dynamic") rescales its frequencies from the
# longest position it is called with, and keeps the result: it grows the table when a
# longer sequence comes and resets it only when one shorter than the model's original
# maximum does. One rotary module serves every task of a job on an executor, so the
# table a microbatch got depended on which microbatches and tasks ran before it: the
# forward of microbatch 0 and its recompute in the backward disagreed once microbatch 1
# was longer (a weight gradient 2.7% off), and the same task gave different outputs on
# different workers. The module is therefore put back as it was built before each
# microbatch's first call (``rotary_reset``): a microbatch's table depends on its own
# positions only, as in one transformers forward of that microbatch on a fresh model.


def rotary_reset(rotary: torch.nn.Module) -> Callable[[], None] | None:
    """For a rotary module that changes as it runs (rope_type "dynamic"), a function that
    puts it back as it is now; None for every other rotary. Note [dynamic rotary]."""
    types = getattr(rotary, "rope_type", None)
    kinds = types.values() if isinstance(types, dict) else [types]
    if "dynamic" not in kinds:
        return None
    buffers = {name: b.clone() for name, b in rotary.named_buffers(recurse=False)}
    # Plain attributes the update sets: max_seq_len_cached, attention_scaling,
    # original_inv_freq (their names, and the layer-type prefixes, vary by version).
    attributes = {
        name: value.clone() if isinstance(value, torch.Tensor) else value
        for name, value in vars(rotary).items()
        if not name.startswith("_") and isinstance(value, (int, float, torch.Tensor))
    }

    def reset() -> None:
        # What the update added (a layer type's ``<type>_max_seq_len_cached``) goes too:
        # left, it would stop the next growth or reset of that layer type's table.
        for name in [n for n, _ in rotary.named_buffers(recurse=False) if n not in buffers]:
            delattr(rotary, name)
        for name in [n for n in vars(rotary) if not n.startswith("_") and n not in attributes]:
            if isinstance(vars(rotary)[name], (int, float, torch.Tensor)):
                delattr(rotary, name)
        for name, b in buffers.items():
            rotary.register_buffer(name, b.clone(), persistent=False)
        for name, value in attributes.items():
            setattr(rotary, name, value.clone() if isinstance(value, torch.Tensor) else value)

    return reset


class StageContext:
    """Positions, rotary tables and masks of one microbatch, built on first use.
    Note [packed documents]. ``executor`` is the StageExecutor running the task (typed
    loosely: the executor imports this module)."""

    def __init__(self, executor: Any, h: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        ex = executor
        rows, seq = h.shape[0], h.shape[1]
        if position_ids is None:
            self.position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
        else:
            if tuple(position_ids.shape) != (rows, seq):
                raise ValueError(
                    f"position_ids {tuple(position_ids.shape)} do not match the microbatch "
                    f"[{rows}, {seq}]"
                )
            self.position_ids = position_ids.to(h.device, torch.int64, non_blocking=True)
        self._given_positions = position_ids is not None
        # Note [long-row attention]: from LONG_ROW_TOKENS on, no seq x seq masks.
        self.long = (
            seq >= document_attention.LONG_ROW_TOKENS and ex.model.attn_implementation == "sdpa"
        )
        self._packed: bool | None = None
        self._spans: list[list[tuple[int, int]]] | None = None
        self._h = h
        self._ex = ex
        self._masks: dict[str, torch.Tensor | None] = {}
        self._rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def position_embeddings(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary (cos, sin) for a layer of ``layer_type`` (one table unless the family's
        rotary is keyed by layer type)."""
        key = layer_type if self._ex.model.rotary_keyed_by_layer_type else None
        if key not in self._rotary:
            positions = self.position_ids
            if hasattr(self._ex._rotary, "mrope_section") and positions.dim() == 2:
                # A multimodal rotary (Qwen3.5's) takes one row of positions per grid
                # axis, (3, rows, seq); text has the same positions on each. Newer
                # transformers expand 2-D positions themselves, 5.17 (the GPU machine's)
                # does not.
                positions = positions.unsqueeze(0).expand(3, -1, -1)
            args = (self._h, positions) if key is None else (self._h, positions, key)
            if self._ex._rotary_reset is not None:
                self._ex._rotary_reset()  # Note [dynamic rotary]
            self._rotary[key] = self._ex._rotary(*args)
        return self._rotary[key]

    def packed(self) -> bool:
        """Whether some row holds several documents (one device sync, asked once)."""
        if self._packed is None:
            self._packed = self._given_positions and _restarts(self.position_ids)
        return self._packed

    def spans_for(self, kind: str) -> list[list[tuple[int, int]]] | None:
        """The rows' documents when a layer of mask ``kind`` attends without a mask
        (Note [long-row attention]), else None."""
        if not self.long or kind not in ("full", "sliding"):
            return None
        if kind == "full" and not self.packed():
            return None  # plain causal: no mask anyway (is_causal)
        if self._spans is None:
            self._spans = document_spans(self.position_ids.expand(self._h.shape[0], -1))
        return self._spans

    def mask(self, kind: str) -> torch.Tensor | None:
        if self.spans_for(kind) is not None:
            return None  # the documents are declared instead (Note [long-row attention])
        if kind not in self._masks:
            from transformers.masking_utils import (
                create_causal_mask,
                create_recurrent_attention_mask,
                create_sliding_window_causal_mask,
            )

            if kind == "recurrent" and self._given_positions and _restarts(self.position_ids):
                # A linear-attention layer carries one state along the whole row; it
                # cannot keep packed documents apart as the attention masks do.
                raise ValueError(
                    f"{self._ex.model.architecture} has linear-attention layers, which "
                    "would mix the packed documents of a row: set data.packing to 'none' "
                    "for this model"
                )
            fn = {
                "full": create_causal_mask,
                "sliding": create_sliding_window_causal_mask,
                "recurrent": create_recurrent_attention_mask,
            }[kind]
            # No padding mask: rows are packed / right-padded and causal, so pads never
            # reach real tokens; with SDPA and plain positions this yields None
            # (is_causal), exactly as HF. Packed documents: Note [packed documents].
            self._masks[kind] = fn(
                config=self._ex.model.config,
                inputs_embeds=self._h,
                attention_mask=None,
                position_ids=self.position_ids,
                **{_cache_kwarg(fn): None},
            )
        return self._masks[kind]


@functools.cache
def _cache_kwarg(fn: Callable) -> str:
    """The name transformers' mask function gives its (required) cache argument: ``cache``
    from 5.24 on, ``past_key_values`` before (still accepted, with a warning, until 5.40)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether some row's positions restart (packed documents). Asked only for models with
    linear-attention layers (one device sync per microbatch and stage there)."""
    p = position_ids
    if p.shape[-1] < 2:
        return False
    return bool((p[..., 1:] != p[..., :-1] + 1).any())
