"""Discrete-event simulation of the RoundPipe schedule, and of GPipe / 1F1B for comparison.

The planner (roundpipe.coordinator.planning) uses this module to predict what a plan will
do before any GPU runs it, and ``roundpipe plan`` uses it to predict throughput, bubble
fraction and memory on hardware this machine does not have. Everything here is plain
arithmetic on durations: no torch, no CUDA.

RoundPipe (``simulate_roundpipe``)
    One iteration is the stage list ``F_0 .. F_{p-1}, T, B_0 .. B_{q-1}``; each stage is a
    task that runs microbatches 0..M-1 in order. Task j (counted over all iterations) runs
    on worker ``(counter_start + j) mod N``; the counter persists across iterations, so
    iteration k+1's first stages start while iteration k drains. Rules, one per line of
    the real runtime (docs/architecture.md, "One training step"; Note [weight-update
    ordering]):

    * a worker runs its tasks one at a time, in task order;
    * microbatch m of stage s starts when stage s-1 finished microbatch m (plus the
      activation hand-off latency through host memory) and the worker is free;
    * a task's weight upload is prefetched one task ahead: it starts once the worker has
      started the task before it (only two stages are resident), on that worker's
      host-to-device link, and the task cannot start before its upload ends;
    * the tail and backward tasks download their gradients after their last microbatch,
      on the worker's device-to-host link, overlapped with the next task; a gradient slot
      is written only once the optimizer consumed the previous iteration's gradient;
    * one CPU optimizer thread updates each tail/backward stage's layers (in task order)
      once their gradients are down; iteration i reads weights version
      ``max(i - 1 - staleness, 0)``, so its uploads wait for that optimizer step;
    * the trainer sends iteration i only once iteration i-2 has finished entirely.

Split stages
    A plan's split stage (Note [microbatch-split stages] in roundpipe.shared.plan) is
    given as consecutive ``SimStage`` s with the same layers and ``microbatches``
    subsets, which run as separate tasks (round-robin like the rest;
    roundpipe.coordinator.planning.costs.plan_sim_stages). Microbatch m of a task
    depends on the task before it that ran m, and a forward task over layer 0 on the
    iteration's start only. At staleness 0 this is what lets both workers share an
    iteration's fill and drain (docs/benchmarks.md, sync mode).

GPipe / 1F1B (``simulate_bound``)
    The classic schedules: stage i is *bound* to GPU i, its weights stay resident, and
    every iteration ends with a flush. GPipe runs all forwards, then all backwards;
    1F1B (PipeDream-flush) runs ``N - 1 - i`` warm-up forwards, then alternates.

Results are ``SimResult``: the timeline as data (``events``), iteration times,
throughput, bubble fraction, per-worker utilisation, and a compact per-worker grid
(``grid()``) or Gantt chart (``gantt()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "BoundStage",
    "SimEvent",
    "SimResult",
    "SimStage",
    "simulate_bound",
    "simulate_roundpipe",
]

StageKindName = Literal["F", "T", "B"]


@dataclass(frozen=True)
class SimStage:
    """One RoundPipe stage task, as durations. Times are for a worker of speed 1.0."""

    kind: StageKindName
    start: int
    """First layer (half-open range ``[start, stop)``); used for labels and for which
    optimizer chunks a task's weights depend on."""
    stop: int
    compute_s: float
    """Compute time of one microbatch."""
    upload_s: float = 0.0
    """Weight upload, once per task, prefetched one task ahead."""
    download_s: float = 0.0
    """Gradient download after the last microbatch (tail and backward stages)."""
    handoff_s: float = 0.0
    """Latency on each microbatch's dependency on the previous stage (the activation's
    device-to-host copy by the producer plus the host-to-device copy by this stage)."""
    overhead_s: float = 0.0
    """Fixed cost per task (launch, synchronisation), paid before the first microbatch."""
    optimizer_s: float = 0.0
    """CPU optimizer time for this stage's layers (tail and backward stages)."""
    label: str = ""
    """Short name used in grids; ``F0``/``T``/``B3`` when empty (set by the simulator)."""
    microbatches: tuple[int, ...] | None = None
    """The microbatches this task runs, in order (None: all): one stage split into
    consecutive tasks over disjoint microbatches (Note [microbatch-split stages])."""


@dataclass(frozen=True)
class BoundStage:
    """One pipeline stage bound to one GPU (GPipe / 1F1B). Times per microbatch."""

    forward_s: float
    backward_s: float
    start: int = 0
    stop: int = 0
    handoff_s: float = 0.0
    """Activation (forward) / gradient (backward) transfer to the neighbouring stage."""


@dataclass(frozen=True)
class SimEvent:
    """One interval of the simulated timeline."""

    worker: int
    iteration: int
    """1-based iteration number."""
    stage: int
    """Index into the stage list of the simulation."""
    microbatch: int | None
    """None for once-per-task work (uploads, downloads)."""
    what: Literal["compute", "upload", "download", "optimizer"]
    start: float
    end: float
    label: str
    """``F0m3``, ``Tm0``, ``B2m1`` (RoundPipe) or ``F3``/``B3`` (bound schedules);
    ``up:F0`` / ``down:B2`` for transfers."""


@dataclass
class SimResult:
    """What a simulation predicts. All times in seconds."""

    schedule: str
    """``"roundpipe"``, ``"gpipe"`` or ``"1f1b"``."""
    num_workers: int
    num_microbatches: int
    iterations: int
    iteration_ends: list[float]
    """Time at which each iteration's last task (compute and downloads) finished."""
    iteration_s: float
    """Steady-state time per iteration: with two or more iterations, the mean gap between
    iteration ends after the first; with one, its end time."""
    bubble_fraction: float
    """Share of worker time not computing, in steady state: ``1 - work of one iteration /
    (workers x iteration_s)`` with the work averaged over the iterations after the first
    (with one iteration: over its whole run, fill and drain included)."""
    utilisation: list[float]
    """Per worker: its compute time per iteration / ``iteration_s`` (same iterations)."""
    tokens_per_s: float | None
    events: list[SimEvent] = field(repr=False)
    window: tuple[float, float] = (0.0, 0.0)
    optimizer_events: list[SimEvent] = field(default_factory=list, repr=False)
    """The CPU optimizer's updates (RoundPipe with ``optimizer_s``): one per tail or
    backward stage and iteration, ``worker`` -1, ``what`` ``"optimizer"``."""

    @property
    def makespan(self) -> float:
        return self.iteration_ends[-1] if self.iteration_ends else 0.0

    def worker_events(
        self, worker: int, *, what: str = "compute", iteration: int | None = None
    ) -> list[SimEvent]:
        """One worker's events of one kind in time order (optionally one iteration)."""
        return sorted(
            (
                e
                for e in self.events
                if e.worker == worker
                and e.what == what
                and (iteration is None or e.iteration == iteration)
            ),
            key=lambda e: (e.start, e.end),
        )

    def grid(self, *, iteration: int | None = None, max_items: int | None = None) -> str:
        """The schedule as text: per worker, its compute items in order.

        ``w0: F0m0 F0m1 F0m2 | Tm0 ...`` ('|' separates tasks). With several iterations
        and ``iteration=None`` each item is prefixed with its iteration (``2:F0m0``).
        """
        multi = iteration is None and self.iterations > 1
        lines = []
        for w in range(self.num_workers):
            items: list[str] = []
            prev_task: tuple[int, int] | None = None
            for e in self.worker_events(w, iteration=iteration):
                task = (e.iteration, e.stage)
                if prev_task is not None and task != prev_task and self.schedule == "roundpipe":
                    items.append("|")
                prev_task = task
                items.append(f"{e.iteration}:{e.label}" if multi else e.label)
            if max_items is not None and len(items) > max_items:
                items = items[:max_items] + ["..."]
            lines.append(f"w{w}: " + " ".join(items))
        return "\n".join(lines)

    def gantt(self, width: int = 80) -> str:
        """A character timeline per worker: F/T/B for compute (by stage kind), '.' idle."""
        end = self.makespan
        if end <= 0:
            return "\n".join(f"w{w}: " for w in range(self.num_workers))
        scale = width / end
        lines = []
        for w in range(self.num_workers):
            row = ["."] * width
            for e in self.worker_events(w):
                a = int(e.start * scale)
                b = max(a + 1, int(round(e.end * scale)))
                for i in range(a, min(b, width)):
                    row[i] = e.label[0]
            lines.append(f"w{w}: " + "".join(row))
        lines.append(f"    0{'':{width - 12}}{end:10.4g}s")
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


def _speeds(speeds: Sequence[float] | None, n: int) -> list[float]:
    if speeds is None:
        return [1.0] * n
    out = [float(v) for v in speeds]
    if len(out) != n:
        raise ValueError(f"speeds has {len(out)} entries for {n} workers")
    if any(not v > 0 for v in out):
        raise ValueError(f"worker speeds must be positive, got {out}")
    return out


def _check_common(num_workers: int, num_microbatches: int, iterations: int) -> None:
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")


def _stage_labels(stages: Sequence[SimStage]) -> list[str]:
    labels, nf, nb = [], 0, 0
    for st in stages:
        if st.label:
            labels.append(st.label)
        elif st.kind == "F":
            labels.append(f"F{nf}")
        elif st.kind == "B":
            labels.append(f"B{nb}")
        else:
            labels.append("T")
        nf += st.kind == "F"
        nb += st.kind == "B"
    return labels


def _summarise(
    schedule: str,
    num_workers: int,
    num_microbatches: int,
    iteration_ends: list[float],
    events: list[SimEvent],
    tokens_per_iteration: int | None,
) -> SimResult:
    k = len(iteration_ends)
    if k >= 2:
        lo, hi = iteration_ends[0], iteration_ends[-1]
        iteration_s = (hi - lo) / (k - 1)
        counted = range(2, k + 1)  # the steady iterations: all but the first
    else:
        lo, hi = 0.0, iteration_ends[0]
        iteration_s = hi
        counted = range(1, 2)
    # Busy time per worker of the counted iterations' tasks, per iteration: in steady
    # state that is the share of each iteration a worker computes (the drain of the last
    # simulated iteration, which a longer run would fill, does not count as idle).
    busy = [0.0] * num_workers
    for e in events:
        if e.what == "compute" and e.iteration in counted:
            busy[e.worker] += e.end - e.start
    span = iteration_s * len(counted)
    if span > 0:
        utilisation = [b / span for b in busy]
        bubble = 1.0 - sum(busy) / (num_workers * span)
    else:
        utilisation = [0.0] * num_workers
        bubble = 0.0
    tps = None
    if tokens_per_iteration is not None and iteration_s > 0:
        tps = tokens_per_iteration / iteration_s
    return SimResult(
        schedule=schedule,
        num_workers=num_workers,
        num_microbatches=num_microbatches,
        iterations=k,
        iteration_ends=iteration_ends,
        iteration_s=iteration_s,
        bubble_fraction=max(0.0, bubble),
        utilisation=utilisation,
        tokens_per_s=tps,
        events=events,
        window=(lo, hi),
    )


# ------------------------------------------------------------------------- RoundPipe


def simulate_roundpipe(
    stages: Sequence[SimStage],
    *,
    num_workers: int,
    num_microbatches: int,
    iterations: int = 1,
    speeds: Sequence[float] | None = None,
    staleness: int = 1,
    counter_start: int = 0,
    tokens_per_iteration: int | None = None,
) -> SimResult:
    """Simulate ``iterations`` iterations of the RoundPipe schedule (see module doc).

    ``stages`` is one iteration's task list in schedule order (F..., T, B...). ``speeds``
    are relative worker speeds (compute time is divided by them; transfers are not).
    ``staleness`` is 0 (iteration i waits for optimizer step i-1) or 1 (step i-2).
    """
    _check_common(num_workers, num_microbatches, iterations)
    if not stages:
        raise ValueError("no stages to simulate")
    if staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness}")
    n, m_count, s_count = num_workers, num_microbatches, len(stages)
    for st in stages:
        mbs = st.microbatches
        if mbs is not None and (
            not mbs or len(set(mbs)) != len(mbs) or not all(0 <= m < m_count for m in mbs)
        ):
            raise ValueError(
                f"stage {st.kind}[{st.start}:{st.stop}] runs microbatches {list(mbs)}: "
                f"expected distinct indices in 0..{m_count - 1}"
            )
    v = _speeds(speeds, n)
    labels = _stage_labels(stages)
    # Optimizer chunks: the tail and backward stages (their layers), in task order.
    chunk_of = {s: st for s, st in enumerate(stages) if st.kind in ("T", "B")}
    # The chunk that consumes a task's gradient slot: its own, or for a part of a split
    # stage the stage's last part (the layers' optimizer waits for every part).
    consumer = list(range(s_count))
    for s in range(s_count - 2, -1, -1):
        here, after = stages[s], stages[s + 1]
        if (here.kind, here.start, here.stop) == (after.kind, after.start, after.stop):
            consumer[s] = consumer[s + 1]
    # For each stage, the chunks whose layers it reads (overlapping ranges).
    reads = [
        [c for c, ch in chunk_of.items() if ch.start < st.stop and st.start < ch.stop]
        for st in stages
    ]
    events: list[SimEvent] = []
    iteration_ends: list[float] = []
    worker_free = [0.0] * n  # compute engine free
    up_free = [0.0] * n  # host-to-device link free
    down_free = [0.0] * n  # device-to-host link free
    last_start: list[float | None] = [None] * n  # compute start of the worker's last task
    opt_free = 0.0
    opt_end: dict[tuple[int, int], float] = {}  # (iteration, chunk stage) -> time
    chain_end: list[float] = []  # per microbatch: when the task before finished it
    optimizer_events: list[SimEvent] = []
    for k in range(1, iterations + 1):
        gate = iteration_ends[k - 3] if k >= 3 else 0.0
        version = max(k - 1 - staleness, 0)
        iter_end = 0.0
        for s, st in enumerate(stages):
            j = (k - 1) * s_count + s
            w = (counter_start + j) % n
            ready = gate
            if version >= 1:
                for c in reads[s]:
                    ready = max(ready, opt_end[(version, c)])
            up_start = max(up_free[w], ready)
            if last_start[w] is not None:
                up_start = max(up_start, last_start[w])
            up_end = up_start + st.upload_s
            up_free[w] = up_end
            if st.upload_s > 0:
                events.append(
                    SimEvent(w, k, s, None, "upload", up_start, up_end, f"up:{labels[s]}")
                )
            start = max(worker_free[w], up_end, gate)
            last_start[w] = start
            t = start + st.overhead_s
            if s == 0:
                chain_end = [gate] * m_count
            # Note [microbatch-split stages]: a first stage (or a part of one) starts
            # from the batch, every other from the task before it that ran m.
            first = s == 0 or (st.kind == "F" and st.start == 0)
            for m in range(m_count) if st.microbatches is None else st.microbatches:
                dep = gate if first else chain_end[m] + st.handoff_s
                a = max(t, dep)
                t = a + st.compute_s / v[w]
                chain_end[m] = t
                events.append(SimEvent(w, k, s, m, "compute", a, t, f"{labels[s]}m{m}"))
            worker_free[w] = t
            end = t
            if st.kind in ("T", "B"):
                d_start = max(t, down_free[w], opt_end.get((k - 1, consumer[s]), 0.0))
                d_end = d_start + st.download_s
                down_free[w] = d_end
                if st.download_s > 0:
                    events.append(
                        SimEvent(w, k, s, None, "download", d_start, d_end, f"down:{labels[s]}")
                    )
                end = max(end, d_end)
                o_start = max(opt_free, d_end)
                opt_free = o_start + st.optimizer_s
                opt_end[(k, s)] = opt_free
                if st.optimizer_s > 0:
                    optimizer_events.append(
                        SimEvent(-1, k, s, None, "optimizer", o_start, opt_free, labels[s])
                    )
            iter_end = max(iter_end, end)
        iteration_ends.append(iter_end)
    result = _summarise(
        "roundpipe", n, m_count, iteration_ends, events, tokens_per_iteration=tokens_per_iteration
    )
    result.optimizer_events = optimizer_events
    return result


# ------------------------------------------------------------------- GPipe / 1F1B


def _bound_order(schedule: str, i: int, n: int, m: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", mb) for mb in range(m)] + [("B", mb) for mb in range(m)]
    warmup = min(n - 1 - i, m)
    ops = [("F", mb) for mb in range(warmup)]
    for b in range(m - warmup):
        ops.append(("F", warmup + b))
        ops.append(("B", b))
    ops += [("B", b) for b in range(m - warmup, m)]
    return ops


def simulate_bound(
    stages: Sequence[BoundStage],
    *,
    schedule: Literal["gpipe", "1f1b"],
    num_microbatches: int,
    iterations: int = 1,
    speeds: Sequence[float] | None = None,
    optimizer_s: float = 0.0,
    tokens_per_iteration: int | None = None,
) -> SimResult:
    """Simulate GPipe or 1F1B with stage i bound to GPU i (one stage per GPU).

    Each iteration ends with a pipeline flush and an optimizer step of ``optimizer_s``
    (on the GPUs, all at once) before the next iteration starts.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    n = len(stages)
    _check_common(n, num_microbatches, iterations)
    m_count = num_microbatches
    v = _speeds(speeds, n)
    events: list[SimEvent] = []
    iteration_ends: list[float] = []
    t0 = 0.0
    for k in range(1, iterations + 1):
        orders = [_bound_order(schedule, i, n, m_count) for i in range(n)]
        pos = [0] * n
        free = [t0] * n
        done: dict[tuple[str, int, int], float] = {}  # (op, stage, mb) -> end
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for i in range(n):
                while pos[i] < len(orders[i]):
                    op, mb = orders[i][pos[i]]
                    if op == "F":
                        dep_key = ("F", i - 1, mb) if i > 0 else None
                        hand = stages[i - 1].handoff_s if i > 0 else 0.0
                    elif i == n - 1:
                        dep_key, hand = ("F", i, mb), 0.0
                    else:
                        dep_key, hand = ("B", i + 1, mb), stages[i].handoff_s
                    if dep_key is not None and dep_key not in done:
                        break
                    dep = done[dep_key] + hand if dep_key is not None else t0
                    a = max(free[i], dep)
                    dur = (stages[i].forward_s if op == "F" else stages[i].backward_s) / v[i]
                    b = a + dur
                    free[i] = b
                    done[(op, i, mb)] = b
                    events.append(SimEvent(i, k, i, mb, "compute", a, b, f"{op}{mb}"))
                    pos[i] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - the orders above cannot deadlock
                raise RuntimeError(f"{schedule} schedule deadlocked")
        end = max(free) + optimizer_s
        iteration_ends.append(end)
        t0 = end
    return _summarise(schedule, n, m_count, iteration_ends, events, tokens_per_iteration)
