"""What synchronous training (staleness 0) costs against staleness 1 (issue 18).

With staleness 0, iteration k+1 computes on W_k: its first forward stage (layer 0
onwards) waits for the optimizer to update the layers whose gradients the backward of
iteration k finishes last. With staleness 1 it computes on W_{k-1} and overlaps
iteration k's backward. Measured side by side for the demo-sized model (the
``roundpipe demo`` job: Qwen3-shaped, hidden 128, 4 layers, 3 microbatches of 4 x 128
tokens), 2 CPU workers of one thread each:

  simulator  the planner's plan for the job, simulated at staleness 0 and 1 with the
             planner's cost model (roundpipe.coordinator.planning.simulator)
  runtime    the job through real daemons (LocalCluster), staleness 0 and 1, tokens/s
             over the steps after the warm-up, mean of ``--repeats`` interleaved runs;
             with the demo's global-norm clipping (which makes the optimizer wait for
             the whole step) and without

Prints a table and last ``RESULT sync_vs_async=<staleness-0 tokens/s / staleness-1
tokens/s>`` for the runtime without clipping (the plain synchronous case).

Usage: python benchmarks/sync_mode.py [--steps 24] [--warmup 4] [--repeats 2]
       [--no-clip-runs] [--no-runtime]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_runtime

from roundpipe.coordinator.jobspec import JobSpec, load_job_spec
from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.hardware import cpu_hardware
from roundpipe.coordinator.planning.search import plan_stages
from roundpipe.shared.model import LayeredModel

DEMO_JOB = Path(__file__).resolve().parent.parent / "roundpipe" / "demo_data" / "demo_job.yaml"


def demo_spec(staleness: int, grad_clip: float | None, steps: int, out: Path) -> JobSpec:
    d = load_job_spec(DEMO_JOB).to_dict()
    d["train"].update(steps=steps, staleness=staleness)
    d["optimizer"]["grad_clip"] = grad_clip
    d["output"] = {"dir": str(out), "checkpoint_every": 0, "keep_last": 1}
    return JobSpec.from_dict(d)


def simulate(spec: JobSpec, num_workers: int) -> dict[int, float]:
    """Predicted tokens/s at staleness 0 and 1, each with the planner's plan for it."""
    from roundpipe.coordinator.jobspec import model_config_from_spec

    model = LayeredModel(model_config_from_spec(spec.model))
    hw = cpu_hardware(num_workers)
    costs = estimate_costs(
        model,
        microbatch_rows=spec.batch.microbatch_size,
        seq_len=spec.data.seq_len,
        compute_dtype=spec.train.dtype,
        flops_per_s=hw.flops_per_s,
    )
    tokens = spec.global_batch_size * spec.data.seq_len
    out = {}
    for staleness in (0, 1):
        result = plan_stages(
            costs,
            hw,
            spec.batch.num_microbatches,
            staleness=staleness,
            tokens_per_iteration=tokens,
        )
        out[staleness] = tokens / result.predicted_iteration_s
        print(
            f"# simulator, staleness {staleness}: plan {result.plan}, "
            f"{result.predicted_iteration_s * 1e3:.1f} ms per step"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case, interleaved")
    parser.add_argument("--no-clip-runs", action="store_true", help="skip the clipped runs")
    parser.add_argument("--no-runtime", action="store_true", help="the simulator only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rp-bench-sync-"))
    rows: list[tuple[str, float, float]] = []
    sim = simulate(demo_spec(1, None, args.steps, root / "sim"), args.workers)
    rows.append(("simulator", sim[0], sim[1]))
    cpu = ["--cpu", "--threads", "1"]
    clips = [] if args.no_runtime else [None] if args.no_clip_runs else [None, 1.0]
    for clip in clips:
        rates: dict[int, list[float]] = {0: [], 1: []}
        # Interleaved, so that a change in the machine's load hits both alike.
        for r in range(args.repeats):
            for staleness in (0, 1):
                name = f"s{staleness}-clip{clip}-{r}"
                run = run_runtime(
                    demo_spec(staleness, clip, args.steps, root / name / "out"),
                    [cpu] * args.workers,
                    warmup=args.warmup,
                    root=root / name,
                    coordinator_threads=1,
                    env={"OMP_NUM_THREADS": "1"},
                )
                rates[staleness].append(run.tokens_per_s)
                print(f"# runtime {name}: plan {run.plan}, {run.tokens_per_s:.0f} tokens/s")
        label = "runtime" if clip is None else f"runtime, clip {clip}"
        rows.append((label, statistics.mean(rates[0]), statistics.mean(rates[1])))
    print(f"{'system':22} {'staleness 0':>12} {'staleness 1':>12} {'0 / 1':>7}  (tokens/s)")
    for label, s0, s1 in rows:
        print(f"{label:22} {s0:12.0f} {s1:12.0f} {s0 / s1:7.2f}")
    key = [r for r in rows if r[0] == "runtime"] or rows
    print(f"RESULT sync_vs_async={key[0][1] / key[0][2]:.2f}")


if __name__ == "__main__":
    main()
