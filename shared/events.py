"""The event table: 64-bit sequence counters in shared memory that order work across processes.

Every counter has exactly one writer (the process that produces what the counter stands
for); any number of processes read it. A counter only moves forward: it holds the newest
iteration (or version) whose data is complete, so "wait until counter >= k" is the one
synchronisation primitive the runtime needs (:class:`Counters` below numbers a job's
counters: act, dact, wgrad, version, uploaded, ...; docs/runtime.md, "The event table").

Layout (its own arena, or any 64-byte-aligned region of one)::

    offset 0    u32 doorbell          bumped after every signal; waiters sleep on it (futex)
    offset 4    u32 reserved
    offset 8    u64 number of counters
    offset 16   48 bytes reserved (rest of the first cache line)
    offset 64   i64 counter[0], counter[1], ..., counter[n-1]

Note [event-table barriers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A producer writes its data, then stores the counter; a consumer loads the counter, then
reads the data. Nothing in Python orders these memory accesses for another process, so:

* ``signal`` issues a full memory barrier *between* the data writes and the counter
  store, and ``wait_at_least`` issues one *after* it has seen the counter and before it returns
  (before the caller reads the data). On x86-64 (total store order) the hardware already
  keeps stores in order and loads in order, and the barrier is what stops the compiler from
  reordering across it; on weaker architectures (aarch64) the barrier is what makes the
  protocol correct at all. A counter store or load is one aligned 8-byte access, which is
  single-copy atomic on both, so a reader never sees half a counter.
* The barrier is two acquire/release pairs of a process-local lock: release(1) -> acquire(2)
  is ordered (the lock is sequentially consistent), data accesses cannot sink below
  release(1), and the counter access cannot rise above acquire(2). This is the same fix
  vLLM adopted for its shared-memory broadcast queue (vllm issue 27858/29389).
* With an asynchronous device-to-host copy the "data write" is not over when the copy is
  issued. Activation hand-offs (act, dact) then store the counter at issue, with a ticket
  and a later *landed mark* the consumer's upload waits for; every other counter is
  stored after its copy landed (roundpipe.shared.handoff, Note [dead producers and
  imported events] there).

Note [waiting in three phases]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A waiter must wake soon after the signal without burning a core while it waits:

1. **Spin** for 50 us: in a busy pipeline the counter is often about to move.
2. **Poll-sleep** for the first ``ROUNDPIPE_WAIT_POLL_MS`` (default 20 ms) of the wait:
   sleep on the doorbell word with the Linux futex system call in 100 us slices. A
   signal still wakes the sleeper at once; the slices only keep its CPU out of deep
   idle. Waking a CPU from deep idle is what makes a futex wake slow: on the 2-vCPU KVM
   guests we develop on, a process asleep for 2 ms took 70-190 us to run again after the
   wake, one that kept waking every 100 us took 25-40 us (benchmarks/ipc.py). The price
   is about 10% of one core while it lasts. 20 ms covers the usual hand-off in a
   pipeline: a stage waits for its input for about the jitter between two stages.
3. **Sleep** on the doorbell in 50 ms slices until the deadline (pipeline fill, the
   optimizer waiting for a whole backward pass, an idle job).

``signal`` bumps the doorbell and wakes all sleepers. Elsewhere than Linux the sleep
falls back to short exponential back-off. Every wait has a deadline and raises
:class:`EventTimeout` naming the counter, the value waited for and the value last seen.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from roundpipe.shared.arena import Arena, ArenaError
from roundpipe.shared.defaults import env_non_negative

__all__ = [
    "COUNTERS_START",
    "EVENTS_ARENA",
    "Counters",
    "EventTable",
    "EventTimeout",
    "LOSS_SCALE_EXP_MAX",
    "LOSS_SCALE_EXP_MIN",
    "loss_scale_value",
    "memory_barrier",
    "read_loss_scale_value",
    "table_nbytes",
]

log = logging.getLogger(__name__)

COUNTERS_START = 64
EVENTS_ARENA = "events"
"""Name of the arena of a job that holds its event table, at DATA_START
(roundpipe.shared.arena): the coordinator's layout creates it, workers map it by name."""
# Note [waiting in three phases]
_SPIN_S = 50e-6
_POLL_SLICE_S = 100e-6
_SLEEP_SLICE_S = 0.05


def _poll_window_s() -> float:
    ms = env_non_negative("ROUNDPIPE_WAIT_POLL_MS", 20, "milliseconds", "turns poll-sleeping off")
    return ms / 1e3


_POLL_S = _poll_window_s()


def _check_value(value: int) -> None:
    """A counter is a signed 64-bit integer: ctypes would store a larger value wrapped
    around (2**63 became -2**63, and the counter went backwards)."""
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"event counter value {value} does not fit a signed 64-bit counter")


# A loss-scale counter holds a step and the scale's exponent, so that it only grows
# (counters never go backwards) and a reader can tell which step it is for.
LOSS_SCALE_EXP_MIN = 0
LOSS_SCALE_EXP_MAX = 64
_EXP_CODES = 256


def loss_scale_value(step: int, exponent: int) -> int:
    """Counter value saying that step ``step`` uses the loss scale ``2 ** exponent``."""
    if not LOSS_SCALE_EXP_MIN <= exponent <= LOSS_SCALE_EXP_MAX:
        raise ValueError(
            f"loss scale 2**{exponent} is outside 2**{LOSS_SCALE_EXP_MIN}..2**{LOSS_SCALE_EXP_MAX}"
        )
    return step * _EXP_CODES + exponent


def read_loss_scale_value(value: int) -> tuple[int, int]:
    """(step, exponent) of a loss-scale counter's value."""
    return divmod(value, _EXP_CODES)


def table_nbytes(num_counters: int) -> int:
    """Bytes an event table of ``num_counters`` counters occupies."""
    return COUNTERS_START + 8 * num_counters


class EventTimeout(TimeoutError):
    """A wait on the event table passed its deadline."""


_barrier_lock = threading.Lock()


def memory_barrier() -> None:
    """Full memory barrier between the caller's earlier and later memory accesses.

    See Note [event-table barriers].
    """
    _barrier_lock.acquire()
    _barrier_lock.release()
    _barrier_lock.acquire()
    _barrier_lock.release()


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a shared (not process-private) 32-bit word."""

    _SYSCALL_NUMBERS = {"x86_64": 202, "aarch64": 98, "arm64": 98}
    _WAIT, _WAKE = 0, 1  # no FUTEX_PRIVATE_FLAG: the word is shared between processes

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        self.available = False
        number = self._SYSCALL_NUMBERS.get(platform.machine())
        if sys.platform != "linux" or number is None:
            return
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._number = number
        self.available = True

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        # Returns at once (EAGAIN) if the word no longer holds `expected`: no lost wake-up.
        self._syscall(
            ctypes.c_long(self._number),
            ctypes.c_void_p(address),
            ctypes.c_int(self._WAIT),
            ctypes.c_uint32(expected),
            ctypes.byref(ts),
            None,
            ctypes.c_uint32(0),
        )

    def wake_all_call(self, address: int) -> Callable[[], object]:
        """A ready-made FUTEX_WAKE(all) for ``address``: ``signal`` is on the critical
        path, so its ctypes arguments are built once per table, not once per call."""
        args = (
            ctypes.c_long(self._number),
            ctypes.c_void_p(address),
            ctypes.c_int(self._WAKE),
            ctypes.c_int(2**31 - 1),
            None,
            None,
            ctypes.c_uint32(0),
        )
        syscall = self._syscall
        return lambda: syscall(*args)


_futex = _Futex()


class EventTable:
    """Counters in an arena region. Build with :meth:`create` (owner) or :meth:`attach`."""

    def __init__(self, arena: Arena, offset: int, labels: Callable[[int], str] | None = None):
        if offset % 64:
            raise ArenaError(f"event table offset {offset} is not 64-byte aligned")
        header = (ctypes.c_uint32 * 2).from_buffer(arena.buffer, offset)
        count = ctypes.c_uint64.from_buffer(arena.buffer, offset + 8).value
        if offset + table_nbytes(count) > arena.nbytes:
            raise ArenaError(
                f"event table at offset {offset} of {count} counters overruns arena {arena.name!r}"
            )
        self.arena = arena
        self.offset = offset
        self.num_counters = count
        self._header = header
        self._doorbell_address = ctypes.addressof(header)
        self._counters = (ctypes.c_int64 * max(count, 1)).from_buffer(
            arena.buffer, offset + COUNTERS_START
        )
        self._labels = labels
        self._wake_all = (
            _futex.wake_all_call(self._doorbell_address) if _futex.available else lambda: None
        )

    @classmethod
    def create(cls, arena: Arena, offset: int, num_counters: int) -> EventTable:
        """Initialise a table of zeroed counters in ``arena`` at ``offset`` (owner side)."""
        if offset + table_nbytes(num_counters) > arena.nbytes:
            raise ArenaError(
                f"an event table of {num_counters} counters needs "
                f"{table_nbytes(num_counters)} bytes at offset {offset}; arena "
                f"{arena.name!r} has {arena.nbytes}"
            )
        arena.buffer[offset : offset + table_nbytes(num_counters)] = bytes(
            table_nbytes(num_counters)
        )
        ctypes.c_uint64.from_buffer(arena.buffer, offset + 8).value = num_counters
        memory_barrier()
        return cls(arena, offset)

    def label(self, index: int) -> str:
        """Human name of a counter for error messages (e.g. ``act[layer 3][mb 1]``)."""
        if self._labels is not None:
            return f"{self._labels(index)} (counter {index})"
        return f"counter {index}"

    def set_labeler(self, labels: Callable[[int], str]) -> None:
        self._labels = labels

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_counters:
            raise IndexError(f"event counter {index} outside table of {self.num_counters}")

    # -- reading ---------------------------------------------------------------------

    def read(self, index: int) -> int:
        """Current value (no ordering with later data reads: use ``wait_at_least``)."""
        self._check_index(index)
        return self._counters[index]

    def snapshot(self) -> list[int]:
        return list(self._counters[: self.num_counters])

    # -- writing (single writer per counter) -----------------------------------------

    def signal(self, index: int, value: int) -> None:
        """Publish ``value`` for counter ``index`` after the caller's data writes.

        Counters never go backwards: signalling a value at or below the current one is a
        no-op, which makes a re-executed (idempotent) task's signals harmless.
        """
        self._check_index(index)
        _check_value(value)
        if value <= self._counters[index]:
            return
        memory_barrier()  # data writes before the counter store: Note [event-table barriers]
        self._counters[index] = value
        memory_barrier()  # counter store before the doorbell bump
        self._header[0] = (self._header[0] + 1) & 0xFFFFFFFF
        self._wake_all()

    def reset(self, index: int, value: int = 0) -> None:
        """Owner-only: set a counter backwards (new job on a reused table). Not for workers."""
        self._check_index(index)
        _check_value(value)
        self._counters[index] = value
        memory_barrier()

    # -- waiting ---------------------------------------------------------------------

    def wait_at_least(
        self,
        index: int,
        value: int,
        timeout_s: float,
        *,
        should_abort: Callable[[], bool] | None = None,
    ) -> int:
        """Block until counter ``index`` >= ``value``; return the value seen.

        Raises :class:`EventTimeout` after ``timeout_s``. ``should_abort`` is polled at
        least every sleep slice (50 ms) so a caller can stop waiting on shutdown; if it
        returns True, :class:`InterruptedError` is raised. Note [waiting in three phases]
        says how the wait spends its time.
        """
        self._check_index(index)
        counters = self._counters
        seen = counters[index]
        if seen >= value:
            memory_barrier()  # the caller's data reads after the counter load
            return seen
        start = time.perf_counter()
        spin_until = start + _SPIN_S
        poll_until = start + _POLL_S
        deadline = start + timeout_s
        backoff_s = 20e-6
        while True:
            doorbell = self._header[0]
            seen = counters[index]
            if seen >= value:
                memory_barrier()
                return seen
            now = time.perf_counter()
            if now >= deadline:
                raise EventTimeout(
                    f"timed out after {timeout_s:.3g}s waiting for {self.label(index)} to reach "
                    f"{value}; last value seen {seen}. The producer of that counter has "
                    "stopped or is slower than the deadline allows"
                )
            if now < spin_until:
                continue
            if should_abort is not None and should_abort():
                raise InterruptedError(f"wait for {self.label(index)} >= {value} was aborted")
            slice_s = min(_POLL_SLICE_S if now < poll_until else _SLEEP_SLICE_S, deadline - now)
            if _futex.available:
                _futex.wait(self._doorbell_address, doorbell, slice_s)
            else:
                time.sleep(min(backoff_s, slice_s))
                backoff_s = min(backoff_s * 2, 1e-3)

    def close(self) -> None:
        """Drop this table's references into the arena mapping."""
        self._counters = None  # type: ignore[assignment]
        self._header = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Counters:
    """Index arithmetic of a training job's event table for ``num_layers`` layers and M
    microbatches (what each counter stands for: roundpipe.coordinator.training.layout). The
    coordinator lays the table out with it; a worker rebuilds it from JobSetup, so both
    name a counter the same way in their errors."""

    num_layers: int
    num_microbatches: int

    def act(self, layer: int, mb: int) -> int:
        return layer * self.num_microbatches + mb

    def dact(self, layer: int, mb: int) -> int:
        return (self.num_layers + layer) * self.num_microbatches + mb

    def wgrad(self, layer: int) -> int:
        return 2 * self.num_layers * self.num_microbatches + layer

    def version(self, layer: int) -> int:
        return 2 * self.num_layers * self.num_microbatches + self.num_layers + layer

    @property
    def handoff_counters(self) -> int:
        """The act and dact counters: indices [0, handoff_counters)."""
        return 2 * self.num_layers * self.num_microbatches

    def is_handoff(self, index: int) -> bool:
        """Whether counter ``index`` stands for an activation hand-off between workers
        (roundpipe.shared.handoff): act or dact."""
        return 0 <= index < self.handoff_counters

    def landed(self, index: int, value: int) -> int:
        """The landed mark of act/dact counter ``index`` for values of ``value``'s parity
        (roundpipe.shared.handoff)."""
        return self.handoff_counters + 2 * self.num_layers + 2 * index + value % 2

    def wgrad_part(self, layer: int) -> int:
        """Like ``wgrad``, for the second gradient part of a microbatch-split backward
        stage (Note [microbatch-split stages] in roundpipe.shared.plan)."""
        return 3 * self.handoff_counters + 2 * self.num_layers + layer

    def loss_scale(self, step: int) -> int:
        """The float16 loss scale that step ``step`` seeds its backward with, one counter
        per step parity (Note [dynamic loss scaling] in
        roundpipe.coordinator.training.loss_scale; its value: ``loss_scale_value``)."""
        return 3 * self.handoff_counters + 3 * self.num_layers + step % 2

    @property
    def total(self) -> int:
        return 3 * self.handoff_counters + 3 * self.num_layers + 2

    def label(self, index: int) -> str:
        """Readable name of a counter, used in timeout errors."""
        per_kind = self.num_layers * self.num_microbatches
        if index < per_kind:
            return (
                f"act[layer {index // self.num_microbatches}][mb {index % self.num_microbatches}]"
            )
        if index < 2 * per_kind:
            index -= per_kind
            return (
                f"dact[layer {index // self.num_microbatches}][mb {index % self.num_microbatches}]"
            )
        index -= 2 * per_kind
        if index < self.num_layers:
            return f"wgrad[layer {index}]"
        if index < 2 * self.num_layers:
            return f"version[layer {index - self.num_layers}]"
        index -= 2 * self.num_layers
        if index >= 2 * self.handoff_counters + self.num_layers:
            return f"loss_scale[step parity {index - 2 * self.handoff_counters - self.num_layers}]"
        if index >= 2 * self.handoff_counters:
            return f"wgrad_part[layer {index - 2 * self.handoff_counters}]"
        return f"landed {self.label(index // 2)} (parity {index % 2})"
