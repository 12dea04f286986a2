"""Where training rows come from: JSONL and Parquet files, and ``datasets`` folders.

Every source yields ``SourceRow(where, fields)``: ``where`` names the file and the line
(JSONL) or row (Parquet / Arrow) for error messages, ``fields`` is the row as a dict (one
JSON object, one table row). These are a file's rows, before tokenizing; the fixed-length
token rows a job trains on are packed from them in roundpipe.coordinator.spec.data.

Sources (``source_kind`` tells them apart; nothing is ever downloaded):

* a ``.jsonl`` / ``.ndjson`` / ``.json`` file: one JSON object per line (blank lines
  skipped);
* a ``.parquet`` file: read in row batches with pyarrow;
* a directory written by ``datasets``' ``save_to_disk`` (``state.json`` /
  ``dataset_dict.json``): opened with ``datasets.load_from_disk``; for a DatasetDict
  the split is ``split`` (default ``train``);
* a directory of ``.parquet`` or ``.arrow`` shards (as ``push_to_hub`` / ``to_parquet``
  leave them): every shard in name order; of shards named for several splits
  (``train-00000-of-00001.parquet``, ``test-...``), those of ``split`` only.

Plain text (``.txt``) is not a row source; roundpipe.coordinator.spec.documents reads it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roundpipe.coordinator.spec.errors import host_shortage
from roundpipe.coordinator.spec.paths import open_for_read

__all__ = [
    "JSONL_EXTS",
    "PARQUET_EXTS",
    "SourceRow",
    "SourceError",
    "first_row",
    "read_rows",
    "source_kind",
]

JSONL_EXTS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTS = (".parquet", ".pq")
_BATCH_ROWS = 1024


class SourceError(ValueError):
    """A source is missing or unreadable; the message names the path (and line)."""


@dataclass(frozen=True, slots=True)
class SourceRow:
    """One row of a source: a JSON object of a JSONL file, or a table row."""

    where: str
    """``path:line`` (JSONL) or ``path row N`` (table sources), for messages."""
    fields: dict[str, Any]


def source_kind(path: str) -> str | None:
    """``"jsonl"``, ``"parquet"``, ``"datasets"`` (a saved Dataset / DatasetDict),
    ``"shards"`` (a folder of Parquet / Arrow files), or None: not a row source."""
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


def read_rows(path: str, *, split: str = "train") -> Iterator[SourceRow]:
    """Every row of ``path`` in order. SourceError for unreadable input."""
    kind = source_kind(path)
    if kind == "jsonl":
        yield from _jsonl(path)
    elif kind == "parquet":
        yield from _parquet(path, path)
    elif kind == "datasets":
        yield from _saved_dataset(path, split)
    elif kind == "shards":
        for shard in _shards(path, split):
            if shard.endswith(".arrow"):
                yield from _arrow(shard)
            else:
                yield from _parquet(shard, shard)
    else:
        raise SourceError(
            f"{path} is not a JSONL or Parquet file, nor a folder saved by datasets "
            "(save_to_disk) or of .parquet/.arrow shards"
        )


def first_row(path: str, *, split: str = "train") -> SourceRow | None:
    """The first row (for format detection), or None for an empty source."""
    for row in read_rows(path, split=split):
        return row
    return None


# ------------------------------------------------------------------------ JSONL


def _jsonl(path: str) -> Iterator[SourceRow]:
    try:
        # Bytes: decode per line, so a bad byte has a line number. In the coordinator no
        # symbolic link is followed: the path was resolved when the job was accepted.
        f = open_for_read(path)
    except OSError as exc:
        if host_shortage(exc) is not None:
            raise  # the host's shortage, not the file's: the job pauses (spec.errors)
        raise SourceError(f"cannot read data file {path}: {exc.strerror}") from None
    with f:
        first = True
        for lineno, raw in enumerate(f, 1):
            line = decode_line(raw, path, lineno).strip()
            if not line:
                continue
            yield SourceRow(f"{path}:{lineno}", parse_json_object(line, path, lineno, first))
            first = False


def decode_line(raw: bytes, path: str, lineno: int) -> str:
    """Line ``lineno`` of ``path`` as text; the first line without its byte-order mark
    (editors on Windows write one: it is not text to train on)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from None
    return text.removeprefix("\ufeff") if lineno == 1 else text


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` is text a tokenizer takes: JSON's ``\\ud83d`` escapes can leave
    an unpaired surrogate half, which fast tokenizers refuse with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json_object(line: str, path: str, lineno: int, first: bool = False) -> dict[str, Any]:
    """The record on line ``lineno`` (``first``: the file's first non-blank line)."""
    if first and line.startswith("["):
        # The usual instruction-data .json (Alpaca, LLaMA-Factory): one array of records,
        # often pretty-printed. Its first line is not a record; say what the file is,
        # and how to convert it (into another file: `> itself` would empty it first).
        name = Path(path).name
        out = Path(path).stem + (".converted.jsonl" if name.endswith(".jsonl") else ".jsonl")
        raise SourceError(
            f"{path}:{lineno}: this looks like a JSON array of records; data files are "
            'JSON Lines, one object per line: convert it, e.g. python -c "import json, '
            'sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]" '
            f"{name} > {out}"
        )
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SourceError(
            f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    except RecursionError:
        raise SourceError(f"{path}:{lineno}: JSON nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise SourceError(f"{path}:{lineno}: unreadable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


# ------------------------------------------------------------------------ tables


_SPLIT_SHARD = re.compile(r"(?P<split>.+?)-\d+-of-\d+(?:-[0-9a-f]+)?\.[^.]+")
"""A shard named for its split, as ``push_to_hub`` writes them:
``train-00000-of-00002.parquet`` (``datasets`` 2 added a fingerprint:
``train-00000-of-00002-0b1c2d3e4f506172.parquet``)."""

_SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""Names that ``datasets`` reads as a split when a file's name starts with one, followed
by a separator (``-._`` , a space or a digit) or nothing: ``train.parquet``,
``test_0.parquet``, ``dev-set.parquet``."""
_SPLIT_WORD = re.compile(
    r"(?P<word>" + "|".join(w for ws in _SPLIT_WORDS.values() for w in ws) + r")(?:[-._ 0-9].*)?",
    re.IGNORECASE,
)


def _split_word(word: str) -> str | None:
    """The split a ``datasets`` split name stands for (``dev`` -> ``validation``)."""
    word = word.lower()
    return next((split for split, ws in _SPLIT_WORDS.items() if word in ws), None)


def _split_of(name: str) -> tuple[str | None, bool]:
    """The split ``name`` (a shard's file name) is named for, and whether by the shard
    pattern ``push_to_hub`` writes (which says so beyond doubt); ``(None, False)``: none."""
    if m := _SPLIT_SHARD.fullmatch(name):
        return m["split"], True
    if m := _SPLIT_WORD.fullmatch(Path(name).stem):
        return _split_word(m["word"]), False
    return None, False


def _shards(folder: str, split: str | None = None) -> list[str]:
    """The shards of ``folder`` to read, in name order. Shards named for more than one
    split (``train-00000-of-00001.parquet`` beside ``test-...``, or ``train.parquet``
    beside ``test.parquet``) are a dataset's splits side by side: only ``split``'s are
    read (None: all of them). A folder mixing such shards with shards named for no
    split is refused: which are ``split``'s rows cannot be told."""
    names = sorted(os.listdir(folder))
    parquet = [n for n in names if Path(n).suffix.lower() in PARQUET_EXTS]
    arrow = [n for n in names if n.endswith(".arrow")]
    shards = parquet or arrow
    named = {n: _split_of(n) for n in shards}
    splits = {name for name, _ in named.values()}
    if split is None or splits == {None}:
        return [os.path.join(folder, n) for n in shards]
    if None in splits:
        unnamed = [n for n in shards if named[n][0] is None]
        raise SourceError(
            f"{folder} holds shards named for splits {', '.join(sorted(splits - {None}))} "
            f"beside shards named for none ({', '.join(unnamed[:3])}"
            f"{', ...' if len(unnamed) > 3 else ''}), so data.split {split!r} cannot be "
            "told apart; move each split's shards to a folder of its own and point "
            "data.path at the one to train on"
        )
    if len(splits) == 1:
        # One dataset's shards, whatever they are called (``data-00000-of-00002``,
        # ``training_data.parquet``), unless push_to_hub's names say they are another
        # split than the one asked (only ``test-...`` shards, split train).
        (only,) = splits
        other = _split_word(only) not in (None, _split_word(split) or split)
        if not (other and all(sure for _, sure in named.values())):
            return [os.path.join(folder, n) for n in shards]
    if split not in splits:
        raise SourceError(
            f"{folder} holds the shards of split{'s' if len(splits) > 1 else ''} "
            f"{', '.join(sorted(splits))} but not {split!r}; set data.split to one of them"
        )
    return [os.path.join(folder, n) for n in shards if named[n][0] == split]


def _parquet(path: str, label: str) -> Iterator[SourceRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - a dependency
        raise SourceError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise SourceError(f"cannot read Parquet file {path}: {exc}") from None
    row = 0
    batches = pf.iter_batches(batch_size=_BATCH_ROWS)
    while True:
        try:  # a damaged page, or a value Python cannot hold, shows only as it is read
            batch = next(batches, None)
            rows = [] if batch is None else batch.to_pylist()
        except Exception as exc:
            raise SourceError(f"cannot read Parquet file {path} near row {row}: {exc}") from None
        if batch is None:
            return
        for fields in rows:
            yield SourceRow(f"{label} row {row}", fields)
            row += 1


def _arrow(path: str) -> Iterator[SourceRow]:
    from datasets import Dataset

    try:
        ds = Dataset.from_file(path)  # memory-mapped, no cache written
    except Exception as exc:
        raise SourceError(f"cannot read Arrow shard {path}: {exc}") from None
    yield from _rows_of(ds, path)


def _saved_dataset(path: str, split: str) -> Iterator[SourceRow]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:  # pragma: no cover - a dependency
        raise SourceError("reading a saved dataset needs the datasets package") from None
    try:
        ds = load_from_disk(path)
    except Exception as exc:
        raise SourceError(f"cannot load the dataset saved in {path}: {exc}") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise SourceError(
                f"{path} holds splits {', '.join(sorted(ds))} but not {split!r}; "
                "set data.split to one of them"
            )
        ds = ds[split]
        path = f"{path} [{split}]"
    yield from _rows_of(ds, path)


def _rows_of(ds: Any, label: str) -> Iterator[SourceRow]:
    # Python values, every column: a dataset saved after set_format("torch") or
    # "numpy" would slice to tensors and arrays, and hide the columns left out.
    ds = ds.with_format(None)
    for start in range(0, len(ds), _BATCH_ROWS):
        chunk = ds[start : start + _BATCH_ROWS]  # a dict of columns
        names = list(chunk)
        for i, values in enumerate(zip(*(chunk[n] for n in names))):
            yield SourceRow(f"{label} row {start + i}", dict(zip(names, values)))
