"""Odd but plausible data files: each trains on exactly its text, or is refused with a
DataError that names the file, the line or row and what to do, never a bare traceback
(the spec checker turns any other exception into an "internal error" naming nothing).

Byte-order marks, broken surrogate escapes, JSON that Python cannot hold, damaged
Parquet pages, chat templates that are not UTF-8, conversations that open with the
assistant, shard folders holding several splits, datasets saved with a tensor format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import DEMO_DATA

from roundpipe.coordinator.spec.data import build_dataset
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.formats import resolve_format

TOKENIZER = str(DEMO_DATA / "tokenizer")
TEMPLATE = DEMO_DATA / "chat_template.jinja"
BOM = "\ufeff".encode()


def _lines(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(ds) -> list[list[int]]:
    return [ds.tokens[i, :n].tolist() for i, n in enumerate(ds.lengths.tolist())]


@pytest.mark.parametrize("name", ["d.jsonl", "d.txt"])
def test_a_byte_order_mark_is_not_trained_on(tmp_path: Path, name: str) -> None:
    """A file saved by an editor that writes a byte-order mark trains on the same tokens
    as without one (it is not text: before, it became tokens of the first document, and
    a JSONL file with one was refused)."""
    text = (
        '{"text": "Hello world"}\n{"text": "Second doc"}\n'
        if name.endswith(".jsonl")
        else "Hello world\n\nSecond doc\n"
    )
    plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
    for path, data in ((plain, text.encode()), (marked, BOM + text.encode())):
        path.parent.mkdir()
        path.write_bytes(data)
    kw: dict[str, Any] = dict(seq_len=32, tokenizer=TOKENIZER)
    assert _rows(build_dataset(marked, **kw)) == _rows(build_dataset(plain, **kw))


def test_a_chat_template_with_a_byte_order_mark_renders_without_it(tmp_path: Path) -> None:
    marked = tmp_path / "marked.jinja"
    marked.write_bytes(BOM + TEMPLATE.read_bytes())
    data = _lines(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    kw: dict[str, Any] = dict(seq_len=64, tokenizer=TOKENIZER, packing=False)
    a = build_dataset(data, chat_template=str(TEMPLATE), **kw)
    b = build_dataset(data, chat_template=str(marked), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)


def test_a_chat_template_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes(b"caf\xe9 " + TEMPLATE.read_bytes())
    data = _lines(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"latin1\.jinja is not UTF-8 text \(byte 0xe9 at offset 3"):
        build_dataset(data, seq_len=64, tokenizer=TOKENIZER, chat_template=str(latin1))


@pytest.mark.parametrize(
    "record, field",
    [
        ('{"text": "ok"}\n{"text": "broken emoji \\ud83d here"}\n', "text"),
        ('{"prompt": "a \\udc00", "completion": "b"}\n', "prompt"),
    ],
    ids=["text", "prompt_completion"],
)
def test_an_unpaired_surrogate_escape_names_its_line(
    tmp_path: Path, record: str, field: str
) -> None:
    """``\\ud83d`` alone is valid JSON but not text: the fast tokenizer refused it with a
    TypeError naming nothing."""
    data = tmp_path / "d.jsonl"
    data.write_text(record)
    line = record.count("\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:{line}: field '{field}' holds an unpaired"):
        build_dataset(data, seq_len=16, tokenizer=TOKENIZER)


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
        ('{"input_ids": [' + "9" * 5000 + "]}", "unreadable JSON"),
    ],
    ids=["deep", "bigint"],
)
def test_json_python_cannot_hold_names_its_line(tmp_path: Path, line: str, why: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:2: {why}"):
        build_dataset(data, seq_len=16, tokenizer=TOKENIZER, format="jsonl_text")


def test_a_damaged_parquet_page_names_the_file_and_row(tmp_path: Path) -> None:
    """The footer is intact (the file opens), a data page is not: found only as the rows
    are read, where pyarrow's OSError escaped unnamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    texts = [f"document number {i} " * 20 for i in range(200)]
    pq.write_table(pa.table({"text": texts}), path, compression="snappy", use_dictionary=False)
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 3
    raw[middle : middle + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"cannot read Parquet file .*d\.parquet near row 0"):
        build_dataset(path, seq_len=16, tokenizer=TOKENIZER)


def test_a_shard_folder_of_several_splits_reads_only_the_split_asked(tmp_path: Path) -> None:
    """``push_to_hub`` leaves ``train-00000-of-00001.parquet`` beside
    ``test-00000-of-00001.parquet``: before, both were read, the test rows first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    for split, ids in (("train", [1, 1, 1]), ("test", [9, 9, 9])):
        pq.write_table(pa.table({"input_ids": [ids]}), folder / f"{split}-00000-of-00001.parquet")
    assert _rows(build_dataset(folder, seq_len=4)) == [[1, 1, 1]]
    assert _rows(build_dataset(folder, seq_len=4, split="test")) == [[9, 9, 9]]
    with pytest.raises(DataError, match="holds the shards of splits test, train but not 'dev'"):
        build_dataset(folder, seq_len=4, split="dev")
    # datasets 2 added a fingerprint to the names: train-00000-of-00001-<hex>.parquet
    for shard in folder.iterdir():
        shard.rename(shard.with_name(shard.stem + "-0b1c2d3e4f506172.parquet"))
    assert _rows(build_dataset(folder, seq_len=4)) == [[1, 1, 1]]


def test_a_shard_folder_of_split_named_files_reads_only_the_split_asked(tmp_path: Path) -> None:
    """``train.parquet`` beside ``test.parquet`` (and ``datasets``' other split names)
    are splits too: before, only push_to_hub's shard names were, and both files were
    read. Shards named for no split beside named ones are refused, not mixed in."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def shard(path: Path, token: int) -> None:
        path.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"input_ids": [[token] * 3]}), path)

    folder = tmp_path / "data"
    for name, token in (("train.parquet", 1), ("test_0.parquet", 9), ("dev-set.parquet", 5)):
        shard(folder / name, token)
    assert _rows(build_dataset(folder, seq_len=4)) == [[1, 1, 1]]
    assert _rows(build_dataset(folder, seq_len=4, split="test")) == [[9, 9, 9]]
    assert _rows(build_dataset(folder, seq_len=4, split="validation")) == [[5, 5, 5]]
    shard(folder / "extra.parquet", 7)
    with pytest.raises(DataError, match=r"beside shards named for none \(extra\.parquet\)"):
        build_dataset(folder, seq_len=4)
    # One split by a loose name is a folder of one dataset: read whatever it is called.
    shard(tmp_path / "one" / "training_data.parquet", 3)
    assert _rows(build_dataset(tmp_path / "one", seq_len=4, split="test")) == [[3, 3, 3]]
    # push_to_hub's names say the split beyond doubt: another split asked is refused.
    shard(tmp_path / "hub" / "train-00000-of-00001.parquet", 4)
    with pytest.raises(DataError, match="holds the shards of split train but not 'test'"):
        build_dataset(tmp_path / "hub", seq_len=4, split="test")
    # ... but a name that is no split's is one dataset's shards, read whole.
    for i in range(2):
        shard(tmp_path / "plain" / f"data-0000{i}-of-00002.parquet", 6 + i)
    assert _rows(build_dataset(tmp_path / "plain", seq_len=4)) == [[6, 6, 6, 7], [7, 7]]


@pytest.mark.parametrize("fmt", ["torch", "numpy"])
def test_a_dataset_saved_with_a_tensor_format_reads_as_lists(tmp_path: Path, fmt: str) -> None:
    """``set_format("torch")`` before ``save_to_disk`` is a common step after tokenizing:
    its rows sliced to tensors and were refused as not lists of integers, and columns
    left out of the format were hidden from format detection."""
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10, 11]]})
    ds.set_format(fmt)
    ds.save_to_disk(str(tmp_path / "tokens"))
    assert _rows(build_dataset(tmp_path / "tokens", seq_len=8)) == [[5, 6, 7, 8, 9, 10, 11]]
    both = datasets.Dataset.from_dict({"text": ["hello"], "input_ids": [[1, 2]]})
    both.set_format(fmt, columns=["input_ids"])
    both.save_to_disk(str(tmp_path / "both"))
    with pytest.raises(DataError, match="fits more than one format"):
        resolve_format(tmp_path / "both")


def test_a_conversation_opening_with_the_assistant_says_what_to_do(tmp_path: Path) -> None:
    """Without ``{% generation %}`` markers the assistant's tokens are found by rendering
    the turns before it, and a first turn has none: the template was blamed for
    rejecting an empty conversation, roles listed as nothing."""
    marked = TEMPLATE.read_text()
    plain = tmp_path / "plain.jinja"
    plain.write_text(marked.replace("{%- generation %}", "").replace("{%- endgeneration %}", ""))
    chat = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"}]
    data = _lines(tmp_path / "c.jsonl", [{"messages": chat}])
    kw: dict[str, Any] = dict(seq_len=64, tokenizer=TOKENIZER, packing=False)
    with pytest.raises(DataError, match=r"c\.jsonl:1: the conversation opens with an assistant"):
        build_dataset(data, chat_template=str(plain), **kw)
    # With the markers, or with loss on everything, the same record trains.
    assert build_dataset(data, chat_template=str(TEMPLATE), **kw).num_rows == 1
    everything = build_dataset(data, chat_template=str(plain), loss_on="all", **kw)
    assert everything.num_rows == 1


def test_an_unforeseen_error_reading_the_data_still_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec check caught DataError only: any other exception a library raised on odd
    input reached the client as "internal error", naming nothing."""
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.service import admission
    from roundpipe.coordinator.spec import data
    from roundpipe.coordinator.spec.errors import JobSpecError

    def odd(spec):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    monkeypatch.setattr(data, "build_dataset_from_spec", odd)
    spec = tiny_spec(tmp_path / "out").to_dict()
    with pytest.raises(JobSpecError) as err:
        admission.validate_spec(spec)
    (problem,) = err.value.errors
    assert problem.path == "data", problem
    assert f"cannot read {spec['data']['path']}: TypeError: TextEncodeInput" in problem.message
