"""TaskTracker: re-dispatch after worker loss, parking, bounded retries, deadlines."""

from __future__ import annotations

import pytest
from protocol_helpers import sample_stage_task, task_failed

from roundpipe.coordinator.training import recovery
from roundpipe.coordinator.training.recovery import RecoveryPolicy, TaskGaveUp, TaskTracker
from roundpipe.protocol import StageTask, TaskDone


def task(task_id: int) -> StageTask:
    return sample_stage_task(job_id="j", task_id=task_id)


def done(task_id: int, worker_id: int, seconds: float = 0.1) -> TaskDone:
    return TaskDone(
        job_id="j", task_id=task_id, attempt=0, worker_id=worker_id, seconds=seconds, layer_times={}
    )


class Pool:
    def __init__(self, workers: list[int]):
        self.workers = workers
        self.sent: list[tuple[int, int, int]] = []  # (task id, attempt, worker)

    def send(self, t: StageTask, worker_id: int) -> None:
        self.sent.append((t.task_id, t.attempt, worker_id))


def make(workers: list[int], **policy) -> tuple[TaskTracker, Pool]:
    pool = Pool(workers)
    return TaskTracker(pool.send, lambda: list(pool.workers), RecoveryPolicy(**policy)), pool


def test_round_robin_and_duplicate_completions() -> None:
    tracker, pool = make([1, 2, 3])
    for i in range(5):
        tracker.dispatch(task(i))
    assert [w for _, _, w in pool.sent] == [1, 2, 3, 1, 2]
    assert tracker.completed(done(0, 1)) is not None
    assert tracker.completed(done(0, 3)) is None  # a late re-run: ignored


def test_lost_worker_tasks_go_to_the_others_as_new_attempts() -> None:
    tracker, pool = make([1, 2, 3])
    for i in range(6):
        tracker.dispatch(task(i))
    tracker.completed(done(0, 1))
    pool.workers.remove(1)
    pool.sent.clear()
    assert tracker.worker_lost(1, "process gone") == [3]  # task 0 had finished already
    assert pool.sent == [(3, 1, pool.sent[0][2])] and pool.sent[0][2] in (2, 3)
    assert tracker.in_flight[3].task.attempt == 1
    tracker.completed(done(3, pool.sent[0][2]))
    assert tracker.recoveries[0]["next_task_after_s"] is not None


def test_tasks_park_while_no_worker_is_left_and_resume_when_one_joins() -> None:
    tracker, pool = make([1])
    tracker.dispatch(task(0))
    tracker.dispatch(task(1))
    pool.workers.clear()
    tracker.worker_lost(1, "heartbeat")
    tracker.dispatch(task(2))
    assert tracker.waiting_for_workers and len(tracker.parked) == 3
    pool.workers.append(4)
    pool.sent.clear()
    assert tracker.dispatch_parked() == 3
    assert pool.sent == [(0, 1, 4), (1, 1, 4), (2, 0, 4)]  # in task order


def test_failing_task_is_retried_then_gives_up_with_its_error() -> None:
    tracker, pool = make([1, 2], max_attempts=3)
    tracker.dispatch(task(7))
    for attempt in range(2):
        worker = pool.sent[-1][2]
        tracker.failed(
            task_failed("j", 7, attempt, worker, "OutOfMemoryError", "CUDA out of memory")
        )
        assert pool.sent[-1][2] != worker  # retried on another worker
    with pytest.raises(TaskGaveUp, match="failed 3 times.*OutOfMemoryError: CUDA out of memory"):
        tracker.failed(
            task_failed("j", 7, 2, pool.sent[-1][2], "OutOfMemoryError", "CUDA out of memory")
        )


def test_progress_deadline_finds_a_hung_worker() -> None:
    tracker, _ = make([1, 2], deadline_floor_s=5.0, deadline_factor=10.0)
    tracker.dispatch(task(0))
    tracker.dispatch(task(1))
    start = tracker.in_flight[0].sent_at
    tracker.completed(done(1, 2, seconds=1.0))  # slowest task 1 s -> deadline 10 s
    assert tracker.hung_workers(start + 9) == []
    assert tracker.hung_workers(start + 11) == [1]
    # The coordinator stalled (frozen, paused) for 6 s meanwhile: completions waited
    # unread, so that is no worker's hang (every busy worker was SIGKILLed for it).
    tracker.excuse(6.0, now=start + 11)
    assert tracker.hung_workers(start + 11) == []
    assert tracker.hung_workers(start + 17) == [1]  # a real hang still is one


def test_the_only_worker_retries_its_own_failed_task() -> None:
    """With one worker there is no other to retry on: the task goes back to it (it was
    parked, waiting for a worker that never joins, and the job hung)."""
    tracker, pool = make([1], max_attempts=3)
    tracker.dispatch(task(7))
    tracker.failed(task_failed("j", 7, 0, 1, "OutOfMemoryError", "CUDA out of memory"))
    assert pool.sent[-1] == (7, 1, 1) and not tracker.parked
    assert not tracker.waiting_for_workers
    tracker.failed(task_failed("j", 7, 1, 1, "OutOfMemoryError", "CUDA out of memory"))
    with pytest.raises(TaskGaveUp, match="failed 3 times"):
        tracker.failed(task_failed("j", 7, 2, 1, "OutOfMemoryError", "CUDA out of memory"))


def test_idle_time_between_tasks_is_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline of a worker that had nothing to do runs from its next task: a pause
    between iterations (a drained checkpoint of a large model) longer than the deadline
    fenced every worker half a second after the next iteration began."""
    clock = [1000.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: clock[0])
    tracker, _ = make([1, 2], deadline_floor_s=5.0, deadline_factor=10.0)
    tracker.dispatch(task(0))
    tracker.dispatch(task(1))
    clock[0] += 0.1
    tracker.completed(done(0, 1, seconds=0.1))
    tracker.completed(done(1, 2, seconds=0.1))
    clock[0] += 60  # a minute with nothing in flight
    tracker.dispatch(task(2))
    tracker.dispatch(task(3))
    assert tracker.hung_workers(clock[0] + 0.5) == []
    assert tracker.hung_workers(clock[0] + 4) == []
    assert sorted(tracker.hung_workers(clock[0] + 6)) == [1, 2]  # a real hang still is one


def test_failures_its_workers_call_retryable_do_not_use_up_the_tasks_attempts() -> None:
    """A worker stopping under its task (a rolling restart of the workers), a dead
    producer's input, a failed copy: the worker marks such a failure retryable. Three of
    them under one task failed the job as if the task itself had failed three times.
    They count apart, against a bound that only stops a loop; the task's own failures
    still end it after max_attempts."""
    from roundpipe.protocol import replace

    tracker, pool = make([1, 2], max_attempts=3, max_retryable_attempts=6)
    tracker.dispatch(task(7))

    def fail(retryable: bool) -> None:
        attempt, worker = pool.sent[-1][1], pool.sent[-1][2]
        msg = task_failed("j", 7, attempt, worker, "TaskAborted", "the worker is stopping")
        tracker.failed(replace(msg, retryable=retryable))

    for _ in range(5):
        fail(retryable=True)
    fail(retryable=False)
    fail(retryable=False)
    with pytest.raises(TaskGaveUp, match="failed 3 times; last on worker"):
        fail(retryable=False)
    tracker, pool = make([1, 2], max_retryable_attempts=6)
    tracker.dispatch(task(7))
    for _ in range(5):
        fail(retryable=True)
    with pytest.raises(TaskGaveUp, match="failed 6 times in ways its workers called retryable"):
        fail(retryable=True)
