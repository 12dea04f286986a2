"""Measured per-layer times from ``TaskDone.layer_times`` turned back into ``LayerCost``s
for re-planning."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.planning.costs import (
    LayerCost,
)

if TYPE_CHECKING:
    pass


def _parse_key(key: str) -> tuple[int, str] | None:
    layer, _, phase = key.partition(".")
    if not layer.isdigit():
        return None
    return int(layer), phase


_KINDS = {"forward": "F", "F": "F", "backward": "B", "B": "B", "tail": "T", "T": "T"}


_BWD_WITH_FORWARD = "bwd+fwd"
"""A layer-grain backward sample, one forward more than a backward (``record``)."""


class ProfileAggregator:
    """Measured per-layer times -> ``LayerCost``s for re-planning.

    Feed it every ``TaskDone`` (``record_done``, or ``record`` with the task's kind) and
    call ``end_iteration(k)`` once iteration k's tasks are all done. ``layer_times`` keys
    are ``"<layer>"`` or ``"<layer>.<phase>"`` with seconds for the whole task (all its
    microbatches):

    * forward task: the layer's forward (``"12.fwd"``, or ``"12"``);
    * backward task: recompute + backward of the layer (``"12"``, or the sum of its
      phases, e.g. ``"12.fwd"`` (recompute) + ``"12.bwd"``);
    * tail task: forward + backward of the layer, same keys as backward.

    Samples are divided by the task's microbatch count and multiplied by the worker's
    relative speed (so a half-speed worker's times count as a reference worker's), then
    averaged per iteration (re-runs of a task), and folded into an exponential moving
    average with weight ``alpha`` for the newest iteration. The first
    ``warmup_iterations`` iterations seen are dropped (allocator warm-up, cuDNN/cuBLAS
    autotuning, first uploads). ``settled`` turns true once every layer has a backward
    (or tail) measurement and, for ``settle_iterations`` consecutive folded iterations,
    the averages moved by less than ``settle_tolerance`` of their total (sum of absolute
    changes over sum of averages).

    ``costs()`` returns the prior (cold-start) costs with measured times: a layer only
    ever measured in the tail gets its forward time from its measured tail time and the
    prior's forward/backward ratio; a layer with no measurement is scaled by the median
    measured/prior ratio. Byte counts always come from the prior.
    """

    def __init__(
        self,
        prior: Sequence[LayerCost],
        num_microbatches: int,
        *,
        alpha: float = 0.5,
        warmup_iterations: int = 1,
        settle_tolerance: float = 0.05,
        settle_iterations: int = 2,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.prior = list(prior)
        self.num_microbatches = num_microbatches
        self.alpha = alpha
        self.warmup_iterations = warmup_iterations
        self.settle_tolerance = settle_tolerance
        self.settle_iterations = settle_iterations
        self.ema: dict[tuple[int, str], float] = {}  # (layer, "fwd"|"bwd") -> s per microbatch
        self._pending: dict[int, dict[tuple[int, str], list[float]]] = {}
        self._first_iteration: int | None = None
        self._calm = 0
        self.folded_iterations = 0
        self.last_change: float | None = None
        """How much the averages moved at the last folded iteration, relative to their
        total (infinite when a layer was measured for the first time)."""

    def record(
        self,
        iteration: int,
        kind: str,
        layer_times: Mapping[str, float],
        *,
        worker_speed: float = 1.0,
        num_microbatches: int | None = None,
        extra_forward: bool = False,
    ) -> None:
        """One task's measurements (kind: forward/backward/tail or F/B/T).
        ``extra_forward``: a backward task at layer grain, whose times hold one more
        forward of each layer than a backward's cost does (the cost model adds that
        forward itself: Note [recompute grain] in roundpipe.worker.executor); it is
        taken off with the layer's forward time of the same iteration."""
        if kind not in _KINDS:
            raise ValueError(f"unknown task kind {kind!r}: expected forward, tail or backward")
        k = _KINDS[kind]
        if self._first_iteration is None or iteration < self._first_iteration:
            self._first_iteration = iteration
        m = num_microbatches or self.num_microbatches
        scale = worker_speed / m
        total: dict[int, float] = {}
        bare: dict[int, float] = {}
        for key, seconds in layer_times.items():
            parsed = _parse_key(key)
            if parsed is None or not 0 <= parsed[0] < len(self.prior):
                continue
            layer, phase = parsed
            if k == "F" and phase not in ("", "fwd"):
                continue
            if phase == "":
                bare[layer] = float(seconds)
            else:
                total[layer] = total.get(layer, 0.0) + float(seconds)
        total.update(bare)  # a bare "<layer>" key is the layer's total
        bucket = self._pending.setdefault(iteration, {})
        phase_name = "fwd" if k == "F" else _BWD_WITH_FORWARD if extra_forward else "bwd"
        for layer, seconds in total.items():
            bucket.setdefault((layer, phase_name), []).append(seconds * scale)

    def record_done(
        self, task: Any, done: Any, *, worker_speed: float = 1.0, extra_forward: bool = False
    ) -> None:
        """Convenience: a ``StageTask`` and its ``TaskDone``."""
        self.record(
            task.iteration,
            task.kind,
            done.layer_times,
            worker_speed=worker_speed,
            num_microbatches=task.num_microbatches,
            extra_forward=extra_forward,
        )

    def end_iteration(self, iteration: int) -> None:
        """Fold the samples of ``iteration`` (and any earlier ones still pending)."""
        for k in sorted(i for i in self._pending if i <= iteration):
            samples = self._pending.pop(k)
            self._take_off_extra_forwards(samples)
            assert self._first_iteration is not None
            if k < self._first_iteration + self.warmup_iterations:
                continue
            moved = before = 0.0
            fresh = False
            for key, values in samples.items():
                x = sum(values) / len(values)
                old = self.ema.get(key)
                if old is None:
                    self.ema[key] = x
                    fresh = True
                    continue
                new = self.alpha * x + (1 - self.alpha) * old
                self.ema[key] = new
                moved += abs(new - old)
                before += old
            # The share of the measured time that moved: big layers, which decide the
            # plan, count most; a tiny layer's jitter (large relative, small absolute)
            # does not hold settling back.
            if fresh:
                change = math.inf
            elif before > 0:
                change = moved / before
            else:
                change = math.inf if moved > 0 else 0.0
            self.folded_iterations += 1
            self.last_change = change
            self._calm = self._calm + 1 if change < self.settle_tolerance else 0

    def _take_off_extra_forwards(self, samples: dict[tuple[int, str], list[float]]) -> None:
        """Layer-grain backward samples become backward samples: less the layer's
        forward, as measured this iteration (else its average, else the prior's)."""
        for layer, phase in [key for key in samples if key[1] == _BWD_WITH_FORWARD]:
            values = samples.pop((layer, phase))
            forwards = samples.get((layer, "fwd"))
            forward = (
                sum(forwards) / len(forwards)
                if forwards
                else self.ema.get((layer, "fwd"), self.prior[layer].forward_s)
            )
            samples.setdefault((layer, "bwd"), []).extend(max(v - forward, 0.0) for v in values)

    @property
    def covered(self) -> bool:
        """Every layer with backward work has a backward/tail measurement (forward times
        can be inferred; LoRA's prefix has no backward to measure)."""
        return all(
            (layer, "bwd") in self.ema for layer, p in enumerate(self.prior) if p.backward_s > 0
        )

    @property
    def settled(self) -> bool:
        return self.covered and self._calm >= self.settle_iterations

    def restart_settling(self) -> None:
        """Keep the averages but require ``settle_iterations`` calm iterations again
        before ``settled`` (the trainer calls it after each re-planning attempt)."""
        self._calm = 0

    def costs(self) -> list[LayerCost]:
        ratios = []
        for (layer, phase), v in self.ema.items():
            p = self.prior[layer]
            ref = p.forward_s if phase == "fwd" else p.backward_s
            if ref > 0:
                ratios.append(v / ref)
        ratios.sort()
        global_scale = ratios[len(ratios) // 2] if ratios else 1.0
        out = []
        for layer, p in enumerate(self.prior):
            fwd = self.ema.get((layer, "fwd"))
            bwd = self.ema.get((layer, "bwd"))
            if fwd is None and bwd is not None and p.backward_s > 0:
                fwd = p.forward_s * bwd / p.backward_s
            if bwd is None and fwd is not None and p.forward_s > 0:
                bwd = p.backward_s * fwd / p.forward_s
            if fwd is None:
                fwd = p.forward_s * global_scale
            if bwd is None:
                bwd = p.backward_s * global_scale
            out.append(replace(p, forward_s=fwd, backward_s=bwd))
        return out


# -- a measured profile as a file -------------------------------------------------------

PROFILE_FILE = "profile.json"
"""Where a job's measured profile goes in its output directory (``save_profile``)."""

_PROFILE_VERSION = 1


def save_profile(path: Path, costs: Sequence[LayerCost], about: Mapping[str, Any]) -> None:
    """Write measured per-layer ``costs`` and ``about`` (the job's shape and the workers
    they were measured on) to ``path``, atomically: ``roundpipe plan --profile`` reads it
    back to predict a step from measured rather than estimated times."""
    doc = {
        "version": _PROFILE_VERSION,
        "about": dict(about),
        "layers": [asdict(c) for c in costs],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no empty temporary left behind
        raise


def load_profile(path: Path) -> tuple[list[LayerCost], dict[str, Any]]:
    """``(costs, about)`` from a file ``save_profile`` wrote. Raises ValueError naming the
    file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the profile {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != _PROFILE_VERSION:
        raise ValueError(
            f"{path} is not a profile this version writes (a job's {PROFILE_FILE}, "
            f"version {_PROFILE_VERSION})"
        )
    names = {f.name for f in fields(LayerCost)}
    try:
        costs = [
            LayerCost(**{k: v for k, v in layer.items() if k in names}) for layer in doc["layers"]
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: a layer entry is malformed ({exc})") from None
    return costs, dict(doc.get("about") or {})
