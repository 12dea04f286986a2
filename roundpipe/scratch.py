"""The working directory of a one-off run (a benchmark, `roundpipe chaos`, a GPU check
step): its data, job outputs and daemon logs.

A run on a shared server must not fill /tmp: each benchmark's default run writes tens to
hundreds of MB, and a test suite runs them many times. So a directory this module makes
is removed when the run succeeds, and kept when it fails, with its path on stderr, since
the daemons' logs in it say why. A directory the user named (``--workdir``) is theirs:
it is created if missing and never removed.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def work_dir(
    prefix: str, named: str | Path | None = None, *, parent: str | Path | None = None
) -> Iterator[Path]:
    """``named`` if given (kept), else a new directory ``<parent or $TMPDIR>/<prefix>*``
    removed on success. A failure is an exception, or ``sys.exit`` with a status other
    than 0: the directory is then kept and named on stderr, unless it is empty (a usage
    error before anything was written leaves nothing behind)."""
    if named is not None:
        path = Path(named)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _say_kept(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        raise
    except BaseException:
        _say_kept(path)
        raise
    shutil.rmtree(path, ignore_errors=True)


def _say_kept(path: Path) -> None:
    if not any(path.iterdir()):
        path.rmdir()  # nothing to read: not worth a directory in /tmp
        return
    print(
        f"the run failed: its files (daemon logs, job outputs) are kept in {path}", file=sys.stderr
    )
