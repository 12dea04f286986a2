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

Note [microbatch-split stages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A forward or backward stage may be *split* by microbatch: ``B[0:4/2]`` runs as two
tasks over the same layers, the first over microbatches ``[0, 2)``, the second over
``[2, M)``, and round-robin puts them on different workers. With staleness 0 this is
what lets both workers share an iteration's fill and drain (each iteration's tasks wait
for the previous step's weights, so nothing else overlaps them: docs/benchmarks.md, sync
mode). A split gradient stage writes its second part's gradient into a second buffer
(``grads_part``, counter ``wgrad_part``) and the optimizer adds the two parts before it
steps. A task accumulates its microbatches' gradients left to right in fp32, so with a
second part of exactly one microbatch (``/M-1``) the sum ``(g_0 + ... + g_{M-2}) +
g_{M-1}`` is bitwise the unsplit task's; any other split point sums the same terms in
another association (float noise). The tail is never split.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["RECOMPUTE_GRAINS", "Plan", "Stage", "StageKind"]

StageKind = Literal["F", "T", "B"]

RECOMPUTE_GRAINS = ("stage", "layer")
"""How a backward task recomputes its range (Note [recompute grain] in
roundpipe.worker.executor): the whole stage under autograd, or one layer at a time."""

_RANGE_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*(?:/\s*(\d+)\s*)?$")
_PLAN_RE = re.compile(r"^\s*F\[(?P<f>[^\]]*)\]\s+T\[(?P<t>[^\]]*)\]\s+B\[(?P<b>[^\]]*)\]\s*$")


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of an iteration: a kind, a half-open layer range and its microbatch
    split (0: one task; j > 0: tasks over microbatches [0, j) and [j, M), Note
    [microbatch-split stages])."""

    kind: StageKind
    start: int
    stop: int
    split: int = 0

    def __str__(self) -> str:
        return f"{self.kind}[{_fmt_range(self.start, self.stop, self.split)}]"


def _fmt_range(a: int, b: int, split: int) -> str:
    return f"{a}:{b}/{split}" if split else f"{a}:{b}"


def _fmt_ranges(ranges: Iterable[tuple[int, int]], splits: Sequence[int] = ()) -> str:
    ranges = list(ranges)
    splits = list(splits) or [0] * len(ranges)
    return ",".join(_fmt_range(a, b, j) for (a, b), j in zip(ranges, splits))


def _parse_ranges(text: str, what: str) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Ranges and their microbatch splits (0 where none is given)."""
    text = text.strip()
    if not text:
        return (), ()
    out, splits = [], []
    for part in text.split(","):
        m = _RANGE_RE.match(part)
        if m is None:
            raise ValueError(
                f"bad {what} range {part.strip()!r}: expected 'start:stop' or "
                "'start:stop/split' (a microbatch split)"
            )
        out.append((int(m.group(1)), int(m.group(2))))
        splits.append(int(m.group(3) or 0))
    return tuple(out), tuple(splits)


def _as_ranges(ranges: Iterable[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(r[0]), int(r[1])) for r in ranges)


def _as_splits(splits: Iterable[int], ranges: tuple[tuple[int, int], ...], what: str):
    """Splits as a tuple with one entry per range, or () when no stage is split (so
    plans that differ only in spelling "no split" compare equal)."""
    out = tuple(int(j) for j in splits)
    if not any(out):
        return ()
    if len(out) != len(ranges):
        raise ValueError(f"{what}_split needs one entry per {what} stage, got {list(out)}")
    return out


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Forward stages, fused tail and backward stages of one iteration."""

    forward: tuple[tuple[int, int], ...]
    """Ascending, contiguous ranges covering [0, tail[0]); empty when the tail starts at 0."""
    tail: tuple[int, int]
    """The fused tail range; it always ends at the last layer (num_layers)."""
    backward: tuple[tuple[int, int], ...]
    """Descending, contiguous ranges covering [0, tail[0]), highest range first."""
    forward_split: tuple[int, ...] = ()
    """Per forward stage, its microbatch split (Note [microbatch-split stages]); () when
    no stage is split."""
    backward_split: tuple[int, ...] = ()
    """Per backward stage, likewise."""

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, tests) but store hashable tuples.
        object.__setattr__(self, "forward", _as_ranges(self.forward))
        object.__setattr__(self, "backward", _as_ranges(self.backward))
        object.__setattr__(self, "tail", (int(self.tail[0]), int(self.tail[1])))
        for what in ("forward", "backward"):
            splits = _as_splits(getattr(self, f"{what}_split"), getattr(self, what), what)
            if any(j < 0 for j in splits):
                raise ValueError(f"{what}_split entries must be >= 0, got {list(splits)}")
            object.__setattr__(self, f"{what}_split", splits)

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

    def validate_microbatches(self, num_microbatches: int) -> None:
        """Raise ValueError when a split does not leave both tasks of its stage at least
        one of ``num_microbatches`` microbatches (Note [microbatch-split stages])."""
        for stage in self.stages():
            if stage.split and not 0 < stage.split < num_microbatches:
                raise ValueError(
                    f"plan {self}: stage {stage} splits its microbatches at {stage.split}, "
                    f"but a split must be in 1..{num_microbatches - 1} with "
                    f"{num_microbatches} microbatches per iteration (each part needs one)"
                )

    # ----------------------------------------------------------------- queries

    @property
    def is_split(self) -> bool:
        """Whether any stage runs as two tasks (Note [microbatch-split stages])."""
        return bool(self.forward_split or self.backward_split)

    def unsplit(self) -> Plan:
        """The same stages, each one task."""
        return Plan(forward=self.forward, tail=self.tail, backward=self.backward)

    def split_gradient_layers(self) -> frozenset[int]:
        """Layers whose gradient comes in two parts (a split backward stage's layers)."""
        return frozenset(
            layer
            for (a, b), j in zip(self.backward, self.backward_split)
            if j
            for layer in range(a, b)
        )

    @property
    def num_tasks(self) -> int:
        """Tasks per iteration: one per stage, two per split stage."""
        return sum(2 if s.split else 1 for s in self.stages())

    def backward_boundaries(self) -> frozenset[int]:
        """Layers whose input the forward pass keeps: the first layer of each backward stage."""
        return frozenset(a for a, _ in self.backward)

    def stages(self) -> list[Stage]:
        """All tasks of one iteration in schedule order: F..., T, B..."""
        fs = self.forward_split or (0,) * len(self.forward)
        bs = self.backward_split or (0,) * len(self.backward)
        return (
            [Stage("F", a, b, j) for (a, b), j in zip(self.forward, fs)]
            + [Stage("T", *self.tail)]
            + [Stage("B", a, b, j) for (a, b), j in zip(self.backward, bs)]
        )

    @property
    def num_layers(self) -> int:
        return self.tail[1]

    # ------------------------------------------------------------ string form

    def __str__(self) -> str:
        return (
            f"F[{_fmt_ranges(self.forward, self.forward_split)}] "
            f"T[{self.tail[0]}:{self.tail[1]}] "
            f"B[{_fmt_ranges(self.backward, self.backward_split)}]"
        )

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read the string form back, e.g. ``"F[0:3,3:5] T[5:8] B[4:5,0:4]"`` (or with
        microbatch splits, ``"F[0:3/1,3:5] T[5:8] B[4:5,0:4/2]"``).

        Only the syntax is checked here; call ``validate(num_layers)`` for the layout.
        """
        m = _PLAN_RE.match(text)
        if m is None:
            raise ValueError(
                f"cannot parse plan {text!r}: expected the form 'F[0:3,3:5] T[5:8] B[4:5,0:4]'"
            )
        tail, tail_split = _parse_ranges(m.group("t"), "tail")
        if len(tail) != 1:
            raise ValueError(f"cannot parse plan {text!r}: T[...] must hold exactly one range")
        if any(tail_split):
            raise ValueError(f"cannot parse plan {text!r}: the tail cannot be split")
        forward, forward_split = _parse_ranges(m.group("f"), "forward")
        backward, backward_split = _parse_ranges(m.group("b"), "backward")
        return cls(
            forward=forward,
            tail=tail[0],
            backward=backward,
            forward_split=forward_split,
            backward_split=backward_split,
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
