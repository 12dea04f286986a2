"""Checkpoints on disk: written atomically, validated on load, free of worker topology.

A job's checkpoints live under ``<output>/checkpoints``::

    latest                          text file: name of the newest complete checkpoint
    step-00000004/                  one complete checkpoint (after optimizer step 4)
        config.json, model.safetensors, generation_config.json, tokenizer files
                                    the model in Hugging Face layout (LoRA: a PEFT adapter
                                    directory, adapter_config.json + adapter_model.safetensors)
        training_state/state.safetensors
                                    fp32 masters, AdamW moments, the compute-dtype weights
                                    of the previous version, RNG state (keys by parameter
                                    name: nothing depends on the plan or the workers)
        training_state/progress.safetensors
                                    the progress history so far (``PROGRESS_FILE``)
        checkpoint.json             the manifest, written last: step, job, spec, data
                                    cursor, and every file's size and SHA-256
    .tmp-step-00000006-<pid>-<hex>/ a write in progress (or one a dead process left)
    .trash-step-00000002-<pid>-<hex>/
                                    a checkpoint being removed

Note [atomic checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~
A write goes into a fresh ``.tmp-*`` directory; every file is fsynced (and hashed from
what was written), then the manifest is written and fsynced, then the directory itself.
Only then is it renamed to ``step-XXXXXXXX`` (rename is atomic within a file system) and
the parent directory fsynced; only after that is ``latest`` replaced, by writing a
temporary file, fsyncing it and ``os.replace``-ing it over the old pointer (again
followed by an fsync of the directory). So:

* a process killed at any point leaves ``latest`` naming a complete checkpoint (or no
  ``latest`` at all before the first one); leftovers are ``.tmp-*`` / ``.trash-*``
  directories that :meth:`CheckpointDir.remove_stale` deletes once their writer is dead;
* a ``step-*`` directory exists only complete, manifest included; the manifest's sizes
  and checksums catch later damage (a truncated or altered file), and
  :meth:`CheckpointDir.find_latest` then falls back to the newest checkpoint that passes;
* the pointer is a regular file replaced atomically, never a symlink that could dangle.

Removing a checkpoint (pruning to ``keep_last``, or replacing a directory of the same
name) first renames it to ``.trash-*``, so a half-deleted directory never looks like a
checkpoint.

Checkpoints belong to a job (``job_id`` in the manifest): ``find_latest(job_id=...)``
and ``prune`` only look at that job's, so a new job writing into an output directory
that holds another job's checkpoints neither resumes from them nor prunes them (a
checkpoint of the same step number is replaced).

The names on disk and the manifest reader live in the spec room
(roundpipe.coordinator.spec.checkpoint_format), which reads a checkpoint's manifest when it
checks ``model.resume_from``; this module writes, verifies and prunes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from roundpipe.coordinator.spec.checkpoint_format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    parse_step,
    read_manifest,
    read_pointer,
    sealed,
    step_name,
)
from roundpipe.coordinator.spec.paths import modes

__all__ = [
    "STATE_FILE",
    "CheckpointDir",
    "as_os_error",
    "load_tensors",
    "resolve_checkpoint",
    "StreamedTensors",
    "TensorEntry",
    "save_tensor_stream",
    "save_tensors",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

STATE_FILE = "training_state/state.safetensors"
PROGRESS_FILE = "training_state/progress.safetensors"
"""The progress history up to the checkpoint's step: one float64 tensor ``progress``,
``[steps, 6]`` (roundpipe.coordinator.training.progress_log.COLUMNS). Its own file, not
the manifest: every save reads every manifest of the directory to prune, and a history
of a long run is megabytes (checkpoints written before it hold the history in the
manifest, as ``progress``; they still load)."""

_TEMP_RE = re.compile(r"\.(?:tmp|trash)-.+-(\d+)-[0-9a-f]+\Z")
_CHUNK = 1 << 22


# --------------------------------------------------------------------------- fsync helpers


def fsync_dir(path: Path) -> None:
    """fsync a directory: the renames and creations in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_files(directory: Path) -> None:
    """fsync the regular files directly in ``directory``, then the directory: what a
    writer that is not atomic (``save_pretrained``) wrote there is on disk before the
    caller records that it was written."""
    for entry in directory.iterdir():
        if entry.is_file() and not entry.is_symlink():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the ``.tmp-*`` / ``.trash-*`` entries in ``directory`` whose writing
    process is gone (a writer killed between its writes and its renames)."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        log.info("[checkpoint] removed %d stale temporary entries in %s", len(removed), directory)
    return removed


def _create(path: Path) -> BinaryIO:
    """A new file of this process's private mode (0600 by default, whatever the umask),
    never through a symbolic link left at ``path``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    return os.fdopen(os.open(path, flags, modes().file), "wb")


def _write_synced(path: Path, data: bytes) -> None:
    with _create(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _hash_and_sync(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a written file, read back; fsync it (a read-only fd will do)."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
        os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover: this process is not writing it any more
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def as_os_error(exc: BaseException, path: Path | str) -> OSError | None:
    """The OSError behind ``exc``, if it is one: an OSError itself, or an I/O error that a
    library reported in its own type (safetensors: ``... (os error 28)``)."""
    if isinstance(exc, OSError):
        return exc
    m = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(exc))
    if m:
        code = int(m.group(1) or m.group(2))
        return OSError(code, os.strerror(code), str(path))
    return None


# --------------------------------------------------------------------------- tensor files

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def save_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` as a safetensors file, streaming each tensor's bytes (no copy of
    the whole state in memory; views into shared arenas are fine), then fsync it.

    The file is standard safetensors (``safetensors.safe_open`` reads it).
    """
    tensors = {name: t.detach() for name, t in tensors.items()}
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    save_tensor_stream(path, entries, iter([tensors]), metadata)


TensorEntry = tuple[str, torch.dtype, tuple[int, ...]]
"""A tensor's name, dtype and shape: what a safetensors header holds of it."""


class StreamedTensors(NamedTuple):
    """Tensors that arrive in parts (``save_tensor_stream``): all their entries up front,
    the parts one after another."""

    entries: Sequence[TensorEntry]
    parts: Iterator[Mapping[str, torch.Tensor]]


def save_tensor_stream(
    path: Path,
    entries: Sequence[TensorEntry],
    parts: Iterator[Mapping[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file whose tensors arrive in parts: the header is written
    first from ``entries`` (every tensor's name, dtype and shape, in file order), then
    each part of ``parts`` (a mapping of the next tensors in that order) as it comes, so
    only one part need be in memory at a time (Note [streamed checkpoint state] in
    roundpipe.coordinator.training.sharded_optimizer: one layer gathered from every
    node). Then fsync. A part that does not match the entries raises ValueError; the
    caller's temporary directory then goes (Note [atomic checkpoint])."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in entries:
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise TypeError(f"cannot save {name}: dtype {dtype} is not supported")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    expected = iter(entries)
    with _create(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for part in parts:
            for name, t in part.items():
                want = next(expected, None)
                if want is None or want != (name, t.dtype, tuple(t.shape)):
                    raise ValueError(
                        f"{path.name}: got tensor {name} {t.dtype}{list(t.shape)} where the "
                        f"header has {want or 'no more tensors'}"
                    )
                if t.device.type != "cpu":
                    t = t.cpu()
                if t.numel():
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        missing = next(expected, None)
        if missing is not None:
            raise ValueError(f"{path.name}: the parts ended before tensor {missing[0]}")
        f.flush()
        os.fsync(f.fileno())


def load_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, one tensor in memory at a time."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            yield key, f.get_tensor(key)


# --------------------------------------------------------------------------- validation


def verify_checkpoint(path: Path, *, checksums: bool = True) -> CheckpointInfo:
    """Check that ``path`` is a complete, undamaged checkpoint; return its manifest.

    Every file the manifest lists must exist with its recorded size and (with
    ``checksums``) SHA-256. Raises CheckpointError naming the first problem.
    """
    info = read_manifest(path)
    for rel, meta in info.manifest["files"].items():
        file = path / rel
        if rel.startswith("/") or ".." in Path(rel).parts or not isinstance(meta, dict):
            raise CheckpointError(f"{path / MANIFEST} lists an invalid file entry {rel!r}")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is damaged: {rel} is missing") from None
        if size != meta.get("size"):
            raise CheckpointError(
                f"checkpoint {path} is damaged: {rel} has {size} bytes, the manifest says "
                f"{meta.get('size')}"
            )
        if checksums and _sha256(file) != meta.get("sha256"):
            raise CheckpointError(f"checkpoint {path} is damaged: {rel} fails its SHA-256 check")
    return info


def _damage(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` by its files' sizes, or None."""
    try:
        verify_checkpoint(path, checksums=False)
    except CheckpointError as exc:
        return str(exc)
    return None


def resolve_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """A verified checkpoint from what a user points at: a ``step-*`` directory, a
    ``checkpoints`` directory (its newest good checkpoint), or a job's output directory
    (``<dir>/checkpoints``)."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return verify_checkpoint(p)
    for root in (p, p / "checkpoints"):
        if root.is_dir() and (
            (root / LATEST).is_file() or any(parse_step(e.name) is not None for e in root.iterdir())
        ):
            found = CheckpointDir(root).find_latest()
            if found is None:
                raise CheckpointError(f"{root} holds no complete, undamaged checkpoint")
            return found
    raise CheckpointError(
        f"{p} is not a RoundPipe checkpoint: expected a step-* directory holding {MANIFEST}, "
        "a checkpoints directory, or a job output directory with checkpoints/"
    )


# --------------------------------------------------------------------------- the directory


class CheckpointDir:
    """The ``checkpoints`` directory of one output directory (Note [atomic checkpoint])."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CheckpointDir({str(self.root)!r})"

    def _temp_path(self, kind: str, name: str) -> Path:
        return self.root / f".{kind}-{name}-{os.getpid()}-{secrets.token_hex(4)}"

    # -- housekeeping --

    def remove_stale(self) -> list[Path]:
        """Delete ``.tmp-*`` / ``.trash-*`` entries whose writing process is gone."""
        return remove_stale_temporaries(self.root)

    def ensure_writable(self) -> None:
        """Create the directory, remove stale temporaries, and prove a synced write works.

        Raises OSError (with the path) for an unwritable or full directory."""
        self.root.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        self.remove_stale()
        probe = self._temp_path("tmp", "probe")
        try:
            _write_synced(probe, b"roundpipe write probe\n")
        except OSError as exc:  # named by the directory: the probe is gone when it is read
            # (A read-only file system refuses even to unlink a file that is not there;
            # that must not replace the error that says so.)
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.root)) from exc
        probe.unlink()

    # -- reading --

    def pointer(self) -> str | None:
        """The checkpoint name ``latest`` holds, or None (absent or not a step name)."""
        return read_pointer(self.root)

    def _step_dirs(self) -> list[Path]:
        try:
            entries = list(self.root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        dirs = [e for e in entries if parse_step(e.name) is not None and e.is_dir()]
        return sorted(dirs, key=lambda e: parse_step(e.name) or 0)

    def complete(self, job_id: str | None = None) -> list[CheckpointInfo]:
        """Checkpoints with a readable manifest (of ``job_id`` if given), oldest first.
        File sizes and checksums are not checked here."""
        out = []
        for d in self._step_dirs():
            try:
                info = read_manifest(d)
            except CheckpointError:
                continue
            if job_id is None or info.job_id == job_id:
                out.append(info)
        return out

    def likely_resume(self, job_id: str | None = None) -> CheckpointInfo | None:
        """The checkpoint a resume most likely loads (``find_latest``'s order: ``latest``
        first, then the newest), judged by file sizes only: for a message, where
        ``find_latest`` would read every byte to verify checksums. None if none is
        intact."""
        name = self.pointer()
        mine = self.complete(job_id)
        pointed = [c for c in mine if c.path.name == name]
        rest = [c for c in reversed(mine) if c.path.name != name]
        return next((c for c in pointed + rest if _damage(c.path) is None), None)

    def find_latest(self, job_id: str | None = None) -> CheckpointInfo | None:
        """The newest complete, undamaged checkpoint (of ``job_id`` if given), or None.

        ``latest`` is tried first; if it is missing, damaged or another job's, the
        ``step-*`` directories are tried newest first (logging why the pointer's target
        was passed over)."""
        tried = set()
        name = self.pointer()
        if name is not None:
            tried.add(name)
            try:
                info = verify_checkpoint(self.root / name)
                if job_id is None or info.job_id == job_id:
                    return info
            except CheckpointError as exc:
                log.warning("[checkpoint] %s; falling back to an older checkpoint", exc)
        for d in reversed(self._step_dirs()):
            if d.name in tried:
                continue
            try:
                info = verify_checkpoint(d)
            except CheckpointError as exc:
                log.warning("[checkpoint] skipping %s", exc)
                continue
            if job_id is None or info.job_id == job_id:
                return info
        return None

    # -- writing --

    def write(
        self,
        step: int,
        fill: Callable[[Path], None],
        manifest: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint ``step`` atomically (Note [atomic checkpoint]); return its path.

        ``fill(directory)`` writes the checkpoint's files into a temporary directory;
        ``manifest`` is stored in ``checkpoint.json`` with ``format``, ``version``,
        ``step`` and ``files`` added. On any error the temporary directory is removed,
        ``latest`` is untouched, and the error propagates (I/O errors as OSError)."""
        name = step_name(step)
        self.root.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        tmp = self._temp_path("tmp", name)
        trash = None
        try:
            tmp.mkdir(mode=modes().dir)
            try:
                fill(tmp)
            except Exception as exc:
                os_error = as_os_error(exc, tmp)
                if os_error is None or os_error is exc:
                    raise
                raise os_error from exc
            files: dict[str, Any] = {}
            dirs = {tmp}
            for file in sorted(tmp.rglob("*")):
                if file.is_symlink():
                    raise OSError(f"checkpoint writer left a symlink {file}; expected files only")
                if file.is_dir():
                    dirs.add(file)
                    continue
                rel = file.relative_to(tmp).as_posix()
                if rel == MANIFEST:
                    raise ValueError(f"fill() must not write {MANIFEST}")
                files[rel] = _hash_and_sync(file)
            for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                if d != tmp:
                    fsync_dir(d)
            body = dict(manifest)
            body.update(
                format=FORMAT,
                version=FORMAT_VERSION,
                step=step,
                written_at=time.time(),
                files=files,
            )
            _write_synced(tmp / MANIFEST, json.dumps(sealed(body), indent=1).encode())
            fsync_dir(tmp)
            target = self.root / name
            if os.path.lexists(target):
                # A checkpoint of this step exists (another job's, or this job's from
                # before a crash that came before its pointer moved): replace it.
                trash = self._temp_path("trash", name)
                os.rename(target, trash)
            os.rename(tmp, target)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            self._write_pointer(name)
        except BaseException:
            # No pointer, no checkpoint: the caller reports this write as failed, so the
            # directory goes too (and the one it replaced comes back), or a later run
            # would resume from a checkpoint the job never announced.
            self.remove(target)
            if trash is not None:
                os.rename(trash, target)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return target

    def _write_pointer(self, name: str) -> None:
        tmp = self._temp_path("tmp", LATEST)
        try:
            _write_synced(tmp, (name + "\n").encode())
            try:
                os.replace(tmp, self.root / LATEST)
            except OSError as exc:  # named by `latest` (its filename is the temporary)
                raise OSError(exc.errno, exc.strerror or str(exc), str(self.root / LATEST)) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.root)

    def remove(self, path: Path) -> None:
        """Delete one checkpoint directory (renamed to ``.trash-*`` first)."""
        trash = self._temp_path("trash", path.name)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, keep_last: int, job_id: str | None) -> list[Path]:
        """Keep ``job_id``'s newest ``keep_last`` intact checkpoints up to ``latest`` (0:
        keep all); remove its older ones, its damaged ones, and any newer than ``latest``
        (left by a run that was interrupted before its pointer moved, and superseded by
        the resumed run). Never removes what ``latest`` names, nor other jobs'
        checkpoints, nor a directory whose manifest cannot be read (whose it is is not
        known). Intact: every file the manifest lists has its recorded size (checksums
        are not read here: that is every byte of every checkpoint, at every save). A
        damaged one counted toward ``keep_last`` left fewer checkpoints to resume from
        than asked for, while it can never be loaded."""
        latest = self.pointer()
        latest_step = parse_step(latest) if latest else None
        mine = self.complete(job_id)
        if latest_step is None:
            return []
        doomed = [c for c in mine if c.step > latest_step]
        intact = 0
        for c in reversed([c for c in mine if c.step <= latest_step]):
            if keep_last <= 0:
                break
            damage = _damage(c.path)
            if damage is not None and c.path.name != latest:
                log.warning("[checkpoint] removing a damaged checkpoint: %s", damage)
                doomed.append(c)
            elif damage is None and intact < keep_last:
                intact += 1
            else:
                doomed.append(c)
        removed = []
        for c in doomed:
            if c.path.name == latest:
                continue
            try:
                self.remove(c.path)
                removed.append(c.path)
            except OSError as exc:
                log.warning("[checkpoint] cannot remove old checkpoint %s: %s", c.path, exc)
        return removed
