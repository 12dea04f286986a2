"""Event table: ordered hand-offs between real processes, deadlines, monotonic counters."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import assert_import_fails

from roundpipe.shared import events
from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EventTable, EventTimeout, table_nbytes

TABLE_OFFSET = DATA_START  # must match tests/procs/shm_child.py
PAYLOAD_OFFSET = DATA_START + 4096


def make_table_arena(arena_dir: Path, payload_bytes: int = 0) -> tuple[Arena, EventTable]:
    arena = Arena.create("events", 4096 + payload_bytes, directory=arena_dir)
    return arena, EventTable.create(arena, TABLE_OFFSET, 64)


@pytest.mark.parametrize(("slots", "words"), [(1, 512), (4, 16_384)])
def test_ten_thousand_ordered_handoffs_between_processes(
    arena_dir: Path, spawn_child, slots: int, words: int
) -> None:
    """A producer and a consumer process hand 10,000 payloads over through the table.

    Each payload's first word is -i and the rest are i, so a read that raced the writer
    (a torn read) or came out of order is counted as bad by the consumer.
    """
    n = 10_000
    arena, _ = make_table_arena(arena_dir, payload_bytes=slots * words * 8)
    try:
        consumer = spawn_child("shm_child.py", "consumer", arena.path, n, slots, words)
        producer = spawn_child("shm_child.py", "producer", arena.path, n, slots, words)
        out, err = consumer.communicate(timeout=240)
        assert consumer.returncode == 0, err
        assert producer.wait(timeout=60) == 0, producer.stderr.read()
        assert out.strip() == "bad=0"
        table = EventTable(arena, TABLE_OFFSET)
        assert table.read(0) == n and table.read(1) == n
    finally:
        arena.destroy()


def test_timeout_names_counter_target_and_last_value(arena_dir: Path) -> None:
    arena, table = make_table_arena(arena_dir)
    try:
        table.set_labeler(lambda i: f"wgrad[layer {i}]")
        table.signal(3, 4)
        start = time.perf_counter()
        with pytest.raises(EventTimeout) as err:
            table.wait_at_least(3, 5, timeout_s=0.2)
        elapsed = time.perf_counter() - start
        assert 0.2 <= elapsed < 20  # the timeout, not forever (a loaded machine runs late)
        message = str(err.value)
        assert "wgrad[layer 3] (counter 3)" in message
        assert "reach 5" in message and "last value seen 4" in message
    finally:
        arena.destroy()


def test_counters_never_go_backwards(arena_dir: Path) -> None:
    arena, table = make_table_arena(arena_dir)
    try:
        table.signal(0, 7)
        table.signal(0, 3)  # a re-executed task re-signals an older value: ignored
        assert table.read(0) == 7
        assert table.wait_at_least(0, 5, timeout_s=0.1) == 7
        with pytest.raises(IndexError):
            table.signal(64, 1)
        # A value past a signed 64-bit counter is refused: stored, it wrapped around to
        # a negative value and the counter went backwards. The wire refuses it too.
        with pytest.raises(ValueError, match="signed 64-bit"):
            table.signal(0, 2**63)
        assert table.read(0) == 7
        from roundpipe.protocol import EventSignal, ProtocolError

        with pytest.raises(ProtocolError, match="value"):
            EventSignal(counter=0, value=2**63)
    finally:
        arena.destroy()


def test_abort_interrupts_a_wait(arena_dir: Path) -> None:
    arena, table = make_table_arena(arena_dir)
    try:
        stop = threading.Event()
        threading.Timer(0.1, stop.set).start()
        with pytest.raises(InterruptedError, match="aborted"):
            table.wait_at_least(5, 1, timeout_s=30, should_abort=stop.is_set)
    finally:
        arena.destroy()


@pytest.mark.parametrize("poll_ms", [0.0, 20.0])
def test_sleeping_waiter_is_woken_by_another_process(
    arena_dir: Path, spawn_child, monkeypatch, poll_ms: float
) -> None:
    """The waiter falls asleep (futex) before the signal; it must wake promptly, not at
    the end of its sleep slice. Timing is only reported here, not asserted (see
    benchmarks/ipc.py), except for a generous bound that a lost wake-up would break.
    With poll-sleeping off (0) the waiter is in 50 ms slices, so that bound proves the
    futex wake; with the default it is in 100 us slices (Note [waiting in three
    phases])."""
    monkeypatch.setattr(events, "_POLL_S", poll_ms / 1e3)
    n = 20
    arena, table = make_table_arena(arena_dir, payload_bytes=8 * n)
    try:
        waker = spawn_child("shm_child.py", "waker", arena.path, n)
        stamps = arena.view(arena.ref(PAYLOAD_OFFSET, torch.float64, (n,)))
        latencies = []
        for i in range(1, n + 1):
            table.signal(2, i)
            table.wait_at_least(0, i, timeout_s=30)
            latencies.append(time.perf_counter() - float(stamps[i - 1]))
        assert waker.wait(timeout=30) == 0
        latencies.sort()
        print(f"median wake latency {latencies[n // 2] * 1e6:.1f} us")
        assert latencies[n // 2] < 0.045  # below one 50 ms sleep slice: woken, not timed out
    finally:
        arena.destroy()


def test_bad_poll_window_setting_is_a_clear_error() -> None:
    assert_import_fails(
        "roundpipe.shared.events",
        {"ROUNDPIPE_WAIT_POLL_MS": "soon"},
        "ROUNDPIPE_WAIT_POLL_MS='soon' is not a number of milliseconds",
    )


def test_table_must_fit_its_arena(arena_dir: Path) -> None:
    with Arena.create("tiny", 64, directory=arena_dir) as arena:
        with pytest.raises(Exception, match="needs"):
            EventTable.create(arena, TABLE_OFFSET, 10_000)
        assert table_nbytes(10) == 64 + 80
