"""Soak: does anything grow with steps or with jobs? (issue 15)

Real daemons (a coordinator and 2 CPU workers, as ``roundpipe.cluster.LocalCluster``
starts them). Two phases:

  long    one tiny job of ``--steps`` steps (default 10,000), checkpoints every
          ``--checkpoint-every`` steps (default 1,000), keeping the last one
  jobs    ``--jobs`` short jobs (default 50) back to back, each of a model large enough
          (~2.6M parameters, ~31 MiB of fp32 masters and AdamW moments) that a job
          keeping its state would show

A sampler thread records, every ``--every`` seconds, for the coordinator, its admission
child (spec validation) and each worker: RSS, open file descriptors, threads; and the
files and bytes in the arena directory (/dev/shm). In the jobs phase a sample is also
taken right after each job, and only those count there. Growth is the least-squares
slope after a warm-up (the first 10% of the steps; the first 5 jobs): MiB per 1,000
steps in the long phase, MiB per job in the jobs phase.

Prints a table and last ``RESULT rss_growth_mib_per_job=<x> rss_growth_mib_per_1k_steps=<y>``
(the coordinator's slopes). Target: rss_growth_mib_per_job < 1.

Usage: python benchmarks/soak.py [--steps 10000] [--jobs 50] [--every 0.5]
           [--checkpoint-every 1000]
       python benchmarks/soak.py --steps 300 --jobs 8      # a few minutes
       python benchmarks/soak.py --smoke    # under a minute: the default's paths (tests)

``--smoke`` is 150 steps with a checkpoint every 50 and 8 jobs: several checkpoints, each
replacing the last (as the default's ten do), and more jobs than the 5 warm-up ones, so
both phases' slopes are computed, as in the default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from common import demo_data_spec

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.jobspec import JobSpec

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
SHORT = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def make_spec(config: dict, steps: int, out: Path, checkpoint_every: int) -> JobSpec:
    return demo_data_spec(
        config,
        out,
        steps=steps,
        seq_len=32,
        microbatch_size=2,
        num_microbatches=2,
        output={"checkpoint_every": checkpoint_every, "keep_last": 1},
    )


@dataclass
class Sample:
    t: float
    step: int  # long phase: the job's step; jobs phase: jobs finished
    phase: str
    procs: dict[str, tuple[float, int, int]]  # name -> (rss MiB, fds, threads)
    shm_files: int
    shm_mib: float


@dataclass
class Sampler:
    cluster: LocalCluster
    every_s: float
    samples: list[Sample] = field(default_factory=list)
    phase: str = "long"
    position: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def processes(self) -> dict[str, psutil.Process]:
        procs = {"coordinator": psutil.Process(self.cluster.coordinator.proc.pid)}
        for child in procs["coordinator"].children(recursive=True):
            try:
                tracker = "resource_tracker" in " ".join(child.cmdline())
            except psutil.Error:
                continue
            # The spec-validation child (coordinator.admission) and multiprocessing's
            # resource tracker that spawning it starts.
            procs["mp-resource-tracker" if tracker else "admission-child"] = child
        for name, daemon in self.cluster.workers.items():
            procs[f"worker-{name}"] = psutil.Process(daemon.proc.pid)
        return procs

    def sample(self, phase: str | None = None) -> None:
        values = {}
        for name, proc in self.processes().items():
            try:
                with proc.oneshot():
                    values[name] = (
                        proc.memory_info().rss / 2**20,
                        proc.num_fds(),
                        proc.num_threads(),
                    )
            except psutil.Error:
                continue
        files = [p for p in self.cluster.arena_dir.iterdir() if p.is_file()]
        size = sum(p.stat().st_blocks * 512 for p in files if p.exists())
        self.samples.append(
            Sample(
                time.monotonic(),
                self.position,
                phase or self.phase,
                values,
                len(files),
                size / 2**20,
            )
        )

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sample()
            except (OSError, psutil.Error):
                pass  # a file or process went away between listing and reading

    def start(self) -> Sampler:
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than 2 distinct x)."""
    if len({x for x, _ in points}) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx


def growth(samples: list[Sample], name: str, index: int, skip_below: float, scale: float):
    pts = [
        (s.step / scale, s.procs[name][index])
        for s in samples
        if name in s.procs and s.step >= skip_below
    ]
    if not pts:
        return None, None, 0.0
    return pts[0][1], pts[-1][1], slope(pts)


def long_phase(
    cluster: LocalCluster, sampler: Sampler, steps: int, checkpoint_every: int, root: Path
) -> tuple[float, int]:
    """Run the long job; (its seconds, the checkpoints left on disk: keep_last is 1, so
    more than one means old checkpoints pile up, which is growth too)."""
    spec = make_spec(TINY, steps, root / "long", checkpoint_every=checkpoint_every)
    job = cluster.client.submit(spec)
    started = time.monotonic()
    for event in job.progress(poll_s=0.5):
        sampler.position = event.step
    status = job.wait()
    if status.state != "succeeded":
        raise SystemExit(f"the long job {status.state}: {status.message}\n{cluster.logs()}")
    return time.monotonic() - started, len(list((root / "long" / "checkpoints").glob("step-*")))


def jobs_phase(cluster: LocalCluster, sampler: Sampler, jobs: int, root: Path) -> float:
    sampler.phase = "jobs-running"  # periodic samples, inside jobs: not used for slopes
    sampler.position = 0
    started = time.monotonic()
    for i in range(jobs):
        spec = make_spec(SHORT, 2, root / f"short-{i}", checkpoint_every=0)
        status = cluster.client.submit(spec).wait()
        if status.state != "succeeded":
            raise SystemExit(f"job {i} {status.state}: {status.message}\n{cluster.logs()}")
        shutil.rmtree(root / f"short-{i}", ignore_errors=True)
        sampler.sample("jobs")  # right after the job: what it left behind
        sampler.position = i + 1
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--checkpoint-every", type=int, default=1000, help="long job's steps")
    parser.add_argument("--smoke", action="store_true", help="short, the default's paths")
    args = parser.parse_args()
    if args.smoke:
        # Shorter, not simpler: checkpoints still replace each other in the long phase
        # (150 / 50 = 3 of them), and 8 jobs leave 3 past the 5 warm-up jobs for a slope.
        args.steps, args.checkpoint_every, args.jobs = 150, 50, 8
    root = Path(tempfile.mkdtemp(prefix="rp-soak-"))
    arena_dir = Path(tempfile.mkdtemp(prefix="rp-soak-", dir="/dev/shm"))
    cluster = LocalCluster(root / "cluster", arena_dir, allow_write=[root])
    try:
        cluster.add_worker("w1")
        cluster.add_worker("w2")
        cluster.wait_for_workers(2)
        sampler = Sampler(cluster, args.every).start()
        long_s, kept = (
            long_phase(cluster, sampler, args.steps, args.checkpoint_every, root)
            if args.steps
            else (0.0, 0)
        )
        jobs_s = jobs_phase(cluster, sampler, args.jobs, root) if args.jobs else 0.0
        sampler.stop()
    finally:
        leaked = cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(arena_dir, ignore_errors=True)

    long = [s for s in sampler.samples if s.phase == "long"]
    per_job = [s for s in sampler.samples if s.phase == "jobs"]
    print(
        f"soak: {args.steps} steps (a checkpoint every {args.checkpoint_every}) in "
        f"{long_s:.0f}s, {args.jobs} jobs in {jobs_s:.0f}s "
        f"({len(sampler.samples)} samples, pid {os.getpid()}); {kept} checkpoint(s) of the "
        "long job on disk at its end (keep_last 1)"
    )
    print(
        f"{'process':<28} {'metric':<8} {'long: first':>11} {'last':>8} {'/1k steps':>10} "
        f"{'jobs: first':>11} {'last':>8} {'/job':>8}"
    )
    names = sorted({n for s in sampler.samples for n in s.procs})
    results: dict[str, float] = {}
    for name in names:
        for index, metric in enumerate(("rss MiB", "fds", "threads")):
            a0, a1, a_slope = growth(long, name, index, 0.1 * args.steps, 1000.0)
            b0, b1, b_slope = growth(per_job, name, index, 5, 1.0)
            cells = [
                "-" if v is None else f"{v:.1f}" for v in (a0, a1, a_slope * 1.0, b0, b1, b_slope)
            ]
            if a0 is None:
                cells[2] = "-"
            if b0 is None:
                cells[5] = "-"
            print(
                f"{name:<28} {metric:<8} {cells[0]:>11} {cells[1]:>8} {cells[2]:>10} "
                f"{cells[3]:>11} {cells[4]:>8} {cells[5]:>8}"
            )
            if name == "coordinator" and index == 0:
                results["rss_growth_mib_per_1k_steps"] = a_slope
                results["rss_growth_mib_per_job"] = b_slope
    shm = [(s.shm_files, s.shm_mib) for s in sampler.samples]
    print(
        f"/dev/shm arenas: at most {max(f for f, _ in shm)} files / {max(m for _, m in shm):.1f}"
        f" MiB during jobs; {shm[-1][0]} files at the end; after stop: {len(leaked)} left"
    )
    print(
        f"RESULT rss_growth_mib_per_job={results.get('rss_growth_mib_per_job', 0.0):.3f} "
        f"rss_growth_mib_per_1k_steps={results.get('rss_growth_mib_per_1k_steps', 0.0):.3f}"
    )


if __name__ == "__main__":
    main()
