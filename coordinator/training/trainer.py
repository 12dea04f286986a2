"""One training job, start to finish, without sockets.

``Trainer`` owns a job's state: the model description, the arenas (via ``JobLayout``),
the fp32 masters and the layer-wise AdamW, the data loader. ``run`` drives iterations:
it writes each global batch into the io arena, builds the iteration's StageTasks
(roundpipe.coordinator.training.schedule) and hands them to workers round-robin through a
``WorkerPort``, with a task counter that persists across iterations. Workers report
completions into ``inbox``.

Everything that crosses between a trainer and the world is typed, in
roundpipe.coordinator.training.job_events: results and worker events come in through ``inbox``,
the trainer's ``JobEvent``s (plan chosen, checkpoint written) go out through one
``on_event`` callable, and tasks go out through the port. The coordinator daemon runs a
Trainer in a job thread with a port over ZeroMQ; tests use in-process ``WorkerCore``
threads.

The trainer composes the parts of a job, each in a module of its own, built in
``prepare`` once the state they share exists:

* ``JobPlanner`` (job_planner): the first plan, the layout sized against host memory,
  re-plans from measured layer times (Note [re-planning]);
* ``OptimizerThread`` (optimizer_thread): updates layers as their gradients complete
  (Note [weight-update ordering] in roundpipe.coordinator.training.schedule);
* ``Checkpointer`` (checkpointer): writes checkpoints, drained or in the background, and
  restores a job from one (Note [checkpoint cut]);
* ``ModelExporter`` (exporter): the model in Hugging Face layout, for ``export`` and for
  every checkpoint;
* ``JobOutput`` (job_output): the output directory, written through its checked pin;
* ``GroupMember`` (group_member): this node's side of a data-parallel group;
* ``ProgressLog`` (progress_log): the progress events, shared between threads.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from roundpipe.coordinator.planning.hardware import HardwareSpec, cpu_hardware
from roundpipe.coordinator.spec.checkpoint_format import CheckpointInfo
from roundpipe.coordinator.spec.choices import optimizer_state_sharded
from roundpipe.coordinator.spec.data import DataLoader, GlobalBatch, build_dataset_from_spec
from roundpipe.coordinator.spec.jobspec import (
    JobSpec,
    model_config_from_spec,
    validate_against_model,
)
from roundpipe.coordinator.spec.paths import PathPolicy, PathRefused
from roundpipe.coordinator.training.checkpointer import Checkpointer, CheckpointMoments
from roundpipe.coordinator.training.divergence import (
    Diverged,
    check_loss,
    kept_after_divergence,
)
from roundpipe.coordinator.training.exporter import ModelExporter
from roundpipe.coordinator.training.group_member import GroupMember
from roundpipe.coordinator.training.hold_point import held
from roundpipe.coordinator.training.initial_weights import place_initial_weights
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed
from roundpipe.coordinator.training.job_events import (
    CheckpointSettled,
    CheckpointWritten,
    InboxEvent,
    JobEvent,
    PlanChosen,
    Wakeup,
    WorkerJoined,
    WorkerLost,
    WorkerPort,
)
from roundpipe.coordinator.training.job_output import JobOutput
from roundpipe.coordinator.training.job_planner import JobPlanner
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.loss_scale import LossScaler
from roundpipe.coordinator.training.memory import release_freed_memory
from roundpipe.coordinator.training.multinode import GradientReducer, GroupError, JobGroup
from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer
from roundpipe.coordinator.training.optimizer_thread import OptimizerThread
from roundpipe.coordinator.training.progress_log import ProgressLog
from roundpipe.coordinator.training.recovery import RecoveryPolicy, TaskGaveUp, TaskTracker
from roundpipe.coordinator.training.schedule import ScheduleBuilder
from roundpipe.coordinator.training.sharded_checkpoint import ShardedCheckpoints
from roundpipe.coordinator.training.sharded_optimizer import ZeroShards
from roundpipe.coordinator.training.timeline import TimelineRecorder
from roundpipe.protocol import JobSetup, ProgressEvent, StageTask, TaskDone, TaskFailed
from roundpipe.shared.model import LayeredModel, model_config_dict
from roundpipe.shared.plan import Plan

__all__ = ["Trainer", "default_plan"]

_STALL_S = 1.0
"""A wait for the inbox this much longer than asked: this process stalled."""

log = logging.getLogger(__name__)


def default_plan(num_layers: int, num_workers: int) -> Plan:
    """A simple uniform plan, independent of any cost model (the chaos harness pins it
    so that faulty and fault-free runs cut the model alike; jobs use the planner).

    The tail fuses the last decoder layer with the head; forward stages are as many as
    the workers (round-robin keeps them all busy), backward stages twice as many because
    recompute + backward costs about three forward passes (asymmetric partition).
    """
    tail_layers = 2 if num_layers >= 4 else 1
    before_tail = num_layers - tail_layers
    if before_tail == 0:
        return Plan(forward=(), tail=(0, num_layers), backward=())
    num_forward = max(1, min(before_tail, num_workers))
    num_backward = max(1, min(before_tail, 2 * num_forward))
    return Plan.uniform(
        num_layers, num_forward=num_forward, num_backward=num_backward, tail_layers=tail_layers
    )


class Trainer:
    """Runs one job. Build, ``prepare()``, then ``run(...)``; always ``close()``."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        arena_dir: str | Path,
        namespace: str,
        output_dir: Path,
        wait_timeout_s: float = 600.0,
        optimizer_impl: str = "fused",
        recovery_policy: RecoveryPolicy | None = None,
        on_event: Callable[[JobEvent], None] | None = None,
        paths: PathPolicy | None = None,
        group: JobGroup | None = None,
    ):
        self.job_id = job_id
        self.group = group
        """This job's data-parallel group (coordinator.multinode), or None: one node."""
        self.paths = paths
        """The coordinator's allowed roots: checked again before the job's files are
        opened and before every write into its output (None: not confined)."""
        self.spec = spec
        self.arena_dir = Path(arena_dir)
        self.namespace = namespace
        self.output_dir = Path(output_dir)
        self.wait_timeout_s = wait_timeout_s
        self.optimizer_impl = optimizer_impl
        self.inbox: queue.Queue[TaskDone | TaskFailed | InboxEvent] = queue.Queue()
        """Results and events for the run loop (roundpipe.coordinator.training.job_events)."""
        self.recovery_policy = recovery_policy or RecoveryPolicy()
        self._port: WorkerPort | None = None
        self._stall_seen = 0.0
        """The port's stalled seconds already credited to the progress deadline."""
        self.tracker: TaskTracker | None = None
        """The tasks in flight and the workers that hold them; None until ``run``."""
        self.progress_log = ProgressLog()
        self.step = 0
        self.last_loss: float | None = None
        self._cancel = threading.Event()  # also set when a run ends: its threads stop
        self.output = JobOutput(job_id, self.output_dir, paths)
        self.start_step = 0
        """Step the run starts after: 0, or the step of the checkpoint it resumed from."""
        self.member = (
            None
            if group is None
            else GroupMember(
                job_id,
                spec,
                group,
                output=self.output,
                cancelled=self._cancel,
                wake=lambda why: self.inbox.put(Wakeup(why)),
            )
        )
        """This node's side of the group, or None: one node."""
        self.layout: JobLayout | None = None
        self.shards: ZeroShards | None = None
        """This node's shard of the optimizer state (``train.optimizer_sharding:
        sharded`` in a group), else None: ``masters`` are then whole."""
        self.on_event = on_event
        """Gets the job's ``JobEvent``s: the plan chosen, checkpoints written."""
        self.hardware: HardwareSpec | None = None
        self.plan_history: list[tuple[int, str, str]] = []
        """(first iteration, plan, why) for every plan the job has used."""
        # The parts that share the prepared state (module docstring); None until then.
        self.planner: JobPlanner | None = None
        self.optimizer_thread: OptimizerThread | None = None
        self.checkpointer: Checkpointer | None = None
        self.exporter: ModelExporter | None = None
        self.sharded_checkpoints: ShardedCheckpoints | None = None
        """Writes checkpoints with sharded optimizer state (Note [sharded checkpoint])."""
        self.prepared = False
        """True once ``prepare`` has finished (``step`` is then the step it resumes from)."""
        self.loss_scaler: LossScaler | None = None
        """float16 loss scaling (set by ``prepare``)."""
        # observability: replaced by a recording one when run() starts
        self.timeline = TimelineRecorder(job_id)

    @property
    def progress(self) -> list[ProgressEvent]:
        """The progress events so far, as objects (read from other threads with
        ``progress_page`` / ``recent_progress``)."""
        return self.progress_log.events()

    @property
    def checkpoint_step(self) -> int | None:
        """Step of the newest checkpoint written or resumed from (None: none yet)."""
        return self.output.checkpoint_step

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The checkpoint ``prepare`` restored, if any."""
        return None if self.checkpointer is None else self.checkpointer.resumed_from

    @property
    def held_output(self) -> Path:
        """The output directory held open from ``prepare`` to ``close`` (its pin): where
        the run's trace and TensorBoard scalars go, written all along."""
        return self.output.held

    @property
    def staging_bytes(self) -> int:
        """Host memory set aside for background checkpoints (0: checkpoints drain the
        pipeline); decided in ``prepare`` (Note [background checkpoint])."""
        return 0 if self.planner is None else self.planner.staging_bytes

    # -- preparation ------------------------------------------------------------------

    def prepare(self, num_workers: int, hardware: HardwareSpec | None = None) -> None:
        """Load the model and data, validate against each other, plan (Note
        [re-planning]), lay out the arenas, and restore the newest checkpoint of this
        job (or ``model.resume_from``) if any. ``hardware`` describes the workers (default:
        ``num_workers`` CPU workers).

        Raises JobPaused if the output directory cannot be written (checked first, so a
        bad directory costs nothing), JobFailed if a checkpoint does not fit the job.
        """
        if self.paths is not None:
            try:
                self.paths.recheck(self.spec.to_dict())
            except PathRefused as exc:
                raise JobFailed(str(exc)) from None
        self.output.hold()
        spec = self.spec
        config = model_config_from_spec(spec.model)
        lora = spec.lora.model_settings() if spec.lora is not None else None
        if spec.model.path is not None:
            model = LayeredModel.from_hf_dir(
                spec.model.path, lora, dequantize_mxfp4=spec.model.dequantize
            )
        else:
            model = LayeredModel(config, lora)
        self.node_microbatches = spec.batch.num_microbatches
        """Microbatches this node trains per step: the global batch's, or its share."""
        self._microbatch_offset = 0
        """The global index of this node's first microbatch."""
        if self.group is not None:
            try:
                share = self.group.microbatches(spec.batch.num_microbatches)
                self.node_microbatches, self._microbatch_offset = len(share), share.start
            except ValueError as exc:
                raise JobFailed(str(exc)) from None
        self.dataset = build_dataset_from_spec(spec)
        validate_against_model(spec, model.config, vocab_size_needed=self.dataset.vocab_size_needed)
        self.loader = DataLoader.from_spec(spec, self.dataset)
        self.model = model
        self.compute_dtype = getattr(torch, spec.train.dtype)
        self.hardware = hardware or cpu_hardware(max(1, num_workers))
        self.planner = JobPlanner(
            self.job_id,
            spec,
            hardware=self.hardware,
            arena_dir=self.arena_dir,
            node_microbatches=self.node_microbatches,
            compute_dtype=self.compute_dtype,
            nodes=1 if self.group is None else self.group.world_size,
            rank=0 if self.group is None else self.group.rank,
            dataset_bytes=self.dataset.nbytes,
        )
        layout, why = self.planner.first_layout(model)
        log.info(
            "[trainer] job %s: this node (rank %d of %d) needs %s",
            self.job_id,
            self.planner.rank,
            self.planner.nodes,
            self.planner.host_memory(layout).describe(model.parameter_count()),
        )
        layout.create(self.arena_dir, self.namespace)
        self.layout = layout
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        self.shards = self._make_shards()
        # Sharded, every node but rank 0 keeps only its pieces of the masters as they are
        # read (rank 0 keeps the whole ones until the nodes are in sync: it restores and
        # broadcasts them); the others' are the shapes alone (Note [sharded start-up]).
        self.masters, full_masters = place_initial_weights(
            model,
            layout,
            self.spec,
            pieces_of=self.shards if self.group is not None and not self.group.leader else None,
        )
        full_masters = self._shard_masters(full_masters)
        release_freed_memory()  # the fp32 weights loaded above, freed: off the RSS
        self.optimizer = LayerwiseOptimizer.from_spec(spec, self.masters, impl=self.optimizer_impl)
        self.loss_scaler = LossScaler.from_spec(spec, self.job_id)
        self.schedule = ScheduleBuilder(
            layout=layout,
            job_id=self.job_id,
            staleness=spec.train.staleness,
            seed=spec.train.seed,
            wait_timeout_s=self.wait_timeout_s,
            loss_scaling=self.loss_scaler is not None,
        )
        self._build_parts()
        log.info(
            "[trainer] job %s: %s, %d layers, plan %s, %d trainable tensors",
            self.job_id,
            model.architecture,
            model.num_layers,
            self.plan,
            sum(len(v) for v in self.masters.values()),
        )
        assert self.checkpointer is not None
        # With a group, rank 0 alone reads checkpoints and hands the state to the others.
        source = (
            self.checkpointer.resume_source() if self.group is None or self.group.leader else None
        )
        full_moments: CheckpointMoments | None = None
        if source is not None:
            if self.shards is not None:  # whole masters; sync keeps the pieces
                assert full_masters is not None
                # the states stay in the file, read a layer at a time as sync sends them
                full_moments = self.checkpointer.restore(
                    source, masters=full_masters, stream_moments=True
                )
            else:
                self.checkpointer.restore(source)
            self._start_after(source.step)
        if self.member is not None:
            leader_step = self.member.sync(
                layout=layout,
                masters=self.masters,
                optimizer=self.optimizer,
                dataset=self.dataset,
                loader=self.loader,
                progress=self.progress_log,
                start_step=self.start_step,
                shards=self.shards,
                full_masters=full_masters,
                full_moments=full_moments,
                checkpointer=self.checkpointer,
            )
            if leader_step is not None:
                self._start_after(leader_step)
        if self.loss_scaler is not None:  # the first steps' scales, for the workers
            self.loss_scaler.publish(layout.events, layout.counters)
        if full_moments is not None:
            full_moments.close()
        del full_masters, full_moments
        release_freed_memory()
        self._plan_chosen(self.start_step + 1, why)
        self.prepared = True

    def _make_shards(self) -> ZeroShards | None:
        """With ``train.optimizer_sharding: sharded`` in a group: how this node's pieces
        of the masters and optimizer states are cut (roundpipe.coordinator.training.
        sharded_optimizer). None: replicated, or one node (whose shard is the whole
        state)."""
        spec = self.spec
        if not optimizer_state_sharded(spec.train.optimizer_sharding, spec.optimizer.state_dtype):
            return None
        if self.group is None:
            if spec.train.optimizer_sharding == "sharded":  # asked for, not the default
                log.info(
                    "[trainer] job %s: optimizer_sharding 'sharded' on one node: its shard "
                    "is the whole optimizer state (as 'replicated')",
                    self.job_id,
                )
            return None
        return ZeroShards(
            self.group, self.group.rank, self.group.world_size, spec.train.grad_transport
        )

    def _shard_masters(
        self, full: dict[int, dict[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]] | None:
        """Sharded: keep only this node's pieces as ``masters`` and return the whole
        masters ``full`` as placed (rank 0's tensors, the others' shapes), which
        ``prepare`` drops once the nodes are in sync. None: not sharded."""
        if self.shards is None:
            if self.group is not None:
                log.info(  # benchmarks/multinode.py reads it
                    "[trainer] job %s: optimizer state replicated on %d nodes: rank %d holds "
                    "the masters and moments of %d of %d trainable elements",
                    self.job_id,
                    self.group.world_size,
                    self.group.rank,
                    *(sum(t.numel() for per in self.masters.values() for t in per.values()),) * 2,
                )
            return None
        assert self.group is not None
        if self.group.leader:
            self.masters = self.shards.shard_masters(full)
        log.info(  # benchmarks/multinode.py reads it
            "[trainer] job %s: optimizer state sharded over %d nodes: rank %d holds the "
            "masters and moments of %d of %d trainable elements",
            self.job_id,
            self.group.world_size,
            self.group.rank,
            sum(t.numel() for per in self.masters.values() for t in per.values()),
            sum(t.numel() for per in full.values() for t in per.values()),
        )
        return full

    def _build_parts(self) -> None:
        """The parts that work on the prepared state (module docstring)."""
        assert self.layout is not None
        self.exporter = ModelExporter(self.spec, self.model, self.layout, self.masters, self.output)
        self.checkpointer = Checkpointer(
            self.job_id,
            self.spec,
            model=self.model,
            layout=self.layout,
            masters=self.masters,
            optimizer=self.optimizer,
            optimizer_impl=self.optimizer_impl,
            loader=self.loader,
            progress=self.progress_log,
            plan_history=self.plan_history,
            output=self.output,
            exporter=self.exporter,
            emit=self._emit,
            loss_scaler=self.loss_scaler,
        )
        self.optimizer_thread = OptimizerThread(
            self.job_id,
            self.spec,
            model=self.model,
            layout=self.layout,
            masters=self.masters,
            optimizer=self.optimizer,
            cancelled=self._cancel,
            wake=lambda why: self.inbox.put(Wakeup(why)),
            shards=self.shards,
            loss_scaler=self.loss_scaler,
            checkpoint_due=self.checkpointer.due,
        )
        if self.shards is not None:
            assert self.member is not None
            self.sharded_checkpoints = ShardedCheckpoints(
                self.shards,
                self.layout,
                self.masters,
                self.optimizer,
                self.checkpointer,
                job_id=self.job_id,
                stopped=self.member.stopped,
            )

    def _start_after(self, step: int) -> None:
        """Start the run after ``step``, whose state (and progress) was just restored
        (Note [checkpoint cut])."""
        self.step = self.start_step = step
        self.last_loss = self.progress_log.last_loss
        # Every step up to it is applied: until run() starts its recorder, the optimizer
        # lag (metrics, status) read step - 0, the whole run's steps.
        self.timeline.optimizer_step = step

    def _plan_chosen(self, iteration: int, why: str) -> None:
        self.plan_history.append((iteration, str(self.plan), why))
        self.timeline.set_plan(self.plan)  # observability: stage labels
        log.info(
            "[trainer] job %s: plan %s from step %d (%s)", self.job_id, self.plan, iteration, why
        )
        self._emit(PlanChosen(self.plan, why))

    @property
    def plan(self) -> Plan:
        """The plan in use (the layout's: Note [slot pools])."""
        assert self.layout is not None, "prepare() first"
        return self.layout.plan

    def switch_plan(self, plan: Plan, iteration: int, why: str) -> None:
        """Use ``plan`` from ``iteration`` on. Only with no task in flight."""
        assert self.layout is not None
        self.layout.assign(plan)
        self._plan_chosen(iteration, why)

    def job_setup(self) -> JobSetup:
        assert self.layout is not None
        return JobSetup(
            job_id=self.job_id,
            model_config=model_config_dict(self.model.config),
            lora=None if self.model.lora is None else self.model.lora.to_mapping(),
            compute_dtype=self.spec.train.dtype,
            arenas=self.layout.arena_infos(),
            layers=self.layout.layer_layouts(),
            num_microbatches=self.layout.num_microbatches,
            global_microbatches=self.spec.batch.num_microbatches,
            microbatch_offset=self._microbatch_offset,
        )

    # -- running ----------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()
        self.output.cancelled.set()  # ends a write's retry wait (Note [out of descriptors])
        self.inbox.put(Wakeup("cancel"))

    def _emit(self, event: JobEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def progress_page(self, after_seq: int, limit: int) -> tuple[list[ProgressEvent], bool]:
        """Up to ``limit`` progress events after ``after_seq``, in seq order, and whether
        more follow (any thread)."""
        return self.progress_log.page(after_seq, limit)

    def recent_progress(self, n: int) -> list[ProgressEvent]:
        """The newest ``n`` progress events (any thread)."""
        return self.progress_log.recent(n)

    def run(
        self,
        port: WorkerPort,
        on_progress: Callable[[ProgressEvent], None] | None = None,
    ) -> None:
        """Train steps ``start_step + 1 .. spec.train.steps``, writing checkpoints on the
        way (each one a ``CheckpointWritten`` event). Raises JobFailed / JobCancelled /
        JobPaused (a checkpoint could not be written; the previous one is intact).

        Tasks go out through ``port`` (roundpipe.coordinator.training.job_events.WorkerPort).
        Worker loss arrives in ``inbox`` as ``WorkerLost`` and a new worker as
        ``WorkerJoined``; the lost worker's tasks are re-dispatched (coordinator.recovery).
        A worker that stopped making progress is fenced through the port.
        """
        layout, spec = self.layout, self.spec
        checkpointer, optimizer_thread, planner = (
            self.checkpointer,
            self.optimizer_thread,
            self.planner,
        )
        assert layout is not None, "prepare() first"
        assert checkpointer is not None and optimizer_thread is not None and planner is not None
        steps = spec.train.steps
        # observability: timeline, measured bubble, TensorBoard (coordinator.timeline)
        self.timeline = TimelineRecorder.for_job(self, len(self.masters))
        if self.group is not None:  # the network lane
            self.group.timeline = self.timeline
        self._start_background_checkpoints(checkpointer)
        if self.member is not None:
            self.member.start_reducer(
                layout,
                self.start_step + 1,
                wait_grads=optimizer_thread.wait_local_grads,
                grads=optimizer_thread.node_grads,
                shards=self.shards,
            )
        optimizer_thread.start(
            self.start_step + 1,
            timeline=self.timeline,
            reducer=self._reducer,
            background=checkpointer.background,
        )
        tracker = TaskTracker(port.send_task, port.live_workers, self.recovery_policy)
        self.tracker = tracker
        self._port = port
        self._stall_seen = port.stalled_s()
        unfinished: dict[int, StageTask] = {}  # dispatched, in flight or parked, not done
        pending_per_iteration: dict[int, int] = {}
        tail_task: dict[int, int] = {}
        next_task_id = 0
        next_task_iteration = self.start_step + 1  # the first iteration not dispatched
        tokens_per_step = spec.global_batch_size * spec.data.seq_len
        started = time.perf_counter()
        last_time = started
        completed_iterations = self.start_step
        diverged = False  # a loss that is not finite was reported: report no more

        def report_through(k: int) -> None:
            """Report every iteration up to ``k`` whose tail has finished."""
            nonlocal completed_iterations, last_time
            while (
                not diverged
                and completed_iterations < k
                and completed_iterations + 1 in tail_task
                and tail_task[completed_iterations + 1] not in unfinished
                and self._loss_known(completed_iterations + 1)
            ):
                completed_iterations += 1
                last_time = self._report(
                    completed_iterations, tokens_per_step, last_time, on_progress
                )
                # Forget finished iterations: a long job must not grow per step.
                tail_task.pop(completed_iterations, None)
                for done in [i for i, n in pending_per_iteration.items() if n == 0]:
                    if done <= completed_iterations:
                        del pending_per_iteration[done]

        def handle_next() -> None:
            self._handle(self._next_message(), unfinished, pending_per_iteration)
            if checkpointer.background is not None:
                # A background checkpoint's writer waits for its step's report: report
                # whatever has finished at once (the drained path's reports stay as
                # they were).
                report_through(next_task_iteration - 1)

        try:
            for k in range(self.start_step + 1, steps + 1):
                while held(k) and not self._cancel.is_set():  # a test point, off unless set
                    if any(pending_per_iteration.values()):
                        handle_next()
                    report_through(k - 1)
                    self._cancel.wait(0.05)
                if self._cancel.is_set():
                    raise JobCancelled(f"job {self.job_id} was cancelled")
                # Note [weight-update ordering], point 5: iteration k reuses k-2's slots.
                while pending_per_iteration.get(k - 2, 0) > 0:
                    handle_next()
                better = planner.replan_candidate(layout)
                if better is not None:  # Note [re-planning]: drain, then switch
                    while any(pending_per_iteration.values()):
                        handle_next()
                        report_through(k - 1)
                    self.switch_plan(better[0], k, better[1])
                batch = self.loader.next_batch()
                assert batch.step == k, (batch.step, k)
                parity = k % 2
                background = checkpointer.background
                if checkpointer.due(k) and background is not None:
                    # Note [background checkpoint]: begun before any task of iteration
                    # k exists, so before the optimizer's step k; the cursor is now k+1.
                    waited = time.perf_counter()
                    while not background.can_begin:  # bounded memory
                        handle_next()
                    checkpointer.note_wait(k, time.perf_counter() - waited)
                    background.begin(k, checkpointer.context())
                # With a group: this node's share; the loss is still normalised over
                # the global batch (batch.num_label_tokens below).
                share = self._node_share(batch)
                layout.write_batch(parity, share)
                assert layout.events is not None
                for m in range(layout.num_microbatches):
                    layout.events.signal(layout.counters.act(0, m), k)
                real_tokens = None
                if layout.model.router_aux is not None and batch.has_padding:
                    # Note [router auxiliary loss]: padding is no token it counts.
                    real_tokens = (batch.num_real_tokens, share.microbatch_row_lengths)
                tasks = self.schedule.tasks(
                    k, batch.num_label_tokens, next_task_id, real_tokens=real_tokens
                )
                optimizer_thread.split_layers(
                    k, self.plan.split_gradient_layers() & set(layout.grads_part)
                )
                next_task_id += len(tasks)
                pending_per_iteration[k] = len(tasks)
                next_task_iteration = k + 1
                for task in tasks:
                    if task.kind == "tail":
                        tail_task[k] = task.task_id
                    unfinished[task.task_id] = task
                    tracker.dispatch(task)  # parked if no worker is connected
                report_through(k - 1)
                # Rank 0 only; with sharded state every node, to gather its shard.
                writes_checkpoints = self.group is None or self.group.leader or self.shards
                if checkpointer.due(k) and background is None and writes_checkpoints:
                    # Note [checkpoint cut]: nothing of iteration k+1 is sent until the
                    # pipeline has drained and the optimizer has applied step k.
                    while any(pending_per_iteration.values()) or not self._loss_known(k):
                        handle_next()
                        report_through(k)
                    optimizer_thread.wait_for(k, self._check_running)
                    report_through(k)
                    path = self.save_checkpoint(k)
                    if path is not None:
                        self._emit(CheckpointWritten(k, path, self.last_loss))
            while any(pending_per_iteration.values()) or not self._loss_known(steps):
                handle_next()
                report_through(steps)
            optimizer_thread.wait_for(steps, self._check_running)
            while checkpointer.background is not None and checkpointer.background.busy:
                handle_next()  # the final checkpoint
            checkpointer.settle_background()  # one that settled after the last message
            if self.shards is not None:  # rank 0 exports the whole model
                if steps > self.start_step:
                    log.info(
                        "[multinode] job %s all-gather: %d bytes of weights per step",
                        self.job_id,
                        self.shards.bytes_gathered // (steps - self.start_step),
                    )
                assert self.sharded_checkpoints is not None
                full = self.sharded_checkpoints.gather_masters(
                    "final", f"every node's masters of step {steps}"
                )
                if full is not None:
                    assert self.exporter is not None
                    self.exporter.masters = {
                        layer: {key[len("master/") :]: t for key, t in per.items()}
                        for layer, per in full.items()
                    }
        except Diverged as failure:  # Note [diverged training]
            diverged = True
            kept = kept_after_divergence(failure.step, checkpointer, handle_next, self.group)
            raise JobFailed(failure.message(spec, kept)) from None
        finally:
            self._cancel.set()
            # Abandons an unfinished checkpoint and wakes a capture waiting for it; a
            # later save_checkpoint drains, as without staging.
            checkpointer.stop_background()
            optimizer_thread.stop(timeout_s=30)
            if self.member is not None:
                self.member.stop_reducer()
        log.info(
            "[trainer] job %s finished steps %d..%d in %.1fs",
            self.job_id,
            self.start_step + 1,
            steps,
            time.perf_counter() - started,
        )

    @property
    def waiting_for_workers(self) -> bool:
        """True while tasks are parked because no worker is connected."""
        return self.tracker is not None and self.tracker.waiting_for_workers

    def _local_loss(self, k: int) -> float:
        """Iteration k's loss over this node's microbatches (read after its tail's
        TaskDone, before iteration k+2 reuses the parity's slots)."""
        assert self.layout is not None
        parity = k % 2
        return sum(
            float(self.layout.view(self.layout.loss[(parity, m)]))
            for m in range(self.layout.num_microbatches)
        )

    def _report(self, k: int, tokens: int, last_time: float, on_progress) -> float:
        assert self.optimizer_thread is not None and self.checkpointer is not None
        reducer = self._reducer
        if reducer is not None:
            loss = reducer.global_loss(k)
            assert loss is not None
            reducer.forget_loss(k)
        else:
            loss = self._local_loss(k)
        now = time.perf_counter()
        self.step = k
        self.last_loss = loss
        event = ProgressEvent(
            seq=k,
            step=k,
            loss=loss,
            tokens_per_s=tokens / max(now - last_time, 1e-9),
            lr=self.optimizer.lr_at(k),
            time=time.time(),
            optimizer_s=self.optimizer_thread.latest_busy_s(),
        )
        self.progress_log.append(event)
        finite = math.isfinite(loss)  # else the job stops below (Note [diverged training])
        if self.checkpointer.background is not None and finite:
            self.checkpointer.background.reported(k)
        self.timeline.step_reported(event)  # observability
        if on_progress is not None:
            on_progress(event)
        log.info(
            "[trainer] job %s step %d loss %.4f optim %.0f ms",
            self.job_id,
            k,
            loss,
            event.optimizer_s * 1e3,
        )
        check_loss(k, loss)
        return now

    def _next_message(self) -> TaskDone | TaskFailed | InboxEvent:
        assert self.optimizer_thread is not None
        while True:
            self._check_running()
            if self._cancel.is_set():
                raise JobCancelled(f"job {self.job_id} was cancelled")
            asked = time.monotonic()
            try:
                return self.inbox.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() - asked > 0.5 + _STALL_S:
                    # This process stalled (frozen, paused): completions may wait unread
                    # in the socket. The I/O loop turns, reads them and measures the
                    # stall before progress is judged.
                    continue
                self._check_progress()

    def _check_progress(self) -> None:
        """Fence and replace workers that hold tasks but stopped completing them."""
        tracker = self.tracker
        if tracker is None:
            return
        if self._port is not None:  # the coordinator's stalls are no worker's hang
            stalled = self._port.stalled_s()
            if stalled > self._stall_seen:
                tracker.excuse(stalled - self._stall_seen)
                self._stall_seen = stalled
        for worker_id in tracker.hung_workers():
            reason = "no task completed within the progress deadline"
            if self._port is not None:
                self._port.fence(worker_id, reason)
            tracker.worker_lost(worker_id, reason)

    def _handle(self, msg, unfinished: dict[int, StageTask], pending: dict[int, int]) -> None:
        tracker, checkpointer, planner = self.tracker, self.checkpointer, self.planner
        assert tracker is not None and checkpointer is not None and planner is not None
        if isinstance(msg, WorkerLost):
            tracker.worker_lost(msg.worker_id, msg.reason)
            return
        if isinstance(msg, WorkerJoined):
            if tracker.dispatch_parked():
                log.info("[trainer] job %s continues: worker %d joined", self.job_id, msg.worker_id)
            return
        if isinstance(msg, Wakeup):
            return  # what it wakes the loop for (cancel, optimizer error) is checked there
        if isinstance(msg, CheckpointSettled):
            checkpointer.settle_background()  # announce it, or raise why it was not written
            return
        if isinstance(msg, TaskFailed):
            if msg.task_id not in unfinished:
                return
            try:
                tracker.failed(msg)
            except TaskGaveUp as exc:
                raise JobFailed(str(exc)) from None
            return
        tracker.completed(msg)
        task = unfinished.pop(msg.task_id, None)
        self.timeline.task_done(msg, task)  # observability
        if task is None:
            return  # a duplicate completion (a re-run finishing late)
        pending[task.iteration] -= 1
        if task.kind == "tail" and self._reducer is not None:
            self._reducer.set_local_loss(task.iteration, self._local_loss(task.iteration))
        if pending[task.iteration] == 0:
            self.timeline.iteration_done(
                task.iteration, len(tracker.live_workers())
            )  # observability
        if planner.profile is not None:
            # A layer-grain backward ran one more forward than a backward's cost holds.
            extra_forward = task.kind == "backward" and planner.recompute == "layer"
            planner.profile.record_done(task, msg, extra_forward=extra_forward)
            if pending[task.iteration] == 0:
                planner.profile.end_iteration(task.iteration)
                planner.write_profile(
                    self.held_output, self.plan, self.output.shown
                )  # roundpipe plan --profile

    # -- data parallelism across nodes (group_member) ---------------------------------

    @property
    def _reducer(self) -> GradientReducer | None:
        """The group's gradient reducer while ``run`` runs (None: one node)."""
        return None if self.member is None else self.member.reducer

    def _node_share(self, batch: GlobalBatch) -> GlobalBatch:
        """The microbatches of ``batch`` this node trains (all of them without a group)."""
        return batch if self.member is None else self.member.share(batch)

    def _loss_known(self, k: int) -> bool:
        """Whether iteration k's loss can be reported (with a group: once summed)."""
        reducer = self._reducer
        if reducer is None or self.step >= k:  # reported: its loss was known
            return True
        return reducer.global_loss(k) is not None

    @property
    def waiting_on_group(self) -> str | None:
        """Which nodes this one has long been waiting for at a collective, and why where
        they said (coordinator.multinode), else None."""
        return None if self.member is None else self.member.waiting

    def _check_group(self) -> None:
        """``check_group``, and tell the others when this node's tasks are parked for
        want of a worker (they wait for it)."""
        if self.member is not None:
            self.member.check(tasks_parked=self.waiting_for_workers)

    def _check_running(self) -> None:
        """``_check_group``, then the optimizer thread: raise JobPaused if it stopped in a
        collective that a lost node broke (the group stopped; that node's heartbeat may not
        have timed out yet), JobFailed if it failed otherwise."""
        self._check_group()  # first: an optimizer stopped by the group is no bug
        assert self.optimizer_thread is not None
        error = self.optimizer_thread.error
        if error is None:
            return
        if isinstance(error, GroupError) and self.member is not None:
            raise self.member.stopped(error) from None
        raise JobFailed(f"optimizer failed: {error}") from error

    def end_with_group(self) -> None:
        """After ``run`` (and rank 0's ``export``): with a group, rank 0 says the job is
        done, and another node waits for that and ends as rank 0 did (GroupMember.end);
        nothing without one."""
        if self.member is not None:
            self.member.end()

    def check_group(self) -> None:
        """Raise JobPaused if another node left the job, went silent or failed a
        collective (Note [arrive before a collective]); JobCancelled if rank 0 cancelled
        it. Also called by the daemon while the job waits for a first worker."""
        if self.member is not None:
            self.member.check_stopped()

    # -- checkpoints and results (checkpointer, exporter) -----------------------------

    def save_checkpoint(self, step: int) -> Path | None:
        """Write the checkpoint after ``step`` from the live state (call only at a cut:
        Note [checkpoint cut]) and prune to ``output.keep_last``. Raises JobPaused if it
        cannot be written. With sharded state every node calls this: the shards are
        gathered at rank 0, which writes (Note [sharded checkpoint]); elsewhere None."""
        assert self.checkpointer is not None, "prepare() first"
        if self.sharded_checkpoints is None:
            return self.checkpointer.save(step)
        return self.sharded_checkpoints.save(step)

    def _start_background_checkpoints(self, checkpointer: Checkpointer) -> None:
        """Write checkpoints in the background if this node has staging for them (Note
        [background checkpoint]): one node alone or rank 0 of a replicated group; with
        sharded state every node, and only if every node has (Note [sharded background
        checkpoint]: all of them take part in each gather, so all must stage or none)."""
        settled = lambda: self.inbox.put(CheckpointSettled())  # noqa: E731
        sharded = self.sharded_checkpoints
        if sharded is None:
            if self.staging_bytes and (self.group is None or self.group.leader):
                checkpointer.start_background(settled)
            return
        assert self.group is not None
        staged = self.group.exchange(
            "background-checkpoints",
            "1" if self.staging_bytes else "0",
            "whether every node can stage checkpoints",
        )
        if all(v == "1" for v in staged):
            checkpointer.start_background(
                settled, sources=sharded.sources, write=sharded.write_staged
            )
        elif self.staging_bytes:
            log.info(
                "[trainer] job %s: checkpoints stop the pipeline while they are written: "
                "node(s) %s cannot stage them, and every node of a sharded group takes part",
                self.job_id,
                ", ".join(str(r) for r, v in enumerate(staged) if v != "1"),
            )

    def final_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """fp32 masters for trainable weights, params-arena copies for frozen ones."""
        assert self.exporter is not None, "prepare() first"
        return self.exporter.final_weights()

    def write_hf_model(
        self, directory: Path, weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """Write the current model (or ``weights``) in Hugging Face layout into
        ``directory`` (roundpipe.coordinator.training.exporter)."""
        assert self.exporter is not None, "prepare() first"
        self.exporter.write_hf_model(directory, weights)

    def export(self, directory: Path | None = None) -> Path:
        """Write the final model in Hugging Face layout into ``directory`` (default: the
        output directory). Raises JobPaused if it cannot be written (the final
        checkpoint holds the same model)."""
        assert self.exporter is not None, "prepare() first"
        return self.exporter.export(directory)

    def close(self) -> None:
        """Stop the job's threads and give back what it holds: its output directory and
        its arenas. Every part is let go even if one before it fails (logged): one that
        raised left the arenas in /dev/shm and the job's log handler catching later
        jobs' lines."""
        self._cancel.set()
        parts: list[tuple[str, Callable[[], None]]] = [
            ("the background checkpoint", self._stop_background),
            ("the timeline", self.timeline.close),  # settle the last step, finish the trace
            ("the output directory", self.output.release),
            ("the arenas", self._destroy_layout),
        ]
        for what, close in parts:
            try:
                close()
            except Exception:
                log.exception("[trainer] job %s: letting go of %s failed", self.job_id, what)

    def _stop_background(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.stop_background()

    def _destroy_layout(self) -> None:
        if self.layout is not None:
            layout, self.layout = self.layout, None
            layout.destroy()
