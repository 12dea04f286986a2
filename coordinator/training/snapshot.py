"""Checkpoints that do not stop training: each layer's state is copied into staging right
after its update, and a background thread writes the checkpoint while the pipeline runs.

Note [background checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The state Note [checkpoint cut] (coordinator/training/checkpointer.py) lists is, per trainable layer
l: the fp32 masters and the optimizer moments after step k, and the compute-dtype
W_{k-1} in params[(k-1) % 2]. The optimizer thread is their only writer, and it next
writes them in step k+1 of layer l. So a copy taken *in the optimizer thread* right
after the step-k update of l (after its version is published: the copy only reads, and
the next forward may already read params[k % 2]) is exactly the cut's state of l.
Nothing drains: iteration k+1 and later run while layers are captured and written.

The rest of the cut is taken elsewhere, at the moment it holds:

* the data cursor, the RNG state and the plan by the run loop when it dispatches
  iteration k (the loader then stands at step k+1; no optimizer step k can have run,
  since it needs iteration k's gradients), in ``begin``;
* the progress history once step k has been reported (``reported``).

The writer thread waits for all of them, then writes through ``CheckpointDir.write``
as a drained checkpoint is written (Note [atomic checkpoint]: temporary directory,
fsync, rename, ``latest``), so crash safety and verification are unchanged; like a
drained one it writes through the output directory checked and held open for the whole
write (``JobOutput.pinned``), so a directory swapped for a link meanwhile gets
nothing. The run loop learns of each result from a ``CheckpointSettled`` in its inbox
(roundpipe.coordinator.training.job_events) and announces it as ``CheckpointWritten``.

Bounded memory: the staging buffers hold one checkpoint's state. They are allocated on
the first checkpoint and reused. A checkpoint begun while the previous one is still
being written gets staging when that write ends: until then its first capture waits
(the optimizer thread, and through the version counters the pipeline, waits for the
disk), and a third is not begun (the run loop waits, still handling task completions).
So a writer that falls behind delays training instead of growing memory, and it has
until the optimizer reaches the next checkpoint step, not only until that iteration is
dispatched.

Fault point (tests, docs/fault-tolerance.md): ``ROUNDPIPE_CHECKPOINT_FAULT`` makes the
writer stop in the middle of a write, between the model files and the training state
(the ``check_abort`` call), with the temporary directory on disk and nothing renamed::

    ROUNDPIPE_CHECKPOINT_FAULT="stall@step=3,marker=/tmp/reached"   # wait until closed
    ROUNDPIPE_CHECKPOINT_FAULT="hold@step=3,marker=/tmp/reached"    # until it is removed
    ROUNDPIPE_CHECKPOINT_FAULT="kill@step=3"                        # SIGKILL the process

``stall`` waits until the job stops (``close``: the write is then abandoned as any
other); ``hold`` waits until its marker is removed (or the job stops), then the write
goes on: a write that takes as long as a test needs; ``kill`` is a crash at that point.
``step`` (optional) picks the checkpoint; ``marker`` (optional, last: the rest of the
value is its path; ``hold`` needs one) is created when the
point is reached, before the action, so a test can act on a write that is provably in
flight. It fires once per writer (one job run); drained checkpoints have no such point.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT_FAULT_ENV",
    "BackgroundCheckpoints",
    "CheckpointAborted",
    "LayerState",
    "WriterFault",
    "parse_writer_fault",
]

log = logging.getLogger(__name__)

LayerState = Mapping[int, Mapping[str, torch.Tensor]]
"""``{layer: {key: tensor}}``: a checkpoint's per-layer tensors (``master/<name>``,
``exp_avg/<name>``, ..., ``prev/<name>``), live views or staged copies."""


class CheckpointAborted(RuntimeError):
    """A background checkpoint was abandoned (the job stopped); nothing was published."""


CHECKPOINT_FAULT_ENV = "ROUNDPIPE_CHECKPOINT_FAULT"


@dataclass
class WriterFault:
    """The writer's fault point (module docstring): ``action`` at ``step`` (any if None)."""

    action: str  # "stall", "hold" or "kill"
    step: int | None = None
    marker: Path | None = None
    fired: bool = False


def parse_writer_fault(text: str | None) -> WriterFault | None:
    """Parse ``ACTION@step=N,marker=PATH`` (both optional); raise ValueError if malformed."""
    if not text:
        return None
    action, _, rest = text.partition("@")
    if action not in ("stall", "hold", "kill"):
        raise ValueError(f"{CHECKPOINT_FAULT_ENV}: action {action!r} must be stall, hold or kill")
    fault = WriterFault(action)
    while rest:
        if rest.startswith("marker="):
            fault.marker, rest = Path(rest[len("marker=") :]), ""
            continue
        part, _, rest = rest.partition(",")
        key, _, value = part.partition("=")
        if key != "step" or not value.isdigit():
            raise ValueError(
                f"{CHECKPOINT_FAULT_ENV}: {part!r} must be step=N or (last) marker=PATH"
            )
        fault.step = int(value)
    if action == "hold" and fault.marker is None:
        raise ValueError(f"{CHECKPOINT_FAULT_ENV}: hold needs marker=PATH (it holds until removed)")
    return fault


class BackgroundCheckpoints:
    """One checkpoint at a time, captured layer by layer, written by a background thread.

    ``sources(step)`` gives the live tensors that make up checkpoint ``step`` (the same
    keys and shapes for every step). ``write(step, staged, context)`` writes the
    checkpoint from the staged copies and returns its path; it runs in the writer thread
    and may call ``check_abort()`` between files. ``on_settled()`` is called in the
    writer thread whenever a checkpoint has been written or has failed (the trainer
    puts a ``CheckpointSettled`` into its run loop's inbox).
    """

    def __init__(
        self,
        sources: Callable[[int], LayerState],
        write: Callable[[int, LayerState, Any], Path | None],
        on_settled: Callable[[], None],
        *,
        name: str = "rp-checkpoint-writer",
    ):
        self._sources = sources
        self._write = write
        self._on_settled = on_settled
        self._staging: dict[int, dict[str, torch.Tensor]] | None = None
        self._cv = threading.Condition()
        self._step: int | None = None  # the checkpoint that owns staging, until settled
        self._context: Any = None
        self._pending: set[int] = set()  # layers of it not captured yet
        self._next: tuple[int, Any] | None = None  # begun, waiting for staging
        self._reported = 0
        self._finished: list[tuple[int, Path | None]] = []
        self._failed: tuple[int, BaseException] | None = None
        self._closed = False
        self._fault = parse_writer_fault(os.environ.get(CHECKPOINT_FAULT_ENV))
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a checkpoint is begun and not yet written (or failed)."""
        with self._cv:
            return self._step is not None or self._next is not None

    def busy_before(self, step: int) -> bool:
        """Whether a checkpoint of a step before ``step`` is begun and not yet written (or
        failed): a job that stops at ``step`` lets it finish (Note [diverged training])."""
        with self._cv:
            steps = (self._step, self._next[0] if self._next is not None else None)
            return any(s is not None and s < step for s in steps)

    @property
    def can_begin(self) -> bool:
        """Whether ``begin`` may be called: no begun checkpoint is waiting for staging."""
        with self._cv:
            return self._next is None

    def begin(self, step: int, context: Any) -> None:
        """Start checkpoint ``step``: its layers are captured as ``capture(step, layer)``
        is called for each. ``context`` (cursor, RNG, ...) goes to ``write``. If the
        previous checkpoint is still being written, this one waits for its staging: its
        first capture blocks until then. Only when ``can_begin``."""
        with self._cv:
            if self._next is not None:
                raise RuntimeError(f"checkpoint {self._next[0]} is still waiting for staging")
            if self._staging is None:  # once: the same shapes every step
                self._staging = {
                    layer: {key: torch.empty_like(t) for key, t in per.items()}
                    for layer, per in self._sources(step).items()
                }
            self._next = (step, context)
            self._activate_next()

    def _activate_next(self) -> None:
        """Give staging to the waiting checkpoint if it is free (lock held)."""
        if self._step is None and self._next is not None:
            (self._step, self._context), self._next = self._next, None
            assert self._staging is not None
            self._pending = set(self._staging)
            self._cv.notify_all()

    def capture(self, step: int, layer: int) -> None:
        """In the optimizer thread, right after step ``step`` of ``layer`` is written:
        copy the layer's state into staging if checkpoint ``step`` is begun, first
        waiting for the previous checkpoint's write if it still holds staging (bounded
        memory: the optimizer, and so the pipeline, waits for the disk then)."""
        with self._cv:
            if self._next is not None and self._next[0] == step:
                started = time.perf_counter()
                while self._next is not None and self._next[0] == step and not self._closed:
                    self._cv.wait()  # until the previous write ends and this one is active
                waited = time.perf_counter() - started
                if waited > 0.01:
                    log.info(
                        "[checkpoint] checkpoint step %d waited %.2fs for the previous one "
                        "to be written (staging holds one checkpoint)",
                        step,
                        waited,
                    )
            if self._step != step or layer not in self._pending:
                return
            assert self._staging is not None
            staged = self._staging[layer]
        for key, live in self._sources(step)[layer].items():
            staged[key].copy_(live)
        with self._cv:
            self._pending.discard(layer)
            self._cv.notify_all()

    def reported(self, step: int) -> None:
        """Step ``step``'s progress event exists (the manifest's history may end there)."""
        with self._cv:
            self._reported = max(self._reported, step)
            self._cv.notify_all()

    def take_settled(
        self,
    ) -> tuple[list[tuple[int, Path | None]], tuple[int, BaseException] | None]:
        """Checkpoints written since the last call ((step, path), oldest first), and
        (step, error) of one that could not be written, if any (each returned once)."""
        with self._cv:
            finished, self._finished = self._finished, []
            failed, self._failed = self._failed, None
            return finished, failed

    def check_abort(self) -> None:
        """Raise CheckpointAborted if ``close`` was called (for ``write``). The fault
        point (module docstring) is here: mid-write, in the writer thread."""
        if self._fault is not None:
            self._fault_point(self._fault)
        if self._closed:
            raise CheckpointAborted("the job stopped while a checkpoint was being written")

    def wait_unless_closed(self, seconds: float) -> None:
        """Wait ``seconds`` before a checkpoint is tried again (Note [out of
        descriptors] in roundpipe.coordinator.training.job_output); raise
        CheckpointAborted at once if ``close`` is called meanwhile."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed, timeout=seconds)
            if self._closed:
                raise CheckpointAborted("the job stopped while a checkpoint was being written")

    def _fault_point(self, fault: WriterFault) -> None:
        with self._cv:
            step = self._step
        if fault.fired or fault.step not in (None, step):
            return
        fault.fired = True
        log.warning("[checkpoint] fault point: %s while writing checkpoint %s", fault.action, step)
        if fault.marker is not None:  # whole or absent: a watcher may read it at once
            part = fault.marker.with_name(fault.marker.name + ".part")
            part.write_text(f"{step}\n")
            os.replace(part, fault.marker)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        held = fault.action == "hold"  # until the marker is removed, then the write goes on
        with self._cv:
            while not self._closed and not (held and not fault.marker.exists()):
                self._cv.wait(timeout=0.05 if held else None)

    def close(self) -> None:
        """Stop the writer: an unfinished checkpoint is abandoned at its next file (its
        temporary directory removed; ``latest`` untouched). Waits for the thread, so no
        write reads memory the caller frees next."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _ready(self) -> bool:
        return self._step is not None and not self._pending and self._reported >= self._step

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._ready()):
                    self._cv.wait()
                if self._closed:
                    return
                step, context = self._step, self._context
            assert step is not None and self._staging is not None
            try:
                path = self._write(step, self._staging, context)
            except BaseException as exc:  # surfaced by the run loop (take_settled)
                if not isinstance(exc, CheckpointAborted):
                    log.warning("[checkpoint] background checkpoint %d failed: %s", step, exc)
                with self._cv:
                    self._failed, self._step = (step, exc), None
                    self._next = None  # the job stops: the run loop raises the error
                    self._cv.notify_all()  # a capture waiting for staging gives up
            else:
                with self._cv:
                    self._finished.append((step, path))
                    self._step = None
                    self._activate_next()
            self._on_settled()
