"""Data files -> documents: the documents of a file, as token ids with labels.

Input formats (roundpipe.coordinator.spec.formats tells them apart); rows come from
JSONL, Parquet or a ``datasets`` folder (roundpipe.coordinator.spec.sources), column
names from ``Columns``:

* ``jsonl_text``: the document in the ``text`` column; loss on every token;
* ``jsonl_tokens``: ``input_ids`` (a list of ints), taken as is: no tokenizer runs (one
  is still used, if available, for the EOS and pad ids); optional ``labels`` of the same
  length (-100 = no loss) are used as given, else the loss covers every token;
* ``chat``: ``messages`` rendered with the chat template, loss on assistant turns
  (``loss_on: assistant``) or everything (``all``); roundpipe.coordinator.spec.instruct;
* ``prompt_completion``: ``prompt`` and ``completion`` (strings or message lists), loss
  on the completion (or everything with ``loss_on: all``);
* ``text``: UTF-8 text; documents are separated by one or more empty lines and kept as
  written (indentation included).
Blank lines in JSONL files are skipped; empty documents are skipped.

Labelled records (chat, prompt_completion, token records with labels) are *whole*
(``Document.whole``): roundpipe.coordinator.spec.data cuts or refuses one longer than
``seq_len`` and never splits it across two rows. Text documents are cut anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from roundpipe.coordinator.spec.errors import DataError, host_shortage
from roundpipe.coordinator.spec.formats import (
    Columns,
    check_data_path,
    resolve_format,
    show_keys,
    source_rows,
)
from roundpipe.coordinator.spec.instruct import (
    InstructError,
    render_chat,
    render_prompt_completion,
)
from roundpipe.coordinator.spec.paths import open_for_read
from roundpipe.coordinator.spec.sources import SourceError, SourceRow, decode_line, is_unicode_text
from roundpipe.shared.model import IGNORE_INDEX

__all__ = ["Document", "documents", "read_documents"]

_TOKENIZE_CHUNK = 1024  # documents per tokenizer call: batched for speed, bounded memory


def read_documents(
    path: str | os.PathLike[str],
    format: str = "auto",
    text_field: str = "text",
    *,
    columns: Columns | None = None,
    split: str = "train",
) -> Iterator[tuple[int | str, str | list[int]]]:
    """Yield ``(where, document)`` for the unlabelled formats: a ``str`` (text,
    jsonl_text) or a ``list[int]`` (jsonl_tokens). ``where`` is the line number for text
    files, ``path:line`` / ``path row N`` for records.

    Raises DataError naming the path and line for malformed input.
    """
    p = os.fspath(path)
    cols = columns or Columns(text=text_field)
    fmt = resolve_format(p, format, text_field, columns=cols, split=split)
    check_data_path(p)
    if fmt == "text":
        yield from _read_paragraphs(p)
        return
    for row in source_rows(p, split):
        if fmt == "jsonl_text":
            yield row.where, _text_of(row, cols.text)
        elif fmt == "jsonl_tokens":
            yield row.where, _token_list(row, cols.input_ids)
        else:
            raise DataError(f"read_documents reads unlabelled formats, not {fmt}")


def _text_of(row: SourceRow, name: str) -> str:
    if name not in row.fields:
        raise DataError(f"{row.where}: no {name!r} field (its keys: {show_keys(row.fields)})")
    text = row.fields[name]
    if not isinstance(text, str):
        raise DataError(f"{row.where}: field {name!r} is {type(text).__name__}; expected a string")
    if not is_unicode_text(text):
        raise DataError(
            f"{row.where}: field {name!r} holds an unpaired UTF-16 surrogate (a broken "
            "\\ud83d-style escape); fix or drop the record"
        )
    return text


def _token_list(row: SourceRow, name: str, *, labels: bool = False) -> list[int]:
    ids = row.fields.get(name)
    ok = isinstance(ids, list) and all(
        type(t) is int and (0 <= t < 2**31 or (labels and t == IGNORE_INDEX)) for t in ids
    )
    if not ok:
        what = "integers in [0, 2**31) or -100" if labels else "integers in [0, 2**31)"
        raise DataError(f"{row.where}: {name!r} must be a list of {what}")
    return list(ids)


def _read_paragraphs(path: str) -> Iterator[tuple[int, str]]:
    r"""The documents of a text file, each with the line it starts on. A document is
    the text between empty lines, as it is in the file: its indentation and a line of
    spaces inside it kept (code, indented Markdown blocks), without the line break that
    ends it. Line breaks are read as ``\n`` whether the file has ``\r\n`` (Windows) or
    ``\r`` (classic Mac OS), as Python's and ``datasets``' text readers read them: a
    ``\r`` trained as a token of every line break teaches the model to write one."""
    try:
        f = open_for_read(path)  # no symbolic link followed in the coordinator
    except OSError as exc:
        if host_shortage(exc) is not None:
            raise  # the host's shortage, not the file's: the job pauses (spec.errors)
        raise DataError(f"cannot read data file {path}: {exc.strerror}") from None
    lines: list[str] = []
    start = 0
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = decode_line(raw, path, lineno)
            except SourceError as exc:
                raise DataError(str(exc)) from None
            for line in _universal_lines(text):
                if line != "\n":
                    if not lines:
                        start = lineno
                    lines.append(line)
                elif lines:
                    yield from _paragraph(start, lines)
                    lines = []
    yield from _paragraph(start, lines)


def _paragraph(start: int, lines: list[str]) -> Iterator[tuple[int, str]]:
    """The document of ``lines``, without its last line break; none if it is only
    whitespace (an empty document is skipped)."""
    text = "".join(lines)
    if text.strip():
        yield start, text.removesuffix("\n")


def _universal_lines(text: str) -> list[str]:
    r"""``text`` (one line read up to ``\n``) as lines ending in ``\n``, its ``\r\n``
    and lone ``\r`` line breaks read as ``\n``; the last one may have no line break."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\n" not in text[:-1]:
        return [text]
    lines = [line + "\n" for line in text.split("\n")]  # not splitlines(): \f is no break
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


@dataclass
class Document:
    """One document's token ids and unshifted labels (IGNORE_INDEX: no loss)."""

    ids: list[int]
    labels: list[int]
    where: str
    """The file (text documents) or ``path:line`` / ``path row N`` (records)."""
    whole: bool
    """A labelled record: cut to seq_len (or refused) and never split across rows."""


def documents(
    p: str, fmt: str, cols: Columns, split: str, tokenizer: Any, loss_on: str, eos: int | None
) -> Iterator[Document]:
    """Every document of file ``p`` in format ``fmt``: text tokenized (EOS appended when
    ``eos`` is given), token rows as they are, chats and prompt/completion pairs rendered
    with their labels (``loss_on``)."""
    if fmt == "jsonl_tokens":
        yield from _token_records(p, split, cols, eos)
        return
    if fmt in ("text", "jsonl_text"):
        for ids in _token_documents(read_documents(p, fmt, columns=cols, split=split), tokenizer):
            if eos is not None and ids and ids[-1] != eos:
                ids.append(eos)
            yield Document(ids, list(ids), p, whole=False)
        return
    for row in source_rows(p, split):
        try:
            if fmt == "chat":
                if cols.messages not in row.fields:
                    raise DataError(
                        f"{row.where}: no {cols.messages!r} field (its keys: "
                        f"{show_keys(row.fields)}); set data.columns.messages"
                    )
                ids, labels = render_chat(
                    tokenizer, row.fields[cols.messages], row.where, loss_on=loss_on,
                    field=cols.messages,
                )  # fmt: skip
            else:
                missing = [c for c in (cols.prompt, cols.completion) if c not in row.fields]
                if missing:
                    raise DataError(
                        f"{row.where}: no {' or '.join(map(repr, missing))} field (its keys: "
                        f"{show_keys(row.fields)}); set data.columns.prompt / .completion"
                    )
                ids, labels = render_prompt_completion(
                    tokenizer,
                    row.fields[cols.prompt],
                    row.fields[cols.completion],
                    row.where,
                    loss_on=loss_on,
                    eos_token_id=eos,
                    fields=(cols.prompt, cols.completion),
                )
        except InstructError as exc:
            raise DataError(str(exc)) from None
        yield Document(ids, labels, row.where, whole=True)


def _token_records(p: str, split: str, cols: Columns, eos: int | None) -> Iterator[Document]:
    """Records of token ids. Labelled (``cols.labels``: each a whole record, its own
    labels) when the first record has labels, and then every record must; otherwise
    none may: labels on a later record only would be dropped without a word, and
    their prompt tokens trained."""
    labelled: bool | None = None
    for row in source_rows(p, split):
        ids = _token_list(row, cols.input_ids)
        has = cols.labels in row.fields
        if labelled is None:
            labelled = has
        elif has != labelled:
            first = "has them, so every record needs them" if labelled else "has none"
            raise DataError(
                f"{row.where}: {'no' if labelled else 'a'} {cols.labels!r} field, but the "
                f"first record {first}: give every record {cols.labels!r} or none"
            )
        if not labelled:
            if eos is not None and ids and ids[-1] != eos:
                ids.append(eos)
            yield Document(ids, list(ids), p, whole=False)
            continue
        labels = _token_list(row, cols.labels, labels=True)
        if len(labels) != len(ids):
            raise DataError(
                f"{row.where}: {len(labels)} labels for {len(ids)} input_ids; they must "
                "have the same length (-100 where no loss)"
            )
        yield Document(ids, labels, row.where, whole=True)


def _token_documents(
    docs: Iterator[tuple[int | str, str | list[int]]], tokenizer: Any
) -> Iterator[list[int]]:
    batch: list[str] = []
    for _, doc in docs:
        if isinstance(doc, list):
            yield list(doc)
            continue
        if not doc.strip():
            continue
        batch.append(doc)
        if len(batch) >= _TOKENIZE_CHUNK:
            yield from _tokenize(tokenizer, batch)
            batch = []
    if batch:
        yield from _tokenize(tokenizer, batch)


def _tokenize(tokenizer: Any, texts: list[str]) -> Iterator[list[int]]:
    # verbose=False: documents longer than the tokenizer's model_max_length are normal
    # here (they are packed/cut afterwards), so its warning would only mislead.
    out = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    for ids in out:
        yield list(ids)
