"""The AdamW + bf16 kernel's arithmetic, compiled by numba (Note [compiled AdamW kernel]
in roundpipe.coordinator.training.adamw_kernel, which loads, checks and runs it).

Importing this module needs numba; nothing is compiled until :func:`compiled`.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["compiled", "quotient_array"]

_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_INF = np.float32(np.inf)


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` in float32 rounded once (``llvm.fma.f32``): where torch's compiled
    kernel has a fused multiply-add, and nowhere else (no fast-math flags anywhere)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32"
        )
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, x):
    """A float32's bits as a uint32 (a register bitcast, no memory round trip)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@numba.njit(inline="always")
def _quotient(a, b, inv_b):
    """``a / b`` correctly rounded, for ``a = sqrt(v)`` and a step's constant ``b > 0``,
    without a division (Note [division by a constant]): ``inv_b`` is ``1 / b`` rounded,
    ``q`` a first quotient, then two corrections by the exact remainder ``a - q * b``."""
    q = a * inv_b
    q1 = _fma(_fma(-q, b, a), inv_b, q)
    q2 = _fma(_fma(-q1, b, a), inv_b, q1)
    # 0, inf and NaN: a * inv_b is already a / b (the remainders would be NaN for inf).
    return q2 if (a > _ZERO) & (a < _INF) else q


@numba.njit(error_model="numpy")
def quotient_array(a, b, inv_b):
    """:func:`_quotient` over an array (tests check it against ``a / b``)."""
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _quotient(a[i], b, inv_b)
    return out


@numba.njit(inline="always")
def _body(p, g, m, v, decay, coeff, base_is_grad, beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step):
    """torch's vector body for one element (the Note lists the FMAs)."""
    p = p * decay  # 1 without weight decay (see AdamWConstants.decay)
    base = g if base_is_grad else m
    m = _fma(coeff, g - m, base)  # torch's lerp(m, g, w)
    v = _fma(c2 * g, g, v * beta2)
    denom = _quotient(np.sqrt(v), bc2_sqrt, inv_bc2) + eps
    p = p + (neg_step * m) / denom
    return p, m, v


@numba.njit(inline="always")
def _scalar_tail(p, g, m, v, decay, w, base_is_grad, beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step):
    """torch's scalar loop for one element: the same but for the FMAs of ``m`` (large
    lerp weight) and ``v``."""
    p = p * decay
    if base_is_grad:
        m = _fma(-(g - m), _ONE - w, g)
    else:
        m = _fma(w, g - m, m)
    v = _fma(v, beta2, (c2 * g) * g)
    denom = _quotient(np.sqrt(v), bc2_sqrt, inv_bc2) + eps
    p = p + (neg_step * m) / denom
    return p, m, v


@numba.njit(inline="always")
def _bf16_bits(x):
    """torch's float32 -> bfloat16 cast: round to nearest even, NaN -> 0xFFFF."""
    if x != x:
        return np.uint16(0xFFFF)
    bits = _f32_bits(x)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + rounding) >> np.uint32(16))


@numba.njit(inline="always")
def _loop(param, grad, exp_avg, exp_avg_sq, out, vector, write_out, scale, grad_scale, c):
    """One of torch's two loops over equal-length flat slices. Indices run from 0 (numba
    then drops its negative-index handling, which would stop LLVM from vectorizing)."""
    decay, w, beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step = c
    base_is_grad = not (abs(w) < np.float32(0.5))
    coeff = w - _ONE if base_is_grad else w
    for i in range(param.size):
        g = grad[i]
        if scale:
            g = g * grad_scale
            grad[i] = g
        if vector:
            p, m, v = _body(
                param[i], g, exp_avg[i], exp_avg_sq[i], decay, coeff, base_is_grad,
                beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step,
            )  # fmt: skip
        else:
            p, m, v = _scalar_tail(
                param[i], g, exp_avg[i], exp_avg_sq[i], decay, w, base_is_grad,
                beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step,
            )  # fmt: skip
        param[i] = p
        exp_avg[i] = m
        exp_avg_sq[i] = v
        if write_out:
            out[i] = _bf16_bits(p)


def _make_common_loop(store_grad):
    """The vector loop of the usual case, with no loop-invariant test left inside (they
    cost ~15% of the loop's time): a bf16 ``out`` is written, the lerp weight is below 0.5
    (beta1 > 0.5), and the gradient is always multiplied by ``grad_scale`` (1 without
    clipping; ``g * 1`` is ``g``), stored back only when ``store_grad`` (clipping)."""

    @numba.njit(inline="always")
    def loop(param, grad, exp_avg, exp_avg_sq, out, grad_scale, c):
        decay, w, beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step = c
        for i in range(param.size):
            g = grad[i] * grad_scale
            if store_grad:  # a constant of this variant: no test in the loop
                grad[i] = g
            p, m, v = _body(
                param[i], g, exp_avg[i], exp_avg_sq[i], decay, w, False,
                beta2, c2, bc2_sqrt, inv_bc2, eps, neg_step,
            )  # fmt: skip
            param[i] = p
            exp_avg[i] = m
            exp_avg_sq[i] = v
            out[i] = _bf16_bits(p)

    return loop


_common_loop = _make_common_loop(store_grad=False)
_common_loop_clipped = _make_common_loop(store_grad=True)


def _step_range(param, grad, exp_avg, exp_avg_sq, out, lo, hi, numel, grad_scale, scale, c):
    """AdamW over elements [lo, hi) of one flat tensor of ``numel`` elements, writing
    the result's bf16 bits into ``out`` (skipped when ``out`` is empty). With ``scale``
    the gradient is first multiplied by ``grad_scale`` and stored back (clipping)."""
    # Where torch's vector arithmetic ends: every whole 16-element unit, and the first 8
    # of a tail of 8 or more (its compiler's 8-wide loop).
    vector_end = numel - numel % 16
    if numel - vector_end >= 8:
        vector_end += 8
    split = min(max(lo, vector_end), hi)
    write_out = out.size > 0
    o = out[lo:split] if write_out else out
    if write_out and abs(c[1]) < np.float32(0.5):
        p, g, m, v = param[lo:split], grad[lo:split], exp_avg[lo:split], exp_avg_sq[lo:split]
        if scale:
            _common_loop_clipped(p, g, m, v, o, grad_scale, c)
        else:
            _common_loop(p, g, m, v, o, grad_scale, c)
    else:
        _loop(
            param[lo:split], grad[lo:split], exp_avg[lo:split], exp_avg_sq[lo:split], o,
            True, write_out, scale, grad_scale, c,
        )  # fmt: skip
    o = out[split:hi] if write_out else out
    _loop(
        param[split:hi], grad[split:hi], exp_avg[split:hi], exp_avg_sq[split:hi], o,
        False, write_out, scale, grad_scale, c,
    )  # fmt: skip


_F32 = types.Array(types.float32, 1, "C")
_SIGNATURE = types.void(
    _F32, _F32, _F32, _F32, types.Array(types.uint16, 1, "C"),
    types.int64, types.int64, types.int64, types.float32, types.boolean,
    types.UniTuple(types.float32, 8),
)  # fmt: skip


def compiled() -> Callable[..., None]:
    """The compiled kernel: machine code for this host, from numba's on-disk cache when
    an earlier process compiled it (``cache=True``), else compiled now (a few seconds).
    ``nogil``: threads run it side by side. No fast-math: IEEE sqrt and division."""
    # error_model="numpy": IEEE division (x / 0 is inf), without the Python-style check
    # for a zero divisor that would also keep LLVM from vectorizing the loop.
    options = {"nogil": True, "error_model": "numpy"}
    try:
        return numba.njit(_SIGNATURE, cache=True, **options)(_step_range)
    except RuntimeError:
        # No writable cache directory (numba's "cannot cache" error): compile every time.
        return numba.njit(_SIGNATURE, cache=False, **options)(_step_range)
