"""The job state machine (coordinator.jobs) on its own: no sockets, no daemon, a real
job store on disk."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from runtime_helpers import tiny_spec

from roundpipe.coordinator.service.jobs import BadState, JobBook, outcome
from roundpipe.coordinator.service.jobstore import JobStore
from roundpipe.coordinator.spec.checkpoint_format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    step_name,
)
from roundpipe.coordinator.spec.paths import PathPolicy
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.progress_log import ProgressLog
from roundpipe.protocol import FINAL_JOB_STATES, JOB_STATES, STOPPED_JOB_STATES


def book_in(state_dir: Path) -> JobBook:
    state_dir.mkdir(parents=True, exist_ok=True)
    book = JobBook(
        state_dir,
        PathPolicy.create(read=["/"], write=["/"]),
        threading.RLock(),
        JobStore.in_state_dir(state_dir),
    )
    book.load()
    return book


def submit(book: JobBook, out: Path, owner: str = "alice"):
    spec = tiny_spec(out)
    return book.submit(spec, spec.to_dict(), owner=owner)


def test_states_are_one_closed_set() -> None:
    assert JOB_STATES == ("queued", "running", "paused", "succeeded", "failed", "cancelled")
    assert FINAL_JOB_STATES < STOPPED_JOB_STATES <= set(JOB_STATES)
    assert STOPPED_JOB_STATES - FINAL_JOB_STATES == {"paused"}


def test_a_queued_job_says_which_job_it_waits_for(tmp_path: Path) -> None:
    """A queued job's status said nothing (an empty message) while another job ran: it
    names the job ahead of it and how many more are queued before it."""
    book = book_in(tmp_path / "state")
    a, b, c = (submit(book, tmp_path / name) for name in "abc")
    assert book.status(a).message == "starts next"
    assert book.status(b).message == (f"waits for job {a.job_id} (queued): one job runs at a time")
    running = book.take_next(threading.Event())
    assert running is a and book.status(a).message == ""
    assert book.status(b).message == (f"waits for job {a.job_id} (running): one job runs at a time")
    assert book.status(c).message == (
        f"waits for job {a.job_id} (running) and 1 queued before it: one job runs at a time"
    )
    # Another owner's job is not named to a user (roundpipe jobs does not list it).
    assert book.status(b, viewer="alice").message.startswith(f"waits for job {a.job_id}")
    assert book.status(b, viewer="bob").message == (
        "waits for another owner's job (running): one job runs at a time"
    )
    # Between a run's final state and its release, it is not said to run.
    book.set_state(a, "succeeded", "done")
    assert book.status(b).message == "starts next"
    book.finish(a, "succeeded", "done")
    assert book.status(b).message == "starts next"
    # A queued job's own message (where a resumed job continues) stays, after it.
    book.cancel(c)
    book.resume(c)
    assert book.status(c).message == (
        f"waits for job {b.job_id} (queued): one job runs at a time; resume requested; "
        "continues from the start (it has no checkpoint)"
    )


def test_submit_run_cancel_resume(tmp_path: Path) -> None:
    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    b = submit(book, tmp_path / "b")
    assert (a.state, b.state) == ("queued", "queued") and book.queue == [a.job_id, b.job_id]
    assert a.output_dir == str(tmp_path / "a") and a.owner == "alice"

    # The job thread takes them in order; a cancelled queued job never runs.
    book.cancel(b)
    assert b.state == "cancelled" and b.message == "cancelled before it started"
    stop = threading.Event()
    running = book.take_next(stop)
    assert running is a and a.state == "running" and book.active is a

    # A run that pauses (e.g. a full disk), resumed: queued again with where it goes on.
    state, message = outcome(a, JobPaused("cannot write checkpoint: disk full"), stopping=False)
    book.finish(a, state, message)
    assert a.state == "paused" and book.active is None and "disk full" in a.message
    assert book.resume(a) == "from the start (it has no checkpoint)"
    assert a.state == "queued" and book.queue == [a.job_id]
    assert book.resume(a) is None  # already queued: nothing to do

    # A cancelled job can be resumed; a succeeded one cannot.
    assert book.resume(b) is not None and b.state == "queued" and not b.cancel_requested
    assert book.take_next(stop) is a
    book.record_checkpoint(a, 2, 5.5)
    book.finish(a, *outcome(a, None, stopping=False))
    assert a.state == "succeeded" and a.checkpoint_step == 2 and a.message.startswith("model")
    with pytest.raises(BadState, match="already succeeded"):
        book.resume(a)
    with pytest.raises(BadState, match=r"already ended \(succeeded\); nothing to cancel"):
        book.cancel(a)  # a job that has ended stays as it is, and the caller is told
    assert a.state == "succeeded"

    # Every change went to the store first: a new book reads the same states back.
    again = book_in(tmp_path / "state")
    assert {j.job_id: j.state for j in again.jobs.values()} == {
        a.job_id: "succeeded",
        b.job_id: "queued",
    }
    assert again.queue == [b.job_id] and again.jobs[a.job_id].checkpoint_step == 2
    stop.set()
    assert book.take_next(stop) is None


def test_a_resume_while_a_cancel_is_stopping_the_job_is_refused(tmp_path: Path) -> None:
    """cancel then resume of a running job: the resume was acknowledged as "already
    running" and lost, and the job ended cancelled. It is refused, with what to do."""
    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    assert book.take_next(threading.Event()) is a
    book.cancel(a)
    assert a.state == "running" and a.cancel_requested
    with pytest.raises(BadState, match="is being cancelled; resume it once it is cancelled"):
        book.resume(a)
    book.finish(a, *outcome(a, JobCancelled("cancelled"), stopping=False))
    assert a.state == "cancelled"
    assert book.resume(a) is not None and a.state == "queued"


def test_outcome_of_a_run(tmp_path: Path) -> None:
    book = book_in(tmp_path / "state")
    job = submit(book, tmp_path / "a")
    assert outcome(job, JobFailed("bad data"), stopping=False) == ("failed", "bad data")
    assert outcome(job, ValueError("x"), stopping=False) == ("failed", "ValueError: x")
    assert outcome(job, JobCancelled("c"), stopping=False)[0] == "cancelled"
    # A coordinator shutdown interrupts a job: it is queued again, from its checkpoint.
    job.checkpoint_step = 4
    state, message = outcome(job, JobCancelled("c"), stopping=True)
    assert state == "queued" and "from checkpoint step 4 on restart" in message
    # ... unless its owner had asked to cancel it.
    job.cancel_requested = True
    assert outcome(job, JobCancelled("c"), stopping=True)[0] == "cancelled"


def _manifest(out: Path, step: int, job_id: str) -> None:
    """A checkpoint's manifest as the trainer writes it last (files are not looked at)."""
    d = out / "checkpoints" / step_name(step)
    d.mkdir(parents=True)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "job_id": job_id}
    (d / MANIFEST).write_text(json.dumps({**manifest, "files": {}}))


def test_restart_after_a_checkpoint_the_store_missed_shows_its_step(tmp_path: Path) -> None:
    """A crash between a checkpoint's completion on disk and the store's update: after the
    restart the job says it resumes from that checkpoint (it said step 0)."""
    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    assert book.take_next(threading.Event()) is a
    book.record_checkpoint(a, 2, 5.5)
    _manifest(tmp_path / "a", 2, a.job_id)
    _manifest(tmp_path / "a", 4, a.job_id)  # on disk, never recorded: the crash
    _manifest(tmp_path / "a", 6, "job-of-someone-else")

    again = book_in(tmp_path / "state")  # the coordinator restarts
    job = again.jobs[a.job_id]
    assert job.state == "queued" and job.checkpoint_step == 4
    assert job.status().step == 4
    assert job.message == "interrupted by a coordinator restart; resumes from checkpoint step 4"
    assert book_in(tmp_path / "state").jobs[a.job_id].checkpoint_step == 4  # stored too


def test_restart_names_the_checkpoint_the_pointer_names(tmp_path: Path) -> None:
    """Killed after step 4 was renamed into place but before ``latest`` moved: the
    trainer resumes from step 2 (the pointer's), so the status must say 2, not 4."""
    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    assert book.take_next(threading.Event()) is a
    _manifest(tmp_path / "a", 2, a.job_id)
    _manifest(tmp_path / "a", 4, a.job_id)
    (tmp_path / "a" / "checkpoints" / LATEST).write_text(step_name(2) + "\n")
    job = book_in(tmp_path / "state").jobs[a.job_id]
    assert job.checkpoint_step == 2 and job.status().step == 2
    assert CheckpointDir(tmp_path / "a" / "checkpoints").pointer() == step_name(2)


def test_a_checkpoint_finished_during_a_clean_stop_is_shown_after_the_restart(
    tmp_path: Path,
) -> None:
    """SIGTERM while a background checkpoint is being written: the job is stored queued
    with its older step, then the write completes (pointer moved) with nobody left to
    record it. The restarted coordinator shows the step the job resumes from."""
    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    assert book.take_next(threading.Event()) is a
    book.record_checkpoint(a, 2, 5.5)
    _manifest(tmp_path / "a", 2, a.job_id)
    book.finish(a, "queued", "interrupted by a coordinator shutdown; resumes from step 2")
    _manifest(tmp_path / "a", 4, a.job_id)  # the background write, done after the stop
    (tmp_path / "a" / "checkpoints" / LATEST).write_text(step_name(4) + "\n")
    job = book_in(tmp_path / "state").jobs[a.job_id]
    assert job.state == "queued" and job.checkpoint_step == 4 and job.status().step == 4


def test_a_stop_while_the_job_thread_builds_a_job_leaves_it_queued(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM while the job thread built a new job's spec (its data read: minutes)
    found no trainer to cancel; with a worker connected the job then prepared and
    trained after the I/O loop had ended, and the coordinator hung until killed. Now the
    job thread sees the stop when it hands over its trainer: the job stays queued."""
    import zmq

    from roundpipe.coordinator.service.job_runner import JobRunner
    from roundpipe.coordinator.training import trainer as trainer_module

    class OneWorker:  # a worker is connected: the wait for one does not see the stop
        def live(self):
            return [0]

        def hardware(self):
            return None

        def forget_job(self, job_id):
            pass

        def identities(self):
            return []  # nothing to send the teardown to

    def prepare(self, *args, **kwargs):
        raise AssertionError("a job prepared after the coordinator was told to stop")

    monkeypatch.setattr(trainer_module.Trainer, "prepare", prepare)
    book = book_in(tmp_path / "state")
    job = submit(book, tmp_path / "out")
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PULL)
    outbox.bind("inproc://outbox")
    stopping = threading.Event()
    runner = JobRunner(
        book,
        OneWorker(),
        threading.RLock(),
        ctx=ctx,
        outbox="inproc://outbox",
        stopping=stopping,
        on_group_lost=lambda why: None,
        group=None,
        paths=PathPolicy.create(read=["/"], write=["/"]),
        arena_dir=arena_dir,
        namespace="stopbuild",
        wait_timeout_s=10,
    )
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://outbox")
    try:
        assert book.take_next(threading.Event()) is job
        stopping.set()  # the SIGTERM lands while the job thread is still at its start
        runner._run_job(job, push)
    finally:
        push.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
    assert job.state == "queued", job.message  # continues after the restart
    assert book_in(tmp_path / "state").queue == [job.job_id]


def test_a_cancel_or_resume_the_store_refuses_changes_nothing(tmp_path: Path) -> None:
    """The store could not record a cancel (locked, a full disk): memory said cancelled,
    the store queued, and after a restart the job its owner cancelled ran. Now the
    request fails (store_error) and nothing changes; the same for a resume."""
    import sqlite3

    from roundpipe.coordinator.service.jobstore import JobStoreError

    book = book_in(tmp_path / "state")
    a = submit(book, tmp_path / "a")
    b = submit(book, tmp_path / "b")
    book.cancel(b)
    assert book.store is not None
    book.store._db.execute("PRAGMA busy_timeout = 100")  # fail fast, not after 10 s
    blocker = sqlite3.connect(book.store.path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    try:
        with pytest.raises(JobStoreError):
            book.cancel(a)
        assert a.state == "queued" and not a.cancel_requested and book.queue == [a.job_id]
        with pytest.raises(JobStoreError):
            book.resume(b)
        assert b.state == "cancelled" and b.job_id not in book.queue
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    again = book_in(tmp_path / "state")
    assert {j.job_id: j.state for j in again.jobs.values()} == {
        a.job_id: "queued",
        b.job_id: "cancelled",
    }


def test_after_a_restart_the_queue_keeps_its_order(tmp_path: Path) -> None:
    """The queue was rebuilt in submission order: an old job resumed behind newer ones
    jumped ahead of them, and ahead of the job a shutdown had cut off, which the docs
    say goes first."""
    book = book_in(tmp_path / "state")
    stop = threading.Event()
    a = submit(book, tmp_path / "a")
    assert book.take_next(stop) is a
    book.finish(a, "paused", "disk full")
    x, y = submit(book, tmp_path / "x"), submit(book, tmp_path / "y")
    book.resume(a)
    assert book.queue == [x.job_id, y.job_id, a.job_id]
    assert [*book_in(tmp_path / "state").queue] == [x.job_id, y.job_id, a.job_id]
    # x runs, a coordinator shutdown cuts it off: it goes first after the restart.
    assert book.take_next(stop) is x
    book.finish(x, *outcome(x, JobCancelled("stopping"), stopping=True))
    assert x.state == "queued"
    assert [*book_in(tmp_path / "state").queue] == [x.job_id, y.job_id, a.job_id]


def test_a_stopped_jobs_error_lets_go_of_its_frames() -> None:
    """The error a job ended with is kept until its end is recorded; its traceback's
    frames (the trainer's, with its tensors and arena views) are cut before the memory
    is released, down the chain of causes, or a failed job's arenas stayed mapped."""
    import gc
    import weakref

    from roundpipe.coordinator.service.job_runner import _drop_tracebacks

    class Big:
        pass

    def fail(held: Big) -> None:
        try:
            raise OSError("disk full")
        except OSError as exc:
            raise JobPaused("paused") from exc

    held = Big()
    ref = weakref.ref(held)
    try:
        fail(held)
    except JobPaused as exc:
        error = exc
    del held
    gc.collect()
    assert ref() is not None  # the frame of fail() holds it
    _drop_tracebacks(error)
    gc.collect()
    assert ref() is None
    assert error.__traceback__ is None and error.__cause__.__traceback__ is None


def _history(last: int, loss: float) -> ProgressLog:
    return ProgressLog([k, loss, 1e6, 3e-4, k + 0.5, 0.25] for k in range(1, last + 1))


def _shown(job) -> list[tuple[int, float]]:
    events, _ = job.progress_page(0)
    return [(e.step, e.loss) for e in events]


@pytest.mark.parametrize("cut_off_by", ["a resume", "a shutdown"])
def test_a_queued_jobs_stored_history_ends_at_its_checkpoint(tmp_path: Path, cut_off_by) -> None:
    """Note [compact progress history]: a run that ended at step 10 (checkpoint 6) wrote
    its history. Queued again (resumed, or cut off by a shutdown), the job trains 7-10
    anew; after a restart its history showed the old 7-10, so a client following it from
    step 10 missed the new ones; and its status showed step 6 with step 10's loss."""
    book = book_in(tmp_path / "state")
    job = submit(book, tmp_path / "out")
    book.take_next(threading.Event())
    book.record_checkpoint(job, 6, 1.0)
    job.progress = ProgressLog([k, 20.0 - k, 1e6, 3e-4, k + 0.5, 0.25] for k in range(1, 11))
    job.step, job.loss = 10, 10.0
    if cut_off_by == "a resume":
        book.finish(job, *outcome(job, JobPaused("a node was lost"), stopping=False))
        book.resume(job)
        assert (job.status().step, job.status().loss) == (6, 14.0)
    else:
        book.finish(job, *outcome(job, JobCancelled("stopping"), stopping=True))
    assert job.state == "queued"
    job = book_in(tmp_path / "state").jobs[job.job_id]
    assert _shown(job) == [(k, 20.0 - k) for k in range(1, 7)]
    # the checkpoint's step and its loss (a later step's loss was shown beside it)
    assert (job.status().step, job.status().loss) == (6, 14.0)


def test_a_history_that_cannot_be_written_leaves_no_older_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's history that cannot be written (a full disk) stays in memory; the file of
    the run before it was shown for the job after a restart, its losses and steps."""
    import errno

    book = book_in(tmp_path / "state")
    job = submit(book, tmp_path / "out")
    book.take_next(threading.Event())
    job.progress = _history(10, 1.0)
    book.finish(job, *outcome(job, JobPaused("the disk is full"), stopping=False))
    book.resume(job)
    book.take_next(threading.Event())
    job.progress = _history(20, 2.0)

    def full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ProgressLog, "write", full)
    book.finish(job, *outcome(job, JobPaused("the disk is full"), stopping=False))
    assert _shown(job)[-1] == (20, 2.0)  # in memory
    assert book_in(tmp_path / "state").jobs[job.job_id].progress_page(0) == ([], False)


def test_a_run_cut_off_by_a_crash_keeps_its_checkpoints_loss(tmp_path: Path) -> None:
    """A crash writes no history of the run: after the restart the job shows its
    checkpoint's step with the loss the store recorded for it (it showed none)."""
    book = book_in(tmp_path / "state")
    job = submit(book, tmp_path / "out")
    book.take_next(threading.Event())
    job.progress = ProgressLog([k, 20.0 - k, 1e6, 3e-4, k + 0.5, 0.25] for k in range(1, 8))
    book.record_checkpoint(job, 6, 14.0)
    job = book_in(tmp_path / "state").jobs[job.job_id]  # the crash, then a restart
    assert (job.state, job.status().step, job.status().loss) == ("queued", 6, 14.0)


def test_a_forgotten_job_is_gone_but_its_output_stays_its_owners(tmp_path: Path) -> None:
    """`roundpipe forget`: an ended job's record, log and history go (jobs and their
    directories piled up forever in a long-lived coordinator); its output stays, and
    another owner still may not write there, after a restart too."""
    from roundpipe.coordinator.spec.errors import JobSpecError
    from roundpipe.coordinator.spec.jobspec import JobSpec

    book = book_in(tmp_path / "state")
    raw = tiny_spec(tmp_path / "x").to_dict()
    raw["output"]["dir"] = None  # the default: <state>/jobs/<id>/output
    default = book.submit(JobSpec.from_dict(raw), raw, owner="alice")
    named = submit(book, tmp_path / "named")
    with pytest.raises(BadState, match="only a job that has ended"):
        book.forget(default)  # queued
    for job in (default, named):
        assert book.take_next(threading.Event()) is job
        with pytest.raises(BadState, match="is running"):
            book.forget(job)
        job.progress = _history(3, 1.0)
        Path(job.log_path).write_text("a log\n")
        book.finish(job, "succeeded", "done")
        Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    job_dirs = {job.job_id: book.job_dir(job.job_id) for job in (default, named)}
    assert (job_dirs[named.job_id] / "progress.f64").exists()
    for job in (default, named):
        book.forget(job)
        assert job.job_id not in book.jobs and book.store.get(job.job_id) is None
        assert not (job_dirs[job.job_id] / "job.log").exists()
        assert not (job_dirs[job.job_id] / "progress.f64").exists()
        assert Path(job.output_dir).is_dir()
    assert job_dirs[default.job_id].is_dir()  # it holds the default output
    assert not job_dirs[named.job_id].exists()
    for again in (book, book_in(tmp_path / "state")):
        assert not again.jobs
        for job in (default, named):
            spec = tiny_spec(Path(job.output_dir) / "sub")
            with pytest.raises(JobSpecError, match="another owner"):
                again.submit(spec, spec.to_dict(), owner="bob")
            mine = again.submit(spec, spec.to_dict(), owner="alice")
            again.cancel(mine)
            again.forget(mine)
    # Moved, and linked from where it was: still protected (resolved at each check, as
    # a listed job's output is).
    moved = tmp_path / "moved"
    Path(named.output_dir).rename(moved)
    Path(named.output_dir).symlink_to(moved)
    spec = tiny_spec(moved / "bob")
    with pytest.raises(JobSpecError, match="another owner"):
        book_in(tmp_path / "state").submit(spec, spec.to_dict(), owner="bob")


def test_forgetting_races_nothing_and_shifts_no_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a reviewer: a resume of a job being forgotten queued a job that no longer
    existed (the job thread died on it); `roundpipe jobs` paged by position, so a forget
    between two pages skipped a job; a group follower's record (not in this node's store)
    could not be forgotten."""
    from roundpipe.coordinator.service import requests as requests_module
    from roundpipe.coordinator.service.auth import Peer
    from roundpipe.coordinator.service.requests import ClientRequests
    from roundpipe.protocol import ListJobs

    book = book_in(tmp_path / "state")
    jobs = [submit(book, tmp_path / f"out{i}") for i in range(5)]
    for job in jobs:
        book.cancel(job)
    book.forget(jobs[0])
    with pytest.raises(BadState, match="was forgotten; submit it again"):
        book.resume(jobs[0])  # the admission thread still held the record
    assert not book.queue
    with pytest.raises(BadState, match="forgotten already"):
        book.forget(jobs[0])

    monkeypatch.setattr(requests_module, "MAX_REPLY_BYTES", 1)  # one job a page
    requests = ClientRequests(
        book,
        None,
        book._lock,
        paths=book.paths,
        arena_dir=tmp_path,  # type: ignore[arg-type]
    )
    admin = Peer("root", frozenset({"admin"}))
    page = requests.handle(ListJobs(start=0), admin)
    listed = [j.job_id for j in page.jobs]
    assert listed == [jobs[1].job_id]
    book.forget(jobs[1])  # between two pages
    while page.next_start is not None:
        page = requests.handle(ListJobs(start=page.next_start), admin)
        listed += [j.job_id for j in page.jobs]
    assert listed == [j.job_id for j in jobs[1:]]

    # A follower's record of a job announced again (a resume at rank 0) is added anew:
    # it goes to the end of the listing, which stays in order.
    with book._lock:
        book.add(jobs[2])
    listed, start = [], 0
    while start is not None:
        page = requests.handle(ListJobs(start=start), admin)
        listed += [j.job_id for j in page.jobs]
        assert page.next_start is None or page.next_start > start, listed  # advances
        start = page.next_start
    assert listed == [jobs[3].job_id, jobs[4].job_id, jobs[2].job_id]

    follower = jobs[2]
    follower.stored = False  # as job_runner announces a group's job on a follower
    book.store.forget(follower.job_id, [])  # rank 0's store holds it, not this one
    book.forget(follower)
    assert follower.job_id not in book.jobs
