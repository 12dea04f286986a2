"""Messages between the coordinator and its workers: handshake, jobs, stage tasks, liveness.

Everything a RoundPipe process sends over ZeroMQ -- coordinator, workers, clients -- is
a *message* encoded by :func:`~roundpipe.protocol.codec.encode` and read back by
:func:`~roundpipe.protocol.codec.decode`; there is no other encode/decode path. This
module holds the messages the coordinator and its workers exchange; the structs they
carry (:class:`~roundpipe.protocol.structs.TensorRef` descriptors into the shared-memory
arenas, never tensor data) are in roundpipe.protocol.structs, the client's messages in
roundpipe.protocol.client_messages.

Field-by-field documentation lives on the classes below, one comment line per field; the
class *is* the schema. Direction: W = worker, C = coordinator.

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
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import field

from roundpipe.protocol.schema import (
    Invalid,
    Message,
    Name,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    UInt16,
    declare_message,
    describe,
    invalid_field,
)
from roundpipe.protocol.structs import (
    ArenaInfo,
    ComputeDTypeName,
    EventSignal,
    EventWait,
    LayerLayout,
    MicrobatchIO,
)
from roundpipe.protocol.version import PROTOCOL_VERSION

__all__ = [
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
]


# --------------------------------------------------------------------------- handshake


@declare_message
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
            raise invalid_field(
                "protocol_version",
                f"{PROTOCOL_VERSION} (this process's PROTOCOL_VERSION)",
                describe(self.protocol_version),
            )
        if (self.device == "cuda") != (self.device_index is not None):
            expected = "an int for a cuda device" if self.device == "cuda" else "None for cpu"
            raise invalid_field("device_index", expected, describe(self.device_index))


@declare_message
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


@declare_message
class Reject(Message):
    """The coordinator refused a worker; the worker reports `reason` and exits."""

    #: why, for the worker's log
    reason: str
    #: the coordinator's PROTOCOL_VERSION
    expected_version: UInt16


# --------------------------------------------------------------------------- jobs to workers


@declare_message
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
    #: microbatches per iteration on this node; with len(layers) it fixes the layout of
    #: the event table's counters (roundpipe.shared.events.Counters), which EventWait and
    #: EventSignal refer to by index and timeout errors name
    num_microbatches: PosInt
    #: microbatches of the global batch, over every node of a data-parallel group
    #: (num_microbatches on one node): the router auxiliary loss weighs a microbatch by
    #: its share of the global batch's tokens
    global_microbatches: PosInt
    #: the global index of this node's first microbatch (0 on one node): dropout seeds
    #: follow the global index, so a group draws the masks one coordinator would
    microbatch_offset: NonNegInt

    def _check(self) -> None:
        if self.microbatch_offset + self.num_microbatches > self.global_microbatches:
            raise invalid_field(
                "microbatch_offset",
                f"at most global_microbatches - num_microbatches "
                f"({self.global_microbatches} - {self.num_microbatches})",
                describe(self.microbatch_offset),
            )
        names = [a.name for a in self.arenas]
        if len(set(names)) != len(names):
            raise invalid_field("arenas", "arenas with distinct names", describe(names))
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
                        raise invalid_field(
                            f"layers[{i}].{key}[{j}].ref.arena",
                            "the name of an arena listed in arenas",
                            describe(named.ref.arena),
                        )


@declare_message
class JobTeardown(Message):
    """Forget a job: drop its layer skeletons, unmap its arenas."""

    #: job id
    job_id: Name


# --------------------------------------------------------------------------- stage tasks


@declare_message
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
    #: router auxiliary loss only: the real (not padding) tokens of the global batch,
    #: over every node of a group (MicrobatchIO.row_tokens); 0: every token is real
    router_tokens: NonNegInt = 0
    #: float16 loss scaling (tail and backward tasks): the event counter holding this
    #: iteration's loss scale, which the backward is seeded with
    #: (Note [dynamic loss scaling] in roundpipe.coordinator.training.loss_scale);
    #: None: no scaling
    loss_scale_counter: NonNegInt | None = None

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches in this task."""
        return len(self.microbatches)

    def _check(self) -> None:
        start, stop, kind = self.layer_start, self.layer_stop, self.kind
        if stop <= start:
            raise invalid_field(
                "layer_stop",
                f"an int > layer_start ({start}); a stage has at least one layer",
                describe(stop),
            )
        if not self.microbatches:
            raise invalid_field(
                "microbatches", "a non-empty list of MicrobatchIO", describe(self.microbatches)
            )
        if kind == "tail":
            if self.loss_denominator < 1:
                raise invalid_field(
                    "loss_denominator",
                    "a positive int for a tail task (label tokens in the global batch)",
                    describe(self.loss_denominator),
                )
        elif self.loss_denominator != 0:
            raise invalid_field(
                "loss_denominator",
                f"0 for a {kind} task (only the tail computes the loss)",
                describe(self.loss_denominator),
            )
        if self.grad_part > 1:
            raise invalid_field(
                "grad_part", "0 or 1 (a split stage has two parts)", describe(self.grad_part)
            )
        if self.grad_part and kind != "backward":
            raise invalid_field(
                "grad_part",
                f"0 for a {kind} task (only a backward stage is split into gradient parts)",
                describe(self.grad_part),
            )
        if kind == "forward" and (self.grad_waits or self.grad_signals):
            name = next(n for n in ("grad_waits", "grad_signals") if getattr(self, n))
            raise invalid_field(
                name,
                "an empty list for a forward task (a forward stage keeps no gradients)",
                describe(getattr(self, name)),
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

    def _microbatch_error(self) -> Invalid:
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
                    return invalid_field(at + name, wrong, describe(value))
            for j, saved in enumerate(mb.saved):
                if kind != "forward":
                    return invalid_field(
                        at + "saved", f"[] (a {kind} task saves nothing)", describe(mb.saved)
                    )
                if not start < saved.layer < stop:
                    return invalid_field(
                        f"{at}saved[{j}].layer",
                        f"a layer strictly inside ({start}, {stop}) (the task's layers)",
                        describe(saved.layer),
                    )
            if mb.index in indices:
                return invalid_field(
                    at + "index", "an index not used by an earlier microbatch", describe(mb.index)
                )
            indices.add(mb.index)
        raise AssertionError("_microbatch_error called on valid microbatches")


def _kind_rule(kind: str, owner: str, name: str) -> tuple[str, str]:
    """StageTask._microbatch_error: a ref that only `owner` tasks have."""
    if kind == owner:
        return f"a TensorRef (a {kind} task needs {name})", ""
    return "", f"None ({name} is for {owner} tasks only; this task is {kind!r})"


@declare_message
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


MAX_FAILURE_TEXT_CHARS = 64 * 1024
"""Most characters of TaskFailed's ``message`` and of its ``traceback`` each: a worker
cuts longer ones (keeping the traceback's end, where the error is), and the coordinator
refuses a TaskFailed larger than these allow (coordinator/service/inbound.py)."""


@declare_message
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


@declare_message
class Heartbeat(Message):
    """Liveness only: answered by a dedicated thread, so a long task never looks dead.
    Progress is judged separately, by task deadlines."""

    #: who sends it: a worker name or the coordinator id
    sender: Name
    #: increases by one per heartbeat from this sender
    seq: NonNegInt
    #: sender's time.time() when sent
    sent_at: float


@declare_message
class Shutdown(Message):
    """Stop: the receiver drops its state and exits."""

    #: why, for logs
    reason: str
