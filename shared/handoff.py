"""Activation hand-offs between workers: counter at issue, then a landed mark.

An activation (a stage's output, or an input gradient) is written by one worker and read
by the worker that runs the next stage. With a real bus the producer's device-to-host copy
is asynchronous, and storing the event-table counter only once the copy has landed costs
a host round trip per hand-off (the producer's completion thread wakes, stores the
counter, the consumer wakes). So activation hand-offs take two steps instead (the event
table and its counters: roundpipe.shared.events; docs/runtime.md, "Activation hand-offs"):

1. The producer issues the copy, records a completion event after it (CUDA: an
   interprocess event of its ring, roundpipe.worker.cuda), writes a *ticket* for the
   counter (which process, which ring record, the event's IPC handle), issues a memory
   barrier, and stores the counter at once: "counter at issue".
2. When the copy has really landed, the producer's completion thread stores the entry's
   *landed mark* (an ordinary event-table counter, one per act/dact counter and parity).

A consumer waits for the counter as before, reads the ticket, and its *upload link* (never
its compute thread) waits for the producer's completion before its own copy reads the
slot: on a GPU its upload stream waits on the producer's interprocess event; on the
emulated bus the link waits until the landed mark arrives. Weight gradients and losses,
read by the CPU coordinator, keep "counter after landing".

Note [dead producers and imported events]
    CUDA leaves undefined what an imported interprocess event does once its exporter
    (the producer process) has destroyed it, e.g. because the producer died. So no
    result may depend on the event of a producer that is gone:

    a. before a consumer publishes anything computed from an input it got through a
       ticket (its outputs' counters, weight gradients, losses), it checks that input's
       landed mark; normally it was set long before. If it does not come within the
       task's wait timeout, the task fails with ``HandoffLost`` (retryable) and the
       coordinator re-runs it, as for any failure;
    b. a re-run of the dead producer's task writes a new ticket and sets the landed mark
       itself (Note [no rewrite after signal] in roundpipe.worker.runtime): a consumer
       waiting for the landed mark (emulated bus) simply sees the re-run land;
    c. on a GPU, a consumer whose upload stream waits on a producer event that does not
       complete within the wait timeout cannot trust that stream any more (the wait may
       never end): its engine is marked broken, the task fails, and the worker exits so
       its CUDA context is torn down. Workers are stateless: the coordinator re-runs the
       task elsewhere and the supervisor restarts the worker.

    A worker on the ``cpu`` backend copies at once: it stores the landed mark, then the
    counter, and writes no ticket; a consumer that finds no ticket for the value it
    waited for knows the bytes were in place before the counter (the coordinator's
    ``act[0]`` and every ``cpu`` producer).

Note [ticket layout]
    The tickets live in the events arena, after the event table (at
    ``handoff_offset(counters)``): one 128-byte record per act/dact counter and parity
    (the parity of the counter's value: iteration k writes slot parity k % 2, and k + 2
    reuses the slot only after every reader of k has finished, as for the data slots)::

        offset 0    i64 value      the counter value the ticket is for (written last)
        offset 8    i64 pid        producer process (errors and logs)
        offset 16   i64 seq        producer's ring record number (CUDA; 0 otherwise)
        offset 24   i64 version    odd while a writer is inside the record
        offset 64   64 bytes       cudaIpcEventHandle of that record (CUDA; zeros otherwise)

    A ticket is rewritten only by a re-run of its task (after the first producer was
    declared lost), so writers use a sequence lock: version made odd, memory barrier,
    record, memory barrier, version made even. A reader reads the version, the record, and the version
    again, and uses the record only if the version was even and unchanged and the value
    is the one it waited for. Otherwise it has no event to wait on and waits for the
    landed mark on the host instead, which is always safe. (Two writers at once, an
    original declared lost while still running and its re-run, could leave a torn
    handle that passes the check; opening it fails, and the consumer falls back to the
    landed mark too.)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from roundpipe.shared.arena import DATA_START
from roundpipe.shared.events import (
    Counters,
    EventTable,
    EventTimeout,
    memory_barrier,
    table_nbytes,
)

__all__ = [
    "TICKET_BYTES",
    "Handoff",
    "HandoffBoard",
    "HandoffLost",
    "IssueMark",
    "Ticket",
    "events_arena_nbytes",
    "handoff_offset",
]

TICKET_BYTES = 128
_HANDLE_AT = 64
_HANDLE_BYTES = 64


def handoff_offset(counters: Counters) -> int:
    """Arena offset of the ticket records (after the event table at DATA_START)."""
    end = DATA_START + table_nbytes(counters.total)
    return (end + 63) // 64 * 64


def events_arena_nbytes(counters: Counters) -> int:
    """Data bytes of the events arena: the event table, then the tickets."""
    return handoff_offset(counters) - DATA_START + 2 * counters.handoff_counters * TICKET_BYTES


class HandoffLost(RuntimeError):
    """An input that came through a ticket never landed: its producer is gone.

    The task that read it fails and is re-run (retryable)."""


@dataclass(frozen=True)
class IssueMark:
    """What a producer's engine says about a copy it has just issued."""

    pid: int
    seq: int = 0
    handle: bytes = b""


@dataclass(frozen=True)
class Ticket:
    value: int
    pid: int
    seq: int
    handle: bytes


@dataclass(frozen=True)
class Handoff:
    """One input of a consumer that came through a ticket: its upload must follow the
    producer's copy (Note [dead producers and imported events])."""

    board: HandoffBoard
    counter: int
    value: int
    ticket: Ticket
    timeout_s: float

    def landed(self) -> bool:
        return self.board.landed(self.counter, self.value)

    def producer_alive(self) -> bool:
        """Whether the ticket's producer process still runs (same host; True if unknown)."""
        return self.ticket.pid <= 0 or _pid_alive(self.ticket.pid)

    def superseded(self) -> bool:
        """Whether the ticket for this value is no longer the one followed: a re-run of
        the producer wrote the data again (or is writing it)."""
        return self.board.ticket(self.counter, self.value) != self.ticket

    def wait_landed(self, should_abort: Callable[[], bool] | None = None) -> bool:
        """Block until the producer's copy has landed; return whether it had to wait.

        Raises HandoffLost after ``timeout_s``."""
        if self.landed():
            memory_barrier()
            return False
        self.board.wait_landed(self.counter, self.value, self.timeout_s, self.ticket, should_abort)
        return True


class HandoffBoard:
    """Tickets and landed marks of one job's act/dact counters (see module doc)."""

    def __init__(self, table: EventTable, counters: Counters) -> None:
        self.table = table
        self.counters = counters
        self.offset = handoff_offset(counters)
        need = self.offset + 2 * counters.handoff_counters * TICKET_BYTES
        if need > table.arena.nbytes:
            raise ValueError(
                f"the events arena ({table.arena.nbytes} bytes) has no room for the "
                f"hand-off tickets ({need} bytes needed): coordinator and worker disagree on "
                "the event-table layout; run the same RoundPipe version on both"
            )
        buf = table.arena.buffer
        n = 2 * counters.handoff_counters
        self._words = (ctypes.c_int64 * (n * TICKET_BYTES // 8)).from_buffer(buf, self.offset)
        self._buf = buf

    def close(self) -> None:
        self._words = None  # type: ignore[assignment]
        self._buf = None

    def is_handoff(self, counter: int) -> bool:
        return self.counters.is_handoff(counter)

    # -- producer -----------------------------------------------------------------

    def _record(self, counter: int, value: int) -> int:
        if not self.counters.is_handoff(counter):
            raise IndexError(f"counter {counter} is no act/dact counter: it has no ticket")
        return 2 * counter + value % 2

    def write_ticket(self, counter: int, value: int, mark: IssueMark) -> None:
        """Write the ticket of ``counter`` = ``value`` (before the counter is stored)."""
        rec = self._record(counter, value)
        words = self._words
        base = rec * TICKET_BYTES // 8
        version = words[base + 3]
        words[base + 3] = version | 1
        memory_barrier()
        words[base + 1] = mark.pid
        words[base + 2] = mark.seq
        at = self.offset + rec * TICKET_BYTES + _HANDLE_AT
        self._buf[at : at + _HANDLE_BYTES] = mark.handle.ljust(_HANDLE_BYTES, b"\0")
        words[base] = value
        memory_barrier()
        words[base + 3] = (version | 1) + 1

    def mark_landed(self, counter: int, value: int) -> None:
        """The copy behind ``counter`` = ``value`` has landed (completion thread)."""
        self.table.signal(self.counters.landed(counter, value), value)

    # -- consumer -----------------------------------------------------------------

    def ticket(self, counter: int, value: int) -> Ticket | None:
        """The ticket for exactly ``value``, or None: no ticket (the bytes were in place
        before the counter) or one being rewritten (wait for the landed mark)."""
        rec = self._record(counter, value)
        words = self._words
        base = rec * TICKET_BYTES // 8
        version = words[base + 3]
        memory_barrier()
        found, pid, seq = words[base], words[base + 1], words[base + 2]
        at = self.offset + rec * TICKET_BYTES + _HANDLE_AT
        handle = bytes(self._buf[at : at + _HANDLE_BYTES])
        memory_barrier()
        if version % 2 or words[base + 3] != version:
            # Being rewritten (by a re-run): no usable event; the landed mark will do.
            return Ticket(value, 0, 0, b"")
        if found != value:
            return None
        return Ticket(value, pid, seq, handle if any(handle) else b"")

    def handoff(self, counter: int, value: int, timeout_s: float) -> Handoff | None:
        """The hand-off a consumer of ``counter`` >= ``value`` must follow, or None."""
        if not self.counters.is_handoff(counter) or self.landed(counter, value):
            return None
        ticket = self.ticket(counter, value)
        if ticket is None:
            return None
        return Handoff(self, counter, value, ticket, timeout_s)

    def landed(self, counter: int, value: int) -> bool:
        return self.table.read(self.counters.landed(counter, value)) >= value

    def wait_landed(
        self,
        counter: int,
        value: int,
        timeout_s: float,
        ticket: Ticket | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        try:
            self.table.wait_at_least(
                self.counters.landed(counter, value), value, timeout_s, should_abort=should_abort
            )
        except EventTimeout:
            who = f"process {ticket.pid}" if ticket is not None else "its producer"
            alive = ""
            if ticket is not None and ticket.pid > 0:
                alive = " (still running)" if _pid_alive(ticket.pid) else " (no longer running)"
            raise HandoffLost(
                f"{self.table.label(counter)} = {value} was announced by {who}{alive}, but "
                f"its copy did not land within {timeout_s:.3g}s: the producer probably "
                "died mid-copy. This task fails and is re-run; the producer's task is "
                "re-run too and writes the data again"
            ) from None


def _pid_alive(pid: int) -> bool:
    return psutil.pid_exists(pid)
