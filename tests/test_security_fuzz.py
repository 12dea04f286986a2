"""Flood the coordinator with garbage, as authenticated and as unauthenticated peers
(issue 16): at least 100,000 frames per socket on a client socket, a worker socket, a
socket without a key, one with an unknown key, and a raw Unix socket that does not speak
ZMTP at all. The coordinator must stay up, answer a real client afterwards, keep its RSS
and file descriptors flat, and keep its log small (refusals are rate-limited).
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import psutil
import pytest
import zmq
from runtime_helpers import coordinator_only, fake_hello

from roundpipe.protocol import (
    CancelJob,
    GetJobStatus,
    GetProgress,
    Heartbeat,
    ListJobs,
    ListWorkers,
    ResumeJob,
    SubmitJob,
    TaskDone,
    TaskFailed,
    encode,
)
from roundpipe.shared.keys import apply_connect_keys, connect_keys, new_key_pair

pytestmark = pytest.mark.slow

FRAMES_PER_SOCKET = 100_000
SEED = int(os.environ.get("RP_FUZZ_SEED", "1616"))


def _mutations(rng: random.Random, valid: list[bytes], count: int) -> list[list[bytes]]:
    """Valid frames, and frames with flipped, cut, extended or random bytes, and
    messages of several frames."""
    out: list[list[bytes]] = []
    for _ in range(count):
        frame = bytearray(rng.choice(valid))
        kind = rng.randrange(7)
        if kind == 0:
            pass  # valid as it is
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        elif kind == 2:
            frame = frame[: rng.randrange(len(frame))]
        elif kind == 3:
            frame += rng.randbytes(rng.randint(1, 64))
        elif kind == 4:
            frame = bytearray(rng.randbytes(rng.randint(0, 128)))
        elif kind == 5:
            frame[2:4] = rng.randrange(65536).to_bytes(2, "big")  # another version
        if kind == 6:
            out.append([bytes(frame), rng.randbytes(rng.randint(0, 16))])
        else:
            out.append([bytes(frame)])
    return out


def _client_pool(rng: random.Random) -> list[list[bytes]]:
    def job_id() -> str:
        return "job-" + rng.randbytes(4).hex()

    valid = [
        encode(ListJobs(start=rng.randrange(100))),
        encode(ListWorkers()),
        encode(ListWorkers(after=rng.randrange(100))),
        encode(GetJobStatus(job_id=job_id())),
        encode(GetProgress(job_id=job_id(), after_seq=rng.randrange(10))),
        encode(CancelJob(job_id=job_id())),
        encode(ResumeJob(job_id=job_id())),
        encode(SubmitJob(spec={"model": {"path": "/nonexistent"}})),
    ]
    return _mutations(rng, [f for m in valid for f in m], 2000)


def _worker_pool(rng: random.Random) -> list[list[bytes]]:
    def some_task() -> dict:
        """Which task a report is about: a random one of job-x's, from a random worker."""
        return dict(
            job_id="job-x", task_id=rng.randrange(1000), attempt=0, worker_id=rng.randrange(5)
        )

    valid = [
        encode(Heartbeat(sender="fuzz", seq=rng.randrange(1000), sent_at=time.time())),
        encode(TaskDone(**some_task(), seconds=0.0, layer_times={})),
        encode(
            TaskFailed(**some_task(), error_type="E", message="m", traceback="", retryable=False)
        ),
        # Refused as implausible (1 byte): the fuzzer never becomes a worker that tasks
        # would be sent to.
        encode(fake_hello(worker_name="fuzz", memory_bytes=1)),
    ]
    return _mutations(rng, [f for m in valid for f in m], 2000)


def _flood(sock: zmq.Socket, pool: list[list[bytes]], count: int, *, block: bool) -> int:
    """Send ``count`` messages from ``pool`` without waiting for replies; return how many
    the socket took (a socket that never completes its handshake takes only its HWM)."""
    sent = 0
    flags = 0 if block else zmq.NOBLOCK
    for i in range(count):
        try:
            sock.send_multipart(pool[i % len(pool)], flags=flags, copy=True)
            sent += 1
        except zmq.Again:
            pass
    return sent


def _zmtp_frame(body: bytes) -> bytes:
    return bytes([0, len(body)]) + body if len(body) < 256 else b""


# ZMTP 3.0 greeting of a NULL-mechanism peer: what a peer without a key says first.
_NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
_READY = bytes([4, 26]) + b"\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"


def _raw_frames(path: str, rng: random.Random, frames: int) -> int:
    """Frames over raw Unix connections, 1,000 per connection: half start as a ZMTP peer
    without a key would (greeting, READY, then frames), half are bytes that are not ZMTP
    at all. The coordinator hangs up on both; each connection starts over."""
    bodies = [rng.randbytes(rng.randint(1, 64)) for _ in range(1000)]
    junk = b"".join(bodies)
    zmtp = _NULL_GREETING + _READY + b"".join(_zmtp_frame(b) for b in bodies)
    sent = 0
    while sent < frames:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.settimeout(5)
            s.connect(path)
            s.sendall(zmtp if (sent // 1000) % 2 else junk)
        except OSError:
            pass  # the coordinator hung up part way
        finally:
            s.close()
        sent += len(bodies)
    return sent


def _usage(pid: int) -> tuple[int, int]:
    proc = psutil.Process(pid)
    return proc.memory_info().rss, proc.num_fds()


def test_flood_of_frames_from_every_kind_of_peer(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"fuzz seed {SEED} (set RP_FUZZ_SEED to replay)")
    with coordinator_only(tmp_path / "c", "fuzz") as cluster:
        cluster.add_key("fuzz-client", "client")
        cluster.add_key("fuzz-worker", "worker")
        pid = cluster.coordinator.proc.pid
        client_pool, worker_pool = _client_pool(rng), _worker_pool(rng)
        authenticated = {
            "client": (cluster.dealer("fuzz-client"), client_pool),
            "worker": (cluster.dealer("fuzz-worker"), worker_pool),
        }
        stranger_keys = connect_keys(
            new_key_pair(tmp_path, "stranger"), cluster.keys_dir / "coordinator.key"
        )
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.RECONNECT_IVL, 1)  # hammer the handshake
        apply_connect_keys(stranger, stranger_keys)
        stranger.connect(cluster.address)
        no_key = zmq.Context.instance().socket(zmq.DEALER)
        no_key.setsockopt(zmq.LINGER, 0)
        no_key.setsockopt(zmq.RECONNECT_IVL, 1)
        no_key.connect(cluster.address)
        try:
            # Warm up (first replies, logs, caches), then take the baseline.
            for sock, pool in authenticated.values():
                _flood(sock, pool, 10_000, block=True)
            cluster.client.workers()
            time.sleep(1)
            rss0, fds0 = _usage(pid)
            started = time.monotonic()
            counts = {
                name: _flood(sock, pool, FRAMES_PER_SOCKET, block=True)
                for name, (sock, pool) in authenticated.items()
            }
            counts["unknown key"] = _flood(stranger, client_pool, FRAMES_PER_SOCKET, block=False)
            counts["no key"] = _flood(no_key, worker_pool, FRAMES_PER_SOCKET, block=False)
            counts["raw, no key"] = _raw_frames(
                cluster.address[len("ipc://") :], rng, FRAMES_PER_SOCKET
            )
            # The coordinator has read everything once it answers a request sent after it.
            assert isinstance(cluster.client.jobs(), list)
            took = time.monotonic() - started
        finally:
            for sock, _ in authenticated.values():
                sock.close()
            stranger.close()
            no_key.close()
        # Closed connections are released as the coordinator's I/O thread gets to them:
        # wait for it (a leak never comes down, so the bound below still catches one).
        deadline = time.monotonic() + 30
        while _usage(pid)[1] > fds0 + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.coordinator.alive(), cluster.logs()
        assert cluster.client.workers() == []  # no fuzzer became a worker
        assert cluster.client.jobs() == []  # nor submitted a job
        rss1, fds1 = _usage(pid)
        log_bytes = cluster.coordinator.log_path.stat().st_size
        print(
            f"sent {counts} in {took:.1f}s; coordinator RSS {rss0 / 2**20:.1f} -> "
            f"{rss1 / 2**20:.1f} MiB, fds {fds0} -> {fds1}, log {log_bytes} bytes"
        )
        assert counts["client"] == counts["worker"] == FRAMES_PER_SOCKET
        assert counts["raw, no key"] >= FRAMES_PER_SOCKET
        assert rss1 - rss0 < 32 * 2**20, "coordinator memory grew under the flood"
        assert fds1 <= fds0 + 2, "coordinator leaked file descriptors"
        assert log_bytes < 256 * 1024, "refusals were not rate-limited"
