"""Host<->device copy bandwidth: pinned (an arena registered in place) vs pageable memory.

What a GPU worker's transfers can reach: a 256 MB buffer copied to and from the device,
from pageable memory and from memory registered with ``cudaHostRegister`` (as the worker
registers its arenas, roundpipe.worker.cuda.pin_arena), plus what the transfer engine
measures at start-up (``Hello.h2d_bytes_per_s``). ``--smoke`` runs the same code on the
CPU (a plain copy stands in for each direction) so the tests can run the script.

Prints a table and last ``RESULT h2d_pinned_gbs=<x> d2h_pinned_gbs=<y> pinned_speedup=<z>``.

Usage: python benchmarks/bandwidth.py [--mb 256] [--reps 10] [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.worker.cuda import pin_arena, unpin_arena


def rate(src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
    cuda = dst.is_cuda or src.is_cuda
    dst.copy_(src, non_blocking=True)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    if cuda:
        torch.cuda.synchronize()
    return src.numel() * reps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU only, small")
    args = parser.parse_args()
    nbytes = (8 if args.smoke else args.mb) << 20
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    rows = {}
    rows["pageable"] = (rate(pageable, dev, args.reps), rate(dev, pageable, args.reps))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        with Arena.create("bw", nbytes, directory=Path(tmp)) as arena:
            pinned = pin_arena(arena)  # False without CUDA: then the same copies, unpinned
            host = arena.view(arena.ref(DATA_START, torch.uint8, (arena.data_nbytes,)))[:nbytes]
            try:
                rows["arena, registered" if pinned else "arena (no CUDA: not pinned)"] = (
                    rate(host, dev, args.reps),
                    rate(dev, host, args.reps),
                )
            finally:
                if pinned:
                    unpin_arena(arena)
    if device.type == "cuda":
        from roundpipe.worker.transfer import CudaEngine

        engine = CudaEngine(device)
        rows["engine start-up test"] = engine.measure_bandwidth()
        engine.close()
    print(
        f"{nbytes >> 20} MB x {args.reps} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    print(f"{'host memory':28} {'H2D GB/s':>9} {'D2H GB/s':>9}")
    for name, (h2d, d2h) in rows.items():
        print(f"{name:28} {h2d / 1e9:9.2f} {d2h / 1e9:9.2f}")
    pinned_row = next(v for k, v in rows.items() if k.startswith("arena"))
    print(
        f"RESULT h2d_pinned_gbs={pinned_row[0] / 1e9:.2f} d2h_pinned_gbs={pinned_row[1] / 1e9:.2f}"
        f" pinned_speedup={pinned_row[0] / rows['pageable'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
