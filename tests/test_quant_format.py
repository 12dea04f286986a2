"""The NF4 / int8 storage format of frozen weights (roundpipe.shared.quant_format).

The reference dequantisation here is written from the formats' definitions (the QLoRA
paper's NF4 values, two codes per byte high nibble first, absmax per 64 elements, the
double quantisation of the absmaxes; int8 absmax rows or blocks), element by element in
numpy float32, independently of the module's vectorised torch code: the two must agree
bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roundpipe.shared import quant_format
from roundpipe.shared.quant_format import QuantFormat

# The NF4 values as printed in the QLoRA paper (Appendix E).
PAPER_NF4 = np.array(
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
    dtype=np.float32,
)


def reference_dynamic_map() -> np.ndarray:
    """The signed 8-bit dynamic map from its definition: a sign, e zero bits, a one bit,
    then 6 - e linear fraction bits over [0.1, 1] x 10^-e (value = the middle of its
    interval); plus 0 and 1."""
    out = {0.0, 1.0}
    for zeros in range(7):
        frac_bits = 6 - zeros
        n = 2**frac_bits
        width = 0.9 / n
        for k in range(n):
            magnitude = (0.1 + width * (k + 0.5)) * 10.0**-zeros
            out.add(float(np.float32(magnitude)))
            out.add(float(np.float32(-magnitude)))
    values = np.array(sorted(out), dtype=np.float32)
    assert values.size == 256
    return values


def reference_nf4(parts: dict, shape: tuple[int, ...], double_quant: bool) -> np.ndarray:
    n = int(np.prod(shape))
    codes = parts["codes"].numpy()
    if double_quant:
        dyn = reference_dynamic_map()
        qa = parts["absmax_codes"].numpy()
        scale = parts["absmax_scale"].numpy()
        offset = np.float32(parts["absmax_offset"].numpy()[0])
        absmax = np.empty(qa.size, dtype=np.float32)
        for i in range(qa.size):
            absmax[i] = np.float32(dyn[qa[i]] * scale[i // 256]) + offset
    else:
        absmax = parts["absmax"].numpy()
    out = np.empty(n, dtype=np.float32)
    for i in range(n):
        byte = int(codes[i // 2])
        index = byte >> 4 if i % 2 == 0 else byte & 0xF
        out[i] = PAPER_NF4[index] * absmax[i // 64]
    return out.reshape(shape)


def reference_int8(parts: dict, shape: tuple[int, ...], scales: str) -> np.ndarray:
    n = int(np.prod(shape))
    codes = parts["codes"].numpy().reshape(-1)
    absmax = parts["absmax"].numpy()
    row = shape[-1] if scales == "per_channel" else 64
    out = np.empty(n, dtype=np.float32)
    for i in range(n):
        out[i] = np.float32(codes[i]) * np.float32(absmax[i // row] / np.float32(127.0))
    return out.reshape(shape)


SHAPES = [(48, 40), (3, 24, 16), (7, 9)]  # 1920 (30 blocks), MoE-like 3-D, a ragged tail


@pytest.fixture(params=["whole", "passes"])
def passes(request, monkeypatch):
    """Each tensor in one pass, or (``passes``) in passes of 128 elements: two NF4
    blocks, a few int8 rows, a ragged last pass (``CHUNK_ELEMENTS``)."""
    if request.param == "passes":
        monkeypatch.setattr(quant_format, "CHUNK_ELEMENTS", 128)
    return request.param


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_dequantisation_is_the_definition_bitwise(shape, double_quant, passes):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    fmt = QuantFormat("nf4", double_quant=double_quant)
    parts = fmt.quantize(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == fmt.parts(shape)
    got = fmt.dequantize(parts, shape, torch.float32).numpy()
    want = reference_nf4(parts, shape, double_quant)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # The compute dtype is the fp32 value cast once.
    bf16 = fmt.dequantize(parts, shape, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(want).to(torch.bfloat16))


def test_nf4_parts_do_not_depend_on_the_thread_count() -> None:
    """torch's CPU mean of the absmaxes (the double quantisation's offset) changed in
    its last bit with the thread count from 262,144 blocks up (a 4096 x 4096 matrix):
    a coordinator resumed with other --threads, or another node of a group, quantised
    another base (hundreds of weights off), and resume was no longer bitwise."""
    torch.manual_seed(0)
    w = torch.randn(4096, 4096) * 0.02
    fmt = QuantFormat("nf4", double_quant=True)
    threads = torch.get_num_threads()
    try:
        parts = []
        for n in (1, 3):
            torch.set_num_threads(n)
            parts.append(fmt.quantize(w))
    finally:
        torch.set_num_threads(threads)
    assert parts[0].keys() == parts[1].keys()
    for name in parts[0]:
        assert torch.equal(parts[0][name], parts[1][name]), name


@pytest.mark.parametrize("scales", ["per_channel", "per_block"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_dequantisation_is_the_definition_bitwise(shape, scales, passes):
    torch.manual_seed(1)
    w = torch.randn(shape)
    fmt = QuantFormat("int8", int8_scales=scales)
    parts = fmt.quantize(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == fmt.parts(shape)
    got = fmt.dequantize(parts, shape, torch.float32).numpy()
    want = reference_int8(parts, shape, scales)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dequantisation_holds_one_pass_of_temporaries_beside_its_result():
    """A 64M-element NF4 tensor dequantised to bf16 (128 MiB) on the CPU: the process's
    peak grows by the result and one pass's fp32 values and indices, not by the ~16 bytes
    per element a whole-tensor pass would hold (over 1 GiB here)."""
    code = """
import resource, sys, torch
from roundpipe.shared.quant_format import CHUNK_ELEMENTS, NF4_BLOCK, QuantFormat
n = 64 << 20
fmt = QuantFormat("nf4", double_quant=False)
g = torch.Generator().manual_seed(0)
parts = {"codes": torch.randint(0, 256, (n // 2,), dtype=torch.uint8, generator=g),
         "absmax": torch.rand(n // NF4_BLOCK, generator=g)}
small = {"codes": parts["codes"][: 1 << 19], "absmax": parts["absmax"][: 1 << 14]}
fmt.dequantize(small, (1024, 1024), torch.bfloat16)  # the allocator's first use
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = fmt.dequantize(parts, (n // 4096, 4096), torch.bfloat16)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(grew, out.numel() * 2, CHUNK_ELEMENTS)
"""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    grew, result_bytes, chunk = map(int, result.stdout.split())
    assert grew <= result_bytes + 24 * chunk, (grew, result_bytes)  # 128 MiB + <= 96 MiB


def test_nf4_codes_are_the_nearest_values():
    torch.manual_seed(2)
    w = torch.randn(64 * 20)
    fmt = QuantFormat("nf4", double_quant=False)
    parts = fmt.quantize(w)
    absmax = w.view(-1, 64).abs().amax(1)
    scaled = (w.view(-1, 64) / absmax[:, None]).reshape(-1).numpy()
    nearest = np.abs(scaled[:, None] - PAPER_NF4[None, :]).argmin(1)
    codes = parts["codes"].numpy()
    index = np.stack([codes >> 4, codes & 0xF], 1).reshape(-1)
    assert np.array_equal(index, nearest)
    assert torch.equal(parts["absmax"], absmax)
    # Every block's largest magnitude is exact (it is +-1 x absmax).
    back = fmt.dequantize(parts, (64 * 20,), torch.float32)
    assert torch.equal(back.view(-1, 64).abs().amax(1), absmax)


def test_round_trip_errors_and_bytes_per_parameter():
    torch.manual_seed(3)
    shape = (256, 512)
    w = torch.randn(shape) * 0.02
    n = w.numel()
    for fmt, bound, per_param in [
        (QuantFormat("nf4"), 0.12, 0.52),
        (QuantFormat("nf4", double_quant=False), 0.12, 0.57),
        (QuantFormat("int8"), 0.01, 1.01),
        (QuantFormat("int8", int8_scales="per_block"), 0.01, 1.07),
    ]:
        back = fmt.dequantize(fmt.quantize(w), shape, torch.float32)
        rel = float((back - w).norm() / w.norm())
        assert rel < bound, (fmt, rel)
        assert fmt.nbytes(shape) / n <= per_param, fmt
    # Double quantisation: the absmaxes come back to within 8-bit precision.
    fmt = QuantFormat("nf4")
    parts = fmt.quantize(w)
    exact = w.view(-1, 64).abs().amax(1)
    assert float(((fmt.absmax(parts) - exact).abs() / exact).max()) < 0.02


def test_zero_blocks_and_refused_kinds():
    fmt = QuantFormat("nf4")
    z = torch.zeros(3, 64)
    assert torch.equal(fmt.dequantize(fmt.quantize(z), (3, 64), torch.float32), z)
    int8 = QuantFormat("int8")
    assert torch.equal(int8.dequantize(int8.quantize(z), (3, 64), torch.float32), z)
    with pytest.raises(ValueError, match="fp4"):
        QuantFormat("fp4")
    with pytest.raises(ValueError, match="per_tensor"):
        QuantFormat("int8", int8_scales="per_tensor")


def bnb_layout_parts(fmt: QuantFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``layout: bitsandbytes`` parts made from ours: the same codes plus the tables (a
    bitsandbytes checkpoint's are read by roundpipe.shared.bnb_checkpoint)."""
    from roundpipe.shared.quant_format import NF4_CODE, dynamic_code

    parts = QuantFormat(fmt.kind, double_quant=fmt.double_quant).quantize(w)
    if fmt.kind == "nf4":
        parts["code"] = NF4_CODE.clone()
        if fmt.double_quant:
            parts["absmax_code"] = dynamic_code()
    return parts


@pytest.mark.parametrize("kind, dq", [("nf4", True), ("nf4", False), ("int8", False)])
def test_the_bitsandbytes_layout_reads_its_tables_and_order(kind, dq):
    fmt = QuantFormat(kind, double_quant=dq, layout="bitsandbytes")
    torch.manual_seed(0)
    shape = (24, 40)  # rows end inside blocks: the blocks cut the flattened tensor
    w = torch.randn(shape) * 0.02
    parts = bnb_layout_parts(fmt, w)
    assert {k: (t.dtype, tuple(t.shape)) for k, t in parts.items()} == fmt.parts(shape)
    ours = QuantFormat(kind, double_quant=dq)
    got = fmt.dequantize(parts, shape, torch.float32)
    if kind == "nf4":  # the same tables: the same weights
        assert torch.equal(got, ours.dequantize(parts, shape, torch.float32))
        # The tables are the parts', not the module's.
        parts["code"] = parts["code"] * 2
        assert torch.equal(fmt.dequantize(parts, shape, torch.float32), got * 2)
    else:  # (code * absmax) * fp32(1/127), bitsandbytes' order of the operations
        want = parts["codes"].float() * parts["absmax"].unsqueeze(1) * (1 / 127)
        assert torch.equal(got, want)
        assert torch.allclose(got, ours.dequantize(parts, shape, torch.float32), rtol=1e-6)
    with pytest.raises(ValueError, match="read from its checkpoint"):
        fmt.quantize(w)
    with pytest.raises(ValueError, match="per_channel"):
        QuantFormat("int8", int8_scales="per_block", layout="bitsandbytes")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, dq", [("nf4", True), ("nf4", False), ("int8", False)])
def test_cuda_dequantises_the_bitsandbytes_layout_like_the_cpu(kind, dq):
    fmt = QuantFormat(kind, double_quant=dq, layout="bitsandbytes")
    torch.manual_seed(0)
    shape = (8, 96, 128)
    parts = bnb_layout_parts(fmt, torch.randn(shape) * 0.02)
    on_gpu = {k: v.cuda() for k, v in parts.items()}
    for dtype in (torch.float32, torch.bfloat16):
        cpu = fmt.dequantize(parts, shape, dtype)
        assert torch.equal(cpu, fmt.dequantize(on_gpu, shape, dtype).cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, dq", [("nf4", True), ("nf4", False), ("int8", False)])
def test_cuda_dequantisation_peaks_at_its_result_and_one_pass(kind, dq):
    """On a 24 GiB card a Qwen3-30B-A3B expert tensor's dequantisation must not hold
    ~16 bytes per element of temporaries: the allocator's peak is the bf16 result and
    one pass (``CHUNK_ELEMENTS``)."""
    fmt = QuantFormat(kind, double_quant=dq)
    shape = (16, 1024, 4096)  # 64M elements, an expert tensor's kind of shape
    parts = {k: v.cuda() for k, v in fmt.quantize(torch.randn(shape) * 0.02).items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fmt.dequantize(parts, shape, torch.bfloat16)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= out.numel() * 2 + 24 * quant_format.CHUNK_ELEMENTS, peak


@pytest.mark.parametrize("scales", ["per_channel", "per_block"])
def test_int8_codes_of_subnormal_rows_follow_the_definition(scales):
    """code = round(x / absmax * 127): with 127 / absmax first, an absmax below about
    3.7e-37 made the scale inf, every nonzero element ±127 and zero NaN (0 * inf)."""
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([1e-38, 5e-39, 0.0, -2.5e-39])
    w[1, :2] = torch.tensor([1.0, -0.5])
    codes = QuantFormat("int8", int8_scales=scales).quantize(w)["codes"]
    assert codes.reshape(2, 64)[0, :4].tolist() == [127, 64, 0, -32]
    assert codes.reshape(2, 64)[1, :2].tolist() == [127, -64]
    assert not codes.reshape(2, 64)[:, 4:].any()
