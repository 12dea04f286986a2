"""The structs used inside messages, never sent alone, and the dtype names they carry.

Tensor data never travels on a socket: messages carry :class:`TensorRef` descriptors
(arena, offset, dtype, shape, stride) into shared-memory arenas that every process maps
(docs/architecture.md, "Processes"; docs/runtime.md, "Shared memory"). A struct inside a
message travels as the array of its field values (roundpipe.protocol.codec, "Frames").

Field-by-field documentation lives on the classes below, one comment line per field; the
class *is* the schema.

Descriptors of tensors and arenas (JobSetup, StageTask)
    TensorRef       where a tensor lives: arena, offset, dtype, shape, stride
    NamedTensorRef  a TensorRef with a parameter name
    ArenaInfo       one shared-memory arena of a job: name, file, size
    LayerLayout     where one layer's weights and gradient slots live
    LayerTensorRef  a TensorRef that belongs to one layer (a saved layer input)

Event-table counters (StageTask)
    EventWait       block until a counter reaches a value
    EventSignal     store a value into a counter

Stage tasks (StageTask)
    MicrobatchIO    everything one microbatch of a task reads, writes, waits for and signals

Client replies (WorkerList, Progress)
    WorkerInfo      one worker as the coordinator sees it
    ProgressEvent   one optimizer step of a job
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from msgspec import field

from roundpipe.protocol.schema import (
    Int64,
    Name,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    ProtocolError,
    Struct,
    declare_struct,
    describe,
    invalid_field,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_NAMES",
    "dtype_to_name",
    "name_to_dtype",
    "dtype_itemsize",
    "TensorRef",
    "NamedTensorRef",
    "ArenaInfo",
    "LayerLayout",
    "EventWait",
    "EventSignal",
    "WorkerInfo",
    "ProgressEvent",
    "LayerTensorRef",
    "MicrobatchIO",
]

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]
ComputeDTypeName = Literal["float32", "float16", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(DTypeName)
"""dtype names a :class:`TensorRef` may carry."""

# --------------------------------------------------------------------------- dtypes

_DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
assert set(_DTYPE_ITEMSIZE) == set(DTYPE_NAMES)


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype name; no torch import needed."""
    try:
        return _DTYPE_ITEMSIZE[name]
    except (KeyError, TypeError):
        raise ProtocolError(
            f"unknown dtype name {name!r}; allowed: {', '.join(DTYPE_NAMES)}"
        ) from None


def dtype_to_name(dtype: torch.dtype) -> str:
    """torch dtype -> wire name, e.g. torch.bfloat16 -> "bfloat16"."""
    # torch is imported lazily so clients (the CLI) can speak the protocol without it.
    import torch

    name = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, torch.dtype) or name not in _DTYPE_ITEMSIZE:
        raise ProtocolError(
            f"dtype {dtype!r} cannot be described by a TensorRef; allowed: "
            + ", ".join(DTYPE_NAMES)
        )
    return name


def name_to_dtype(name: str) -> torch.dtype:
    """Wire name -> torch dtype, e.g. "bfloat16" -> torch.bfloat16."""
    import torch

    dtype_itemsize(name)  # raises ProtocolError for names outside DTYPE_NAMES
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


# --------------------------------------------------------------------------- tensors and arenas


@declare_struct
class TensorRef(Struct):
    """Where a tensor lives: a strided view into a shared-memory arena. Never the data.

    Element (i0, i1, ...) is at byte ``offset + itemsize * sum(i_k * stride[k])`` of the
    arena (strides in elements, as in torch). Whether the view fits inside the arena is
    checked by the shared-memory module, which knows the arena's size.

    A row-major (C-contiguous) view, which every arena slot is, carries ``stride=None``:
    a StageTask holds ~30 descriptors, and their stride tuples were a fifth of the
    objects a worker built to decode one. ``full_stride`` is the stride either way.
    """

    #: arena name, as listed in JobSetup.arenas (e.g. "acts", "params0", "grads")
    arena: Name
    #: byte offset of element (0, ..., 0) from the start of the arena
    offset: NonNegInt
    #: element type, one of DTYPE_NAMES
    dtype: DTypeName
    #: size of each dimension; () is a scalar
    shape: tuple[NonNegInt, ...]
    #: elements to step per dimension, same length as shape; None for a row-major
    #: (C-contiguous) view
    stride: tuple[NonNegInt, ...] | None

    def _check(self) -> None:
        if self.stride is not None and len(self.stride) != len(self.shape):
            raise invalid_field(
                "stride",
                f"tuple of {len(self.shape)} ints (one per shape dimension) or None",
                describe(self.stride),
            )

    @classmethod
    def contiguous(cls, *, arena: str, offset: int, dtype: str, shape: Sequence[int]) -> TensorRef:
        """A row-major (C-contiguous) view of `shape` at `offset`."""
        return cls(arena=arena, offset=offset, dtype=dtype, shape=tuple(shape), stride=None)

    @property
    def full_stride(self) -> tuple[int, ...]:
        """Elements to step per dimension: `stride`, or the row-major stride of `shape`
        when `stride` is None."""
        if self.stride is not None:
            return self.stride
        strides: list[int] = []
        step = 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= max(size, 1)
        return tuple(reversed(strides))

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def end_byte(self) -> int:
        """One past the last byte the view touches (== offset for an empty tensor): the
        arena must be at least this large."""
        if 0 in self.shape:
            return self.offset
        last = sum((size - 1) * step for size, step in zip(self.shape, self.full_stride))
        return self.offset + (last + 1) * _DTYPE_ITEMSIZE[self.dtype]


@declare_struct
class NamedTensorRef(Struct):
    """A tensor with a stable name (a parameter or its gradient)."""

    #: fully qualified parameter name, e.g. "model.layers.3.mlp.up_proj.weight"
    name: Name
    #: where it lives
    ref: TensorRef


@declare_struct
class ArenaInfo(Struct):
    """One shared-memory arena of a job, for workers to map."""

    #: arena name that TensorRef.arena refers to
    name: Name
    #: file to map: in the job's private directory below the coordinator's arena root
    #: (e.g. /dev/shm/roundpipe/rp.<ns>.<pid>.<start>.<random>.d/<random name>)
    path: Name
    #: size of the mapping in bytes
    nbytes: NonNegInt


@declare_struct
class LayerLayout(Struct):
    """Where one layer's weights live. Slots are keyed by layer, not by stage, so a new
    partition needs no new layout (docs/runtime.md, "Shared memory")."""

    #: layer index: 0 = prefix (embedding), 1..n-2 = decoder layers, n-1 = tail
    layer: NonNegInt
    #: every weight of the layer; trainable ones in buffer 0 of params[2], frozen ones
    #: in the "frozen" arena
    params: list[NamedTensorRef]
    #: trainable weights in buffer 1 of params[2] (odd weight versions), same names as
    #: in `params`; empty when nothing is trainable or params are not double-buffered
    params_odd: list[NamedTensorRef] = field(default_factory=list)
    #: fp32 gradient slot of every trainable weight of the layer (name = parameter name;
    #: a tied alias has its own): a backward or tail task over the layer writes each one
    #: once, at its end, after its grad_waits
    grads: list[NamedTensorRef] = field(default_factory=list)
    #: second fp32 gradient slot of every trainable weight, same names as `grads`: where
    #: the second task of a microbatch-split backward stage writes (StageTask.grad_part
    #: 1); empty for layers no plan of the job splits that way
    grads_part: list[NamedTensorRef] = field(default_factory=list)


@declare_struct
class EventWait(Struct):
    """Block until an event-table counter reaches a value (docs/runtime.md, "The event
    table")."""

    #: index of the 64-bit counter in the events arena
    counter: NonNegInt
    #: wait until counter >= at_least
    at_least: Int64


@declare_struct
class EventSignal(Struct):
    """Store a value into an event-table counter after the task's writes are visible."""

    #: index of the 64-bit counter in the events arena (this task is its single writer)
    counter: NonNegInt
    #: value to store
    value: Int64


# --------------------------------------------------------------------------- stage tasks


@declare_struct
class LayerTensorRef(Struct):
    """A tensor that belongs to one layer, e.g. the saved input of a layer."""

    #: layer index (as in LayerLayout.layer)
    layer: NonNegInt
    #: where it lives
    ref: TensorRef


@declare_struct
class MicrobatchIO(Struct):
    """Everything one microbatch of a StageTask reads, writes, waits for and signals.

    A worker streams a task microbatch by microbatch: it waits for a microbatch's
    `waits`, reads its inputs, writes its outputs and stores its `signals` before it
    moves on, so the next stage can start on that microbatch at once. Which of the
    optional refs are present depends on StageTask.kind (checked by StageTask).
    """

    #: microbatch index within the global batch
    index: NonNegInt
    #: the stage input of this microbatch: token ids when the stage starts at layer 0 and
    #: is forward or tail, else hidden states; for a backward stage the saved input of
    #: its first layer
    input: TensorRef
    #: forward: the stage output (hidden states for the next stage); backward/tail: the
    #: gradient w.r.t. the stage input (None when the stage starts at layer 0)
    output: TensorRef | None
    #: backward only: the gradient w.r.t. the stage output
    grad_output: TensorRef | None
    #: tail only: the labels
    labels: TensorRef | None
    #: tail only: where the microbatch's loss contribution (fp32) is written
    loss: TensorRef | None
    #: forward only: inputs of layers strictly inside (layer_start, layer_stop) that start
    #: a backward stage, to be kept for recompute
    saved: list[LayerTensorRef]
    #: counters to wait for before reading this microbatch's inputs or overwriting its
    #: outputs
    waits: list[EventWait]
    #: counters to store once this microbatch's outputs are written
    signals: list[EventSignal]
    #: position ids [rows, seq] int64 of the microbatch (restarting at every packed
    #: document: the model's rotary positions and its block-diagonal causal mask);
    #: None: 0..seq-1 in every row. Written with the batch, like the token ids.
    position_ids: TensorRef | None = None
    #: router auxiliary loss only (Note [router auxiliary loss] in roundpipe.shared.model):
    #: forward: where this stage's fp32 [2, experts] router statistics of the microbatch
    #: (top-k counts, router-probability sums) go; tail: where the complete top-k counts
    #: [experts] go, for the backward stages. Written before the microbatch's signals.
    router_out: TensorRef | None = None
    #: tail: every forward stage's statistics ([2, experts] each); backward: the tail's
    #: counts ([experts]). Empty without a router auxiliary loss.
    router_in: list[TensorRef] = field(default_factory=list)
    #: router auxiliary loss only: the real (not padding) tokens at the start of each of
    #: the microbatch's rows, which alone the loss counts (as transformers does given the
    #: attention mask). Empty: every token is real.
    row_tokens: list[PosInt] = field(default_factory=list)

    def _check(self) -> None:
        if self.loss is not None and self.loss.dtype != "float32":
            raise invalid_field(
                "loss.dtype",
                "'float32' (the loss is accumulated in fp32)",
                describe(self.loss.dtype),
            )
        if len(self.saved) > 1:
            layers = [s.layer for s in self.saved]
            if len(set(layers)) != len(layers):
                raise invalid_field(
                    "saved", "one entry per layer (distinct layers)", describe(layers)
                )


# --------------------------------------------------------------------------- client replies


@declare_struct
class WorkerInfo(Struct):
    """One worker as the coordinator sees it."""

    #: Welcome.worker_id
    worker_id: NonNegInt
    #: Hello.worker_name
    name: Name
    #: Hello.device
    device: Literal["cpu", "cuda"]
    #: Hello.device_name
    device_name: str
    #: Hello.memory_bytes
    memory_bytes: NonNegInt
    #: idle, running a task, or lost (heartbeat missed; its tasks were reassigned)
    state: Literal["idle", "busy", "lost"]
    #: tasks completed since it joined
    tasks_done: NonNegInt
    #: Hello.h2d_bytes_per_s: host-to-device bandwidth measured at start-up
    h2d_bytes_per_s: PosFloat | None = None
    #: Hello.d2h_bytes_per_s
    d2h_bytes_per_s: PosFloat | None = None
    #: the task it runs now, e.g. "step 12 B1 [0:2]"; empty when idle
    current_task: str = ""


@declare_struct
class ProgressEvent(Struct):
    """One optimizer step of a job."""

    #: position in the job's event stream, 1, 2, ...
    seq: NonNegInt
    #: optimizer step just completed
    step: NonNegInt
    #: training loss of the step (may be NaN if training diverged)
    loss: float
    #: training throughput over the step
    tokens_per_s: NonNegFloat
    #: learning rate used for the step
    lr: float
    #: time.time() when the step completed
    time: float
    #: seconds the coordinator's optimizer spent updating the weights (not waiting for
    #: gradients) in the newest optimizer step finished when this event was made: this
    #: step, or under staleness 1 usually the one before; 0.0 before any
    optimizer_s: NonNegFloat = 0.0
