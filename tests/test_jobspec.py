"""Job spec: validation messages, round trips, the shipped demo spec."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml

from roundpipe.coordinator.spec.choices import HF_NO_DECAY
from roundpipe.coordinator.spec.errors import FieldError, JobSpecError
from roundpipe.coordinator.spec.jobspec import (
    JobSpec,
    load_job_spec,
    model_config_from_spec,
    validate_against_model,
)
from roundpipe.coordinator.spec.sections import (
    DataSpec,
    LoraSpec,
    ModelSpec,
    OptimizerSpec,
    TrainSpec,
)
from roundpipe.coordinator.spec.spec_yaml import number_string_hint

DEMO_DIR = Path(__file__).resolve().parents[1] / "roundpipe" / "demo_data"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A local model directory (config.json + tokenizer) and a JSONL data file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "max_position_embeddings": 256, "vocab_size": 512})
    )
    for f in (DEMO_DIR / "tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    return {"model": model, "data": data, "root": tmp_path}


def good(files: dict[str, Path]) -> dict[str, Any]:
    return {
        "model": {"path": str(files["model"])},
        "data": {"path": str(files["data"]), "seq_len": 128},
        "batch": {"microbatch_size": 2, "num_microbatches": 3},
        "train": {"steps": 10, "staleness": 1, "dtype": "float32", "seed": 3},
        "optimizer": {"lr": 1e-3, "warmup_steps": 2, "grad_clip": 1.0},
        "output": {"dir": str(files["root"] / "out"), "checkpoint_every": 5},
    }


def errors_of(exc: pytest.ExceptionInfo[JobSpecError]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in exc.value.errors:
        assert e.path not in out, f"two errors for {e.path}: {exc.value}"
        out[e.path] = e.message
    return out


def spec_errors(d: dict) -> dict[str, str]:
    """``JobSpec.from_dict(d)`` must fail: its error messages by field."""
    with pytest.raises(JobSpecError) as exc:
        JobSpec.from_dict(d)
    return errors_of(exc)


def test_valid_spec_and_derived_values(files: dict[str, Path]) -> None:
    spec = JobSpec.from_dict(good(files))
    assert spec.model.path == str(files["model"])
    assert spec.global_batch_size == 6
    assert spec.data_seed == 3 and spec.init_seed == 3  # default to train.seed
    assert spec.tokenizer_path == str(files["model"])  # a path model's own tokenizer
    assert spec.optimizer.betas == (0.9, 0.999)
    assert spec.lora is None


def test_dict_msgpack_and_yaml_round_trip(files: dict[str, Path], tmp_path: Path) -> None:
    d = good(files)
    d["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec = JobSpec.from_dict(d)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    wire = msgpack.unpackb(msgpack.packb(spec.to_dict()))
    assert JobSpec.from_dict(wire) == spec
    f = tmp_path / "job.yaml"
    f.write_text(spec.to_yaml())
    assert load_job_spec(f) == spec
    assert spec.lora == LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj"))


def test_python_objects_equal_dict_form(files: dict[str, Path]) -> None:
    spec = JobSpec(
        model=ModelSpec(path=files["model"]),  # a Path is accepted and stored as str
        data=DataSpec(path=str(files["data"]), seq_len=64),
        train=TrainSpec(steps=5),
        optimizer=OptimizerSpec(lr=1e-4, betas=[0.9, 0.95]),
    )
    assert spec.optimizer.betas == (0.9, 0.95)
    assert JobSpec.from_dict(spec.to_dict()) == spec


# One bad value per case: (dotted field, bad value, words the message must contain).
BAD_FIELDS: list[tuple[str, Any, str]] = [
    ("model.path", "/nonexistent/model", "does not exist"),
    ("model.tokenizer", "/nonexistent/tok", "does not exist"),
    ("data.path", "/nonexistent/train.jsonl", "does not exist"),
    ("data.format", "parquet", "one of"),
    ("data.seq_len", 1, "integer >= 2"),
    ("data.seq_len", "128", "integer >= 2"),
    ("data.shuffle", "yes", "true or false"),
    ("data.packing", 1, "true or false"),
    ("data.packing", "bfd", "documents, concat, none"),
    ("data.loss_on", "completion", "'assistant', 'all'"),
    ("data.overlong", "cut", "'truncate', 'refuse'"),
    ("data.columns", {"conversation": "messages"}, "a mapping from text, messages"),
    ("data.chat_template", "/nonexistent/t.jinja", "not a file"),
    ("data.split", "", "a split name"),
    ("data.seed", -1, "integer >= 0"),
    ("data.text_field", "", "non-empty"),
    ("data.tokenizer", "/nonexistent/tok", "does not exist"),
    ("batch.microbatch_size", 0, "integer >= 1"),
    ("batch.num_microbatches", 2.5, "integer >= 1"),
    ("train.steps", 0, "integer >= 1"),
    ("train.staleness", 2, "0 (exact) or 1"),
    ("train.dtype", "fp8", "one of"),
    ("train.seed", True, "integer"),
    ("train.plan", "F[0:4] T[4:6] B[0:4/3]", "splits that fit batch.num_microbatches"),
    ("optimizer.lr", 0, "> 0"),
    ("optimizer.lr", "3e-4", "> 0"),
    ("optimizer.betas", [0.9], "two numbers"),
    ("optimizer.betas", [0.9, 1.0], "two numbers"),
    ("optimizer.eps", -1e-8, "> 0"),
    ("optimizer.weight_decay", -0.1, ">= 0"),
    ("optimizer.grad_clip", 0, "null (no clipping) or a number > 0"),
    ("optimizer.schedule", "step", "one of"),
    ("optimizer.warmup_steps", -1, "integer >= 0"),
    ("optimizer.warmup_steps", 11, "more than train.steps"),
    ("optimizer.min_lr_ratio", 1.5, "[0, 1]"),
    ("optimizer.schedule_convention", "torch", "one of 'hf', 'one_based'"),
    ("optimizer.no_decay", "bias", "a list of name patterns"),
    ("optimizer.name", "adam", "one of 'adamw', 'sgd'"),
    ("optimizer.momentum", 0.5, "applies to name: sgd only"),
    ("optimizer.nesterov", True, "needs name: sgd and a momentum > 0"),
    ("optimizer.nesterov", "yes", "true or false"),
    ("optimizer.threads", -1, "integer >= 0"),
    ("output.checkpoint_every", -1, "integer >= 0"),
    ("output.keep_last", None, "integer >= 0"),
    ("lora.r", 0, "integer >= 1"),
    ("lora.alpha", 0, "> 0"),
    ("lora.dropout", 1.0, "[0, 1)"),
    ("lora.target_modules", [], "non-empty list"),
]


@pytest.mark.parametrize(("field", "value", "words"), BAD_FIELDS)
def test_each_bad_field_has_its_own_message(
    files: dict[str, Path], field: str, value: Any, words: str
) -> None:
    d = good(files)
    d.setdefault("lora", {})
    section, name = field.split(".")
    d[section][name] = value
    with pytest.raises(JobSpecError) as exc:
        JobSpec.from_dict(d)
    errs = errors_of(exc)
    assert list(errs) == [field], str(exc.value)
    assert words in errs[field]
    # The message shows what was given, not just what was wrong.
    assert repr(value) in errs[field] or str(value) in errs[field]
    assert field in str(exc.value)


def test_all_problems_reported_at_once(files: dict[str, Path]) -> None:
    d = good(files)
    d["lora"] = {}
    for field, value, _ in BAD_FIELDS:
        if field in ("data.seq_len", "optimizer.lr", "optimizer.betas", "optimizer.warmup_steps"):
            continue  # fields listed twice above; one bad value each here
        if field == "train.plan":
            continue  # checked against batch.num_microbatches, which is bad here
        section, name = field.split(".")
        d[section][name] = value
    d["data"]["path"] = str(files["data"])  # keep the data file, to exercise the rest
    d["data"]["seq_len"] = 1
    d["optimizer"].update(lr=-1, betas=[2, 0], warmup_steps=-1)
    with pytest.raises(JobSpecError) as exc:
        JobSpec.from_dict(d)
    errs = errors_of(exc)
    expected = {f for f, _, _ in BAD_FIELDS} - {"data.path", "train.plan"}
    assert set(errs) == expected, str(exc.value)
    assert f"({len(expected)} problems)" in str(exc.value)


def test_unknown_keys_are_errors_with_suggestions(files: dict[str, Path]) -> None:
    d = good(files)
    d["optimizer"]["learning_rate"] = 1e-3
    d["trian"] = {"steps": 3}
    d["batch"] = "big"
    errs = spec_errors(d)
    assert "did you mean 'lr'" in errs["optimizer.learning_rate"]
    assert "did you mean 'train'" in errs["trian"]
    assert "expected a mapping" in errs["batch"]
    assert len(errs) == 3


def test_model_needs_exactly_one_source(files: dict[str, Path]) -> None:
    d = good(files)
    d["model"] = {"path": str(files["model"]), "architecture": "qwen3"}
    with pytest.raises(JobSpecError, match="got both of path and architecture"):
        JobSpec.from_dict(d)
    del d["model"]
    del d["data"]
    errs = spec_errors(d)
    assert "neither" in errs["model"] and "missing" in errs["data.path"]


def test_the_output_directory_cannot_be_the_model_directory(files: dict[str, Path]) -> None:
    """The export writes the trained model over the output directory's model files: in
    the base model's directory, over the base (a symlink to it as well)."""
    d = good(files)
    d["output"]["dir"] = str(files["model"]) + "/"
    assert "is model.path" in spec_errors(d)["output.dir"]
    (files["root"] / "link").symlink_to(files["model"])
    d["output"]["dir"] = str(files["root"] / "link")
    assert "is model.path" in spec_errors(d)["output.dir"]
    d["output"]["dir"] = str(files["model"] / "finetuned")  # a folder of its own inside: fine
    JobSpec.from_dict(d)


def test_model_directory_checks(files: dict[str, Path]) -> None:
    d = good(files)
    (files["model"] / "config.json").unlink()
    with pytest.raises(JobSpecError, match="has no config.json"):
        JobSpec.from_dict(d)
    d["model"]["path"] = str(files["data"])
    with pytest.raises(JobSpecError, match="is not a directory"):
        JobSpec.from_dict(d)


def test_seq_len_against_path_model_config(files: dict[str, Path]) -> None:
    d = good(files)
    d["data"]["seq_len"] = 512  # config.json says max_position_embeddings 256
    assert "max_position_embeddings (256)" in spec_errors(d)["data.seq_len"]


def test_architecture_models(files: dict[str, Path]) -> None:
    d = good(files)
    d["model"] = {"architecture": "llama", "config": {"hidden_size": 64}, "init_seed": 7}
    d["data"]["tokenizer"] = str(files["model"])
    spec = JobSpec.from_dict(d)
    assert spec.init_seed == 7
    cfg = model_config_from_spec(spec.model)
    assert cfg.hidden_size == 64 and cfg.model_type == "llama"

    d["data"]["seq_len"] = 4096  # LlamaConfig's default max_position_embeddings is 2048
    d["model"]["config"] = {"hiden_size": 64}
    errs = spec_errors(d)
    assert "did you mean 'hidden_size'" in errs["model.config.hiden_size"]
    d["model"]["config"] = {"num_hidden_layers": "four"}
    with pytest.raises(JobSpecError, match="transformers rejected the config"):
        JobSpec.from_dict(d)
    d["model"]["config"] = {}
    with pytest.raises(JobSpecError, match=r"max_position_embeddings \(2048\)"):
        JobSpec.from_dict(d)
    d["model"]["architecture"] = "gpt2"
    with pytest.raises(JobSpecError, match="'llama', 'qwen3', 'qwen3_moe'"):
        JobSpec.from_dict(d)


def test_text_data_needs_a_tokenizer(files: dict[str, Path]) -> None:
    d = good(files)
    d["model"] = {"architecture": "qwen3"}
    assert "needs a tokenizer" in spec_errors(d)["data.tokenizer"]
    # Pre-tokenised data needs none.
    tokens = files["root"] / "ids.jsonl"
    tokens.write_text('{"input_ids": [1, 2, 3]}\n')
    d["data"]["path"] = str(tokens)
    assert JobSpec.from_dict(d).tokenizer_path is None


def test_validate_against_model(files: dict[str, Path]) -> None:
    spec = JobSpec.from_dict(good(files))
    validate_against_model(spec, {"max_position_embeddings": 128, "vocab_size": 512})
    with pytest.raises(JobSpecError) as exc:
        validate_against_model(
            spec, {"max_position_embeddings": 100, "vocab_size": 256}, vocab_size_needed=300
        )
    errs = errors_of(exc)
    assert "at most the model's max_position_embeddings (100)" in errs["data.seq_len"]
    assert "token ids (inputs or labels) up to 299" in errs["data"]


def test_a_bitsandbytes_moe_checkpoint_is_refused_at_submit(files: dict[str, Path]) -> None:
    """bitsandbytes leaves a mixture of experts' fused expert tensors unquantised: the
    job used to be accepted, then fail at start blaming llm_int8_skip_modules."""
    d = good(files)
    d["lora"] = {"r": 4, "alpha": 8}
    spec = JobSpec.from_dict(d)
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    config = {"max_position_embeddings": 128, "vocab_size": 512, "quantization_config": bnb}
    validate_against_model(spec, config)  # a dense model's checkpoint is the base
    with pytest.raises(JobSpecError) as exc:
        validate_against_model(spec, {**config, "num_experts": 4})
    assert "mixture-of-experts" in errors_of(exc)["model.path"]


def test_yaml_file(files: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    shutil.copy(files["data"], tmp_path / "sub" / "d.jsonl")
    text = f"""
model: {{path: {files["model"]}}}
data: {{path: d.jsonl, seq_len: 64}}
optimizer: {{lr: 3e-4, eps: 1E-6}}
"""
    f = tmp_path / "sub" / "job.yaml"
    f.write_text(text)
    spec = load_job_spec(f)
    assert spec.optimizer.lr == 3e-4 and spec.optimizer.eps == 1e-6  # not strings
    assert spec.data.path == str(tmp_path / "sub" / "d.jsonl")  # relative to the file
    assert isinstance(yaml.safe_load("x: 3e-4")["x"], str)  # global loader untouched

    with pytest.raises(JobSpecError, match="cannot read job spec file"):
        load_job_spec(tmp_path / "missing.yaml")
    f.write_text("model: [unclosed\n")
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job_spec(f)
    f.write_text("- a list\n")
    with pytest.raises(JobSpecError, match="expected a mapping"):
        load_job_spec(f)


def test_demo_spec_is_valid() -> None:
    spec = load_job_spec(DEMO_DIR / "demo_job.yaml")
    assert spec.model.architecture == "qwen3"
    assert spec.data.path == str(DEMO_DIR / "demo_corpus.jsonl")
    assert spec.batch.microbatch_size == 4 and spec.batch.num_microbatches == 3
    assert spec.train.staleness == 1 and spec.train.dtype == "float32"
    assert 64 <= spec.data.seq_len <= 128
    cfg = model_config_from_spec(spec.model)
    assert cfg.hidden_size == 128 and cfg.num_hidden_layers == 4
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    tok = json.loads((DEMO_DIR / "tokenizer" / "tokenizer.json").read_text())
    assert cfg.vocab_size == len(tok["model"]["vocab"])
    validate_against_model(spec, cfg, vocab_size_needed=cfg.vocab_size)
    assert JobSpec.from_dict(copy.deepcopy(spec.to_dict())) == spec


REPO = DEMO_DIR.parents[1]
SHIPPED_SPECS = sorted(DEMO_DIR.glob("*.yaml"))


def _yaml_1_1_number_strings(value: Any, where: str = "") -> list[str]:
    """Strings in a plainly loaded YAML value that were meant as numbers (``3e-3``)."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _yaml_1_1_number_strings(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [
            s for i, v in enumerate(value) for s in _yaml_1_1_number_strings(v, f"{where}[{i}]")
        ]
    return [f"{where}: {value!r}"] if number_string_hint(value) is not None else []


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda p: p.name)
def test_shipped_specs_read_the_same_with_any_yaml_loader(path: Path) -> None:
    """A user who loads a shipped spec with yaml.safe_load (YAML 1.1) and submits the dict
    gets the spec load_job_spec reads: no number arrives as a string."""
    assert SHIPPED_SPECS, "the demo specs ship in roundpipe/demo_data"
    plain = yaml.safe_load(path.read_text())
    assert _yaml_1_1_number_strings(plain) == []
    submitted = JobSpec.from_dict(msgpack.unpackb(msgpack.packb(plain)), base_dir=path.parent)
    assert submitted == load_job_spec(path)


def test_yaml_examples_in_the_docs_hold_numbers_every_loader_reads() -> None:
    found = []
    for doc in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        if not doc.is_file():
            continue
        text = doc.read_text()
        for m in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
            line = text.count("\n", 0, m.start()) + 1
            found += [
                f"{doc.name}:{line} {s}"
                for s in _yaml_1_1_number_strings(yaml.safe_load(m.group(1)))
            ]
    assert found == []


def test_a_number_that_yaml_1_1_read_as_a_string_names_the_trap(files: dict[str, Path]) -> None:
    d = good(files)
    d["optimizer"].update(lr="3e-3", eps="1e8", betas=[0.9, "95E-2"])
    d["lora"] = {"alpha": "1.5e1"}
    errs = spec_errors(d)
    assert errs["optimizer.lr"] == (
        "got the string '3e-3'; expected a number > 0: YAML 1.1 loaders such as PyYAML read "
        "3e-3 without a dot as a string; write 3.0e-3 or 0.003"
    )
    assert (
        "read 1e8 without a dot and a sign after the e as a string; write 1.0e+8 or "
        in (errs["optimizer.eps"])
    )
    assert "read 95E-2 without a dot as a string; write 95.0e-2 or 0.95" in errs["optimizer.betas"]
    assert (
        "read 1.5e1 without a sign after the e as a string; write 1.5e+1 or 15.0"
        in (errs["lora.alpha"])
    )
    # The suggested spellings are numbers to PyYAML, and the same numbers.
    for text in ("3.0e-3", "0.003", "1.0e+8", "95.0e-2", "1.5e+1"):
        assert isinstance(yaml.safe_load(f"x: {text}")["x"], float), text
    assert yaml.safe_load("x: 3.0e-3")["x"] == yaml.safe_load("x: 0.003")["x"] == 3e-3
    # Other strings keep the plain message.
    d = good(files)
    d["optimizer"]["lr"] = "fast"
    assert spec_errors(d)["optimizer.lr"] == "got 'fast' (str); expected a number > 0"


def test_optimizer_porting_settings(files: dict[str, Path]) -> None:
    d = good(files)
    spec = JobSpec.from_dict(d)
    assert spec.optimizer.schedule_convention == "hf"  # the Hugging Face Trainer's lrs
    assert spec.optimizer.no_decay == HF_NO_DECAY  # biases and norms: no weight decay
    d["optimizer"].update(no_decay=[], schedule_convention="one_based")
    spec = JobSpec.from_dict(d)
    assert spec.optimizer.no_decay == () and JobSpec.from_dict(spec.to_dict()) == spec
    d["optimizer"]["no_decay"] = ["bias", "norm(", ""]
    assert "a list of name patterns" in spec_errors(d)["optimizer.no_decay"]
    d["optimizer"]["no_decay"] = ["bias", "norm("]
    with pytest.raises(JobSpecError, match=r"'norm\(' is not a valid regular expression"):
        JobSpec.from_dict(d)


def test_hf_trainer_names_get_hints_to_our_fields(files: dict[str, Path]) -> None:
    """TrainingArguments / peft / LLaMA-Factory names, in any section or at the top level,
    point at the field that means the same, with its full path when it lives elsewhere."""
    d = good(files)
    d["lora"] = {"lora_target": "all-linear", "lora_rank": 8}
    d["train"]["gradient_accumulation_steps"] = 4
    d["batch"]["per_device_train_batch_size"] = 2
    d["optimizer"]["warmup_ratio"] = 0.1
    d["learning_rate"] = 1e-4
    d["num_train_epochs"] = 3
    d["bf16"] = True
    errs = spec_errors(d)
    assert "did you mean 'target_modules'?" in errs["lora.lora_target"]
    assert "did you mean 'r'?" in errs["lora.lora_rank"]
    assert "did you mean 'batch.num_microbatches'?" in errs["train.gradient_accumulation_steps"]
    assert "did you mean 'microbatch_size'?" in errs["batch.per_device_train_batch_size"]
    assert "'warmup_steps'? a step count" in errs["optimizer.warmup_ratio"]
    assert "did you mean 'optimizer.lr'?" in errs["learning_rate"]
    assert "optimizer steps, not epochs" in errs["num_train_epochs"]
    assert "'train.dtype'? dtype: bfloat16" in errs["bf16"]
    assert len(errs) == 8


def test_every_name_in_the_hf_mapping_table_gets_its_hint_at_the_top_level(
    files: dict[str, Path],
) -> None:
    """docs/coming-from-hf.md promises a hint for the names of its table, in any section
    or at the top level: five of them (train_on_prompt, dataset_name, neat_packing,
    template, min_lr_rate) and our own names written at the top level got none."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-hf.md").read_text()
    table = doc[doc.index("## Arguments") : doc.index("## What else must match")]
    checked = 0
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first, second = [c.strip() for c in line.strip("|").split("|")][:2]
        targets = re.findall(r"`([a-z_]+\.[a-z_]+)", second)
        if not targets:
            continue  # no counterpart (gradient_checkpointing) or not a field
        for name in re.findall(r"`([a-z_0-9]+)[`:]", first):
            d = good(files)
            d[name] = 1
            message = spec_errors(d)[name]
            assert "did you mean" in message and any(t in message for t in targets), (
                name,
                message,
            )
            checked += 1
    assert checked >= 40


def test_a_long_problem_line_keeps_its_start_and_its_advice() -> None:
    """A problem line is bounded (a key of a megabyte makes no megabyte message); what is
    left out is its middle, so long paths never push out the advice at its end (an
    `--allow-read` hint was once cut off on a machine with long temporary paths)."""
    paths = ", ".join(f"/tmp/{'x' * 60}/{i}" for i in range(30))
    advice = "ask the operator to add its directory with --allow-read DIR"
    message = f"access refused to '/a/b': the coordinator may read only below {paths}; {advice}"
    text = str(JobSpecError([FieldError("data.chat_template", message)]))
    line = text.splitlines()[1]
    assert line.startswith("  - data.chat_template: access refused to '/a/b'"), line
    assert line.endswith(advice), line
    assert len(line) < 900 and "characters left out" in line, line
    short = str(JobSpecError([FieldError("data.path", "no such file '/x'")]))
    assert short.splitlines()[1] == "  - data.path: no such file '/x'"
