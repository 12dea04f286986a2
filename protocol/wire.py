"""RoundPipe wire protocol: the one place where the wire format is written down.

Everything a RoundPipe process sends over ZeroMQ -- coordinator, workers, clients -- is
a *message* encoded by :func:`encode` and read back by :func:`decode`. There is no other
encode/decode path. Tensor data never travels on a socket: messages carry
:class:`TensorRef` descriptors (arena, offset, dtype, shape, stride) into shared-memory
arenas that every process maps (ARCHITECTURE.md sections 2 and 3).

Frames
======

One message is exactly one ZeroMQ frame::

    bytes 0-1    b"RP"
    bytes 2-3    protocol version, big-endian uint16
    byte  4      n, the length of the type name (1..64)
    bytes 5..    the message type name, n ASCII bytes [A-Za-z][A-Za-z0-9_]*: the class
                 name of the message, e.g. b"StageTask"
    the rest     the body: a msgpack map {field name: value} holding every field

Example, a heartbeat at version 2::

    b"RP\\x00\\x02" + b"\\x09" + b"Heartbeat" + msgpack({"sender": "rp-worker-0", "seq": 7,
                                                   "sent_at": 1767225600.5})

- Header and type come before the body, so a receiver can check the version and route
  or reject a message without unpacking its body. They share the body's frame because
  ZeroMQ (pyzmq) costs ~10 us per frame on each send and each receive: three frames
  made a StageTask round trip ~30 us slower (benchmarks/ipc.py).
- :func:`encode` returns, and :func:`decode` takes, a list of :data:`NUM_FRAMES` (one)
  frame, so that routing envelopes stay outside the message. A ROUTER socket prepends
  the peer's identity frame (and a REQ peer an empty delimiter frame); the socket layer
  strips them before calling :func:`decode` and adds them back after :func:`encode`
  (``[identity, *encode(msg)]``).
- Who sends a message is not part of it: the connection is authenticated below the
  protocol (CurveZMQ on tcp://, peer credentials or CurveZMQ on ipc://;
  roundpipe.coordinator.auth), and the coordinator decides what a message may do from
  the sender's identity and role, never from a field it carries (``worker_id``,
  ``pid``).
- Body values use msgpack's native types only: nil, bool, int (-2**63 .. 2**64-1),
  float, str (UTF-8), bin (bytes), array, map with str keys. No ext types (timestamps
  included). A list or tuple is an array.
- A nested record (e.g. a :class:`TensorRef` inside a StageTask) is an *array* of its
  field values in declaration order, e.g. ``["acts", 4096, "bfloat16", [4, 2048],
  nil]`` (a row-major TensorRef). Field names travel once, as the keys of the body map;
  a StageTask carries ~80 records, and as maps they would double the body and triple
  the cost of unpacking it. A message nested in a message (a JobStatus in a JobList) keeps the form
  it has alone: the map of its fields.
- A key repeated in a map counts with its last value (msgpack leaves duplicates to the
  reader; this is what msgpack and msgspec do).
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

A header with another version makes :func:`decode` raise :class:`ProtocolVersionError`
carrying ``seen_version``, ``expected_version`` and, when the type name is readable, the
``message_type``. The handshake uses it: the coordinator answers a worker's mismatched
``Hello`` with a ``Reject(expected_version=...)`` encoded at the coordinator's own
version; the worker cannot read that body, but decoding it raises
``ProtocolVersionError(seen_version=<coordinator's>, message_type="Reject")``, which is
exactly what the worker must report before it exits.

Limits and errors
=================

``decode`` refuses, with :class:`ProtocolError` (or its subclass
:class:`ProtocolVersionError`) and never any other exception:

- a frame count other than 1, a frame that is not a bytes-like object;
- a frame that does not start with b"RP" + a uint16 version; a version mismatch;
- a type name that is empty, longer than 64 bytes, shorter than its length byte says,
  not ASCII, or not registered;
- a body larger than ``max_body_bytes`` (default :data:`DEFAULT_MAX_BODY_BYTES`, 16 MiB),
  checked before unpacking; msgpack's own per-object limits derived from the body length;
  nesting deeper than msgpack's stack (values typed ``Any`` at most
  :data:`MAX_ANY_DEPTH` levels); any ext type; invalid UTF-8; a non-str map key;
  trailing bytes after the body;
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

Speed
=====

Records are msgspec Structs, so encoding and decoding run in msgspec's compiled codec,
which checks every field's type and constraints while it builds the objects; only the
cross-field rules run in Python (see "validation" in the source). The realistic backward
StageTask of benchmarks/ipc.py (9 microbatches, 27 descriptors, 1.2 KB) encodes in
5-9 us and decodes in 20-40 us on a 2-vCPU VM. What does not change from task to task
travels once, in JobSetup (weight and gradient slots, the counter layout). A body the compiled decoder refuses goes to the plain validator, which decides
and writes every error message, so the two agree (the fuzz tests check that they do).
Construction in Python takes the compiled decoder for records that hold no other record
and plain values only, and the plain validator otherwise.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple, TypeVar, Union

import msgpack
import msgspec
from msgspec import field

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_ANY_DEPTH",
    "MAX_TYPE_NAME_BYTES",
    "NUM_FRAMES",
    "DTYPE_NAMES",
    "MESSAGE_TYPES",
    "ProtocolError",
    "ProtocolVersionError",
    "Struct",
    "Message",
    "encode",
    "encoded_size",
    "decode",
    "decode_as",
    "replace",
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
    "JobLog",
    "ListWorkers",
    "WorkerList",
    "GetJobLog",
    "GetProgress",
    "Progress",
    "ERROR_CODES",
    "ErrorCode",
    "ErrorReply",
    "Ack",
]

PROTOCOL_VERSION: int = 10
"""Bump on any change to any message (see "Version rule" above)."""

DEFAULT_MAX_BODY_BYTES: int = 16 * 1024 * 1024
"""Largest body :func:`decode` accepts unless told otherwise. Messages carry descriptors,
never tensor data, so even a JobSetup for a large MoE model stays far below this."""

MAX_REPLY_BYTES: int = 1024 * 1024
"""Budget of one page of a list reply (JobList, WorkerList, Progress): the coordinator
adds items while their encoded size fits (always at least one). Far below
DEFAULT_MAX_BODY_BYTES, so a page is always encodable, and small enough to answer fast."""

MAX_ANY_DEPTH: int = 32
"""Deepest nesting of lists/maps inside a field typed ``Any`` (job specs, options).
Bounded so validation can never hit Python's recursion limit."""

MAX_TYPE_NAME_BYTES: int = 64
"""Longest message type name."""

NUM_FRAMES: int = 1
"""Frames of one message, routing frames not counted (see "Frames" above)."""

_MAGIC = b"RP"
_HEADER_BYTES = 4  # b"RP" + uint16 version
_HEADER = _MAGIC + PROTOCOL_VERSION.to_bytes(2, "big")
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
# Validation has two layers that read one set of rules: the field annotations, whose
# constraints are written once, as msgspec ``Meta`` (``Meta(ge=0)`` and so on).
#
# 1. The compiled codec (msgspec). Every record class is a msgspec.Struct, so msgspec's
#    C decoder checks types, ranges, choices, unknown fields and
#    array lengths while it builds the objects: no Python code runs per field. Cross-field
#    rules (``_check``) run as msgspec's ``__post_init__``, and only on the classes that
#    have them. This is the path every ordinary message takes, both ways.
#
# 2. The reference validator (this section). Every field annotation, its Meta included,
#    is also compiled, when its class is defined, into a _Rule whose `convert(value, wire)` returns the
#    value to store or raises _Invalid. It is the specification: one small function per
#    kind of annotation, and it writes every error message. `wire=True` means the value
#    came out of msgpack (nested records arrive as arrays, every array as a tuple);
#    `wire=False` means a Python caller is constructing a message (records must be
#    instances already). Decoding takes it only when msgspec refuses a body, to decide
#    whether the body is really invalid and to say precisely why. The tests check that
#    both layers agree on every fuzzed input.
#
# Construction must validate where a record is built, and msgspec does not validate
# constructor arguments. A record that holds no other record (TensorRef, EventWait,
# TaskDone, Heartbeat, ...: most records built) is constructed through the compiled
# layer: its arguments are encoded and decoded again (_construct_flat), ~10x faster than
# the reference and holding exactly what a receiver will see. Anything that refuses --
# and every record that holds records, whose nested values must be instances of the
# right class rather than anything that encodes alike -- takes the reference, which
# decides and writes the error.


# Every constraint is written once, as msgspec's Meta: the compiled decoder enforces it
# and the reference validator reads it back (_compile_annotated) to check constructions
# and to word the error ("non-negative int"). Only these Meta keys are used.
_META_KEYS = ("ge", "gt", "le", "min_length")
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
UInt16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]
ComputeDTypeName = Literal["float32", "float16", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(DTypeName)
"""dtype names a :class:`TensorRef` may carry."""

_Conv = Callable[[Any, bool], Any]


class _Rule(NamedTuple):
    # The reference: (value, wire) -> value to store, or raise _Invalid.
    convert: _Conv
    # What it accepts, for error messages: "non-negative int", "list of TensorRef".
    expected: str
    # True when a value may hold an `Any` somewhere: msgspec decodes those values
    # without the reference's limits (depth, ext types), so they are checked again.
    has_any: bool = False


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
    if not wire and not v.isascii():
        # Lone surrogates are valid in Python str but not in UTF-8; catch them here
        # rather than as an error inside the encoder.
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


def _compile(tp: Any) -> _Rule:
    """Turn one field annotation into a _Rule. Unsupported annotations fail at import
    time (TypeError), not on the first message that uses them."""
    if tp is Any:
        return _Rule(_conv_any, "msgpack value", has_any=True)
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        return _Rule(*scalar)
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


_SCALARS: dict[Any, tuple[_Conv, str]] = {
    int: (_conv_int, "int"),
    float: (_conv_float, "float"),
    str: (_conv_str, "str"),
    bool: (_conv_bool, "bool"),
    bytes: (_conv_bytes, "bytes"),
    None: (_conv_none, "None"),
    type(None): (_conv_none, "None"),
}


def _compile_annotated(inner: _Rule, marks: tuple[Any, ...]) -> _Rule:
    expected = inner.expected
    checks: list[Callable[[Any], bool]] = []
    for mark in marks:
        if not isinstance(mark, msgspec.Meta):
            raise TypeError(f"unknown Annotated marker {mark!r}")
        given = {k: getattr(mark, k) for k in _META_KEYS if getattr(mark, k) is not None}
        others = [
            k
            for k in ("lt", "multiple_of", "pattern", "max_length")
            if getattr(mark, k, None) is not None
        ]
        if others:
            raise TypeError(f"Meta constraint(s) {others} are not supported by the validator")
        if "ge" in given:
            checks.append(lambda v, m=given["ge"]: v >= m)
            expected = f"{'positive' if given['ge'] >= 1 else 'non-negative'} {expected}"
        if "gt" in given:
            checks.append(lambda v, m=given["gt"]: v > m)
            expected = f"positive {expected}"
        if "le" in given:
            checks.append(lambda v, m=given["le"]: v <= m)
            expected = f"{expected} <= {given['le']}"
        if "min_length" in given:
            if given["min_length"] != 1:
                raise TypeError("only min_length=1 (non-empty) is supported by the validator")
            checks.append(lambda v: len(v) > 0)
            expected = f"non-empty {expected}"
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

    return _Rule(convert, expected, inner.has_any)


def _compile_literal(choices: tuple[Any, ...]) -> _Rule:
    if not all(type(c) is str for c in choices):
        raise TypeError(f"only str Literal choices are supported, got {choices!r}")
    allowed = frozenset(choices)
    expected = "one of " + ", ".join(repr(c) for c in choices)

    def convert(v: Any, wire: bool) -> str:
        if isinstance(v, str) and v in allowed:
            return str.__str__(v)
        raise _Invalid(expected, _seen(v))

    return _Rule(convert, expected)


def _compile_union(rules: list[_Rule], args: tuple[Any, ...]) -> _Rule:
    expected = " or ".join(r.expected for r in rules)
    has_any = any(r.has_any for r in rules)
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

        return _Rule(convert_optional, expected, has_any)

    if any(isinstance(a, type) and issubclass(a, Struct) for a in args):
        raise TypeError("a Union of records is not supported (which record would it be?)")

    def convert(v: Any, wire: bool) -> Any:
        for rule in rules:
            try:
                return rule.convert(v, wire)
            except _Invalid:
                continue
        raise _Invalid(expected, _seen(v))

    return _Rule(convert, expected, has_any)


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

    return _Rule(convert, expected, item.has_any)


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

    return _Rule(convert, expected, value.has_any)


def _compile_struct(cls: type[Struct]) -> _Rule:
    name = cls.__name__

    def convert(v: Any, wire: bool) -> Struct:
        if wire:
            if not issubclass(cls, Message):
                return _struct_from_array(cls, v)
            # A message inside a message (a JobStatus in a JobList) keeps its own form:
            # the map of its fields, as when it travels alone.
            if type(v) is not dict:
                raise _Invalid(f"{name} as a map of its fields", _seen(v))
            return _struct_from_map(cls, v)
        if isinstance(v, cls):
            return v  # validated when it was constructed
        raise _Invalid(name, _seen(v))

    if any(spec.rule.has_any for spec in _SPECS[cls]):
        # The compiled decoder's `Any` values are re-checked per message field
        # (_ANY_FIELDS); one inside a nested record would escape that check.
        raise TypeError(f"{name}: a record nested in a message cannot hold an Any value")
    return _Rule(convert, name)


class _FieldSpec(NamedTuple):
    name: str
    rule: _Rule
    default: Callable[[], Any] | None  # None: required


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
_REGISTRY: dict[str, type[Message]] = {}
# The same registry keyed by the type name as bytes (decode), and by class the bytes
# that start its frame: header, type-name length, type name (encode).
_REGISTRY_BY_NAME_BYTES: dict[bytes, type[Message]] = {}
_PREFIX: dict[type, bytes] = {}
# Per message class: the compiled decoder. Per record class: the fields that may hold an
# `Any`, and for a record that holds no other record the decoder that constructs it
# (_construct_flat).
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_ANY_FIELDS: dict[type, tuple[_FieldSpec, ...]] = {}
_FLAT_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(_REGISTRY)
"""Every message type that may travel on the wire, by type name (bytes 5.. of the frame)."""


# --------------------------------------------------------------------------- reference paths
#
# Whole-record validation: every construction, and the decoding of any body that the
# compiled decoder refused (see "validation" above).


def _build(cls: type[Struct], values: dict[str, Any]) -> Struct:
    """An instance from field values that are already valid (msgspec's own __init__,
    which runs the cross-field rules as __post_init__)."""
    return msgspec.StructMeta.__call__(cls, **values)  # type: ignore[no-any-return]


def _convert_field(spec: _FieldSpec, value: Any, wire: bool) -> Any:
    try:
        return spec.rule.convert(value, wire)
    except _Invalid as e:
        e.path.append("." + spec.name)
        raise


def _construct(cls: type[Struct], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Struct:
    """What ``cls(**kwargs)`` does: validate every argument, then build."""
    specs = _SPECS.get(cls)
    if specs is None:
        raise TypeError(f"{cls.__name__} is not a declared roundpipe.protocol record")
    if args:
        raise TypeError(f"{cls.__name__}() takes keyword arguments only")
    unknown = kwargs.keys() - {spec.name for spec in specs}
    if unknown:
        raise TypeError(f"{cls.__name__}() got unexpected keyword arguments {sorted(unknown)}")
    flat = _FLAT_DECODERS.get(cls)
    if flat is not None:
        try:
            return _construct_flat(cls, flat, specs, kwargs)
        except Exception:
            pass  # refused: the reference below decides, and names the problem
    values = {}
    try:
        for spec in specs:
            if spec.name in kwargs:
                values[spec.name] = _convert_field(spec, kwargs[spec.name], False)
            elif spec.default is not None:
                values[spec.name] = spec.default()
            else:
                raise TypeError(f"{cls.__name__}() missing keyword argument {spec.name!r}")
        return _build(cls, values)
    except _Invalid as e:
        raise e.to_error(cls.__name__) from None
    except RecursionError:
        raise ProtocolError(
            f"invalid {cls.__name__}: nested too deeply", message_type=cls.__name__
        ) from None


def _construct_flat(
    cls: type[Struct],
    decoder: msgspec.msgpack.Decoder[Any],
    specs: tuple[_FieldSpec, ...],
    kwargs: dict[str, Any],
) -> Struct:
    """Construction of a record that holds no other record: its wire form, decoded. The
    compiled decoder checks every value, and the record holds exactly what a receiver
    will see (plain values, its own containers). Raises on anything wrong; the caller
    then lets the reference path name the problem ("validation" above).

    Only plain values take this path: msgspec's encoder would also write sets, enums,
    UUIDs, dates, dataclasses, ... as msgpack values that the decoder then accepts,
    where the reference refuses them or stores them converted."""
    for value in kwargs.values():
        if not _plain(value):
            raise TypeError("not a plain value")
    if issubclass(cls, Message):
        body = _ENCODER.encode(kwargs)  # absent fields with a default: the decoder fills them
    else:
        body = _ENCODER.encode(
            [kwargs[s.name] if s.name in kwargs else s.default() for s in specs]  # type: ignore[misc]
        )
    # (No `Any` to re-check: a record with an `Any` field is not flat, see _declare.)
    return decoder.decode(body)  # type: ignore[no-any-return]


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _plain(value: Any) -> bool:
    """A value of exactly the types a record without nested records holds: a scalar, a
    list or tuple of scalars, or a str-keyed map of scalars."""
    t = type(value)
    if t in _PLAIN_SCALARS:
        return True
    if t is tuple or t is list:
        return all(type(item) in _PLAIN_SCALARS for item in value)
    if t is dict:
        return all(type(k) is str and type(v) in _PLAIN_SCALARS for k, v in value.items())
    return False


def _recheck_any(cls: type[Struct], record: Struct) -> None:
    """msgspec takes any msgpack value for `Any` (ext types, any depth, int keys): hold
    those values to the reference's rules."""
    for spec in _ANY_FIELDS[cls]:
        msgspec.structs.force_setattr(
            record, spec.name, spec.rule.convert(getattr(record, spec.name), True)
        )


def _struct_from_map(cls: type[Struct], d: dict[Any, Any]) -> Struct:
    """A message body: a map of field names to wire values."""
    values = {}
    matched = 0
    for spec in _SPECS[cls]:
        if spec.name in d:
            matched += 1
            values[spec.name] = _convert_field(spec, d[spec.name], True)
        elif spec.default is not None:
            values[spec.name] = spec.default()
        else:
            raise _missing(cls, spec.name)
    if matched != len(d):
        raise _unknown(cls, d)
    return _build(cls, values)


def _struct_from_array(cls: type[Struct], items: Any) -> Struct:
    """A nested record: an array of its field values in declaration order, of which
    trailing fields with a default may be left out."""
    specs = _SPECS[cls]
    if type(items) is not tuple and type(items) is not list:
        raise _Invalid(_array_expected(cls), _seen(items))
    if len(items) > len(specs):
        raise _Invalid(_array_expected(cls), f"{len(items)} values: {_seen(items)}")
    values = {}
    for i, spec in enumerate(specs):
        if i < len(items):
            values[spec.name] = _convert_field(spec, items[i], True)
        elif spec.default is not None:
            values[spec.name] = spec.default()
        else:
            raise _missing(cls, spec.name)
    return _build(cls, values)


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


# --------------------------------------------------------------------------- base classes


_C = TypeVar("_C", bound=type)
_S = TypeVar("_S", bound="Struct")


class _RecordMeta(msgspec.StructMeta):
    """Metaclass of every record. Calling a record class validates its arguments
    (msgspec's __init__ would store anything); decoding does not come through here,
    msgspec builds those instances itself. A class that defines ``_check`` gets it as
    msgspec's ``__post_init__``, so the cross-field rules run on both paths."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> Any:
        if "_check" in ns and any(isinstance(base, _RecordMeta) for base in bases):
            ns["__post_init__"] = ns["_check"]
        kw.setdefault("kw_only", True)  # msgspec applies it per class, not inherited
        return super().__new__(mcls, name, bases, ns, **kw)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _construct(cls, args, kwargs)  # type: ignore[arg-type]


def _declare(cls: _C, *, is_message: bool) -> _C:
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            default: Callable[[], Any] | None = lambda value=f.default: value  # noqa: E731
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory
        else:
            default = None
        specs.append(_FieldSpec(f.name, _compile(hints[f.name]), default))
    _SPECS[cls] = tuple(specs)
    _ANY_FIELDS[cls] = tuple(s for s in specs if s.rule.has_any)
    if is_message:
        _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    if not any(_holds_records(hints[s.name]) or s.rule.has_any for s in specs):
        # (An `Any` value may nest deeper than _plain looks: such records take the
        # reference, which checks and copies it.)
        _FLAT_DECODERS[cls] = _DECODERS.get(cls) or msgspec.msgpack.Decoder(cls)
    return cls


def _holds_records(tp: Any) -> bool:
    """Whether a field annotation can hold a record (a Struct) anywhere inside."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return True
    return any(_holds_records(arg) for arg in typing.get_args(tp))


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _struct(cls: _C) -> _C:
    """Make a validated record: a frozen, keyword-only msgspec Struct whose field
    annotations are compiled into validation rules right away."""
    return _declare(cls, is_message=False)


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def _message(cls: _C) -> _C:
    """A record that may travel alone: registered under its class name (the type in its frame)."""
    cls = _declare(cls, is_message=True)
    assert issubclass(cls, Message), cls
    name = cls.__name__
    assert name not in _REGISTRY, f"duplicate message type {name}"
    assert _TYPE_NAME_RE.match(name.encode("ascii")) and len(name) <= MAX_TYPE_NAME_BYTES
    _REGISTRY[name] = cls
    _REGISTRY_BY_NAME_BYTES[name.encode("ascii")] = cls
    _PREFIX[cls] = _HEADER + bytes([len(name)]) + name.encode("ascii")
    return cls


class Struct(
    msgspec.Struct,
    metaclass=_RecordMeta,
    frozen=True,
    kw_only=True,
    array_like=True,  # a nested record travels as the array of its field values
    forbid_unknown_fields=True,  # ... and not one value more
    # Not tracked by the cycle collector: cheaper to allocate (a decoded StageTask is ~370
    # objects, ~12% faster) and never scanned. Records cannot form cycles: they are
    # frozen trees of plain values, and Any values are copied and bounded in depth.
    gc=False,
):
    """Base of every record: frozen, keyword-only, validated on construction."""

    def _check(self) -> None:
        """Cross-field rules; raise _Invalid with the offending field's path."""


class Message(Struct, array_like=False):
    """Base of every message type (a Struct that travels alone, as a map of its fields;
    see MESSAGE_TYPES)."""


def replace(record: _S, **changes: Any) -> _S:
    """A copy of `record` with some fields changed, validated like a new record (the
    counterpart of dataclasses.replace)."""
    values = {name: getattr(record, name) for name in record.__struct_fields__}
    values.update(changes)
    return type(record)(**values)


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
    #: fp32 gradient slot of every trainable weight of the layer (name = parameter name;
    #: a tied alias has its own): a backward or tail task over the layer writes each one
    #: once, at its end, after its grad_waits
    grads: list[NamedTensorRef] = field(default_factory=list)


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
    (JobSetup.layers[i].grads).
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
    #: (roundpipe.coordinator.timeline); None until measured
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


# --------------------------------------------------------------------------- encode / decode

_FAST_DECODE = True  # tests turn it off to check that both paths agree
_ENCODER = msgspec.msgpack.Encoder()
_M = TypeVar("_M", bound=Message)


def encode(msg: Message, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[bytes]:
    """Encode a message into its frame: ``[header + type + msgpack body]`` (a list of
    NUM_FRAMES, so that callers add routing frames with ``[identity, *encode(msg)]``).

    The message was validated when it was constructed, and it owns copies of its lists
    and maps, so encoding does not validate again (it is on the coordinator's hot path).
    Mutating those containers in place is a bug that this function (what it cannot
    encode) or the receiver (what it would not accept) reports as a ProtocolError.

    Raises ProtocolError if `msg` is not a registered message or the body would exceed
    `max_body_bytes` (the receiver would refuse it).
    """
    cls = type(msg)
    prefix = _PREFIX.get(cls)
    if prefix is None:
        raise ProtocolError(f"cannot encode {_seen(msg)}: not a registered message type")
    name = cls.__name__
    try:
        body = _ENCODER.encode(msg)
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
    return [prefix + body]


def encoded_size(record: Struct) -> int:
    """Bytes ``record`` takes inside a body (a message as a map, a record as an array):
    what a sender filling a page up to MAX_REPLY_BYTES adds per item."""
    try:
        return len(_ENCODER.encode(record))
    except Exception as e:
        raise ProtocolError(f"cannot encode {_seen(record)}: {type(e).__name__}: {e}") from e


def decode(frames: Sequence[bytes], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Message:
    """Decode the frame of one message (routing frames already stripped): a sequence of
    NUM_FRAMES frames, as ``identity, *frames = sock.recv_multipart()`` leaves them.

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


def _decode(
    frames: Sequence[bytes], max_body_bytes: int, expected: type[Message] | None
) -> Message:
    # The common case first: one bytes frame (what recv_multipart returns) with this
    # version's header and a registered type. Anything else takes the checks below,
    # which also write the error messages.
    if type(frames) is list and len(frames) == NUM_FRAMES:
        frame = frames[0]
        if type(frame) is bytes and len(frame) > _HEADER_BYTES and frame.startswith(_HEADER):
            body_at = _HEADER_BYTES + 1 + frame[_HEADER_BYTES]
            cls = _REGISTRY_BY_NAME_BYTES.get(frame[_HEADER_BYTES + 1 : body_at])
            if (
                cls is not None
                and body_at <= len(frame)
                and (expected is None or cls is expected)
                and len(frame) - body_at <= max_body_bytes
            ):
                return _decode_body(cls, memoryview(frame)[body_at:])
    return _decode_checked(frames, max_body_bytes, expected)


def _decode_checked(
    frames: Sequence[bytes], max_body_bytes: int, expected: type[Message] | None
) -> Message:
    try:
        count = len(frames)
    except Exception:  # TypeError, or whatever a hostile __len__ raises
        raise ProtocolError(f"expected a sequence of frames, got {_seen(frames)}") from None
    if count != NUM_FRAMES:
        raise ProtocolError(
            f"expected {NUM_FRAMES} frame (header, type, body) after routing frames are "
            f"stripped, got {count}"
        )
    try:
        frame = frames[0]
    except Exception as e:  # a hostile Sequence whose __getitem__ misbehaves
        raise ProtocolError(f"cannot read frames: {type(e).__name__}: {e}") from None
    try:
        view = memoryview(frame)  # type: ignore[arg-type]
    except Exception:  # TypeError; ValueError for a released buffer; a hostile __buffer__
        raise ProtocolError(f"frame 0 is {_seen(frame)}, expected a bytes-like object") from None
    if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
        raise ProtocolError("frame 0 is not a contiguous byte buffer")
    view = view.cast("B")  # a bytearray or zmq.Frame may come as another 1-byte format

    if view.nbytes < _HEADER_BYTES or view[:2].tobytes() != _MAGIC:
        raise ProtocolError(
            f"bad header: expected b'RP' + uint16 version, got "
            f"{view[:16].tobytes()!r}{'...' if view.nbytes > 16 else ''} ({view.nbytes} bytes)"
        )
    # Type name first only so a version error can say what the peer sent; the version
    # is still checked before the name is trusted for anything.
    name_len = view[_HEADER_BYTES] if view.nbytes > _HEADER_BYTES else 0
    body_at = _HEADER_BYTES + 1 + name_len
    type_bytes = view[_HEADER_BYTES + 1 : body_at].tobytes()
    readable = (
        1 <= name_len <= MAX_TYPE_NAME_BYTES
        and len(type_bytes) == name_len
        and _TYPE_NAME_RE.match(type_bytes) is not None
    )
    type_name = type_bytes.decode("ascii") if readable else None

    version = int.from_bytes(view[2:_HEADER_BYTES].tobytes(), "big")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(version, PROTOCOL_VERSION, message_type=type_name)

    if type_name is None:
        raise ProtocolError(
            f"bad type name: expected a length byte 1..{MAX_TYPE_NAME_BYTES} after the "
            f"header, then that many ASCII bytes [A-Za-z][A-Za-z0-9_]*; got length "
            f"{name_len if view.nbytes > _HEADER_BYTES else 'missing'} and "
            f"{type_bytes[:MAX_TYPE_NAME_BYTES]!r} ({view.nbytes} bytes in the frame)"
        )
    cls = _REGISTRY.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}", message_type=type_name)
    if expected is not None and cls is not expected:
        raise ProtocolError(
            f"expected a {expected.__name__} message, got {type_name}", message_type=type_name
        )

    size = view.nbytes - body_at
    if size > max_body_bytes:
        raise ProtocolError(
            f"{type_name} body is {size} bytes, more than the limit of {max_body_bytes} "
            "(max_body_bytes)",
            message_type=type_name,
        )
    return _decode_body(cls, view[body_at:])


def _decode_body(cls: type[Message], body: memoryview) -> Message:
    """The body of a message whose header and type were found valid."""
    if _FAST_DECODE:
        try:
            msg = _DECODERS[cls].decode(body)
            _recheck_any(cls, msg)
            return msg  # type: ignore[no-any-return]
        except Exception:
            pass  # refused: the reference decides, and names the problem
    return _decode_reference(cls, body)


def _decode_reference(cls: type[Message], body: memoryview) -> Message:
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
        return _struct_from_map(cls, fields)  # type: ignore[return-value]
    except _Invalid as e:
        raise e.to_error(type_name) from None
    except RecursionError:
        raise ProtocolError(
            f"invalid {type_name}: nested too deeply", message_type=type_name
        ) from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a RoundPipe body")
