"""``roundpipe data inspect SPEC``: what a job's data gives, before any GPU hour is spent.

Builds the job's rows exactly as the coordinator will (roundpipe.coordinator.spec.data) and
prints how many documents, rows, tokens and trained tokens there are, then one rendered
row with the trained tokens marked: every token that a label trains is wrapped in
``[[...]]``, so the masking (assistant-only, completion-only, packing boundaries) can be
read off directly. A trained token here is one a shifted causal-LM loss predicts.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

__all__ = ["inspect_data", "render_row"]

TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def render_row(tokens: list[int], labels: list[int], positions: list[int], decode: Any) -> str:
    """The row as text: trained tokens in ``[[...]]``, ``|`` where a packed document
    starts. ``decode(ids) -> str`` (a tokenizer's decode, or str of the ids)."""
    out: list[str] = []
    document: list[int] = []
    runs: list[tuple[int, bool]] = []  # (where in the document a run starts, trained)

    def flush() -> None:
        if document:
            out.append(_render_document(document, runs, decode))
            document.clear()
            runs.clear()

    for t, tok in enumerate(tokens):
        trained = labels[t] != -100 and t > 0  # labels[0] is never predicted
        if t > 0 and positions[t] == 0:
            flush()
            out.append(" | ")
        if not runs or trained != runs[-1][1]:
            runs.append((len(document), trained))
        document.append(tok)
    flush()
    return "".join(out)


def _render_document(ids: list[int], runs: list[tuple[int, bool]], decode: Any) -> str:
    """One packed document's text with its trained runs marked. The document is decoded
    whole and cut where each run's prefix stops agreeing with it: a character whose
    bytes span two tokens on either side of a run's edge (byte-level BPE) shows once, in
    the later run, not as a replacement character in each."""
    text = decode(ids)
    cuts = []
    for start, _ in runs:
        agree = len(os.path.commonprefix([decode(ids[:start]), text])) if start else 0
        cuts.append(max(agree, cuts[-1] if cuts else 0))
    cuts.append(len(text))
    parts = []
    for (_, trained), begin, end in zip(runs, cuts, cuts[1:], strict=False):
        piece = text[begin:end]
        parts.append(f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}" if trained else piece)
    return "".join(parts)


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    """``ids`` as text, special tokens kept visible; an id the tokenizer does not have
    (a model vocabulary padded past it, data tokenised with another) is shown as
    ``<id N>``: the tokenizer's decode drops it, and the row would hide a trained token."""
    known = len(tokenizer)
    parts, run = [], []
    for i in ids:
        if 0 <= i < known:
            run.append(i)
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        parts.append(f"<id {i}>")
    if run:
        parts.append(tokenizer.decode(run))
    return "".join(parts)


def inspect_data(spec_path: str, *, row: int = 0, out: IO[str] | None = None) -> int:
    """Print the data summary and row ``row`` of the job spec at ``spec_path``; an exit
    status (0 ok, 2 bad spec or data)."""
    from roundpipe.coordinator.spec.data import build_dataset_from_spec
    from roundpipe.coordinator.spec.errors import DataError, JobSpecError
    from roundpipe.coordinator.spec.formats import columns_of, resolve_format
    from roundpipe.coordinator.spec.jobspec import (
        load_job_spec,
        model_config_from_spec,
        validate_against_model,
    )
    from roundpipe.coordinator.spec.tokenizers import load_tokenizer

    stream = sys.stdout if out is None else out
    try:
        spec = load_job_spec(spec_path)
        ds = build_dataset_from_spec(spec)
        d = spec.data
        assert d.path is not None
        fmt = resolve_format(d.path, d.format, d.text_field, columns=columns_of(d), split=d.split)
        # What the coordinator checks at submit against the model (token ids within its
        # vocabulary, seq_len within its positions): data it would refuse is not "fine".
        validate_against_model(
            spec, model_config_from_spec(spec.model), vocab_size_needed=ds.vocab_size_needed
        )
    except (JobSpecError, DataError) as exc:
        print(f"roundpipe data inspect: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a library's own error on odd input (transformers, pyarrow)
        print(f"roundpipe data inspect: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if not 0 <= row < ds.num_rows:
        print(
            f"roundpipe data inspect: error: --row {row} is out of range (0..{ds.num_rows - 1})",
            file=sys.stderr,
        )
        return 2
    decode: Any = lambda ids: " ".join(map(str, ids)) + " "  # noqa: E731 - token data
    if spec.tokenizer_path is not None:
        tok = load_tokenizer(spec.tokenizer_path)
        decode = lambda ids: _decoded(tok, ids)  # noqa: E731
    real = ds.num_tokens
    trained = ds.num_trained_tokens
    lines = [
        f"data:           {ds.source}",
        f"format:         {fmt}  (loss_on: {d.loss_on}, packing: {ds.packing})",
        f"documents:      {ds.num_documents}",
        f"rows:           {ds.num_rows} of {ds.seq_len} tokens",
        f"tokens:         {real} ({real / (ds.num_rows * ds.seq_len):.1%} of the row space)",
        f"trained tokens: {trained} ({trained / max(real, 1):.1%} of the tokens)",
        f"steps/epoch:    {ds.num_rows / spec.global_batch_size:.1f} "
        f"(global batch {spec.global_batch_size} rows)",
        "",
        f"row {row} ({int(ds.lengths[row])} tokens; {TRAINED_OPEN}trained{TRAINED_CLOSE}, "
        "| = next document):",
    ]
    n = int(ds.lengths[row])
    text = render_row(
        ds.tokens[row, :n].tolist(),
        ds.labels[row, :n].tolist(),  # type: ignore[index]
        ds.positions[row, :n].tolist(),  # type: ignore[index]
        decode,
    )
    stream.write("\n".join(lines) + "\n" + text + "\n")
    return 0
