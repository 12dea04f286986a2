"""Named shared-memory arenas: the only place tensor data lives between processes.

An arena is one file in a RAM-backed directory (``/dev/shm`` by default) that every
process maps with ``mmap(MAP_SHARED)``. The coordinator *owns* its arenas (it creates and
unlinks them); workers *attach* (map, read and write, never unlink). Tensors are addressed
by descriptors (:class:`roundpipe.protocol.TensorRef`: arena name, byte offset, dtype,
shape, stride) and turned into zero-copy views here, so no tensor byte ever crosses a
socket.

File name and ownership::

    rp.<namespace>.<owner pid>.<owner start time, centiseconds>.<arena name>
    e.g. rp.default.41327.173225123456.params0

The owner's pid *and* process start time are in the name, so a later owner can tell a
leftover of a crashed process (pid gone, or pid reused by a process that started at a
different time) from a live one without any lock file: :func:`remove_stale_arenas` deletes
only files that match this exact pattern and whose owner is provably dead. Attaching
processes keep no record that could unlink anything, so an attached process killed with
SIGKILL leaves the owner's arena intact. (``multiprocessing.shared_memory`` is avoided on
purpose: its resource tracker unlinks segments when an *attaching* process exits.)

Layout of one arena file::

    0            64                       4096                                   nbytes
    +------------+------------------------+---------------------------------------+
    | header     | reserved               | data: allocations, each 64-byte aligned|
    +------------+------------------------+---------------------------------------+
    header = magic "RPARENA1" | u32 layout version | u32 reserved | u64 total bytes |
             u64 owner pid | u64 owner start (cs) | 24 bytes arena name (utf-8, NUL-padded)

Descriptor offsets are absolute file offsets, so a view needs no lookup: it must lie
entirely inside ``[DATA_START, nbytes)``, start on a multiple of its element size, and
use non-negative strides. Allocations made through :class:`ArenaAllocator` start on
64-byte boundaries (one cache line; also what vectorised copies like).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from roundpipe.protocol import TensorRef, dtype_to_name, name_to_dtype

__all__ = [
    "ALIGNMENT",
    "DATA_START",
    "Arena",
    "ArenaAllocator",
    "ArenaError",
    "arena_file_name",
    "default_arena_dir",
    "process_start_cs",
    "remove_stale_arenas",
]

log = logging.getLogger(__name__)

ALIGNMENT = 64
DATA_START = 4096
_MAGIC = b"RPARENA1"
_LAYOUT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ24s")
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,24}$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_FILE_RE = re.compile(
    r"^rp\.(?P<ns>[A-Za-z0-9_-]{1,40})\.(?P<pid>\d+)\.(?P<start>\d+)\.(?P<name>[A-Za-z0-9_-]{1,24})$"
)


class ArenaError(RuntimeError):
    """A shared-memory arena could not be created, attached or addressed."""


def default_arena_dir() -> Path:
    """``$ROUNDPIPE_ARENA_DIR``, else ``/dev/shm`` (RAM-backed), else the temp dir."""
    configured = os.environ.get("ROUNDPIPE_ARENA_DIR")
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def process_start_cs(pid: int) -> int:
    """Start time of process ``pid`` in centiseconds since the epoch (pid-reuse guard).

    psutil derives it from boot time plus clock ticks, so it is stable for one process
    at 10 ms resolution; rounding to centiseconds makes it an exact identity key.
    """
    return round(psutil.Process(pid).create_time() * 100)


def arena_file_name(namespace: str, name: str, pid: int, start_cs: int) -> str:
    return f"rp.{namespace}.{pid}.{start_cs}.{name}"


def _owner_alive(pid: int, start_cs: int) -> bool:
    try:
        # Allow one tick of disagreement: create_time is rebuilt from /proc each call.
        return abs(process_start_cs(pid) - start_cs) <= 1
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by someone else: never touch it


def remove_stale_arenas(directory: str | os.PathLike[str], namespace: str) -> list[Path]:
    """Unlink arenas of ``namespace`` whose owner process is dead. Returns what was removed.

    Called by an owner when it starts, so a crashed coordinator's leftovers do not pile
    up in RAM. Only names matching the arena pattern are considered, and a file whose
    owner is alive (same pid and start time) is never removed.
    """
    removed: list[Path] = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        match = _FILE_RE.match(entry.name)
        if match is None or match["ns"] != namespace:
            continue
        if _owner_alive(int(match["pid"]), int(match["start"])):
            continue
        try:
            entry.unlink()
            removed.append(entry)
        except FileNotFoundError:
            pass  # another starting owner got there first
    if removed:
        log.info(
            "[arena] removed %d stale arena(s) of dead owners: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class _Header:
    nbytes: int
    owner_pid: int
    owner_start_cs: int
    name: str


class Arena:
    """One mapped arena. Create with :meth:`create` (owner) or :meth:`attach` (others)."""

    def __init__(self, path: Path, mapping: mmap.mmap, header: _Header, *, owner: bool):
        self.path = path
        self.name = header.name
        self.nbytes = header.nbytes
        self.owner_pid = header.owner_pid
        self.is_owner = owner
        self._mmap = mapping
        # One byte view of the whole file; every tensor view slices it (cheap, zero-copy).
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        nbytes: int,
        *,
        directory: str | os.PathLike[str] | None = None,
        namespace: str = "default",
        prefault: bool = True,
    ) -> Arena:
        """Create and map a new arena of at least ``nbytes`` of data space.

        The file is allocated up front (``posix_fallocate``), so a RAM disk that is too
        small fails here, with the sizes in the message, instead of a SIGBUS mid-training.
        """
        if not _NAME_RE.match(name):
            raise ArenaError(f"arena name {name!r} must be 1-24 characters of [A-Za-z0-9_-]")
        if not _NAMESPACE_RE.match(namespace):
            raise ArenaError(
                f"arena namespace {namespace!r} must be 1-40 characters of [A-Za-z0-9_-]"
            )
        if nbytes < 0:
            raise ArenaError(f"arena {name!r}: size must be >= 0 bytes, got {nbytes}")
        directory = Path(directory) if directory is not None else default_arena_dir()
        if not directory.is_dir():
            raise ArenaError(
                f"arena directory {directory} does not exist; create it or set "
                "ROUNDPIPE_ARENA_DIR / --arena-dir to a RAM-backed directory"
            )
        pid = os.getpid()
        start_cs = process_start_cs(pid)
        total = DATA_START + _round_up(max(nbytes, 1), mmap.PAGESIZE)
        path = directory / arena_file_name(namespace, name, pid, start_cs)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ArenaError(
                f"arena {path} already exists (this process created it twice)"
            ) from None
        except OSError as exc:
            raise ArenaError(f"cannot create arena file {path}: {exc.strerror}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                free = _free_bytes(directory)
                raise ArenaError(
                    f"cannot allocate {total / 2**20:.1f} MiB for arena {name!r} in {directory} "
                    f"({exc.strerror}; {free / 2**20:.1f} MiB free). Free memory in that "
                    "directory, enlarge it (e.g. the size= option of /dev/shm), or point "
                    "--arena-dir at a larger RAM-backed directory."
                ) from exc
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mapping = mmap.mmap(fd, total, flags=flags)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps the file alive
        header = _Header(nbytes=total, owner_pid=pid, owner_start_cs=start_cs, name=name)
        mapping[: _HEADER.size] = _HEADER.pack(
            _MAGIC, _LAYOUT_VERSION, 0, total, pid, start_cs, name.encode()
        )
        log.debug("[arena] created %s (%d bytes)", path, total)
        return cls(path, mapping, header, owner=True)

    @classmethod
    def attach(cls, path: str | os.PathLike[str], *, prefault: bool = False) -> Arena:
        """Map an existing arena read-write. Never unlinks it, whatever happens later."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(
                f"arena {path} does not exist: its owner (the coordinator) has exited or "
                "removed it; reconnect to the coordinator for the current arenas"
            ) from None
        except OSError as exc:
            raise ArenaError(f"cannot open arena {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < DATA_START:
                raise ArenaError(f"{path} is {size} bytes: too small to be a RoundPipe arena")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mapping = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        magic, version, _, total, pid, start_cs, raw_name = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC or version != _LAYOUT_VERSION or total != size:
            mapping.close()
            raise ArenaError(
                f"{path} is not a RoundPipe arena of layout version {_LAYOUT_VERSION} "
                f"(magic {magic!r}, version {version}, size {total} vs file {size})"
            )
        header = _Header(total, pid, start_cs, raw_name.rstrip(b"\0").decode())
        return cls(path, mapping, header, owner=False)

    def close(self) -> None:
        """Unmap (as far as no tensor view still uses the mapping). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._bytes = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            # Tensor views still reference the mapping; it is released when they are.
            pass

    def destroy(self) -> None:
        """Owner only: unlink the file and unmap. Attached processes keep their mapping."""
        if not self.is_owner:
            raise ArenaError(
                f"arena {self.name!r} is attached, not owned: only its owner may destroy it"
            )
        self.path.unlink(missing_ok=True)
        self.close()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.is_owner:
            self.destroy()
        else:
            self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"Arena({self.name!r}, {self.nbytes} bytes, {role}, {self.path})"

    # -- addressing ------------------------------------------------------------------

    @property
    def buffer(self) -> mmap.mmap:
        """The raw mapping, for fixed-layout structures such as the event table."""
        if self._closed:
            raise ArenaError(f"arena {self.name!r} is closed")
        return self._mmap

    @property
    def data_nbytes(self) -> int:
        return self.nbytes - DATA_START

    def ref(
        self,
        offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
    ) -> TensorRef:
        """A descriptor for a tensor at ``offset`` (contiguous unless ``stride`` is given)."""
        ref = TensorRef(
            arena=self.name,
            offset=int(offset),
            dtype=dtype_to_name(dtype),
            shape=tuple(int(s) for s in shape),
            stride=tuple(int(s) for s in stride) if stride is not None else None,
        )
        self._check(ref, dtype)
        return ref

    def view(self, ref: TensorRef) -> torch.Tensor:
        """Zero-copy tensor over the bytes ``ref`` describes (bounds-checked)."""
        if self._closed:
            raise ArenaError(f"arena {self.name!r} is closed")
        if ref.arena != self.name:
            raise ArenaError(f"descriptor for arena {ref.arena!r} used on arena {self.name!r}")
        dtype = name_to_dtype(ref.dtype)
        extent = self._check(ref, dtype)
        itemsize = _itemsize(dtype)
        flat = self._bytes[ref.offset : ref.offset + _round_up(extent, itemsize)].view(dtype)
        if ref.stride is None:
            return flat.view(ref.shape)  # extent is exactly the elements of `shape`
        return flat.as_strided(ref.shape, ref.stride)

    def _check(self, ref: TensorRef, dtype: torch.dtype) -> int:
        itemsize = _itemsize(dtype)
        stride = ref.full_stride
        if len(ref.shape) != len(stride):
            raise ArenaError(f"descriptor {ref}: shape and stride differ in length")
        if any(s < 0 for s in ref.shape) or any(s < 0 for s in stride):
            raise ArenaError(f"descriptor {ref}: negative sizes or strides are not allowed")
        if ref.offset % itemsize:
            raise ArenaError(
                f"descriptor {ref}: offset {ref.offset} is not a multiple of the {ref.dtype} "
                f"element size {itemsize}"
            )
        if math.prod(ref.shape) == 0:
            extent = 0
        else:
            extent = itemsize * (1 + sum((n - 1) * s for n, s in zip(ref.shape, stride)))
        if ref.offset < DATA_START or ref.offset + extent > self.nbytes:
            raise ArenaError(
                f"descriptor {ref} reaches bytes [{ref.offset}, {ref.offset + extent}) outside "
                f"the data region [{DATA_START}, {self.nbytes}) of arena {self.name!r}"
            )
        return extent


class ArenaAllocator:
    """Bump allocator handing out 64-byte-aligned descriptors inside one arena.

    Layouts are computed once per job (slots keyed by layer index), so there is no free():
    a new layout starts a new allocator over a fresh arena.
    """

    def __init__(self, arena_name: str, capacity: int | None = None):
        self.arena_name = arena_name
        self.capacity = capacity
        self.used = DATA_START

    def alloc(self, dtype: torch.dtype, shape: Sequence[int]) -> TensorRef:
        shape = tuple(int(s) for s in shape)
        offset = _round_up(self.used, ALIGNMENT)
        nbytes = _itemsize(dtype) * math.prod(shape)
        end = offset + nbytes
        if self.capacity is not None and end > self.capacity:
            raise ArenaError(
                f"arena {self.arena_name!r} is full: {nbytes} more bytes needed at offset "
                f"{offset}, capacity {self.capacity}"
            )
        self.used = end
        return TensorRef(
            arena=self.arena_name,
            offset=offset,
            dtype=dtype_to_name(dtype),
            shape=shape,
            stride=None,  # row-major
        )

    @property
    def nbytes_needed(self) -> int:
        """Data bytes to pass to :meth:`Arena.create` so every allocation fits."""
        return max(self.used - DATA_START, 0)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0
