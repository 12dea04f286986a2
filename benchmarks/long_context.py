"""The longest sequence that trains on CPU workers under a per-worker memory cap, against
the planner's prediction for the same cap (issue 36).

A coordinator and two CPU workers run as real daemons (``LocalCluster``); each worker is
started with ``--memory-limit CAP`` (Note [CPU memory cap]: RLIMIT_DATA on its private
memory, so a task past the cap fails at once, its error naming the cap). Jobs of one row
per microbatch, two microbatches, fp32, a Qwen3-shaped model and rows of packed demo
documents run with a pinned plan of the shape a long sequence gets (a forward stage of
the embedding and all decoder layers but the last, the tail, and one backward stage at
layer grain: Note [recompute grain]). The long-row attention (Note [long-row attention])
and the sequence-chunked MLP (Note [sequence-chunked MLP]) are on from 4,096 tokens.

1. Sequence lengths double from 512 while a job trains (two steps: the second one
   timed, for the tokens/s table); a sampler keeps each worker's peak private memory
   (RssAnon, and VmData, what the cap counts).
2. Between the longest that trained and the first that failed, a bisection (one step
   per try) finds the longest that trains, to ``--resolution`` tokens. Every failure
   must be the loud one (the job's error names the cap); anything else stops the run.
3. The planner predicts the same: ``longest_sequence`` for the pinned plan on
   ``cpu_hardware`` with the cap, and the workers' own memory between jobs (measured
   after the first job: interpreter, torch, threads) as the reserve. Each row of the
   table shows the planner's per-worker figure next to the measured peaks.

Usage::

    python benchmarks/long_context.py           # cap 1 GiB: ~20 min on 2 shared cores
    python benchmarks/long_context.py --smoke   # the same paths, cap 500 MiB, coarse

Last line: ``RESULT max_seq_tokens=<n> predicted_over_measured=<planner / measured>``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import demo_data_spec  # benchmarks/ is on sys.path

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.hardware import cpu_hardware
from roundpipe.coordinator.planning.search import evaluate_plan
from roundpipe.coordinator.planning.sequence import longest_sequence
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.spec.paths import spec_read_dirs
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import MiB, format_bytes, parse_quantity

# Qwen3's shape (grouped-query attention, head_dim apart from hidden / heads, q/k norms,
# SwiGLU at 3x), narrow enough that a 32K-token step takes seconds on one core.
CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)
PLAN = "F[0:4] T[4:6] B[0:4]"
MICROBATCHES = 2
WORKERS = 2
SIZES = {
    # cap per worker, first length, resolution of the bisection (tokens)
    "default": dict(cap="1GiB", start=512, resolution=1024),
    "smoke": dict(cap="500MiB", start=2048, resolution=4096),
}


def make_spec(out: Path, seq_len: int, steps: int) -> JobSpec:
    return demo_data_spec(
        CONFIG,
        out,
        steps=steps,
        seq_len=seq_len,
        microbatch_size=1,
        num_microbatches=MICROBATCHES,
        staleness=1,
        train={"plan": PLAN, "recompute": "layer"},
        output={"checkpoint_every": 0},
    )


def _status(pid: int) -> tuple[int, int]:
    """(RssAnon, VmData) of ``pid`` in bytes (zeros once it is gone)."""
    found = {"RssAnon:": 0, "VmData:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0] + ":"
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found["RssAnon:"], found["VmData:"]


class Sampler:
    """Peaks of each worker's RssAnon and VmData, polled every few milliseconds."""

    def __init__(self, pids: list[int], period_s: float = 0.005) -> None:
        self.pids, self.period_s = pids, period_s
        self.rss = dict.fromkeys(pids, 0)
        self.data = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for pid in self.pids:
                rss, data = _status(pid)
                self.rss[pid] = max(self.rss[pid], rss)
                self.data[pid] = max(self.data[pid], data)


class Bench:
    def __init__(self, root: Path, cap: int) -> None:
        self.root, self.cap = root, cap
        self.arena_dir = Path(tempfile.mkdtemp(prefix="rp-long-", dir="/dev/shm"))
        spec = make_spec(root / "out", 512, 1)
        self.cluster = LocalCluster(
            root / "cluster",
            self.arena_dir,
            # A task of a long row on a shared 2-core machine can take minutes: the
            # progress deadline's default floor (60 s) would fence the worker running it.
            coordinator_args=[
                "--threads",
                "1",
                "--log-level",
                "WARNING",
                "--task-deadline",
                "1800",
            ],
            client_timeout_s=120,
            allow_read=spec_read_dirs(spec),
            allow_write=[root],
        )
        device = ["--cpu", "--threads", "1", "--memory-limit", str(cap)]
        # Started afresh, not forked: a forked worker's VmData (what the cap counts) and
        # RSS would include what the fork server imported for the coordinator.
        self.workers = [
            self.cluster.add_worker(f"w{i}", device=device, fork=False) for i in range(WORKERS)
        ]
        self.cluster.wait_for_workers(WORKERS, timeout_s=300)
        self.pids = [w.proc.pid for w in self.workers]
        self.runs = 0

    def close(self) -> None:
        self.cluster.stop(timeout_s=60)
        shutil.rmtree(self.arena_dir, ignore_errors=True)

    def idle_private(self) -> int:
        """The largest VmData of a worker between jobs (what the cap counts)."""
        return max(_status(pid)[1] for pid in self.pids)

    def run(self, seq_len: int, steps: int) -> dict:
        """One job; {ok, tokens_per_s (steps >= 2), rss, data, error}."""
        self.runs += 1
        spec = make_spec(self.root / f"out{self.runs}", seq_len, steps)
        with Sampler(self.pids) as sampler:
            job = self.cluster.client.submit(spec)
            times = {e.step: e.time for e in job.progress(timeout_s=3600)}
            status = job.wait(timeout_s=600)
        for w in self.workers:
            if not w.alive():
                raise RuntimeError(f"worker {w.name} died at {seq_len} tokens:\n{w.tail()}")
        out = dict(
            ok=status.state == "succeeded",
            rss=max(sampler.rss.values()),
            data=max(sampler.data.values()),
            error=status.message or "",
            tokens_per_s=None,
        )
        if out["ok"] and steps >= 2 and 1 in times and 2 in times:
            out["tokens_per_s"] = MICROBATCHES * seq_len / (times[2] - times[1])
        if not out["ok"] and "memory cap" not in out["error"]:
            raise RuntimeError(
                f"the job at {seq_len} tokens failed, but not naming the cap: {out['error']}"
            )
        return out


def predicted(cap: int, reserve: int, seq_len: int | None = None) -> tuple[int, int]:
    """(the planner's longest sequence under ``cap``, its per-worker memory at
    ``seq_len``: the fullest worker, reserve included)."""
    model = LayeredModel(model_config_from_spec(make_spec(Path("unused"), 512, 1).model))
    hw = cpu_hardware(WORKERS, memory_limit_bytes=cap, reserved_bytes=reserve)
    plan = Plan.parse(PLAN)

    def costs_for(n: int):
        return estimate_costs(
            model,
            microbatch_rows=1,
            seq_len=n,
            compute_dtype="float32",
            flops_per_s=2e10,
            on_gpu=False,  # CPU workers
        )

    fit = longest_sequence(
        costs_for, hw, MICROBATCHES, rows=1, lo=2, hi=1 << 20, recompute="layer", plan=plan
    )
    best = fit.seq_len if fit is not None else 0
    need = 0
    if seq_len is not None:
        result = evaluate_plan(plan, costs_for(seq_len), hw, MICROBATCHES, recompute="layer")
        need = max(result.per_worker_memory)
    return best, need


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the same paths under a small cap")
    p.add_argument("--cap", default=None, help="per-worker memory cap (default per size)")
    p.add_argument("--resolution", type=int, default=None, help="bisection step, tokens")
    p.add_argument("--keep", default=None, help="keep the runs' files in this directory")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "default"]
    cap = int(parse_quantity(args.cap or size["cap"], what="--cap"))
    resolution = args.resolution or size["resolution"]
    root = Path(args.keep or tempfile.mkdtemp(prefix="rp-long-"))
    started = time.perf_counter()
    print(
        f"CPU workers: {WORKERS} x 1 thread, --memory-limit {format_bytes(cap)} each; "
        f"qwen3 {CONFIG['num_hidden_layers']} layers hidden {CONFIG['hidden_size']}, "
        f"plan {PLAN}, recompute layer, {MICROBATCHES} microbatches of 1 row, fp32",
        flush=True,
    )
    bench = Bench(root, cap)
    rows: list[tuple[int, dict]] = []
    try:
        seq, good, bad = size["start"], 0, None
        reserve = None
        while bad is None:
            r = bench.run(seq, steps=2)
            if reserve is None:
                reserve = bench.idle_private()
            rows.append((seq, r))
            if r["ok"]:
                good, seq = seq, seq * 2
            else:
                bad = seq
        if good == 0:
            raise RuntimeError(f"not even {seq} tokens train under {format_bytes(cap)}")
        while bad - good > resolution:
            mid = (good + bad) // 2 // 256 * 256
            r = bench.run(mid, steps=1)
            rows.append((mid, r))
            if r["ok"]:
                good = mid
            else:
                bad = mid
    finally:
        bench.close()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    assert reserve is not None
    best, _ = predicted(cap, reserve)
    print(f"worker memory between jobs (the planner's reserve): {format_bytes(reserve)}")
    print(
        f"{'tokens':>8} {'trains':>6} {'tokens/s':>9} {'peak RssAnon':>13} "
        f"{'peak VmData':>12} {'planner':>10} {'RSS/planner':>11}"
    )
    for seq, r in sorted(rows):
        _, need = predicted(cap, reserve, seq)
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(
            f"{seq:>8} {'yes' if r['ok'] else 'CAP':>6} {tps:>9} "
            f"{r['rss'] / MiB:>9.0f} MiB {r['data'] / MiB:>8.0f} MiB "
            f"{need / MiB:>6.0f} MiB {r['rss'] / need:>11.3f}"
        )
    failures = [r["error"] for _, r in rows if not r["ok"]]
    if failures:
        print(f"an over-cap run fails with: {failures[0][:300]}")
    print(f"planner's longest sequence under the cap: {best:,} tokens; measured: {good:,}")
    print(f"({time.perf_counter() - started:.0f} s)")
    print(f"RESULT max_seq_tokens={good} predicted_over_measured={best / good:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
