"""LayeredModel: layer listing, names, tied weights, LoRA, init and loading, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import LORA_SPEC, tiny_config  # noqa: E402

from roundpipe.shared.model import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    LayeredModel,
    LoraSettings,
    ParamSpec,
    count_label_tokens,
    shift_labels,
)

torch.set_num_threads(1)


def test_layers_and_names() -> None:
    model = LayeredModel.from_config(tiny_config("qwen3"))
    assert model.architecture == "Qwen3ForCausalLM"
    assert model.num_layers == 6 and model.num_decoder_layers == 4
    assert [s.name for s in model.layer_params(0)] == ["model.embed_tokens.weight"]
    names3 = [s.name for s in model.layer_params(3)]
    assert all(n.startswith("model.layers.2.") for n in names3)  # HF layer i = our i + 1
    assert "model.layers.2.self_attn.q_proj.weight" in names3
    q = next(s for s in model.layer_params(3) if s.name.endswith("q_proj.weight"))
    assert q.shape == (4 * 16, 32) and q.numel == 64 * 32  # head_dim 16 != 32 / 4
    tail = [s.name for s in model.layer_params(5)]
    assert tail == ["model.norm.weight", "lm_head.weight"]
    assert model.tied_params == {}
    assert all(s.trainable and s.tied_to is None for s in model.param_specs())
    assert model.layer_of("lm_head.weight") == 5
    assert len(model.trainable_names) == len(model.param_specs())
    with pytest.raises(IndexError):
        model.layer_params(6)
    with pytest.raises(KeyError, match="not a parameter"):
        model.layer_of("nope")


def test_tied_embeddings_are_flagged() -> None:
    model = LayeredModel.from_config(tiny_config("llama"))
    head = model.layer_params(model.num_layers - 1)[-1]
    assert head == ParamSpec("lm_head.weight", (256, 32), True, "model.embed_tokens.weight")
    assert model.tied_params == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in model.trainable_names
    weights = model.init_weights(0)
    assert "lm_head.weight" not in weights[model.num_layers - 1]
    rw = model.range_weights(weights, 5, 6)
    assert rw["lm_head.weight"] is weights[0]["model.embed_tokens.weight"]
    assert model.checkpoint_name("lm_head.weight") is None
    assert model.checkpoint_name("model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_init_weights_equal_seeded_transformers(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    model = LayeredModel.from_config(cfg)
    state = torch.random.get_rng_state()
    weights = model.init_weights(seed=123)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    torch.manual_seed(123)
    hf = AutoModelForCausalLM.from_config(cfg)
    ref = dict(hf.named_parameters())
    flat = {n: t for per in weights.values() for n, t in per.items()}
    assert set(flat) == set(ref)
    for n, t in flat.items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[n]), n
    # Every spec but the tied ones has a tensor, in the listed layer.
    for layer in range(model.num_layers):
        want = [s.name for s in model.layer_params(layer) if s.tied_to is None]
        assert list(weights[layer]) == want
    bf = model.init_weights(seed=123, dtype=torch.bfloat16)
    assert bf[1][next(iter(bf[1]))].dtype == torch.bfloat16


def test_lora_names_and_trainable_flags() -> None:
    model = LayeredModel.from_config(tiny_config("llama"), LORA_SPEC)
    assert model.lora == LoraSettings(
        r=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "down_proj")
    )
    specs = model.param_specs()
    trainable = [s.name for s in specs if s.trainable]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 4 * 4 * 2
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert model.layer_of(base) == 1 and model.layer_of(a) == 1
    assert next(s for s in specs if s.name == a).shape == (4, 32)
    assert model.tied_params == {
        "base_model.model.lm_head.weight": "base_model.model.model.embed_tokens.weight"
    }
    # Export names: HF names for the base model, peft's adapter-file keys for adapters.
    assert model.checkpoint_name(base) == "model.layers.0.self_attn.q_proj.weight"
    assert (
        model.checkpoint_name(a) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert model.checkpoint_name("base_model.model.model.norm.weight") == "model.norm.weight"
    # The same names as peft's own wrapped model.
    hf = model.to_hf_model(model.init_weights(0))
    assert {n for n, p in hf.named_parameters() if p.requires_grad} == set(trainable)
    from peft import get_peft_model_state_dict

    keys = set(get_peft_model_state_dict(hf))
    assert keys == {model.checkpoint_name(n) for n in trainable}


def test_lora_settings_validation() -> None:
    s = LoraSettings.from_mapping(
        {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": "q_proj"}
    )
    assert s.target_modules == ("q_proj",) and s.dropout == 0.1
    # What JobSetup carries to the workers reads back as the same settings.
    assert s.to_mapping() == {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj"]}
    assert LoraSettings.from_mapping(s.to_mapping()) == s
    for bad, msg in [
        ({"r": 0, "alpha": 1}, "positive integer"),
        ({"r": 4}, "need 'alpha'"),
        ({"r": 4, "alpha": 8, "dropout": 1.0}, "dropout"),
        ({"r": 4, "alpha": 8, "rank": 3}, "unknown LoRA setting 'rank'"),
        ({"r": 4, "alpha": 8, "target_modules": []}, "target_modules"),
    ]:
        with pytest.raises(ValueError, match=msg):
            LoraSettings.from_mapping(bad)
    with pytest.raises(ValueError, match="inside decoder layers only"):
        LayeredModel.from_config(
            tiny_config("qwen3"), {"r": 2, "alpha": 2, "target_modules": ["lm_head"]}
        )


def _save(model: LayeredModel, weights: dict, path: Path, **kw: object) -> None:
    model.to_hf_model(weights).save_pretrained(str(path), **kw)


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("llama", {}),
        ("qwen3", {"max_shard_size": "40KB"}),  # sharded, with an index file
        ("qwen3_moe", {}),  # per-expert tensors (HF's default save format)
        ("qwen3_moe", {"save_original_format": False}),  # fused 3-D expert tensors
    ],
)
def test_load_weights_from_hf_dir(arch: str, kw: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = LayeredModel.from_config(tiny_config(arch))
    weights = src.init_weights(seed=9)
    _save(src, weights, tmp_path, **kw)
    model = LayeredModel.from_hf_dir(tmp_path)
    assert model.source_dir == tmp_path and model.architecture == src.architecture
    loaded = model.load_weights()
    assert loaded.keys() == weights.keys()
    for layer, per in weights.items():
        assert list(loaded[layer]) == list(per)
        for n, t in per.items():
            assert torch.equal(loaded[layer][n], t), n
    # transformers reads the same directory to the same tensors.
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ref = dict(hf.named_parameters())
    flat = model.flat_weights(loaded)
    assert all(torch.equal(flat[n], ref[n]) for n in ref)


def test_load_weights_with_lora(tmp_path: Path) -> None:
    src = LayeredModel.from_config(tiny_config("llama"))
    _save(src, src.init_weights(seed=1), tmp_path)
    model = LayeredModel.from_hf_dir(tmp_path, LORA_SPEC)
    a = model.load_weights(seed=3, dtype=torch.bfloat16)
    b = model.load_weights(seed=3)
    base = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    assert torch.equal(
        b[2][base], src.init_weights(seed=1)[2]["model.layers.1.mlp.down_proj.weight"]
    )
    assert a[2][base].dtype == torch.bfloat16
    for per in b.values():
        for n, t in per.items():
            if ".lora_B." in n:
                assert not t.any()
            elif ".lora_A." in n:
                assert t.any() and t.abs().max() <= 1 / 32**0.5
    other = model.load_weights(seed=4)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert not torch.equal(other[1][name], b[1][name])


@pytest.mark.parametrize("lora", [None, LORA_SPEC])
def test_the_hf_model_for_saving_leaves_torch_default_dtype_alone(
    monkeypatch: pytest.MonkeyPatch, lora
) -> None:
    """Building the transformers model a checkpoint saves (a background thread) set
    torch's process-wide default dtype to the config's (bfloat16) for the while: the
    training threads' float tensors made meanwhile were bfloat16. The saved config still
    names the config's dtype."""
    config = tiny_config("qwen3")
    config.dtype = torch.bfloat16
    model = LayeredModel.from_config(config, lora)
    weights = model.init_weights(seed=1)
    defaults = []
    real = torch.set_default_dtype

    def record(dtype: torch.dtype) -> None:
        defaults.append(dtype)
        real(dtype)

    monkeypatch.setattr(torch, "set_default_dtype", record)
    hf = model.hf_model_of(weights)
    assert set(defaults) <= {torch.float32}, defaults
    assert torch.get_default_dtype() == torch.float32
    base = hf if lora is None else hf.base_model.model
    assert base.config.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LayeredModel.from_hf_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LayeredModel.from_hf_dir(tmp_path)
    cfg = tiny_config("qwen3")
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LayeredModel.from_hf_dir(tmp_path)
    # A checkpoint that lacks a tensor, or has the wrong shape for the config.
    from safetensors.torch import save_file

    model = LayeredModel.from_config(cfg)
    flat = model.flat_weights(model.init_weights(0))
    partial = {n: t for n, t in flat.items() if "layers.3." not in n}
    save_file(partial, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks \d+ weight\(s\).*layers\.3\."):
        LayeredModel.from_hf_dir(tmp_path).load_weights()
    flat["model.norm.weight"] = torch.ones(7)
    save_file(flat, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(7,\)"):
        LayeredModel.from_hf_dir(tmp_path).load_weights()
    with pytest.raises(ValueError, match="needs hf_dir"):
        model.load_weights()


def test_unsupported_and_unbuildable_configs(tmp_path: Path) -> None:
    from transformers import GPT2Config, LlamaConfig, PhiConfig

    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MistralForCausalLM",
        "Gemma3ForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "GptOssForCausalLM",
    )
    for cfg in (PhiConfig(), GPT2Config()):
        with pytest.raises(ValueError, match="supported architectures are LlamaForCausalLM"):
            LayeredModel.from_config(cfg)
    seq = LlamaConfig(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="only causal LMs"):
        LayeredModel.from_config(seq)
    bad = tiny_config("llama", hidden_act="no-such-activation")
    with pytest.raises(ValueError, match="transformers cannot build LlamaForCausalLM"):
        LayeredModel.from_config(bad)
    with pytest.raises(ValueError, match="output_router_logits"):
        LayeredModel.from_config(tiny_config("llama", output_router_logits=True))
    with pytest.raises(ValueError, match="needs 'model_type'"):
        LayeredModel.from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="cannot build a config"):
        LayeredModel.from_config({"model_type": "no-such-model"})
    cfg_dict = tiny_config("qwen3").to_dict()
    model = LayeredModel.from_config(cfg_dict)
    assert model.architecture == "Qwen3ForCausalLM" and model.num_layers == 6
    # A directory whose config names another architecture.
    (tmp_path / "config.json").write_text(json.dumps(GPT2Config().to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        LayeredModel.from_hf_dir(tmp_path)


def test_label_helpers() -> None:
    labels = torch.tensor([[5, 6, -100, 7], [-100, 1, 2, -100]])
    assert shift_labels(labels).tolist() == [[6, -100, 7, -100], [1, 2, -100, -100]]
    assert count_label_tokens(labels) == 4
