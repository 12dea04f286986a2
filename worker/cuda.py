"""GPU-only pieces of the shared-memory layer: in-place pinning and interprocess CUDA events.

Everything here is a no-op or raises a clear error when CUDA is absent, so CPU workers
and the test suite import this module freely.

Pinning. A worker registers each arena with ``cudaHostRegister`` once, so host<->device
copies from arena views are true asynchronous DMA. ``Tensor.pin_memory()`` is no
substitute: it *copies* into a new pinned buffer and the copy is no longer shared.

Interprocess events. A producer that writes an arena with an asynchronous device-to-host
copy cannot just store the event-table counter afterwards: the bytes are not there yet.
It records an interprocess CUDA event on the copy's stream, publishes which record that
is, then signals the counter (Note [event-table barriers] in roundpipe.shared.events). The
consumer waits for the counter on the host, then makes its own stream wait on the
producer's event — no host synchronisation on the critical path. The worker does this
for activation hand-offs (roundpipe.shared.handoff): its ``CudaEngine`` keeps one
``CudaEventRing`` and puts each record's IPC handle into the counter's ticket, which a
consumer opens with ``open_ipc_event`` (once per handle). ``EventHandleBoard`` and
``CudaEventReader`` are the older fixed-board variant, kept for tests/test_cuda.py.

Why a ring: a CUDA event stands only for its *latest* record, so a slot must not be
re-recorded before every reader has enqueued its wait on it (``cudaStreamWaitEvent``
captures the record current at enqueue time; later re-records do not affect it). With a
ring of K slots a slot is reused after K records; the worker's download link keeps at
most two copies in flight and consumers skip the event once the copy's landed mark is
set, so K = 64 leaves a wide margin (Note [activation hand-off] in
roundpipe.worker.transfer). Waiting on a *later* record of the same stream is always safe
(it covers the earlier copy too).

Handle board layout (a region of an arena, 64-byte aligned)::

    for producer p in 0..P-1:        (stride = 64 + K * 64 bytes)
        u64 number of valid handles  (0 until the producer has published)
        56 bytes reserved
        K x 64-byte cudaIpcEventHandle
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import torch

from roundpipe.shared.arena import DATA_START, Arena, ArenaError
from roundpipe.shared.events import memory_barrier

__all__ = [
    "HANDLE_BYTES",
    "CudaEventRing",
    "CudaEventReader",
    "EventHandleBoard",
    "cuda_available",
    "open_ipc_event",
    "PinnedArenas",
    "pin_arena",
    "pinned_key",
    "release_cached_memory",
    "unpin_arena",
]

log = logging.getLogger(__name__)

HANDLE_BYTES = 64


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pin_arena(arena: Arena) -> bool:
    """Register the arena's pages with CUDA in place (page-locked, DMA-able).

    Returns False (and does nothing) without CUDA. Raises ArenaError if the driver
    refuses, e.g. because the memlock limit is too low.
    """
    if not cuda_available():
        return False
    tensor = arena.view(arena.ref(DATA_START, torch.uint8, (arena.data_nbytes,)))
    # cudaHostRegisterPortable (1): pinned for every CUDA context, not only the current.
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), arena.data_nbytes, 1)
    if int(err) != 0:
        raise ArenaError(
            f"cudaHostRegister of arena {arena.name!r} ({arena.data_nbytes} bytes) failed "
            f"with CUDA error {int(err)}; check `ulimit -l` (LimitMEMLOCK=infinity in the "
            "systemd unit) and free host memory"
        )
    return True


def pinned_key(arena: Arena) -> tuple[str, int]:
    """What identifies a registration: the arena's file and the address it is mapped at.
    (An ``id()`` can be reused by a later arena object once this one is gone, which would
    leave that arena unpinned; a file reopened elsewhere is a new registration.)"""
    return str(arena.path), arena.view(arena.ref(DATA_START, torch.uint8, (1,))).data_ptr()


def unpin_arena(arena: Arena) -> bool:
    """Undo :func:`pin_arena`. Returns whether the driver agreed; a refusal is logged
    (the pages stay locked until the process exits, which costs memory, not correctness)."""
    if not cuda_available():
        return False
    tensor = arena.view(arena.ref(DATA_START, torch.uint8, (arena.data_nbytes,)))
    err = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
    if err != 0:
        log.warning(
            "cudaHostUnregister of arena %r failed with CUDA error %d; its %d bytes stay "
            "page-locked until this worker exits",
            arena.name,
            err,
            arena.data_nbytes,
        )
    return err == 0


class PinnedArenas:
    """The arenas one engine registered, each once (a second ``cudaHostRegister`` of the
    same pages is refused), keyed by ``pinned_key``."""

    def __init__(self) -> None:
        self._keys: set[tuple[str, int]] = set()

    def register(self, arenas: Sequence[Arena]) -> None:
        for arena in arenas:
            key = pinned_key(arena)
            if key not in self._keys and pin_arena(arena):
                self._keys.add(key)

    def unregister(self, arenas: Sequence[Arena]) -> None:
        for arena in arenas:
            key = pinned_key(arena)
            if key in self._keys:
                self._keys.discard(key)
                unpin_arena(arena)


def release_cached_memory(device: torch.device) -> None:
    """Hand the blocks torch's caching allocator keeps on ``device`` back to the GPU: on
    a GPU other processes share, an idle worker would hold its last job's peak for good.
    cuBLAS keeps a workspace per (handle, stream) in that allocator, which empty_cache
    cannot free while they hold it, so they go first (torch has no public name for this;
    where it lacks the private one, the workspaces stay)."""
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
        torch.cuda.empty_cache()


class CudaEventRing:
    """Producer side: K interprocess events recorded round-robin."""

    def __init__(self, device: torch.device | int, size: int = 16):
        if not cuda_available():
            raise RuntimeError("CudaEventRing needs CUDA; CPU workers publish counters only")
        if size < 2:
            raise ValueError(f"event ring size must be >= 2, got {size}")
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        with torch.cuda.device(self.device):
            # Interprocess events cannot carry timing; blocking=False keeps host waits spinning
            # only when someone explicitly synchronises, which the runtime never does.
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(size)]
            self.handles = [bytes(ev.ipc_handle()) for ev in self._events]
        self._next = 0
        self.records = 0
        """How many records so far (the number of the latest, from 1)."""

    @property
    def events(self) -> list:
        return list(self._events)

    def record(self, stream: torch.cuda.Stream | None = None) -> int:
        """Record the next slot on ``stream`` (default: current); return the slot index."""
        slot = self._next
        self._events[slot].record(stream)
        self._next = (slot + 1) % len(self._events)
        self.records += 1
        return slot


def open_ipc_event(device: torch.device | int, handle: bytes):
    """Open another process's interprocess event from its 64-byte handle."""
    if not cuda_available():
        raise RuntimeError("opening a CUDA event handle needs CUDA")
    device = torch.device("cuda", device) if isinstance(device, int) else device
    return torch.cuda.Event.from_ipc_handle(device, handle)


class CudaEventReader:
    """Consumer side: opens a producer's handles once, then waits on slots."""

    def __init__(self, device: torch.device | int, handles: Sequence[bytes]):
        if not cuda_available():
            raise RuntimeError("CudaEventReader needs CUDA")
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        # Opening a handle in the process that created it fails in the driver; the runtime
        # only opens other processes' rings.
        self._events = [open_ipc_event(self.device, h) for h in handles]

    def wait(self, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` wait (on the device, not the host) for the producer's record."""
        self._events[slot].wait(stream)


class EventHandleBoard:
    """Interprocess event handles of every producer, in shared memory (see module doc)."""

    def __init__(self, arena: Arena, offset: int, num_producers: int, ring_size: int):
        if offset % 64:
            raise ArenaError(f"event handle board offset {offset} is not 64-byte aligned")
        self.arena = arena
        self.offset = offset
        self.num_producers = num_producers
        self.ring_size = ring_size
        self.stride = 64 + ring_size * HANDLE_BYTES
        if offset + self.nbytes(num_producers, ring_size) > arena.nbytes:
            raise ArenaError(f"event handle board overruns arena {arena.name!r}")

    @staticmethod
    def nbytes(num_producers: int, ring_size: int) -> int:
        return num_producers * (64 + ring_size * HANDLE_BYTES)

    def publish(self, producer: int, handles: Sequence[bytes]) -> None:
        if len(handles) > self.ring_size or any(len(h) != HANDLE_BYTES for h in handles):
            raise ValueError(
                f"expected at most {self.ring_size} handles of {HANDLE_BYTES} bytes each"
            )
        base = self.offset + producer * self.stride
        buf = self.arena.buffer
        buf[base + 64 : base + 64 + len(handles) * HANDLE_BYTES] = b"".join(handles)
        memory_barrier()  # handles before the count: who sees the count sees the handles
        ctypes.c_uint64.from_buffer(buf, base).value = len(handles)

    def handles(self, producer: int) -> list[bytes]:
        """The producer's handles, or [] if it has not published yet."""
        base = self.offset + producer * self.stride
        buf = self.arena.buffer
        count = ctypes.c_uint64.from_buffer(buf, base).value
        memory_barrier()
        return [
            bytes(buf[base + 64 + i * HANDLE_BYTES : base + 64 + (i + 1) * HANDLE_BYTES])
            for i in range(count)
        ]
