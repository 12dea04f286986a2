"""Block-wise 8-bit optimizer states (``optimizer.state_dtype: int8``).

AdamW's two moments take 8 of the ~20 bytes a parameter costs in host memory. Stored as
8-bit codes with one fp32 scale per block of ``BLOCK`` elements they take ~2.03 bytes,
as in the 8-bit optimizer literature (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2022):

* each block of ``BLOCK`` consecutive elements is scaled by its largest magnitude
  (``absmax``), so one outlier spoils only its own block;
* the scaled values in [-1, 1] (``exp_avg``) or [0, 1] (the square root of
  ``exp_avg_sq``: Note [8-bit second moment] in roundpipe.coordinator.training.optimizer) are rounded to
  the nearest of 256 code values spread over several orders of magnitude (a *dynamic*
  code map: for each power of ten, a number of linear steps that shrinks with the
  exponent), so small moments keep relative precision where a linear 8-bit grid would
  round them to zero and ``exp_avg / sqrt(exp_avg_sq)`` would blow up.

The optimizer dequantizes one chunk of a tensor into fp32 scratch, runs the same fused
AdamW kernel as for fp32 states, and quantizes the chunk back (Note [chunked fused
AdamW] in roundpipe.coordinator.training.optimizer). Codes and scales are the state: checkpoints
save them as they are, so a resumed job continues bit for bit.

Layout of one tensor's state (``n`` elements, ``ceil(n / BLOCK)`` blocks)::

    codes   uint8[n]            index into the code map, per element
    absmax  float32[n_blocks]   the block's scale (0 for an all-zero block)
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "BLOCK",
    "SIGNED_MAP",
    "UNSIGNED_MAP",
    "CodeMap",
    "absmax_numel",
    "dequantize_",
    "quantize_",
    "square_to_root_",
]

BLOCK = 256
"""Elements per scale. Divides the optimizer's CHUNK_NUMEL, so chunks never split a block."""


def absmax_numel(numel: int) -> int:
    """Scales a tensor of ``numel`` elements needs."""
    return -(-numel // BLOCK)


class CodeMap:
    """256 sorted code values in [-1, 1] (``signed``) or [0, 1], and the midpoints
    between neighbours that rounding to the nearest code searches."""

    def __init__(self, *, signed: bool) -> None:
        self.signed = signed
        self.values = _dynamic_map(signed)
        self.midpoints = (self.values[1:] + self.values[:-1]) / 2
        self.zero_code = int((self.values == 0).nonzero()[0])
        """The code of 0."""

    def encode(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        """Nearest code index of each element of ``scaled`` (in the map's range) into
        ``out`` (uint8)."""
        out.copy_(torch.bucketize(scaled, self.midpoints))

    def decode(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Code values of ``codes`` into ``out`` (fp32)."""
        torch.index_select(self.values, 0, codes.long(), out=out)


def _dynamic_map(signed: bool) -> torch.Tensor:
    """The code values: 0, 1 and, per power of ten 10^-e (e = 0..6), linear steps over
    (0.1, 1] x 10^-e, the finer the larger the magnitude (-values too when signed)."""
    magnitudes: set[float] = {0.0, 1.0}
    slots = 127 if signed else 255  # non-zero codes per sign
    decades = 7
    # Steps per decade halve with each decade down, using up the slots.
    weights = [2.0 ** (decades - 1 - e) for e in range(decades)]
    total = sum(weights)
    for e, w in enumerate(weights):
        steps = max(1, int(math.floor((slots - 1) * w / total)))
        lo, hi = 0.1 * 10.0**-e, 10.0**-e
        for i in range(1, steps + 1):
            magnitudes.add(lo + (hi - lo) * i / steps)
    values = sorted(magnitudes)
    # Fill remaining slots with midpoints of the widest gaps, so there are exactly 256.
    need = (128 if signed else 256) - len(values)
    while need > 0:
        gaps = sorted(
            ((values[i + 1] - values[i]) / max(values[i + 1], 1e-12), i)
            for i in range(len(values) - 1)
        )
        _, i = gaps[-1]
        values.insert(i + 1, (values[i] + values[i + 1]) / 2)
        need -= 1
    values = values[: 128 if signed else 256]
    if signed:
        values = [-v for v in reversed(values[1:])] + values  # 127 negatives, 0, 127 positives
        values.append(-1.0)  # 256th code: a duplicate of -1 keeps the table full
        values.sort()
    return torch.tensor(values, dtype=torch.float32)


SIGNED_MAP = CodeMap(signed=True)
"""The first moment's code map."""
UNSIGNED_MAP = CodeMap(signed=False)
"""The second moment's (its square root's) code map."""


def dequantize_(
    codes: torch.Tensor, absmax: torch.Tensor, code_map: CodeMap, out: torch.Tensor
) -> None:
    """``out`` (fp32, flat, ``codes.numel()`` elements) = code value x block scale."""
    n = codes.numel()
    code_map.decode(codes, out)
    full = n // BLOCK
    if full:
        out[: full * BLOCK].view(full, BLOCK).mul_(absmax[:full].unsqueeze(1))
    if n > full * BLOCK:
        out[full * BLOCK :].mul_(absmax[full])


def quantize_(
    src: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, code_map: CodeMap
) -> torch.Tensor | None:
    """Block scales of ``src`` (fp32, flat) into ``absmax`` and its codes into ``codes``.
    ``src`` is scaled in place (it is scratch). Returns None, or, when some elements were
    not finite, where they were: they are stored as 0 (see ``_pack_int8`` in
    coordinator/training/optimizer.py). An infinite element made its block's scale inf,
    a NaN one (a NaN gradient) made it NaN, and either turned all 256 of the block's
    moments, then weights, into NaN, where fp32 states lose only that one weight.
    Checked on the scales, so the common case costs nothing."""
    n = src.numel()
    full = n // BLOCK
    overflowed = None
    if full:
        blocks = src[: full * BLOCK].view(full, BLOCK)
        torch.amax(blocks.abs(), dim=1, out=absmax[:full])
        if not torch.isfinite(absmax[:full]).all():
            overflowed = _zero_nonfinite(src)
            torch.amax(blocks.abs(), dim=1, out=absmax[:full])
        scale = torch.where(absmax[:full] > 0, absmax[:full], 1.0)
        blocks.div_(scale.unsqueeze(1))
    if n > full * BLOCK:
        tail = src[full * BLOCK :]
        absmax[full] = tail.abs().max()
        if not torch.isfinite(absmax[full]):
            overflowed = _zero_nonfinite(src) if overflowed is None else overflowed
            absmax[full] = tail.abs().max()
        tail.div_(absmax[full] if absmax[full] > 0 else 1.0)
    code_map.encode(src, codes)
    return overflowed


def _zero_nonfinite(values: torch.Tensor) -> torch.Tensor:
    nonfinite = ~torch.isfinite(values)
    values.masked_fill_(nonfinite, 0.0)
    return nonfinite


def square_to_root_(codes: torch.Tensor, absmax: torch.Tensor, code_map: CodeMap) -> None:
    """In place: codes and scales of values ``v`` (unsigned) become those of ``sqrt(v)``,
    a block-aligned piece at a time (a second moment stored before Note [8-bit second
    moment] in roundpipe.coordinator.training.optimizer)."""
    piece = BLOCK * 4096
    scratch = torch.empty(min(piece, codes.numel()), dtype=torch.float32)
    for start in range(0, codes.numel(), piece):
        c = codes[start : start + piece]
        a = absmax[start // BLOCK : start // BLOCK + absmax_numel(c.numel())]
        values = scratch[: c.numel()]
        dequantize_(c, a, code_map, values)
        quantize_(values.sqrt_(), c, a, code_map)
