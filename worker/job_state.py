"""What a worker keeps per job, and the copies of a task in flight.

A worker is stateless between jobs: :class:`JobState` is built from the ``JobSetup``
message alone (arena mappings, the model skeleton on the meta device, the executor,
views of every layer's weight and gradient slots) and dropped at ``JobTeardown``.
:class:`TaskCopies` follows one task's uploads and downloads until all have landed:
the runtime reports the task only then, and a teardown waits for them before it unmaps
the job's arenas.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from roundpipe.protocol import JobSetup, StageTask, TensorRef, name_to_dtype
from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EVENTS_ARENA, Counters, EventTable
from roundpipe.shared.handoff import HandoffBoard
from roundpipe.shared.model import LayeredModel
from roundpipe.worker.executor import StageExecutor
from roundpipe.worker.transfer import Transfer, TransferEngine

__all__ = ["JobState", "TaskCopies"]


@dataclass
class JobState:
    """What a worker keeps of one job: its arenas, its model skeleton and executor, its
    event table and hand-off board, and views of every layer's weight and gradient slots."""

    setup: JobSetup
    model: LayeredModel
    executor: StageExecutor
    arenas: dict[str, Arena]
    events: EventTable
    handoffs: HandoffBoard
    # layer -> (parity-0 name->view, parity-1 overrides name->view)
    weights: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    # layer -> its gradient slots, name -> view (JobSetup's LayerLayout.grads)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # layer -> its second gradient slots (LayerLayout.grads_part; split stages only)
    grads_part: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # copies of this job's tasks still in flight: teardown waits for them before unmapping
    inflight: set[TaskCopies] = field(default_factory=set)

    @classmethod
    def open(cls, setup: JobSetup, device: torch.device, engine: TransferEngine) -> JobState:
        """Map the job's arenas (registered with ``engine``), build its model skeleton and
        executor for ``device``, and view its slots. On failure nothing stays mapped."""
        arenas: dict[str, Arena] = {}
        try:
            for info in setup.arenas:
                # Only a regular file of this user (the coordinator's), mode 0600, and no
                # link (Note [private arena directory] in roundpipe.shared.arena).
                arenas[info.name] = Arena.attach(info.path)
            model = LayeredModel.from_config(dict(setup.model_config), setup.lora)
            dtype = name_to_dtype(setup.compute_dtype)
            executor = StageExecutor(model, device, dtype)
            engine.register(arenas.values())
            events = EventTable(arenas[EVENTS_ARENA], DATA_START)
            counters = Counters(model.num_layers, setup.num_microbatches)
            # Name counters in timeout errors the way the coordinator does.
            events.set_labeler(counters.label)
            handoffs = HandoffBoard(events, counters)
            state = cls(setup, model, executor, arenas, events, handoffs)
            for layout in setup.layers:
                even = {p.name: state.view(p.ref) for p in layout.params}
                odd = {p.name: state.view(p.ref) for p in layout.params_odd}
                state.weights[layout.layer] = (even, odd)
                state.grads[layout.layer] = {g.name: state.view(g.ref) for g in layout.grads}
                state.grads_part[layout.layer] = {
                    g.name: state.view(g.ref) for g in layout.grads_part
                }
        except BaseException:
            engine.unregister(arenas.values())
            for arena in arenas.values():
                arena.close()
            raise
        return state

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arenas[ref.arena].view(ref)

    def grad_slots(self, start: int, stop: int, part: int = 0) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, slot view) of every gradient slot of layers [start, stop):
        the first slots, or the second ones for ``part`` 1 (a split stage's second task)."""
        if part:
            missing = [
                layer
                for layer in range(start, stop)
                if self.grads.get(layer) and not self.grads_part.get(layer)
            ]
            if missing:
                raise ValueError(
                    f"a task writes the second gradient part of layers {missing}, which "
                    "JobSetup gave no second slots (LayerLayout.grads_part)"
                )
        slots = self.grads_part if part else self.grads
        return [(n, v) for layer in range(start, stop) for n, v in slots.get(layer, {}).items()]

    def task_weights(self, task: StageTask) -> dict[str, torch.Tensor]:
        """Name -> slot view of every weight ``task``'s layers compute with: trainable ones
        from the params parity of its weight version, tied ones from their owner's layer."""
        odd = task.weight_version % 2 == 1
        model = self.model
        out: dict[str, torch.Tensor] = {}

        def lookup(layer: int, name: str) -> torch.Tensor:
            even_views, odd_views = self.weights[layer]
            if odd and name in odd_views:
                return odd_views[name]
            return even_views[name]

        quantized = model.quantized_base
        for layer in range(task.layer_start, task.layer_stop):
            for spec in model.layer_params(layer):
                if quantized is not None and spec.name in quantized.shapes:
                    # Uploaded as its quantised parts; the executor dequantises (Note
                    # [quantised base] in roundpipe.shared.quantized_base).
                    for part in quantized.parts(spec.name):
                        out[part] = lookup(layer, part)
                elif spec.tied_to is None:
                    out[spec.name] = lookup(layer, spec.name)
                else:
                    out[spec.name] = lookup(model.layer_of(spec.tied_to), spec.tied_to)
        return out

    def close(self) -> None:
        self.handoffs.close()
        self.events.close()
        self.weights.clear()
        for arena in self.arenas.values():
            arena.close()


class TaskCopies:
    """The copies of one task: when all have landed, and what they cost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: list[tuple[Transfer, bool]] = []

    def add(self, transfer: Transfer, *, up: bool) -> None:
        with self._lock:
            self._transfers.append((transfer, up))

    def cancel(self) -> None:
        for t, up in list(self._transfers):
            if up:
                t.cancel()

    def wait_all(self) -> None:
        for t, _ in list(self._transfers):
            try:
                t.wait()
            except Exception:  # noqa: BLE001 - the task fails anyway; its error is raised
                pass

    def when_all_landed(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(first copy error or None)`` once, after every copy landed."""
        with self._lock:
            transfers = [t for t, _ in self._transfers]
        left = [len(transfers) + 1]  # +1: the registration itself, so it fires once
        lock = threading.Lock()

        def one_landed() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback(next((t.error for t in transfers if t.error is not None), None))

        for t in transfers:
            t.then(one_landed, always=True)
        one_landed()

    def _sum(self, up: bool, what: str) -> float:
        return sum(getattr(t, what) for t, u in self._transfers if u == up)

    @property
    def upload_s(self) -> float:
        return self._sum(True, "link_s")

    @property
    def download_s(self) -> float:
        return self._sum(False, "link_s")

    @property
    def upload_bytes(self) -> int:
        return int(self._sum(True, "nbytes"))

    @property
    def download_bytes(self) -> int:
        return int(self._sum(False, "nbytes"))
