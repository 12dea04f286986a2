"""The chaos harness's worker bookkeeping (roundpipe.chaos._Fleet), without processes.

Workers are named ``chaos-w0``, ``chaos-w1``, ... in every chaos run, so whatever a run
remembers about a name must stay with that run. A set of frozen names once lived at
module level: a worker frozen (SIGSTOP) by one test, its cluster stopped before the name
was forgotten, hid the next test's live ``chaos-w3``; the harness then waited for the
wrong workers until it timed out.
"""

from __future__ import annotations

import signal

from roundpipe.chaos import _Fleet


class FakeDaemon:
    def __init__(self, name: str) -> None:
        self.name = name
        self.exited = False
        self.signals: list[int] = []

    def alive(self) -> bool:
        return not self.exited


class FakeCluster:
    """What _Fleet uses of LocalCluster: its worker table, add_worker and signal_worker."""

    def __init__(self) -> None:
        self.workers: dict[str, FakeDaemon] = {}
        self.faults: dict[str, str | None] = {}

    def add_worker(self, name: str, *, fault: str | None = None) -> FakeDaemon:
        self.workers[name] = FakeDaemon(name)
        self.faults[name] = fault
        return self.workers[name]

    def signal_worker(self, name: str, sig: int) -> None:
        self.workers[name].signals.append(sig)


def test_keep_starts_workers_up_to_the_count_and_replaces_the_exited() -> None:
    cluster = FakeCluster()
    fleet = _Fleet(cluster, 3)
    fleet.keep()
    assert fleet.running() == ["chaos-w0", "chaos-w1", "chaos-w2"]
    cluster.workers["chaos-w1"].exited = True
    fleet.keep()
    assert fleet.running() == ["chaos-w0", "chaos-w2", "chaos-w3"]
    assert "chaos-w1" not in cluster.workers


def test_a_frozen_worker_is_neither_picked_nor_counted_until_it_is_fenced() -> None:
    cluster = FakeCluster()
    fleet = _Fleet(cluster, 2)
    fleet.keep()
    fleet.freeze("chaos-w0")
    assert cluster.workers["chaos-w0"].signals == [signal.SIGSTOP]
    assert fleet.running() == ["chaos-w1"]
    fleet.keep()  # the frozen one still looks alive: a replacement joins beside it
    assert fleet.running() == ["chaos-w1", "chaos-w2"]
    cluster.workers["chaos-w0"].exited = True  # the coordinator fenced it
    fleet.keep()
    assert "chaos-w0" not in cluster.workers and "chaos-w0" not in fleet.frozen


def test_a_name_frozen_by_one_run_does_not_hide_the_next_runs_worker() -> None:
    first = _Fleet(FakeCluster(), 4)
    first.keep()
    first.freeze("chaos-w3")  # and its cluster stops before the worker is fenced
    second = _Fleet(FakeCluster(), 4)
    second.keep()
    assert second.running() == ["chaos-w0", "chaos-w1", "chaos-w2", "chaos-w3"]


def test_an_armed_worker_carries_its_fault() -> None:
    cluster = FakeCluster()
    fleet = _Fleet(cluster, 1)
    armed = fleet.add(fault="kill@iteration=4,when=issued")
    fleet.keep()
    assert fleet.running() == [armed.name]
    assert cluster.faults[armed.name] == "kill@iteration=4,when=issued"
