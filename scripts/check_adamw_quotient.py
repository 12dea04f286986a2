"""Is the AdamW kernel's division-free quotient exactly ``a / b``? Every input, checked.

Note [division by a constant] (roundpipe.coordinator.training.adamw_kernel) replaces
``sqrt(v) / sqrt(bias_correction2)`` by a reciprocal multiply and two FMA corrections.
This compares that quotient with float32 division for *every* float32 ``a`` the kernel
can see (0; every value from sqrt of the smallest denormal to sqrt of the largest float;
inf and a block of NaNs), for the bias corrections of betas 0.5 to 0.9999 at steps 1 to
1000, random divisors and 1.0. The tests check a sample; rerun this after changing the
quotient or moving to another CPU architecture (a few minutes on 2 cores).

    python scripts/check_adamw_quotient.py [--quick]

``--quick``: 2^24 inputs per divisor instead of all. Last line: ``RESULT divisors=<n>
inputs_per_divisor=<n> mismatches=<n>``; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numba
import numpy as np

from roundpipe.coordinator.training.adamw_numba import _quotient, quotient_array

BLOCK = 1 << 16


@numba.njit(parallel=True, error_model="numpy")
def mismatches(b, inv_b, first_bits, blocks):
    """Inputs among ``blocks`` blocks of BLOCK float32 bit patterns from ``first_bits``
    whose quotient differs from ``a / b`` (two NaNs count as equal)."""
    bad = 0
    for block in numba.prange(blocks):
        start = first_bits + block * BLOCK
        a = np.arange(start, start + BLOCK, dtype=np.int64).astype(np.uint32).view(np.float32)
        for i in range(BLOCK):
            expected = a[i] / b
            got = _quotient(a[i], b, inv_b)
            if got != expected and not (got != got and expected != expected):
                bad += 1
    return bad


def divisors() -> list[np.float32]:
    out = [
        np.float32(math.sqrt(1 - beta2 ** float(step)))
        for beta2 in (0.999, 0.99, 0.95, 0.98, 0.9999, 0.5)
        for step in (1, 2, 3, 5, 10, 100, 1000)
    ]
    out += list(np.random.default_rng(0).uniform(0.01, 1.0, 10).astype(np.float32))
    return out + [np.float32(1.0), np.nextafter(np.float32(1), np.float32(0)), np.float32(0.5)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2^24 inputs per divisor")
    args = parser.parse_args()
    # Square roots of positive floats start at sqrt(smallest denormal) and end at
    # sqrt(largest float); 0, inf and NaN are checked separately.
    lo = int(np.float32(math.sqrt(np.float32(1.4e-45))).view(np.uint32))
    hi = int(np.float32(math.sqrt(np.finfo(np.float32).max)).view(np.uint32))
    blocks = (1 << 24) // BLOCK if args.quick else -(-(hi + 1 - lo) // BLOCK)
    # 0, +inf and a block of NaN patterns around the quiet NaN.
    nans = np.arange(0x7FC00000 - BLOCK // 2, 0x7FC00000 + BLOCK // 2, dtype=np.uint32)
    special = np.concatenate([np.array([0, 0x7F800000], np.uint32), nans]).view(np.float32)
    started, total, checked = time.time(), 0, 0
    for b in divisors():
        inv_b = np.float32(1.0) / b
        bad = mismatches(b, inv_b, lo, blocks)
        with np.errstate(invalid="ignore"):  # NaN / b
            got, expected = quotient_array(special, b, inv_b), special / b
        bad += int((got.view(np.uint32) != expected.view(np.uint32)).sum())
        if bad:
            print(f"divisor {b!r}: {bad} mismatches")
        total += bad
        checked += 1
    per = blocks * BLOCK
    print(f"# {time.time() - started:.0f}s, inputs from {lo:#x}")
    print(f"RESULT divisors={checked} inputs_per_divisor={per} mismatches={total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
