"""An ipc:// coordinator without keys: the socket's directory decides who may connect,
and the kernel's peer credentials who the peer is (docs/deploy.md, "Keys and access").

The coordinator runs in this process (as root, like the test); the other user is a
child process that imports what it needs and then drops to ``nobody`` before it
connects, so the kernel reports uid 65534 for its connection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator_helpers import serving

from roundpipe.client import Client
from roundpipe.coordinator.service.daemon import Coordinator
from roundpipe.coordinator.service.jobs import JobRecord

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")

NOBODY = 65534

_AS_NOBODY = textwrap.dedent(
    """
    import json, os, sys, time
    import zmq
    from roundpipe.client import Client, CoordinatorUnavailable, RoundPipeError
    from roundpipe.protocol import Hello, decode, encode

    address, job_id, groups = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    os.setgroups(groups)
    os.setgid(65534)
    os.setuid(65534)
    out = {"uid": os.getuid()}
    client = Client(address, timeout_s=3)
    try:
        out["jobs"] = [j.job_id for j in client.jobs()]
    except CoordinatorUnavailable:
        out["jobs"] = "unreachable"
        print(json.dumps(out))
        sys.exit(0)
    for name in ("status", "cancel", "resume"):
        try:
            getattr(client, name)(job_id)
            out[name] = "accepted"
        except RoundPipeError as exc:
            out[name] = exc.code
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart(encode(Hello(worker_name="x", hostname="h", pid=os.getpid(),
        process_create_time=0.0, device="cpu", device_index=None, device_name="cpu",
        memory_bytes=2**34, compute_capability=None)))
    out["hello"] = decode(sock.recv_multipart()).code if sock.poll(5000) else None
    print(json.dumps(out))
    """
)


@pytest.fixture
def coordinator(tmp_path: Path, arena_dir: Path) -> Iterator[Coordinator]:
    # Outside pytest's private (0700) temporary tree, so that only this directory's
    # mode decides: owner and group (root's group 0 here) may connect.
    sock_dir = Path(tempfile.mkdtemp(prefix="rp-ipc-", dir="/tmp"))
    os.chmod(sock_dir, 0o770)
    c = Coordinator(f"ipc://{sock_dir}/c.sock", tmp_path / "state", arena_dir)
    c.bind()
    job = JobRecord("job-of-root", None, state="paused", total_steps=3, owner="unix:root")
    c.book.jobs[job.job_id] = job
    try:
        with serving(c):
            yield c
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _as_nobody(c: Coordinator, groups: list[int]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, c.address, "job-of-root", json.dumps(groups)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_another_user_is_a_client_that_sees_only_its_own_jobs(coordinator: Coordinator) -> None:
    assert coordinator.auth is not None and coordinator.auth.mode == "peer-credentials"
    assert oct(os.stat(coordinator.address[len("ipc://") :]).st_mode & 0o777) == "0o660"
    seen = _as_nobody(coordinator, groups=[0])  # a member of the socket's group
    assert seen == {
        "uid": NOBODY,
        "jobs": [],
        "status": "unknown_job",
        "cancel": "unknown_job",
        "resume": "unknown_job",
        "hello": "forbidden",
    }
    # The coordinator's own user is admin: it sees the job, untouched.
    with Client(coordinator.address, timeout_s=10) as root:
        jobs = root.jobs()
    assert [(j.job_id, j.state) for j in jobs] == [("job-of-root", "paused")]


def test_a_user_outside_the_group_cannot_connect(coordinator: Coordinator) -> None:
    assert _as_nobody(coordinator, groups=[]) == {"uid": NOBODY, "jobs": "unreachable"}
