"""Where a row counts as long, and how a long row's MLP is cut: shared by the worker,
which does it (Note [long-row attention], Note [sequence-chunked MLP]), and the
planner, which prices its memory (roundpipe.coordinator.planning.costs)."""

from __future__ import annotations

__all__ = ["LONG_ROW_TOKENS", "MLP_CHUNK_TOKENS", "mlp_chunk_tokens"]

LONG_ROW_TOKENS = 4096
"""From this many tokens per row attention goes without ``seq x seq`` masks and the
dense MLP over sequence chunks."""

MLP_CHUNK_TOKENS = 4096
"""Tokens per chunk of a long row's MLP (Note [sequence-chunked MLP])."""


def mlp_chunk_tokens(seq_len: int, threshold: int = LONG_ROW_TOKENS) -> int | None:
    """Tokens per MLP chunk for rows of ``seq_len`` (None: the MLP runs whole)."""
    if seq_len >= threshold and seq_len > MLP_CHUNK_TOKENS:
        return MLP_CHUNK_TOKENS
    return None
