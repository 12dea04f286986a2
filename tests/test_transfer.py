"""The transfer engine (roundpipe.worker.transfer) through its emulated backend.

The emulated bus holds every chunk for latency + bytes / bandwidth before copying it, so
anything that reads data before its completion was reported sees stale bytes. These
tests drive the same scheduling logic the CUDA backend uses: priorities and chunking,
completion before counters, prefetch, and whole training runs that must stay bitwise
equal to the CPU backend.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import final_weights_in_process, first_iteration, tiny_spec
from transfer_helpers import HeldLink

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EventTable
from roundpipe.worker.runtime import WorkerCore
from roundpipe.worker.transfer import (
    CpuEngine,
    EmulatedEngine,
    Priority,
    Upload,
    make_engine,
    parse_duration,
)

MB = 1 << 20


@pytest.fixture
def engine():
    e = EmulatedEngine(100e6, latency_s=0.0, chunk_bytes=MB)
    yield e
    e.close()


def test_upload_lands_in_private_device_memory(engine: EmulatedEngine) -> None:
    src = torch.randn(1000)
    up = engine.upload({"w": src}, Priority.WEIGHT)
    got = up.tensors()["w"]
    assert torch.equal(got, src)
    assert got.data_ptr() != src.data_ptr()  # a copy, as on a device: not the arena view
    assert up.nbytes == 4000 and up.link_s > 0


def test_download_runs_its_callback_on_the_link_after_the_bytes_landed(
    engine: EmulatedEngine,
) -> None:
    src = torch.arange(3 * MB // 4, dtype=torch.float32)  # 3 MB: three 1 MB chunks
    dst = torch.zeros_like(src)
    seen: dict[str, object] = {}

    def landed() -> None:
        seen["thread"] = threading.current_thread().name
        seen["complete"] = torch.equal(dst, src)

    held = HeldLink(engine.d2h)
    t = engine.download([(src, dst)], Priority.WEIGHT, then=landed)
    assert not torch.equal(dst, src) and not seen  # asynchronous: nothing has landed yet
    held.release()
    t.wait(10)
    assert seen == {"thread": "rp-d2h-emulated", "complete": True}


def test_activation_upload_overtakes_queued_weight_chunks() -> None:
    """Note [priority-aware transfers]: an activation issued behind 8 weight chunks waits
    for the chunk on the bus, not for the other seven."""
    e = EmulatedEngine(1e9, latency_s=0.0, chunk_bytes=MB)
    held = HeldLink(e.h2d)  # the first weight chunk stays on the bus until both are queued
    try:
        weights = e.upload({"w": torch.zeros(2 * MB)}, Priority.WEIGHT)  # 8 chunks
        assert held.on_bus.wait(10)
        chunks_left_when_activation_landed: list[int] = []
        act = e.upload({"x": torch.ones(1000)}, Priority.ACTIVATION)
        act.then(lambda: chunks_left_when_activation_landed.append(weights._left))
        held.release()
        act.wait(10)
        weights.wait(10)
        assert chunks_left_when_activation_landed == [7]
        assert act.finished_at < weights.finished_at
    finally:
        held.release()
        e.close()


def test_activation_downloads_go_before_weight_gradients() -> None:
    e = EmulatedEngine(1e9, latency_s=0.0, chunk_bytes=MB)
    held = HeldLink(e.d2h)  # the first gradient chunk stays on the bus until both are queued
    try:
        order: list[str] = []
        grads = e.download(
            [(torch.ones(2 * MB), torch.zeros(2 * MB))],
            Priority.WEIGHT,
            then=lambda: order.append("g"),
        )
        assert held.on_bus.wait(10)
        act = e.download(
            [(torch.ones(10), torch.zeros(10))], Priority.ACTIVATION, then=lambda: order.append("a")
        )
        held.release()
        grads.wait(10)
        act.wait(10)
        assert order == ["a", "g"]
    finally:
        held.release()
        e.close()


def test_a_failed_copy_never_runs_its_success_callbacks(engine: EmulatedEngine) -> None:
    published: list[str] = []
    t = engine.download(
        [(torch.ones(10), torch.zeros(11))],  # shapes differ: the copy raises on the link
        Priority.ACTIVATION,
        then=lambda: published.append("counter"),
    )
    t.then(lambda: published.append("always"), always=True)
    with pytest.raises(RuntimeError):
        t.wait(10)
    assert published == ["always"]


def test_counter_is_stored_only_after_the_data_landed(arena_dir: Path) -> None:
    """The runtime's pattern: download, then signal in the completion. A reader that sees
    the counter must see every byte, however slow the bus."""
    e = EmulatedEngine(50e6, latency_s=0.02, chunk_bytes=MB)
    with Arena.create("ev", DATA_START + 8 * MB, directory=arena_dir) as arena:
        table = EventTable.create(arena, DATA_START, 4)
        data = arena.view(arena.ref(DATA_START + 4096, torch.float32, (MB,)))
        torn: list[int] = []
        stop = threading.Event()

        def reader() -> None:
            last = 0
            while not stop.is_set():
                k = table.read(0)
                if k > last:
                    table.wait_at_least(0, k, 1.0)  # with a memory barrier, like a real consumer
                    if not bool((data == float(k)).all()):
                        torn.append(k)
                    last = k

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for k in range(1, 6):
                src = torch.full((MB,), float(k))
                table.wait_at_least(0, k - 1, 10)
                e.download([(src, data)], Priority.ACTIVATION, then=lambda k=k: table.signal(0, k))
                # the next write may only start once its slot's reader is done: wait here
                table.wait_at_least(0, k, 10)
        finally:
            stop.set()
            thread.join()
            table.close()
            e.close()
        assert torn == []


def test_parse_duration_and_engine_choice() -> None:
    assert parse_duration("20us") == pytest.approx(2e-5)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("0.2") == 0.2
    with pytest.raises(ValueError, match="expected e.g."):
        parse_duration("fast")
    assert isinstance(make_engine("cpu"), CpuEngine)
    e = make_engine("cpu", emulate_bandwidth=2e9)
    assert isinstance(e, EmulatedEngine) and e.measure_bandwidth() == (2e9, 2e9)
    e.close()
    with pytest.raises(ValueError, match="a GPU has one"):
        make_engine("cuda:0", emulate_bandwidth=2e9)


# -- the worker runtime on the emulated bus ----------------------------------------------


def _prepared(tmp_path: Path, arena_dir: Path, namespace: str):
    return first_iteration(tmp_path, arena_dir, "job-tx", namespace)


def test_next_task_weights_upload_while_the_current_task_computes(
    tmp_path: Path, arena_dir: Path
) -> None:
    trainer, tasks = _prepared(tmp_path, arena_dir, "txprefetch")
    core = WorkerCore(1, transfer=EmulatedEngine(5e6, latency_s=0.001))
    try:
        core.setup_job(trainer.job_setup())
        queue = list(tasks)
        core.peek_next = lambda: queue[0] if queue else None
        dones = []
        while queue:
            task = queue.pop(0)
            dones.append(core.run_task(task))
            if task is tasks[0]:
                prefetched = core.prefetcher.last
                assert prefetched is not None and prefetched.started_at is not None
                # Uploading task 1's weights began before task 0's compute ended.
                assert prefetched.started_at < core.last_compute_end
        assert core.prefetcher.used == len(tasks) - 1
        assert core.prefetcher.discarded == 0
        assert all(d.upload_bytes > 0 and d.upload_s > 0 for d in dones)
        assert all(d.download_bytes > 0 for d in dones)
        assert dones[2].layer_times and dones[2].compute_s > 0
        # The prefetcher keeps no used upload (its device weights) alive once its task is
        # done: it holds none by a strong reference (the engine's threads may still hold
        # one for a moment, so whether it is gone yet is not asked).
        core.teardown_job("job-tx")
        held = [v for v in vars(core.prefetcher).values() if isinstance(v, Upload)]
        assert not held, held
    finally:
        core.close()
        trainer.close()


def test_a_stale_prefetch_is_discarded(tmp_path: Path, arena_dir: Path) -> None:
    from roundpipe.protocol import replace

    trainer, tasks = _prepared(tmp_path, arena_dir, "txstale")
    core = WorkerCore(1, transfer=EmulatedEngine(50e6, latency_s=0.0))
    try:
        core.setup_job(trainer.job_setup())
        retried = replace(tasks[1], attempt=1)  # the task was re-assigned: a new attempt
        core.peek_next = lambda: tasks[1]
        core.run_task(tasks[0])
        stale = core.prefetcher.last
        core.peek_next = lambda: None
        core.run_task(retried)  # must not take attempt 0's upload
        assert core.prefetcher.used == 0 and core.prefetcher.discarded == 1
        assert stale is not None
        core.peek_next = lambda: tasks[2]
        core.run_task(tasks[1])  # arms task 2, then the job goes away
        core.teardown_job("job-tx")
        assert core.prefetcher.discarded == 2
    finally:
        core.close()
        trainer.close()


def test_a_teardown_waits_for_a_prefetch_dropped_before(tmp_path: Path, arena_dir: Path) -> None:
    """A prefetch dropped without waiting (another task ran first) may still be copying
    from the job's arenas: the job's teardown waits for it too (it returned at once and
    unmapped the arenas under the copy: the transfer thread segfaulted)."""
    trainer, tasks = _prepared(tmp_path, arena_dir, "txdropped")
    core = WorkerCore(1, transfer=EmulatedEngine(1e6, latency_s=1e-5))  # a slow bus
    try:
        core.setup_job(trainer.job_setup())
        core.prefetcher.arm(tasks[1])
        deadline = time.monotonic() + 60
        while (dropped := core.prefetcher.last) is None:  # issued once its weights are
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert core.prefetcher.take(tasks[0]) is None  # another task first: dropped
        assert not dropped.done()
        core.teardown_job("job-tx")
        assert dropped.done()
    finally:
        core.close()
        trainer.close()


def _train(spec, arena_dir: Path, namespace: str, engine) -> dict[str, torch.Tensor]:
    return final_weights_in_process(spec, arena_dir, namespace, engine, job_id="job-tx")


@pytest.mark.parametrize("staleness", [0, 1])
def test_slow_emulated_bus_trains_bitwise_like_the_cpu_backend(
    tmp_path: Path, arena_dir: Path, staleness: int
) -> None:
    """Long copy delays everywhere: any counter stored before its data landed, any
    upload read before it completed, or a prefetch of the wrong weights changes bits."""
    spec = tiny_spec(tmp_path / "a", steps=4, staleness=staleness)
    cpu = _train(spec, arena_dir, "txcpu", None)
    slow = functools.partial(EmulatedEngine, 20e6, latency_s=0.003, chunk_bytes=64 * 1024)
    emulated = _train(
        tiny_spec(tmp_path / "b", steps=4, staleness=staleness), arena_dir, "txemu", slow
    )
    assert cpu.keys() == emulated.keys()
    for name in cpu:
        assert torch.equal(cpu[name], emulated[name]), name


def test_issue_is_seen_before_landing_and_a_failed_copy_counts_as_issued() -> None:
    """Note [compute waits on the device]: a CUDA compute thread waits only until every
    chunk is issued (``wait_issued``); the host engines wait for landing (``wait_usable``).
    A copy that fails must still wake whoever waits for its issue."""
    e = EmulatedEngine(1e9, latency_s=1.0, chunk_bytes=MB)  # lands 1 s after issue
    try:
        up = e.upload({"x": torch.ones(10)}, Priority.ACTIVATION)
        assert up.wait_issued(10)
        assert not up.done() and up.issued_at is not None
        assert e.wait_usable(up, 0.01) is False  # the host engine waits for the bytes
        assert e.wait_usable(up, 10) and up.done()
        bad = e.download([(torch.ones(10), torch.zeros(11))], Priority.ACTIVATION)
        assert bad.wait_issued(10)
        with pytest.raises(RuntimeError):
            bad.wait(10)
    finally:
        e.close()
