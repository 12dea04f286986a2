"""Where one job's training state lives in shared memory, and which counter means what.

The coordinator creates five arenas per job (docs/runtime.md, "Shared memory") and one event
table; workers map them from the ``JobSetup`` message. Slots are keyed by *layer index*
and by *parity* (iteration or weight version mod 2), never by stage or worker::

    params  per layer, per parameter (tied aliases excluded), compute dtype
              trainable:  [parity 0 | parity 1]   weight version v lives in parity v % 2
                          (one copy that both parities name at staleness 0: Note
                          [weight copies])
              frozen:     one copy (LoRA base weights); with a quantised base, one
                          copy of each part of each quantised weight (Note [quantised
                          base] in roundpipe.shared.quantized_base)
    grads   per trainable parameter, fp32: the current step's weight gradient (+ one per
              tied alias: the tail's LM-head contribution to the owner); layers of the
              same shape share a bounded pool of slots (Note [gradient buffer]); plus,
              for the layers of microbatch-split backward stages, a second slot each
              for the second part (``grads_part``, Note [microbatch-split stages] in
              roundpipe.shared.plan)
    acts    per activation boundary b, per parity, per microbatch: [rows, seq, hidden]
              hidden state entering layer b (compute dtype)
    dacts   per gradient boundary b, per parity, per microbatch: [rows, seq, hidden]
              gradient w.r.t. the hidden state entering layer b (compute dtype)
    io      per parity, per microbatch: input_ids [rows, seq] int64, labels [rows, seq]
              int64, position_ids [rows, seq] int64 (restarting per packed document),
              loss contribution [1] fp32; with a router auxiliary loss also, per layer
              that starts a forward stage, that stage's router statistics [2, experts]
              fp32, and the tail's complete top-k counts [experts] fp32
    events  the event table (roundpipe.shared.events) at DATA_START, then the hand-off
              tickets of the act/dact counters (roundpipe.shared.handoff)

Activation boundaries are the layers that start a forward stage, the tail or a backward
stage (layer 0 excluded: its input is ``io.input_ids``); gradient boundaries are the
layers that start the tail or a backward stage (layer 0 excluded: nothing consumes the
gradient w.r.t. token ids).

Note [slot pools]
~~~~~~~~~~~~~~~~~
Only the acts and dacts arenas depend on the plan, and every slot in one of them has the
same shape. So each is a *pool* of interchangeable slots, ``capacity`` boundaries x 2
parities x M microbatches, and ``assign(plan)`` maps the plan's boundaries onto it. A
re-plan (roundpipe.coordinator.training.trainer) re-assigns the pools once the pipeline has
drained: no arena is re-created, workers see nothing change (tasks carry the
descriptors), and the event-table counters are per layer, so they stay valid too. The
capacity is chosen when the job starts; a plan with more boundaries than that does not
``fit`` and the re-planner does not pick it.

Note [gradient buffer]
~~~~~~~~~~~~~~~~~~~~~~
A layer's gradient lives in the grads arena only from the moment its backward task
writes it until the optimizer has consumed it (``version[l]`` published): in steady
state, a stage or two of layers. So the arena is not one fp32 slot per parameter but,
for each *shape class* (trainable layers whose gradient tensors have the same shapes in
the same order: the decoder layers), a pool of ``grad_buffer_layers`` slots; the class's
layers, ascending, take slots round-robin (layer of rank r in its class -> slot r mod S).
Layers in a class of their own (the embedding, the head, tied owners and aliases) keep a
slot each. The mapping is fixed for the job, so it travels in JobSetup like any other
descriptor and workers see nothing new.

Two layers sharing a slot are ordered by the event table, exactly as a layer's
consecutive gradients already are (Note [weight-update ordering], point 4): a task
writes layer l's gradient for iteration k only after ``version[l'] >= k`` for every
sharer l' above l (written earlier in the same iteration: backward runs last layers
first) and ``version[l'] >= k - 1`` for every sharer below it (last iteration's). A
backward task thus waits for a free slot as it waits for the optimizer. A stage that
writes two layers of the same slot would wait for itself, so every gradient-writing
stage of a plan must map its layers to distinct slots (``fits``); ``grad_buffer_layers``
at least the largest such stage guarantees it.

Global-norm clipping needs every gradient of a step before the first update, and so does
float16 loss scaling's overflow test (Note [dynamic loss scaling] in
roundpipe.coordinator.training.loss_scale), so a job with either keeps one slot per layer
(``grad_buffer_layers=None``). A
bucket of a group's gradient reduction needs all its layers' gradients at once too, so
where slots are shared the reduction takes one layer at a time (Note [gradient buckets]
in roundpipe.coordinator.training.sharded_optimizer).

Note [weight copies]
~~~~~~~~~~~~~~~~~~~
A layer needs two compute-dtype copies only while two of its weight versions can be
read or written at once. With staleness 1 that is every layer, for a whole iteration:
W_{k-1} is written when iteration k-1's backward of layer l has finished, and W_{k-2} is
read until iteration k's backward of layer l has (Note [weight-update ordering]); a
single copy would make iteration k+1's forward of the first layers wait for iteration
k's backward, which is staleness 0's schedule. With staleness 0 the readers of W_{k-1}
are iteration k's own tasks over l, all finished before ``wgrad[l] >= k`` lets the
optimizer write W_k, and iteration k+1 reads only after ``version[l] >= k``: one copy
suffices, and ``weight_copies=1`` makes both parities name it (workers see nothing
new). A task re-run after its outputs were signalled writes nothing (Note [no rewrite
after signal]), so what it reads then does not matter.

Event-table counters (each has one writer; values are iteration numbers, starting at 1,
or weight versions; 0 = nothing yet)::

    act[l][m]     writer: the task producing the input of layer l for microbatch m
                  (the coordinator for l = 0: the batch is in io)
    dact[l][m]    writer: the tail / backward task starting at layer l
    wgrad[l]      writer: the task that writes layer l's gradients (tied aliases of the
                  tail count for the tail layer)
    wgrad_part[l] writer: the second task of a microbatch-split backward stage over l,
                  once it wrote l's ``grads_part``
    version[l]    writer: the optimizer; newest weight version of layer l in params
    landed[c][p]  writer: the writer of act/dact counter c; newest value of parity p
                  whose bytes have landed (act and dact are stored when their copy is
                  issued: roundpipe.shared.handoff)

Their index arithmetic is roundpipe.shared.events.Counters: workers rebuild it from
JobSetup to name counters in their timeout errors. See Note [weight-update ordering] in
roundpipe.coordinator.training.schedule for how these order
the optimizer against the tasks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roundpipe.protocol import ArenaInfo, LayerLayout, NamedTensorRef, TensorRef
from roundpipe.shared.arena import DATA_START, Arena, ArenaAllocator, ArenaDir, prepare_arena_dir
from roundpipe.shared.events import EVENTS_ARENA, Counters, EventTable
from roundpipe.shared.handoff import events_arena_nbytes
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

if TYPE_CHECKING:
    from roundpipe.coordinator.spec.data import GlobalBatch

__all__ = ["JobLayout"]

log = logging.getLogger(__name__)


@dataclass
class JobLayout:
    """Arena descriptors of one job; ``create`` allocates, ``arenas``/``views`` expose them."""

    model: LayeredModel
    plan: Plan
    compute_dtype: torch.dtype
    microbatch_rows: int
    seq_len: int
    num_microbatches: int
    counters: Counters
    # params[layer][name] -> (parity-0 ref, parity-1 ref or None for frozen weights)
    params: dict[int, dict[str, tuple[TensorRef, TensorRef | None]]]
    grads: dict[int, dict[str, TensorRef]]
    act_slots: list[TensorRef]  # the acts pool (Note [slot pools])
    dact_slots: list[TensorRef]  # the dacts pool
    input_ids: dict[tuple[int, int], TensorRef]  # (parity, mb)
    labels: dict[tuple[int, int], TensorRef]
    position_ids: dict[tuple[int, int], TensorRef]
    loss: dict[tuple[int, int], TensorRef]
    sizes: dict[str, int]
    # Router auxiliary loss only (Note [router auxiliary loss], roundpipe.shared.model):
    # (layer, parity, mb) -> the statistics of the forward stage starting at layer (every
    # layer has a row, so a re-plan needs no new slots); (parity, mb) -> the tail's counts.
    router_stats: dict[tuple[int, int, int], TensorRef] = field(default_factory=dict)
    router_counts: dict[tuple[int, int], TensorRef] = field(default_factory=dict)
    grad_slot: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Trainable layer -> (shape class, slot) of its gradients (Note [gradient buffer])."""
    grads_part: dict[int, dict[str, TensorRef]] = field(default_factory=dict)
    """Second gradient slots of the layers a split backward stage may cover (Note
    [microbatch-split stages] in roundpipe.shared.plan); fixed for the job, like the
    pools, so a re-plan can only split stages over these layers (``fits``)."""
    arenas: dict[str, Arena] = field(default_factory=dict)
    space: ArenaDir | None = None
    """The job's private arena directory (Note [private arena directory] in
    roundpipe.shared.arena), while its arenas exist."""
    events: EventTable | None = None
    # (layer, parity, mb) -> slot, for the plan currently assigned
    acts: dict[tuple[int, int, int], TensorRef] = field(default_factory=dict)
    dacts: dict[tuple[int, int, int], TensorRef] = field(default_factory=dict)
    recompute: str = "stage"
    """How backward tasks recompute their stage, for the whole job (Note [recompute
    grain] in roundpipe.worker.executor); the planner's choice, kept by re-plans."""

    # -- planning ---------------------------------------------------------------------

    @classmethod
    def plan_layout(
        cls,
        model: LayeredModel,
        plan: Plan,
        *,
        compute_dtype: torch.dtype,
        microbatch_rows: int,
        seq_len: int,
        num_microbatches: int,
        act_capacity: int | None = None,
        dact_capacity: int | None = None,
        grad_buffer_layers: int | None = None,
        weight_copies: int = 2,
    ) -> JobLayout:
        """Lay out a job for ``plan``. ``act_capacity`` / ``dact_capacity``: how many
        activation / gradient boundaries the slot pools hold (default: exactly what
        ``plan`` needs; more leaves room for a re-plan, Note [slot pools]).
        ``grad_buffer_layers``: gradient slots per shape class (Note [gradient buffer];
        None: one per trainable layer). ``weight_copies``: compute-dtype copies of each
        trainable weight, 2 or 1 (staleness 0 only: Note [weight copies]). The layers
        of ``plan``'s split backward stages get second gradient slots (Note
        [microbatch-split stages] in roundpipe.shared.plan)."""
        if weight_copies not in (1, 2):
            raise ValueError(f"weight_copies must be 1 or 2, got {weight_copies}")
        plan.validate(model.num_layers)
        plan.validate_microbatches(num_microbatches)
        need_a = len(cls.activation_boundaries(plan))
        need_d = len(cls.gradient_boundaries(plan))
        act_capacity = need_a if act_capacity is None else act_capacity
        dact_capacity = need_d if dact_capacity is None else dact_capacity
        if act_capacity < need_a or dact_capacity < need_d:
            raise ValueError(
                f"slot pools of {act_capacity} activation / {dact_capacity} gradient "
                f"boundaries are too small for plan {plan} ({need_a} / {need_d})"
            )
        allocs = {name: ArenaAllocator(name) for name in ("params", "grads", "acts", "dacts", "io")}
        params: dict[int, dict[str, tuple[TensorRef, TensorRef | None]]] = {}
        grads, grad_slot = cls._grad_slots(model, allocs["grads"], grad_buffer_layers)
        grads_part = {
            layer: {
                name: allocs["grads"].alloc(torch.float32, tuple(ref.shape))
                for name, ref in grads[layer].items()
            }
            for layer in sorted(plan.split_gradient_layers())
            if grads[layer]
        }
        quantized = model.quantized_base
        for layer in range(model.num_layers):
            params[layer] = {}
            for spec in model.layer_params(layer):
                if spec.tied_to is not None:
                    continue
                if quantized is not None and spec.name in quantized.shapes:
                    # Frozen and stored quantised: one copy of each part (Note
                    # [quantised base] in roundpipe.shared.quantized_base).
                    for part, (dtype, shape) in quantized.parts(spec.name).items():
                        params[layer][part] = (allocs["params"].alloc(dtype, shape), None)
                    continue
                even = allocs["params"].alloc(compute_dtype, spec.shape)
                odd = None
                if spec.trainable:
                    two = weight_copies == 2
                    odd = allocs["params"].alloc(compute_dtype, spec.shape) if two else even
                params[layer][spec.name] = (even, odd)
        hidden = (microbatch_rows, seq_len, model.hidden_size)
        per_boundary = 2 * num_microbatches  # parities x microbatches
        act_slots = [
            allocs["acts"].alloc(compute_dtype, hidden) for _ in range(act_capacity * per_boundary)
        ]
        dact_slots = [
            allocs["dacts"].alloc(compute_dtype, hidden)
            for _ in range(dact_capacity * per_boundary)
        ]
        input_ids, labels, position_ids, loss = {}, {}, {}, {}
        for parity in (0, 1):
            for mb in range(num_microbatches):
                rows = (microbatch_rows, seq_len)
                input_ids[(parity, mb)] = allocs["io"].alloc(torch.int64, rows)
                labels[(parity, mb)] = allocs["io"].alloc(torch.int64, rows)
                position_ids[(parity, mb)] = allocs["io"].alloc(torch.int64, rows)
                loss[(parity, mb)] = allocs["io"].alloc(torch.float32, (1,))
        router_stats, router_counts = _router_slots(model, allocs["io"], num_microbatches)
        counters = Counters(model.num_layers, num_microbatches)
        sizes = {name: a.nbytes_needed for name, a in allocs.items()}
        sizes[EVENTS_ARENA] = events_arena_nbytes(counters)
        layout = cls(
            model=model,
            plan=plan,
            compute_dtype=compute_dtype,
            microbatch_rows=microbatch_rows,
            seq_len=seq_len,
            num_microbatches=num_microbatches,
            counters=counters,
            params=params,
            grads=grads,
            act_slots=act_slots,
            dact_slots=dact_slots,
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            loss=loss,
            sizes=sizes,
            router_stats=router_stats,
            router_counts=router_counts,
            grad_slot=grad_slot,
            grads_part=grads_part,
        )
        if not layout.fits(plan):
            raise ValueError(
                f"a gradient buffer of {grad_buffer_layers} layers per shape class is too "
                f"small for plan {plan}: a stage writes two layers that share a slot"
            )
        layout.assign(plan)
        return layout

    @staticmethod
    def _grad_slots(
        model: LayeredModel, alloc: ArenaAllocator, buffer_layers: int | None
    ) -> tuple[dict[int, dict[str, TensorRef]], dict[int, tuple[int, int]]]:
        """Gradient refs per layer and each trainable layer's (class, slot) (Note
        [gradient buffer])."""
        tied = set(model.tied_params) | set(model.tied_params.values())
        classes: dict[tuple, list[int]] = {}
        for layer in range(model.num_layers):
            specs = [s for s in model.layer_params(layer) if s.trainable]
            if not specs:
                continue
            if buffer_layers is None or any(s.name in tied for s in specs):
                key: tuple = ("own", layer)  # a class of its own: one slot
            else:
                key = tuple(tuple(s.shape) for s in specs)
            classes.setdefault(key, []).append(layer)
        grads: dict[int, dict[str, TensorRef]] = {layer: {} for layer in range(model.num_layers)}
        grad_slot: dict[int, tuple[int, int]] = {}
        for class_id, members in enumerate(classes.values()):
            num_slots = min(len(members), buffer_layers or len(members))
            slots: list[list[TensorRef]] = []
            for rank, layer in enumerate(members):
                specs = [s for s in model.layer_params(layer) if s.trainable]
                slot = rank % num_slots
                if slot == len(slots):
                    # The tied alias gets a gradient slot of its own (Note [tied embeddings]).
                    slots.append([alloc.alloc(torch.float32, s.shape) for s in specs])
                grads[layer] = {s.name: ref for s, ref in zip(specs, slots[slot])}
                grad_slot[layer] = (class_id, slot)
        return grads, grad_slot

    @staticmethod
    def grad_buffer_layers_for(plan: Plan, stages: int) -> int:
        """Gradient slots per shape class that hold ``stages`` of ``plan``'s largest
        gradient-writing stage (Note [gradient buffer])."""
        widest = max(stop - start for start, stop in (plan.tail, *plan.backward))
        return max(1, stages) * widest

    @property
    def shares_grad_slots(self) -> bool:
        """Whether some layers take turns in one gradient slot (Note [gradient buffer])."""
        return len(set(self.grad_slot.values())) < len(self.grad_slot)

    def tied_gradients(self) -> list[tuple[str, str]]:
        """(alias, owner) of each tied weight whose alias has a gradient slot of its own
        (Note [tied embeddings]): the optimizer adds the two before it updates the owner."""
        layer_of = self.model.layer_of
        return [
            (alias, owner)
            for alias, owner in self.model.tied_params.items()
            if alias in self.grads[layer_of(alias)]
        ]

    def grad_sharers(self, layer: int) -> list[int]:
        """Other layers whose gradients use ``layer``'s slot (Note [gradient buffer])."""
        slot = self.grad_slot.get(layer)
        return [other for other, s in self.grad_slot.items() if s == slot and other != layer]

    @property
    def act_capacity(self) -> int:
        """Activation boundaries the acts pool holds."""
        return len(self.act_slots) // (2 * self.num_microbatches)

    @property
    def dact_capacity(self) -> int:
        """Gradient boundaries the dacts pool holds."""
        return len(self.dact_slots) // (2 * self.num_microbatches)

    def fits(self, plan: Plan) -> bool:
        """Whether ``plan``'s boundaries fit the slot pools (Note [slot pools]), no
        stage writes two layers of one gradient slot (Note [gradient buffer]) and every
        split gradient stage has its second slots (Note [microbatch-split stages])."""
        try:
            plan.validate_microbatches(self.num_microbatches)
        except ValueError:
            return False
        needs_part = {layer for layer in plan.split_gradient_layers() if self.grads[layer]}
        if not needs_part <= set(self.grads_part):
            return False
        for start, stop in (plan.tail, *plan.backward):
            slots = [
                self.grad_slot[layer] for layer in range(start, stop) if layer in self.grad_slot
            ]
            if len(slots) != len(set(slots)):
                return False
        return (
            len(self.activation_boundaries(plan)) <= self.act_capacity
            and len(self.gradient_boundaries(plan)) <= self.dact_capacity
        )

    def assign(self, plan: Plan) -> None:
        """Make ``plan`` the current plan: map its boundaries onto the slot pools. Only
        while no task is in flight (the trainer drains the pipeline first)."""
        plan.validate(self.model.num_layers)
        if not self.fits(plan):
            raise ValueError(
                f"plan {plan} needs {len(self.activation_boundaries(plan))} activation and "
                f"{len(self.gradient_boundaries(plan))} gradient boundaries and distinct "
                "gradient slots per stage (Note [gradient buffer]) and second gradient "
                f"slots for layers {sorted(plan.split_gradient_layers())}; the slot pools "
                f"hold {self.act_capacity} and {self.dact_capacity} boundaries, second "
                f"slots exist for layers {sorted(self.grads_part)} (Note [microbatch-split "
                "stages])"
            )
        m = self.num_microbatches

        def mapping(boundaries: set[int], slots: list[TensorRef]):
            return {
                (b, parity, mb): slots[(2 * i + parity) * m + mb]
                for i, b in enumerate(sorted(boundaries))
                for parity in (0, 1)
                for mb in range(m)
            }

        self.acts = mapping(self.activation_boundaries(plan), self.act_slots)
        self.dacts = mapping(self.gradient_boundaries(plan), self.dact_slots)
        self.plan = plan

    @staticmethod
    def activation_boundaries(plan: Plan) -> set[int]:
        starts = {a for a, _ in plan.forward} | {plan.tail[0]} | {a for a, _ in plan.backward}
        return starts - {0}

    @staticmethod
    def gradient_boundaries(plan: Plan) -> set[int]:
        return ({plan.tail[0]} | {a for a, _ in plan.backward}) - {0}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    # -- allocation -------------------------------------------------------------------

    def create(self, directory: str | Path, namespace: str) -> None:
        """Create the arenas (owner side) and a zeroed event table, in a directory private
        to this job below the arena root ``directory`` (``rp.<namespace>.<pid>.<start>.
        <random>.d``, mode 0700; the root itself when it is private already), which
        :meth:`destroy` removes again (Note [private arena directory] in
        roundpipe.shared.arena)."""
        try:
            self.space = prepare_arena_dir(directory, namespace)
            for name, nbytes in self.sizes.items():
                self.arenas[name] = Arena.create(
                    name, nbytes, directory=self.space.path, namespace=namespace
                )
        except BaseException:
            self.destroy()
            raise
        self.events = EventTable.create(self.arenas[EVENTS_ARENA], DATA_START, self.counters.total)
        self.events.set_labeler(self.counters.label)
        log.info(
            "[layout] %d arenas, %.1f MiB in %s: %s",
            len(self.arenas),
            self.total_bytes / 2**20,
            self.space.path,
            ", ".join(f"{n}={s / 2**20:.1f}MiB" for n, s in self.sizes.items()),
        )

    def destroy(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        for arena in self.arenas.values():
            arena.destroy()
        self.arenas.clear()
        if self.space is not None:
            self.space.close()  # empty now
            self.space = None

    def write_batch(self, parity: int, batch: GlobalBatch) -> None:
        """Copy ``batch``'s token ids, labels and position ids into the io slots of
        ``parity`` (the caller then signals act[0][m])."""
        positions = batch.microbatch_position_ids
        for m, (ids, labels) in enumerate(batch.microbatches):
            self.view(self.input_ids[(parity, m)]).copy_(ids)
            self.view(self.labels[(parity, m)]).copy_(labels)
            self.view(self.position_ids[(parity, m)]).copy_(positions[m])

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arenas[ref.arena].view(ref)

    # -- what workers need ------------------------------------------------------------

    def arena_infos(self) -> list[ArenaInfo]:
        return [
            ArenaInfo(name=name, path=str(arena.path), nbytes=arena.nbytes)
            for name, arena in self.arenas.items()
        ]

    def layer_layouts(self) -> list[LayerLayout]:
        out = []
        for layer in range(self.model.num_layers):
            even = [NamedTensorRef(name=n, ref=r[0]) for n, r in self.params[layer].items()]
            odd = [
                NamedTensorRef(name=n, ref=r[1])
                for n, r in self.params[layer].items()
                if r[1] is not None
            ]
            grads = [NamedTensorRef(name=n, ref=r) for n, r in self.grads[layer].items()]
            part = [
                NamedTensorRef(name=n, ref=r) for n, r in self.grads_part.get(layer, {}).items()
            ]
            out.append(
                LayerLayout(layer=layer, params=even, params_odd=odd, grads=grads, grads_part=part)
            )
        return out

    def trainable_layers(self) -> list[int]:
        """Layers that own at least one gradient slot (the optimizer's work list)."""
        return [layer for layer, g in self.grads.items() if g]


def _router_slots(
    model: LayeredModel, io: ArenaAllocator, num_microbatches: int
) -> tuple[dict[tuple[int, int, int], TensorRef], dict[tuple[int, int], TensorRef]]:
    """The io slots of the router auxiliary loss (none without one)."""
    aux = model.router_aux
    stats: dict[tuple[int, int, int], TensorRef] = {}
    counts: dict[tuple[int, int], TensorRef] = {}
    if aux is None:
        return stats, counts
    for parity in (0, 1):
        for mb in range(num_microbatches):
            counts[(parity, mb)] = io.alloc(torch.float32, (aux.num_experts,))
            for layer in range(model.num_layers - 1):
                stats[(layer, parity, mb)] = io.alloc(torch.float32, (2, aux.num_experts))
    return stats, counts
