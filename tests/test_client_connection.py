"""What the client says when the connection, not the coordinator's answer, goes wrong.

A peer that closes every connection mid-handshake (a coordinator out of descriptors or
crashing, the wrong coordinator key, something that is not a coordinator) was reported
as "your key is not authorised"; a coordinator that died while checking a submission
left the client waiting 360 s, then saying it "is running". Real sockets throughout: a
raw TCP peer, an in-process coordinator with keys, a forked fake coordinator.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from coordinator_helpers import serving
from runtime_helpers import tiny_spec

from roundpipe import client as client_module
from roundpipe.client import Client, ConnectionLost, NotAuthorized
from roundpipe.coordinator.service.daemon import Coordinator
from roundpipe.protocol import WorkerList, decode, encode
from roundpipe.shared.keys import add_key, init_keys

DEADLINE_S = 60.0  # an upper bound only: each wait ends when the awaited thing happens


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    init_keys(keys)
    add_key(keys, "me", "client", out_dir=tmp_path / "me")
    return keys


@pytest.fixture
def closer() -> Iterator[int]:
    """A TCP port whose listener accepts every connection and closes it at once."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def test_a_peer_closing_mid_handshake_is_not_called_a_refusal(
    closer: int, keys_dir: Path, tmp_path: Path
) -> None:
    address = f"tcp://127.0.0.1:{closer}"
    with Client(address, timeout_s=DEADLINE_S) as keyless:
        with pytest.raises(NotAuthorized) as err:
            keyless.jobs()
    message = str(err.value)  # a keyed coordinator may close a keyless client so too
    assert "it needs a key" in message, message
    assert "closed the connection during the handshake 3 times" in message, message
    assert "out of file descriptors" in message
    keyed = Client(
        address,
        timeout_s=DEADLINE_S,
        key=tmp_path / "me" / "me.key_secret",
        coordinator_key=keys_dir / "coordinator.key",
    )
    with keyed, pytest.raises(NotAuthorized) as refused:
        keyed.jobs()
    message = str(refused.value)
    assert "closed the connection during the handshake" in message, message
    assert f"most likely {keys_dir / 'coordinator.key'} is not that coordinator" in message
    assert "not authorised" not in message


def test_the_wrong_coordinator_key_is_named(
    keys_dir: Path, tmp_path: Path, arena_dir: Path
) -> None:
    """The client holds another coordinator's public key: the coordinator cannot read
    its handshake and closes it without a word, time after time."""
    other = tmp_path / "other-keys"
    init_keys(other)
    c = Coordinator("tcp://127.0.0.1:*", tmp_path / "state", arena_dir, keys_dir=keys_dir)
    c.bind()
    c.address = c.router.getsockopt(zmq.LAST_ENDPOINT).decode()
    with serving(c):
        right = Client(
            c.address,
            timeout_s=DEADLINE_S,
            key=tmp_path / "me" / "me.key_secret",
            coordinator_key=keys_dir / "coordinator.key",
        )
        with right:
            assert right.jobs() == []
        wrong = Client(
            c.address,
            timeout_s=DEADLINE_S,
            key=tmp_path / "me" / "me.key_secret",
            coordinator_key=other / "coordinator.key",
        )
        with wrong, pytest.raises(NotAuthorized, match="most likely .*other-keys"):
            wrong.jobs()


def _answers_the_ping_then_dies(address: str) -> None:
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(address)
    identity = router.recv_multipart()[0]
    router.send_multipart([identity, *encode(WorkerList(workers=[]))])  # the ping
    frames = router.recv_multipart()
    assert type(decode(frames[1:])).__name__ == "SubmitJob"
    os._exit(0)  # as a crash: nothing closed, no answer


def test_a_coordinator_lost_during_a_submission_is_named_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submission's wait (SUBMIT_TIMEOUT_S, 360 s) is for a coordinator still
    checking specs; a dropped connection ends it at once with what happened."""
    monkeypatch.setattr(client_module, "SUBMIT_TIMEOUT_S", DEADLINE_S)
    address = f"ipc://{tmp_path}/c.sock"
    fake = multiprocessing.get_context("fork").Process(
        target=_answers_the_ping_then_dies, args=(address,)
    )
    fake.start()
    try:
        with Client(address, timeout_s=DEADLINE_S) as c:
            # Not StillChecking after SUBMIT_TIMEOUT_S: the drop ends the wait.
            with pytest.raises(ConnectionLost, match="dropped while it handled this request"):
                c.submit(tiny_spec(tmp_path / "out"))
    finally:
        fake.join(timeout=DEADLINE_S)
        if fake.is_alive():
            fake.kill()
    assert fake.exitcode == 0
