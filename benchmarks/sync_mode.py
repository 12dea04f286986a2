"""What synchronous training (staleness 0) costs against staleness 1 (issue 18).

With staleness 0, iteration k+1 computes on W_k: its first forward stage (layer 0
onwards) waits for the optimizer to update the layers whose gradients the backward of
iteration k finishes last. With staleness 1 it computes on W_{k-1} and overlaps
iteration k's backward. Measured side by side for the demo-sized model (the
``roundpipe demo`` job: Qwen3-shaped, hidden 128, 4 layers, 3 microbatches of 4 x 128
tokens), 2 CPU workers of one thread each:

  simulator  the planner's plan for the job, simulated at staleness 0 and 1 with the
             planner's cost model (roundpipe.coordinator.planning.simulator): at
             staleness 0 it splits stages by microbatch (Note [microbatch-split
             stages] in roundpipe.shared.plan); "unsplit": the planner's best plan
             without splits (what it chose before splits existed); the best unsplit
             plan for each staleness over every partition of the layers (the planner's
             candidate search skips most of them); and any ``--plan``
  runtime    the job through real daemons (one LocalCluster, job after job), staleness
             0 and 1, tokens/s at the median step after the warm-up, mean of
             ``--repeats`` interleaved runs (with their spread and the ratio of each
             interleaved pair): the
             planner's plans; the unsplit plan forced on both settings ("runtime,
             unsplit", the figure before splits); with the demo's global-norm
             clipping (which makes the optimizer wait for the whole step); and each
             ``--plan`` forced on both settings (``train.plan``), e.g. edge stages
             ``'F[0:1,1:4] T[4:6] B[3:4,2:3,1:2,0:1]'``

Prints a table and last ``RESULT sync_vs_async=<staleness-0 tokens/s / staleness-1
tokens/s> unsplit=<the same, unsplit plan>`` for the runtime without clipping (the plain
synchronous case): the median of the interleaved pairs' ratios (with ``--no-runtime``:
the simulator's).

Usage: python benchmarks/sync_mode.py [--steps 24] [--warmup 4] [--repeats 2]
       [--no-clip-runs] [--no-unsplit-runs] [--no-runtime] [--plan PLAN ...]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path

from common import run_job, runtime_cluster

from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.hardware import cpu_hardware
from roundpipe.coordinator.planning.search import evaluate_plan, plan_stages
from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec
from roundpipe.coordinator.spec.paths import DEMO_DATA_DIR, spec_read_dirs
from roundpipe.scratch import work_dir
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

DEMO_JOB = DEMO_DATA_DIR / "demo_job.yaml"


# Every partition of a model of up to this many layers is simulated (about 4^(layers-2)
# plans: 341 for the demo's 6).
EXHAUSTIVE_MAX_LAYERS = 8


def demo_spec(
    staleness: int, grad_clip: float | None, steps: int, out: Path, plan: str | None = None
) -> JobSpec:
    d = load_job_spec(DEMO_JOB).to_dict()
    d["train"].update(steps=steps, staleness=staleness)
    # A short run (the tests' smoke run) must stay valid: no more lr warm-up than steps.
    d["optimizer"]["warmup_steps"] = min(d["optimizer"]["warmup_steps"], steps)
    if plan is not None:
        d["train"]["plan"] = plan
    d["optimizer"]["grad_clip"] = grad_clip
    d["output"] = {"dir": str(out), "checkpoint_every": 0, "keep_last": 1}
    return JobSpec.from_dict(d)


def partitions(stop: int) -> Iterator[list[tuple[int, int]]]:
    """Every cut of [0, stop) into contiguous ascending ranges."""
    for cuts in itertools.product((False, True), repeat=stop - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [stop]
        yield [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def every_plan(num_layers: int) -> Iterator[Plan]:
    """Every plan of ``num_layers`` layers: tail length, forward and backward cuts."""
    for t in range(1, num_layers):
        for forward in partitions(t):
            for backward in partitions(t):
                yield Plan(forward=forward, tail=(t, num_layers), backward=backward[::-1])


def simulate(
    spec: JobSpec, num_workers: int, plans: Sequence[str]
) -> tuple[list[tuple[str, float, float, float]], Plan]:
    """Rows (label, staleness-0 tokens/s, staleness-1 tokens/s, their ratio) the simulator
    predicts: the planner's plan for each staleness, its best unsplit plan, the best
    unsplit plan for each over every partition, and each of ``plans``; and the planner's
    unsplit staleness-0 plan."""
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec

    model = LayeredModel(model_config_from_spec(spec.model))
    hw = cpu_hardware(num_workers)
    costs = estimate_costs(
        model,
        microbatch_rows=spec.batch.microbatch_size,
        seq_len=spec.data.seq_len,
        compute_dtype=spec.train.dtype,
        flops_per_s=hw.flops_per_s,
        on_gpu=False,  # CPU workers
    )
    forced = [Plan.parse(text) for text in plans]
    for plan in forced:
        plan.validate(len(costs))
    m = spec.batch.num_microbatches
    tokens = spec.global_batch_size * spec.data.seq_len
    planned: dict[tuple[str, int], float] = {}
    unsplit_plan = None
    for label, fits in (("planner's", None), ("unsplit", _unsplit)):
        for staleness in (0, 1):
            result = plan_stages(
                costs, hw, m, staleness=staleness, tokens_per_iteration=tokens, fits=fits
            )
            planned[(label, staleness)] = tokens / result.predicted_iteration_s
            if fits is not None and staleness == 0:
                unsplit_plan = result.plan
            print(
                f"# simulator, staleness {staleness}: {label} plan {result.plan}, "
                f"{result.predicted_iteration_s * 1e3:.1f} ms per step"
            )
    assert unsplit_plan is not None
    rows = [
        (name, planned[(label, 0)], planned[(label, 1)], planned[(label, 0)] / planned[(label, 1)])
        for name, label in (("simulator", "planner's"), ("simulator, unsplit", "unsplit"))
    ]

    def step_s(plan: Plan, staleness: int) -> float:
        return evaluate_plan(
            plan, costs, hw, m, staleness=staleness, tokens_per_iteration=tokens
        ).predicted_iteration_s

    best: dict[int, float] = {}
    if len(costs) <= EXHAUSTIVE_MAX_LAYERS:
        for staleness in (0, 1):
            s, plan = min(
                ((step_s(p, staleness), p) for p in every_plan(len(costs))),
                key=lambda r: (round(r[0], 4), len(r[1].stages())),
            )
            best[staleness] = tokens / s
            print(
                f"# simulator, staleness {staleness}: best of every plan {plan}, "
                f"{s * 1e3:.1f} ms per step"
            )
        rows.append(("simulator, every unsplit plan", best[0], best[1], best[0] / best[1]))
    for plan in forced:
        s0, s1 = tokens / step_s(plan, 0), tokens / step_s(plan, 1)
        rows.append((f"simulator, {plan}", s0, s1, s0 / s1))
    return rows, unsplit_plan


def _unsplit(plan: Plan) -> bool:
    return not plan.is_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case, interleaved")
    parser.add_argument("--no-clip-runs", action="store_true", help="skip the clipped runs")
    parser.add_argument(
        "--no-unsplit-runs", action="store_true", help="skip the runs of the unsplit plan"
    )
    parser.add_argument("--no-runtime", action="store_true", help="the simulator only")
    parser.add_argument(
        "--plan",
        action="append",
        default=[],
        help="also run this plan (train.plan) at both settings; may be repeated",
    )
    args = parser.parse_args()
    with work_dir("rp-bench-sync-") as root:
        spec = demo_spec(1, None, args.steps, root / "sim")
        try:
            rows, unsplit_plan = simulate(spec, args.workers, args.plan)
        except ValueError as exc:  # a --plan that does not parse or fit the demo's layers
            parser.error(f"--plan: {exc}")
        cases: list[tuple[str, float | None, str | None]] = []
        if not args.no_runtime:
            cases.append(("runtime", None, None))
            if not args.no_unsplit_runs:
                cases.append(("runtime, unsplit", None, str(unsplit_plan)))
            if not args.no_clip_runs:
                cases.append(("runtime, clip 1.0", 1.0, None))
            cases += [(f"runtime, {Plan.parse(t)}", None, t) for t in args.plan]
        rates = {(label, s): [] for label, _, _ in cases for s in (0, 1)}
        if cases:
            _run_cases(cases, args, spec, root, rates)
    for label, _, _ in cases:
        s0, s1 = rates[(label, 0)], rates[(label, 1)]
        pairs = [a / b for a, b in zip(s0, s1, strict=True)]
        print(
            f"# {label}: staleness 0 {_spread(s0)}, staleness 1 {_spread(s1)}, "
            f"0 / 1 per interleaved pair {_spread(pairs, '.2f')}"
        )
        # The ratio: the median of the interleaved pairs, which a burst of load on the
        # shared machine during one run cannot drag as it drags the means.
        rows.append((label, statistics.mean(s0), statistics.mean(s1), statistics.median(pairs)))
    width = max(len(row[0]) for row in rows)
    print(
        f"{'system':{width}} {'staleness 0':>12} {'staleness 1':>12} {'0 / 1':>7}  "
        "(tokens/s; runtime: means, and the median ratio of the interleaved pairs)"
    )
    for label, s0, s1, ratio in rows:
        print(f"{label:{width}} {s0:12.0f} {s1:12.0f} {ratio:7.2f}")
    ratio = {row[0]: row[3] for row in rows}
    runtime = "runtime" in ratio
    unsplit = ratio.get("runtime, unsplit" if runtime else "simulator, unsplit")
    line = f"RESULT sync_vs_async={ratio['runtime' if runtime else 'simulator']:.2f}"
    print(line if unsplit is None else f"{line} unsplit={unsplit:.2f}")


def _run_cases(
    cases: Sequence[tuple[str, float | None, str | None]],
    args: argparse.Namespace,
    spec: JobSpec,
    root: Path,
    rates: dict[tuple[str, int], list[float]],
) -> None:
    """Each case at staleness 0 and 1, ``args.repeats`` times, into ``rates`` (tokens/s
    at the median step). One cluster runs every job in turn (its workers are stateless;
    each job's warm-up steps come before its timed ones)."""
    cpu = ["--cpu", "--threads", "1"]
    tokens_per_step = spec.global_batch_size * spec.data.seq_len
    with runtime_cluster(
        [cpu] * args.workers,
        root=root / "cluster",
        coordinator_threads=1,
        env={"OMP_NUM_THREADS": "1"},
        allow_read=spec_read_dirs(spec),
        allow_write=[root],
    ) as cluster:
        # Interleaved, so that a change in the machine's load hits every case alike.
        for r in range(args.repeats):
            for c, (label, clip, plan) in enumerate(cases):
                for staleness in (0, 1):
                    out = root / f"case{c}-s{staleness}-{r}" / "out"
                    run = run_job(
                        cluster,
                        demo_spec(staleness, clip, args.steps, out, plan),
                        warmup=args.warmup,
                    )
                    # The median step: robust to a burst of load from other processes
                    # on the machine, which would weigh on the mean of one run.
                    rate = tokens_per_step / statistics.median(run.step_s)
                    rates[(label, staleness)].append(rate)
                    print(
                        f"# {label}, staleness {staleness}, run {r}: plan {run.plan}, "
                        f"{rate:.0f} tokens/s at the median step ({run.tokens_per_s:.0f} mean)"
                    )


def _spread(values: Sequence[float], fmt: str = ".0f") -> str:
    """``mean (min..max)`` of ``values``."""
    return (
        f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}..{max(values):{fmt}}, "
        f"n={len(values)})"
    )


if __name__ == "__main__":
    main()
