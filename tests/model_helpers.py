"""Shared helpers for the model-execution tests: tiny configs, batches, HF references and
random plans (the in-process reference driver is roundpipe.worker.reference)."""

from __future__ import annotations

import random
from collections.abc import Mapping

import torch

from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

__all__ = [
    "ALL_ARCHS",
    "ARCHS",
    "NEW_ARCHS",
    "random_plan",
    "LORA_SPEC",
    "assert_grads_close",
    "VOCAB",
    "batch",
    "hf_reference",
    "perturb_lora",
    "rel_err",
    "split_rows",
    "new_family_overrides",
    "tiny_config",
]

VOCAB = 256
LORA_SPEC = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
ARCHS = ("llama", "qwen3", "qwen3_moe")
NEW_ARCHS = ("mistral", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss")
ALL_ARCHS = ARCHS + NEW_ARCHS

# Uneven microbatch row counts of a 7-row global batch, per M.
_SPLITS = {1: [7], 2: [4, 3], 3: [3, 1, 3], 5: [2, 1, 1, 2, 1]}


def tiny_config(arch: str, **overrides: object) -> object:
    """Tiny configs with grouped-query attention and 4 decoder layers.

    llama: tied embeddings; qwen3: head_dim 16 != hidden / heads (32 / 4 = 8);
    qwen3_moe: 4 experts, top-2, one dense (mlp_only) layer. mistral: a 5-token sliding
    window on every layer. gemma3_text: sliding / full layers (window 4) with their own
    RoPE bases, tied embeddings. qwen3_5_text / qwen3_5_moe_text: linear, full, linear,
    full attention (torch Gated DeltaNet path); the MoE one with 4 experts, top-2 and a
    shared expert. gpt_oss: 4 experts with biases, top-2, sinks, sliding / full layers.
    """
    from transformers import AutoConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if arch == "llama":
        kw = dict(common, tie_word_embeddings=True)
        kw.update(overrides)
        return LlamaConfig(**kw)
    if arch == "qwen3":
        kw = dict(common, head_dim=16, tie_word_embeddings=False)
        kw.update(overrides)
        return Qwen3Config(**kw)
    if arch == "qwen3_moe":
        kw = dict(
            common,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[2],
            tie_word_embeddings=False,
        )
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    kw = dict(common, **new_family_overrides(arch))
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def new_family_overrides(arch: str) -> dict[str, object]:
    """What the tiny configs of the families in NEW_ARCHS set beyond the common sizes
    (plain data: job specs carry it as ``model.config``)."""
    kw: dict[str, object] = dict(tie_word_embeddings=False)
    if arch == "mistral":
        kw.update(head_dim=8, sliding_window=5)
    elif arch == "gemma3_text":
        kw.update(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    elif arch in ("qwen3_5_text", "qwen3_5_moe_text"):
        kw.update(
            head_dim=8,
            # 8 value heads: with 4, HF's own fp32 gradient of layer 0's dt_bias / A_log
            # (sums that cancel) is 2e-5 from fp64, so a 1e-5 bar would measure fp32 noise.
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
        if arch == "qwen3_5_moe_text":
            kw.update(
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                num_experts=4,
                num_experts_per_tok=2,
            )
    elif arch == "gpt_oss":
        kw.update(
            head_dim=8,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4,
            },
        )
    else:
        raise ValueError(arch)
    return kw


def batch(seed: int, rows: int = 7, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and labels with some -100 (right padding, a masked prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, seq - 4 :] = -100  # right-padded row
    labels[min(2, rows - 1), :5] = -100  # masked prompt
    return ids, labels


def split_rows(
    ids: torch.Tensor, labels: torch.Tensor, m: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sizes = _SPLITS[m] if ids.shape[0] == 7 else [ids.shape[0] // m] * m
    out, r = [], 0
    for n in sizes:
        out.append((ids[r : r + n], labels[r : r + n]))
        r += n
    assert r == ids.shape[0]
    return out


def hf_reference(
    model: LayeredModel,
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    ids: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the plain transformers (or peft) model on the full batch."""
    hf = model.to_hf_model({k: {n: t.to(dtype) for n, t in v.items()} for k, v in weights.items()})
    loss = hf(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).float()
        for n, p in hf.named_parameters()
        if p.requires_grad
    }
    return float(loss.detach()), grads


def perturb_lora(weights: dict[int, dict[str, torch.Tensor]], seed: int) -> None:
    """Give LoRA B matrices non-zero values so that A gets a non-zero gradient."""
    g = torch.Generator().manual_seed(seed)
    for per in weights.values():
        for n, t in per.items():
            if ".lora_B." in n:
                per[n] = torch.randn(t.shape, generator=g) * 0.1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, with an absolute floor for all-zero references."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_grads_close(
    ours: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    tol: float,
    context: str = "",
    *,
    looser: Mapping[str, float] | None = None,
) -> None:
    """Every gradient within ``tol`` (relative), or within ``looser[suffix]`` for the
    parameters whose names end with one of its keys."""
    assert set(ours) == set(ref), f"{context}: names differ: {sorted(set(ours) ^ set(ref))[:6]}"
    bad = []
    for n, r in ref.items():
        assert ours[n].dtype == torch.float32, f"{context}: {n} grad is {ours[n].dtype}"
        assert ours[n].shape == r.shape, f"{context}: {n} shape {ours[n].shape} vs {r.shape}"
        if r.norm() == 0:
            if ours[n].norm() > 1e-12:
                bad.append((n, float(ours[n].norm())))
        elif (e := rel_err(ours[n], r)) > next(
            (t for suffix, t in (looser or {}).items() if n.endswith(suffix)), tol
        ):
            bad.append((n, e))
    assert not bad, f"{context}: gradients differ (name, rel err): {bad[:6]}"


# ----------------------------------------------------------- test drivers and generators


def random_plan(num_layers: int, rng: random.Random) -> Plan:
    """A random valid plan (any tail start, any cut points)."""
    t0 = rng.randrange(0, num_layers)
    if t0 == 0:
        return Plan(forward=(), tail=(0, num_layers), backward=())
    fwd = _random_split(t0, rng)
    bwd = tuple(reversed(_random_split(t0, rng)))
    return Plan(forward=fwd, tail=(t0, num_layers), backward=bwd)


def _random_split(n: int, rng: random.Random) -> tuple[tuple[int, int], ...]:
    # Each of the n-1 inner boundaries is a cut with probability 1/2: this reaches every
    # partition, including all-single-layer and one-stage ones.
    cuts = [0] + [i for i in range(1, n) if rng.random() < 0.5] + [n]
    return tuple((cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1))
