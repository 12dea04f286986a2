"""CPU optimizer throughput against the machine's memory-copy bandwidth (issue 18).

Every system does one AdamW step over the same Qwen3-1.7B-shaped decoder layers (fp32
masters, fp32 gradients, fp32 moments) *and* writes the updated weights in the compute
dtype (bf16), as the runtime must before a layer's new version is published:

  runtime     this runtime's path: LayerwiseOptimizer.step_layers over all layers (chunked
              fused AdamW with the cast in the same pass, a team of ``--threads``)
  runtime-dft the same with the default thread count (half the cores)
  torch-fused one torch.optim.AdamW(fused=True) over all parameters, then a cast per tensor
  loop        the per-layer loop as it was before issue 18: a torch.optim.AdamW(fused=True)
              per layer, stepped one after another, each followed by its cast
  paper       the paper's library's CPU Adam (PyPI roundpipe 0.1.1, subpackage
              roundpipe/optim: a C++ OpenMP kernel built with torch's cpp_extension at
              first use; decoupled weight decay, i.e. AdamW), then a cast per tensor. Run in
              its own process, with its own site directory (``--paper-site``; installed
              there with pip if missing), loading that subpackage alone: the package's
              ``__init__`` needs a GPU, and its import name is also ``roundpipe``.
  copy        a large tensor copy (256 MiB) and an in-place update of one (torch): the
  in-place    bandwidth bound is the faster of the two (bytes read plus bytes written).

GB/s counts the bytes AdamW with the cast must move per parameter, the same for every
system: read+write master, moment and second moment (24), read the gradient (4), write
the bf16 weight (2): 30 bytes. Copy GB/s counts bytes read plus bytes written. Each
system is timed in interleaved rounds after a warm-up; the table shows the best round
(the machine may be shared) and the median. Every system in this process runs with
``--threads`` torch threads (default: every core), except runtime-dft; so does the
paper's process (OMP_NUM_THREADS).

Usage: python benchmarks/optimizer.py [--layers 6] [--scale 0.5] [--rounds 5]
       [--threads N] [--paper-site DIR] [--smoke]

Last line: ``RESULT optimizer_vs_bound=<runtime GB/s / bound GB/s>
vs_torch_fused=<runtime params/s / torch-fused params/s>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

BYTES_PER_PARAM = 30
"""Bytes AdamW plus the bf16 cast moves per parameter (see the module docstring)."""

# Qwen3-1.7B: hidden 2048, MLP 6144, 16 query heads and 8 KV heads of 128 (28 layers).
QWEN3_1_7B = {"hidden": 2048, "mlp": 6144, "heads": 16, "kv_heads": 8, "head_dim": 128}


def layer_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """One Qwen3-1.7B decoder layer's trainable tensors, matrix sides times ``scale``."""
    h = int(QWEN3_1_7B["hidden"] * scale)
    mlp = int(QWEN3_1_7B["mlp"] * scale)
    hd = QWEN3_1_7B["head_dim"]
    q = max(1, int(QWEN3_1_7B["heads"] * scale)) * hd
    kv = max(1, int(QWEN3_1_7B["kv_heads"] * scale)) * hd
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (mlp, h),
        "mlp.up_proj.weight": (mlp, h),
        "mlp.down_proj.weight": (h, mlp),
    }


class Buffers:
    """Masters, gradients, moments and bf16 outs of ``layers`` layers."""

    def __init__(self, layers: int, scale: float) -> None:
        shapes = layer_shapes(scale)
        gen = torch.Generator().manual_seed(0)
        self.masters = {
            i: {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
            for i in range(layers)
        }
        self.grads = {
            i: {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
            for i in range(layers)
        }
        self.moments = {
            i: {n: (torch.zeros(s), torch.zeros(s)) for n, s in shapes.items()}
            for i in range(layers)
        }
        self.outs = {
            i: {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes.items()}
            for i in range(layers)
        }
        self.num_params = sum(t.numel() for d in self.masters.values() for t in d.values())

    def flat(
        self,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(master, grad, exp_avg, exp_avg_sq, out) of every tensor."""
        return [
            (self.masters[i][n], self.grads[i][n], *self.moments[i][n], self.outs[i][n])
            for i in self.masters
            for n in self.masters[i]
        ]


def torch_adamw(items, lr: float, wd: float) -> torch.optim.AdamW:
    """A torch.optim.AdamW(fused=True) whose state lives in the given buffers."""
    params = [p for p, *_ in items]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    for p, g, m, v, _ in items:
        p.grad = g
        opt.state[p] = {"step": torch.zeros(()), "exp_avg": m, "exp_avg_sq": v}
    return opt


def copy_kernel(numel: int) -> Callable[[], None]:
    """A streaming copy: reads 4 bytes and writes 4 bytes per element."""
    src, dst = torch.randn(numel), torch.empty(numel)
    return lambda: dst.copy_(src)


def in_place_kernel(numel: int) -> Callable[[], None]:
    """A streaming in-place update: reads and writes 4 bytes per element, without the
    copy's read-for-ownership of the destination (AdamW's arrays are updated in place)."""
    t = torch.randn(numel)
    return lambda: t.add_(1.0)


def time_rounds(
    systems: dict[str, tuple[Callable[[], object], int]], rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each ``name: (fn, torch threads)``, interleaved rounds after one
    warm-up call each. Each call runs with its own torch thread count (set untimed: the
    runtime's optimizer sets it too, but only when it differs)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(rounds + 1):
        for name, (fn, threads) in systems.items():
            torch.set_num_threads(threads)
            start = time.perf_counter()
            fn()
            if r:  # round 0 is the warm-up
                times[name].append(time.perf_counter() - start)
    return times


# -- the paper's library, in its own process ---------------------------------------------


def paper_child(args: argparse.Namespace) -> None:
    """Runs in the child process: load roundpipe/optim from the paper's site directory as
    a package of its own (not ``roundpipe``: its ``__init__`` needs a GPU, and ours has the
    same name) and time its Adam with the cast."""
    package = Path(args.paper_site, "roundpipe", "optim")
    sys.path.insert(0, args.paper_site)  # its optim_builder imports cpuinfo from there
    spec = importlib.util.spec_from_file_location(
        "paper_optim", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper_optim"] = module
    spec.loader.exec_module(module)
    buffers = Buffers(args.layers, args.scale)
    items = buffers.flat()
    opt = module.Adam(
        [p for p, *_ in items], lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True
    )
    for p, g, m, v, _ in items:
        p.grad = g
        opt.state[p] = {"step": torch.zeros(()), "exp_avg": m, "exp_avg_sq": v}

    def step() -> None:
        opt.step()
        for p, *_, out in items:
            out.copy_(p)

    times = time_rounds({"paper": (step, torch.get_num_threads())}, args.rounds)["paper"]
    print(json.dumps({"times": times, "num_params": buffers.num_params}))


def run_paper(args: argparse.Namespace) -> tuple[list[float] | None, str]:
    """Times of the paper's Adam, or None and why not."""
    site = Path(args.paper_site)
    if not (site / "roundpipe" / "optim").is_dir():
        # Not vendored: installed from the package index into its own directory.
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
            + ["roundpipe==0.1.1", "py-cpuinfo"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if install.returncode != 0 or not (site / "roundpipe" / "optim").is_dir():
            tail = (install.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"unavailable: pip could not install roundpipe==0.1.1 ({tail})"
    threads = args.threads or len(os.sched_getaffinity(0))
    env = dict(
        os.environ,
        TORCH_EXTENSIONS_DIR=str(site / "torch_extensions"),
        OMP_NUM_THREADS=str(threads),  # its kernel's OpenMP team: the same thread count
    )
    child = subprocess.run(
        [sys.executable, __file__, "--paper-child", "--paper-site", str(site)]
        + ["--layers", str(args.layers), "--scale", str(args.scale)]
        + ["--rounds", str(args.rounds)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tempfile.gettempdir(),  # not the repo root: our roundpipe/ must not be found
    )
    if child.returncode != 0:
        tail = " ".join(child.stderr.strip().splitlines()[-2:]) or "no output"
        return None, f"unavailable: the paper's Adam did not build or run ({tail[-300:]})"
    return json.loads(child.stdout.strip().splitlines()[-1])["times"], ""


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--scale", type=float, default=0.5, help="matrix sides x this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument(
        "--paper-site", default=os.path.join(tempfile.gettempdir(), "rp-paper-site")
    )
    parser.add_argument("--no-paper", action="store_true", help="skip the paper's library")
    parser.add_argument("--smoke", action="store_true", help="a tiny, quick run (tests)")
    parser.add_argument("--paper-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.scale, args.rounds = 2, 0.125, 2
    if args.paper_child:
        paper_child(args)
        return

    from roundpipe.coordinator.training.optimizer import (
        LayerwiseOptimizer,
        LRSchedule,
        default_threads,
    )

    cores = len(os.sched_getaffinity(0))
    threads = args.threads or cores
    started = time.perf_counter()
    # The paper's process first, so the two processes' buffers are never alive together.
    paper_times, paper_note = (None, "skipped (--no-paper)")
    if not args.no_paper:
        paper_times, paper_note = run_paper(args)

    buffers = Buffers(args.layers, args.scale)
    items = buffers.flat()
    lr, wd = 1e-4, 0.01
    schedule = LRSchedule(lr=lr)

    def runtime_path(n: int) -> Callable[[], None]:
        opt = LayerwiseOptimizer(
            buffers.masters,
            schedule=schedule,
            weight_decay=wd,
            moments=buffers.moments,
            threads=n,
        )
        step = 0

        def run() -> None:
            nonlocal step
            step += 1
            opt.step_layers(buffers.grads, step, outs=buffers.outs)

        return run

    whole = torch_adamw(items, lr, wd)

    def torch_fused() -> None:
        whole.step()
        for p, *_, out in items:
            out.copy_(p)

    per_layer = {
        i: torch_adamw(
            [
                (p, buffers.grads[i][n], *buffers.moments[i][n], buffers.outs[i][n])
                for n, p in buffers.masters[i].items()
            ],
            lr,
            wd,
        )
        for i in buffers.masters
    }

    def loop() -> None:
        for i in sorted(per_layer, reverse=True):
            per_layer[i].step()
            for name, p in buffers.masters[i].items():
                buffers.outs[i][name].copy_(p)

    copy_numel = 64 * 1024 * 1024 if not args.smoke else 4 * 1024 * 1024
    ours, ours_default = runtime_path(threads), runtime_path(default_threads())
    systems: dict[str, tuple[Callable[[], object], int]] = {
        "runtime": (ours, threads),
        "runtime-dft": (ours_default, default_threads()),
        "torch-fused": (torch_fused, threads),
        "loop": (loop, threads),
        "copy": (copy_kernel(copy_numel), threads),
        "in-place": (in_place_kernel(copy_numel), threads),
    }
    times = time_rounds(systems, args.rounds)
    if paper_times is not None:
        times["paper"] = paper_times

    n = buffers.num_params
    # The bound: the better of the two streaming kernels (both count bytes read + written).
    stream_gbs = {k: 2 * 4 * copy_numel / min(times[k]) / 1e9 for k in ("copy", "in-place")}
    copy_gbs = max(stream_gbs.values())
    print(
        f"# {args.layers} Qwen3-1.7B-shaped layers x{args.scale} ({n / 1e6:.1f}M params), "
        f"{cores} cores, runtime threads {threads} (default {default_threads()}), "
        f"torch {torch.__version__}, {args.rounds} rounds"
    )
    print(
        f"{'system':12} {'best ms':>9} {'median ms':>10} {'Mparams/s':>10} {'GB/s':>7} {'vs bound':>9}"
    )
    rates: dict[str, float] = {}
    for name in ("runtime", "runtime-dft", "torch-fused", "loop", "paper"):
        if name not in times:
            print(f"{name:12} {paper_note}")
            continue
        best, median = min(times[name]), statistics.median(times[name])
        rates[name] = n / best
        gbs = n * BYTES_PER_PARAM / best / 1e9
        print(
            f"{name:12} {best * 1e3:9.1f} {median * 1e3:10.1f} {n / best / 1e6:10.0f} "
            f"{gbs:7.1f} {gbs / copy_gbs:9.2f}"
        )
    for name, gbs in stream_gbs.items():
        print(
            f"{name:12} {min(times[name]) * 1e3:9.1f} {statistics.median(times[name]) * 1e3:10.1f} "
            f"{'':>10} {gbs:7.1f} {gbs / copy_gbs:9.2f}"
        )
    print(f"# took {time.perf_counter() - started:.0f}s")
    vs_bound = rates["runtime"] * BYTES_PER_PARAM / 1e9 / copy_gbs
    vs_fused = rates["runtime"] / rates["torch-fused"]
    print(f"RESULT optimizer_vs_bound={vs_bound:.2f} vs_torch_fused={vs_fused:.2f}")


if __name__ == "__main__":
    main()
