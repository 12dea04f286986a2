"""The wire is pinned: every message type, every field of every struct, and the exact
bytes of sample frames, as they were at PROTOCOL_VERSION 15.

Moving code around in roundpipe.protocol must leave these tests passing unchanged. A
deliberate change to the protocol bumps PROTOCOL_VERSION (see "Version rule" in
roundpipe.protocol.version) and updates the captured lists here in the same commit.
"""

from __future__ import annotations

import hashlib
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union

import msgspec

from roundpipe.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    ArenaInfo,
    ErrorReply,
    EventSignal,
    EventWait,
    Heartbeat,
    Hello,
    JobList,
    JobSetup,
    JobStatus,
    LayerLayout,
    Message,
    MicrobatchIO,
    NamedTensorRef,
    Progress,
    ProgressEvent,
    StageTask,
    Struct,
    TaskDone,
    TensorRef,
    WorkerInfo,
    WorkerList,
    encode,
)

MESSAGE_TYPE_NAMES = [
    "Ack",
    "CancelJob",
    "ErrorReply",
    "ForgetJob",
    "GetJobLog",
    "GetJobStatus",
    "GetProgress",
    "Heartbeat",
    "Hello",
    "JobAccepted",
    "JobList",
    "JobLog",
    "JobSetup",
    "JobStatus",
    "JobTeardown",
    "ListJobs",
    "ListWorkers",
    "Progress",
    "Reject",
    "ResumeJob",
    "Shutdown",
    "StageTask",
    "SubmitJob",
    "TaskDone",
    "TaskFailed",
    "Welcome",
    "WorkerList",
]

# Captured before the catalogue of messages was split into modules (issue 34): type name -> its fields in
# wire order, "name: type(constraints) = default".
WIRE_CATALOGUE = {
    "Ack": [],
    "ArenaInfo": [
        "name: str(min_length=1)",
        "path: str(min_length=1)",
        "nbytes: int(ge=0)",
    ],
    "CancelJob": [
        "job_id: str(min_length=1)",
    ],
    "ForgetJob": [
        "job_id: str(min_length=1)",
    ],
    "ErrorReply": [
        "code: 'bad_hello' | 'bad_spec' | 'bad_state' | 'busy' | 'forbidden' | 'internal_error' | 'protocol_error' | 'spec_check_failed' | 'store_error' | 'unexpected_message' | 'unknown_job' | 'unknown_worker'",
        "message: str",
    ],
    "EventSignal": [
        "counter: int(ge=0)",
        "value: int(ge=-9223372036854775808, le=9223372036854775807)",
    ],
    "EventWait": [
        "counter: int(ge=0)",
        "at_least: int(ge=-9223372036854775808, le=9223372036854775807)",
    ],
    "GetJobLog": [
        "job_id: str(min_length=1)",
        "offset: int(ge=0) = 0",
    ],
    "GetJobStatus": [
        "job_id: str(min_length=1)",
    ],
    "GetProgress": [
        "job_id: str(min_length=1)",
        "after_seq: int(ge=0)",
    ],
    "Heartbeat": [
        "sender: str(min_length=1)",
        "seq: int(ge=0)",
        "sent_at: float",
    ],
    "Hello": [
        "protocol_version: int(ge=0, le=65535) = 15",
        "worker_name: str(min_length=1)",
        "hostname: str",
        "pid: int(ge=0)",
        "process_create_time: float",
        "device: 'cpu' | 'cuda'",
        "device_index: int(ge=0) | None",
        "device_name: str",
        "memory_bytes: int(ge=0)",
        "compute_capability: str | None",
        "h2d_bytes_per_s: float(gt=0.0) | None = None",
        "d2h_bytes_per_s: float(gt=0.0) | None = None",
    ],
    "JobAccepted": [
        "job_id: str(min_length=1)",
    ],
    "JobList": [
        "jobs: list[JobStatus]",
        "next_start: int(ge=0) | None = None",
        "total: int(ge=0) = 0",
    ],
    "JobLog": [
        "job_id: str(min_length=1)",
        "offset: int(ge=0)",
        "text: str",
        "next_offset: int(ge=0)",
        "more: bool = False",
    ],
    "JobSetup": [
        "job_id: str(min_length=1)",
        "model_config: dict[str, Any]",
        "lora: dict[str, Any] | None",
        "compute_dtype: 'float32' | 'float16' | 'bfloat16'",
        "arenas: list[ArenaInfo]",
        "layers: list[LayerLayout]",
        "num_microbatches: int(ge=1)",
        "global_microbatches: int(ge=1)",
        "microbatch_offset: int(ge=0)",
    ],
    "JobStatus": [
        "job_id: str(min_length=1)",
        "state: 'queued' | 'running' | 'paused' | 'succeeded' | 'failed' | 'cancelled'",
        "step: int(ge=0)",
        "total_steps: int(ge=0)",
        "loss: float | None",
        "message: str",
        "output_dir: str | None",
        "plan: str = ''",
        "tokens_per_s: float(ge=0) | None = None",
        "bubble_fraction: float(ge=0) | None = None",
        "optimizer_lag_steps: int(ge=0) = 0",
        "worker_busy: dict[str, float(ge=0)] = {}",
    ],
    "JobTeardown": [
        "job_id: str(min_length=1)",
    ],
    "LayerLayout": [
        "layer: int(ge=0)",
        "params: list[NamedTensorRef]",
        "params_odd: list[NamedTensorRef] = []",
        "grads: list[NamedTensorRef] = []",
        "grads_part: list[NamedTensorRef] = []",
    ],
    "LayerTensorRef": [
        "layer: int(ge=0)",
        "ref: TensorRef",
    ],
    "ListJobs": [
        "start: int(ge=0) = 0",
    ],
    "ListWorkers": [
        "after: int(ge=0) | None = None",
    ],
    "MicrobatchIO": [
        "index: int(ge=0)",
        "input: TensorRef",
        "output: TensorRef | None",
        "grad_output: TensorRef | None",
        "labels: TensorRef | None",
        "loss: TensorRef | None",
        "saved: list[LayerTensorRef]",
        "waits: list[EventWait]",
        "signals: list[EventSignal]",
        "position_ids: TensorRef | None = None",
        "router_out: TensorRef | None = None",
        "router_in: list[TensorRef] = []",
        "row_tokens: list[int(ge=1)] = []",
    ],
    "NamedTensorRef": [
        "name: str(min_length=1)",
        "ref: TensorRef",
    ],
    "Progress": [
        "job_id: str(min_length=1)",
        "events: list[ProgressEvent]",
        "done: bool",
    ],
    "ProgressEvent": [
        "seq: int(ge=0)",
        "step: int(ge=0)",
        "loss: float",
        "tokens_per_s: float(ge=0)",
        "lr: float",
        "time: float",
        "optimizer_s: float(ge=0) = 0.0",
    ],
    "Reject": [
        "reason: str",
        "expected_version: int(ge=0, le=65535)",
    ],
    "ResumeJob": [
        "job_id: str(min_length=1)",
    ],
    "Shutdown": [
        "reason: str",
    ],
    "StageTask": [
        "job_id: str(min_length=1)",
        "task_id: int(ge=0)",
        "attempt: int(ge=0)",
        "iteration: int(ge=0)",
        "kind: 'forward' | 'tail' | 'backward'",
        "layer_start: int(ge=0)",
        "layer_stop: int(ge=0)",
        "weight_version: int(ge=0)",
        "weight_waits: list[EventWait]",
        "microbatches: list[MicrobatchIO]",
        "grad_waits: list[EventWait]",
        "grad_signals: list[EventSignal]",
        "loss_denominator: int(ge=0)",
        "seed: int(ge=0)",
        "wait_timeout_s: float(gt=0.0)",
        "options: dict[str, Any] = {}",
        "grad_part: int(ge=0) = 0",
        "router_tokens: int(ge=0) = 0",
        "loss_scale_counter: int(ge=0) | None = None",
    ],
    "SubmitJob": [
        "spec: dict[str, Any]",
    ],
    "TaskDone": [
        "job_id: str(min_length=1)",
        "task_id: int(ge=0)",
        "attempt: int(ge=0)",
        "worker_id: int(ge=0)",
        "seconds: float(ge=0)",
        "layer_times: dict[str, float(ge=0)]",
        "compute_s: float(ge=0) = 0.0",
        "upload_s: float(ge=0) = 0.0",
        "download_s: float(ge=0) = 0.0",
        "upload_bytes: int(ge=0) = 0",
        "download_bytes: int(ge=0) = 0",
        "started_at: float(ge=0) = 0.0",
        "wait_s: float(ge=0) = 0.0",
    ],
    "TaskFailed": [
        "job_id: str(min_length=1)",
        "task_id: int(ge=0)",
        "attempt: int(ge=0)",
        "worker_id: int(ge=0)",
        "error_type: str",
        "message: str",
        "traceback: str",
        "retryable: bool",
    ],
    "TensorRef": [
        "arena: str(min_length=1)",
        "offset: int(ge=0)",
        "dtype: 'float32' | 'float16' | 'bfloat16' | 'float64' | 'int64' | 'int32' | 'int16' | 'int8' | 'uint8' | 'bool'",
        "shape: tuple[int(ge=0), ...]",
        "stride: tuple[int(ge=0), ...] | None",
    ],
    "Welcome": [
        "worker_id: int(ge=0)",
        "coordinator_id: str(min_length=1)",
        "heartbeat_interval_s: float(gt=0.0)",
        "arena_dir: str",
    ],
    "WorkerInfo": [
        "worker_id: int(ge=0)",
        "name: str(min_length=1)",
        "device: 'cpu' | 'cuda'",
        "device_name: str",
        "memory_bytes: int(ge=0)",
        "state: 'idle' | 'busy' | 'lost'",
        "tasks_done: int(ge=0)",
        "h2d_bytes_per_s: float(gt=0.0) | None = None",
        "d2h_bytes_per_s: float(gt=0.0) | None = None",
        "current_task: str = ''",
    ],
    "WorkerList": [
        "workers: list[WorkerInfo]",
        "more: bool = False",
    ],
}


# sha256 of the frame of each sample message below.
FRAME_SHA256 = {
    "Heartbeat": "9ceeff77fe55a3a06f298a8f1542d23530c2753f230e4bd66167a61b7986f886",
    "Hello": "7710783f6667d04135cee3f59d89f97bca868d1cf2d3ff249fb8ae5dd3e08003",
    "JobSetup": "239665f55bd622dbe4566ebe416149def2c69256ffd114c87ceb885c16ed6f2d",
    "StageTask": "198fe08a2a7e4cba378d485856b9169063be6895741a782a555a1d7bcb28e199",
    "TaskDone": "3949f1ec15ec736b7821d5e09632a384bd6dbeed42fdb888d00aaca7f030c348",
    "JobList": "c82a00f64b0961b3ea9bcf5e63d5fb8bc1be7f4d631a13b2527e922b47bef6a2",
    "WorkerList": "21393961bbb42a6bde6eeb2602aaf50afd052e9ba72b9eed0d7f42a21b8eb7ce",
    "Progress": "137bf20e2acedc218f5eba5d8020064655faea8838c1b339184b696eb3d3a6c1",
    "ErrorReply": "aab87a33d215439721eefe28d7b533ee8ab8da413601d2261734021e04a810e1",
    "Ack": "a6e01e4aac524e1933edd57d7556ea02a8e81171b2333c4d7bc75fbf38d5ea8b",
}


def _wire_type(tp: Any) -> str:
    """An annotation as text that names what travels, not where a class is defined."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        meta = args[1]
        marks = ", ".join(
            f"{k}={getattr(meta, k)!r}"
            for k in ("ge", "gt", "le", "min_length")
            if getattr(meta, k) is not None
        )
        return f"{_wire_type(args[0])}({marks})"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(_wire_type(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _wire_type(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if tp is Any:
        return "Any"
    if tp is type(None):
        return "None"
    return str(tp.__name__)


def _classes() -> dict[str, type[Struct]]:
    """Every registered message type and every struct they hold, by name."""
    out: dict[str, type[Struct]] = {}
    todo: list[Any] = [MESSAGE_TYPES[name] for name in sorted(MESSAGE_TYPES)]
    while todo:
        tp = todo.pop(0)
        if isinstance(tp, type) and issubclass(tp, Struct):
            if tp.__name__ in out:
                continue
            out[tp.__name__] = tp
            todo.extend(f.type for f in msgspec.structs.fields(tp))
        else:
            todo.extend(typing.get_args(tp))
    return out


def _catalogue() -> dict[str, list[str]]:
    """Each of _classes() with its fields in wire order, as WIRE_CATALOGUE writes them."""
    out: dict[str, list[str]] = {}
    for name, cls in _classes().items():
        lines = []
        for f in msgspec.structs.fields(cls):
            text = f"{f.name}: {_wire_type(f.type)}"
            if f.default is not msgspec.NODEFAULT:
                text += f" = {f.default!r}"
            elif f.default_factory is not msgspec.NODEFAULT:
                text += f" = {f.default_factory()!r}"
            lines.append(text)
        out[name] = lines
    return out


def test_protocol_version_is_unchanged() -> None:
    assert PROTOCOL_VERSION == 15


def test_message_types_and_their_fields_are_unchanged() -> None:
    assert sorted(MESSAGE_TYPES) == MESSAGE_TYPE_NAMES
    assert _catalogue() == WIRE_CATALOGUE


def test_structs_inside_messages_travel_as_arrays_messages_as_maps() -> None:
    for name, cls in _classes().items():
        # A message is the map of its fields; a struct inside one, the array of its values.
        assert cls.__struct_config__.array_like == (name not in MESSAGE_TYPES), name
        assert cls.__struct_config__.forbid_unknown_fields, name


def _samples() -> Iterator[Message]:
    ref = TensorRef(arena="acts", offset=4096, dtype="bfloat16", shape=(4, 2048), stride=None)
    lab = TensorRef(arena="acts", offset=0, dtype="int64", shape=(4, 2048), stride=(2048, 1))
    loss = TensorRef(arena="loss", offset=8, dtype="float32", shape=(1,), stride=None)
    yield Heartbeat(sender="rp-worker-0", seq=7, sent_at=1767225600.5)
    yield Hello(
        worker_name="rp-worker-3",
        hostname="h",
        pid=42,
        process_create_time=1.5,
        device="cuda",
        device_index=0,
        device_name="GPU",
        memory_bytes=1 << 30,
        compute_capability="8.9",
        h2d_bytes_per_s=2.5e10,
    )
    yield JobSetup(
        job_id="j",
        model_config={"hidden_size": 64, "layers": [1, 2.5, None, True]},
        lora=None,
        compute_dtype="bfloat16",
        arenas=[ArenaInfo(name="acts", path="/dev/shm/a", nbytes=1 << 20)],
        layers=[
            LayerLayout(
                layer=0,
                params=[NamedTensorRef(name="w", ref=ref)],
                grads=[NamedTensorRef(name="w", ref=ref)],
            )
        ],
        num_microbatches=2,
        global_microbatches=4,
        microbatch_offset=2,
    )
    yield StageTask(
        job_id="j",
        task_id=3,
        attempt=1,
        iteration=2,
        kind="tail",
        layer_start=2,
        layer_stop=4,
        weight_version=2,
        weight_waits=[EventWait(counter=1, at_least=2)],
        microbatches=[
            MicrobatchIO(
                index=0,
                input=ref,
                output=ref,
                grad_output=None,
                labels=lab,
                loss=loss,
                saved=[],
                waits=[EventWait(counter=5, at_least=1)],
                signals=[EventSignal(counter=6, value=1)],
                position_ids=lab,
                router_in=[ref],
            )
        ],
        grad_waits=[],
        grad_signals=[EventSignal(counter=9, value=3)],
        loss_denominator=100,
        seed=7,
        wait_timeout_s=30.0,
        options={"k": [1, "x"]},
        grad_part=0,
        loss_scale_counter=11,
    )
    yield TaskDone(
        job_id="j",
        task_id=3,
        attempt=1,
        worker_id=0,
        seconds=1.25,
        layer_times={"2": 0.5, "3.fwd": 0.25},
        upload_bytes=10,
    )
    yield JobList(
        jobs=[
            JobStatus(
                job_id="j",
                state="running",
                step=1,
                total_steps=5,
                loss=2.5,
                message="",
                output_dir=None,
                worker_busy={"0": 0.5},
            )
        ],
        next_start=1,
        total=2,
    )
    yield WorkerList(
        workers=[
            WorkerInfo(
                worker_id=0,
                name="w",
                device="cpu",
                device_name="cpu",
                memory_bytes=1,
                state="idle",
                tasks_done=0,
            )
        ],
        more=True,
    )
    yield Progress(
        job_id="j",
        events=[ProgressEvent(seq=1, step=1, loss=2.0, tokens_per_s=3.0, lr=1e-4, time=5.0)],
        done=False,
    )
    yield ErrorReply(code="bad_spec", message="no")
    yield Ack()


def test_sample_frames_are_byte_for_byte_unchanged() -> None:
    seen = {type(m).__name__: hashlib.sha256(encode(m)[0]).hexdigest() for m in _samples()}
    assert seen == FRAME_SHA256
