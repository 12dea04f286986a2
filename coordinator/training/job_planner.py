"""Choosing a job's plan and sizing its arenas for it: the first plan, the layout
checked against the host's memory, and re-plans while the job runs.

The search itself is the planning room's (roundpipe.coordinator.planning.search); this
module decides when to ask it and what a job may afford.

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

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import torch

from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.profile import PROFILE_FILE, ProfileAggregator, save_profile
from roundpipe.coordinator.planning.search import (
    initial_plan,
    pinned_grain,
    replan_if_better,
    runnable_grain,
)
from roundpipe.coordinator.spec.choices import optimizer_state_sharded
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.sections import staging_limit_bytes
from roundpipe.coordinator.training.job_errors import JobFailed
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.memory import (
    HostMemory,
    InsufficientMemory,
    check_host_memory,
    checkpoint_staging_needed,
    grad_buffer_layers,
    host_memory_needed,
    weight_copies,
)
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

__all__ = ["JobPlanner", "replan_pool_capacity"]

log = logging.getLogger(__name__)

_MAX_REPLAN_ATTEMPTS = 3
_REPLAN_MIN_GAIN = 0.05
_POOL_HEADROOM = 1.5
"""Slot pools hold this many times the initial plan's boundaries (at least 2 more, at
most every layer), so a re-plan may add stages (Note [re-planning])."""


def replan_pool_capacity(num_layers: int, plan: Plan) -> dict[str, int]:
    """The activation and gradient slot pools of a job that may re-plan (_POOL_HEADROOM):
    ``JobLayout.plan_layout``'s ``act_capacity`` and ``dact_capacity``. `roundpipe plan`
    sizes its host-memory figure with them too, as admission does."""
    capacity = {}
    for key, boundaries in (
        ("act_capacity", JobLayout.activation_boundaries(plan)),
        ("dact_capacity", JobLayout.gradient_boundaries(plan)),
    ):
        n = len(boundaries)
        capacity[key] = min(num_layers - 1, max(n + 2, int(n * _POOL_HEADROOM)))
    return capacity


@dataclass(eq=False, repr=False)
class JobPlanner:
    """Plans one job for ``hardware`` (module docstring)."""

    job_id: str
    spec: JobSpec
    _: KW_ONLY
    hardware: HardwareSpec
    arena_dir: Path
    node_microbatches: int
    """Microbatches this node trains per step: the global batch's, or its share."""
    compute_dtype: torch.dtype
    nodes: int = 1
    """Nodes of the job's data-parallel group (1: none)."""
    rank: int = 0
    """This node's rank in it: what it holds of sharded optimizer state (``memory``)."""
    dataset_bytes: int = 0
    """Bytes of the job's data rows, counted in its host memory."""
    profile: ProfileAggregator | None = field(default=None, init=False)
    """Measured layer times, when the planner may re-plan (Note [re-planning])."""
    replan_attempts: int = field(default=0, init=False)
    recompute: str = field(default="stage", init=False)
    """How the job's backward tasks recompute (Note [recompute grain] in
    roundpipe.worker.executor): ``train.recompute``, or the planner's choice for auto."""
    staging_bytes: int = field(default=0, init=False)
    """Host memory set aside for background checkpoints (0: checkpoints drain the
    pipeline); decided with the layout (Note [background checkpoint])."""
    _profile_unwritable: bool = field(default=False, init=False)
    """The last profile write failed (and was logged)."""

    def first_layout(self, model: LayeredModel) -> tuple[JobLayout, str]:
        """The job's first plan's layout (sized, not created) and why that plan. Raises
        JobFailed if no plan fits the host's memory."""
        plan, why = self._initial_plan(model)
        try:
            return self._checked_layout(model, plan), why
        except InsufficientMemory as exc:
            if not plan.is_split or self.spec.train.plan:
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
                return self._checked_layout(model, plan), why
            except InsufficientMemory as exc2:
                raise JobFailed(str(exc2)) from None

    def _choose_staging(self, layout: JobLayout) -> int:
        """Bytes of staging for background checkpoints (``output.checkpoint_staging``):
        one checkpoint's per-layer state, if the setting allows that much ("auto": if
        the machine has it available besides the job); else 0, and checkpoints drain."""
        spec = self.spec
        need = checkpoint_staging_needed(layout, spec, nodes=self.nodes, rank=self.rank)
        sharded = optimizer_state_sharded(spec.train.optimizer_sharding, spec.optimizer.state_dtype)
        if need == 0 or (self.nodes > 1 and self.rank != 0 and not sharded):
            return 0  # only rank 0 writes; in a sharded group every node sends its pieces
        limit = staging_limit_bytes(spec.output.checkpoint_staging)
        if limit is not None:
            if need <= limit:
                return need
            why = f"output.checkpoint_staging is {limit} bytes"
        else:
            try:
                check_host_memory(self._needed(layout, need), self.arena_dir)
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
            capacity = replan_pool_capacity(model.num_layers, plan)
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
        layout.recompute = self.recompute
        # Admission control: refuse before any arena, master or moment exists, with the
        # figures (issue 15: seq_len 65536 on a tiny model took 2.7 GB unasked).
        self.staging_bytes = self._choose_staging(layout)
        check_host_memory(self._needed(layout, self.staging_bytes), self.arena_dir)
        return layout

    def host_memory(self, layout: JobLayout) -> HostMemory:
        """This node's host memory for ``layout``, as the admission check counted it."""
        return self._needed(layout, self.staging_bytes)

    def _needed(self, layout: JobLayout, staging: int) -> HostMemory:
        """This node's host memory for ``layout`` with ``staging`` bytes of checkpoint
        staging (its share of sharded optimizer state: ``host_memory_needed``)."""
        return host_memory_needed(
            layout,
            self.spec,
            checkpoint_staging=staging,
            nodes=self.nodes,
            rank=self.rank,
            dataset=self.dataset_bytes,
        )

    def _initial_plan(
        self, model: LayeredModel, fits: Callable[[Plan], bool] | None = None
    ) -> tuple[Plan, str]:
        """The job's first plan and why: the spec's, or the planner's cold start (among
        the plans ``fits`` accepts)."""
        spec, hw = self.spec, self.hardware
        # A given plan, or a planner asked for one grain, runs at that grain; "auto" is
        # the planner's to choose.
        if spec.train.recompute == "layer" and runnable_grain(model, "layer") != "layer":
            log.warning(
                "[trainer] job %s: train.recompute %s is not possible with the router "
                "auxiliary loss; backward tasks recompute whole stages",
                self.job_id,
                spec.train.recompute,
            )
        self.recompute = pinned_grain(runnable_grain(model, spec.train.recompute))
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
                recompute=spec.train.recompute,
            )
        except ValueError as exc:
            raise JobFailed(f"cannot plan this job: {exc}") from None
        self.recompute = result.recompute
        if spec.train.replan:
            # CPU timings jitter by 5-10% from step to step; 10% still catches a plan
            # that is off by more than the 5% a switch must gain.
            self.profile = ProfileAggregator(
                result.costs, self.node_microbatches, settle_tolerance=0.1
            )
        return result.plan, (
            f"planned from parameter sizes for {hw.num_workers} worker(s), predicted "
            f"{result.predicted_iteration_s:.3g}s per step, recompute at "
            f"{result.recompute} grain"
        )

    def write_profile(
        self, output_dir: Path, plan: Plan, shown: Callable[[object], str] = str
    ) -> None:
        """Write the measured profile, once every layer has a measurement, to
        ``output_dir/profile.json`` with what it was measured on: `roundpipe plan
        --profile` predicts a step from it (measured times against the cold-start
        model's). Only the group's rank 0 writes (one output). A write that fails is
        logged once (it is tried again at each step; ``shown``: its path as the user
        knows it), not fatal: the file is observability."""
        profile, hw = self.profile, self.hardware
        if profile is None or not profile.covered or self.rank != 0:
            return
        spec = self.spec
        about = {
            "job": self.job_id,
            "architecture": spec.model.architecture,
            "seq_len": spec.data.seq_len,
            "microbatch_rows": spec.batch.microbatch_size,
            "num_microbatches": self.node_microbatches,
            "dtype": spec.train.dtype,
            "plan": str(plan),
            "recompute": self.recompute,
            "iterations_folded": profile.folded_iterations,
            "settled": profile.settled,
            "hardware": {
                "num_workers": hw.num_workers,
                "memory_limit_bytes": hw.memory_limit_bytes,
                "bandwidth_bytes_per_s": hw.bandwidth_bytes_per_s,
                "reserved_bytes": hw.reserved_bytes,
                "task_overhead_s": hw.task_overhead_s,
                "gpu_workers": hw.gpu_workers,
                "host_views": hw.host_views,
            },
        }
        try:
            save_profile(output_dir / PROFILE_FILE, profile.costs(), about)
        except OSError as exc:
            if not self._profile_unwritable:
                log.warning(
                    "[planner] job %s: could not write its profile %s: %s (tried again at "
                    "each step, without saying so again)",
                    self.job_id,
                    shown(output_dir / PROFILE_FILE),
                    shown(exc.strerror or exc),
                )
            self._profile_unwritable = True
        else:
            self._profile_unwritable = False

    def replan_candidate(self, layout: JobLayout) -> tuple[Plan, str] | None:
        """A better plan than ``layout``'s under the measured layer times, if they have
        settled and one fits the slot pools (Note [re-planning])."""
        profile, hw = self.profile, self.hardware
        if profile is None or not profile.settled:
            return None
        if self.replan_attempts >= _MAX_REPLAN_ATTEMPTS:
            return None
        self.replan_attempts += 1
        profile.restart_settling()  # the next attempt waits for fresh, settled numbers
        started = time.perf_counter()
        spec = self.spec
        result = replan_if_better(
            layout.plan,
            profile.costs(),
            hw,
            self.node_microbatches,
            min_gain=_REPLAN_MIN_GAIN,
            staleness=spec.train.staleness,
            tokens_per_iteration=self.node_microbatches
            * spec.batch.microbatch_size
            * spec.data.seq_len,
            fits=layout.fits,
            recompute=layout.recompute,
        )
        log.info(
            "[trainer] job %s: re-planning attempt %d took %.2fs: %s",
            self.job_id,
            self.replan_attempts,
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
