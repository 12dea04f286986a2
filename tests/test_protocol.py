"""Tests for roundpipe.protocol: round trips, fuzzing, error messages, a real socket."""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import datetime
import enum
import inspect
import math
import pickle
import random
import re
import struct
import tempfile
import time
import types
import typing
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Annotated, Any, Literal, NamedTuple
from unittest import mock

import msgpack
import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_helpers import sample_microbatch, sample_ref, sample_stage_task
from runtime_helpers import fake_hello

import roundpipe.protocol as proto
from roundpipe.protocol import (
    DTYPE_NAMES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    ArenaInfo,
    EventSignal,
    EventWait,
    Heartbeat,
    Hello,
    JobSetup,
    JobStatus,
    LayerLayout,
    LayerTensorRef,
    Message,
    MicrobatchIO,
    NamedTensorRef,
    ProtocolError,
    ProtocolVersionError,
    Reject,
    StageTask,
    Struct,
    TaskDone,
    TensorRef,
    Welcome,
    client_messages,
    codec,
    decode,
    decode_as,
    dtype_to_name,
    encode,
    name_to_dtype,
    replace,
    schema,
    structs,
    worker_messages,
)

_HDR = b"RP" + PROTOCOL_VERSION.to_bytes(2, "big")  # the header of this version


def _join(header: bytes, type_name: bytes, body: bytes) -> list[bytes]:
    """The frame of a message from its three parts (the length byte written right)."""
    return [header + bytes([len(type_name) % 256]) + type_name + body]


def _parts(frames: list[bytes]) -> tuple[bytes, bytes, bytes]:
    """A well-formed frame split back into header, type name and body."""
    (frame,) = frames
    body_at = 5 + frame[4]
    return frame[:4], frame[5:body_at], frame[body_at:]


# --------------------------------------------------------------------------- strategies
#
# Strategies are derived from the classes' own annotations, so a new message type or
# field is covered without touching this file. Only cross-field rules need an override.

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_text = st.text(max_size=12)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_name = st.text(min_size=1, max_size=12)
_dtypes = st.sampled_from(DTYPE_NAMES)

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(_INT64_MIN, _UINT64_MAX)
    | _finite
    | _text
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def _for_annotation(tp: Any) -> st.SearchStrategy[Any]:
    if tp is Any:
        return _msgpack_values
    simple = {
        int: st.integers(_INT64_MIN, _UINT64_MAX),
        float: _finite,
        str: _text,
        bool: st.booleans(),
        bytes: st.binary(max_size=8),
        type(None): st.none(),
    }
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, marks = args[0], args[1:]
        lo: float | None = None
        hi: float | None = None
        non_empty = False
        for mark in marks:  # the constraints, written once as msgspec.Meta
            if mark.ge is not None:
                lo = mark.ge
            if mark.gt is not None:
                lo = mark.gt + 1e-6
            if mark.le is not None:
                hi = mark.le
            if mark.min_length:
                non_empty = True
        if base is int:
            return st.integers(int(lo) if lo is not None else _INT64_MIN, hi or _UINT64_MAX)
        if base is float:
            return st.floats(min_value=lo, allow_nan=False, allow_infinity=False)
        if base is str:
            return _name if non_empty else _text
        raise AssertionError(f"no strategy for {tp!r}")
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_for_annotation(a) for a in args])
    if origin is list:
        return st.lists(_for_annotation(args[0]), max_size=3)
    if origin is tuple:
        return st.lists(_for_annotation(args[0]), max_size=4).map(tuple)
    if origin is dict:
        return st.dictionaries(_text, _for_annotation(args[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, Struct):
        return for_struct(tp)
    raise AssertionError(f"no strategy for {tp!r}")


@st.composite
def _tensor_refs(
    draw: st.DrawFn,
    arenas: st.SearchStrategy[str] = _name,
    dtypes: st.SearchStrategy[str] = _dtypes,
) -> TensorRef:
    ndim = draw(st.integers(0, 4))
    dims = st.lists(st.integers(0, 2**40), min_size=ndim, max_size=ndim).map(tuple)
    return TensorRef(
        arena=draw(arenas),
        offset=draw(st.integers(0, _UINT64_MAX)),
        dtype=draw(dtypes),
        shape=draw(dims),
        stride=draw(st.none() | dims),
    )


@st.composite
def _hellos(draw: st.DrawFn) -> Hello:
    device = draw(st.sampled_from(["cpu", "cuda"]))
    return Hello(
        worker_name=draw(_name),
        hostname=draw(_text),
        pid=draw(st.integers(0, 2**22)),
        process_create_time=draw(_finite),
        device=device,
        device_index=draw(st.integers(0, 7)) if device == "cuda" else None,
        device_name=draw(_text),
        memory_bytes=draw(st.integers(0, 2**40)),
        compute_capability=draw(st.sampled_from(["8.9", "9.0"])) if device == "cuda" else None,
    )


_KINDS = ("forward", "tail", "backward")


@st.composite
def _microbatches(draw: st.DrawFn, kind: str, start: int, stop: int, index: int) -> MicrobatchIO:
    """A microbatch that is valid in a `kind` task over layers [start, stop)."""
    refs = _tensor_refs()

    def ref_if(wanted: bool) -> TensorRef | None:
        return draw(refs) if wanted else None

    saved: list[LayerTensorRef] = []
    if kind == "forward" and stop - start > 1:
        layers = draw(st.lists(st.integers(start + 1, stop - 1), max_size=2, unique=True))
        saved = [LayerTensorRef(layer=layer, ref=draw(refs)) for layer in layers]
    tail = kind == "tail"
    return MicrobatchIO(
        index=index,
        input=draw(refs),
        output=ref_if(kind == "forward" or start > 0),
        grad_output=ref_if(kind == "backward"),
        labels=ref_if(tail),
        loss=draw(_tensor_refs(dtypes=st.just("float32"))) if tail else None,
        saved=saved,
        waits=draw(st.lists(for_struct(EventWait), max_size=2)),
        signals=draw(st.lists(for_struct(EventSignal), max_size=2)),
    )


@st.composite
def _any_microbatch(draw: st.DrawFn) -> MicrobatchIO:
    start = draw(st.integers(0, 50))
    stop = draw(st.integers(start + 1, start + 10))
    index = draw(st.integers(0, 2**20))
    return draw(_microbatches(draw(st.sampled_from(_KINDS)), start, stop, index))


@st.composite
def _stage_tasks(draw: st.DrawFn) -> StageTask:
    kind = draw(st.sampled_from(_KINDS))
    start = draw(st.integers(0, 10_000))
    stop = draw(st.integers(start + 1, start + 100))
    indices = draw(st.lists(st.integers(0, 2**20), min_size=1, max_size=3, unique=True))
    mbs = [draw(_microbatches(kind, start, stop, m)) for m in indices]
    per_kind = {
        "microbatches",
        "layer_start",
        "layer_stop",
        "kind",
        "loss_denominator",
        "grad_part",
    }
    grad_fields = {"grad_waits", "grad_signals"}
    base = draw(_builds_fields(StageTask, skip=per_kind | grad_fields))
    if kind != "forward":
        base.update(draw(_builds_fields(StageTask, only=grad_fields)))
    else:
        base.update(grad_waits=[], grad_signals=[])
    return StageTask(
        **base,
        kind=kind,
        layer_start=start,
        layer_stop=stop,
        microbatches=mbs,
        loss_denominator=draw(st.integers(1, 2**40)) if kind == "tail" else 0,
        grad_part=draw(st.integers(0, 1)) if kind == "backward" else 0,
    )


@st.composite
def _job_setups(draw: st.DrawFn) -> JobSetup:
    arenas = draw(st.lists(for_struct(ArenaInfo), max_size=4, unique_by=lambda a: a.name))
    layers: list[LayerLayout] = []
    if arenas:
        names = st.sampled_from([a.name for a in arenas])
        refs = st.builds(NamedTensorRef, name=_name, ref=_tensor_refs(names))
        layers = draw(
            st.lists(
                st.builds(
                    LayerLayout,
                    layer=st.integers(0, 200),
                    params=st.lists(refs, max_size=3),
                    params_odd=st.lists(refs, max_size=2),
                    grads=st.lists(refs, max_size=2),
                    grads_part=st.lists(refs, max_size=2),
                ),
                max_size=3,
            )
        )
    counts = {"num_microbatches", "microbatch_offset", "global_microbatches"}
    base = draw(_builds_fields(JobSetup, skip={"arenas", "layers"} | counts))
    # This node's microbatches lie inside the global batch's.
    base["num_microbatches"] = draw(st.integers(1, 2**40))
    base["microbatch_offset"] = draw(st.integers(0, 2**40))
    base["global_microbatches"] = (
        base["num_microbatches"] + base["microbatch_offset"] + draw(st.integers(0, 2**40))
    )
    return JobSetup(**base, arenas=arenas, layers=layers)


_OVERRIDES: dict[type, Callable[[], st.SearchStrategy[Any]]] = {
    TensorRef: _tensor_refs,
    Hello: _hellos,
    StageTask: _stage_tasks,
    MicrobatchIO: _any_microbatch,
    JobSetup: _job_setups,
}


def _builds_fields(
    cls: type, skip: Collection[str] = (), only: Collection[str] | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.fixed_dictionaries(
        {
            name: _for_annotation(tp)
            for name, tp in hints.items()
            if name not in skip and (only is None or name in only)
        }
    )


_STRUCT_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {}


def for_struct(cls: type) -> st.SearchStrategy[Any]:
    if cls not in _STRUCT_STRATEGIES:
        if cls in _OVERRIDES:
            _STRUCT_STRATEGIES[cls] = _OVERRIDES[cls]()
        else:
            _STRUCT_STRATEGIES[cls] = st.deferred(
                lambda: _builds_fields(cls).map(lambda kw: cls(**kw))
            )
    return _STRUCT_STRATEGIES[cls]


_TYPE_NAMES = sorted(MESSAGE_TYPES)
any_message = st.sampled_from(_TYPE_NAMES).flatmap(lambda n: for_struct(MESSAGE_TYPES[n]))

# --------------------------------------------------------------------------- helpers


def _body(frames: list[bytes]) -> dict[str, Any]:
    return msgpack.unpackb(_parts(frames)[2])


def _with_body(frames: list[bytes], body: Any) -> list[bytes]:
    header, type_name, _ = _parts(frames)
    return _join(header, type_name, msgpack.packb(body, use_bin_type=True))


def _frames(type_name: str, body: Any, version: int = PROTOCOL_VERSION) -> list[bytes]:
    return _join(
        b"RP" + struct.pack(">H", version),
        type_name.encode(),
        msgpack.packb(body, use_bin_type=True),
    )


def _at(cls: type, name: str) -> int:
    """Position of a field in the wire array of a nested record."""
    return list(cls.__struct_fields__).index(name)


def _output(m: int, overrides: dict[str, Any]) -> TensorRef | None:
    """The input gradient of a backward/tail microbatch: none at layer 0."""
    return sample_ref(offset=100 * m + 24) if overrides.get("layer_start", 1) > 0 else None


def _backward_task(**overrides: Any) -> StageTask:
    mbs = [
        sample_microbatch(
            m, output=_output(m, overrides), grad_output=sample_ref(offset=100 * m + 72), saved=[]
        )
        for m in range(2)
    ]
    kw: dict[str, Any] = dict(
        kind="backward",
        microbatches=mbs,
        grad_waits=[EventWait(counter=20, at_least=1)],
        grad_signals=[EventSignal(counter=21, value=1)],
    )
    kw.update(overrides)
    return sample_stage_task(**kw)


def _tail_task(**overrides: Any) -> StageTask:
    mbs = [
        sample_microbatch(
            m,
            output=_output(m, overrides),
            labels=sample_ref(dtype="int64"),
            loss=sample_ref(dtype="float32", shape=(1,), stride=(1,)),
            saved=[],
        )
        for m in range(2)
    ]
    kw: dict[str, Any] = dict(kind="tail", microbatches=mbs, loss_denominator=1000)
    kw.update(overrides)
    return sample_stage_task(**kw)


def _hello(**overrides: Any) -> Hello:
    return fake_hello(
        **{
            "worker_name": "rp-worker-0",
            "hostname": "box",
            "pid": 1234,
            "process_create_time": 1.5e9,
            **overrides,
        }
    )


def _decode_error(frames: Any, **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, **kw)
    return info.value


def _outcome(frames: Any, **kw: Any) -> Message | ProtocolError:
    """The fuzz oracle: a valid Message (which must re-encode to the same thing) or a
    ProtocolError. Any other exception propagates and fails the test. The generated
    fast decoder must agree exactly with the reference validator, which
    codec.decode_reference takes alone."""
    try:
        msg = decode(frames, **kw)
    except ProtocolError as e:
        assert str(e)
        assert _described(lambda: codec.decode_reference(frames, **kw)) == f"error {e}"
        return e
    assert isinstance(msg, Message)
    assert _described(lambda: codec.decode_reference(frames, **kw)) == f"ok {msg!r}"
    again = encode(msg)
    assert encode(decode(again)) == again
    return msg


def _described(make: Callable[[], Any]) -> str:
    """An outcome as text; repr tells 1 from 1.0 and a list from a tuple."""
    try:
        return f"ok {make()!r}"
    except ProtocolError as e:
        return f"error {e}"


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("type_name", _TYPE_NAMES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_round_trip_every_message_type(type_name: str, data: st.DataObject) -> None:
    cls = MESSAGE_TYPES[type_name]
    msg = data.draw(for_struct(cls))
    frames = encode(msg)
    assert len(frames) == 1 and type(frames[0]) is bytes
    header, name, body = _parts(frames)
    assert header == b"RP" + PROTOCOL_VERSION.to_bytes(2, "big")
    assert name == type_name.encode("ascii")
    back = decode(frames)
    assert type(back) is cls
    assert back == msg
    assert encode(back) == frames  # encoding is deterministic
    assert decode_as(frames, cls) == msg
    # What this encoder writes, the compiled decoder takes without the reference's help.
    assert repr(schema.decode_compiled(cls, memoryview(body))) == repr(msg)


def test_ordinary_messages_take_the_fast_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("the reference path was used")

    monkeypatch.setattr(codec, "_decode_body_reference", refuse)
    for task in (sample_stage_task(), _backward_task(), _tail_task(layer_start=0)):
        assert decode(encode(task)) == task
    assert decode(encode(_hello())) == _hello()


def test_records_that_hold_no_records_are_built_by_the_compiled_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leaf records (most of what a coordinator builds) are constructed through the
    compiled decoder; the reference only decides refusals and builds container records."""
    tasks = [sample_stage_task(), _backward_task(), _tail_task(layer_start=0)]

    def refuse(*args: Any) -> None:
        raise AssertionError("the reference path was used")

    monkeypatch.setattr(schema, "_build", refuse)
    assert sample_ref() == sample_ref(shape=[2, 3], stride=[3, 1])  # lists are stored as tuples
    assert _hello() == decode(encode(_hello()))
    done = TaskDone(job_id="j", task_id=1, attempt=0, worker_id=2, seconds=1, layer_times={})
    assert type(done.seconds) is float  # as a receiver would see it
    with pytest.raises(AssertionError, match="reference path"):
        sample_stage_task()  # holds records: built by the reference
    monkeypatch.undo()
    assert all(decode(encode(t)) == t for t in tasks)
    # A refusal is decided and worded by the reference (as in test_cross_field_rules).
    with pytest.raises(ProtocolError, match="field stride: expected tuple of 2 ints"):
        sample_ref(stride=(1,))
    with pytest.raises(ProtocolError, match="field counter: expected non-negative int"):
        EventWait(counter=-1, at_least=0)


def test_every_message_type_is_registered_and_exported() -> None:
    exported = [getattr(proto, name) for name in proto.__all__]
    for name, cls in MESSAGE_TYPES.items():
        assert cls.__name__ == name and any(cls is e for e in exported)
        assert issubclass(cls, Message)
    for name in proto.__all__:
        assert hasattr(proto, name), name


@pytest.mark.parametrize("module", [structs, worker_messages, client_messages])
def test_docstring_lists_every_message_and_every_field_is_documented(
    module: types.ModuleType,
) -> None:
    doc = module.__doc__ or ""
    source = inspect.getsource(module)
    lines = source.splitlines()
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    declared = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, Struct) and c.__module__ == module.__name__
    ]
    assert declared
    for cls in declared:
        assert re.search(rf"\b{cls.__name__}\b", doc), f"{cls.__name__} missing from docstring"
        fields = [n for n in classes[cls.__name__].body if isinstance(n, ast.AnnAssign)]
        assert [f.target.id for f in fields] == list(cls.__struct_fields__)  # type: ignore[attr-defined]
        for f in fields:
            above = lines[f.lineno - 2].strip()
            assert above.startswith("#:"), f"{cls.__name__}.{f.target.id} has no #: comment"  # type: ignore[attr-defined]


def test_every_struct_and_message_is_declared_in_one_of_the_catalogues() -> None:
    modules = {m.__name__ for m in (structs, worker_messages, client_messages)}
    exported = [getattr(proto, name) for name in proto.__all__]
    declared = [c for c in exported if isinstance(c, type) and issubclass(c, Struct)]
    assert len(declared) > len(MESSAGE_TYPES)
    for cls in declared:
        if cls not in (Struct, Message):
            assert cls.__module__ in modules, cls
    for cls in MESSAGE_TYPES.values():
        assert cls.__module__ != structs.__name__, f"{cls.__name__} is a message"


def test_records_alone_cannot_be_encoded() -> None:
    with pytest.raises(ProtocolError, match="not a registered message type"):
        encode(sample_ref())  # type: ignore[arg-type]


def test_tuple_fields_decode_to_tuples() -> None:
    task = decode(encode(sample_stage_task()))
    assert isinstance(task, StageTask)
    shape = task.microbatches[0].input.shape
    assert shape == (2, 3) and type(shape) is tuple
    assert type(task.microbatches) is list and type(task.microbatches[1].waits) is list
    assert task.options == {"note": [1, "x"]} and type(task.options["note"]) is list


def test_nested_records_travel_as_arrays() -> None:
    frames = encode(sample_stage_task())
    body = _body(frames)
    assert list(body) == list(StageTask.__struct_fields__)
    ref = body["microbatches"][0][_at(MicrobatchIO, "input")]
    assert ref == ["acts", 0, "bfloat16", [2, 3], [3, 1]]
    # Trailing fields with a default may be left out of an array.
    layout = LayerLayout(layer=2, params=[])
    frames = encode(
        JobSetup(
            job_id="j",
            model_config={},
            lora=None,
            compute_dtype="bfloat16",
            arenas=[],
            layers=[layout],
            num_microbatches=1,
            global_microbatches=1,
            microbatch_offset=0,
        )
    )
    body = _body(frames)
    body["layers"][0] = body["layers"][0][: _at(LayerLayout, "params_odd")]
    assert decode_as(_with_body(frames, body), JobSetup).layers == [layout]


@pytest.mark.parametrize(
    ("change", "field", "expected", "seen"),
    [
        (
            lambda r: r + ["extra"],
            "microbatches[0].input",
            "TensorRef as an array of its field values [arena, offset, dtype, shape, stride]",
            "6 values",
        ),
        (
            lambda r: r[:3],
            "microbatches[0].input.shape",
            "tuple of non-negative int (required field)",
            "nothing: field is missing",
        ),
        (
            lambda r: dict(zip(["arena", "offset", "dtype", "shape", "stride"], r)),
            "microbatches[0].input",
            "TensorRef as an array",
            "(map)",
        ),
        (lambda r: None, "microbatches[0].input", "TensorRef as an array", "None (None)"),
    ],
)
def test_nested_record_array_errors(
    change: Callable[[list[Any]], Any], field: str, expected: str, seen: str
) -> None:
    frames = encode(sample_stage_task())
    body = _body(frames)
    mb = body["microbatches"][0]
    mb[_at(MicrobatchIO, "input")] = change(mb[_at(MicrobatchIO, "input")])
    err = _decode_error(_with_body(frames, body))
    assert err.field == field, str(err)
    assert f"invalid StageTask: field {field}: expected {expected}" in str(err)
    assert seen in str(err)


def test_float_field_accepts_int_and_stores_float() -> None:
    frames = _frames("Heartbeat", {"sender": "w", "seq": 1, "sent_at": 5})
    msg = decode_as(frames, Heartbeat)
    assert msg.sent_at == 5.0 and type(msg.sent_at) is float


def test_nan_and_inf_survive_where_allowed() -> None:
    status = JobStatus(
        job_id="j",
        state="failed",
        step=3,
        total_steps=10,
        loss=math.nan,
        message="diverged",
        output_dir=None,
    )
    back = decode_as(encode(status), JobStatus)
    assert back.loss is not None and math.isnan(back.loss)


def test_num_microbatches() -> None:
    assert sample_stage_task().num_microbatches == 2
    assert decode_as(encode(_tail_task()), StageTask).num_microbatches == 2


def test_defaults_fill_absent_optional_fields() -> None:
    frames = encode(sample_stage_task())
    body = _body(frames)
    del body["options"]
    assert decode_as(_with_body(frames, body), StageTask).options == {}


def test_frames_may_be_any_bytes_like() -> None:
    frames = encode(_hello())
    for convert in (bytearray, memoryview, zmq.Frame):
        assert decode([convert(f) for f in frames]) == _hello()


# --------------------------------------------------------------------------- error messages


def test_missing_field_names_message_field_and_type() -> None:
    frames = encode(_hello())
    body = _body(frames)
    del body["pid"]
    err = _decode_error(_with_body(frames, body))
    assert "Hello" in str(err) and "pid" in str(err) and "missing" in str(err)
    assert "non-negative int" in str(err)
    assert err.message_type == "Hello" and err.field == "pid"


def test_unknown_field_is_refused() -> None:
    frames = encode(Heartbeat(sender="w", seq=1, sent_at=0.0))
    body = _body(frames) | {"colour": "red"}
    err = _decode_error(_with_body(frames, body))
    assert "Heartbeat" in str(err) and "colour" in str(err) and "no such field" in str(err)
    assert "'red' (str)" in str(err)


@pytest.mark.parametrize(
    ("field", "value", "expected", "seen"),
    [
        ("seq", "7", "expected non-negative int", "'7' (str)"),
        ("seq", True, "expected non-negative int", "True (bool)"),
        ("seq", -1, "expected non-negative int", "-1 (int)"),
        ("seq", 1.0, "expected non-negative int", "1.0 (float)"),
        ("sent_at", None, "expected float", "None (None)"),
        ("sent_at", False, "expected float", "False (bool)"),
        ("sender", "", "expected non-empty str", "'' (str)"),
        ("sender", b"w", "expected non-empty str", "b'w' (bytes)"),
    ],
)
def test_wrong_type_says_field_expected_and_seen(
    field: str, value: Any, expected: str, seen: str
) -> None:
    body = {"sender": "w", "seq": 1, "sent_at": 0.0} | {field: value}
    err = _decode_error(_frames("Heartbeat", body))
    text = str(err)
    assert text.startswith(f"invalid Heartbeat: field {field}: "), text
    assert expected in text and seen in text, text
    assert err.field == field


def test_nested_field_path_is_reported() -> None:
    frames = encode(sample_stage_task())
    body = _body(frames)
    body["microbatches"][1][_at(MicrobatchIO, "input")][_at(TensorRef, "offset")] = -8
    err = _decode_error(_with_body(frames, body))
    assert str(err) == (
        "invalid StageTask: field microbatches[1].input.offset: expected non-negative int, "
        "got -8 (int)"
    )
    assert err.field == "microbatches[1].input.offset"


def test_literal_and_dtype_choices() -> None:
    err = _decode_error(_with_body(encode(_hello()), _body(encode(_hello())) | {"device": "gpu"}))
    assert "device" in str(err) and "one of 'cpu', 'cuda'" in str(err) and "'gpu'" in str(err)

    body = _body(encode(sample_stage_task()))
    body["microbatches"][0][_at(MicrobatchIO, "output")][_at(TensorRef, "dtype")] = "float8"
    err = _decode_error(_frames("StageTask", body))
    assert err.field == "microbatches[0].output.dtype"
    assert "'bfloat16'" in str(err) and "float8" in str(err)


def test_cross_field_rules() -> None:
    with pytest.raises(ProtocolError, match=r"TensorRef: field stride: expected tuple of 2 ints"):
        sample_ref(stride=(1,))
    body = _body(encode(sample_stage_task()))
    saved = body["microbatches"][1][_at(MicrobatchIO, "saved")][0][_at(LayerTensorRef, "ref")]
    saved[_at(TensorRef, "stride")] = [1, 1, 1]
    err = _decode_error(_frames("StageTask", body))
    assert err.field == "microbatches[1].saved[0].ref.stride"
    assert "expected tuple of 2 ints (one per shape dimension)" in str(err)
    with pytest.raises(ProtocolError, match=r"field layer_stop: expected an int > layer_start"):
        sample_stage_task(layer_start=5, layer_stop=5)
    with pytest.raises(ProtocolError, match=r"field device_index: expected None for cpu"):
        _hello(device="cpu", device_index=0)
    with pytest.raises(ProtocolError, match=r"field device_index: expected an int for a cuda"):
        _hello(device_index=None)

    def job_setup(**fields: Any) -> JobSetup:
        base: dict[str, Any] = dict(
            job_id="j",
            model_config={},
            lora=None,
            compute_dtype="bfloat16",
            arenas=[ArenaInfo(name="acts", path="/dev/shm/x", nbytes=10)],
            layers=[],
            num_microbatches=1,
            global_microbatches=1,
            microbatch_offset=0,
        )
        return JobSetup(**(base | fields))

    stray = [NamedTensorRef(name="w", ref=sample_ref(arena="nope"))]
    for key in ("params", "grads"):
        with pytest.raises(ProtocolError, match=rf"layers\[0\]\.{key}\[0\]\.ref\.arena"):
            job_setup(layers=[LayerLayout(**{"layer": 0, "params": [], key: stray})])
    # A node's microbatches must lie inside the global batch's.
    with pytest.raises(ProtocolError, match=r"field microbatch_offset: expected at most"):
        job_setup(num_microbatches=2, global_microbatches=4, microbatch_offset=3)


def _swap_mb(task: StageTask, **changes: Any) -> StageTask:
    """`task` with microbatch 1 changed (built without validation: the test validates)."""
    mbs = list(task.microbatches)
    mbs[1] = replace(mbs[1], **changes)
    return replace(task, microbatches=mbs)


_KIND_RULES: list[tuple[Callable[[], Any], str, str]] = [
    # (make an invalid task, field, start of the expected text)
    (
        lambda: sample_stage_task(microbatches=[]),
        "microbatches",
        "a non-empty list of MicrobatchIO",
    ),
    (
        lambda: sample_stage_task(microbatches=[sample_microbatch(0), sample_microbatch(0)]),
        "microbatches[1].index",
        "an index not",
    ),
    (
        lambda: _swap_mb(sample_stage_task(), output=None),
        "microbatches[1].output",
        "a TensorRef (a forward task writes the stage output)",
    ),
    (
        lambda: _swap_mb(sample_stage_task(), grad_output=sample_ref()),
        "microbatches[1].grad_output",
        "None (grad_output is for backward tasks only; this task is 'forward')",
    ),
    (
        lambda: _swap_mb(sample_stage_task(), labels=sample_ref()),
        "microbatches[1].labels",
        "None (labels is for tail tasks only",
    ),
    (
        lambda: _swap_mb(sample_stage_task(), saved=[LayerTensorRef(layer=5, ref=sample_ref())]),
        "microbatches[1].saved[0].layer",
        "a layer strictly inside (1, 5)",
    ),
    (
        lambda: _swap_mb(sample_stage_task(), saved=[LayerTensorRef(layer=1, ref=sample_ref())]),
        "microbatches[1].saved[0].layer",
        "a layer strictly inside (1, 5)",
    ),
    (
        lambda: sample_stage_task(grad_waits=[EventWait(counter=1, at_least=1)]),
        "grad_waits",
        "an empty list for a forward task",
    ),
    (
        lambda: sample_stage_task(grad_signals=[EventSignal(counter=1, value=1)]),
        "grad_signals",
        "an empty list for a forward task",
    ),
    (lambda: sample_stage_task(loss_denominator=5), "loss_denominator", "0 for a forward task"),
    (lambda: _backward_task(loss_denominator=5), "loss_denominator", "0 for a backward task"),
    (lambda: _tail_task(loss_denominator=0), "loss_denominator", "a positive int for a tail"),
    (lambda: _tail_task(grad_part=1), "grad_part", "0 for a tail task"),
    (lambda: sample_stage_task(grad_part=1), "grad_part", "0 for a forward task"),
    (lambda: _backward_task(grad_part=2), "grad_part", "0 or 1"),
    (
        lambda: _swap_mb(_backward_task(), grad_output=None),
        "microbatches[1].grad_output",
        "a TensorRef (a backward task needs grad_output)",
    ),
    (
        lambda: _swap_mb(_backward_task(), saved=[LayerTensorRef(layer=2, ref=sample_ref())]),
        "microbatches[1].saved",
        "[] (a backward task saves nothing)",
    ),
    (
        lambda: _swap_mb(_backward_task(), loss=sample_ref(dtype="float32")),
        "microbatches[1].loss",
        "None (loss is for tail tasks only; this task is 'backward')",
    ),
    (
        lambda: _swap_mb(_backward_task(layer_start=0), output=sample_ref()),
        "microbatches[1].output",
        "None (a backward task starting at layer 0 has no input gradient)",
    ),
    (
        lambda: _swap_mb(_backward_task(), output=None),
        "microbatches[1].output",
        "a TensorRef (a backward task writes the gradient w.r.t. its input)",
    ),
    (
        lambda: _swap_mb(_tail_task(), labels=None),
        "microbatches[1].labels",
        "a TensorRef (a tail task needs labels)",
    ),
    (
        lambda: _swap_mb(_tail_task(), loss=None),
        "microbatches[1].loss",
        "a TensorRef (a tail task needs loss)",
    ),
    (
        lambda: _swap_mb(_tail_task(layer_start=0), output=sample_ref()),
        "microbatches[1].output",
        "None (a tail task starting at layer 0 has no input gradient)",
    ),
]


@pytest.mark.parametrize(("make", "field", "expected"), _KIND_RULES)
def test_stage_task_kind_rules(make: Callable[[], Any], field: str, expected: str) -> None:
    # Each case is checked both where a task is built and where it is received.
    with pytest.raises(ProtocolError) as info:
        make()
    err = info.value
    assert err.field == field, str(err)
    assert str(err).startswith(f"invalid StageTask: field {field}: expected {expected}"), str(err)
    with _unchecked(StageTask):
        task = make()
    received = _decode_error(encode(task))
    assert str(received) == str(err)


@contextlib.contextmanager
def _unchecked(cls: type) -> Iterator[None]:
    """Within this block, `cls` is built without its cross-field rules (to send an invalid
    message, as a buggy or hostile peer would): a valid instance gets the field values
    written over it."""
    template = {StageTask: sample_stage_task}[cls]()
    real_build = schema._build  # type: ignore[attr-defined]

    def build(c: type, values: dict[str, Any]) -> Any:
        if c is not cls:
            return real_build(c, values)
        obj = msgspec.structs.replace(template)
        for name, value in values.items():
            msgspec.structs.force_setattr(obj, name, value)
        return obj

    schema._build = build  # type: ignore[attr-defined]
    try:
        yield
    finally:
        schema._build = real_build  # type: ignore[attr-defined]


def test_valid_tasks_of_every_kind() -> None:
    tasks = [sample_stage_task(), _backward_task(), _tail_task()]
    tasks += [_backward_task(layer_start=0), _tail_task(layer_start=0)]
    for task in tasks:
        assert decode(encode(task)) == task
    assert {t.kind for t in tasks} == {"forward", "backward", "tail"}


def test_microbatch_rules() -> None:
    with pytest.raises(ProtocolError, match=r"MicrobatchIO: field loss.dtype: expected 'float32'"):
        sample_microbatch(loss=sample_ref(dtype="bfloat16"))
    twice = [LayerTensorRef(layer=2, ref=sample_ref()), LayerTensorRef(layer=2, ref=sample_ref())]
    with pytest.raises(ProtocolError, match=r"field saved: expected one entry per layer"):
        sample_microbatch(saved=twice)


def test_construction_validates_with_the_same_messages() -> None:
    with pytest.raises(ProtocolError) as info:
        sample_stage_task(microbatches=[sample_microbatch(), "not a microbatch"])
    assert str(info.value) == (
        "invalid StageTask: field microbatches[1]: expected MicrobatchIO, "
        "got 'not a microbatch' (str)"
    )
    with pytest.raises(ProtocolError) as info:
        sample_microbatch(output=5)
    assert str(info.value) == (
        "invalid MicrobatchIO: field output: expected TensorRef or None, got 5 (int)"
    )
    with pytest.raises(ProtocolError, match=r"field options\['x'\]\[0\]: expected msgpack value"):
        sample_stage_task(options={"x": [object()]})
    with pytest.raises(ProtocolError, match="field offset: expected non-negative int"):
        sample_ref(offset=-1)
    with pytest.raises(ProtocolError, match="msgpack's range"):
        sample_ref(offset=2**64)
    with pytest.raises(ProtocolError, match="UTF-8"):
        Heartbeat(sender="\ud800", seq=0, sent_at=0.0)
    with pytest.raises(TypeError):
        Heartbeat("w", 0, 0.0)  # type: ignore[misc]  # keyword-only
    assert sample_ref(shape=[2, 3], stride=[3, 1]).shape == (2, 3)  # lists become tuples


def test_messages_are_frozen() -> None:
    msg = Heartbeat(sender="w", seq=0, sent_at=0.0)
    with pytest.raises(AttributeError):
        msg.seq = 1  # type: ignore[misc]


def test_messages_own_their_containers() -> None:
    mbs = [sample_microbatch()]
    waits = [EventWait(counter=1, at_least=1)]
    options: dict[str, Any] = {"x": [1]}
    task = sample_stage_task(microbatches=mbs, weight_waits=waits, options=options)
    mbs.append("garbage")  # type: ignore[arg-type]
    waits.clear()
    options["x"].append(object())
    assert len(task.microbatches) == 1 and len(task.weight_waits) == 1
    assert task.options == {"x": [1]}
    assert decode(encode(task)) == task


def test_mutating_a_message_in_place_still_fails_cleanly() -> None:
    # Not validated again by encode (hot path), but never a non-protocol error: either
    # encode refuses, or the receiver does.
    task = sample_stage_task()
    task.microbatches.clear()
    err = _decode_error(encode(task))
    assert err.field == "microbatches" and "non-empty" in str(err)
    task = sample_stage_task()
    task.microbatches[0].waits.append(3)  # type: ignore[arg-type]
    err = _decode_error(encode(task))  # an int encodes; the receiver wants an EventWait
    assert err.field == "microbatches[0].waits[1]", str(err)
    for bad in (object(), 2**70, "\ud800"):
        task = sample_stage_task()
        task.options["x"] = bad
        with pytest.raises(ProtocolError, match="cannot encode StageTask"):
            encode(task)
    task = sample_stage_task()
    task.options["self"] = task.options  # a cycle
    with pytest.raises(ProtocolError, match="cannot encode StageTask"):
        encode(task)


def test_version_mismatch_and_reject_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker of the next version says Hello to this coordinator.
    ours, theirs = PROTOCOL_VERSION, PROTOCOL_VERSION + 1
    hello = encode(_hello())
    hello_next = [b"RP" + theirs.to_bytes(2, "big") + hello[0][4:]]
    with pytest.raises(ProtocolVersionError) as info:
        decode(hello_next)
    err = info.value
    assert isinstance(err, ProtocolError)
    assert (err.seen_version, err.expected_version, err.message_type) == (theirs, ours, "Hello")
    assert f"version {theirs}" in str(err) and f"version {ours}" in str(err)

    # The coordinator answers with a Reject at its own version ...
    reject = encode(Reject(reason=str(err), expected_version=err.expected_version))
    assert decode_as(reject, Reject).expected_version == PROTOCOL_VERSION
    # ... which the newer worker cannot read, but learns exactly why.
    monkeypatch.setattr(codec, "PROTOCOL_VERSION", theirs)
    monkeypatch.setattr(codec, "_HEADER", b"RP" + theirs.to_bytes(2, "big"))
    with pytest.raises(ProtocolVersionError) as info:
        decode(reject)
    assert (info.value.seen_version, info.value.expected_version) == (ours, theirs)
    assert info.value.message_type == "Reject"


def test_errors_pickle() -> None:
    err = _decode_error(_frames("Heartbeat", {"sender": "w", "seq": -1, "sent_at": 0.0}))
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.field, back.message_type) == (str(err), "seq", "Heartbeat")
    verr = ProtocolVersionError(3, 1, message_type="Hello")
    vback = pickle.loads(pickle.dumps(verr))
    assert (vback.seen_version, vback.expected_version, vback.message_type) == (3, 1, "Hello")
    assert str(vback) == str(verr)


def test_decode_as_names_expected_type() -> None:
    frames = encode(Reject(reason="busy", expected_version=PROTOCOL_VERSION))
    with pytest.raises(ProtocolError, match="expected a Welcome message, got Reject"):
        decode_as(frames, Welcome)
    with pytest.raises(TypeError):
        decode_as(frames, int)  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("frames", "pattern"),
    [
        ([], "expected 1 frame "),
        ([*_join(_HDR, b"Ack", b"\x80"), b"\x80"], "expected 1 frame "),
        ([b"id", *_join(_HDR, b"Ack", b"\x80")], "expected 1 frame "),
        (None, "expected a sequence of frames"),
        (["RP"], "frame 0 is 'RP' \\(str\\)"),
        ([5], "frame 0 is 5"),
        ([b"RP\x00"], "bad header"),
        ([b"XX\x00\x01\x03Ack\x80"], "bad header"),
        ([_HDR], "bad type name: .* got length missing"),
        (_join(_HDR, b"", b"\x80"), "bad type name"),
        (_join(_HDR, b"A" * 65, b"\x80"), "bad type name"),
        (_join(_HDR, "Äck".encode(), b"\x80"), "bad type name"),
        ([_HDR + b"\x09Ack"], "bad type name: .* got length 9 and b'Ack'"),  # cut short
        ([_HDR + b"\x04Ack\x80"], "bad type name"),  # the length byte takes a body byte
        (_join(_HDR, b"Nope", b"\x80"), "unknown message type 'Nope'"),
        (_join(_HDR, b"Ack", b""), "malformed Ack body"),
        (_join(_HDR, b"Ack", b"\x80\x00"), "malformed Ack body: ExtraData"),
        (_join(_HDR, b"Ack", b"\x92\x01\x02"), "body: expected a map of fields"),
        (_join(_HDR, b"Ack", b"\xdd\xff\xff\xff\xff"), "malformed Ack body"),
        (_join(_HDR, b"Ack", b"\xd6\xff\x00\x00\x00\x01"), "malformed Ack body"),  # timestamp
        (_join(_HDR, b"Ack", b"\xc7\x00\x05"), "malformed Ack body"),  # empty ext
        (_join(_HDR, b"Ack", b"\x81\xa1a\xc1"), "malformed Ack body"),  # 0xc1 never used
        (_join(_HDR, b"Ack", b"\x81\x01\x02"), "malformed Ack body"),  # int key
        (_join(_HDR, b"Ack", b"\x81\xa1a\xa2\xff\xfe"), "malformed Ack body"),  # bad UTF-8
        (_join(_HDR, b"Ack", b"\x91" * 100_000), "malformed Ack body"),  # deep nesting
        (_join(_HDR, b"Ack", b"\x81\xc4\x01k\x01"), "field b'k'"),  # bin key
    ],
)
def test_malformed_frames(frames: Any, pattern: str) -> None:
    err = _decode_error(frames)
    assert re.search(pattern, str(err)), str(err)
    assert type(err) is ProtocolError


class _HostileFrames:
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> bytes:
        raise RuntimeError("boom")


class _BadLen:
    def __len__(self) -> int:
        raise ValueError("no length")


@pytest.mark.parametrize(
    "frames", [_HostileFrames(), _BadLen(), "abc", {0: b"", 1: b""}, b"abc", iter([b"x"])]
)
def test_odd_frame_containers(frames: Any) -> None:
    assert type(_decode_error(frames)) is ProtocolError


def test_a_released_buffer_is_a_protocol_error() -> None:
    view = memoryview(encode(Ack())[0])
    view.release()  # memoryview(view) now raises ValueError
    assert "expected a bytes-like object" in str(_decode_error([view]))


def test_peer_supplied_names_are_shortened_in_errors() -> None:
    body = {"sender": "w", "seq": 1, "sent_at": 0.0, "k" * 10_000: 1}
    err = _decode_error(_frames("Heartbeat", body))
    assert "kkk..." in str(err) and len(str(err)) < 400


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_intervals_must_be_positive(value: float) -> None:
    with pytest.raises(ProtocolError, match="field heartbeat_interval_s: expected positive float"):
        Welcome(worker_id=0, coordinator_id="c", heartbeat_interval_s=value, arena_dir="/dev/shm")


def test_base_classes_are_not_records() -> None:
    for cls in (Struct, Message):
        with pytest.raises(TypeError, match="not a declared"):
            cls()


def test_body_size_limits() -> None:
    frames = encode(Heartbeat(sender="w" * 100, seq=1, sent_at=0.0))
    err = _decode_error(frames, max_body_bytes=50)
    assert "max_body_bytes" in str(err) and "Heartbeat" in str(err)
    assert decode(frames, max_body_bytes=len(_parts(frames)[2])).seq == 1
    with pytest.raises(ProtocolError, match="max_body_bytes"):
        encode(Heartbeat(sender="w" * 100, seq=1, sent_at=0.0), max_body_bytes=50)
    huge = _join(_HDR, b"Ack", b"\x80" + b"\x00" * (16 * 2**20))
    assert "more than the limit" in str(_decode_error(huge))


def test_any_values_nested_too_deep_are_refused() -> None:
    deep: Any = 1
    for _ in range(schema.MAX_ANY_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nested at most"):
        sample_stage_task(options={"x": deep})
    body = _body(encode(sample_stage_task())) | {"options": {"x": deep}}
    assert "nested at most" in str(_decode_error(_frames("StageTask", body)))


# --------------------------------------------------------------------------- dtypes


def test_dtype_helpers() -> None:
    for name in DTYPE_NAMES:
        dtype = name_to_dtype(name)
        assert isinstance(dtype, torch.dtype)
        assert dtype_to_name(dtype) == name
        assert proto.dtype_itemsize(name) == dtype.itemsize
    with pytest.raises(ProtocolError, match="complex64"):
        dtype_to_name(torch.complex64)
    with pytest.raises(ProtocolError, match="unknown dtype name 'float8'"):
        name_to_dtype("float8")
    with pytest.raises(ProtocolError):
        name_to_dtype(["float32"])  # type: ignore[arg-type]


def test_tensor_ref_geometry_matches_torch() -> None:
    ref = TensorRef.contiguous(arena="acts", offset=64, dtype="bfloat16", shape=(2, 3, 4))
    assert ref.stride is None and ref.full_stride == (12, 4, 1) and ref.numel == 24
    assert torch.empty(2, 3, 4).stride() == ref.full_stride
    assert TensorRef.contiguous(arena="a", offset=0, dtype="int8", shape=()).full_stride == ()
    assert ref.end_byte == 64 + 24 * 2
    base = torch.zeros(100, dtype=torch.float32)
    view = base.as_strided((3, 2), (1, 5), 4)
    tref = TensorRef(arena="a", offset=16, dtype="float32", shape=(3, 2), stride=(1, 5))
    last = view[-1, -1].data_ptr() - base.data_ptr() + 4
    assert tref.end_byte == last
    assert TensorRef(arena="a", offset=8, dtype="int8", shape=(0, 5), stride=(5, 1)).end_byte == 8


# --------------------------------------------------------------------------- fuzzing

_MUTATIONS_PER_EXAMPLE = 48
_FUZZ_EXAMPLES = 400  # 400 * 48 = 19,200 mutated inputs, checked below


def _random_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random msgpack-encodable value, biased towards edge cases."""
    kind = rnd.randrange(14 if depth < 4 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice([0, -1, 1, 2**63 - 1, -(2**63), 2**64 - 1, 255, -129])
    if kind == 3:
        return rnd.randint(-(2**40), 2**40)
    if kind == 4:
        return rnd.choice([0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e308])
    if kind == 5:
        return rnd.choice(["", "cpu", "cuda", "forward", "float32", "a" * 70, "Äck", "x"])
    if kind == 6:
        return rnd.randbytes(rnd.randrange(6))
    if kind == 7:
        return msgpack.ExtType(rnd.randrange(128), rnd.randbytes(rnd.randrange(3)))
    if kind == 8:
        return rnd.uniform(-1e6, 1e6)
    if kind in (9, 10):
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    keys: list[Any] = [rnd.choice(["arena", "offset", "shape", "x", ""]) for _ in range(3)]
    if rnd.random() < 0.1:
        keys.append(rnd.randbytes(2))
    return {k: _random_value(rnd, depth + 1) for k in keys[: rnd.randrange(4)]}


def _containers(obj: Any, out: list[Any]) -> list[Any]:
    if isinstance(obj, (dict, list)):
        out.append(obj)
        for child in obj.values() if isinstance(obj, dict) else obj:
            _containers(child, out)
    return out


def _mutate_structure(body: Any, rnd: random.Random) -> Any:
    """Drop/add fields, swap a value's type, make numbers negative, deep inside."""
    targets = _containers(body, [])
    if not targets:
        return _random_value(rnd)
    target = rnd.choice(targets)
    op = rnd.randrange(5)
    if isinstance(target, dict):
        keys = list(target)
        if op == 0 and keys:
            del target[rnd.choice(keys)]
        elif op == 1:
            target[rnd.choice(["extra", "offset", "kind", "seq", "a" * 3])] = _random_value(rnd)
        elif keys:
            key = rnd.choice(keys)
            old = target[key]
            if op == 2 and isinstance(old, int) and not isinstance(old, bool):
                target[key] = -(old % 2**63) - 1
            elif op == 3:
                target[key] = {int: "1", str: 1, float: True, bool: 1, list: (), dict: []}.get(
                    type(old), None
                )
            else:
                target[key] = _random_value(rnd)
    else:
        if op == 0 and target:
            del target[rnd.randrange(len(target))]
        elif op == 1:
            target.append(_random_value(rnd))
        elif target:
            target[rnd.randrange(len(target))] = _random_value(rnd)
    return body


def _damage(data: bytes, rnd: random.Random) -> bytes:
    """Flip bits in, truncate, extend or overwrite a span of `data`."""
    op = rnd.randrange(4)
    if op == 1:
        return data[: rnd.randrange(len(data) + 1)]
    if op == 2:
        return data + rnd.randbytes(rnd.randint(1, 8))
    buf = bytearray(data)
    if buf and op == 0:
        for _ in range(rnd.randint(1, 4)):
            buf[rnd.randrange(len(buf))] ^= 1 << rnd.randrange(8)
    elif buf:
        start = rnd.randrange(len(buf))
        span = rnd.randint(1, 8)
        buf[start : start + span] = rnd.randbytes(span)
    return bytes(buf)


def _mutate(frames: list[bytes], rnd: random.Random) -> tuple[Any, dict[str, Any]]:
    """One mutated input (frames, decode kwargs) from a valid encoding. Most mutations
    change one part (header, type name, body) and write the length byte to match;
    op 0 damages the frame as a whole, length byte included."""
    parts = list(_parts(frames))
    op = rnd.randrange(15)
    if op == 0:
        return [_damage(frames[0], rnd)], {}
    if op in (1, 2, 3):  # damage one part
        i = rnd.randrange(3)
        parts[i] = _damage(parts[i], rnd)
    elif op == 4:  # another protocol version
        parts[0] = b"RP" + struct.pack(">H", rnd.choice([0, 1, 255, 65535]))
    elif op == 5:  # wrong frame counts
        choice = rnd.randrange(4)
        if choice == 0:
            return [], {}
        if choice == 1:
            return [*frames, rnd.randbytes(rnd.randrange(5))], {}
        if choice == 2:
            return [b"\x00identity", *frames], {}
        return [*frames, *frames], {}
    elif op == 6:  # the body of one type under another type's name
        parts[1] = rnd.choice(_TYPE_NAMES).encode()
    elif op in (7, 8, 9, 10):  # structural change to the body: fields, types, signs
        body = msgpack.unpackb(parts[2])
        for _ in range(rnd.randint(1, 3)):
            body = _mutate_structure(body, rnd)
        parts[2] = msgpack.packb(body, use_bin_type=True)
    elif op == 11:  # a random msgpack object as body
        parts[2] = msgpack.packb(_random_value(rnd), use_bin_type=True)
    elif op == 12:  # a frame that is not bytes, or not a sequence of frames
        bad = rnd.choice([None, 3, "RP", 1.5, object(), [b"x"]])
        return (bad, {}) if rnd.random() < 0.2 else ([bad], {})
    elif op == 13:  # small body limit
        return frames, {"max_body_bytes": rnd.randrange(len(parts[2]) + 2)}
    else:  # random bytes for type name and body, valid header
        parts[1:] = [rnd.randbytes(rnd.randrange(10)), rnd.randbytes(rnd.randrange(40))]
    return _join(*parts), {}


def test_fuzz_mutated_valid_encodings() -> None:
    counts = {"inputs": 0, "valid": 0, "errors": 0}

    @settings(
        max_examples=_FUZZ_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(msg=any_message, seed=st.integers(0, 2**32))
    def run(msg: Message, seed: int) -> None:
        frames = encode(msg)
        rnd = random.Random(seed)
        for _ in range(_MUTATIONS_PER_EXAMPLE):
            mutated, kwargs = _mutate(frames, rnd)
            try:
                result = _outcome(mutated, **kwargs)
            except Exception as e:
                raise AssertionError(f"seed={seed} frames={mutated!r} {kwargs}") from e
            counts["inputs"] += 1
            counts["valid" if isinstance(result, Message) else "errors"] += 1

    run()
    print(f"mutation fuzz: {counts}")  # visible with pytest -s
    assert counts["inputs"] >= 10_000, counts
    # Both outcomes must actually happen, or the mutations are too gentle/too harsh.
    assert counts["valid"] > 100 and counts["errors"] > 5_000, counts


class _Colour(enum.IntEnum):
    RED = 1


class _Word(str):
    pass


class _Shade(enum.Enum):
    DARK = "dark"


class _Pair(NamedTuple):
    a: int
    b: int


@dataclasses.dataclass
class _Point:
    x: int
    y: int


_ODD_VALUES: list[Any] = [
    *(None, True, 0, 1, -1, 2**64, -(2**63) - 1, 1.5, -0.5, math.nan, 3.0),
    *("", "x", "é", "\ud800", b"", b"x", bytearray(b"x")),
    *([], (), {}, [1], (1, 2), {"a": 1}, {1: 2}, [None], ["x"], object()),
    *(_Colour.RED, _Word("forward"), _Word("")),  # converted to plain int and str
    # encodable by msgspec, refused or converted by the reference
    *({3, 1}, frozenset({2, 3}), _Pair(1, 2), collections.OrderedDict(a=1.0)),
    *(uuid.UUID(int=7), datetime.datetime(2026, 1, 1), _Shade.DARK, _Point(1, 2)),
]


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_construction_of_odd_values_agrees_with_the_wire(data: st.DataObject) -> None:
    # Every record class, from a valid instance with zero to two fields replaced by odd
    # values (or by values of another field): construction either raises ProtocolError
    # or builds a record that survives the wire unchanged, through both decode paths.
    records = sorted(
        (c for c in schema._SPECS if c not in (Struct, Message)),  # type: ignore[attr-defined]
        key=lambda c: c.__name__,
    )
    cls = data.draw(st.sampled_from(records))
    specs = schema._SPECS[cls]  # type: ignore[attr-defined]
    valid = data.draw(for_struct(cls))
    kw = {spec.name: getattr(valid, spec.name) for spec in specs}
    if kw:
        donors = list(kw.values())
        for _ in range(data.draw(st.integers(0, 2))):
            name = data.draw(st.sampled_from(sorted(kw)))
            kw[name] = data.draw(st.sampled_from(_ODD_VALUES + donors))
    outcome = _described(lambda: cls(**kw))
    with mock.patch.dict(schema._FLAT_DECODERS, clear=True):  # type: ignore[attr-defined]
        assert _described(lambda: cls(**kw)) == outcome  # the reference builds the same
    try:
        built = cls(**kw)
    except ProtocolError:
        return
    for spec in specs:  # plain values were stored: no IntEnum, no str subclass, no list
        value = getattr(built, spec.name)
        assert type(value) in (type(None), bool, int, float, str, bytes, list, tuple, dict) or (
            isinstance(value, Struct)
        ), (spec.name, value)
    if issubclass(cls, Message):
        assert _outcome(encode(built)) == built


def test_fuzz_random_frames() -> None:
    seed = 20260101
    rnd = random.Random(seed)
    count = 0
    for _ in range(4000):
        n = rnd.choice([0, 1, 1, 1, 1, 1, 2, 3])
        frames: list[Any] = [rnd.randbytes(rnd.randrange(24)) for _ in range(n)]
        if n == 1 and rnd.random() < 0.8:
            body = frames[0]
            if rnd.random() < 0.6:
                body = msgpack.packb(_random_value(rnd), use_bin_type=True)
            frames = _join(_HDR, rnd.choice(_TYPE_NAMES).encode(), body)
        try:
            _outcome(frames)
        except Exception as e:
            raise AssertionError(f"seed={seed} iteration={count} frames={frames!r}") from e
        count += 1
    assert count == 4000


# --------------------------------------------------------------------------- sockets


def _serve_until_valid(sock: zmq.Socket[bytes], *, routed: bool) -> tuple[int, Message]:
    """A receive loop the way a daemon writes it: garbage is logged and skipped."""
    garbage = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not sock.poll(1000):
            continue
        frames = sock.recv_multipart(copy=False)
        envelope, payload = (frames[:1], frames[1:]) if routed else ([], frames)
        try:
            msg = decode(payload)
        except ProtocolError:
            garbage += 1
            continue
        sock.send_multipart([*(f.bytes for f in envelope), *encode(Ack())])
        return garbage, msg
    raise AssertionError("no valid message within 10 s")


_GARBAGE: list[list[bytes]] = [
    [b"hello"],
    [_HDR + b"\x09Heart"],
    _join(b"RP\x00\x09", b"Heartbeat", b"\x80"),
    _join(_HDR, b"Heartbeat", b"\xff\xff\xff"),
    _join(_HDR, b"Heartbeat", msgpack.packb({"sender": "w", "seq": -5, "sent_at": 0.0})),
    _join(_HDR, b"NoSuchType", b"\x80"),
    [*_join(_HDR, b"Ack", b"\x80"), b""],
    [b"", b"", b"", b"", b""],
]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_receive_loop_survives_garbage(transport: str) -> None:
    ctx = zmq.Context.instance()
    routed = transport == "tcp"
    server = ctx.socket(zmq.ROUTER if routed else zmq.PAIR)
    client = ctx.socket(zmq.DEALER if routed else zmq.PAIR)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
    # A short private directory: ipc paths are limited to ~100 characters.
    sock_dir = tempfile.TemporaryDirectory(prefix="rp-")
    try:
        if routed:
            port = server.bind_to_random_port("tcp://127.0.0.1")
            client.connect(f"tcp://127.0.0.1:{port}")
        else:
            address = f"ipc://{sock_dir.name}/protocol.sock"
            server.bind(address)
            client.connect(address)
        for frames in _GARBAGE:
            client.send_multipart(frames)
        beat = Heartbeat(sender="rp-worker-0", seq=42, sent_at=time.time())
        client.send_multipart(encode(beat))
        garbage, msg = _serve_until_valid(server, routed=routed)
        assert garbage == len(_GARBAGE)
        assert msg == beat
        assert client.poll(5000), "no reply"
        assert decode_as(client.recv_multipart(), Ack) == Ack()
    finally:
        server.close()
        client.close()
        sock_dir.cleanup()


def test_error_codes_are_one_closed_set() -> None:
    """Every ErrorReply code the coordinator, the client and the CLI spell is in
    ErrorCode, and a reply with any other code does not decode."""
    import re
    from pathlib import Path

    from roundpipe.protocol import ERROR_CODES, ErrorReply

    root = Path(__file__).resolve().parents[1]
    spelled = set()
    for folder in ("coordinator", "roundpipe", "worker"):
        for path in (root / folder).glob("*.py"):
            text = path.read_text()
            spelled |= set(re.findall(r'\bcode\s*==?\s*"([a-z_]+)"', text))
    assert spelled and spelled <= ERROR_CODES, spelled - ERROR_CODES
    frames = encode(ErrorReply(code="unknown_job", message="m"))
    bad = frames[0].replace(b"unknown_job", b"unknown_jab")
    with pytest.raises(ProtocolError, match="code"):
        decode([bad])
