"""RoundPipe wire protocol: the message catalogue, one class per message type.

Everything a RoundPipe process sends over ZeroMQ -- coordinator, workers, clients -- is
a *message* encoded by :func:`encode` and read back by :func:`decode`. There is no other
encode/decode path. Tensor data never travels on a socket: messages carry
:class:`TensorRef` descriptors (arena, offset, dtype, shape, stride) into shared-memory
arenas that every process maps (ARCHITECTURE.md sections 2 and 3).

How a message becomes a frame (header, limits, errors) is roundpipe.protocol.codec;
how a class becomes a validated record is roundpipe.protocol.schema.

Version rule
============

:data:`PROTOCOL_VERSION` is one integer for the whole protocol. Any change to any
message -- a field added, removed, renamed or retyped, a new message type, a changed
meaning, a changed limit that a valid sender could hit -- bumps it. Peers must match
exactly: there is no negotiation and no compatibility window, because coordinator and
workers are installed together from one package. The header layout (b"RP" + uint16)
never changes, so every version can read every other version's number.

A header with another version makes :func:`decode` raise :class:`ProtocolVersionError`
carrying ``seen_version``, ``expected_version`` and, when the type name is readable, the
``message_type``. The handshake uses it: the coordinator answers a worker's mismatched
``Hello`` with a ``Reject(expected_version=...)`` encoded at the coordinator's own
version; the worker cannot read that body, but decoding it raises
``ProtocolVersionError(seen_version=<coordinator's>, message_type="Reject")``, which is
exactly what the worker must report before it exits.

Messages
========

Field-by-field documentation lives on the classes below, one comment line per field; the
class *is* the schema. Direction: W = worker, C = coordinator, K = client.

Handshake (W -> C, C -> W)
    Hello        W -> C   first message of a worker: identity, device, memory
    Welcome      C -> W   accepted; the worker's id and heartbeat interval
    Reject       C -> W   refused (version mismatch, duplicate worker, shutting down)

Jobs to workers (C -> W)
    JobSetup     C -> W   model config, LoRA settings, arenas and per-layer weight layout
    JobTeardown  C -> W   forget everything about a job

Stage tasks (C -> W, W -> C)
    StageTask    C -> W   run layers [layer_start, layer_stop) over its microbatches,
                          one MicrobatchIO at a time
    TaskDone     W -> C   the task's outputs are written and its signals stored
    TaskFailed   W -> C   the task raised; whether a retry elsewhere may succeed

Liveness and control (both directions)
    Heartbeat    W <-> C  liveness ping, answered by a dedicated thread
    Shutdown     C -> W   stop: drop all state and exit (the reason goes to the log)

Client API (K -> C requests, C -> K replies)
    SubmitJob    K -> C   a job spec;                     reply JobAccepted or ErrorReply
    JobAccepted  C -> K   the new job's id
    GetJobStatus K -> C   one job's state;                reply JobStatus or ErrorReply
    JobStatus    C -> K   state, step, loss of a job
    CancelJob    K -> C   cancel a job;                   reply Ack or ErrorReply
    ResumeJob    K -> C   re-queue a stopped job from its newest checkpoint;
                                                          reply Ack or ErrorReply
    ListJobs     K -> C   one page of jobs, from a position;  reply JobList
    JobList      C -> K   a JobStatus per job of the page, where the next page starts
    ListWorkers  K -> C   one page of workers, after an id;   reply WorkerList
    WorkerList   C -> K   a WorkerInfo per worker of the page, whether more follow
    GetProgress  K -> C   progress events after a seq;    reply Progress or ErrorReply
    Progress     C -> K   a page of ProgressEvents in seq order, whether the job has ended
    GetJobLog    K -> C   a job's log from a byte offset; reply JobLog or ErrorReply
    JobLog       C -> K   up to 256 KiB of the log (whole lines), where the next piece starts

Replies are bounded: the coordinator fills a page up to :data:`MAX_REPLY_BYTES` (at least
one item), so no amount of history, no number of workers and no length of a peer's
strings can make a reply the encoder refuses; the client asks for the next page.
    ErrorReply   C -> K   a request failed: machine-readable code and a message
    Ack          C -> K   a request succeeded and has nothing to return

Records used inside messages (never sent alone): TensorRef, NamedTensorRef, ArenaInfo,
LayerLayout, EventWait, EventSignal, LayerTensorRef, MicrobatchIO, WorkerInfo,
ProgressEvent.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from msgspec import field

from roundpipe.protocol.schema import (
    Message,
    Name,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    ProtocolError,
    Struct,
    UInt16,
    _fail,
    _Invalid,
    _message,
    _seen,
    _struct,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_REPLY_BYTES",
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
    "Hello",
    "Welcome",
    "Reject",
    "JobSetup",
    "JobTeardown",
    "StageTask",
    "TaskDone",
    "TaskFailed",
    "Heartbeat",
    "Shutdown",
    "SubmitJob",
    "JobAccepted",
    "GetJobStatus",
    "JobStatus",
    "CancelJob",
    "ResumeJob",
    "ListJobs",
    "JobList",
    "JobLog",
    "ListWorkers",
    "WorkerList",
    "GetJobLog",
    "GetProgress",
    "Progress",
    "ERROR_CODES",
    "ErrorCode",
    "FINAL_JOB_STATES",
    "JOB_STATES",
    "JobState",
    "STOPPED_JOB_STATES",
    "ErrorReply",
    "Ack",
]

PROTOCOL_VERSION: int = 12
"""Bump on any change to any message (see "Version rule" above)."""

MAX_REPLY_BYTES: int = 1024 * 1024
"""Budget of one page of a list reply (JobList, WorkerList, Progress): the coordinator
adds items while their encoded size fits (always at least one). Far below
DEFAULT_MAX_BODY_BYTES, so a page is always encodable, and small enough to answer fast."""

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


# --------------------------------------------------------------------------- records


@_struct
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
            raise _fail(
                "stride",
                f"tuple of {len(self.shape)} ints (one per shape dimension) or None",
                _seen(self.stride),
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


@_struct
class NamedTensorRef(Struct):
    """A tensor with a stable name (a parameter or its gradient)."""

    #: fully qualified parameter name, e.g. "model.layers.3.mlp.up_proj.weight"
    name: Name
    #: where it lives
    ref: TensorRef


@_struct
class ArenaInfo(Struct):
    """One shared-memory arena of a job, for workers to map."""

    #: arena name that TensorRef.arena refers to
    name: Name
    #: file to map: in the job's private directory below the coordinator's arena root
    #: (e.g. /dev/shm/roundpipe/rp.<ns>.<pid>.<start>.<random>.d/<random name>)
    path: Name
    #: size of the mapping in bytes
    nbytes: NonNegInt


@_struct
class LayerLayout(Struct):
    """Where one layer's weights live. Slots are keyed by layer, not by stage, so a new
    partition needs no new layout (ARCHITECTURE.md section 3)."""

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


@_struct
class EventWait(Struct):
    """Block until an event-table counter reaches a value (ARCHITECTURE.md section 5)."""

    #: index of the 64-bit counter in the events arena
    counter: NonNegInt
    #: wait until counter >= at_least
    at_least: int


@_struct
class EventSignal(Struct):
    """Store a value into an event-table counter after the task's writes are visible."""

    #: index of the 64-bit counter in the events arena (this task is its single writer)
    counter: NonNegInt
    #: value to store
    value: int


# --------------------------------------------------------------------------- handshake


@_message
class Hello(Message):
    """First message of a worker to the coordinator."""

    #: must equal PROTOCOL_VERSION (the header carries it too; repeated for logs)
    protocol_version: UInt16 = PROTOCOL_VERSION
    #: stable worker name, e.g. "rp-worker-3"
    worker_name: Name
    #: host the worker runs on
    hostname: str
    #: OS process id of the worker
    pid: NonNegInt
    #: process start time (psutil create_time); with pid, tells a restart from a reconnect
    process_create_time: float
    #: kind of device the worker computes on
    device: Literal["cpu", "cuda"]
    #: CUDA device ordinal; None for a CPU worker
    device_index: NonNegInt | None
    #: human-readable device name, e.g. "NVIDIA GeForce RTX 4090" or the CPU model
    device_name: str
    #: usable device memory in bytes (host memory for a CPU worker)
    memory_bytes: NonNegInt
    #: CUDA compute capability "major.minor", e.g. "8.9"; None for a CPU worker
    compute_capability: str | None
    #: host-to-device bytes/s measured at start-up (pinned; the emulated bus's setting
    #: for a CPU worker with --emulate-pcie); None when nothing crosses a bus
    h2d_bytes_per_s: PosFloat | None = None
    #: device-to-host bytes/s, measured likewise
    d2h_bytes_per_s: PosFloat | None = None

    def _check(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise _fail(
                "protocol_version",
                f"{PROTOCOL_VERSION} (this process's PROTOCOL_VERSION)",
                _seen(self.protocol_version),
            )
        if (self.device == "cuda") != (self.device_index is not None):
            expected = "an int for a cuda device" if self.device == "cuda" else "None for cpu"
            raise _fail("device_index", expected, _seen(self.device_index))


@_message
class Welcome(Message):
    """The coordinator accepted a worker."""

    #: id the coordinator assigned; used in TaskDone/TaskFailed and the event table
    worker_id: NonNegInt
    #: unique per coordinator process; a new value means the coordinator restarted
    coordinator_id: Name
    #: how often each side sends Heartbeat
    heartbeat_interval_s: PosFloat
    #: directory holding the arena files
    arena_dir: str


@_message
class Reject(Message):
    """The coordinator refused a worker; the worker reports `reason` and exits."""

    #: why, for the worker's log
    reason: str
    #: the coordinator's PROTOCOL_VERSION
    expected_version: UInt16


# --------------------------------------------------------------------------- jobs to workers


@_message
class JobSetup(Message):
    """Everything a worker needs before it can run a job's stage tasks."""

    #: job id
    job_id: Name
    #: model architecture config (a Hugging Face config.json as a map) to build layer
    #: skeletons on the meta device
    model_config: dict[str, Any]
    #: LoRA settings (peft LoraConfig fields), or None for full fine-tuning
    lora: dict[str, Any] | None
    #: dtype the layers compute in
    compute_dtype: ComputeDTypeName
    #: arenas to map, each exactly once
    arenas: list[ArenaInfo]
    #: weight and gradient layout of every layer, in layer order
    layers: list[LayerLayout]
    #: microbatches per iteration; with len(layers) it fixes the layout of the event
    #: table's counters (roundpipe.shared.events.Counters), which EventWait and
    #: EventSignal refer to by index and timeout errors name
    num_microbatches: PosInt

    def _check(self) -> None:
        names = [a.name for a in self.arenas]
        if len(set(names)) != len(names):
            raise _fail("arenas", "arenas with distinct names", _seen(names))
        known = set(names)
        for i, layout in enumerate(self.layers):
            refs_by_key = (
                ("params", layout.params),
                ("params_odd", layout.params_odd),
                ("grads", layout.grads),
            )
            for key, refs in refs_by_key:
                for j, named in enumerate(refs):
                    if named.ref.arena not in known:
                        raise _fail(
                            f"layers[{i}].{key}[{j}].ref.arena",
                            "the name of an arena listed in arenas",
                            _seen(named.ref.arena),
                        )


@_message
class JobTeardown(Message):
    """Forget a job: drop its layer skeletons, unmap its arenas."""

    #: job id
    job_id: Name


# --------------------------------------------------------------------------- stage tasks


@_struct
class LayerTensorRef(Struct):
    """A tensor that belongs to one layer, e.g. the saved input of a layer."""

    #: layer index (as in LayerLayout.layer)
    layer: NonNegInt
    #: where it lives
    ref: TensorRef


@_struct
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

    def _check(self) -> None:
        if self.loss is not None and self.loss.dtype != "float32":
            raise _fail(
                "loss.dtype", "'float32' (the loss is accumulated in fp32)", _seen(self.loss.dtype)
            )
        if len(self.saved) > 1:
            layers = [s.layer for s in self.saved]
            if len(set(layers)) != len(layers):
                raise _fail("saved", "one entry per layer (distinct layers)", _seen(layers))


@_message
class StageTask(Message):
    """Run layers [layer_start, layer_stop) over `microbatches`, one after the other.

    Idempotent: a retry (attempt + 1, maybe on another worker) makes the same writes.

    kind "forward": per microbatch read `input`, write `output` (and the `saved` layer
    inputs); no gradients. kind "tail": forward + loss + backward of the last stage, per
    microbatch `labels` in, `loss` and (unless the stage starts at layer 0) the input
    gradient `output` out. kind "backward": recompute from the saved `input`, then
    backward from `grad_output`; the input gradient goes to `output` (again None at layer
    0). Backward and tail tasks accumulate weight gradients over all their microbatches
    and write them once, at the end, to the gradient slots of their layers
    (JobSetup.layers[i].grads, or grads_part for ``grad_part`` 1). A microbatch-split
    stage is two tasks over disjoint `microbatches` (Note [microbatch-split stages] in
    roundpipe.shared.plan).
    """

    #: job id
    job_id: Name
    #: unique within the job; the same for every attempt
    task_id: NonNegInt
    #: 0 for the first dispatch, +1 for each retry
    attempt: NonNegInt
    #: training iteration (optimizer step) the task belongs to
    iteration: NonNegInt
    #: forward stage (no grad kept), fused tail (forward+loss+backward), or backward
    #: stage with recompute
    kind: Literal["forward", "tail", "backward"]
    #: first layer of the stage
    layer_start: NonNegInt
    #: one past the last layer of the stage
    layer_stop: NonNegInt
    #: weight version W_v to compute with; trainable weights are read from params
    #: buffer v % 2 (LayerLayout.params for even v, params_odd for odd v)
    weight_version: NonNegInt
    #: counters to wait for before reading weights
    weight_waits: list[EventWait]
    #: the microbatches to process, in processing order (at least one)
    microbatches: list[MicrobatchIO]
    #: counters to wait for before overwriting the gradient slots of the stage's layers
    #: (JobSetup.layers[i].grads; a backward or tail task writes them all once, at its
    #: end; empty for a forward task)
    grad_waits: list[EventWait]
    #: counters to store once the gradient slots are written
    grad_signals: list[EventSignal]
    #: number of label tokens in the whole global batch (the loss is sum / this); tail
    #: only, 0 otherwise
    loss_denominator: NonNegInt
    #: RNG seed of the job, so a recompute replays the forward's dropout
    seed: NonNegInt
    #: deadline of each wait; the timeout error names the counter (JobSetup's layout)
    wait_timeout_s: PosFloat
    #: free-form knobs that do not change the protocol
    options: dict[str, Any] = field(default_factory=dict)
    #: which gradient slots a backward or tail task writes: 0 = LayerLayout.grads, 1 =
    #: LayerLayout.grads_part (the second task of a microbatch-split backward stage; the
    #: optimizer adds the two); 0 for a forward task
    grad_part: NonNegInt = 0

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches in this task."""
        return len(self.microbatches)

    def _check(self) -> None:
        start, stop, kind = self.layer_start, self.layer_stop, self.kind
        if stop <= start:
            raise _fail(
                "layer_stop",
                f"an int > layer_start ({start}); a stage has at least one layer",
                _seen(stop),
            )
        if not self.microbatches:
            raise _fail(
                "microbatches", "a non-empty list of MicrobatchIO", _seen(self.microbatches)
            )
        if kind == "tail":
            if self.loss_denominator < 1:
                raise _fail(
                    "loss_denominator",
                    "a positive int for a tail task (label tokens in the global batch)",
                    _seen(self.loss_denominator),
                )
        elif self.loss_denominator != 0:
            raise _fail(
                "loss_denominator",
                f"0 for a {kind} task (only the tail computes the loss)",
                _seen(self.loss_denominator),
            )
        if self.grad_part > 1:
            raise _fail("grad_part", "0 or 1 (a split stage has two parts)", _seen(self.grad_part))
        if self.grad_part and kind != "backward":
            raise _fail(
                "grad_part",
                f"0 for a {kind} task (only a backward stage is split into gradient parts)",
                _seen(self.grad_part),
            )
        if kind == "forward" and (self.grad_waits or self.grad_signals):
            name = next(n for n in ("grad_waits", "grad_signals") if getattr(self, n))
            raise _fail(
                name,
                "an empty list for a forward task (a forward stage keeps no gradients)",
                _seen(getattr(self, name)),
            )
        # The common case stays one cheap pass; _microbatch_error says what is wrong.
        forward, backward, tail = kind == "forward", kind == "backward", kind == "tail"
        has_output = forward or start > 0
        indices = set()
        for mb in self.microbatches:
            if (
                (mb.output is None) == has_output
                or (mb.grad_output is None) == backward
                or (mb.labels is None) == tail
                or (mb.loss is None) == tail
                or (mb.saved and not (forward and all(start < s.layer < stop for s in mb.saved)))
                or mb.index in indices
            ):
                raise self._microbatch_error()
            indices.add(mb.index)

    def _microbatch_error(self) -> _Invalid:
        kind, start, stop = self.kind, self.layer_start, self.layer_stop
        indices: set[int] = set()
        if kind == "forward":
            output = ("a TensorRef (a forward task writes the stage output)", "")
        elif start > 0:
            output = (f"a TensorRef (a {kind} task writes the gradient w.r.t. its input)", "")
        else:
            output = ("", f"None (a {kind} task starting at layer 0 has no input gradient)")
        # field -> (expected if it is None, expected if it is not), "" where that is fine
        rules = {
            "output": output,
            "grad_output": _kind_rule(kind, "backward", "grad_output"),
            "labels": _kind_rule(kind, "tail", "labels"),
            "loss": _kind_rule(kind, "tail", "loss"),
        }
        for i, mb in enumerate(self.microbatches):
            at = f"microbatches[{i}]."
            for name, (if_none, if_set) in rules.items():
                value = getattr(mb, name)
                wrong = if_none if value is None else if_set
                if wrong:
                    return _fail(at + name, wrong, _seen(value))
            for j, saved in enumerate(mb.saved):
                if kind != "forward":
                    return _fail(at + "saved", f"[] (a {kind} task saves nothing)", _seen(mb.saved))
                if not start < saved.layer < stop:
                    return _fail(
                        f"{at}saved[{j}].layer",
                        f"a layer strictly inside ({start}, {stop}) (the task's layers)",
                        _seen(saved.layer),
                    )
            if mb.index in indices:
                return _fail(
                    at + "index", "an index not used by an earlier microbatch", _seen(mb.index)
                )
            indices.add(mb.index)
        raise AssertionError("_microbatch_error called on valid microbatches")


def _kind_rule(kind: str, owner: str, name: str) -> tuple[str, str]:
    """StageTask._microbatch_error: a ref that only `owner` tasks have."""
    if kind == owner:
        return f"a TensorRef (a {kind} task needs {name})", ""
    return "", f"None ({name} is for {owner} tasks only; this task is {kind!r})"


@_message
class TaskDone(Message):
    """A task finished: all outputs written and all signals stored."""

    #: job id
    job_id: Name
    #: StageTask.task_id
    task_id: NonNegInt
    #: StageTask.attempt
    attempt: NonNegInt
    #: the worker that ran it (Welcome.worker_id)
    worker_id: NonNegInt
    #: wall time of the whole task
    seconds: NonNegFloat
    #: measured time per layer and phase, keyed e.g. "12" or "12.fwd" (msgpack map keys
    #: are str), for the planner (CUDA events on a GPU)
    layer_times: dict[str, NonNegFloat]
    #: seconds of compute (without waiting for inputs or uploads)
    compute_s: NonNegFloat = 0.0
    #: seconds the bus spent on this task's uploads (weights, activations, labels)
    upload_s: NonNegFloat = 0.0
    #: seconds the bus spent on this task's downloads
    download_s: NonNegFloat = 0.0
    #: bytes uploaded
    upload_bytes: NonNegInt = 0
    #: bytes downloaded
    download_bytes: NonNegInt = 0
    #: the worker's time.time() when it began the task (0: not reported); the
    #: coordinator's timeline places the task by it (same host clock)
    started_at: NonNegFloat = 0.0
    #: seconds blocked on event counters (weight versions, inputs, free gradient slots)
    wait_s: NonNegFloat = 0.0


@_message
class TaskFailed(Message):
    """A task raised. Signals it already stored stay stored; a retry rewrites only what
    the task had not signalled (tasks are idempotent)."""

    #: job id
    job_id: Name
    #: StageTask.task_id
    task_id: NonNegInt
    #: StageTask.attempt
    attempt: NonNegInt
    #: the worker that ran it
    worker_id: NonNegInt
    #: exception class name, e.g. "torch.OutOfMemoryError"
    error_type: str
    #: str(exception)
    message: str
    #: formatted traceback from the worker
    traceback: str
    #: True if the same task may succeed on a retry (OOM elsewhere, timeout); False for
    #: deterministic failures (bad config, NaN check) that would fail again
    retryable: bool


# --------------------------------------------------------------------------- liveness


@_message
class Heartbeat(Message):
    """Liveness only: answered by a dedicated thread, so a long task never looks dead.
    Progress is judged separately, by task deadlines."""

    #: who sends it: a worker name or the coordinator id
    sender: Name
    #: increases by one per heartbeat from this sender
    seq: NonNegInt
    #: sender's time.time() when sent
    sent_at: float


@_message
class Shutdown(Message):
    """Stop: the receiver drops its state and exits."""

    #: why, for logs
    reason: str


# --------------------------------------------------------------------------- client API


JobState = Literal["queued", "running", "paused", "succeeded", "failed", "cancelled"]
"""A job's lifecycle state (roundpipe.coordinator.service.jobs draws the state machine)."""
JOB_STATES: tuple[str, ...] = typing.get_args(JobState)
"""Every job state, in lifecycle order; the coordinator, the client and the CLI share it."""
FINAL_JOB_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
"""Job states that never change on their own (a resume can queue a failed or cancelled
job again)."""
STOPPED_JOB_STATES: frozenset[str] = FINAL_JOB_STATES | {"paused"}
"""States in which a job makes no progress until someone acts: the final ones, and
``paused`` (stopped without losing anything, e.g. its checkpoint could not be written)."""


@_message
class SubmitJob(Message):
    """Submit a job; the coordinator validates the spec before accepting it."""

    #: the job spec (ARCHITECTURE.md section 8) as a map
    spec: dict[str, Any]


@_message
class JobAccepted(Message):
    """A submitted job was queued."""

    #: its id
    job_id: Name


@_message
class GetJobStatus(Message):
    """Ask for one job's status."""

    #: job id
    job_id: Name


@_message
class JobStatus(Message):
    """One job's status (also an element of JobList)."""

    #: job id
    job_id: Name
    #: lifecycle state
    state: JobState
    #: optimizer steps completed
    step: NonNegInt
    #: optimizer steps planned
    total_steps: NonNegInt
    #: latest training loss, None before the first step (may be NaN if training diverged)
    loss: float | None
    #: human-readable detail: the error of a failed job, what a queued job waits for
    message: str
    #: where checkpoints and the final model go, once known
    output_dir: str | None
    #: the stage partition in use (Plan string form, e.g. "F[0:4] T[4:6] B[2:4,0:2]"),
    #: empty until the job has been planned
    plan: str = ""
    #: training throughput of the latest step (None: no step yet or not running)
    tokens_per_s: NonNegFloat | None = None
    #: measured share of worker time not computing in the newest settled step
    #: (roundpipe.coordinator.training.timeline); None until measured
    bubble_fraction: NonNegFloat | None = None
    #: steps the pipeline has finished that the optimizer has not applied yet
    optimizer_lag_steps: NonNegInt = 0
    #: per worker id (as a string): share of the newest settled step spent computing
    worker_busy: dict[str, NonNegFloat] = field(default_factory=dict)


@_message
class CancelJob(Message):
    """Cancel a job (queued or running)."""

    #: job id
    job_id: Name


@_message
class ResumeJob(Message):
    """Re-queue a paused, failed or cancelled job; it continues from its newest
    checkpoint (from the start if it has none)."""

    #: job id
    job_id: Name


@_message
class ListJobs(Message):
    """Ask for one page of the jobs' statuses, in submission order."""

    #: position (0 = the oldest job) of the first job wanted: JobList.next_start of the
    #: previous page
    start: NonNegInt = 0


@_message
class JobList(Message):
    """One page of the jobs the coordinator knows (at most MAX_REPLY_BYTES of them)."""

    #: one status per job, oldest first, from ListJobs.start on
    jobs: list[JobStatus]
    #: ListJobs.start of the next page; None when this page holds the last job
    next_start: NonNegInt | None = None
    #: how many jobs the coordinator knows in all
    total: NonNegInt = 0


@_message
class ListWorkers(Message):
    """Ask for one page of the workers, by worker id."""

    #: only workers with a larger worker_id (None: from the first): the last worker_id
    #: of the previous page
    after: NonNegInt | None = None


@_struct
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


@_message
class WorkerList(Message):
    """One page of the workers the coordinator knows (at most MAX_REPLY_BYTES of them)."""

    #: one entry per worker, by worker_id, ids > ListWorkers.after
    workers: list[WorkerInfo]
    #: True if workers with larger ids follow: ask again with after = the last id here
    more: bool = False


@_message
class GetProgress(Message):
    """Ask for a job's progress events newer than `after_seq` (long-poll friendly)."""

    #: job id
    job_id: Name
    #: return events with seq > after_seq; 0 for all (seqs start at 1)
    after_seq: NonNegInt


@_message
class GetJobLog(Message):
    """Ask for a piece of a job's log (the coordinator's log lines of that job); only its
    owner or an admin gets it."""

    #: job id
    job_id: Name
    #: byte offset in the log to read from; 0 for the beginning
    offset: NonNegInt = 0


@_message
class JobLog(Message):
    """A piece of a job's log, at most MAX_REPLY_BYTES; ask again from `next_offset`."""

    #: job id
    job_id: Name
    #: byte offset of `text` in the log
    offset: NonNegInt
    #: the log from `offset`, whole lines where a line fits (UTF-8; bad bytes replaced)
    text: str
    #: where the next piece starts: `offset` plus the bytes `text` was decoded from
    next_offset: NonNegInt
    #: True if the log held more than this piece when it was read
    more: bool = False


@_struct
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


@_message
class Progress(Message):
    """Progress events of a job, oldest first."""

    #: job id
    job_id: Name
    #: events with seq > GetProgress.after_seq, in seq order; a page of at most
    #: MAX_REPLY_BYTES: ask again after the last seq for the rest
    events: list[ProgressEvent]
    #: True once the job has ended and this page holds its last event
    done: bool


ErrorCode = Literal[
    "bad_hello",  # a worker's Hello reports impossible hardware
    "bad_spec",  # the job spec is invalid (or does not fit the machine); the message lists why
    "bad_state",  # the job is in a state that does not allow the request (resume a success)
    "busy",  # the coordinator cannot take the request now; try again
    "forbidden",  # the sender's role may not send this request
    "internal_error",  # a bug in the coordinator; the message says what failed
    "protocol_error",  # the request could not be decoded (version, type, body)
    "spec_check_failed",  # the spec could not be checked (the checking process died)
    "store_error",  # the job store could not record the request
    "unexpected_message",  # a message type the coordinator does not take from this peer
    "unknown_job",  # no such job (or not one the sender may see)
    "unknown_worker",  # the coordinator does not know this worker (it restarted)
]
"""Every ``ErrorReply.code``: one closed set for the coordinator, the client and the CLI."""

ERROR_CODES: frozenset[str] = frozenset(typing.get_args(ErrorCode))


@_message
class ErrorReply(Message):
    """A request failed."""

    #: machine-readable, one of ErrorCode
    code: ErrorCode
    #: human-readable explanation
    message: str


@_message
class Ack(Message):
    """A client request succeeded and has nothing to return."""
