"""Stage plans: how one iteration's layers are cut into forward, tail and backward tasks.

A model has ``n`` layers (0 = prefix, 1..n-2 = decoder layers, n-1 = tail; see
docs/model-execution.md). One iteration runs, in order::

    F_0, F_1, ..., F_{p-1}   forward stages: ascending ranges covering [0, tail.start)
    T                        fused tail: forward + loss + backward of [tail.start, n)
    B_0, B_1, ..., B_{q-1}   backward stages: descending ranges covering [0, tail.start)

The forward and backward partitions are independent of each other (asymmetric). Every
range is half-open ``(start, stop)``. When the tail starts at layer 0 (the whole model is
one fused task) both partitions are empty.

A plan is plain data: it prints as ``F[0:3,3:5] T[5:8] B[4:5,0:4]`` and
``Plan.parse`` reads that form back, so a plan can be logged, compared in tests and kept
in a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Plan", "Stage", "StageKind"]

StageKind = Literal["F", "T", "B"]

_RANGE_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_PLAN_RE = re.compile(r"^\s*F\[(?P<f>[^\]]*)\]\s+T\[(?P<t>[^\]]*)\]\s+B\[(?P<b>[^\]]*)\]\s*$")


@dataclass(frozen=True, slots=True)
class Stage:
    """One task of an iteration: a kind and a half-open layer range."""

    kind: StageKind
    start: int
    stop: int

    def __str__(self) -> str:
        return f"{self.kind}[{self.start}:{self.stop}]"


def _fmt_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)


def _parse_ranges(text: str, what: str) -> tuple[tuple[int, int], ...]:
    text = text.strip()
    if not text:
        return ()
    out = []
    for part in text.split(","):
        m = _RANGE_RE.match(part)
        if m is None:
            raise ValueError(f"bad {what} range {part.strip()!r}: expected 'start:stop'")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def _as_ranges(ranges: Iterable[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(r[0]), int(r[1])) for r in ranges)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Forward stages, fused tail and backward stages of one iteration."""

    forward: tuple[tuple[int, int], ...]
    """Ascending, contiguous ranges covering [0, tail[0]); empty when the tail starts at 0."""
    tail: tuple[int, int]
    """The fused tail range; it always ends at the last layer (num_layers)."""
    backward: tuple[tuple[int, int], ...]
    """Descending, contiguous ranges covering [0, tail[0]), highest range first."""

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, tests) but store hashable tuples.
        object.__setattr__(self, "forward", _as_ranges(self.forward))
        object.__setattr__(self, "backward", _as_ranges(self.backward))
        object.__setattr__(self, "tail", (int(self.tail[0]), int(self.tail[1])))

    # ------------------------------------------------------------------ checks

    def validate(self, num_layers: int) -> None:
        """Raise ValueError naming the first problem if this plan does not fit the model."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        t0, t1 = self.tail
        if t1 != num_layers:
            raise ValueError(
                f"plan {self}: tail {t0}:{t1} must end at the last layer (stop == {num_layers})"
            )
        if not 0 <= t0 < t1:
            raise ValueError(f"plan {self}: tail {t0}:{t1} must be a non-empty range in [0, {t1})")
        for what, ranges in (("forward", self.forward), ("backward", self.backward)):
            for a, b in ranges:
                if not 0 <= a < b:
                    raise ValueError(f"plan {self}: {what} stage {a}:{b} is empty or negative")
        if t0 == 0:
            if self.forward or self.backward:
                raise ValueError(
                    f"plan {self}: the tail covers the whole model, so forward and backward "
                    "stages must be empty"
                )
            return
        if not self.forward:
            raise ValueError(f"plan {self}: forward stages must cover layers 0:{t0}")
        expect = 0
        for a, b in self.forward:
            if a != expect:
                raise ValueError(
                    f"plan {self}: forward stage {a}:{b} must start at {expect} "
                    "(forward stages are ascending and contiguous from layer 0)"
                )
            expect = b
        if expect != t0:
            raise ValueError(
                f"plan {self}: forward stages end at {expect} but the tail starts at {t0}"
            )
        if not self.backward:
            raise ValueError(f"plan {self}: backward stages must cover layers 0:{t0}")
        expect = t0
        for a, b in self.backward:
            if b != expect:
                raise ValueError(
                    f"plan {self}: backward stage {a}:{b} must stop at {expect} "
                    "(backward stages are descending and contiguous down from the tail start)"
                )
            expect = a
        if expect != 0:
            raise ValueError(f"plan {self}: backward stages stop short of layer 0 (at {expect})")

    # ----------------------------------------------------------------- queries

    def backward_boundaries(self) -> frozenset[int]:
        """Layers whose input the forward pass keeps: the first layer of each backward stage."""
        return frozenset(a for a, _ in self.backward)

    def stages(self) -> list[Stage]:
        """All tasks of one iteration in schedule order: F..., T, B..."""
        return (
            [Stage("F", a, b) for a, b in self.forward]
            + [Stage("T", *self.tail)]
            + [Stage("B", a, b) for a, b in self.backward]
        )

    @property
    def num_layers(self) -> int:
        return self.tail[1]

    # ------------------------------------------------------------ string form

    def __str__(self) -> str:
        return (
            f"F[{_fmt_ranges(self.forward)}] T[{self.tail[0]}:{self.tail[1]}] "
            f"B[{_fmt_ranges(self.backward)}]"
        )

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read the string form back, e.g. ``"F[0:3,3:5] T[5:8] B[4:5,0:4]"``.

        Only the syntax is checked here; call ``validate(num_layers)`` for the layout.
        """
        m = _PLAN_RE.match(text)
        if m is None:
            raise ValueError(
                f"cannot parse plan {text!r}: expected the form 'F[0:3,3:5] T[5:8] B[4:5,0:4]'"
            )
        tail = _parse_ranges(m.group("t"), "tail")
        if len(tail) != 1:
            raise ValueError(f"cannot parse plan {text!r}: T[...] must hold exactly one range")
        return cls(
            forward=_parse_ranges(m.group("f"), "forward"),
            tail=tail[0],
            backward=_parse_ranges(m.group("b"), "backward"),
        )

    # ------------------------------------------------------------- generators

    @classmethod
    def uniform(
        cls, num_layers: int, *, num_forward: int, num_backward: int, tail_layers: int = 1
    ) -> Plan:
        """Split the layers before a ``tail_layers``-long tail into near-equal stages."""
        if not 1 <= tail_layers <= num_layers:
            raise ValueError(f"tail_layers must be in [1, {num_layers}], got {tail_layers}")
        t0 = num_layers - tail_layers
        if t0 == 0:
            return cls(forward=(), tail=(0, num_layers), backward=())
        for what, k in (("num_forward", num_forward), ("num_backward", num_backward)):
            if not 1 <= k <= t0:
                raise ValueError(f"{what} must be in [1, {t0}] for a tail at {t0}, got {k}")
        fwd = _even_split(t0, num_forward)
        bwd = tuple(reversed(_even_split(t0, num_backward)))
        return cls(forward=fwd, tail=(t0, num_layers), backward=bwd)


def _even_split(n: int, k: int) -> tuple[tuple[int, int], ...]:
    cuts = [round(i * n / k) for i in range(k + 1)]
    return tuple((cuts[i], cuts[i + 1]) for i in range(k))
