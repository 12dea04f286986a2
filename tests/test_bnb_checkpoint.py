"""A bitsandbytes-quantised checkpoint as a LoRA job's quantised base (Note [bitsandbytes
checkpoint] in roundpipe.shared.bnb_checkpoint).

The fixtures are built by transformers + bitsandbytes on the CPU (a test-only dependency:
these tests skip without it); the runtime reads the codes without bitsandbytes. Checked:
the weights our reader dequantises are bitsandbytes' own bit for bit, a LoRA job on such
a checkpoint trains like the plain loop over its dequantised base, and the spec refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    TINY_QWEN3,
    assert_params_match,
    oracle_train,
    tiny_spec,
    trained_in_process,
)

from roundpipe.coordinator.service.admission import validate_spec
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.quantized_base import PART_SEP

bnb = pytest.importorskip(
    "bitsandbytes", reason="bitsandbytes (the dev extra) builds the quantised fixtures"
)

KINDS = {
    "nf4-dq": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    },
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "int8": {"load_in_8bit": True},
}
ODD = "nf4-dq-odd"
"""Also: a bf16 model whose matrices end in a partial block (90 x 40 = 56.25 blocks of
64), its codes kept in bf16 storage (``bnb_4bit_quant_storage``)."""
ODD_CONFIG = dict(
    TINY_QWEN3, hidden_size=40, intermediate_size=90, head_dim=20, num_hidden_layers=1
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Qwen3 (fp32) quantised each way by transformers + bitsandbytes."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen3Config

    root = tmp_path_factory.mktemp("bnb")
    torch.manual_seed(7)
    plain = AutoModelForCausalLM.from_config(Qwen3Config(**TINY_QWEN3), dtype=torch.float32)
    plain.save_pretrained(root / "plain")
    out = {}
    for kind, settings in KINDS.items():
        quantised = AutoModelForCausalLM.from_pretrained(
            root / "plain",
            quantization_config=BitsAndBytesConfig(**settings),
            device_map="cpu",
            dtype=torch.float32,
        )
        quantised.save_pretrained(root / kind)
        out[kind] = root / kind
    torch.manual_seed(8)
    odd = AutoModelForCausalLM.from_config(Qwen3Config(**ODD_CONFIG), dtype=torch.bfloat16)
    odd.save_pretrained(root / "odd-plain")
    settings = dict(KINDS["nf4-dq"], bnb_4bit_quant_storage=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(
        root / "odd-plain",
        quantization_config=BitsAndBytesConfig(**settings),
        device_map="cpu",
        dtype=torch.bfloat16,
    ).save_pretrained(root / ODD)
    out[ODD] = root / ODD
    return out


def bnb_dequantised(directory: Path, key: str, dtype: torch.dtype) -> torch.Tensor:
    """Weight ``key`` as bitsandbytes itself dequantises it."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file

    sd = load_file(directory / "model.safetensors")
    module = key.rsplit(".", 1)[0]
    if f"{module}.SCB" in sd:
        return F.int8_vectorwise_dequant(sd[key], sd[f"{module}.SCB"]).to(dtype)
    state = {k[len(key) + 1 :]: v for k, v in sd.items() if k.startswith(key + ".")}
    qs = F.QuantState.from_dict(state, device=torch.device("cpu"))
    qs.dtype = dtype
    if qs.shape[-1] % qs.blocksize == 0:
        return F.dequantize_4bit(sd[key], qs)
    # Rows that end inside a block: bitsandbytes 0.50's CPU kernel cuts blocks per row
    # there, unlike its quantiser and its reference torch path (the CUDA kernels' layout),
    # which cut the flattened tensor (its weights are ~5x further from the original here).
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if qs.nested else qs.absmax
    codes = sd[key].view(torch.uint8).reshape(-1)
    return _dequantize_4bit_compute(codes, absmax, qs.code, qs.blocksize, qs.shape, dtype)


def quantised_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    return {k.split(".quant_state.")[0] for k in keys if ".quant_state." in k} | {
        k[: -len(".SCB")] + ".weight" for k in keys if k.endswith(".SCB")
    }


@pytest.mark.parametrize("kind", [*KINDS, ODD])
def test_the_codes_dequantise_to_bitsandbytes_weights_bitwise(checkpoints, kind):
    model = LayeredModel.from_hf_dir(checkpoints[kind], {"r": 4, "alpha": 8})
    qb = model.quantized_base
    assert qb is not None and qb.format.bnb and qb.format.kind == kind.split("-")[0]
    assert qb.format.double_quant == ("-dq" in kind) or kind == "int8"
    weights = model.load_weights(seed=0)
    flat = {n: t for per_layer in weights.values() for n, t in per_layer.items()}
    # Stored as parts, not dequantised at load.
    assert not any(n in flat for n in qb.shapes)
    keys = {n.removeprefix("base_model.model.").replace(".base_layer.", ".") for n in qb.shapes}
    assert keys == quantised_keys(checkpoints[kind])  # every quantised tensor, and only they
    for name in qb.shapes:
        parts = qb.get_parts(flat, name)
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        for dtype in (torch.float32, torch.bfloat16):
            ours = qb.dequantize(parts, name, dtype)
            assert torch.equal(ours, bnb_dequantised(checkpoints[kind], key, dtype)), (key, dtype)


@pytest.mark.parametrize("kind, staleness", [("nf4-dq", 1), ("int8", 0)])
def test_lora_on_the_checkpoint_matches_the_loop_over_its_dequantised_base(
    tmp_path, arena_dir, checkpoints, kind, staleness
):
    spec = tiny_spec(tmp_path, steps=4, staleness=staleness, lora={"r": 4, "alpha": 8})
    as_dict = spec.to_dict()
    as_dict["model"] = {"path": str(checkpoints[kind]), "tokenizer": as_dict["model"]["tokenizer"]}
    spec = validate_spec(as_dict)
    with trained_in_process(spec, arena_dir, 2, job_id=f"job-{kind}") as trainer:
        runtime = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
        layout = trainer.layout
        # The base sits in the params arena as the checkpoint's codes.
        assert any(n.endswith(PART_SEP + "codes") for per in layout.params.values() for n in per)
        trainer.export(tmp_path / "export")  # the adapter, in peft's format
    assert (tmp_path / "export" / "adapter_model.safetensors").is_file()
    oracle = oracle_train(spec, dequantized_base=True)
    lora_only = {n: t for n, t in runtime.items() if ".lora_" in n}
    assert lora_only
    assert_params_match(lora_only, oracle, rtol=1e-4)
    frozen = {n: t for n, t in runtime.items() if ".base_layer." in n}
    assert frozen and all(torch.equal(t, oracle[n]) for n, t in frozen.items())


def path_spec(tmp_path: Path, directory: Path, lora: dict | None) -> dict:
    spec = tiny_spec(tmp_path / "out", lora=lora).to_dict()
    spec["model"] = {"path": str(directory), "tokenizer": spec["model"]["tokenizer"]}
    return spec


def refusal(spec: dict) -> str:
    with pytest.raises(JobSpecError) as info:
        validate_spec(spec)
    return str(info.value)


def test_the_spec_accepts_lora_and_refuses_the_rest(tmp_path, checkpoints):
    nf4 = checkpoints["nf4-dq"]
    job = validate_spec(path_spec(tmp_path, nf4, {"r": 4, "alpha": 8}))
    assert isinstance(job, JobSpec)
    # The checkpoint's own quantisation, named explicitly, is accepted too.
    validate_spec(path_spec(tmp_path, nf4, {"r": 4, "alpha": 8, "base_quantization": "nf4"}))
    text = refusal(path_spec(tmp_path, nf4, None))
    assert "model.path" in text and "full fine-tuning is refused" in text
    text = refusal(path_spec(tmp_path, nf4, {"r": 4, "alpha": 8, "base_quantization": "int8"}))
    assert "lora.base_quantization" in text and "conflicts" in text and "nf4" in text
    lora = {"r": 4, "alpha": 8, "base_quantization": "nf4", "double_quantization": False}
    text = refusal(path_spec(tmp_path, nf4, lora))
    assert "lora.base_quantization" in text and "double_quantization: True" in text
    text = refusal(
        path_spec(tmp_path, checkpoints["int8"], {"r": 4, "alpha": 8, "base_quantization": "nf4"})
    )
    assert "lora.base_quantization" in text and "int8" in text
    # fp4 has no parts here: refused, naming it.
    fp4 = tmp_path / "fp4"
    fp4.mkdir()
    config = json.loads((nf4 / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (fp4 / "config.json").write_text(json.dumps(config))
    (fp4 / "model.safetensors").write_bytes(b"")
    text = refusal(path_spec(tmp_path, fp4, {"r": 4, "alpha": 8}))
    assert "model.path" in text and "fp4" in text


def test_a_resume_is_checked_against_the_base_the_adapters_trained_on(
    tmp_path, arena_dir, checkpoints
):
    """The adapters of a job on a bitsandbytes checkpoint (its quantisation unnamed: the
    checkpoint decides) continue on that checkpoint however the spec spells it, and on
    no other base. The specs' spellings were compared: naming the checkpoint's own nf4
    was refused ("the adapters have 'none'"), and the unquantised model it came from
    was accepted and trained another model."""
    import shutil

    from roundpipe.coordinator.spec.checkpoint_format import MANIFEST_DIGEST, sealed
    from roundpipe.coordinator.training.job_errors import JobFailed
    from roundpipe.coordinator.training.trainer import Trainer

    plain = checkpoints["nf4-dq"].parent / "plain"
    nf4 = shutil.copytree(checkpoints["nf4-dq"], tmp_path / "nf4")  # moved at the end
    lora = {"r": 4, "alpha": 8}
    first = path_spec(tmp_path / "first", nf4, lora)
    first["train"]["steps"], first["optimizer"]["warmup_steps"] = 1, 0
    spec = validate_spec(first)
    with trained_in_process(spec, arena_dir, 1, job_id="job-first"):
        pass
    manifest = next((tmp_path / "first" / "out" / "checkpoints").glob("step-*/checkpoint.json"))
    assert json.loads(manifest.read_text())["model"]["base"] == {
        "quantization": "nf4",
        "layout": "bitsandbytes",
        "double_quantization": True,
    }

    def resumed(directory: Path, **settings) -> dict:
        d = path_spec(tmp_path / "second", directory, dict(lora, **settings))
        d["model"]["resume_from"] = str(tmp_path / "first" / "out")
        d["train"]["steps"], d["optimizer"]["warmup_steps"] = 2, 0
        return d

    validate_spec(resumed(nf4))
    validate_spec(resumed(nf4, base_quantization="nf4"))
    for settings in ({}, {"base_quantization": "nf4"}):
        text = refusal(resumed(plain, **settings))
        assert "lora.base_quantization" in text and "bitsandbytes checkpoint's own codes" in text
    # The job's own checkpoint, resumed after its model.path changed under it (here: the
    # unquantised model), is refused by the trainer, naming both bases.
    again = path_spec(tmp_path / "first", plain, lora)
    again["train"]["steps"], again["optimizer"]["warmup_steps"] = 2, 0
    trainer = Trainer(
        "job-first",
        validate_spec(again),
        arena_dir=arena_dir,
        namespace="job-again",
        output_dir=tmp_path / "first" / "out",
    )
    try:
        with pytest.raises(JobFailed, match="trained on a bitsandbytes checkpoint's own codes"):
            trainer.prepare(1)
    finally:
        trainer.close()
    # A checkpoint written before manifests recorded the base, whose model has moved
    # since: what it was quantised as is unknown, so the resume is not refused for it.
    doc = json.loads(manifest.read_text())
    del doc["model"]["base"]
    manifest.write_text(json.dumps(sealed({k: v for k, v in doc.items() if k != MANIFEST_DIGEST})))
    moved = nf4.rename(tmp_path / "nf4-moved")
    validate_spec(resumed(moved))
    validate_spec(resumed(moved, base_quantization="nf4"))
