"""Data parallelism across coordinators on this machine (issues 21 and 38,
docs/multi-node.md).

Runs the same per-node work on W = 1, 2 and 3 nodes (coordinators, each with one CPU
worker, a gloo group over loopback for W > 1; the global batch is W x M microbatches),
in bf16, with the optimizer state replicated and sharded (``train.optimizer_sharding``), and at
W = 2 once more with the gradients sent in bfloat16 (``train.grad_transport``). Reports
per run: the step time, the gradient reduction (all-reduce or reduce-scatter) seconds
and bytes per step, the bytes all-gathered per step (sharded), the host bytes per node
(rank 0's arenas plus its fp32 masters and AdamW moments), and the step time that
``roundpipe plan``'s data-parallel model predicts from its two inputs, measured here:

- the one-node step *as a node of W gets it on this machine*: W independent one-node
  clusters run the one-node job at the same time (no group, no collectives). On one
  machine the W nodes share its cores, which real servers do not; measuring the one-node
  step under the same sharing leaves the model's own term, the traffic, to be checked;
- the loopback bandwidth: a gloo all-reduce of the model's gradient bytes between two
  processes, nothing else running (``--network-bandwidth``).

The workers are CPU workers on one host: the collectives move their bytes on the cores
the workers compute on, so the prediction is the one for that case
(``--collectives-share-cores``: the one-node step plus the network time).

Usage: python benchmarks/multinode.py [--steps 8] [--hidden 256] [--layers 4]
       [--nodes 1,2,3] [--grad-bucket-mb MiB] [--smoke]

Last line: ``RESULT sharded_host_ratio=<sharded / replicated host bytes per node at W=2>
bitwise_equal=<1 if every sharded model equals its replicated one bit for bit>
plan_error=<max |predicted / measured step - 1| over the runs with W > 1>``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import demo_data_spec  # benchmarks/ is on sys.path
from safetensors.torch import load_file

from roundpipe.cluster import cpu_cluster, local_group
from roundpipe.coordinator.planning.data_parallel import predict_data_parallel
from roundpipe.coordinator.training.hold_point import hold_env

_REDUCED = r"job {} (all-reduce|reduce-scatter): (\d+) bytes of gradients per step, ([0-9.]+)s"
_GATHERED = re.compile(r"all-gather: (\d+) bytes of weights per step")
_ARENAS = re.compile(r"\[layout\] \d+ arenas, ([0-9.]+) MiB")
_HELD = re.compile(r"holds the masters and moments of (\d+) of (\d+) trainable elements")


def step_time(events) -> float:
    """Median seconds between consecutive steps after the first (warm-up)."""
    times = [e.time for e in events]
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return statistics.median(gaps) if gaps else float("nan")


def job_log(root: Path, job_id: str) -> str:
    """Rank 0's log of one job (STATE_DIR/jobs/JOB/job.log)."""
    logs = sorted(root.rglob(f"jobs/{job_id}/job.log"))
    return logs[0].read_text() if logs else ""


def _allreduce_rank(rank: int, world: int, port: int, numel: int, reps: int, out) -> None:
    """One process of ``loopback_bandwidth``: ``reps`` timed all-reduces after a warm-up."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    buf = torch.ones(numel)
    dist.all_reduce(buf)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(buf)
    if rank == 0:
        out.put((time.perf_counter() - start) / reps)
    dist.destroy_process_group()


def loopback_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes per second one node sends (and receives) in a gloo ring all-reduce of
    ``nbytes`` fp32 between two processes on this machine: 2 (W-1)/W x bytes / time, the
    ``--network-bandwidth`` that ``predict_data_parallel`` takes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, 2, port, nbytes // 4, reps, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    seconds = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return nbytes / seconds  # 2 (W-1)/W = 1 at W = 2


HOLD_STEP = 3
"""The concurrent runs wait before this iteration until every cluster has reached it."""


def concurrent_one_node_step(nodes: int, spec_for, root: Path) -> float:
    """The one-node job's step time while ``nodes`` independent one-node clusters run it
    at once (the share of this machine each node of a ``nodes``-node group gets). The
    clusters start seconds apart, so each job is held before iteration HOLD_STEP
    (ROUNDPIPE_TRAIN_HOLD) until every one has got there, then all are let go at once:
    the median over the steps after that, up to the first cluster's end."""
    runs: list[list[tuple[int, float]]] = [[] for _ in range(nodes)]  # (step, time)
    ready = [threading.Event() for _ in range(nodes)]
    go = root / "go"
    with contextlib.ExitStack() as stack:
        hold = hold_env(HOLD_STEP, go)
        clusters = [
            stack.enter_context(
                cpu_cluster(root / f"c{nodes}-{i}", f"bench-c{i}", num_workers=1, env=hold)
            )
            for i in range(nodes)
        ]
        handles = [c.client.submit(spec_for(f"c{nodes}-{i}")) for i, c in enumerate(clusters)]

        def follow(i: int) -> None:
            for e in handles[i].progress(timeout_s=1200):
                runs[i].append((e.step, e.time))
                if e.step == HOLD_STEP - 1:
                    ready[i].set()
            ready[i].set()  # ended (or failed) early: do not hold the others

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(nodes)]
        for t in threads:
            t.start()
        for event in ready:
            event.wait(timeout=1200)
        go.touch()
        for t in threads:
            t.join()
        for c, h in zip(clusters, handles):
            assert h.wait(timeout_s=60).state == "succeeded", c.logs()
    end = min(run[-1][1] for run in runs)  # before any cluster finished
    # From the gap after the first step that began once all were let go.
    shared = [
        b - a for run in runs for (k, a), (_, b) in zip(run, run[1:]) if k > HOLD_STEP and b <= end
    ]
    assert len(shared) >= 2 * nodes, f"too few concurrent steps to measure: {runs}"
    return statistics.median(shared)


def model_tensors(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2, help="per node")
    parser.add_argument("--nodes", default="1,2,3", help="node counts to run")
    parser.add_argument(
        "--grad-bucket-mb",
        type=float,
        default=None,
        help="the jobs' train.grad_bucket_mb (default: the job spec's default)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny and quick (tests)")
    args = parser.parse_args()
    if args.smoke:  # the default's runs, narrower, shorter, on 1 and 2 nodes
        args.steps, args.hidden, args.nodes = 4, 64, "1,2"
    node_counts = sorted({int(n) for n in args.nodes.split(",")} | {1, 2})
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
    m = args.microbatches
    bucket = {} if args.grad_bucket_mb is None else {"grad_bucket_mb": args.grad_bucket_mb}
    runs: dict[tuple[int, str], dict] = {}
    try:

        def spec(name: str, nodes: int, steps: int = args.steps, **train):
            return demo_data_spec(
                config,
                root / name,
                steps=steps,
                seq_len=64,
                microbatch_size=2,
                num_microbatches=m * nodes,
                # bf16 weight copies, as jobs have them by default (the arenas' share of
                # the host bytes per node is then that of a real job)
                train={"dtype": "bfloat16", **bucket, **train},
            )

        def record(key, handle, events, logs_root: Path, out: Path) -> None:
            text = job_log(logs_root, handle.job_id)
            # The reducer thread logs into the coordinator's log only.
            log_path = logs_root / "coordinator.log"
            whole = log_path.read_text() if log_path.exists() else ""
            reduced = re.findall(_REDUCED.format(re.escape(handle.job_id)), whole)
            gathered = _GATHERED.findall(text)
            arenas = _ARENAS.findall(text)
            held = _HELD.findall(text)
            runs[key] = {
                "step_s": step_time(events),
                "losses": [e.loss for e in events],
                "reduce_s": float(reduced[-1][2]) if reduced else float("nan"),
                "reduce_bytes": int(reduced[-1][1]) if reduced else 0,
                "gather_bytes": int(gathered[-1]) if gathered else 0,
                "arena_bytes": float(arenas[-1]) * 2**20 if arenas else float("nan"),
                "held": int(held[-1][0]) if held else None,
                "trainable": int(held[-1][1]) if held else None,
                "model": model_tensors(out),
            }

        with cpu_cluster(root / "w1", "bench-mn1", num_workers=1) as one:
            handle = one.client.submit(spec("w1", 1))
            events = list(handle.progress(timeout_s=1200))
            assert handle.wait(timeout_s=60).state == "succeeded", one.logs()
            record((1, "replicated"), handle, events, root / "w1", root / "w1")
        # The model's inputs, measured: the one-node step as W nodes share this machine,
        # and the loopback bandwidth (module docstring).
        shared_step = {1: runs[(1, "replicated")]["step_s"]}
        for w in [n for n in node_counts if n > 1]:
            shared_step[w] = concurrent_one_node_step(
                w, lambda name: spec(name, 1, steps=3 * args.steps), root / f"shared{w}"
            )
        for w in [n for n in node_counts if n > 1]:
            modes = ["replicated", "sharded"] + (["bf16"] if w == 2 else [])
            # Several coordinators starting at once on a busy machine answer late.
            with local_group(
                root / f"g{w}", f"bench-mn{w}", num_nodes=w, client_timeout_s=180
            ) as nodes:
                for mode in modes:
                    train = (  # bf16: against the replicated fp32 run, as documented
                        {"grad_transport": "bfloat16", "optimizer_sharding": "replicated"}
                        if mode == "bf16"
                        else {"optimizer_sharding": mode}
                    )
                    handle = nodes[0].client.submit(spec(f"w{w}-{mode}", w, **train))
                    events = list(handle.progress(timeout_s=1200))
                    assert handle.wait(timeout_s=60).state == "succeeded", nodes[0].logs()
                    logs_root = root / f"g{w}" / "node0"
                    record((w, mode), handle, events, logs_root, root / f"w{w}-{mode}")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    one = runs[(1, "replicated")]
    trainable = runs[(2, "replicated")]["trainable"]
    one["held"] = one["trainable"] = trainable
    bandwidth = loopback_bandwidth(runs[(2, "replicated")]["reduce_bytes"])
    print(
        f"{'nodes':>5} {'mode':<10} {'step s':>8} {'pred s':>8} {'reduce s':>9} "
        f"{'reduce B':>10} {'gather B':>10} {'host MiB':>9}"
    )
    errors, equal = [], True
    for (w, mode), r in sorted(runs.items()):
        r["host"] = r["arena_bytes"] + 12 * (r["held"] or 0)
        predicted = float("nan")
        if w > 1 and bandwidth > 0 and mode != "bf16":
            p = predict_data_parallel(
                iteration_s=shared_step[w],
                tokens_per_iteration=1,
                trainable_params=trainable,
                nodes=w,
                bandwidth_bytes_per_s=bandwidth,
                staleness=1,
                sharded=mode == "sharded",
                # CPU workers on one host: loopback moves the bytes on their cores.
                shared_cores=True,
            )
            predicted = p.step_s
            errors.append(abs(predicted / r["step_s"] - 1))
        if mode == "sharded":
            replicated = runs[(w, "replicated")]["model"]
            equal &= all(torch.equal(replicated[k], r["model"][k]) for k in replicated)
        print(
            f"{w:>5} {mode:<10} {r['step_s']:>8.4f} {predicted:>8.4f} {r['reduce_s']:>9.4f} "
            f"{r['reduce_bytes']:>10} {r['gather_bytes']:>10} {r['host'] / 2**20:>9.2f}"
        )
    print(
        f"loopback bandwidth (a 2-process gloo all-reduce, per direction): "
        f"{bandwidth / 1e9:.3f} GB/s; one-node step with W nodes sharing this machine: "
        + ", ".join(f"W={w} {s:.4f}s" for w, s in sorted(shared_step.items()))
    )
    fp32, bf16 = runs[(2, "replicated")], runs[(2, "bf16")]
    loss_diff = max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"]))
    worst = max(
        ((bf16["model"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
        for k, v in fp32["model"].items()
    )
    print(
        f"bf16 gradient transport vs fp32 (2 nodes, {args.steps} steps): max |loss diff| "
        f"{loss_diff:.3g}, largest relative weight difference {worst:.3g}, "
        f"bytes {bf16['reduce_bytes']} vs {fp32['reduce_bytes']}"
    )
    ratio = runs[(2, "sharded")]["host"] / runs[(2, "replicated")]["host"]
    plan_error = max(errors) if errors else float("nan")
    print(
        f"RESULT sharded_host_ratio={ratio:.3f} bitwise_equal={int(equal)} "
        f"plan_error={plan_error:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
