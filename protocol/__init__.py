"""RoundPipe wire protocol: typed messages, one encode/decode path.

Three modules, read in this order:

- :mod:`roundpipe.protocol.messages`: every message type, one class each, with the
  version rule (``PROTOCOL_VERSION``) and the catalogue in its docstring;
- :mod:`roundpipe.protocol.codec`: frames (header, type name, msgpack body), limits and
  errors, ``encode`` / ``decode``;
- :mod:`roundpipe.protocol.schema`: the record machinery (``Struct``, ``Message``,
  validation rules derived from the field annotations, ``ProtocolError``).

This package re-exports their public API; import from ``roundpipe.protocol``.
"""

from roundpipe.protocol import codec, messages, schema
from roundpipe.protocol.codec import *  # noqa: F403
from roundpipe.protocol.messages import *  # noqa: F403
from roundpipe.protocol.schema import *  # noqa: F403

__all__ = [*schema.__all__, *messages.__all__, *codec.__all__]
