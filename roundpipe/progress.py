"""Rendering a job's progress: the progress line of ``roundpipe submit --wait``,
``roundpipe demo`` and ``roundpipe resume --wait``, and the formats of its figures.

Its own module so that the CLI and the demo both use it without importing each other.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time
from typing import IO

from roundpipe.client import STOPPED_STATES, JobHandle
from roundpipe.protocol import JobStatus, ProgressEvent

__all__ = [
    "ProgressPrinter",
    "WatchResult",
    "format_duration",
    "format_loss",
    "format_rate",
    "said_of",
    "watch_job",
]


def format_duration(seconds: float | None) -> str:
    """``75`` -> ``1:15``; ``3725`` -> ``1:02:05``; unknown -> ``--:--``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M tok/s"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


class ProgressPrinter:
    """Renders ProgressEvents as a progress line: step/total, a bar, loss, tokens/s, lr,
    ETA.

    On a terminal (``tty=True``) one line is redrawn in place with a carriage return.
    Otherwise (logs, CI, tests) it prints a full line every ``every`` steps (default:
    about ten lines per job) plus the first and the last step.
    """

    BAR_WIDTH = 20

    def __init__(
        self,
        stream: IO[str],
        total_steps: int,
        *,
        tty: bool | None = None,
        every: int | None = None,
        started_at: float | None = None,
    ) -> None:
        """``started_at``: when watching began (``time.time()``; default now); events
        before it are a replay of the job's history."""
        self.stream = stream
        self.started_at = time.time() if started_at is None else started_at
        self.total_steps = max(0, int(total_steps))
        if tty is None:
            isatty = getattr(stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.every = every if every is not None else max(1, math.ceil(self.total_steps / 10))
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=20)
        self._line_len = 0  # length of the line currently drawn (tty)
        self._last_printed_step: int | None = None
        self.events_seen = 0

    def _pace_s(self) -> float | None:
        """Seconds per step over the recent window, or None before two steps are known."""
        if len(self._recent) < 2:
            return None
        (step0, t0), (step1, t1) = self._recent[0], self._recent[-1]
        return (t1 - t0) / (step1 - step0) if step1 > step0 else None

    def eta_s(self) -> float | None:
        """Seconds left at the recent pace, or None before two steps are known."""
        per_step = self._pace_s()
        if per_step is None or self.total_steps <= 0:
            return None
        return max(0.0, per_step * (self.total_steps - self._recent[-1][0]))

    def _note_time(self, step: int, at: float) -> None:
        """Add a step to the pace's window, afresh at the first step that happened after
        this printer started watching while the one before it happened earlier (``resume
        --wait`` replays the steps before the checkpoint with their old times, then the
        run goes on, maybe hours later: counted in, that pause made the ETA read hours
        for minutes left), or when the step went back (re-done after a resume)."""
        if self._recent:
            last_step, last_time = self._recent[-1]
            if step <= last_step or last_time < self.started_at <= at:
                self._recent.clear()
        self._recent.append((step, at))

    def format(self, event: ProgressEvent) -> str:
        """The progress text for `event` (without bar on a non-terminal)."""
        total = self.total_steps or "?"
        parts = [f"step {event.step}/{total}"]
        if self.tty and self.total_steps:
            done = min(1.0, event.step / self.total_steps)
            filled = int(round(done * self.BAR_WIDTH))
            parts[0] = f"[{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] " + parts[0]
        parts += [
            f"loss {format_loss(event.loss)}",
            format_rate(event.tokens_per_s),
            f"lr {event.lr:.2e}",
            f"optim {event.optimizer_s * 1e3:.0f} ms",
            f"ETA {format_duration(self.eta_s())}",
        ]
        return " | ".join(parts)

    def update(self, event: ProgressEvent) -> None:
        """Show one event."""
        self.events_seen += 1
        self._note_time(event.step, event.time)
        text = self.format(event)
        if self.tty:
            pad = max(0, self._line_len - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._line_len = len(text)
        else:
            last = self._last_printed_step
            due = (
                last is None
                or event.step - last >= self.every
                or (self.total_steps and event.step >= self.total_steps)
            )
            if not due:
                return
            self.stream.write(text + "\n")
            self._last_printed_step = event.step
        self.stream.flush()

    def finish(self) -> None:
        """End the in-place line (tty) so that what follows starts on a new line."""
        if self.tty and self._line_len:
            self.stream.write("\n")
            self.stream.flush()
            self._line_len = 0


@dataclasses.dataclass
class WatchResult:
    """What :func:`watch_job` saw: the final status and the first and last events."""

    status: JobStatus
    first: ProgressEvent | None
    last: ProgressEvent | None
    num_events: int


def watch_job(
    handle: JobHandle,
    *,
    total_steps: int | None = None,
    stream: IO[str] | None = None,
    tty: bool | None = None,
    poll_s: float = 0.2,
    timeout_s: float | None = None,
    after_seq: int = 0,
    shown: str | None = None,
) -> WatchResult:
    """Show a job's progress on `stream` (default stderr) until it ends; return how it
    ended. ``total_steps`` defaults to the job's own ``total_steps``; ``after_seq``: show
    the events after it only (a resumed job's, after its checkpoint). Until the job
    trains, what it waits for is shown as it changes; ``shown``: the ``STATE: MESSAGE``
    the caller printed already."""
    out = sys.stderr if stream is None else stream
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    status = _until_it_trains(handle, out, after_seq, deadline, shown)
    if deadline is not None:  # one limit for the wait and the progress after it
        timeout_s = max(deadline - time.monotonic(), 0.0)
    if total_steps is None:
        total_steps = status.total_steps
    printer = ProgressPrinter(out, total_steps, tty=tty)
    first: ProgressEvent | None = None
    last: ProgressEvent | None = None
    try:
        for event in handle.progress(poll_s=poll_s, timeout_s=timeout_s, after_seq=after_seq):
            if first is None:
                first = event
            last = event
            printer.update(event)
    finally:
        printer.finish()
    return WatchResult(handle.status(), first, last, printer.events_seen)


WAITING_POLL_S = 1.0
"""How often, at most, ``watch_job`` asks a job that has not started training what it
waits for."""


def _until_it_trains(
    handle: JobHandle, out: IO[str], after_seq: int, deadline: float | None, shown: str | None
) -> JobStatus:
    """Before a job trains a step past ``after_seq``, say what it waits for each time
    that changes (queued behind another job, waiting for a worker to connect): ``submit
    --wait`` printed nothing at all meanwhile. Returns the job's status once it trains
    or has stopped."""
    sleep = 0.05  # a job that starts at once is watched at once
    while True:
        status = handle.status()
        if status.step > after_seq or status.state in STOPPED_STATES:
            return status
        said = said_of(status)
        if said != shown:
            print(f"job {handle.job_id} {said}", file=out, flush=True)
            shown = said
        if deadline is not None and time.monotonic() >= deadline:
            return status  # the progress that follows times out at once, naming the job
        time.sleep(sleep)
        sleep = min(2 * sleep, WAITING_POLL_S)


def said_of(status: JobStatus) -> str:
    """``STATE: MESSAGE`` (or the state alone), as ``watch_job`` shows a waiting job."""
    return status.state + (f": {status.message}" if status.message else "")
