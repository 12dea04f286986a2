"""Reading training records from local files: JSONL, Parquet, and ``datasets`` folders.

Every source yields ``Record(where, fields)``: ``where`` names the file and the line
(JSONL) or row (Parquet / Arrow) for error messages, ``fields`` is the record as a dict.

Sources (``record_source`` tells them apart; nothing is ever downloaded):

* a ``.jsonl`` / ``.ndjson`` / ``.json`` file: one JSON object per line (blank lines
  skipped);
* a ``.parquet`` file: read in row batches with pyarrow;
* a directory written by ``datasets``' ``save_to_disk`` (``state.json`` /
  ``dataset_dict.json``): opened with ``datasets.load_from_disk``; for a DatasetDict
  the split is ``split`` (default ``train``);
* a directory of ``.parquet`` or ``.arrow`` shards (as ``push_to_hub`` / ``to_parquet``
  leave them): every shard in name order.

Plain text (``.txt``) is not a record source; roundpipe.coordinator.spec.data reads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roundpipe.coordinator.spec.paths import open_for_read

__all__ = [
    "JSONL_EXTS",
    "PARQUET_EXTS",
    "Record",
    "RecordError",
    "first_record",
    "read_records",
    "record_source",
]

JSONL_EXTS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTS = (".parquet", ".pq")
_BATCH_ROWS = 1024


class RecordError(ValueError):
    """A record source is missing or unreadable; the message names the path (and line)."""


@dataclass(frozen=True, slots=True)
class Record:
    where: str
    """``path:line`` (JSONL) or ``path row N`` (table sources), for messages."""
    fields: dict[str, Any]


def record_source(path: str) -> str | None:
    """``"jsonl"``, ``"parquet"``, ``"datasets"`` (a saved Dataset / DatasetDict),
    ``"shards"`` (a folder of Parquet / Arrow files), or None: not a record source."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(
            os.path.join(path, "dataset_dict.json")
        ):
            return "datasets"
        if _shards(path):
            return "shards"
        return None
    ext = Path(path).suffix.lower()
    if ext in JSONL_EXTS:
        return "jsonl"
    if ext in PARQUET_EXTS:
        return "parquet"
    return None


def read_records(path: str, *, split: str = "train") -> Iterator[Record]:
    """Every record of ``path`` in order. RecordError for unreadable input."""
    kind = record_source(path)
    if kind == "jsonl":
        yield from _jsonl(path)
    elif kind == "parquet":
        yield from _parquet(path, path)
    elif kind == "datasets":
        yield from _saved_dataset(path, split)
    elif kind == "shards":
        for shard in _shards(path):
            if shard.endswith(".arrow"):
                yield from _arrow(shard)
            else:
                yield from _parquet(shard, shard)
    else:
        raise RecordError(
            f"{path} is not a JSONL or Parquet file, nor a folder saved by datasets "
            "(save_to_disk) or of .parquet/.arrow shards"
        )


def first_record(path: str, *, split: str = "train") -> Record | None:
    """The first record (for format detection), or None for an empty source."""
    for record in read_records(path, split=split):
        return record
    return None


# ------------------------------------------------------------------------ JSONL


def _jsonl(path: str) -> Iterator[Record]:
    try:
        # Bytes: decode per line, so a bad byte has a line number. In the coordinator no
        # symbolic link is followed: the path was resolved when the job was accepted.
        f = open_for_read(path)
    except OSError as exc:
        raise RecordError(f"cannot read data file {path}: {exc.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            line = decode_line(raw, path, lineno).strip()
            if not line:
                continue
            yield Record(f"{path}:{lineno}", parse_json_object(line, path, lineno))


def decode_line(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from None


def parse_json_object(line: str, path: str, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError(
            f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(record, dict):
        raise RecordError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    return record


# ------------------------------------------------------------------------ tables


def _shards(folder: str) -> list[str]:
    names = sorted(os.listdir(folder))
    parquet = [n for n in names if Path(n).suffix.lower() in PARQUET_EXTS]
    arrow = [n for n in names if n.endswith(".arrow")]
    return [os.path.join(folder, n) for n in (parquet or arrow)]


def _parquet(path: str, label: str) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - a dependency
        raise RecordError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise RecordError(f"cannot read Parquet file {path}: {exc}") from None
    row = 0
    for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
        for fields in batch.to_pylist():
            yield Record(f"{label} row {row}", fields)
            row += 1


def _arrow(path: str) -> Iterator[Record]:
    from datasets import Dataset

    try:
        ds = Dataset.from_file(path)  # memory-mapped, no cache written
    except Exception as exc:
        raise RecordError(f"cannot read Arrow shard {path}: {exc}") from None
    yield from _rows_of(ds, path)


def _saved_dataset(path: str, split: str) -> Iterator[Record]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:  # pragma: no cover - a dependency
        raise RecordError("reading a saved dataset needs the datasets package") from None
    try:
        ds = load_from_disk(path)
    except Exception as exc:
        raise RecordError(f"cannot load the dataset saved in {path}: {exc}") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise RecordError(
                f"{path} holds splits {', '.join(sorted(ds))} but not {split!r}; "
                "set data.split to one of them"
            )
        ds = ds[split]
        path = f"{path} [{split}]"
    yield from _rows_of(ds, path)


def _rows_of(ds: Any, label: str) -> Iterator[Record]:
    for start in range(0, len(ds), _BATCH_ROWS):
        chunk = ds[start : start + _BATCH_ROWS]  # a dict of columns
        names = list(chunk)
        for i, values in enumerate(zip(*(chunk[n] for n in names))):
            yield Record(f"{label} row {start + i}", dict(zip(names, values)))
