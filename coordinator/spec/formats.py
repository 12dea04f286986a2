"""Which format a data file holds: plain text, text or token rows, chats, or prompt /
completion pairs (``data.format``), and which columns hold what (``data.columns``).

Only the first row is read (roundpipe.coordinator.spec.documents reads the rest), so a
spec's check can tell the format, and whether it needs a tokenizer, cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roundpipe.coordinator.spec.choices import DATA_FORMATS
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.sections import DataSpec
from roundpipe.coordinator.spec.sources import SourceError, SourceRow, read_rows, source_kind

__all__ = [
    "Columns",
    "check_data_path",
    "columns_of",
    "resolve_format",
    "show_keys",
    "source_rows",
]

_TEXT_EXTS = (".txt", ".text", ".md")


@dataclass(frozen=True)
class Columns:
    """Which record fields (JSON keys, Parquet / datasets columns) hold what."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    input_ids: str = "input_ids"
    labels: str = "labels"


def columns_of(data: DataSpec) -> Columns:
    """The columns a data section names (``text_field`` and ``columns``)."""
    return Columns(**{"text": data.text_field, **dict(data.columns or {})})


def check_data_path(p: str) -> None:
    """DataError unless ``p`` is a data file, or a folder of a ``datasets`` source."""
    if not os.path.exists(p):
        raise DataError(f"data file not found: {p}")
    if os.path.isdir(p):
        if source_kind(p) is None:
            raise DataError(
                f"data folder {p} is neither saved by datasets (save_to_disk) nor holds "
                ".parquet/.arrow shards; point data.path at a data file or such a folder"
            )
    elif not os.path.isfile(p):
        raise DataError(f"data path is not a regular file: {p}")


def source_rows(p: str, split: str) -> Iterator[SourceRow]:
    try:
        yield from read_rows(p, split=split)
    except SourceError as exc:
        raise DataError(str(exc)) from None


def show_keys(fields: dict[str, Any]) -> str:
    """A row's first keys, for messages."""
    return ", ".join(map(repr, list(fields)[:8])) or "none"


def resolve_format(
    path: str | os.PathLike[str],
    format: str = "auto",
    text_field: str = "text",
    *,
    columns: Columns | None = None,
    split: str = "train",
) -> str:
    """The concrete format of ``path``: ``format`` itself unless it is ``"auto"``.

    ``auto``: ``.txt``/``.text``/``.md`` is text; for record sources (JSONL, Parquet,
    datasets folders) the first record's columns decide: ``messages`` -> chat,
    ``prompt`` + ``completion`` -> prompt_completion, ``input_ids`` -> jsonl_tokens,
    the text column -> jsonl_text. A record matching more than one is refused.
    """
    p = os.fspath(path)
    cols = columns or Columns(text=text_field)
    if format not in DATA_FORMATS:
        raise DataError(
            f"unknown data format {format!r}; expected one of {', '.join(DATA_FORMATS)}"
        )
    if format != "auto":
        return format
    check_data_path(p)
    if not os.path.isdir(p) and Path(p).suffix.lower() in _TEXT_EXTS:
        return "text"
    if source_kind(p) is None:
        ext = Path(p).suffix.lower()
        raise DataError(
            f"cannot tell the format of {p} from its extension {ext or '(none)'!r}; "
            f"set data.format to one of {', '.join(DATA_FORMATS[1:])}"
        )
    first = next(iter(source_rows(p, split)), None)
    if first is None:
        raise DataError(f"empty dataset: {p} holds no records")
    f = first.fields
    found = [
        name
        for name, present in (
            ("chat", cols.messages in f),
            ("prompt_completion", cols.prompt in f and cols.completion in f),
            ("jsonl_tokens", cols.input_ids in f),
            ("jsonl_text", cols.text in f),
        )
        if present
    ]
    if len(found) == 1:
        return found[0]
    if found:
        raise DataError(
            f"{first.where}: the record fits more than one format ({', '.join(found)}; its "
            f"keys: {show_keys(f)}); set data.format"
        )
    raise DataError(
        f"{first.where}: record has neither the text field {cols.text!r} nor "
        f"{cols.input_ids!r}, {cols.messages!r} or {cols.prompt!r}+{cols.completion!r} "
        f"(its keys: {show_keys(f)}); set data.text_field / data.columns or data.format"
    )
