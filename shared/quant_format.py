"""NF4 and int8 storage of frozen weights: quantise once, dequantise per layer.

A LoRA job's base weights never change, so they can be kept in fewer bits than the
compute dtype: in the host arenas, on the bus and on the worker until the layer runs.
This module is the format only (pure torch, any device); which weights of a model are
quantised is roundpipe.shared.quantized_base.

Formats (definitions, not code, taken from the literature):

``nf4`` -- 4-bit NormalFloat (Dettmers et al., "QLoRA", 2023). The tensor, flattened in
row-major order and zero-padded to a multiple of ``NF4_BLOCK`` (64), is cut into blocks;
each block is divided by its largest magnitude (``absmax``) and every value replaced by
the index of the nearest of the 16 ``NF4_CODE`` values (quantiles of a normal
distribution, with an exact 0). Two indices share a byte, the first of a pair in the high
nibble. Dequantised: ``NF4_CODE[index] * absmax`` in fp32, then cast to the compute dtype.

``nf4`` with double quantisation (QLoRA's "DQ"): the fp32 absmaxes themselves are stored
in 8 bits. Their mean is subtracted (``absmax_offset``, one fp32); the centred values are
cut into blocks of ``NESTED_BLOCK`` (256), each scaled by its largest magnitude
(``absmax_scale``, fp32) and replaced by the index of the nearest of 256 *dynamic* code
values (``dynamic_code()``). Dequantised: ``code * scale + offset``. Per parameter this
is 0.5 + 1/64 + 4/(64 * 256) bytes (~0.516) instead of 0.5 + 4/64 (0.5625).

``int8`` -- absmax int8 (as LLM.int8's weight storage): each row (``per_channel``: every
index but the last, so one scale per output channel of a linear weight) or each block of
``NF4_BLOCK`` flat elements (``per_block``) is scaled by ``127 / absmax`` and rounded to
an int8 in [-127, 127]. Dequantised: ``code * (absmax / 127)`` in fp32, then cast.

``layout: bitsandbytes`` -- the same two formats as a bitsandbytes checkpoint stores them
(read by roundpipe.shared.bnb_checkpoint, Note [bitsandbytes checkpoint]; never quantised
here). Its nf4 parts are those above plus the code tables the checkpoint carries (``code``,
16 fp32, and with double quantisation ``absmax_code``, 256 fp32: bitsandbytes' dynamic map
differs from ``dynamic_code()`` in the last bit of a few values); its int8 is
``per_channel`` and dequantises as ``(code * absmax) * fp32(1/127)``, bitsandbytes' order
of the operations, so that the weights are bit for bit the ones bitsandbytes computes.

A quantised tensor is a dict of named *parts* (plain tensors), so that the arenas, the
protocol and the transfer engines carry it as they carry any weight: ``parts(shape)``
says their dtypes and shapes, ``quantize`` fills them, ``dequantize`` reads them back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from roundpipe.shared.quant_choices import INT8_SCALES, QUANTIZATIONS

__all__ = [
    "INT8_SCALES",
    "LAYOUTS",
    "NESTED_BLOCK",
    "NF4_BLOCK",
    "NF4_CODE",
    "QUANTIZATIONS",
    "QuantFormat",
    "dynamic_code",
]


LAYOUTS = ("roundpipe", "bitsandbytes")
"""``QuantFormat.layout``'s values: quantised here, or read from a bitsandbytes checkpoint."""
_INV127 = float(torch.tensor(1 / 127, dtype=torch.float32))
"""1/127 rounded to fp32: bitsandbytes multiplies int8 codes by it."""

NF4_BLOCK = 64
"""Elements per NF4 absmax (and per int8 ``per_block`` scale), as QLoRA."""
CHUNK_ELEMENTS = 1 << 22
"""Elements quantised or dequantised per pass. Each pass's fp32 values and indices
take about 16 bytes per element; done over a whole tensor at once, that is 8x the bf16
result (about 7.5 GB for one Qwen3-30B-A3B expert tensor on a 24 GiB GPU). Blocks and
rows are independent, so a pass gives the bits the whole tensor would."""
NESTED_BLOCK = 256
"""Absmaxes per second-level scale with double quantisation, as QLoRA."""

NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
"""The 16 NF4 values of the QLoRA paper (Appendix E), ascending; index 7 is exactly 0."""


def dynamic_code() -> torch.Tensor:
    """The 256 signed *dynamic* 8-bit code values (Dettmers, "8-bit Approximations for
    Parallelism in Deep Learning", 2016; the map QLoRA's double quantisation uses), ascending.

    For each decade 10^-e (e = 6 .. 0), 2^(6 - e) values spread linearly over
    [0.1, 1] x 10^-e (the midpoints of 2^(6 - e) + 1 equally spaced boundaries): more
    steps for larger magnitudes. Those 127 magnitudes with both signs, 0 and 1 make 256.
    """
    values = [0.0, 1.0]
    for i in range(7):  # i = 6 - e: the number of fraction bits of that decade
        steps = 2**i
        scale = 10.0 ** (i - 6)
        bounds = [0.1 + 0.9 * k / steps for k in range(steps + 1)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            v = scale * (lo + hi) / 2
            values += [v, -v]
    out = torch.tensor(sorted(values), dtype=torch.float32)
    assert out.numel() == 256
    return out


_DYNAMIC_CODE = dynamic_code()


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    """Boundaries between neighbouring code values: the nearest code of x is
    ``bucketize(x, midpoints)`` (a tie goes to the lower code)."""
    return (code[1:] + code[:-1]) / 2


# Code tables and their midpoints per device, made once (they are tiny).
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(which: str, device: torch.device) -> torch.Tensor:
    key = (which, device)
    t = _TABLES.get(key)
    if t is None:
        base = {
            "nf4": NF4_CODE,
            "nf4_mid": _midpoints(NF4_CODE),
            "dyn": _DYNAMIC_CODE,
            "dyn_mid": _midpoints(_DYNAMIC_CODE),
            "nf4_pairs": _nf4_pairs(NF4_CODE),
        }[which]
        t = _TABLES[key] = base.to(device)
    return t


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flattened to fp32, zero-padded to whole blocks, as ``[blocks, block]``."""
    flat = x.reshape(-1).to(torch.float32)
    pad = _blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _absmax_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.abs().amax(dim=1)


def _mean_of(values: torch.Tensor) -> torch.Tensor:
    """``values.mean()`` as fp32 ``[1]``, the same whatever the thread count or device:
    torch's mean of 262,144 or more values on the CPU changed in the last bit with
    ``torch.get_num_threads()``, which moved every block's absmax, so a resumed job (or
    another node of a group) quantised another base. A float64 sum on the host (numpy's:
    one thread, one order) rounded once."""
    total = values.detach().to("cpu", torch.float64).numpy().sum()
    return torch.tensor([total / values.numel()], dtype=torch.float32, device=values.device)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero block has absmax 0; dividing by 1 instead keeps its codes at 0.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


@dataclass(frozen=True)
class QuantFormat:
    """How one job stores its frozen base: ``kind`` ``nf4`` or ``int8`` and its options."""

    kind: str
    double_quant: bool = True
    """nf4 only: store the absmaxes in 8 bits (QLoRA's double quantisation)."""
    int8_scales: str = "per_channel"
    """int8 only: one absmax per row (``per_channel``) or per 64 elements (``per_block``)."""
    layout: str = "roundpipe"
    """``bitsandbytes``: the parts come from a bitsandbytes checkpoint (module docstring)."""

    def __post_init__(self) -> None:
        if self.kind not in ("nf4", "int8"):
            raise ValueError(f"unknown base quantisation {self.kind!r}: expected nf4 or int8")
        if self.int8_scales not in INT8_SCALES:
            raise ValueError(
                f"unknown int8 scales {self.int8_scales!r}: expected one of {INT8_SCALES}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown quantised layout {self.layout!r}: expected one of {LAYOUTS}")
        if self.bnb and self.kind == "int8" and self.int8_scales != "per_channel":
            raise ValueError("bitsandbytes stores int8 weights with per_channel scales only")

    @property
    def bnb(self) -> bool:
        """Parts read from a bitsandbytes checkpoint (``layout: bitsandbytes``)."""
        return self.layout == "bitsandbytes"

    # -- layout ------------------------------------------------------------------------

    def parts(self, shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The parts a tensor of ``shape`` is stored as: name -> (dtype, shape)."""
        n = math.prod(shape)
        nb = _blocks(n, NF4_BLOCK)
        if self.kind == "nf4":
            out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
                "codes": (torch.uint8, (nb * NF4_BLOCK // 2,))
            }
            if self.double_quant:
                out["absmax_codes"] = (torch.uint8, (nb,))
                out["absmax_scale"] = (torch.float32, (_blocks(nb, NESTED_BLOCK),))
                out["absmax_offset"] = (torch.float32, (1,))
            else:
                out["absmax"] = (torch.float32, (nb,))
            if self.bnb:
                out["code"] = (torch.float32, (NF4_CODE.numel(),))
                if self.double_quant:
                    out["absmax_code"] = (torch.float32, (_DYNAMIC_CODE.numel(),))
            return out
        if self.int8_scales == "per_channel":
            rows = n // shape[-1] if shape else 1
            return {"codes": (torch.int8, tuple(shape)), "absmax": (torch.float32, (rows,))}
        return {"codes": (torch.int8, (nb * NF4_BLOCK,)), "absmax": (torch.float32, (nb,))}

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of ``shape`` takes stored (every part, padding included)."""
        return sum(
            math.prod(s) * torch.empty((), dtype=d).element_size()
            for d, s in self.parts(shape).values()
        )

    # -- quantise ----------------------------------------------------------------------

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of ``w`` (any float dtype; computed in fp32 on ``w``'s device)."""
        if self.bnb:
            raise ValueError(
                "a bitsandbytes-layout base is read from its checkpoint, not quantised"
            )
        if self.kind == "nf4":
            return self._quantize_nf4(w)
        return self._quantize_int8(w)

    def _quantize_nf4(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = w.reshape(-1)
        nb = _blocks(flat.numel(), NF4_BLOCK)
        codes = torch.empty(nb * NF4_BLOCK // 2, dtype=torch.uint8, device=w.device)
        absmax = torch.empty(nb, dtype=torch.float32, device=w.device)
        per_pass = CHUNK_ELEMENTS // NF4_BLOCK
        for b0 in range(0, nb, per_pass):
            b1 = min(b0 + per_pass, nb)
            blocks = _padded_blocks(flat[b0 * NF4_BLOCK : b1 * NF4_BLOCK], NF4_BLOCK)
            absmax[b0:b1] = _absmax_rows(blocks)
            scaled = blocks / _safe(absmax[b0:b1]).unsqueeze(1)
            idx = torch.bucketize(scaled, _table("nf4_mid", w.device)).to(torch.uint8).view(-1)
            # Two indices per byte, the first of a pair in the high nibble.
            codes[b0 * NF4_BLOCK // 2 : b1 * NF4_BLOCK // 2] = (idx[0::2] << 4) | idx[1::2]
        out = {"codes": codes}
        if not self.double_quant:
            out["absmax"] = absmax
            return out
        offset = _mean_of(absmax)
        nested = _padded_blocks(absmax - offset, NESTED_BLOCK)
        scale = _absmax_rows(nested)
        near = torch.bucketize(nested / _safe(scale).unsqueeze(1), _table("dyn_mid", w.device))
        out["absmax_codes"] = near.to(torch.uint8).view(-1)[: absmax.numel()]
        out["absmax_scale"] = scale
        out["absmax_offset"] = offset
        return out

    def _quantize_int8(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.int8_scales == "per_channel":
            width = w.shape[-1]
            source = w.reshape(-1, width)
            codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        else:
            width = NF4_BLOCK
            source = w.reshape(-1)
            codes = torch.empty(
                _blocks(source.numel(), width) * width, dtype=torch.int8, device=w.device
            )
        num_rows = codes.numel() // max(width, 1) if codes.numel() else 0
        absmax = torch.empty(num_rows, dtype=torch.float32, device=w.device)
        code_rows = codes.view(num_rows, width)
        per_pass = max(1, CHUNK_ELEMENTS // max(width, 1))
        for r0 in range(0, num_rows, per_pass):
            r1 = min(r0 + per_pass, num_rows)
            if self.int8_scales == "per_channel":
                rows = source[r0:r1].to(torch.float32)
            else:
                rows = _padded_blocks(source[r0 * width : r1 * width], width)
            absmax[r0:r1] = _absmax_rows(rows)
            # x / absmax * 127, as the format defines it: 127 / absmax overflows to inf
            # for an absmax below about 3.7e-37 (and 0 * inf is NaN).
            unit = rows / _safe(absmax[r0:r1]).unsqueeze(1)
            code_rows[r0:r1] = torch.round(unit * 127.0).clamp_(-127, 127).to(torch.int8)
        return {"codes": codes, "absmax": absmax}

    # -- dequantise --------------------------------------------------------------------

    def absmax(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The NF4 block absmaxes (fp32): stored, or decoded from double quantisation."""
        if not self.double_quant:
            return parts["absmax"]
        codes = parts["absmax_codes"]
        table = parts["absmax_code"] if self.bnb else _table("dyn", codes.device)
        values = table[codes.long()]
        scale = parts["absmax_scale"].repeat_interleave(NESTED_BLOCK)[: codes.numel()]
        return values * scale + parts["absmax_offset"]

    def dequantize(
        self, parts: Mapping[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor of ``shape`` in ``dtype``, on the parts' device (a new tensor),
        made ``CHUNK_ELEMENTS`` at a time: beside the result, only one pass's fp32 values
        and indices exist (module docstring of the formats; ``CHUNK_ELEMENTS``)."""
        n = math.prod(shape)
        codes = parts["codes"]
        out = torch.empty(n, dtype=dtype, device=codes.device)
        if self.kind == "nf4":
            self._dequantize_nf4(parts, out)
        else:
            self._dequantize_int8(parts, out)
        return out.view(shape)

    def _dequantize_nf4(self, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        codes, n = parts["codes"], out.numel()
        # The two fp32 values of each byte (high nibble first), looked up with the byte
        # itself as an int32 index: no int64 index per element, no stacked nibbles.
        pairs = _nf4_pairs(parts["code"]) if self.bnb else _table("nf4_pairs", codes.device)
        absmax = self.absmax(parts)
        per_pass, nb = CHUNK_ELEMENTS // NF4_BLOCK, _blocks(n, NF4_BLOCK)
        for b0 in range(0, nb, per_pass):
            b1 = min(b0 + per_pass, nb)
            byte_idx = codes[b0 * NF4_BLOCK // 2 : b1 * NF4_BLOCK // 2].to(torch.int32)
            values = pairs.index_select(0, byte_idx).view(-1, NF4_BLOCK)
            values.mul_(absmax[b0:b1].unsqueeze(1))
            e0, e1 = b0 * NF4_BLOCK, min(b1 * NF4_BLOCK, n)
            out[e0:e1] = values.view(-1)[: e1 - e0]

    def _dequantize_int8(self, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        codes, absmax, n = parts["codes"], parts["absmax"], out.numel()
        if self.bnb or self.int8_scales == "per_channel":
            code_rows = codes.reshape(-1, codes.shape[-1])
        else:
            code_rows = codes.view(-1, NF4_BLOCK)
        width = code_rows.shape[1]
        if not self.bnb:
            # absmax / 127 divided by a tensor on its own device: CUDA divides by a Python
            # number as a multiplication by its reciprocal (one ulp off the CPU's true
            # division), and a GPU worker's weights must equal a CPU worker's bit for bit.
            scale = (absmax / absmax.new_tensor(127.0)).unsqueeze(1)
        per_pass, num_rows = max(1, CHUNK_ELEMENTS // max(width, 1)), _blocks(n, max(width, 1))
        for r0 in range(0, num_rows, per_pass):
            r1 = min(r0 + per_pass, num_rows)
            if self.bnb:  # bitsandbytes' order of the operations
                w = code_rows[r0:r1] * absmax[r0:r1].unsqueeze(1) * _INV127
            else:
                w = code_rows[r0:r1].to(torch.float32) * scale[r0:r1]
            e0, e1 = r0 * width, min(r1 * width, n)
            out[e0:e1] = w.view(-1)[: e1 - e0]


def _nf4_pairs(code: torch.Tensor) -> torch.Tensor:
    """``[256, 2]``: row ``b`` holds ``code[b >> 4]`` and ``code[b & 15]``."""
    return torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)
