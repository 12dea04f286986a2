"""RoundPipe wire protocol: messages into frames and back, the one encode/decode path.

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
  roundpipe.coordinator.service.auth), and the coordinator decides what a message may do from
  the sender's identity and role, never from a field it carries (``worker_id``,
  ``pid``).
- Body values use msgpack's native types only: nil, bool, int (-2**63 .. 2**64-1),
  float, str (UTF-8), bin (bytes), array, map with str keys. No ext types (timestamps
  included). A list or tuple is an array.
- A nested struct (e.g. a :class:`TensorRef` inside a StageTask) is an *array* of its
  field values in declaration order, e.g. ``["acts", 4096, "bfloat16", [4, 2048],
  nil]`` (a row-major TensorRef). Field names travel once, as the keys of the body map;
  a StageTask carries ~80 structs, and as maps they would double the body and triple
  the cost of unpacking it. A message nested in a message (a JobStatus in a JobList) keeps the form
  it has alone: the map of its fields.
- A key repeated in a map counts with its last value (msgpack leaves duplicates to the
  reader; this is what msgpack and msgspec do).
- Every field is written by the encoder; a receiver fills an absent field only where
  the class declares a default (a body map may leave out such a field, a struct array
  only such fields at its end).

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
  struct that is not an array or has too many values, a value of the wrong type
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

Speed
=====

Messages and their structs are msgspec Structs, so encoding and decoding run in msgspec's compiled codec,
which checks every field's type and constraints while it builds the objects; only the
cross-field rules run in Python (see roundpipe.protocol.schema). The realistic backward
StageTask of benchmarks/ipc.py (9 microbatches, 27 descriptors, 1.2 KB) encodes in
5-9 us and decodes in 20-40 us on a 2-vCPU VM. What does not change from task to task
travels once, in JobSetup (weight and gradient slots, the counter layout). A body the
compiled decoder refuses goes to the plain validator, which decides and writes every
error message, so the two agree (the fuzz tests compare :func:`decode` with
:func:`decode_reference`, which takes the plain validator alone).
Construction in Python takes the compiled decoder for structs that hold no other struct
and plain values only, and the plain validator otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

# Every message type is declared in these two modules: imported here so that the
# registry is complete before the frame prefixes below are built from it.
from roundpipe.protocol import client_messages, worker_messages  # noqa: F401
from roundpipe.protocol.schema import (
    MAX_TYPE_NAME_BYTES,
    MESSAGE_TYPES,
    Message,
    ProtocolError,
    ProtocolVersionError,
    Struct,
    decode_compiled,
    describe,
    encode_struct,
    is_type_name,
    message_from_fields,
)
from roundpipe.protocol.version import PROTOCOL_VERSION

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "NUM_FRAMES",
    "decode",
    "decode_as",
    "encode",
    "encoded_size",
    "message_type",
]

DEFAULT_MAX_BODY_BYTES: int = 16 * 1024 * 1024
"""Largest body :func:`decode` accepts unless told otherwise. Messages carry descriptors,
never tensor data, so even a JobSetup for a large MoE model stays far below this."""

NUM_FRAMES: int = 1
"""Frames of one message, routing frames not counted (see "Frames" above)."""

_MAGIC = b"RP"
_HEADER_BYTES = 4  # b"RP" + uint16 version
_HEADER = _MAGIC + PROTOCOL_VERSION.to_bytes(2, "big")

# --------------------------------------------------------------------------- encode / decode

# The registry keyed by the type name as bytes (decode), and per class the bytes that
# start its frame: header, type-name length, type name (encode).
_REGISTRY_BY_NAME_BYTES: dict[bytes, type[Message]] = {
    name.encode("ascii"): cls for name, cls in MESSAGE_TYPES.items()
}
_PREFIX: dict[type, bytes] = {
    cls: _HEADER + bytes([len(name)]) + name.encode("ascii") for name, cls in MESSAGE_TYPES.items()
}
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
        raise ProtocolError(f"cannot encode {describe(msg)}: not a registered message type")
    name = cls.__name__
    try:
        body = encode_struct(msg)
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


def encoded_size(struct: Struct) -> int:
    """Bytes ``struct`` takes inside a body (a message as a map, a struct as an array):
    what a sender filling a page up to MAX_REPLY_BYTES adds per item."""
    try:
        return len(encode_struct(struct))
    except Exception as e:
        raise ProtocolError(f"cannot encode {describe(struct)}: {type(e).__name__}: {e}") from e


def decode(frames: Sequence[bytes], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Message:
    """Decode the frame of one message (routing frames already stripped): a sequence of
    NUM_FRAMES frames, as ``identity, *frames = sock.recv_multipart()`` leaves them.

    Frames may be bytes, bytearray, memoryview or zmq.Frame. Raises ProtocolVersionError
    on a version mismatch and ProtocolError on anything else wrong; never another
    exception type.
    """
    return _decode(frames, max_body_bytes, None)


def message_type(frame: bytes | memoryview) -> type[Message] | None:
    """The message type a frame's header names, read without touching its body (a
    receiver can then choose the body limit to decode it with); None when the header
    names no registered type. The version is not checked here: :func:`decode` does, and
    says so."""
    view = memoryview(frame)
    if view.nbytes <= _HEADER_BYTES or view[:2] != _MAGIC:
        return None
    body_at = _HEADER_BYTES + 1 + view[_HEADER_BYTES]
    return _REGISTRY_BY_NAME_BYTES.get(view[_HEADER_BYTES + 1 : body_at].tobytes())


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


def decode_reference(
    frames: Sequence[bytes], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Message:
    """What :func:`decode` does, with every frame taking the checked path and every body
    read by the reference validator alone (never the compiled decoder): slower, and for
    any input the same message or the same error. tests/test_protocol.py holds
    :func:`decode` to it; the runtime has no use for it."""
    return _decode_checked(frames, max_body_bytes, None, _decode_body_reference)


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
    return _decode_checked(frames, max_body_bytes, expected, _decode_body)


def _decode_checked(
    frames: Sequence[bytes],
    max_body_bytes: int,
    expected: type[Message] | None,
    decode_body: Callable[[type[Message], memoryview], Message],
) -> Message:
    try:
        count = len(frames)
    except Exception:  # TypeError, or whatever a hostile __len__ raises
        raise ProtocolError(f"expected a sequence of frames, got {describe(frames)}") from None
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
        raise ProtocolError(f"frame 0 is {describe(frame)}, expected a bytes-like object") from None
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
        and is_type_name(type_bytes)
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
    cls = MESSAGE_TYPES.get(type_name)
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
    return decode_body(cls, view[body_at:])


def _decode_body(cls: type[Message], body: memoryview) -> Message:
    """The body of a message whose header and type were found valid."""
    try:
        return decode_compiled(cls, body)
    except Exception:
        pass  # refused: the reference decides, and names the problem
    return _decode_body_reference(cls, body)


def _decode_body_reference(cls: type[Message], body: memoryview) -> Message:
    """The body of a message whose header and type were found valid, read by msgpack
    with limits from the body's size and checked by the reference validator."""
    type_name = cls.__name__
    size = len(body)
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,  # str stays str (and invalid UTF-8 is refused)
            strict_map_key=True,  # map keys must be str (or bin, refused later)
            # Arrays become tuples: cheaper to build, immutable as shape/stride must be,
            # and nested structs are arrays of their field values.
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
            f"invalid {type_name}: body: expected a map of fields, got {describe(fields)}",
            message_type=type_name,
        )
    return message_from_fields(cls, fields)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a RoundPipe body")
