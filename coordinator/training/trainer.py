"""One training job, start to finish, without sockets.

``Trainer`` owns a job's state: the model description, the arenas (via ``JobLayout``),
the fp32 masters and the layer-wise AdamW, the data loader. ``run`` drives iterations:
it writes each global batch into the io arena, builds the iteration's StageTasks
(roundpipe.coordinator.training.schedule) and hands them to workers round-robin through a
``WorkerPort``, with a task counter that persists across iterations. Workers report
completions into ``inbox``. A separate optimizer thread updates layers as their gradients
complete (Note [weight-update ordering]).

Everything that crosses between a trainer and the world is typed, in
roundpipe.coordinator.training.job_events: results and worker events come in through ``inbox``,
the trainer's ``JobEvent``s (plan chosen, checkpoint written) go out through one
``on_event`` callable, and tasks go out through the port. The coordinator daemon runs a
Trainer in a job thread with a port over ZeroMQ; tests use in-process ``WorkerCore``
threads.

Checkpoints (roundpipe.coordinator.training.checkpoint, docs/checkpoints.md). Every
``output.checkpoint_every`` steps and after the last step the trainer writes the model
in Hugging Face layout plus the training state as of the cut (Note [checkpoint cut]):
captured layer by layer as the optimizer updates them and written by a background
thread while training goes on (roundpipe.coordinator.training.snapshot, Note [background
checkpoint]), or, without staging memory, with the pipeline drained; ``prepare`` resumes from the job's newest good checkpoint, or from
``model.resume_from``. The model files come from ``write_hf_model``, which ``export``
uses too.

Note [checkpoint cut]
~~~~~~~~~~~~~~~~~~~~~
A checkpoint "after step s" holds the state at a cut where every task of iterations
<= s has completed, the optimizer has applied step s to every layer, and no task of
iteration s+1 has been sent. A drained checkpoint stops dispatching until that holds
(the workers idle for the length of the write); a background one assembles the same
state per layer while training runs on (Note [background checkpoint] in
roundpipe.coordinator.training.snapshot). At the cut the state is:

* the fp32 masters W_s (stored once, as the model files' tensors) and the AdamW
  moments and step counts after step s;
* params[s % 2] = compute-dtype W_s (a cast of the masters, recomputed on load);
* params[(s-1) % 2] = compute-dtype W_{s-1}. With staleness 1 iteration s+1 computes
  its gradient on W_{s-1} (Note [weight-update ordering]), so it is saved
  (``prev/<name>``); this is the "in-flight delayed gradient" of the uninterrupted run,
  stored as the weights it is computed from. At staleness 0 the job keeps one weight
  copy (Note [weight copies] in roundpipe.coordinator.training.layout), so ``prev`` holds W_s
  (manifest ``prev_version``); resumed under staleness 1, iterations s+1 and s+2 then
  both compute on W_s, as iterations 1 and 2 of a fresh run both compute on W_0;
* the data cursor (next step s+1; ``batch_for_step`` is a pure function of the step),
  the learning-rate schedule position (step s; the schedule is a pure function of the
  step), and the RNG state (workers seed dropout from (seed, iteration, layer,
  microbatch), so the only process RNG is the coordinator's torch CPU generator, saved
  and restored although the loop draws nothing from it).

Resuming rebuilds exactly this: masters, moments, both parities, ``version[l] = s`` in
the fresh event table, the cursor; iteration s+1 then runs as it would have. Nothing in
it depends on the plan or on the workers, so a checkpoint taken with 3 workers resumes
with 1 or 2 (the plan is chosen afresh).

Note [re-planning]
~~~~~~~~~~~~~~~~~~
Unless the job spec pins ``train.plan``, ``prepare`` plans from parameter sizes
(roundpipe.coordinator.planning.search.initial_plan) for the connected
workers' hardware, and sizes the activation slot pools with room for other plans (Note
[slot pools] in roundpipe.coordinator.training.layout). While the job runs, every ``TaskDone``'s
per-layer times feed a ``ProfileAggregator``. Once those have settled, at the start of an
iteration, the trainer asks ``replan_if_better`` for a plan that fits the pools and is
predicted at least 5% faster under the measured costs. If there is one, it stops
dispatching, waits for every task in flight (the weights, gradients and counters do not
depend on the plan, so the optimizer need not wait), re-assigns the pools and carries
on with the new plan. Training results do not depend on the plan; only speed does. A
job tries at most ``_MAX_REPLAN_ATTEMPTS`` times, each after the measurements settled
again, so a futile search costs little.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from roundpipe.coordinator.planning.hardware import HardwareSpec, cpu_hardware
from roundpipe.coordinator.planning.profile import ProfileAggregator
from roundpipe.coordinator.planning.search import initial_plan, replan_if_better
from roundpipe.coordinator.spec.data import DataError, DataLoader, build_dataset_from_spec
from roundpipe.coordinator.spec.jobspec import (
    JobSpec,
    model_config_from_spec,
    staging_limit_bytes,
    validate_against_model,
)
from roundpipe.coordinator.spec.paths import (
    PathPolicy,
    PathRefused,
    modes,
    pinned_dir,
    restrict_tree,
)
from roundpipe.coordinator.training.checkpoint import (
    STATE_FILE,
    CheckpointDir,
    CheckpointError,
    CheckpointInfo,
    as_os_error,
    resolve_checkpoint,
    save_tensors,
    step_name,
)
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
    progress_page,
)
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.memory import (
    InsufficientMemory,
    check_host_memory,
    checkpoint_staging_needed,
    committed_checkpoint_staging,
    grad_buffer_layers,
    host_memory_needed,
    release_freed_memory,
    weight_copies,
)
from roundpipe.coordinator.training.multinode import GradientReducer, GroupError, JobGroup
from roundpipe.coordinator.training.optimizer import (
    LayerwiseOptimizer,
    clip_coefficient,
    global_grad_norm,
)
from roundpipe.coordinator.training.recovery import RecoveryPolicy, TaskGaveUp, TaskTracker
from roundpipe.coordinator.training.schedule import ScheduleBuilder
from roundpipe.coordinator.training.snapshot import BackgroundCheckpoints, LayerState
from roundpipe.coordinator.training.timeline import TimelineRecorder
from roundpipe.protocol import JobSetup, ProgressEvent, StageTask, TaskDone, TaskFailed
from roundpipe.shared.model import LayeredModel, model_config_dict
from roundpipe.shared.plan import Plan

__all__ = ["JobCancelled", "JobFailed", "JobPaused", "Trainer", "default_plan"]

log = logging.getLogger(__name__)

_MAX_REPLAN_ATTEMPTS = 3
_REPLAN_MIN_GAIN = 0.05
_POOL_HEADROOM = 1.5
"""Slot pools hold this many times the initial plan's boundaries (at least 2 more, at
most every layer), so a re-plan may add stages (Note [re-planning])."""


class JobFailed(RuntimeError):
    """The job cannot continue; the message says why and what to do."""


class JobCancelled(RuntimeError):
    """The job was cancelled by a client."""


class JobPaused(RuntimeError):
    """The job stopped without losing anything (its output could not be written) and
    waits for ``roundpipe resume``; the message says why and what to do."""


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


def _as_master(w: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a freshly loaded weight: the tensor itself when it is an fp32
    tensor that owns exactly its storage (the loaders' output, dropped after loading),
    else a copy. Taking it over instead of copying keeps the loading peak at one fp32
    model, not two (docs/memory.md)."""
    owns = (
        w.dtype == torch.float32
        and w.is_contiguous()
        and w.storage_offset() == 0
        and w.untyped_storage().nbytes() == w.numel() * w.element_size()
        and not w.requires_grad
    )
    return w if owns else w.to(torch.float32).clone()


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
        self.reducer: GradientReducer | None = None
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
        self.progress: list[ProgressEvent] = []
        """Appended under ``_progress_lock``; read with ``progress_page`` / ``recent_progress``."""
        self._progress_lock = threading.Lock()
        self.step = 0
        self.last_loss: float | None = None
        self.checkpoints = CheckpointDir(self.output_dir / "checkpoints")
        self._pins = threading.local()
        """Per thread (the run loop's and the background checkpoint writer's each hold
        their own): ``root``, the output directory's pin while ``_pinned_output`` holds
        one; see ``_output_root``."""
        self._held_output_fd: int | None = None
        self.held_output = self.output_dir
        """The output directory checked in ``prepare`` and held open until ``close`` (its
        pin): where the run's trace and TensorBoard scalars go, written all along."""
        self.start_step = 0
        """Step the run starts after: 0, or the step of the checkpoint it resumed from."""
        self.checkpoint_step: int | None = None
        """Step of the newest checkpoint written or resumed from (None: none yet)."""
        self.resumed_from: CheckpointInfo | None = None
        self._base_model_written = False
        self.staging_bytes = 0
        """Host memory set aside for background checkpoints (0: checkpoints drain the
        pipeline); decided in ``prepare`` (Note [background checkpoint])."""
        self._background: BackgroundCheckpoints | None = None
        self._cancel = threading.Event()
        self._optimizer_error: BaseException | None = None
        self._optimizer_done_step = 0
        self._optimizer_cv = threading.Condition()
        self._optimizer_last_s = 0.0
        """Busy seconds (updating, not waiting for gradients) of optimizer step
        ``_optimizer_done_step``."""
        self.layout: JobLayout | None = None
        self.on_event = on_event
        """Gets the job's ``JobEvent``s: the plan chosen, checkpoints written."""
        self.hardware: HardwareSpec | None = None
        self.profile: ProfileAggregator | None = None
        """Measured layer times, when the planner may re-plan (Note [re-planning])."""
        self.plan_history: list[tuple[int, str, str]] = []
        """(first iteration, plan, why) for every plan the job has used."""
        self._replan_attempts = 0
        self.prepared = False
        """True once ``prepare`` has finished (``step`` is then the step it resumes from)."""
        # observability: replaced by a recording one when run() starts
        self.timeline = TimelineRecorder(job_id)

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
            try:
                fd = self.paths.open_output(self.output_dir)
                if self._held_output_fd is not None:  # prepared again: hold the new check
                    os.close(self._held_output_fd)
                self._held_output_fd = fd
            except PathRefused as exc:
                raise JobFailed(str(exc)) from None
            self.held_output = pinned_dir(self._held_output_fd) or self.output_dir
        try:
            CheckpointDir(self.held_output / self.checkpoints.root.name).ensure_writable()
        except OSError as exc:
            message = self._io_error_message("the output directory is not writable", exc)
            raise JobPaused(message) from exc
        spec = self.spec
        config = model_config_from_spec(spec.model)
        lora = spec.lora.model_settings() if spec.lora is not None else None
        if spec.model.path is not None:
            model = LayeredModel.from_hf_dir(
                spec.model.path, lora, dequantize_mxfp4=spec.model.dequantize
            )
            weights = model.load_weights(dtype=torch.float32, seed=spec.init_seed)
        else:
            model = LayeredModel(config, lora)
            weights = model.init_weights(spec.init_seed)
        self.node_microbatches = spec.batch.num_microbatches
        """Microbatches this node trains per step: the global batch's, or its share."""
        if self.group is not None:
            try:
                self.node_microbatches = len(self.group.microbatches(spec.batch.num_microbatches))
            except ValueError as exc:
                raise JobFailed(str(exc)) from None
        self.dataset = build_dataset_from_spec(spec)
        validate_against_model(spec, model.config, vocab_size_needed=self.dataset.vocab_size_needed)
        self.loader = DataLoader.from_spec(spec, self.dataset)
        self.model = model
        self.compute_dtype = getattr(torch, spec.train.dtype)
        self.hardware = hardware or cpu_hardware(max(1, num_workers))
        plan, why = self._initial_plan(model)
        try:
            layout = self._checked_layout(model, plan)
        except InsufficientMemory as exc:
            if not plan.is_split or spec.train.plan:
                raise JobFailed(str(exc)) from None
            # The planner's split plan needs a second gradient buffer (and sums) that
            # this host cannot hold: the best unsplit plan may fit.
            log.info(
                "[trainer] job %s: no room for split stages (%s); planning unsplit",
                self.job_id,
                exc,
            )
            plan, why = self._initial_plan(model, fits=lambda p: not p.is_split)
            try:
                layout = self._checked_layout(model, plan)
            except InsufficientMemory as exc2:
                raise JobFailed(str(exc2)) from None
        layout.create(self.arena_dir, self.namespace)
        self.layout = layout
        # fp32 masters (coordinator memory) and W_0 in params parity 0.
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        for layer, names in layout.params.items():
            trainable = {s.name for s in model.layer_params(layer) if s.trainable}
            for name, (even, _odd) in names.items():
                w = weights[layer][name]
                layout.view(even).copy_(w)
                if name in trainable:
                    self.masters.setdefault(layer, {})[name] = _as_master(w)
        del weights
        release_freed_memory()  # the fp32 weights loaded above, freed: off the RSS
        self.optimizer = LayerwiseOptimizer.from_spec(spec, self.masters, impl=self.optimizer_impl)
        self.schedule = ScheduleBuilder(
            layout=layout,
            job_id=self.job_id,
            staleness=spec.train.staleness,
            seed=spec.train.seed,
            wait_timeout_s=self.wait_timeout_s,
        )
        # Tied aliases: owner layer -> [(tail layer, alias name, owner name)].
        self._tied: dict[int, list[tuple[int, str, str]]] = {}
        for alias, owner in model.tied_params.items():
            if alias in layout.grads[model.layer_of(alias)]:
                self._tied.setdefault(model.layer_of(owner), []).append(
                    (model.layer_of(alias), alias, owner)
                )
        self._tied_scratch = {
            owner: torch.empty_like(self.masters[layer][owner])
            for layer, items in self._tied.items()
            for _, _, owner in items
        }
        # Note [microbatch-split stages] (roundpipe.shared.plan): the two parts of a
        # split layer's gradient are added out of place, so summing twice (clipping
        # reads the gradients before the update does) gives the same bits.
        self._split_scratch = {
            layer: {name: torch.empty_like(self.masters[layer][name]) for name in names}
            for layer, names in layout.grads_part.items()
            if layer in self.masters
        }
        self._split_layers_of_step: dict[int, frozenset[int]] = {}
        """Step -> the layers whose gradient comes in two parts that step (the plan of
        the step's tasks; the optimizer may still step k after a re-plan for k+1)."""
        log.info(
            "[trainer] job %s: %s, %d layers, plan %s, %d trainable tensors",
            self.job_id,
            model.architecture,
            model.num_layers,
            self.plan,
            sum(len(v) for v in self.masters.values()),
        )
        # With a group, rank 0 alone reads checkpoints and hands the state to the others.
        source = self._resume_source() if self.group is None or self.group.leader else None
        if source is not None:
            self._restore(source)
        if self.group is not None:
            self._sync_with_group()
        self._plan_chosen(self.start_step + 1, why)
        self.prepared = True

    def _choose_staging(self, layout: JobLayout) -> int:
        """Bytes of staging for background checkpoints (``output.checkpoint_staging``):
        one checkpoint's per-layer state, if the setting allows that much ("auto": if
        the machine has it available besides the job); else 0, and checkpoints drain."""
        spec = self.spec
        need = checkpoint_staging_needed(layout, spec)
        if need == 0:
            return 0
        limit = staging_limit_bytes(spec.output.checkpoint_staging)
        if limit is not None:
            if committed_checkpoint_staging(layout, spec):
                return need
            why = f"output.checkpoint_staging is {limit} bytes"
        else:
            try:
                check_host_memory(
                    host_memory_needed(layout, spec, checkpoint_staging=need), self.arena_dir
                )
                return need
            except InsufficientMemory:
                why = "the machine does not have that much memory to spare"
        log.info(
            "[trainer] job %s: checkpoints stop the pipeline while they are written: "
            "writing them in the background needs %d bytes of staging and %s",
            self.job_id,
            need,
            why,
        )
        return 0

    def _checked_layout(self, model: LayeredModel, plan: Plan) -> JobLayout:
        """The job's layout for ``plan``, sized, not created; raises InsufficientMemory
        when the host cannot hold it. Sets ``staging_bytes``."""
        spec = self.spec
        capacity: dict[str, int] = {}
        if self.profile is not None:  # leave room in the slot pools for a re-plan
            for key, boundaries in (
                ("act_capacity", JobLayout.activation_boundaries(plan)),
                ("dact_capacity", JobLayout.gradient_boundaries(plan)),
            ):
                n = len(boundaries)
                capacity[key] = min(model.num_layers - 1, max(n + 2, int(n * _POOL_HEADROOM)))
        layout = JobLayout.plan_layout(
            model,
            plan,
            compute_dtype=self.compute_dtype,
            microbatch_rows=spec.batch.microbatch_size,
            seq_len=spec.data.seq_len,
            num_microbatches=self.node_microbatches,
            grad_buffer_layers=grad_buffer_layers(spec, plan),
            weight_copies=weight_copies(spec),
            **capacity,
        )
        # Admission control: refuse before any arena, master or moment exists, with the
        # figures (issue 15: seq_len 65536 on a tiny model took 2.7 GB unasked).
        self.staging_bytes = self._choose_staging(layout)
        check_host_memory(
            host_memory_needed(layout, spec, checkpoint_staging=self.staging_bytes),
            self.arena_dir,
        )
        return layout

    def _initial_plan(
        self, model: LayeredModel, fits: Callable[[Plan], bool] | None = None
    ) -> tuple[Plan, str]:
        """The job's first plan and why: the spec's, or the planner's cold start (among
        the plans ``fits`` accepts)."""
        spec, hw = self.spec, self.hardware
        assert hw is not None
        if spec.train.plan:
            plan = Plan.parse(spec.train.plan)
            try:
                plan.validate(model.num_layers)
                plan.validate_microbatches(self.node_microbatches)
            except ValueError as exc:
                raise JobFailed(f"train.plan does not fit this job: {exc}") from None
            return plan, "set by train.plan in the job spec"
        try:
            result = initial_plan(
                model,
                hw,
                microbatch_rows=spec.batch.microbatch_size,
                seq_len=spec.data.seq_len,
                num_microbatches=self.node_microbatches,
                compute_dtype=self.compute_dtype,
                staleness=spec.train.staleness,
                fits=fits,
            )
        except ValueError as exc:
            raise JobFailed(f"cannot plan this job: {exc}") from None
        if spec.train.replan:
            # CPU timings jitter by 5-10% from step to step; 10% still catches a plan
            # that is off by more than the 5% a switch must gain.
            self.profile = ProfileAggregator(
                result.costs, self.node_microbatches, settle_tolerance=0.1
            )
        return result.plan, (
            f"planned from parameter sizes for {hw.num_workers} worker(s), predicted "
            f"{result.predicted_iteration_s:.3g}s per step"
        )

    def _plan_chosen(self, iteration: int, why: str) -> None:
        self.plan_history.append((iteration, str(self.plan), why))
        self.timeline.set_plan(self.plan)  # observability: stage labels
        log.info(
            "[trainer] job %s: plan %s from step %d (%s)", self.job_id, self.plan, iteration, why
        )
        self._emit(PlanChosen(self.plan, why))

    def _replan_candidate(self) -> tuple[Plan, str] | None:
        """A better plan under the measured layer times, if they have settled and one
        fits the slot pools (Note [re-planning])."""
        profile, layout, hw = self.profile, self.layout, self.hardware
        if profile is None or layout is None or hw is None or not profile.settled:
            return None
        if self._replan_attempts >= _MAX_REPLAN_ATTEMPTS:
            return None
        self._replan_attempts += 1
        profile.restart_settling()  # the next attempt waits for fresh, settled numbers
        started = time.perf_counter()
        spec = self.spec
        result = replan_if_better(
            self.plan,
            profile.costs(),
            hw,
            self.node_microbatches,
            min_gain=_REPLAN_MIN_GAIN,
            staleness=spec.train.staleness,
            tokens_per_iteration=self.node_microbatches
            * spec.batch.microbatch_size
            * spec.data.seq_len,
            fits=layout.fits,
        )
        log.info(
            "[trainer] job %s: re-planning attempt %d took %.2fs: %s",
            self.job_id,
            self._replan_attempts,
            time.perf_counter() - started,
            "no plan predicted >= 5% faster" if result is None else f"found {result.plan}",
        )
        if result is None:
            return None
        before = result.replaces_iteration_s
        assert before is not None
        gain = 1 - result.predicted_iteration_s / before
        return result.plan, (
            f"re-planned from measured layer times: predicted {result.predicted_iteration_s:.3g}s "
            f"per step instead of {before:.3g}s ({gain:.0%} faster)"
        )

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
            lora=None
            if self.model.lora is None
            else {
                "r": self.model.lora.r,
                "alpha": self.model.lora.alpha,
                "dropout": self.model.lora.dropout,
                "target_modules": list(self.model.lora.target_modules)
                if not isinstance(self.model.lora.target_modules, str)
                else self.model.lora.target_modules,
            },
            compute_dtype=self.spec.train.dtype,
            arenas=self.layout.arena_infos(),
            layers=self.layout.layer_layouts(),
            num_microbatches=self.layout.num_microbatches,
        )

    # -- resuming (Note [checkpoint cut]) ---------------------------------------------

    def _resume_source(self) -> CheckpointInfo | None:
        """This job's newest good checkpoint, else ``model.resume_from``, else None."""
        own = self.checkpoints.find_latest(job_id=self.job_id)
        if own is not None:
            return own
        if self.spec.model.resume_from is not None:
            try:
                return resolve_checkpoint(self.spec.model.resume_from)
            except CheckpointError as exc:
                raise JobFailed(f"model.resume_from: {exc}") from None
        return None

    def _restore(self, info: CheckpointInfo) -> None:
        assert self.layout is not None and self.layout.events is not None
        layout, s, manifest = self.layout, info.step, info.manifest
        steps = self.spec.train.steps
        if s > steps:
            raise JobFailed(
                f"checkpoint {info.path} is at step {s}, past this job's train.steps "
                f"({steps}); set train.steps above {s} to train further"
            )
        where = f"checkpoint {info.path}"
        from safetensors import safe_open

        try:
            state = safe_open(str(info.path / STATE_FILE), framework="pt")
        except Exception as exc:
            raise JobFailed(f"cannot read {info.path / STATE_FILE}: {exc}") from None
        with state:
            keys = set(state.keys())
            # Masters are in the model files (checkpoint_name keys); checkpoints written
            # before that hold them as master/<name> too.
            masters_in_state = any(k.startswith("master/") for k in keys)
            kinds = ("master",) * masters_in_state + ("prev", *self.optimizer.kinds)
            expected = {
                f"{kind}/{name}"
                for names in self.masters.values()
                for name in names
                for kind in kinds
            }
            saved = {k for k in keys if not k.startswith("rng/")}
            if saved != expected:
                missing = sorted(expected - saved)[:3]
                extra = sorted(saved - expected)[:3]
                raise JobFailed(
                    f"{where} does not fit this job's model (missing {missing}, unexpected "
                    f"{extra}); it was written for model {manifest.get('spec', {}).get('model')}"
                    f" with lora {manifest.get('spec', {}).get('lora')}"
                )

            def load(key: str, like: torch.Tensor) -> torch.Tensor:
                t = state.get_tensor(key)
                if t.shape != like.shape:
                    raise JobFailed(
                        f"{where}: {key} has shape {tuple(t.shape)}, this job's model "
                        f"{tuple(like.shape)}"
                    )
                return t

            if masters_in_state:
                exported: dict[str, torch.Tensor] = {}
            else:
                names = [name for per in self.masters.values() for name in per]
                try:
                    exported = self.model.read_exported(info.path, names)
                except (OSError, ValueError) as exc:
                    raise JobFailed(f"cannot read the model files of {where}: {exc}") from None
                lacking = [n for n in names if n not in exported]
                if lacking:
                    raise JobFailed(
                        f"{where}: its model files lack {len(lacking)} trained weight(s) of "
                        f"this job's model, e.g. {lacking[:3]}"
                    )
            optimizer_state = self.optimizer.state_dict()  # live buffers
            for key, buf in optimizer_state["tensors"].items():
                layer_and_name, kind = key.rsplit(".", 1)
                name = layer_and_name.split(".", 1)[1]
                buf.copy_(load(f"{kind}/{name}", buf))
            optimizer_state["steps"] = {layer: s for layer in optimizer_state["steps"]}
            self.optimizer.load_state_dict(optimizer_state)  # step counts (buffers in place)
            c = layout.counters
            for layer, names in self.masters.items():
                for name, master in names.items():
                    saved = exported.get(name)
                    if saved is None:
                        saved = load(f"master/{name}", master)
                    elif saved.shape != master.shape or saved.dtype != torch.float32:
                        raise JobFailed(
                            f"{where}: {name} in the model files is {saved.dtype} "
                            f"{tuple(saved.shape)}, this job's model float32 {tuple(master.shape)}"
                        )
                    master.copy_(saved)
                    refs = layout.params[layer][name]
                    current, previous = refs[s % 2], refs[(s - 1) % 2]
                    assert current is not None and previous is not None
                    if s >= 1:
                        layout.view(previous).copy_(load(f"prev/{name}", master))
                    # Last: with one weight copy (Note [weight copies]) both refs name
                    # the same buffer, and W_s is the version iteration s+1 reads.
                    layout.view(current).copy_(master)
                layout.events.signal(c.version(layer), s)
            if "rng/torch_cpu" in keys:
                torch.set_rng_state(state.get_tensor("rng/torch_cpu"))
        try:
            self.loader.load_state_dict(manifest["data_cursor"])
        except (DataError, KeyError) as exc:
            raise JobFailed(f"cannot resume from {where}: {exc}") from None
        self.progress = _progress_from_rows(p for p in manifest.get("progress", []) if p[0] <= s)
        self.step = s
        self.last_loss = self.progress[-1].loss if self.progress else None
        self.start_step = s
        self._optimizer_done_step = s
        self.checkpoint_step = s
        self.resumed_from = info
        log.info(
            "[trainer] job %s resumes from %s (step %d of %d%s)",
            self.job_id,
            info.path,
            s,
            steps,
            "" if info.job_id == self.job_id else f", written by job {info.job_id}",
        )

    # -- running ----------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()
        self.inbox.put(Wakeup("cancel"))

    def _emit(self, event: JobEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def progress_page(self, after_seq: int, limit: int) -> tuple[list[ProgressEvent], bool]:
        """Up to ``limit`` progress events after ``after_seq``, in seq order, and whether
        more follow (any thread)."""
        with self._progress_lock:
            return progress_page(self.progress, after_seq, limit)

    def recent_progress(self, n: int) -> list[ProgressEvent]:
        """The newest ``n`` progress events (any thread)."""
        with self._progress_lock:
            return self.progress[-n:]

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step``: every ``checkpoint_every``
        steps, and after the last one."""
        every = self.spec.output.checkpoint_every
        return step == self.spec.train.steps or (every > 0 and step % every == 0)

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
        assert self.layout is not None
        layout, spec = self.layout, self.spec
        steps = spec.train.steps
        # observability: timeline, measured bubble, TensorBoard (coordinator.timeline)
        self.timeline = TimelineRecorder.for_job(self, len(self.masters))
        optimizer_thread = threading.Thread(
            target=self._optimizer_loop, name=f"rp-optimizer-{self.job_id}", daemon=True
        )
        optimizer_thread.start()
        if self.group is not None:
            self._start_reducer()
        if self.staging_bytes and (self.group is None or self.group.leader):
            self._background = BackgroundCheckpoints(
                self._state_tensors,
                self._write_checkpoint,
                lambda: self.inbox.put(CheckpointSettled()),
                name=f"rp-checkpoints-{self.job_id}",
            )
        tracker = TaskTracker(port.send_task, port.live_workers, self.recovery_policy)
        self.tracker = tracker
        self._port = port
        unfinished: dict[int, StageTask] = {}  # dispatched, in flight or parked, not done
        pending_per_iteration: dict[int, int] = {}
        tail_task: dict[int, int] = {}
        next_task_id = 0
        next_task_iteration = self.start_step + 1  # the first iteration not dispatched
        tokens_per_step = spec.global_batch_size * spec.data.seq_len
        started = time.perf_counter()
        last_time = started
        completed_iterations = self.start_step

        def report_through(k: int) -> None:
            """Report every iteration up to ``k`` whose tail has finished."""
            nonlocal completed_iterations, last_time
            while (
                completed_iterations < k
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
            if self._background is not None:
                # A background checkpoint's writer waits for its step's report: report
                # whatever has finished at once (the drained path's reports stay as
                # they were).
                report_through(next_task_iteration - 1)

        try:
            for k in range(self.start_step + 1, steps + 1):
                if self._cancel.is_set():
                    raise JobCancelled(f"job {self.job_id} was cancelled")
                # Note [weight-update ordering], point 5: iteration k reuses k-2's slots.
                while pending_per_iteration.get(k - 2, 0) > 0:
                    handle_next()
                better = self._replan_candidate()
                if better is not None:  # Note [re-planning]: drain, then switch
                    while any(pending_per_iteration.values()):
                        handle_next()
                        report_through(k - 1)
                    self.switch_plan(better[0], k, better[1])
                batch = self.loader.next_batch()
                assert batch.step == k, (batch.step, k)
                parity = k % 2
                if self.checkpoint_due(k) and self._background is not None:
                    # Note [background checkpoint]: begun before any task of iteration
                    # k exists, so before the optimizer's step k; the cursor is now k+1.
                    waited = time.perf_counter()
                    while not self._background.can_begin:  # bounded memory
                        handle_next()
                    self._note_checkpoint_wait(k, time.perf_counter() - waited)
                    self._background.begin(k, self._checkpoint_context())
                # With a group: this node's share; the loss is still normalised over
                # the global batch (batch.num_label_tokens below).
                layout.write_batch(parity, self._node_share(batch))
                assert layout.events is not None
                for m in range(layout.num_microbatches):
                    layout.events.signal(layout.counters.act(0, m), k)
                tasks = self.schedule.tasks(k, batch.num_label_tokens, next_task_id)
                self._split_layers_of_step[k] = self.plan.split_gradient_layers() & set(
                    layout.grads_part
                )
                self._split_layers_of_step.pop(k - 4, None)
                next_task_id += len(tasks)
                pending_per_iteration[k] = len(tasks)
                next_task_iteration = k + 1
                for task in tasks:
                    if task.kind == "tail":
                        tail_task[k] = task.task_id
                    unfinished[task.task_id] = task
                    tracker.dispatch(task)  # parked if no worker is connected
                report_through(k - 1)
                writes_checkpoints = self.group is None or self.group.leader  # rank 0 only
                if self.checkpoint_due(k) and self._background is None and writes_checkpoints:
                    # Note [checkpoint cut]: nothing of iteration k+1 is sent until the
                    # pipeline has drained and the optimizer has applied step k.
                    while any(pending_per_iteration.values()) or not self._loss_known(k):
                        handle_next()
                        report_through(k)
                    self._wait_optimizer(k)
                    report_through(k)
                    path = self.save_checkpoint(k)
                    self._emit(CheckpointWritten(k, path, self.last_loss))
            while any(pending_per_iteration.values()) or not self._loss_known(steps):
                handle_next()
                report_through(steps)
            self._wait_optimizer(steps)
            while self._background is not None and self._background.busy:
                handle_next()  # the final checkpoint
            self._settle_background()  # one that settled after the last message
        finally:
            self._cancel.set()
            with self._optimizer_cv:
                self._optimizer_cv.notify_all()
            if self._background is not None:
                # Abandons an unfinished checkpoint and wakes a capture waiting for it.
                self._background.close()
            optimizer_thread.join(timeout=30)
            self._stop_reducer()
            self._background = None  # a later save_checkpoint drains, as without staging
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
        tracker = getattr(self, "tracker", None)
        return tracker is not None and tracker.waiting_for_workers

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
        if self.reducer is not None:
            loss = self.reducer.global_loss(k)
            assert loss is not None
            self.reducer.forget_loss(k)
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
            optimizer_s=self._latest_optimizer_s(),
        )
        with self._progress_lock:
            self.progress.append(event)
        if self._background is not None:
            self._background.reported(k)
        self.timeline.step_reported(event)  # observability
        if on_progress is not None:
            on_progress(event)
        log.info("[trainer] job %s step %d loss %.4f", self.job_id, k, loss)
        return now

    def _latest_optimizer_s(self) -> float:
        """Busy seconds of the newest finished optimizer step (0.0 before any)."""
        with self._optimizer_cv:
            return self._optimizer_last_s

    def _next_message(self) -> TaskDone | TaskFailed | InboxEvent:
        while True:
            self._check_group()  # first: an optimizer stopped by the group is no bug
            if self._optimizer_error is not None:
                raise JobFailed(f"optimizer failed: {self._optimizer_error}") from (
                    self._optimizer_error
                )
            if self._cancel.is_set():
                raise JobCancelled(f"job {self.job_id} was cancelled")
            try:
                return self.inbox.get(timeout=0.5)
            except queue.Empty:
                self._check_progress()

    def _check_progress(self) -> None:
        """Fence and replace workers that hold tasks but stopped completing them."""
        tracker = getattr(self, "tracker", None)
        if tracker is None:
            return
        for worker_id in tracker.hung_workers():
            reason = "no task completed within the progress deadline"
            if self._port is not None:
                self._port.fence(worker_id, reason)
            tracker.worker_lost(worker_id, reason)

    def _handle(self, msg, unfinished: dict[int, StageTask], pending: dict[int, int]) -> None:
        tracker = self.tracker
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
            self._settle_background()  # announce it, or raise why it was not written
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
        if task.kind == "tail" and self.reducer is not None:
            self.reducer.set_local_loss(task.iteration, self._local_loss(task.iteration))
        if pending[task.iteration] == 0:
            self.timeline.iteration_done(
                task.iteration, len(tracker.live_workers())
            )  # observability
        if self.profile is not None:
            self.profile.record_done(task, msg)
            if pending[task.iteration] == 0:
                self.profile.end_iteration(task.iteration)

    # -- optimizer --------------------------------------------------------------------

    def _optimizer_loop(self) -> None:
        """Apply steps start+1..K layer by layer as gradients complete (Note [weight-update
        ordering])."""
        try:
            for k in range(self.start_step + 1, self.spec.train.steps + 1):
                busy_s = self._optimizer_step(k)
                with self._optimizer_cv:
                    self._optimizer_done_step = k
                    self._optimizer_last_s = busy_s
                    self._optimizer_cv.notify_all()
        except InterruptedError:
            pass  # cancelled while waiting for gradients
        except BaseException as exc:  # surfaced by the run loop as JobFailed
            log.exception("[trainer] optimizer thread failed")
            self._optimizer_error = exc
            self.inbox.put(Wakeup("optimizer error"))

    def _optimizer_step(self, k: int) -> float:
        """Step k for every layer: each time the highest layer not yet updated has its
        gradients, update it together with every other layer whose gradients have
        landed, in one multi-threaded pass (Note [chunked fused AdamW]), lowest layer
        first, publishing each layer's version as soon as it is written. With staleness 0
        the next forward needs layer 0 first, and its gradients land last. Returns the
        seconds spent updating (not waiting)."""
        assert self.layout is not None
        layout = self.layout
        remaining = sorted(self.masters, reverse=True)  # the last layers finish first
        clip = self.spec.optimizer.grad_clip
        coef = None
        if clip is not None:
            # The global norm needs every gradient of the step before any update.
            for layer in remaining:
                self._wait_grads(layer, k)
            coef = clip_coefficient(
                global_grad_norm({layer: self._grads(layer, k) for layer in remaining}), clip
            )
        busy_s = 0.0
        while remaining:
            self._wait_grads(remaining[0], k)
            ready = [layer for layer in remaining if self._grads_landed(layer, k)]
            grads = {layer: self._grads(layer, k) for layer in ready}
            for layer in ready:  # observability: grad norm (TensorBoard)
                self.timeline.layer_grads(k, grads[layer])
            started = time.perf_counter()
            self.optimizer.step_layers(
                grads,
                k,
                clip_coef=coef,
                outs={
                    layer: {
                        name: layout.view(layout.params[layer][name][k % 2])
                        for name in self.masters[layer]
                    }
                    for layer in ready
                },
                on_layer_done=self._publisher(k),
            )
            busy_s += time.perf_counter() - started
            remaining = [layer for layer in remaining if layer not in ready]
        return busy_s

    def _publisher(self, k: int) -> Callable[[int], None]:
        """Called as each layer's step-k update is written: publish its version at once
        (the next forward may start on it), capture it for a background checkpoint of
        step k, and time it for the timeline's optimizer lane."""
        assert self.layout is not None and self.layout.events is not None
        events, c = self.layout.events, self.layout.counters
        since = time.time()

        background = self._background

        def publish(layer: int) -> None:
            nonlocal since
            events.signal(c.version(layer), k)
            if background is not None:  # Note [background checkpoint]
                background.capture(k, layer)
            now = time.time()
            self.timeline.optimizer_layer(k, layer, since, now)  # observability
            since = now

        return publish

    def _grads_landed(self, layer: int, k: int) -> bool:
        """Whether step k's gradients of ``layer`` (tied contributions included) are in
        (with a group: summed over the nodes, Note [reduced before stepped])."""
        assert self.layout is not None and self.layout.events is not None
        c, events = self.layout.counters, self.layout.events
        sources = {layer} | {t for t, _, _ in self._tied.get(layer, [])}
        if self.reducer is not None:
            return all(self.reducer.reduced(src, k) for src in sources)
        return all(
            events.read(c.wgrad(src)) >= k
            and (not self._split_at(src, k) or events.read(c.wgrad_part(src)) >= k)
            for src in sources
        )

    def _split_at(self, layer: int, k: int) -> bool:
        """Whether step k's gradient of ``layer`` comes in two parts (Note
        [microbatch-split stages] in roundpipe.shared.plan). Asked only once ``wgrad[l]
        >= k``, so after step k's tasks were built."""
        return layer in self._split_layers_of_step.get(k, ())

    def _wait_grads(self, layer: int, k: int) -> None:
        """Wait for step k's gradients of ``layer``, including tied contributions."""
        sources = {layer} | {t for t, _, _ in self._tied.get(layer, [])}
        if self.reducer is not None:
            for src in sources:
                self.reducer.wait_reduced(src, k)
            return
        for src in sources:
            self._wait_local_grads(src, k)

    def _wait_local_grads(self, layer: int, k: int) -> None:
        """Wait until this node's step-k gradient of ``layer`` is in the grads arena
        (both parts of it when a split stage wrote it)."""
        assert self.layout is not None and self.layout.events is not None
        events, counters = self.layout.events, self.layout.counters

        def wait(counter: int) -> None:
            events.wait_at_least(
                counter, k, timeout_s=self.wait_timeout_s * 4, should_abort=self._cancel.is_set
            )

        wait(counters.wgrad(layer))
        if self._split_at(layer, k):  # known once wgrad[l] >= k
            wait(counters.wgrad_part(layer))

    def _split_sum(self, layer: int) -> dict[str, torch.Tensor]:
        """A split layer's gradient, first part + second (Note [microbatch-split stages]
        in roundpipe.shared.plan), added out of place into its scratch: summing again
        gives the same bits."""
        assert self.layout is not None
        layout = self.layout
        first, second = layout.grads[layer], layout.grads_part[layer]
        scratch = self._split_scratch[layer]
        for name, out in scratch.items():
            torch.add(layout.view(first[name]), layout.view(second[name]), out=out)
        return scratch

    def _node_grads(self, layer: int, k: int) -> list[torch.Tensor]:
        """What the group reducer all-reduces in place for step k: this node's gradient
        of ``layer``, its two parts added first when split, so that every node reduces
        one tensor per weight whatever its plan (nodes plan for their own workers)."""
        assert self.layout is not None
        if self._split_at(layer, k):
            return list(self._split_sum(layer).values())
        return [self.layout.view(ref) for ref in self.layout.grads[layer].values()]

    def _grads(self, layer: int, k: int) -> dict[str, torch.Tensor]:
        """Layer's step-k gradients as fp32 views; a split stage's two parts (Note
        [microbatch-split stages] in roundpipe.shared.plan; with a group the reducer
        added them before reducing) and tied contributions summed into scratch."""
        assert self.layout is not None
        layout = self.layout
        grads = {name: layout.view(layout.grads[layer][name]) for name in self.masters[layer]}
        if self._split_at(layer, k):
            summed = self._split_scratch[layer] if self.reducer else self._split_sum(layer)
            grads.update(summed)
        for tail_layer, alias, owner in self._tied.get(layer, []):
            total = self._tied_scratch[owner]
            torch.add(grads[owner], layout.view(layout.grads[tail_layer][alias]), out=total)
            grads[owner] = total
        return grads

    def _wait_optimizer(self, step: int) -> None:
        with self._optimizer_cv:
            while self._optimizer_done_step < step:
                self._check_group()  # the optimizer waits for the group's gradients
                if self._optimizer_error is not None:
                    raise JobFailed(f"optimizer failed: {self._optimizer_error}")
                if self._cancel.is_set():
                    raise JobCancelled(f"job {self.job_id} was cancelled")
                self._optimizer_cv.wait(timeout=0.5)

    # -- data parallelism across nodes (coordinator.multinode) --------------------------

    def _node_share(self, batch):
        """The microbatches of ``batch`` this node trains (all of them without a group)."""
        if self.group is None:
            return batch
        return batch.shard(self.group.microbatches(self.spec.batch.num_microbatches))

    def _loss_known(self, k: int) -> bool:
        """Whether iteration k's loss can be reported (with a group: once summed)."""
        if self.reducer is None or self.step >= k:  # reported: its loss was known
            return True
        return self.reducer.global_loss(k) is not None

    def _group_paused(self, exc: BaseException) -> JobPaused:
        kept = (
            f"checkpoint step {self.checkpoint_step} is kept"
            if self.checkpoint_step
            else "no checkpoint has been written yet"
        )
        return JobPaused(
            f"the data-parallel group stopped: {exc}. The job is paused; {kept}. Run "
            f"`roundpipe resume {self.job_id}` to continue from it on the nodes that remain "
            "(docs/multi-node.md)"
        )

    @property
    def waiting_on_group(self) -> str | None:
        """Which nodes this one has long been waiting for at a collective, and why where
        they said (coordinator.multinode), else None."""
        return self.group.waiting if self.group is not None else None

    def _check_group(self) -> None:
        """``check_group``, and tell the others when this node's tasks are parked for
        want of a worker (they wait for it)."""
        if self.group is None:
            return
        self.group.set_note(
            "no worker connected to its coordinator (tasks parked)"
            if self.waiting_for_workers
            else None
        )
        self.check_group()

    def check_group(self) -> None:
        """Raise JobPaused if another node left the job, went silent or failed a
        collective (Note [arrive before a collective]); JobCancelled if rank 0 cancelled
        it. Also called by the daemon while the job waits for a first worker."""
        if self.group is None:
            return
        reducer = self.reducer
        problem = self.group.problem()
        if self.group.left_as == "cancelled":  # rank 0's job was cancelled: so is ours
            raise JobCancelled(problem or f"job {self.job_id} was cancelled at rank 0")
        if reducer is not None and reducer.error is not None:
            raise self._group_paused(reducer.error)
        if problem is not None:
            raise self._group_paused(GroupError(problem))

    def _start_reducer(self) -> None:
        assert self.group is not None and self.layout is not None
        layout = self.layout
        self.group.cancelled = self._cancel.is_set
        self.reducer = GradientReducer(
            self.group,
            layers=sorted(layout.trainable_layers(), reverse=True),
            first_step=self.start_step + 1,
            last_step=self.spec.train.steps,
            wait_grads=self._wait_local_grads,
            grads=self._node_grads,
            stopped=self._cancel.is_set,
            wake=lambda why: self.inbox.put(Wakeup(why)),
        )
        self.reducer.start()

    def _stop_reducer(self) -> None:
        """After the run: the reducer ends at once unless it is inside a collective,
        which ends within the collective timeout (the arenas must outlive it)."""
        reducer = self.reducer
        if reducer is None or self.group is None:
            return
        if not reducer.join(self.group.nodes.timeout_s + 10):
            log.error("[trainer] job %s: the all-reduce thread did not stop", self.job_id)

    def _sync_with_group(self) -> None:
        """Make every node start from rank 0's state (Note [checkpoint cut]): the nodes
        check that they prepared the same job, then rank 0 broadcasts its step, data
        cursor and progress, and its masters, moments and both weight parities. Only rank
        0 reads checkpoints, so a checkpoint of any topology resumes on any other."""
        group, layout = self.group, self.layout
        assert group is not None and layout is not None and layout.events is not None
        group.cancelled = self._cancel.is_set
        trainable = sorted(
            (layer, name, tuple(t.shape))
            for layer, d in self.masters.items()
            for name, t in d.items()
        )
        moments = self.optimizer.state_dict()["tensors"]
        fingerprint = json.dumps(
            {
                "data": self.dataset.fingerprint,
                "rows": self.dataset.num_rows,
                "tensors": hashlib.sha256(repr(trainable).encode()).hexdigest(),
                "moments": sorted(moments),
            },
            sort_keys=True,
        )
        state = ""
        if group.leader:
            state = json.dumps(
                {
                    "step": self.start_step,
                    "cursor": self.loader.state_dict(),
                    "progress": self._progress_rows(),
                }
            )
        try:
            found = group.exchange("prepared", fingerprint, "every node to prepare the job")
            for rank, theirs in enumerate(found):
                if theirs != found[0]:
                    raise JobFailed(
                        f"{group.nodes.describe(rank)} prepared different data or a different "
                        "model than rank 0 (dataset fingerprint or trainable tensors differ): "
                        "every node needs the same model, tokenizer and data files at the "
                        "same paths"
                    )
            leader_state = json.loads(group.exchange("state", state, "rank 0's state")[0])
            tensors = [self.masters[layer][name] for layer, name, _ in trainable]
            tensors += [moments[key] for key in sorted(moments)]
            for layer, name, _ in trainable:
                tensors += [layout.view(ref) for ref in layout.params[layer][name] if ref]
            group.broadcast(tensors, "rank 0's training state")
        except GroupError as exc:
            raise self._group_paused(exc) from None
        except InterruptedError:
            raise JobCancelled(f"job {self.job_id} was cancelled") from None
        if group.leader:
            return
        s = int(leader_state["step"])
        try:
            self.loader.load_state_dict(leader_state["cursor"])
        except DataError as exc:
            raise JobFailed(f"this node's data differs from rank 0's: {exc}") from None
        optimizer_state = self.optimizer.state_dict()
        optimizer_state["steps"] = {layer: s for layer in optimizer_state["steps"]}
        self.optimizer.load_state_dict(optimizer_state)
        for layer in self.masters:
            layout.events.signal(layout.counters.version(layer), s)
        self.progress = _progress_from_rows(leader_state["progress"])
        self.step = self.start_step = self._optimizer_done_step = s
        self.last_loss = self.progress[-1].loss if self.progress else None

    # -- checkpoints ------------------------------------------------------------------

    def _progress_rows(self, up_to: int | None = None) -> list[list[float]]:
        """The progress events (of steps up to ``up_to``) as a checkpoint manifest stores
        them (one list per step)."""
        with self._progress_lock:
            return [
                [e.step, e.loss, e.tokens_per_s, e.lr, e.time, e.optimizer_s]
                for e in self.progress
                if up_to is None or e.step <= up_to
            ]

    @contextlib.contextmanager
    def _pinned_output(self, what: str) -> Iterator[Path]:
        """Check that the output directory is still a directory below a write root that
        only the coordinator can change (coordinator.paths), and yield a path to write
        into it through that checked directory held open (coordinator.paths.pinned_dir):
        in a write root others can write to, the directory could otherwise be renamed
        away and replaced by a link between the check and the last file written.
        Raises JobFailed if the check fails, JobPaused (the message begins with ``what``)
        if the directory cannot be opened at all (out of file descriptors, I/O error)."""
        if self.paths is None:
            yield self.output_dir
            return
        try:
            fd = self.paths.open_output(self.output_dir)
        except PathRefused as exc:
            raise JobFailed(str(exc)) from None
        except OSError as exc:
            raise JobPaused(self._io_error_message(what, _with_path(exc, self.output_dir))) from exc
        try:
            pinned = pinned_dir(fd) or self.output_dir  # no /proc: the checked path
            self._pins.root = pinned
            yield pinned
        finally:
            self._pins.root = None
            os.close(fd)

    @property
    def _output_root(self) -> Path:
        """Where this thread writes into the output directory: the pin it holds
        (``_pinned_output``), else the directory's path."""
        return getattr(self._pins, "root", None) or self.output_dir

    def _shown(self, text: object) -> str:
        """``text`` (a path, a message) as the user knows it: the output directory's pin
        replaced by its path."""
        text = str(text)
        for pin in {self._output_root, self.held_output} - {self.output_dir}:
            # Not inside a longer fd number: /proc/self/fd/1 is no prefix of .../fd/12.
            text = re.sub(re.escape(str(pin)) + r"(?![0-9])", lambda _: str(self.output_dir), text)
        return text

    def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint after ``step`` from the live state (call only at a cut:
        Note [checkpoint cut]) and prune to ``output.keep_last``. Raises JobPaused if it
        cannot be written."""
        return self._write_checkpoint(step, self._state_tensors(step), self._checkpoint_context())

    def _write_checkpoint(self, step: int, state: LayerState, context: dict) -> Path:
        """Write checkpoint ``step`` of ``state`` (live at a cut, or staged: the
        background writer calls this in its thread) atomically, through the output
        directory held open for the whole write (``_pinned_output``), then prune. Raises
        JobPaused if it cannot be written, JobFailed if the output directory is refused."""
        started = time.perf_counter()
        background = self._background
        check = background.check_abort if background is not None else (lambda: None)
        with self._pinned_output(f"cannot write checkpoint step {step}") as output:
            checkpoints = CheckpointDir(output / self.checkpoints.root.name)
            try:
                written = checkpoints.write(
                    step,
                    lambda d: self._fill_checkpoint(d, state, context["rng"], check),
                    self._manifest(step, context),
                )
            except OSError as exc:
                raise JobPaused(
                    self._io_error_message(f"cannot write checkpoint step {step}", exc)
                ) from exc
            path = self.checkpoints.root / written.name
            self.checkpoint_step = step
            try:
                checkpoints.prune(self.spec.output.keep_last, self.job_id)
            except OSError as exc:  # the new checkpoint is safe; old ones just linger
                log.warning(
                    "[trainer] job %s: pruning old checkpoints failed: %s",
                    self.job_id,
                    self._shown(str(exc)),
                )
        log.info(
            "[trainer] job %s: checkpoint step %d written to %s in %.2fs%s",
            self.job_id,
            step,
            path,
            time.perf_counter() - started,
            " (in the background)" if background is not None else "",
        )
        return path

    def _settle_background(self) -> None:
        """In the run loop: announce background checkpoints written since the last call
        (``CheckpointWritten``); raise JobPaused (or JobFailed) for one that could not be
        written."""
        if self._background is None:
            return
        finished, failed = self._background.take_settled()
        for step, path in finished:
            self._emit(CheckpointWritten(step, path, self._loss_at(step)))
        if failed is None:
            return
        step, error = failed
        if isinstance(error, (JobPaused, JobFailed)):  # full disk; output directory refused
            raise error
        os_error = as_os_error(error, self.checkpoints.root)
        if os_error is not None:  # any I/O error pauses, as a drained checkpoint's does
            what = f"cannot write checkpoint step {step}"
            raise JobPaused(self._io_error_message(what, os_error)) from error
        raise JobFailed(f"cannot write checkpoint step {step}: {error}") from error

    def _loss_at(self, step: int) -> float | None:
        """The loss reported for ``step`` (a background checkpoint is announced after
        later steps have run)."""
        with self._progress_lock:
            for event in reversed(self.progress):
                if event.step == step:
                    return event.loss
        return None

    def _note_checkpoint_wait(self, step: int, waited_s: float) -> None:
        if waited_s > 0.01:
            log.info(
                "[trainer] job %s: checkpoint step %d waited %.2fs for the one before the "
                "previous one to be written (output.checkpoint_staging holds one)",
                self.job_id,
                step,
                waited_s,
            )

    def _state_tensors(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The live per-layer tensors of checkpoint ``step`` (Note [checkpoint cut]): fp32
        masters, optimizer state, and the compute-dtype weights of version step - 1."""
        assert self.layout is not None
        moments = self.optimizer.state_dict()["tensors"]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer in sorted(self.masters):
            per = out[layer] = {}
            for name, master in self.masters[layer].items():
                per[f"master/{name}"] = master
                for kind in self.optimizer.kinds:  # AdamW's moments, SGD's momentum
                    per[f"{kind}/{name}"] = moments[f"{layer}.{name}.{kind}"]
                previous = self.layout.params[layer][name][(step - 1) % 2]
                assert previous is not None
                per[f"prev/{name}"] = self.layout.view(previous)
        return out

    def _checkpoint_context(self) -> dict:
        """What a checkpoint takes from the run loop at its cut (the loader then stands
        at the step after it): data cursor, RNG state, plans."""
        return {
            "data_cursor": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "plan": str(self.plan),
            "plan_history": [list(entry) for entry in self.plan_history],
        }

    def _fill_checkpoint(
        self,
        directory: Path,
        state: LayerState,
        rng: torch.Tensor,
        check_abort: Callable[[], None],
    ) -> None:
        """The model files, then the training state. The fp32 masters are stored once,
        in the model files (read back by ``checkpoint_name``); the training state holds
        the rest (docs/checkpoints.md, "What is on disk")."""
        assert self.layout is not None
        masters = {
            layer: {key[len("master/") :]: t for key, t in per.items() if key.startswith("master/")}
            for layer, per in state.items()
        }
        self.write_hf_model(directory, self._weights_with(masters))
        check_abort()
        tensors = {
            key: t
            for per in state.values()
            for key, t in per.items()
            if not key.startswith("master/")
        }
        tensors["rng/torch_cpu"] = rng
        (directory / STATE_FILE).parent.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        save_tensors(
            directory / STATE_FILE,
            tensors,
            {"format": "roundpipe-training-state", "masters": "model files"},
        )

    def _manifest(self, step: int, context: dict) -> dict:
        spec_dict = self.spec.to_dict()
        spec_json = json.dumps(spec_dict, sort_keys=True, separators=(",", ":"))
        progress = self._progress_rows(up_to=step)  # a background checkpoint: later steps ran
        return {
            "job_id": self.job_id,
            "total_steps": self.spec.train.steps,
            "spec": spec_dict,
            "spec_sha256": hashlib.sha256(spec_json.encode()).hexdigest(),
            "model": {
                "architecture": self.model.architecture,
                "kind": "lora" if self.model.lora is not None else "full",
                "base_model": str(self._base_model_dir()) if self.model.lora else None,
                "trainable_tensors": sum(len(v) for v in self.masters.values()),
            },
            "plan": context["plan"],
            "plan_history": context["plan_history"],
            "staleness": self.spec.train.staleness,
            # The weight version saved as prev/* (Note [checkpoint cut]).
            "prev_version": step - 1 if weight_copies(self.spec) == 2 else step,
            "compute_dtype": self.spec.train.dtype,
            "data_cursor": context["data_cursor"],
            "lr_schedule": {"step": step, "lr": self.optimizer.lr_at(step) if step else 0.0},
            "optimizer": {
                "impl": self.optimizer_impl,
                # Every layer's step count is the checkpoint's (Note [checkpoint cut]).
                "steps": {str(layer): step for layer in self.masters},
            },
            "masters": "model files",
            "rng": {
                "torch_cpu": f"{STATE_FILE}:rng/torch_cpu",
                "seed": self.spec.train.seed,
                "init_seed": self.spec.init_seed,
                "data_seed": self.spec.data_seed,
            },
            "progress": progress,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from.path),
        }

    def _io_error_message(self, what: str, exc: OSError) -> str:
        where = self._shown(exc.filename or self.checkpoints.root)
        code = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{exc.strerror or exc}" + (f" [{code}]" if code else "")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space on that file system"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "make the directory writable by the coordinator"
        elif exc.errno in (errno.EMFILE, errno.ENFILE):
            fix = "see the coordinator's log for what holds its files (a flood of connections?)"
        else:
            fix = "fix the problem"
        if self.checkpoint_step:
            kept = (
                f"checkpoint step {self.checkpoint_step} "
                f"({self.checkpoints.root / step_name(self.checkpoint_step)}) is kept and the "
                "job resumes from it"
            )
        else:
            kept = "no checkpoint has been written yet, so the job resumes from the start"
        return (
            f"{what}: {where}: {reason}. The job is paused; {kept}: {fix}, then run "
            f"`roundpipe resume {self.job_id}`"
        )

    # -- results ----------------------------------------------------------------------

    def final_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """fp32 masters for trainable weights, params-arena copies for frozen ones."""
        weights = self._weights_with(self.masters)
        return {layer: {n: t.clone() for n, t in per.items()} for layer, per in weights.items()}

    def _base_model_dir(self) -> Path:
        """The base model a LoRA adapter names: the job's local model directory, or for
        a randomly initialised base, ``<output>/base_model``."""
        if self.spec.model.path is not None:
            return Path(self.spec.model.path).resolve()
        return (self.output_dir / "base_model").resolve()

    def _weights_with(
        self, masters: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every layer's weights: ``masters`` for trainable ones (no copy), the params
        arena's for frozen ones (they never change)."""
        assert self.layout is not None
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer, names in self.layout.params.items():
            out[layer] = {}
            for name, (even, _odd) in names.items():
                if name in self.masters.get(layer, {}):
                    out[layer][name] = masters[layer][name]
                else:
                    out[layer][name] = self.layout.view(even).to(torch.float32)
        return out

    def write_hf_model(
        self, directory: Path, weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """Write the current model in Hugging Face layout into ``directory`` (shared by
        ``export`` and checkpoints): ``save_pretrained`` of the transformers model
        (safetensors + config), or for LoRA a PEFT adapter directory whose
        ``base_model_name_or_path`` is ``_base_model_dir()``, so that
        ``AutoPeftModelForCausalLM.from_pretrained`` works offline; plus the tokenizer.
        A randomly initialised base is written once per run, atomically, to
        ``<output>/base_model`` (it never changes: only adapters train). ``weights``:
        the weights to write (default: the current ones, ``final_weights()``)."""
        from transformers.utils import logging as hf_logging

        if weights is None:
            weights = self.final_weights()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            if self.model.lora is not None:
                base_dir = self._base_model_dir()
                if self.spec.model.path is None and not self._base_model_written:
                    # First, so that peft finds the base's config when saving the adapter.
                    base = self.model.hf_model_of(weights).unload()
                    self._write_base_model(base, self._output_root / base_dir.name)
                model = self.model.hf_model_of(weights)
                for config in model.peft_config.values():
                    config.base_model_name_or_path = str(base_dir)
                model.save_pretrained(str(directory))
            else:
                model = self.model.hf_model_of(weights)
                model.save_pretrained(str(directory))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer_dir = self.spec.tokenizer_path
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            from roundpipe.coordinator.spec.data import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_dir)
            if self.spec.data.chat_template is not None:
                # The exported model chats with the template it was trained on.
                from roundpipe.coordinator.spec.instruct import load_chat_template

                load_chat_template(tokenizer, self.spec.data.chat_template)
            tokenizer.save_pretrained(str(directory))
        restrict_tree(directory)  # whatever the umask: full weights are private

    def _write_base_model(self, base_model, base_dir: Path) -> None:
        tmp = base_dir.parent / f".tmp-{base_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        trash = base_dir.parent / f".trash-{base_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            base_model.save_pretrained(str(tmp))
            restrict_tree(tmp)
            for file in tmp.iterdir():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
            if base_dir.exists():
                os.rename(base_dir, trash)
            os.rename(tmp, base_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(trash, ignore_errors=True)
        self._base_model_written = True

    def export(self, directory: Path | None = None) -> Path:
        """Write the final model in Hugging Face layout (``write_hf_model``) into
        ``directory`` (default: the output directory). Raises JobPaused if it cannot be
        written (the final checkpoint holds the same model)."""
        directory = self.output_dir if directory is None else Path(directory)
        with self._pinned_output(f"cannot write the final model to {directory}") as output:
            target = output if directory == self.output_dir else directory
            try:
                target.mkdir(mode=modes().dir, parents=True, exist_ok=True)
                self.write_hf_model(target)
            except Exception as exc:
                os_error = as_os_error(exc, target)
                if os_error is None:
                    raise
                raise JobPaused(
                    self._io_error_message(f"cannot write the final model to {directory}", os_error)
                ) from exc
        return directory

    def close(self) -> None:
        self._cancel.set()
        if self._background is not None:
            self._background.close()
        self.timeline.close()  # observability: settle the last step, finish the trace
        if self._held_output_fd is not None:
            os.close(self._held_output_fd)
            self._held_output_fd = None
            self.held_output = self.output_dir
        if self.layout is not None:
            self.layout.destroy()
            self.layout = None


def _with_path(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` if it names no file itself (an error message says where)."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def _progress_from_rows(rows: Iterable[Sequence[float]]) -> list[ProgressEvent]:
    """``Trainer._progress_rows`` read back (from a checkpoint, or from rank 0)."""
    return [
        ProgressEvent(
            seq=int(p[0]),
            step=int(p[0]),
            loss=p[1],
            tokens_per_s=p[2],
            lr=p[3],
            time=p[4],
            optimizer_s=p[5] if len(p) > 5 else 0.0,  # older checkpoints: not recorded
        )
        for p in rows
    ]
