"""The client API, the ``roundpipe`` CLI and ``roundpipe demo``, against a fake coordinator.

The fake speaks the real protocol over real ZeroMQ sockets (a ROUTER, as the coordinator
binds) and plays scripted jobs, chosen by the spec's ``train.seed``:

    seed 0    runs one step per poll (GetProgress / GetJobStatus), then succeeds
    seed 13   fails at step 2 ("worker demo-worker-1 lost: boom")
    seed 666  rejected on submit (ErrorReply bad_spec)
    seed 7    stays running forever
    seed 21   already finished when accepted (all events at once)

The same fake, started as processes (``python -c ... coordinator|worker ARGS``), stands
in for the real daemons to test the demo's process management; the end-to-end test with
real daemons lives elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

import roundpipe
from roundpipe import cli, progress
from roundpipe.client import (
    Client,
    CoordinatorUnavailable,
    JobHandle,
    JobRejected,
    RoundPipeError,
    StillChecking,
    UnknownJob,
)
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import load_job_spec
from roundpipe.demo import run_demo
from roundpipe.protocol import (
    Ack,
    CancelJob,
    ErrorReply,
    GetJobStatus,
    GetProgress,
    Heartbeat,
    JobAccepted,
    JobList,
    JobStatus,
    ListJobs,
    ListWorkers,
    Message,
    Progress,
    ProgressEvent,
    ResumeJob,
    SubmitJob,
    WorkerInfo,
    WorkerList,
    decode,
    encode,
)

TESTS_DIR = Path(__file__).parent

SEED_OK, SEED_FAIL, SEED_REJECT, SEED_STALL, SEED_INSTANT = 0, 13, 666, 7, 21


# --------------------------------------------------------------------------- the fake


class _FakeJob:
    def __init__(self, job_id: str, spec: dict[str, Any], log_dir: Path | None) -> None:
        self.job_id = job_id
        self.total = int(spec["train"]["steps"])
        self.seed = int(spec["train"]["seed"])
        self.lr = float(spec["optimizer"]["lr"])
        self.output_dir = spec["output"]["dir"] or f"/fake/output/{job_id}"
        self.state = "queued"
        self.message = "waiting for workers"
        self.step = 0
        self.events: list[ProgressEvent] = []
        self.log = None if log_dir is None else log_dir / "jobs" / job_id / "job.log"
        self._write_log(f"job {job_id} queued: {self.total} steps")
        if self.seed == SEED_INSTANT:
            while self.state not in ("succeeded", "failed"):
                self.tick()

    def _write_log(self, line: str) -> None:
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def tick(self) -> None:
        if (
            self.state in ("succeeded", "failed", "cancelled")
            or self.seed == SEED_STALL
            and (self.state == "running")
        ):
            return
        if self.state == "queued":
            self.state, self.message = "running", ""
            self._write_log("running")
            return
        self.step += 1
        loss = 6.0 - 0.5 * self.step
        self.events.append(
            ProgressEvent(
                seq=len(self.events) + 1,
                step=self.step,
                loss=loss,
                tokens_per_s=1536.0,
                lr=self.lr,
                time=time.time(),
                optimizer_s=0.042,
            )
        )
        self._write_log(f"step {self.step} loss {loss:.4f}")
        if self.seed == SEED_FAIL and self.step == 2:
            self.state, self.message = "failed", "worker demo-worker-1 lost: boom"
            self._write_log(f"failed: {self.message}")
        elif self.step >= self.total:
            self.state = "succeeded"
            self._write_log(f"succeeded; model written to {self.output_dir}")

    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            state=self.state,  # type: ignore[arg-type]
            step=self.step,
            total_steps=self.total,
            loss=self.events[-1].loss if self.events else None,
            message=self.message,
            output_dir=self.output_dir,
        )


def _sample_worker(
    worker_id: int,
    device: str,
    device_name: str,
    memory_gib: int,
    state: str,
    tasks_done: int = 0,
    **more: Any,
) -> WorkerInfo:
    """A worker as the fake coordinator lists it, named the way workers name themselves."""
    return WorkerInfo(
        worker_id=worker_id,
        name=f"rp-worker-{worker_id}",
        device=device,
        device_name=device_name,
        memory_bytes=memory_gib * 2**30,
        state=state,
        tasks_done=tasks_done,
        **more,
    )


class FakeCoordinator:
    """A thread with a ROUTER socket that answers the client API of the protocol."""

    def __init__(
        self,
        address: str,
        *,
        state_dir: Path | None = None,
        workers: list[WorkerInfo] | None = None,
        max_events: int = 1000,
    ) -> None:
        self.address = address
        self.state_dir = state_dir
        self.static_workers = (
            workers
            if workers is not None
            else [
                _sample_worker(
                    0,
                    "cuda",
                    "NVIDIA GeForce RTX 4090",
                    24,
                    "busy",
                    tasks_done=42,
                    h2d_bytes_per_s=24.1e9,
                    d2h_bytes_per_s=25.3e9,
                    current_task="step 12 B1 [0:2]",
                ),
                _sample_worker(1, "cpu", "cpu (16 cores)", 64, "idle"),
            ]
        )
        self.heartbeat_senders: dict[str, float] = {}
        self.max_events = max_events
        self.delay_next_s = 0.0
        self.late_reply_sent = threading.Event()  # set once a delayed reply went out
        self.server_keys: tuple[bytes, bytes] | None = None  # CURVE (public, secret)
        self.jobs: dict[str, _FakeJob] = {}
        self.requests: list[Message] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-coordinator", daemon=True)

    def start(self) -> FakeCoordinator:
        self._thread.start()
        assert self._ready.wait(5), "fake coordinator did not start"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def serve_until(self, stop: threading.Event | None = None) -> None:
        """Serve in the calling thread (the subprocess fake) until `stop` is set."""
        if stop is not None:
            self._stop = stop
        self._run()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.server_keys is not None:
            # A CURVE server with no ZAP handler: any client key completes the handshake
            # (the real coordinator checks keys; this fake only needs to speak CURVE).
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self.server_keys
        sock.bind(self.address)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                identity, *frames = sock.recv_multipart()
                request = decode(frames)
                reply = self.handle(request)
                late = self.delay_next_s > 0
                if late:  # a slow coordinator: the reply comes late
                    time.sleep(self.delay_next_s)
                    self.delay_next_s = 0.0
                if reply is not None:
                    sock.send_multipart([identity, *encode(reply)])
                if late:
                    self.late_reply_sent.set()
        finally:
            sock.close(linger=0)

    def handle(self, msg: Message) -> Message | None:
        if isinstance(msg, Heartbeat):  # a (fake) worker: no reply
            self.heartbeat_senders[msg.sender] = time.time()
            return None
        self.requests.append(msg)
        if isinstance(msg, SubmitJob):
            if msg.spec["train"]["seed"] == SEED_REJECT:
                return ErrorReply(code="bad_spec", message="data.path: the fake refuses this")
            job_id = f"job-{len(self.jobs) + 1:04d}"
            self.jobs[job_id] = _FakeJob(job_id, msg.spec, self.state_dir)
            return JobAccepted(job_id=job_id)
        if isinstance(msg, ListJobs):
            return JobList(jobs=[j.status() for j in self.jobs.values()])
        if isinstance(msg, ListWorkers):
            return WorkerList(workers=self.static_workers + self._heartbeat_workers())
        job = self.jobs.get(getattr(msg, "job_id", ""))
        if job is None:
            return ErrorReply(code="unknown_job", message="no such job")
        if isinstance(msg, GetJobStatus):
            job.tick()
            return job.status()
        if isinstance(msg, GetProgress):
            job.tick()
            events = [e for e in job.events if e.seq > msg.after_seq][: self.max_events]
            final = job.state in ("succeeded", "failed", "cancelled")
            return Progress(job_id=job.job_id, events=events, done=final)
        if isinstance(msg, CancelJob):
            if job.state in ("succeeded", "failed"):
                return ErrorReply(code="bad_state", message=f"job is already {job.state}")
            job.state, job.message = "cancelled", "cancelled by the user"
            return Ack()
        return ErrorReply(code="unexpected_message", message=f"unexpected {type(msg).__name__}")

    def _heartbeat_workers(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                worker_id=100 + i,
                name=name,
                device="cpu",
                device_name="",
                memory_bytes=2**30,
                state="idle",
                tasks_done=0,
            )
            for i, name in enumerate(sorted(self.heartbeat_senders))
        ]


# --------------------------------------------------------------------------- fixtures


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeCoordinator]:
    coordinator = FakeCoordinator(
        f"tcp://127.0.0.1:{_free_port()}", state_dir=tmp_path / "state"
    ).start()
    yield coordinator
    coordinator.stop()


@pytest.fixture
def client(fake: FakeCoordinator) -> Iterator[Client]:
    with Client(fake.address, timeout_s=5) as c:
        yield c


def _write_spec(tmp_path: Path, *, seed: int = SEED_OK, steps: int = 5, **extra: Any) -> Path:
    """A small valid spec that validates without transformers: a path model with only a
    config.json, token-id data."""
    model = tmp_path / "model"
    if not model.exists():
        model.mkdir()
        (model / "config.json").write_text(
            '{"model_type": "llama", "vocab_size": 100, "max_position_embeddings": 64}'
        )
        (tmp_path / "tokens.jsonl").write_text('{"input_ids": [1, 2, 3, 4, 5]}\n')
    raw: dict[str, Any] = {
        "model": {"path": "model"},
        "data": {"path": "tokens.jsonl", "seq_len": 16},
        "train": {"steps": steps, "seed": seed},
        "optimizer": {"lr": 3e-3},
    }
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / f"spec-{seed}-{steps}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# --------------------------------------------------------------------------- client


def test_package_exports_client_api() -> None:
    assert roundpipe.Client is Client
    assert roundpipe.JobHandle is JobHandle
    for name in ("RoundPipeError", "UnknownJob", "JobRejected", "CoordinatorUnavailable"):
        assert issubclass(getattr(roundpipe, name), RoundPipeError)
    assert roundpipe.JobSpecError is JobSpecError
    with pytest.raises(AttributeError):
        _ = roundpipe.NoSuchThing  # type: ignore[attr-defined]


def test_submit_progress_wait_success(client: Client, fake: FakeCoordinator, tmp_path: Path):
    handle = client.submit(_write_spec(tmp_path, steps=5))
    assert isinstance(handle, JobHandle)
    # A cheap request first (an absent coordinator is reported within the client's own
    # timeout), then the SubmitJob, which may take long to answer.
    ping, sent = fake.requests[:2]
    assert isinstance(ping, ListWorkers) and isinstance(sent, SubmitJob)
    # The validated spec travels with absolute paths.
    assert sent.spec["model"]["path"] == str(tmp_path / "model")
    assert sent.spec["train"]["steps"] == 5

    events = list(handle.progress(poll_s=0.01, timeout_s=10))
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [e.step for e in events] == [1, 2, 3, 4, 5]
    assert events[-1].loss == pytest.approx(3.5)

    status = handle.wait(timeout_s=5, poll_s=0.01)
    assert status.state == "succeeded"
    assert status.step == status.total_steps == 5
    assert status.output_dir == f"/fake/output/{handle.job_id}"
    assert handle.status() == status
    assert client.job(handle.job_id) == handle


def test_submit_accepts_jobspec_and_mapping(client: Client, fake: FakeCoordinator, tmp_path):
    path = _write_spec(tmp_path)
    spec = load_job_spec(path)
    h1 = client.submit(spec)
    h2 = client.submit(spec.to_dict())
    assert h1.job_id != h2.job_id
    assert [m.spec for m in fake.requests if isinstance(m, SubmitJob)] == [spec.to_dict()] * 2
    with pytest.raises(TypeError, match="spec must be"):
        client.submit(42)  # type: ignore[arg-type]


def test_invalid_spec_fails_before_sending(client: Client, fake: FakeCoordinator, tmp_path):
    path = _write_spec(tmp_path, optimizer={"lr": -1.0})
    with pytest.raises(JobSpecError, match="optimizer.lr"):
        client.submit(path)
    with pytest.raises(JobSpecError, match="unknown field"):
        client.submit({"model": {"path": str(tmp_path / "model")}, "bogus": 1})
    assert fake.requests == []


def test_rejected_spec_is_job_rejected(client: Client, tmp_path: Path) -> None:
    with pytest.raises(JobRejected) as info:
        client.submit(_write_spec(tmp_path, seed=SEED_REJECT))
    assert info.value.code == "bad_spec"
    assert info.value.message == "data.path: the fake refuses this"
    assert "the fake refuses this" in str(info.value)


def test_unknown_job(client: Client) -> None:
    handle = client.job("nope")  # no request yet
    with pytest.raises(UnknownJob, match="'nope'") as info:
        handle.status()
    assert info.value.job_id == "nope"
    assert info.value.code == "unknown_job"
    with pytest.raises(UnknownJob):
        next(handle.progress())
    with pytest.raises(UnknownJob):
        client.cancel("nope")
    with pytest.raises(ValueError):
        client.job("")


def test_failure_is_a_state_not_an_exception(client: Client, tmp_path: Path) -> None:
    handle = client.submit(_write_spec(tmp_path, seed=SEED_FAIL))
    events = list(handle.progress(poll_s=0.01, timeout_s=10))
    assert [e.step for e in events] == [1, 2]
    status = handle.wait(timeout_s=5)
    assert status.state == "failed"
    assert "boom" in status.message


def test_cancel(client: Client, tmp_path: Path) -> None:
    handle = client.submit(_write_spec(tmp_path, seed=SEED_STALL))
    handle.cancel()
    status = handle.wait(timeout_s=5, poll_s=0.01)
    assert status.state == "cancelled"
    assert list(handle.progress(poll_s=0.01, timeout_s=5)) == []
    with pytest.raises(RoundPipeError, match="already") as info:
        client.cancel(client.submit(_write_spec(tmp_path, seed=SEED_INSTANT)).job_id)
    assert info.value.code == "bad_state"
    assert not isinstance(info.value, UnknownJob)


def test_progress_and_wait_time_out_naming_the_job(client: Client, tmp_path: Path) -> None:
    handle = client.submit(_write_spec(tmp_path, seed=SEED_STALL))
    with pytest.raises(TimeoutError, match=handle.job_id):
        list(handle.progress(poll_s=0.02, timeout_s=0.3))
    with pytest.raises(TimeoutError, match=rf"{handle.job_id}.*state running"):
        handle.wait(timeout_s=0.3, poll_s=0.02)


def test_progress_drains_capped_replies(client: Client, fake: FakeCoordinator, tmp_path):
    fake.max_events = 2  # the job has ended; its 7 events come 2 per reply
    handle = client.submit(_write_spec(tmp_path, seed=SEED_INSTANT, steps=7))
    assert [e.seq for e in handle.progress(poll_s=0.01, timeout_s=5)] == list(range(1, 8))
    # Resuming after an event skips what was seen.
    assert [e.seq for e in handle.progress(after_seq=5, timeout_s=5)] == [6, 7]


def test_jobs_and_workers(client: Client, tmp_path: Path) -> None:
    assert client.jobs() == []
    a = client.submit(_write_spec(tmp_path))
    b = client.submit(_write_spec(tmp_path, seed=SEED_STALL))
    assert [j.job_id for j in client.jobs()] == [a.job_id, b.job_id]
    workers = client.workers()
    assert [w.name for w in workers] == ["rp-worker-0", "rp-worker-1"]
    assert workers[0].device == "cuda"


def test_timeout_raises_unavailable_then_recovers(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    with Client(address, timeout_s=0.3) as c:
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailable) as info:
            c.jobs()
        assert time.monotonic() - started < 3
        text = str(info.value)
        assert address in text
        assert "roundpipe-coordinator" in text
        assert info.value.address == address
        fake = FakeCoordinator(address).start()
        try:
            # The timed-out ListJobs was dropped with the old socket: this reply is the
            # WorkerList, not a stale JobList, and the fake saw only this request.
            assert len(c.workers()) == 2
            assert [type(m) for m in fake.requests] == [ListWorkers]
        finally:
            fake.stop()


@pytest.mark.parametrize("timeout_s", [1e9, float("inf")])
def test_a_very_long_timeout_waits_instead_of_overflowing(
    fake: FakeCoordinator, timeout_s: float
) -> None:
    """`--timeout 1e9` (or inf, no limit) overflowed the poll's C int of milliseconds:
    every request raised OverflowError."""
    with Client(fake.address, timeout_s=timeout_s) as c:
        assert len(c.workers()) == 2


def test_a_submission_still_being_checked_is_not_reported_as_a_dead_coordinator(
    fake: FakeCoordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator answers the ping but not yet the submission (it is tokenizing a
    large data file): the error says the job may yet be accepted, not "is it running?"
    (a user who believed that submitted the job twice)."""
    import roundpipe.client as client_module

    monkeypatch.setattr(client_module, "SUBMIT_TIMEOUT_S", 0.3)
    answer = fake.handle
    monkeypatch.setattr(fake, "handle", lambda m: None if isinstance(m, SubmitJob) else answer(m))
    with Client(fake.address, timeout_s=0.2) as c:
        with pytest.raises(StillChecking) as info:
            c.submit(_write_spec(tmp_path))
    assert isinstance(info.value, CoordinatorUnavailable)
    text = str(info.value)
    assert "is running" in text and "may yet be accepted" in text and "roundpipe jobs" in text
    assert "is it running?" not in text
    from roundpipe.shared.defaults import SPEC_CHECK_TIMEOUT_S, SUBMIT_TIMEOUT_S

    assert SUBMIT_TIMEOUT_S > SPEC_CHECK_TIMEOUT_S  # the real wait outlasts the check


def test_late_reply_is_never_taken_for_the_next_one(fake: FakeCoordinator) -> None:
    with Client(fake.address, timeout_s=0.2) as c:
        fake.delay_next_s = 0.5
        with pytest.raises(CoordinatorUnavailable):
            c.jobs()
        assert fake.late_reply_sent.wait(10)  # the JobList reply went to the old socket
        assert [w.name for w in c.workers()] == ["rp-worker-0", "rp-worker-1"]
        assert c.jobs() == []


def test_client_argument_errors(fake: FakeCoordinator) -> None:
    with pytest.raises(ValueError, match="invalid coordinator address"):
        Client("localhost:7420")
    with pytest.raises(ValueError, match="timeout_s"):
        Client(fake.address, timeout_s=0)
    c = Client(fake.address)
    assert fake.address in repr(c)
    c.close()
    c.close()  # idempotent
    with pytest.raises(RoundPipeError, match="closed"):
        c.jobs()


def test_default_address_and_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from roundpipe.shared import defaults

    monkeypatch.delenv("ROUNDPIPE_ADDRESS", raising=False)
    assert defaults.default_address() == "tcp://127.0.0.1:7420"
    monkeypatch.setenv("ROUNDPIPE_ADDRESS", "ipc:///tmp/x.sock")
    assert defaults.default_address() == "ipc:///tmp/x.sock"
    assert Client(timeout_s=1).address == "ipc:///tmp/x.sock"

    monkeypatch.setenv("ROUNDPIPE_STATE_DIR", str(tmp_path / "s"))
    assert defaults.default_state_dir() == tmp_path / "s"
    monkeypatch.delenv("ROUNDPIPE_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert defaults.default_state_dir() == tmp_path / "xdg" / "roundpipe"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert defaults.default_state_dir() == tmp_path / "home" / ".local" / "state" / "roundpipe"
    assert defaults.CLIENT_TIMEOUT_S == 10


# --------------------------------------------------------------------------- CLI


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err


def test_cli_submit_prints_job_id(capsys, fake: FakeCoordinator, tmp_path: Path) -> None:
    rc, out, err = _run(capsys, "submit", str(_write_spec(tmp_path)), "--address", fake.address)
    assert rc == 0, err
    assert out.strip() == "job-0001"
    assert list(fake.jobs) == ["job-0001"]


def test_cli_submit_wait_success(capsys, fake: FakeCoordinator, tmp_path: Path) -> None:
    spec = _write_spec(tmp_path, steps=30)
    rc, out, err = _run(capsys, "submit", str(spec), "--wait", "--address", fake.address)
    assert rc == 0, err
    assert out.strip() == "job-0001"  # stdout holds the id only; progress is on stderr
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    # Not a terminal: one line every ~3 steps (about ten per job), first and last included.
    assert lines[0].startswith(
        "step 1/30 | loss 5.5000 | 1.5k tok/s | lr 3.00e-03 | optim 42 ms | ETA "
    )
    assert lines[-1].startswith("step 30/30 ")
    assert 8 <= len(lines) <= 12
    assert "\r" not in err
    assert "job job-0001 succeeded (30/30 steps, loss 5.5000 -> -9.0000)" in err
    assert "model written to /fake/output/job-0001" in err


def test_cli_submit_wait_failure(capsys, fake: FakeCoordinator, tmp_path: Path) -> None:
    spec = _write_spec(tmp_path, seed=SEED_FAIL)
    rc, out, err = _run(capsys, "submit", str(spec), "--wait", "--address", fake.address)
    assert rc == 1
    assert out.strip() == "job-0001"
    assert "job job-0001 failed at 2/5 steps: worker demo-worker-1 lost: boom" in err
    _no_traceback(err)


def test_cli_submit_bad_spec_exit_2(capsys, fake: FakeCoordinator, tmp_path: Path) -> None:
    spec = _write_spec(tmp_path, optimizer={"learning_rate": 1e-3, "lr": 0})
    rc, out, err = _run(capsys, "submit", str(spec), "--address", fake.address)
    assert rc == 2
    assert out == ""
    assert "optimizer.learning_rate: unknown field (did you mean 'lr'?)" in err
    assert "optimizer.lr" in err
    assert str(spec) in err
    _no_traceback(err)

    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    rc, _, err = _run(capsys, "submit", str(broken), "--address", fake.address)
    assert rc == 2
    assert "not valid YAML" in err

    rc, _, err = _run(capsys, "submit", str(tmp_path / "missing.yaml"), "--address", fake.address)
    assert rc == 2
    assert "cannot read job spec file" in err
    assert fake.requests == []  # nothing was sent

    rc, _, err = _run(
        capsys, "submit", str(_write_spec(tmp_path, seed=SEED_REJECT)), "--address", fake.address
    )
    assert rc == 2
    assert "rejected the job: data.path: the fake refuses this" in err


def test_cli_status(capsys, fake: FakeCoordinator, client: Client, tmp_path: Path) -> None:
    handle = client.submit(_write_spec(tmp_path, seed=SEED_FAIL))
    handle.wait(timeout_s=5, poll_s=0.01)
    rc, out, err = _run(capsys, "status", handle.job_id, "--address", fake.address)
    assert rc == 0, err
    assert "state:   failed" in out
    assert "step:    2/5" in out
    assert "loss:    5.0000" in out
    assert "message: worker demo-worker-1 lost: boom" in out

    rc, out, _ = _run(capsys, "status", handle.job_id, "--json", "--address", fake.address)
    assert rc == 0
    assert '"state": "failed"' in out

    rc, out, err = _run(capsys, "status", "job-9999", "--address", fake.address)
    assert rc == 1
    assert out == ""
    assert err.startswith("roundpipe: error: unknown job 'job-9999'")
    assert len(err.strip().splitlines()) == 1


def test_cli_jobs_table(capsys, fake: FakeCoordinator, client: Client, tmp_path: Path) -> None:
    rc, out, _ = _run(capsys, "jobs", "--address", fake.address)
    assert (rc, out.strip()) == (0, "no jobs")
    ok = client.submit(_write_spec(tmp_path))
    ok.wait(timeout_s=5, poll_s=0.01)
    bad = client.submit(_write_spec(tmp_path, seed=SEED_FAIL))
    bad.wait(timeout_s=5, poll_s=0.01)
    rc, out, _ = _run(capsys, "jobs", "--address", fake.address)
    assert rc == 0
    header, row1, row2 = out.strip().splitlines()
    assert header.split() == ["JOB", "STATE", "STEP", "LOSS", "OUTPUT", "/", "MESSAGE"]
    assert row1.split() == ["job-0001", "succeeded", "5/5", "3.5000", "/fake/output/job-0001"]
    assert row2.split()[:4] == ["job-0002", "failed", "2/5", "5.0000"]
    assert row2.endswith("worker demo-worker-1 lost: boom")
    assert header.index("STATE") == row1.index("succeeded")  # columns line up


def test_cli_workers_table(capsys, fake: FakeCoordinator) -> None:
    rc, out, _ = _run(capsys, "workers", "--address", fake.address)
    assert rc == 0
    header, row0, row1 = out.strip().splitlines()
    assert header.split() == (
        ["ID", "NAME", "DEVICE", "MEMORY", "CAP", "H2D", "/", "D2H", "STATE", "TASKS"]
        + ["CURRENT", "TASK"]
    )
    assert "rp-worker-0" in row0
    assert "cuda (NVIDIA GeForce RTX 4090)" in row0
    assert "24.0 GiB" in row0
    assert "  24.1 / 25.3 GB/s  " in row0
    assert row0.split()[-6:] == ["busy", "42", "step", "12", "B1", "[0:2]"]
    assert header.index("CURRENT TASK") == row0.index("step 12")  # columns line up
    assert row1.split()[-3:] == ["idle", "0", "-"]
    assert "  cpu (16 cores)  " in row1
    fake.static_workers = []
    rc, out, _ = _run(capsys, "workers", "--address", fake.address)
    assert rc == 0 and out.startswith("no workers")


def test_cli_cancel(capsys, fake: FakeCoordinator, client: Client, tmp_path: Path) -> None:
    handle = client.submit(_write_spec(tmp_path, seed=SEED_STALL))
    rc, out, _ = _run(capsys, "cancel", handle.job_id, "--address", fake.address)
    assert rc == 0
    assert handle.job_id in out
    assert handle.status().state == "cancelled"
    rc, _, err = _run(capsys, "cancel", "job-9999", "--address", fake.address)
    assert rc == 1
    assert "unknown job 'job-9999'" in err


def test_cli_logs(capsys, fake: FakeCoordinator, client: Client, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    handle = client.submit(_write_spec(tmp_path, steps=3))
    handle.wait(timeout_s=5, poll_s=0.01)
    rc, out, _ = _run(capsys, "logs", handle.job_id, "--state-dir", state)
    assert rc == 0
    assert out.splitlines()[0] == "job job-0001 queued: 3 steps"
    assert "step 3 loss 4.5000" in out

    rc, out, err = _run(capsys, "logs", "job-9999", "--state-dir", state)
    assert rc == 1
    assert str(tmp_path / "state" / "jobs" / "job-9999" / "job.log") in err
    rc, _, err = _run(capsys, "logs", "../etc", "--state-dir", state)
    assert rc == 2
    assert "invalid job id" in err


def test_cli_logs_follow(capsys, fake: FakeCoordinator, client: Client, tmp_path: Path) -> None:
    # --follow asks the coordinator for the state: the fake advances one step per
    # request, so the job finishes while being followed, and the whole log is printed.
    handle = client.submit(_write_spec(tmp_path, steps=4))
    argv = ["logs", handle.job_id, "--follow", "--poll", "0.01", "--address", fake.address]
    rc, out, err = _run(capsys, *argv, "--state-dir", str(tmp_path / "state"))
    assert rc == 0, err
    assert out.splitlines()[-1] == "succeeded; model written to /fake/output/job-0001"


def test_cli_unreachable_coordinator(capsys) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    rc, out, err = _run(capsys, "jobs", "--address", address, "--timeout", "0.2")
    assert rc == 1
    assert out == ""
    assert err.startswith(f"roundpipe: error: no reply from the RoundPipe coordinator at {address}")
    assert len(err.strip().splitlines()) == 1


def test_cli_usage_errors(capsys, tmp_path: Path) -> None:
    assert (
        _run(
            capsys,
        )[0]
        == 2
    )
    rc, _, err = _run(capsys, "jobs", "--address", "nonsense")
    assert rc == 2
    assert "invalid coordinator address 'nonsense'" in err
    assert _run(capsys, "status")[0] == 2  # missing JOB
    assert _run(capsys, "demo", "--workers", "0")[0] == 2
    # An --output that is a file is the option's problem, not the shipped spec's.
    afile = tmp_path / "afile"
    afile.touch()
    rc, _, err = _run(capsys, "demo", "--output", str(afile), "--steps", "1")
    assert rc == 2 and f"--output: '{afile}' exists and is not a directory" in err, err
    assert "demo_job.yaml" not in err, err
    rc, _, err = _run(capsys, "demo", "--output", "~nosuchuser-rp/x", "--steps", "1")
    assert rc == 2 and "--output ~nosuchuser-rp/x" in err and "Traceback" not in err, err
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0 and "submit" in out


def _event(step: int, t: float) -> ProgressEvent:
    return ProgressEvent(seq=step, step=step, loss=2.0, tokens_per_s=2.5e6, lr=1e-4, time=t)


def test_progress_printer_tty_and_eta() -> None:
    stream = io.StringIO()
    printer = progress.ProgressPrinter(stream, 10, tty=True)
    for step in (1, 2, 3):
        printer.update(_event(step, 100.0 + 2 * step))
    printer.finish()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    last = text.split("\r")[-1]
    assert last.startswith("[######..............] step 3/10 | loss 2.0000 | 2.50M tok/s")
    assert "ETA 0:14" in last  # 2 s per step, 7 steps left
    assert progress.format_duration(3725) == "1:02:05"
    assert progress.format_duration(None) == "--:--"
    assert progress.format_duration(math.nan) == "--:--"


def test_the_eta_after_a_resume_counts_no_pause() -> None:
    """`resume --wait` replays the steps before the checkpoint with their old times, and
    the resumed run goes on an hour later: the pace spanned the pause, and the ETA read
    about two days for 15 minutes left. A step re-done after the resume (step went
    back) starts the pace afresh too; a slow step in a run (a checkpoint's) does not."""
    for replayed in (100, 2):  # a checkpoint at step 2 replays two steps only
        printer = progress.ProgressPrinter(io.StringIO(), 1000, tty=True, started_at=3000.0)
        for step in range(1, replayed + 1):
            printer.update(_event(step, float(step)))  # 1 s per step, before watching
        live = [replayed + 1, replayed + 2, replayed + 3]
        for step in live:
            printer.update(_event(step, 3600.0 + step))
            assert printer.eta_s() in (None, pytest.approx(1000 - step))
        assert printer.eta_s() == pytest.approx(1000 - live[-1])
    printer.update(_event(3, 9000.0))  # back from step 5
    printer.update(_event(4, 9002.0))
    assert printer.eta_s() == pytest.approx(2 * 996)
    printer.update(_event(5, 9100.0))  # a checkpoint's step: part of the pace
    assert printer.eta_s() == pytest.approx(50 * 995)


def test_progress_printer_plain_every_n() -> None:
    stream = io.StringIO()
    printer = progress.ProgressPrinter(stream, 100, tty=False)
    for step in range(1, 101):
        printer.update(_event(step, float(step)))
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]


# --------------------------------------------------------------------------- demo

_BOOT = (
    f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); "
    "import test_client_cli as t; t.fake_daemon_main()"
)


def fake_daemon_main() -> None:
    """Entry point of the fake daemons that the demo tests start as processes:
    ``python -c BOOT coordinator|worker|crash ARGS`` with the real daemons' arguments."""
    import argparse

    role, *args = sys.argv[1:]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads")  # the demo sizes CPU threads for both daemons
    if role == "coordinator":
        for flag in ("--address", "--state-dir", "--arena-dir", "--log-level", "--keys-dir"):
            parser.add_argument(flag, required=True)
        for flag in ("--allow-read", "--allow-write"):  # the job's paths
            parser.add_argument(flag, action="append", required=True)
        ns = parser.parse_args(args)
        arena = Path(ns.arena_dir) / "rp-fake-arena-0"
        arena.write_bytes(b"\0" * 4096)
        fake = FakeCoordinator(ns.address, state_dir=Path(ns.state_dir), workers=[])
        from roundpipe.shared.keys import coordinator_key_pair

        fake.server_keys = coordinator_key_pair(Path(ns.keys_dir))
        print(f"roundpipe-coordinator ready on {ns.address}", file=sys.stderr, flush=True)
        fake.serve_until(stop)
        if not os.environ.get("FAKE_LEAVE_ARENA"):
            arena.unlink()
        print("coordinator stopped", file=sys.stderr, flush=True)
    elif role == "worker":
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument("--cpu", action="store_true")
        group.add_argument("--gpu", type=int)
        for flag in ("--coordinator", "--name", "--log-level"):
            parser.add_argument(flag, required=True)
        ns = parser.parse_args(args)
        from roundpipe.shared.keys import apply_connect_keys, connect_keys

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        apply_connect_keys(sock, connect_keys())  # ROUNDPIPE_KEY from the demo
        sock.connect(ns.coordinator)
        seq = 0
        while not stop.wait(0.1):
            sock.send_multipart(encode(Heartbeat(sender=ns.name, seq=seq, sent_at=time.time())))
            seq += 1
        sock.close()
    else:
        print("worker: cannot open device: fake crash", file=sys.stderr, flush=True)
        sys.exit(3)


def _demo_cmd(role: str) -> list[str]:
    return [sys.executable, "-c", _BOOT, role]


def _demo(tmp_path: Path, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options: dict[str, Any] = {
        "num_workers": 2,
        "cpu": True,
        "steps": 4,
        "output_dir": tmp_path / "demo-out",
        "spec_path": _write_spec(tmp_path, steps=40),
        "startup_timeout_s": 60,
        "timeout_s": 30,
        "coordinator_command": _demo_cmd("coordinator"),
        "worker_command": _demo_cmd("worker"),
        "stdout": out,
        "stderr": err,
    }
    options.update(kwargs)
    rc = run_demo(**options)
    return rc, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def _no_new_demo_dirs() -> Iterator[None]:
    """The demo removes its temporary and arena directories, whatever happens. The ones
    it made are recorded as it makes them: a listing of /tmp and /dev/shm also saw the
    directories of a real demo that another test process started meanwhile."""
    import tempfile

    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    tempfile.mkdtemp = recording
    try:
        yield
    finally:
        tempfile.mkdtemp = mkdtemp
    demo_dirs = [d for d in made if os.path.basename(d).startswith("roundpipe-demo")]
    assert demo_dirs  # the demo made them here
    assert [d for d in demo_dirs if os.path.exists(d)] == []


def test_demo_with_fake_daemons(tmp_path: Path) -> None:
    with _no_new_demo_dirs():
        rc, out, err = _demo(tmp_path)
    assert rc == 0, err
    assert "starting a coordinator at ipc://" in err
    assert "step 4/4" in err
    lines = out.splitlines()
    assert lines[0].startswith("demo job job-0001 succeeded: 4 steps in ")
    assert lines[1] == "loss: 5.5000 (step 1) -> 4.0000 (step 4)"
    assert lines[2] == f"model written to {tmp_path / 'demo-out'}"


def test_demo_reports_leftover_arenas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LEAVE_ARENA", "1")
    with _no_new_demo_dirs():
        rc, _, err = _demo(tmp_path, steps=1)
    assert rc == 1
    assert "left 1 arena file(s)" in err
    assert "rp-fake-arena-0" in err


def test_demo_worker_crash_shows_its_log(tmp_path: Path) -> None:
    with _no_new_demo_dirs():
        rc, out, err = _demo(tmp_path, worker_command=_demo_cmd("crash"))
    assert rc == 1
    assert out == ""
    # Both fake workers crash; whichever the demo sees first is reported (the other may
    # already have been stopped by the demo's cleanup).
    assert re.search(r"demo-worker-[01] \(exit status 3\)", err), err
    assert "stopped during startup" in err
    assert "cannot open device: fake crash" in err  # the tail of the worker's log


def test_demo_bad_overrides_exit_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    rc, _, err = _demo(tmp_path, output_dir=tmp_path / "file")
    assert rc == 2
    assert "--output: " in err and "is not a directory" in err, err


def test_cli_resume_of_a_job_whose_spec_is_now_refused_is_a_usage_error(
    capsys, fake: FakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 means "invalid job spec", from the client or as ``bad_spec`` from the
    coordinator (docs/client.md): resume's ``bad_spec`` exited 1."""
    answer = fake.handle
    refusal = ErrorReply(code="bad_spec", message="it cannot run again: data.path: gone")
    monkeypatch.setattr(
        fake, "handle", lambda m: refusal if isinstance(m, ResumeJob) else answer(m)
    )
    rc, _, err = _run(capsys, "resume", "job-0001", "--address", fake.address)
    assert rc == 2 and "data.path: gone" in err, err
    _no_traceback(err)


def test_watching_a_job_that_never_starts_keeps_to_one_time_limit() -> None:
    """watch_job's wait for a job to start and the progress after it share its
    ``timeout_s``: the progress got a whole ``timeout_s`` of its own (a demo job that
    never started failed after twice its limit)."""
    import types

    from roundpipe.progress import watch_job

    given = []

    def progress(poll_s=0.2, timeout_s=None, after_seq=0):
        given.append(timeout_s)
        raise TimeoutError("job j did not finish")
        yield  # a generator, as JobHandle.progress

    status = JobStatus(
        job_id="j", state="queued", step=0, total_steps=5, loss=None, message="", output_dir=None
    )
    handle = types.SimpleNamespace(job_id="j", status=lambda: status, progress=progress)
    with pytest.raises(TimeoutError):
        watch_job(handle, timeout_s=0.3, stream=io.StringIO())
    assert given == [0.0]
