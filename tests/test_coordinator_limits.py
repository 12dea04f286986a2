"""Nothing a peer sends can crash or stall the coordinator (docs/deploy.md).

Each test plays one of the routes that used to end the coordinator's I/O loop (an
oversized reply, encoded outside any error handler) against a real coordinator process
over its real socket, then checks the coordinator still answers.
"""

from __future__ import annotations

import ctypes
import json
import os
import sqlite3
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from coordinator_helpers import serving
from runtime_helpers import coordinator_only, fake_hello

from roundpipe.client import Client
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.service.daemon import Coordinator
from roundpipe.coordinator.service.inbound import DEFAULT_FRAME_LIMIT, frame_limit
from roundpipe.coordinator.service.jobs import MAX_TEXT_CHARS, JobRecord
from roundpipe.coordinator.service.jobstore import JobStore
from roundpipe.coordinator.service.workers import MAX_NAME_CHARS
from roundpipe.coordinator.spec.errors import MAX_LISTED_PROBLEMS
from roundpipe.coordinator.spec.jobspec import MAX_SPEC_BYTES
from roundpipe.coordinator.training.progress_log import ProgressLog
from roundpipe.protocol import (
    MAX_REPLY_BYTES,
    ErrorReply,
    GetJobStatus,
    Hello,
    ListWorkers,
    Message,
    ProgressEvent,
    SubmitJob,
    TaskFailed,
    Welcome,
    WorkerList,
    decode,
    encode,
)
from roundpipe.shared.keys import apply_connect_keys

CLI = [sys.executable, "-m", "roundpipe.cli"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    with coordinator_only(tmp_path_factory.mktemp("limits"), "limits") as c:
        yield c


def _ask(
    cluster: LocalCluster, frames: list[bytes], timeout_ms: int = 30_000, as_: str = "admin"
) -> Message | None:
    sock = cluster.dealer(as_)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return decode(sock.recv_multipart())
    finally:
        sock.close()


def _alive(cluster: LocalCluster) -> None:
    assert cluster.coordinator.alive(), cluster.logs()
    cluster.client.workers()  # answers


def test_spec_with_many_unknown_keys_gets_a_bounded_error(cluster: LocalCluster) -> None:
    # ~0.9 MB of unknown keys: the full error text would be ~12 MB.
    spec = {"model": {f"k{i:06d}": 0 for i in range(90_000)}}
    reply = _ask(cluster, encode(SubmitJob(spec=spec)))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
    assert len(reply.message) <= MAX_TEXT_CHARS + 200
    assert f"and {90_000 + 2 - MAX_LISTED_PROBLEMS} more problems not shown" in reply.message
    _alive(cluster)


def test_spec_over_the_size_limit_is_refused_unread(cluster: LocalCluster) -> None:
    spec = {"model": {"path": "x" * (2 * MAX_SPEC_BYTES)}}
    reply = _ask(cluster, encode(SubmitJob(spec=spec)))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
    assert "more than the limit" in reply.message and len(reply.message) < 500
    _alive(cluster)


def test_frame_over_the_socket_limit_is_dropped_before_it_is_read(cluster: LocalCluster) -> None:
    # ZMQ_MAXMSGSIZE: libzmq closes the connection instead of buffering 40 MiB; without
    # it the coordinator read the whole frame and answered a protocol_error.
    frame = encode(SubmitJob(spec={}))[0] + b"\0" * (40 * 2**20)
    assert _ask(cluster, [frame], timeout_ms=3000) is None
    _alive(cluster)


def test_a_hello_too_large_to_keep_is_refused_unread(cluster: LocalCluster) -> None:
    """A Hello is kept for as long as its worker stays connected: 20 of 15 MiB each
    once held 350 MiB of the coordinator's memory."""
    hello = fake_hello(
        worker_name="huge-" + "n" * 4_000_000,
        device="cpu",
        device_index=None,
        device_name="d",
        memory_bytes=2**34,
        compute_capability=None,
    )
    reply = _ask(cluster, encode(hello), as_="worker")
    assert isinstance(reply, ErrorReply) and reply.code == "protocol_error", reply
    limit = frame_limit(Hello)
    assert f"refused unread: Hello of {len(encode(hello)[0])} bytes" in reply.message, reply
    assert f"over the limit of {limit}" in reply.message
    assert not [w for w in cluster.client.workers() if w.name.startswith("huge")]
    _alive(cluster)


def test_a_message_of_many_frames_is_refused_without_keeping_them(cluster: LocalCluster) -> None:
    frames = encode(GetJobStatus(job_id="x")) * 20_000
    reply = _ask(cluster, frames)
    assert isinstance(reply, ErrorReply) and reply.code == "protocol_error", reply
    assert "a message has 1 frame, this one 20000" in reply.message, reply
    _alive(cluster)


def test_any_type_over_its_limit_is_refused_unread(cluster: LocalCluster) -> None:
    """Decoding is the cost (a 16 MiB body of a type holding ``Any`` took 3 s of the I/O
    thread): past its type's limit a frame is answered from its header alone."""
    frame = encode(GetJobStatus(job_id="x" * (DEFAULT_FRAME_LIMIT + 10)))[0]
    reply = _ask(cluster, [frame])
    assert isinstance(reply, ErrorReply) and reply.code == "protocol_error", reply
    assert f"GetJobStatus of {len(frame)} bytes is over the limit of" in reply.message
    # A worker's failure report may be larger, up to what its cut texts make.
    assert frame_limit(TaskFailed) > DEFAULT_FRAME_LIMIT
    _alive(cluster)


def test_claimed_routing_ids_cannot_abort_the_coordinator(cluster: LocalCluster) -> None:
    """libzmq's ROUTER aborts the process when its next automatic routing id (b"\\0" +
    a counter started from rand()) is one a peer claimed; unseeded, rand() starts the
    same in every process, so a client claiming the next ids killed the coordinator as
    soon as another peer connected. The claims here are those ids: the first values
    of an unseeded rand() as libzmq forms them."""
    libc = ctypes.CDLL(None)
    libc.srand(1)  # glibc's sequence when nobody seeds it
    draws = [libc.rand() for _ in range(8)]
    starts = [(draws[i] | (draws[i + 1] << 31)) & 0xFFFFFFFF for i in range(0, 8, 2)]
    claimers = []
    try:
        for start in starts:
            for k in range(10):
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, b"\0" + struct.pack(">I", (start + k) & 0xFFFFFFFF))
                apply_connect_keys(sock, cluster._keys("admin"))
                sock.connect(cluster.address)
                claimers.append(sock)
                sock.send_multipart(encode(GetJobStatus(job_id="x")))
        for sock in claimers:  # answered: each claim is registered
            assert sock.poll(30_000), cluster.logs()
            sock.recv_multipart()
        for _ in range(20):  # honest peers, whose ids the ROUTER makes
            reply = _ask(cluster, encode(ListWorkers()))
            assert isinstance(reply, WorkerList), (reply, cluster.logs())
    finally:
        for sock in claimers:
            sock.close()
    _alive(cluster)


def test_fake_hellos_with_long_names_then_list_workers(cluster: LocalCluster) -> None:
    socks = []
    try:
        for i in range(2):
            hello = fake_hello(
                worker_name=f"fake{i}-" + "n" * 5_000,
                device="cpu",
                device_index=None,
                device_name="d" * 5_000,
                memory_bytes=2**34,
                compute_capability=None,
            )
            sock = cluster.dealer("worker")
            socks.append(sock)
            sock.send_multipart(encode(hello))
            assert sock.poll(30_000) and isinstance(decode(sock.recv_multipart()), Welcome)
        # Both are listed (within their heartbeat timeout), with their names cut.
        workers = cluster.client.workers()
        fakes = [w for w in workers if w.name.startswith("fake")]
        assert len(fakes) == 2, workers
        assert all(len(w.name) <= MAX_NAME_CHARS + 100 for w in fakes)
        assert all(len(w.device_name) <= MAX_NAME_CHARS + 100 for w in fakes)
        reply = _ask(cluster, encode(ListWorkers()))
        assert isinstance(reply, WorkerList)
    finally:
        for sock in socks:
            sock.close()
    _alive(cluster)


def _store_with_history(state_dir: Path, count: int, path_chars: int) -> list[str]:
    """A job store holding ``count`` finished jobs whose output paths are long, written
    in one transaction (through JobStore, one fsync per job would take minutes)."""
    JobStore.in_state_dir(state_dir).close()  # creates the schema
    now = time.time()
    ids = [f"job-old-{i:06d}" for i in range(count)]
    rows = [
        (
            job_id,
            '{"model": {"path": "/gone"}}',
            "succeeded",
            "model written",
            "/out/" + "p" * path_chars + f"/{job_id}",
            3,
            3,
            1.5,
            3,
            now,
            now,
            "F[0:2] T[2:4] B[0:2]",
        )
        for job_id in ids
    ]
    db = sqlite3.connect(state_dir / JobStore.FILENAME)
    with db:
        db.executemany(
            "INSERT INTO jobs (job_id, spec, state, message, output_dir, step, total_steps, "
            "loss, checkpoint_step, created_at, updated_at, plan) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    db.close()
    return ids


def test_long_job_history_is_listed_page_by_page(tmp_path: Path, arena_dir: Path) -> None:
    """~4,800 jobs with 3.5 KB output paths made a 17 MB JobList: `roundpipe jobs`
    killed the (restarted) coordinator on every call."""
    root = tmp_path / "c"
    (root / "state").mkdir(parents=True)
    ids = _store_with_history(root / "state", 5_000, 3_500)
    cluster = LocalCluster(root, arena_dir)
    try:
        result = subprocess.run(
            [*CLI, "jobs", "--json", "--address", cluster.address],
            env={**os.environ, **cluster.key_env("admin")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:] + cluster.logs()
        listed = json.loads(result.stdout)
        assert [j["job_id"] for j in listed] == ids
        assert all(j["step"] == 3 and j["state"] == "succeeded" for j in listed)
        # The client walked several pages, each within the reply budget.
        assert len(ids) * 3_500 > 3 * MAX_REPLY_BYTES
        _alive(cluster)
    finally:
        cluster.stop()


def test_a_finished_jobs_history_costs_the_coordinator_under_64_bytes_a_step() -> None:
    """Note [compact progress history]: a coordinator keeps every finished job's
    history until it restarts; as ProgressEvent objects that was ~260 bytes a step
    (1 GB after 4 million steps trained). Read back, the events are the ones appended."""
    steps = 100_000
    tracemalloc.start()
    try:
        log = ProgressLog()
        for k in range(1, steps + 1):
            log.append(
                ProgressEvent(seq=k, step=k, loss=1.0 / k, tokens_per_s=1e6, lr=3e-4, time=k + 0.5)
            )
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 64 * steps, f"{held / steps:.0f} bytes a step"
    assert len(log) == steps and log.last_loss == 1.0 / steps
    page, more = log.page(after_seq=41_999, limit=3)
    assert [(e.seq, e.step, e.loss, e.time) for e in page] == [
        (k, k, 1.0 / k, k + 0.5) for k in (42_000, 42_001, 42_002)
    ]
    assert more and log.page(after_seq=steps, limit=3) == ([], False)
    assert log.loss_at(77_777) == 1.0 / 77_777 and log.loss_at(steps + 1) is None
    cut = log.up_to(500)
    assert len(cut) == 500 and len(log) == steps
    assert cut.recent(1)[0].step == 500 and cut.table().shape == (500, 6)


def test_a_stored_history_reads_as_the_one_written(tmp_path: Path) -> None:
    """A finished run's history in its file (StoredProgress) pages, cuts and counts as
    the log it was written from; a file cut inside a row reads as its whole rows, a
    missing one as empty, and neither raises."""
    from roundpipe.coordinator.training.progress_log import StoredProgress

    steps = 100_000
    log = ProgressLog([k, 1.0 / k, 1e6, 3e-4, k + 0.5, 0.25] for k in range(1, steps + 1))
    stored = log.write(tmp_path / "progress.f64")
    assert isinstance(stored, StoredProgress)
    assert len(stored) == steps and (tmp_path / "progress.f64").stat().st_size == 48 * steps
    for after, limit in ((0, 3), (41_999, 5), (steps - 2, 10), (steps, 3), (-5, 2)):
        assert stored.page(after, limit) == log.page(after, limit)
    assert stored.up_to(500).events() == log.up_to(500).events()
    assert stored.up_to(0).events() == [] and len(stored.up_to(steps + 9)) == steps
    with open(tmp_path / "progress.f64", "r+b") as f:
        f.truncate(48 * 10 + 20)  # cut inside row 11
    assert len(stored) == 10 and stored.page(0, 100) == (log.page(0, 10)[0], False)
    (tmp_path / "progress.f64").unlink()
    assert len(stored) == 0 and stored.page(0, 5) == ([], False)
    assert stored.up_to(5).events() == []
    assert not list(tmp_path.iterdir())  # no temporary file left


def test_progress_of_a_long_job_comes_in_pages(tmp_path: Path, arena_dir: Path) -> None:
    """GetProgress on a job of 300,000 steps: a reply of ~15 MB before, one page now. The
    coordinator runs in this process (a real socket) so the test can hand it a history
    that would take hours to train."""
    address = f"ipc://{tmp_path}/c.sock"
    c = Coordinator(address, tmp_path / "state", arena_dir)
    c.bind()
    steps = 300_000
    job = JobRecord("job-long", None, state="succeeded", total_steps=steps, step=steps)
    job.progress = ProgressLog([k, 1.0 / k, 1e6, 3e-4, float(k), 0.0] for k in range(1, steps + 1))
    c.book.jobs[job.job_id] = job
    with serving(c), Client(address, timeout_s=30) as client:
        first = client.get_progress(job.job_id)
        assert 0 < len(first.events) < steps and not first.done
        assert len(encode(first)[0]) <= MAX_REPLY_BYTES
        seen = [e.step for e in client.job(job.job_id).progress(timeout_s=120)]
        assert seen == list(range(1, steps + 1))
        assert client.get_progress(job.job_id, after_seq=steps).done


def test_unknown_job_id_of_megabytes_gets_a_short_error(cluster: LocalCluster) -> None:
    reply = _ask(cluster, encode(GetJobStatus(job_id="j" * 200_000)))  # decoded
    assert isinstance(reply, ErrorReply) and reply.code == "unknown_job"
    assert len(reply.message) < 1000
    reply = _ask(cluster, encode(GetJobStatus(job_id="j" * 15_000_000)))  # refused unread
    assert isinstance(reply, ErrorReply) and reply.code == "protocol_error"
    assert len(reply.message) < 1000
    _alive(cluster)


def test_slow_spec_validation_never_starves_heartbeats(tmp_path: Path, arena_dir: Path) -> None:
    """A data file of blank lines takes seconds to validate. That ran on the I/O thread:
    no reply and no heartbeat read meanwhile, so both workers were declared lost and
    SIGKILLed. Now validation runs on the admission thread."""
    from runtime_helpers import tiny_spec

    data = tmp_path / "blank.jsonl"
    with open(data, "wb") as f:
        f.write(b"\n" * (40 * 2**20))
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["data"]["path"] = str(data)
    cluster = LocalCluster(tmp_path / "c", arena_dir, coordinator_args=["--worker-timeout", "2"])
    try:
        cluster.add_worker("w1")
        cluster.add_worker("w2")
        cluster.wait_for_workers(2)
        before = {w.worker_id for w in cluster.client.workers()}
        sock = cluster.dealer()
        try:
            started = time.monotonic()
            sock.send_multipart(encode(SubmitJob(spec=spec)))
            latencies = []
            while not sock.poll(0):
                asked = time.monotonic()
                assert {w.worker_id for w in cluster.client.workers()} == before
                latencies.append(time.monotonic() - asked)
                assert time.monotonic() - started < 120, cluster.logs()
                time.sleep(0.05)
            took = time.monotonic() - started
            reply = decode(sock.recv_multipart())
        finally:
            sock.close()
        assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
        assert "empty dataset" in reply.message
        latencies.sort()
        median = latencies[len(latencies) // 2]
        print(
            f"validation took {took:.1f}s; {len(latencies)} ListWorkers meanwhile, median "
            f"{median * 1e3:.1f} ms, slowest {latencies[-1] * 1e3:.0f} ms"
        )
        assert took > 2, "validation was too quick to show a stall; make the file larger"
        # Before: one request, answered when the validation ended (seconds later).
        assert len(latencies) >= 10 and median < 0.1
        assert all(w.alive() for w in cluster.workers.values()), cluster.logs()
        assert "lost" not in cluster.coordinator.tail(20_000)
    finally:
        cluster.stop()


def _fake_gpu_worker(cluster: LocalCluster, memory_bytes: int):
    hello = fake_hello(
        worker_name="small-gpu", device_name="a small GPU", memory_bytes=memory_bytes
    )
    sock = cluster.dealer("worker")
    sock.send_multipart(encode(hello))
    assert sock.poll(30_000) and isinstance(decode(sock.recv_multipart()), Welcome)
    return sock


def test_job_that_fits_no_connected_gpu_is_refused_at_submit(tmp_path: Path) -> None:
    """With GPU workers connected, a job no plan fits on them is refused at submit with
    the planner's figures, not accepted to fail when it starts."""
    from runtime_helpers import tiny_spec

    spec = tiny_spec(tmp_path / "out", seq_len=64).to_dict()
    # The fake workers send no heartbeats: keep them registered for the whole test.
    slow_loss = ["--worker-timeout", "600"]
    with coordinator_only(tmp_path / "c", "gpu-admission", slow_loss) as cluster:
        sock = _fake_gpu_worker(cluster, memory_bytes=2**30 + 4096)
        try:
            reply = _ask(cluster, encode(SubmitJob(spec=spec)))
            assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
            assert "cannot run on the connected GPU workers (1.0 GiB each)" in reply.message
            assert "does not fit one GPU" in reply.message, reply.message
            pinned = {**spec, "train": {**spec["train"], "plan": "F[0:3] T[3:6] B[0:3]"}}
            reply = _ask(cluster, encode(SubmitJob(spec=pinned)))
            assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
            assert "train.plan" in reply.message and "needs about" in reply.message
        finally:
            sock.close()
        sock = _fake_gpu_worker(cluster, memory_bytes=8 * 2**30)
        try:
            # A 8 GiB GPU connected too: the planner plans for the smallest, still refused.
            reply = _ask(cluster, encode(SubmitJob(spec=spec)))
            assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
        finally:
            sock.close()


def test_plan_that_does_not_match_the_model_is_refused_at_submit(cluster: LocalCluster) -> None:
    from runtime_helpers import tiny_spec

    spec = tiny_spec(cluster.root / "out", plan="F[0:2] T[2:4] B[0:2]").to_dict()
    reply = _ask(cluster, encode(SubmitJob(spec=spec)))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
    assert "train.plan" in reply.message and "last layer" in reply.message, reply.message


def test_spec_checker_child_exits_with_a_killed_coordinator(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A SIGKILLed coordinator cannot shut its spec-checking child down; the child
    notices it was orphaned and exits instead of living on."""
    import signal

    import psutil

    cluster = LocalCluster(tmp_path / "c", arena_dir)
    try:
        cluster.wait_for_workers(0)
        # A spec it refuses: answered only once the checking child has run.
        reply = _ask(cluster, encode(SubmitJob(spec={"model": {}})))
        assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
        children = psutil.Process(cluster.coordinator.proc.pid).children(recursive=True)
        assert children, "the spec checker should be a child of the coordinator"
        cluster.coordinator.proc.send_signal(signal.SIGKILL)
        cluster.coordinator.proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"still running after the coordinator died: {alive}"
    finally:
        cluster.stop()


def test_a_workers_failure_report_always_fits_the_coordinators_limit() -> None:
    """The worker cuts a failure's message (keeping its start) and traceback (keeping
    its end, where the error is) so that the TaskFailed is never refused unread."""
    from roundpipe.worker.daemon import _cut

    text = "\U0001f525" * 300_000  # 4 bytes a character in UTF-8: the worst case
    message, trace = _cut("start " + text, keep="start"), _cut(text + " end", keep="end")
    assert message.startswith("start ") and trace.endswith(" end")
    assert "characters left out" in message and "characters left out" in trace
    failed = TaskFailed(
        job_id="j" * 64,
        task_id=1,
        attempt=0,
        worker_id=0,
        error_type="RuntimeError",
        message=message,
        traceback=trace,
        retryable=True,
    )
    assert len(encode(failed)[0]) <= frame_limit(TaskFailed)
    assert _cut("short", keep="end") == "short"
