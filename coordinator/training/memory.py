"""Host memory a job needs, checked against the machine before anything is allocated.

A job's host memory is known before it exists, so no spec can make the coordinator run
out. By component (:class:`HostMemory`, docs/memory.md):

* its arenas (``JobLayout.sizes``): compute-dtype weights (two copies at staleness 1,
  one at staleness 0: Note [weight copies] in roundpipe.coordinator.training.layout), the
  bounded fp32 gradient buffer (Note [gradient buffer]), activation and gradient slots,
  the io arena and the event table; files under ``--arena-dir`` that take RAM
  (/dev/shm); GPU workers pin these same pages, so pinning adds nothing;
* the fp32 master weights of its trainable parameters (4 bytes each) and the optimizer
  states (AdamW: 8 bytes, ~2.03 with ``optimizer.state_dtype: int8``), in the
  coordinator's own memory;
* the job's data rows (token ids, labels, position ids), held for the whole job;
* the staging copy of one checkpoint's training state, when checkpoints are written in
  the background (:func:`checkpoint_staging_needed`; Note [background checkpoint] in
  roundpipe.coordinator.training.snapshot).

:func:`host_memory_needed` adds them up from a layout that has been planned but not
created (:func:`planned_layout` builds it as the trainer does); :func:`check_host_memory`
refuses a job that does not fit what the machine has available now
(``psutil.virtual_memory().available``) or whose arenas do not fit the arena directory's
free space, with a message giving every figure. The trainer checks before it creates
the arenas; the coordinator's admission child checks the least any plan needs
(:func:`least_host_memory`) at submit, so a hopeless job is refused at once.

Not counted: a CPU worker's working memory while it runs a task (autograd's saved
tensors, in the worker process), the coordinator's own heap (~100 MB per job), and the
weights the trainer loads once at start (after this check: a
weight at a time from a model directory, a random model whole; they become the masters,
or go into the arena and are freed).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from roundpipe.coordinator.spec.choices import optimizer_state_sharded
from roundpipe.coordinator.spec.sections import TrainSpec
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.shared.model import LayeredModel

if TYPE_CHECKING:
    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared.plan import Plan

__all__ = [
    "HostMemory",
    "InsufficientMemory",
    "check_host_memory",
    "checkpoint_staging_needed",
    "checkpoint_gather_nbytes",
    "collective_buffer_nbytes",
    "committed_checkpoint_staging",
    "grad_buffer_layers",
    "host_memory_needed",
    "least_host_memory",
    "optimizer_state_nbytes",
    "planned_layout",
    "release_freed_memory",
    "sharded_elements",
    "weight_copies",
]


class InsufficientMemory(RuntimeError):
    """The job needs more host memory (or arena space) than the machine has."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory one job takes while it runs, by component."""

    weights: int
    """Compute-dtype weights in the params arena (Note [weight copies] in
    roundpipe.coordinator.training.layout) and the frozen weights."""
    grads: int
    """The gradient arena (Note [gradient buffer] in roundpipe.coordinator.training.layout)."""
    activations: int
    """Activation and activation-gradient slots, the io arena and the event table."""
    masters: int
    """fp32 master weights of the trainable parameters (coordinator memory)."""
    moments: int
    """Optimizer states of the trainable parameters (coordinator memory)."""
    staging: int = 0
    """Pinned staging buffers: none (GPU workers pin the arenas in place)."""
    checkpoint_staging: int = 0
    """One checkpoint's training state copied for the background writer (coordinator
    memory; 0: checkpoints drain the pipeline)."""
    gathered: int = 0
    """What rank 0 of a group with sharded optimizer state gathers while it writes a
    checkpoint: the whole fp32 masters, and the optimizer states one layer at a time
    (Note [streamed checkpoint state] in roundpipe.coordinator.training.sharded_optimizer);
    0 on the other ranks and unsharded."""
    start_up: int = 0
    """A node of a group with sharded optimizer state other than rank 0, while the nodes
    get in sync: one layer's whole masters and optimizer states, as rank 0 sends them
    (Note [sharded start-up] in roundpipe.coordinator.training.initial_weights; rank 0's whole
    masters and a layer's states are in ``gathered``); 0 elsewhere."""
    split_sums: int = 0
    """Where the optimizer adds the two parts of a gradient (coordinator memory, fp32):
    a microbatch-split stage's (as large as the second parts: Note [microbatch-split
    stages] in roundpipe.shared.plan) and a trainable tied weight's two uses (as large as
    the weight: the embedding of a tied-embedding model); 0 when there are none."""
    dataset: int = 0
    """The data's rows (token ids, labels and position ids, int32), which the coordinator
    holds for the whole job (``PackedDataset.nbytes``; 0 where not known)."""
    collectives: int = 0
    """A node's scratch buffers for its collectives with the other nodes of a group: the
    largest bucket's gradient packed in the transport dtype (Note [one layout for both
    reductions], Note [gradient buckets]) and, sharded, the all-gather's buffers of its
    weights; 0 on one node."""

    @property
    def arenas(self) -> int:
        """Shared-memory arenas under the arena directory (all of ``JobLayout.sizes``)."""
        return self.weights + self.grads + self.activations

    @property
    def total(self) -> int:
        return (
            self.arenas
            + self.masters
            + self.moments
            + self.staging
            + self.checkpoint_staging
            + self.gathered
            + self.start_up
            + self.split_sums
            + self.dataset
            + self.collectives
        )

    def components(self) -> dict[str, int]:
        """Every component by name, in the order ``describe`` gives them: the fields."""
        return asdict(self)

    def describe(self, parameters: int | None = None) -> str:
        """One line with every figure; with ``parameters``, also bytes per parameter."""
        per = "" if not parameters else f", {self.total / parameters:.2f} bytes per parameter"
        gathered = (
            f"state gathered for checkpoints {_gib(self.gathered)}, " if self.gathered else ""
        )
        collectives = f"collective buffers {_gib(self.collectives)}, " if self.collectives else ""
        if self.start_up:
            collectives += f"a layer of rank 0's state at start-up {_gib(self.start_up)}, "
        collectives += f"data rows {_gib(self.dataset)}, " if self.dataset else ""
        return (
            f"{_gib(self.total)} of host memory (arenas {_gib(self.arenas)}: weights "
            f"{_gib(self.weights)}, gradient buffer {_gib(self.grads)}, activations "
            f"{_gib(self.activations)}; fp32 masters {_gib(self.masters)}, optimizer states "
            f"{_gib(self.moments)}, pinned staging {_gib(self.staging)}, checkpoint staging "
            f"{_gib(self.checkpoint_staging)}, {gathered}{collectives}split-gradient sums {_gib(self.split_sums)})"
            f"{per}"
        )


def host_memory_needed(
    layout: JobLayout,
    spec: JobSpec | None = None,
    *,
    checkpoint_staging: int = 0,
    nodes: int = 1,
    rank: int = 0,
    dataset: int = 0,
) -> HostMemory:
    """What a job with this (planned, not yet created) layout takes in host memory.
    ``spec``: the job's optimizer settings (default: AdamW with fp32 states);
    ``checkpoint_staging``: bytes staged for background checkpoints (the trainer's
    choice, ``committed_checkpoint_staging`` before it has chosen). ``nodes`` and
    ``rank``: this node's place in a data-parallel group; with
    ``train.optimizer_sharding: sharded`` it holds only its pieces of the masters and
    optimizer states, and rank 0 also the whole masters (and a layer's states) while it
    writes a checkpoint. ``dataset``: bytes of the job's data rows (``HostMemory.dataset``)."""
    trainable = layout.model.parameter_count(trainable_only=True)
    sizes = layout.sizes
    moments = optimizer_state_nbytes(layout, spec)
    masters, gathered, start_up, collectives = 4 * trainable, 0, 0, 0
    sharded = spec is not None and nodes > 1 and _sharded(spec)
    if nodes > 1:
        from roundpipe.coordinator.training.sharded_optimizer import bucket_cap_mb

        transport, weights = (
            ("float32", "float32")
            if spec is None
            else (spec.train.grad_transport, spec.train.dtype)
        )
        collectives = collective_buffer_nbytes(
            layout.model,
            nodes,
            sharded=sharded,
            transport_bytes=getattr(torch, transport).itemsize,
            weight_bytes=getattr(torch, weights).itemsize,
            bucket_mb=bucket_cap_mb(
                (TrainSpec if spec is None else spec.train).grad_bucket_mb,
                layout.shares_grad_slots,
            ),
        )
    if sharded:
        if rank == 0:
            gathered = checkpoint_gather_nbytes(layout.model, masters, moments)
        else:  # masters and states of the largest layer (Note [sharded start-up])
            largest = _largest_layer(layout.model)
            start_up = 4 * largest + moments * largest // max(trainable, 1)
        held = sharded_elements(layout.model, nodes, rank)
        # fp32 moments and SGD's momentum are per element (int8 states are refused)
        moments, masters = moments * held // max(trainable, 1), 4 * held
    return HostMemory(
        weights=sizes["params"],
        grads=sizes["grads"],
        activations=sum(n for name, n in sizes.items() if name not in ("params", "grads")),
        masters=masters,
        moments=moments,
        checkpoint_staging=checkpoint_staging,
        gathered=gathered,
        start_up=start_up,
        split_sums=sum(
            4 * ref.numel for slots in layout.grads_part.values() for ref in slots.values()
        )
        + _tied_sums_nbytes(layout),
        dataset=dataset,
        collectives=collectives,
    )


def _tied_sums_nbytes(layout: JobLayout) -> int:
    """The optimizer thread's scratch where a tied weight's two gradients are added (its
    ``_tied_scratch``): one fp32 tensor per owner, as large as the owner's slot."""
    owners = {owner for _, owner in layout.tied_gradients()}
    return sum(4 * layout.grads[layout.model.layer_of(o)][o].numel for o in owners)


def collective_buffer_nbytes(
    model: LayeredModel,
    nodes: int,
    *,
    sharded: bool,
    transport_bytes: int,
    weight_bytes: int,
    bucket_mb: float = 0,
) -> int:
    """``HostMemory.collectives``: the largest bucket's trainable tensors (Note [gradient
    buckets]: ``bucket_mb`` is ``train.grad_bucket_mb``) packed rank-major (Note [shard
    boundaries]) in the transport dtype (``transport_bytes`` per element) for its
    reduction, plus, sharded, the all-gather's buffer in the compute dtype
    (``weight_bytes``; Note [sharded collectives over gloo])."""
    from roundpipe.coordinator.training.sharded_optimizer import gradient_buckets, span

    trainable = {
        layer: [s.numel for s in model.layer_params(layer) if s.trainable]
        for layer in reversed(range(model.num_layers))  # the reducer's order
    }
    buckets = gradient_buckets(
        [(layer, transport_bytes * sum(n)) for layer, n in trainable.items() if n],
        bucket_mb * 2**20,
    )
    packed = max(
        (
            nodes * sum(span(n, nodes) for layer in bucket for n in trainable[layer])
            for bucket in buckets
        ),
        default=0,
    )
    total = packed * transport_bytes
    if sharded:
        total += packed * weight_bytes
    return total


def _sharded(spec: JobSpec) -> bool:
    return optimizer_state_sharded(spec.train.optimizer_sharding, spec.optimizer.state_dtype)


def checkpoint_gather_nbytes(model: LayeredModel, masters: int, moments: int) -> int:
    """What rank 0 of a group with sharded optimizer state holds on top of its pieces
    while it writes a checkpoint, given the whole ``masters`` and ``moments`` bytes: the
    whole masters (the model files are written from them at once), and the largest
    layer's optimizer states twice (the gather's buffers and the whole tensors it fills;
    the states are written a layer at a time: Note [streamed checkpoint state] in
    roundpipe.coordinator.training.sharded_optimizer)."""
    trainable = max(1, model.parameter_count(trainable_only=True))
    return masters + 2 * (moments * _largest_layer(model) // trainable)


def _largest_layer(model: LayeredModel) -> int:
    """Trainable elements of the layer that has the most (a tied weight counted once)."""
    return max(
        (
            sum(s.numel for s in model.layer_params(layer) if s.trainable and s.tied_to is None)
            for layer in range(model.num_layers)
        ),
        default=0,
    )


def sharded_elements(model: LayeredModel, nodes: int, rank: int) -> int:
    """Trainable elements whose masters and moments rank ``rank`` of ``nodes`` holds with
    sharded optimizer state (Note [shard boundaries] in
    roundpipe.coordinator.training.sharded_optimizer)."""
    from roundpipe.coordinator.training.sharded_optimizer import piece

    held = 0
    for layer in range(model.num_layers):
        for s in model.layer_params(layer):
            if s.trainable and s.tied_to is None:
                lo, hi = piece(s.numel, rank, nodes)
                held += hi - lo
    return held


def grad_buffer_layers(spec: JobSpec, plan: Plan) -> int | None:
    """Gradient slots per shape class for ``spec`` under ``plan`` (Note [gradient
    buffer] in roundpipe.coordinator.training.layout); None: one slot per trainable layer."""
    stages = spec.train.grad_buffer_stages
    if stages == 0 or spec.optimizer_waits_for_whole_step:
        return None
    return JobLayout.grad_buffer_layers_for(plan, stages)


def weight_copies(spec: JobSpec) -> int:
    """Compute-dtype copies of each trainable weight (Note [weight copies] in
    roundpipe.coordinator.training.layout)."""
    return 1 if spec.train.staleness == 0 else 2


def planned_layout(model: LayeredModel, plan: Plan, spec: JobSpec) -> JobLayout:
    """The layout the trainer gives ``spec`` under ``plan`` (without the slot pools'
    re-planning headroom), sized, not created."""
    import torch

    return JobLayout.plan_layout(
        model,
        plan,
        compute_dtype=getattr(torch, spec.train.dtype),
        microbatch_rows=spec.batch.microbatch_size,
        seq_len=spec.data.seq_len,
        num_microbatches=spec.batch.num_microbatches,
        grad_buffer_layers=grad_buffer_layers(spec, plan),
        weight_copies=weight_copies(spec),
    )


def least_host_memory(model: LayeredModel, spec: JobSpec, dataset: int = 0) -> HostMemory:
    """The least host memory ``spec`` needs under any plan (what admission checks at
    submit): the activation slots of the plan with the fewest (the whole model as one
    tail stage) and the gradient buffer of the plan with the narrowest stages (one layer
    each), sized, not created; with the checkpoint staging an explicit
    ``output.checkpoint_staging`` commits the job to ("auto" takes staging only if the
    machine has it to spare when the job starts, so it adds nothing here); ``dataset``:
    bytes of its data rows."""
    import dataclasses

    from roundpipe.shared.plan import Plan

    n = model.num_layers
    one_stage = Plan(forward=(), tail=(0, n), backward=())
    layout = planned_layout(model, one_stage, spec)
    staging = committed_checkpoint_staging(layout, spec)
    fewest_slots = host_memory_needed(layout, spec, checkpoint_staging=staging, dataset=dataset)
    if n < 2:
        return fewest_slots
    narrowest = Plan.uniform(n, num_forward=1, num_backward=n - 1, tail_layers=1)
    grads = host_memory_needed(planned_layout(model, narrowest, spec), spec).grads
    return dataclasses.replace(fewest_slots, grads=min(grads, fewest_slots.grads))


def optimizer_state_nbytes(layout: JobLayout, spec: JobSpec | None = None) -> int:
    """Bytes of optimizer state: AdamW's two fp32 moments (8 bytes per trainable
    parameter) or, with ``optimizer.state_dtype: int8``, two uint8 codes per parameter
    and two fp32 scales per block of them (Note [8-bit states]); SGD's momentum buffer
    (4, none without momentum)."""
    model = layout.model
    trainable = model.parameter_count(trainable_only=True)
    if spec is None or (spec.optimizer.name == "adamw" and spec.optimizer.state_dtype != "int8"):
        return 8 * trainable
    if spec.optimizer.name == "adamw":
        from roundpipe.coordinator.training.quantized_state import absmax_numel

        numels = [
            s.numel
            for layer in range(model.num_layers)
            for s in model.layer_params(layer)
            if s.trainable and s.tied_to is None
        ]
        return sum(2 * n + 2 * 4 * absmax_numel(n) for n in numels)
    return 4 * trainable if spec.optimizer.momentum else 0


def checkpoint_staging_needed(
    layout: JobLayout, spec: JobSpec, *, nodes: int = 1, rank: int = 0
) -> int:
    """Bytes of staging background checkpoints need (Note [background checkpoint] in
    roundpipe.coordinator.training.snapshot): one checkpoint's per-layer state, that is per
    trainable parameter its fp32 master (4), its optimizer state
    (:func:`optimizer_state_nbytes`) and its previous compute-dtype weight (``prev/*``).
    With sharded optimizer state over ``nodes``, rank ``rank`` stages its pieces of the
    masters and states, and only rank 0 the previous weights (Note [sharded background
    checkpoint] in roundpipe.coordinator.training.sharded_optimizer). 0 for a job that
    checkpoints only after its last step: nothing to overlap with."""
    every = spec.output.checkpoint_every
    if every <= 0 or every >= spec.train.steps:
        return 0
    trainable = layout.model.parameter_count(trainable_only=True)
    prev = layout.compute_dtype.itemsize * trainable
    state = 4 * trainable + optimizer_state_nbytes(layout, spec)
    if nodes == 1 or not _sharded(spec):
        return state + prev
    held = sharded_elements(layout.model, nodes, rank)
    return state * held // max(trainable, 1) + (prev if rank == 0 else 0)


def committed_checkpoint_staging(layout: JobLayout, spec: JobSpec) -> int:
    """The checkpoint staging ``spec`` commits the job to before it starts: with a size
    in ``output.checkpoint_staging``, one checkpoint's (:func:`checkpoint_staging_needed`)
    if the size holds it, else 0 (checkpoints drain the pipeline); with ``"auto"``, 0:
    the trainer takes staging only if the machine has it to spare when it prepares."""
    from roundpipe.coordinator.spec.sections import staging_limit_bytes

    limit = staging_limit_bytes(spec.output.checkpoint_staging)
    need = checkpoint_staging_needed(layout, spec)
    return need if limit is not None and need <= limit else 0


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS. glibc keeps freed chunks below its mmap
    threshold (which rises to 32 MiB after a large free) in the heap, so a job's freed
    tensors, such as the fp32 weights the trainer loads once, would stay in the
    coordinator's RSS. Collects reference cycles first: a finished trainer sits in some
    (its threads' callbacks refer back to it), and until the cycle collector happened to
    run, each finished job's optimizer state stayed (about one job's worth of RSS per job,
    dropping back only now and then)."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def check_host_memory(
    need: HostMemory, arena_dir: str | os.PathLike[str] | None, *, what: str = "this job"
) -> None:
    """Raise InsufficientMemory unless ``need`` fits the memory available now and its
    arenas fit the free space of ``arena_dir`` (None: not checked). Its data rows are
    held already (every caller checks after building them, so ``available`` is without
    them), and only the rest is compared."""
    available = psutil.virtual_memory().available
    fix = (
        "use a shorter data.seq_len, a smaller batch.microbatch_size or fewer "
        "batch.num_microbatches, LoRA, or a machine with more memory"
    )
    if need.total - need.dataset > available:
        raise InsufficientMemory(
            f"{what} needs {need.describe()}, but only {_gib(available)} is available on "
            f"this machine; {fix}"
        )
    if arena_dir is None:
        return
    arena_free = shutil.disk_usage(Path(arena_dir)).free
    if need.arenas > arena_free:
        raise InsufficientMemory(
            f"{what} needs {_gib(need.arenas)} of arenas in {arena_dir}, which has "
            f"{_gib(arena_free)} free; {fix}, or give the arena directory more space"
        )
