"""RoundPipe wire protocol: typed messages, one encode/decode path.

The wire format (frames, version rule, limits, every message type) is written down once,
in the docstring of :mod:`roundpipe.protocol.wire`; this package re-exports its public API.
"""

from roundpipe.protocol.wire import *  # noqa: F403 -- the public API is wire.__all__
from roundpipe.protocol.wire import __all__ as __all__
