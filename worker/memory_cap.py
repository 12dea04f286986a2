"""A CPU worker's memory cap (``roundpipe-worker --cpu --memory-limit``): Note [CPU
memory cap]."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

from roundpipe.shared.units import format_bytes

__all__ = ["apply_cpu_memory_cap", "cap_bytes", "describe_failure", "private_bytes"]

# Note [CPU memory cap]
# ~~~~~~~~~~~~~~~~~~~~~
# A CPU worker stands in for a GPU of a given memory, so exceeding the cap must fail the
# task at once with a message that names the cap, never swap or wake the OOM killer.
# The cap is the kernel's RLIMIT_DATA on the worker process: its private writable memory
# (heap, anonymous mappings, thread stacks), which is what a task allocates; the arenas
# are shared mappings of /dev/shm files, owned and accounted by the coordinator, and do
# not count, as a GPU's memory does not hold the host's copy of the model. The kernel
# refuses the mapping that would pass the limit, malloc returns NULL and torch raises
# its allocation error in the task, which the worker reports naming the cap
# (``describe_failure``). The alternatives fail that test: RLIMIT_AS counts the arenas'
# mappings and every reserved but untouched range (glibc's 64 MiB per-thread heaps),
# so its figure means nothing comparable to a GPU's memory; a check of the resident
# size between layers, or the cgroup memory limit, let one allocation go past it (the
# cgroup then reclaims, swaps or kills, silently to the job). RLIMIT_DATA counts address
# space, not touched pages, so a cap is never exceeded unnoticed. With a cap, glibc
# gives every allocation from 128 KiB up its own mapping (M_MMAP_THRESHOLD fixed, which
# also stops its dynamic raise of the threshold), so a freed tensor is returned to the
# kernel at once and the limit counts live tensors, not a heap's fragments.
_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

_cap: int | None = None


def apply_cpu_memory_cap(limit_bytes: int) -> int:
    """Cap this process's private memory at ``limit_bytes`` (RLIMIT_DATA). Raises
    ValueError for a cap not above what the process uses already."""
    global _cap
    used = private_bytes()
    if limit_bytes <= used:
        raise ValueError(
            f"--memory-limit {format_bytes(limit_bytes)}: this worker already uses "
            f"{format_bytes(used)} of private memory (the interpreter and torch); give more"
        )
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        except (OSError, AttributeError):  # not glibc: the cap still holds
            pass
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and limit_bytes > hard:
        raise ValueError(
            f"--memory-limit {format_bytes(limit_bytes)} is above this process's hard "
            f"RLIMIT_DATA of {format_bytes(hard)}"
        )
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))
    _cap = limit_bytes
    return limit_bytes


def cap_bytes() -> int | None:
    """The cap in force (None: none)."""
    return _cap


def private_bytes(pid: int | str = "self") -> int:
    """What RLIMIT_DATA counts for process ``pid``: its VmData."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmData")


_ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "out of memory")


def describe_failure(exc: BaseException) -> str:
    """``exc``'s message, naming the cap when a capped allocation failed."""
    message = str(exc)
    if _cap is None:
        return message
    if isinstance(exc, MemoryError) or any(s in message.lower() for s in _ALLOCATION_FAILED):
        return (
            f"the worker's memory cap of {format_bytes(_cap)} was exceeded (roundpipe-worker "
            f"--memory-limit, enforced as RLIMIT_DATA on its private memory): {message}"
        )
    return message
