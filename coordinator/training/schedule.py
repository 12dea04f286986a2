"""The RoundPipe schedule as data: iteration k of a plan becomes a list of StageTasks.

Each task names every tensor it reads and writes (descriptors into the job's arenas) and
every event-table counter it waits for or stores, so workers synchronise with each other
directly, without a coordinator round trip between stages. Tasks are assigned to workers
round-robin by the trainer; nothing here depends on which worker runs a task, which is
what makes a task idempotent and re-runnable elsewhere.

Note [weight-update ordering]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Weight versions: W_0 initial, W_k = AdamW(W_{k-1}, g_k). Iteration k (k >= 1) computes
g_k on W_v with v = max(k - 1 - staleness, 0):

* staleness 0: v = k - 1, exactly a single-process training loop;
* staleness 1: v = k - 2, the loop that applies each gradient one step late, giving the
  optimizer of step k - 1 a whole iteration to finish.

Orderings, each enforced by an event-table wait (layout in roundpipe.coordinator.training.layout):

1. A task reads layer l's trainable weights of version v only after ``version[l] >= v``
   (the tail also waits for the owner of a tied weight).
2. The optimizer updates layer l for step k once ``wgrad[l] >= k`` (and the tail's
   ``wgrad`` when l owns a tied weight, and ``wgrad_part[l]`` when a split backward
   stage covers l: Note [microbatch-split stages] in roundpipe.shared.plan), writes W_k
   into params parity k % 2, then stores ``version[l] = k``.
3. Parity k % 2 held W_{k-2}. Its readers are iteration k's tasks (staleness 1) or
   iteration k-1's (staleness 0); in both cases they finished reading layer l before
   ``wgrad[l] >= k`` could be stored, so the optimizer never overwrites weights in use.
   At staleness 0 both parities are one buffer (Note [weight copies] in
   roundpipe.coordinator.training.layout): it held W_{k-1}, whose readers are iteration k's own
   tasks, finished by then too.
4. A task writes layer l's gradient slot for iteration k only after ``version[l] >= k-1``:
   the optimizer has consumed g_{k-1}. A slow optimizer throttles the pipeline instead
   of corrupting it. Where layers share a slot (Note [gradient buffer] in
   roundpipe.coordinator.training.layout), also after the optimizer consumed the gradient of
   every sharer written before: ``version[l'] >= k`` above l, ``>= k-1`` below it.
5. Activation and io slots are double-buffered by iteration parity; the trainer sends
   iteration k's tasks (and writes its batch) only after every task of iteration k-2 has
   completed, so a slot is never overwritten before its last reader is done.

Global-norm gradient clipping needs every gradient of step k before any layer can be
updated, so with clipping the optimizer waits for the whole step (still overlapping the
next iteration's forward under staleness 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.protocol import (
    EventSignal,
    EventWait,
    LayerTensorRef,
    MicrobatchIO,
    StageTask,
)

__all__ = ["ScheduleBuilder", "weight_version_for"]

_Real = tuple[int, list[list[int]]] | None
"""ScheduleBuilder.tasks' ``real_tokens``: the global batch's real tokens and those of
each row of this node's microbatches, or None (no padding, or no router loss)."""


def weight_version_for(iteration: int, staleness: int) -> int:
    """Weight version iteration ``iteration`` computes its gradient on."""
    return max(iteration - 1 - staleness, 0)


@dataclass
class ScheduleBuilder:
    """Builds the tasks of one iteration for a job layout."""

    layout: JobLayout
    job_id: str
    staleness: int
    seed: int
    wait_timeout_s: float
    loss_scaling: bool = False
    """float16 loss scaling: tail and backward tasks name the counter holding their
    step's loss scale (Note [dynamic loss scaling] in
    roundpipe.coordinator.training.loss_scale)."""

    def tasks(
        self,
        iteration: int,
        loss_denominator: int,
        first_task_id: int,
        *,
        real_tokens: _Real = None,
    ) -> list[StageTask]:
        """The tasks of iteration ``iteration``. ``real_tokens``: with a router
        auxiliary loss and padding in the batch, the global batch's real tokens and
        those of each row of this node's microbatches (StageTask.router_tokens,
        MicrobatchIO.row_tokens)."""
        k, real = iteration, real_tokens
        tasks: list[StageTask] = []
        for stage in self.layout.plan.stages():
            for part, mbs in enumerate(self._parts(stage.split)):
                task_id = first_task_id + len(tasks)
                if stage.kind == "F":
                    tasks.append(self._forward(k, task_id, stage.start, stage.stop, mbs, real))
                elif stage.kind == "T":
                    tasks.append(self._tail(k, task_id, loss_denominator, real))
                else:
                    tasks.append(
                        self._backward(k, task_id, stage.start, stage.stop, mbs, part, real)
                    )
        return tasks

    def _parts(self, split: int) -> list[range]:
        """The microbatches of each task of a stage (Note [microbatch-split stages] in
        roundpipe.shared.plan): all of them, or [0, split) and [split, M)."""
        m = self.layout.num_microbatches
        return [range(m)] if not split else [range(split), range(split, m)]

    # -- pieces shared by all kinds ---------------------------------------------------

    def _common(
        self, iteration: int, task_id: int, kind: str, start: int, stop: int, real: _Real
    ) -> dict:
        version = weight_version_for(iteration, self.staleness)
        scaled = self.loss_scaling and kind != "forward"
        return dict(
            router_tokens=real[0] if real else 0,
            loss_scale_counter=self.layout.counters.loss_scale(iteration) if scaled else None,
            job_id=self.job_id,
            task_id=task_id,
            attempt=0,
            iteration=iteration,
            kind=kind,
            layer_start=start,
            layer_stop=stop,
            weight_version=version,
            weight_waits=self._weight_waits(start, stop, version),
            seed=self.seed,
            wait_timeout_s=self.wait_timeout_s,
        )

    def _weight_owner_layers(self, start: int, stop: int) -> list[int]:
        """Layers whose trainable weights a task over [start, stop) reads."""
        model = self.layout.model
        layers = set()
        for layer in range(start, stop):
            for spec in model.layer_params(layer):
                if spec.trainable:
                    owner = model.layer_of(spec.tied_to) if spec.tied_to else layer
                    layers.add(owner)
        return sorted(layers)

    def _weight_waits(self, start: int, stop: int, version: int) -> list[EventWait]:
        if version == 0:
            return []  # W_0 is written before any task is sent
        c = self.layout.counters
        return [
            EventWait(counter=c.version(layer), at_least=version)
            for layer in self._weight_owner_layers(start, stop)
        ]

    def _grad_order(self, iteration: int, start: int, stop: int, part: int = 0) -> dict:
        """The ordering of the gradient slots a backward/tail task writes (Note 4); the
        slots themselves are in JobSetup (LayerLayout.grads, or grads_part for ``part``
        1: a second slot of its own per layer, shared with no other layer)."""
        c = self.layout.counters
        model = self.layout.model
        owners, signal_layers = set(), []
        for layer in range(start, stop):
            slots = self.layout.grads[layer]
            if not slots:
                continue
            signal_layers.append(layer)
            for name in slots:
                spec_owner = model.tied_params.get(name)
                owners.add(model.layer_of(spec_owner) if spec_owner else layer)
        # Layer -> the weight version its optimizer must have published (Note 4).
        needed: dict[int, int] = {o: iteration - 1 for o in owners}
        for layer in signal_layers if part == 0 else []:
            for sharer in self.layout.grad_sharers(layer):
                if start <= sharer < stop:
                    continue  # never: a plan's stage maps its layers to distinct slots
                at_least = iteration if sharer > layer else iteration - 1
                needed[sharer] = max(needed.get(sharer, 0), at_least)
        waits = [
            EventWait(counter=c.version(layer), at_least=v)
            for layer, v in sorted(needed.items())
            if v > 0
        ]
        counter = c.wgrad_part if part else c.wgrad
        signals = [EventSignal(counter=counter(layer), value=iteration) for layer in signal_layers]
        return dict(grad_waits=waits, grad_signals=signals, grad_part=part)

    def _input_ref(self, layer: int, parity: int, mb: int):
        if layer == 0:
            return self.layout.input_ids[(parity, mb)]
        return self.layout.acts[(layer, parity, mb)]

    @staticmethod
    def _row_tokens(real: _Real, m: int) -> list[int]:
        """MicrobatchIO.row_tokens of microbatch m (empty: every token is real)."""
        return real[1][m] if real else []

    def _wait(self, index: int, at_least: int) -> EventWait:
        return EventWait(counter=index, at_least=at_least)

    def _signal(self, index: int, value: int) -> EventSignal:
        return EventSignal(counter=index, value=value)

    # -- the three kinds --------------------------------------------------------------

    def _forward(
        self, k: int, task_id: int, start: int, stop: int, microbatches: range, real: _Real
    ) -> StageTask:
        c, p = self.layout.counters, k % 2
        inner = sorted(b for b in self.layout.plan.backward_boundaries() if start < b < stop)
        mbs = []
        for m in microbatches:
            signals = [self._signal(c.act(stop, m), k)] + [
                self._signal(c.act(b, m), k) for b in inner
            ]
            mbs.append(
                MicrobatchIO(
                    index=m,
                    input=self._input_ref(start, p, m),
                    output=self.layout.acts[(stop, p, m)],
                    grad_output=None,
                    labels=None,
                    loss=None,
                    saved=[LayerTensorRef(layer=b, ref=self.layout.acts[(b, p, m)]) for b in inner],
                    waits=[self._wait(c.act(start, m), k)],
                    signals=signals,
                    position_ids=self.layout.position_ids[(p, m)],
                    router_out=self.layout.router_stats.get((start, p, m)),
                    row_tokens=self._row_tokens(real, m),
                )
            )
        return StageTask(
            **self._common(k, task_id, "forward", start, stop, real),
            microbatches=mbs,
            grad_waits=[],
            grad_signals=[],
            loss_denominator=0,
        )

    def _tail(self, k: int, task_id: int, loss_denominator: int, real: _Real) -> StageTask:
        c, p = self.layout.counters, k % 2
        start, stop = self.layout.plan.tail
        mbs = []
        for m in range(self.layout.num_microbatches):
            waits = [self._wait(c.act(start, m), k)]
            if start != 0:
                # Labels come with the batch. (Position ids do too, but every stage reads
                # them after waiting for its input, which follows act[0] transitively.)
                waits.append(self._wait(c.act(0, m), k))
            mbs.append(
                MicrobatchIO(
                    index=m,
                    input=self._input_ref(start, p, m),
                    output=self.layout.dacts[(start, p, m)] if start else None,
                    grad_output=None,
                    labels=self.layout.labels[(p, m)],
                    loss=self.layout.loss[(p, m)],
                    saved=[],
                    waits=waits,
                    signals=[self._signal(c.dact(start, m), k)] if start else [],
                    position_ids=self.layout.position_ids[(p, m)],
                    # Note [router auxiliary loss]: the forward stages' statistics in, the
                    # counts out for the backward stages (none when there are none).
                    router_in=[
                        self.layout.router_stats[(a, p, m)]
                        for a, _ in self.layout.plan.forward
                        if (a, p, m) in self.layout.router_stats
                    ],
                    router_out=self.layout.router_counts.get((p, m)) if start else None,
                    row_tokens=self._row_tokens(real, m),
                )
            )
        return StageTask(
            **self._common(k, task_id, "tail", start, stop, real),
            microbatches=mbs,
            **self._grad_order(k, start, stop),
            loss_denominator=loss_denominator,
        )

    def _backward(
        self,
        k: int,
        task_id: int,
        start: int,
        stop: int,
        microbatches: range,
        part: int,
        real: _Real,
    ) -> StageTask:
        c, p = self.layout.counters, k % 2
        mbs = []
        for m in microbatches:
            mbs.append(
                MicrobatchIO(
                    index=m,
                    input=self._input_ref(start, p, m),
                    output=self.layout.dacts[(start, p, m)] if start else None,
                    grad_output=self.layout.dacts[(stop, p, m)],
                    labels=None,
                    loss=None,
                    saved=[],
                    waits=[self._wait(c.act(start, m), k), self._wait(c.dact(stop, m), k)],
                    signals=[self._signal(c.dact(start, m), k)] if start else [],
                    position_ids=self.layout.position_ids[(p, m)],
                    router_in=[self.layout.router_counts[(p, m)]]
                    if (p, m) in self.layout.router_counts
                    else [],
                    row_tokens=self._row_tokens(real, m),
                )
            )
        return StageTask(
            **self._common(k, task_id, "backward", start, stop, real),
            microbatches=mbs,
            **self._grad_order(k, start, stop, part),
            loss_denominator=0,
            # Note [recompute grain] (roundpipe.worker.executor); absent: stage grain.
            options={"recompute": "layer"} if self.layout.recompute == "layer" else {},
        )
