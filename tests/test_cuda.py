"""CUDA paths of the shared-memory layer. Skipped cleanly on machines without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.cuda import (
    CudaEventReader,
    EventHandleBoard,
    cuda_available,
    pin_arena,
    unpin_arena,
)
from roundpipe.shared.events import EventTable

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TABLE_OFFSET = DATA_START  # must match tests/procs/cuda_child.py
BOARD_OFFSET = DATA_START + 1024
PAYLOAD_OFFSET = DATA_START + 8192
WORDS = 1 << 20


def test_registered_arena_h2d_and_d2h(arena_dir: Path) -> None:
    with Arena.create("pinned", 64 << 20, directory=arena_dir) as arena:
        assert pin_arena(arena)
        host = arena.view(arena.ref(DATA_START, torch.bfloat16, (4096, 4096)))
        host.copy_(torch.randn(4096, 4096).to(torch.bfloat16))
        device = host.to("cuda", non_blocking=True)
        back = arena.view(arena.ref(DATA_START + (32 << 20), torch.bfloat16, (4096, 4096)))
        back.copy_(device * 2, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, host * 2)
        unpin_arena(arena)


def test_ipc_event_orders_a_copy_across_processes(arena_dir: Path, spawn_child) -> None:
    nbytes = 8192 + WORDS * 4
    with Arena.create("ipc", nbytes, directory=arena_dir) as arena:
        table = EventTable.create(arena, TABLE_OFFSET, 8)
        payload = arena.view(arena.ref(PAYLOAD_OFFSET, torch.float32, (WORDS,)))
        payload.zero_()
        pin_arena(arena)
        child = spawn_child("cuda_child.py", arena.path)
        table.wait_at_least(0, 1, timeout_s=120)
        slot = table.read(1) - 1
        board = EventHandleBoard(arena, BOARD_OFFSET, num_producers=1, ring_size=4)
        reader = CudaEventReader(0, board.handles(0))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            reader.wait(slot, stream)  # device-side wait: the host does not block here
            on_device = payload.to("cuda", non_blocking=True)
        stream.synchronize()
        assert bool((on_device == 42.0).all()), "consumer copied before the producer's D2H"
        assert child.wait(timeout=60) == 0, child.stderr.read()
        unpin_arena(arena)


def test_cuda_helpers_report_availability() -> None:
    assert cuda_available()


def test_memory_limit_caps_the_worker_process() -> None:
    """`roundpipe-worker --gpu N --memory-limit SIZE`: allocations past the cap fail in
    that process (run in a child so the cap does not stay on this test process)."""
    code = (
        "import torch\n"
        "from roundpipe.worker.daemon import apply_memory_limit\n"
        "apply_memory_limit(torch.device('cuda:0'), 1 << 30)\n"
        "a = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    b = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('capped')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "capped" in result.stdout, result.stderr
