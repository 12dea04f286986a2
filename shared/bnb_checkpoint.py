"""A bitsandbytes-quantised Hugging Face checkpoint as a LoRA job's quantised base.

A checkpoint saved after loading with ``BitsAndBytesConfig(load_in_4bit=True, ...)`` or
``load_in_8bit=True`` holds its linear weights as bitsandbytes' codes. A LoRA job on it
keeps them as they are: its base is stored and uploaded quantised exactly as with
``lora.base_quantization`` (Note [quantised base] in roundpipe.shared.quantized_base), in
``QuantFormat(..., layout="bitsandbytes")`` (roundpipe.shared.quant_format). The parts are
parsed here from the safetensors tensors; bitsandbytes itself is not needed.

Note [bitsandbytes checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What bitsandbytes 0.50 writes (observed in checkpoints transformers 5 saves; n is the
weight's element count, ``<w>`` its key, ``<m>`` its module's):

4-bit (``load_in_4bit``, ``bnb_4bit_quant_type: nf4``):

- ``<w>``: uint8 ``[ceil(n / 2), 1]`` (another ``bnb_4bit_quant_storage`` dtype holds the
  same bytes). The weight flattened in row-major order, two 4-bit indices per byte: the
  element of even flat index in the high nibble (bits 7..4), the odd one in the low.
- ``<w>.quant_map``: fp32 ``[16]``, the value of each index (the NF4 values; equal to
  ``NF4_CODE`` bit for bit, but read from the checkpoint all the same).
- ``<w>.absmax``: one scale per block of ``blocksize`` (64) flat elements. Without
  double quantisation fp32 ``[blocks]``. With it (``bnb_4bit_use_double_quant``) uint8
  ``[blocks]``: indices into ``<w>.nested_quant_map`` (fp32 ``[256]``, a signed dynamic
  map that differs from ``dynamic_code()`` in the last bit of a few values), scaled per
  ``nested_blocksize`` (256) indices by ``<w>.nested_absmax`` (fp32 ``[ceil(blocks /
  256)]``) and shifted by ``nested_offset`` (the mean absmax, subtracted before the
  nested quantisation): ``absmax = nested_quant_map[i] * nested_absmax[i // 256] +
  nested_offset``, in fp32.
- ``<w>.quant_state.bitsandbytes__nf4``: uint8 bytes of a UTF-8 JSON object:
  ``quant_type``, ``blocksize``, ``dtype`` (the weight's before quantisation), ``shape``
  and, with double quantisation, ``nested_blocksize``, ``nested_dtype`` and
  ``nested_offset`` (the fp32 offset as a decimal: it reads back exactly).
- The weight is ``quant_map[index] * absmax[block]`` in fp32, then cast to ``dtype``.
  Blocks cut the flattened weight, so a row may end inside one. (bitsandbytes 0.50's
  CPU dequantisation kernel cuts them per row when a row's length is not a multiple of
  64, unlike its quantiser and its reference torch path; we follow the latter.)

8-bit (``load_in_8bit``): ``<w>`` int8 of the weight's shape, ``<m>.SCB`` fp32 ``[rows]``
(each row's absmax: one per output channel) and ``<m>.weight_format`` (uint8 scalar, 0:
plain row-major). The weight is ``(code * SCB[row]) * fp32(1/127)``, in that order.

Everything else (embedding, LM head, norms, biases) is stored unquantised. These map onto
QuantFormat's parts one to one: ``codes``, ``absmax`` or ``absmax_codes`` /
``absmax_scale`` / ``absmax_offset`` and the two tables as ``code`` / ``absmax_code``;
int8 ``codes`` and ``absmax``. A block size other than 64 / 256, fp4 and an 8-bit weight
kept in 16 bits (``llm_int8_has_fp16_weight``) are refused: they have no parts here.
A weight the job quantises (QuantizedBase.of) must be quantised in the checkpoint; a
quantised weight the job keeps in the compute dtype (an MoE router) is dequantised at load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from roundpipe.shared.quant_format import NESTED_BLOCK, NF4_BLOCK, QuantFormat

__all__ = ["bnb_format", "is_bnb", "read_parts"]

Getter = Callable[[str], "torch.Tensor | None"]
"""The checkpoint's tensor of a key (None if absent)."""

_STATE = ".quant_state.bitsandbytes__"


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def is_bnb(quant_config: Any) -> bool:
    """Whether a ``quantization_config`` says bitsandbytes quantised the checkpoint."""
    if quant_config is None:
        return False
    method = _get(quant_config, "quant_method")
    return str(getattr(method, "value", method)).lower() == "bitsandbytes"


def bnb_format(quant_config: Any) -> QuantFormat:
    """The QuantFormat of a bitsandbytes checkpoint's ``quantization_config``; ValueError
    for what has no parts here (Note [bitsandbytes checkpoint])."""
    if _get(quant_config, "load_in_4bit"):
        kind = str(_get(quant_config, "bnb_4bit_quant_type") or "fp4")
        if kind != "nf4":
            raise ValueError(
                f"this checkpoint is quantised by bitsandbytes as {kind}; only nf4 (and "
                "8-bit) checkpoints can be a LoRA job's quantised base"
            )
        return QuantFormat(
            "nf4",
            double_quant=bool(_get(quant_config, "bnb_4bit_use_double_quant")),
            layout="bitsandbytes",
        )
    if _get(quant_config, "load_in_8bit"):
        if _get(quant_config, "llm_int8_has_fp16_weight"):
            raise ValueError(
                "this checkpoint keeps its 8-bit weights in 16 bits "
                "(llm_int8_has_fp16_weight); only int8-coded checkpoints are supported"
            )
        return QuantFormat("int8", layout="bitsandbytes")
    raise ValueError("this bitsandbytes quantization_config has neither load_in_4bit nor 8bit")


def is_quantised(get: Getter, key: str) -> bool:
    """Whether weight ``key`` is stored as bitsandbytes codes."""
    module = key.rsplit(".", 1)[0]
    return get(f"{key}{_STATE}nf4") is not None or get(f"{module}.SCB") is not None


def read_parts(
    get: Getter, key: str, fmt: QuantFormat, shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """Weight ``key``'s parts in ``fmt`` (``layout: bitsandbytes``); ValueError if it is
    not stored as ``fmt`` says (Note [bitsandbytes checkpoint])."""
    where = f"bitsandbytes checkpoint: {key}"
    if fmt.kind == "int8":
        return _read_int8(get, key, shape, where)
    raw = get(f"{key}{_STATE}nf4")
    if raw is None:
        if get(f"{key}{_STATE}fp4") is not None:
            raise ValueError(f"{where} is fp4-quantised; only nf4 is supported")
        raise ValueError(
            f"{where} is not nf4-quantised, but the job's quantised base needs it to be "
            "(a module bitsandbytes skipped, llm_int8_skip_modules?)"
        )
    state = json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8"))
    if tuple(state.get("shape", ())) != tuple(shape):
        raise ValueError(f"{where} has shape {state.get('shape')}, the config implies {shape}")
    if state.get("blocksize") != NF4_BLOCK:
        raise ValueError(f"{where}: blocksize {state.get('blocksize')}; only {NF4_BLOCK}")
    expected = fmt.parts(shape)
    n_bytes = expected["codes"][1][0]
    codes = get(key).contiguous().view(torch.uint8).reshape(-1)  # type: ignore[union-attr]
    if codes.numel() != math.ceil(math.prod(shape) / 2):
        raise ValueError(f"{where} has {codes.numel()} code bytes for shape {shape}")
    if codes.numel() < n_bytes:  # zero codes pad the last block, as quantize() writes
        codes = torch.cat([codes, codes.new_zeros(n_bytes - codes.numel())])
    parts = {"codes": codes, "code": _tensor(get, f"{key}.quant_map", where)}
    absmax = _tensor(get, f"{key}.absmax", where)
    nested = "nested_offset" in state
    if nested != fmt.double_quant:
        raise ValueError(
            f"{where}: double quantisation is {'on' if nested else 'off'} for this weight, "
            "unlike the checkpoint's quantization_config"
        )
    if not nested:
        parts["absmax"] = absmax.to(torch.float32)
    else:
        if state.get("nested_blocksize") != NESTED_BLOCK:
            raise ValueError(
                f"{where}: nested_blocksize {state.get('nested_blocksize')}; only {NESTED_BLOCK}"
            )
        parts["absmax_codes"] = absmax.view(torch.uint8)
        parts["absmax_code"] = _tensor(get, f"{key}.nested_quant_map", where)
        parts["absmax_scale"] = _tensor(get, f"{key}.nested_absmax", where)
        offset = torch.tensor([float(state["nested_offset"])], dtype=torch.float32)
        parts["absmax_offset"] = offset
    _check_parts(parts, expected, where)
    return parts


def _read_int8(get: Getter, key: str, shape: tuple[int, ...], where: str):
    module = key.rsplit(".", 1)[0]
    codes, scb = get(key), get(f"{module}.SCB")
    if codes is None or scb is None or codes.dtype != torch.int8:
        raise ValueError(
            f"{where} is not int8-quantised (no int8 weight and {module}.SCB), but the "
            "job's quantised base needs it to be (a module bitsandbytes skipped?)"
        )
    fmt = get(f"{module}.weight_format")
    if fmt is not None and int(fmt.reshape(-1)[0]) != 0:
        raise ValueError(f"{where}: weight_format {int(fmt.reshape(-1)[0])}; only 0 (row-major)")
    if tuple(codes.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(codes.shape)}, the config implies {shape}")
    parts = {"codes": codes, "absmax": scb.to(torch.float32)}
    _check_parts(parts, QuantFormat("int8", layout="bitsandbytes").parts(shape), where)
    return parts


def _tensor(get: Getter, key: str, where: str) -> torch.Tensor:
    t = get(key)
    if t is None:
        raise ValueError(f"{where}: the checkpoint lacks {key}")
    return t.reshape(-1) if t.dim() != 1 else t


def _check_parts(parts: Mapping[str, torch.Tensor], expected, where: str) -> None:
    for name, (dtype, shape) in expected.items():
        t = parts[name]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{where}: part {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}"
            )
