"""A tiny job trained on a device worker must give the losses of a CPU worker.

Runs the same small Qwen3-shaped job (fp32; ``--dtype`` another) twice through real daemons: once on one CPU
worker (the reference), once on the worker given by ``--device`` (default ``--gpu 0``;
``--smoke`` uses a CPU worker behind the emulated bus instead, so the script runs without
a GPU). Prints both loss curves, writes them as JSON (``--json``), and exits 1 if any
step's loss differs by more than ``--rtol`` (relative).

The daemons' logs and the job outputs stay in ``--workdir`` (default: ``parity-work``
under ``$GPU_CHECK_OUT`` when gpu_check.sh runs it, else a temp dir), so a failed or
stopped run brings its cause back; every wait is bounded by ``--wait-s``, under the
step's own limit, and each curve is printed as soon as it is known.

Usage: python scripts/gpu_parity.py [--device "--gpu 0"] [--json out.json] [--smoke] [--dtype D]
           [--workdir DIR] [--wait-s 120]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from roundpipe.client import RoundPipeError
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import DEMO_DATA_DIR  # the installed package's
from roundpipe.scratch import work_dir


def spec(out: Path, steps: int, dtype: str = "float32") -> JobSpec:
    return JobSpec.from_dict(
        {
            "model": {
                "architecture": "qwen3",
                "config": {
                    "hidden_size": 128,
                    "intermediate_size": 352,
                    "num_hidden_layers": 4,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 32,
                    "vocab_size": 512,
                    "max_position_embeddings": 512,
                },
                "init_seed": 0,
                "tokenizer": str(DEMO_DATA_DIR / "tokenizer"),
            },
            "data": {"path": str(DEMO_DATA_DIR / "demo_corpus.jsonl"), "seq_len": 128, "seed": 1},
            "batch": {"microbatch_size": 2, "num_microbatches": 3},
            "train": {"steps": steps, "staleness": 0, "dtype": dtype, "seed": 0},
            "optimizer": {"lr": 1e-3, "schedule": "constant"},
            "output": {"dir": str(out)},
        }
    )


def losses(
    root: Path, worker: list[str], steps: int, wait_s: float, dtype: str = "float32"
) -> list[float]:
    """The job's loss curve on one worker started with ``worker``; raises with the
    daemons' logs when the job fails or a wait runs out."""
    shutil.rmtree(root, ignore_errors=True)  # a rerun's: the job's output dir starts empty
    root.mkdir(parents=True)
    arena_dir = Path(tempfile.mkdtemp(prefix="rp-parity-", dir="/dev/shm"))
    cluster = LocalCluster(root, arena_dir, client_timeout_s=60, allow_write=[root])
    try:
        cluster.add_worker("w0", device=worker)
        try:
            cluster.wait_for_workers(1, timeout_s=wait_s)
            handle = cluster.client.submit(spec(root / "out", steps, dtype))
            curve = [e.loss for e in handle.progress(timeout_s=wait_s)]
            status = handle.wait(timeout_s=wait_s)
        except (TimeoutError, RoundPipeError) as exc:  # a worker that never came, a refusal
            raise RuntimeError(f"{worker}: {exc}\n{cluster.logs()}") from exc
        if status.state != "succeeded":
            raise RuntimeError(f"{worker}: job {status.state}: {status.message}\n{cluster.logs()}")
        print(f"{' '.join(worker)}: {' '.join(f'{x:.6f}' for x in curve)}", flush=True)
        return curve
    finally:
        cluster.stop()
        for f in arena_dir.iterdir():
            f.unlink()
        arena_dir.rmdir()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="--gpu 0", help="worker options of the device run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype of both runs (float16 trains with its dynamic loss scaling)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU worker on an emulated bus")
    parser.add_argument("--workdir", default=None, help="daemon logs and job outputs")
    parser.add_argument("--wait-s", type=float, default=120.0, help="bound on every wait")
    args = parser.parse_args()
    device = shlex.split(args.device)
    if args.smoke:
        device = ["--cpu", "--threads", "1", "--emulate-pcie", "200MB/s"]
    named = args.workdir
    if named is None and os.environ.get("GPU_CHECK_OUT"):
        named = Path(os.environ["GPU_CHECK_OUT"]) / "parity-work"
    with work_dir("rp-parity-", named) as root:
        print(f"daemon logs and job outputs in {root}", flush=True)
        code = compare(args, device, root)
        if code:
            sys.exit(code)  # inside work_dir: a temporary one is kept for its logs
    return 0


def compare(args: argparse.Namespace, device: list[str], root: Path) -> int:
    """Both loss curves, the table and the RESULT line; 0 when they agree."""
    reference = losses(
        root / "cpu", ["--cpu", "--threads", "1"], args.steps, args.wait_s, args.dtype
    )
    try:
        measured = losses(root / "device", device, args.steps, args.wait_s, args.dtype)
    except RuntimeError as exc:
        print(f"{exc}\nRESULT parity=FAIL error={str(exc).splitlines()[0]!r}", flush=True)
        if args.json:
            Path(args.json).write_text(
                json.dumps({"device": device, "cpu": reference, "error": str(exc), "ok": False})
            )
        return 1
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, measured))
    ok = len(reference) == len(measured) == args.steps and worst <= args.rtol
    print(f"{'step':>4} {'cpu worker':>12} {'device worker':>14}")
    for i, (a, b) in enumerate(zip(reference, measured), start=1):
        print(f"{i:4d} {a:12.6f} {b:14.6f}")
    print(f"RESULT parity={'ok' if ok else 'FAIL'} worst_rel_diff={worst:.2e}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "cpu": reference, "measured": measured, "ok": ok})
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
