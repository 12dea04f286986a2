"""How a job stops short of its last step: the three errors a ``Trainer`` raises.

The service tells them apart: a failed job is over, a cancelled one was stopped by a
client, a paused one lost nothing and waits for ``roundpipe resume``."""

from __future__ import annotations

__all__ = ["JobCancelled", "JobFailed", "JobPaused"]


class JobFailed(RuntimeError):
    """The job cannot continue; the message says why and what to do."""


class JobCancelled(RuntimeError):
    """The job was cancelled by a client."""


class JobPaused(RuntimeError):
    """The job stopped without losing anything (its output could not be written) and
    waits for ``roundpipe resume``; the message says why and what to do."""
