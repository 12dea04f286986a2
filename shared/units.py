"""Sizes and rates written by people: ``24GiB``, ``25GB/s``, ``165T``, and back.

Shared by the coordinator (planner, admission) and the worker (``--memory-limit``,
``--emulate-pcie``), so neither package imports the other for it.
"""

from __future__ import annotations

import re

__all__ = ["GiB", "KiB", "MiB", "format_bytes", "format_seconds", "parse_quantity"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_QTY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": KiB, "mi": MiB, "gi": GiB, "ti": 1 << 40}


def parse_quantity(text: str | float | int, *, what: str = "quantity") -> float:
    """``"24GiB"`` -> 25769803776, ``"25GB/s"`` -> 25e9, ``"165T"`` -> 1.65e14, ``"3e9"``.

    K/M/G/T/P are powers of 1000, Ki/Mi/Gi/Ti powers of 1024; a trailing ``B``, ``/s``,
    ``B/s`` or ``FLOPS`` is ignored.
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = _QTY_RE.match(text)
    if m is None:
        raise ValueError(f"cannot read {what} {text!r}: expected e.g. 24GiB, 25GB/s, 165T")
    value, unit = float(m.group(1)), m.group(2).lower()
    for tail in ("flops", "/s", "b"):
        if unit.endswith(tail):
            unit = unit[: -len(tail)]
    if unit in _BIN:
        return value * _BIN[unit]
    if unit in _SUFFIX:
        return value * _SUFFIX[unit]
    raise ValueError(f"cannot read {what} {text!r}: unknown unit {m.group(2)!r}")


def format_bytes(n: float) -> str:
    """``25769803776`` -> ``"24.0 GiB"``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_seconds(s: float) -> str:
    """``2.5`` -> ``"2.50 s"``, ``0.0123`` -> ``"12.3 ms"``, ``4e-5`` -> ``"40 us"``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
