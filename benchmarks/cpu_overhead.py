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

Usage: python benchmarks/cpu_overhead.py [--steps 8] [--warmup 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import plain_loop, run_runtime

from roundpipe.coordinator.jobspec import JobSpec

DEMO = Path(__file__).resolve().parent.parent / "roundpipe" / "demo_data"
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


def make_spec(steps: int, num_microbatches: int, out: Path) -> JobSpec:
    return JobSpec.from_dict(
        {
            "model": {
                "architecture": "qwen3",
                "config": CONFIG,
                "init_seed": 0,
                "tokenizer": str(DEMO / "tokenizer"),
            },
            "data": {"path": str(DEMO / "demo_corpus.jsonl"), "seq_len": 512, "seed": 1},
            "batch": {"microbatch_size": 1, "num_microbatches": num_microbatches},
            "train": {"steps": steps, "staleness": 1, "dtype": "float32", "seed": 0},
            "optimizer": {"lr": 1e-4, "schedule": "constant"},
            "output": {"dir": str(out)},
        }
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="total compute threads")
    parser.add_argument("--microbatches", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rp-bench-"))
    spec = make_spec(args.steps, args.microbatches, root / "out")
    plain = plain_loop(spec, warmup=args.warmup, threads=args.threads)
    one = runtime(spec, 1, args.threads, args.warmup, root)
    two = runtime(spec, 2, max(1, args.threads // 2), args.warmup, root)
    tokens = spec.global_batch_size * spec.data.seq_len
    print(
        f"model: qwen3 hidden 512 x 8 layers, seq 512, {args.microbatches} microbatches "
        f"of 1 row ({tokens} tokens/step), fp32, {args.threads} threads in total"
    )
    print(f"{'system':36} {'tokens/s':>10} {'ratio':>8}")
    print(f"{'plain loop + checkpointing':36} {plain:10.1f} {1.0:8.2f}")
    print(f"{'runtime, 1 CPU worker':36} {one:10.1f} {one / plain:8.2f}")
    print(f"{'runtime, 2 CPU workers':36} {two:10.1f} {two / plain:8.2f}")
    print(f"RESULT ratio_1w={one / plain:.2f} ratio_2w={two / plain:.2f}")


if __name__ == "__main__":
    main()
