"""Training data: documents -> fixed-length token rows -> deterministic global batches.

Pipeline (all in the coordinator, once per job; the rows are small next to the model):

    file ──read──> documents ──tokenize / render──> token ids + labels (+ EOS after text)
         ──pack──> PackedDataset: rows [num_rows, seq_len] of ids, labels, position ids
         ──DataLoader.batch_for_step(step)──> GlobalBatch: microbatch_size * num_microbatches
                                              rows, split into microbatches

Reading a file into documents (its format, its rows, tokenizing and rendering chats) is
roundpipe.coordinator.spec.documents; this module packs them and serves batches.

Labelled records (chat, prompt_completion, token records with labels) are *whole*: one
longer than ``seq_len`` is cut to ``seq_len`` (``overlong: truncate``, counted and
logged; dropped if no trained token is left) or refused (``overlong: refuse``), and
with packing a whole record never straddles two rows. Text documents are cut anywhere.

Packing (``packing``):
* ``documents`` (default, ``true``): documents are concatenated into full rows, but each
  attends only to itself: the position ids restart at 0 at every document start (and at
  every row start), which the model turns into a block-diagonal causal mask and
  per-document rotary positions (transformers' packed-sequence detection, see Note
  [packed documents] in roundpipe.worker.executor), and the first token of each document
  gets no label, since the token before it belongs to another document. A packed run
  therefore equals the unpacked run of the same documents.
* ``concat``: the old behaviour: one token stream, attention across document boundaries,
  positions 0..seq_len-1 in every row; a whole record that does not fit in the rest of
  a row pads it and starts the next.
* ``none`` (``false``): every document starts a new row; a text document longer than
  ``seq_len`` continues in further rows; the last row of each is padded.
The final partial row is kept, right-padded with the pad id (EOS if the tokenizer has no
pad) and labelled ``IGNORE_INDEX`` (-100) in the padding; a final remainder of fewer than
2 tokens is dropped, since it holds nothing to predict.

Labels are unshifted, with padding and masked tokens set to -100: the Hugging Face
convention, where the loss shifts by one so that position t predicts token t+1.
``GlobalBatch.num_label_tokens`` counts the tokens such a loss predicts (labels[:, 1:]
that are not -100), the denominator for normalising the loss over the global batch, so
masked tokens never count in it.

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
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from roundpipe.coordinator.spec.choices import DATA_LOSS_ON, DATA_OVERLONG, packing_mode
from roundpipe.coordinator.spec.documents import Document, documents
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.formats import (
    Columns,
    check_data_path,
    columns_of,
    resolve_format,
)
from roundpipe.coordinator.spec.instruct import InstructError, load_chat_template
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.tokenizers import load_tokenizer
from roundpipe.shared.model import IGNORE_INDEX

__all__ = [
    "DataLoader",
    "GlobalBatch",
    "PackedDataset",
    "build_dataset",
    "build_dataset_from_spec",
]

logger = logging.getLogger(__name__)
_STATE_VERSION = 1


# --------------------------------------------------------------------------- dataset


@dataclass(frozen=True, eq=False)
class PackedDataset:
    """Fixed-length rows of token ids; row i holds ``lengths[i]`` real tokens, then pad."""

    tokens: torch.Tensor
    """int32 ``[num_rows, seq_len]``."""
    lengths: torch.Tensor
    """int32 ``[num_rows]``: real tokens at the start of each row (>= 2)."""
    pad_token_id: int
    """Id written into padding (its label is IGNORE_INDEX, and the router auxiliary loss
    leaves padding out by ``lengths``, so its value never matters for the loss; it must
    only be a valid embedding index)."""
    eos_token_id: int | None
    """Separator appended after each text document; ``None``: token data without a
    tokenizer."""
    num_documents: int
    """Documents read (empty ones skipped)."""
    source: str
    """The data file."""
    max_token_id: int = field(default=-1)
    """Largest real token id; see ``vocab_size_needed``."""
    labels: torch.Tensor | None = None
    """int32 ``[num_rows, seq_len]``, unshifted, -100 = no loss; ``None``: the tokens,
    with padding set to -100."""
    positions: torch.Tensor | None = None
    """int32 ``[num_rows, seq_len]``: position ids (restarting per document with
    ``packing: documents``); ``None``: 0..seq_len-1 in every row."""
    packing: str = "concat"
    """How the rows were packed (``PACKING``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the rows the dataset holds (ids, labels, positions, lengths)."""
        tensors = (self.tokens, self.labels, self.positions, self.lengths)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __post_init__(self) -> None:
        if self.labels is None:
            pad = torch.arange(self.seq_len).unsqueeze(0) >= self.lengths.unsqueeze(1)
            object.__setattr__(self, "labels", self.tokens.masked_fill(pad, IGNORE_INDEX))
        if self.positions is None:
            rows = torch.arange(self.seq_len, dtype=torch.int32).expand(self.num_rows, -1)
            object.__setattr__(self, "positions", rows.contiguous())

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
    def num_trained_tokens(self) -> int:
        """Tokens a shifted causal-LM loss predicts over all rows (labels[:, 1:] != -100)."""
        assert self.labels is not None
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def vocab_size_needed(self) -> int:
        """One more than the largest token id: the model's vocab_size must be >= this."""
        return max(self.max_token_id, self.pad_token_id) + 1

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the rows: a checkpointed data cursor only resumes on the same rows."""
        assert self.labels is not None and self.positions is not None
        h = hashlib.sha256()
        h.update(f"{self.seq_len}:{self.num_rows}:".encode())
        h.update(self.tokens.numpy().tobytes())
        h.update(self.lengths.numpy().tobytes())
        # Text rows packed the old way hash as before (a cursor saved then still resumes).
        if not torch.equal(self.labels, _default_labels(self.tokens, self.lengths)):
            h.update(b"labels:" + self.labels.numpy().tobytes())
        if self.packing == "documents":
            h.update(b"positions:" + self.positions.numpy().tobytes())
        return h.hexdigest()[:32]

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, both int64 ``[len(index), seq_len]``, for row ``index``."""
        assert self.labels is not None
        return (
            self.tokens.index_select(0, index).long(),
            self.labels.index_select(0, index).long(),
        )

    def position_ids(self, index: torch.Tensor) -> torch.Tensor:
        """int64 ``[len(index), seq_len]``: the position ids of rows ``index``."""
        assert self.positions is not None
        return self.positions.index_select(0, index).long()


def _default_labels(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    pad = torch.arange(tokens.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)
    return tokens.masked_fill(pad, IGNORE_INDEX)


def build_dataset(
    path: str | os.PathLike[str],
    *,
    seq_len: int,
    format: str = "auto",
    text_field: str = "text",
    tokenizer: Any = None,
    packing: bool | str = True,
    columns: Columns | None = None,
    loss_on: str = "assistant",
    chat_template: str | None = None,
    overlong: str = "truncate",
    split: str = "train",
) -> PackedDataset:
    """Read, tokenize and pack ``path`` into rows of ``seq_len`` tokens.

    ``tokenizer`` is a tokenizer directory or an already loaded tokenizer (anything with
    ``__call__`` returning ``input_ids`` and an ``eos_token_id``; chat data needs
    ``apply_chat_template``). It is required for text and instruction formats; for
    ``jsonl_tokens`` it is optional and only supplies EOS/pad ids. Raises DataError for a
    missing/malformed file or record, a missing tokenizer, or an empty result.
    """
    p = os.path.abspath(os.fspath(path))
    cols = columns or Columns(text=text_field)
    mode = packing_mode(packing)
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    if loss_on not in DATA_LOSS_ON:
        raise DataError(f"unknown loss_on {loss_on!r}; expected one of {', '.join(DATA_LOSS_ON)}")
    if overlong not in DATA_OVERLONG:
        raise DataError(
            f"unknown overlong {overlong!r}; expected one of {', '.join(DATA_OVERLONG)}"
        )
    fmt = resolve_format(p, format, cols.text, columns=cols, split=split)
    check_data_path(p)
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is None and fmt != "jsonl_tokens":
        raise DataError(f"{p} is {fmt} data and needs a tokenizer; none was given")
    eos = None if tokenizer is None else tokenizer.eos_token_id
    if eos is None and fmt in ("text", "jsonl_text"):
        raise DataError("the tokenizer has no EOS token, which separates documents; use another")
    if fmt == "chat" or (fmt == "prompt_completion" and chat_template is not None):
        try:
            load_chat_template(tokenizer, chat_template)
        except InstructError as exc:
            raise DataError(str(exc)) from None
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (eos if eos is not None else 0)

    packer = _Packer(seq_len, pad, mode)
    num_docs = cut = dropped = 0
    docs = documents(p, fmt, cols, split, tokenizer, loss_on, eos)
    for doc in docs:
        if not doc.ids:
            continue
        if doc.whole and len(doc.ids) > seq_len:
            if overlong == "refuse":
                raise DataError(
                    f"{doc.where}: the record has {len(doc.ids)} tokens, more than data.seq_len "
                    f"= {seq_len}; raise seq_len, shorten or drop the record, or set "
                    "data.overlong: truncate"
                )
            doc.ids, doc.labels = doc.ids[:seq_len], doc.labels[:seq_len]
            cut += 1
            if all(y == IGNORE_INDEX for y in doc.labels[1:]):
                dropped += 1  # nothing left to train on
                continue
        packer.add(doc)
        num_docs += 1
    if cut:
        logger.warning(
            "[data] %s: %d record(s) longer than seq_len %d were truncated (%d of them "
            "dropped: no trained token left); data.overlong: refuse makes this an error",
            p,
            cut,
            seq_len,
            dropped,
        )
    tokens, labels, positions, lengths, max_id = packer.finish()
    if tokens.shape[0] == 0:
        what = "no documents" if num_docs == 0 else "fewer than 2 tokens"
        if dropped:  # the records were there: seq_len (or the truncation) dropped them
            what += (
                f": its {dropped} record(s) longer than data.seq_len = {seq_len} kept no "
                "trained token once truncated; raise seq_len"
            )
        raise DataError(f"empty dataset: {p} yields {what}")
    ds = PackedDataset(
        tokens=tokens,
        lengths=lengths,
        pad_token_id=int(pad),
        eos_token_id=None if eos is None else int(eos),
        num_documents=num_docs,
        source=p,
        max_token_id=max_id,
        labels=labels,
        positions=positions,
        packing=mode,
    )
    if ds.num_trained_tokens == 0:
        raise DataError(f"{p}: no token carries a label, so there is nothing to train on")
    logger.info(
        "[data] %s: %d documents, %d tokens (%d trained), %d rows of %d (%s, packing %s)",
        p,
        num_docs,
        ds.num_tokens,
        ds.num_trained_tokens,
        ds.num_rows,
        seq_len,
        fmt,
        mode,
    )
    return ds


def build_dataset_from_spec(spec: JobSpec) -> PackedDataset:
    """``build_dataset`` with the settings of a validated job spec."""
    d = spec.data
    assert d.path is not None, "a validated spec has data.path"
    cols = columns_of(d)
    fmt = resolve_format(d.path, d.format, d.text_field, columns=cols, split=d.split)
    return build_dataset(
        d.path,
        seq_len=d.seq_len,
        format=fmt,
        text_field=d.text_field,
        # Only a tokenizer that exists (a model directory without tokenizer files gives
        # None): token data then has no separator between documents, as documented.
        tokenizer=spec.tokenizer_path,
        packing=d.packing,
        columns=cols,
        loss_on=d.loss_on,
        chat_template=d.chat_template,
        overlong=d.overlong,
        split=d.split,
    )


class _Packer:
    """Accumulates documents into flat int32 buffers (ids, labels, positions) of whole
    rows. See the module docstring for the three packing modes."""

    def __init__(self, seq_len: int, pad: int, mode: str) -> None:
        self.seq_len = seq_len
        self.pad = pad
        self.mode = mode
        self.ids = array.array("i")
        self.labels = array.array("i")
        self.positions = array.array("i")
        self.lengths = array.array("i")
        self.max_id = -1
        assert self.ids.itemsize == 4, "int32 rows assume a 4-byte C int"

    @property
    def _used(self) -> int:
        """Tokens already in the open (last, unfinished) row."""
        return len(self.ids) - len(self.lengths) * self.seq_len

    def add(self, doc: Document) -> None:
        # Labels too: a label id past the vocabulary fails the loss on a worker (a
        # device-side assert on CUDA) as an input id does. IGNORE_INDEX is below both.
        self.max_id = max(self.max_id, max(doc.ids), max(doc.labels, default=-1))
        s = self.seq_len
        # One stream (concat): documents join inside a row, the token before a document
        # predicts its first, and positions run 0..s-1 in every row.
        concat = self.mode == "concat"
        if self.mode == "none" or (doc.whole and self._used + len(doc.ids) > s):
            self._close_row()  # a whole record straddles no rows, concat's neither
        start = 0
        while start < len(doc.ids):
            used = self._used
            take = min(s - used, len(doc.ids) - start)
            ids = doc.ids[start : start + take]
            labels = doc.labels[start : start + take]
            if used > 0 and not concat:
                # The token before this one belongs to another document: nothing of it
                # may predict this one (labels are unshifted: labels[t] is what t-1
                # predicts).
                labels = [IGNORE_INDEX, *labels[1:]]
            self.ids.extend(ids)
            self.labels.extend(labels)
            self.positions.extend(range(used, used + take) if concat else range(take))
            start += take
            if self._used == s:
                self.lengths.append(s)  # a long document continues in the next row
        if self.mode == "none":
            self._close_row()

    def _close_row(self) -> None:
        """Pad the open row (if any) to seq_len; a row of < 2 real tokens is dropped."""
        used = self._used
        if used == 0:
            return
        if used < 2:
            del self.ids[-used:], self.labels[-used:], self.positions[-used:]
            return
        rest = self.seq_len - used
        self.ids.extend([self.pad] * rest)
        self.labels.extend([IGNORE_INDEX] * rest)
        # Padding continues the last document's positions: a row holding one document
        # keeps plain 0..s-1 positions (SDPA's is_causal fast path); pads carry no label
        # and no real token attends to them (causal).
        self.positions.extend(range(used, self.seq_len))
        self.lengths.append(used)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        s = self.seq_len
        self._close_row()
        rows = len(self.lengths)
        return (
            _tensor(self.ids, (rows, s)),
            _tensor(self.labels, (rows, s)),
            _tensor(self.positions, (rows, s)),
            _tensor(self.lengths, (rows,)),
            self.max_id,
        )


def _tensor(buf: array.array, shape: tuple[int, ...]) -> torch.Tensor:
    if not shape[0]:
        return torch.empty(shape, dtype=torch.int32)
    return torch.frombuffer(buf, dtype=torch.int32).clone().view(shape)  # own the memory


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
    """int64 ``[G, seq_len]``: unshifted labels, -100 in padding and masked tokens."""
    microbatch_size: int
    """Rows per microbatch."""
    position_ids: torch.Tensor | None = None
    """int64 ``[G, seq_len]``: position ids (restarting per document with packing
    ``documents``); ``None``: 0..seq_len-1 in every row."""
    row_lengths: torch.Tensor | None = None
    """int64 ``[G]``: real tokens of each row, the padding after them; ``None``: no
    padding. The router auxiliary loss counts real tokens only, as transformers does
    given the attention mask (Note [router auxiliary loss] in roundpipe.shared.model)."""

    @property
    def has_padding(self) -> bool:
        return self.row_lengths is not None and bool(
            (self.row_lengths < self.input_ids.shape[1]).any()
        )

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the batch that are not padding."""
        if self.row_lengths is None:
            return self.input_ids.numel()
        return int(self.row_lengths.sum())

    @property
    def microbatch_row_lengths(self) -> list[list[int]]:
        """Real tokens of each row, per microbatch."""
        lengths = self.row_lengths
        if lengths is None:
            lengths = torch.full((self.input_ids.shape[0],), self.input_ids.shape[1])
        return [part.tolist() for part in lengths.split(self.microbatch_size)]

    @property
    def microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(input_ids, labels)]``, each ``[microbatch_size, seq_len]``: contiguous views."""
        return list(
            zip(self.input_ids.split(self.microbatch_size), self.labels.split(self.microbatch_size))
        )

    @property
    def microbatch_position_ids(self) -> list[torch.Tensor]:
        """``[position_ids]`` per microbatch, each ``[microbatch_size, seq_len]``."""
        pos = self.position_ids
        if pos is None:
            seq = self.input_ids.shape[1]
            pos = torch.arange(seq).expand(self.input_ids.shape[0], seq)
        return list(pos.split(self.microbatch_size))

    @property
    def num_label_tokens(self) -> int:
        """Tokens a shifted causal-LM loss predicts in the whole batch (its denominator)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def shard(self, microbatches: range) -> GlobalBatch:
        """The batch made of the given microbatches only (one node's share with data
        parallelism, coordinator.multinode); its loss must still be normalised by the
        whole batch's ``num_label_tokens``."""
        rows = slice(
            microbatches.start * self.microbatch_size, microbatches.stop * self.microbatch_size
        )
        return replace(
            self,
            row_indices=self.row_indices[rows],
            input_ids=self.input_ids[rows],
            labels=self.labels[rows],
            position_ids=None if self.position_ids is None else self.position_ids[rows],
            row_lengths=None if self.row_lengths is None else self.row_lengths[rows],
        )


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
            position_ids=self.dataset.position_ids(index),
            row_lengths=self.dataset.lengths[index].long(),
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
        # Without a shuffle the seed orders nothing (the spec check says the same): a
        # resume may change train.seed, e.g. for other dropout.
        keys = ("seed", "shuffle") if self.shuffle or state.get("shuffle") else ("shuffle",)
        diffs = [
            f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}"
            for k in (*keys, "global_batch_size", "num_rows", "fingerprint")
            if state.get(k) != mine[k]
        ]
        if diffs:
            raise DataError(
                f"the data cursor does not match {self.dataset.source} as loaded now ("
                + "; ".join(diffs)
                + "); resuming would not reproduce the batches"
                + (
                    ". If neither the data nor its settings changed, this RoundPipe reads "
                    "the data differently from the one that wrote the checkpoint (since "
                    "November 2026 a UTF-8 byte-order mark is not read as text, and a shard "
                    "folder of several splits gives data.split's rows only)"
                    if any(d.startswith(("num_rows", "fingerprint")) for d in diffs)
                    else ""
                )
            )
        step = state.get("next_step")
        if not isinstance(step, int) or step < 1:
            raise DataError(f"data cursor next_step must be an integer >= 1, got {step!r}")
        self._next_step = step
