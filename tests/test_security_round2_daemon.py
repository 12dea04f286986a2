"""Security, round two (issue 33), items 2 and 10, played against real coordinators.

- A forged ``Hello`` naming one of the coordinator's own helper processes (the spec
  checker, multiprocessing's resource tracker) made the coordinator SIGKILL it once the
  "worker" went silent: every later submission then failed until a restart. Only the
  kernel's word (the pid at the other end of an ipc:// connection) proves a worker's
  process now, and the coordinator's own children are never candidates
  (Note [no fencing by hearsay] in coordinator/service/workers.py).
- A spec checker that died anyway (the OOM killer) is replaced for the next submission.
- ``--max-jobs-per-owner``: an owner's queued and running jobs are bounded; resumes
  count; admins see and cancel everyone's jobs.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from runtime_helpers import fake_hello, tiny_spec

from roundpipe.client import JobRejected, RoundPipeError
from roundpipe.cluster import LocalCluster, cpu_cluster
from roundpipe.coordinator.service.admission import SpecValidator
from roundpipe.coordinator.service.auth import Peer
from roundpipe.coordinator.service.workers import provable_worker_process
from roundpipe.protocol import ErrorReply, SubmitJob, Welcome, decode, encode

WORKER_TIMEOUT_S = 2


def _children(cluster: LocalCluster) -> list[psutil.Process]:
    procs = psutil.Process(cluster.coordinator.proc.pid).children(recursive=True)
    for p in procs:
        p.create_time()  # cached: is_running() then compares it (a reused pid is not it)
    return procs


def _exiting(pid: int) -> bool:
    """Whether child ``pid`` has not exited yet (WNOWAIT: it is left to be reaped)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False  # reaped already


def _wait(predicate, what: str, cluster: LocalCluster, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}\n{cluster.logs()}"
        time.sleep(0.05)


def _check_a_bad_spec(cluster: LocalCluster) -> None:
    """Submit a spec the coordinator's checker refuses (the client would refuse it
    first): answered only once the checking child has run."""
    sock = cluster.dealer("admin")
    try:
        sock.send_multipart(encode(SubmitJob(spec={"model": {}})))
        assert sock.poll(60_000), cluster.logs()
        reply = decode(sock.recv_multipart())
        assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
    finally:
        sock.close()


# --------------------------------------------------------------------------- item 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    with cpu_cluster(
        tmp_path_factory.mktemp("round2"),
        "round2",
        ["--worker-timeout", str(WORKER_TIMEOUT_S), "--max-jobs-per-owner", "2"],
    ) as c:
        for name, role in (("rogue", "worker"), ("alice", "client"), ("bob", "client")):
            c.add_key(name, role)
        yield c


def test_forged_hello_naming_the_coordinators_helpers_kills_none(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A worker key's holder sends Hellos naming each child of the coordinator (spec
    checker, resource tracker) and goes silent. Each fake worker is dropped, none of the
    processes is signalled, and the next submission is checked as before."""
    _check_a_bad_spec(cluster)  # the spec checker has run
    helpers = _children(cluster)
    assert helpers, f"the spec checker should be a child of the coordinator\n{cluster.logs()}"
    socks = []
    try:
        for proc in helpers:
            sock = cluster.dealer("rogue")
            hello = fake_hello(
                worker_name=f"claims-{proc.pid}",
                hostname=socket.gethostname(),
                pid=proc.pid,
                process_create_time=proc.create_time(),
                device="cpu",
                device_index=None,
                compute_capability=None,
            )
            sock.send_multipart(encode(hello))
            assert sock.poll(30_000), cluster.logs()
            assert isinstance(decode(sock.recv_multipart()), Welcome)
            socks.append(sock)
    finally:
        for sock in socks:  # silent from now on: lost after the worker timeout
            sock.close()
    names = {f"claims-{p.pid}" for p in helpers}
    _wait(
        lambda: not names & {w.name for w in cluster.client.workers()},
        "the silent fake workers were never declared lost",
        cluster,
    )
    _wait(
        lambda: cluster.coordinator.tail(400_000).count("dropped, not killed") >= len(helpers),
        "the fake workers were not dropped",
        cluster,
    )
    assert "fenced worker process" not in cluster.coordinator.tail(400_000), cluster.logs()
    assert [p.pid for p in helpers if not p.is_running()] == []
    # The spec checker still works: a real submission is checked and accepted.
    handle = cluster.client.submit(tiny_spec(tmp_path / "out", steps=2))
    cluster.client.cancel(handle.job_id)
    assert handle.wait(timeout_s=60).state == "cancelled"


def test_a_killed_spec_checker_is_replaced_for_the_next_submission(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The spec-checking child dies between submissions (the OOM killer, an operator's
    kill): the next SubmitJob and ResumeJob are checked by a new one, not refused with
    BrokenProcessPool until a restart."""
    _check_a_bad_spec(cluster)  # the spec checker is running
    for round_ in range(2):
        checkers = [
            p for p in _children(cluster) if "resource_tracker" not in " ".join(p.cmdline())
        ]
        assert checkers, cluster.logs()
        for proc in checkers:
            proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(checkers, timeout=30)
        handle = cluster.client.submit(tiny_spec(tmp_path / f"out{round_}", steps=2))
        cluster.client.cancel(handle.job_id)
        assert handle.wait(timeout_s=60).state == "cancelled"
    # A resume that needs its spec checked again (it was cancelled) after another kill.
    for proc in [p for p in _children(cluster) if "resource_tracker" not in " ".join(p.cmdline())]:
        proc.send_signal(signal.SIGKILL)
        psutil.wait_procs([proc], timeout=30)
    cluster.client.resume(handle.job_id)
    cluster.client.cancel(handle.job_id)
    assert handle.wait(timeout_s=60).state == "cancelled"


@pytest.fixture
def used_validator(tmp_path: Path) -> Iterator[tuple[SpecValidator, dict]]:
    """A SpecValidator that has checked a tiny spec once (so its pool has a child), and
    that spec; closed afterwards."""
    spec = tiny_spec(tmp_path / "out", steps=2).to_dict()
    validator = SpecValidator(timeout_s=120)
    try:
        assert validator.validate(spec)["train"]["steps"] == 2
        assert validator._pool is not None
        yield validator, spec
    finally:
        validator.close()


def test_spec_validator_replaces_a_dead_pool(
    used_validator: tuple[SpecValidator, dict],
) -> None:
    """The pool's child is killed while idle: the next validation gets a new child."""
    validator, spec = used_validator
    first = validator._pool
    pids = [p.pid for p in first._processes.values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # Until it has exited, without reaping it (that is for the pool or the validator).
    deadline = time.monotonic() + 30
    while any(_exiting(pid) for pid in pids):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert validator.validate(spec)["train"]["steps"] == 2
    assert validator._pool is not first


def test_sighup_to_the_spec_checker_leaves_it_working(
    used_validator: tuple[SpecValidator, dict],
) -> None:
    """`systemctl reload` may send SIGHUP to the coordinator's whole group: the spec
    checker ignores it (its default action would end the child)."""
    validator, spec = used_validator
    first = validator._pool
    children = [psutil.Process(p.pid) for p in first._processes.values()]
    for child in children:
        child.send_signal(signal.SIGHUP)
    # SIGHUP is delivered before the next request is read; one more round trip
    # through the same child proves it survived it.
    assert validator.validate(spec)["train"]["steps"] == 2
    assert validator._pool is first
    assert all(child.is_running() for child in children)


def test_only_the_kernels_word_proves_a_workers_process() -> None:
    """``Hello.pid`` is a claim: on tcp:// (no peer credentials) nothing is provable, not
    even a child of this process; on ipc:// the kernel's pid is, unless it is this process
    or one of its children (a coordinator's helpers)."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    try:
        claim = fake_hello(
            pid=child.pid, process_create_time=psutil.Process(child.pid).create_time()
        )
        assert provable_worker_process(claim, Peer("w", frozenset({"worker"}))) is None
        assert (
            provable_worker_process(claim, Peer("w", frozenset({"worker"}), pid=child.pid)) is None
        )
        me = fake_hello(pid=os.getpid(), process_create_time=psutil.Process().create_time())
        assert (
            provable_worker_process(me, Peer("w", frozenset({"worker"}), pid=os.getpid())) is None
        )
        # A process that is neither: the kernel's pid and the claim agree.
        parent = psutil.Process(os.getppid())
        other = fake_hello(pid=parent.pid, process_create_time=parent.create_time())
        proven = provable_worker_process(other, Peer("w", frozenset({"worker"}), pid=parent.pid))
        assert proven is not None and proven.pid == parent.pid
        # The kernel's pid, but a claimed start time that is not that process's.
        wrong = fake_hello(pid=parent.pid, process_create_time=parent.create_time() - 100)
        assert (
            provable_worker_process(wrong, Peer("w", frozenset({"worker"}), pid=parent.pid)) is None
        )
    finally:
        child.kill()
        child.wait()


def test_a_frozen_worker_on_ipc_is_still_fenced(cluster: LocalCluster) -> None:
    """The kernel's word still counts: a real worker on the ipc:// socket, frozen
    (SIGSTOP), is declared lost and SIGKILLed, so it can never wake up and write."""
    worker = cluster.add_worker("frozen")
    _wait(
        lambda: "frozen" in {w.name for w in cluster.client.workers()},
        "the worker did not join",
        cluster,
        timeout_s=120,
    )
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        assert worker.proc.wait(timeout=60) == -signal.SIGKILL, cluster.logs()
    finally:
        if worker.alive():
            worker.proc.kill()
            worker.proc.wait()
    assert "fenced worker process" in cluster.coordinator.tail(400_000)


# --------------------------------------------------------------------------- item 10


def test_jobs_per_owner_are_bounded_and_resumes_count(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """``--max-jobs-per-owner 2``: alice's third job is refused with her count, the limit
    and what to do; bob is not affected; an admin sees and cancels alice's jobs; a resume
    that would queue a third job of alice's is refused too."""
    alice = cluster.client_as("alice")
    bob = cluster.client_as("bob")
    try:
        # No worker: the first job waits "running" for one, the second is queued.
        a1 = alice.submit(tiny_spec(tmp_path / "a1", steps=2))
        a2 = alice.submit(tiny_spec(tmp_path / "a2", steps=2))
        with pytest.raises(JobRejected) as refused:
            alice.submit(tiny_spec(tmp_path / "a3", steps=2))
        message = str(refused.value)
        assert refused.value.code == "busy", message
        for part in ("alice", "2 jobs queued or running", "limit of 2", "wait", "roundpipe cancel"):
            assert part in message, message
        b1 = bob.submit(tiny_spec(tmp_path / "b1", steps=2))  # another owner's own count
        # The admin sees everyone's jobs and may cancel them.
        listed = {j.job_id for j in cluster.client.jobs()}
        assert {a1.job_id, a2.job_id, b1.job_id} <= listed
        assert {j.job_id for j in bob.jobs()} == {b1.job_id}
        cluster.client.cancel(a1.job_id)
        assert alice.job(a1.job_id).wait(timeout_s=60).state == "cancelled"
        a3 = alice.submit(tiny_spec(tmp_path / "a3", steps=2))  # room again
        with pytest.raises(RoundPipeError) as resume_refused:
            alice.resume(a1.job_id)  # would be her third
        assert resume_refused.value.code == "busy"
        assert "limit of 2" in str(resume_refused.value)
        for handle in (a2, a3, b1):
            cluster.client.cancel(handle.job_id)
        for handle in (a2, a3, b1):
            assert cluster.client.job(handle.job_id).wait(timeout_s=60).state == "cancelled"
        alice.resume(a1.job_id)  # room again: queued
        assert alice.status(a1.job_id).state in ("queued", "running")
        cluster.client.cancel(a1.job_id)
        assert alice.job(a1.job_id).wait(timeout_s=60).state == "cancelled"
    finally:
        alice.close()
        bob.close()
