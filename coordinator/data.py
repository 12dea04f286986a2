"""Training data: local files -> fixed-length token rows -> deterministic global batches.

Pipeline (all in the coordinator, once per job; the rows are small next to the model):

    file ──read_documents──> documents ──tokenize──> token ids (+ EOS after each document)
         ──pack──> PackedDataset: rows [num_rows, seq_len] + real length of each row
         ──DataLoader.batch_for_step(step)──> GlobalBatch: microbatch_size * num_microbatches
                                              rows, split into microbatches

Input formats (``resolve_format`` picks one for ``format="auto"``):

* ``jsonl_text``: one JSON object per line, the document in ``text_field``;
* ``jsonl_tokens``: one JSON object per line with ``input_ids`` (a list of ints), taken
  as is: no tokenizer runs (one is still used, if available, for the EOS and pad ids);
* ``text``: UTF-8 text; documents are separated by one or more blank lines.
Blank lines in JSONL files are skipped; empty documents are skipped.

Rows. With ``packing`` (default) the documents, each followed by EOS (unless it already
ends with EOS), are concatenated into one token stream cut into rows of ``seq_len``;
attention is not masked at document boundaries, as usual for packed causal-LM training.
The final partial row is kept, right-padded with the pad id (EOS if the tokenizer has no
pad) and labelled ``IGNORE_INDEX`` (-100) in the padding, so no token is lost; a final
remainder of fewer than 2 tokens is dropped, since it holds nothing to predict. Without
packing every document starts a new row; a document longer than ``seq_len`` continues in
further rows, and the last row of each document is padded the same way.

Labels are the input ids themselves, unshifted, with padding set to -100: the Hugging
Face convention, where the loss shifts by one so that position t predicts token t+1.
``GlobalBatch.num_label_tokens`` counts the tokens such a loss predicts (labels[:, 1:]
that are not -100), the denominator for normalising the loss over the global batch.

Order. Rows form an endless stream of epochs; each epoch is a fresh permutation drawn
from ``(seed, epoch)`` (or the file order without shuffling), and step s (counted from
1, like optimizer steps) takes stream positions ``[(s-1)*G, s*G)`` with G the global
batch size. A batch may therefore span two epochs, and a dataset with fewer rows than
G simply repeats; no row is ever dropped. ``batch_for_step`` is a pure function of the
step, so a resumed job, a re-run task or a prefetching coordinator all see the same rows.
The permutation comes from Python's ``random.Random`` seeded with a string, whose
sequence Python keeps stable across versions (unlike torch.randperm's, which may change).
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.coordinator.jobspec import TOKENIZER_FILES, has_tokenizer_files
from roundpipe.coordinator.paths import open_for_read

if TYPE_CHECKING:
    from roundpipe.coordinator.jobspec import JobSpec

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "DataLoader",
    "GlobalBatch",
    "PackedDataset",
    "build_dataset",
    "build_dataset_from_spec",
    "load_tokenizer",
    "read_documents",
    "resolve_format",
]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of positions that carry no loss (padding), as torch's cross_entropy expects."""

_TEXT_EXTS = (".txt", ".text", ".md")
_JSONL_EXTS = (".jsonl", ".ndjson", ".json")
_FORMATS = ("auto", "jsonl_text", "jsonl_tokens", "text")
_TOKENIZE_CHUNK = 1024  # documents per tokenizer call: batched for speed, bounded memory
_STATE_VERSION = 1


class DataError(ValueError):
    """A data file, tokenizer or data cursor is unusable. The message names the path
    (and the line number, for a bad JSONL line)."""


# --------------------------------------------------------------------------- reading


def _open_data(path: str | os.PathLike[str]) -> Any:
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DataError(f"data file not found: {p}")
    if not os.path.isfile(p):
        raise DataError(f"data path is not a regular file: {p}")
    try:
        # Bytes: decode per line, so a bad byte has a line number. In the coordinator no
        # symbolic link is followed: the path was resolved when the job was accepted.
        return open_for_read(p)
    except OSError as exc:
        raise DataError(f"cannot read data file {p}: {exc.strerror}") from None


def _decode(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from None


def _parse_record(line: str, path: str, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    return record


def resolve_format(
    path: str | os.PathLike[str], format: str = "auto", text_field: str = "text"
) -> str:
    """The concrete format of ``path``: ``format`` itself unless it is ``"auto"``.

    ``auto`` goes by extension (see ``_TEXT_EXTS``/``_JSONL_EXTS``) and, for JSONL, by
    the first record: ``input_ids`` means pre-tokenised, ``text_field`` means text.
    """
    p = os.fspath(path)
    if format not in _FORMATS:
        raise DataError(f"unknown data format {format!r}; expected one of {', '.join(_FORMATS)}")
    if format != "auto":
        return format
    ext = Path(p).suffix.lower()
    if ext in _TEXT_EXTS:
        return "text"
    if ext not in _JSONL_EXTS:
        raise DataError(
            f"cannot tell the format of {p} from its extension {ext or '(none)'!r}; "
            f"set data.format to one of jsonl_text, jsonl_tokens, text"
        )
    with _open_data(p) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, p, lineno).strip()
            if not line:
                continue
            record = _parse_record(line, p, lineno)
            if "input_ids" in record:
                return "jsonl_tokens"
            if text_field in record:
                return "jsonl_text"
            keys = ", ".join(map(repr, list(record)[:8])) or "none"
            raise DataError(
                f"{p}:{lineno}: record has neither the text field {text_field!r} nor "
                f"'input_ids' (its keys: {keys}); set data.text_field"
            )
    raise DataError(f"empty dataset: {p} holds no records")


def read_documents(
    path: str | os.PathLike[str], format: str = "auto", text_field: str = "text"
) -> Iterator[tuple[int, str | list[int]]]:
    """Yield ``(line_number, document)``: a ``str``, or a ``list[int]`` for jsonl_tokens.

    Raises DataError naming the path and line for malformed input.
    """
    p = os.fspath(path)
    fmt = resolve_format(p, format, text_field)
    with _open_data(p) as f:
        if fmt == "text":
            yield from _read_paragraphs(f, p)
            return
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, p, lineno).strip()
            if not line:
                continue
            record = _parse_record(line, p, lineno)
            if fmt == "jsonl_text":
                if text_field not in record:
                    keys = ", ".join(map(repr, list(record)[:8])) or "none"
                    raise DataError(f"{p}:{lineno}: no {text_field!r} field (its keys: {keys})")
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{p}:{lineno}: field {text_field!r} is {type(text).__name__}; expected a string"
                    )
                yield lineno, text
            else:
                ids = record.get("input_ids")
                if not isinstance(ids, list) or not all(
                    type(t) is int and 0 <= t < 2**31 for t in ids
                ):
                    raise DataError(
                        f"{p}:{lineno}: 'input_ids' must be a list of integers in [0, 2**31)"
                    )
                yield lineno, ids


def _read_paragraphs(f: Any, path: str) -> Iterator[tuple[int, str]]:
    lines: list[str] = []
    start = 0
    for lineno, raw in enumerate(f, 1):
        line = _decode(raw, path, lineno)
        if line.strip():
            if not lines:
                start = lineno
            lines.append(line)
        elif lines:
            yield start, "".join(lines).strip()
            lines = []
    if lines:
        yield start, "".join(lines).strip()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)`` with clear errors.

    A directory without tokenizer files is refused: transformers 5 would return an
    empty tokenizer (EOS id 0) instead of failing.
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise DataError(f"tokenizer directory not found: {p}")
    if not has_tokenizer_files(p):
        raise DataError(
            f"cannot load a tokenizer from {p}: it holds no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); set data.tokenizer to a tokenizer directory"
        )
    from transformers import AutoTokenizer  # lazy: slow import, unneeded for token data

    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise DataError(f"cannot load a tokenizer from {p}: {' '.join(str(exc).split())}") from None


# --------------------------------------------------------------------------- dataset


@dataclass(frozen=True, eq=False)
class PackedDataset:
    """Fixed-length rows of token ids; row i holds ``lengths[i]`` real tokens, then pad."""

    tokens: torch.Tensor
    """int32 ``[num_rows, seq_len]``."""
    lengths: torch.Tensor
    """int32 ``[num_rows]``: real tokens at the start of each row (>= 2)."""
    pad_token_id: int
    """Id written into padding (its label is IGNORE_INDEX, so its value never matters
    for the loss; it must only be a valid embedding index)."""
    eos_token_id: int | None
    """Separator appended after each document; ``None``: token data without a tokenizer."""
    num_documents: int
    """Documents read (empty ones skipped)."""
    source: str
    """The data file."""
    max_token_id: int = field(default=-1)
    """Largest real token id; see ``vocab_size_needed``."""

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens, separators included."""
        return int(self.lengths.sum())

    @property
    def vocab_size_needed(self) -> int:
        """One more than the largest token id: the model's vocab_size must be >= this."""
        return max(self.max_token_id, self.pad_token_id) + 1

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the rows: a checkpointed data cursor only resumes on the same rows."""
        h = hashlib.sha256()
        h.update(f"{self.seq_len}:{self.num_rows}:".encode())
        h.update(self.tokens.numpy().tobytes())
        h.update(self.lengths.numpy().tobytes())
        return h.hexdigest()[:32]

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, both int64 ``[len(index), seq_len]``, for row ``index``."""
        input_ids = self.tokens.index_select(0, index).long()
        labels = input_ids.clone()
        pad = torch.arange(self.seq_len).unsqueeze(0) >= self.lengths.index_select(
            0, index
        ).unsqueeze(1)
        labels[pad] = IGNORE_INDEX
        return input_ids, labels


def build_dataset(
    path: str | os.PathLike[str],
    *,
    seq_len: int,
    format: str = "auto",
    text_field: str = "text",
    tokenizer: Any = None,
    packing: bool = True,
) -> PackedDataset:
    """Read, tokenize and pack ``path`` into rows of ``seq_len`` tokens.

    ``tokenizer`` is a tokenizer directory or an already loaded tokenizer (anything with
    ``__call__`` returning ``input_ids`` and an ``eos_token_id``). It is required for
    text formats; for ``jsonl_tokens`` it is optional and only supplies EOS/pad ids.
    Raises DataError for a missing/malformed file, a missing tokenizer, or an empty result.
    """
    p = os.path.abspath(os.fspath(path))
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    fmt = resolve_format(p, format, text_field)
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is None and fmt != "jsonl_tokens":
        raise DataError(f"{p} is text ({fmt}) and needs a tokenizer; none was given")
    eos = None if tokenizer is None else tokenizer.eos_token_id
    if eos is None and fmt != "jsonl_tokens":
        raise DataError("the tokenizer has no EOS token, which separates documents; use another")
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (eos if eos is not None else 0)

    packer = _Packer(seq_len, pad, packing)
    num_docs = 0
    for ids in _token_documents(read_documents(p, fmt, text_field), tokenizer):
        if not ids:
            continue
        if eos is not None and ids[-1] != eos:
            ids.append(eos)
        packer.add(ids)
        num_docs += 1
    tokens, lengths, max_id = packer.finish()
    if tokens.shape[0] == 0:
        what = "no documents" if num_docs == 0 else "fewer than 2 tokens"
        raise DataError(f"empty dataset: {p} yields {what}")
    ds = PackedDataset(
        tokens=tokens,
        lengths=lengths,
        pad_token_id=int(pad),
        eos_token_id=None if eos is None else int(eos),
        num_documents=num_docs,
        source=p,
        max_token_id=max_id,
    )
    logger.info(
        "[data] %s: %d documents, %d tokens, %d rows of %d (%s, %s)",
        p,
        num_docs,
        ds.num_tokens,
        ds.num_rows,
        seq_len,
        fmt,
        "packed" if packing else "unpacked",
    )
    return ds


def build_dataset_from_spec(spec: JobSpec) -> PackedDataset:
    """``build_dataset`` with the settings of a validated job spec."""
    d = spec.data
    assert d.path is not None, "a validated spec has data.path"
    fmt = resolve_format(d.path, d.format, d.text_field)
    return build_dataset(
        d.path,
        seq_len=d.seq_len,
        format=fmt,
        text_field=d.text_field,
        # Only a tokenizer that exists (a model directory without tokenizer files gives
        # None): token data then has no separator between documents, as documented.
        tokenizer=spec.tokenizer_path,
        packing=d.packing,
    )


def _token_documents(
    docs: Iterator[tuple[int, str | list[int]]], tokenizer: Any
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


class _Packer:
    """Accumulates documents into a flat int32 buffer of whole rows."""

    def __init__(self, seq_len: int, pad: int, packing: bool) -> None:
        self.seq_len = seq_len
        self.pad = pad
        self.packing = packing
        self.flat = array.array("i")
        self.lengths = array.array("i")
        self.max_id = -1
        assert self.flat.itemsize == 4, "int32 rows assume a 4-byte C int"

    def add(self, ids: list[int]) -> None:
        self.max_id = max(self.max_id, max(ids))
        if self.packing:
            self.flat.extend(ids)
            return
        s = self.seq_len
        for start in range(0, len(ids), s):
            chunk = ids[start : start + s]
            if len(chunk) < 2:
                continue  # nothing to predict in a 1-token row
            self.flat.extend(chunk)
            self.flat.extend([self.pad] * (s - len(chunk)))
            self.lengths.append(len(chunk))

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        s = self.seq_len
        if self.packing:
            total = len(self.flat)
            full, rem = divmod(total, s)
            self.lengths.extend([s] * full)
            if rem >= 2:
                self.flat.extend([self.pad] * (s - rem))
                self.lengths.append(rem)
            else:
                del self.flat[full * s :]
        rows = len(self.lengths)
        flat = (
            torch.frombuffer(self.flat, dtype=torch.int32)
            if rows
            else torch.empty(0, dtype=torch.int32)
        )
        tokens = flat.clone().view(rows, s)  # clone: own the memory, not the array's
        lengths = (
            torch.frombuffer(self.lengths, dtype=torch.int32).clone()
            if rows
            else torch.empty(0, dtype=torch.int32)
        )
        return tokens, lengths, self.max_id


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The rows of one optimizer step."""

    step: int
    """Optimizer step this batch is for (from 1)."""
    epoch: int
    """Epoch of the batch's first row (from 0)."""
    row_indices: torch.Tensor
    """int64 ``[G]``: dataset rows in batch order."""
    input_ids: torch.Tensor
    """int64 ``[G, seq_len]``."""
    labels: torch.Tensor
    """int64 ``[G, seq_len]``: ``input_ids`` with padding set to IGNORE_INDEX (unshifted)."""
    microbatch_size: int
    """Rows per microbatch."""

    @property
    def microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(input_ids, labels)]``, each ``[microbatch_size, seq_len]``: contiguous views."""
        return list(
            zip(self.input_ids.split(self.microbatch_size), self.labels.split(self.microbatch_size))
        )

    @property
    def num_label_tokens(self) -> int:
        """Tokens a shifted causal-LM loss predicts in the whole batch (its denominator)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


class DataLoader:
    """Deterministic global batches over a PackedDataset, with a resumable cursor.

    ``batch_for_step(step)`` is pure; ``next_batch()`` / iteration follow a cursor
    (the next step to serve) that ``state_dict()`` saves and ``load_state_dict()``
    restores exactly. Not thread-safe: one owner (the coordinator's scheduler) calls it.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        microbatch_size: int,
        num_microbatches: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if microbatch_size < 1 or num_microbatches < 1:
            raise ValueError(
                f"microbatch_size and num_microbatches must be >= 1, got {microbatch_size}, {num_microbatches}"
            )
        if dataset.num_rows == 0:
            raise DataError(f"empty dataset: {dataset.source} has no rows")
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.num_microbatches = num_microbatches
        self.shuffle = shuffle
        self.seed = seed
        self._next_step = 1
        self._orders: dict[int, torch.Tensor] = {}
        if dataset.num_rows < self.global_batch_size:
            logger.warning(
                "[data] %s has %d rows, fewer than one global batch (%d): rows repeat within a step",
                dataset.source,
                dataset.num_rows,
                self.global_batch_size,
            )

    @classmethod
    def from_spec(cls, spec: JobSpec, dataset: PackedDataset | None = None) -> DataLoader:
        """A loader with the batch/shuffle settings of ``spec`` (building the dataset if
        not given)."""
        if dataset is None:
            dataset = build_dataset_from_spec(spec)
        return cls(
            dataset,
            microbatch_size=spec.batch.microbatch_size,
            num_microbatches=spec.batch.num_microbatches,
            shuffle=spec.data.shuffle,
            seed=spec.data_seed,
        )

    @property
    def global_batch_size(self) -> int:
        return self.microbatch_size * self.num_microbatches

    @property
    def next_step(self) -> int:
        """The step ``next_batch()`` serves next."""
        return self._next_step

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """int64 ``[num_rows]``: the row order of ``epoch`` (identity without shuffle)."""
        order = self._orders.get(epoch)
        if order is None:
            n = self.dataset.num_rows
            idx = list(range(n))
            if self.shuffle:
                random.Random(f"roundpipe.data:{self.seed}:{epoch}").shuffle(idx)
            order = torch.tensor(idx, dtype=torch.int64)
            # A batch touches at most a few consecutive epochs; keep a small window.
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def batch_for_step(self, step: int) -> GlobalBatch:
        """The batch of optimizer step ``step`` (>= 1); the same for the same step, always."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        n, g = self.dataset.num_rows, self.global_batch_size
        start = (step - 1) * g
        parts = []
        pos = start
        while pos < start + g:
            epoch, offset = divmod(pos, n)
            take = min(n - offset, start + g - pos)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            pos += take
        index = torch.cat(parts)
        input_ids, labels = self.dataset.rows(index)
        return GlobalBatch(
            step=step,
            epoch=start // n,
            row_indices=index,
            input_ids=input_ids,
            labels=labels,
            microbatch_size=self.microbatch_size,
        )

    def next_batch(self) -> GlobalBatch:
        """The batch at the cursor; advances the cursor by one step."""
        batch = self.batch_for_step(self._next_step)
        self._next_step += 1
        return batch

    def __iter__(self) -> Iterator[GlobalBatch]:
        """Endless: pair with ``range(steps)`` or stop on ``batch.step``."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The cursor: plain ints/strings (msgpack/JSON-able).

        ``epoch``/``position`` say where the next batch starts, for people; the shuffle
        needs no RNG state beyond ``seed``, since each epoch's order is drawn from
        ``(seed, epoch)``. ``fingerprint`` ties the cursor to these exact rows.
        """
        pos = (self._next_step - 1) * self.global_batch_size
        epoch, position = divmod(pos, self.dataset.num_rows)
        return {
            "version": _STATE_VERSION,
            "next_step": self._next_step,
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "num_rows": self.dataset.num_rows,
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved cursor; DataError if it belongs to other data or settings."""
        if state.get("version") != _STATE_VERSION:
            raise DataError(
                f"data cursor version {state.get('version')!r} is not supported (expected {_STATE_VERSION})"
            )
        mine = self.state_dict()
        diffs = [
            f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}"
            for k in ("seed", "shuffle", "global_batch_size", "num_rows", "fingerprint")
            if state.get(k) != mine[k]
        ]
        if diffs:
            raise DataError(
                f"the data cursor does not match {self.dataset.source} as loaded now ("
                + "; ".join(diffs)
                + "); resuming would not reproduce the batches"
            )
        step = state.get("next_step")
        if not isinstance(step, int) or step < 1:
            raise DataError(f"data cursor next_step must be an integer >= 1, got {step!r}")
        self._next_step = step
