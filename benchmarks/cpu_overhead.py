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
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from roundpipe.client import Client
from roundpipe.coordinator.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.jobspec import JobSpec
from roundpipe.shared.model import LayeredModel, count_label_tokens

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


def plain_loop(spec: JobSpec, warmup: int, threads: int) -> float:
    torch.set_num_threads(threads)
    layered = LayeredModel.from_config({"model_type": "qwen3", **CONFIG})
    model = layered.to_hf_model(layered.init_weights(0))
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = DataLoader.from_spec(spec, build_dataset_from_spec(spec))
    tokens = spec.global_batch_size * spec.data.seq_len
    start = None
    for k in range(1, spec.train.steps + 1):
        if k == warmup + 1:
            start = time.perf_counter()
        batch = loader.batch_for_step(k)
        for ids, labels in batch.microbatches:
            loss = model(input_ids=ids, labels=labels).loss
            (loss * count_label_tokens(labels) / batch.num_label_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert start is not None
    return tokens * (spec.train.steps - warmup) / (time.perf_counter() - start)


def runtime(spec: JobSpec, workers: int, threads_each: int, warmup: int, root: Path) -> float:
    arena_dir = Path(tempfile.mkdtemp(prefix="rp-bench-", dir="/dev/shm"))
    address = f"ipc://{root}/bench-{workers}.sock"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_each))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "roundpipe.coordinator.daemon",
                "--address",
                address,
                "--state-dir",
                str(root / f"state{workers}"),
                "--arena-dir",
                str(arena_dir),
                "--log-level",
                "WARNING",
            ],
            env=env,
        )
    ]
    for i in range(workers):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roundpipe.worker.daemon",
                    "--cpu",
                    "--threads",
                    str(threads_each),
                    "--coordinator",
                    address,
                    "--name",
                    f"bench{i}",
                    "--log-level",
                    "WARNING",
                ],
                env=env,
            )
        )
    try:
        with Client(address, timeout_s=30) as client:
            deadline = time.monotonic() + 120
            while len(client.workers()) < workers:
                if time.monotonic() > deadline:
                    raise RuntimeError("workers did not connect")
                time.sleep(0.2)
            job = client.submit(spec)
            events = list(job.progress(timeout_s=3600))
            status = job.wait(timeout_s=600)
            if status.state != "succeeded":
                raise RuntimeError(f"benchmark job {status.state}: {status.message}")
        timed = [e for e in events if e.step > warmup]
        first = next(e for e in events if e.step == warmup)
        seconds = timed[-1].time - first.time
        tokens = spec.global_batch_size * spec.data.seq_len * len(timed)
        return tokens / seconds
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in arena_dir.iterdir():
            f.unlink()
        arena_dir.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="total compute threads")
    parser.add_argument("--microbatches", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rp-bench-"))
    spec = make_spec(args.steps, args.microbatches, root / "out")
    plain = plain_loop(spec, args.warmup, args.threads)
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
