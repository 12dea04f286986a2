"""The worker's logic without sockets: map a job's arenas, run StageTasks, forget.

``WorkerCore`` is what ``roundpipe-worker`` wraps with ZeroMQ (roundpipe.worker.daemon),
and what in-process tests drive directly. It is stateless between tasks in the sense the
design asks for: everything it keeps per job (arena mappings, the model skeleton on the
meta device, the executor: roundpipe.worker.job_state) is rebuilt from the ``JobSetup``
message alone, and every task reads its inputs from and writes its results to shared
memory. This module runs the tasks: the waits, the microbatch stream, the downloads
and the signals.

Running a task, in order:

1. wait for the weights' version counters (Note [weight-update ordering] in
   roundpipe.coordinator.training.schedule), and upload the right params parity, unless the
   prefetcher already did while the previous task computed (Note [weight prefetch] in
   roundpipe.worker.prefetch);
2. stream microbatches: before microbatch m is read, wait for its counters and upload
   it (microbatch m + 1 is uploaded while m computes if its counters are already met);
   as soon as its output (forward) or input gradient (backward, tail) exists, download
   it to its slot, and store its counters (at issue with a ticket, or once the copy has
   landed: Note [activation hand-off] in roundpipe.worker.transfer), so the next stage
   on another worker can start on it while this one continues with m + 1;
3. wait until the gradient slots are free, download the summed weight gradients (every
   slot is written, zeros where a parameter got no gradient, so a re-run writes the same
   bytes), and store the wgrad counters once they have landed;
4. report TaskDone once every copy of the task has landed (the compute thread is free
   to start the next task before that).

All copies go through the worker's transfer engine (roundpipe.worker.transfer): views on
a CPU worker, an emulated bus, or CUDA streams.

A task is idempotent: re-running it (on this or another worker) reads the same inputs
and computes the same bytes; counters never move backwards.

Note [no rewrite after signal]
    When a task is re-run because its first worker died, some of its outputs may already
    be published. Those are never written again: once the bytes a microbatch's (or the
    task's gradient) signals cover are all in place, a second write could land on a slot
    that a later iteration already reuses (a gradient slot is refilled with g_{k+1} as
    soon as the optimizer consumed g_k). "In place" is the *landed mark* for act/dact
    counters, which are stored when their copy is issued (Note [activation hand-off] in
    roundpipe.worker.transfer), and the counter itself for the others (stored after
    landing). Every producer stores the landed marks, the ``cpu`` backend too (landed
    mark first, then the counter), so the check means the same whoever ran first. The
    re-run only stores what is still missing.

    An act/dact counter that is stored but whose landed mark is not (the first producer
    died between issue and landing) does not stop the re-run: its slot cannot have been
    reused, because every consumer of it waits for that landed mark before it uses the
    bytes (and before it publishes anything computed from them), and the slot is reused
    only after its consumers finished. So the re-run writes the data again, with a new
    ticket, and stores the landed mark; the counter store is a no-op.

    A re-run racing with the first attempt's slow copy: the re-run checks the landed mark,
    finds it missing, and issues its copy; then the first attempt's copy lands and stores
    the mark, consumers go on, and only after they finished could the slot be reused
    (iteration k + 2), while the re-run's copy of the same bytes is still due. That race
    needs the first attempt to still be copying when the coordinator has already given
    its task to another worker, i.e. a worker declared lost while alive; it is the same
    race as with counters stored after landing, and the same fencing prevents it (a lost
    worker's process is killed before its tasks are re-run when the coordinator can
    prove which process it is: roundpipe.coordinator.training.recovery, docs/fault-tolerance.md).
    A task that fails or aborts first waits for its copies in flight, so a re-run on the
    same worker sees what really landed.

    The tail's losses have no counter: the coordinator reads them after TaskDone. They
    are queued before the tail's weight gradients, at the same priority, so once those
    gradients' signals are stored the first run's losses are in place too, and the
    optimizer may already have replaced the weights the re-run read. So a re-run whose
    gradients landed writes no losses either: the step's loss stays the one computed
    with the step's weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from roundpipe.protocol import (
    EventSignal,
    EventWait,
    JobSetup,
    MicrobatchIO,
    StageTask,
    TaskDone,
    TensorRef,
)
from roundpipe.shared.events import (
    loss_scale_value,
    memory_barrier,
    read_loss_scale_value,
)
from roundpipe.shared.handoff import Handoff, HandoffLost, IssueMark
from roundpipe.shared.plan import RECOMPUTE_GRAINS
from roundpipe.worker.executor import RngKey, TailLabels, tail_labels
from roundpipe.worker.faults import Fault
from roundpipe.worker.job_state import JobState, TaskCopies
from roundpipe.worker.prefetch import WeightPrefetcher
from roundpipe.worker.transfer import (
    Priority,
    Transfer,
    TransferEngine,
    Upload,
    make_engine,
)

__all__ = ["TaskAborted", "TaskInterrupted", "WorkerCore"]

log = logging.getLogger(__name__)


class TaskAborted(RuntimeError):
    """The worker was asked to stop while a task waited."""


class TaskInterrupted(RuntimeError):
    """The task's job was torn down (cancelled, failed, paused) while the task ran.

    Nobody waits for its result any more: the worker drops it without a reply, so a
    cancelled job frees its workers within a layer's compute instead of a whole task's.
    """


class WorkerCore:
    """Executes StageTasks for the jobs set up on it. One task at a time."""

    def __init__(
        self,
        worker_id: int,
        device: torch.device | str | None = None,
        transfer: TransferEngine | None = None,
    ):
        """``device``: where tasks compute; default the engine's (``transfer``), else the
        CPU. A CUDA engine given without its device computed on the CPU, reading copies
        to the host that nothing waited for."""
        self.worker_id = worker_id
        if device is None:
            device = transfer.device if transfer is not None else "cpu"
        self.device = torch.device(device)
        if transfer is not None:
            engine_device = torch.device(transfer.device)  # a CUDA engine's has its index
            if engine_device.type != self.device.type or self.device.index not in (
                None,
                engine_device.index,
            ):
                raise ValueError(
                    f"worker {worker_id}: device {self.device} but its transfer engine "
                    f"copies to {engine_device}"
                )
            self.device = engine_device
        self._owns_engine = transfer is None
        self.engine = transfer if transfer is not None else make_engine(self.device)
        self.jobs: dict[str, JobState] = {}
        self.should_abort: Callable[[], bool] = lambda: False
        self.session_ended: Callable[[], bool] = lambda: False
        """True once the daemon's session with its coordinator is over (lost, or the
        worker stops): the running task stops at its next layer, as on a teardown."""
        self.peek_next: Callable[[], StageTask | None] = lambda: None
        """The task queued after the running one (the daemon's queue), for prefetch."""
        # should_abort is looked up at each call: the daemon sets it after construction.
        self.prefetcher = WeightPrefetcher(
            self.engine, self.jobs, lambda: self.should_abort(), worker_id
        )
        self.overlap = True
        """False: every copy is waited for where it is issued and nothing is fetched
        ahead (transfers, then compute): the serial baseline of benchmarks/overlap.py."""
        self.fault: Fault | None = None  # test/chaos fault injection (worker.faults)
        self._waited_s = 0.0  # time the current task spent waiting for counters
        self._waited_before_s = 0.0  # ... before its compute window (weights)
        self._waited_in_compute_s = 0.0  # ... inside the window (comes off compute_s)
        # Jobs whose JobTeardown has arrived but not yet been carried out: their running
        # task stops at the next layer (interrupt_job, from the daemon's I/O thread).
        self._interrupted: set[str] = set()
        self.last_compute_end = 0.0  # host clock when the last task's compute returned

    # -- jobs -------------------------------------------------------------------------

    def setup_job(self, setup: JobSetup) -> None:
        old = self.jobs.get(setup.job_id)
        if old is not None:
            if old.setup == setup:
                return  # a repeated setup (e.g. after a reconnect) changes nothing
            # The job resumed with new arenas while this worker missed the old run's
            # teardown: kept, the old run's mapping would take the new run's tasks.
            log.info(
                "[worker %d] job %s set up again with other arenas: the old run's go",
                self.worker_id,
                setup.job_id,
            )
            self.teardown_job(setup.job_id)
        state = JobState.open(setup, self.device, self.engine)
        self.jobs[setup.job_id] = state
        log.info(
            "[worker %d] job %s set up (%d layers)",
            self.worker_id,
            setup.job_id,
            state.model.num_layers,
        )

    def interrupt_job(self, job_id: str) -> None:
        """Make the job's running task stop at its next layer or wait (any thread).

        Called when the job's JobTeardown arrives, before it reaches the compute thread;
        teardown_job ends the interruption, so a later setup of the same job id (a
        resume) runs normally.
        """
        self._interrupted.add(job_id)

    def teardown_job(self, job_id: str) -> None:
        self.prefetcher.discard(job_id, wait=True)
        state = self.jobs.pop(job_id, None)
        if state is not None:
            for copies in list(state.inflight):
                copies.wait_all()
            self.engine.unregister(state.arenas.values())
            state.close()
            log.info("[worker %d] job %s torn down", self.worker_id, job_id)
            if not self.jobs:
                # Stateless between jobs, device memory included: nothing is cached for
                # a next job that may have other shapes, or never come.
                self.engine.release_cached_memory()
        self._interrupted.discard(job_id)

    def _check_interrupted(self, task: StageTask) -> None:
        if task.job_id in self._interrupted:
            why = f"job {task.job_id} was torn down"
        elif self.session_ended():
            why = "the session with the coordinator is over"
        else:
            return
        raise TaskInterrupted(
            f"task {task.task_id} ({task.kind} {task.layer_start}:{task.layer_stop}) stopped: {why}"
        )

    def close(self) -> None:
        self.prefetcher.discard(wait=True)
        for job_id in list(self.jobs):
            self.teardown_job(job_id)
        if self._owns_engine:
            self.engine.close()

    # -- tasks ------------------------------------------------------------------------

    def run_task(self, task: StageTask) -> TaskDone:
        """Run a task and return its TaskDone once every copy has landed."""
        box: list[TaskDone | BaseException] = []
        landed = threading.Event()

        def deliver(result: TaskDone | BaseException) -> None:
            box.append(result)
            landed.set()

        self.start_task(task, deliver)
        landed.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def start_task(
        self, task: StageTask, deliver: Callable[[TaskDone | BaseException], None]
    ) -> None:
        """Compute a task on the calling thread; ``deliver`` gets its TaskDone (or the
        error of a copy) once all its copies have landed, possibly on a transfer thread
        after this returns. A compute error is raised here, after the task's copies in
        flight have landed (Note [no rewrite after signal])."""
        state = self.jobs.get(task.job_id)
        if state is None:
            raise RuntimeError(
                f"task {task.task_id} of job {task.job_id!r} arrived before the job's setup"
            )
        started = time.perf_counter()
        started_at = time.time()  # wall clock, for the coordinator's timeline
        self._waited_s = self._waited_before_s = self._waited_in_compute_s = 0.0
        copies = TaskCopies()
        state.inflight.add(copies)
        watch = self.engine.stopwatch()
        state.executor.stopwatch = watch
        state.executor.before_layer = lambda: self._check_interrupted(task)
        try:
            self._compute(state, task, copies)
        except BaseException:
            copies.cancel()  # uploads still waiting for a producer's copy give up
            copies.wait_all()
            state.inflight.discard(copies)
            raise
        finally:
            state.executor.stopwatch = None
            state.executor.before_layer = None
            self.last_compute_end = time.perf_counter()
        waited_in_compute_s = self._waited_in_compute_s
        wait_s = self._waited_before_s + self._waited_s

        def finish(error: BaseException | None) -> None:
            state.inflight.discard(copies)
            if error is not None:
                deliver(error)
                return
            try:
                done = self._task_done(
                    task, state, watch, copies, started, waited_in_compute_s, started_at, wait_s
                )
            except BaseException as exc:  # noqa: BLE001 - reported as the task's failure
                deliver(exc)
                return
            deliver(done)

        copies.when_all_landed(finish)

    def _task_done(
        self, task, state, watch, copies, started, waited_s, started_at, wait_s
    ) -> TaskDone:
        measured = watch.resolve()
        compute_s = max(0.0, measured.pop(_TASK_KEY, 0.0) - waited_s)
        return TaskDone(
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=task.attempt,
            worker_id=self.worker_id,
            seconds=time.perf_counter() - started,
            layer_times=self._layer_times(task, measured, compute_s),
            compute_s=compute_s,
            upload_s=copies.upload_s,
            download_s=copies.download_s,
            upload_bytes=copies.upload_bytes,
            download_bytes=copies.download_bytes,
            started_at=started_at,
            wait_s=wait_s,
        )

    def _compute(self, state: JobState, task: StageTask, copies: TaskCopies) -> None:
        timeout = task.wait_timeout_s
        self._fault_point("start", task)
        for wait in task.weight_waits:
            self._wait(state, wait, timeout)
        upload = self.prefetcher.take(task)
        if upload is None:
            upload = self.engine.upload(state.task_weights(task), Priority.WEIGHT)
        copies.add(upload, up=True)
        nxt = self.peek_next() if self.overlap else None
        if nxt is not None:
            self.prefetcher.arm(nxt)  # Note [weight prefetch]
        waited = time.perf_counter()
        weights = upload.tensors()
        self._waited_s += time.perf_counter() - waited
        watch = state.executor.stopwatch
        assert watch is not None
        self._waited_before_s = self._waited_s
        self._waited_s = 0.0  # from here on: waits inside the compute window
        watch.start(_TASK_KEY)
        rng = RngKey(
            seed=task.seed,
            iteration=task.iteration,
            # The global index: a group's nodes draw the masks one coordinator would.
            microbatches=tuple(
                state.setup.microbatch_offset + mb.index for mb in task.microbatches
            ),
        )
        feed = _MicrobatchFeed(self, state, task, copies)
        ex = state.executor
        start, stop = task.layer_start, task.layer_stop
        loss_scale = self._loss_scale(state, task, timeout)
        if task.kind == "forward":
            save = {s.layer for mb in task.microbatches for s in mb.saved}
            ex.forward(
                start,
                stop,
                weights,
                feed.inputs(),
                save,
                rng=rng,
                position_ids=feed.position_ids(),
                on_output=feed.write_output,
                on_saved=feed.write_saved,
                on_router_stats=feed.write_router,
                row_tokens=feed.row_tokens(),
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
                position_ids=feed.position_ids(),
                on_grad_input=feed.write_output,
                router_counts=feed.router_inputs(),
                batch_tokens=feed.batch_tokens(),
                row_tokens=feed.row_tokens(),
                recompute=_recompute_grain(task),
                loss_scale=loss_scale,
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
                position_ids=feed.position_ids(),
                on_grad_input=feed.write_output,
                router_stats=feed.router_inputs(),
                batch_tokens=feed.batch_tokens(),
                row_tokens=feed.row_tokens(),
                on_router_counts=feed.write_router,
                loss_scale=loss_scale,
            )
            feed.write_grad_inputs(result.grad_inputs)
            # Losses come down once per task; the coordinator reads them after TaskDone,
            # so they need no counter.
            feed.verify_inputs()  # Note [dead producers and imported events], point a
            if not (task.grad_signals and self._landed(state, list(task.grad_signals))):
                pairs = []  # (else: Note [no rewrite after signal], the losses)
                for m, mb in enumerate(task.microbatches):
                    assert mb.loss is not None
                    dst = state.view(mb.loss)
                    pairs.append((result.losses[m : m + 1].reshape(dst.shape), dst))
                copies.add(self.engine.download(pairs, Priority.WEIGHT), up=False)
            grads = result.weight_grads
        watch.stop(_TASK_KEY)
        # Only waits inside the stopwatch's window come off compute_s; the gradient-slot
        # waits below are after it (they still count in the task's wait_s).
        self._waited_in_compute_s = self._waited_s
        slots = state.grad_slots(start, stop, task.grad_part) if task.kind != "forward" else []
        if slots:
            for wait in task.grad_waits:
                self._wait(state, wait, timeout)
            signals = list(task.grad_signals)
            if self._landed(state, signals):  # Note [no rewrite after signal]
                self._publish_landed(state, signals)
            else:
                feed.verify_inputs()  # Note [dead producers and imported events], point a
                pairs = []
                for name, dst in slots:
                    grad = grads.get(name)
                    if grad is None:
                        dst.zero_()  # write every slot: a re-run must produce the same bytes
                    else:
                        pairs.append((grad, dst))
                # Weight gradients go behind activations (Note [priority-aware transfers]);
                # their counters are stored once they have landed.
                copies.add(self._download(state, pairs, Priority.WEIGHT, signals), up=False)
        feed.verify_inputs()
        self._fault_point("end", task)

    def _download(
        self,
        state: JobState,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        priority: Priority,
        signals: Sequence[EventSignal],
        after_issue: Callable[[], None] | None = None,
    ) -> Transfer:
        """Copy ``pairs`` to the arenas and store ``signals``: act/dact counters at issue
        with a ticket and their landed marks once the bytes are there on an engine that
        does so (Note [activation hand-off] in roundpipe.worker.transfer); every other
        counter, and every counter on the ``cpu`` backend, once the bytes are there."""
        if self.engine.broken is not None:  # its announcements could never land
            raise HandoffLost(self.engine.broken)
        board = state.handoffs
        early = [s for s in signals if board.is_handoff(s.counter)]
        if not (self.engine.counter_at_issue and early):
            return self.engine.download(
                pairs, priority, then=lambda: self._publish_landed(state, signals)
            )
        late = [s for s in signals if not board.is_handoff(s.counter)]

        def issued(mark: IssueMark) -> None:
            for sig in early:
                board.write_ticket(sig.counter, sig.value, mark)
            for sig in early:  # signal() has a memory barrier: the tickets before the counters
                self._signal(state, sig)
            if after_issue is not None:
                after_issue()

        def landed() -> None:
            for sig in early:
                board.mark_landed(sig.counter, sig.value)
            for sig in late:
                self._signal(state, sig)

        return self.engine.download(pairs, priority, then=landed, on_issue=issued)

    def _publish_landed(self, state: JobState, signals: Sequence[EventSignal]) -> None:
        """Store ``signals`` whose bytes are all in place: landed marks first, so a reader
        that sees a counter sees its landed mark too."""
        board = state.handoffs
        for sig in signals:
            if board.is_handoff(sig.counter):
                board.mark_landed(sig.counter, sig.value)
        for sig in signals:
            self._signal(state, sig)

    @staticmethod
    def _layer_times(
        task: StageTask, measured: dict[int, float], busy_s: float
    ) -> dict[str, float]:
        """Per-layer seconds for the planner (roundpipe.coordinator.planning.profile keys).

        Forward tasks: each layer's measured forward time (``"L.fwd"``). Backward and tail
        tasks: autograd runs the whole stage at once, so the task's compute time (without
        waiting for inputs or uploads) is split over its layers in proportion to their
        measured forward (recompute) times (``"L"``). Measured with CUDA events on a GPU.
        """
        if not measured:
            return {}
        if task.kind == "forward":
            return {f"{layer}.fwd": s for layer, s in measured.items()}
        total = sum(measured.values()) or 1.0
        return {f"{layer}": busy_s * s / total for layer, s in measured.items()}

    def _wait(self, state: JobState, wait: EventWait, timeout_s: float) -> None:
        started = time.perf_counter()
        job_id = state.setup.job_id
        try:
            state.events.wait_at_least(
                wait.counter,
                wait.at_least,
                timeout_s,
                should_abort=lambda: self.should_abort() or job_id in self._interrupted,
            )
        except InterruptedError as exc:
            if job_id in self._interrupted:
                raise TaskInterrupted(f"job {job_id} was torn down while a task waited") from None
            raise TaskAborted(str(exc)) from None
        finally:
            self._waited_s += time.perf_counter() - started

    def _loss_scale(self, state: JobState, task: StageTask, timeout_s: float) -> float:
        """The float16 loss scale of the task's iteration (1.0 without scaling): the
        coordinator's optimizer stores it once the step before has been decided (Note
        [dynamic loss scaling] in roundpipe.coordinator.training.loss_scale)."""
        counter = task.loss_scale_counter
        if counter is None:
            return 1.0
        k = task.iteration
        self._wait(state, EventWait(counter=counter, at_least=loss_scale_value(k, 0)), timeout_s)
        # A later step's scale there means step k has been decided: every gradient of it
        # was consumed, so this is a rerun whose results nothing reads any more (its
        # gradients are not written again: Note [no rewrite after signal]). Any scale
        # does for it.
        _, exponent = read_loss_scale_value(state.events.read(counter))
        return float(2**exponent)

    def _signal(self, state: JobState, sig: EventSignal) -> None:
        state.events.signal(sig.counter, sig.value)

    @staticmethod
    def _landed(state: JobState, signals: Sequence[EventSignal]) -> bool:
        """Whether an earlier run's bytes for these signals are all in place: it stored
        a landed mark (act/dact) or a counter (the rest) of any of them."""
        board = state.handoffs
        return any(
            board.landed(s.counter, s.value)
            if board.is_handoff(s.counter)
            else state.events.read(s.counter) >= s.value
            for s in signals
        )

    def _verify_landed(self, state: JobState, handoffs: Sequence[Handoff]) -> None:
        """Block until these inputs' copies have landed (normally long since)."""
        job_id = state.setup.job_id
        for handoff in handoffs:
            try:
                handoff.wait_landed(
                    should_abort=lambda: self.should_abort() or job_id in self._interrupted
                )
                if self.engine.kind == "cuda" and handoff.superseded():
                    # The device followed the first producer's event, and that producer
                    # was re-run: what the stream read is not known to be its data.
                    raise HandoffLost(
                        f"{state.events.label(handoff.counter)} = {handoff.value} was "
                        f"re-produced after this task's stream followed process "
                        f"{handoff.ticket.pid}'s copy of it; the task is re-run on the new copy"
                    )
            except InterruptedError as exc:
                if job_id in self._interrupted:
                    raise TaskInterrupted(
                        f"job {job_id} was torn down while a task waited"
                    ) from None
                raise TaskAborted(str(exc)) from None

    def _fault_point(self, where: str, task: StageTask, mb: int | None = None) -> None:
        if self.fault is not None and self.fault.point(where, task=task, mb=mb):
            # ``hold`` (worker.faults): wait until the job is torn down, then go on, so the
            # task's own interruption checks are what stop it.
            log.warning("[worker] task %d held by ROUNDPIPE_FAULT", task.task_id)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while task.job_id not in self._interrupted and time.monotonic() < deadline:
                time.sleep(0.01)


HOLD_LIMIT_S = 600.0
"""The longest a ``hold`` fault holds a task (a test that never cancels still ends)."""

_TASK_KEY = -1
"""Stopwatch key of a task's whole compute (layer keys are >= 0)."""


class _LazyInputs(Sequence):
    """A sequence whose item m waits for microbatch m's counters, then uploads it."""

    def __init__(self, feed: _MicrobatchFeed, what: str):
        self._feed = feed
        self._what = what

    def __len__(self) -> int:
        return len(self._feed.task.microbatches)

    def __getitem__(self, m):  # type: ignore[override]
        if isinstance(m, slice):
            return [self[i] for i in range(*m.indices(len(self)))]
        return self._feed.fetch(self._what, m)


_PICK: dict[str, Callable[[MicrobatchIO], TensorRef | None]] = {
    "input": lambda mb: mb.input,
    "grad_output": lambda mb: mb.grad_output,
    "labels": lambda mb: mb.labels,
    "position_ids": lambda mb: mb.position_ids,
}


class _MicrobatchFeed:
    """Per-microbatch waits and uploads on the way in, downloads and signals on the way
    out (signals stored by the engine once the download has landed)."""

    def __init__(self, core: WorkerCore, state: JobState, task: StageTask, copies: TaskCopies):
        self.core = core
        self.state = state
        self.task = task
        self.copies = copies
        self._ready: set[int] = set()
        self._faulted: set[int] = set()
        self._written: set[int] = set()
        self._uploads: dict[tuple[str, int], Upload] = {}
        self._saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Inputs that came through tickets, per microbatch, not yet seen landed (Note
        # [dead producers and imported events] in roundpipe.shared.handoff).
        self._handoffs: dict[int, list[Handoff]] = {}

    # -- in ---------------------------------------------------------------------------

    def _wait_ready(self, m: int) -> MicrobatchIO:
        mb = self.task.microbatches[m]
        if m not in self._ready:
            for wait in mb.waits:
                self.core._wait(self.state, wait, self.task.wait_timeout_s)
            self._became_ready(m)
        return mb

    def _became_ready(self, m: int) -> None:
        """Microbatch m's counters are met: note which inputs came through tickets."""
        self._ready.add(m)
        board = self.state.handoffs
        found = []
        for wait in self.task.microbatches[m].waits:
            h = board.handoff(wait.counter, wait.at_least, self.task.wait_timeout_s)
            if h is not None:
                found.append(h)
        if found:
            self._handoffs[m] = found

    def verify_inputs(self, upto: int | None = None) -> None:
        """Before publishing anything computed from microbatches [0, upto] (all: None):
        their inputs' copies must have landed, or the task fails (HandoffLost)."""
        for m in sorted(self._handoffs):
            if upto is not None and m > upto:
                break
            self.core._verify_landed(self.state, self._handoffs.pop(m))

    def _ready_now(self, m: int) -> bool:
        """Whether microbatch m's counters are all met already (no waiting)."""
        if m in self._ready:
            return True
        events = self.state.events
        if all(events.read(w.counter) >= w.at_least for w in self.task.microbatches[m].waits):
            memory_barrier()  # Note [event-table barriers]: the counters before the data
            self._became_ready(m)
            return True
        return False

    def _upload(self, what: str, m: int) -> Upload:
        mb = self.task.microbatches[m]
        # The link waits for the producers' copies of this microbatch's inputs, if they
        # came at issue (Note [activation hand-off] in roundpipe.worker.transfer).
        after = self._handoffs.get(m, ())
        engine = self.core.engine
        if what == "router_in":
            views = {f"r{i}": self.state.view(r) for i, r in enumerate(mb.router_in)}
            return engine.upload(views, Priority.ACTIVATION, after)
        ref = _PICK[what](mb)
        assert ref is not None, what
        view = self.state.view(ref)
        if what == "labels":
            # Label positions are found on the host: the device never syncs for them (the
            # labels come from the coordinator, which writes before it signals).
            shifted, positions = tail_labels(view)
            return engine.upload({"shifted": shifted, "positions": positions}, Priority.ACTIVATION)
        return engine.upload({"x": view}, Priority.ACTIVATION, after)

    def fetch(self, what: str, m: int):
        if m not in self._faulted:
            self._faulted.add(m)
            self.core._fault_point("mb", self.task, self.task.microbatches[m].index)
        up = self._uploads.pop((what, m), None)
        if up is None:
            self._wait_ready(m)
            up = self._upload(what, m)
            self.copies.add(up, up=True)
        # Look ahead: microbatch m + 1 goes up while m computes, if it is there already.
        nxt = m + 1
        if (
            self.core.overlap
            and nxt < len(self.task.microbatches)
            and (what, nxt) not in self._uploads
            and self.core.engine.kind != "cpu"
            and self._ready_now(nxt)
            and not self._blocks_the_link(nxt)
        ):
            ahead = self._upload(what, nxt)
            self.copies.add(ahead, up=True)
            self._uploads[(what, nxt)] = ahead
        waited = time.perf_counter()
        if up.follows:
            self._await_producers(up)
        tensors = up.tensors()
        self.core._waited_s += time.perf_counter() - waited
        if what == "labels":
            labels = self.task.microbatches[m].labels
            assert labels is not None
            return TailLabels(tensors["shifted"], tensors["positions"], tuple(labels.shape))
        if what == "router_in":  # the forward stages' statistics add up (or one count)
            parts = [tensors[f"r{i}"] for i in range(len(tensors))]
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)
        return tensors["x"]

    def _blocks_the_link(self, m: int) -> bool:
        """Whether uploading microbatch m now would hold the upload link: on the host
        engines the link itself waits for a producer's copy that has not landed, and
        every copy queued behind it (microbatch m - 1's other inputs, the next task's
        weights) would wait too, with no way to yield. On CUDA only the device waits."""
        if self.core.engine.kind == "cuda":
            return False
        return any(not h.landed() for h in self._handoffs.get(m, ()))

    def _await_producers(self, up: Upload) -> None:
        """Wait for an upload that follows other workers' copies, as for a counter: a
        torn-down job or a lower-numbered task (the re-run of a dead producer's task,
        which may be what this upload waits for) makes the task give up and yield."""
        job_id = self.task.job_id
        while not self.core.engine.wait_usable(up, 0.05):
            if job_id in self.core._interrupted:
                raise TaskInterrupted(f"job {job_id} was torn down while a task waited")
            if self.core.should_abort():
                raise TaskAborted(f"task {self.task.task_id} gave up waiting for a producer's copy")

    def inputs(self) -> _LazyInputs:
        return _LazyInputs(self, "input")

    def grad_outputs(self) -> _LazyInputs:
        return _LazyInputs(self, "grad_output")

    def labels(self) -> _LazyInputs:
        return _LazyInputs(self, "labels")

    def router_inputs(self) -> _LazyInputs | None:
        """Router statistics in (tail) or counts in (backward); Note [router auxiliary
        loss] in roundpipe.shared.model. None without them."""
        if not self.task.microbatches[0].router_in:
            return None
        return _LazyInputs(self, "router_in")

    def batch_tokens(self) -> int:
        """Tokens of the global batch, over every node of a group: padding left out
        (StageTask.router_tokens) or, without padding, every microbatch slot has the same
        shape, and a task holds all of this node's or, split (Note [microbatch-split
        stages] in roundpipe.shared.plan), some."""
        if self.task.router_tokens:
            return self.task.router_tokens
        shape = self.task.microbatches[0].input.shape
        return self.state.setup.global_microbatches * shape[0] * shape[1]

    def row_tokens(self) -> list[list[int]] | None:
        """Real tokens of each row of each microbatch (MicrobatchIO.row_tokens); None:
        every token is real."""
        if not any(mb.row_tokens for mb in self.task.microbatches):
            return None
        return [list(mb.row_tokens) for mb in self.task.microbatches]

    def write_router(self, m: int, tensor: torch.Tensor) -> None:
        """Microbatch m's router statistics / counts travel with its output (so they
        have landed before its signals), like saved inputs."""
        ref = self.task.microbatches[m].router_out
        if ref is not None:
            self._saved.setdefault(m, []).append((tensor, self.state.view(ref)))

    def position_ids(self) -> _LazyInputs | None:
        """Fetched only when a decoder layer needs them (Note [packed documents])."""
        if any(mb.position_ids is None for mb in self.task.microbatches):
            return None
        return _LazyInputs(self, "position_ids")

    # -- out --------------------------------------------------------------------------

    def write_output(self, m: int, tensor: torch.Tensor) -> None:
        mb = self.task.microbatches[m]
        assert mb.output is not None
        self._written.add(m)
        saved = self._saved.pop(m, [])
        self.verify_inputs(m)  # Note [dead producers and imported events], point a
        if self.core._landed(self.state, mb.signals):  # Note [no rewrite after signal]
            self.core._publish_landed(self.state, mb.signals)
            return
        # Saved inputs travel with the output: one copy, one completion, then the
        # microbatch's counters (its signals cover both).
        pairs = saved + [(tensor, self.state.view(mb.output))]
        copy = self.core._download(
            self.state,
            pairs,
            Priority.ACTIVATION,
            mb.signals,
            after_issue=lambda: self.core._fault_point("issued", self.task, mb.index),
        )
        self.copies.add(copy, up=False)
        if not self.core.overlap:
            copy.wait()

    def write_saved(self, layer: int, m: int, tensor: torch.Tensor) -> None:
        for saved in self.task.microbatches[m].saved:
            if saved.layer == layer:
                self._saved.setdefault(m, []).append((tensor, self.state.view(saved.ref)))

    def write_grad_inputs(self, grad_inputs: list[torch.Tensor] | None) -> None:
        for m, mb in enumerate(self.task.microbatches):
            if m in self._written:
                continue
            if mb.output is not None and grad_inputs is not None:
                self.write_output(m, grad_inputs[m])
            else:
                self._written.add(m)
                self.verify_inputs(m)
                self.core._publish_landed(self.state, mb.signals)


def _recompute_grain(task: StageTask) -> str:
    """The grain a backward task asks for (``options["recompute"]``, Note [recompute
    grain] in roundpipe.worker.executor); stage grain when absent. Anything else is the
    coordinator's bug: the task fails and says so."""
    grain = task.options.get("recompute", "stage")
    if grain not in RECOMPUTE_GRAINS:
        raise ValueError(
            f"task {task.task_id} asks for recompute {grain!r}; expected one of {RECOMPUTE_GRAINS}"
        )
    return str(grain)
