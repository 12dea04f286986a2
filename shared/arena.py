"""Named shared-memory arenas: the only place tensor data lives between processes.

An arena is one file in a RAM-backed directory (``/dev/shm`` by default) that every
process maps with ``mmap(MAP_SHARED)``. The coordinator *owns* its arenas (it creates and
unlinks them); workers *attach* (map, read and write, never unlink). Tensors are addressed
by descriptors (:class:`roundpipe.protocol.TensorRef`: arena name, byte offset, dtype,
shape, stride) and turned into zero-copy views here, so no tensor byte ever crosses a
socket.

Where arenas live (Note [private arena directory])::

    <arena root>/rp.<namespace>.<owner pid>.<owner start, cs>.<random>.d/    mode 0700
        rp.<namespace>.<owner pid>.<owner start, cs>.<arena name>.<random>   mode 0600
    e.g. /dev/shm/rp.c1a2b3c4d5.41327.173225123456.9f86d081884c7d65.d/
             rp.c1a2b3c4d5.41327.173225123456.params.5b2c0f7e1d9a3c44

The owner's pid *and* process start time are in the names, so a later owner can tell a
leftover of a crashed process (pid gone, or pid reused by a process that started at a
different time) from a live one without any lock file: :func:`remove_stale_arenas` deletes
only entries that match these exact patterns, belong to this user and whose owner is
provably dead. Attaching processes keep no record that could unlink anything, so an
attached process killed with SIGKILL leaves the owner's arena intact.
(``multiprocessing.shared_memory`` is avoided on purpose: its resource tracker unlinks
segments when an *attaching* process exits.)

Note [private arena directory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The arena root (``--arena-dir``, default ``/dev/shm``) is usually shared by every local
user. Names there must not be predictable, or anyone could create them first and make
every job fail; and nothing there may be mapped that someone else could have planted. So:

* :func:`prepare_arena_dir` gives each job (``JobLayout.create`` in the coordinator) a
  directory of its own: the root itself when that is already private (owned by this
  user, no group/other access), else a new ``rp.<ns>.<pid>.<start>.<random>.d`` in it,
  made with ``mkdir`` (exclusive: an existing name, link or not, is never reused) and
  mode 0700, and removed with the job's arenas. A root whose owner is neither this user
  nor root, or that others may write to without the sticky bit, is refused (the
  coordinator checks at start, :func:`check_arena_root`): they could rename that
  directory and put their own in its place.
* :meth:`Arena.create` creates only in a private directory (:func:`check_private_dir`,
  opened with ``O_NOFOLLOW``), with a random component in each file name, ``O_CREAT |
  O_EXCL | O_NOFOLLOW``, mode 0600.
* :meth:`Arena.attach` (the workers) opens with ``O_NOFOLLOW`` and maps only a regular file
  owned by the coordinator's user (workers run as that user: its own uid by default) with
  no group/other access (:func:`check_arena_file`).

Arenas never get group access (``--group-access`` is for job outputs): a worker must run
as the coordinator's user.

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

import errno
import logging
import math
import mmap
import os
import pwd
import re
import secrets
import stat
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
    "ArenaDir",
    "ArenaError",
    "arena_file_name",
    "check_arena_file",
    "check_arena_root",
    "check_private_dir",
    "default_arena_dir",
    "prepare_arena_dir",
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
_TOKEN_BYTES = 8  # 64 random bits in every directory and file name
# Files made before names had a random part (no ".<token>") are still cleaned up.
_FILE_RE = re.compile(
    r"^rp\.(?P<ns>[A-Za-z0-9_-]{1,40})\.(?P<pid>\d+)\.(?P<start>\d+)"
    r"\.(?P<name>[A-Za-z0-9_-]{1,24})(?:\.(?P<token>[0-9a-f]{16}))?$"
)
_DIR_RE = re.compile(
    r"^rp\.(?P<ns>[A-Za-z0-9_-]{1,40})\.(?P<pid>\d+)\.(?P<start>\d+)\.(?P<token>[0-9a-f]{16})\.d$"
)
_PRIVATE_DIR_MODE = 0o700
_ARENA_FILE_MODE = 0o600


class ArenaError(RuntimeError):
    """A shared-memory arena could not be created, attached or addressed."""


def default_arena_dir() -> Path:
    """The arena *root*: ``$ROUNDPIPE_ARENA_DIR``, else ``/dev/shm`` (RAM-backed), else the
    temp dir. Arenas go into a private directory in it (:func:`prepare_arena_dir`)."""
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


def arena_file_name(
    namespace: str, name: str, pid: int, start_cs: int, token: str | None = None
) -> str:
    """``rp.<namespace>.<pid>.<start>.<name>[.<token>]``; :meth:`Arena.create` always
    adds a random ``token`` (16 hex digits), so no other user can predict the name."""
    base = f"rp.{namespace}.{pid}.{start_cs}.{name}"
    return base if token is None else f"{base}.{token}"


def _owner_alive(pid: int, start_cs: int) -> bool:
    try:
        # Allow one tick of disagreement: create_time is rebuilt from /proc each call.
        return abs(process_start_cs(pid) - start_cs) <= 1
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by someone else: never touch it


# --------------------------------------------------------------------------- ownership


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def check_private_dir(st: os.stat_result, path: str | os.PathLike[str], uid: int) -> None:
    """Refuse ``path`` (``st``: its stat, taken through an open descriptor) as a directory
    to create arenas in unless it is a directory of user ``uid`` that no group or other
    user can access at all. Arenas never get group access."""
    if not stat.S_ISDIR(st.st_mode):
        raise ArenaError(f"arena directory {path} is not a directory")
    if st.st_uid != uid:
        raise ArenaError(
            f"arena directory {path} is owned by {_who(st.st_uid)}, not by the coordinator's "
            f"user ({_who(uid)}): whoever owns it can read, replace or remove the arenas in "
            "it, so it is refused. Have it removed (by its owner or root), or point "
            "--arena-dir / ROUNDPIPE_ARENA_DIR at a shared RAM-backed root such as /dev/shm, "
            "in which the coordinator makes a private directory of its own"
        )
    if st.st_mode & 0o077:
        raise ArenaError(
            f"arena directory {path} (owner {_who(st.st_uid)}) has mode {_mode(st)}: group "
            "or other users have access, and arenas need a directory only the coordinator's "
            f"user can open. Run `chmod 700 {path}`, or point --arena-dir / "
            "ROUNDPIPE_ARENA_DIR at a shared RAM-backed root such as /dev/shm, in which the "
            "coordinator makes a private directory (0700) of its own (in code: create in "
            "prepare_arena_dir(root, namespace).path)"
        )


def check_arena_file(st: os.stat_result, path: str | os.PathLike[str], uid: int) -> None:
    """Refuse to map ``path`` (``st``: its stat through the descriptor opened with
    ``O_NOFOLLOW``) unless it is a regular file of user ``uid`` (the coordinator's) with no
    group or other access: anything else was not made by :meth:`Arena.create` of that
    user, so someone else may have planted it."""
    if not stat.S_ISREG(st.st_mode):
        raise ArenaError(f"arena {path} is not a regular file: refused")
    if st.st_uid != uid:
        raise ArenaError(
            f"arena {path} is owned by {_who(st.st_uid)}, not by the coordinator's user "
            f"({_who(uid)}): refused, another user may have planted it. Workers must run as "
            "the coordinator's user (docs/deploy.md); if they do, remove the file (its owner "
            "or root) and restart the job"
        )
    if st.st_mode & 0o077:
        raise ArenaError(
            f"arena {path} (owner {_who(st.st_uid)}) has mode {_mode(st)}: group or other "
            "users may read or write it, and a RoundPipe arena is always 0600; refused. "
            "Remove it and restart the job"
        )


def _open_dir(path: Path) -> int:
    """A descriptor of directory ``path``, whose last component must not be a link."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ArenaError(
            f"arena directory {path} does not exist; create it or set ROUNDPIPE_ARENA_DIR / "
            "--arena-dir to a RAM-backed directory"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(path):
            raise ArenaError(
                f"arena directory {path} is a symbolic link: refused (whoever owns the link "
                "can re-point it); name the directory itself"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise ArenaError(f"arena directory {path} is not a directory") from None
        raise ArenaError(f"cannot open arena directory {path}: {exc.strerror}") from exc


def check_arena_root(root: str | os.PathLike[str], *, uid: int | None = None) -> Path:
    """The arena root ``root`` (links resolved: ``/dev/shm`` may be one), once it is safe
    to keep a private directory in for user ``uid`` (default: this process's): owned by
    that user or by root, and if group or others may write to it, with the sticky bit
    (else they could rename the private directory and put their own in its place).
    Raises :class:`ArenaError` saying what is wrong and what to do."""
    uid = os.geteuid() if uid is None else uid
    path = Path(os.path.realpath(root))
    fd = _open_dir(path)
    try:
        _root_is_private(os.fstat(fd), path, uid)
    finally:
        os.close(fd)
    return path


def _root_is_private(st: os.stat_result, path: Path, uid: int) -> bool:
    """Whether the root is private to ``uid`` already (then it holds arenas directly);
    raises :class:`ArenaError` for one that is unsafe to make a private directory in."""
    if st.st_uid == uid and not st.st_mode & 0o077:
        return True
    if st.st_uid not in (uid, 0):
        raise ArenaError(
            f"arena root {path} is owned by {_who(st.st_uid)}, neither the coordinator's user "
            f"({_who(uid)}) nor root: its owner could remove or replace the coordinator's "
            "arena directory in it. Point --arena-dir / ROUNDPIPE_ARENA_DIR at /dev/shm or "
            "at a directory of the coordinator's user"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ArenaError(
            f"arena root {path} (owner {_who(st.st_uid)}, mode {_mode(st)}) lets group or "
            "other users write to it without the sticky bit: they could rename the "
            "coordinator's arena directory and put their own in its place. Run `chmod +t "
            f"{path}` (as /dev/shm has) or `chmod go-w {path}`, or point --arena-dir / "
            "ROUNDPIPE_ARENA_DIR elsewhere"
        )
    return False


@dataclass
class ArenaDir:
    """Where a job's arenas live (:func:`prepare_arena_dir`). ``close()`` removes the
    directory if this process created it (after its arenas are destroyed)."""

    path: Path
    root: Path
    created: bool

    def close(self) -> None:
        if not self.created:
            return
        self.created = False
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning(
                "[arena] could not remove the arena directory %s (%s); the next coordinator "
                "of this namespace removes it",
                self.path,
                exc.strerror,
            )

    def __enter__(self) -> ArenaDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare_arena_dir(
    root: str | os.PathLike[str], namespace: str, *, uid: int | None = None
) -> ArenaDir:
    """A private directory for arenas of this process (a coordinator's job) below ``root``.

    First the leftovers of dead owners of ``namespace`` are removed
    (:func:`remove_stale_arenas`). A root that is already private to user ``uid`` (default:
    this process's) is used as it is; otherwise, once :func:`check_arena_root` accepts it,
    a new ``rp.<namespace>.<pid>.<start>.<random>.d`` (mode 0700) is made in it with
    ``mkdir``, which never reuses an existing name, and checked through a descriptor opened
    without following links. Note [private arena directory].
    """
    if not _NAMESPACE_RE.match(namespace):
        raise ArenaError(f"arena namespace {namespace!r} must be 1-40 characters of [A-Za-z0-9_-]")
    uid = os.geteuid() if uid is None else uid
    path = Path(os.path.realpath(root))
    fd = _open_dir(path)
    try:
        # Checked through the descriptor the directory is then made in.
        private_root = _root_is_private(os.fstat(fd), path, uid)
        remove_stale_arenas(path, namespace, uid=uid)
        if private_root:
            return ArenaDir(path=path, root=path, created=False)
        pid = os.getpid()
        start_cs = process_start_cs(pid)
        for _ in range(8):
            name = f"rp.{namespace}.{pid}.{start_cs}.{secrets.token_hex(_TOKEN_BYTES)}.d"
            try:
                os.mkdir(name, _PRIVATE_DIR_MODE, dir_fd=fd)
                break
            except FileExistsError:
                continue  # 64 random bits taken: someone is guessing; draw again
            except OSError as exc:
                raise ArenaError(
                    f"cannot create an arena directory in {path}: {exc.strerror}"
                ) from exc
        else:
            raise ArenaError(f"no free arena directory name in {path} after 8 random draws")
        private = path / name
        try:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            sub = os.open(name, flags, dir_fd=fd)
            try:
                os.fchmod(sub, _PRIVATE_DIR_MODE)  # whatever the umask took away
                check_private_dir(os.fstat(sub), private, uid)
            finally:
                os.close(sub)
        except BaseException:
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)
    log.info("[arena] arenas go to %s (mode 0700)", private)
    return ArenaDir(path=private, root=path, created=True)


def remove_stale_arenas(
    directory: str | os.PathLike[str], namespace: str, *, uid: int | None = None
) -> list[Path]:
    """Unlink arenas (and arena directories) of ``namespace`` in ``directory`` whose owner
    process is dead. Returns what was removed.

    Called by an owner when it starts (:func:`prepare_arena_dir`), so a crashed
    coordinator's leftovers do not pile up in RAM. Only names matching the arena patterns
    are considered, only entries of user ``uid`` (default: this process's) that are not
    links, and an entry whose owner is alive (same pid and start time) is never removed.
    """
    uid = os.geteuid() if uid is None else uid
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        file_match = _FILE_RE.match(entry.name)
        match = file_match or _DIR_RE.match(entry.name)
        if match is None or match["ns"] != namespace:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if st.st_uid != uid or _owner_alive(int(match["pid"]), int(match["start"])):
            continue
        path = Path(entry.path)
        if file_match is not None and stat.S_ISREG(st.st_mode):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass  # another starting owner got there first
        elif file_match is None and stat.S_ISDIR(st.st_mode):
            removed.extend(_remove_arena_dir(path))
    if removed:
        log.info(
            "[arena] removed %d stale arena(s) of dead owners: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def _remove_arena_dir(path: Path) -> list[Path]:
    """The arena files in a dead owner's private directory, then the directory."""
    removed: list[Path] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return removed  # gone, or replaced by something else since: not ours to touch
    try:
        for name in os.listdir(fd):
            if _FILE_RE.match(name) is None:
                continue
            try:
                os.unlink(name, dir_fd=fd)
                removed.append(path / name)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("[arena] left %s of a dead coordinator in place: %s", path, exc.strerror)
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

        ``directory`` must be private to this user (:func:`check_private_dir`; a
        coordinator's comes from :func:`prepare_arena_dir`); the file gets a random name
        component and is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600. It is
        allocated up front (``posix_fallocate``), so a RAM disk that is too small fails
        here, with the sizes in the message, instead of a SIGBUS mid-training.
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
        dir_fd = _open_dir(directory)
        try:
            check_private_dir(os.fstat(dir_fd), directory, os.geteuid())
            return cls._create_in(dir_fd, directory, name, nbytes, namespace, prefault)
        finally:
            os.close(dir_fd)

    @classmethod
    def _create_in(
        cls, dir_fd: int, directory: Path, name: str, nbytes: int, namespace: str, prefault: bool
    ) -> Arena:
        pid = os.getpid()
        start_cs = process_start_cs(pid)
        total = DATA_START + _round_up(max(nbytes, 1), mmap.PAGESIZE)
        file_name = arena_file_name(namespace, name, pid, start_cs, secrets.token_hex(_TOKEN_BYTES))
        path = directory / file_name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(file_name, flags, _ARENA_FILE_MODE, dir_fd=dir_fd)
        except FileExistsError:
            raise ArenaError(
                f"arena {path} already exists in this process's private directory"
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
            try:
                os.unlink(file_name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)  # the mapping keeps the file alive
        header = _Header(nbytes=total, owner_pid=pid, owner_start_cs=start_cs, name=name)
        mapping[: _HEADER.size] = _HEADER.pack(
            _MAGIC, _LAYOUT_VERSION, 0, total, pid, start_cs, name.encode()
        )
        log.debug("[arena] created %s (%d bytes)", path, total)
        return cls(path, mapping, header, owner=True)

    @classmethod
    def attach(
        cls, path: str | os.PathLike[str], *, prefault: bool = False, owner_uid: int | None = None
    ) -> Arena:
        """Map an existing arena read-write. Never unlinks it, whatever happens later.

        Only a regular file of user ``owner_uid`` (the coordinator's; default this
        process's, as workers run as the coordinator's user) with mode 0600 is mapped, and
        the path's last component must not be a link (:func:`check_arena_file`).
        """
        path = Path(path)
        uid = os.geteuid() if owner_uid is None else owner_uid
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArenaError(
                f"arena {path} does not exist: its owner (the coordinator) has exited or "
                "removed it; reconnect to the coordinator for the current arenas"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ArenaError(
                    f"arena {path} is a symbolic link: refused (an arena is a file the "
                    "coordinator created; someone may have planted the link)"
                ) from None
            raise ArenaError(f"cannot open arena {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            check_arena_file(st, path, uid)
            size = st.st_size
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
        """Let go of the mapping: it is unmapped at once if no tensor view of it is
        left, else when the last one goes. Idempotent.

        Never ``mmap.close()``: ``torch.frombuffer`` holds a reference to the mmap
        object, not a buffer export, so closing it unmapped the memory under live views
        (a transfer or compute thread still finishing its task segfaulted). Views in
        reference cycles go when the cycle collector runs: the coordinator collects
        after each job (``release_freed_memory``)."""
        if self._closed:
            return
        self._closed = True
        self._bytes = None  # type: ignore[assignment]
        self._mmap = None  # type: ignore[assignment]

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
