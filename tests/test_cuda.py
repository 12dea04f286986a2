"""CUDA paths of the shared-memory layer. Skipped cleanly on machines without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EventTable
from roundpipe.worker.cuda import (
    CudaEventReader,
    EventHandleBoard,
    cuda_available,
    pin_arena,
    unpin_arena,
)

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
        assert unpin_arena(arena)  # the driver agreed


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
        table.signal(2, 1)  # done with its event: the producer may exit
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


# -- the CUDA transfer engine (roundpipe.worker.transfer) ---------------------------------


def _cuda_engine(**kw):
    from roundpipe.worker.transfer import CudaEngine

    return CudaEngine(torch.device("cuda", 0), **kw)


def test_cuda_engine_round_trip_through_a_registered_arena(arena_dir: Path) -> None:
    from roundpipe.worker.transfer import Priority

    engine = _cuda_engine(chunk_bytes=1 << 20)
    with Arena.create("eng", 64 << 20, directory=arena_dir) as arena:
        engine.register([arena])
        try:
            host = arena.view(arena.ref(DATA_START, torch.float32, (4 << 20,)))
            host.copy_(torch.randn(4 << 20))
            up = engine.upload({"w": host}, Priority.WEIGHT)  # 16 chunks on the weight stream
            dev = up.tensors()["w"]
            assert dev.is_cuda and torch.equal(dev.cpu(), host)
            back = arena.view(arena.ref(DATA_START + (32 << 20), torch.float32, (4 << 20,)))
            landed: list[bool] = []
            done = engine.download(
                [(dev * 2, back)],
                Priority.ACTIVATION,
                then=lambda: landed.append(torch.equal(back, host * 2)),
            )
            done.wait(60)
            assert landed == [True]  # the callback ran after the bytes were in the arena
        finally:
            engine.unregister([arena])
            engine.close()


def test_a_cuda_engine_given_no_device_index_uses_the_current_device(arena_dir: Path) -> None:
    """``cuda`` without an index: the link threads' set_device would raise and the thread
    die, and the first copy would wait forever; the engine takes the current device."""
    from roundpipe.worker.transfer import CudaEngine, Priority

    engine = CudaEngine(torch.device("cuda"))
    with Arena.create("noindex", 8 << 20, directory=arena_dir) as arena:
        engine.register([arena])
        engine.register([arena])  # registered once: a second pin would be refused
        try:
            assert engine.device == torch.device("cuda", torch.cuda.current_device())
            host = arena.view(arena.ref(DATA_START, torch.float32, (1 << 20,)))
            host.copy_(torch.arange(1 << 20, dtype=torch.float32))
            up = engine.upload({"w": host}, Priority.WEIGHT)
            assert torch.equal(up.tensors()["w"].cpu(), host)
        finally:
            engine.unregister([arena])
            engine.close()


def test_cuda_activation_upload_overtakes_queued_weight_chunks(arena_dir: Path) -> None:
    from roundpipe.worker.transfer import Priority

    engine = _cuda_engine(chunk_bytes=4 << 20, window=2)
    try:
        weights = engine.upload(
            {"w": torch.zeros(512 << 20, dtype=torch.uint8).pin_memory()}, Priority.WEIGHT
        )
        left: list[int] = []
        act = engine.upload({"x": torch.ones(1024).pin_memory()}, Priority.ACTIVATION)
        act.then(lambda: left.append(weights._left))
        act.wait(60)
        weights.wait(60)
        assert left[0] > 100  # of 128 chunks: it waited for the window, not the stage
    finally:
        engine.close()


def test_cuda_stopwatch_and_bandwidth_measure_something() -> None:
    engine = _cuda_engine()
    try:
        h2d, d2h = engine.measure_bandwidth(nbytes=16 << 20, reps=2)
        assert h2d > 1e9 and d2h > 1e9
        watch = engine.stopwatch()
        a = torch.randn(2048, 2048, device="cuda")
        watch.start(3)
        for _ in range(10):
            a = a @ a.T / 2048
        watch.stop(3)
        assert watch.resolve()[3] > 0
    finally:
        engine.close()


def test_gpu_worker_core_matches_the_cpu_worker(tmp_path: Path, arena_dir: Path) -> None:
    """Every task of an iteration on a GPU WorkerCore (CUDA engine, prefetch) gives the
    CPU worker's loss and gradients (fp32, within float noise)."""
    from runtime_helpers import first_iteration

    from roundpipe.worker.runtime import WorkerCore

    results = []
    for device in ("cpu", "cuda:0"):
        trainer, tasks = first_iteration(
            tmp_path / device, arena_dir, "job-gpu", f"gpu{device[:3]}"
        )
        layout = trainer.layout
        num_mb = len(tasks[0].microbatches)
        core = WorkerCore(0, device)
        try:
            core.setup_job(trainer.job_setup())
            queue = list(tasks)
            core.peek_next = lambda queue=queue: queue[0] if queue else None
            dones = []
            while queue:
                dones.append(core.run_task(queue.pop(0)))
            assert all(d.layer_times for d in dones)  # CUDA-event timings reach the planner
            losses = [layout.view(layout.loss[(1, m)]).item() for m in range(num_mb)]
            grads = {
                n: v.clone()
                for layer in range(trainer.model.num_layers)
                for n, v in core.jobs["job-gpu"].grads.get(layer, {}).items()
            }
            results.append((losses, grads))
        finally:
            core.close()
            trainer.close()
    (cpu_losses, cpu_grads), (gpu_losses, gpu_grads) = results
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, g in cpu_grads.items():
        assert torch.allclose(gpu_grads[name], g, rtol=1e-3, atol=1e-5), name


def test_a_gpu_worker_holds_no_cached_memory_after_its_last_job(
    tmp_path: Path, arena_dir: Path
) -> None:
    """After an iteration on a GPU WorkerCore and the job's teardown, the process has
    given the allocator's cached blocks back: its reserved memory is no more than
    before the job (it rose during it)."""
    from runtime_helpers import first_iteration

    from roundpipe.worker.runtime import WorkerCore

    trainer, tasks = first_iteration(tmp_path, arena_dir, "job-gpu-rel", "gpurel")
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    core = WorkerCore(0, "cuda:0")
    try:
        core.setup_job(trainer.job_setup())
        for task in tasks:
            core.run_task(task)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_reserved() > before
        core.teardown_job("job-gpu-rel")
        assert torch.cuda.memory_reserved() <= before, torch.cuda.memory_summary()
    finally:
        core.close()
        trainer.close()


def test_cuda_engines_hand_off_an_activation_through_an_ipc_event(
    arena_dir: Path, spawn_child
) -> None:
    """Note [activation hand-off]: the producer process stores the counter at issue; this
    process's upload link makes its stream wait on the producer's interprocess event, so
    it reads the complete payload though the counter came ~1 s before the bytes."""
    sys.path.insert(0, str(Path(__file__).parent / "procs"))
    import cuda_handoff_child as child_mod

    from roundpipe.shared.handoff import HandoffBoard, events_arena_nbytes
    from roundpipe.worker.transfer import Priority

    counters = child_mod.COUNTERS
    nbytes = child_mod.payload_offset() - DATA_START + child_mod.WORDS * 4
    assert nbytes > events_arena_nbytes(counters)
    with Arena.create("handoff", nbytes, directory=arena_dir) as arena:
        table = EventTable.create(arena, DATA_START, counters.total)
        board = HandoffBoard(table, counters)
        payload = arena.view(
            arena.ref(child_mod.payload_offset(), torch.float32, (child_mod.WORDS,))
        )
        payload.zero_()
        engine = _cuda_engine()
        engine.register([arena])
        try:
            child = spawn_child("cuda_handoff_child.py", arena.path)
            table.wait_at_least(child_mod.COUNTER, 1, timeout_s=120)
            handoff = board.handoff(child_mod.COUNTER, 1, timeout_s=60)
            assert handoff is not None, "the counter came after landing, not at issue"
            assert handoff.ticket.handle and handoff.ticket.seq >= 1
            up = engine.upload({"x": payload}, Priority.ACTIVATION, [handoff])
            got = up.tensors()["x"]
            assert bool((got == 42.0).all()), "consumer copied before the producer's D2H"
            # The producer marks "landed" from its own link thread once its host sees the
            # copy done, which may be after this consumer's device-side wait released it.
            board.wait_landed(child_mod.COUNTER, 1, timeout_s=60)
            table.signal(child_mod.DONE, 1)
            assert child.wait(timeout=60) == 0, child.stderr.read()
        finally:
            engine.unregister([arena])
            engine.close()
            board.close()
            table.close()
