"""The durable job store, alone and inside a coordinator that restarts (no processes)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import tiny_spec

from roundpipe.coordinator.service.auth import Peer
from roundpipe.coordinator.service.daemon import Coordinator
from roundpipe.coordinator.service.jobstore import JobStore, JobStoreError
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.protocol import (
    Ack,
    CancelJob,
    ErrorReply,
    JobAccepted,
    JobList,
    ListJobs,
    ResumeJob,
    SubmitJob,
)


def test_jobs_and_states_survive_reopening(tmp_path: Path) -> None:
    store = JobStore.in_state_dir(tmp_path)
    store.add("job-1", {"a": 1}, output_dir="/out/1", total_steps=10)
    store.add("job-2", {"b": [1, 2]}, total_steps=5)
    store.update("job-1", state="running", step=3, loss=2.5, checkpoint_step=2)
    store.update("job-2", state="failed", message="boom")
    with pytest.raises(ValueError):
        store.update("job-2", state="exploded")
    with pytest.raises(ValueError):
        store.update("job-2", spec="{}")
    with pytest.raises(JobStoreError):
        store.update("job-9", state="queued")
    with pytest.raises(JobStoreError):
        store.add("job-1", {})  # ids are unique
    store.close()

    store = JobStore.in_state_dir(tmp_path)
    jobs = store.all()
    assert [j.job_id for j in jobs] == ["job-1", "job-2"]
    one, two = jobs
    assert (one.state, one.step, one.loss, one.checkpoint_step) == ("running", 3, 2.5, 2)
    assert one.spec == {"a": 1} and one.output_dir == "/out/1" and one.total_steps == 10
    assert (two.state, two.message, two.spec) == ("failed", "boom", {"b": [1, 2]})
    assert store.recover() == ["job-1"]
    recovered = store.get("job-1")
    assert recovered.state == "queued" and "checkpoint step 2" in recovered.message
    assert store.get("job-2").state == "failed"
    assert store.get("nope") is None


def _schema_1_store(directory: Path, more_columns: str = "") -> sqlite3.Connection:
    """A job store as the first schema wrote it (``more_columns`` added to its table)."""
    db = sqlite3.connect(str(directory / JobStore.FILENAME))
    db.execute(
        "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL "
        "UNIQUE, spec TEXT NOT NULL, state TEXT NOT NULL, message TEXT NOT NULL DEFAULT '', "
        "output_dir TEXT, step INTEGER NOT NULL DEFAULT 0, total_steps INTEGER NOT NULL "
        "DEFAULT 0, loss REAL, checkpoint_step INTEGER, created_at REAL NOT NULL, "
        f"updated_at REAL NOT NULL{more_columns})"
    )
    return db


def test_schema_1_store_gains_the_plan_column(tmp_path: Path) -> None:
    """A store written before plans were stored opens, keeps its jobs and stores plans."""
    db = _schema_1_store(tmp_path)
    db.execute(
        "INSERT INTO jobs (job_id, spec, state, total_steps, created_at, updated_at) "
        "VALUES ('old-job', '{}', 'succeeded', 4, 1.0, 2.0)"
    )
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    store = JobStore.in_state_dir(tmp_path)
    old = store.get("old-job")
    assert (old.state, old.total_steps, old.plan) == ("succeeded", 4, None)
    store.add("new-job", {})
    store.update("new-job", plan="F[0:2] T[2:6] B[0:2]")
    store.close()
    store = JobStore.in_state_dir(tmp_path)
    assert store.get("new-job").plan == "F[0:2] T[2:6] B[0:2]"
    store.close()


def test_a_migration_stopped_part_way_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    """The migration is one transaction. Its second step fails here (the store already
    has an ``owner`` column): the first step (``plan``) must be undone and the version
    kept, as after a coordinator killed between the steps, which used to leave a store
    that no later start could open ("duplicate column name: plan")."""
    db = _schema_1_store(tmp_path, ", owner TEXT")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with pytest.raises(JobStoreError, match="duplicate column name: owner"):
        JobStore.in_state_dir(tmp_path)
    db = sqlite3.connect(str(tmp_path / JobStore.FILENAME))
    columns = [row[1] for row in db.execute("PRAGMA table_info(jobs)")]
    assert "plan" not in columns
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    db.execute("ALTER TABLE jobs DROP COLUMN owner")  # what was in the way, gone:
    db.commit()
    db.close()
    JobStore.in_state_dir(tmp_path).close()  # the migration runs whole


def test_damaged_or_newer_store_is_refused_clearly(tmp_path: Path) -> None:
    (tmp_path / JobStore.FILENAME).write_bytes(b"this is not a database" * 100)
    with pytest.raises(JobStoreError, match="move it aside"):
        JobStore.in_state_dir(tmp_path)
    newer = tmp_path / "newer"
    newer.mkdir()
    db = sqlite3.connect(newer / JobStore.FILENAME)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(JobStoreError, match="newer"):
        JobStore.in_state_dir(newer)


def test_a_store_that_cannot_be_written_is_not_called_damaged(tmp_path: Path) -> None:
    """A coordinator restarted on a state file system that cannot take a write (here
    its file-size limit; a full disk alike) says so and keeps the jobs: it blamed damage
    and advised moving the file aside, which drops every job, and a failing ROLLBACK
    hid the error ("cannot rollback - no transaction is active")."""
    store = JobStore.in_state_dir(tmp_path)
    store.add("job-1", {"a": 1}, total_steps=5)
    store.update("job-1", state="paused", step=3, checkpoint_step=2)
    del store  # as a killed coordinator leaves it: its WAL not checkpointed
    opener = (
        "import resource, signal, sys\n"
        "from roundpipe.coordinator.service.jobstore import JobStore, JobStoreError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    JobStore.in_state_dir(sys.argv[1])\n"
        "except JobStoreError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", opener, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    message = out.stdout.strip()
    assert "disk I/O error" in message and "the jobs in it are kept" in message, out
    assert "move it aside" not in message and "rollback" not in message, out
    reopened = JobStore.in_state_dir(tmp_path)
    assert [(j.job_id, j.state, j.step) for j in reopened.all()] == [("job-1", "paused", 3)]


# --------------------------------------------------------------------------- coordinator


def start(state_dir: Path, arena_dir: Path, sock_dir: Path) -> Coordinator:
    """A coordinator that is bound (jobs loaded) but does not serve: requests are fed to
    its handler directly, and no job runs."""
    c = Coordinator(f"ipc://{sock_dir}/c.sock", state_dir, arena_dir)
    c.bind()
    return c


# The identity requests are made as (an admin, like the coordinator's own user on ipc).
OWNER = Peer("unix:root", frozenset({"admin", "worker"}))


def stop(c: Coordinator) -> None:
    c.router.disable_monitor()
    c.handshake_events.close()
    c.router.close()
    c.zap.close()
    c.outbox.close()
    c.ctx.term()
    assert c.book.store is not None
    c.book.store.close()


def test_coordinator_restart_requeues_running_and_keeps_paused(
    tmp_path: Path, arena_dir: Path
) -> None:
    state = tmp_path / "state"
    c = start(state, arena_dir, tmp_path)
    ids = []
    for name in ("a", "b", "c", "d"):
        reply = c.requests.handle(SubmitJob(spec=tiny_spec(tmp_path / name).to_dict()), OWNER)
        assert isinstance(reply, JobAccepted)
        ids.append(reply.job_id)
    a, b, cc, d = (c.book.jobs[i] for i in ids)
    c.book.set_state(a, "running", "")  # interrupted mid-run by the "crash" below
    c.book.set_state(b, "paused", "cannot write checkpoint step 4: No space left on device")
    c.book.store.update(b.job_id, checkpoint_step=2)
    c.book.set_state(d, "succeeded", "model written")
    stop(c)

    c = start(state, arena_dir, tmp_path)
    try:
        assert c.book.queue == [ids[0], ids[2]]  # submission order, the interrupted one first
        a, b, cc, d = (c.book.jobs[i] for i in ids)
        assert a.state == "queued" and "interrupted by a coordinator restart" in a.message
        assert b.state == "paused" and "No space left" in b.message
        listed = c.requests.handle(ListJobs(), OWNER)
        assert isinstance(listed, JobList)
        assert [j.job_id for j in listed.jobs] == ids
        assert [j.state for j in listed.jobs] == ["queued", "paused", "queued", "succeeded"]

        assert isinstance(c.requests.handle(ResumeJob(job_id=b.job_id), OWNER), Ack)
        assert b.state == "queued" and "checkpoint step 2" in b.message
        assert c.book.queue[-1] == b.job_id
        # Resuming a job that is queued (here: resumed automatically after the restart)
        # is a no-op success: it keeps its place and its message.
        assert isinstance(c.requests.handle(ResumeJob(job_id=a.job_id), OWNER), Ack)
        assert c.book.queue.count(a.job_id) == 1 and "coordinator restart" in a.message
        for job_id, code in ((d.job_id, "bad_state"), ("x", "unknown_job")):
            reply = c.requests.handle(ResumeJob(job_id=job_id), OWNER)
            assert isinstance(reply, ErrorReply) and reply.code == code, reply
        assert "model.resume_from" in c.requests.handle(ResumeJob(job_id=d.job_id), OWNER).message
        assert isinstance(c.requests.handle(CancelJob(job_id=b.job_id), OWNER), Ack)
        assert b.state == "cancelled" and b.job_id not in c.book.queue
    finally:
        stop(c)
    store = JobStore.in_state_dir(state)
    assert [j.state for j in store.all()] == ["queued", "cancelled", "queued", "succeeded"]
    store.close()


def test_stored_job_whose_spec_went_invalid_fails_on_load(tmp_path: Path, arena_dir: Path) -> None:
    state = tmp_path / "state"
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello world"}\n')
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["data"]["path"] = str(data)
    c = start(state, arena_dir, tmp_path)
    job_id = c.requests.handle(SubmitJob(spec=spec), OWNER).job_id
    stop(c)
    data.unlink()
    # With a checkpoint of its own, the reason was replaced by "interrupted by a
    # coordinator restart; resumes from checkpoint step 2".
    CheckpointDir(tmp_path / "out" / "checkpoints").write(
        2, lambda d: (d / "weights").write_bytes(b"w"), {"job_id": job_id}
    )
    c = start(state, arena_dir, tmp_path)
    try:
        job = c.book.jobs[job_id]
        assert job.state == "failed" and "no longer valid" in job.message
        assert "data.path" in job.message and c.book.queue == []
        reply = c.requests.handle(ResumeJob(job_id=job_id), OWNER)
        assert isinstance(reply, ErrorReply) and reply.code == "bad_spec"
    finally:
        stop(c)


def test_a_spent_resume_from_is_dropped_only_for_an_intact_checkpoint_of_the_jobs_own(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A job whose model.resume_from no longer validates is built without it only if a
    checkpoint of its own passes its checksums, as the trainer judges it: judged by
    file sizes, a damaged one let the job train from step 0 and succeed."""
    out = tmp_path / "out"
    spec = tiny_spec(out).to_dict()
    spec["model"]["resume_from"] = str(tmp_path / "gone")
    c = start(tmp_path / "state", arena_dir, tmp_path)
    try:
        book = c.book
        assert book.spent_resume_from("job-b", spec, str(out)) is None  # none of its own
        ckpts = CheckpointDir(out / "checkpoints")
        ckpts.write(2, lambda d: (d / "weights").write_bytes(b"good"), {"job_id": "job-b"})
        spent = book.spent_resume_from("job-b", spec, str(out))
        assert spent is not None and spent["model"]["resume_from"] is None
        assert spec["model"]["resume_from"] == str(tmp_path / "gone")  # not changed in place
        assert book.spent_resume_from("job-c", spec, str(out)) is None  # another job's
        (out / "checkpoints" / "step-00000002" / "weights").write_bytes(b"evil")  # same size
        assert book.spent_resume_from("job-b", spec, str(out)) is None
    finally:
        stop(c)


def test_a_follower_node_builds_an_announced_job_without_its_resume_from(
    tmp_path: Path, arena_dir: Path
) -> None:
    """Rank 0 alone restores a checkpoint and sends the other nodes its state; a
    follower that checked model.resume_from refused a job whose source was gone (though
    rank 0 resumes it from its own checkpoints) or is on rank 0's disk only."""
    import threading

    from roundpipe.coordinator.service.job_runner import JobRunner
    from roundpipe.coordinator.training.multinode import JobAnnouncement

    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["model"]["resume_from"] = str(tmp_path / "gone")
    c = start(tmp_path / "state", arena_dir, tmp_path)
    try:
        runner = JobRunner(
            c.book,
            c.workers,
            threading.RLock(),
            ctx=c.ctx,
            outbox="inproc://unused",
            stopping=threading.Event(),
            on_group_lost=lambda why: None,
            group=None,
            paths=c.paths,
            arena_dir=arena_dir,
            namespace="t",
            wait_timeout_s=1,
        )
        job = runner._follower_job(JobAnnouncement(1, "job-x", spec))
        built = c.book.build_spec(job.job_id, job.spec_dict, job.output_dir)
        assert built.model.resume_from is None and built.train.steps == spec["train"]["steps"]
    finally:
        stop(c)
