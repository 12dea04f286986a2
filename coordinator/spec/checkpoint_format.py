"""How a RoundPipe checkpoint looks on disk, read side: its names and its manifest.

The spec room reads a checkpoint's manifest when it checks ``model.resume_from`` (the
model, data and batch settings must be those the checkpoint was written with), before
any training code runs; :mod:`roundpipe.coordinator.training.checkpoint` writes, verifies
and prunes checkpoints with the same names (the layout is drawn there, Note [atomic
checkpoint]). Nothing here checks the files' sizes or checksums; the manifest's own
digest (``MANIFEST_DIGEST``) is checked whenever it is read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MANIFEST_DIGEST",
    "CheckpointError",
    "CheckpointInfo",
    "parse_step",
    "manifest_digest",
    "read_manifest",
    "read_pointer",
    "sealed",
    "step_name",
]

FORMAT = "roundpipe-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
MANIFEST_DIGEST = "manifest_sha256"
LATEST = "latest"

_STEP_RE = re.compile(r"step-(\d{8,})\Z")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged; the message names the file."""


def step_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer step ``step``."""
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name (``step-00000004`` -> 4), or None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory and its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def job_id(self) -> str | None:
        return self.manifest.get("job_id")


def read_manifest(path: Path) -> CheckpointInfo:
    """Parse ``path/checkpoint.json`` (no file checks); CheckpointError if unusable."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {MANIFEST} is missing"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a RoundPipe checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file} has checkpoint format version {manifest.get('version')!r}; this "
            f"RoundPipe reads version {FORMAT_VERSION}"
        )
    digest = manifest.get(MANIFEST_DIGEST)
    if digest is not None and digest != manifest_digest(manifest):
        # (A manifest written before the digest existed has none: it is read unchecked.)
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} fails its SHA-256 check")
    step = manifest.get("step")
    files = manifest.get("files")
    if not isinstance(step, int) or step < 0 or not isinstance(files, dict):
        raise CheckpointError(f"{file} lacks a valid step or file list")
    named = parse_step(path.name)
    if named is not None and named != step:
        raise CheckpointError(
            f"checkpoint {path} is damaged: its {MANIFEST} says step {step}, its name step {named}"
        )
    return CheckpointInfo(path, step, manifest)


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """SHA-256 of a manifest's content but its own digest (``MANIFEST_DIGEST``), in a
    canonical JSON form: every file of a checkpoint is checked against the manifest, and
    the manifest against this."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with its digest, as written."""
    return {**manifest, MANIFEST_DIGEST: manifest_digest(manifest)}


def read_pointer(root: Path) -> str | None:
    """The checkpoint name ``root/latest`` holds, or None (absent, or not a regular file
    holding a step name). An output directory is the submitter's to fill: ``latest``
    may be anything there, and the coordinator reads it at start, so it reads at most
    a few bytes of a regular file, never a symbolic link, and never waits (a FIFO)."""
    try:
        fd = os.open(root / LATEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link: never what a writer leaves
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, 256)
    finally:
        os.close(fd)
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return name if parse_step(name) is not None else None
