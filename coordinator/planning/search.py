"""The search for a plan: min-max stage partitions under memory limits, simulated; and the
entry points the trainer and the CLI call (``initial_plan``, ``replan_if_better``)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.planning.costs import (
    CostModel,
    LayerCost,
    StageEstimate,
    estimate_costs,
    per_worker_memory,
    plan_estimates,
    plan_sim_stages,
    task_estimates,
)
from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.simulator import (
    SimResult,
    SimStage,
    simulate_roundpipe,
)
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel


@dataclass(frozen=True)
class PlanResult:
    """A plan with what the cost model and the simulator predict for it."""

    plan: Plan
    predicted_iteration_s: float
    """Simulated steady-state seconds per iteration (optimizer step)."""
    stage_times: tuple[float, ...]
    """Per stage in task order (F..., T, B...): ``StageEstimate.time_s``."""
    per_stage_memory: tuple[int, ...]
    """Per stage in task order: ``StageEstimate.memory_bytes`` (reserve included)."""
    notes: tuple[str, ...]
    stages: tuple[StageEstimate, ...]
    objective_s: float
    """The search's objective: max(stages, N) x the slowest stage's time on the slowest
    worker (speed-matched plans: N x the busiest worker's time per iteration)."""
    num_workers: int
    num_microbatches: int
    memory_limit_bytes: int
    per_worker_memory: tuple[int, ...]
    """Peak per worker in the simulated task order (reserve included)."""
    simulation: SimResult = field(repr=False)
    sim_stages: tuple[SimStage, ...] = field(repr=False)
    tokens_per_iteration: int | None = None
    costs: tuple[LayerCost, ...] = field(default=(), repr=False)
    """The per-layer costs the prediction used (the prior for ``ProfileAggregator``)."""
    hardware: HardwareSpec | None = field(default=None, repr=False)
    replaces_iteration_s: float | None = None
    """Set by ``replan_if_better``: the predicted seconds per iteration of the plan this
    one would replace, under the same costs."""
    recompute: str = "stage"
    """How its backward tasks recompute (Note [recompute grain] in
    roundpipe.worker.executor)."""

    @property
    def predicted_tokens_per_s(self) -> float | None:
        if self.tokens_per_iteration is None or self.predicted_iteration_s <= 0:
            return None
        return self.tokens_per_iteration / self.predicted_iteration_s

    @property
    def bubble_fraction(self) -> float:
        return self.simulation.bubble_fraction

    @property
    def slowest_stage_s(self) -> float:
        return max(self.stage_times)


def _evaluate(
    cm: CostModel,
    plan: Plan,
    *,
    staleness: int,
    iterations: int,
    tokens_per_iteration: int | None,
    notes: Sequence[str] = (),
    objective: float | None = None,
) -> PlanResult:
    ests = plan_estimates(cm, plan)
    sims = plan_sim_stages(cm, plan, ests)
    # Task j runs on worker j mod N: the assignment repeats every N / gcd(S, N)
    # iterations; simulate at least one full period after the first iteration.
    n_workers = cm.hw.num_workers
    iterations = max(iterations, 1 + n_workers // math.gcd(len(sims), n_workers))
    sim = simulate_roundpipe(
        sims,
        num_workers=cm.hw.num_workers,
        num_microbatches=cm.m,
        iterations=iterations,
        speeds=cm.hw.speeds,
        staleness=staleness,
        tokens_per_iteration=tokens_per_iteration,
    )
    iteration_s = sim.iteration_s
    host_s = _shared_host_seconds(cm, plan)
    if host_s > iteration_s:  # one process issues every worker's kernels
        notes = [
            *notes,
            f"host-bound: one process issues every worker's kernels, "
            f"{format_seconds(host_s)} of host time per iteration against "
            f"{format_seconds(sim.iteration_s)} of schedule",
        ]
        iteration_s = host_s
    times = tuple(e.time_s for e in ests)
    slowest = max(times)
    if objective is None:
        objective = max(len(ests), cm.hw.num_workers) * slowest / cm.hw.min_speed
    # (a split variant passes its base's notes, automatic ones included: once each)
    all_notes = list(dict.fromkeys([*notes, *_auto_notes(cm, ests, sims, sim)]))
    return PlanResult(
        plan=plan,
        predicted_iteration_s=iteration_s,
        stage_times=times,
        per_stage_memory=tuple(e.memory_bytes for e in ests),
        notes=tuple(all_notes),
        stages=tuple(ests),
        objective_s=objective,
        num_workers=cm.hw.num_workers,
        num_microbatches=cm.m,
        memory_limit_bytes=cm.hw.memory_limit_bytes,
        per_worker_memory=tuple(per_worker_memory(cm, task_estimates(plan, ests), iterations)),
        simulation=sim,
        sim_stages=tuple(sims),
        tokens_per_iteration=tokens_per_iteration,
        costs=tuple(cm.costs),
        hardware=cm.hw,
        recompute=cm.recompute,
    )


def _shared_host_seconds(cm: CostModel, plan: Plan) -> float:
    """Host seconds per iteration when every worker's kernels come from one process
    (``HardwareSpec.shared_launch_s``; Note [kernels and the host] in
    roundpipe.coordinator.planning.shape_costs): every microbatch's kernels of every
    stage, one after another. 0 for a process per worker."""
    if not cm.hw.shared_launch_s:
        return 0.0
    kernels = sum(cm.costs[i].forward_kernels for a, b in plan.forward for i in range(a, b))
    stages = [plan.tail, *plan.backward]
    kernels += sum(cm.costs[i].backward_kernels for a, b in stages for i in range(a, b))
    return cm.m * kernels * cm.hw.shared_launch_s


def _auto_notes(
    cm: CostModel, ests: Sequence[StageEstimate], sims: Sequence[SimStage], sim: SimResult
) -> list[str]:
    notes = []
    hw = cm.hw
    if cm.m < hw.num_workers + 1 and len(ests) > 1:
        notes.append(
            f"{cm.m} microbatches for {hw.num_workers} workers: with fewer than N+1 = "
            f"{hw.num_workers + 1} the pipeline idles between tasks; raise the microbatch count"
        )
    limited = [e.label for e in ests if e.bound != "compute"]
    if limited:
        notes.append(
            "transfer-bound stages (PCIe time exceeds compute): "
            + ", ".join(limited[:8])
            + (" ..." if len(limited) > 8 else "")
        )
    worst = max(ests, key=lambda e: e.memory_bytes)
    if worst.memory_bytes > hw.memory_limit_bytes:
        notes.append(
            f"stage {worst.label} needs {format_bytes(worst.memory_bytes)}, over the "
            f"{format_bytes(hw.memory_limit_bytes)} limit"
        )
    opt = sum(s.optimizer_s for s in sims)
    if opt > 0.9 * sim.iteration_s:
        notes.append(
            f"the CPU optimizer needs {format_seconds(opt)} per step, about the iteration time "
            f"({format_seconds(sim.iteration_s)}): it throttles the pipeline; raise the "
            "microbatch count (a bigger global batch) or use a faster optimizer"
        )
    if hw.mixed:
        notes.append(
            "mixed worker speeds "
            + ",".join(f"{v:g}" for v in hw.speed_list)
            + f"; {len(ests)} stages"
            + (
                f" = {len(ests) // hw.num_workers} x {hw.num_workers} workers: stage i always "
                "runs on worker i mod N (sized to its speed)"
                if len(ests) % hw.num_workers == 0
                else ": stages rotate over the workers (sized for the slowest)"
            )
        )
    return notes


@dataclass(order=True)
class _Candidate:
    objective: float
    num_stages: int
    plan: Plan = field(compare=False)
    note: str = field(compare=False, default="")


class _Search:
    """The partition search for one cost model."""

    def __init__(self, cm: CostModel, fits: Callable[[Plan], bool] | None = None):
        self.cm = cm
        self.fits = fits  # candidate filter (plan_stages' ``fits``)
        n = cm.n
        self.speed = cm.hw.min_speed  # rotating stages may land on the slowest worker
        # Segment tables for every a < b <= n-1 (the tail always holds layer n-1).
        self.t_f = [[math.inf] * n for _ in range(n)]
        self.t_b = [[math.inf] * n for _ in range(n)]
        self.res_f = [[0] * n for _ in range(n)]
        self.res_b = [[0] * n for _ in range(n)]
        self.run_f = [[0] * n for _ in range(n)]
        self.run_b = [[0] * n for _ in range(n)]
        self.comp_f = [[0.0] * n for _ in range(n)]
        self.comp_b = [[0.0] * n for _ in range(n)]
        self.xfer_f = [[0.0] * n for _ in range(n)]
        self.xfer_b = [[0.0] * n for _ in range(n)]
        bw, ovh = cm.bw, cm.hw.task_overhead_s
        for a in range(n - 1):
            for b in range(a + 1, n):
                for kind, tt, rr, uu, cc, xx in (
                    ("F", self.t_f, self.res_f, self.run_f, self.comp_f, self.xfer_f),
                    ("B", self.t_b, self.res_b, self.run_b, self.comp_b, self.xfer_b),
                ):
                    compute, up, down, resident, run = cm.parts(kind, a, b)
                    cc[a][b] = compute
                    xx[a][b] = max(up, down) / bw
                    tt[a][b] = max(compute / self.speed, xx[a][b]) + ovh
                    rr[a][b] = resident
                    uu[a][b] = run

    # -- greedy packing -----------------------------------------------------------------

    def _ok(self, kind: str, a: int, b: int, cap: float, budget: int, room: int) -> bool:
        if kind == "F":
            t, res, run = self.t_f[a][b], self.res_f[a][b], self.run_f[a][b]
        else:
            t, res, run = self.t_b[a][b], self.res_b[a][b], self.run_b[a][b]
        return t <= cap and res <= budget and run <= room

    def greedy_f(self, t: int, cap: float, budget: int, room: int) -> list[tuple[int, int]] | None:
        out, a = [], 0
        while a < t:
            if not self._ok("F", a, a + 1, cap, budget, room):
                return None
            b = a + 1
            while b < t and self._ok("F", a, b + 1, cap, budget, room):
                b += 1
            out.append((a, b))
            a = b
        return out

    def greedy_b(self, t: int, cap: float, budget: int, room: int) -> list[tuple[int, int]] | None:
        out, b = [], t
        while b > 0:
            if not self._ok("B", b - 1, b, cap, budget, room):
                return None
            a = b - 1
            while a > 0 and self._ok("B", a - 1, b, cap, budget, room):
                a -= 1
            out.append((a, b))
            b = a
        return out

    def pareto(
        self, kind: str, t: int, budget: int, room: int, floor: float
    ) -> list[tuple[int, float]]:
        """(stage count, minimal slowest-stage time) for every useful count, ascending count.

        Exact min-max partitions: for each count the smallest cap whose greedy packing
        needs at most that many stages (binary search over all segment times).
        """
        tt = self.t_f if kind == "F" else self.t_b
        rr = self.res_f if kind == "F" else self.res_b
        uu = self.run_f if kind == "F" else self.run_b
        caps = sorted(
            {
                tt[a][b]
                for a in range(t)
                for b in range(a + 1, t + 1)
                if rr[a][b] <= budget and uu[a][b] <= room
            }
        )
        if not caps:
            return []
        greedy = self.greedy_f if kind == "F" else self.greedy_b
        memo: dict[int, float] = {}

        def count(i: int) -> float:
            if i not in memo:
                parts = greedy(t, caps[i], budget, room)
                memo[i] = math.inf if parts is None else len(parts)
            return memo[i]

        hi = len(caps) - 1
        p = count(hi)
        if p == math.inf:
            return []
        out: list[tuple[int, float]] = []
        while True:
            lo, top = 0, hi
            while lo < top:
                mid = (lo + top) // 2
                if count(mid) <= p:
                    top = mid
                else:
                    lo = mid + 1
            out.append((int(count(lo)), caps[lo]))
            if caps[lo] <= floor or lo == 0 or count(lo - 1) == math.inf:
                break
            hi = lo - 1
            p = count(hi)
        return out

    # -- one tail / budget --------------------------------------------------------------

    def candidates_for(
        self, t: int, tail_time: float, budget: int, room: int, keep: list[_Candidate], k: int
    ) -> None:
        n_workers = self.cm.hw.num_workers
        singles_f = max(self.t_f[a][a + 1] for a in range(t))
        singles_b = max(self.t_b[a][a + 1] for a in range(t))
        floor = max(tail_time, singles_f, singles_b)
        fwd = self.pareto("F", t, budget, room, floor)
        bwd = self.pareto("B", t, budget, room, floor)
        n = self.cm.n
        for p, fcap in fwd:
            for q, bcap in bwd:
                cap = max(fcap, bcap, tail_time)
                stages = p + 1 + q
                obj = max(stages, n_workers) * cap
                if len(keep) >= k and -keep[0].objective <= obj:
                    continue
                fparts = self.greedy_f(t, fcap, budget, room)
                bparts = self.greedy_b(t, bcap, budget, room)
                assert fparts is not None and bparts is not None
                plan = Plan(forward=fparts, tail=(t, n), backward=bparts)
                _push(keep, _Candidate(obj, stages, plan), k, self.fits)

    # -- mixed speeds: stage i always on worker i mod N -----------------------------------

    def _seg_time(self, kind: str, a: int, b: int, speed: float) -> float:
        cc = self.comp_f if kind == "F" else self.comp_b
        xx = self.xfer_f if kind == "F" else self.xfer_b
        return max(cc[a][b] / speed, xx[a][b]) + self.cm.hw.task_overhead_s

    def _pack_positions(
        self, kind: str, t: int, cap: float, budget: int, room: int, first_pos: int
    ) -> list[tuple[int, int]] | None:
        """Greedy packing where stage i (task position first_pos + i) runs on worker
        position mod N, so its cap is met at that worker's speed."""
        speeds = self.cm.hw.speed_list
        n_workers = len(speeds)
        res = self.res_f if kind == "F" else self.res_b
        run = self.run_f if kind == "F" else self.run_b

        def good(x: int, y: int, speed: float) -> bool:
            return (
                self._seg_time(kind, x, y, speed) <= cap
                and res[x][y] <= budget
                and run[x][y] <= room
            )

        out: list[tuple[int, int]] = []
        if kind == "F":
            a = 0
            while a < t:
                speed = speeds[(first_pos + len(out)) % n_workers]
                if not good(a, a + 1, speed):
                    return None
                b = a + 1
                while b < t and good(a, b + 1, speed):
                    b += 1
                out.append((a, b))
                a = b
        else:
            b = t
            while b > 0:
                speed = speeds[(first_pos + len(out)) % n_workers]
                if not good(b - 1, b, speed):
                    return None
                a = b - 1
                while a > 0 and good(a - 1, b, speed):
                    a -= 1
                out.append((a, b))
                b = a
        return out

    def _pad_backward(
        self,
        bparts: list[tuple[int, int]],
        first_pos: int,
        extra: int,
        cap: float,
        budget: int,
        room: int,
    ) -> list[tuple[int, int]] | None:
        """Split backward stages (from the last) until there are ``extra`` more, every
        stage still meeting ``cap`` at the speed of the worker its position maps to."""
        speeds = self.cm.hw.speed_list
        n_workers = len(speeds)

        def fits(parts: list[tuple[int, int]]) -> bool:
            return all(
                self._seg_time("B", a, b, speeds[(first_pos + i) % n_workers]) <= cap
                and self.res_b[a][b] <= budget
                and self.run_b[a][b] <= room
                for i, (a, b) in enumerate(parts)
            )

        parts = list(bparts)
        for _ in range(extra):
            done = False
            for i in range(len(parts) - 1, -1, -1):
                a, b = parts[i]
                for cut in range(b - 1, a, -1):
                    trial = parts[:i] + [(cut, b), (a, cut)] + parts[i + 1 :]
                    if fits(trial):
                        parts, done = trial, True
                        break
                if done:
                    break
            if not done:
                return None
        return parts

    def speed_matched(
        self,
        t: int,
        budget: int,
        room: int,
        keep: list[_Candidate],
        k: int,
        tail_parts: tuple[float, float],
    ) -> None:
        """Stages sized to the worker they always land on (stage count a multiple of N).

        With S = c x N stages per iteration, task j = k S + i runs on worker i mod N in
        every iteration, so stage i may take as long on its worker as the others take
        on theirs. Sweeps a geometric grid of caps; keeps plans with S a multiple of N.
        """
        hw = self.cm.hw
        n_workers, speeds = hw.num_workers, hw.speed_list
        ovh = hw.task_overhead_s
        n = self.cm.n
        tail_compute, tail_xfer = tail_parts
        fastest = max(speeds)
        lo = max(
            max(self._seg_time("F", a, a + 1, fastest) for a in range(t)),
            max(self._seg_time("B", a, a + 1, fastest) for a in range(t)),
            max(tail_compute / fastest, tail_xfer) + ovh,
        )
        hi = (self.comp_f[0][t] + self.comp_b[0][t] + tail_compute) / min(speeds) + ovh
        hi = max(hi, lo)
        steps = 120
        seen: set[Plan] = set()
        for i in range(steps + 1):
            cap = lo * (hi / lo) ** (i / steps)
            fparts = self._pack_positions("F", t, cap, budget, room, 0)
            if fparts is None:
                continue
            tpos = len(fparts)
            tail_t = max(tail_compute / speeds[tpos % n_workers], tail_xfer) + ovh
            if tail_t > cap:
                continue
            bparts = self._pack_positions("B", t, cap, budget, room, tpos + 1)
            if bparts is None:
                continue
            stages = len(fparts) + 1 + len(bparts)
            if stages % n_workers:
                padded = self._pad_backward(
                    bparts, tpos + 1, n_workers - stages % n_workers, cap, budget, room
                )
                if padded is None:
                    continue
                bparts = padded
                stages = len(fparts) + 1 + len(bparts)
            plan = Plan(forward=fparts, tail=(t, n), backward=bparts)
            if plan in seen:
                continue
            seen.add(plan)
            times = [
                self._seg_time("F", x, y, speeds[j % n_workers]) for j, (x, y) in enumerate(fparts)
            ]
            times.append(tail_t)
            times += [
                self._seg_time("B", x, y, speeds[(tpos + 1 + j) % n_workers])
                for j, (x, y) in enumerate(bparts)
            ]
            load = [0.0] * n_workers
            for j, tm in enumerate(times):
                load[j % n_workers] += tm
            _push(
                keep, _Candidate(n_workers * max(load), stages, plan, "speed-matched"), k, self.fits
            )


def _push(
    keep: list[_Candidate], cand: _Candidate, k: int, fits: Callable[[Plan], bool] | None = None
) -> None:
    """Keep the k best candidates (a max-heap on the objective via negation) among those
    ``fits`` accepts."""
    if fits is not None and not fits(cand.plan):
        return
    for c in keep:
        if c.plan == cand.plan:
            return
    item = _Candidate(-cand.objective, -cand.num_stages, cand.plan, cand.note)
    if len(keep) < k:
        heapq.heappush(keep, item)
    elif item > keep[0]:
        heapq.heapreplace(keep, item)


def _check_single_layers(cm: CostModel) -> None:
    """Raise ValueError if a layer cannot run on one GPU even in a stage of its own."""
    hw = cm.hw
    n = cm.n
    for layer in range(n):
        c = cm.costs[layer]
        if layer == n - 1:
            *_, run = cm.parts("T", layer, n)
            kind = "in the tail"
        else:
            *_, run = cm.parts("B", layer, layer + 1)
            kind = "in a backward stage"
        need = run + hw.reserved_bytes
        if need > hw.memory_limit_bytes:
            raise ValueError(
                f"{cm.name(layer)} does not fit one GPU: {kind} it needs "
                f"{format_bytes(need)} (weights {format_bytes(c.param_bytes)}, fp32 gradients "
                f"{format_bytes(c.grad_bytes)}, working memory {format_bytes(c.work_bytes)} "
                f"for one microbatch, I/O buffers, {format_bytes(hw.reserved_bytes)} reserved) "
                f"but the memory limit is {format_bytes(hw.memory_limit_bytes)}; use a "
                "shorter sequence or smaller microbatches, LoRA, or GPUs with more memory"
            )


def runnable_grain(model: LayeredModel, recompute: str) -> str:
    """``recompute`` as ``model``'s backward tasks can run: a model with a router
    auxiliary loss recomputes whole stages only (its router counts are a stage's: Note
    [recompute grain] in roundpipe.worker.executor), so a plan priced at layer grain for
    it would need more memory than predicted. Anything else: ``recompute``."""
    return "stage" if model.router_aux is not None else recompute


def pinned_grain(recompute: str) -> str:
    """The recompute grain of a plan the planner did not choose (a pinned train.plan):
    ``train.recompute``, with "auto" meaning stage grain. Admission prices such a plan
    at it and the trainer runs it there."""
    return "stage" if recompute == "auto" else recompute


def plan_stages(
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    max_tail_layers: int | None = None,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    candidates: int = 12,
    sim_iterations: int = 4,
    select: str = "simulation",
    fits: Callable[[Plan], bool] | None = None,
    recompute: str = "stage",
) -> PlanResult:
    """Choose forward stages, fused tail and backward stages for ``costs`` on ``hw``.

    Minimises ``max(stages, N) x slowest stage`` (stage time = max of compute over M
    microbatches at the slowest worker's speed and the PCIe time of its uploads and
    downloads) subject to the memory limit, over tails of 1..``max_tail_layers`` layers
    (default: all, pruned once the tail alone is too slow) and weight budgets; the best
    ``candidates`` plans are then simulated and the fastest in simulation is returned
    (``select="objective"``: the best by the objective alone, fewest stages on ties).
    With mixed worker speeds, plans whose stage count is a multiple of N (stage i always
    on worker i mod N) with stages sized to their worker's speed are candidates too.

    ``fits``: only plans it accepts are candidates (the trainer's re-planner passes the
    slot-pool check, Note [slot pools] in roundpipe.coordinator.training.layout).

    ``recompute``: ``stage`` or ``layer`` (Note [recompute grain] in
    roundpipe.worker.executor), or ``auto``: layer grain when no stage-grain plan fits
    the memory limit, or when under a memory limit its best plan is predicted faster.

    Raises ValueError when a single layer cannot fit the memory limit (naming it and the
    numbers) or when no plan fits at all.
    """
    if select not in ("simulation", "objective"):
        raise ValueError(f"select must be 'simulation' or 'objective', got {select!r}")
    if recompute == "auto":
        args = (costs, hw, num_microbatches)
        options = dict(
            max_tail_layers=max_tail_layers,
            staleness=staleness,
            tokens_per_iteration=tokens_per_iteration,
            candidates=candidates,
            sim_iterations=sim_iterations,
            select=select,
            fits=fits,
        )
        try:
            by_stage = plan_stages(*args, **options, recompute="stage")
        except ValueError as stage_error:
            try:
                return plan_stages(*args, **options, recompute="layer")
            except ValueError:
                raise stage_error from None
        if not hw.gpu_memory_limited:
            return by_stage  # without a memory limit, layer grain only adds a forward
        # Under a memory limit layer grain may allow longer backward stages (fewer tasks
        # and hand-offs) for one more forward each: the prediction decides.
        by_layer = plan_stages(*args, **options, recompute="layer")
        if by_layer.predicted_iteration_s < by_stage.predicted_iteration_s:
            return by_layer
        return by_stage
    cm = CostModel(costs, hw, num_microbatches, recompute)
    _check_single_layers(cm)
    n = cm.n
    search = _Search(cm, fits)
    room_total = hw.usable_bytes
    kmax = n if max_tail_layers is None else max(1, min(n, max_tail_layers))
    keep: list[_Candidate] = []
    best_obj = math.inf
    tried_tails = 0
    for tail_len in range(1, kmax + 1):
        t = n - tail_len
        compute, up, down, tail_res, tail_run = cm.parts("T", t, n)
        tail_time = max(compute / search.speed, up / cm.bw, down / cm.bw) + hw.task_overhead_s
        if tail_run > room_total:
            break  # longer tails only need more memory
        if max(1, hw.num_workers) * tail_time >= best_obj:
            break  # the tail alone already costs more than the best plan so far
        tried_tails += 1
        if t == 0:
            if tail_run + tail_res > room_total:
                # The whole model as one stage runs beside the next task's prefetched
                # copy of itself, as every other tail does (its memory was checked
                # alone: a plan over the limit was chosen and admitted).
                continue
            obj = max(1, hw.num_workers) * tail_time
            single = Plan(forward=(), tail=(0, n), backward=())
            _push(keep, _Candidate(obj, 1, single), candidates, fits)
            best_obj = min(best_obj, obj)
            continue
        lo = max(
            tail_res,
            max(search.res_b[a][a + 1] for a in range(t)),
        )
        lo_run = max(
            tail_run,
            max(search.run_b[a][a + 1] for a in range(t)),
            max(search.run_f[a][a + 1] for a in range(t)),
        )
        hi = room_total - lo_run
        lo = max(lo, 1)
        if hi < lo:
            continue
        # Weight budgets: the largest stage's weights+grads is what every other stage must
        # leave room for (it may be the prefetched one). If the whole range fits as one
        # stage of each kind, memory never binds and one budget is enough.
        full_res = max(search.res_b[0][t], tail_res)
        full_run = max(search.run_b[0][t], search.run_f[0][t], tail_run)
        if full_res + full_run <= room_total:
            budgets = [full_res]
        else:
            steps = 6
            budgets = sorted({int(lo * (hi / lo) ** (i / (steps - 1))) for i in range(steps)})
            budgets[-1] = hi
        for budget in budgets:
            room = room_total - budget
            if tail_res > budget or tail_run > room:
                continue
            search.candidates_for(t, tail_time, budget, room, keep, candidates)
            if hw.mixed and hw.num_workers > 1:
                search.speed_matched(
                    t, budget, room, keep, candidates, (compute, max(up, down) / cm.bw)
                )
        if keep:
            best_obj = min(best_obj, min(-c.objective for c in keep))
    if not keep:
        # The least any plan needs: its largest one-layer stage running (the tail's last
        # layer included) beside the largest one-layer stage prefetched.
        singles = [
            (
                max(search.run_b[i][i + 1], search.run_f[i][i + 1]),
                search.res_b[i][i + 1],
                cm.name(i),
            )
            for i in range(n - 1)
        ]
        *_, last_res, last_run = cm.parts("T", n - 1, n)
        singles.append((last_run, last_res, f"the tail's {cm.name(n - 1)}"))
        run, _, worst = max(singles, key=lambda single: single[0] + single[1])
        need = run + max(res for _, res, _ in singles) + hw.reserved_bytes
        raise ValueError(
            f"no plan fits {format_bytes(hw.memory_limit_bytes)} per GPU: every stage must "
            "hold its own weights, gradients and working memory plus the prefetched next "
            f"stage's weights and gradients; {worst} alone needs about "
            f"{format_bytes(need)} that way. Use a shorter sequence or smaller microbatches, "
            "LoRA, or GPUs with more memory"
        )
    results = []
    for cand in sorted(keep, key=lambda c: (-c.objective, -c.num_stages)):
        notes = [f"tail of {n - cand.plan.tail[0]} layer(s)"]
        if cand.note:
            notes.append(cand.note)
        res = _evaluate(
            cm,
            cand.plan,
            staleness=staleness,
            iterations=sim_iterations,
            tokens_per_iteration=tokens_per_iteration,
            notes=notes,
            objective=-cand.objective,
        )
        results.append(res)
    if select == "objective":
        best = min(results, key=lambda r: (r.objective_s, len(r.stages)))
    else:
        best = min(results, key=lambda r: (r.predicted_iteration_s, len(r.stages)))
        if staleness == 0 and hw.num_workers > 1 and cm.m > 1:
            best = _best_split(cm, results, best, tokens_per_iteration, sim_iterations, fits)
    extra = (
        f"searched {tried_tails} tail length(s), simulated {len(results)} candidate plans; "
        f"search objective max(stages, N) x slowest = {format_seconds(best.objective_s)}"
    )
    return replace(best, notes=best.notes + (extra,))


_SPLIT_BASES = 4
"""How many of the best simulated plans ``_best_split`` tries split variants of."""

_SPLIT_MIN_GAIN = 0.02
"""A split plan must be predicted this much faster than the best unsplit one: it costs a
second gradient buffer (host memory) and a second weight upload per split stage."""


def split_variants(plan: Plan, num_microbatches: int) -> list[Plan]:
    """Variants of ``plan`` with microbatch-split stages (Note [microbatch-split stages]
    in roundpipe.shared.plan) where staleness 0 idles a worker: the first forward stage
    split after its first microbatch, half of them or all but the last (the next
    iteration's fill; three points keep the search short with many microbatches), and
    the last one or two backward stages split before their last microbatch (the drain;
    that split point keeps the gradient sum bitwise the unsplit plan's). Split, a stage
    is shared by two workers, so the backward stages are also tried merged: the last two
    into one, and all."""
    m = num_microbatches
    if m < 2 or not plan.forward:
        return []
    nf = len(plan.forward)
    back = plan.backward
    partitions = {back, (*back[:-2], (back[-1][0], back[-2][1])) if len(back) > 1 else back}
    partitions.add(((0, plan.tail[0]),))
    points = sorted({1, m // 2, m - 1} - {0})
    forward_options = [()] + [(j,) + (0,) * (nf - 1) for j in points]
    out = []
    for backward in sorted(partitions):
        nb = len(backward)
        backward_options = [()] + [
            tuple(m - 1 if i >= nb - last else 0 for i in range(nb))
            for last in range(1, min(nb, 2) + 1)
        ]
        for fs in forward_options:
            for bs in backward_options:
                if fs or bs:
                    out.append(
                        Plan(
                            forward=plan.forward,
                            tail=plan.tail,
                            backward=backward,
                            forward_split=fs,
                            backward_split=bs,
                        )
                    )
    return out


def _best_split(
    cm: CostModel,
    results: Sequence[PlanResult],
    best: PlanResult,
    tokens_per_iteration: int | None,
    sim_iterations: int,
    fits: Callable[[Plan], bool] | None,
) -> PlanResult:
    """``best``, or a split variant of one of the best few plans predicted at least
    ``_SPLIT_MIN_GAIN`` faster at staleness 0. Its iterations cannot overlap (each
    waits for the last step's first layers), so every step pays the pipeline's fill and
    drain with one worker idle; splitting the stages there by microbatch gives both
    workers a share (docs/benchmarks.md, sync mode)."""
    bases = sorted(results, key=lambda r: r.predicted_iteration_s)[:_SPLIT_BASES]
    winner = best
    seen: set[Plan] = set()  # bases that differ only in the merged stages give one variant
    for base in bases:
        for plan in split_variants(base.plan, cm.m):
            if plan in seen or (fits is not None and not fits(plan)):
                continue
            seen.add(plan)
            res = _evaluate(
                cm,
                plan,
                staleness=0,
                iterations=sim_iterations,
                tokens_per_iteration=tokens_per_iteration,
                notes=(*base.notes, "stages split by microbatch for staleness 0"),
                objective=base.objective_s,
            )
            limit = cm.hw.memory_limit_bytes
            if max(res.per_worker_memory) > limit or max(res.per_stage_memory) > limit:
                # A merged stage that does not fit, beside the largest resident stage
                # as every other candidate is checked (a lost worker moves the turns).
                continue
            if res.predicted_iteration_s < winner.predicted_iteration_s:
                winner = res
    if winner.predicted_iteration_s < best.predicted_iteration_s * (1 - _SPLIT_MIN_GAIN):
        return winner
    return best


def evaluate_plan(
    plan: Plan,
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    sim_iterations: int = 4,
    recompute: str = "stage",
) -> PlanResult:
    """Predict what a given plan does under ``costs`` (no search; memory not enforced,
    an over-limit stage is named in the notes)."""
    plan.validate(len(costs))
    plan.validate_microbatches(num_microbatches)
    cm = CostModel(costs, hw, num_microbatches, recompute)
    return _evaluate(
        cm,
        plan,
        staleness=staleness,
        iterations=sim_iterations,
        tokens_per_iteration=tokens_per_iteration,
    )


def replan_if_better(
    current: Plan,
    costs: Sequence[LayerCost],
    hw: HardwareSpec,
    num_microbatches: int,
    *,
    min_gain: float = 0.05,
    staleness: int = 1,
    tokens_per_iteration: int | None = None,
    max_tail_layers: int | None = None,
    fits: Callable[[Plan], bool] | None = None,
    recompute: str = "stage",
) -> PlanResult | None:
    """A new plan if it is predicted at least ``min_gain`` (relative) faster than
    ``current`` under the same (measured) costs, else None. Both are simulated alike.
    ``fits`` restricts the candidates as in :func:`plan_stages`; None is also the answer
    when no candidate passes it."""
    try:
        new = plan_stages(
            costs,
            hw,
            num_microbatches,
            max_tail_layers=max_tail_layers,
            staleness=staleness,
            tokens_per_iteration=tokens_per_iteration,
            fits=fits,
            recompute=recompute,
        )
    except ValueError:
        if fits is None:
            raise
        return None  # nothing better fits the job's slot pools
    if new.plan == current:
        return None
    old = evaluate_plan(
        current,
        costs,
        hw,
        num_microbatches,
        staleness=staleness,
        tokens_per_iteration=tokens_per_iteration,
        recompute=recompute,
    )
    if new.predicted_iteration_s < old.predicted_iteration_s * (1 - min_gain):
        return replace(new, replaces_iteration_s=old.predicted_iteration_s)
    return None


def initial_plan(
    model: LayeredModel,
    hardware: HardwareSpec,
    *,
    microbatch_rows: int,
    seq_len: int,
    num_microbatches: int,
    compute_dtype: Any = "bfloat16",
    staleness: int = 1,
    fits: Callable[[Plan], bool] | None = None,
    recompute: str = "auto",
) -> PlanResult:
    """A job's cold-start plan on ``hardware``: ``estimate_costs`` + ``plan_stages``
    (``fits`` and ``recompute`` as there).

    The result's ``costs`` are the prior to give ``ProfileAggregator`` for re-planning.
    Raises ValueError when no plan fits (the message says what to change).
    """
    costs = estimate_costs(
        model,
        microbatch_rows=microbatch_rows,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        flops_per_s=hardware.flops_per_s,
        on_gpu=hardware.gpu_workers,  # CPU workers chunk the LM head differently
    )
    recompute = runnable_grain(model, recompute)
    return plan_stages(
        costs,
        hardware,
        num_microbatches,
        staleness=staleness,
        tokens_per_iteration=num_microbatches * microbatch_rows * seq_len,
        fits=fits,
        recompute=recompute,
    )
