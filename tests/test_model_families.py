"""Declared model families (roundpipe.shared.families) beyond the gradient oracle.

tests/test_model_oracle.py proves every family's staged loss and gradients equal the
whole transformers model. Here: each family's layer types, masks, rotary and buffers are
the ones its own forward uses; what is not supported is refused with a message naming
it; exports reload with ``from_pretrained`` with no missing or unexpected keys; and jobs
of the new families train through the trainer to the single-process oracle's weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import (  # noqa: E402
    NEW_ARCHS,
    VOCAB,
    batch,
    new_family_overrides,
    tiny_config,
)

from roundpipe.shared.families import FAMILIES  # noqa: E402
from roundpipe.shared.model import LayeredModel  # noqa: E402
from roundpipe.worker.executor import StageExecutor  # noqa: E402

torch.set_num_threads(1)


def _types(model: LayeredModel) -> list[str]:
    return [model.layer_type(layer) for layer in range(1, model.num_layers - 1)]


def test_layer_types_masks_and_rotary_follow_each_family() -> None:
    mistral = LayeredModel.from_config(tiny_config("mistral"))
    assert {mistral.mask_kind(layer) for layer in range(1, 5)} == {"sliding"}
    no_window = LayeredModel.from_config(tiny_config("mistral", sliding_window=None))
    assert {no_window.mask_kind(layer) for layer in range(1, 5)} == {"full"}

    gemma = LayeredModel.from_config(tiny_config("gemma3_text"))
    assert _types(gemma) == ["sliding_attention", "full_attention"] * 2
    assert gemma.rotary_keyed_by_layer_type
    # The embedding scale is a buffer the meta skeleton cannot hold: the family declares it.
    assert gemma.part_buffers(0, "cpu") == {"embed_scale": torch.tensor(32**0.5)}
    assert gemma.part_buffers(1, "cpu") == {}
    assert gemma.tied_params == {"lm_head.weight": "model.embed_tokens.weight"}

    qwen35 = LayeredModel.from_config(tiny_config("qwen3_5_moe_text"))
    assert [qwen35.mask_kind(layer) for layer in range(1, 5)] == ["recurrent", "full"] * 2

    oss = LayeredModel.from_config(tiny_config("gpt_oss"))
    assert [oss.mask_kind(layer) for layer in range(1, 5)] == ["sliding", "full"] * 2
    # Sinks have no SDPA path in transformers: the family picks eager attention.
    assert oss.attn_implementation == "eager"
    assert oss.skeleton.config._experts_implementation == "grouped_mm"
    names = {s.name for s in oss.layer_params(1)}
    assert {
        "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
    } <= names


def test_rotary_per_layer_type_matters_for_gemma3() -> None:
    """Gemma 3's local and global layers use different RoPE bases: a layer run with the
    other type's table gives another output (the executor must key the table by type)."""
    model = LayeredModel.from_config(tiny_config("gemma3_text"))
    weights = model.init_weights(seed=1)
    ex = StageExecutor(model)
    ids, _ = batch(seed=1, rows=2)
    h = ex.forward(0, 1, model.range_weights(weights, 0, 1), [ids]).outputs[0]
    rot = model.make_rotary("cpu")
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    local = rot(h, pos, "sliding_attention")
    glob = rot(h, pos, "full_attention")
    assert not torch.allclose(local[0], glob[0])


def test_unsupported_settings_are_refused_by_name() -> None:
    from transformers import AutoConfig, PhiConfig

    with pytest.raises(ValueError, match="MXFP4-packed.*bf16 checkpoint"):
        LayeredModel.from_config(
            tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"})
        )
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        LayeredModel.from_config(tiny_config("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        LayeredModel.from_config(tiny_config("gemma3_text", final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="model_type 'qwen3_5_text'"):
        LayeredModel.from_config(AutoConfig.for_model("qwen3_5"))
    with pytest.raises(ValueError, match="model_type 'gemma3_text'"):
        LayeredModel.from_config(AutoConfig.for_model("gemma3"))
    with pytest.raises(ValueError, match="declared Family.*register_family"):
        LayeredModel.from_config(PhiConfig())
    # A router loss needs a declared router: refused for a family without one.
    with pytest.raises(ValueError, match="output_router_logits.*MistralForCausalLM"):
        LayeredModel.from_config(tiny_config("mistral", output_router_logits=True))


def test_packed_documents_are_refused_on_linear_attention() -> None:
    """A Gated DeltaNet layer's state runs along the whole row: packed documents would
    leak into each other, so the executor refuses them; plain positions are fine."""
    model = LayeredModel.from_config(tiny_config("qwen3_5_text"))
    weights = model.init_weights(seed=1)
    ex = StageExecutor(model)
    ids, _ = batch(seed=2, rows=2)
    w = model.range_weights(weights, 0, 2)
    plain = torch.arange(ids.shape[1]).repeat(2, 1)
    ex.forward(0, 2, w, [ids], position_ids=[plain])
    packed = torch.cat([torch.arange(5), torch.arange(ids.shape[1] - 5)]).repeat(2, 1)
    with pytest.raises(ValueError, match="linear-attention.*packing"):
        ex.forward(0, 2, w, [ids], position_ids=[packed])


def test_job_spec_refuses_documents_packing_for_linear_attention(tmp_path: Path) -> None:
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.spec.errors import JobSpecError

    kw = dict(architecture="qwen3_5_text", config=_spec_config("qwen3_5_text"))
    with pytest.raises(JobSpecError, match="data.packing.*linear-attention"):
        tiny_spec(tmp_path, **kw)
    for packing in ("none", "concat"):
        tiny_spec(tmp_path, packing=packing, **kw)
    # A value of the wrong type is one clear problem, not a TypeError from the model checks.
    with pytest.raises(JobSpecError, match=r"data.packing: .*\['documents'\]"):
        tiny_spec(tmp_path, packing=["documents"], **kw)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_export_reloads_with_from_pretrained(arch: str, tmp_path: Path) -> None:
    """The export path (``to_hf_model`` + ``save_pretrained``) writes what transformers
    loads with no missing, unexpected or mismatched keys, and what we load back."""
    from transformers import AutoModelForCausalLM

    model = LayeredModel.from_config(tiny_config(arch))
    weights = model.init_weights(seed=4)
    model.to_hf_model(weights).save_pretrained(str(tmp_path))
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    flat = model.flat_weights(weights)
    assert all(torch.equal(p, flat[n]) for n, p in hf.named_parameters())
    again = LayeredModel.from_hf_dir(tmp_path)
    assert again.architecture == model.architecture
    loaded = again.load_weights()
    assert all(torch.equal(loaded[k][n], t) for k, per in weights.items() for n, t in per.items())


def test_mxfp4_packed_experts_in_a_checkpoint_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = LayeredModel.from_config(tiny_config("gpt_oss"))
    flat = model.flat_weights(model.init_weights(seed=1))
    packed = {}
    for name, t in flat.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            # The hub layout: uint8 blocks of 16 bytes (32 fp4 values) and their scales.
            packed[name + "_blocks"] = torch.zeros(4, 32, 4, 16, dtype=torch.uint8)
            packed[name + "_scales"] = torch.zeros(4, 32, 4, dtype=torch.uint8)
        else:
            packed[name] = t.contiguous()
    save_file(packed, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="gate_up_proj is stored MXFP4-packed"):
        LayeredModel.from_hf_dir(tmp_path).load_weights()


def _spec_config(arch: str) -> dict:
    """TINY_QWEN3's sizes with the family's tiny settings, as a job spec's model.config
    (only the fields the family's config class has)."""
    import dataclasses

    from runtime_helpers import TINY_QWEN3
    from transformers import CONFIG_MAPPING

    fields = {f.name for f in dataclasses.fields(CONFIG_MAPPING[arch])}
    merged = TINY_QWEN3 | new_family_overrides(arch) | {"head_dim": 16}
    return {k: v for k, v in merged.items() if k in fields}


@pytest.mark.parametrize(
    ("arch", "lora"),
    [(a, False) for a in NEW_ARCHS] + [("gpt_oss", True), ("qwen3_5_moe_text", True)],
)
def test_jobs_of_new_families_match_the_oracle_and_export(
    tmp_path: Path, arena_dir: Path, arch: str, lora: bool
) -> None:
    """A job through the trainer (two in-process workers, staleness 1) ends with the
    weights of the single-process transformers / peft loop, and its export loads back."""
    from runtime_helpers import assert_params_match, oracle_train, tiny_spec, trained_in_process
    from transformers import AutoModelForCausalLM

    spec = tiny_spec(
        tmp_path,
        steps=2,
        staleness=1,
        architecture=arch,
        config=_spec_config(arch),
        lora={"r": 4} if lora else None,
        packing="none" if arch in ("qwen3_5_text", "qwen3_5_moe_text", "gpt_oss") else None,
    )
    with trained_in_process(spec, arena_dir, 2) as trainer:
        runtime = {n: t for per in trainer.final_weights().values() for n, t in per.items()}
        trainer.export(tmp_path / "export")
    oracle = oracle_train(spec)
    if lora:
        from peft import AutoPeftModelForCausalLM

        runtime = {n: t for n, t in runtime.items() if ".lora_" in n}
        assert runtime
        loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "export"))
        exported = {n: p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
        assert exported.keys() == runtime.keys()
    else:
        loaded, info = AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "export"), output_loading_info=True
        )
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys")), info
        exported = {n: p.detach() for n, p in loaded.named_parameters()}
    assert_params_match(runtime, oracle, rtol=3e-5 if lora else 1e-5)
    assert_params_match(exported, runtime, rtol=0)


def test_every_family_has_a_tiny_config() -> None:
    """Each declared family is in the oracle tests' list (a new family comes with them)."""
    from model_helpers import ALL_ARCHS

    assert set(FAMILIES) == set(ALL_ARCHS)
    assert VOCAB == 256


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text", "gpt_oss"])
def test_packed_documents_equal_documents_alone(arch: str) -> None:
    """Note [packed documents] for the sliding-window families: a row holding two
    documents (positions restarting at the second) gives each document's loss and
    gradients as if it were alone. (transformers' own GptOssModel does not pass position
    ids to its mask functions, so whole-model GPT-OSS lets packed documents see each
    other; the layered run keeps them apart like every other family.)"""
    from model_helpers import assert_grads_close

    from roundpipe.shared.model import count_label_tokens

    model = LayeredModel.from_config(tiny_config(arch))
    weights = model.range_weights(model.init_weights(seed=3), 0, model.num_layers)
    ex = StageExecutor(model)
    ids, labels = batch(seed=5, rows=1, seq=12)
    labels[:, :] = ids
    labels[:, 8] = -100  # the first document's last token predicts nothing across the cut
    n = count_label_tokens(labels)
    packed_pos = torch.cat([torch.arange(8), torch.arange(4)]).unsqueeze(0)
    packed = ex.tail(0, model.num_layers, weights, [ids], [labels], n, position_ids=[packed_pos])
    alone = ex.tail(
        0,
        model.num_layers,
        weights,
        [ids[:, :8], ids[:, 8:]],
        [labels[:, :8], labels[:, 8:]],
        n,
        position_ids=[packed_pos[:, :8], packed_pos[:, 8:]],
    )
    assert abs(packed.loss_sum - alone.loss_sum) <= 1e-5 * abs(alone.loss_sum)
    assert_grads_close(packed.weight_grads, alone.weight_grads, 1e-5, arch)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_aux_loss_job_matches_the_oracle(tmp_path: Path, arena_dir: Path, arch: str) -> None:
    """output_router_logits through the trainer: forward stages hand their router
    statistics to the tail and the tail its counts to the backward stages through the io
    arena; the weights equal the transformers loop with the load-balancing loss."""
    from runtime_helpers import (
        TINY_QWEN3,
        assert_params_match,
        oracle_train,
        tiny_spec,
        trained_in_process,
    )

    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    if arch == "qwen3_moe":
        base = {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}
        config = base | {"moe_intermediate_size": 32, "num_experts": 4} | aux
        config |= {"num_experts_per_tok": 2}
    else:
        config = _spec_config(arch) | aux
    spec = tiny_spec(
        tmp_path,
        steps=2,
        staleness=1,
        architecture=arch,
        config=config,
        plan="F[0:1,1:3] T[3:6] B[2:3,0:2]",
        packing="none",
    )
    with trained_in_process(spec, arena_dir, 2) as trainer:
        assert trainer.model.router_aux is not None
        runtime = {n: t for per in trainer.final_weights().values() for n, t in per.items()}
    oracle = oracle_train(spec)
    assert_params_match(runtime, oracle, rtol=1e-5)
    # The aux loss moved the weights: without it the oracle differs.
    plain = oracle_train(
        tiny_spec(
            tmp_path,
            steps=2,
            staleness=1,
            architecture=arch,
            config={k: v for k, v in config.items() if k != "output_router_logits"},
            plan="F[0:1,1:3] T[3:6] B[2:3,0:2]",
            packing="none",
        )
    )
    router = next(n for n in oracle if n.endswith((".mlp.gate.weight", ".mlp.router.weight")))
    assert not torch.allclose(plain[router], oracle[router], rtol=1e-4, atol=0)


_FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4_checkpoint(path: Path, **overrides: object) -> dict[str, torch.Tensor]:
    """A tiny GPT-OSS directory in the hub's MXFP4 layout (``*_blocks`` / ``*_scales``,
    ``quantization_config``); returns the expert tensors it encodes, decoded here by the
    format's definition: two e2m1 codes per byte, low nibble first, each group of 32
    values times 2^(scale - 127), stored [experts, out, in / 32, 16]."""
    from safetensors.torch import save_file

    config = tiny_config("gpt_oss", intermediate_size=32, **overrides)
    model = LayeredModel.from_config(config)
    flat = model.flat_weights(model.init_weights(seed=1))
    g = torch.Generator().manual_seed(7)
    tensors, expected = {}, {}
    for name, t in flat.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t.contiguous()
            continue
        experts, n_in, n_out = t.shape
        blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=g)
        scales = torch.randint(120, 130, (experts, n_out, n_in // 32), generator=g)
        lut = torch.tensor(_FP4)
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(experts, n_out, -1, 32)
        values = lut[codes] * torch.pow(2.0, (scales - 127).float()).unsqueeze(-1)
        expected[name] = values.reshape(experts, n_out, n_in).transpose(1, 2).contiguous()
        tensors[name + "_blocks"] = blocks.to(torch.uint8)
        tensors[name + "_scales"] = scales.to(torch.uint8)
    save_file(tensors, str(path / "model.safetensors"))
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(str(path))
    return expected


def test_mxfp4_checkpoint_dequantised_on_load(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from roundpipe.shared.model import IGNORE_INDEX

    expected = _mxfp4_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="MXFP4-packed"):
        LayeredModel.from_hf_dir(tmp_path)
    model = LayeredModel.from_hf_dir(tmp_path, dequantize_mxfp4=True)
    assert getattr(model.config, "quantization_config", None) is None
    flat = model.flat_weights(model.load_weights())
    for name, want in expected.items():
        assert torch.equal(flat[name], want), name
    # The dequantised model trains, and exports as a plain (unquantised) checkpoint.
    ex = StageExecutor(model)
    ids, labels = batch(seed=1, rows=2)
    labels[0, :3] = IGNORE_INDEX
    res = ex.tail(
        0, model.num_layers, model.range_weights(model.load_weights(), 0, 6), [ids], [labels], 20
    )
    assert torch.isfinite(res.losses).all()
    model.to_hf_model(model.load_weights()).save_pretrained(str(tmp_path / "export"))
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert getattr(hf.config, "quantization_config", None) is None


def test_job_spec_dequantize_option(tmp_path: Path) -> None:
    """``model.dequantize`` drops the MXFP4 quantization_config from the job's model
    config (so admission and the workers build the plain model); it needs a path model."""
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.spec.errors import JobSpecError
    from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
    from roundpipe.coordinator.spec.sections import ModelSpec

    _mxfp4_checkpoint(tmp_path)
    config = model_config_from_spec(ModelSpec(path=str(tmp_path), dequantize=True))
    assert getattr(config, "quantization_config", None) is None
    LayeredModel(config)  # the family accepts the dequantised config
    with pytest.raises(ValueError, match="MXFP4"):
        LayeredModel(model_config_from_spec(ModelSpec(path=str(tmp_path))))
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["model"]["dequantize"] = True
    with pytest.raises(JobSpecError, match="model.dequantize.*path model only"):
        JobSpec.from_dict(spec)


def test_job_trains_a_dequantised_mxfp4_checkpoint(tmp_path: Path, arena_dir: Path) -> None:
    """A job on an MXFP4 GPT-OSS directory with model.dequantize trains through the
    trainer (workers build the plain model from the job's config) and exports a plain
    checkpoint that transformers loads."""
    from runtime_helpers import DEMO_DATA, tiny_spec, trained_in_process
    from transformers import AutoModelForCausalLM

    from roundpipe.coordinator.spec.jobspec import JobSpec

    (tmp_path / "ckpt").mkdir()
    _mxfp4_checkpoint(tmp_path / "ckpt", vocab_size=512)
    spec = tiny_spec(tmp_path / "out", steps=2, packing="none").to_dict()
    spec["model"] = {
        "path": str(tmp_path / "ckpt"),
        "dequantize": True,
        "tokenizer": str(DEMO_DATA / "tokenizer"),
    }
    job = JobSpec.from_dict(spec)
    with trained_in_process(job, arena_dir, 2) as trainer:
        assert trainer.model.architecture == "GptOssForCausalLM"
        assert all(torch.isfinite(t).all() for t in trainer.final_weights()[1].values())
        trainer.export(tmp_path / "export")
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert getattr(hf.config, "quantization_config", None) is None


def test_all_linear_lora_on_an_moe_model_directory_trains(tmp_path: Path, arena_dir: Path) -> None:
    """peft wraps each fused expert parameter in a wrapper of its own (``experts.
    base_layer.base_layer.gate_up_proj``): the checkpoint name kept one ``.base_layer``,
    so the default all-linear LoRA (nf4 base or not) on an MoE model read from a
    directory failed at start, the checkpoint said to lack the experts."""
    from runtime_helpers import tiny_spec, trained_in_process
    from transformers import AutoConfig, AutoModelForCausalLM

    from roundpipe.coordinator.spec.jobspec import JobSpec

    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "moe")
    for quant in ("none", "nf4"):
        lora = {"r": 4, "alpha": 8, "base_quantization": quant}  # all-linear: the default
        d = tiny_spec(tmp_path / f"out-{quant}", steps=2, lora=lora).to_dict()
        d["model"] = {"path": str(tmp_path / "moe"), "tokenizer": d["model"]["tokenizer"]}
        with trained_in_process(JobSpec.from_dict(d), arena_dir, 2, job_id=f"job-{quant}") as t:
            assert t.step == 2 and t.last_loss is not None, quant
