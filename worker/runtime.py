"""The worker's logic without sockets: map a job's arenas, run StageTasks, forget.

``WorkerCore`` is what ``roundpipe-worker`` wraps with ZeroMQ (roundpipe.worker.daemon),
and what in-process tests drive directly. It is stateless between tasks in the sense the
design asks for: everything it keeps per job (arena mappings, the model skeleton on the
meta device, the executor) is rebuilt from the ``JobSetup`` message alone, and every
task reads its inputs from and writes its results to shared memory.

Running a task, in order:

1. wait for the weights' version counters (Note [weight-update ordering] in
   roundpipe.coordinator.schedule), and bind the right params parity;
2. stream microbatches: before microbatch m is read, wait for its counters; as soon as
   its output (forward) or input gradient (backward, tail) exists, write it to its slot
   and store its counters, so the next stage on another worker can start on it while
   this one continues with m + 1;
3. wait until the gradient slots are free, write the summed weight gradients (every slot
   is written, zeros where a parameter got no gradient, so a re-run writes the same
   bytes), and store the wgrad counters.

A task is idempotent: re-running it (on this or another worker) reads the same inputs
and computes the same bytes; counters never move backwards.

Note [no rewrite after signal]
    When a task is re-run because its first worker died, some of its outputs may already
    be published (their counters stored). Those are never written again: a counter is
    stored only after all the writes it covers, so if any of a microbatch's (or of the
    task's gradient) counters has reached its value, every byte it covers is already in
    place, and a second write could land on a slot that a later iteration already reuses
    (a gradient slot is refilled with g_{k+1} as soon as the optimizer consumed g_k). The
    re-run only stores the counters that are still missing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from roundpipe.protocol import (
    EventSignal,
    EventWait,
    JobSetup,
    MicrobatchIO,
    StageTask,
    TaskDone,
    TensorRef,
    name_to_dtype,
)
from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import Counters, EventTable
from roundpipe.shared.model import LayeredModel
from roundpipe.worker.executor import RngKey, StageExecutor
from roundpipe.worker.faults import Fault

__all__ = ["EVENTS_ARENA", "JobState", "WorkerCore", "TaskAborted"]

log = logging.getLogger(__name__)

EVENTS_ARENA = "events"  # the coordinator's layout puts the event table at DATA_START there


class TaskAborted(RuntimeError):
    """The worker was asked to stop while a task waited."""


@dataclass
class JobState:
    setup: JobSetup
    model: LayeredModel
    executor: StageExecutor
    arenas: dict[str, Arena]
    events: EventTable
    # layer -> (parity-0 name->view, parity-1 overrides name->view)
    weights: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    # layer -> its gradient slots, name -> view (JobSetup's LayerLayout.grads)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arenas[ref.arena].view(ref)

    def grad_slots(self, start: int, stop: int) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, slot view) of every gradient slot of layers [start, stop)."""
        return [
            (n, v) for layer in range(start, stop) for n, v in self.grads.get(layer, {}).items()
        ]

    def close(self) -> None:
        self.events.close()
        self.weights.clear()
        for arena in self.arenas.values():
            arena.close()


def model_config_dict(config) -> dict:
    """A transformers config as a plain, msgpack-able dict (what JobSetup carries)."""
    return json.loads(config.to_json_string(use_diff=False))


class WorkerCore:
    """Executes StageTasks for the jobs set up on it. One task at a time."""

    def __init__(self, worker_id: int, device: torch.device | str = "cpu"):
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.jobs: dict[str, JobState] = {}
        self.should_abort: Callable[[], bool] = lambda: False
        self.fault: Fault | None = None  # test/chaos fault injection (worker.faults)
        self._waited_s = 0.0  # time the current task spent waiting for counters

    # -- jobs -------------------------------------------------------------------------

    def setup_job(self, setup: JobSetup) -> None:
        if setup.job_id in self.jobs:
            return  # a repeated setup (e.g. after a reconnect) changes nothing
        arenas: dict[str, Arena] = {}
        try:
            for info in setup.arenas:
                arenas[info.name] = Arena.attach(info.path)
            model = LayeredModel.from_config(dict(setup.model_config), setup.lora)
            dtype = name_to_dtype(setup.compute_dtype)
            executor = StageExecutor(model, self.device, dtype)
            events = EventTable(arenas[EVENTS_ARENA], DATA_START)
            # Name counters in timeout errors the way the coordinator does.
            events.set_labeler(Counters(model.num_layers, setup.num_microbatches).label)
            state = JobState(setup, model, executor, arenas, events)
            for layout in setup.layers:
                even = {p.name: state.view(p.ref) for p in layout.params}
                odd = {p.name: state.view(p.ref) for p in layout.params_odd}
                state.weights[layout.layer] = (even, odd)
                state.grads[layout.layer] = {g.name: state.view(g.ref) for g in layout.grads}
        except BaseException:
            for arena in arenas.values():
                arena.close()
            raise
        self.jobs[setup.job_id] = state
        log.info(
            "[worker %d] job %s set up (%d layers)", self.worker_id, setup.job_id, model.num_layers
        )

    def teardown_job(self, job_id: str) -> None:
        state = self.jobs.pop(job_id, None)
        if state is not None:
            state.close()
            log.info("[worker %d] job %s torn down", self.worker_id, job_id)

    def close(self) -> None:
        for job_id in list(self.jobs):
            self.teardown_job(job_id)

    # -- tasks ------------------------------------------------------------------------

    def run_task(self, task: StageTask) -> TaskDone:
        state = self.jobs.get(task.job_id)
        if state is None:
            raise RuntimeError(
                f"task {task.task_id} of job {task.job_id!r} arrived before the job's setup"
            )
        started = time.perf_counter()
        self._waited_s = 0.0
        state.executor.layer_forward_s = {}
        timeout = task.wait_timeout_s
        self._fault_point("start", task)
        for wait in task.weight_waits:
            self._wait(state, wait, timeout)
        weights = self._weights(state, task)
        rng = RngKey(seed=task.seed, iteration=task.iteration)
        feed = _MicrobatchFeed(self, state, task)
        ex = state.executor
        start, stop = task.layer_start, task.layer_stop
        if task.kind == "forward":
            save = {s.layer for mb in task.microbatches for s in mb.saved}
            ex.forward(
                start,
                stop,
                weights,
                feed.inputs(),
                save,
                rng=rng,
                on_output=feed.write_output,
                on_saved=feed.write_saved,
            )
            grads: dict[str, torch.Tensor] = {}
        elif task.kind == "backward":
            result = ex.backward(
                start,
                stop,
                weights,
                feed.inputs(),
                feed.grad_outputs(),
                rng=rng,
                on_grad_input=feed.write_output,
            )
            feed.write_grad_inputs(result.grad_inputs)
            grads = result.weight_grads
        else:
            result = ex.tail(
                start,
                stop,
                weights,
                feed.inputs(),
                feed.labels(),
                task.loss_denominator,
                rng=rng,
                on_grad_input=feed.write_output,
            )
            feed.write_grad_inputs(result.grad_inputs)
            for mb, loss in zip(task.microbatches, result.microbatch_losses):
                assert mb.loss is not None
                state.view(mb.loss).fill_(loss)
            grads = result.weight_grads
            # Losses are read by the coordinator after TaskDone; no counter needed.
        slots = state.grad_slots(start, stop) if task.kind != "forward" else []
        if slots:
            for wait in task.grad_waits:
                self._wait(state, wait, timeout)
            if not self._published(state, task.grad_signals):  # Note [no rewrite after signal]
                for name, dst in slots:
                    grad = grads.get(name)
                    if grad is None:
                        dst.zero_()  # write every slot: a re-run must produce the same bytes
                    else:
                        dst.copy_(grad)
            for sig in task.grad_signals:
                self._signal(state, sig)
        self._fault_point("end", task)
        seconds = time.perf_counter() - started
        return TaskDone(
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=task.attempt,
            worker_id=self.worker_id,
            seconds=seconds,
            layer_times=self._layer_times(task, state, seconds - self._waited_s),
        )

    @staticmethod
    def _layer_times(task: StageTask, state: JobState, busy_s: float) -> dict[str, float]:
        """Per-layer seconds for the planner (roundpipe.coordinator.planner keys).

        Forward tasks: each layer's measured forward time (``"L.fwd"``). Backward and tail
        tasks: autograd runs the whole stage at once, so the task's busy time (wall time
        minus waiting for inputs) is split over its layers in proportion to their measured
        forward (recompute) times (``"L"``).
        """
        measured = state.executor.layer_forward_s
        if not measured:
            return {}
        if task.kind == "forward":
            return {f"{layer}.fwd": s for layer, s in measured.items()}
        total = sum(measured.values()) or 1.0
        return {f"{layer}": busy_s * s / total for layer, s in measured.items()}

    def _weights(self, state: JobState, task: StageTask) -> dict[str, torch.Tensor]:
        odd = task.weight_version % 2 == 1
        model = state.model
        out: dict[str, torch.Tensor] = {}

        def lookup(layer: int, name: str) -> torch.Tensor:
            even_views, odd_views = state.weights[layer]
            if odd and name in odd_views:
                return odd_views[name]
            return even_views[name]

        for layer in range(task.layer_start, task.layer_stop):
            for spec in model.layer_params(layer):
                if spec.tied_to is None:
                    out[spec.name] = lookup(layer, spec.name)
                else:
                    out[spec.name] = lookup(model.layer_of(spec.tied_to), spec.tied_to)
        return out

    def _wait(self, state: JobState, wait: EventWait, timeout_s: float) -> None:
        started = time.perf_counter()
        try:
            state.events.wait_at_least(
                wait.counter, wait.at_least, timeout_s, should_abort=self.should_abort
            )
        except InterruptedError as exc:
            raise TaskAborted(str(exc)) from None
        finally:
            self._waited_s += time.perf_counter() - started

    def _signal(self, state: JobState, sig: EventSignal) -> None:
        state.events.signal(sig.counter, sig.value)

    @staticmethod
    def _published(state: JobState, signals: Sequence[EventSignal]) -> bool:
        """Whether an earlier run already stored any of these (so all its writes are done)."""
        return any(state.events.read(s.counter) >= s.value for s in signals)

    def _fault_point(self, where: str, task: StageTask, mb: int | None = None) -> None:
        if self.fault is not None:
            self.fault.point(where, task=task, mb=mb)


class _LazyInputs(Sequence):
    """A sequence whose item m waits for microbatch m's counters before it is read."""

    def __init__(self, feed: _MicrobatchFeed, pick: Callable[[MicrobatchIO], TensorRef]):
        self._feed = feed
        self._pick = pick

    def __len__(self) -> int:
        return len(self._feed.task.microbatches)

    def __getitem__(self, m):  # type: ignore[override]
        if isinstance(m, slice):
            return [self[i] for i in range(*m.indices(len(self)))]
        mb = self._feed.ready(m)
        return self._feed.state.view(self._pick(mb))


class _MicrobatchFeed:
    """Per-microbatch waits on the way in, writes and signals on the way out."""

    def __init__(self, core: WorkerCore, state: JobState, task: StageTask):
        self.core = core
        self.state = state
        self.task = task
        self._ready: set[int] = set()
        self._written: set[int] = set()

    def ready(self, m: int) -> MicrobatchIO:
        mb = self.task.microbatches[m]
        if m not in self._ready:
            self.core._fault_point("mb", self.task, mb.index)
            for wait in mb.waits:
                self.core._wait(self.state, wait, self.task.wait_timeout_s)
            self._ready.add(m)
        return mb

    def inputs(self) -> _LazyInputs:
        return _LazyInputs(self, lambda mb: mb.input)

    def grad_outputs(self) -> _LazyInputs:
        return _LazyInputs(self, lambda mb: mb.grad_output)

    def labels(self) -> _LazyInputs:
        return _LazyInputs(self, lambda mb: mb.labels)

    def _publish(self, m: int) -> None:
        for sig in self.task.microbatches[m].signals:
            self.core._signal(self.state, sig)
        self._written.add(m)

    def _already_published(self, m: int) -> bool:
        return self.core._published(self.state, self.task.microbatches[m].signals)

    def write_output(self, m: int, tensor: torch.Tensor) -> None:
        mb = self.task.microbatches[m]
        assert mb.output is not None
        if not self._already_published(m):  # Note [no rewrite after signal]
            self.state.view(mb.output).copy_(tensor)
        self._publish(m)

    def write_saved(self, layer: int, m: int, tensor: torch.Tensor) -> None:
        # Saved inputs are published together with the microbatch's output (its signals
        # list covers both), which comes later in the same microbatch.
        if self._already_published(m):
            return
        for saved in self.task.microbatches[m].saved:
            if saved.layer == layer:
                self.state.view(saved.ref).copy_(tensor)

    def write_grad_inputs(self, grad_inputs: list[torch.Tensor] | None) -> None:
        for m, mb in enumerate(self.task.microbatches):
            if m in self._written:
                continue
            if mb.output is not None and grad_inputs is not None and not self._already_published(m):
                self.state.view(mb.output).copy_(grad_inputs[m])
            self._publish(m)
