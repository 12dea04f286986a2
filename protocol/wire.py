"""RoundPipe wire protocol: the one place where the wire format is written down.

Everything a RoundPipe process sends over ZeroMQ -- coordinator, workers, clients -- is
a *message* encoded by :func:`encode` and read back by :func:`decode`. There is no other
encode/decode path. Tensor data never travels on a socket: messages carry
:class:`TensorRef` descriptors (arena, offset, dtype, shape, stride) into shared-memory
arenas that every process maps (ARCHITECTURE.md sections 2 and 3).

Frames
======

One message is exactly three ZeroMQ frames::

    frame 0  header  4 bytes: b"RP" + protocol version as big-endian uint16
    frame 1  type    the message type name, ASCII, e.g. b"StageTask" (1..64 bytes,
                     [A-Za-z][A-Za-z0-9_]*); the class name of the message
    frame 2  body    msgpack map {field name: value} holding every field of the message

Example, a heartbeat at version 1::

    [b"RP\\x00\\x01", b"Heartbeat", msgpack({"sender": "rp-worker-0", "seq": 7,
                                           "sent_at": 1767225600.5})]

- The type travels as its own small frame (as in vLLM v1) so a receiver can route or
  reject a message without unpacking its body.
- Routing envelopes are not part of a message. A ROUTER socket prepends the peer's
  identity frame (and a REQ peer an empty delimiter frame); the socket layer strips
  them before calling :func:`decode` and adds them back after :func:`encode`. `decode`
  sees exactly the three frames above.
- Body values use msgpack's native types only: nil, bool, int (-2**63 .. 2**64-1),
  float, str (UTF-8), bin (bytes), array, map with str keys. No ext types (timestamps
  included). A nested record (e.g. a :class:`TensorRef`) is a map of its fields, a tuple
  is an array. Every field is written by the encoder; a receiver fills an absent field
  only where the class declares a default.

Version rule
============

:data:`PROTOCOL_VERSION` is one integer for the whole protocol. Any change to any
message -- a field added, removed, renamed or retyped, a new message type, a changed
meaning, a changed limit that a valid sender could hit -- bumps it. Peers must match
exactly: there is no negotiation and no compatibility window, because coordinator and
workers are installed together from one package. The header layout (b"RP" + uint16)
never changes, so every version can read every other version's number.

A frame 0 with another version makes :func:`decode` raise :class:`ProtocolVersionError`
carrying ``seen_version``, ``expected_version`` and, when frame 1 is readable, the
``message_type``. The handshake uses it: the coordinator answers a worker's mismatched
``Hello`` with a ``Reject(expected_version=...)`` encoded at the coordinator's own
version; the worker cannot read that body, but decoding it raises
``ProtocolVersionError(seen_version=<coordinator's>, message_type="Reject")``, which is
exactly what the worker must report before it exits.

Limits and errors
=================

``decode`` refuses, with :class:`ProtocolError` (or its subclass
:class:`ProtocolVersionError`) and never any other exception:

- a frame count other than 3, a frame that is not a bytes-like object;
- a header that is not exactly 4 bytes starting with b"RP"; a version mismatch;
- a type name that is empty, longer than 64 bytes, not ASCII, or not registered;
- a body larger than ``max_body_bytes`` (default :data:`DEFAULT_MAX_BODY_BYTES`, 16 MiB),
  checked before unpacking; msgpack's own per-object limits derived from the body length;
  nesting deeper than msgpack's stack (values typed ``Any`` at most
  :data:`MAX_ANY_DEPTH` levels); any ext type; invalid UTF-8; a non-str map key;
  a duplicate map key; trailing bytes after the body;
- a body that is not a map, a missing required field, an unknown field, a value of the
  wrong type (``bool`` is not an ``int``; an ``int`` is accepted where a ``float`` is
  expected), a negative size/offset/index, a string outside a fixed set of choices, or a
  violated cross-field rule (e.g. ``len(stride) != len(shape)``).

The error message names the message type, the field path, what was expected and what
was seen, e.g.::

    invalid StageTask: field inputs[2].offset: expected non-negative int, got -8 (int)

Constructing a message validates it with the same rules and messages, so an invalid
message cannot be built and a sender learns of a bad value where it made it. A message
owns copies of its lists and maps; :func:`encode` does not validate again.

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
    StageTask    C -> W   run layers [layer_start, layer_stop) over all microbatches
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
    ListJobs     K -> C   all jobs;                       reply JobList
    JobList      C -> K   a JobStatus per job
    ListWorkers  K -> C   all workers;                    reply WorkerList
    WorkerList   C -> K   a WorkerInfo per worker
    GetProgress  K -> C   progress events after a seq;    reply Progress or ErrorReply
    Progress     C -> K   ProgressEvents in seq order, and whether the job has ended
    ErrorReply   C -> K   a request failed: machine-readable code and a message
    Ack          C -> K   a request succeeded and has nothing to return

Records used inside messages (never sent alone): TensorRef, NamedTensorRef, ArenaInfo,
LayerLayout, EventWait, EventSignal, WorkerInfo, ProgressEvent.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple, TypeVar, Union

import msgpack

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_ANY_DEPTH",
    "MAX_TYPE_NAME_BYTES",
    "DTYPE_NAMES",
    "MESSAGE_TYPES",
    "ProtocolError",
    "ProtocolVersionError",
    "Struct",
    "Message",
    "encode",
    "decode",
    "decode_as",
    "dtype_to_name",
    "name_to_dtype",
    "dtype_itemsize",
    # records
    "TensorRef",
    "NamedTensorRef",
    "ArenaInfo",
    "LayerLayout",
    "EventWait",
    "EventSignal",
    "WorkerInfo",
    "ProgressEvent",
    # handshake
    "Hello",
    "Welcome",
    "Reject",
    # jobs to workers
    "JobSetup",
    "JobTeardown",
    # stage tasks
    "StageTask",
    "TaskDone",
    "TaskFailed",
    # liveness and control
    "Heartbeat",
    "Shutdown",
    # client API
    "SubmitJob",
    "JobAccepted",
    "GetJobStatus",
    "JobStatus",
    "CancelJob",
    "ListJobs",
    "JobList",
    "ListWorkers",
    "WorkerList",
    "GetProgress",
    "Progress",
    "ErrorReply",
    "Ack",
]

PROTOCOL_VERSION: int = 1
"""Bump on any change to any message (see "Version rule" above)."""

DEFAULT_MAX_BODY_BYTES: int = 16 * 1024 * 1024
"""Largest body :func:`decode` accepts unless told otherwise. Messages carry descriptors,
never tensor data, so even a JobSetup for a large MoE model stays far below this."""

MAX_ANY_DEPTH: int = 32
"""Deepest nesting of lists/maps inside a field typed ``Any`` (job specs, options).
Bounded so validation can never hit Python's recursion limit."""

MAX_TYPE_NAME_BYTES: int = 64
"""Longest message type name (frame 1)."""

_MAGIC = b"RP"
_HEADER_BYTES = 4
_NUM_FRAMES = 3
_TYPE_NAME_RE = re.compile(rb"[A-Za-z][A-Za-z0-9_]*\Z")
# msgpack's integer range: the encoder cannot write anything outside it.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_SEEN_REPR_CHARS = 80


# --------------------------------------------------------------------------- errors


class ProtocolError(Exception):
    """A message could not be encoded or decoded: malformed, oversized or invalid.

    ``message_type`` is the type involved when known; ``field`` is the dotted field path
    (``"inputs[2].offset"``) when the problem is one field.
    """

    def __init__(
        self, text: str, *, message_type: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(text)
        self.message_type = message_type
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only state would be lost by the default exception pickling, and errors
        # do cross process boundaries (worker -> coordinator logs, multiprocessing tests).
        return (
            _rebuild_error,
            (type(self), str(self), {"message_type": self.message_type, "field": self.field}),
        )


class ProtocolVersionError(ProtocolError):
    """The peer speaks another protocol version; see "Version rule" in the module doc."""

    def __init__(
        self, seen_version: int, expected_version: int, *, message_type: str | None = None
    ) -> None:
        what = f" (message type {message_type!r})" if message_type else ""
        super().__init__(
            f"protocol version mismatch: peer sent version {seen_version}{what}, this "
            f"process speaks version {expected_version}; coordinator and workers must be "
            "installed from the same RoundPipe release",
            message_type=message_type,
        )
        self.seen_version = seen_version
        self.expected_version = expected_version

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_version_error,
            (type(self), self.seen_version, self.expected_version, self.message_type),
        )


def _rebuild_error(cls: type[ProtocolError], text: str, state: dict[str, Any]) -> ProtocolError:
    return cls(text, **state)


def _rebuild_version_error(
    cls: type[ProtocolVersionError], seen: int, expected: int, message_type: str | None
) -> ProtocolVersionError:
    return cls(seen, expected, message_type=message_type)


class _Invalid(Exception):
    """Internal: one value failed validation. Containers prepend their path segment as
    the exception unwinds, so the success path never builds path strings."""

    def __init__(self, expected: str, seen: str) -> None:
        super().__init__(expected, seen)
        self.expected = expected
        self.seen = seen
        self.path: list[str] = []  # segments, innermost first

    def field_path(self) -> str:
        return "".join(reversed(self.path)).lstrip(".")

    def to_error(self, type_name: str) -> ProtocolError:
        where = self.field_path()
        text = f"invalid {type_name}: "
        text += f"field {where}: " if where else "body: "
        text += f"expected {self.expected}, got {self.seen}"
        return ProtocolError(text, message_type=type_name, field=where or None)


_WIRE_TYPE_NAMES: dict[type, str] = {
    type(None): "None",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bytes",
    list: "list",
    tuple: "tuple",
    dict: "map",
}


def _seen(value: object) -> str:
    """Describe a rejected value briefly: its repr (truncated) and its type."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not turn into a non-protocol error
        text = "<unrepresentable>"
    if len(text) > _SEEN_REPR_CHARS:
        text = text[: _SEEN_REPR_CHARS - 3] + "..."
    kind = _WIRE_TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


# --------------------------------------------------------------------------- validation
#
# Every field annotation is compiled once, when its class is defined, into a _Rule: a
# converter plus a human description of what it accepts. A converter takes
# (value, wire) and returns the value to store or raises _Invalid. `wire=True` means
# the value came out of msgpack (records arrive as maps, tuples as lists); `wire=False`
# means a Python caller is constructing a message (records must be instances already).


class _Ge(NamedTuple):
    """Annotated marker: number must be >= minimum (NaN fails too)."""

    minimum: int
    description: str


class _Gt(NamedTuple):
    """Annotated marker: number must be > minimum (timeouts, intervals)."""

    minimum: float


class _Le(NamedTuple):
    """Annotated marker: number must be <= maximum."""

    maximum: int


class _NonEmpty(NamedTuple):
    """Annotated marker: str must not be empty (names and ids)."""


NonNegInt = Annotated[int, _Ge(0, "non-negative")]
PosInt = Annotated[int, _Ge(1, "positive")]
UInt16 = Annotated[int, _Ge(0, "non-negative"), _Le(0xFFFF)]
NonNegFloat = Annotated[float, _Ge(0, "non-negative")]
PosFloat = Annotated[float, _Gt(0.0)]
Name = Annotated[str, _NonEmpty()]

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]
ComputeDTypeName = Literal["float32", "float16", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(DTypeName)
"""dtype names a :class:`TensorRef` may carry."""

_Conv = Callable[[Any, bool], Any]


class _Rule(NamedTuple):
    convert: _Conv
    expected: str
    # Optional shortcut for wire mode: a cheap predicate that is True only when the value
    # is valid and would be stored unchanged. Decoding a StageTask is mostly ints and
    # short strings inside TensorRefs; this skips a call chain per value (about 2x).
    fast: Callable[[Any], bool] | None = None


def _conv_int(v: Any, wire: bool) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        if not wire:
            if not _INT_MIN <= v <= _INT_MAX:
                raise _Invalid("int in msgpack's range [-2**63, 2**64-1]", _seen(v))
            if type(v) is not int:  # IntEnum and friends: store the plain value
                return int(v)
        return v
    raise _Invalid("int", _seen(v))


def _conv_float(v: Any, wire: bool) -> float:
    if type(v) is float:
        return v
    # An int is accepted (a JSON-minded peer may write 1 for 1.0) but stored as float so
    # equality and arithmetic do not depend on how the sender spelled the number.
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, int) and not _INT_MIN <= v <= _INT_MAX:
            raise _Invalid("float", _seen(v))
        return float(v)
    raise _Invalid("float", _seen(v))


def _conv_str(v: Any, wire: bool) -> str:
    if type(v) is not str:
        if not isinstance(v, str):
            raise _Invalid("str", _seen(v))
        v = str.__str__(v)  # StrEnum etc.: store the plain value
    if not wire:
        # Lone surrogates are valid in Python str but not in UTF-8; catch them here
        # rather than as a UnicodeEncodeError inside msgpack.
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid("str encodable as UTF-8", _seen(v)) from None
    return v


def _conv_bool(v: Any, wire: bool) -> bool:
    if type(v) is bool:
        return v
    raise _Invalid("bool", _seen(v))


def _conv_bytes(v: Any, wire: bool) -> bytes:
    if type(v) is bytes:
        return v
    if not wire and isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise _Invalid("bytes", _seen(v))


def _conv_none(v: Any, wire: bool) -> None:
    if v is None:
        return None
    raise _Invalid("None", _seen(v))


_ANY_EXPECTED = "msgpack value (None, bool, int, float, str, bytes, list, map with str keys)"


def _conv_any(v: Any, wire: bool, depth: int = 0) -> Any:
    """Accept msgpack-native values only, so whatever a caller puts in an ``Any`` field
    is guaranteed to encode and to come back equal (tuples become lists here, as they
    would on the wire)."""
    t = type(v)
    if v is None or t is bool or t is float or t is bytes:
        return v
    if t is int:
        return _conv_int(v, wire)
    if t is str:
        return _conv_str(v, wire)
    if t is list or t is tuple or t is dict:
        if depth >= MAX_ANY_DEPTH:
            raise _Invalid(f"msgpack value nested at most {MAX_ANY_DEPTH} levels", "deeper nesting")
        if t is dict:
            out: dict[str, Any] = {}
            for key, item in v.items():
                if type(key) is not str:
                    raise _Invalid("map with str keys", f"key {_seen(key)}")
                try:
                    out[key] = _conv_any(item, wire, depth + 1)
                except _Invalid as e:
                    e.path.append(_key_segment(key))
                    raise
            return out
        items: list[Any] = []
        for i, item in enumerate(v):
            try:
                items.append(_conv_any(item, wire, depth + 1))
            except _Invalid as e:
                e.path.append(f"[{i}]")
                raise
        return items
    raise _Invalid(_ANY_EXPECTED, _seen(v))


def _key_segment(key: str) -> str:
    text = repr(key)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"[{text}]"


def _compile(tp: Any) -> _Rule:
    """Turn one field annotation into a _Rule. Unsupported annotations fail at import
    time (TypeError), not on the first message that uses them."""
    if tp is Any:
        return _Rule(_conv_any, "msgpack value")
    scalar = {
        int: _Rule(_conv_int, "int", lambda v: type(v) is int),
        float: _Rule(_conv_float, "float", lambda v: type(v) is float),
        str: _Rule(_conv_str, "str", lambda v: type(v) is str),
        bool: _Rule(_conv_bool, "bool", lambda v: type(v) is bool),
        bytes: _Rule(_conv_bytes, "bytes", lambda v: type(v) is bytes),
        None: _Rule(_conv_none, "None", lambda v: v is None),
        type(None): _Rule(_conv_none, "None", lambda v: v is None),
    }
    if tp in scalar:
        return scalar[tp]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return _compile_annotated(_compile(args[0]), args[1:])
    if origin is Literal:
        return _compile_literal(args)
    if origin is Union or origin is types.UnionType:
        return _compile_union([_compile(a) for a in args], args)
    if origin is list and len(args) == 1:
        return _compile_sequence(_compile(args[0]), as_tuple=False)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _compile_sequence(_compile(args[0]), as_tuple=True)
    if origin is dict and len(args) == 2 and args[0] is str:
        return _compile_str_map(_compile(args[1]))
    if isinstance(tp, type) and issubclass(tp, Struct):
        return _compile_struct(tp)
    raise TypeError(f"roundpipe.protocol cannot validate annotation {tp!r}")


def _compile_annotated(inner: _Rule, marks: tuple[Any, ...]) -> _Rule:
    expected = inner.expected
    checks: list[Callable[[Any], bool]] = []
    for mark in marks:
        if isinstance(mark, _Ge):
            checks.append(lambda v, m=mark.minimum: v >= m)
            expected = f"{mark.description} {expected}"
        elif isinstance(mark, _Le):
            checks.append(lambda v, m=mark.maximum: v <= m)
            expected = f"{expected} <= {mark.maximum}"
        elif isinstance(mark, _Gt):
            checks.append(lambda v, m=mark.minimum: v > m)
            expected = f"positive {expected}"
        elif isinstance(mark, _NonEmpty):
            checks.append(lambda v: len(v) > 0)
            expected = f"non-empty {expected}"
        else:
            raise TypeError(f"unknown Annotated marker {mark!r}")
    convert_inner = inner.convert

    def convert(v: Any, wire: bool) -> Any:
        try:
            out = convert_inner(v, wire)
        except _Invalid as e:
            if e.expected == inner.expected and not e.path:
                e.expected = expected  # "non-negative int", not just "int"
            raise
        for check in checks:
            if not check(out):  # `not (nan >= 0)` is True: NaN is refused too
                raise _Invalid(expected, _seen(v))
        return out

    return _Rule(convert, expected, _annotated_fast(inner, marks))


def _annotated_fast(inner: _Rule, marks: tuple[Any, ...]) -> Callable[[Any], bool] | None:
    """One flat predicate for the markers in use (a chain of lambdas costs a call each)."""
    kinds = tuple(type(m) for m in marks)
    if inner.expected in ("int", "float"):
        exact = int if inner.expected == "int" else float
        if kinds == (_Ge,):
            lo = marks[0].minimum
            return lambda v: type(v) is exact and v >= lo
        if kinds == (_Gt,):
            gt = marks[0].minimum
            return lambda v: type(v) is exact and v > gt
        if kinds == (_Ge, _Le):
            lo, hi = marks[0].minimum, marks[1].maximum
            return lambda v: type(v) is exact and lo <= v <= hi
    if inner.expected == "str" and kinds == (_NonEmpty,):
        return lambda v: type(v) is str and v != ""
    return None


def _compile_literal(choices: tuple[Any, ...]) -> _Rule:
    if not all(type(c) is str for c in choices):
        raise TypeError(f"only str Literal choices are supported, got {choices!r}")
    allowed = frozenset(choices)
    expected = "one of " + ", ".join(repr(c) for c in choices)

    def convert(v: Any, wire: bool) -> str:
        if isinstance(v, str) and v in allowed:
            return str.__str__(v)
        raise _Invalid(expected, _seen(v))

    return _Rule(convert, expected, lambda v: type(v) is str and v in allowed)


def _compile_union(rules: list[_Rule], args: tuple[Any, ...]) -> _Rule:
    expected = " or ".join(r.expected for r in rules)
    non_none = [r for r, a in zip(rules, args) if a is not type(None)]
    if len(non_none) == 1 and len(rules) == 2:
        # Optional[X]: errors deep inside X (a nested field) are more useful verbatim
        # than "X or None", so only a top-level mismatch is reported as the union.
        convert_inner = non_none[0].convert

        def convert_optional(v: Any, wire: bool) -> Any:
            if v is None:
                return None
            try:
                return convert_inner(v, wire)
            except _Invalid as e:
                if not e.path:
                    e.expected = expected
                raise

        return _Rule(convert_optional, expected)

    def convert(v: Any, wire: bool) -> Any:
        for rule in rules:
            try:
                return rule.convert(v, wire)
            except _Invalid:
                continue
        raise _Invalid(expected, _seen(v))

    return _Rule(convert, expected)


def _compile_sequence(item: _Rule, *, as_tuple: bool) -> _Rule:
    expected = f"{'tuple' if as_tuple else 'list'} of {item.expected}"
    convert_item = item.convert
    fast_item = item.fast

    def convert(v: Any, wire: bool) -> Any:
        t = type(v)
        # Wire lists are fresh from msgpack, so they may be kept as they are.
        if wire and t is list and fast_item is not None and all(map(fast_item, v)):
            return tuple(v) if as_tuple else v
        # msgpack has one array type: tuples arrive as lists. A Python caller may pass
        # either; the stored type follows the annotation.
        if not (t is list or (not wire and t is tuple)):
            raise _Invalid(expected, _seen(v))
        out = []
        for i, x in enumerate(v):
            try:
                out.append(convert_item(x, wire))
            except _Invalid as e:
                e.path.append(f"[{i}]")
                raise
        return tuple(out) if as_tuple else out

    return _Rule(convert, expected)


def _compile_str_map(value: _Rule) -> _Rule:
    expected = f"map of str to {value.expected}"
    convert_value = value.convert

    def convert(v: Any, wire: bool) -> dict[str, Any]:
        if type(v) is not dict:
            raise _Invalid(expected, _seen(v))
        out: dict[str, Any] = {}
        for key, x in v.items():
            if type(key) is not str:
                raise _Invalid(f"{expected} (str keys)", f"key {_seen(key)}")
            try:
                out[key] = convert_value(x, wire)
            except _Invalid as e:
                e.path.append(_key_segment(key))
                raise
        return out

    return _Rule(convert, expected)


def _compile_struct(cls: type[Struct]) -> _Rule:
    name = cls.__name__

    def convert(v: Any, wire: bool) -> Struct:
        if wire:
            if type(v) is dict:
                return _struct_from_wire(cls, v)
            raise _Invalid(f"{name} (a map of its fields)", _seen(v))
        if isinstance(v, cls):
            return v  # validated by its own __post_init__
        raise _Invalid(name, _seen(v))

    return _Rule(convert, name)


class _FieldSpec(NamedTuple):
    name: str
    rule: _Rule
    default: Callable[[], Any] | None  # None: required


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
# The same, flattened for the decode loop: (name, fast, convert, default).
_PLANS: dict[type, tuple[tuple[str, Any, _Conv, Any], ...]] = {}
_ABSENT = object()
# For encoding: (field names, attrgetter returning all of them as a tuple).
_GETTERS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}
_REGISTRY: dict[str, type[Message]] = {}
MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(_REGISTRY)
"""Every message type that may travel on the wire, by type name (frame 1)."""


def _struct_from_wire(cls: type[Struct], d: dict[Any, Any]) -> Struct:
    # Skip __init__/__post_init__: every field is converted here, then only the
    # cross-field rules remain. object.__setattr__ is how frozen dataclasses set fields.
    obj = object.__new__(cls)
    setattr_ = object.__setattr__
    matched = 0
    for name, fast, convert, default in _PLANS[cls]:
        value = d.get(name, _ABSENT)
        if value is _ABSENT:
            if default is None:
                raise _missing(cls, name)
            value = default()
        else:
            matched += 1
            if fast is None or not fast(value):
                try:
                    value = convert(value, True)
                except _Invalid as e:
                    e.path.append("." + name)
                    raise
        setattr_(obj, name, value)
    if matched != len(d):
        raise _unknown(cls, d)
    obj._check()
    return obj


def _missing(cls: type[Struct], name: str) -> _Invalid:
    rule = next(s.rule for s in _SPECS[cls] if s.name == name)
    err = _Invalid(f"{rule.expected} (required field)", "nothing: field is missing")
    err.path.append("." + name)
    return err


def _unknown(cls: type[Struct], d: dict[Any, Any]) -> _Invalid:
    known = {s.name for s in _SPECS[cls]}
    unknown = next(k for k in d if k not in known)
    err = _Invalid(
        f"no such field; {cls.__name__} has: {', '.join(sorted(known)) or '(no fields)'}",
        f"unknown field with value {_seen(d[unknown])}",
    )
    label = unknown if isinstance(unknown, str) else repr(unknown)
    if len(label) > 40:  # the name came from the peer: keep the error message short
        label = label[:37] + "..."
    err.path.append("." + label)
    return err


def _pack_default(obj: Any) -> Any:
    """msgpack hook: a record is packed as the map of its fields, in declaration order
    (so encoding is deterministic). Everything else msgpack packs natively or refuses."""
    getter = _GETTERS.get(type(obj))
    if getter is not None:
        names, get = getter
        return dict(zip(names, get(obj)))
    raise TypeError(f"cannot serialize {_seen(obj)}")


# --------------------------------------------------------------------------- base classes


_C = TypeVar("_C", bound=type)


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _struct(cls: _C) -> _C:
    """Make a validated record: a frozen, keyword-only, slotted dataclass whose field
    annotations are compiled into validation rules right away."""
    cls = dataclass(frozen=True, kw_only=True, slots=True)(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Callable[[], Any] | None = lambda value=f.default: value  # noqa: E731
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        else:
            default = None
        specs.append(_FieldSpec(f.name, _compile(hints[f.name]), default))
    _SPECS[cls] = tuple(specs)
    _PLANS[cls] = tuple((s.name, s.rule.fast, s.rule.convert, s.default) for s in specs)
    names = tuple(s.name for s in specs)
    # attrgetter of one name returns the bare value, of zero names is not allowed.
    get = (
        operator.attrgetter(*names)
        if len(names) > 1
        else lambda o: tuple(getattr(o, n) for n in names)
    )
    _GETTERS[cls] = (names, get)
    return cls


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _message(cls: _C) -> _C:
    """A record that may travel alone: registered under its class name (frame 1)."""
    cls = _struct(cls)
    assert issubclass(cls, Message), cls
    name = cls.__name__
    assert name not in _REGISTRY, f"duplicate message type {name}"
    assert _TYPE_NAME_RE.match(name.encode("ascii")) and len(name) <= MAX_TYPE_NAME_BYTES
    _REGISTRY[name] = cls
    return cls


@dataclass(frozen=True, kw_only=True, slots=True)
class Struct:
    """Base of every record: frozen, keyword-only, validated on construction."""

    def __post_init__(self) -> None:
        cls = type(self)
        specs = _SPECS.get(cls)
        if specs is None:  # Struct/Message themselves, or a subclass not declared here
            raise TypeError(f"{cls.__name__} is not a declared roundpipe.protocol record")
        try:
            for spec in specs:
                value = getattr(self, spec.name)
                try:
                    converted = spec.rule.convert(value, False)
                except _Invalid as e:
                    e.path.append("." + spec.name)
                    raise
                if converted is not value:
                    object.__setattr__(self, spec.name, converted)
            self._check()
        except _Invalid as e:
            raise e.to_error(cls.__name__) from None
        except RecursionError:
            raise ProtocolError(
                f"invalid {cls.__name__}: nested too deeply", message_type=cls.__name__
            ) from None

    def _check(self) -> None:
        """Cross-field rules; raise _Invalid with the offending field's path."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Message(Struct):
    """Base of every message type (a Struct that travels alone, see MESSAGE_TYPES)."""


def _fail(field_name: str, expected: str, seen: str) -> _Invalid:
    err = _Invalid(expected, seen)
    err.path.append("." + field_name)
    return err


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
    """

    #: arena name, as listed in JobSetup.arenas (e.g. "acts", "params0", "grads")
    arena: Name
    #: byte offset of element (0, ..., 0) from the start of the arena
    offset: NonNegInt
    #: element type, one of DTYPE_NAMES
    dtype: DTypeName
    #: size of each dimension; () is a scalar
    shape: tuple[NonNegInt, ...]
    #: elements to step per dimension; same length as shape
    stride: tuple[NonNegInt, ...]

    def _check(self) -> None:
        if len(self.stride) != len(self.shape):
            raise _fail(
                "stride",
                f"tuple of {len(self.shape)} ints (one per shape dimension)",
                _seen(self.stride),
            )

    @classmethod
    def contiguous(cls, *, arena: str, offset: int, dtype: str, shape: Sequence[int]) -> TensorRef:
        """A row-major (C-contiguous) view of `shape` at `offset`."""
        strides: list[int] = []
        step = 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return cls(
            arena=arena,
            offset=offset,
            dtype=dtype,
            shape=tuple(shape),
            stride=tuple(reversed(strides)),
        )

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
        last = sum((size - 1) * step for size, step in zip(self.shape, self.stride))
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
    #: file to map (under the coordinator's arena_dir, e.g. /dev/shm/roundpipe/...)
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


@_struct
class EventWait(Struct):
    """Block until an event-table counter reaches a value (ARCHITECTURE.md section 5)."""

    #: index of the 64-bit counter in the events arena
    counter: NonNegInt
    #: wait until counter >= at_least
    at_least: int
    #: what the counter stands for, for timeout errors, e.g. "act[12][3]"
    label: str


@_struct
class EventSignal(Struct):
    """Store a value into an event-table counter after the task's writes are visible."""

    #: index of the 64-bit counter in the events arena (this task is its single writer)
    counter: NonNegInt
    #: value to store
    value: int
    #: what the counter stands for, e.g. "wgrad[12]"
    label: str


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
    #: weight layout of every layer, in layer order
    layers: list[LayerLayout]

    def _check(self) -> None:
        names = [a.name for a in self.arenas]
        if len(set(names)) != len(names):
            raise _fail("arenas", "arenas with distinct names", _seen(names))
        known = set(names)
        for i, layout in enumerate(self.layers):
            for key, refs in (("params", layout.params), ("params_odd", layout.params_odd)):
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


@_message
class StageTask(Message):
    """Run layers [layer_start, layer_stop) over microbatches 0..num_microbatches-1.

    Idempotent: a retry (attempt + 1, maybe on another worker) makes the same writes.
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
    #: microbatches to process, in order
    num_microbatches: PosInt
    #: weight version W_v to compute with; trainable weights are read from params
    #: buffer v % 2 (LayerLayout.params for even v, params_odd for odd v)
    weight_version: NonNegInt
    #: tensors read, e.g. per microbatch the stage input (forward) or the activation
    #: gradient (backward), token ids and labels for the prefix/tail
    inputs: list[TensorRef]
    #: tensors written, e.g. per microbatch the stage output or input gradient, loss sums
    outputs: list[TensorRef]
    #: activations saved for recompute: written by forward, read by backward
    saved: list[TensorRef]
    #: where the stage's weight gradients go, written once at the end of the task
    grads: list[NamedTensorRef]
    #: counters to wait for before reading inputs/saved or overwriting outputs
    waits: list[EventWait]
    #: counters to store once all writes are visible
    signals: list[EventSignal]
    #: deadline of each wait; the timeout error names the EventWait label
    wait_timeout_s: PosFloat
    #: free-form knobs that do not change the protocol (e.g. loss normalisation count)
    options: dict[str, Any] = field(default_factory=dict)

    def _check(self) -> None:
        if self.layer_stop <= self.layer_start:
            raise _fail(
                "layer_stop",
                f"an int > layer_start ({self.layer_start}); a stage has at least one layer",
                _seen(self.layer_stop),
            )


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
    #: are str), for the planner
    layer_times: dict[str, NonNegFloat]


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


@_message
class CancelJob(Message):
    """Cancel a job (queued or running)."""

    #: job id
    job_id: Name


@_message
class ListJobs(Message):
    """Ask for every job's status."""


@_message
class JobList(Message):
    """Every job the coordinator knows."""

    #: one status per job, oldest first
    jobs: list[JobStatus]


@_message
class ListWorkers(Message):
    """Ask for every worker."""


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


@_message
class WorkerList(Message):
    """Every worker the coordinator knows."""

    #: one entry per worker, by worker_id
    workers: list[WorkerInfo]


@_message
class GetProgress(Message):
    """Ask for a job's progress events newer than `after_seq` (long-poll friendly)."""

    #: job id
    job_id: Name
    #: return events with seq > after_seq; 0 for all (seqs start at 1)
    after_seq: NonNegInt


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


@_message
class Progress(Message):
    """Progress events of a job, oldest first."""

    #: job id
    job_id: Name
    #: events with seq > GetProgress.after_seq, in seq order
    events: list[ProgressEvent]
    #: True once the job has ended (no more events will come)
    done: bool


@_message
class ErrorReply(Message):
    """A client request failed."""

    #: machine-readable code, e.g. "not_found", "invalid_spec", "bad_request", "internal"
    code: Name
    #: human-readable explanation
    message: str


@_message
class Ack(Message):
    """A client request succeeded and has nothing to return."""


# --------------------------------------------------------------------------- encode / decode

_HEADER = _MAGIC + PROTOCOL_VERSION.to_bytes(2, "big")
_M = TypeVar("_M", bound=Message)


def encode(msg: Message, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[bytes]:
    """Encode a message into its three frames: [header, type name, msgpack body].

    The message was validated when it was constructed, and it owns copies of its lists
    and maps, so encoding does not validate again (it is on the coordinator's hot path).
    Mutating those containers in place is a bug that the receiver reports as a
    ProtocolError; values msgpack cannot pack raise ProtocolError here.

    Raises ProtocolError if `msg` is not a registered message or the body would exceed
    `max_body_bytes` (the receiver would refuse it).
    """
    cls = type(msg)
    name = cls.__name__
    if _REGISTRY.get(name) is not cls:
        raise ProtocolError(f"cannot encode {_seen(msg)}: not a registered message type")
    try:
        body = msgpack.packb(msg, use_bin_type=True, default=_pack_default)
    except Exception as e:  # overflow, lone surrogates, cycles in a mutated message
        raise ProtocolError(
            f"cannot encode {name}: {type(e).__name__}: {e}", message_type=name
        ) from e
    if len(body) > max_body_bytes:
        raise ProtocolError(
            f"cannot encode {name}: body is {len(body)} bytes, more than the limit of "
            f"{max_body_bytes} (max_body_bytes); messages carry descriptors, not data",
            message_type=name,
        )
    return [_HEADER, name.encode("ascii"), body]


def decode(frames: Sequence[bytes], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Message:
    """Decode the three frames of one message (routing frames already stripped).

    Frames may be bytes, bytearray, memoryview or zmq.Frame. Raises ProtocolVersionError
    on a version mismatch and ProtocolError on anything else wrong; never another
    exception type.
    """
    return _decode(frames, max_body_bytes, None)


def decode_as(
    frames: Sequence[bytes],
    expected_type: type[_M],
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> _M:
    """Like decode, but the message must be an `expected_type` (e.g. Welcome during the
    handshake); anything else raises ProtocolError naming the expected type."""
    if not (isinstance(expected_type, type) and issubclass(expected_type, Message)):
        raise TypeError(f"expected_type must be a Message subclass, got {expected_type!r}")
    msg = _decode(frames, max_body_bytes, expected_type)
    assert isinstance(msg, expected_type)
    return msg


def _frame_view(frame: object, index: int) -> memoryview:
    try:
        view = memoryview(frame)  # type: ignore[arg-type]
    except TypeError:
        raise ProtocolError(
            f"frame {index} is {_seen(frame)}, expected a bytes-like object"
        ) from None
    if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
        raise ProtocolError(f"frame {index} is not a contiguous byte buffer")
    return view


def _decode(
    frames: Sequence[bytes], max_body_bytes: int, expected: type[Message] | None
) -> Message:
    try:
        count = len(frames)
    except Exception:  # TypeError, or whatever a hostile __len__ raises
        raise ProtocolError(f"expected a sequence of frames, got {_seen(frames)}") from None
    if count != _NUM_FRAMES:
        raise ProtocolError(
            f"expected {_NUM_FRAMES} frames (header, type, body) after routing frames "
            f"are stripped, got {count}"
        )
    try:
        header, type_frame, body = (_frame_view(frames[i], i) for i in range(_NUM_FRAMES))
    except ProtocolError:
        raise
    except Exception as e:  # a hostile Sequence whose __getitem__ misbehaves
        raise ProtocolError(f"cannot read frames: {type(e).__name__}: {e}") from None

    # Type name first only so a version error can say what the peer sent; the version
    # is still checked before the name is trusted for anything.
    type_bytes = type_frame.tobytes() if type_frame.nbytes <= MAX_TYPE_NAME_BYTES else b""
    type_name = type_bytes.decode("ascii") if _TYPE_NAME_RE.match(type_bytes) else None

    if header.nbytes != _HEADER_BYTES or header[:2].tobytes() != _MAGIC:
        raise ProtocolError(
            f"bad header frame: expected {_HEADER_BYTES} bytes, b'RP' + uint16 version, "
            f"got {header[:16].tobytes()!r}{'...' if header.nbytes > 16 else ''} "
            f"({header.nbytes} bytes)"
        )
    version = int.from_bytes(header[2:4].tobytes(), "big")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(version, PROTOCOL_VERSION, message_type=type_name)

    if type_name is None:
        shown = type_frame[:MAX_TYPE_NAME_BYTES].tobytes()
        raise ProtocolError(
            f"bad type frame: expected 1..{MAX_TYPE_NAME_BYTES} ASCII bytes "
            f"[A-Za-z][A-Za-z0-9_]*, got {shown!r} ({type_frame.nbytes} bytes)"
        )
    cls = _REGISTRY.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}", message_type=type_name)
    if expected is not None and cls is not expected:
        raise ProtocolError(
            f"expected a {expected.__name__} message, got {type_name}", message_type=type_name
        )

    size = body.nbytes
    if size > max_body_bytes:
        raise ProtocolError(
            f"{type_name} body is {size} bytes, more than the limit of {max_body_bytes} "
            "(max_body_bytes)",
            message_type=type_name,
        )
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,  # str stays str (and invalid UTF-8 is refused)
            strict_map_key=True,  # map keys must be str (or bin, refused later)
            use_list=True,
            # Every length is bounded by the body size, which is already bounded; ext
            # types (timestamps too) have no place in a body.
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
            ext_hook=_refuse_ext,
            object_pairs_hook=_pairs_to_dict,
        )
    except Exception as e:  # every msgpack failure mode, and RecursionError
        raise ProtocolError(
            f"malformed {type_name} body: {type(e).__name__}: {e}", message_type=type_name
        ) from None
    if type(fields) is not dict:
        raise ProtocolError(
            f"invalid {type_name}: body: expected a map of fields, got {_seen(fields)}",
            message_type=type_name,
        )
    try:
        return _struct_from_wire(cls, fields)  # type: ignore[return-value]
    except _Invalid as e:
        raise e.to_error(type_name) from None
    except RecursionError:
        raise ProtocolError(
            f"invalid {type_name}: nested too deeply", message_type=type_name
        ) from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a RoundPipe body")


def _pairs_to_dict(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A duplicate key would otherwise silently keep the last value: refuse it.
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate map key")
    return d
