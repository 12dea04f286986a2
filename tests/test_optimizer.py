"""Layer-wise AdamW equals torch.optim.AdamW over the whole model; schedules; checkpoints."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch
from torch import nn

from roundpipe.coordinator.optimizer import (
    IMPLS,
    LayerwiseAdamW,
    LRSchedule,
    OptimizerStepError,
    clip_coefficient,
    global_grad_norm,
)

VOCAB, DIM = 37, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


def make_model() -> nn.ModuleList:
    """Layers as the runtime numbers them: 0 prefix, 1..n-2 blocks, n-1 tail."""
    torch.manual_seed(0)
    return nn.ModuleList([nn.Embedding(VOCAB, DIM), Block(), Block(), nn.Linear(DIM, VOCAB)])


def forward_loss(model: nn.ModuleList, ids: torch.Tensor) -> torch.Tensor:
    h = model[0](ids)
    for block in model[1:-1]:
        h = block(h)
    logits = model[-1](h)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class Arena:
    """One flat fp32 buffer with a view per tensor of every layer, like a shm arena."""

    def __init__(self, model: nn.ModuleList) -> None:
        shapes = {(i, n): p.shape for i, m in enumerate(model) for n, p in m.named_parameters()}
        self.buf = torch.zeros(sum(math.prod(s) for s in shapes.values()))
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        off = 0
        for (layer, name), shape in shapes.items():
            n = math.prod(shape)
            self.views.setdefault(layer, {})[name] = self.buf[off : off + n].view(shape)
            off += n


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


SCHEDULE = LRSchedule(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)


def run_both(impl: str, steps: int, grad_clip: float | None) -> tuple[nn.ModuleList, Arena]:
    """Train a reference model with torch.optim.AdamW and a copy with LayerwiseAdamW."""
    ref = make_model()
    flags = {"fused": impl == "fused", "foreach": impl == "foreach"}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=SCHEDULE.lr, weight_decay=0.1, **flags)

    worker = make_model()  # computes gradients from the masters, like a worker would
    masters = Arena(worker)
    grads = Arena(worker)
    params_bf16 = {
        i: {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in d.items()}
        for i, d in masters.views.items()
    }
    for layer, m in enumerate(worker):
        for name, p in m.named_parameters():
            masters.views[layer][name].copy_(p.detach())
    opt = LayerwiseAdamW(
        masters.views, schedule=SCHEDULE, weight_decay=0.1, grad_clip=grad_clip, impl=impl
    )
    ptrs = {(i, n): t.data_ptr() for i, d in masters.views.items() for n, t in d.items()}

    for step in range(1, steps + 1):
        ids = batch(step)
        # Reference: one whole-model optimizer.
        ref_opt.zero_grad()
        forward_loss(ref, ids).backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
        for group in ref_opt.param_groups:
            group["lr"] = SCHEDULE.lr_at(step)
        ref_opt.step()

        # Layer-wise: gradients land in the grads arena, layers update last-first.
        with torch.no_grad():
            for layer, m in enumerate(worker):
                for name, p in m.named_parameters():
                    p.copy_(masters.views[layer][name])
        worker.zero_grad()
        forward_loss(worker, ids).backward()
        for layer, m in enumerate(worker):
            for name, p in m.named_parameters():
                grads.views[layer][name].copy_(p.grad)
        coef = None
        if grad_clip is not None:
            coef = clip_coefficient(global_grad_norm(grads.views), grad_clip)
        for layer in reversed(opt.layers):
            lr = opt.step_layer(
                layer, grads.views[layer], step, clip_coef=coef, out=params_bf16[layer]
            )
            assert lr == SCHEDULE.lr_at(step)
        for layer, d in masters.views.items():
            for name, t in d.items():
                assert torch.equal(params_bf16[layer][name], t.to(torch.bfloat16))
    # Updated in place: the masters are still the arena's views.
    assert ptrs == {(i, n): t.data_ptr() for i, d in masters.views.items() for n, t in d.items()}
    assert all(opt.last_step(layer) == steps for layer in opt.layers)
    return ref, masters


def max_diff(ref: nn.ModuleList, masters: Arena) -> float:
    return max(
        (p.detach() - masters.views[layer][name]).abs().max().item()
        for layer, m in enumerate(ref)
        for name, p in m.named_parameters()
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_layerwise_equals_whole_model_adamw_bitwise(impl: str) -> None:
    ref, masters = run_both(impl, steps=6, grad_clip=None)
    for layer, m in enumerate(ref):
        for name, p in m.named_parameters():
            assert torch.equal(p.detach(), masters.views[layer][name]), (impl, layer, name)


def test_layerwise_with_clipping_matches_clip_grad_norm() -> None:
    ref, masters = run_both("fused", steps=6, grad_clip=0.05)  # small: clipping is active
    assert max_diff(ref, masters) <= 1e-6


def test_global_norm_matches_torch() -> None:
    g = {1: {"a": torch.randn(5, 3)}, 0: {"b": torch.randn(7), "c": torch.randn(2, 2)}}
    flat = [g[0]["b"], g[0]["c"], g[1]["a"]]
    assert torch.equal(global_grad_norm(g), nn.utils.get_total_norm(flat))
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(4.0, 1.0).item() == pytest.approx(0.25, rel=1e-6)


def test_schedules_at_known_steps() -> None:
    const = LRSchedule(lr=1.0)
    assert [const.lr_at(s) for s in (1, 50, 10**6)] == [1.0, 1.0, 1.0]
    warm = LRSchedule(lr=2.0, warmup_steps=4)
    assert [warm.lr_at(s) for s in (1, 2, 4, 5)] == [0.5, 1.0, 2.0, 2.0]

    lin = LRSchedule(lr=1.0, schedule="linear", warmup_steps=10, total_steps=110)
    assert lin.lr_at(5) == pytest.approx(0.5)
    assert lin.lr_at(10) == pytest.approx(1.0)
    assert lin.lr_at(60) == pytest.approx(0.5)
    assert lin.lr_at(110) == pytest.approx(0.0)

    cos = LRSchedule(lr=1.0, schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert cos.lr_at(10) == pytest.approx(1.0)
    assert cos.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cos.lr_at(60) == pytest.approx(0.55)
    assert cos.lr_at(110) == pytest.approx(0.1)
    assert cos.lr_at(500) == pytest.approx(0.1)  # stays at the minimum
    nowarm = LRSchedule(lr=1.0, schedule="cosine", total_steps=4)
    assert nowarm.lr_at(4) == pytest.approx(0.0) and nowarm.lr_at(1) < 1.0
    with pytest.raises(ValueError, match="count from 1"):
        cos.lr_at(0)


def test_state_dict_round_trip_continues_identically() -> None:
    def masters() -> dict[int, dict[str, torch.Tensor]]:
        torch.manual_seed(5)
        return {0: {"w": torch.randn(4, 3)}, 1: {"w": torch.randn(6), "b": torch.randn(2)}}

    def grads(step: int) -> dict[int, dict[str, torch.Tensor]]:
        torch.manual_seed(100 + step)
        return {0: {"w": torch.randn(4, 3)}, 1: {"w": torch.randn(6), "b": torch.randn(2)}}

    sched = LRSchedule(lr=1e-2, schedule="linear", warmup_steps=1, total_steps=8)
    a_w = masters()
    a = LayerwiseAdamW(a_w, schedule=sched)
    for step in range(1, 4):
        for layer, g in grads(step).items():
            a.step_layer(layer, g, step)
    # Through safetensors bytes, as a checkpoint would store it.
    state = a.state_dict()
    blob = safetensors.torch.save(state["tensors"])
    saved = {
        "version": state["version"],
        "steps": dict(state["steps"]),
        "tensors": safetensors.torch.load(blob),
    }

    b_w = {i: {n: t.clone() for n, t in d.items()} for i, d in a_w.items()}
    moments = {
        i: {n: (torch.full_like(t, 7.0), torch.full_like(t, 7.0)) for n, t in d.items()}
        for i, d in b_w.items()
    }
    b = LayerwiseAdamW(b_w, schedule=sched, moments=moments)
    b.load_state_dict(saved)
    assert b.last_step(1) == 3
    for step in range(4, 8):
        for layer, g in grads(step).items():
            a.step_layer(layer, g, step)
            b.step_layer(layer, g, step)
    for layer in a_w:
        for name in a_w[layer]:
            assert torch.equal(a_w[layer][name], b_w[layer][name])
    # b's moments live in the buffers it was given.
    assert torch.equal(moments[1]["b"][0], a.state_dict()["tensors"]["1.b.exp_avg"])


def test_moment_buffers_are_used_and_zeroed() -> None:
    w = {3: {"w": torch.ones(5)}}
    bufs = {3: {"w": (torch.full((5,), 9.0), torch.full((5,), 9.0))}}
    opt = LayerwiseAdamW(w, schedule=LRSchedule(lr=0.1), moments=bufs)
    assert bufs[3]["w"][0].eq(0).all()
    opt.step_layer(3, {"w": torch.full((5,), 2.0)}, 1)
    assert bufs[3]["w"][0].eq(0.2).all()  # (1 - 0.9) * 2
    assert opt.state_dict()["tensors"]["3.w.exp_avg"] is bufs[3]["w"][0]


def test_low_precision_grads_equal_their_fp32_values() -> None:
    g = torch.randn(8).to(torch.bfloat16)
    w1, w2 = {0: {"w": torch.ones(8)}}, {0: {"w": torch.ones(8)}}
    o1 = LayerwiseAdamW(w1, schedule=LRSchedule(lr=0.1))
    o2 = LayerwiseAdamW(w2, schedule=LRSchedule(lr=0.1))
    for step in (1, 2):
        o1.step_layer(0, {"w": g}, step)
        o2.step_layer(0, {"w": g.float()}, step)
    assert torch.equal(w1[0]["w"], w2[0]["w"])


def test_step_errors() -> None:
    w = {0: {"w": torch.zeros(3)}}
    opt = LayerwiseAdamW(w, schedule=LRSchedule(lr=0.1))
    g = {"w": torch.ones(3)}
    with pytest.raises(OptimizerStepError, match="asked for step 2, but its last step was 0"):
        opt.step_layer(0, g, 2)
    opt.step_layer(0, g, 1)
    before = w[0]["w"].clone()
    with pytest.raises(OptimizerStepError, match="asked for step 1"):
        opt.step_layer(0, g, 1)  # a repeated step changes nothing
    assert torch.equal(before, w[0]["w"])
    with pytest.raises(OptimizerStepError, match=r"missing \['w'\], unexpected \['v'\]"):
        opt.step_layer(0, {"v": torch.ones(3)}, 2)
    with pytest.raises(OptimizerStepError, match="gradient shape"):
        opt.step_layer(0, {"w": torch.ones(4)}, 2)
    with pytest.raises(OptimizerStepError, match="no trainable weights"):
        opt.step_layer(5, g, 1)
    clipped = LayerwiseAdamW({0: {"w": torch.zeros(3)}}, schedule=LRSchedule(lr=0.1), grad_clip=1.0)
    with pytest.raises(OptimizerStepError, match="pass clip_coef"):
        clipped.step_layer(0, g, 1)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        LayerwiseAdamW({0: {"w": torch.zeros(3, dtype=torch.bfloat16)}}, schedule=LRSchedule(lr=1))
