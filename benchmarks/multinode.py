"""Data parallelism across coordinators on this machine (issue 21, docs/multi-node.md).

Runs the same per-node work twice, side by side: one coordinator with one CPU worker and
a global batch of M microbatches, then two coordinators (a gloo group over loopback), each
with one CPU worker, and a global batch of 2M (each node trains M). Reports the step time
of each, the step-time ratio (1.0 = perfect weak scaling), and the gradient all-reduce
time per step against the bytes reduced (from rank 0's log; it includes waiting for the
slower node). On one machine the two nodes share its cores, so the ratio mostly measures
that contention; the all-reduce figures are the loopback cost of gloo.

Usage: python benchmarks/multinode.py [--steps 8] [--hidden 256] [--layers 4] [--smoke]

Last line: ``RESULT step_ratio=<2-node step s / 1-node step s>
allreduce_gbps=<bytes reduced per step / all-reduce s per step, GB/s>``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import demo_data_spec  # benchmarks/ is on sys.path

from roundpipe.cluster import cpu_cluster, local_group

_ALLREDUCE = re.compile(r"all-reduce: (\d+) bytes of gradients per step, ([0-9.]+)s per step")


def step_time(events) -> float:
    """Median seconds between consecutive steps after the first (warm-up)."""
    times = [e.time for e in events]
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return statistics.median(gaps) if gaps else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2, help="per node")
    parser.add_argument("--smoke", action="store_true", help="tiny and quick (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.hidden = 4, 64  # the default's 4 layers, narrower and shorter
    config = {
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": args.hidden // 4,
        "vocab_size": 512,
        "max_position_embeddings": 256,
    }
    root = Path(tempfile.mkdtemp(prefix="rp-bench-multinode-"))
    for name in ("ROUNDPIPE_ALLOW_READ", "ROUNDPIPE_ALLOW_WRITE"):  # the coordinators' roots
        os.environ[name] = ":".join(filter(None, (os.environ.get(name), str(root))))
    rows = []
    try:
        m = args.microbatches

        def spec(name: str, nodes: int):
            return demo_data_spec(
                config,
                root / name,
                steps=args.steps,
                seq_len=64,
                microbatch_size=2,
                num_microbatches=m * nodes,
            )

        with cpu_cluster(root / "one", "bench-mn1", num_workers=1) as one:
            handle = one.client.submit(spec("one", 1))
            events = list(handle.progress(timeout_s=600))
            assert handle.wait(timeout_s=60).state == "succeeded", one.logs()
        rows.append(("1 node", m, step_time(events), float("nan"), 0))
        with local_group(root / "two", "bench-mn2") as (rank0, _rank1):
            handle = rank0.client.submit(spec("two", 2))
            events = list(handle.progress(timeout_s=600))
            assert handle.wait(timeout_s=60).state == "succeeded", rank0.logs()
            found = _ALLREDUCE.findall(rank0.coordinator.log_path.read_text())
        nbytes, reduce_s = (int(found[-1][0]), float(found[-1][1])) if found else (0, float("nan"))
        rows.append(("2 nodes", 2 * m, step_time(events), reduce_s, nbytes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'setup':<8} {'global mb':>9} {'step s':>8} {'allreduce s':>11} {'bytes/step':>11}")
    for name, mbs, step_s, red_s, nbytes in rows:
        print(f"{name:<8} {mbs:>9} {step_s:>8.4f} {red_s:>11.4f} {nbytes:>11}")
    ratio = rows[1][2] / rows[0][2]
    gbps = rows[1][4] / rows[1][3] / 1e9 if rows[1][3] > 0 else float("nan")
    print(f"RESULT step_ratio={ratio:.3f} allreduce_gbps={gbps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
