"""Host memory per parameter: what a running job really takes against what the plan says.

A job of a few hundred million parameters runs through the real daemons (a coordinator
and one CPU worker, ``LocalCluster``). While it runs, a sampler records

* the coordinator's private memory (``RssAnon`` of /proc/<pid>/status: the fp32 masters,
  the optimizer states, scratch; shared arena pages it maps are not counted here), above
  what the idle coordinator held before the job was submitted;
* the bytes its arenas take in the arena directory (a RAM disk: /dev/shm), allocated up
  front (``posix_fallocate``);

and keeps the peak of their sum. Divided by the model's parameter count, that is set
against ``host_memory_needed`` (coordinator/training/memory.py) for the plan the job ran: the
figure ``roundpipe plan`` prints and admission control checks. The CPU worker's working
memory (autograd's saved tensors while it computes) is not part of either figure.

Usage::

    python benchmarks/host_memory.py                 # ~270M parameters, bf16, fp32 AdamW
    python benchmarks/host_memory.py --smoke         # a tiny model, seconds
    python benchmarks/host_memory.py --set train.staleness=0
    python benchmarks/host_memory.py --set optimizer.state_dtype=int8
    python benchmarks/host_memory.py --throughput    # grad_buffer_stages 0/1/2: tokens/s
    python benchmarks/host_memory.py --states --steps 200   # demo loss, fp32 vs int8 states

Prints one row per component, then ``RESULT host_bytes_per_param=<x> predicted=<y>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

from common import demo_data_spec, run_runtime  # benchmarks/ is on sys.path

from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.spec.sections import TrainSpec
from roundpipe.coordinator.training.memory import HostMemory, host_memory_needed, planned_layout
from roundpipe.coordinator.training.trainer import default_plan
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

FULL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, vocab_size=16384)
# --smoke: narrow, but deep enough (8 decoder layers) that the pinned 4-worker plan has
# twice as many backward stages as forward ones, as the default's has; with 4 layers it
# would have as many.
SMOKE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=8, vocab_size=1024)
THROUGHPUT = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, vocab_size=1024)
COMMON = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64)


def _rss_anon(pid: int) -> int:
    """Private anonymous resident bytes of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _allocated(directory: Path) -> int:
    """Bytes the files under ``directory`` take (allocated blocks, not apparent size)."""
    total = 0
    for path in directory.glob("*"):
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            pass  # removed while we looked
    return total


class Sampler:
    """Samples the coordinator's RssAnon and the arena directory every ``period_s``."""

    def __init__(self, pid: int, arena_dir: Path, period_s: float = 0.05) -> None:
        self.pid, self.arena_dir, self.period_s = pid, arena_dir, period_s
        self.idle_anon = _rss_anon(pid)
        self.peak = (0, 0, 0)  # (anon + arenas, anon, arenas)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            anon = max(0, _rss_anon(self.pid) - self.idle_anon)
            arenas = _allocated(self.arena_dir)
            if anon + arenas > self.peak[0]:
                self.peak = (anon + arenas, anon, arenas)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _override(doc: dict, assignment: str) -> None:
    key, _, raw = assignment.partition("=")
    *parents, leaf = key.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    try:
        node[leaf] = json.loads(raw)
    except json.JSONDecodeError:
        node[leaf] = raw


def make_spec(
    args: argparse.Namespace,
    out: Path,
    config: dict,
    *,
    num_microbatches: int = 2,
    train: dict | None = None,
) -> JobSpec:
    """A Qwen3 job of ``config`` on the demo data, cancelled after ``args.steps`` (no
    final checkpoint), with the plan pinned and ``--set`` applied."""
    base = demo_data_spec(
        {**config, **COMMON, "tie_word_embeddings": False},
        out,
        steps=args.steps + 10,
        seq_len=args.seq_len,
        microbatch_size=1,
        num_microbatches=num_microbatches,
        staleness=1,
        train={"dtype": args.dtype, "replan": False, **(train or {})},
        output={"checkpoint_every": 0},
    )
    doc = base.to_dict()
    # The stages a server of --plan-workers GPUs would run (one CPU worker runs them all),
    # so that the gradient buffer is sized as there, not for one stage of every layer.
    num_layers = LayeredModel(model_config_from_spec(base.model), None).num_layers
    doc["train"]["plan"] = str(default_plan(num_layers, args.plan_workers))
    for assignment in args.set:
        _override(doc, assignment)
    return JobSpec.from_dict(doc)


def predicted(spec: JobSpec, plan: str) -> tuple[HostMemory, int]:
    """What coordinator/training/memory.py says the job needs under the plan it ran, and the
    model's parameter count."""
    model = LayeredModel(model_config_from_spec(spec.model), None)
    layout = planned_layout(model, Plan.parse(plan), spec)
    return host_memory_needed(layout, spec), model.parameter_count()


def _two_cpu_workers(spec: JobSpec, root: Path, *, warmup: int, stop_after: int):
    return run_runtime(
        spec,
        [["--cpu", "--threads", "1"]] * 2,
        warmup=warmup,
        root=root / "cluster",
        coordinator_threads=1,
        stop_after=stop_after,
        # A loaded shared machine can starve a busy worker's heartbeat for seconds.
        coordinator_args=["--worker-timeout", "300"],
    )


def throughput(args: argparse.Namespace) -> int:
    """Tokens/s with the gradient buffer at 0 (one slot per layer), 1 and 2 stages, side
    by side in interleaved rounds (the machine is shared): what waiting for a free
    gradient slot costs."""
    settings = (0, 1, 2)
    rates: dict[int, list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for stages in settings:
            with tempfile.TemporaryDirectory(prefix="rp-hostmem-") as tmp:
                root = Path(tmp)
                spec = make_spec(
                    args,
                    root / "out",
                    THROUGHPUT,
                    num_microbatches=4,
                    train={"dtype": "float32", "grad_buffer_stages": stages},
                )
                run = _two_cpu_workers(spec, root, warmup=2, stop_after=args.steps)
                rates[stages].append(run.tokens_per_s)
    print(f"# plan {run.plan}, {args.rounds} interleaved rounds, 2 CPU workers, staleness 1")
    print(f"{'grad_buffer_stages':<20}{'median tokens/s':>16}{'vs 0':>8}  runs")
    base_rate = statistics.median(rates[0])
    for stages in settings:
        med = statistics.median(rates[stages])
        runs = " ".join(f"{r:.0f}" for r in rates[stages])
        print(f"{stages:<20}{med:>16.1f}{med / base_rate:>8.3f}  {runs}")
    default = TrainSpec().grad_buffer_stages
    ratio = statistics.median(rates[default]) / base_rate
    print(f"RESULT grad_buffer_throughput_ratio={ratio:.3f} stages={default}")
    return 0


def states(args: argparse.Namespace) -> int:
    """The demo job (roundpipe demo's spec, 2 CPU workers) with fp32 and with 8-bit
    AdamW states, side by side: the loss at the demo's 40 steps and over a longer run."""
    from roundpipe.demo import demo_spec

    losses: dict[str, dict[int, float]] = {}
    for dtype in ("float32", "int8"):
        with tempfile.TemporaryDirectory(prefix="rp-hostmem-") as tmp:
            root = Path(tmp)
            doc = demo_spec(steps=args.steps, output_dir=root / "out").to_dict()
            doc["optimizer"]["state_dtype"] = dtype
            doc["output"]["checkpoint_every"] = 0
            for assignment in args.set:
                _override(doc, assignment)
            spec = JobSpec.from_dict(doc)
            run = _two_cpu_workers(spec, root, warmup=0, stop_after=args.steps)
            losses[dtype] = run.losses
    marks = sorted({s for s in (1, 10, 20, 40, 100, 200, 400, args.steps) if s <= args.steps})
    print(f"# roundpipe demo's job, {args.steps} steps, AdamW states fp32 vs int8 (block 256)")
    print(f"{'step':>6}{'fp32 loss':>12}{'int8 loss':>12}{'int8 - fp32':>14}")
    for step in marks:
        a, b = losses["float32"][step], losses["int8"][step]
        print(f"{step:>6}{a:>12.4f}{b:>12.4f}{b - a:>+14.4f}")
    last = args.steps
    tail = [s for s in losses["float32"] if s > last - 10]
    mean32 = statistics.mean(losses["float32"][s] for s in tail)
    mean8 = statistics.mean(losses["int8"][s] for s in tail)
    print(f"mean loss of the last {len(tail)} steps: fp32 {mean32:.4f}, int8 {mean8:.4f}")
    print(f"RESULT int8_minus_fp32_loss={mean8 - mean32:+.4f} steps={last}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model (seconds)")
    p.add_argument("--steps", type=int, default=3, help="steps to run (default 3)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--plan-workers",
        type=int,
        default=4,
        help="pin the uniform plan for this many workers (default 4)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job-spec field, e.g. train.staleness=0 (JSON values)",
    )
    p.add_argument(
        "--throughput",
        action="store_true",
        help="instead: tokens/s with grad_buffer_stages 0, 1, 2 side by side",
    )
    p.add_argument("--rounds", type=int, default=3, help="--throughput rounds (default 3)")
    p.add_argument(
        "--states",
        action="store_true",
        help="instead: the demo job's loss with fp32 vs int8 AdamW states (--steps 40)",
    )
    args = p.parse_args(argv)
    if args.states:
        if args.steps == 3:
            args.steps = 40
        return states(args)
    if args.throughput:
        if args.steps == 3:
            args.steps = 8
        return throughput(args)
    with tempfile.TemporaryDirectory(prefix="rp-hostmem-") as tmp:
        root = Path(tmp)
        spec = make_spec(args, root / "out", SMOKE if args.smoke else FULL)
        samplers: list[Sampler] = []

        def start(cluster) -> None:
            samplers.append(Sampler(cluster.coordinator.proc.pid, cluster.arena_dir))

        run = run_runtime(
            spec,
            [["--cpu", "--threads", "1"]],
            warmup=0,
            root=root / "cluster",
            coordinator_threads=1,
            stop_after=args.steps,
            while_running=start,
            # A loaded shared machine can starve a busy worker's heartbeat for seconds.
            coordinator_args=["--worker-timeout", "300"],
        )
        sampler = samplers[0]
        sampler.stop()
    need, params = predicted(spec, run.plan)
    total, anon, arenas = sampler.peak
    print(
        f"# {params:,} parameters, {spec.train.dtype}, staleness {spec.train.staleness}, "
        f"plan {run.plan}"
    )
    print(f"{'component':<28}{'bytes':>16}{'bytes/param':>14}")
    for name, nbytes in need.components().items():
        print(f"{'predicted ' + name:<28}{nbytes:>16,}{nbytes / params:>14.2f}")
    print(f"{'predicted total':<28}{need.total:>16,}{need.total / params:>14.2f}")
    print(f"{'measured arenas (/dev/shm)':<28}{arenas:>16,}{arenas / params:>14.2f}")
    print(f"{'measured coordinator anon':<28}{anon:>16,}{anon / params:>14.2f}")
    print(f"{'measured total':<28}{total:>16,}{total / params:>14.2f}")
    print(f"RESULT host_bytes_per_param={total / params:.2f} predicted={need.total / params:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
