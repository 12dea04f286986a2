"""The coordinator's durable job store: one SQLite file in its state directory.

Every job and every change of its state is written here before the coordinator acts on
it, so jobs survive a coordinator restart (a crash, ``systemctl restart``, an upgrade):

* ``queued`` jobs run again, in submission order;
* ``running`` jobs were interrupted: :meth:`JobStore.recover` turns them back into
  ``queued`` (with a message saying so), and when they run the trainer resumes them from
  their newest checkpoint (roundpipe.coordinator.training.checkpoint);
* ``paused`` jobs wait for ``roundpipe resume JOB``;
* ``succeeded``, ``failed`` and ``cancelled`` jobs are kept for ``roundpipe jobs``.

Schema (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    jobs(seq INTEGER PRIMARY KEY AUTOINCREMENT   -- submission order
         job_id TEXT UNIQUE, spec TEXT (JSON), state TEXT, message TEXT,
         output_dir TEXT, step INTEGER, total_steps INTEGER, loss REAL,
         checkpoint_step INTEGER (NULL: none yet), created_at REAL, updated_at REAL,
         plan TEXT (NULL: not planned yet; the stage partition in use, Plan string form))

    forgotten_dirs(path TEXT, owner TEXT, job_id TEXT)  -- PRIMARY KEY (path, job_id)

``forgotten_dirs`` keeps, for each job removed with ``roundpipe forget``, the directories
it owned (its output, and its job directory where that stays): another owner's job may
not write there any more than while the job was listed.

Schema version 1 lacked ``plan``, version 3 ``forgotten_dirs``; opening such a store adds
them.

The database runs in WAL mode with ``synchronous=FULL``: a change is on disk when the
call returns. One connection, guarded by a lock, serves every thread of the daemon.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_VERSION", "JobStore", "JobStoreError", "StoredJob"]

SCHEMA_VERSION = 4
STATES = ("queued", "running", "paused", "succeeded", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    output_dir TEXT,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    checkpoint_step INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    plan TEXT,
    owner TEXT NOT NULL DEFAULT ''
)
"""
_FORGOTTEN_SCHEMA = """
CREATE TABLE IF NOT EXISTS forgotten_dirs (
    path TEXT NOT NULL,
    owner TEXT NOT NULL,
    job_id TEXT NOT NULL,
    PRIMARY KEY (path, job_id)
)
"""

_COLUMNS = (
    "job_id",
    "spec",
    "state",
    "message",
    "output_dir",
    "step",
    "total_steps",
    "loss",
    "checkpoint_step",
    "created_at",
    "updated_at",
    "plan",
    "owner",
)
_UPDATABLE = frozenset(
    {"state", "message", "output_dir", "step", "total_steps", "loss", "checkpoint_step", "plan"}
)


class JobStoreError(RuntimeError):
    """The job store cannot be opened or written; the message names the file."""


@dataclass(frozen=True)
class StoredJob:
    """One row of the store."""

    job_id: str
    spec: dict[str, Any]
    state: str
    message: str
    output_dir: str | None
    step: int
    total_steps: int
    loss: float | None
    checkpoint_step: int | None
    created_at: float
    updated_at: float
    plan: str | None = None
    # The identity that submitted it ('' for a job stored before identities existed:
    # only admins see those).
    owner: str = ""


def _open_error(path: Path, exc: sqlite3.Error) -> str:
    """Why the job store at ``path`` cannot be opened, and what to do. Moving the file
    aside drops every job it holds: the advice for a damaged file only, not for a full
    disk or an I/O error, which leave the file as it was."""
    code = getattr(exc, "sqlite_errorcode", None)
    full = code == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    if full or code == sqlite3.SQLITE_IOERR or "disk I/O error" in str(exc):
        fix = (
            "free space on that file system"
            if full
            else "check that file system (free space, permissions, the disk)"
        )
        return (
            f"cannot open the job store {path}: {exc}; {fix} and start the coordinator again "
            "(the jobs in it are kept)"
        )
    return (
        f"cannot open the job store {path}: {exc}; if the file is damaged, move it aside "
        "(the coordinator then starts with no jobs)"
    )


class JobStore:
    """Jobs and their states in ``<state_dir>/jobs.sqlite3``."""

    FILENAME = "jobs.sqlite3"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                str(self.path), check_same_thread=False, isolation_level=None, timeout=10
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            # One transaction: killed part-way, a migration must leave the old schema
            # and its version (each statement committing on its own left columns added
            # under the old version number, and the next start failed on them).
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._create_or_migrate()
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite rolls back itself on a full disk
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise JobStoreError(_open_error(self.path, exc)) from exc

    def _create_or_migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JobStoreError(
                f"job store {self.path} has schema version {version}, newer than this "
                f"RoundPipe's {SCHEMA_VERSION}; run the newer roundpipe-coordinator"
            )
        self._db.execute(_SCHEMA)
        self._db.execute(_FORGOTTEN_SCHEMA)  # v4
        # Migrations: v2 added the plan column, v3 the owner.
        if 1 <= version < 2:
            self._db.execute("ALTER TABLE jobs ADD COLUMN plan TEXT")
        if 1 <= version < 3:
            self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @classmethod
    def in_state_dir(cls, state_dir: str | Path) -> JobStore:
        return cls(Path(state_dir) / cls.FILENAME)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, params: tuple = ()) -> tuple[list[tuple], int]:
        """Run one statement (atomic on its own); return its rows and rowcount."""
        try:
            with self._lock:
                cursor = self._db.execute(sql, params)
                return cursor.fetchall(), cursor.rowcount
        except sqlite3.Error as exc:
            raise JobStoreError(f"job store {self.path}: {exc}") from exc

    # -- writing --

    def add(
        self,
        job_id: str,
        spec: dict[str, Any],
        *,
        state: str = "queued",
        message: str = "",
        output_dir: str | None = None,
        total_steps: int = 0,
        owner: str = "",
    ) -> StoredJob:
        """Record a new job."""
        if state not in STATES:
            raise ValueError(f"unknown job state {state!r}")
        now = time.time()
        self._execute(
            "INSERT INTO jobs (job_id, spec, state, message, output_dir, step, total_steps, "
            "created_at, updated_at, owner) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
            (job_id, json.dumps(spec), state, message, output_dir, total_steps, now, now, owner),
        )
        job = self.get(job_id)
        assert job is not None
        return job

    def update(self, job_id: str, **fields: Any) -> None:
        """Change some of a job's columns (state, message, step, loss, ...) at once."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"cannot update {sorted(unknown)}")
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown job state {fields['state']!r}")
        if not fields:
            return
        names = sorted(fields)
        sets = ", ".join(f"{n} = ?" for n in names)
        _, count = self._execute(
            f"UPDATE jobs SET {sets}, updated_at = ? WHERE job_id = ?",
            (*(fields[n] for n in names), time.time(), job_id),
        )
        if count != 1:
            raise JobStoreError(f"job store {self.path} has no job {job_id!r}")

    def recover(self) -> list[str]:
        """After a restart: jobs left ``running`` become ``queued`` (to resume from their
        newest checkpoint). Returns their ids."""
        interrupted, _ = self._execute(
            "SELECT job_id, checkpoint_step FROM jobs WHERE state = 'running'"
        )
        for job_id, checkpoint_step in interrupted:
            self.update(job_id, state="queued", message=interrupted_message(checkpoint_step))
        return [job_id for job_id, _ in interrupted]

    def forget(self, job_id: str, owned: list[tuple[str, str]], *, stored: bool = True) -> None:
        """Remove a job, keeping the directories it ``owned`` ([(path, owner)]) in
        ``forgotten_dirs``: one transaction, so that its output never stands unowned.
        ``stored=False``: the job has no row here (a group follower's), only its
        directories are recorded."""
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    gone = self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                    if stored and gone.rowcount != 1:
                        raise JobStoreError(f"job store {self.path} has no job {job_id!r}")
                    self._db.executemany(
                        "INSERT OR REPLACE INTO forgotten_dirs (path, owner, job_id) "
                        "VALUES (?, ?, ?)",
                        [(path, owner, job_id) for path, owner in owned],
                    )
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise JobStoreError(f"job store {self.path}: {exc}") from exc

    # -- reading --

    def get(self, job_id: str) -> StoredJob | None:
        rows, _ = self._execute(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE job_id = ?", (job_id,)
        )
        return _row(rows[0]) if rows else None

    def all(self) -> list[StoredJob]:
        """Every job, in submission order."""
        rows, _ = self._execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs ORDER BY seq")
        return [_row(r) for r in rows]

    def forgotten_dirs(self) -> list[tuple[str, str, str]]:
        """(path, owner, job id) of every directory a forgotten job owned."""
        rows, _ = self._execute("SELECT path, owner, job_id FROM forgotten_dirs ORDER BY rowid")
        return [(path, owner, job_id) for path, owner, job_id in rows]


def interrupted_message(checkpoint_step: int | None) -> str:
    """What a job cut off by a coordinator restart says it resumes from."""
    where = (
        f"from checkpoint step {checkpoint_step}"
        if checkpoint_step
        else "from the start (no checkpoint had been written)"
    )
    return f"interrupted by a coordinator restart; resumes {where}"


def _row(row: tuple) -> StoredJob:
    values = dict(zip(_COLUMNS, row))
    values["spec"] = json.loads(values["spec"])
    return StoredJob(**values)
