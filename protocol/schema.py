"""The struct machinery behind every message: base classes, registration, validation.

Structs (:class:`Struct`) and messages (:class:`Message`) are msgspec Structs declared in
roundpipe.protocol.structs, roundpipe.protocol.worker_messages and
roundpipe.protocol.client_messages; this module turns their field annotations into
validation rules, registers message types by name (:data:`MESSAGE_TYPES`) and holds the
errors (:class:`ProtocolError`). roundpipe.protocol.codec puts messages into frames and
back.

Validation has two layers that read one set of rules: the field annotations, whose
constraints are written once, as msgspec ``Meta`` (``Meta(ge=0)`` and so on).

1. The compiled codec (msgspec). Every struct class is a msgspec.Struct, so msgspec's
   C decoder checks types, ranges, choices, unknown fields and
   array lengths while it builds the objects: no Python code runs per field. Cross-field
   rules (``_check``) run as msgspec's ``__post_init__``, and only on the classes that
   have them. This is the path every ordinary message takes, both ways.

2. The reference validator (this section). Every field annotation, its Meta included,
   is also compiled, when its class is defined, into a _Rule whose `convert(value, wire)` returns the
   value to store or raises Invalid. It is the specification: one small function per
   kind of annotation, and it writes every error message. `wire=True` means the value
   came out of msgpack (nested structs arrive as arrays, every array as a tuple);
   `wire=False` means a Python caller is constructing a message (structs must be
   instances already). Decoding takes it only when msgspec refuses a body, to decide
   whether the body is really invalid and to say precisely why. The tests check that
   both layers agree on every fuzzed input.

Construction must validate where a struct is built, and msgspec does not validate
constructor arguments. A struct that holds no other struct (TensorRef, EventWait,
TaskDone, Heartbeat, ...: most structs built) is constructed through the compiled
layer: its arguments are encoded and decoded again (_construct_flat), ~10x faster than
the reference and holding exactly what a receiver will see. Anything that refuses --
and every struct that holds structs, whose nested values must be instances of the
right class rather than anything that encodes alike -- takes the reference, which
decides and writes the error.

The package-internal interface (not re-exported by roundpipe.protocol):

- for the modules that declare structs and messages: the decorators
  :func:`declare_struct` and :func:`declare_message`, the field types (``NonNegInt``,
  ``Name``, ...), and for cross-field rules :func:`invalid_field` and :func:`describe`;
- for the codec: :func:`encode_struct`, :func:`decode_compiled` (the fast path),
  :func:`message_from_fields` (the reference path) and :func:`is_type_name`.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, Union

import msgspec

__all__ = [
    "MAX_ANY_DEPTH",
    "MAX_TYPE_NAME_BYTES",
    "MESSAGE_TYPES",
    "Message",
    "ProtocolError",
    "ProtocolVersionError",
    "Struct",
    "replace",
]

MAX_ANY_DEPTH: int = 32
"""Deepest nesting of lists/maps inside a field typed ``Any`` (job specs, options).
Bounded so validation can never hit Python's recursion limit."""

MAX_TYPE_NAME_BYTES: int = 64
"""Longest message type name."""

_TYPE_NAME_RE = re.compile(rb"[A-Za-z][A-Za-z0-9_]*\Z")
# msgpack's integer range: the encoder cannot write anything outside it.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_SEEN_REPR_CHARS = 80
# Construction of flat structs encodes their arguments (_construct_flat).
_ENCODER = msgspec.msgpack.Encoder()

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
    """The peer speaks another protocol version; see "Version rule" in roundpipe.protocol.version."""

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


class Invalid(Exception):
    """One value failed validation (raised by the rules, and by a struct's ``_check``,
    through :func:`invalid_field`). Containers prepend their path segment as
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


def describe(value: object) -> str:
    """Describe a rejected value briefly: its repr (truncated) and its type."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not turn into a non-protocol error
        text = "<unrepresentable>"
    if len(text) > _SEEN_REPR_CHARS:
        text = text[: _SEEN_REPR_CHARS - 3] + "..."
    kind = _WIRE_TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


# Every constraint is written once, as msgspec's Meta: the compiled decoder enforces it
# and the reference validator reads it back (_compile_annotated) to check constructions
# and to word the error ("non-negative int"). Only these Meta keys are used.
_META_KEYS = ("ge", "gt", "le", "min_length")
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""A value an event-table counter (a signed 64-bit integer) can hold."""
UInt16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]

_Conv = Callable[[Any, bool], Any]


class _Rule(NamedTuple):
    # The reference: (value, wire) -> value to store, or raise Invalid.
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
                raise Invalid("int in msgpack's range [-2**63, 2**64-1]", describe(v))
            if type(v) is not int:  # IntEnum and friends: store the plain value
                return int(v)
        return v
    raise Invalid("int", describe(v))


def _conv_float(v: Any, wire: bool) -> float:
    if type(v) is float:
        return v
    # An int is accepted (a JSON-minded peer may write 1 for 1.0) but stored as float so
    # equality and arithmetic do not depend on how the sender spelled the number.
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, int) and not _INT_MIN <= v <= _INT_MAX:
            raise Invalid("float", describe(v))
        return float(v)
    raise Invalid("float", describe(v))


def _conv_str(v: Any, wire: bool) -> str:
    if type(v) is not str:
        if not isinstance(v, str):
            raise Invalid("str", describe(v))
        v = str.__str__(v)  # StrEnum etc.: store the plain value
    if not wire and not v.isascii():
        # Lone surrogates are valid in Python str but not in UTF-8; catch them here
        # rather than as an error inside the encoder.
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid("str encodable as UTF-8", describe(v)) from None
    return v


def _conv_bool(v: Any, wire: bool) -> bool:
    if type(v) is bool:
        return v
    raise Invalid("bool", describe(v))


def _conv_bytes(v: Any, wire: bool) -> bytes:
    if type(v) is bytes:
        return v
    if not wire and isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise Invalid("bytes", describe(v))


def _conv_none(v: Any, wire: bool) -> None:
    if v is None:
        return None
    raise Invalid("None", describe(v))


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
            raise Invalid(f"msgpack value nested at most {MAX_ANY_DEPTH} levels", "deeper nesting")
        if t is dict:
            out: dict[str, Any] = {}
            for key, item in v.items():
                if type(key) is not str:
                    raise Invalid("map with str keys", f"key {describe(key)}")
                try:
                    out[key] = _conv_any(item, wire, depth + 1)
                except Invalid as e:
                    e.path.append(_key_segment(key))
                    raise
            return out
        items: list[Any] = []
        for i, item in enumerate(v):
            try:
                items.append(_conv_any(item, wire, depth + 1))
            except Invalid as e:
                e.path.append(f"[{i}]")
                raise
        return items
    raise Invalid(_ANY_EXPECTED, describe(v))


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
        except Invalid as e:
            if e.expected == inner.expected and not e.path:
                e.expected = expected  # "non-negative int", not just "int"
            raise
        for check in checks:
            if not check(out):  # `not (nan >= 0)` is True: NaN is refused too
                raise Invalid(expected, describe(v))
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
        raise Invalid(expected, describe(v))

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
            except Invalid as e:
                if not e.path:
                    e.expected = expected
                raise

        return _Rule(convert_optional, expected, has_any)

    if any(isinstance(a, type) and issubclass(a, Struct) for a in args):
        raise TypeError("a Union of structs is not supported (which struct would it be?)")

    def convert(v: Any, wire: bool) -> Any:
        for rule in rules:
            try:
                return rule.convert(v, wire)
            except Invalid:
                continue
        raise Invalid(expected, describe(v))

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
            raise Invalid(expected, describe(v))
        out = []
        for i, x in enumerate(v):
            try:
                out.append(convert_item(x, wire))
            except Invalid as e:
                e.path.append(f"[{i}]")
                raise
        return tuple(out) if as_tuple else out

    return _Rule(convert, expected, item.has_any)


def _compile_str_map(value: _Rule) -> _Rule:
    expected = f"map of str to {value.expected}"
    convert_value = value.convert

    def convert(v: Any, wire: bool) -> dict[str, Any]:
        if type(v) is not dict:
            raise Invalid(expected, describe(v))
        out: dict[str, Any] = {}
        for key, x in v.items():
            if type(key) is not str:
                raise Invalid(f"{expected} (str keys)", f"key {describe(key)}")
            try:
                out[key] = convert_value(x, wire)
            except Invalid as e:
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
                raise Invalid(f"{name} as a map of its fields", describe(v))
            return _struct_from_map(cls, v)
        if isinstance(v, cls):
            return v  # validated when it was constructed
        raise Invalid(name, describe(v))

    if any(spec.rule.has_any for spec in _SPECS[cls]):
        # The compiled decoder's `Any` values are re-checked per message field
        # (_ANY_FIELDS); one inside a nested struct would escape that check.
        raise TypeError(f"{name}: a struct nested in a message cannot hold an Any value")
    return _Rule(convert, name)


class _FieldSpec(NamedTuple):
    name: str
    rule: _Rule
    default: Callable[[], Any] | None  # None: required


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
_REGISTRY: dict[str, type[Message]] = {}
# Per message class: the compiled decoder. Per struct class: the fields that may hold an
# `Any`, and for a struct that holds no other struct the decoder that constructs it
# (_construct_flat).
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_ANY_FIELDS: dict[type, tuple[_FieldSpec, ...]] = {}
_FLAT_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(_REGISTRY)
"""Every message type that may travel on the wire, by type name (bytes 5.. of the frame)."""


# --------------------------------------------------------------------------- reference paths
#
# Whole-struct validation: every construction, and the decoding of any body that the
# compiled decoder refused (see the module doc).


def _build(cls: type[Struct], values: dict[str, Any]) -> Struct:
    """An instance from field values that are already valid (msgspec's own __init__,
    which runs the cross-field rules as __post_init__)."""
    return msgspec.StructMeta.__call__(cls, **values)  # type: ignore[no-any-return]


def _convert_field(spec: _FieldSpec, value: Any, wire: bool) -> Any:
    try:
        return spec.rule.convert(value, wire)
    except Invalid as e:
        e.path.append("." + spec.name)
        raise


def _construct(cls: type[Struct], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Struct:
    """What ``cls(**kwargs)`` does: validate every argument, then build."""
    specs = _SPECS.get(cls)
    if specs is None:
        raise TypeError(f"{cls.__name__} is not a declared roundpipe.protocol struct")
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
    except Invalid as e:
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
    """Construction of a struct that holds no other struct: its wire form, decoded. The
    compiled decoder checks every value, and the struct holds exactly what a receiver
    will see (plain values, its own containers). Raises on anything wrong; the caller
    then lets the reference path name the problem (the module doc).

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
    # (No `Any` to re-check: a struct with an `Any` field is not flat, see _declare.)
    return decoder.decode(body)  # type: ignore[no-any-return]


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _plain(value: Any) -> bool:
    """A value of exactly the types a struct without nested structs holds: a scalar, a
    list or tuple of scalars, or a str-keyed map of scalars."""
    t = type(value)
    if t in _PLAIN_SCALARS:
        return True
    if t is tuple or t is list:
        return all(type(item) in _PLAIN_SCALARS for item in value)
    if t is dict:
        return all(type(k) is str and type(v) in _PLAIN_SCALARS for k, v in value.items())
    return False


def _recheck_any(cls: type[Struct], struct: Struct) -> None:
    """msgspec takes any msgpack value for `Any` (ext types, any depth, int keys): hold
    those values to the reference's rules."""
    for spec in _ANY_FIELDS[cls]:
        msgspec.structs.force_setattr(
            struct, spec.name, spec.rule.convert(getattr(struct, spec.name), True)
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
    """A nested struct: an array of its field values in declaration order, of which
    trailing fields with a default may be left out."""
    specs = _SPECS[cls]
    if type(items) is not tuple and type(items) is not list:
        raise Invalid(_array_expected(cls), describe(items))
    if len(items) > len(specs):
        raise Invalid(_array_expected(cls), f"{len(items)} values: {describe(items)}")
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


def _missing(cls: type[Struct], name: str) -> Invalid:
    rule = next(s.rule for s in _SPECS[cls] if s.name == name)
    err = Invalid(f"{rule.expected} (required field)", "nothing: field is missing")
    err.path.append("." + name)
    return err


def _unknown(cls: type[Struct], d: dict[Any, Any]) -> Invalid:
    known = {s.name for s in _SPECS[cls]}
    unknown = next(k for k in d if k not in known)
    err = Invalid(
        f"no such field; {cls.__name__} has: {', '.join(sorted(known)) or '(no fields)'}",
        f"unknown field with value {describe(d[unknown])}",
    )
    label = unknown if isinstance(unknown, str) else repr(unknown)
    if len(label) > 40:  # the name came from the peer: keep the error message short
        label = label[:37] + "..."
    err.path.append("." + label)
    return err


# --------------------------------------------------------------------------- base classes


_C = TypeVar("_C", bound=type)
_S = TypeVar("_S", bound="Struct")


class _StructMeta(msgspec.StructMeta):
    """Metaclass of every struct. Calling a struct class validates its arguments
    (msgspec's __init__ would store anything); decoding does not come through here,
    msgspec builds those instances itself. A class that defines ``_check`` gets it as
    msgspec's ``__post_init__``, so the cross-field rules run on both paths."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> Any:
        if "_check" in ns and any(isinstance(base, _StructMeta) for base in bases):
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
    if not any(_holds_structs(hints[s.name]) or s.rule.has_any for s in specs):
        # (An `Any` value may nest deeper than _plain looks: such structs take the
        # reference, which checks and copies it.)
        _FLAT_DECODERS[cls] = _DECODERS.get(cls) or msgspec.msgpack.Decoder(cls)
    return cls


def _holds_structs(tp: Any) -> bool:
    """Whether a field annotation can hold a struct (a Struct) anywhere inside."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return True
    return any(_holds_structs(arg) for arg in typing.get_args(tp))


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def declare_struct(cls: _C) -> _C:
    """Make a validated struct: a frozen, keyword-only msgspec Struct whose field
    annotations are compiled into validation rules right away."""
    return _declare(cls, is_message=False)


@typing.dataclass_transform(kw_only_default=True, frozen_default=True)
def declare_message(cls: _C) -> _C:
    """A struct that may travel alone: registered under its class name (the type in its frame)."""
    cls = _declare(cls, is_message=True)
    assert issubclass(cls, Message), cls
    name = cls.__name__
    assert name not in _REGISTRY, f"duplicate message type {name}"
    assert _TYPE_NAME_RE.match(name.encode("ascii")) and len(name) <= MAX_TYPE_NAME_BYTES
    _REGISTRY[name] = cls
    return cls


class Struct(
    msgspec.Struct,
    metaclass=_StructMeta,
    frozen=True,
    kw_only=True,
    array_like=True,  # a nested struct travels as the array of its field values
    forbid_unknown_fields=True,  # ... and not one value more
    # Not tracked by the cycle collector: cheaper to allocate (a decoded StageTask is ~370
    # objects, ~12% faster) and never scanned. Structs cannot form cycles: they are
    # frozen trees of plain values, and Any values are copied and bounded in depth.
    gc=False,
):
    """Base of every struct: frozen, keyword-only, validated on construction."""

    def _check(self) -> None:
        """Cross-field rules; raise Invalid with the offending field's path."""


class Message(Struct, array_like=False):
    """Base of every message type (a Struct that travels alone, as a map of its fields;
    see MESSAGE_TYPES)."""


def replace(struct: _S, **changes: Any) -> _S:
    """A copy of `struct` with some fields changed, validated like a new struct (the
    counterpart of dataclasses.replace)."""
    values = {name: getattr(struct, name) for name in struct.__struct_fields__}
    values.update(changes)
    return type(struct)(**values)


def invalid_field(field_name: str, expected: str, seen: str) -> Invalid:
    """The error a cross-field rule (``_check``) raises: ``field_name`` (a dotted path
    inside the struct) should have been ``expected``; ``seen`` is :func:`describe` of
    what it holds."""
    err = Invalid(expected, seen)
    err.path.append("." + field_name)
    return err


# --------------------------------------------------------------------------- the codec's interface


def is_type_name(name: bytes) -> bool:
    """Whether ``name`` has the form of a message type name: ASCII
    ``[A-Za-z][A-Za-z0-9_]*`` (its length is the codec's to check)."""
    return _TYPE_NAME_RE.match(name) is not None


def encode_struct(struct: Struct) -> bytes:
    """The msgpack form of ``struct``: a message as the map of its fields, a struct as
    the array of its field values. Raises whatever msgspec raises on a value it cannot
    write (the codec words the error)."""
    return _ENCODER.encode(struct)


def decode_compiled(cls: type[Message], body: memoryview) -> Message:
    """The fast path: a message body read by msgspec's compiled decoder, its ``Any``
    values held to the reference's rules. Raises (any exception) where the body is not
    valid; :func:`message_from_fields` then decides, and words the error."""
    msg = _DECODERS[cls].decode(body)
    _recheck_any(cls, msg)
    return msg  # type: ignore[no-any-return]


def message_from_fields(cls: type[Message], fields: dict[Any, Any]) -> Message:
    """The reference path: a message from the map of its fields as msgpack unpacked them,
    every value checked by the reference validator. Raises ProtocolError naming the
    message type, the field path, what was expected and what was seen."""
    type_name = cls.__name__
    try:
        return _struct_from_map(cls, fields)  # type: ignore[return-value]
    except Invalid as e:
        raise e.to_error(type_name) from None
    except RecursionError:
        raise ProtocolError(
            f"invalid {type_name}: nested too deeply", message_type=type_name
        ) from None
