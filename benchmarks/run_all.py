"""Every benchmark's documented default command, each under a time limit, in one table.

Runs the scripts of docs/benchmarks.md one after another (never side by side: they time
themselves), each as its own process with its documented default arguments, and keeps
each one's last ``RESULT key=value ...`` line. A benchmark that fails, runs past its
limit or prints no RESULT line is a row saying so; the others still run. Benchmarks
whose default needs a GPU are skipped without one (their ``--smoke`` runs on CPU
workers with ``--smoke``).

Writes ``results.json`` (one object per benchmark: command, status, seconds, RESULT
figures, and the output's tail when it did not succeed) and ``results.md`` (the table
docs/benchmarks.md shows) into ``--out``, prints the table, and ends with ``RESULT
benchmarks=<n> ok=<n> failed=<n> skipped=<n>``. Exits 1 if any benchmark failed.

Usage: python benchmarks/run_all.py [--out DIR] [--only a,b] [--smoke] [--scale X]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    #: the documented default command's arguments
    default: tuple[str, ...] = ()
    #: a short run that takes the same code paths (None: the default is short already)
    smoke: tuple[str, ...] | None = ("--smoke",)
    #: seconds the default may take on a 2-core machine; the smoke run gets a fifth
    limit_s: float = 300
    #: the default needs a CUDA GPU (its smoke run does not)
    needs_gpu: bool = False


# In the order of docs/benchmarks.md's table; limits are about twice what each took on
# the 2-core developer machine (docs/benchmarks.md), so a loaded machine still finishes.
BENCHMARKS = (
    Benchmark("ipc", smoke=("--roundtrips", "50", "--wakes", "5", "--copy-mib", "4"), limit_s=120),
    Benchmark("cpu_overhead", limit_s=300),
    Benchmark("plan_sim", smoke=None, limit_s=120),
    Benchmark("paper_table", smoke=("--only", "Qwen3-1.7B,GPT-OSS-20B"), limit_s=300),
    Benchmark("overlap", limit_s=300),
    Benchmark("bandwidth", limit_s=120, needs_gpu=True),
    Benchmark("soak", limit_s=900),
    Benchmark("packing", limit_s=300),
    Benchmark("optimizer", limit_s=300),
    Benchmark("moe", limit_s=420),
    # The default's runtime cases (planner's plans, unsplit, clipped), a few steps each.
    Benchmark("sync_mode", smoke=("--steps", "3", "--warmup", "1", "--repeats", "1"), limit_s=1200),
    Benchmark("multinode", limit_s=300),
    Benchmark("host_memory", limit_s=240),
    Benchmark("qlora", limit_s=300),
    Benchmark("long_context", limit_s=2400),
    Benchmark("long_context_gpu", limit_s=600, needs_gpu=True),
    Benchmark("checkpoint", limit_s=300),
    Benchmark("gpu_throughput", limit_s=600, needs_gpu=True),
)


@dataclass
class Outcome:
    name: str
    command: str
    status: str  # ok | failed | timeout | no RESULT | skipped: ...
    seconds: float = 0.0
    result: dict[str, str] = field(default_factory=dict)
    tail: str = ""


def parse_result(stdout: str) -> dict[str, str] | None:
    """The figures of the last ``RESULT key=value ...`` line, or None if there is none."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return None
    pairs = (word.partition("=") for word in lines[-1].split()[1:])
    return {key: value for key, sep, value in pairs if sep}


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End every process of ``proc``'s group (it leads one of its own): SIGTERM (daemons
    stop cleanly, removing their arenas), then SIGKILL whatever is left after
    ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reaped, the script no longer counts as one of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_one(bench: Benchmark, *, smoke: bool, scale: float, has_gpu: bool) -> Outcome:
    args = bench.default
    limit = bench.limit_s * scale
    if smoke and bench.smoke is not None:
        args, limit = bench.smoke, max(60.0, limit / 5)
    command = " ".join(["python", f"benchmarks/{bench.name}.py", *args])
    if bench.needs_gpu and not has_gpu and not smoke:
        return Outcome(bench.name, command, "skipped: needs a GPU")
    started = time.monotonic()
    # Its own process group: a benchmark starts daemons (a coordinator, workers), and
    # on a timeout they go with it. Killing the script alone left them training on,
    # taking the cores from every benchmark and test after it.
    proc = subprocess.Popen(
        [sys.executable, str(HERE / f"{bench.name}.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE.parent,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        stdout, _ = proc.communicate()
        return Outcome(
            bench.name, command, f"timeout ({limit:.0f} s)", time.monotonic() - started, {}, stdout
        )
    stop_group(proc)  # anything a finished benchmark left running
    seconds = time.monotonic() - started
    result = parse_result(stdout)
    tail = (stdout + stderr)[-2000:]
    if proc.returncode != 0:
        return Outcome(bench.name, command, f"failed (exit {proc.returncode})", seconds, {}, tail)
    if result is None:
        return Outcome(bench.name, command, "no RESULT line", seconds, {}, tail)
    return Outcome(bench.name, command, "ok", seconds, result)


def markdown(outcomes: list[Outcome]) -> str:
    rows = ["| benchmark | command | status | seconds | RESULT |", "|---|---|---|---|---|"]
    for o in outcomes:
        figures = " ".join(f"{k}={v}" for k, v in o.result.items())
        rows.append(f"| {o.name} | `{o.command}` | {o.status} | {o.seconds:.0f} | {figures} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmark-results"))
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="each one's short run instead")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every time limit")
    args = parser.parse_args(argv)
    known = {b.name: b for b in BENCHMARKS}
    names = [n for n in args.only.split(",") if n] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    outcomes = []
    for name in names:
        print(f"run_all: {name} ...", flush=True)
        outcome = run_one(known[name], smoke=args.smoke, scale=args.scale, has_gpu=has_gpu)
        print(f"run_all: {name}: {outcome.status} ({outcome.seconds:.0f} s)", flush=True)
        outcomes.append(outcome)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps([asdict(o) for o in outcomes], indent=1) + "\n"
    )
    table = markdown(outcomes)
    (args.out / "results.md").write_text(table)
    print(table)
    count = {
        "ok": sum(o.status == "ok" for o in outcomes),
        "skipped": sum(o.status.startswith("skipped") for o in outcomes),
    }
    failed = len(outcomes) - count["ok"] - count["skipped"]
    print(
        f"RESULT benchmarks={len(outcomes)} ok={count['ok']} failed={failed} "
        f"skipped={count['skipped']}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
