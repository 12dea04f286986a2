"""Receiving with a brief spin: how the daemons' I/O loops wait for the next message.

A blocking ``poll`` puts the thread to sleep, and waking it costs a context switch per
hop: on a small VM about 20 us for each of the two processes' receiving threads, a
third of a message's round trip (benchmarks/ipc.py). Messages come in bursts: a
TaskDone is followed by the next StageTask, a request by its reply. So a loop that has
just handled a message first polls without blocking for ``ROUNDPIPE_RECV_SPIN_US``
(default 200 us) and only then sleeps in ``poll(timeout)``. An idle loop pays the spin
once per timeout (0.2% of a core at a 100 ms timeout); 0 turns spinning off. Each
check is followed by ``sched_yield``: the peer that will send the next message may be
waiting for this very core (2-core machines), and a spin that never yields kept it off
for the whole spin (~300 us round trips in about a third of benchmark runs).
"""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from roundpipe.shared.defaults import env_non_negative

__all__ = ["RECV_SPIN_S", "poll_spinning"]

RECV_SPIN_S: float = (
    env_non_negative("ROUNDPIPE_RECV_SPIN_US", 200, "microseconds", "turns spinning off") / 1e6
)
"""How long :func:`poll_spinning` polls without blocking before it sleeps."""


def poll_spinning(
    poller: zmq.Poller | zmq.Socket[Any], timeout_ms: int, spin_s: float = RECV_SPIN_S
) -> Any:
    """``poller.poll(timeout_ms)`` (a Poller of ZeroMQ sockets, or one socket: POLLIN),
    after checking for up to `spin_s` seconds without blocking. Returns what ``poll``
    returns."""
    if spin_s > 0:
        # Reading ZMQ_EVENTS is the cheapest non-blocking check (it also processes the
        # socket's pending commands); Socket.poll(0) would build a Poller per call.
        sockets = [s for s, _ in poller.sockets] if isinstance(poller, zmq.Poller) else [poller]
        deadline = time.perf_counter() + spin_s
        while not any(s.get(zmq.EVENTS) & zmq.POLLIN for s in sockets):
            if time.perf_counter() >= deadline:
                break
            os.sched_yield()
    return poller.poll(timeout_ms)
