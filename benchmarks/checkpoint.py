"""What checkpoints cost a running job (issue 25): background against drained writes.

One Qwen3-shaped full fine-tuning job (fp32, AdamW, staleness 1) through real daemons
(one LocalCluster, job after job) on CPU workers, three ways, interleaved ``--repeats``
times:

  none        no checkpoint in the timed steps
  background  a checkpoint every ``--every`` steps, written by the background writer
              (``output.checkpoint_staging: auto``; Note [background checkpoint])
  drained     the same checkpoints with ``checkpoint_staging: 0``: the pipeline drains
              and the write is on the critical path (what every checkpoint did before)

and, first, the output file system's sequential write bandwidth (``--disk-bytes`` written
in 4 MiB pieces, then fsync).

For each way: seconds per step (mean over the steps after ``--warmup``), seconds lost per
checkpoint (the timed steps' total minus the none run's, per checkpoint in them), that
as a fraction of a step, bytes per checkpoint, the writer's bandwidth (bytes / the
seconds from start of a write to ``latest`` moved, from the job log) against the disk's,
and the coordinator's CPU seconds per checkpoint (its process's user + system time over
the timed steps, minus the none run's, per checkpoint in them). Where the workers keep
every core busy (CPU workers on a small machine), the writer's CPU time comes out of
theirs: the stall is then about that CPU time over the cores, whatever the overlap; on
a GPU host the workers' compute is on the GPUs and the writer has cores of its own.

Last line ``RESULT checkpoint_stall_steps=<background: lost seconds per checkpoint / step
seconds> write_vs_disk=<background write bandwidth / disk bandwidth>``.

The default model has ~50M parameters (hidden 768, 8 layers): the shared 2-core, 23 GiB
development machine cannot hold a few hundred million with two workers beside other
work; ``--hidden 1536 --layers 12`` gives ~350M where memory allows.

Usage: python benchmarks/checkpoint.py [--hidden 768] [--layers 8] [--steps 14]
       [--warmup 2] [--every 2] [--repeats 1] [--workers 2] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from common import demo_data_spec, run_job, runtime_cluster

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import spec_read_dirs

MODES = ("none", "background", "drained")
_WRITTEN = re.compile(r"checkpoint step (\d+) written to \S+ in ([0-9.]+)s")


def model_config(hidden: int, layers: int) -> dict:
    heads = max(1, hidden // 64)
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 64 * 64 or 64,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64 if hidden >= 64 else hidden,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    }


def disk_write_bandwidth(directory: Path, nbytes: int) -> float:
    """Bytes/s of a sequential write of ``nbytes`` into ``directory``, fsync included."""
    path = directory / f".disk-probe-{os.getpid()}"
    piece = os.urandom(4 << 20)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, piece)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    path.unlink()
    return written / elapsed


def job_spec(args, out: Path, mode: str) -> JobSpec:
    output = {"keep_last": 1}
    if mode != "none":
        output["checkpoint_every"] = args.every
        output["checkpoint_staging"] = "auto" if mode == "background" else 0
    return demo_data_spec(
        model_config(args.hidden, args.layers),
        out,
        steps=args.steps,
        seq_len=args.seq_len,
        microbatch_size=args.rows,
        num_microbatches=args.microbatches,
        output=output,
    )


def checkpoint_bytes(out: Path) -> int:
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    if not ckpts:
        return 0
    return sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file())


def write_seconds(job_log: Path) -> list[float]:
    """Seconds each checkpoint's write took, from the job's log."""
    return [float(m.group(2)) for m in _WRITTEN.finditer(job_log.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="microbatch size")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--disk-bytes", type=float, default=1 << 30)
    parser.add_argument("--output", type=Path, default=None, help="where jobs write (a disk)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    args = parser.parse_args()
    if args.smoke:
        # Narrower and shorter, but the default's 8 layers (shared gradient slots, Note
        # [gradient buffer]) and a width at which the planner still picks the default's
        # plan shape for 2 workers (three backward stages; at hidden 64 it picks two).
        args.hidden, args.steps, args.warmup = 128, 7, 1
        args.seq_len, args.disk_bytes = 32, 16 << 20
    base = Path(tempfile.mkdtemp(prefix="rp-bench-ckpt-", dir=args.output))
    try:
        disk_bps = disk_write_bandwidth(base, int(args.disk_bytes))
        stop_after = args.steps - 1  # cancel before the final checkpoint
        step_s: dict[str, list[float]] = {m: [] for m in MODES}
        sizes: dict[str, int] = {}
        writes: dict[str, list[float]] = {m: [] for m in MODES}
        cpu_s: dict[str, float] = {m: 0.0 for m in MODES}  # the coordinator's, per run
        plan = ""
        # One cluster runs every job in turn (workers are stateless; each job's warm-up
        # steps come before its timed ones).
        with runtime_cluster(
            [["--cpu", "--threads", "1"]] * args.workers,
            root=base / "cluster",
            coordinator_threads=1,
            env={"OMP_NUM_THREADS": "1"},
            coordinator_args=["--log-level", "INFO"],
            allow_read=spec_read_dirs(job_spec(args, base, "none")),
            allow_write=[base],
        ) as cluster:
            coordinator = psutil.Process(cluster.coordinator.proc.pid)
            for r in range(args.repeats):
                for mode in MODES:  # interleaved: a change in load hits all alike
                    out = base / f"{mode}-{r}" / "out"
                    cpu_at: dict[int, float] = {}  # over the timed steps, as their times

                    def sample(event, cpu_at=cpu_at) -> None:
                        if event.step in (args.warmup, stop_after):
                            cpu_at[event.step] = _cpu_s(coordinator)

                    run = run_job(
                        cluster,
                        job_spec(args, out, mode),
                        warmup=args.warmup,
                        stop_after=stop_after,
                        on_progress=sample,
                    )
                    cpu_s[mode] += (cpu_at[stop_after] - cpu_at[args.warmup]) / args.repeats
                    plan = run.plan
                    step_s[mode] += run.step_s
                    sizes[mode] = max(sizes.get(mode, 0), checkpoint_bytes(out))
                    writes[mode] += write_seconds(run.job_log)
                    shutil.rmtree(out.parent, ignore_errors=True)
        timed = range(args.warmup + 1, stop_after + 1)  # the steps run_job times
        per_run = sum(1 for k in timed if k % args.every == 0)
        none_total = sum(step_s["none"]) / args.repeats
        step = statistics.mean(step_s["none"])
        params = _param_count(job_spec(args, base / "count", "none"))
        print(f"# model: {params / 1e6:.1f}M parameters, plan {plan}, {args.workers} CPU workers")
        print(f"# disk: sequential write {disk_bps / 1e6:.0f} MB/s ({args.disk_bytes:.0f} bytes)")
        print(f"# {psutil.cpu_count()} cores for the coordinator and the {args.workers} workers")
        print(
            f"# checkpoints every {args.every} steps: {per_run} in each run's timed steps "
            f"{timed.start}..{timed.stop - 1}"
        )
        print(
            f"{'mode':11} {'s/step':>8} {'steps/s':>8} {'lost s/ckpt':>12} {'/ step':>7} "
            f"{'MB/ckpt':>8} {'write s':>8} {'MB/s':>7} {'vs disk':>7} {'CPU s/ckpt':>10}"
        )
        results: dict[str, tuple[float, float]] = {}
        for mode in MODES:
            mean = statistics.mean(step_s[mode])
            total = sum(step_s[mode]) / args.repeats
            lost = (total - none_total) / per_run if mode != "none" and per_run else 0.0
            size = sizes.get(mode, 0)
            write_s = statistics.mean(writes[mode]) if writes[mode] else float("nan")
            bandwidth = size / write_s if writes[mode] else float("nan")
            results[mode] = (lost / step, bandwidth / disk_bps)
            if mode == "none":  # no checkpoint in its timed steps
                print(f"{mode:11} {mean:8.3f} {1 / mean:8.3f} {'-':>12} {'-':>7}")
                continue
            ckpt_cpu = (cpu_s[mode] - cpu_s["none"]) / per_run if per_run else float("nan")
            print(
                f"{mode:11} {mean:8.3f} {1 / mean:8.3f} {lost:12.3f} {lost / step:7.2f} "
                f"{size / 1e6:8.1f} {write_s:8.2f} {bandwidth / 1e6:7.0f} "
                f"{bandwidth / disk_bps:7.2f} {ckpt_cpu:10.2f}"
            )
        stall, vs_disk = results["background"]
        print(f"RESULT checkpoint_stall_steps={stall:.3f} write_vs_disk={vs_disk:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _cpu_s(process: psutil.Process) -> float:
    """User + system seconds of ``process`` (every thread) so far."""
    times = process.cpu_times()
    return times.user + times.system


def _param_count(spec: JobSpec) -> int:
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec
    from roundpipe.shared.model import LayeredModel

    return LayeredModel(model_config_from_spec(spec.model)).parameter_count()


if __name__ == "__main__":
    main()
