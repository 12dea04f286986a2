"""CPU optimizer throughput against the machine's memory bandwidth (issues 18 and 35).

Every system does the same work, one AdamW step over the same Qwen3-1.7B-shaped decoder
layers (fp32 masters, fp32 gradients, two fp32 moments) *and* the updated weights written
in the compute dtype (bf16), as the runtime must before a layer's new version is
published. What differs is how many passes over memory each makes for it:

  runtime       this runtime's path: LayerwiseOptimizer.step_layers over all layers on
                its compiled kernel (Note [compiled AdamW kernel]): one pass, AdamW and the
                bf16 cast together, a team of ``--threads``
  runtime-dft   the same with the default thread count (half the cores)
  runtime-torch the same optimizer with ``kernel="torch"`` (torch's fused kernel per 1M-
                element chunk, each chunk cast to bf16 right after, from cache)
  torch-fused   one torch.optim.AdamW(fused=True) over all parameters, then a cast per tensor
  loop          the per-layer loop as it was before issue 18: a torch.optim.AdamW(fused=True)
                per layer, stepped one after another, each followed by its cast
  paper         the paper's library's CPU Adam (PyPI roundpipe 0.1.1, subpackage
                roundpipe/optim: a C++ OpenMP kernel built with torch's cpp_extension at
                first use, -Ofast -march=native; decoupled weight decay, i.e. AdamW), then
                a cast per tensor (its library has no fused cast: a second pass). Run in a
                process of its own, with its own site directory (``--paper-site``;
                installed there with pip if missing), loading that subpackage alone (the
                package's ``__init__`` needs a GPU, and its import name is also
                ``roundpipe``); the process stays up and is timed in the same interleaved
                rounds as the others, each round measured inside it.
  stream        the bound: a kernel with the runtime's exact memory traffic and next to no
                arithmetic, over the same buffers with the same threads and ranges
  copy          torch streaming kernels, for reference (not the bound: their read/write
  in-place      mix is not AdamW's)

Bytes per parameter (the ``B/param`` column) count what each system's passes move between
the cores and memory: every fp32 array read (4 each) and written back (4 each), the bf16
weight written (2), plus a read for ownership (2) of the bf16 line before it is written,
as ordinary stores do to memory not read first. One pass: 16 read + 14 written + 2 = 32.
Two passes (AdamW, then ``out.copy_(p)``): 28 + (4 + 2 + 2) = 36; runtime-torch's second
pass re-reads a 4 MiB chunk, mostly from cache, so its 36 overstates its memory traffic.
GB/s is B/param x params/s; "vs bound" is that over the stream row's GB/s (the runtime
moves exactly the stream's bytes, so its figure is time_stream / time_runtime).

Each system is timed in interleaved rounds after a warm-up; the table shows the best round
(the machine may be shared) and the median. Every system runs with ``--threads`` threads
(default: every core), except runtime-dft; so does the paper's process (OMP_NUM_THREADS).

Usage: python benchmarks/optimizer.py [--layers 6] [--scale 0.5] [--rounds 7]
       [--threads N] [--paper-site DIR] [--no-paper] [--smoke]

Last line: ``RESULT optimizer_vs_bound=<runtime GB/s / stream GB/s>
vs_torch_fused=<runtime params/s / torch-fused params/s>
vs_paper_adam=<runtime params/s / paper params/s, nan without the paper's row>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

BYTES_PER_PARAM = {
    "runtime": 32,
    "runtime-dft": 32,
    "runtime-torch": 36,
    "torch-fused": 36,
    "loop": 36,
    "paper": 36,
    "stream": 32,
}
"""Bytes each system moves per parameter (see the module docstring)."""
COPY_BYTES = {"copy": 12, "in-place": 8}
"""Bytes per fp32 element: a copy reads 4, writes 4 and reads the destination line for
ownership (4); an in-place update reads 4 and writes 4."""
SYSTEMS = ("runtime", "runtime-dft", "runtime-torch", "torch-fused", "loop", "paper")

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
    """A streaming in-place update: reads and writes 4 bytes per element."""
    t = torch.randn(numel)
    return lambda: t.add_(1.0)


def stream_kernel(buffers: Buffers, threads: int) -> Callable[[], None]:
    """The bound: the runtime kernel's memory traffic (read master, gradient and both
    moments, write back master and moments, write a bf16 weight) with trivial arithmetic,
    over the same buffers, split between ``threads`` threads as the runtime splits them.
    Values are left unchanged (``x * 1 + g * 0`` is ``x`` for finite data; without fast
    math the compiler must still load and store everything)."""
    import numba

    from roundpipe.coordinator.training.adamw_kernel import Team, flat_array, split

    @numba.njit(nogil=True, error_model="numpy")
    def touch(p, g, m, v, out):
        one, zero = np.float32(1.0), np.float32(0.0)
        for i in range(p.size):
            dg = g[i] * zero
            x = p[i] * one + dg
            p[i] = x
            m[i] = m[i] * one + dg
            v[i] = v[i] * one + dg
            out[i] = np.uint16(x > zero)  # a data-dependent 2-byte store, as the cast's

    team = Team()
    arrays = [tuple(flat_array(t) for t in item) for item in buffers.flat()]
    # The runtime splits layer by layer; so does this.
    per_layer, start = [], 0
    for layer in buffers.masters:
        count = len(buffers.masters[layer])
        tensors = arrays[start : start + count]
        start += count
        per_layer.append((tensors, split([a[0].size for a in tensors], threads)))

    def run_share(tensors, share) -> None:
        for i, lo, hi in share:
            touch(*(a[lo:hi] for a in tensors[i]))

    def run() -> None:
        for tensors, shares in per_layer:
            team.run([lambda t=tensors, s=share: run_share(t, s) for share in shares])

    return run


def time_rounds(
    systems: dict[str, tuple[Callable[[], object], int]], rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each ``name: (fn, torch threads)``, interleaved rounds after one
    warm-up call each. Each call runs with its own torch thread count (set untimed: the
    runtime's optimizer sets it too, but only when it differs). A call that returns a
    float has timed itself (the paper's, measured in its own process): that is used."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(rounds + 1):
        for name, (fn, threads) in systems.items():
            torch.set_num_threads(threads)
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            if r:  # round 0 is the warm-up
                times[name].append(result if isinstance(result, float) else elapsed)
    return times


# -- the paper's library, in its own process ---------------------------------------------


def paper_child(args: argparse.Namespace) -> None:
    """Runs in the child process: load roundpipe/optim from the paper's site directory as
    a package of its own (not ``roundpipe``: its ``__init__`` needs a GPU, and ours has the
    same name), say ``ready``, then time one step of its Adam plus the cast for every
    ``step`` line read from stdin."""
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
    print(json.dumps({"ready": True, "num_params": buffers.num_params}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        opt.step()
        for p, *_, out in items:  # its library has no fused cast: a second pass
            out.copy_(p)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class Paper:
    """The paper's Adam, stepped in its own process (``paper_child``) on command."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child

    def step(self) -> float:
        """One step; the seconds it took, measured in the child."""
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write("step\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"the paper's process ended: {self.child.stderr.read()[-300:]}")
        return float(json.loads(line)["seconds"])

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        self.child.wait(timeout=60)


def start_paper(args: argparse.Namespace) -> tuple[Paper | None, str]:
    """The paper's process, built and ready to step, or None and why not."""
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
    child = subprocess.Popen(
        [sys.executable, __file__, "--paper-child", "--paper-site", str(site)]
        + ["--layers", str(args.layers), "--scale", str(args.scale)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not the repo root: our roundpipe/ must not be found
    )
    assert child.stdout is not None and child.stderr is not None
    ready = child.stdout.readline()  # after the build (minutes the first time) and setup
    if not ready:
        child.wait()
        tail = " ".join(child.stderr.read().strip().splitlines()[-2:]) or "no output"
        return None, f"unavailable: the paper's Adam did not build or run ({tail[-300:]})"
    return Paper(child), ""


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--scale", type=float, default=0.5, help="matrix sides x this")
    parser.add_argument("--rounds", type=int, default=7)
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
    paper, paper_note = (None, "skipped (--no-paper)")
    if not args.no_paper:
        paper, paper_note = start_paper(args)

    buffers = Buffers(args.layers, args.scale)
    items = buffers.flat()
    lr, wd = 1e-4, 0.01
    schedule = LRSchedule(lr=lr)

    def runtime_path(n: int, kernel: str) -> tuple[Callable[[], None], str]:
        opt = LayerwiseOptimizer(
            buffers.masters,
            schedule=schedule,
            weight_decay=wd,
            moments=buffers.moments,
            threads=n,
            kernel=kernel,
        )
        step = 0

        def run() -> None:
            nonlocal step
            step += 1
            opt.step_layers(buffers.grads, step, outs=buffers.outs)

        return run, opt.kernel_in_use

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
    ours, kernel = runtime_path(threads, "auto")
    ours_default, _ = runtime_path(default_threads(), "auto")
    ours_torch, _ = runtime_path(threads, "torch")
    systems: dict[str, tuple[Callable[[], object], int]] = {
        "runtime": (ours, threads),
        "runtime-dft": (ours_default, default_threads()),
        "runtime-torch": (ours_torch, threads),
        "torch-fused": (torch_fused, threads),
        "loop": (loop, threads),
        "stream": (stream_kernel(buffers, threads), threads),
        "copy": (copy_kernel(copy_numel), threads),
        "in-place": (in_place_kernel(copy_numel), threads),
    }
    if paper is not None:
        systems["paper"] = (paper.step, threads)
    try:
        times = time_rounds(systems, args.rounds)
    finally:
        if paper is not None:
            paper.close()

    n = buffers.num_params
    bound_gbs = n * BYTES_PER_PARAM["stream"] / min(times["stream"]) / 1e9
    print(
        f"# {args.layers} Qwen3-1.7B-shaped layers x{args.scale} ({n / 1e6:.1f}M params), "
        f"{cores} cores, runtime threads {threads} (default {default_threads()}), "
        f"runtime kernel {kernel}, torch {torch.__version__}, {args.rounds} rounds"
    )
    print(
        f"{'system':14} {'best ms':>9} {'median ms':>10} {'Mparams/s':>10} {'B/param':>8} "
        f"{'GB/s':>7} {'vs bound':>9}"
    )
    rates: dict[str, float] = {}
    for name in (*SYSTEMS, "stream"):
        if name not in times:
            print(f"{name:14} {paper_note}")
            continue
        best, median = min(times[name]), statistics.median(times[name])
        rates[name] = n / best
        gbs = n * BYTES_PER_PARAM[name] / best / 1e9
        print(
            f"{name:14} {best * 1e3:9.1f} {median * 1e3:10.1f} {n / best / 1e6:10.0f} "
            f"{BYTES_PER_PARAM[name]:8d} {gbs:7.1f} {gbs / bound_gbs:9.2f}"
        )
    for name, per_element in COPY_BYTES.items():
        best = min(times[name])
        gbs = per_element * copy_numel / best / 1e9
        print(
            f"{name:14} {best * 1e3:9.1f} {statistics.median(times[name]) * 1e3:10.1f} "
            f"{'':>10} {'':>8} {gbs:7.1f} {gbs / bound_gbs:9.2f}"
        )
    print(f"# took {time.perf_counter() - started:.0f}s")
    vs_bound = rates["runtime"] * BYTES_PER_PARAM["runtime"] / 1e9 / bound_gbs
    vs_fused = rates["runtime"] / rates["torch-fused"]
    vs_paper = rates["runtime"] / rates["paper"] if "paper" in rates else math.nan
    print(
        f"RESULT optimizer_vs_bound={vs_bound:.2f} vs_torch_fused={vs_fused:.2f} "
        f"vs_paper_adam={vs_paper:.2f}"
    )


if __name__ == "__main__":
    main()
