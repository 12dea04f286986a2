"""A job's pipeline timeline: what every worker and the optimizer did, and when.

The trainer calls a ``TimelineRecorder`` at four points (each a few lines in
roundpipe.coordinator.training.trainer and its optimizer thread,
roundpipe.coordinator.training.optimizer_thread, marked ``# observability``):

* ``task_done(msg, task)``: a worker's ``TaskDone``. The worker reports when the task
  started (``started_at``, wall clock: coordinator and workers share the host's clock),
  how long it took (``seconds``, until its last copy landed) and its phases: ``compute_s``,
  ``upload_s``, ``download_s`` and ``wait_s`` (time blocked on counters: weights of the
  right version, inputs, free gradient slots);
* ``optimizer_layer(step, layer, start, end)``: the CPU optimizer updated one layer;
* ``iteration_done(k)``: every task of iteration k has completed;
* ``step_reported(event)``: the trainer published step k's ProgressEvent;
* ``collective(...)``: in a data-parallel group, this node took part in a collective
  (roundpipe.coordinator.training.multinode): when it was ready, when every node had
  arrived, and when the collective ended. The network lane shows where a group's step
  goes: waiting for the slowest node, or moving bytes.

Memory is bounded: the recorder keeps the tasks of the last ``keep_steps`` iterations
(enough to measure the bubble of recent steps) and forgets older ones. Everything it
records is streamed to Chrome-trace / Perfetto JSON files in ``<output>/timeline/``
(Note [trace segments]), which ``roundpipe timeline`` reads back and draws.

Measured bubble fraction (the simulator's definition, measured): the share of worker
time in step k's window not spent computing, ``1 - compute / (workers x window)``,
where the window runs from the end of iteration k-1 to the end of iteration k (the
moment its last task finished). Iterations overlap (round-robin), so the window holds
tasks of iterations k and k+1 (iteration k+2 is not sent before k has finished); the
figure for step k is therefore settled, and published, once iteration k+1 has finished
(or when the job ends). A task cut by a window edge counts the share of its compute
time that its overlap with the window is of its span.

Note [trace segments]
~~~~~~~~~~~~~~~~~~~~~
A job that runs for days must not fill the disk with one ever-growing trace, and a
trace must be readable while the job runs or after the coordinator died. So the trace
is a series of files ``trace-<first step, 8 digits>-<run start, ms>.json``, a new one
every ``segment_steps`` steps, of which the newest ``keep_segments`` are kept. Each file
is ``{"traceEvents":[`` then one event per line (a comma before every event but the
first) and, once the segment is finished, ``]}``: valid JSON for Perfetto and
chrome://tracing once closed, and readable line by line by ``read_trace`` before. A
resumed job repeats the steps after its checkpoint; ``read_trace`` keeps, for every
step, the events of the newest run that recorded it.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from roundpipe.protocol import ProgressEvent, StageTask, TaskDone
from roundpipe.shared.plan import Plan

__all__ = [
    "NETWORK_TID",
    "OPTIMIZER_TID",
    "TENSORBOARD_DIR",
    "TRACE_DIR",
    "Trace",
    "OptimizerRecord",
    "TaskRecord",
    "TimelineRecorder",
    "bubble_in_window",
    "read_trace",
    "stage_label",
    "trace_files",
]

log = logging.getLogger(__name__)

TRACE_DIR = "timeline"
"""Sub-directory of the job's output directory that holds the trace segments."""
TENSORBOARD_DIR = "tensorboard"
"""Sub-directory of the job's output directory that holds the TensorBoard event file."""
OPTIMIZER_TID = 0
"""Chrome-trace thread id of the optimizer lane; worker w is thread id w + 1 (its id is
also in each event's ``args.worker``)."""
NETWORK_TID = -1
"""Chrome-trace thread id of the network lane: this node's collectives with the other
nodes of a data-parallel group (roundpipe.coordinator.training.multinode)."""
_SEGMENT_RE = re.compile(r"^trace-(\d{8})-(\d+)\.json$")
_KIND_CATEGORY = {"forward": "forward", "tail": "tail", "backward": "backward"}


def stage_label(plan: Plan | None, kind: str, start: int, stop: int) -> str:
    """``F0``, ``T``, ``B3``: a task's stage in ``plan`` (``F[2:4]`` if not in it)."""
    if kind == "tail":
        return "T"
    letter, ranges = ("F", plan.forward) if kind == "forward" else ("B", plan.backward)
    if plan is not None and (start, stop) in ranges:
        return f"{letter}{ranges.index((start, stop))}"
    return f"{letter}[{start}:{stop}]"


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One completed task, times in seconds since the epoch (time.time())."""

    worker: int
    iteration: int
    task_id: int
    attempt: int
    kind: str
    label: str
    start: float
    end: float
    compute_s: float
    upload_s: float
    download_s: float
    wait_s: float
    upload_bytes: int
    download_bytes: int


@dataclass(frozen=True, slots=True)
class OptimizerRecord:
    """The optimizer's update of one layer for one step."""

    step: int
    layer: int
    start: float
    end: float


def bubble_in_window(
    tasks: Iterable[TaskRecord], window: tuple[float, float], num_workers: int
) -> tuple[float, dict[int, float]]:
    """(bubble fraction, busy fraction per worker) over ``window`` (module docstring)."""
    lo, hi = window
    span = hi - lo
    busy: dict[int, float] = collections.defaultdict(float)
    for t in tasks:
        overlap = min(t.end, hi) - max(t.start, lo)
        if overlap <= 0:
            continue
        duration = t.end - t.start
        share = overlap / duration if duration > 0 else 1.0
        busy[t.worker] += min(t.compute_s, duration) * share
    if span <= 0 or num_workers <= 0:
        return 0.0, {}
    per_worker = {w: min(1.0, b / span) for w, b in busy.items()}
    bubble = 1.0 - sum(per_worker.values()) / num_workers
    return max(0.0, bubble), per_worker


@dataclass
class _WorkerTotals:
    tasks_done: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    compute_s: float = 0.0


@dataclass
class _StepFigures:
    """What the recorder knows of one step, for metrics and TensorBoard."""

    iteration_end: float | None = None
    complete: bool = False
    """Every task of the step completed (``iteration_done``)."""
    reported: ProgressEvent | None = None
    optimizer_end: float | None = None
    bubble: float | None = None
    busy: dict[int, float] = field(default_factory=dict)


class TimelineRecorder:
    """Records one job's timeline (module docstring). Thread-safe: the trainer's run
    loop and its optimizer thread call it, metric scrapes read it."""

    def __init__(
        self,
        job_id: str,
        trace_dir: Path | None = None,
        tensorboard_dir: Path | None = None,
        *,
        keep_steps: int = 64,
        segment_steps: int = 1000,
        keep_segments: int = 10,
        first_step: int = 1,
        shown: Callable[[object], str] = str,
    ) -> None:
        """Without ``trace_dir`` nothing is written, only the figures are kept; without
        ``tensorboard_dir`` no TensorBoard scalars are written. ``first_step``: the
        run's first step (a resumed job's: after its checkpoint). ``shown``: a path or
        message as the user knows it, in warnings (the output directory is written
        through a pin: JobOutput.shown)."""
        self.job_id = job_id
        self.keep_steps = keep_steps
        self.segment_steps = segment_steps
        self.keep_segments = keep_segments
        self.plan: Plan | None = None
        self._lock = threading.Lock()
        self._tasks: collections.deque[TaskRecord] = collections.deque()
        self._steps: dict[int, _StepFigures] = {}
        self.workers: dict[int, _WorkerTotals] = {}
        self.latest_bubble: float | None = None
        """Measured bubble fraction of the newest settled step (None before one)."""
        self.latest_bubble_step = 0
        self.latest_busy: dict[int, float] = {}
        """Busy fraction per worker in the newest settled step's window."""
        self.latest_optimizer_lag_s: float | None = None
        self.optimizer_step = 0
        """Newest step the optimizer has applied to every layer."""
        self._optimizer_layers_left: dict[int, int] = {}
        self.num_optimizer_layers = 0
        self._live_workers: int | None = None
        self._t0 = time.time()
        self._writer: _TraceWriter | None = None
        if trace_dir is not None:
            self._writer = _TraceWriter(
                Path(trace_dir),
                job_id,
                self._t0,
                segment_steps=segment_steps,
                keep_segments=keep_segments,
                shown=shown,
            )
        self._tensorboard = None
        self._grad_sq: dict[int, float] = {}  # step -> sum of squared gradient norms so far
        if tensorboard_dir is not None:
            from roundpipe.coordinator.training.tensorboard import ScalarWriter

            try:
                self._tensorboard = ScalarWriter(
                    Path(tensorboard_dir), first_step=first_step, job_id=job_id, shown=shown
                )
            except OSError as exc:  # an aid, like the trace: the job goes on without it
                log.warning(
                    "[timeline] job %s: cannot write TensorBoard scalars to %s (%s); the job "
                    "runs without them",
                    job_id,
                    shown(tensorboard_dir),
                    shown(exc),
                )

    @classmethod
    def for_job(cls, trainer, num_optimizer_layers: int) -> TimelineRecorder:
        """The recorder of a Trainer's run, as its job spec's ``output`` asks, started."""
        output = trainer.spec.output
        recorder = cls(
            trainer.job_id,
            trainer.held_output / TRACE_DIR if output.timeline else None,
            trainer.held_output / TENSORBOARD_DIR if output.tensorboard else None,
            first_step=trainer.start_step + 1,
            shown=trainer.output.shown,
        )
        recorder.start(trainer.start_step + 1, trainer.plan, num_optimizer_layers)
        return recorder

    # -- inputs (called by the trainer) -------------------------------------------------

    def start(self, first_step: int, plan: Plan, num_optimizer_layers: int) -> None:
        """The run starts after ``first_step - 1`` (a resumed job: after its checkpoint)."""
        with self._lock:
            self.plan = plan
            self.optimizer_step = first_step - 1
            self.num_optimizer_layers = num_optimizer_layers
            if self._writer is not None:
                self._writer.begin(first_step)

    def set_plan(self, plan: Plan) -> None:
        with self._lock:
            self.plan = plan

    def task_done(self, msg: TaskDone, task: StageTask | None) -> None:
        """A worker finished a task (``task`` is None for a late duplicate)."""
        end_guess = time.time()
        start = msg.started_at if msg.started_at > 0 else end_guess - msg.seconds
        end = start + msg.seconds
        with self._lock:
            totals = self.workers.setdefault(msg.worker_id, _WorkerTotals())
            totals.tasks_done += 1
            totals.upload_bytes += msg.upload_bytes
            totals.download_bytes += msg.download_bytes
            totals.compute_s += msg.compute_s
            if task is None:
                return
            record = TaskRecord(
                worker=msg.worker_id,
                iteration=task.iteration,
                task_id=task.task_id,
                attempt=msg.attempt,
                kind=task.kind,
                label=stage_label(self.plan, task.kind, task.layer_start, task.layer_stop),
                start=start,
                end=end,
                compute_s=msg.compute_s,
                upload_s=msg.upload_s,
                download_s=msg.download_s,
                wait_s=msg.wait_s,
                upload_bytes=msg.upload_bytes,
                download_bytes=msg.download_bytes,
            )
            self._tasks.append(record)
            figures = self._steps.setdefault(task.iteration, _StepFigures())
            figures.iteration_end = max(figures.iteration_end or end, end)
            if self._writer is not None:
                self._writer.task(record, task.layer_start, task.layer_stop)

    def optimizer_layer(self, step: int, layer: int, start: float, end: float) -> None:
        """The optimizer updated ``layer`` for ``step`` between ``start`` and ``end``."""
        with self._lock:
            if self._writer is not None:
                self._writer.optimizer(OptimizerRecord(step, layer, start, end))
            left = self._optimizer_layers_left.get(step, self.num_optimizer_layers) - 1
            if left > 0:
                self._optimizer_layers_left[step] = left
                return
            self._optimizer_layers_left.pop(step, None)
            self.optimizer_step = max(self.optimizer_step, step)
            grad_sq = self._grad_sq.pop(step, None)
            if grad_sq is not None and self._tensorboard is not None:
                self._tensorboard.scalar("train/grad_norm", math.sqrt(grad_sq), step)
            figures = self._steps.setdefault(step, _StepFigures())
            figures.optimizer_end = end
            if figures.iteration_end is not None:
                self.latest_optimizer_lag_s = max(0.0, end - figures.iteration_end)

    def collective(
        self, name: str, step: int | None, began: float, entered: float, end: float, nbytes: int
    ) -> None:
        """This node was ready for collective ``name`` at ``began``, every node had
        arrived at ``entered``, and it ended at ``end`` (``time.time()``); ``nbytes``: its
        tensors' size. ``step``: the step of a per-step collective (None: another, e.g. a
        checkpoint's gather)."""
        with self._lock:
            if self._writer is not None:
                self._writer.collective(name, step, began, entered, end, nbytes)

    def iteration_done(self, k: int, num_workers: int | None = None) -> None:
        """Every task of iteration k has completed: step k-1's window is settled.
        ``num_workers``: the workers live now (default: those that completed a task)."""
        with self._lock:
            if num_workers:
                self._live_workers = num_workers
            self._steps.setdefault(k, _StepFigures()).complete = True
            self._settle(k - 1)
            self._forget_before(k - self.keep_steps)

    def step_reported(self, event: ProgressEvent) -> None:
        with self._lock:
            self._steps.setdefault(event.step, _StepFigures()).reported = event
            if self._writer is not None:
                self._writer.step(event, self.num_workers)
        if self._tensorboard is not None:
            self._tensorboard.progress(event)

    def layer_grads(self, step: int, grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """One layer's gradients of ``step``, before the optimizer uses them: summed
        into the step's global gradient norm (only when TensorBoard is on: it reads every
        gradient once more). ``scale``: the float16 loss scale they carry, divided out."""
        if self._tensorboard is None:
            return
        sq = sum(
            (float(torch.linalg.vector_norm(g, dtype=torch.float32)) / scale) ** 2
            for g in grads.values()
        )
        with self._lock:
            self._grad_sq[step] = self._grad_sq.get(step, 0.0) + sq

    def close(self) -> None:
        """Settle the last step, finish the trace segment and the TensorBoard file."""
        with self._lock:
            if self._writer is not None:
                self._writer.stay_in_segment()  # what is left belongs to the last one
            for k in sorted(self._steps):
                # Not a step the run stopped inside (cancelled, paused): its bubble from
                # the tasks it had done was no step's, and the resumed run measures it.
                if self._steps[k].bubble is None and self._steps[k].complete:
                    self._settle(k)
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    # -- figures (read by metrics and status) -------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker_totals(self) -> dict[int, tuple[int, int, int]]:
        """{worker: (tasks done, bytes uploaded, bytes downloaded)} over the job."""
        with self._lock:
            return {
                w: (t.tasks_done, t.upload_bytes, t.download_bytes) for w, t in self.workers.items()
            }

    def recent_tasks(self) -> list[TaskRecord]:
        with self._lock:
            return list(self._tasks)

    # -- internals (under the lock) -------------------------------------------------------

    def _settle(self, k: int) -> None:
        figures = self._steps.get(k)
        before = self._steps.get(k - 1)
        if figures is None or figures.iteration_end is None or figures.bubble is not None:
            return
        if before is not None and before.iteration_end is not None:
            lo = before.iteration_end
        else:  # the run's first step: from its first task's start
            lo = min((t.start for t in self._tasks if t.iteration == k), default=0.0)
        hi = figures.iteration_end
        if hi <= lo:
            return
        workers = self._live_workers or self.num_workers
        bubble, busy = bubble_in_window(self._tasks, (lo, hi), max(1, workers))
        figures.bubble, figures.busy = bubble, busy
        self.latest_bubble, self.latest_bubble_step, self.latest_busy = bubble, k, busy
        if self._writer is not None:
            self._writer.bubble(k, hi, bubble, busy)
        if self._tensorboard is not None:
            self._tensorboard.scalar("pipeline/bubble_fraction", bubble, k)

    def _forget_before(self, k: int) -> None:
        while self._tasks and self._tasks[0].iteration < k:
            self._tasks.popleft()
        for old in [s for s in self._steps if s < k]:
            del self._steps[old]


# --------------------------------------------------------------------------- trace files


class _TraceWriter:
    """Streams Chrome-trace events into segment files (Note [trace segments])."""

    def __init__(
        self,
        directory: Path,
        job_id: str,
        t0: float,
        *,
        segment_steps: int,
        keep_segments: int,
        shown: Callable[[object], str] = str,
    ):
        self.directory = directory
        self._shown = shown
        self.job_id = job_id
        self.t0 = t0
        self.segment_steps = segment_steps
        self.keep_segments = keep_segments
        self._file = None
        self._first = True
        self._segment_start = 0
        self._next_segment: int | None = None  # opened by the next event after a step
        self._failed = False

    def begin(self, first_step: int) -> None:
        self._open(first_step)

    def _open(self, first_step: int) -> None:
        self._finish()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"trace-{first_step:08d}-{int(self.t0 * 1000)}.json"
            self._file = open(self.directory / name, "w", encoding="utf-8")
        except OSError as exc:
            self._disable(exc)
            return
        self._segment_start = first_step
        self._first = True
        self._file.write('{"traceEvents":[\n')
        meta = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": f"job {self.job_id}"}},
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": OPTIMIZER_TID,
                "args": {"name": "optimizer"},
            },
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 1,
                "tid": 0,
                "args": {"sort_index": 1e6},
            },
            # Not a Chrome-trace field: the wall-clock origin of ts, for read_trace.
            {"ph": "M", "name": "roundpipe_origin", "pid": 1, "args": {"epoch_s": self.t0}},
        ]
        for event in meta:
            self._emit(event)
        self._named_workers: set[int] = set()
        self._named_network = False
        self._prune()

    def _prune(self) -> None:
        if self.keep_segments <= 0:
            return
        segments = trace_files(self.directory)
        for old in segments[: max(0, len(segments) - self.keep_segments)]:
            try:
                old.unlink()
            except OSError:
                pass

    def _ts(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def stay_in_segment(self) -> None:
        self._next_segment = None

    def _roll(self) -> None:
        # A new segment opens lazily, so that the job's last step leaves no empty one.
        if self._next_segment is not None:
            first, self._next_segment = self._next_segment, None
            self._open(first)

    def _emit(self, event: dict) -> None:
        self._roll()
        if self._file is None:
            return
        try:
            self._file.write(("" if self._first else ",") + json.dumps(event) + "\n")
        except OSError as exc:
            self._disable(exc)
        self._first = False

    def task(self, r: TaskRecord, layer_start: int, layer_stop: int) -> None:
        self._roll()  # before naming the worker's lane in the segment
        if self._file is None:
            return
        if r.worker not in self._named_workers:
            self._named_workers.add(r.worker)
            self._emit(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 1,
                    "tid": r.worker + 1,
                    "args": {"name": f"worker {r.worker}"},
                }
            )
        self._emit(
            {
                "ph": "X",
                "name": r.label,
                "cat": _KIND_CATEGORY.get(r.kind, r.kind),
                "pid": 1,
                "tid": r.worker + 1,
                "ts": self._ts(r.start),
                "dur": round((r.end - r.start) * 1e6, 1),
                "args": {
                    "step": r.iteration,
                    "worker": r.worker,
                    "task": r.task_id,
                    "attempt": r.attempt,
                    "layers": f"{layer_start}:{layer_stop}",
                    "compute_s": r.compute_s,
                    "upload_s": r.upload_s,
                    "download_s": r.download_s,
                    "wait_s": r.wait_s,
                    "upload_bytes": r.upload_bytes,
                    "download_bytes": r.download_bytes,
                },
            }
        )

    def optimizer(self, r: OptimizerRecord) -> None:
        self._emit(
            {
                "ph": "X",
                "name": f"L{r.layer}",
                "cat": "optimizer",
                "pid": 1,
                "tid": OPTIMIZER_TID,
                "ts": self._ts(r.start),
                "dur": round((r.end - r.start) * 1e6, 1),
                "args": {"step": r.step, "layer": r.layer},
            }
        )

    def collective(
        self, name: str, step: int | None, began: float, entered: float, end: float, nbytes: int
    ) -> None:
        self._roll()  # before naming the lane in the segment
        if self._file is None:
            return
        if not self._named_network:
            self._named_network = True
            self._emit(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 1,
                    "tid": NETWORK_TID,
                    "args": {"name": "network (collectives)"},
                }
            )
        args: dict = {"collective": name, "wait_s": entered - began, "bytes": nbytes}
        if step is not None:
            args["step"] = step
        self._emit(
            {
                "ph": "X",
                "name": name,
                "cat": "collective",
                "pid": 1,
                "tid": NETWORK_TID,
                "ts": self._ts(began),
                "dur": round((end - began) * 1e6, 1),
                "args": args,
            }
        )

    def step(self, event: ProgressEvent, num_workers: int) -> None:
        self._emit(
            {
                "ph": "i",
                "s": "g",
                "name": f"step {event.step}",
                "cat": "step",
                "pid": 1,
                "tid": OPTIMIZER_TID,
                "ts": self._ts(event.time),
                "args": {
                    "step": event.step,
                    "loss": event.loss,
                    "tokens_per_s": event.tokens_per_s,
                    "lr": event.lr,
                    "workers": num_workers,
                },
            }
        )
        if event.step - self._segment_start + 1 >= self.segment_steps:
            self._next_segment = event.step + 1

    def bubble(self, step: int, t: float, bubble: float, busy: dict[int, float]) -> None:
        self._emit(
            {
                "ph": "C",
                "name": "bubble fraction",
                "pid": 1,
                "ts": self._ts(t),
                "args": {"bubble": round(bubble, 4)},
            }
        )
        # Not drawn by viewers; read by read_trace.
        self._emit(
            {
                "ph": "M",
                "name": "roundpipe_step",
                "pid": 1,
                "args": {
                    "step": step,
                    "bubble_fraction": bubble,
                    "busy": {str(w): b for w, b in busy.items()},
                },
            }
        )

    def _finish(self) -> None:
        if self._file is None:
            return
        try:
            self._file.write("]}\n")
            self._file.close()
        except OSError as exc:
            log.warning(
                "[timeline] job %s: closing the trace failed: %s", self.job_id, self._shown(exc)
            )
        self._file = None

    def close(self) -> None:
        self._finish()

    def _disable(self, exc: OSError) -> None:
        # The trace is an aid: a full disk must not fail the job (checkpoints will
        # report it); say so once and stop writing.
        if not self._failed:
            log.warning(
                "[timeline] job %s: cannot write the trace in %s (%s); timeline recording stops",
                self.job_id,
                self._shown(self.directory),
                self._shown(exc),
            )
        self._failed = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = None


def trace_files(directory: Path) -> list[Path]:
    """The trace segments in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m:
            found.append(((int(m.group(2)), int(m.group(1))), directory / name))
    return [path for _, path in sorted(found)]


@dataclass
class Trace:
    """What ``read_trace`` found: the events of every step, newest run first."""

    tasks: list[dict]
    """``ph: X`` events of workers (``tid`` >= 1), the optimizer (``tid`` 0) and, in a
    data-parallel group, the collectives of a step (``tid`` NETWORK_TID)."""
    steps: dict[int, dict]
    """Per step: ``loss``, ``tokens_per_s``, ``lr`` (from the step's instant event) and,
    once settled, ``bubble_fraction`` and ``busy`` (per worker id)."""
    origin: float
    """Wall-clock time of ``ts == 0``, of the newest run."""


def read_trace(
    directory: Path, steps: Sequence[int] | None = None, *, newest_segments: int | None = None
) -> Trace:
    """Read the trace segments in ``directory`` (complete or still being written).

    ``steps``: keep only the events of these steps; ``newest_segments``: read only that
    many of the newest files (enough to find the latest steps of a long job). Times are
    converted to the newest run's origin. Raises FileNotFoundError if there is no trace.
    """
    files = trace_files(directory)
    if newest_segments is not None:
        files = files[-newest_segments:]
    if not files:
        raise FileNotFoundError(
            f"no timeline trace in {directory} (is it a job's output directory? a job writes "
            f"{TRACE_DIR}/trace-*.json unless output.timeline is false)"
        )
    wanted = None if steps is None else set(steps)
    by_step: dict[int, tuple[int, list[dict]]] = {}  # step -> (run, events)
    step_info: dict[int, tuple[int, dict]] = {}
    origins: dict[int, float] = {}
    for path in files:
        run = int(_SEGMENT_RE.match(path.name).group(2))  # type: ignore[union-attr]
        origin = run / 1000
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip().lstrip(",")
                if not line.startswith("{") or line.startswith('{"traceEvents"'):
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                name, ph, args = event.get("name"), event.get("ph"), event.get("args") or {}
                if ph == "M" and name == "roundpipe_origin":
                    origin = float(args.get("epoch_s", origin))
                    origins[run] = origin
                    continue
                step = args.get("step")
                if not isinstance(step, int) or (wanted is not None and step not in wanted):
                    continue
                if ph == "X":
                    event["ts"] = event["ts"] + origin * 1e6  # absolute, for now
                    held = by_step.get(step)
                    if held is None or held[0] < run:
                        by_step[step] = (run, [event])
                    elif held[0] == run:
                        held[1].append(event)
                elif ph == "i" or (ph == "M" and name == "roundpipe_step"):
                    held_info = step_info.get(step)
                    if held_info is None or held_info[0] < run:
                        step_info[step] = (run, {})
                    info = step_info[step][1]
                    if step_info[step][0] == run:
                        info.update({k: v for k, v in args.items() if k != "step"})
    newest = max(origins) if origins else max(run for run, _ in by_step.values() or [(0, [])])
    origin = origins.get(newest, newest / 1000)
    tasks = []
    for _, events in by_step.values():
        for event in events:
            event["ts"] = event["ts"] - origin * 1e6
            tasks.append(event)
    tasks.sort(key=lambda e: e["ts"])
    return Trace(
        tasks=tasks, steps={s: info for s, (_, info) in sorted(step_info.items())}, origin=origin
    )
