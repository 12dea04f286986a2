"""A job's output directory: where its checkpoints and its final model are written.

Writing into it safely is this module's job. With a ``PathPolicy`` (coordinator
confined to allowed roots) the directory is checked again before every write and
written through the checked directory held open (``JobOutput.pinned``): in a write root
others can write to, it could otherwise be renamed away and replaced by a link between
the check and the last file written. Error messages name the directory as the user
knows it, never the pin (``shown``), and say which checkpoint a paused job resumes from
(``io_error_message``). A write that ran out of file descriptors is tried again a few
times before the job pauses (``retry_short_of_descriptors``: Note [out of descriptors])."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from roundpipe.coordinator.spec.checkpoint_format import step_name
from roundpipe.coordinator.spec.errors import host_shortage
from roundpipe.coordinator.spec.paths import PathPolicy, PathRefused, pinned_dir
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused

__all__ = ["DESCRIPTOR_RETRY_WAITS_S", "JobOutput"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DESCRIPTOR_RETRY_WAITS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
"""How long a write that ran out of file descriptors waits before each new try (15.5 s
in all, past the ROUTER's 10 s handshake limit); then the job pauses. Note [out of
descriptors]."""

# Note [out of descriptors]
# The coordinator's connection budget (Note [connection budget] in
# roundpipe.coordinator.service.connections) is enforced after the fact: libzmq accepts a
# flood's connections on its own thread, as fast as descriptors allow, and the I/O loop
# hangs up the excess once it reads the monitor's events. Under a burst the process can
# therefore sit at its open-files limit for a moment, and again each time the kernel
# hands over more of the flood's pending connects, until the flood is hung up or its
# handshakes time out (10 s). A checkpoint or final model that meets EMFILE or ENFILE
# then is tried again after DESCRIPTOR_RETRY_WAITS_S (the write is atomic, or overwrites
# in place, so a new try starts clean) and the job pauses only if the descriptors stay
# short: a leak or a limit set too low, for a person to fix. Other errors (a full disk,
# permissions) do not go away by waiting and pause at once. A checkpoint whose state
# is gathered from several nodes as it is written (Note [streamed checkpoint state]) is
# not tried again: the gathers are collectives the other nodes do not repeat.


class JobOutput:
    """One job's output directory (``output_dir``) and its checkpoints below it."""

    def __init__(self, job_id: str, output_dir: Path, paths: PathPolicy | None):
        self.job_id = job_id
        self.cancelled = threading.Event()
        """Set when the job is cancelled (``Trainer.cancel``): a retry's wait ends in
        JobCancelled."""
        self.output_dir = output_dir
        self.paths = paths
        """The coordinator's allowed roots: checked again before every write into the
        output (None: not confined)."""
        self.checkpoints = CheckpointDir(output_dir / "checkpoints")
        self.checkpoint_step: int | None = None
        """Step of the newest checkpoint written or resumed from (None: none yet): what
        a paused job resumes from."""
        self.checkpoint_path: Path | None = None
        """Where that checkpoint is: in this job's ``checkpoints/``, or where the job
        resumed from (``model.resume_from`` may name another job's)."""
        self._pins = threading.local()
        """Per thread (the run loop's and the background checkpoint writer's each hold
        their own): ``root``, the output directory's pin while ``pinned`` holds one;
        see ``root``."""
        self._held_fd: int | None = None
        self.held = output_dir
        """The output directory checked in ``hold`` and held open until ``release`` (its
        pin): where the run's trace and TensorBoard scalars go, written all along."""

    def hold(self) -> None:
        """Check the output directory (with a ``PathPolicy``) and hold it open, then
        check that checkpoints can be written into it. Raises JobFailed if the policy
        refuses it, JobPaused if it is not writable."""
        if self.paths is not None:
            try:
                fd = self.paths.open_output(self.output_dir)
                if self._held_fd is not None:  # prepared again: hold the new check
                    os.close(self._held_fd)
                self._held_fd = fd
            except PathRefused as exc:
                raise JobFailed(str(exc)) from None
            self.held = pinned_dir(self._held_fd) or self.output_dir
        try:
            CheckpointDir(self.held / self.checkpoints.root.name).ensure_writable()
        except OSError as exc:
            if self.checkpoint_step is None:  # checked before any is restored: the message
                # says which one the job resumes from
                try:
                    kept = self.checkpoints.likely_resume(job_id=self.job_id)
                except OSError:  # not even readable: the message says where
                    kept = None
                if kept is not None:
                    self.checkpoint_step, self.checkpoint_path = kept.step, kept.path
            message = self.io_error_message("the output directory is not writable", exc)
            raise JobPaused(message) from exc

    def kept(self) -> tuple[int, Path] | None:
        """The checkpoint this job can continue from (step, path): the newest it wrote or
        resumed from; None before any."""
        if not self.checkpoint_step:
            return None
        step = self.checkpoint_step
        return step, self.checkpoint_path or self.checkpoints.root / step_name(step)

    def release(self) -> None:
        """Close the directory ``hold`` holds open."""
        if self._held_fd is not None:
            os.close(self._held_fd)
            self._held_fd = None
            self.held = self.output_dir

    @contextlib.contextmanager
    def pinned(self, what: str) -> Iterator[Path]:
        """Check that the output directory is still a directory below a write root that
        only the coordinator can change (coordinator.paths), and yield a path to write
        into it through that checked directory held open (coordinator.paths.pinned_dir):
        in a write root others can write to, the directory could otherwise be renamed
        away and replaced by a link between the check and the last file written.
        Raises JobFailed if the check fails, JobPaused (the message begins with ``what``)
        if the directory cannot be opened at all (out of file descriptors, I/O error)."""
        if self.paths is None:
            yield self.output_dir
            return
        try:
            fd = self.paths.open_output(self.output_dir)
        except PathRefused as exc:
            raise JobFailed(str(exc)) from None
        except OSError as exc:
            raise JobPaused(self.io_error_message(what, _with_path(exc, self.output_dir))) from exc
        try:
            pinned = pinned_dir(fd) or self.output_dir  # no /proc: the checked path
            self._pins.root = pinned
            yield pinned
        finally:
            self._pins.root = None
            os.close(fd)

    @property
    def root(self) -> Path:
        """Where this thread writes into the output directory: the pin it holds
        (``pinned``), else the directory's path."""
        return getattr(self._pins, "root", None) or self.output_dir

    def retry_short_of_descriptors(
        self, what: str, write: Callable[[], T], wait: Callable[[float], None] | None = None
    ) -> T:
        """``write()``, tried again after each of DESCRIPTOR_RETRY_WAITS_S (``wait``
        waits; it may raise to give up; by default ``wait_unless_cancelled``) while it
        raises JobPaused for EMFILE or ENFILE (Note [out of descriptors]); any other
        error, or the last one, propagates."""
        wait = self.wait_unless_cancelled if wait is None else wait
        for wait_s in (*DESCRIPTOR_RETRY_WAITS_S, None):
            try:
                return write()
            except JobPaused as paused:
                shortage = host_shortage(paused)
                if wait_s is None or shortage is None or shortage.errno == errno.ENOMEM:
                    raise
                log.warning(
                    "[trainer] job %s: %s: out of file descriptors (%s); trying again in %gs "
                    "(a flood of connections? see the coordinator's log)",
                    self.job_id,
                    what,
                    shortage.strerror or shortage,
                    wait_s,
                )
            wait(wait_s)
        raise AssertionError("unreachable")

    def wait_unless_cancelled(self, seconds: float) -> None:
        """Wait ``seconds``; JobCancelled at once if the job is cancelled meanwhile."""
        if self.cancelled.wait(seconds):
            raise JobCancelled(f"job {self.job_id} was cancelled")

    def shown(self, text: object) -> str:
        """``text`` (a path, a message) as the user knows it: the output directory's pin
        replaced by its path."""
        text = str(text)
        for pin in {self.root, self.held} - {self.output_dir}:
            # Not inside a longer fd number: /proc/self/fd/1 is no prefix of .../fd/12.
            text = re.sub(re.escape(str(pin)) + r"(?![0-9])", lambda _: str(self.output_dir), text)
        return text

    def io_error_message(self, what: str, exc: OSError) -> str:
        """Why writing failed, what to fix, and which checkpoint the paused job resumes
        from."""
        where = self.shown(exc.filename or self.checkpoints.root)
        code = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{exc.strerror or exc}" + (f" [{code}]" if code else "")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space on that file system"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "make the directory writable by the coordinator"
        elif exc.errno in (errno.EMFILE, errno.ENFILE):
            fix = "see the coordinator's log for what holds its files (a flood of connections?)"
        else:
            fix = "fix the problem"
        if (checkpoint := self.kept()) is not None:
            step, path = checkpoint
            kept = f"checkpoint step {step} ({path}) is kept and the job resumes from it"
        else:
            kept = "no checkpoint has been written yet, so the job resumes from the start"
        return (
            f"{what}: {where}: {reason}. The job is paused; {kept}: {fix}, then run "
            f"`roundpipe resume {self.job_id}`"
        )


def _with_path(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` if it names no file itself (an error message says where)."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))
