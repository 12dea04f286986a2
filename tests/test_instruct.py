"""Instruction data: chat / prompt-completion labels against transformers, table sources,
packing without cross-document attention, and training on masked rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import TINY_QWEN3, assert_params_match, oracle_train, tiny_spec
from test_trainer import train_in_process

from roundpipe.coordinator.spec.data import build_dataset
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.formats import Columns, resolve_format
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.shared.model import IGNORE_INDEX, LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.worker.executor import StageExecutor
from roundpipe.worker.reference import run_iteration

DEMO = Path(__file__).resolve().parents[1] / "roundpipe" / "demo_data"
CHATS = [json.loads(line)["messages"] for line in (DEMO / "demo_chat.jsonl").open()][:40]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO / "chat_tokenizer"), local_files_only=True)


def demo_tokenizer_with_template() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"), local_files_only=True)
    tok.chat_template = (DEMO / "chat_template.jinja").read_text()
    return tok


def rows(ds) -> list[tuple[list[int], list[int]]]:
    return [
        (ds.tokens[i, :n].tolist(), ds.labels[i, :n].tolist())
        for i, n in enumerate(ds.lengths.tolist())
    ]


# ------------------------------------------------------------------ labels vs oracle


@pytest.mark.parametrize("which", ["chat_tokenizer", "demo_tokenizer_and_template_file"])
def test_chat_labels_equal_transformers_assistant_mask(tmp_path: Path, which: str) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    if which == "chat_tokenizer":
        tok, template = chat_tokenizer(), None
        oracle_tok = chat_tokenizer()
    else:
        tok, template = str(DEMO / "tokenizer"), str(DEMO / "chat_template.jinja")
        oracle_tok = demo_tokenizer_with_template()
    ds = build_dataset(data, seq_len=512, tokenizer=tok, chat_template=template, packing=False)
    assert ds.num_rows == len(CHATS)
    for (ids, labels), messages in zip(rows(ds), CHATS):
        enc = oracle_tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == list(enc["input_ids"])
        assert labels == [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"])]
    everything = build_dataset(
        data, seq_len=512, tokenizer=tok, chat_template=template, packing=False, loss_on="all"
    )
    real = everything.labels != IGNORE_INDEX
    assert int(real.sum()) == everything.num_tokens  # every real token is trained
    assert torch.equal(everything.labels[real], everything.tokens[real])


def test_template_without_generation_markers_masks_turn_by_turn(tmp_path: Path) -> None:
    """A template without ``{% generation %}``: the turns are found by rendering the
    conversation turn by turn; here they must cover what the markers covered plus the
    newline the template writes after each assistant turn."""
    marked = (DEMO / "chat_template.jinja").read_text()
    plain = marked.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert plain != marked
    (tmp_path / "plain.jinja").write_text(plain)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS[:10]])
    kw: dict[str, Any] = dict(seq_len=512, tokenizer=str(DEMO / "tokenizer"), packing=False)
    a = build_dataset(data, chat_template=str(DEMO / "chat_template.jinja"), **kw)
    b = build_dataset(data, chat_template=str(tmp_path / "plain.jinja"), **kw)
    assert torch.equal(a.tokens, b.tokens)
    newline = demo_tokenizer_with_template()("\n", add_special_tokens=False)["input_ids"]
    extra = (b.labels != IGNORE_INDEX) & (a.labels == IGNORE_INDEX)
    assert set(b.tokens[extra].tolist()) == set(newline)
    assert not ((a.labels != IGNORE_INDEX) & (b.labels == IGNORE_INDEX)).any()


def _without_markers(template: str) -> str:
    plain = template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert plain != template
    return plain


def _long_chat(turns: int, seed: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    words = [w for m in CHATS for w in m[-1]["content"].split()]
    chat = [{"role": "system", "content": "Answer briefly."}] if seed % 2 else []
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        chat.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, 40)))})
    return chat


@pytest.mark.parametrize("which", ["chat_tokenizer", "demo_tokenizer"])
def test_turn_by_turn_masks_agree_with_the_rule_on_tokens_in_linear_time(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template without generation markers: the mask found from the turns' character
    spans and one tokenisation of the text (Note [turn-by-turn masks]) is the one the
    rule on tokens gives, prefix by tokenised prefix, on the shipped conversations and on
    long random ones; and what is tokenised is the text twice, however many turns (the
    definition tokenised every prefix: 2.2 s for one 200-turn record)."""
    from roundpipe.coordinator.spec import instruct

    tok = chat_tokenizer() if which == "chat_tokenizer" else demo_tokenizer_with_template()
    tok.chat_template = _without_markers(tok.chat_template)
    conversations = [*CHATS, *(_long_chat(turns, seed) for seed, turns in enumerate([2, 9, 60]))]
    for chat in conversations:
        expected = instruct._turn_by_turn_mask_by_tokens(tok, chat, "x")
        assert instruct._turn_by_turn_mask(tok, chat, "x") == expected
        assert any(expected[1])

    tokenised: list[int] = []
    real_call = type(tok).__call__
    monkeypatch.setattr(
        type(tok),
        "__call__",
        lambda self, text, **kw: tokenised.append(len(text)) or real_call(self, text, **kw),
    )
    monkeypatch.setattr(instruct, "_turn_by_turn_mask_by_tokens", None)  # not needed here
    chat = _long_chat(200, seed=7)
    ids, labels = instruct.render_chat(tok, chat, "x")
    text = tok.apply_chat_template(chat, tokenize=False)
    assert sum(tokenised) <= 2 * len(text) + 100, (sum(tokenised), len(text))
    assert sum(1 for y in labels if y != IGNORE_INDEX) > len(ids) // 4


def test_a_prefix_that_merges_across_its_own_end_is_masked_by_its_spans() -> None:
    """A tokenizer that merges " " and "\n" (as byte-level vocabularies do) and a
    template that writes the contents one after another: "q:" "a " "\n" "b". The text
    before the second assistant turn, tokenised alone, ends in " \n", a token the
    whole text never has (there " " and "\n" are apart, "b" follows). The rule on
    tokens refused the record for it; its spans give each assistant token."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from roundpipe.coordinator.spec import instruct

    raw = json.loads((DEMO / "tokenizer" / "tokenizer.json").read_text())
    raw["model"]["vocab"]["ĠĊ"] = max(raw["model"]["vocab"].values()) + 1
    merges = raw["model"]["merges"]
    merges.insert(0, ["Ġ", "Ċ"] if isinstance(merges[0], list) else "Ġ Ċ")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)))
    tok.chat_template = "{%- for m in messages %}{{- m.content }}{%- endfor %}"
    chat = [
        {"role": "user", "content": "q:"},
        {"role": "assistant", "content": "a "},
        {"role": "user", "content": "\n"},
        {"role": "assistant", "content": "b"},
    ]
    ids = tok("q:a \nb", add_special_tokens=False)["input_ids"]
    cut = tok("q:a \n", add_special_tokens=False)["input_ids"]
    assert cut != ids[: len(cut)] and len(ids) == 6  # q : a " " "\n" b
    with pytest.raises(instruct.InstructError, match="does not render this conversation turn"):
        instruct._turn_by_turn_mask_by_tokens(tok, chat, "x")
    assert instruct.render_chat(tok, chat, "x") == (
        ids,
        [IGNORE_INDEX, IGNORE_INDEX, ids[2], ids[3], IGNORE_INDEX, ids[5]],
    )


def test_a_token_across_a_turns_edge_is_settled_by_the_rule_on_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A generation prompt that ends inside a word ("...Answer: th" + "e cat"): one token
    spans the edge of the turn, so the pieces cannot settle the mask and the rule on
    tokens decides, here refusing the record as before (the prefix's tokens are not the
    whole's)."""
    from roundpipe.coordinator.spec import instruct

    tok = demo_tokenizer_with_template()
    tok.chat_template = (
        "{%- for m in messages %}{{- m.role ~ ': ' ~ m.content ~ '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: th' }}{%- endif %}"
    )
    chat = [{"role": "user", "content": "what sat on the mat"}]
    chat.append({"role": "assistant", "content": "e cat sat on the mat"})
    whole = tok("assistant: the cat", add_special_tokens=False)["input_ids"]
    cut = tok("assistant: th", add_special_tokens=False)["input_ids"]
    assert whole[: len(cut)] != cut  # the edge falls inside a token
    settled = []
    by_tokens = instruct._turn_by_turn_mask_by_tokens
    monkeypatch.setattr(
        instruct,
        "_turn_by_turn_mask_by_tokens",
        lambda *a: settled.append(a) or by_tokens(*a),
    )
    with pytest.raises(instruct.InstructError, match="does not render this conversation turn"):
        instruct.render_chat(tok, chat, "x")
    assert len(settled) == 1


def test_prompt_completion_strings_and_messages(tmp_path: Path) -> None:
    tok = chat_tokenizer()
    eos = tok.eos_token_id
    strings = write_jsonl(
        tmp_path / "pc.jsonl",
        [{"prompt": "What does the cow say?", "completion": " The cow says moo."}],
    )
    assert resolve_format(strings) == "prompt_completion"
    (ids, labels), = rows(build_dataset(strings, seq_len=64, tokenizer=tok))  # fmt: skip
    prompt = tok("What does the cow say?")["input_ids"]
    completion = tok(" The cow says moo.", add_special_tokens=False)["input_ids"] + [eos]
    assert ids == prompt + completion
    assert labels == [IGNORE_INDEX] * len(prompt) + completion

    q = [{"role": "user", "content": "What does the cow say?"}]
    a = [{"role": "assistant", "content": "The cow says moo."}]
    msgs = write_jsonl(tmp_path / "pcm.jsonl", [{"prompt": q, "completion": a}])
    (ids, labels), = rows(build_dataset(msgs, seq_len=64, tokenizer=tok))  # fmt: skip
    assert ids == list(tok.apply_chat_template(q + a, tokenize=True, return_dict=True)["input_ids"])
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert tok.decode(trained) == "The cow says moo.<|im_end|>\n"


def test_token_records_with_labels_are_used_as_given(tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
            {"input_ids": [9, 10, 11], "labels": [-100, 10, 11]},
        ],
    )
    ds = build_dataset(data, seq_len=8, packing="none")
    assert rows(ds) == [([5, 6, 7, 8], [-100, -100, 7, 8]), ([9, 10, 11], [-100, 10, 11])]
    packed = build_dataset(data, seq_len=8)
    # Packed: the second record's first label is dropped (its predecessor is the first
    # record) and its positions restart.
    assert rows(packed) == [([5, 6, 7, 8, 9, 10, 11], [-100, -100, 7, 8, -100, 10, 11])]
    assert packed.positions[0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert packed.num_trained_tokens == 4
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: 1 labels for 2 input_ids"):
        build_dataset(bad, seq_len=8)


# ------------------------------------------------------------------ sources


def test_parquet_and_datasets_folders_read_like_jsonl(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"conversation": m, "id": i} for i, m in enumerate(CHATS[:12])]
    cols = Columns(messages="conversation")
    kw: dict[str, Any] = dict(seq_len=256, tokenizer=chat_tokenizer(), columns=cols)
    ref = build_dataset(write_jsonl(tmp_path / "c.jsonl", records), **kw)

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    (tmp_path / "shards").mkdir()
    ds.select(range(6)).to_parquet(str(tmp_path / "shards" / "part-0.parquet"))
    ds.select(range(6, 12)).to_parquet(str(tmp_path / "shards" / "part-1.parquet"))
    for source in ("c.parquet", "saved", "saved_dict", "shards"):
        path = tmp_path / source
        assert resolve_format(path, columns=cols) == "chat", source
        got = build_dataset(path, **kw)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.labels, ref.labels), source
    one = build_dataset(tmp_path / "saved_dict", split="test", **kw)
    assert one.num_documents == 1
    with pytest.raises(DataError, match="holds splits test, train but not 'dev'; set data.split"):
        build_dataset(tmp_path / "saved_dict", split="dev", **kw)
    with pytest.raises(DataError, match=r"c\.parquet row 0: record has neither"):
        resolve_format(tmp_path / "c.parquet")  # default column names: no 'messages'


def test_auto_detection_refuses_ambiguous_records(tmp_path: Path) -> None:
    both = write_jsonl(tmp_path / "b.jsonl", [{"messages": [], "text": "x"}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: the record fits more than one format"):
        resolve_format(both)
    assert resolve_format(both, "chat") == "chat"


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"msgs": []}, r":2: no 'messages' field \(its keys: 'msgs'\); set data.columns"),
        (
            {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
            r":2: the chat template rejects this conversation \(roles: assistant, tool\): "
            r"role tool is not one of system, user, assistant",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            r":2: the conversation has no assistant turn.*set data.loss_on: all",
        ),
        ({"messages": [{"content": "x"}]}, r":2: messages\[0\] must be an object with a string"),
        # the tokenizer's TypeError blamed the chat template
        (
            {"messages": [{"role": "user", "content": "a \ud83d"}, CHATS[0][1]]},
            r":2: messages\[0\] \(user\) holds an unpaired UTF-16 surrogate",
        ),
        # the same in a content part (or any field a template renders)
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a \ud83d"}]},
                    CHATS[0][1],
                ]
            },
            r":2: messages\[0\] \(user\) holds an unpaired UTF-16 surrogate",
        ),
    ],
)
def test_bad_chat_records_name_file_line_and_fix(
    tmp_path: Path, record: dict[str, Any], message: str
) -> None:
    f = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[0]}, record])
    with pytest.raises(DataError, match=r"bad\.jsonl" + message):
        build_dataset(f, seq_len=256, tokenizer=chat_tokenizer(), format="chat")


@pytest.mark.parametrize("completion", ["", "   "])
def test_an_empty_completion_is_refused(tmp_path: Path, completion: str) -> None:
    """EOS was appended to an empty completion before the check for one, so the record
    trained "prompt -> EOS" without a word (only a tokenizer without EOS refused it)."""
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Hi", "completion": completion}])
    with pytest.raises(DataError, match=r"pc\.jsonl:1: the completion is empty"):
        build_dataset(f, seq_len=64, tokenizer=chat_tokenizer(), format="prompt_completion")


def test_a_completion_needs_a_tokenizer_with_eos(tmp_path: Path) -> None:
    """A completion is trained with the EOS after it (docs/job-spec.md), so the model
    learns to stop; a tokenizer without one trained it without, silently."""
    tok = chat_tokenizer()
    tok.eos_token = None
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Hi", "completion": "Moo."}])
    with pytest.raises(DataError, match=r"pc\.jsonl:1: the tokenizer has no EOS token"):
        build_dataset(f, seq_len=64, tokenizer=tok, format="prompt_completion")


def test_records_all_dropped_by_truncation_are_named(tmp_path: Path) -> None:
    """Chats whose answers all lie past seq_len are cut to nothing trained: the error
    said the file "yields no documents", the reason only in a log line at submit."""
    long = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    f = write_jsonl(tmp_path / "long.jsonl", [{"messages": long}] * 3)
    with pytest.raises(DataError, match=r"its 3 record\(s\) longer than data\.seq_len = 32"):
        build_dataset(f, seq_len=32, tokenizer=chat_tokenizer(), format="chat", overlong="truncate")


def test_a_long_chat_record_is_cut_without_transformers_warning(
    tmp_path: Path, caplog, capfd
) -> None:
    """Longer than the tokenizer's model_max_length, a chat record is cut to seq_len: the
    "will result in indexing errors" warning only misled (text records had it off)."""
    tok = chat_tokenizer()
    long = [{"role": "user", "content": "word " * (tok.model_max_length + 10)}, CHATS[0][1]]
    f = write_jsonl(tmp_path / "long.jsonl", [{"messages": long}])
    build_dataset(f, seq_len=256, tokenizer=tok, format="chat", overlong="truncate", loss_on="all")
    assert "indexing errors" not in caplog.text + capfd.readouterr().err


def test_a_tokenizer_without_chat_template_asks_for_one(tmp_path: Path) -> None:
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    q, a = CHATS[0][:1], CHATS[0][1:2]
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": q, "completion": a}])
    for f in (chat, pc):
        with pytest.raises(DataError, match="has no chat template; set data.chat_template"):
            build_dataset(f, seq_len=256, tokenizer=str(DEMO / "tokenizer"))


def test_overlong_records_are_truncated_or_refused(tmp_path: Path) -> None:
    long_answer = {"role": "assistant", "content": " ".join(["one two three"] * 80)}
    long = [{"role": "user", "content": "Count."}, long_answer]
    f = write_jsonl(tmp_path / "l.jsonl", [{"messages": CHATS[0]}, {"messages": long}])
    with pytest.raises(DataError, match=r"l\.jsonl:2: the record has \d+ tokens, more than "):
        build_dataset(f, seq_len=128, tokenizer=chat_tokenizer(), overlong="refuse")
    ds = build_dataset(f, seq_len=128, tokenizer=chat_tokenizer(), packing="none")
    assert ds.num_rows == 2 and ds.lengths[1] == 128
    # A prompt longer than seq_len leaves nothing to train on: the record is dropped.
    long_prompt = [{"role": "user", "content": long_answer["content"]}, CHATS[0][1]]
    g = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHATS[0]}, {"messages": long_prompt}])
    assert build_dataset(g, seq_len=128, tokenizer=chat_tokenizer()).num_documents == 1


# ------------------------------------------------------------------ packing


def _model(vocab: int) -> tuple[LayeredModel, dict[int, dict[str, torch.Tensor]]]:
    from transformers import Qwen3Config

    layered = LayeredModel(Qwen3Config(**{**TINY_QWEN3, "vocab_size": vocab}))
    return layered, layered.init_weights(5)


def _step(layered, weights, ds, plan: str) -> tuple[float, dict[str, torch.Tensor]]:
    everything = torch.arange(ds.num_rows)
    ids, labels = ds.rows(everything)
    pos = ds.position_ids(everything)
    half = (ds.num_rows + 1) // 2  # two microbatches of a global batch
    mbs = list(zip(ids.split(half), labels.split(half)))
    res = run_iteration(
        layered,
        Plan.parse(plan),
        weights,
        mbs,
        StageExecutor(layered),
        position_ids=list(pos.split(half)),
    )
    return res.loss, res.grads


@pytest.mark.slow
def test_packed_documents_equal_the_unpacked_run(tmp_path: Path) -> None:
    """Loss and every gradient of one step on packed rows equal those on one document per
    row (fp32, 1e-5); the old concatenation does not, so the test can tell."""
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS[:8]])
    kw: dict[str, Any] = dict(seq_len=256, tokenizer=chat_tokenizer())
    unpacked = build_dataset(data, packing="none", **kw)
    packed = build_dataset(data, packing="documents", **kw)
    concat = build_dataset(data, packing="concat", **kw)
    assert packed.num_rows < unpacked.num_rows
    assert int((packed.positions == 0).sum(dim=1).max()) >= 3  # 3+ documents in a row
    assert packed.num_trained_tokens == unpacked.num_trained_tokens
    layered, weights = _model(len(chat_tokenizer()))
    plan = f"F[0:2] T[2:{layered.num_layers}] B[0:2]"
    loss_u, grads_u = _step(layered, weights, unpacked, plan)
    loss_p, grads_p = _step(layered, weights, packed, plan)
    assert abs(loss_p - loss_u) <= 1e-5 * abs(loss_u)
    assert_params_match(grads_p, grads_u, rtol=1e-5)
    loss_c, _ = _step(layered, weights, concat, plan)
    assert abs(loss_c - loss_u) > 1e-4 * abs(loss_u)  # 10x the tolerance above


@pytest.mark.slow
def test_training_on_chat_rows_through_the_runtime_matches_a_plain_loop(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A few optimizer steps on the demo conversations (assistant-only labels, packed
    documents) through the coordinator's trainer and two workers equal the plain loop."""
    d = tiny_spec(tmp_path, steps=2, seq_len=96).to_dict()
    d["model"]["tokenizer"] = str(DEMO / "chat_tokenizer")
    d["model"]["config"]["vocab_size"] = len(chat_tokenizer())
    d["data"].update(path=str(DEMO / "demo_chat.jsonl"), format="chat", loss_on="assistant")
    spec = JobSpec.from_dict(d)
    assert_params_match(train_in_process(spec, arena_dir, 2), oracle_train(spec))


# ------------------------------------------------------------------ CLI and demo


def test_data_inspect_shows_a_character_split_over_a_labels_edge_once() -> None:
    """A byte-level tokenizer splits a CJK character over several tokens; where a
    trained run starts inside one, the row shows the character once, in the trained
    run (each run decoded apart showed replacement characters on both sides)."""
    from transformers import AutoTokenizer

    from roundpipe.inspect_data import render_row

    tok = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    ids = tok("吾輩は猫である。")["input_ids"]
    assert tok.decode(ids[:1]) == "\ufffd"  # 吾 takes several byte tokens
    labels = [-100] + ids[1:]  # trained from the second byte of 吾 on
    positions = list(range(len(ids)))
    assert render_row(ids, labels, positions, tok.decode) == "[[吾輩は猫である。]]"
    labels = [-100] * 4 + ids[4:]  # 輩's bytes: ids 3..5
    assert render_row(ids, labels, positions, tok.decode) == "吾[[輩は猫である。]]"
    # a packed document's edge is kept, each document decoded on its own
    positions = [0, 1, 2, 0, *range(1, len(ids) - 3)]
    assert render_row(ids, [-100] * len(ids), positions, tok.decode) == "吾 | 輩は猫である。"


def test_data_inspect_counts_and_marks_trained_tokens(capsys, tmp_path: Path) -> None:
    from roundpipe import cli
    from roundpipe.demo import CHAT_DEMO_SPEC_PATH, demo_spec

    assert cli.main(["data", "inspect", str(CHAT_DEMO_SPEC_PATH)]) == 0
    out = capsys.readouterr().out
    spec = demo_spec(spec_path=CHAT_DEMO_SPEC_PATH, output_dir=tmp_path)
    from roundpipe.coordinator.spec.data import build_dataset_from_spec

    ds = build_dataset_from_spec(spec)
    assert f"rows:           {ds.num_rows} of 256 tokens" in out
    assert f"trained tokens: {ds.num_trained_tokens} " in out
    assert "format:         chat  (loss_on: assistant, packing: documents)" in out
    # Row 0: assistant answers (and their end-of-turn token) are marked, questions not.
    first = CHATS[0]
    assert f"[[{first[1]['content']}<|im_end|>]]" in out
    assert f"[[{first[0]['content']}" not in out and first[0]["content"] in out
    assert " | " in out  # several conversations share the row

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    d = spec.to_dict()
    d["data"]["path"] = str(bad)
    (tmp_path / "bad.yaml").write_text(json.dumps(d))
    assert cli.main(["data", "inspect", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: the conversation has no assistant turn" in err
    assert "Traceback" not in err

    # Data the coordinator would refuse against the model is not shown as fine: the chat
    # tokenizer's ids pass a vocabulary of 500.
    d = spec.to_dict()
    d["model"]["config"] = {**d["model"]["config"], "vocab_size": 500}
    (tmp_path / "small.yaml").write_text(json.dumps(d))
    assert cli.main(["data", "inspect", str(tmp_path / "small.yaml")]) == 2
    err = capsys.readouterr().err
    assert "but the model's vocab_size is 500" in err and "Traceback" not in err


def test_data_inspect_shows_ids_its_tokenizer_lacks() -> None:
    """Token data may hold ids past the tokenizer's (a model vocabulary padded past it,
    data tokenised with another): decode dropped them, so a row hid trained tokens."""
    from roundpipe.inspect_data import _decoded

    tok = chat_tokenizer()
    past = len(tok) + 86
    shown = _decoded(tok, [*tok("ab")["input_ids"], past, *tok("cd")["input_ids"], past + 1])
    assert shown == f"ab<id {past}>cd<id {past + 1}>"


def test_chat_demo_spec_is_valid_and_sized_to_its_tokenizer(tmp_path: Path) -> None:
    from roundpipe import cli
    from roundpipe.coordinator.spec.data import build_dataset_from_spec
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec, validate_against_model
    from roundpipe.demo import CHAT_DEMO_SPEC_PATH, demo_spec

    spec = demo_spec(spec_path=CHAT_DEMO_SPEC_PATH, output_dir=tmp_path)
    assert spec.model.config["vocab_size"] == len(chat_tokenizer())
    assert spec.data.format == "chat" and spec.data.loss_on == "assistant"
    ds = build_dataset_from_spec(spec)
    validate_against_model(
        spec, model_config_from_spec(spec.model), vocab_size_needed=ds.vocab_size_needed
    )
    assert cli.main(["demo", "--chat", "--spec", str(CHAT_DEMO_SPEC_PATH)]) == 2


def test_export_carries_the_chat_template_file(tmp_path: Path, arena_dir: Path) -> None:
    """Trained with data.chat_template on a tokenizer that has none: the exported
    tokenizer holds that template, so the model chats the way it was trained."""
    from test_trainer import new_trainer
    from transformers import AutoTokenizer

    d = tiny_spec(tmp_path, steps=2, seq_len=128).to_dict()
    template = DEMO / "chat_template.jinja"
    d["data"].update(path=str(DEMO / "demo_chat.jsonl"), chat_template=str(template))
    trainer = new_trainer(JobSpec.from_dict(d), arena_dir)
    try:
        trainer.prepare(1)
        trainer.export(tmp_path / "export")
    finally:
        trainer.close()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    assert tok.chat_template == template.read_text()
