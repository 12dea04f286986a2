"""``lora.base_quantization`` in the job spec: accepted values, and what is refused at
submit (the admission check, ``validate_spec``), each with a message that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import TINY_QWEN3, tiny_spec

from roundpipe.coordinator.service.admission import validate_spec
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.shared import quantized_base
from roundpipe.shared.model import LayeredModel


def spec_dict(tmp_path: Path, **lora) -> dict:
    spec = tiny_spec(tmp_path / "out", lora={"r": 4, "alpha": 8, **lora})
    return spec.to_dict()


def test_base_quantization_reaches_the_model(tmp_path):
    job = JobSpec.from_dict(spec_dict(tmp_path, base_quantization="nf4"))
    assert job.lora.base_quantization == "nf4"
    settings = job.lora.model_settings()
    model = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"), settings)
    qb = model.quantized_base
    assert qb is not None and qb.format.kind == "nf4" and qb.format.double_quant
    # Every frozen linear of the decoder layers, and nothing else (norms, embedding, head).
    assert all(name.endswith(".base_layer.weight") or "_proj.weight" in name for name in qb.shapes)
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in qb.shapes)
    assert len(qb.shapes) == 7 * TINY_QWEN3["num_hidden_layers"]
    # What JobSetup carries reads back to the same settings (the worker's model).
    again = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"), model.lora.to_mapping())
    assert again.quantized_base == qb
    job = JobSpec.from_dict(spec_dict(tmp_path, base_quantization="int8", int8_scales="per_block"))
    assert job.lora.model_settings()["int8_scales"] == "per_block"
    assert JobSpec.from_dict(spec_dict(tmp_path)).lora.base_quantization == "none"


@pytest.mark.parametrize(
    "lora, field, words",
    [
        ({"base_quantization": "fp4"}, "lora.base_quantization", "'nf4'"),
        ({"base_quantization": "nf4", "int8_scales": "per_tensor"}, "lora.int8_scales", ""),
        ({"double_quantization": "yes"}, "lora.double_quantization", "true or false"),
    ],
)
def test_bad_values_are_refused(tmp_path, lora, field, words):
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(spec_dict(tmp_path, **lora))
    text = str(info.value)
    assert field in text and words in text


def test_quantisation_outside_lora_points_at_lora(tmp_path):
    # Full fine-tuning has no place for a quantised base: the HF / QLoRA spellings are
    # unknown keys whose hint names lora.base_quantization and says it is LoRA only.
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["model"]["load_in_4bit"] = True
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_dict(spec)
    assert "model.load_in_4bit" in str(info.value)
    assert "lora.base_quantization" in str(info.value) and "LoRA" in str(info.value)


def write_bnb_checkpoint_config(directory: Path) -> None:
    """A model directory whose config says bitsandbytes quantised it (only the config is
    read before the refusal)."""
    from transformers import Qwen3Config

    directory.mkdir()
    config = Qwen3Config(**TINY_QWEN3).to_dict()
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")


def test_full_fine_tuning_of_a_quantised_checkpoint_is_refused_at_submit(tmp_path):
    model_dir = tmp_path / "bnb-model"
    write_bnb_checkpoint_config(model_dir)
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["model"] = {"path": str(model_dir), "tokenizer": spec["model"]["tokenizer"]}
    with pytest.raises(JobSpecError) as info:
        validate_spec(spec)
    text = str(info.value)
    assert "model.path" in text and "bitsandbytes" in text
    assert "full fine-tuning is refused" in text


def test_a_layer_type_the_quantiser_does_not_know_is_refused_at_submit(tmp_path, monkeypatch):
    # No declared family has a frozen matrix outside linear layers, experts, routers and
    # depthwise convolutions; pretend linear layers were unknown to see the refusal.
    monkeypatch.setattr(quantized_base, "QUANTISED_MODULES", ())
    with pytest.raises(JobSpecError) as info:
        validate_spec(spec_dict(tmp_path, base_quantization="nf4"))
    text = str(info.value)
    assert "lora.base_quantization" in text
    assert "q_proj.base_layer.weight" in text and "Linear module" in text
