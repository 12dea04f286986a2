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

Example, a heartbeat at version 2::

    [b"RP\\x00\\x02", b"Heartbeat", msgpack({"sender": "rp-worker-0", "seq": 7,
                                           "sent_at": 1767225600.5})]

- The type travels as its own small frame (as in vLLM v1) so a receiver can route or
  reject a message without unpacking its body.
- Routing envelopes are not part of a message. A ROUTER socket prepends the peer's
  identity frame (and a REQ peer an empty delimiter frame); the socket layer strips
  them before calling :func:`decode` and adds them back after :func:`encode`. `decode`
  sees exactly the three frames above.
- Body values use msgpack's native types only: nil, bool, int (-2**63 .. 2**64-1),
  float, str (UTF-8), bin (bytes), array, map with str keys. No ext types (timestamps
  included). A list or tuple is an array.
- A nested record (e.g. a :class:`TensorRef` inside a StageTask) is an *array* of its
  field values in declaration order, e.g. ``["acts", 4096, "bfloat16", [4, 2048],
  [2048, 1]]``. Field names travel once, as the keys of the body map; a StageTask
  carries ~100 records, and as maps they would double the body and triple the cost of
  unpacking it.
- Every field is written by the encoder; a receiver fills an absent field only where
  the class declares a default (a body map may leave out such a field, a record array
  only such fields at its end).

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
- a body that is not a map, a missing required field, an unknown field, a nested
  record that is not an array or has too many values, a value of the wrong type
  (``bool`` is not an ``int``; an ``int`` is accepted where a ``float`` is expected), a
  negative size/offset/index, a string outside a fixed set of choices, or a violated
  cross-field rule (e.g. ``len(stride) != len(shape)``, a ``grad_output`` on a forward
  task's microbatch).

The error message names the message type, the field path, what was expected and what
was seen, e.g.::

    invalid StageTask: field microbatches[2].input.offset: expected non-negative int,
    got -8 (int)

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
    ListJobs     K -> C   all jobs;                       reply JobList
    JobList      C -> K   a JobStatus per job
    ListWorkers  K -> C   all workers;                    reply WorkerList
    WorkerList   C -> K   a WorkerInfo per worker
    GetProgress  K -> C   progress events after a seq;    reply Progress or ErrorReply
    Progress     C -> K   ProgressEvents in seq order, and whether the job has ended
    ErrorReply   C -> K   a request failed: machine-readable code and a message
    Ack          C -> K   a request succeeded and has nothing to return

Records used inside messages (never sent alone): TensorRef, NamedTensorRef, ArenaInfo,
LayerLayout, EventWait, EventSignal, LayerTensorRef, MicrobatchIO, WorkerInfo,
ProgressEvent.

Speed
=====

Constructing, encoding and decoding use functions generated per class from the field
annotations at import (see "fast paths" in the source); a realistic StageTask of ~100
descriptors is built, encoded or decoded in well under a millisecond. They validate
exactly as the rules above say: anything unusual is handed to the plain validator,
which writes every error message.
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
    "LayerTensorRef",
    "MicrobatchIO",
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
    "ResumeJob",
    "ListJobs",
    "JobList",
    "ListWorkers",
    "WorkerList",
    "GetProgress",
    "Progress",
    "ErrorReply",
    "Ack",
]

PROTOCOL_VERSION: int = 4
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
# Validation has two layers that share one set of rules.
#
# 1. The reference validator (this section). Every field annotation is compiled once,
#    when its class is defined, into a _Rule whose `convert(value, wire)` returns the
#    value to store or raises _Invalid. It is the specification: one small function per
#    kind of annotation, and it writes every error message. `wire=True` means the value
#    came out of msgpack (nested records arrive as arrays, every array as a tuple);
#    `wire=False` means a Python caller is constructing a message (records must be
#    instances already).
#
# 2. Fast paths (section "fast paths" below). Interpreting rules value by value costs
#    several calls per field, about 1 ms for a StageTask of ~100 descriptors. So each
#    record class also gets straight-line functions generated from the same rules
#    (__init__, decode, encode). They only ever *accept*: each field is tested by plain
#    inline checks (`type(v) is int and v >= 0`; a loop for a tuple of ints) that pass
#    only when the reference would store the value unchanged; on anything else -- an
#    invalid value, or merely an unusual one such as an int in a float field -- the whole
#    record goes to the reference validator, which converts it or raises the precise
#    error. Error messages therefore come from the reference alone, and the tests check
#    that both layers agree on every fuzzed input.


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


class _Fast(NamedTuple):
    """Source code for one value in a generated function; ``{v}`` names the variable
    holding the value.

    kind "check": a bool expression, true only when the value is valid and the reference
    `convert` would store it unchanged. kind "convert": an expression evaluating to what
    `convert` would return, raising any exception where the fast path does not apply.
    kind "block": statements (lines, relative indentation) that do the same and rebind
    the variable, for what needs a loop.
    """

    kind: Literal["check", "convert", "block"]
    code: str

    def on(self, var: str) -> str:
        return self.code.replace("{v}", var)

    def emit(self, var: str, indent: str) -> list[str]:
        """Statements that validate `var` and leave the value to store in it."""
        if self.kind == "check":
            return [f"{indent}if not ({self.on(var)}):", f"{indent}    raise _Slow"]
        if self.kind == "convert":
            return [f"{indent}{var} = {self.on(var)}"]
        return [indent + line for line in self.on(var).split("\n")]


class _Rule(NamedTuple):
    # The reference: (value, wire) -> value to store, or raise _Invalid.
    convert: _Conv
    # What it accepts, for error messages: "non-negative int", "list of TensorRef".
    expected: str
    # Fast-path code for construction (py) and decoding (wire); None: the generated code
    # calls `convert` itself.
    fast_py: _Fast | None = None
    fast_wire: _Fast | None = None
    # Encoding: an expression over {v} giving what msgpack packs; None: the value itself.
    encode: str | None = None

    def fast(self, wire: bool) -> _Fast:
        fast = self.fast_wire if wire else self.fast_py
        if fast is None:
            return _Fast("convert", f"{_gen_name(self.convert, 'conv')}({{v}}, {wire})")
        return fast


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
    do on the wire)."""
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


def _int_fast(lo: int, hi: int) -> tuple[_Fast, _Fast]:
    """Fast checks of an int in [lo, hi]. msgpack cannot produce an int outside its own
    range, so on the wire only the markers' bounds need checking."""
    py = _Fast("check", f"type({{v}}) is int and {lo} <= {{v}} <= {hi}")
    wire = "type({v}) is int" + (f" and {{v}} >= {lo}" if lo > _INT_MIN else "")
    wire += f" and {{v}} <= {hi}" if hi < _INT_MAX else ""
    return py, _Fast("check", wire)


def _compile(tp: Any) -> _Rule:
    """Turn one field annotation into a _Rule. Unsupported annotations fail at import
    time (TypeError), not on the first message that uses them."""
    if tp is Any:
        return _Rule(_conv_any, "msgpack value")
    if tp is int:
        return _Rule(_conv_int, "int", *_int_fast(_INT_MIN, _INT_MAX))
    if tp is float:
        return _scalar_rule(_conv_float, "float", "type({v}) is float")
    if tp is str:
        # A non-ASCII str from a caller takes the reference path (the UTF-8 check); on
        # the wire msgpack has already refused invalid UTF-8.
        py, wire = _Fast("check", "type({v}) is str and {v}.isascii()"), "type({v}) is str"
        return _Rule(_conv_str, "str", py, _Fast("check", wire))
    if tp is bool:
        return _scalar_rule(_conv_bool, "bool", "type({v}) is bool")
    if tp is bytes:
        return _scalar_rule(_conv_bytes, "bytes", "type({v}) is bytes")
    if tp is None or tp is type(None):
        return _scalar_rule(_conv_none, "None", "{v} is None")
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


def _scalar_rule(convert: _Conv, expected: str, check: str) -> _Rule:
    """A rule whose fast check is the same for callers and for the wire."""
    return _Rule(convert, expected, _Fast("check", check), _Fast("check", check))


def _compile_annotated(inner: _Rule, marks: tuple[Any, ...]) -> _Rule:
    expected = inner.expected
    checks: list[Callable[[Any], bool]] = []
    extra = ""  # the same checks as source, appended to the inner fast checks
    lo, hi = _INT_MIN, _INT_MAX
    for mark in marks:
        if isinstance(mark, _Ge):
            checks.append(lambda v, m=mark.minimum: v >= m)
            expected = f"{mark.description} {expected}"
            extra += f" and {{v}} >= {mark.minimum!r}"
            lo = max(lo, mark.minimum)
        elif isinstance(mark, _Le):
            checks.append(lambda v, m=mark.maximum: v <= m)
            expected = f"{expected} <= {mark.maximum}"
            extra += f" and {{v}} <= {mark.maximum!r}"
            hi = min(hi, mark.maximum)
        elif isinstance(mark, _Gt):
            checks.append(lambda v, m=mark.minimum: v > m)
            expected = f"positive {expected}"
            extra += f" and {{v}} > {mark.minimum!r}"
        elif isinstance(mark, _NonEmpty):
            checks.append(lambda v: len(v) > 0)
            expected = f"non-empty {expected}"
            extra += ' and {v} != ""'
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

    if convert_inner is _conv_int and all(isinstance(m, (_Ge, _Le)) for m in marks):
        fast_py, fast_wire = _int_fast(lo, hi)  # one range test instead of two
    else:
        if not all(f is not None and f.kind == "check" for f in (inner.fast_py, inner.fast_wire)):
            raise TypeError("Annotated markers are supported on int, float and str only")
        fast_py = _Fast("check", inner.fast(False).code + extra)
        fast_wire = _Fast("check", inner.fast(True).code + extra)
    return _Rule(convert, expected, fast_py, fast_wire)


def _compile_literal(choices: tuple[Any, ...]) -> _Rule:
    if not all(type(c) is str for c in choices):
        raise TypeError(f"only str Literal choices are supported, got {choices!r}")
    allowed = frozenset(choices)
    expected = "one of " + ", ".join(repr(c) for c in choices)

    def convert(v: Any, wire: bool) -> str:
        if isinstance(v, str) and v in allowed:
            return str.__str__(v)
        raise _Invalid(expected, _seen(v))

    fast = _Fast("check", f"type({{v}}) is str and {{v}} in {_gen_name(allowed, 'choices')}")
    return _Rule(convert, expected, fast, fast)


def _compile_union(rules: list[_Rule], args: tuple[Any, ...]) -> _Rule:
    expected = " or ".join(r.expected for r in rules)
    non_none = [r for r, a in zip(rules, args) if a is not type(None)]
    if len(non_none) == 1 and len(rules) == 2:
        # Optional[X]: errors deep inside X (a nested field) are more useful verbatim
        # than "X or None", so only a top-level mismatch is reported as the union.
        inner = non_none[0]
        convert_inner = inner.convert

        def convert_optional(v: Any, wire: bool) -> Any:
            if v is None:
                return None
            try:
                return convert_inner(v, wire)
            except _Invalid as e:
                if not e.path:
                    e.expected = expected
                raise

        def fast(wire: bool) -> _Fast:
            f = inner.fast(wire)
            if f.kind == "check":
                return _Fast("check", f"({{v}} is None or ({f.code}))")
            if f.kind == "convert":
                return _Fast("convert", f"(None if {{v}} is None else {f.code})")
            return _Fast("block", "\n".join(["if {v} is not None:", *f.emit("{v}", "    ")]))

        encode = None if inner.encode is None else f"(None if {{v}} is None else {inner.encode})"
        return _Rule(convert_optional, expected, fast(False), fast(True), encode)

    if any(r.encode is not None for r in rules):
        raise TypeError("a Union of records is not supported (which record would it be?)")

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

    def convert(v: Any, wire: bool) -> Any:
        # msgpack has one array type (decoded as tuple); a Python caller may pass a list
        # or a tuple. The stored type follows the annotation, and is always a new list
        # for list fields: a message owns its lists.
        t = type(v)
        if not (t is list or t is tuple):
            raise _Invalid(expected, _seen(v))
        out = []
        for i, x in enumerate(v):
            try:
                out.append(convert_item(x, wire))
            except _Invalid as e:
                e.path.append(f"[{i}]")
                raise
        return tuple(out) if as_tuple else out

    encode = None if item.encode is None else _map_call(item.encode, "{v}")
    return _Rule(
        convert,
        expected,
        _sequence_fast(item.fast(False), as_tuple, wire=False),
        _sequence_fast(item.fast(True), as_tuple, wire=True),
        encode,
    )


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

    encode = None
    if value.encode is not None:
        k, x = _gen_var(), _gen_var()
        encode = f"{{{k}: {value.encode.replace('{v}', x)} for {k}, {x} in {{v}}.items()}}"
    return _Rule(
        convert, expected, _str_map_fast(value.fast(False)), _str_map_fast(value.fast(True)), encode
    )


def _compile_struct(cls: type[Struct]) -> _Rule:
    name = cls.__name__

    def convert(v: Any, wire: bool) -> Struct:
        if wire:
            return _struct_from_array(cls, v)
        if isinstance(v, cls):
            return v  # validated when it was constructed
        raise _Invalid(name, _seen(v))

    codec = _CODECS[cls]
    return _Rule(
        convert,
        name,
        # A record passed by a caller is an instance, hence valid already.
        _Fast("check", f"type({{v}}) is {_gen_name(cls, name)}"),
        _Fast("convert", f"{codec.from_array_name}({{v}})"),
        f"{codec.to_array_name}({{v}})",
    )


class _FieldSpec(NamedTuple):
    name: str
    rule: _Rule
    default: Callable[[], Any] | None  # None: required


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
_REGISTRY: dict[str, type[Message]] = {}
# The same registry, keyed for encode and decode (frame 1 as bytes -> class, class ->
# generated codec functions).
_REGISTRY_BY_FRAME: dict[bytes, type[Message]] = {}
_FROM_MAP: dict[type, Callable[[dict[Any, Any]], Any]] = {}
_TO_MAP: dict[type, tuple[bytes, Callable[[Any], dict[str, Any]]]] = {}
MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(_REGISTRY)
"""Every message type that may travel on the wire, by type name (frame 1)."""


# --------------------------------------------------------------------------- reference paths
#
# Whole-record validation, used where the fast paths decline (see "validation" above).


def _init_reference(obj: Struct, values: tuple[Any, ...]) -> None:
    """Construct `obj` from its field values (declaration order), validating each."""
    cls = type(obj)
    try:
        for spec, value in zip(_SPECS[cls], values):
            try:
                converted = spec.rule.convert(value, False)
            except _Invalid as e:
                e.path.append("." + spec.name)
                raise
            object.__setattr__(obj, spec.name, converted)
        obj._check()
    except _Invalid as e:
        raise e.to_error(cls.__name__) from None
    except RecursionError:
        raise ProtocolError(
            f"invalid {cls.__name__}: nested too deeply", message_type=cls.__name__
        ) from None


def _struct_from_map(cls: type[Struct], d: dict[Any, Any]) -> Struct:
    """A message body: a map of field names to wire values."""
    obj = object.__new__(cls)
    matched = 0
    for spec in _SPECS[cls]:
        if spec.name in d:
            matched += 1
            try:
                value = spec.rule.convert(d[spec.name], True)
            except _Invalid as e:
                e.path.append("." + spec.name)
                raise
        elif spec.default is not None:
            value = spec.default()
        else:
            raise _missing(cls, spec.name)
        object.__setattr__(obj, spec.name, value)
    if matched != len(d):
        raise _unknown(cls, d)
    obj._check()
    return obj


def _struct_from_array(cls: type[Struct], items: Any) -> Struct:
    """A nested record: an array of its field values in declaration order, of which
    trailing fields with a default may be left out."""
    specs = _SPECS[cls]
    if type(items) is not tuple and type(items) is not list:
        raise _Invalid(_array_expected(cls), _seen(items))
    if len(items) > len(specs):
        raise _Invalid(_array_expected(cls), f"{len(items)} values: {_seen(items)}")
    obj = object.__new__(cls)
    for i, spec in enumerate(specs):
        if i < len(items):
            try:
                value = spec.rule.convert(items[i], True)
            except _Invalid as e:
                e.path.append("." + spec.name)
                raise
        elif spec.default is not None:
            value = spec.default()
        else:
            raise _missing(cls, spec.name)
        object.__setattr__(obj, spec.name, value)
    obj._check()
    return obj


def _array_expected(cls: type[Struct]) -> str:
    names = ", ".join(s.name for s in _SPECS[cls])
    return f"{cls.__name__} as an array of its field values [{names}]"


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


# --------------------------------------------------------------------------- fast paths
#
# Per record class, the field rules are turned into Python source once, at import, and
# compiled with exec (as dataclasses does for __init__). The generated constructor of
# TensorRef reads (print(_GENERATED_SOURCE[...]) shows them all):
#
#     def _init_TensorRef_7(self, *, arena, offset, dtype, shape, stride):
#         try:
#             f_arena = arena
#             ...
#             if not (type(f_arena) is str and f_arena.isascii() and f_arena != ""):
#                 raise _Slow
#             if not (type(f_offset) is int and 0 <= f_offset <= 18446744073709551615):
#                 raise _Slow
#             ...
#             for x1 in f_shape:
#                 if not (type(x1) is int and 0 <= x1 <= 18446744073709551615):
#                     raise _Slow
#             ...
#         except Exception:
#             return _init_reference(self, (arena, offset, dtype, shape, stride, ))
#         _set(self, '__dict__', {'arena': f_arena, 'offset': f_offset, ...})
#         try:
#             _check_TensorRef_8(self)
#         except _Invalid as e:
#             raise e.to_error('TensorRef') from None
#
# The decoder of a nested TensorRef (a tuple, fresh from msgpack) unpacks it, runs the
# same kind of checks and builds the instance without calling __init__; the decoder of
# a message body does the same with the body map. Any exception in a fast path means
# "not sure": the caller hands the whole record (constructor) or the whole body (decode)
# to the reference validator, which accepts or raises the exact error. Nothing is
# validated twice on success: a list of records is checked with `type(x) is TensorRef`
# (a record instance was validated when it was built).
#
# Encoding is generated too: a message becomes the map of its fields, a nested record
# the tuple of its field values (an operator.attrgetter when no field needs work).

_GEN_NS: dict[str, Any] = {}  # globals of all generated code
_GENERATED_SOURCE: dict[str, str] = {}  # name -> source, for debugging and curiosity
# Builtins that generated code calls; a field may not be named like one (its parameter
# in __init__ would shadow it).
_RESERVED_NAMES = frozenset({"self", "type", "len", "list", "tuple", "map", "Exception"})
_NO_VALUE = object()  # __init__ default marker: use the field's default
_BARE_CALL = re.compile(r"(\w+)\(\{v\}\)\Z")  # a fast/encode snippet that is f({v})


class _Slow(Exception):
    """Raised by generated code to hand a value over to the reference validator."""


def _gen_name(obj: Any, hint: str) -> str:
    """Make `obj` visible to generated code under a fresh name."""
    name = f"_{hint}_{len(_GEN_NS)}"
    _GEN_NS[name] = obj
    return name


_var_counter = 0


def _gen_var() -> str:
    """A fresh local variable name (comprehensions nested in one expression)."""
    global _var_counter
    _var_counter += 1
    return f"x{_var_counter}"


def _define(name: str, lines: list[str]) -> Callable[..., Any]:
    source = "\n".join(lines) + "\n"
    _GENERATED_SOURCE[name] = source
    exec(source, _GEN_NS)  # noqa: S102 -- our own source, built from our annotations
    return typing.cast(Callable[..., Any], _GEN_NS[name])


def _map_call(snippet: str, iterable: str) -> str:
    """`[f(x) for x in it]`, written as list(map(f, it)) when f is a plain function."""
    bare = _BARE_CALL.match(snippet)
    if bare:
        return f"list(map({bare.group(1)}, {iterable}))"
    x = _gen_var()
    return f"[{snippet.replace('{v}', x)} for {x} in {iterable}]"


def _sequence_fast(item: _Fast, as_tuple: bool, *, wire: bool) -> _Fast:
    """Inline code for a list/tuple field: loops cost less than a call per value."""
    # msgpack decodes every array as a tuple; a caller may pass a list or a tuple.
    accepted = "type({v}) is not tuple" + ("" if wire else " and type({v}) is not list")
    lines = [f"if {accepted}:", "    raise _Slow"]
    x = _gen_var()
    if item.kind == "check":  # e.g. shape: check each int, keep the container
        lines += [f"for {x} in {{v}}:", *item.emit(x, "    ")]
        if as_tuple:
            lines += [] if wire else ["if type({v}) is list:", "    {v} = tuple({v})"]
        else:
            lines.append("{v} = list({v})")  # a message owns its lists
    else:  # e.g. a list of records arriving as arrays: build a new list
        bare = _BARE_CALL.match(item.code) if item.kind == "convert" else None
        if bare:
            lines.append(f"{{v}} = list(map({bare.group(1)}, {{v}}))")
        else:
            out = _gen_var()
            lines += [f"{out} = []", f"for {x} in {{v}}:", *item.emit(x, "    ")]
            lines += [f"    {out}.append({x})", f"{{v}} = {out}"]
        if as_tuple:
            lines.append("{v} = tuple({v})")
    return _Fast("block", "\n".join(lines))


def _str_map_fast(value: _Fast) -> _Fast:
    """A helper function for a dict[str, X] field (rare, so not inlined)."""
    name = _gen_name(None, "map")
    lines = [
        f"def {name}(v):",
        "    if type(v) is not dict:",
        "        raise _Slow",
        "    out = {}",
        "    for k, x in v.items():",
        "        if type(k) is not str:",
        "            raise _Slow",
        *value.emit("x", "        "),
        "        out[k] = x",
        "    return out",
    ]
    _define(name, lines)
    return _Fast("convert", f"{name}({{v}})")


class _Codec(NamedTuple):
    """Names (in _GEN_NS) of a record's generated functions."""

    from_array_name: str  # nested record: tuple of field values -> instance
    to_array_name: str  # instance -> tuple of field values
    from_map: Callable[[dict[Any, Any]], Any] | None  # messages only: body -> instance
    to_map: Callable[[Any], dict[str, Any]] | None  # messages only: instance -> body


_CODECS: dict[type, _Codec] = {}


def _check_lines(cls: type, obj: str, indent: str, *, to_error: bool) -> list[str]:
    """Call the cross-field rules, if the class has any."""
    if cls._check is Struct._check:  # type: ignore[attr-defined]
        return []
    check = _gen_name(cls._check, f"check_{cls.__name__}")  # a plain function call
    if not to_error:
        return [f"{indent}{check}({obj})"]
    return [
        f"{indent}try:",
        f"{indent}    {check}({obj})",
        f"{indent}except _Invalid as e:",
        f"{indent}    raise e.to_error({cls.__name__!r}) from None",
    ]


def _value_lines(specs: tuple[_FieldSpec, ...], wire: bool, indent: str) -> list[str]:
    """Validate the value of each field, held in local `f_<name>` (checks leave it as
    it is, conversions rebind it); raise on anything the fast path does not handle."""
    return [line for s in specs for line in s.rule.fast(wire).emit(f"f_{s.name}", indent)]


def _fields_dict(names: list[str]) -> str:
    """Source of the instance __dict__ built from the locals `f_<name>`. Records keep
    their fields in a plain __dict__ (no __slots__): setting it in one go makes a
    record about 15% cheaper to build than object.__setattr__ per field, the way a
    frozen dataclass does it."""
    return "{" + ", ".join(f"{n!r}: f_{n}" for n in names) + "}"


def _generate_init(cls: type, specs: tuple[_FieldSpec, ...]) -> None:
    names = [s.name for s in specs]
    clash = _RESERVED_NAMES.intersection(names)
    assert not clash, f"{cls.__name__}: field names {clash} would shadow builtins"
    params = [s.name if s.default is None else f"{s.name}=_NO_VALUE" for s in specs]
    name = _gen_name(None, f"init_{cls.__name__}")
    lines = [f"def {name}(self{', *, ' if params else ''}{', '.join(params)}):"]
    for s in specs:
        if s.default is not None:
            default = _gen_name(s.default, "default")
            lines += [f"    if {s.name} is _NO_VALUE:", f"        {s.name} = {default}()"]
    lines += ["    try:", *[f"        f_{n} = {n}" for n in names]]
    lines += _value_lines(specs, wire=False, indent="        ") or ["        pass"]
    lines += [
        "    except Exception:",
        f"        return _init_reference(self, ({''.join(n + ', ' for n in names)}))",
        f"    _set(self, '__dict__', {_fields_dict(names)})",
        *_check_lines(cls, "self", "    ", to_error=True),
    ]
    init = _define(name, lines)
    init.__name__ = "__init__"
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]


def _generate_codecs(cls: type, specs: tuple[_FieldSpec, ...], *, is_message: bool) -> None:
    names = [s.name for s in specs]
    locals_ = [f"f_{n}" for n in names]
    cls_name = _gen_name(cls, cls.__name__)
    build = [
        f"    o = _new({cls_name})",
        f"    _set(o, '__dict__', {_fields_dict(names)})",
        *_check_lines(cls, "o", "    ", to_error=False),
        "    return o",
    ]

    # Decode a nested record: an array of exactly its fields (the encoder writes them
    # all; a shorter array with defaults left out goes to the reference path). Unpacking
    # raises ValueError on any other length.
    from_array = _gen_name(None, f"from_array_{cls.__name__}")
    _define(
        from_array,
        [
            f"def {from_array}(a):",
            "    if type(a) is not tuple:" if names else "    if a != ():",
            "        raise _Slow",
            *([f"    {', '.join(locals_)}, = a"] if names else []),
            *_value_lines(specs, wire=True, indent="    "),
            *build,
        ],
    )

    # Encode: fetch every field with one attrgetter call, then convert nested records.
    getter = _gen_name(operator.attrgetter(*names), "get") if len(names) > 1 else None
    fetch = (
        [f"    {', '.join(locals_)} = {getter}(o)"]
        if getter
        else [f"    f_{n} = o.{n}" for n in names]
    )

    def encoded(spec: _FieldSpec) -> str:
        var = f"f_{spec.name}"
        return var if spec.rule.encode is None else spec.rule.encode.replace("{v}", var)

    if getter and all(s.rule.encode is None for s in specs):
        to_array = getter  # a leaf record: the attrgetter's tuple is the encoding
    else:
        to_array = _gen_name(None, f"to_array_{cls.__name__}")
        values = "".join(encoded(s) + ", " for s in specs)
        _define(to_array, [f"def {to_array}(o):", *fetch, f"    return ({values})"])

    from_map = to_map = None
    if is_message:
        name = _gen_name(None, f"from_map_{cls.__name__}")
        from_map = _define(
            name,
            [
                f"def {name}(d):",
                f"    if len(d) != {len(names)}:",  # absent defaults, unknown fields
                "        raise _Slow",
                *[f"    f_{n} = d[{n!r}]" for n in names],
                *_value_lines(specs, wire=True, indent="    "),
                *build,
            ],
        )
        name = _gen_name(None, f"to_map_{cls.__name__}")
        items = ", ".join(f"{s.name!r}: {encoded(s)}" for s in specs)
        to_map = _define(name, [f"def {name}(o):", *fetch, f"    return {{{items}}}"])
    _CODECS[cls] = _Codec(from_array, to_array, from_map, to_map)


# --------------------------------------------------------------------------- base classes


_C = TypeVar("_C", bound=type)


def _declare(cls: _C, *, is_message: bool) -> _C:
    # No slots=True: see _fields_dict. No __init__: ours is generated below.
    cls = dataclass(frozen=True, kw_only=True, init=False)(cls)
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
    _generate_init(cls, _SPECS[cls])  # replaces the dataclass __init__
    _generate_codecs(cls, _SPECS[cls], is_message=is_message)
    return cls


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _struct(cls: _C) -> _C:
    """Make a validated record: a frozen, keyword-only, slotted dataclass whose field
    annotations are compiled into validation rules and codec functions right away."""
    return _declare(cls, is_message=False)


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _message(cls: _C) -> _C:
    """A record that may travel alone: registered under its class name (frame 1)."""
    cls = _declare(cls, is_message=True)
    assert issubclass(cls, Message), cls
    name = cls.__name__
    assert name not in _REGISTRY, f"duplicate message type {name}"
    assert _TYPE_NAME_RE.match(name.encode("ascii")) and len(name) <= MAX_TYPE_NAME_BYTES
    _REGISTRY[name] = cls
    codec = _CODECS[cls]
    assert codec.from_map is not None and codec.to_map is not None
    _REGISTRY_BY_FRAME[name.encode("ascii")] = cls
    _FROM_MAP[cls] = codec.from_map
    _TO_MAP[cls] = (name.encode("ascii"), codec.to_map)
    return cls


@dataclass(frozen=True, kw_only=True)
class Struct:
    """Base of every record: frozen, keyword-only, validated on construction.

    Each declared record gets a generated ``__init__`` (see "fast paths"); this hook
    only runs for the bases themselves, which are not records."""

    def __post_init__(self) -> None:
        raise TypeError(f"{type(self).__name__} is not a declared roundpipe.protocol record")

    def _check(self) -> None:
        """Cross-field rules; raise _Invalid with the offending field's path."""


@dataclass(frozen=True, kw_only=True)
class Message(Struct):
    """Base of every message type (a Struct that travels alone, see MESSAGE_TYPES)."""


def _fail(field_name: str, expected: str, seen: str) -> _Invalid:
    err = _Invalid(expected, seen)
    err.path.append("." + field_name)
    return err


# What generated code refers to by name.
_GEN_NS.update(
    _Slow=_Slow,
    _Invalid=_Invalid,
    _NO_VALUE=_NO_VALUE,
    _init_reference=_init_reference,
    # Frozen dataclasses refuse setattr; object's own is how their __init__ sets fields.
    _new=object.__new__,
    _set=object.__setattr__,
)


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
    and write them to `grads` once, at the end.
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
    #: where the stage's accumulated weight gradients go, written once at the end of the
    #: task; name = parameter name (empty for a forward task)
    grads: list[NamedTensorRef]
    #: counters to wait for before overwriting the grads slots
    grad_waits: list[EventWait]
    #: counters to store once the grads are written
    grad_signals: list[EventSignal]
    #: number of label tokens in the whole global batch (the loss is sum / this); tail
    #: only, 0 otherwise
    loss_denominator: NonNegInt
    #: RNG seed of the job, so a recompute replays the forward's dropout
    seed: NonNegInt
    #: deadline of each wait; the timeout error names the EventWait label
    wait_timeout_s: PosFloat
    #: free-form knobs that do not change the protocol
    options: dict[str, Any] = field(default_factory=dict)

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
        if kind == "forward" and (self.grads or self.grad_waits or self.grad_signals):
            name = next(n for n in ("grads", "grad_waits", "grad_signals") if getattr(self, n))
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
    #: the stage partition in use (Plan string form, e.g. "F[0:4] T[4:6] B[2:4,0:2]"),
    #: empty until the job has been planned
    plan: str = ""


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
_FAST_DECODE = True  # tests turn it off to check that both paths agree
_M = TypeVar("_M", bound=Message)


def encode(msg: Message, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[bytes]:
    """Encode a message into its three frames: [header, type name, msgpack body].

    The message was validated when it was constructed, and it owns copies of its lists
    and maps, so encoding does not validate again (it is on the coordinator's hot path).
    Mutating those containers in place is a bug that this function (what it cannot
    encode) or the receiver (what it would not accept) reports as a ProtocolError.

    Raises ProtocolError if `msg` is not a registered message or the body would exceed
    `max_body_bytes` (the receiver would refuse it).
    """
    cls = type(msg)
    try:
        type_frame, to_map = _TO_MAP[cls]
    except (KeyError, TypeError):  # TypeError: an unhashable class (metaclass games)
        raise ProtocolError(f"cannot encode {_seen(msg)}: not a registered message type") from None
    name = cls.__name__
    try:
        body = msgpack.packb(to_map(msg), use_bin_type=True)
    except Exception as e:  # overflow, lone surrogates, cycles, garbage in a mutated message
        raise ProtocolError(
            f"cannot encode {name}: {type(e).__name__}: {e}", message_type=name
        ) from e
    if len(body) > max_body_bytes:
        raise ProtocolError(
            f"cannot encode {name}: body is {len(body)} bytes, more than the limit of "
            f"{max_body_bytes} (max_body_bytes); messages carry descriptors, not data",
            message_type=name,
        )
    return [_HEADER, type_frame, body]


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
    # The common case first: a list of three bytes (what recv_multipart returns) with
    # this version's header and a registered type. Anything else takes the checks below,
    # which also write the error messages.
    if type(frames) is list and len(frames) == _NUM_FRAMES:
        header, type_frame, body = frames
        if type(header) is bytes and type(type_frame) is bytes and type(body) is bytes:
            cls = _REGISTRY_BY_FRAME.get(type_frame)
            if (
                header == _HEADER
                and cls is not None
                and (expected is None or cls is expected)
                and len(body) <= max_body_bytes
            ):
                return _decode_body(cls, body)
    return _decode_checked(frames, max_body_bytes, expected)


def _decode_checked(
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
    return _decode_body(cls, body)


def _decode_body(cls: type[Message], body: bytes | memoryview) -> Message:
    """The body of a message whose frames 0 and 1 were found valid."""
    type_name = cls.__name__
    size = len(body)
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,  # str stays str (and invalid UTF-8 is refused)
            strict_map_key=True,  # map keys must be str (or bin, refused later)
            # Arrays become tuples: cheaper to build, immutable as shape/stride must be,
            # and nested records are arrays of their field values.
            use_list=False,
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
    from_map = _FROM_MAP[cls]
    if _FAST_DECODE:
        try:
            return from_map(fields)  # type: ignore[no-any-return]
        except Exception:
            pass  # the fast path is not sure: the reference decides, and names the problem
    try:
        return _struct_from_map(cls, fields)  # type: ignore[return-value]
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
