"""Runtime overhead on CPU: tokens/s through real daemons vs a plain single-process loop.

Side by side in one invocation, on the same model, data, microbatching and total thread
count:

  plain      one process: transformers model with gradient checkpointing (the same full
             recomputation the runtime does), microbatch accumulation, fused AdamW
  runtime/1w coordinator + 1 CPU worker (--threads T)
  runtime/2w coordinator + 2 CPU workers (--threads T/2 each)

The model is one where compute dominates (Qwen3-shaped, hidden 512, 8 layers, sequence
512). Warm-up steps are excluded. Prints a table and last
`RESULT ratio_1w=<x> ratio_2w=<y>` (runtime tokens/s / plain tokens/s). Target on a
2-core machine: ratio_1w >= 0.85.

With ``--observability`` it measures instead what the observability features cost
(docs/observability.md), 2 CPU workers, runs alternating off / on ``--repeats`` times:

  off        output.timeline false, no TensorBoard, no metrics endpoint
  on         timeline trace + TensorBoard scalars (with the extra gradient-norm pass) +
             --metrics-address, scraped over HTTP every second while the job runs

and, in-process, the cost of the recorder's hooks per call times the calls per step.
Last line `RESULT observability_overhead=<on/off step time - 1> hooks_share=<x>`
(target: at most 0.02).

Usage: python benchmarks/cpu_overhead.py [--steps 8] [--warmup 2] [--threads 2]
       python benchmarks/cpu_overhead.py --observability [--repeats 2]
       python benchmarks/cpu_overhead.py --smoke   # the tests: hidden 128, sequence 128,
                                                   # 3 steps; the same 8 layers and plans
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import demo_data_spec, plain_loop, run_runtime

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.scratch import work_dir
from roundpipe.shared.plan import Plan

CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


# --smoke: narrower and shorter, the same depth. The planner still runs the whole model as
# one stage on one worker and picks F[0:7] T[7:10] B[5:7,3:5,0:3] for two, as it does for
# the default's model.
SMOKE_HIDDEN, SMOKE_SEQ_LEN = 128, 128


def make_spec(
    steps: int,
    num_microbatches: int,
    out: Path,
    *,
    observability: bool = True,
    smoke: bool = False,
) -> JobSpec:
    config = CONFIG
    if smoke:
        config = {
            **CONFIG,
            "hidden_size": SMOKE_HIDDEN,
            "intermediate_size": SMOKE_HIDDEN * 11 // 4,
            "head_dim": SMOKE_HIDDEN // CONFIG["num_attention_heads"],
        }
    return demo_data_spec(
        config,
        out,
        steps=steps,
        seq_len=SMOKE_SEQ_LEN if smoke else 512,
        microbatch_size=1,
        num_microbatches=num_microbatches,
        output={"timeline": observability, "tensorboard": observability},
    )


def runtime(spec: JobSpec, workers: int, threads_each: int, warmup: int, root: Path) -> float:
    cpu = ["--cpu", "--threads", str(threads_each)]
    run = run_runtime(
        spec,
        [cpu] * workers,
        warmup=warmup,
        root=root / f"runtime-{workers}w",
        coordinator_threads=threads_each,
        env={"OMP_NUM_THREADS": str(threads_each)},
    )
    return run.tokens_per_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_every_second(address: str, stop: threading.Event, count: list[int]):
    def scraper(cluster) -> None:
        def loop() -> None:
            while not stop.wait(1.0):
                try:
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                        r.read()
                    count[0] += 1
                except OSError:
                    pass

        threading.Thread(target=loop, daemon=True).start()

    return scraper


def hooks_cost(spec: JobSpec, calls: int = 20000) -> tuple[float, float]:
    """(seconds per task_done, per optimizer_layer) of a recorder writing a trace."""
    from types import SimpleNamespace

    from roundpipe.coordinator.training.timeline import TimelineRecorder
    from roundpipe.protocol import TaskDone

    with tempfile.TemporaryDirectory() as d:
        recorder = TimelineRecorder("bench", Path(d), keep_steps=64)
        recorder.start(1, Plan.parse("F[0:5] T[5:10] B[0:5]"), num_optimizer_layers=10)
        done = TaskDone(
            job_id="bench", task_id=0, attempt=0, worker_id=1, seconds=0.1, layer_times={}
        )
        task = SimpleNamespace(iteration=1, kind="forward", layer_start=0, layer_stop=5, task_id=0)
        t = time.perf_counter()
        for i in range(calls):
            task.iteration = 1 + i // 10
            recorder.task_done(done, task)
        per_task = (time.perf_counter() - t) / calls
        t = time.perf_counter()
        for i in range(calls):
            recorder.optimizer_layer(1 + i // 10, i % 10, 0.0, 0.0)
        per_layer = (time.perf_counter() - t) / calls
        recorder.close()
    return per_task, per_layer


def observability(args: argparse.Namespace, root: Path) -> None:
    threads_each = max(1, args.threads // 2)
    off_s: list[float] = []
    on_s: list[float] = []
    scrapes = [0]
    for r in range(args.repeats):
        for on in (False, True):
            spec = make_spec(
                args.steps,
                args.microbatches,
                root / f"out-{r}-{on}",
                observability=on,
                smoke=args.smoke,
            )
            stop = threading.Event()
            address = f"127.0.0.1:{_free_port()}"
            run = run_runtime(
                spec,
                [["--cpu", "--threads", str(threads_each)]] * 2,
                warmup=args.warmup,
                root=root / f"obs-{r}-{on}",
                coordinator_threads=threads_each,
                env={"OMP_NUM_THREADS": str(threads_each)},
                coordinator_args=["--metrics-address", address] if on else [],
                while_running=_scrape_every_second(address, stop, scrapes) if on else None,
            )
            stop.set()
            (on_s if on else off_s).extend(run.step_s)
    spec = make_spec(args.steps, args.microbatches, root / "hooks", smoke=args.smoke)
    per_task, per_layer = hooks_cost(spec)
    # Calls per step of this job: one per task of its plan, one per layer (with the
    # embedding and the head).
    num_tasks = Plan.parse(run.plan).num_tasks
    step_off = statistics.median(off_s)
    step_on = statistics.median(on_s)
    hooks_s = num_tasks * per_task + (CONFIG["num_hidden_layers"] + 2) * per_layer
    print(
        f"model: qwen3 hidden {spec.model.config['hidden_size']} x 8 layers, seq "
        f"{spec.data.seq_len}, {args.microbatches} microbatches, "
        f"2 CPU workers x {threads_each} thread(s), {args.repeats} off/on pairs, "
        f"{len(off_s)} + {len(on_s)} timed steps, {scrapes[0]} scrapes"
    )
    print(f"{'observability':40} {'median step s':>14} {'ratio':>8}")
    print(f"{'off':40} {step_off:14.3f} {1.0:8.3f}")
    print(f"{'on (timeline, TensorBoard, metrics)':40} {step_on:14.3f} {step_on / step_off:8.3f}")
    print(
        f"recorder hooks in-process: {per_task * 1e6:.1f} us per task, "
        f"{per_layer * 1e6:.1f} us per optimizer layer: {hooks_s * 1e3:.3f} ms per step "
        f"= {hooks_s / step_off:.2e} of a step"
    )
    print(
        f"RESULT observability_overhead={step_on / step_off - 1:.3f} "
        f"hooks_share={hooks_s / step_off:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="total compute threads")
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument(
        "--observability", action="store_true", help="measure timeline/metrics/TensorBoard cost"
    )
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs (--observability)")
    parser.add_argument("--smoke", action="store_true", help="narrow and short (the tests)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 3, 1
    with work_dir("rp-bench-") as root:
        if args.observability:
            observability(args, root)
            return
        spec = make_spec(args.steps, args.microbatches, root / "out", smoke=args.smoke)
        plain = plain_loop(spec, warmup=args.warmup, threads=args.threads)
        one = runtime(spec, 1, args.threads, args.warmup, root)
        two = runtime(spec, 2, max(1, args.threads // 2), args.warmup, root)
    tokens = spec.global_batch_size * spec.data.seq_len
    print(
        f"model: qwen3 hidden {spec.model.config['hidden_size']} x 8 layers, seq "
        f"{spec.data.seq_len}, {args.microbatches} microbatches "
        f"of 1 row ({tokens} tokens/step), fp32, {args.threads} threads in total"
    )
    print(f"{'system':36} {'tokens/s':>10} {'ratio':>8}")
    print(f"{'plain loop + checkpointing':36} {plain:10.1f} {1.0:8.2f}")
    print(f"{'runtime, 1 CPU worker':36} {one:10.1f} {one / plain:8.2f}")
    print(f"{'runtime, 2 CPU workers':36} {two:10.1f} {two / plain:8.2f}")
    print(f"RESULT ratio_1w={one / plain:.2f} ratio_2w={two / plain:.2f}")


if __name__ == "__main__":
    main()
