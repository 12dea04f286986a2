"""Everything between shared memory and the device: one transfer engine per worker.

The executor computes on device tensors and hands device tensors back; this module moves
them. ``WorkerCore`` (roundpipe.worker.runtime) asks the engine to upload a stage's
weights and each microbatch's activations, and to download outputs, saved inputs, input
gradients, weight gradients and losses; the engine says when a copy has landed, and only
then does the runtime store the event-table counter that covers it.

Three backends, one interface (``TransferEngine``), chosen per worker
(``make_engine`` and ``roundpipe-worker --gpu / --cpu [--emulate-pcie BW]``):

``cpu``
    Today's CPU worker: the "device" is host memory, an upload is the arena view itself
    and a download is a copy done on the spot. No threads.
``emulated``
    A real asynchronous engine for machines without a GPU. Each direction of the bus is
    a *link*: a thread that takes copies off a priority queue one chunk at a time, holds
    each chunk for ``latency + bytes / bandwidth`` and only then copies it, so data that
    is read before its completion was reported is visibly stale. Uploads land in private
    tensors (a device's memory is not the arena). Completion callbacks run on the link
    thread. Tests and the CPU benchmarks run the scheduling logic of the CUDA backend
    through it: priorities, chunking, prefetch, completion-before-counter.
``cuda``
    Arenas registered in place once per worker (``cudaHostRegister``; unregistered at
    teardown), so copies are DMA. Streams: compute (the compute thread's current
    stream); activation upload (high priority); weight upload (low priority); download.
    The same link threads issue the copies on those streams, keep at most a small window
    of chunks in flight per direction, and wait for their CUDA events; completion
    callbacks run there, never on the compute thread.

Note [priority-aware transfers]
    A copy engine serves copies roughly in the order they were issued, whatever the
    stream's priority. If a stage's weights (hundreds of MB) were issued at once, the
    next microbatch's activation (a few MB, on the critical path) would wait behind all
    of them. So a link never issues more than ``window`` chunks ahead, and weight copies
    are split into ``chunk_bytes`` pieces: an activation upload arriving while weights
    stream in waits for at most ``window`` chunks. Downloads likewise put activations
    (the next stage on another worker waits for them) before weight gradients (only the
    optimizer waits for those, and it has a whole iteration).

Note [counter after landing]
    A download's completion callback is where the runtime stores the counter that
    publishes the data, so a counter is never stored before its bytes are in the arena.
    On a GPU the callback runs after the copy's CUDA event completed; on the emulated
    link after the delayed copy was done. Within one priority a link completes copies in
    the order they were queued, so a callback also knows every earlier copy of its
    priority has landed. This holds for weight gradients and losses (the CPU coordinator
    reads them) and on the ``cpu`` backend; activation hand-offs between workers on the
    ``emulated`` and ``cuda`` backends follow Note [activation hand-off] instead.

Note [activation hand-off]
    The act and dact counters are stored when the copy is *issued*, not when it landed
    (roundpipe.shared.handoff has the protocol and its safety rules): the download's
    ``on_issue`` runs on the link thread right after the copy's last chunk was issued
    (CUDA: after recording the next event of this process's interprocess ring on the
    download stream) and writes the ticket, then the counter; ``then`` stores the
    landed mark once the bytes are there. A consumer's upload of such an input carries
    the hand-offs (``wait_for``) and its *link* waits for them, never its compute
    thread: on CUDA ``cudaStreamWaitEvent`` of the activation-upload stream on the
    producer's event (skipped if the landed mark is already there), then a copy whose
    completion the link polls against the wait timeout; on the emulated bus the link
    blocks until the landed mark arrives and only then takes the source bytes, so an
    upload that skipped the wait (``_EmulatedLink.wait_for_producers = False``, a test
    switch) copies the stale slot, and the tests see it.

    Why a ring of 64 events is enough: a slot is re-recorded after 64 more hand-off
    copies of the same process, and a d2h link keeps at most ``window`` (2) copies in
    flight, so by then the slot's copy landed long ago and its landed mark is set; a
    consumer checks the landed mark before touching the event and skips the event when
    it is set. Only a consumer that read "not landed" and is then descheduled while the
    producer lands 60 more copies could capture a later record of the same download
    stream, which is still correct (the later copy completes after the earlier one).

Note [compute waits on the device]
    On CUDA the compute thread does not wait for an upload to land: ``tensors()`` waits
    only until the link has *issued* every chunk, then makes the compute stream wait on
    the event recorded after the last chunk (one transfer's chunks all go on one stream,
    in order, so that event covers them all). The host thread goes on enqueueing kernels;
    the device orders them after the copy. For an activation that follows a producer's
    copy (Note [activation hand-off]) the chain is device-only: producer's copy, its
    interprocess event, this worker's upload stream, its event, the compute stream.
    The host engines (``cpu``, ``emulated``) have no device queue, so there the compute
    thread waits for the landing itself (``TransferEngine.wait_usable``). An error the
    link finds after issue (a failed copy, a producer that died: Note [dead producers and
    imported events]) fails the task when its copies are collected; a stream stuck on a
    dead producer's event makes the worker exit (its context goes with it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from roundpipe.shared.handoff import Handoff, HandoffLost, IssueMark

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "CpuEngine",
    "CudaEngine",
    "EmulatedEngine",
    "Priority",
    "Stopwatch",
    "Transfer",
    "TransferEngine",
    "Upload",
    "make_engine",
    "parse_duration",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
"""Weight copies are split into pieces of this size. Note [priority-aware transfers]."""


class Priority(IntEnum):
    """Lower goes first on a link."""

    ACTIVATION = 0
    """Activations and their gradients: the next stage waits for them."""
    WEIGHT = 1
    """Weights (up) and weight gradients and losses (down)."""


def parse_duration(text: str | float) -> float:
    """``"20us"`` -> 2e-5, ``"1.5ms"`` -> 0.0015, ``"0.2s"`` / ``"0.2"`` -> 0.2 seconds."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?\s*", text)
        if m is None:
            raise ValueError(f"cannot read duration {text!r}: expected e.g. 20us, 1.5ms, 0.2s")
        value = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
    if value < 0:
        raise ValueError(f"a duration cannot be negative, got {text!r}")
    return value


# --------------------------------------------------------------------------- handles


class Transfer:
    """Completion handle of one copy (of one or more tensors).

    ``wait()`` blocks until every byte has landed and re-raises a copy's error;
    callbacks added with ``then`` run once, on the link's thread, after landing (at
    once, on the caller's thread, if it has already landed). A copy that failed runs
    only the callbacks added with ``always=True``: a counter must never publish it.
    """

    def __init__(self, chunks: int, nbytes: int) -> None:
        self._lock = threading.Lock()
        self._left = chunks
        self._finished = chunks == 0  # under _lock: callbacks taken (or none to take)
        self._done = threading.Event()  # set after the callbacks ran: wait() sees their effects
        self._callbacks: list[tuple[Callable[[], None], bool]] = []
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        """When the link began the first chunk (host clock)."""
        self.finished_at: float | None = None
        """When the last chunk landed (host clock)."""
        self.link_s = 0.0
        """Seconds the link spent on this copy's chunks."""
        self._unissued = chunks
        self._on_issue: Callable[[object], None] | None = None
        self.issued_at: float | None = None
        """When the link had issued every chunk (and ran ``on_issue``)."""
        self.handoff_wait_s = 0.0
        """Seconds the link waited for producers' copies before this upload could start
        (Note [activation hand-off])."""
        self.cancelled = threading.Event()
        """Set by ``cancel``: a link waiting for a producer's copy on its behalf gives up."""
        self._issued = threading.Event()  # every chunk issued, or the copy is over
        self.last_token: object | None = None
        """CUDA: the event recorded after the last chunk issued so far, on the copy's
        stream (it covers the earlier chunks: one stream, in order)."""
        if chunks == 0:
            self.started_at = self.finished_at = self.queued_at
            self._issued.set()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"a {self.nbytes}-byte copy did not land within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def wait_landed(self, timeout_s: float | None = None) -> bool:
        """Block until the copy is over, successful or not (never raises); False if
        ``timeout_s`` passed first."""
        return self._done.wait(timeout_s)

    def wait_issued(self, timeout_s: float | None = None) -> bool:
        """Block until every chunk is issued (or the copy is over); False on timeout."""
        return self._issued.wait(timeout_s)

    def cancel(self) -> None:
        """Stop waiting for producers' copies (the task gave up); the copy then fails
        unless it already started. Harmless on a copy that waits for nothing."""
        self.cancelled.set()

    def then(self, callback: Callable[[], None], *, always: bool = False) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append((callback, always))
                return
        if always or self.error is None:
            callback()

    # -- link side ----------------------------------------------------------------

    def _chunk_issued(self, context: object) -> None:
        """A chunk is on its way (link thread); after the last one, ``on_issue`` runs."""
        self._unissued -= 1
        if self._unissued:
            return
        self.issued_at = time.perf_counter()
        try:
            if self._on_issue is not None:
                callback, self._on_issue = self._on_issue, None
                callback(context)
        finally:
            self._issued.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def _chunk_started(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now

    def _chunk_done(self, seconds: float, error: BaseException | None = None) -> None:
        with self._lock:
            self.link_s += seconds
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left > 0:
                return
            self.finished_at = time.perf_counter()
            callbacks, self._callbacks = self._callbacks, []
            self._finished = True
        for cb, always in callbacks:
            if not (always or self.error is None):
                continue
            try:
                cb()
            except Exception:  # a callback's failure must not kill the link
                log.exception("transfer completion callback failed")
        self._issued.set()  # a chunk that failed to issue never set it
        self._done.set()


class Upload(Transfer):
    """An upload: ``tensors()`` gives the device tensors once they may be computed on."""

    def __init__(
        self,
        engine: TransferEngine,
        dst: dict[str, torch.Tensor],
        chunks: int,
        nbytes,
        follows: Sequence[Handoff] = (),
    ):
        super().__init__(chunks, nbytes)
        self._engine = engine
        self._dst = dst
        self.follows = tuple(follows)
        """The producers' copies this upload waits for (Note [activation hand-off])."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The uploaded tensors, usable on the caller's (compute) stream."""
        self._engine._ready_for_compute(self)
        return self._dst

    def discard(self) -> None:
        """Drop the device copies. Call it once the upload has landed (``then``), so no
        copy writes into freed memory."""
        self._dst = {}


class Stopwatch:
    """Per-key compute time of one task (host clock; ``CudaStopwatch`` uses CUDA events)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._open: dict[int, float] = {}

    def start(self, key: int) -> None:
        self._open[key] = time.perf_counter()

    def stop(self, key: int) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - self._open.pop(key)

    def resolve(self) -> dict[int, float]:
        """Seconds per key; on a GPU only once the timed work has finished."""
        return dict(self.seconds)


# --------------------------------------------------------------------------- links


@dataclass(order=True)
class _Chunk:
    priority: int
    seq: int
    src: torch.Tensor = field(compare=False)
    dst: torch.Tensor = field(compare=False)
    transfer: Transfer = field(compare=False)
    after: Callable[[], None] | None = field(compare=False, default=None)
    """CUDA: makes the link's stream wait for the producer of ``src`` (compute)."""
    handoffs: tuple = field(compare=False, default=())
    """Producers' copies (roundpipe.shared.handoff.Handoff) this upload must follow."""
    queued_at: float = field(compare=False, default_factory=time.perf_counter)
    """When the chunk was put on its link (the emulated bus may start it from then)."""


class _Link(ABC):
    """One direction of the bus: a thread serving chunks by (priority, arrival)."""

    def __init__(self, name: str, window: int) -> None:
        self.name = name
        self.window = window
        self._cv = threading.Condition()
        self._heap: list[_Chunk] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(
        self,
        priority: int,
        pieces: Iterable[tuple[torch.Tensor, torch.Tensor]],
        transfer,
        after=None,
        handoffs: tuple = (),
    ) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"transfer link {self.name} is closed")
            for src, dst in pieces:
                heapq.heappush(
                    self._heap,
                    _Chunk(priority, next(self._seq), src, dst, transfer, after, handoffs),
                )
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        self._thread_setup()
        inflight: list[tuple[_Chunk, object, float]] = []
        while True:
            with self._cv:
                while not self._heap and not inflight and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap and not inflight:
                    return
                chunk = heapq.heappop(self._heap) if self._heap else None
            if chunk is not None:
                started = time.perf_counter()
                chunk.transfer._chunk_started(started)
                try:
                    token = self._issue(chunk)
                except BaseException as exc:  # noqa: BLE001 - reported through the handle
                    chunk.transfer._chunk_done(time.perf_counter() - started, exc)
                    continue
                inflight.append((chunk, token, started))
                try:
                    chunk.transfer._chunk_issued(self._issue_context(chunk))
                except BaseException as exc:  # noqa: BLE001 - fails the copy when it is over
                    log.exception("a transfer's issue callback failed")
                    chunk.transfer._fail(exc)
            # Issue up to ``window`` chunks ahead; finish the oldest when the window is
            # full or nothing else is queued.
            if inflight and (len(inflight) >= self.window or chunk is None):
                done, token, started = inflight.pop(0)
                error = None
                try:
                    self._finish(done, token)
                except BaseException as exc:  # noqa: BLE001
                    error = exc
                done.transfer._chunk_done(time.perf_counter() - started, error)

    def _thread_setup(self) -> None:  # noqa: B027 - optional hook
        pass

    def _issue_context(self, chunk: _Chunk) -> object:
        """What a transfer's ``on_issue`` gets (CUDA: the stream its copy went on)."""
        return None

    @abstractmethod
    def _issue(self, chunk: _Chunk) -> object:
        """Start the chunk's copy; return what ``_finish`` needs."""

    @abstractmethod
    def _finish(self, chunk: _Chunk, token: object) -> None:
        """Block until the chunk's copy has landed."""


class _EmulatedLink(_Link):
    """Takes each chunk's source bytes when the chunk starts (as DMA reads its source
    during the copy), holds it for latency + bytes / bandwidth, and only then writes the
    destination. So a consumer that reads before a producer's copy was reported landed
    gets stale bytes, and its own copy does not wait long enough to hide it: which is
    what the tests look for.

    Note [emulated bus clock]
        The link keeps the time at which the bus becomes free. A chunk starts at the
        later of that time and the moment it was queued, and lands ``latency + bytes /
        bandwidth`` after its start, as on a real bus that serves copies back to back.
        The link thread's own costs (taking the source, writing the destination, waking
        from sleep late, Python) therefore overlap the emulated transfer instead of
        adding to it: measured on a loaded 2-core machine, per-chunk sleeps made 72 KB
        chunks take 1.2x and 1 MB chunks 2.2x the configured time; with the clock, a run
        of chunks takes the configured time whenever those costs fit inside it.
    """

    def __init__(self, name: str, bandwidth: float, latency_s: float) -> None:
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self._free_at = 0.0  # perf_counter time the emulated bus becomes free
        self.wait_for_producers = True
        """Test switch: False makes uploads skip their hand-off waits (a broken consumer,
        which the tests must catch)."""
        super().__init__(name, window=1)

    def _issue(self, chunk: _Chunk) -> object:
        # Note [activation hand-off]: the model of cudaStreamWaitEvent. This link (not
        # the compute thread) waits until the producers' copies have landed.
        waited_until = 0.0
        if chunk.handoffs and self.wait_for_producers:
            started = time.perf_counter()
            abort = chunk.transfer.cancelled.is_set
            if any([h.wait_landed(should_abort=abort) for h in chunk.handoffs]):
                waited_until = time.perf_counter()
                chunk.transfer.handoff_wait_s += waited_until - started
        nbytes = chunk.src.numel() * chunk.src.element_size()
        if not nbytes:
            return None
        start = max(self._free_at, chunk.queued_at, waited_until)
        self._free_at = start + self.latency_s + nbytes / self.bandwidth
        return chunk.src.clone(), self._free_at

    def _finish(self, chunk: _Chunk, token: object) -> None:
        if token is None:
            return
        taken, land_at = token  # type: ignore[misc]
        delay = land_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        chunk.dst.copy_(taken)


_DEAD_GRACE_S = 2.0
"""How long a CUDA upload may still wait on a producer's event after the producer's
process is seen gone without its landed mark (Note [dead producers and imported events])."""


class _CudaLink(_Link):
    def __init__(
        self,
        name: str,
        engine: CudaEngine,
        streams: Mapping[int, object],
        window: int,
    ) -> None:
        self.engine = engine
        self.device = engine.device
        self.streams = streams
        super().__init__(name, window=window)

    def _thread_setup(self) -> None:
        torch.cuda.set_device(self.device)

    def _issue(self, chunk: _Chunk) -> object:
        stream = self.streams[chunk.priority]
        with torch.cuda.stream(stream):
            if chunk.after is not None:
                chunk.after(stream)
            for handoff in chunk.handoffs:  # Note [activation hand-off]
                self.engine._wait_for_producer(handoff, stream, chunk.transfer.cancelled.is_set)
            chunk.dst.copy_(chunk.src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        chunk.transfer.last_token = event  # Note [compute waits on the device]
        return event

    def _issue_context(self, chunk: _Chunk) -> object:
        return self.streams[chunk.priority]

    def _finish(self, chunk: _Chunk, token: object) -> None:
        if not chunk.handoffs:
            token.synchronize()  # type: ignore[attr-defined]
            return
        # The copy follows other processes' events: poll it with a deadline instead of
        # blocking, so a producer that died cannot hang this thread unseen (Note [dead
        # producers and imported events] in roundpipe.shared.handoff, point c).
        timeout_s = max(h.timeout_s for h in chunk.handoffs)
        deadline = time.perf_counter() + timeout_s
        dead_since: float | None = None
        pause = 20e-6
        while not token.query():  # type: ignore[attr-defined]
            now = time.perf_counter()
            lost = [h for h in chunk.handoffs if not h.landed()]
            if dead_since is None and any(not h.producer_alive() for h in lost):
                dead_since = now
            if now > deadline or (dead_since is not None and now - dead_since > _DEAD_GRACE_S):
                why = (
                    f"{len(lost)} of its producers' copies never landed (landed mark missing"
                    + (", producer process gone)" if dead_since is not None else ")")
                    if lost
                    else "its producers' landed marks came but the stream never moved"
                )
                self.engine.broken = (
                    "an activation upload's stream waits on another process's CUDA event "
                    f"that did not fire ({why}). This worker's stream can no longer be "
                    "trusted; it exits so its CUDA context is torn down (the coordinator "
                    "re-runs its tasks)"
                )
                if self.engine.on_broken is not None:
                    self.engine.on_broken(self.engine.broken)
                raise HandoffLost(self.engine.broken)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


# --------------------------------------------------------------------------- engines


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int):
    """(src piece, dst piece) pairs of at most ``chunk_bytes`` over flat views."""
    n = src.numel()
    if n == 0:
        return []
    per = max(1, chunk_bytes // max(1, src.element_size()))
    s, d = src.reshape(-1), dst.view(-1)
    return [(s[i : i + per], d[i : i + per]) for i in range(0, n, per)]


class TransferEngine(ABC):
    """Moves tensors between the arenas (host) and the worker's device. See module doc."""

    kind: str = "abstract"

    counter_at_issue = False
    """Whether activation hand-offs store their counter when the copy is issued, with a
    ticket, and a landed mark later (Note [activation hand-off]); otherwise counters are
    stored once the copy has landed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.broken: str | None = None
        """Why this engine's streams cannot be trusted any more (the worker must exit),
        or None. Note [dead producers and imported events] in roundpipe.shared.handoff."""
        self.on_broken: Callable[[str], None] | None = None
        """Called (on a link thread) when the engine breaks. The worker process sets it to
        exit: streams queued behind the stuck one (labels, later microbatches, downloads
        after compute) would otherwise block its threads, and its teardown, for good."""
        self.uploaded_bytes = {Priority.ACTIVATION: 0, Priority.WEIGHT: 0}
        """Bytes this engine has put on the bus to the device, by priority: weights
        (prefetched ones included, used or not) and activations. The CPU engine moves
        nothing. A task's own figures travel in ``TaskDone.upload_bytes``."""
        self._count_lock = threading.Lock()

    def _count_upload(self, priority: Priority, nbytes: int) -> None:
        with self._count_lock:
            self.uploaded_bytes[Priority(priority)] += nbytes

    # -- arenas -----------------------------------------------------------------------

    def register(self, arenas: Iterable) -> None:  # noqa: B027 - only CUDA pins
        """Make the arenas DMA-able (CUDA: pin in place). Once per job and worker."""

    def unregister(self, arenas: Iterable) -> None:  # noqa: B027
        """Undo ``register`` (at job teardown)."""

    # -- copies -----------------------------------------------------------------------

    @abstractmethod
    def upload(
        self,
        tensors: Mapping[str, torch.Tensor],
        priority: Priority,
        wait_for: Sequence[Handoff] = (),
    ) -> Upload:
        """Start copying host tensors to the device; the handle gives the device tensors.

        ``wait_for``: producers' copies (announced at issue) the copy must follow; the
        link waits for them, never the caller. Note [activation hand-off]."""

    @abstractmethod
    def download(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        priority: Priority,
        then: Callable[[], None] | None = None,
        on_issue: Callable[[IssueMark], None] | None = None,
    ) -> Transfer:
        """Start copying (device tensor, host view) pairs; ``then`` runs once all landed.

        ``on_issue`` runs once the copy is issued and its completion event recorded
        (before it landed): where a hand-off's ticket and counter are stored. The device
        tensors must not be written again by the caller. Note [counter after landing],
        Note [activation hand-off]."""

    def stopwatch(self) -> Stopwatch:
        return Stopwatch()

    def memory_free_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more device memory fits (for a prefetch)."""
        return True

    def measure_bandwidth(self) -> tuple[float | None, float | None]:
        """(host-to-device, device-to-host) bytes/s, for Hello and the planner."""
        return None, None

    def release_cached_memory(self) -> None:  # noqa: B027 - only CUDA caches device memory
        """Hand the device memory this process keeps cached, and no tensor uses, back to
        the device. The worker calls it when its last job is torn down."""

    def close(self) -> None:  # noqa: B027
        pass

    def wait_usable(self, upload: Upload, timeout_s: float | None = None) -> bool:
        """Block until ``tensors()`` of ``upload`` would not block for long: it landed
        (host-side engines) or, on CUDA, every chunk is issued, since the compute stream
        then waits for it on the device (Note [compute waits on the device]). False if
        ``timeout_s`` passed first."""
        return upload.wait_landed(timeout_s)

    def _ready_for_compute(self, upload: Upload) -> None:
        upload.wait()


class CpuEngine(TransferEngine):
    """The host is the device: uploads are the views, downloads copy at once."""

    kind = "cpu"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def upload(self, tensors, priority, wait_for=()):
        # The "upload" is the arena view itself: a producer's copy it follows must have
        # landed before the caller computes on it (only a job mixing backends gets here).
        for handoff in wait_for:
            handoff.wait_landed()
        return Upload(self, dict(tensors), 0, 0)

    def download(self, pairs, priority, then=None, on_issue=None):
        for src, dst in pairs:
            dst.copy_(src)
        t = Transfer(0, 0)
        if on_issue is not None:
            on_issue(IssueMark(os.getpid()))
        if then is not None:
            then()
        return t


class _LinkedEngine(TransferEngine):
    """Shared by the emulated and CUDA engines: two links, chunked weight copies."""

    def __init__(self, device: torch.device, chunk_bytes: int, counter_at_issue: bool) -> None:
        super().__init__(device)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.counter_at_issue = counter_at_issue
        self.pid = os.getpid()
        self.h2d: _Link
        self.d2h: _Link

    def _alloc(self, like: torch.Tensor, priority: Priority) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def _pieces(self, pairs, priority):
        out = []
        for src, dst in pairs:
            if priority == Priority.WEIGHT:
                out += _split(src, dst, self.chunk_bytes)
            elif src.numel():
                out.append((src, dst))
        return out

    def upload(self, tensors, priority, wait_for=()):
        dst = {name: self._alloc(t, priority) for name, t in tensors.items()}
        pieces = self._pieces([(t, dst[n]) for n, t in tensors.items()], priority)
        nbytes = sum(_nbytes(t) for t in tensors.values())
        self._count_upload(priority, nbytes)
        up = Upload(self, dst, len(pieces), nbytes, wait_for if pieces else ())
        if pieces:
            self.h2d.put(priority, pieces, up, self._after_host(), tuple(wait_for))
        return up

    def download(self, pairs, priority, then=None, on_issue=None):
        pieces = self._pieces(pairs, priority)
        t = Transfer(len(pieces), sum(_nbytes(s) for s, _ in pairs))
        keep = [s for s, _ in pairs]  # the device tensors live until their copy landed
        t.then(keep.clear, always=True)
        if on_issue is not None:
            if pieces:
                t._on_issue = self._issue_callback(on_issue)
            else:
                on_issue(IssueMark(self.pid))
        if then is not None:
            t.then(then)
        if pieces:
            self.d2h.put(priority, pieces, t, self._after_compute())
        return t

    def _issue_callback(self, on_issue: Callable[[IssueMark], None]) -> Callable[[object], None]:
        """``on_issue`` as the link calls it, with the issue context (CUDA: a stream)."""
        return lambda _context: on_issue(IssueMark(self.pid))

    def _after_host(self):
        return None

    def _after_compute(self):
        return None

    def close(self) -> None:
        self.h2d.close()
        self.d2h.close()


class EmulatedEngine(_LinkedEngine):
    """A PCIe bus in software: see the module doc."""

    kind = "emulated"

    def __init__(
        self,
        bandwidth_bytes_per_s: float,
        latency_s: float = 10e-6,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        counter_at_issue: bool = True,
    ) -> None:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"emulated bandwidth must be positive, got {bandwidth_bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"emulated latency must be >= 0, got {latency_s}")
        super().__init__(torch.device("cpu"), chunk_bytes, counter_at_issue)
        self.bandwidth = float(bandwidth_bytes_per_s)
        self.latency_s = latency_s
        self.h2d = _EmulatedLink("rp-h2d-emulated", self.bandwidth, latency_s)
        self.d2h = _EmulatedLink("rp-d2h-emulated", self.bandwidth, latency_s)

    def measure_bandwidth(self):
        return self.bandwidth, self.bandwidth


class CudaEngine(_LinkedEngine):
    """Pinned arenas, four streams, CUDA events. See the module doc."""

    kind = "cuda"

    def __init__(
        self,
        device: torch.device,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = 2,
        memory_limit_bytes: int | None = None,
        counter_at_issue: bool = True,
        ring_size: int = 64,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaEngine needs a cuda device, got {device}")
        if device.index is None:  # (the link threads' set_device would raise, and they die)
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, chunk_bytes, counter_at_issue)
        self.ring_size = ring_size
        self._ring = None  # this process's interprocess events, made at the first hand-off
        self._own: dict[bytes, object] = {}  # IPC handle -> this process's ring event
        self._imported: dict[bytes, object] = {}  # IPC handle -> another process's event
        self._ring_lock = threading.Lock()
        self.memory_limit_bytes = memory_limit_bytes
        with torch.cuda.device(device):
            lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest) numerically
            self.activation_up = torch.cuda.Stream(device, priority=hi)
            self.weight_up = torch.cuda.Stream(device, priority=lo)
            self.down = torch.cuda.Stream(device)
        self.h2d = _CudaLink(
            "rp-h2d",
            self,
            {Priority.ACTIVATION: self.activation_up, Priority.WEIGHT: self.weight_up},
            window,
        )
        self.d2h = _CudaLink("rp-d2h", self, {p: self.down for p in Priority}, window)
        from roundpipe.worker.cuda import PinnedArenas

        self._pins = PinnedArenas()

    def _alloc(self, like: torch.Tensor, priority: Priority) -> torch.Tensor:
        # Allocated on the stream that writes it. A block from the compute stream's pool
        # may have been freed by compute work still queued on the device, and the upload
        # stream, which does not wait for the compute stream, would overwrite it under
        # those kernels. The compute stream's use is recorded at hand-over
        # (``_ready_for_compute``), so the block is not reused before that work is done.
        stream = self.activation_up if priority == Priority.ACTIVATION else self.weight_up
        with torch.cuda.stream(stream):
            return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def register(self, arenas):
        self._pins.register(arenas)

    def release_cached_memory(self):
        from roundpipe.worker.cuda import release_cached_memory

        release_cached_memory(self.device)

    def unregister(self, arenas):
        self._pins.unregister(arenas)

    # -- activation hand-offs (Note [activation hand-off]) ------------------------------

    def _ring_events(self):
        from roundpipe.worker.cuda import CudaEventRing

        with self._ring_lock:
            if self._ring is None:
                self._ring = CudaEventRing(self.device, self.ring_size)
                for event, handle in zip(self._ring.events, self._ring.handles):
                    self._own[bytes(handle)] = event  # a handle cannot be opened by its exporter
            return self._ring

    def _issue_callback(self, on_issue):
        def issued(stream) -> None:
            # On the d2h link, right after the copy's last chunk went on ``stream``: the
            # ring event recorded here completes when the copy has landed.
            ring = self._ring_events()
            slot = ring.record(stream)
            on_issue(IssueMark(self.pid, ring.records, bytes(ring.handles[slot])))

        return issued

    def _wait_for_producer(self, handoff, stream, abort: Callable[[], bool]) -> None:
        """Make ``stream`` wait (on the device) for the producer's copy: its ring event,
        opened once per handle. Falls back to a host wait for the landed mark (this link
        thread) when the ticket carries no usable event."""
        if handoff.landed():
            return  # long landed: nothing to wait for, no foreign event touched
        ticket = handoff.ticket
        usable = ticket.handle and (ticket.pid != self.pid or ticket.handle in self._own)
        # (Another engine of this process: its handles cannot be opened here; tests only.)
        event = self._event_for(ticket.handle) if usable else None
        if event is None:
            handoff.wait_landed(should_abort=abort)  # host fallback, bounded by the timeout
            return
        event.wait(stream)

    def _event_for(self, handle: bytes):
        from roundpipe.worker.cuda import open_ipc_event

        event = self._own.get(handle)
        if event is None:
            event = self._imported.get(handle)
        if event is not None:
            return event
        try:
            event = open_ipc_event(self.device, handle)
        except Exception as exc:  # noqa: BLE001 - a torn or stale handle: wait on the host
            log.warning("cannot open a producer's CUDA event (%s); waiting on the host", exc)
            return None
        if len(self._imported) >= 4096:  # producers that restarted many times: forget old
            self._imported.pop(next(iter(self._imported)))
        self._imported[handle] = event
        return event

    def _after_compute(self):
        # A download reads what the compute stream produced: the download stream waits
        # for the compute work queued so far (on the device, not the host).
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return lambda stream: stream.wait_event(event)

    def wait_usable(self, upload: Upload, timeout_s: float | None = None) -> bool:
        return upload.wait_issued(timeout_s)

    def _ready_for_compute(self, upload: Upload) -> None:
        # Note [compute waits on the device]. record_stream keeps the allocator from
        # handing the blocks to another stream while the compute stream still reads.
        upload.wait_issued()
        stream = torch.cuda.current_stream(self.device)
        if upload.done() or upload.last_token is None:
            upload.wait()  # over already (or nothing was issued): its error, if any
        else:
            if upload.error is not None:  # an issue callback failed
                raise upload.error
            stream.wait_event(upload.last_token)  # type: ignore[arg-type]
        for t in upload._dst.values():
            t.record_stream(stream)

    def stopwatch(self) -> Stopwatch:
        return CudaStopwatch(self.device)

    def memory_free_for(self, nbytes: int) -> bool:
        free, total = torch.cuda.mem_get_info(self.device)
        limit = self.memory_limit_bytes or total
        return torch.cuda.memory_allocated(self.device) + nbytes <= limit and nbytes <= free

    def measure_bandwidth(self, nbytes: int = 64 << 20, reps: int = 5):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rates = []
        for src, dst in ((host, dev), (dev, host)):
            dst.copy_(src, non_blocking=True)  # warm-up
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(nbytes * reps / (start.elapsed_time(end) / 1e3))
        return rates[0], rates[1]


class CudaStopwatch(Stopwatch):
    """Per-key compute time from CUDA events on the current stream (no host sync)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._pairs: list[tuple[int, object, object]] = []
        self._starts: dict[int, object] = {}

    def start(self, key: int) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._starts[key] = ev

    def stop(self, key: int) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._pairs.append((key, self._starts.pop(key), ev))

    def resolve(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, a, b in self._pairs:
            b.synchronize()  # type: ignore[attr-defined]
            out[key] = out.get(key, 0.0) + a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return out


def make_engine(
    device: torch.device | str,
    *,
    emulate_bandwidth: float | None = None,
    emulate_latency_s: float = 10e-6,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    memory_limit_bytes: int | None = None,
) -> TransferEngine:
    """The engine for a worker on ``device``; ``emulate_bandwidth`` picks the emulated bus
    (CPU workers only)."""
    device = torch.device(device)
    if device.type == "cuda":
        if emulate_bandwidth is not None:
            raise ValueError("--emulate-pcie emulates a bus for a CPU worker; a GPU has one")
        return CudaEngine(device, chunk_bytes=chunk_bytes, memory_limit_bytes=memory_limit_bytes)
    if emulate_bandwidth is not None:
        return EmulatedEngine(emulate_bandwidth, emulate_latency_s, chunk_bytes=chunk_bytes)
    return CpuEngine()
