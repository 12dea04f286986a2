"""Running an in-process Coordinator's serve loop for a test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from roundpipe.coordinator.service.daemon import Coordinator


@contextlib.contextmanager
def serving(c: Coordinator) -> Iterator[Coordinator]:
    """Serve the bound coordinator ``c`` in a thread; stop it and wait for the thread on
    the way out (it must end)."""
    server = threading.Thread(target=c.serve, daemon=True)
    server.start()
    try:
        yield c
    finally:
        c.stop()
        server.join(timeout=60)
    assert not server.is_alive()
