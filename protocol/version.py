"""The protocol's version: one integer for the whole wire, and the rule for changing it.

Version rule
============

:data:`PROTOCOL_VERSION` is one integer for the whole protocol. Any change to any
message -- a field added, removed, renamed or retyped, a new message type, a changed
meaning, a changed limit that a valid sender could hit -- bumps it. Peers must match
exactly: there is no negotiation and no compatibility window, because coordinator and
workers are installed together from one package. The header layout (b"RP" + uint16)
never changes, so every version can read every other version's number.

A header with another version makes :func:`~roundpipe.protocol.codec.decode` raise
:class:`~roundpipe.protocol.schema.ProtocolVersionError` carrying ``seen_version``,
``expected_version`` and, when the type name is readable, the ``message_type``. The
handshake uses it: the coordinator answers a worker's mismatched ``Hello`` with a
``Reject(expected_version=...)`` encoded at the coordinator's own version; the worker
cannot read that body, but decoding it raises
``ProtocolVersionError(seen_version=<coordinator's>, message_type="Reject")``, which is
exactly what the worker must report before it exits.

tests/test_protocol_wire.py pins every message type, every field and sample frames at
this version: a change that fails it bumps the version and updates the test.
"""

from __future__ import annotations

__all__ = ["PROTOCOL_VERSION"]

PROTOCOL_VERSION: int = 15
"""Bump on any change to any message (see "Version rule" above)."""
