"""Weight prefetch: the next queued task's weights go up while the current one computes.

Note [weight prefetch]
    While task k computes, the weights of the task queued next on this worker are
    uploaded (one stage ahead; two stages resident) as soon as that task's version
    waits are met, if the device has room. The upload is keyed by the task (job, id,
    attempt, weight version, layer range) and used only by exactly that task: a
    re-dispatched attempt, another task, or a torn-down job discards it. Its data is as
    valid as an upload made when the task starts: the same version waits were met, and
    the params parity it read is not rewritten before this task's iteration has
    finished with it (Note [weight-update ordering], point 3; with the single copy of
    staleness 0, Note [weight copies] in roundpipe.coordinator.training.layout).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping

from roundpipe.protocol import StageTask
from roundpipe.worker.job_state import JobState
from roundpipe.worker.transfer import Priority, TransferEngine, Upload

__all__ = ["WeightPrefetcher"]

log = logging.getLogger(__name__)


def _over(dropped: tuple[str, threading.Thread | None, Upload | None]) -> bool:
    """Whether a dropped prefetch no longer touches its job's arenas."""
    _job, thread, upload = dropped
    return (thread is None or not thread.is_alive()) and (upload is None or upload.done())


def _task_key(task: StageTask) -> tuple:
    """What a prefetched upload is for: exactly this attempt of this task, at this weight
    version over these layers (Note [weight prefetch])."""
    return (
        task.job_id,
        task.task_id,
        task.attempt,
        task.weight_version,
        task.layer_start,
        task.layer_stop,
    )


class WeightPrefetcher:
    """Uploads the next queued task's weights while the current one computes.

    Note [weight prefetch]. A small thread per armed task waits for the task's version
    counters (they are often met already), then issues the upload at weight priority.
    """

    def __init__(
        self,
        engine: TransferEngine,
        jobs: Mapping[str, JobState],
        should_abort: Callable[[], bool],
        worker_id: int,
    ) -> None:
        self.engine = engine
        self.jobs = jobs  # the worker's jobs, by id (the same dict, kept up to date)
        self.should_abort = should_abort  # the worker is stopping
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._upload: Upload | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self.used = 0
        """Prefetched uploads a task used (for tests and logs)."""
        self.discarded = 0
        """Prefetched uploads thrown away: stale, for another task, or the job ended."""
        # The most recent prefetched upload issued, weakly: held, it would keep a whole
        # stage's device weights alive on an idle worker after the task or job ended.
        self._last: weakref.ref[Upload] | None = None
        # Prefetches dropped without waiting (another task came first, or another was
        # armed), still maybe copying from their job's arenas: a teardown of that job
        # waits for them too (discard(job, wait=True)), or it unmapped the arenas under
        # a running copy.
        self._dropped: list[tuple[str, threading.Thread | None, Upload | None]] = []

    def arm(self, task: StageTask) -> None:
        engine = self.engine
        state = self.jobs.get(task.job_id)
        key = _task_key(task)
        if engine.kind == "cpu" or state is None:  # a CPU worker's "upload" is a view
            return
        with self._lock:
            if self._key == key:
                return
        self.discard()
        weights = state.task_weights(task)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        if not engine.memory_free_for(nbytes):
            log.debug("[worker %d] no room to prefetch task %d", self.worker_id, task.task_id)
            return
        cancel = threading.Event()
        thread = threading.Thread(
            target=self._fetch,
            args=(state, task, key, weights, cancel),
            name=f"rp-prefetch-{task.task_id}",
            daemon=True,
        )
        with self._lock:
            self._key, self._upload, self._cancel, self._thread = key, None, cancel, thread
        thread.start()

    def _fetch(self, state, task, key, weights, cancel: threading.Event) -> None:
        try:
            for wait in task.weight_waits:
                state.events.wait_at_least(
                    wait.counter,
                    wait.at_least,
                    task.wait_timeout_s,
                    should_abort=lambda: cancel.is_set() or self.should_abort(),
                )
        except Exception:  # noqa: BLE001 - cancelled or timed out: the task waits itself
            return
        with self._lock:
            if cancel.is_set() or self._key != key:
                return
            self._upload = self.engine.upload(weights, Priority.WEIGHT)
            self._last = weakref.ref(self._upload)

    @property
    def last(self) -> Upload | None:
        """The most recent prefetched upload issued, while something else holds it (for
        tests)."""
        return None if self._last is None else self._last()

    def take(self, task: StageTask) -> Upload | None:
        """The prefetched upload of exactly this task, if it was issued; else None (and
        whatever was prefetched is discarded)."""
        key = _task_key(task)
        with self._lock:
            if self._key == key and self._upload is not None:
                upload, self._key, self._upload = self._upload, None, None
                self.used += 1
                return upload
        self.discard()
        return None

    def discard(self, job_id: str | None = None, *, wait: bool = False) -> None:
        """Drop the armed prefetch (only if it belongs to ``job_id``, when given). With
        ``wait``, return only once nothing of it touches the job's arenas any more (its
        thread has stopped waiting on the event table, its copy has landed): a job's
        arenas are unmapped right after."""
        with self._lock:
            pending = []
            if wait:  # what was dropped earlier still counts until it is over
                pending = [d for d in self._dropped if job_id is None or d[0] == job_id]
                self._dropped = [d for d in self._dropped if d not in pending]
            armed = self._key is not None and (job_id is None or self._key[0] == job_id)
            if armed:
                assert self._key is not None
                self._cancel.set()
                upload, key, self._key, self._upload = self._upload, self._key, None, None
                thread, self._thread = self._thread, None
                self.discarded += 1
                if not wait:
                    self._dropped = [d for d in self._dropped if not _over(d)]
                    self._dropped.append((key[0], thread, upload))
                pending.append((key[0], thread, upload))
        # No upload can be issued any more: _fetch issues under the lock, if not cancelled.
        for _job, thread, upload in pending:
            if wait:
                if thread is not None:
                    thread.join()
                if upload is not None:
                    upload.wait_landed()
        if armed and upload is not None:
            upload.then(upload.discard, always=True)
