"""RoundPipe wire protocol: typed messages, one encode/decode path.

Six modules, read in this order:

- :mod:`roundpipe.protocol.version`: ``PROTOCOL_VERSION`` and the rule for changing it;
- :mod:`roundpipe.protocol.worker_messages`: the messages between the coordinator and
  its workers (handshake, jobs, stage tasks, liveness), one class each, catalogued in
  its docstring;
- :mod:`roundpipe.protocol.client_messages`: the messages between clients and the
  coordinator (requests, replies, error codes, job states);
- :mod:`roundpipe.protocol.structs`: the structs used inside messages (``TensorRef``,
  ``MicrobatchIO``, ...) and the dtype names;
- :mod:`roundpipe.protocol.codec`: frames (header, type name, msgpack body), limits and
  errors, ``encode`` / ``decode``;
- :mod:`roundpipe.protocol.schema`: the struct machinery (``Struct``, ``Message``,
  validation rules derived from the field annotations, ``ProtocolError``).

This package re-exports their public API; import from ``roundpipe.protocol``.
"""

from roundpipe.protocol import (
    client_messages,
    codec,
    schema,
    structs,
    version,
    worker_messages,
)
from roundpipe.protocol.client_messages import *  # noqa: F403
from roundpipe.protocol.codec import *  # noqa: F403
from roundpipe.protocol.schema import *  # noqa: F403
from roundpipe.protocol.structs import *  # noqa: F403
from roundpipe.protocol.version import *  # noqa: F403
from roundpipe.protocol.worker_messages import *  # noqa: F403

__all__ = [
    *schema.__all__,
    *version.__all__,
    *structs.__all__,
    *worker_messages.__all__,
    *client_messages.__all__,
    *codec.__all__,
]
