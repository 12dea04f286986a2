"""Oracle tests: staged execution equals the plain transformers / peft model.

Running a plan's stages one after another through the executor must give the loss and
every parameter gradient of ``model(input_ids, labels=...).loss.backward()`` on the full
batch (fp32: within 1e-5 relative), for any valid plan and any microbatch split.
"""

from __future__ import annotations

import random
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import (  # noqa: E402
    ALL_ARCHS,
    LORA_SPEC,
    assert_grads_close,
    batch,
    hf_reference,
    perturb_lora,
    random_plan,
    rel_err,
    split_rows,
    tiny_config,
)

from roundpipe.shared.model import LayeredModel  # noqa: E402
from roundpipe.shared.plan import Plan  # noqa: E402
from roundpipe.worker.executor import RngKey, StageExecutor  # noqa: E402
from roundpipe.worker.reference import run_iteration  # noqa: E402

torch.set_num_threads(1)

TOL = 1e-5
# A gated delta net's per-head decay parameters get a gradient that is a sum over every
# token of terms of both signs, which mostly cancel: a 1e-7 relative difference in the
# hidden-state gradients (the chunked LM head sums the loss in another order than
# transformers' cross-entropy; the losses are bitwise equal) comes out as about 1e-5
# relative there, and its size moves with the torch build. Every other gradient stays
# within TOL.
LINEAR_ATTENTION_DECAY_TOL = {"linear_attn.A_log": 5e-5, "linear_attn.dt_bias": 5e-5}
PLAN_KINDS = ("whole", "single", "uneven", "random0", "random1")


def make_plan(kind: str, n: int, salt: str) -> Plan:
    if kind == "whole":
        return Plan(forward=(), tail=(0, n), backward=())
    if kind == "single":
        return Plan(
            forward=tuple((i, i + 1) for i in range(n - 1)),
            tail=(n - 1, n),
            backward=tuple((i, i + 1) for i in reversed(range(n - 1))),
        )
    if kind == "uneven":
        return Plan(forward=((0, 1), (1, 4)), tail=(4, n), backward=((3, 4), (0, 3)))
    rng = random.Random(f"{salt}-{kind}")
    plan = random_plan(n, rng)
    # Random plans should exercise staged execution; the whole-model case is covered above.
    while plan.tail[0] == 0:
        plan = random_plan(n, rng)
    return plan


@cache
def setup(arch: str, lora: bool = False):
    model = LayeredModel.from_config(tiny_config(arch), LORA_SPEC if lora else None)
    weights = model.init_weights(seed=11)
    if lora:
        perturb_lora(weights, seed=5)
    ids, labels = batch(seed=3)
    loss, grads = hf_reference(model, weights, ids, labels)
    return model, weights, ids, labels, loss, grads


@pytest.mark.parametrize("kind", PLAN_KINDS)
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_stages_match_transformers(arch: str, m: int, kind: str) -> None:
    model, weights, ids, labels, ref_loss, ref_grads = setup(arch)
    plan = make_plan(kind, model.num_layers, f"{arch}-{m}")
    plan.validate(model.num_layers)
    ex = StageExecutor(model, "cpu", torch.float32)
    res = run_iteration(model, plan, weights, split_rows(ids, labels, m), ex)
    ctx = f"{arch} M={m} {plan}"
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss), f"{ctx}: loss {res.loss} vs {ref_loss}"
    assert len(res.microbatch_losses) == m
    assert_grads_close(res.grads, ref_grads, TOL, ctx, looser=LINEAR_ATTENTION_DECAY_TOL)


def test_tied_embedding_gets_both_contributions() -> None:
    model, weights, ids, labels, _, ref_grads = setup("llama")
    assert model.tied_params == {"lm_head.weight": "model.embed_tokens.weight"}
    ex = StageExecutor(model)
    plan = make_plan("uneven", model.num_layers, "tied")
    res = run_iteration(model, plan, weights, split_rows(ids, labels, 3), ex)
    # The embedding gradient alone (without the head's share) is far from HF's total.
    tail = ex.tail(
        4,
        model.num_layers,
        model.range_weights(weights, 4, model.num_layers),
        ex.forward(0, 4, model.range_weights(weights, 0, 4), [ids]).outputs,
        [labels],
        int((labels[:, 1:] != -100).sum()),
    )
    head_part = tail.weight_grads["lm_head.weight"]
    embed = "model.embed_tokens.weight"
    assert rel_err(res.grads[embed] - head_part, ref_grads[embed]) > 0.1
    assert rel_err(res.grads[embed], ref_grads[embed]) < TOL


@pytest.mark.parametrize("kind", ["whole", "uneven", "random0"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    "arch", ["llama", "qwen3_moe", "mistral", "gemma3_text", "qwen3_5_moe_text", "gpt_oss"]
)
def test_lora_matches_peft(arch: str, m: int, kind: str) -> None:
    model, weights, ids, labels, ref_loss, ref_grads = setup(arch, lora=True)
    assert ref_grads and all(".lora_" in n for n in ref_grads)
    plan = make_plan(kind, model.num_layers, f"lora-{arch}-{m}")
    ex = StageExecutor(model)
    res = run_iteration(model, plan, weights, split_rows(ids, labels, m), ex)
    ctx = f"lora {arch} M={m} {plan}"
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss), ctx
    # Only adapters come back: base weights are frozen (no gradient, no optimizer state).
    assert_grads_close(res.grads, ref_grads, TOL, ctx)
    assert set(res.grads) == set(model.trainable_names)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_bf16_within_bf16_tolerance(arch: str) -> None:
    model, weights, ids, labels, ref_loss, ref_grads = setup(arch)
    plan = make_plan("uneven", model.num_layers, arch)
    ex = StageExecutor(model, "cpu", torch.bfloat16)
    res = run_iteration(model, plan, weights, split_rows(ids, labels, 3), ex)
    hf_loss, hf_grads = hf_reference(model, weights, ids, labels, torch.bfloat16)
    assert abs(res.loss - ref_loss) < 2e-2 * abs(ref_loss)
    assert set(res.grads) == set(ref_grads)
    for n, g in res.grads.items():
        assert g.dtype == torch.float32
        # No worse than transformers' own bf16 run, up to bf16 noise.
        ours, theirs = rel_err(g, ref_grads[n]), rel_err(hf_grads[n], ref_grads[n])
        assert ours <= max(2 * theirs, 3e-2), f"{arch} {n}: bf16 error {ours} vs HF's {theirs}"


def test_fp16_runs_and_agrees() -> None:
    model, weights, ids, labels, ref_loss, ref_grads = setup("qwen3")
    ex = StageExecutor(model, "cpu", torch.float16)
    res = run_iteration(
        model,
        make_plan("uneven", model.num_layers, "fp16"),
        weights,
        split_rows(ids, labels, 3),
        ex,
    )
    assert abs(res.loss - ref_loss) < 1e-2 * abs(ref_loss)
    worst = max(rel_err(res.grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < 2e-2


def test_sliding_window_qwen3_matches_transformers() -> None:
    cfg = tiny_config("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = LayeredModel.from_config(cfg)
    assert [model.mask_kind(layer) for layer in range(1, 5)] == [
        "full",
        "full",
        "sliding",
        "sliding",
    ]
    weights = model.init_weights(seed=2)
    ids, labels = batch(seed=4)
    ref_loss, ref_grads = hf_reference(model, weights, ids, labels)
    res = run_iteration(
        model,
        make_plan("uneven", model.num_layers, "sw"),
        weights,
        split_rows(ids, labels, 3),
        StageExecutor(model),
    )
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss)
    assert_grads_close(res.grads, ref_grads, TOL, "sliding window")


@pytest.mark.parametrize("lora", [False, True])
def test_dropout_recompute_matches_forward(lora: bool) -> None:
    """With dropout live, a staged run (forward, then recompute in backward) gives exactly
    the gradients of the whole model run as one fused task (no recompute)."""
    cfg = tiny_config("llama", attention_dropout=0.3)
    spec = dict(LORA_SPEC, dropout=0.3) if lora else None
    model = LayeredModel.from_config(cfg, spec)
    weights = model.init_weights(seed=1)
    if lora:
        perturb_lora(weights, seed=1)
    ids, labels = batch(seed=9)
    mbs = split_rows(ids, labels, 3)
    ex = StageExecutor(model)
    key = RngKey(seed=7, iteration=4)
    fused = run_iteration(model, make_plan("whole", 6, ""), weights, mbs, ex, rng=key)
    for kind in ("single", "uneven"):
        staged = run_iteration(model, make_plan(kind, 6, ""), weights, mbs, ex, rng=key)
        assert abs(staged.loss - fused.loss) <= TOL * abs(fused.loss)
        assert_grads_close(staged.grads, fused.grads, TOL, f"dropout {kind}")
    # Dropout is really on: another seed, or no dropout, changes the loss.
    other = run_iteration(model, make_plan("whole", 6, ""), weights, mbs, ex, rng=RngKey(8, 4))
    assert abs(other.loss - fused.loss) > 1e-4
    # And the task is idempotent: the same key reproduces it bit for bit.
    again = run_iteration(model, make_plan("whole", 6, ""), weights, mbs, ex, rng=key)
    assert again.loss == fused.loss
    assert all(torch.equal(again.grads[n], fused.grads[n]) for n in fused.grads)


def _arena_views(weights: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """The same weights as views of one flat buffer, as a worker gets them from an arena
    (views share one autograd version counter)."""
    flat = torch.cat([t.reshape(-1) for per in weights.values() for t in per.values()])
    out: dict[int, dict[str, torch.Tensor]] = {}
    offset = 0
    for layer, per in weights.items():
        out[layer] = {}
        for name, t in per.items():
            out[layer][name] = flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
    return out


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_lora_all_linear_default_matches_peft(arch: str) -> None:
    """target_modules all-linear (the job spec's default) has peft's meaning on every
    architecture, including Qwen3-MoE, where peft adapts the fused experts and the router
    through parametrizations, and the staged run equals peft with arena-like weights."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    model = LayeredModel.from_config(config, lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own notes on transformers-5 MoE models
        direct = get_peft_model(
            AutoModelForCausalLM.from_config(config),
            LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
    expected = {n for n, p in direct.named_parameters() if p.requires_grad}
    assert set(model.trainable_names) == expected
    assert not any("lm_head" in n for n in expected)
    # The list form (what a job spec's list or a JobSetup carries) means the same.
    listed = LayeredModel.from_config(config, dict(lora, target_modules=["all-linear"]))
    assert listed.trainable_names == model.trainable_names

    weights = model.init_weights(seed=11)
    perturb_lora(weights, seed=5)
    ids, labels = batch(seed=3)
    ref_loss, ref_grads = hf_reference(model, weights, ids, labels)
    plan = make_plan("uneven", model.num_layers, "all-linear")
    res = run_iteration(
        model, plan, _arena_views(weights), split_rows(ids, labels, 3), StageExecutor(model)
    )
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss)
    assert_grads_close(res.grads, ref_grads, TOL, f"all-linear {arch}")


def _hf_router_reference(
    model: LayeredModel, weights, microbatches, row_tokens=None
) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers with output_router_logits, one forward per microbatch: each adds its
    summed token losses / N and coef * (its tokens / batch tokens) * its aux loss.
    Note [router auxiliary loss]. ``row_tokens[m]``: the real tokens of each row of
    microbatch m; the rest is padding, given to transformers as its attention mask."""
    from roundpipe.shared.model import count_label_tokens, shift_labels

    hf = model.to_hf_model(weights)
    n = sum(count_label_tokens(y) for _, y in microbatches)
    masks = [
        None if row_tokens is None else _attention_mask(x, lengths)
        for (x, _), lengths in zip(microbatches, row_tokens or [None] * len(microbatches))
    ]
    real = [x.numel() if a is None else int(a.sum()) for (x, _), a in zip(microbatches, masks)]
    batch_tokens = sum(real)
    coef = model.config.router_aux_loss_coef
    total = 0.0
    for (x, y), mask, tokens in zip(microbatches, masks, real):
        out = hf(input_ids=x, attention_mask=mask, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]).float(),
            shift_labels(y).reshape(-1),
            reduction="sum",
        )
        loss = ce / n + coef * (tokens / batch_tokens) * out.aux_loss
        loss.backward()
        total += float(loss.detach())
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).float()
        for name, p in hf.named_parameters()
        if p.requires_grad
    }
    return total, grads


def _attention_mask(ids: torch.Tensor, lengths) -> torch.Tensor:
    return (torch.arange(ids.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_router_aux_loss_leaves_padding_out_as_transformers_does(arch: str, m: int) -> None:
    """Right-padded rows (every data.packing mode pads some): transformers, given the
    attention mask a padded batch has, counts only real tokens in the load-balancing
    loss. The padding's routing was counted here: router gradients 100-170% off."""
    config = tiny_config(arch, output_router_logits=True, router_aux_loss_coef=0.5)
    model = LayeredModel.from_config(config)
    weights = model.init_weights(seed=11)
    ids, labels = batch(seed=3)
    lengths = [12, 5, 9, 12, 2, 7, 12]
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
        labels[row, n:] = -100
    mbs = split_rows(ids, labels, m)
    row_tokens, r = [], 0
    for x, _ in mbs:
        row_tokens.append(lengths[r : r + x.shape[0]])
        r += x.shape[0]
    ref_loss, ref_grads = _hf_router_reference(model, weights, mbs, row_tokens)
    plan = make_plan("random1", model.num_layers, f"aux-pad-{arch}-{m}")
    res = run_iteration(model, plan, weights, mbs, StageExecutor(model), row_tokens=row_tokens)
    ctx = f"aux padded {arch} M={m} {plan}"
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss), f"{ctx}: {res.loss} vs {ref_loss}"
    assert_grads_close(res.grads, ref_grads, TOL, ctx)
    # The mask matters: counted in, the padding moves the router gradient.
    _, counted = _hf_router_reference(model, weights, mbs)
    router = next(n for n in ref_grads if ".mlp.gate.weight" in n or ".mlp.router.weight" in n)
    assert rel_err(counted[router], ref_grads[router]) > 1e-3


@pytest.mark.parametrize("kind", ["whole", "single", "random0", "random1"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_router_aux_loss_matches_transformers(arch: str, m: int, kind: str) -> None:
    """output_router_logits: the load-balancing loss and its gradients (router weights
    included) equal transformers', for any plan; with one microbatch that is exactly
    ``model(input_ids, labels=...).loss`` (LM + coef * aux)."""
    # A large coefficient so the aux loss moves the router gradients well beyond 1e-5.
    config = tiny_config(arch, output_router_logits=True, router_aux_loss_coef=0.5)
    model = LayeredModel.from_config(config)
    assert model.router_aux is not None and model.router_aux.num_experts == 4
    weights = model.init_weights(seed=11)
    ids, labels = batch(seed=3)
    mbs = split_rows(ids, labels, m)
    ref_loss, ref_grads = _hf_router_reference(model, weights, mbs)
    if m == 1:
        whole_loss, _ = hf_reference(model, weights, ids, labels)  # HF's own loss + aux
        assert abs(whole_loss - ref_loss) <= 1e-6 * abs(ref_loss)
    plan = make_plan(kind, model.num_layers, f"aux-{arch}-{m}")
    res = run_iteration(model, plan, weights, mbs, StageExecutor(model))
    ctx = f"aux {arch} M={m} {plan}"
    assert abs(res.loss - ref_loss) <= TOL * abs(ref_loss), f"{ctx}: {res.loss} vs {ref_loss}"
    assert_grads_close(res.grads, ref_grads, TOL, ctx)
    # The aux loss is really in there: without it the router gradient differs.
    plain = LayeredModel.from_config(tiny_config(arch))
    _, no_aux = hf_reference(plain, weights, ids, labels)
    router = next(n for n in ref_grads if ".mlp.gate.weight" in n or ".mlp.router.weight" in n)
    assert rel_err(no_aux[router], ref_grads[router]) > 1e-3
