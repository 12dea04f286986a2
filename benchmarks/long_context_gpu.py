"""Long sequences on one GPU worker under a memory cap: the Qwen3-1.7B shape at 73K tokens
and beyond (issue 36's GPU figure; the paper trains it at 73K tokens on a 24 GB card).

A coordinator and one GPU worker (``--gpu 0 --memory-limit CAP``) run as real daemons;
for each length of ``--lengths`` (ascending) a bf16 job of microbatches of one row, each
row one document of random tokens (the whole row attends causally: the hardest case for
attention), trains ``--warmup`` + 1 timed steps under the planner's own plan and
recompute grain. Per length the table gives whether it trained, tokens/s of the timed
step, the plan the coordinator chose, the worker's peak GPU memory (nvidia-smi: CUDA
context and the allocator's reserve included) and the planner's per-worker figure for
that plan; the planner's longest sequence under the cap is printed beside the measured
longest. A length that does not fit must fail loudly: refused at submit with the
planner's figures, or failing the job with an out-of-memory error that names the cap;
lengths after the first failure are not tried.

The model's position table is set to 131,072 (Qwen3-1.7B's config says 40,960; its
long-context releases extend it with rope scaling): admission refuses a row longer than
``max_position_embeddings``, and the work and memory per token do not depend on it.

Usage::

    python benchmarks/long_context_gpu.py [--lengths 73728,102400] [--memory-limit 24GiB]
        [--microbatches 2] [--warmup 1] [--workdir DIR]
    python benchmarks/long_context_gpu.py --smoke   # a tiny model on a CPU worker: the
                                                    # script end to end without a GPU

Last line: ``RESULT max_seq_tokens=<longest that trained> planner_max=<the planner's>``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from common import run_job, runtime_cluster  # benchmarks/ is on sys.path
from gpu_throughput import MODELS

from roundpipe.client import JobRejected
from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.hardware import cpu_hardware, gpu_hardware
from roundpipe.coordinator.planning.search import evaluate_plan
from roundpipe.coordinator.planning.sequence import longest_sequence
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.scratch import work_dir
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import GiB, format_bytes, parse_quantity

# Qwen3-1.7B's published shape, its position table extended (the module docstring).
QWEN3_1_7B = {**MODELS["qwen3-1.7b"]["config"], "max_position_embeddings": 131072}
SMOKE = {  # narrow, but grouped-query heads, tied embeddings and rows past LONG_ROW_TOKENS
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": True,
}


def make_spec(config: dict, root: Path, seq_len: int, args: argparse.Namespace) -> JobSpec:
    """The job at ``seq_len``: random tokens, one document per row, warm-up + 1 timed
    step, plus one more (the job is cancelled before it: no final checkpoint)."""
    steps = args.warmup + 2
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"tokens-{seq_len}.jsonl"
    rng = random.Random(seq_len)
    with open(data, "w") as f:
        for _ in range(steps * args.microbatches):
            ids = [rng.randrange(config["vocab_size"]) for _ in range(seq_len)]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return JobSpec.from_dict(
        {
            "model": {"architecture": "qwen3", "config": config, "init_seed": 0},
            "data": {"path": str(data), "format": "jsonl_tokens", "seq_len": seq_len},
            "batch": {"microbatch_size": 1, "num_microbatches": args.microbatches},
            "train": {"steps": steps, "staleness": 1, "dtype": args.dtype, "seed": 0},
            "optimizer": {"lr": 1e-5, "schedule": "constant"},
            "output": {"dir": str(root / f"out-{seq_len}"), "checkpoint_every": 0},
        }
    )


class Planner:
    """What the planner predicts for ``spec``'s model on one GPU worker of ``cap`` bytes."""

    def __init__(self, spec: JobSpec, cap: int, *, cpu: bool = False) -> None:
        self.model = LayeredModel(model_config_from_spec(spec.model))
        # (--smoke: the CPU worker it runs on, uncapped; its figures only check the path)
        self.hw = cpu_hardware(1) if cpu else gpu_hardware(1, cap)
        self.microbatches, self.dtype = spec.batch.num_microbatches, spec.train.dtype
        self.max_positions = self.model.config.max_position_embeddings

    def costs(self, seq_len: int):
        return estimate_costs(
            self.model,
            microbatch_rows=1,
            seq_len=seq_len,
            compute_dtype=self.dtype,
            flops_per_s=self.hw.flops_per_s,
            on_gpu=self.hw.gpu_workers,
        )

    def longest(self) -> int:
        fit = longest_sequence(
            self.costs, self.hw, self.microbatches, rows=1, lo=512, hi=self.max_positions
        )
        return fit.seq_len if fit is not None else 0

    def memory(self, seq_len: int, plan: str, recompute: str) -> int:
        """The fullest worker's bytes for ``plan`` at ``seq_len`` (reserve included)."""
        result = evaluate_plan(
            Plan.parse(plan),
            self.costs(seq_len),
            self.hw,
            self.microbatches,
            recompute=recompute,
        )
        return max(result.per_worker_memory)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="73728,102400", help="sequence lengths, ascending")
    p.add_argument("--memory-limit", default="24GiB", help="the GPU worker's cap")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", help="data, daemon logs and job logs (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="tiny model on a CPU worker")
    args = p.parse_args(argv)
    config = SMOKE if args.smoke else QWEN3_1_7B
    if args.smoke:
        args.lengths = "4096,8192"
    lengths = sorted(int(n) for n in args.lengths.split(",") if n)
    cap = int(parse_quantity(args.memory_limit, what="--memory-limit"))
    with work_dir("rp-long-gpu-", args.workdir) as root:
        worker = ["--cpu", "--threads", "1"] if args.smoke else ["--gpu", "0"]
        worker += ["--memory-limit", str(cap)] if not args.smoke else []
        specs = {n: make_spec(config, root / "data", n, args) for n in lengths}
        planner = Planner(specs[lengths[0]], cap, cpu=args.smoke)
        planner_max = planner.longest()
        print(
            f"one worker ({' '.join(worker)}); qwen3 {config['num_hidden_layers']} layers, hidden "
            f"{config['hidden_size']}, vocab {config['vocab_size']}; {args.microbatches} "
            f"microbatches of 1 row, {args.dtype}; {args.warmup} warm-up + 1 timed step; "
            f"the planner's longest under {format_bytes(cap)}: {planner_max:,} tokens",
            flush=True,
        )
        rows = []
        with runtime_cluster(
            [worker],
            root=root / "cluster",
            coordinator_threads=1 if args.smoke else 8,
            coordinator_args=["--log-level", "INFO"],  # the job log's plan line: its grain
            allow_read=[root / "data"],
            allow_write=[root / "data"],
        ) as cluster:
            for seq_len in lengths:
                try:
                    run = run_job(
                        cluster, specs[seq_len], warmup=args.warmup, stop_after=args.warmup + 1
                    )
                except JobRejected as exc:  # admission: the planner says it does not fit
                    rows.append((seq_len, "refused", None, "-", None, str(exc).splitlines()[0]))
                    print(f"# {seq_len}: refused at submit: {exc}", flush=True)
                    break
                except (RuntimeError, TimeoutError) as exc:  # it must say why (memory)
                    rows.append((seq_len, "failed", None, "-", None, str(exc).splitlines()[0]))
                    print(f"# {seq_len}: failed: {exc}", flush=True)
                    break
                peak = max(run.gpu_peak_mib.values()) * 2**20 if run.gpu_peak_mib else None
                recompute = _recompute(run.job_log)
                need = planner.memory(seq_len, run.plan, recompute)
                rows.append((seq_len, "yes", run.tokens_per_s, run.plan, peak, f"{need / GiB:.1f}"))
                peak_text = f"{peak / GiB:.1f} GiB" if peak else "not measured (no nvidia-smi)"
                print(
                    f"# {seq_len}: trained, {run.tokens_per_s:,.0f} tokens/s, plan {run.plan} "
                    f"({recompute} grain), peak {peak_text}, planner {need / GiB:.1f} GiB",
                    flush=True,
                )
        print(
            f"{'tokens':>8} {'trains':>7} {'tokens/s':>9} {'peak GiB':>9} {'planner GiB':>12}  plan"
        )
        for seq_len, ok, tps, plan, peak, note in rows:
            tps_text = f"{tps:9,.0f}" if tps else f"{'-':>9}"
            peak_text = f"{peak / GiB:9.1f}" if peak else f"{'-':>9}"
            planned = note if ok == "yes" else "-"
            print(f"{seq_len:>8} {ok:>7} {tps_text} {peak_text} {planned:>12}  {plan}")
            if ok != "yes":
                print(f"         {note}")
        trained = [n for n, ok, *_ in rows if ok == "yes"]
        failures = [note for _, ok, *_, note in rows if ok != "yes"]
        if failures and not any(w in failures[0].lower() for w in ("memory", "fit", "cap")):
            print(f"long_context_gpu.py: a failure that does not name memory: {failures[0]}")
            sys.exit(1)  # inside work_dir: the daemons' logs are kept
        print(f"RESULT max_seq_tokens={max(trained, default=0)} planner_max={planner_max}")
        return 0


def _recompute(job_log: Path) -> str:
    """The recompute grain the job ran at, from its log's plan line ("... recompute at
    layer grain"; the coordinator runs at INFO so that the line is written)."""
    text = job_log.read_text()
    for grain in ("layer", "stage"):
        if f"recompute at {grain} grain" in text:
            return grain
    raise RuntimeError(f"{job_log} does not say the job's recompute grain")


if __name__ == "__main__":
    sys.exit(main())
