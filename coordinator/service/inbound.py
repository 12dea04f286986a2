"""What a peer's message may be before the coordinator decodes it: the ROUTER's routing
ids, how its frames are read, and how large each type of message may be.

Note [inbound limits]
~~~~~~~~~~~~~~~~~~~~~
Authenticated peers are still untrusted: nothing one sends may crash or stall the I/O
loop, or make the coordinator hold memory it chose not to. Three limits apply to every
message on the ROUTER, before any of its body is read:

- **Routing ids.** A ROUTER names a peer that sets no ZMQ_ROUTING_ID with b"\\0" and a
  32-bit counter; a peer may also claim any id of its own, b"\\0"-prefixed ones included.
  libzmq (4.3.5, and its master) asserts, aborting the whole process, when the counter
  reaches an id a peer has claimed; and the counter starts from an unseeded rand(), the
  same value in every process. So a client key could kill the coordinator (and each
  restart) by claiming the next ids. :func:`unpredictable_routing_ids` seeds rand()
  from the OS before the ROUTER is made: a peer must then guess 32 bits, one guess per
  id it holds (at most the connection budget) for each connection made.
- **Frames.** A message is the routing id and NUM_FRAMES frames. :func:`receive` reads
  a frame at a time, keeps those and drops any further ones unread into Python, so a
  message of millions of frames costs no Python objects (libzmq still buffers a
  multipart message until its last frame: only the connection budget and ZMQ_MAXMSGSIZE
  per frame bound that).
- **Size per type.** Decoding is the costly part (a 16 MiB SubmitJob took 3 s of the I/O
  thread, its spec typed ``Any``), so each type has its own limit, read from the header
  alone (:func:`frame_limit`): a spec as large as a job spec may be, a worker's failure
  report with its traceback, a Hello small enough to keep one per connection, and
  256 KiB for everything else (each a few hundred bytes in practice). A larger frame is
  answered without being decoded.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
from dataclasses import dataclass

import zmq

from roundpipe.coordinator.spec.jobspec import MAX_SPEC_BYTES
from roundpipe.protocol import (
    NUM_FRAMES,
    Hello,
    Message,
    SubmitJob,
    TaskFailed,
)
from roundpipe.protocol.worker_messages import MAX_FAILURE_TEXT_CHARS

log = logging.getLogger("roundpipe.coordinator")

DEFAULT_FRAME_LIMIT = 256 * 1024
"""Largest frame of a message type not in FRAME_LIMITS."""

FRAME_LIMITS: dict[type[Message], int] = {
    # A spec file is at most MAX_SPEC_BYTES of text; as msgpack it is no larger.
    SubmitJob: MAX_SPEC_BYTES,
    # The message and the traceback, each cut by the worker, up to 4 bytes a character.
    TaskFailed: 2 * 4 * MAX_FAILURE_TEXT_CHARS + 64 * 1024,
    # Kept for as long as the worker is connected: names, not data.
    Hello: 16 * 1024,
}


def frame_limit(cls: type[Message] | None) -> int:
    """The largest frame the coordinator decodes as a ``cls`` (None: a header naming no
    known type, which decode then refuses by name)."""
    return FRAME_LIMITS.get(cls, DEFAULT_FRAME_LIMIT) if cls is not None else DEFAULT_FRAME_LIMIT


def unpredictable_routing_ids() -> None:
    """Seed libc's rand(), whence libzmq's ROUTER starts its routing-id counter, from
    the OS; call it before each ROUTER a peer can reach is made (Note [inbound
    limits])."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(secrets.randbits(32)))
    except (OSError, AttributeError) as exc:  # no libc symbols: say so, go on
        log.warning("[coordinator] cannot seed libzmq's routing ids (%s)", exc)


@dataclass
class Received:
    """One message read from the ROUTER."""

    identity: bytes
    frames: list[zmq.Frame]
    """At most NUM_FRAMES frames after the routing id."""
    dropped: int
    """Frames beyond those, read and dropped."""
    last: zmq.Frame
    """The last frame read (it carries the connection's User-Id like every frame)."""


def receive(router: zmq.Socket) -> Received:
    """Read one whole message from ``router`` a frame at a time (Note [inbound limits])."""
    first = router.recv(copy=False)
    frames: list[zmq.Frame] = []
    dropped = 0
    last = first
    while last.more:
        last = router.recv(copy=False)
        if len(frames) < NUM_FRAMES:
            frames.append(last)
        else:
            dropped += 1
    return Received(first.bytes, frames, dropped, last)
