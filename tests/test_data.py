"""Data pipeline: reading, packing, deterministic batches, resumable cursor, errors."""

from __future__ import annotations

import filecmp
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from roundpipe.coordinator.spec.data import (
    DataLoader,
    PackedDataset,
    build_dataset,
    build_dataset_from_spec,
)
from roundpipe.coordinator.spec.documents import read_documents
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.formats import resolve_format
from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec
from roundpipe.coordinator.spec.tokenizers import load_tokenizer
from roundpipe.shared.model import IGNORE_INDEX

DEMO_DIR = Path(__file__).resolve().parents[1] / "roundpipe" / "demo_data"
EOS, PAD = 0, 99


class CharTokenizer:
    """One token per character (its code point); no transformers needed."""

    eos_token_id = EOS
    pad_token_id = PAD

    def __call__(self, texts: list[str], **_: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows_of(ds: PackedDataset) -> list[list[int]]:
    return [ds.tokens[i, : ds.lengths[i]].tolist() for i in range(ds.num_rows)]


def test_packing_with_eos_and_padded_last_row(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cde"}, {"text": "fghi"}])
    ds = build_dataset(f, seq_len=4, tokenizer=CharTokenizer())
    a, b, c, d, e, f_, g, h, i = (ord(x) for x in "abcdefghi")
    # Stream: a b EOS c d e EOS f g h i EOS  (12 tokens = 3 full rows)
    assert rows_of(ds) == [[a, b, EOS, c], [d, e, EOS, f_], [g, h, i, EOS]]
    assert ds.num_documents == 3 and ds.num_tokens == 12

    f2 = write_jsonl(tmp_path / "d2.jsonl", [{"text": "abcde"}])  # 6 tokens -> 4 + 2
    ds2 = build_dataset(f2, seq_len=4, tokenizer=CharTokenizer())
    assert ds2.tokens[1].tolist() == [e, EOS, PAD, PAD]
    ids, labels = ds2.rows(torch.tensor([1]))
    assert ids.dtype == torch.int64
    assert labels.tolist() == [[e, EOS, IGNORE_INDEX, IGNORE_INDEX]]

    f3 = write_jsonl(tmp_path / "d3.jsonl", [{"text": "abcd"}])  # 5 tokens: last 1 dropped
    assert rows_of(build_dataset(f3, seq_len=4, tokenizer=CharTokenizer())) == [[a, b, c, d]]


def test_unpacked_rows_start_each_document(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cdefg"}])
    ds = build_dataset(f, seq_len=4, tokenizer=CharTokenizer(), packing=False)
    a, b, c, d, e, f_, g = (ord(x) for x in "abcdefg")
    assert rows_of(ds) == [[a, b, EOS], [c, d, e, f_], [g, EOS]]
    assert ds.tokens[0].tolist() == [a, b, EOS, PAD]


def test_pretokenised_and_text_formats(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert resolve_format(f) == "jsonl_tokens"
    assert rows_of(build_dataset(f, seq_len=5)) == [[5, 6, 7, 8, 9]]  # no tokenizer: no EOS
    with_eos = build_dataset(f, seq_len=7, tokenizer=CharTokenizer())
    assert rows_of(with_eos) == [[5, 6, 7, EOS, 8, 9, EOS]]
    assert with_eos.vocab_size_needed == PAD + 1

    t = tmp_path / "book.txt"
    t.write_text("first para\nstill first\n\n\nsecond\n\n")
    assert resolve_format(t) == "text"
    assert list(read_documents(t)) == [(1, "first para\nstill first"), (5, "second")]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_text_documents_are_kept_as_written(tmp_path: Path, newline: str) -> None:
    """A text file's documents keep their indentation and the lines of spaces inside
    them (a code file, an indented Markdown block, a full-width indent), as ``datasets``'
    text reader keeps them; only empty lines separate documents, and Windows or classic
    Mac OS line breaks read as ``\\n``. (Each document was stripped, and a line of spaces
    cut a function in two.)"""
    docs = [
        "    def f(x):\n        y = x\n    \n        return y",
        "Example:",
        "    pip install foo\n    foo --help   ",
        "\u3000吾輩は猫である。",
    ]
    t = tmp_path / "code.txt"
    t.write_bytes(("\n\n".join(docs) + "\n\n \n\n").replace("\n", newline).encode())
    assert [doc for _, doc in read_documents(t)] == docs  # the lone " " line: no document
    assert [line for line, _ in read_documents(t)] == (
        [1, 6, 8, 11] if newline != "\r" else [1, 1, 1, 1]  # \r alone: one line for Python
    )
    ds = build_dataset(t, seq_len=64, tokenizer=CharTokenizer(), packing="none")
    assert rows_of(ds)[0] == [ord(c) for c in docs[0]] + [EOS]


def test_token_data_with_a_model_dir_without_tokenizer_files(tmp_path: Path) -> None:
    """No tokenizer files next to the model: no tokenizer at all, so documents of token
    data are concatenated without a separator (transformers 5 would otherwise hand out
    an empty tokenizer whose EOS id 0 lands between the documents)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 64, "max_position_embeddings": 32})
    )
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    spec = JobSpec.from_dict(
        {"model": {"path": str(model)}, "data": {"path": str(data), "seq_len": 5}}
    )
    assert spec.tokenizer_path is None
    ds = build_dataset_from_spec(spec)
    assert rows_of(ds) == [[5, 6, 7, 8, 9]]
    assert ds.eos_token_id is None and ds.pad_token_id == 0
    with pytest.raises(
        DataError, match=r"cannot load a tokenizer from .*model: it holds no tokenizer files"
    ):
        load_tokenizer(model)
    # With the tokenizer files there, its EOS separates the documents again.
    for f in (DEMO_DIR / "tokenizer").iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    spec = JobSpec.from_dict(spec.to_dict())
    eos = load_tokenizer(model).eos_token_id
    assert spec.tokenizer_path == str(model)
    assert rows_of(build_dataset_from_spec(spec)) == [[5, 6, 7, eos, 8], [9, eos]]


def test_format_detection(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}])
    assert resolve_format(f, text_field="body") == "jsonl_text"
    with pytest.raises(DataError, match=r"d\.jsonl:1: record has neither the text field 'text'"):
        resolve_format(f)
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        resolve_format(csv)
    assert resolve_format(csv, "text") == "text"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"text": "ok"}\n\n{"text": "bad"\n', r":3: invalid JSON"),
        ('{"text": "ok"}\n"just text"\n', r":2: expected a JSON object, got str"),
        ('{"text": "ok"}\n[1, 2]\n', r":2: expected a JSON object, got list"),
        # Alpaca-style .json: one pretty-printed array, not JSON Lines
        (
            '\n[\n  {"text": "a"},\n  {"text": "b"}\n]\n',
            r":2: this looks like a JSON array.* bad\.jsonl > bad\.converted\.jsonl$",
        ),
        ('{"text": "ok"}\n{"txt": "x"}\n', r":2: no 'text' field \(its keys: 'txt'\)"),
        ('{"text": "ok"}\n{"text": 5}\n', r":2: field 'text' is int"),
    ],
)
def test_malformed_jsonl_names_path_and_line(tmp_path: Path, lines: str, message: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(lines)
    with pytest.raises(DataError, match=str(f).replace(".", r"\.") + message):
        build_dataset(f, seq_len=8, tokenizer=CharTokenizer())


def test_other_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        build_dataset(tmp_path / "nope.jsonl", seq_len=8, tokenizer=CharTokenizer())
    bad_ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, -3]}])
    with pytest.raises(DataError, match=r"ids\.jsonl:2: 'input_ids' must be"):
        build_dataset(bad_ids, seq_len=8)
    utf = tmp_path / "u.jsonl"
    utf.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"u\.jsonl:2: not valid UTF-8"):
        build_dataset(utf, seq_len=8, tokenizer=CharTokenizer())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty dataset: .*empty\.jsonl"):
        build_dataset(empty, seq_len=8, tokenizer=CharTokenizer())
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "  "}])
    with pytest.raises(DataError, match=r"empty dataset: .*blank\.jsonl yields no documents"):
        build_dataset(blank, seq_len=8, tokenizer=CharTokenizer())
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="needs a tokenizer"):
        build_dataset(text, seq_len=8)
    with pytest.raises(DataError, match="tokenizer directory not found: .*/no-tok"):
        build_dataset(text, seq_len=8, tokenizer=tmp_path / "no-tok")
    (tmp_path / "junk-tok").mkdir()
    with pytest.raises(DataError, match="cannot load a tokenizer from .*junk-tok"):
        load_tokenizer(tmp_path / "junk-tok")


@pytest.mark.parametrize("first_labelled", [True, False])
def test_token_records_have_labels_all_or_none(tmp_path: Path, first_labelled: bool) -> None:
    """Whether records are labelled was read from the first record alone: labels on a
    later record were then dropped without a word and its prompt tokens trained."""
    labelled = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
    plain = {"input_ids": [4, 5, 6]}
    records = [labelled, plain] if first_labelled else [plain, labelled]
    f = write_jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(
        DataError, match=r"mixed\.jsonl:2: .*'labels'.* every record 'labels' or none"
    ):
        build_dataset(f, seq_len=8)


def numbered_dataset(num_rows: int, seq_len: int = 4) -> PackedDataset:
    """Row i is filled with the value i + 1, so batches show which rows they hold."""
    tokens = torch.arange(1, num_rows + 1, dtype=torch.int32).unsqueeze(1).repeat(1, seq_len)
    lengths = torch.full((num_rows,), seq_len, dtype=torch.int32)
    lengths[-1] = 2
    return PackedDataset(
        tokens=tokens,
        lengths=lengths,
        pad_token_id=0,
        eos_token_id=0,
        num_documents=num_rows,
        source="<numbered>",
        max_token_id=num_rows,
    )


def test_batches_shape_and_epochs() -> None:
    ds = numbered_dataset(10)
    loader = DataLoader(ds, microbatch_size=2, num_microbatches=2, seed=1)
    b = loader.batch_for_step(1)
    assert len(b.microbatches) == 2
    for ids, labels in b.microbatches:
        assert ids.shape == labels.shape == (2, 4) and ids.is_contiguous()
    # Steps 1-5 cover 20 stream positions = exactly two epochs: each row twice.
    seen = torch.cat([loader.batch_for_step(s).row_indices for s in range(1, 6)])
    assert seen[:10].sort().values.tolist() == list(range(10))
    assert seen[10:].sort().values.tolist() == list(range(10))
    assert seen[:10].tolist() != seen[10:].tolist()  # a fresh order per epoch
    assert loader.batch_for_step(3).epoch == 0  # positions 8..11 start in epoch 0
    # Labels: the short last row is padded with IGNORE_INDEX.
    last = loader.batch_for_step(1)
    for r, idx in enumerate(last.row_indices.tolist()):
        expect = 2 if idx == 9 else 4
        assert (last.labels[r] != IGNORE_INDEX).sum() == expect
    assert b.num_label_tokens == int((b.labels[:, 1:] != IGNORE_INDEX).sum())


def test_determinism_and_seeds() -> None:
    ds = numbered_dataset(50)

    def order(seed: int, shuffle: bool = True) -> list[int]:
        loader = DataLoader(ds, microbatch_size=5, num_microbatches=2, shuffle=shuffle, seed=seed)
        return torch.cat([loader.batch_for_step(s).row_indices for s in range(1, 8)]).tolist()

    assert order(3) == order(3)
    assert order(3) != order(4)
    assert order(3, shuffle=False) == list(range(50)) + list(range(20))
    loader = DataLoader(ds, microbatch_size=5, num_microbatches=2, seed=3)
    b = loader.batch_for_step(6)
    assert torch.equal(loader.batch_for_step(6).input_ids, b.input_ids)  # pure in the step
    fresh = DataLoader(ds, microbatch_size=5, num_microbatches=2, seed=3)
    assert torch.equal(loader.batch_for_step(2).input_ids, fresh.batch_for_step(2).input_ids)


def test_dataset_smaller_than_a_batch_cycles() -> None:
    loader = DataLoader(numbered_dataset(3), microbatch_size=2, num_microbatches=4, seed=0)
    b = loader.batch_for_step(1)
    assert b.row_indices.shape == (8,)
    assert sorted(b.row_indices.tolist()[:3]) == [0, 1, 2]


def test_cursor_resume_is_exact() -> None:
    ds = numbered_dataset(23)
    a = DataLoader(ds, microbatch_size=3, num_microbatches=2, seed=9)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON/msgpack trip
    assert state["next_step"] == 6
    assert (state["epoch"], state["position"]) == divmod(5 * 6, 23)
    b = DataLoader(ds, microbatch_size=3, num_microbatches=2, seed=9)
    b.load_state_dict(state)
    for _, (x, y) in zip(range(6), zip(a, b)):
        assert x.step == y.step
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)

    other_seed = DataLoader(ds, microbatch_size=3, num_microbatches=2, seed=8)
    with pytest.raises(DataError, match="seed: checkpoint 9, now 8"):
        other_seed.load_state_dict(state)
    other_rows = DataLoader(numbered_dataset(24), microbatch_size=3, num_microbatches=2, seed=9)
    with pytest.raises(DataError, match="num_rows"):
        other_rows.load_state_dict(state)

    # Without a shuffle the seed orders nothing: a resume that changed it (train.seed,
    # for other dropout) passed the spec check, then failed here.
    plain = DataLoader(ds, microbatch_size=3, num_microbatches=2, seed=9, shuffle=False)
    plain.next_batch()
    resumed = DataLoader(ds, microbatch_size=3, num_microbatches=2, seed=8, shuffle=False)
    resumed.load_state_dict(plain.state_dict())
    assert torch.equal(resumed.next_batch().input_ids, plain.next_batch().input_ids)


def test_demo_tokenizer_round_trips_text() -> None:
    tok = load_tokenizer(DEMO_DIR / "tokenizer")
    assert len(tok) == 512
    assert tok.convert_ids_to_tokens([tok.eos_token_id, tok.pad_token_id]) == [
        "<|endoftext|>",
        "<|pad|>",
    ]
    for text in ["The day after Monday is Tuesday.", "Unseen: naïve café, 3 + 4 = 7 ✓"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    # Familiar words are single tokens: the tokenizer was trained on the corpus.
    assert len(tok("The day after Monday is Tuesday.")["input_ids"]) <= 8


def test_demo_data_builds_and_feeds_the_demo_job() -> None:
    spec = load_job_spec(DEMO_DIR / "demo_job.yaml")
    loader = DataLoader.from_spec(spec)
    ds = loader.dataset
    assert ds.vocab_size_needed <= 512
    # At least one epoch's worth of distinct rows for the demo's steps.
    assert ds.num_rows >= spec.train.steps * spec.global_batch_size
    b = loader.next_batch()
    assert len(b.microbatches) == 3 and b.input_ids.shape == (12, spec.data.seq_len)
    again = DataLoader.from_spec(spec, dataset=build_dataset_from_spec(spec))
    assert ds.fingerprint == again.dataset.fingerprint


def test_demo_data_is_what_the_generator_makes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_demo_data", DEMO_DIR / "make_demo_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    for name in [
        "demo_corpus.jsonl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "demo_chat.jsonl",
        "chat_tokenizer/tokenizer.json",
        "chat_tokenizer/tokenizer_config.json",
    ]:
        assert filecmp.cmp(tmp_path / name, DEMO_DIR / name, shallow=False), name


def test_packing_modes_positions_and_labels(tmp_path: Path) -> None:
    """documents: positions restart per document (and per row), the first label of each
    later document is dropped; concat: the old stream, plain positions, every label."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cde"}, {"text": "fghi"}])
    a, b, c, d, e, f_, g, h, i = (ord(x) for x in "abcdefghi")
    docs = build_dataset(f, seq_len=6, tokenizer=CharTokenizer(), packing="documents")
    assert rows_of(docs) == [[a, b, EOS, c, d, e], [EOS, f_, g, h, i, EOS]]
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]
    assert docs.labels.tolist() == [
        [a, b, EOS, IGNORE_INDEX, d, e],
        [EOS, IGNORE_INDEX, g, h, i, EOS],
    ]
    concat = build_dataset(f, seq_len=6, tokenizer=CharTokenizer(), packing="concat")
    assert torch.equal(concat.tokens, docs.tokens)
    assert concat.positions.tolist() == [list(range(6))] * 2
    assert torch.equal(concat.labels, concat.tokens)
    assert concat.fingerprint != docs.fingerprint
    loader = DataLoader(docs, microbatch_size=1, num_microbatches=2, shuffle=False)
    batch = loader.batch_for_step(1)
    assert torch.equal(torch.cat(batch.microbatch_position_ids), docs.positions.long())
    # Masked labels never count in the loss normaliser.
    assert batch.num_label_tokens == 8 == docs.num_trained_tokens


@pytest.mark.parametrize("packing", ["documents", "concat"])
def test_a_labelled_record_never_straddles_two_rows(tmp_path: Path, packing: str) -> None:
    """Prompt/answer records (labelled tokens; chats and prompt_completion alike) are
    kept whole in concat's one stream too: an answer cut into the next row trained with
    no prompt before it, and its first token was never predicted."""
    records = [
        {"input_ids": [k + 1, k + 2, k + 3, k + 4, k + 5], "labels": [-100] * 3 + [k + 4, k + 5]}
        for k in (0, 10, 20)
    ]
    ds = build_dataset(write_jsonl(tmp_path / "r.jsonl", records), seq_len=8, packing=packing)
    assert rows_of(ds) == [[1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
    assert ds.num_trained_tokens == 6  # every answer token, in its record's row
    if packing == "concat":
        assert ds.positions.tolist() == [list(range(8))] * 3
