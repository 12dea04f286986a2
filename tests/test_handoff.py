"""Activation hand-offs (roundpipe.shared.handoff): counter at issue, landed mark later.

The emulated bus holds a producer's copy for its latency before writing the arena, so a
counter stored at issue is visibly ahead of the bytes. These tests check that consumers
still always read complete data (their upload link waits, their compute thread does not),
that a consumer which skipped the wait is caught, and that a producer which dies between
"counter at issue" and "landed" costs a re-run, never a wrong result.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import final_weights_in_process, first_iteration, tiny_spec
from transfer_helpers import HeldLink

from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.protocol import replace
from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import Counters, EventTable
from roundpipe.shared.handoff import (
    HandoffBoard,
    HandoffLost,
    IssueMark,
    events_arena_nbytes,
    handoff_offset,
)
from roundpipe.worker.runtime import WorkerCore
from roundpipe.worker.transfer import CpuEngine, EmulatedEngine, Priority

MB = 1 << 20


@pytest.fixture
def board(arena_dir: Path):
    counters = Counters(num_layers=2, num_microbatches=2)
    with Arena.create("ev", events_arena_nbytes(counters), directory=arena_dir) as arena:
        table = EventTable.create(arena, DATA_START, counters.total)
        table.set_labeler(counters.label)
        b = HandoffBoard(table, counters)
        yield b
        b.close()
        table.close()


def test_tickets_and_landed_marks_sit_after_the_counters(board: HandoffBoard) -> None:
    c = board.counters
    assert c.is_handoff(c.act(1, 1)) and c.is_handoff(c.dact(1, 1))
    assert not c.is_handoff(c.wgrad(0)) and not c.is_handoff(c.version(1))
    marks = {c.landed(i, v) for i in range(c.handoff_counters) for v in (1, 2)}
    assert len(marks) == 2 * c.handoff_counters and min(marks) > c.version(1)
    # The landed marks, then one wgrad_part counter per layer (split stages), then the
    # two loss-scale counters (float16 loss scaling, one per step parity) end it.
    assert max(marks) == c.total - 3 - c.num_layers == c.wgrad_part(0) - 1
    assert not c.is_handoff(c.wgrad_part(0)) and c.wgrad_part(c.num_layers - 1) == c.total - 3
    assert {c.loss_scale(1), c.loss_scale(2)} == {c.total - 2, c.total - 1}
    assert not c.is_handoff(c.loss_scale(1))
    assert board.table.label(c.landed(c.act(1, 0), 3)) == (
        f"landed act[layer 1][mb 0] (parity 1) (counter {c.landed(c.act(1, 0), 3)})"
    )
    assert handoff_offset(c) >= DATA_START + 64 + 8 * c.total
    # A ticket is for exactly one value; the other parity's record is separate.
    counter = c.act(1, 0)
    assert board.ticket(counter, 1) is None
    board.write_ticket(counter, 1, IssueMark(pid=123, seq=7, handle=b"h" * 64))
    board.write_ticket(counter, 2, IssueMark(pid=456))
    one, two = board.ticket(counter, 1), board.ticket(counter, 2)
    assert one is not None and (one.pid, one.seq, one.handle) == (123, 7, b"h" * 64)
    assert two is not None and (two.pid, two.handle) == (456, b"")
    assert board.ticket(counter, 3) is None  # parity 1 holds value 1, not 3
    with pytest.raises(IndexError, match="no act/dact counter"):
        board.write_ticket(c.wgrad(0), 1, IssueMark(pid=1))
    # No ticket for the value (a cpu producer, the coordinator): nothing to follow.
    assert board.handoff(c.act(0, 1), 1, 1.0) is None
    # Landed already: nothing to follow either.
    assert board.handoff(counter, 1, 1.0) is not None
    board.mark_landed(counter, 1)
    assert board.handoff(counter, 1, 1.0) is None


def test_a_rerun_of_the_producer_supersedes_the_ticket_a_consumer_followed(
    board: HandoffBoard,
) -> None:
    """A CUDA consumer whose stream followed the first producer's event must not publish
    once a re-run re-produced the data (the first event's outcome is undefined if its
    process died); the runtime asks ``superseded`` after the landed mark came."""
    counter = board.counters.dact(1, 1)
    board.write_ticket(counter, 3, IssueMark(pid=111, seq=5, handle=b"a" * 64))
    followed = board.handoff(counter, 3, 1.0)
    assert followed is not None and not followed.superseded()
    board.write_ticket(counter, 3, IssueMark(pid=222, seq=1, handle=b"b" * 64))  # the re-run
    board.mark_landed(counter, 3)
    assert followed.superseded()
    assert board.handoff(counter, 3, 1.0) is None  # landed: later consumers follow nothing


def _produce(engine, board: HandoffBoard, counter: int, value: int, src, dst):
    """What WorkerCore._download does for one act counter."""

    def issued(mark: IssueMark) -> None:
        board.write_ticket(counter, value, mark)
        board.table.signal(counter, value)

    return engine.download(
        [(src, dst)],
        Priority.ACTIVATION,
        then=lambda: board.mark_landed(counter, value),
        on_issue=issued,
    )


def test_counter_at_issue_and_the_consumer_link_waits(board: HandoffBoard, arena_dir) -> None:
    producer = EmulatedEngine(1e9, latency_s=0.0)
    held = HeldLink(producer.d2h)  # the producer's copy lands when the test says so
    consumer = EmulatedEngine(1e9, latency_s=0.0)
    try:
        with Arena.create("data", 8 * MB, directory=arena_dir) as arena:
            slot = arena.view(arena.ref(DATA_START, torch.float32, (MB,)))
            src = torch.full((MB,), 7.0)
            counter = board.counters.act(1, 0)
            down = _produce(producer, board, counter, 1, src, slot)
            board.table.wait_at_least(counter, 1, 5)
            # Counter at issue: stored, while the bytes and the landed mark are not there.
            assert not board.landed(counter, 1) and not bool((slot == 7.0).any())
            handoff = board.handoff(counter, 1, timeout_s=5)
            assert handoff is not None and handoff.ticket.pid > 0
            # Returns while the producer's copy is held: the caller (the compute thread)
            # did not wait; the consumer's link does.
            up = consumer.upload({"x": slot}, Priority.ACTIVATION, [handoff])
            assert not up.done() and not up.wait_issued(0.2)
            held.release()
            got = up.tensors()["x"]
            assert torch.equal(got, src)
            assert up.handoff_wait_s > 0  # spent on the link, not the caller
            assert down.issued_at is not None and down.finished_at is not None
            assert down.finished_at >= down.issued_at
            assert board.landed(counter, 1)
    finally:
        held.release()
        producer.close()
        consumer.close()


def test_a_consumer_that_skips_the_wait_reads_stale_bytes(board: HandoffBoard, arena_dir) -> None:
    """The test switch that disables the wait is caught: the check can fail."""
    producer = EmulatedEngine(1e9, latency_s=0.0)
    held = HeldLink(producer.d2h)  # the producer's copy lands when the test says so
    consumer = EmulatedEngine(1e9, latency_s=0.0)
    consumer.h2d.wait_for_producers = False
    try:
        with Arena.create("data", 8 * MB, directory=arena_dir) as arena:
            slot = arena.view(arena.ref(DATA_START, torch.float32, (MB,)))
            counter = board.counters.dact(0, 1)
            down = _produce(producer, board, counter, 1, torch.full((MB,), 3.0), slot)
            board.table.wait_at_least(counter, 1, 5)
            handoff = board.handoff(counter, 1, timeout_s=5)
            got = consumer.upload({"x": slot}, Priority.ACTIVATION, [handoff]).tensors()["x"]
            held.release()
            down.wait(5)  # before the arena goes away
            assert not bool((got == 3.0).any())  # stale: the slot's old zeros
    finally:
        held.release()
        producer.close()
        consumer.close()


def test_a_copy_that_never_lands_fails_the_consumer_with_a_clear_error(
    board: HandoffBoard,
) -> None:
    counter = board.counters.act(1, 1)
    board.write_ticket(counter, 1, IssueMark(pid=2**22 + 12345))  # no such process
    board.table.signal(counter, 1)
    handoff = board.handoff(counter, 1, timeout_s=0.2)
    assert handoff is not None
    consumer = EmulatedEngine(1e9, latency_s=0.0)
    try:
        up = consumer.upload({"x": torch.zeros(10)}, Priority.ACTIVATION, [handoff])
        with pytest.raises(HandoffLost, match=r"act\[layer 1\]\[mb 1\].*no longer running"):
            up.tensors()
    finally:
        consumer.close()
    # A cpu-backend consumer computes on the arena view: it waits on its own thread.
    with pytest.raises(HandoffLost, match="did not land within"):
        CpuEngine().upload({"x": torch.zeros(10)}, Priority.ACTIVATION, [handoff])


# -- whole runs -------------------------------------------------------------------------


class _SlowDownloads(EmulatedEngine):
    """Fast uploads, slow downloads: every act/dact counter is stored long before its
    bytes land. Keeps its hand-off transfers for the assertions."""

    instances: list[_SlowDownloads] = []

    def __init__(self, *, wait: bool = True) -> None:
        super().__init__(200e6, latency_s=0.0, chunk_bytes=64 * 1024)
        self.d2h.latency_s = 0.04
        self.h2d.wait_for_producers = wait
        self.handoff_downloads: list = []
        self.uploads: list = []
        _SlowDownloads.instances.append(self)

    def download(self, pairs, priority, then=None, on_issue=None):
        t = super().download(pairs, priority, then, on_issue)
        if on_issue is not None:
            self.handoff_downloads.append(t)
        return t

    def upload(self, tensors, priority, wait_for=()):
        up = super().upload(tensors, priority, wait_for)
        self.uploads.append(up)
        return up


def _final_weights(spec, arena_dir: Path, namespace: str, engine) -> dict[str, torch.Tensor]:
    return final_weights_in_process(spec, arena_dir, namespace, engine, job_id="job-ho")


def test_counter_at_issue_trains_bitwise_like_the_cpu_backend(
    tmp_path: Path, arena_dir: Path
) -> None:
    _SlowDownloads.instances = []
    cpu = _final_weights(tiny_spec(tmp_path / "a", steps=2), arena_dir, "hocpu", None)
    slow = _final_weights(tiny_spec(tmp_path / "b", steps=2), arena_dir, "hoslow", _SlowDownloads)
    assert cpu.keys() == slow.keys()
    for name in cpu:
        assert torch.equal(cpu[name], slow[name]), name
    engines = _SlowDownloads.instances
    downloads = [t for e in engines for t in e.handoff_downloads]
    assert downloads
    # Every act/dact counter went out at issue, before its bytes (typically a whole bus
    # latency, 40 ms; less when the link picked the copy up late on a loaded machine).
    ahead = sorted(t.finished_at - t.issued_at for t in downloads)
    assert ahead[0] > 0 and ahead[len(ahead) // 2] > 0.02
    # Consumers' links (not their compute threads) waited for producers' copies.
    assert sum(up.handoff_wait_s for e in engines for up in e.uploads) > 0


def test_a_consumer_that_skips_the_wait_changes_the_result(tmp_path: Path, arena_dir) -> None:
    cpu = _final_weights(tiny_spec(tmp_path / "a", steps=2), arena_dir, "hocpu2", None)
    broken = _final_weights(
        tiny_spec(tmp_path / "b", steps=2),
        arena_dir,
        "hobroken",
        lambda: _SlowDownloads(wait=False),
    )
    assert any(not torch.equal(cpu[name], broken[name]) for name in cpu)


class _FrozenDownloads(EmulatedEngine):
    """A producer that dies after "counter at issue": its downloads never land (until
    the test lets them, to tear down)."""

    def __init__(self) -> None:
        super().__init__(1e9, latency_s=0.0)
        self.held = HeldLink(self.d2h)


def _grads(trainer) -> dict[str, torch.Tensor]:
    layout: JobLayout = trainer.layout
    return {
        f"{layer}.{name}": layout.view(ref).clone()
        for layer, named in layout.grads.items()
        for name, ref in named.items()
    }


def test_a_producer_lost_between_issue_and_landing_costs_a_rerun(
    tmp_path: Path, arena_dir: Path
) -> None:
    """Note [dead producers and imported events]: the consumer fails (HandoffLost), the
    producer's task is re-run elsewhere (new ticket, its own landed mark), the consumer's
    re-run succeeds, and the iteration's gradients equal a fault-free run's."""
    ref_trainer, ref_tasks = first_iteration(tmp_path / "ref", arena_dir, "job-ref", "horef")
    ref = WorkerCore(0)
    try:
        ref.setup_job(ref_trainer.job_setup())
        for task in ref_tasks:
            ref.run_task(task)
        expected = _grads(ref_trainer)
    finally:
        ref.close()
        ref_trainer.close()

    trainer, tasks = first_iteration(tmp_path / "run", arena_dir, "job-ho", "hodead")
    frozen = _FrozenDownloads()
    engines = [frozen, EmulatedEngine(1e9, latency_s=0.0), EmulatedEngine(1e9, latency_s=0.0)]
    dying, consumer, rescuer = (WorkerCore(i, transfer=e) for i, e in enumerate(engines))
    try:
        for core in (dying, consumer, rescuer):
            core.setup_job(trainer.job_setup())
        dying.start_task(tasks[0], lambda result: None)  # returns once it computed
        counters = trainer.layout.counters
        out = counters.act(tasks[1].layer_start, 0)
        trainer.layout.events.wait_at_least(out, 1, 10)  # announced at issue...
        assert not trainer.layout.events.read(counters.landed(out, 1))  # ...never landed
        quick = replace(tasks[1], wait_timeout_s=0.5)
        with pytest.raises(HandoffLost, match="did not land within 0.5s"):
            consumer.run_task(quick)
        rescuer.run_task(replace(tasks[0], attempt=1))  # re-run: writes again, lands
        assert trainer.layout.events.read(counters.landed(out, 1)) == 1
        consumer.run_task(replace(tasks[1], attempt=1))
        for task in tasks[2:]:
            rescuer.run_task(task)
        got = _grads(trainer)
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    finally:
        frozen.held.release()  # the "dead" copy lands late (same bytes) before teardown
        for core in (dying, consumer, rescuer):
            core.close()
        for engine in engines:
            engine.close()
        trainer.close()


def test_a_consumer_waiting_for_a_lost_producer_yields_to_the_rerun(
    tmp_path: Path, arena_dir: Path
) -> None:
    """The re-run of the lost producer's task may come to the very worker whose upload
    waits for it: the waiting task gives up (TaskAborted: the daemon runs the lower-
    numbered re-run first), its link stops waiting, and both then run there."""
    from roundpipe.worker.runtime import TaskAborted

    trainer, tasks = first_iteration(tmp_path, arena_dir, "job-ho", "hoyield")
    frozen = _FrozenDownloads()
    engines = [frozen, EmulatedEngine(1e9, latency_s=0.0)]
    dying, consumer = (WorkerCore(i, transfer=e) for i, e in enumerate(engines))
    try:
        for core in (dying, consumer):
            core.setup_job(trainer.job_setup())
        dying.start_task(tasks[0], lambda result: None)
        trainer.layout.events.wait_at_least(trainer.layout.counters.act(2, 0), 1, 10)
        rerun_arrived = threading.Event()
        consumer.should_abort = rerun_arrived.is_set
        threading.Timer(0.3, rerun_arrived.set).start()
        started = time.perf_counter()
        with pytest.raises(TaskAborted, match="gave up waiting for a producer's copy"):
            consumer.run_task(tasks[1])  # its wait timeout is 30 s
        assert time.perf_counter() - started < 10
        consumer.should_abort = lambda: False
        consumer.run_task(replace(tasks[0], attempt=1))  # the link is free again
        consumer.run_task(tasks[1])
    finally:
        frozen.held.release()
        for core in (dying, consumer):
            core.close()
        for engine in engines:
            engine.close()
        trainer.close()


def test_ipc_exit_measurement_runs_and_never_hangs(tmp_path: Path) -> None:
    """scripts/ipc_event_after_exit.py (gpu_check.sh step ``ipc-exit``): what an imported
    CUDA event does once its exporter was killed. Without a GPU it says so."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / "ipc_event_after_exit.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads((tmp_path / "ipc_event_after_exit.json").read_text())
    print(json.dumps(found, indent=1))
    if not torch.cuda.is_available():
        assert found == {"cuda": False}
        assert result.stdout.strip().splitlines()[-1] == "RESULT cuda=false"
        return
    assert found["cuda"] and {"pending", "done"} <= found.keys()
    assert result.stdout.strip().splitlines()[-1].startswith("RESULT pending=")


def test_a_worker_whose_engine_broke_exits_even_with_threads_stuck(tmp_path: Path) -> None:
    """Note [dead producers and imported events], point c: threads queued behind a CUDA
    stream that waits on a dead process's event never finish, so the worker's hook exits
    the process (status 3) after a short grace, whatever its other threads do."""
    code = (
        "import threading, time\n"
        "from roundpipe.worker.daemon import _exit_when_broken\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()  # a stuck non-daemon thread\n"
        "print(time.time(), flush=True)  # broken from here on (the imports are not timed)\n"
        "_exit_when_broken('a stream waits on a dead producer')\n"
        "time.sleep(60)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert done.returncode == 3, done.stderr
    broken_at = float(done.stdout.split()[0])
    assert time.time() - broken_at < 30  # not the stuck thread's 60 s
