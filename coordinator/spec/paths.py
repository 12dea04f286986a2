"""Where a job may read and write: the coordinator's allowed roots, and private file modes.

A job spec names files (data, model, tokenizer, a checkpoint to resume from) and an
output directory; the coordinator opens them with its own rights, which are not the
submitter's. So it reads only below ``--allow-read`` roots and writes only below
``--allow-write`` roots (:class:`PathPolicy`), and refuses anything else *before it opens
a single byte*: a refusal says which field, which path, which rule and which flag would
change it, and never anything read from the file.

Rules (docs/deploy.md, "Paths and file modes"):

* A path is resolved first (``..``, every symbolic link), and the resolved path must lie
  below a root: a link inside a root that points out of it is refused like the outside
  path itself. The spec the coordinator keeps holds the resolved paths.
* When a job starts, every path is resolved again and must still be what was accepted
  (a link planted after the submission is refused); the data file is opened without
  following any symbolic link (:func:`open_no_symlinks`), so it is the accepted file.
* Output goes only into directories the coordinator owns (or root owns), that nobody
  else can write to (:meth:`PathPolicy.prepare_output`): missing ones are created, 0700,
  walking down from the root without following links, and the checked directory is held
  open while a checkpoint or the model is written into it (:func:`pinned_dir`). So a
  link swapped into the path after the check receives nothing.
* What the coordinator writes is private: files 0600, directories 0700
  (:data:`PRIVATE_MODES`); ``--group-access`` makes them 0640 / 0750 for a team that
  shares results through the coordinator's group.
* Write roots are readable too (resuming from a checkpoint, training an exported model).
* Which fields are paths is read from the job-spec schema (``sections.PATH_FIELDS``, Note
  [paths are a type]), never from a list kept here: a new path field is confined the
  day it is declared.
* What a job writes belongs to its owner (:func:`check_ownership`): another owner's job
  may neither write into nor read from a job's output or job directory (admins may read
  them); the job book says which directories are whose.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from roundpipe.coordinator.spec.errors import HOST_OUT_OF_RESOURCES, FieldError, JobSpecError
from roundpipe.coordinator.spec.sections import PATH_FIELDS

__all__ = [
    "DEMO_DATA_DIR",
    "GROUP_MODES",
    "PRIVATE_MODES",
    "FileModes",
    "OwnedDir",
    "PathPolicy",
    "PathRefused",
    "check_ownership",
    "modes",
    "open_for_read",
    "open_no_symlinks",
    "pinned_dir",
    "restrict_tree",
    "set_modes",
    "set_strict_reads",
    "spec_read_dirs",
]

log = logging.getLogger(__name__)

# Found through the `roundpipe` package itself, wherever the install put it (a checkout's
# roundpipe/ folder, or site-packages/roundpipe/).
DEMO_DATA_DIR = Path(importlib.util.find_spec("roundpipe").origin).resolve().parent / "demo_data"
"""The shipped demo corpus and tokenizer: always readable (they are part of the install)."""

MAX_TREE_ENTRIES = 100_000
"""Most entries a directory named by a spec may hold (each is checked for links out)."""

ENV_ALLOW_READ = "ROUNDPIPE_ALLOW_READ"
ENV_ALLOW_WRITE = "ROUNDPIPE_ALLOW_WRITE"


# --------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class FileModes:
    file: int
    dir: int
    umask: int


PRIVATE_MODES = FileModes(file=0o600, dir=0o700, umask=0o077)
GROUP_MODES = FileModes(file=0o640, dir=0o750, umask=0o027)
_modes = PRIVATE_MODES


def set_modes(chosen: FileModes) -> None:
    """Use ``chosen`` for everything this process writes from now on, and as its umask
    (which covers what libraries write: transformers' ``save_pretrained``, logs)."""
    global _modes
    _modes = chosen
    os.umask(chosen.umask)


def modes() -> FileModes:
    """The modes this process writes with (default :data:`PRIVATE_MODES`)."""
    return _modes


_strict_reads = False


def set_strict_reads(strict: bool) -> None:
    """In the coordinator (and its spec checker): spec paths were resolved when the job
    was accepted, so a symbolic link in one now is tampering: :func:`open_for_read`
    refuses it. Elsewhere (library use) links are followed as usual."""
    global _strict_reads
    _strict_reads = strict


def open_for_read(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a file a job spec names: :func:`open_no_symlinks` in the coordinator, a plain
    ``open`` elsewhere."""
    if _strict_reads:
        return open_no_symlinks(os.path.abspath(os.fspath(path)))
    return open(path, "rb")


def restrict_tree(directory: str | os.PathLike[str]) -> None:
    """Give ``directory`` and everything below it this process's modes (files written
    by libraries that open with 0666 under a lax umask). Symbolic links are left alone
    (``chmod`` would follow them)."""
    m = modes()
    os.chmod(directory, m.dir)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, m.dir)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, m.file)


# --------------------------------------------------------------------------- refusals


class PathRefused(Exception):
    """A path the coordinator may not use; the message says why and what to change."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
        self.reason = message


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _show_roots(roots: Iterable[str]) -> str:
    return ", ".join(roots) or "(none)"


def open_no_symlinks(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open an absolute ``path`` for reading, refusing a symbolic link in *any* component
    (OSError ELOOP/ENOTDIR): each directory is opened with O_NOFOLLOW relative to the
    one before, so what is opened is exactly what ``path`` spells, whatever is renamed
    or linked meanwhile."""
    p = os.fspath(path)
    if not os.path.isabs(p):
        raise ValueError(f"expected an absolute path, got {p!r}")
    parts = [x for x in p.split(os.sep) if x]
    fd = os.open(os.sep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)
    return os.fdopen(file_fd, "rb")


_FD_DIR = "/proc/self/fd"


def pinned_dir(fd: int) -> Path | None:
    """A path that names the directory open as ``fd`` itself, not whatever its old path
    names now: Linux's ``/proc/self/fd/N`` (None where /proc is not mounted).

    Libraries that write a checkpoint (torch.save, save_pretrained) take paths, not
    directory descriptors; handing them this path makes every file they create land in
    the directory that :meth:`PathPolicy.open_output` checked, even if someone renames
    it away and puts a link in its place while they write."""
    path = Path(_FD_DIR) / str(fd)
    return path if os.path.isdir(path) else None


# --------------------------------------------------------------------------- the policy


def _resolve_root(value: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(value)))


def _env_roots(environ: Mapping[str, str], name: str) -> list[str]:
    return [x for x in environ.get(name, "").split(os.pathsep) if x.strip()]


@dataclass(frozen=True)
class PathPolicy:
    """The directories a coordinator reads from and writes into (resolved paths)."""

    read_roots: tuple[str, ...]
    write_roots: tuple[str, ...]

    @classmethod
    def create(
        cls, read: Iterable[str | os.PathLike[str]], write: Iterable[str | os.PathLike[str]]
    ) -> PathPolicy:
        """Roots as given (resolved); write roots are readable too."""
        write_roots = tuple(dict.fromkeys(_resolve_root(w) for w in write))
        read_roots = tuple(dict.fromkeys([*(_resolve_root(r) for r in read), *write_roots]))
        return cls(read_roots, write_roots)

    @classmethod
    def for_coordinator(
        cls,
        state_dir: str | os.PathLike[str],
        allow_read: Iterable[str] = (),
        allow_write: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> PathPolicy:
        """The coordinator's roots: ``--allow-read``/``--allow-write`` plus
        ``$ROUNDPIPE_ALLOW_READ``/``$ROUNDPIPE_ALLOW_WRITE`` (``:``-separated), plus
        always ``<state dir>/jobs`` (default job outputs) for both and the shipped demo
        data for reading."""
        env = os.environ if environ is None else environ
        jobs = Path(state_dir) / "jobs"
        write = [*allow_write, *_env_roots(env, ENV_ALLOW_WRITE), jobs]
        read = [*allow_read, *_env_roots(env, ENV_ALLOW_READ), DEMO_DATA_DIR]
        return cls.create(read, write)

    def describe(self) -> str:
        return (
            f"reads below {_show_roots(self.read_roots)}; "
            f"writes below {_show_roots(self.write_roots)}"
        )

    def warn_about_open_roots(self) -> None:
        """Log write roots others can write to without the sticky bit: another user could
        rename a job's output directory away and put their own in its place."""
        for root in self.write_roots:
            try:
                st = os.stat(root)
            except OSError:
                log.warning("[paths] write root %s does not exist (yet)", root)
                continue
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                log.warning(
                    "[paths] write root %s is writable by group or others without the "
                    "sticky bit: chmod +t it (as /tmp), or give each user their own root",
                    root,
                )

    # -- checks at submit --

    def check_read(self, value: str, field: str = "") -> str:
        """The resolved path of ``value`` if it lies below a read root; else PathRefused.
        Nothing is opened; the message names no file content and does not say whether
        an outside path exists. A directory (a model, a tokenizer, a checkpoint) must
        not hold a symbolic link that leads out of the roots either: the libraries that
        load it open its files by name (``model.safetensors`` linked to another user's
        weights would otherwise be trained on and exported)."""
        resolved = self._check(value, field, self.read_roots, "--allow-read", "read")
        if os.path.isdir(resolved):
            self._check_tree(resolved, field)
        return resolved

    def _check_tree(self, directory: str, field: str) -> None:
        seen = 0
        for top, dirs, files in os.walk(directory):  # links are not descended into
            for name in dirs + files:
                seen += 1
                if seen > MAX_TREE_ENTRIES:
                    raise PathRefused(
                        field,
                        f"access refused to {directory!r}: it holds more than "
                        f"{MAX_TREE_ENTRIES} entries; name the model, tokenizer or "
                        "checkpoint directory itself",
                    )
                path = os.path.join(top, name)
                if os.path.islink(path) and not any(
                    _within(os.path.realpath(path), r) for r in self.read_roots
                ):
                    raise PathRefused(
                        field,
                        f"access refused to {directory!r}: it holds a symbolic link "
                        f"{os.path.relpath(path, directory)!r} that leads out of every "
                        "directory this coordinator may read; replace it by the file, "
                        "or ask the operator to add the target's directory with "
                        "--allow-read DIR",
                    )

    def check_write(self, value: str, field: str = "") -> str:
        return self._check(value, field, self.write_roots, "--allow-write", "write to")

    def _check(self, value: Any, field: str, roots: tuple[str, ...], flag: str, verb: str) -> str:
        if not isinstance(value, str) or not value:
            raise PathRefused(field, f"expected a path, got {type(value).__name__}")
        if "\0" in value:
            raise PathRefused(field, "access refused: the path contains a NUL byte")
        given = os.path.abspath(os.path.expanduser(value))
        resolved = os.path.realpath(given)
        if any(_within(resolved, r) for r in roots):
            return resolved
        if any(_within(given, r) for r in roots):
            why = (
                "it lies inside an allowed directory but leads out of it (through '..' or a "
                "symbolic link)"
            )
        else:
            why = "it is outside every directory this coordinator may " + verb
        raise PathRefused(
            field,
            f"access refused to {value!r}: {why}. The coordinator may {verb} only below "
            f"{_show_roots(roots)}; put the file there, or ask the operator to add its "
            f"directory with {flag} DIR",
        )

    def confine_spec(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of a raw spec dict whose path fields are resolved and allowed; raises
        JobSpecError listing every refused path (nothing in the spec is opened here)."""
        if not isinstance(spec, Mapping):
            return spec  # not a spec at all: its validation says so
        out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in spec.items()}
        problems: list[FieldError] = []
        for f in PATH_FIELDS:
            raw = out.get(f.section)
            if not isinstance(raw, dict) or raw.get(f.key) in (None, ""):
                continue  # missing or malformed: the spec's own validation says so
            try:
                raw[f.key] = self._checker(f.access)(raw[f.key], f.dotted)
            except PathRefused as exc:
                problems.append(FieldError(exc.field, exc.reason))
        if problems:
            raise JobSpecError(problems)
        return out

    def _checker(self, access: str) -> Callable[[str, str], str]:
        return {"read": self.check_read, "write": self.check_write}[access]

    # -- checks when a job runs --

    def recheck(self, spec: Mapping[str, Any]) -> None:
        """Before a job opens its files: each path still resolves to itself (no link
        appeared since it was accepted) and lies below a root. Raises PathRefused."""
        for f in PATH_FIELDS:
            raw = spec.get(f.section)
            value = raw.get(f.key) if isinstance(raw, Mapping) else None
            if not value:
                continue
            if self._checker(f.access)(value, f.dotted) != value:
                raise PathRefused(
                    f.dotted,
                    f"access refused to {value!r}: it resolved to itself when the job "
                    "was accepted, and now leads elsewhere (a symbolic link or a "
                    "renamed directory appeared in it); submit the job again",
                )

    def prepare_output(self, directory: str | os.PathLike[str], field: str = "output.dir") -> Path:
        """Create ``directory`` (and missing parents) below its write root and prove that
        nobody but the coordinator can change what it names: every directory from the
        root down is entered without following links, and each below the root must be
        owned by the coordinator (or root) and not writable by group or others. New
        directories get this process's directory mode. Raises PathRefused."""
        os.close(self.open_output(directory, field))
        return Path(os.path.abspath(os.fspath(directory)))

    def open_output(self, directory: str | os.PathLike[str], field: str = "output.dir") -> int:
        """:meth:`prepare_output`, returning a file descriptor of the directory it checked
        (the caller closes it). Writing through it (:func:`pinned_dir`) reaches that
        directory even if its path is renamed away and a link put in its place after the
        check: the check and the write cannot be separated."""
        path = os.path.abspath(os.fspath(directory))
        root = max((r for r in self.write_roots if _within(path, r)), key=len, default=None)
        if root is None:
            self.check_write(path, field)  # raises, with the usual message
            raise AssertionError("unreachable")
        rel = [x for x in os.path.relpath(path, root).split(os.sep) if x not in ("", ".")]
        me = os.geteuid()
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno in HOST_OUT_OF_RESOURCES:
                raise  # not the spec's fault: the job pauses, to be resumed
            raise PathRefused(
                field, f"write root {root} cannot be opened ({exc.strerror}); create it"
            ) from None
        try:
            walked = root
            for name in rel:
                walked = os.path.join(walked, name)
                created = False
                try:
                    os.mkdir(name, modes().dir, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass
                try:
                    nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in HOST_OUT_OF_RESOURCES:
                        raise
                    raise PathRefused(
                        field,
                        f"access refused to {walked!r}: it is a symbolic link or not a "
                        f"directory ({exc.strerror}); the coordinator writes only into real "
                        "directories below its write roots",
                    ) from None
                os.close(fd)
                fd = nxt
                st = os.fstat(fd)
                if created:
                    os.fchmod(fd, modes().dir)
                elif st.st_uid not in (me, 0) or (
                    st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
                ):
                    raise PathRefused(
                        field,
                        f"access refused to {walked!r}: the coordinator writes only into "
                        "directories it owns and nobody else can write to (this one is "
                        f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
                        "name a directory that does not exist yet: the coordinator creates "
                        "it",
                    )
        except BaseException:
            os.close(fd)
            raise
        return fd


def spec_read_dirs(spec: Any) -> list[str]:
    """Directories holding what a spec (a JobSpec or its dict) reads: for launchers that
    start their own private coordinator for one user's job (the demo, benchmarks)."""
    raw = spec.to_dict() if hasattr(spec, "to_dict") else spec
    dirs = []
    for f in PATH_FIELDS:
        value = (raw.get(f.section) or {}).get(f.key) if f.access == "read" else None
        if value:
            p = os.path.abspath(value)
            dirs.append(p if os.path.isdir(p) else os.path.dirname(p))
    return dirs


# --------------------------------------------------------------------------- ownership


@dataclass(frozen=True)
class OwnedDir:
    """A directory that belongs to one job, and so to its owner: the job's own directory
    in the state directory (its log) and its output directory. Resolved paths."""

    path: str
    owner: str
    job_id: str


def check_ownership(
    spec: Mapping[str, Any], owner: str, *, admin: bool, owned: Iterable[OwnedDir]
) -> None:
    """Refuse a (confined) spec whose paths reach into another owner's job: writing into
    (or around) another owner's output or job directory, for anyone; reading from one,
    for anyone but an admin. Raises JobSpecError listing every such field. The message
    names neither the other owner nor their job."""
    theirs = [d for d in owned if d.owner != owner]
    problems: list[FieldError] = []
    for f in PATH_FIELDS:
        raw = spec.get(f.section)
        value = raw.get(f.key) if isinstance(raw, Mapping) else None
        if not isinstance(value, str) or not value or (admin and f.access == "read"):
            continue
        path = os.path.realpath(value)
        for d in theirs:
            inside, around = _within(path, d.path), _within(d.path, path)
            if not (inside or around):
                continue
            where = "lies in" if inside else "holds"
            if f.access == "write":
                why = (
                    f"it {where} the output or log of a job that belongs to another owner, and "
                    "a job's output is written only by its owner's jobs; choose another "
                    f"{f.dotted}, or leave it empty for a directory of this job's own"
                )
            else:
                why = (
                    f"it {where} the output or log of a job that belongs to another owner, which "
                    "only that owner's jobs (and admins) may read; ask its owner to share "
                    "a copy below a directory of --allow-read"
                )
            problems.append(FieldError(f.dotted, f"access refused to {value!r}: {why}"))
            break
    if problems:
        raise JobSpecError(problems)
