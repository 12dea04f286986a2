"""A job's progress events (one per step reported), shared between the threads that
read them.

The run loop appends; the service pages through them from its own threads; a checkpoint
stores them beside its training state as a table (``table``) and a resumed job, or a
node of a group starting from rank 0's state, reads them back (``replace``).

Note [compact progress history]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A job may run for hundreds of thousands of steps, and ``roundpipe logs`` and
``progress()`` replay its whole history. So the events are not kept as
``ProgressEvent`` objects (about 260 bytes a step) but as six float64 columns in one
``array`` (48 bytes a step); an event is made when it is read. A step is its own ``seq``
(every event is one step, numbered from 1), and steps only grow, so a page is found by
bisection. float64 holds every field exactly (a step up to 2**53, a ``time.time()``), so
a history read back from a checkpoint is the one written.

A coordinator runs for months and keeps every job it ran: held in memory, the histories
of finished jobs grew with every step ever trained (1 GB after 20 million steps), and a
restart lost them all. So when a run ends its history is written, those same cells, to
a file in the job's directory (``write``), and the job keeps a ``StoredProgress`` that
reads pages from the file (a bisection of ``pread`` calls): nothing in memory, and the
history is there after a restart.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from roundpipe.protocol import ProgressEvent

__all__ = ["COLUMNS", "ProgressLog", "StoredProgress"]

COLUMNS = ("step", "loss", "tokens_per_s", "lr", "time", "optimizer_s")
"""One row of the history, in this order (``rows``, ``table``)."""
_WIDTH = len(COLUMNS)
_ROW_BYTES = _WIDTH * 8  # float64 cells


class ProgressLog:
    """The progress events of one job, in step order; every method is thread-safe
    (Note [compact progress history])."""

    def __init__(self, rows: Iterable[Sequence[float]] = ()) -> None:
        self._lock = threading.Lock()
        self._cells = _cells(rows)
        """Appended under the lock, ``_WIDTH`` cells a step."""

    def append(self, event: ProgressEvent) -> None:
        row = [event.step, event.loss, event.tokens_per_s, event.lr, event.time]
        row.append(event.optimizer_s)
        with self._lock:
            self._cells.extend(row)

    def replace(self, rows: Iterable[Sequence[float]] | torch.Tensor) -> None:
        """Start over from ``rows`` (as ``rows`` or ``table`` gives them: a
        checkpoint's, rank 0's)."""
        cells = _cells(rows)
        with self._lock:
            self._cells = cells

    def up_to(self, step: int) -> ProgressLog:
        """A copy of the events of steps up to ``step`` (a resumed job's, cut at its
        checkpoint)."""
        with self._lock:
            n = bisect.bisect_right(_Steps(self._cells), step)
            copy = ProgressLog()
            copy._cells = self._cells[: n * _WIDTH]
        return copy

    def __len__(self) -> int:
        with self._lock:
            return len(self._cells) // _WIDTH

    def events(self) -> list[ProgressEvent]:
        """Every event, as objects (for tests and small jobs: a page is cheaper)."""
        with self._lock:
            return _events(self._cells, 0, len(self._cells) // _WIDTH)

    @property
    def last_loss(self) -> float | None:
        """The loss of the newest event (None: no step reported yet)."""
        with self._lock:
            return self._cells[-_WIDTH + 1] if self._cells else None

    def page(self, after_seq: int, limit: int) -> tuple[list[ProgressEvent], bool]:
        """Up to ``limit`` events after ``after_seq``, in seq order, and whether more
        follow. By bisection: a poll must not scan a history of maybe hundreds of
        thousands of steps."""
        with self._lock:
            n = len(self._cells) // _WIDTH
            first = bisect.bisect_right(_Steps(self._cells), after_seq)
            stop = min(n, first + max(limit, 0))
            return _events(self._cells, first, stop), stop < n

    def recent(self, n: int) -> list[ProgressEvent]:
        """The newest ``n`` events."""
        with self._lock:
            total = len(self._cells) // _WIDTH
            return _events(self._cells, max(0, total - n), total)

    def loss_at(self, step: int) -> float | None:
        """The loss reported for ``step`` (a background checkpoint is announced after
        later steps have run)."""
        with self._lock:
            steps = _Steps(self._cells)
            i = bisect.bisect_left(steps, step)
            if i < len(steps) and steps[i] == step:
                return self._cells[i * _WIDTH + 1]
        return None

    def rows(self, up_to: int | None = None) -> list[list[float]]:
        """The events (of steps up to ``up_to``) as lists of ``COLUMNS``."""
        return self.table(up_to).tolist()

    def table(self, up_to: int | None = None) -> torch.Tensor:
        """The events (of steps up to ``up_to``) as a float64 ``[steps, COLUMNS]``
        tensor (a checkpoint's ``progress`` file)."""
        with self._lock:
            n = len(self._cells) // _WIDTH
            if up_to is not None:
                n = bisect.bisect_right(_Steps(self._cells), up_to)
            cells = self._cells[: n * _WIDTH]  # a copy: the log may grow meanwhile
        if not cells:
            return torch.empty(0, _WIDTH, dtype=torch.float64)
        return torch.frombuffer(cells, dtype=torch.float64).clone().reshape(n, _WIDTH)

    def write(self, path: Path) -> StoredProgress:
        """Write the history to ``path`` (its cells, native float64), atomically: a
        crash leaves the old file or the new one. OSError if it cannot be written."""
        with self._lock:
            data = self._cells.tobytes()
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return StoredProgress(path)


class StoredProgress:
    """A finished run's history in its file (``ProgressLog.write``), read a page at a
    time; read-only (Note [compact progress history]). The file is opened for each read:
    a coordinator keeps thousands of these and no descriptor for any. A file that is
    gone or cut reads as the whole rows that remain, and its reads never raise."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _opened(self) -> Iterator[_FileRows | None]:
        """The file's rows, or None if it cannot be opened."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            yield None
            return
        try:
            yield _FileRows(fd)
        finally:
            os.close(fd)

    def page(self, after_seq: int, limit: int) -> tuple[list[ProgressEvent], bool]:
        """As ``ProgressLog.page``."""
        with self._opened() as rows:
            if rows is None:
                return [], False
            try:
                first = bisect.bisect_right(_Steps(rows), after_seq)
                stop = min(len(rows), first + max(limit, 0))
                cells = rows.cells(first, stop)
            except OSError:
                return [], False
            return _events(cells, 0, len(cells) // _WIDTH), stop < len(rows)

    def up_to(self, step: int) -> ProgressLog:
        """The events of steps up to ``step``, in memory (a resumed job's, cut at its
        checkpoint)."""
        copy = ProgressLog()
        with self._opened() as rows:
            if rows is not None:
                with contextlib.suppress(OSError):
                    copy._cells = rows.cells(0, bisect.bisect_right(_Steps(rows), step))
        return copy

    def __len__(self) -> int:
        try:
            return os.stat(self.path).st_size // _ROW_BYTES
        except OSError:
            return 0

    def events(self) -> list[ProgressEvent]:
        """Every event, as objects (for tests and small jobs: a page is cheaper)."""
        return self.up_to(2**62).events()


class _FileRows:
    """The whole rows of an open history file, read with ``pread`` (no position kept):
    ``cells`` of rows, and ``[i]`` the cell of flat index i, as ``_Steps`` reads it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.rows = os.fstat(fd).st_size // _ROW_BYTES

    def __len__(self) -> int:
        return self.rows

    def cells(self, first: int, stop: int) -> array:
        cells = array("d")
        if stop > first:
            data = os.pread(self.fd, (stop - first) * _ROW_BYTES, first * _ROW_BYTES)
            cells.frombytes(data[: len(data) // _ROW_BYTES * _ROW_BYTES])
        return cells

    def __getitem__(self, i: int) -> float:
        return self.cells(i // _WIDTH, i // _WIDTH + 1)[i % _WIDTH]


class _Steps(Sequence[float]):
    """The step column of a cell array (or of a file's rows: ``_FileRows``), for
    bisection (no copy)."""

    def __init__(self, cells: array | _FileRows) -> None:
        self._cells = cells

    def __len__(self) -> int:
        return len(self._cells) // _WIDTH if isinstance(self._cells, array) else len(self._cells)

    def __getitem__(self, i):  # type: ignore[override]
        return self._cells[i * _WIDTH]


def _cells(rows: Iterable[Sequence[float]] | torch.Tensor) -> array:
    """``rows`` (lists of ``COLUMNS``, a ``table``; an older checkpoint's rows lack
    ``optimizer_s``: 0.0) as one flat float64 array."""
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 2 or rows.shape[1] != _WIDTH:
            raise ValueError(f"a progress table is [steps, {_WIDTH}], not {list(rows.shape)}")
        cells = array("d")
        cells.frombytes(rows.to(torch.float64).contiguous().numpy().tobytes())
        return cells
    cells = array("d")
    for row in rows:
        cells.extend(float(x) for x in row[:_WIDTH])
        cells.extend([0.0] * (_WIDTH - len(row)))
    return cells


def _events(cells: array, first: int, stop: int) -> list[ProgressEvent]:
    out = []
    for i in range(first, stop):
        step, loss, tokens_per_s, lr, when, optimizer_s = cells[i * _WIDTH : (i + 1) * _WIDTH]
        out.append(
            ProgressEvent(
                seq=int(step),
                step=int(step),
                loss=loss,
                tokens_per_s=tokens_per_s,
                lr=lr,
                time=when,
                optimizer_s=optimizer_s,
            )
        )
    return out
