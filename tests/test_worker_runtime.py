"""WorkerCore on real arenas, without sockets: per-layer times, no rewrite after signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import first_iteration

from roundpipe.protocol import replace
from roundpipe.shared.events import EventTimeout
from roundpipe.worker.runtime import WorkerCore
from roundpipe.worker.transfer import CpuEngine


@pytest.fixture
def prepared(tmp_path: Path, arena_dir: Path):
    trainer, tasks = first_iteration(tmp_path, arena_dir, "job-rt", "rttest", 5)
    core = WorkerCore(1)
    core.setup_job(trainer.job_setup())
    yield trainer, core, tasks
    core.close()
    trainer.close()


def test_tasks_report_per_layer_times(prepared) -> None:
    _, core, tasks = prepared
    dones = [core.run_task(t) for t in tasks]  # F, F, T, B, B: dependency order
    assert set(dones[0].layer_times) == {"0.fwd", "1.fwd"}
    assert set(dones[1].layer_times) == {"2.fwd", "3.fwd"}
    assert set(dones[2].layer_times) == {"4", "5"}  # the tail: forward + backward time
    assert set(dones[3].layer_times) == {"2", "3"}
    assert all(v > 0 for d in dones for v in d.layer_times.values())
    assert sum(dones[3].layer_times.values()) <= dones[3].seconds


class _CountingEngine(CpuEngine):
    """The CPU engine, counting the calls to release cached device memory."""

    def __init__(self) -> None:
        super().__init__()
        self.releases = 0

    def release_cached_memory(self) -> None:
        self.releases += 1


def test_device_memory_is_released_when_the_last_job_is_torn_down(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A worker keeps no cached device memory between jobs (CUDA: the allocator's free
    blocks go back to the GPU, tests/test_cuda.py); while another job is set up, a
    teardown releases nothing."""
    trainer, tasks = first_iteration(tmp_path, arena_dir, "job-rel", "reltest", 5)
    engine = _CountingEngine()
    core = WorkerCore(1, transfer=engine)
    try:
        core.setup_job(trainer.job_setup())
        core.setup_job(replace(trainer.job_setup(), job_id="job-rel-2"))
        for t in tasks:
            core.run_task(t)
        core.teardown_job("job-rel-2")
        assert engine.releases == 0 and list(core.jobs) == ["job-rel"]
        core.teardown_job("job-rel")
        assert engine.releases == 1 and not core.jobs
        core.teardown_job("job-rel")  # a repeated teardown: nothing left to release
        assert engine.releases == 1
    finally:
        core.close()
        trainer.close()


def test_rerun_never_rewrites_published_outputs(prepared) -> None:
    trainer, core, tasks = prepared
    layout = trainer.layout
    for t in tasks:
        core.run_task(t)
    # Pretend later iterations already reuse the slots the first run published.
    act = layout.view(layout.acts[(2, 1, 0)])
    grad_name, grad_ref = next(iter(layout.grads[1].items()))
    grad = layout.view(grad_ref)
    act.fill_(123.0)
    grad.fill_(-7.0)
    # The tail's losses have no counter: published with its gradients, they are what
    # the step reports; a re-run computing them from weights the optimizer replaced
    # since must not overwrite them.
    tail = next(t for t in tasks if t.kind == "tail")
    losses = [layout.view(mb.loss) for mb in tail.microbatches]
    for loss in losses:
        loss.fill_(99.0)
    counters = layout.events.snapshot()
    # the forward writing act[2], the tail, the backward writing layer 1
    for t in (tasks[0], tail, tasks[-1]):
        core.run_task(replace(t, attempt=1))
    assert bool((act == 123.0).all()), "a re-run rewrote a published activation"
    assert bool((grad == -7.0).all()), f"a re-run rewrote the published gradient {grad_name}"
    assert all(bool((loss == 99.0).all()) for loss in losses), "a re-run rewrote the losses"
    assert layout.events.snapshot() == counters  # and no counter moved


def test_rerun_completes_what_a_dead_worker_left_unpublished(prepared) -> None:
    trainer, core, tasks = prepared
    layout = trainer.layout
    for t in tasks[:-1]:
        core.run_task(t)
    first = core.run_task(tasks[-1])
    expected = {n: layout.view(r).clone() for n, r in layout.grads[1].items()}
    # A worker died after writing the gradients but before storing any of their counters
    # (counters are stored only after all of a task's writes, so it is all or nothing).
    for sig in tasks[-1].grad_signals:
        layout.events.reset(sig.counter, 0)
    for layer in (0, 1):
        for ref in layout.grads[layer].values():
            layout.view(ref).zero_()
    core.run_task(replace(tasks[-1], attempt=1))
    assert all(layout.events.read(sig.counter) == 1 for sig in tasks[-1].grad_signals)
    for name, ref in layout.grads[1].items():
        assert torch.equal(layout.view(ref), expected[name]), name
    assert first.task_id == tasks[-1].task_id


def test_a_job_set_up_again_with_other_arenas_runs_on_the_new_ones(
    tmp_path: Path, arena_dir: Path
) -> None:
    """The same job id resumed with new arenas, this worker having missed the old run's
    teardown: the new setup replaces the old (it was ignored, and the worker ran the new
    run's tasks on the old run's arenas and counters)."""
    old, _ = first_iteration(tmp_path / "old", arena_dir, "job-x", "again", 5)
    new, tasks = first_iteration(tmp_path / "new", arena_dir, "job-x", "again", 5)
    core = WorkerCore(1)
    try:
        core.setup_job(old.job_setup())
        core.setup_job(new.job_setup())
        core.setup_job(new.job_setup())  # a true repeat changes nothing
        core.run_task(tasks[0])
        counter = tasks[0].microbatches[0].signals[0].counter
        assert new.layout.events.read(counter) >= 1
        assert old.layout.events.read(counter) == 0
    finally:
        core.close()
        new.close()
        old.close()


def test_the_running_task_stops_when_the_session_ends(prepared) -> None:
    """The coordinator lost (or the worker stopping): the running task stops at its next
    layer, as on a teardown, so the session's end never unmaps its job under it."""
    from roundpipe.worker.runtime import TaskInterrupted

    _, core, tasks = prepared
    core.session_ended = lambda: True
    with pytest.raises(TaskInterrupted, match="the session with the coordinator is over"):
        core.run_task(tasks[0])


def test_worker_timeout_names_the_counter_as_the_coordinator_does(prepared) -> None:
    """Tasks refer to counters by index only; the worker names them from JobSetup."""
    trainer, core, tasks = prepared
    backward = replace(tasks[-1], wait_timeout_s=0.2)  # B[0:2]: no gradient from layer 2 yet
    counter = backward.microbatches[0].waits[1].counter
    assert counter == trainer.layout.counters.dact(2, 0)
    with pytest.raises(
        EventTimeout, match=rf"waiting for dact\[layer 2\]\[mb 0\] \(counter {counter}\)"
    ):
        core.run_task(backward)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "--memory-limit", "1MiB"], "this worker already uses"),
        (["--gpu", "0", "--memory-limit", "lots"], "cannot read --memory-limit 'lots'"),
    ],
)
def test_memory_limit_arguments_are_checked(args: list[str], message: str) -> None:
    """`roundpipe-worker --memory-limit` refuses what it cannot apply, before connecting."""
    result = subprocess.run(
        [sys.executable, "-m", "roundpipe.worker.daemon", *args, "--handshake-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_a_worker_computes_where_its_transfer_engine_copies() -> None:
    """In-process GPU workers (the qlora-cuda checks, benchmarks/qlora.py) were made with
    a CUDA engine and no device: they computed on the CPU, reading host copies of the
    uploads that nothing waited for. The device now comes from the engine; a device
    that contradicts it is refused."""
    from roundpipe.worker.transfer import CpuEngine

    engine = CpuEngine()
    engine.device = torch.device("cuda", 0)  # as a CudaEngine's (no CUDA call here)
    assert WorkerCore(0, transfer=engine).device == torch.device("cuda", 0)
    assert WorkerCore(0, "cuda", transfer=engine).device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="device cpu but its transfer engine copies to cuda:0"):
        WorkerCore(0, "cpu", transfer=engine)
    with pytest.raises(ValueError, match="device cuda:1 but"):
        WorkerCore(0, "cuda:1", transfer=engine)
    assert WorkerCore(0).device == torch.device("cpu")
