"""shared/polling.py: the daemons' I/O loops receive with a brief non-blocking spin."""

from __future__ import annotations

import threading
import time

import zmq
from runtime_helpers import assert_import_fails

from roundpipe.protocol import Heartbeat, decode, encode
from roundpipe.shared.polling import poll_spinning


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    return a, b


def test_a_message_sent_during_the_spin_is_received() -> None:
    ctx = zmq.Context()
    a, b = _pair(ctx)
    poller = zmq.Poller()
    poller.register(a, zmq.POLLIN)
    beat = Heartbeat(sender="w", seq=1, sent_at=0.0)
    try:
        sender = threading.Timer(0.002, lambda: b.send_multipart(encode(beat)))
        sender.start()
        start = time.monotonic()
        # A spin long enough that the message comes within it however late the sender
        # thread runs; it returns when the message is there, not at the spin's end.
        ready = poll_spinning(poller, 5000, spin_s=30)
        assert time.monotonic() - start < 30
        assert ready == [(a, zmq.POLLIN)]
        assert decode(a.recv_multipart()) == beat
        sender.join()
        # One socket works as well as a Poller.
        b.send_multipart(encode(beat))
        assert poll_spinning(a, 5000, spin_s=0.5) & zmq.POLLIN
        assert decode(a.recv_multipart()) == beat
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_nothing_to_receive_spins_then_blocks_until_the_timeout() -> None:
    ctx = zmq.Context()
    a, b = _pair(ctx)
    poller = zmq.Poller()
    poller.register(a, zmq.POLLIN)
    try:
        start = time.monotonic()
        assert poll_spinning(poller, 50, spin_s=0.01) == []
        assert time.monotonic() - start >= 0.05  # spin, then the blocking poll's timeout
        assert poll_spinning(poller, 10, spin_s=0) == []  # 0: no spin at all
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_bad_spin_setting_is_a_clear_error() -> None:
    assert_import_fails(
        "roundpipe.shared.polling",
        {"ROUNDPIPE_RECV_SPIN_US": "-3"},
        "ROUNDPIPE_RECV_SPIN_US must be >= 0, got '-3'",
    )
