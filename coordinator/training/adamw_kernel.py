"""A compiled one-pass AdamW step with the bf16 cast: torch's fused CPU AdamW, bit for bit.

This module loads the kernel (roundpipe.coordinator.training.adamw_numba holds its
arithmetic), checks it against torch, computes each step's constants, and runs it on a
team of threads.

Note [compiled AdamW kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What it does. One pass over a range of one tensor: read the fp32 master, gradient and
two moments, write the master and the moments, and write the updated weight rounded to
bf16 (the copy the workers read) while it is still in a register: 16 bytes read and 14
written per parameter, where torch's kernel followed by ``out.copy_(p)`` is two passes
(28 bytes, then 4 read and 2 written; the bf16 stores of either also read their lines
for ownership). The chunked torch path (Note [chunked fused AdamW]) re-reads each chunk's
masters from cache instead of memory, but still runs the cast as a second loop.

Why bit for bit. The docs promise the masters equal ``torch.optim.AdamW(fused=True)``
exactly (tests/test_optimizer.py, tests/test_adamw_kernel.py). So the arithmetic is
torch's CPU fused AdamW kernel (ATen FusedAdamKernel, ADAMW mode, float32), operation by
operation, with the constants rounded to float32 exactly as torch rounds them, and with
fused multiply-adds exactly where torch's compiled kernel has them. Which multiply-adds
the C++ compiler contracted into FMAs is not in torch's source; we found it by comparing
against ``torch._fused_adamw_`` bit for bit on random data (torch 2.13, x86-64 AVX-512):

* the vector body (16-float vectors, every full 16-element unit of a tensor):
  ``m = fma(coeff, g - m, base)`` (torch's lerp: ``coeff = w, base = m`` when
  ``w = 1 - beta1`` is below 0.5, else ``coeff = w - 1, base = g``);
  ``v = fma(c2 * g, g, v * beta2)`` with ``c2 = 1 - beta2``;
  ``denom = sqrt(v) / sqrt(bias_correction2) + eps`` (IEEE sqrt and division);
  ``p = p * (1 - lr * wd)`` (rounded; only when wd != 0), then
  ``p = p + (-step_size * m) / denom``.
* a tensor's last ``numel % 16`` elements go through torch's scalar loop, which its
  compiler vectorized 8 wide: the first 8 of them (when there are 8 or more) get the
  vector body's arithmetic; the rest get ``v = fma(v, beta2, (c2 * g) * g)``, and for
  a large lerp weight ``m = fma(-(g - m), 1 - w, g)``; the rest is the same.
  Where a tensor is split between threads does not matter: torch splits at 16-element
  boundaries, so only a tensor's end has the scalar loop's arithmetic.

Those contractions belong to one build of torch, so ``self_check`` runs this kernel and
``torch._fused_adamw_`` side by side on a small problem (the optimizer's own betas, eps
and weight decay, every tail length, clipping, three steps) when an optimizer is built,
and the optimizer uses the kernel only if every bit agrees; otherwise it logs one line
and keeps torch's kernel (as it does when numba is missing).

The bf16 cast is torch's ``copy_`` to bfloat16: round to nearest even on the float32
bits, and every NaN becomes 0xFFFF (what torch's vectorized cast writes).

NaNs. Every value that is not a NaN is bitwise torch's, and a result is NaN exactly where
torch's is; the bf16 copy of a NaN is 0xFFFF in both. Which NaN an operation returns
when both operands are NaNs (a NaN master whose update is also NaN: the sign bit may
differ) depends on the operand order the compiler picks for commutative instructions,
which neither torch's build nor LLVM promises; tests/test_adamw_kernel.py checks the rest.

Note [division by a constant]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch divides twice per element (``sqrt(v) / sqrt(bc2)`` and the update's ``/ denom``)
besides the square root; the three share one divider unit, which with two threads and
AVX-512 made the kernel compute bound before it was memory bound. The first divisor is
the same for a whole step, so the kernel computes that quotient without a division:
``y = 1 / b`` rounded once per step, ``q = a * y``, then twice ``q += (a - q * b) * y``
with the remainder ``a - q * b`` exact in one FMA. The result is the correctly rounded
``a / b`` (Markstein's theorem: with ``y`` correctly rounded and ``q`` within one ulp,
one correction rounds correctly; the first correction brings ``q`` within one ulp). It
holds for the ``a`` that occur, square roots (0, or between sqrt of the smallest
denormal and sqrt of the largest float: no remainder underflows, no quotient overflows),
and 0, inf and NaN take ``a * y``, which equals ``a / b`` there (NaN payloads included).
Checked exhaustively by scripts/check_adamw_quotient.py: every such float32 ``a`` against
``a / b`` for 55 divisors (the bias corrections of betas 0.5-0.9999 at steps 1-1000,
random ones, 1.0), no difference; the tests check one binade in full and 2M random ``a``
per divisor. The second division varies per element and stays a division.

Why numba. The kernel must be compiled, yet the package must install from wheels with no
compiler at install time (a coordinator host may have no C++ toolchain; torch's
cpp_extension, which the paper's library uses, builds at first use and needs one). numba
and llvmlite are wheels for the common platforms; numba compiles the loop at run time for
the host's vectors, without fast-math (IEEE sqrt and division, no reassociation, no
contraction) and with ``llvm.fma.f32`` exactly where the code asks for it. The machine
code is cached on disk (``cache=True``: next to the module, or numba's user cache dir
when that is read-only), and the optimizer loads it when it is built, never inside a step
(a first compile takes a few seconds). Without numba the optimizer keeps torch's kernel.

Threads. The kernel releases the GIL (``nogil``); the optimizer runs one call per thread
on disjoint ranges from a small pool of Python threads (``Team``), not numba's parallel
backend, whose default work queue may not be entered from two threads at once (two jobs
in one coordinator would), and not an OpenMP team, whose barrier stalls when one of its
threads is descheduled on a busy host.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "AdamWConstants",
    "MIN_SHARE",
    "UNIT",
    "Team",
    "constants",
    "flat_array",
    "load",
    "self_check",
    "split",
    "step_range",
]

log = logging.getLogger(__name__)

UNIT = 16
"""torch's kernel works on whole units of 16 floats (one cache line); a tensor's last
``numel % UNIT`` elements take its scalar loop."""


@dataclass(frozen=True)
class AdamWConstants:
    """One step's float32 constants, rounded from float64 as torch rounds them."""

    # 1 - lr * wd, or 1 without weight decay: torch then skips the multiply, which the
    # kernel need not, as p * 1 is p (a signalling NaN comes out of the update quiet
    # either way).
    decay: np.float32
    weight: np.float32  # lerp weight w = 1 - beta1
    beta2: np.float32
    c2: np.float32  # 1 - beta2
    bc2_sqrt: np.float32  # sqrt(1 - beta2 ** step)
    inv_bc2_sqrt: np.float32  # 1 / bc2_sqrt, rounded (Note [division by a constant])
    eps: np.float32
    neg_step_size: np.float32  # -lr / (1 - beta1 ** step)


def constants(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> AdamWConstants:
    """The constants of step ``step`` (>= 1), computed in float64 and then rounded to
    float32 in the order torch's kernel does (bias corrections in double)."""
    f = np.float32
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    bc2_sqrt = f(math.sqrt(bias_correction2))
    return AdamWConstants(
        decay=f(1 - lr * weight_decay) if weight_decay != 0 else f(1.0),
        weight=f(1 - beta1),
        beta2=f(beta2),
        c2=f(1 - beta2),
        bc2_sqrt=bc2_sqrt,
        inv_bc2_sqrt=f(1.0) / bc2_sqrt,  # float32 division: correctly rounded
        eps=f(eps),
        neg_step_size=f(-(lr / bias_correction1)),
    )


# --------------------------------------------------------------------------- loading

_lock = threading.Lock()
_loaded: Callable[..., None] | None = None
_load_error: str | None = None


def load() -> tuple[Callable[..., None] | None, str | None]:
    """The compiled kernel, or ``(None, why not)``; compiled once per process."""
    global _loaded, _load_error
    with _lock:
        if _loaded is None and _load_error is None:
            try:
                # Imported here, not at the top: importing numba and compiling (or
                # loading the cached machine code) costs a second, paid only by an
                # optimizer that will use the kernel.
                from roundpipe.coordinator.training import adamw_numba

                _loaded = adamw_numba.compiled()
            except ImportError as exc:
                _load_error = f"numba is not installed ({exc})"
            except Exception as exc:  # a numba/llvmlite that cannot compile it here
                _load_error = f"numba could not compile it ({type(exc).__name__}: {exc})"
        return _loaded, _load_error


def flat_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's storage as a flat numpy array (no copy); bfloat16
    tensors as uint16, the bits the kernel writes."""
    flat = t.detach().view(-1)
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


_NO_OUT = np.empty(0, dtype=np.uint16)


def step_range(
    kernel: Callable[..., None],
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    out: np.ndarray | None,
    lo: int,
    hi: int,
    c: AdamWConstants,
    grad_scale: np.float32 | None = None,
) -> None:
    """Run the kernel on elements [lo, hi) of one tensor (flat arrays; ``out``: the bf16
    bits to write, or None). With ``grad_scale`` the gradient is scaled first, in place."""
    kernel(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        _NO_OUT if out is None else out,
        lo,
        hi,
        param.size,
        np.float32(1.0) if grad_scale is None else grad_scale,
        grad_scale is not None,
        (
            c.decay,
            c.weight,
            c.beta2,
            c.c2,
            c.bc2_sqrt,
            c.inv_bc2_sqrt,
            c.eps,
            c.neg_step_size,
        ),
    )


# --------------------------------------------------------------------------- threads

MIN_SHARE = 1 << 16
"""Elements below which another thread costs more (waking it, ~10-50 us) than it saves."""


def split(sizes: list[int], threads: int) -> list[list[tuple[int, int, int]]]:
    """Cut tensors of ``sizes`` elements into at most ``threads`` shares of about equal
    element count, each a list of ``(tensor index, lo, hi)`` ranges. A cut inside a tensor
    falls on a multiple of UNIT from its start (not needed for the result, which is
    elementwise, but it keeps threads off each other's cache lines)."""
    total = sum(sizes)
    threads = max(1, min(threads, total // MIN_SHARE))
    share = -(-total // threads)
    shares: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for index, size in enumerate(sizes):
        lo = 0
        while lo < size:
            if room <= 0:
                shares.append([])
                room = share
            hi = min(size, -(-(lo + room) // UNIT) * UNIT)
            shares[-1].append((index, lo, hi))
            room -= hi - lo
            lo = hi
    return shares


class Team:
    """The calling thread plus ``threads - 1`` pool threads, running one share each.

    The kernel releases the GIL, so the shares run in parallel; the Python between kernel
    calls (a few microseconds per range) is all that contends for it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def run(self, jobs: list[Callable[[], None]]) -> None:
        """Run ``jobs`` side by side (the first on this thread); return when all are done,
        re-raising the first error."""
        if len(jobs) > 1 and self._size < len(jobs) - 1:
            if self._pool is not None:
                self._pool.shutdown()
            self._size = len(jobs) - 1
            self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="adamw")
        futures = [self._pool.submit(job) for job in jobs[1:]] if self._pool else []
        try:
            jobs[0]()
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
            self._size = 0


# --------------------------------------------------------------------------- self-check

_checked: dict[tuple[float, ...], bool] = {}


def self_check(
    kernel: Callable[..., None], *, lr: float, betas: tuple[float, float], eps: float,
    weight_decay: float,
) -> bool:  # fmt: skip
    """Whether the kernel equals ``torch._fused_adamw_`` bit for bit (masters, moments,
    and the bf16 cast equals ``copy_``) under these hyperparameters: every tail length,
    weight decay on and off, clipping, three steps. Cached per hyperparameters."""
    key = (lr, betas[0], betas[1], eps, weight_decay)
    with _lock:
        if key in _checked:
            return _checked[key]
    gen = torch.Generator().manual_seed(1234)
    ok = True
    for wd in {0.0, weight_decay}:
        for numel in (1, 7, 8, 15, 16, 16 * 5 + 9, 16 * 7 + 13):
            p_ref = torch.randn(numel, generator=gen)
            m_ref, v_ref = torch.zeros(numel), torch.zeros(numel)
            p, m, v = p_ref.clone(), m_ref.clone(), v_ref.clone()
            out = torch.empty(numel, dtype=torch.bfloat16)
            step_t = torch.zeros(())
            for step in (1, 2, 3):
                grad = torch.randn(numel, generator=gen) * (10.0**-step)
                grad[::5] = 0.0
                scale = np.float32(0.75) if step == 2 else None
                g_ref = grad * torch.tensor(scale) if scale is not None else grad.clone()
                step_t.add_(1)
                torch._fused_adamw_(
                    [p_ref], [g_ref], [m_ref], [v_ref], [], [step_t], amsgrad=False, lr=lr,
                    beta1=betas[0], beta2=betas[1], weight_decay=wd, eps=eps, maximize=False,
                )  # fmt: skip
                c = constants(
                    lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, step=step
                )
                g = grad.clone()
                step_range(
                    kernel, flat_array(p), flat_array(g), flat_array(m), flat_array(v), flat_array(out),
                    0, numel, c, scale,
                )  # fmt: skip
                pairs = ((p, p_ref), (m, m_ref), (v, v_ref), (g, g_ref))
                ok = ok and all(
                    torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs
                )
                ok = ok and torch.equal(
                    out.view(torch.int16), p_ref.to(torch.bfloat16).view(torch.int16)
                )
    with _lock:
        _checked[key] = ok
    return ok
