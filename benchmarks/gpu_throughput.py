"""GPU throughput: this runtime vs the paper's library vs a plain PyTorch loop, one GPU.

Side by side in one invocation, on the same GPU, model, batch and microbatch count:

  runtime-1w  coordinator + 1 GPU worker (--memory-limit CAP)
  runtime-2w  coordinator + 2 GPU workers sharing the GPU (CAP each)
  paper       the paper's library, PyPI roundpipe 0.1.1, in its own process and site
              directory (../shared/tools/device-wheels.sh fetches it; --paper-site)
  plain       one process: the transformers model on the GPU, activation checkpointing,
              microbatch accumulation, fused AdamW, under the same cap ("OOM" if it does
              not fit)

Models (random weights, bf16, random tokens): Qwen3-1.7B- and Qwen3-4B-shaped full
fine-tuning, Llama-3.1-8B-shaped LoRA (r 32, alpha 16, every linear layer, as in the
paper's benchmark). Each system runs in its own process.

Figures per system: tokens/s over the timed steps (after warm-up), MFU, and peak GPU
memory per process (nvidia-smi for the runtime's workers, the allocator's peak for the
others). MFU = model FLOPs per second / the GPU's measured bf16 matmul peak, with model
FLOPs per token = 6 x (parameters except the input embedding) + 6 x layers x
attention width x sequence (causal attention, forward and backward); for LoRA
4 x frozen + 6 x adapter parameters, plus attention (no weight gradients for the base).
Recomputation is not counted (it is overhead, as usual for MFU).

Last line: `RESULT vs_paper=<x> mfu=<y> plan_error=<z>` for the first model (runtime-1w
tokens/s over the paper's, nan where the paper's library did not run; plan_error:
|predicted / measured - 1| of runtime-1w's step time, predicted by the planner for the
plan it ran from the layer times the job measured, its profile.json, as `roundpipe plan
--profile` does). Targets: vs_paper >= 1.0, MFU >=
0.40, Qwen3-4B full fine-tuning and Llama-8B LoRA running under a 24 GiB cap. Exits 1
when a system failed (one skipped for want of CUDA or of the paper's library is not a
failure). Each child's whole output stays in the workdir (``<model>/paper.log``,
``<model>/plain.log``), the runtime's daemon logs beside them.

The paper's library runs as installed: on Python 3.12 that includes its beartype runtime
type checks (its default with beartype >= 0.23 on Python >= 3.12), which cost it some
speed; note that beside its figures.

Usage:
  python benchmarks/gpu_throughput.py [--models qwen3-1.7b,qwen3-4b,llama-8b-lora]
      [--systems runtime-1w,runtime-2w,paper,plain] [--seq-len 4096] [--microbatches 8]
      [--steps 5] [--warmup 2] [--memory-limit 24GiB] [--paper-site /tmp/ref]
  python benchmarks/gpu_throughput.py --smoke   # tiny models on CPU workers: checks
                                                # the script end to end without a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RuntimeRun, plain_loop, run_runtime

from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.profile import PROFILE_FILE, load_profile
from roundpipe.coordinator.planning.search import evaluate_plan
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.scratch import work_dir
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import parse_quantity

HERE = Path(__file__).resolve().parent
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Shapes of the published configs (random weights: nothing is downloaded).
MODELS: dict[str, dict] = {
    "qwen3-1.7b": {
        "architecture": "qwen3",
        "config": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    },
    "qwen3-4b": {
        "architecture": "qwen3",
        "config": {
            "vocab_size": 151936,
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    },
    "llama-8b-lora": {
        "architecture": "llama",
        "config": {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        "lora": {"r": 32, "alpha": 16, "target_modules": ALL_LINEAR},
    },
    # --smoke: narrow stand-ins for the models above, on CPU workers. Deep enough (8
    # layers) for stage plans of several stages, tied embeddings like the Qwen3 models,
    # and a Llama LoRA job like the third model, so the smoke takes the default's paths.
    "tiny": {
        "architecture": "qwen3",
        "config": {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
    },
    "tiny-lora": {
        "architecture": "llama",
        "config": {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
        },
        "lora": {"r": 8, "alpha": 16, "target_modules": ALL_LINEAR},
    },
}
SYSTEMS = ("runtime-1w", "runtime-2w", "paper", "plain")
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}
SMOKE_MODELS = "tiny,tiny-lora"


@dataclass
class Result:
    tokens_per_s: float | None = None
    gpu_peak_gib: float | None = None
    note: str = ""
    plan_error: float | None = None
    """|predicted / measured - 1| of the step time, the prediction from the job's own
    measured layer times (its profile.json) for the plan it ran (issue 32: within 15%)."""


def plan_prediction(spec: JobSpec, run: RuntimeRun) -> float | None:
    """Seconds per step the planner predicts for the plan ``run`` ran, from the layer
    times its job measured (``profile.json`` in its output directory, with the workers
    it planned for), as `roundpipe plan --profile` does; None if that job wrote none
    (another system's job may have left one there)."""
    path = Path(spec.output.dir) / PROFILE_FILE
    if not path.exists():
        return None
    costs, about = load_profile(path)
    if about.get("job") != run.job_log.parent.name:
        return None
    result = evaluate_plan(
        Plan.parse(run.plan),
        costs,
        HardwareSpec(**about["hardware"]),
        about["num_microbatches"],
        staleness=spec.train.staleness,
        recompute=about["recompute"],
    )
    return result.predicted_iteration_s


def _error(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None or measured <= 0 else abs(predicted / measured - 1)


# -- the job -------------------------------------------------------------------------


def make_spec(model: dict, args: argparse.Namespace, root: Path) -> JobSpec:
    """The job every system runs: random tokens, ``args.microbatches`` microbatches of
    ``args.rows`` rows, ``warmup + steps`` measured steps plus one (the runtime's job is
    cancelled after the measured ones, before its final checkpoint)."""
    steps = args.warmup + args.steps + 1
    rows = steps * args.microbatches * args.rows
    vocab = model["config"]["vocab_size"]
    root.mkdir(parents=True, exist_ok=True)
    data = root / "tokens.jsonl"
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(rows):
            ids = [rng.randrange(vocab) for _ in range(args.seq_len)]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    spec = {
        "model": {
            "architecture": model["architecture"],
            "config": model["config"],
            "init_seed": 0,
        },
        "data": {"path": str(data), "format": "jsonl_tokens", "seq_len": args.seq_len},
        "batch": {"microbatch_size": args.rows, "num_microbatches": args.microbatches},
        "train": {"steps": steps, "staleness": 1, "dtype": args.dtype, "seed": 0},
        "optimizer": {"lr": 1e-5, "schedule": "constant"},
        "output": {"dir": str(root / "out")},
    }
    if model.get("lora"):
        spec["lora"] = model["lora"]
    return JobSpec.from_dict(spec)


def flops_per_token(spec: JobSpec) -> float:
    """Model FLOPs per trained token (see the module docstring)."""
    lora = spec.lora.model_settings() if spec.lora is not None else None
    layered = LayeredModel(model_config_from_spec(spec.model), lora)
    config = layered.config
    frozen = trainable = 0
    for layer in range(layered.num_layers):
        for p in layered.layer_params(layer):
            if p.tied_to is not None or p.name.endswith("embed_tokens.weight"):
                continue  # the embedding is a lookup; a tied head counts once, below
            n = math.prod(p.shape)
            if p.trainable:
                trainable += n
            else:
                frozen += n
    if config.tie_word_embeddings:  # the LM head is a matmul even when tied
        head = config.vocab_size * config.hidden_size
        if lora is None:
            trainable += head
        else:
            frozen += head
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 6 * config.num_hidden_layers * heads * head_dim * spec.data.seq_len
    return 4 * frozen + 6 * trainable + attention


SMOKE_ONE_WORKER_PLAN = "F[0:3,3:6] T[6:10] B[4:6,2:4,0:2]"
"""--smoke's plan for runtime-1w. On a GPU the planner gives one worker several stages
(the memory cap forces them: e.g. ``F[0:23] T[23:30] B[12:23,0:12]`` for Qwen3-1.7B),
but for one CPU worker it fuses a tiny model into a single tail stage, which would skip
the hand-offs between stages; so the smoke pins a plan of the same kind."""


def _with_plan(spec: JobSpec, plan: str) -> JobSpec:
    """``spec`` with ``train.plan`` pinned to ``plan``."""
    doc = spec.to_dict()
    doc["train"] = {**doc["train"], "plan": plan}
    return JobSpec.from_dict(doc)


# -- child processes -----------------------------------------------------------------


def _run_json(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    log: Path | None = None,
):
    """Run ``argv`` with this Python; return its last JSON stdout line, or raise with the
    end of its stderr on one line. With ``log``, the child's whole stdout and stderr are
    kept there: the one-line tail loses a compiler's or a traceback's cause."""
    result = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=3000,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(
            f"$ {' '.join(argv)}\nexit {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = " | ".join(result.stderr.splitlines()[-3:])
        where = f" (whole output in {log})" if log is not None else ""
        raise RuntimeError(f"{Path(argv[0]).name} exited {result.returncode}{where}: {tail}")
    return json.loads(lines[-1])


def _child(role: str, job: dict, log: Path | None = None):
    """Run ``role`` of this script in a fresh process (see ``child_main``)."""
    return _run_json([__file__, "--child", role, "--job", json.dumps(job)], log=log)


def child_main(role: str, job: dict) -> None:
    import torch

    if role == "peak":
        device, dtype = job["device"], getattr(torch, job["dtype"])
        n = 8192 if device.startswith("cuda") else 1024
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        for _ in range(3):
            a @ b
        sync()
        reps, start = 20, time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        print(json.dumps({"flops_per_s": 2 * n**3 * reps / (time.perf_counter() - start)}))
        return
    if role == "plain":
        device = job["device"]
        if job.get("memory_limit_bytes") and device.startswith("cuda"):
            from roundpipe.worker.daemon import apply_memory_limit

            apply_memory_limit(torch.device(device), job["memory_limit_bytes"])
        spec = JobSpec.from_dict(job["spec"])
        try:
            tokens_per_s = plain_loop(
                spec, warmup=job["warmup"], device=device, threads=job.get("threads")
            )
        except torch.OutOfMemoryError:
            print(json.dumps({"oom": True}))
            return
        peak = torch.cuda.max_memory_reserved() / 2**20 if device.startswith("cuda") else None
        print(json.dumps({"tokens_per_s": tokens_per_s, "gpu_peak_mib": peak}))
        return
    raise SystemExit(f"unknown child role {role!r}")


# -- systems -------------------------------------------------------------------------


def run_system(system: str, name: str, spec: JobSpec, args: argparse.Namespace, root: Path):
    measured_steps = args.warmup + args.steps
    if system.startswith("runtime-"):
        workers = int(system[len("runtime-") : -1])
        if args.smoke:
            device = ["--cpu", "--threads", "1"]
            if workers == 1:
                spec = _with_plan(spec, SMOKE_ONE_WORKER_PLAN)
        else:
            device = ["--gpu", "0", "--memory-limit", str(args.memory_limit_bytes)]
        run = run_runtime(
            spec,
            [device] * workers,
            warmup=args.warmup,
            root=root / system,
            stop_after=measured_steps,
            # the CPU optimizer gets the host's cores unless CPU workers share them
            coordinator_threads=1 if args.smoke else os.cpu_count() or 1,
        )
        peak = max(run.gpu_peak_mib.values()) / 1024 if run.gpu_peak_mib else None
        step_s = sum(run.step_s) / len(run.step_s)
        predicted = plan_prediction(spec, run)
        note = f"plan {run.plan}"
        if predicted is not None:
            note += (
                f"; from its measured layer times the planner predicts {predicted:.3g} s "
                f"per step, measured {step_s:.3g} s"
            )
        return Result(run.tokens_per_s, peak, note, plan_error=_error(predicted, step_s))
    job = {
        "spec": spec.to_dict(),
        "warmup": args.warmup,
        "device": "cpu" if args.smoke else "cuda:0",
        "memory_limit_bytes": None if args.smoke else args.memory_limit_bytes,
        "threads": 2 if args.smoke else None,
    }
    if system == "plain":
        out = _child("plain", job, log=root / "plain.log")
        if out.get("oom"):
            return Result(note="OOM under the cap")
        peak = out["gpu_peak_mib"] / 1024 if out.get("gpu_peak_mib") else None
        return Result(out["tokens_per_s"], peak)
    if system == "paper":
        if args.smoke:
            return Result(note="skipped: needs CUDA")
        if not args.paper_site or not Path(args.paper_site, "roundpipe").is_dir():
            return Result(note=f"skipped: no paper library at --paper-site {args.paper_site}")
        model = MODELS[name]
        paper_job = {
            "model_type": MODEL_TYPES[model["architecture"]],
            "config": model["config"],
            "lora": model.get("lora"),
            "dtype": args.dtype,
            "num_microbatches": args.microbatches,
            "microbatch_rows": args.rows,
            "seq_len": args.seq_len,
            "warmup": args.warmup,
            "steps": args.steps,
            "lr": 1e-5,
            "memory_limit_bytes": args.memory_limit_bytes,
        }
        env = {
            "PYTHONPATH": os.pathsep.join([args.paper_site, os.environ.get("PYTHONPATH", "")]),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        }
        out = _run_json(
            [str(HERE / "paper_baseline.py"), "--job", json.dumps(paper_job)],
            env=env,
            cwd=tempfile.gettempdir(),  # not the repo root: its roundpipe/ would shadow theirs
            log=root / "paper.log",
        )
        checks = "on" if out.get("beartype_checks") else "off"
        return Result(out["tokens_per_s"], out["gpu_peak_mib"] / 1024, f"beartype checks {checks}")
    raise ValueError(f"unknown system {system!r}")


# -- main ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-1.7b,qwen3-4b,llama-8b-lora")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-limit", default="24GiB", help="per worker / process")
    parser.add_argument("--paper-site", default="/tmp/ref", help="where the paper's wheel is")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workdir", help="keep data and daemon logs here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU workers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, json.loads(args.job))
    if args.smoke:
        args.models, args.seq_len, args.microbatches, args.rows = SMOKE_MODELS, 32, 3, 1
        args.steps, args.warmup = 3, 1  # bfloat16, as the default
    args.memory_limit_bytes = int(parse_quantity(args.memory_limit, what="--memory-limit"))
    models = [m for m in args.models.split(",") if m]
    systems = [s for s in args.systems.split(",") if s]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for s in systems:
        if s not in SYSTEMS:
            parser.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")

    device = "cpu" if args.smoke else "cuda:0"
    peak = _child("peak", {"device": device, "dtype": args.dtype})["flops_per_s"]
    with work_dir("rp-gpu-bench-", args.workdir) as root:
        print(
            f"device {device}, measured {args.dtype} matmul peak {peak / 1e12:.1f} TFLOP/s; "
            f"sequence {args.seq_len}, {args.microbatches} microbatches x {args.rows} row(s), "
            f"{args.warmup} warm-up + {args.steps} timed steps; cap "
            f"{args.memory_limit_bytes / 2**30:.0f} GiB per process"
        )
        header = f"{'model':15} {'system':11} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs paper':>9}"
        print(header + "  note")
        first: dict[str, Result] = {}
        first_per_token = 0.0
        failed: list[str] = []
        for name in models:
            workdir = root / name
            spec = make_spec(MODELS[name], args, workdir)
            per_token = flops_per_token(spec)
            results: dict[str, Result] = {}
            for system in systems:
                try:
                    results[system] = run_system(system, name, spec, args, workdir)
                except Exception as exc:  # one failing system must not hide the others
                    results[system] = Result(note=f"failed: {str(exc).splitlines()[0][:300]}")
                # each system's figure as soon as it is known: a run stopped by a time limit
                # keeps the systems that finished
                r = results[system]
                print(f"# {name} {system}: tokens/s {r.tokens_per_s} {r.note}", flush=True)
                if r.note.startswith("failed"):
                    failed.append(f"{name} {system}")
            paper = results.get("paper")
            for system, r in results.items():
                tps = f"{r.tokens_per_s:10.0f}" if r.tokens_per_s else f"{'-':>10}"
                mfu = f"{r.tokens_per_s * per_token / peak:6.3f}" if r.tokens_per_s else f"{'-':>6}"
                mem = f"{r.gpu_peak_gib:9.1f}" if r.gpu_peak_gib is not None else f"{'-':>9}"
                ratio = (
                    f"{r.tokens_per_s / paper.tokens_per_s:9.2f}"
                    if r.tokens_per_s and paper is not None and paper.tokens_per_s
                    else f"{'-':>9}"
                )
                print(f"{name:15} {system:11} {tps} {mfu} {mem} {ratio}  {r.note}", flush=True)
            if not first:
                first, first_per_token = results, per_token
        ours, paper = first.get("runtime-1w"), first.get("paper")
        vs_paper = (
            ours.tokens_per_s / paper.tokens_per_s
            if ours and ours.tokens_per_s and paper and paper.tokens_per_s
            else float("nan")
        )
        mfu = (
            ours.tokens_per_s * first_per_token / peak
            if ours and ours.tokens_per_s
            else float("nan")
        )
        plan_error = ours.plan_error if ours and ours.plan_error is not None else float("nan")
        print(f"RESULT vs_paper={vs_paper:.2f} mfu={mfu:.3f} plan_error={plan_error:.3f}")
        if failed:  # a skipped system (no CUDA, no paper site) is not a failure; a crash is
            print(f"gpu_throughput.py: {', '.join(failed)} failed (see above)", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
