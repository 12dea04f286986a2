"""Process-level fault tests: workers killed or frozen mid-job, the coordinator killed.

Every run prints its seed; replay with RP_CHAOS_SEED=<seed>. A run passes only if every
faulty job ends bitwise equal to the fault-free reference (CPU, fp32, one thread per
worker), and it reports the recovery time of each fault (fault to the next completed
task).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path

import pytest
from runtime_helpers import tiny_spec

from roundpipe.chaos import FaultSpec, random_faults, run_chaos
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.training.hold_point import hold_env

pytestmark = pytest.mark.slow


def chaos_seed() -> int:
    seed = int(os.environ.get("RP_CHAOS_SEED") or random.SystemRandom().randrange(1, 10**6))
    print(f"\nchaos seed {seed} (replay: RP_CHAOS_SEED={seed})")
    return seed


def random_chaos(
    tmp_path: Path,
    arena_dir: Path,
    *,
    steps: int,
    faults_per_trial: int,
    min_injected: int,
    max_trials: int,
    worker_args: list[str] | None = None,
) -> None:
    """Random worker faults until ``min_injected`` fired mid-job; every trial bitwise
    equal to the fault-free reference."""
    seed = chaos_seed()
    rng = random.Random(seed)
    spec = tiny_spec(tmp_path / "out", steps=steps, staleness=1)

    def more(_: int) -> tuple[list[FaultSpec], int]:
        return random_faults(rng, faults_per_trial, spec), rng.randrange(1, 10**6)

    report = run_chaos(
        spec,
        root=tmp_path,
        arena_dir=arena_dir,
        num_workers=3,
        trials=[],
        seeds=[],
        min_injected=min_injected,
        more=more,
        max_trials=max_trials,
        worker_args=worker_args or [],
    )
    print(report.table())
    recoveries = [r for t in report.trials for r in t.recovery_s]
    if recoveries:
        print(
            f"recovery (fault -> next completed task): median {statistics.median(recoveries):.2f}s,"
            f" max {max(recoveries):.2f}s over {len(recoveries)} faults that stalled a task"
        )
    assert report.injected >= min_injected, f"only {report.injected} faults fired (seed {seed})"
    assert report.ok, f"seed {seed}\n{report.table()}"


def test_twenty_random_worker_faults_leave_the_result_bitwise_unchanged(
    tmp_path: Path, arena_dir: Path
) -> None:
    # Five faults a trial: the same twenty faults in fewer jobs (each job costs start-up
    # and a bitwise comparison; a fault costs its recovery wherever it fires).
    random_chaos(tmp_path, arena_dir, steps=24, faults_per_trial=5, min_injected=20, max_trials=10)


def test_coordinator_kill_resumes_exactly(tmp_path: Path, arena_dir: Path) -> None:
    seed = chaos_seed()
    rng = random.Random(seed)
    spec = tiny_spec(tmp_path / "out", steps=12, staleness=1)
    raw = spec.to_dict()
    raw["output"]["checkpoint_every"] = 3
    spec = type(spec).from_dict(raw)
    trials = [[FaultSpec("coordinator", at_fraction=rng.uniform(0.25, 0.6))]]
    report = run_chaos(
        spec,
        root=tmp_path,
        arena_dir=arena_dir,
        num_workers=2,
        trials=trials,
        seeds=[rng.randrange(1, 10**6)],
    )
    print(report.table())
    assert report.injected == 1 and report.ok, f"seed {seed}\n{report.table()}"


def test_a_deterministically_failing_task_fails_the_job_after_bounded_retries(
    tmp_path: Path, arena_dir: Path
) -> None:
    cluster = LocalCluster(tmp_path, arena_dir, coordinator_args=["--worker-timeout", "2"])
    try:
        for i in range(3):  # the tail task of iteration 1 raises wherever it runs
            cluster.add_worker(
                f"w{i}", fault="raise@kind=tail,iteration=1,attempt=any,repeat=always"
            )
        cluster.wait_for_workers(3)
        status = cluster.client.submit(tiny_spec(tmp_path / "out", steps=2)).wait(timeout_s=300)
        assert status.state == "failed", status
        assert "failed 3 times" in status.message and "FaultInjected" in status.message
    finally:
        assert cluster.stop() == []


def test_the_only_worker_retries_a_task_that_failed_once(tmp_path: Path, arena_dir: Path) -> None:
    """One worker (one GPU): a task that fails once is retried on the same worker. It
    used to wait for another worker to join, and the job hung "waiting for a worker"."""
    cluster = LocalCluster(tmp_path, arena_dir, coordinator_args=["--worker-timeout", "2"])
    try:
        cluster.add_worker("only", fault="raise@kind=tail,iteration=1")
        cluster.wait_for_workers(1)
        status = cluster.client.submit(tiny_spec(tmp_path / "out", steps=3)).wait(timeout_s=300)
        assert status.state == "succeeded" and status.step == 3, (status, cluster.logs())
        assert "retry 1 of 2" in cluster.coordinator.tail(10**6)
    finally:
        assert cluster.stop() == []


def test_job_waits_with_no_worker_and_continues_when_one_joins(
    tmp_path: Path, arena_dir: Path
) -> None:
    # Both workers are killed once step 3 is reported, while the job is held before
    # iteration 5 (ROUNDPIPE_TRAIN_HOLD): it cannot end first, however fast it trains.
    spec = tiny_spec(tmp_path / "ref", steps=10, staleness=0)
    go = tmp_path / "go"
    go.touch()  # the reference run is not held
    cluster = LocalCluster(
        tmp_path,
        arena_dir,
        coordinator_args=["--worker-timeout", "2"],
        env=hold_env(5, go),
    )
    try:
        cluster.add_worker("a")
        cluster.add_worker("b")
        cluster.wait_for_workers(2)
        reference = cluster.client.submit(spec).wait(timeout_s=300)
        assert reference.state == "succeeded", reference.message
        go.unlink()
        raw = spec.to_dict()
        raw["output"]["dir"] = str(tmp_path / "faulty")  # same 2 workers: same default plan
        job = cluster.client.submit(type(spec).from_dict(raw))
        deadline = time.monotonic() + 120
        while job.status().step < 3:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.02)
        for name in ("a", "b"):
            cluster.signal_worker(name, signal.SIGKILL)
        go.touch()
        while "waiting for a worker" not in job.status().message:
            assert time.monotonic() < deadline, (job.status(), cluster.logs())
            time.sleep(0.05)
        assert job.status().state == "running"
        cluster.add_worker("c")
        status = job.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
        from roundpipe.chaos import _bitwise_equal

        assert _bitwise_equal(Path(spec.output.dir), tmp_path / "faulty")
    finally:
        assert cluster.stop() == []


def test_worker_faults_on_an_emulated_bus_leave_the_result_bitwise_unchanged(
    tmp_path: Path, arena_dir: Path
) -> None:
    """The same chaos with every copy asynchronous (roundpipe-worker --emulate-pcie): a
    worker killed or frozen with copies in flight loses nothing and publishes nothing
    early."""
    random_chaos(
        tmp_path,
        arena_dir,
        steps=16,
        faults_per_trial=3,
        min_injected=6,
        max_trials=6,
        worker_args=["--emulate-pcie", "100MB/s", "--emulate-latency", "1ms"],
    )


def test_a_producer_killed_between_counter_at_issue_and_landing_changes_nothing(
    tmp_path: Path, arena_dir: Path
) -> None:
    """Note [dead producers and imported events]: a worker SIGKILLs itself right after it
    stored an activation counter at issue, before the copy landed. Consumers that read
    the ticket wait for a landed mark that only the re-run provides; the job ends bitwise
    equal to the fault-free run."""
    seed = chaos_seed()
    spec = tiny_spec(tmp_path / "out", steps=6, staleness=1)
    # Iteration 4, mid-job: the harness lists the armed worker before it submits
    # (chaos._trial), so round-robin hands it tasks of every iteration. A trial where it
    # still fired nothing is repeated, and then the test fails.
    point = [FaultSpec("point", point="kill@iteration=4,when=issued")]
    report = run_chaos(
        spec,
        root=tmp_path,
        arena_dir=arena_dir,
        num_workers=3,
        trials=[point],
        seeds=[seed],
        min_injected=1,
        more=lambda i: (point, seed + i),
        max_trials=3,
        worker_args=["--emulate-pcie", "100MB/s", "--emulate-latency", "20ms"],
    )
    print(report.table())
    assert report.injected >= 1 and report.ok, f"seed {seed}\n{report.table()}"


@pytest.mark.parametrize(
    "raised, status, kept",
    [(KeyboardInterrupt(), 130, False), (RuntimeError("the reference run failed"), 1, True)],
    ids=["ctrl-c", "broken-run"],
)
def test_chaos_cleans_up_after_ctrl_c_and_names_a_broken_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, raised, status, kept
) -> None:
    """Ctrl-C left the work directory (tens of MB) in /tmp; a run that broke (the
    reference run failed, a coordinator vanished) ended in a traceback. Now an interrupt
    removes it, and a broken run is one FAIL line naming the kept directory."""
    import yaml

    from roundpipe import chaos

    def broken(*args, **kwargs):
        (kwargs["root"] / "coordinator.log").write_text("evidence")
        raise raised

    import tempfile

    monkeypatch.setattr(chaos, "run_chaos", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes it
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(tmp_path / "out", steps=2).to_dict()))
    assert chaos.main([str(spec), "--trials", "1", "--seed", "3"]) == status
    err = capsys.readouterr().err
    left = list(tmp_path.glob("roundpipe-chaos-*"))
    assert bool(left) == kept, (left, err)
    if kept:
        assert f"chaos: FAIL: the run could not go on (seed 3; work dir {left[0]}" in err
        assert "Traceback" not in err
