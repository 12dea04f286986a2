"""Layer-wise AdamW equals torch.optim.AdamW over the whole model; schedules; checkpoints."""

from __future__ import annotations

import math
import re

import pytest
import safetensors.torch
import torch
from torch import nn

from roundpipe.coordinator.spec.choices import HF_NO_DECAY
from roundpipe.coordinator.training.optimizer import (
    CHUNK_NUMEL,
    IMPLS,
    LayerwiseOptimizer,
    LRSchedule,
    OptimizerStepError,
    clip_coefficient,
    decays,
    default_threads,
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


def run_both(
    impl: str, steps: int, grad_clip: float | None, no_decay: tuple[str, ...] = ()
) -> tuple[nn.ModuleList, Arena]:
    """Train a reference model with torch.optim.AdamW and a copy with LayerwiseOptimizer.

    With ``no_decay`` the reference has two parameter groups, built as the Hugging Face
    Trainer builds them (``get_decay_parameter_names``'s name rule)."""
    ref = make_model()
    flags = {"fused": impl == "fused", "foreach": impl == "foreach"}
    named = [(f"{i}.{n}", p) for i, m in enumerate(ref) for n, p in m.named_parameters()]
    exempt = [p for n, p in named if any(re.search(x, n.lower()) for x in no_decay)]
    decayed = [p for n, p in named if not any(re.search(x, n.lower()) for x in no_decay)]
    groups = [{"params": decayed}] + ([{"params": exempt, "weight_decay": 0.0}] if exempt else [])
    ref_opt = torch.optim.AdamW(groups, lr=SCHEDULE.lr, weight_decay=0.1, **flags)

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
    opt = LayerwiseOptimizer(
        masters.views,
        schedule=SCHEDULE,
        weight_decay=0.1,
        grad_clip=grad_clip,
        impl=impl,
        no_decay=no_decay,
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


@pytest.mark.parametrize("no_decay", [(), HF_NO_DECAY])
@pytest.mark.parametrize("impl", IMPLS)
def test_layerwise_equals_whole_model_adamw_bitwise(impl: str, no_decay: tuple[str, ...]) -> None:
    ref, masters = run_both(impl, steps=6, grad_clip=None, no_decay=no_decay)
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
    """The one_based convention: step s is schedule position s (warmup peaks at W)."""
    const = LRSchedule(lr=1.0, convention="one_based")
    assert [const.lr_at(s) for s in (1, 50, 10**6)] == [1.0, 1.0, 1.0]
    warm = LRSchedule(lr=2.0, warmup_steps=4, convention="one_based")
    assert [warm.lr_at(s) for s in (1, 2, 4, 5)] == [0.5, 1.0, 2.0, 2.0]

    lin = LRSchedule(
        lr=1.0, schedule="linear", warmup_steps=10, total_steps=110, convention="one_based"
    )
    assert lin.lr_at(5) == pytest.approx(0.5)
    assert lin.lr_at(10) == pytest.approx(1.0)
    assert lin.lr_at(60) == pytest.approx(0.5)
    assert lin.lr_at(110) == pytest.approx(0.0)

    cos = LRSchedule(
        lr=1.0,
        schedule="cosine",
        warmup_steps=10,
        total_steps=110,
        min_lr_ratio=0.1,
        convention="one_based",
    )
    assert cos.lr_at(10) == pytest.approx(1.0)
    assert cos.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cos.lr_at(60) == pytest.approx(0.55)
    assert cos.lr_at(110) == pytest.approx(0.1)
    assert cos.lr_at(500) == pytest.approx(0.1)  # stays at the minimum
    nowarm = LRSchedule(lr=1.0, schedule="cosine", total_steps=4, convention="one_based")
    assert nowarm.lr_at(4) == pytest.approx(0.0) and nowarm.lr_at(1) < 1.0
    # Warmup over the whole run still peaks at its last step.
    assert LRSchedule(lr=1.0, schedule="linear", warmup_steps=3, total_steps=3).lr_at(3) < 1.0
    full = LRSchedule(
        lr=1.0, schedule="linear", warmup_steps=3, total_steps=3, convention="one_based"
    )
    assert full.lr_at(3) == 1.0
    with pytest.raises(ValueError, match="count from 1"):
        cos.lr_at(0)
    with pytest.raises(ValueError, match="unknown schedule convention 'torch'"):
        LRSchedule(lr=1.0, convention="torch")


@pytest.mark.parametrize(
    ("schedule", "warmup", "min_lr_ratio"),
    [
        ("constant", 3, 0.0),
        ("constant", 0, 0.0),
        ("linear", 3, 0.0),
        ("linear", 0, 0.0),
        ("cosine", 3, 0.0),
        ("cosine", 2, 0.1),
    ],
)
def test_hf_convention_equals_transformers_schedulers(
    schedule: str, warmup: int, min_lr_ratio: float
) -> None:
    """The default (hf) convention gives, bitwise, the learning rate that transformers'
    get_*_schedule_with_warmup sets for each optimizer step when it is stepped after
    every optimizer step (the Trainer's loop): lr 0 at step 1 of a warmup."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    total, lr = 11, 3e-4
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr)
    if schedule == "constant":
        hf = get_constant_schedule_with_warmup(opt, warmup)
    elif schedule == "linear":
        hf = get_linear_schedule_with_warmup(opt, warmup, total)
    elif min_lr_ratio:
        hf = get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=min_lr_ratio
        )
    else:
        hf = get_cosine_schedule_with_warmup(opt, warmup, total)
    ours = LRSchedule(
        lr=lr,
        schedule=schedule,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=min_lr_ratio,
    )
    assert ours.convention == "hf"
    for step in range(1, total + 1):
        assert ours.lr_at(step) == opt.param_groups[0]["lr"], step  # the lr step uses
        opt.step()
        hf.step()
    if warmup:
        assert ours.lr_at(1) == 0.0 and ours.lr_at(warmup + 1) == lr


def test_no_decay_default_is_the_hf_trainers_rule() -> None:
    """HF_NO_DECAY picks the tensors the Trainer's get_decay_parameter_names leaves out:
    biases and every norm weight, on the supported architectures."""
    from model_helpers import ARCHS, tiny_config
    from transformers import AutoModelForCausalLM, Trainer

    for arch in ARCHS:
        model = AutoModelForCausalLM.from_config(tiny_config(arch, attention_bias=True))
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        hf = set(Trainer.get_decay_parameter_names(None, model))
        ours = {n for n in names if decays(n, HF_NO_DECAY)}
        assert ours == hf, arch
        exempt = set(names) - ours
        assert any(".bias" in n for n in exempt) and "model.norm.weight" in exempt
        assert any("q_norm" in n or "input_layernorm" in n for n in exempt)
    masters = {
        0: {"a.weight": torch.ones(2), "a.bias": torch.ones(2)},
        1: {"norm.weight": torch.ones(2)},
    }
    opt = LayerwiseOptimizer(
        masters, schedule=LRSchedule(lr=0.5), weight_decay=0.5, no_decay=HF_NO_DECAY
    )
    assert opt.decayed == {"a.weight"}
    opt.step_layer(0, {"a.weight": torch.zeros(2), "a.bias": torch.zeros(2)}, 1)
    opt.step_layer(1, {"norm.weight": torch.zeros(2)}, 1)
    # Zero gradients: only decoupled decay moves a weight, by a factor 1 - lr * wd.
    assert masters[0]["a.weight"].eq(0.75).all()
    assert masters[0]["a.bias"].eq(1).all() and masters[1]["norm.weight"].eq(1).all()


def test_state_dict_round_trip_continues_identically() -> None:
    def masters() -> dict[int, dict[str, torch.Tensor]]:
        torch.manual_seed(5)
        return {0: {"w": torch.randn(4, 3)}, 1: {"w": torch.randn(6), "b": torch.randn(2)}}

    def grads(step: int) -> dict[int, dict[str, torch.Tensor]]:
        torch.manual_seed(100 + step)
        return {0: {"w": torch.randn(4, 3)}, 1: {"w": torch.randn(6), "b": torch.randn(2)}}

    sched = LRSchedule(lr=1e-2, schedule="linear", warmup_steps=1, total_steps=8)
    a_w = masters()
    a = LayerwiseOptimizer(a_w, schedule=sched)
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
    b = LayerwiseOptimizer(b_w, schedule=sched, moments=moments)
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
    opt = LayerwiseOptimizer(w, schedule=LRSchedule(lr=0.1), moments=bufs)
    assert bufs[3]["w"][0].eq(0).all()
    opt.step_layer(3, {"w": torch.full((5,), 2.0)}, 1)
    assert bufs[3]["w"][0].eq(0.2).all()  # (1 - 0.9) * 2
    assert opt.state_dict()["tensors"]["3.w.exp_avg"] is bufs[3]["w"][0]


def test_low_precision_grads_equal_their_fp32_values() -> None:
    g = torch.randn(8).to(torch.bfloat16)
    w1, w2 = {0: {"w": torch.ones(8)}}, {0: {"w": torch.ones(8)}}
    o1 = LayerwiseOptimizer(w1, schedule=LRSchedule(lr=0.1))
    o2 = LayerwiseOptimizer(w2, schedule=LRSchedule(lr=0.1))
    for step in (1, 2):
        o1.step_layer(0, {"w": g}, step)
        o2.step_layer(0, {"w": g.float()}, step)
    assert torch.equal(w1[0]["w"], w2[0]["w"])


def test_step_errors() -> None:
    w = {0: {"w": torch.zeros(3)}}
    opt = LayerwiseOptimizer(w, schedule=LRSchedule(lr=0.1))
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
    clipped = LayerwiseOptimizer(
        {0: {"w": torch.zeros(3)}}, schedule=LRSchedule(lr=0.1), grad_clip=1.0
    )
    with pytest.raises(OptimizerStepError, match="pass clip_coef"):
        clipped.step_layer(0, g, 1)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        LayerwiseOptimizer(
            {0: {"w": torch.zeros(3, dtype=torch.bfloat16)}}, schedule=LRSchedule(lr=1)
        )


# -- the chunked multi-threaded path (Note [chunked fused AdamW]) -----------------------


def _big_layers() -> dict[int, dict[str, torch.Tensor]]:
    """Tensors of several chunks with ragged tails, small ones, and a no-decay norm."""
    torch.manual_seed(11)
    shapes = {
        0: {"embed.weight": (2 * CHUNK_NUMEL // 512 + 1, 512)},  # 2 chunks and a tail
        1: {"up.weight": (CHUNK_NUMEL + 129,), "up.bias": (129,), "norm.weight": (64,)},
        2: {"down.weight": (9, CHUNK_NUMEL // 8 + 1), "down.bias": (7,)},
    }
    return {i: {n: torch.randn(s) for n, s in d.items()} for i, d in shapes.items()}


def _random_grads(
    w: dict[int, dict[str, torch.Tensor]], seed: int, grad_clip: float | None
) -> tuple[dict[int, dict[str, torch.Tensor]], torch.Tensor | None]:
    """Gradients like ``w``'s tensors, and the clip coefficient over them (if clipping)."""
    torch.manual_seed(seed)
    grads = {i: {n: torch.randn_like(t) for n, t in d.items()} for i, d in w.items()}
    coef = None if grad_clip is None else clip_coefficient(global_grad_norm(grads), grad_clip)
    return grads, coef


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_chunked_path_is_bitwise_the_per_layer_torch_loop(
    threads: int, grad_clip: float | None
) -> None:
    """Today's per-layer loop (a torch.optim.AdamW(fused=True) per layer, then a cast into
    the params buffer) against step_layers over groups of layers, over several steps."""
    default = torch.get_num_threads()
    sched = LRSchedule(lr=1e-2, schedule="cosine", warmup_steps=1, total_steps=5)
    ref_w, new_w = _big_layers(), _big_layers()
    ref_opts = {}
    for layer, tensors in ref_w.items():
        on = [t for n, t in tensors.items() if decays(n, HF_NO_DECAY)]
        off = [t for n, t in tensors.items() if not decays(n, HF_NO_DECAY)]
        groups = [{"params": on}] + ([{"params": off, "weight_decay": 0.0}] if off else [])
        ref_opts[layer] = torch.optim.AdamW(groups, lr=sched.lr, weight_decay=0.1, fused=True)
    opt = LayerwiseOptimizer(
        new_w,
        schedule=sched,
        weight_decay=0.1,
        grad_clip=grad_clip,
        no_decay=HF_NO_DECAY,
        threads=threads,
    )
    ref_out = {
        i: {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in d.items()}
        for i, d in ref_w.items()
    }
    new_out = {
        i: {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in d.items()}
        for i, d in new_w.items()
    }
    try:
        for step in range(1, 6):
            grads, coef = _random_grads(ref_w, 100 + step, grad_clip)
            # Reference: today's loop, last layer first.
            for layer in sorted(ref_w, reverse=True):
                for name, t in ref_w[layer].items():
                    g = grads[layer][name].clone()
                    t.grad = g.mul_(coef) if coef is not None else g
                for group in ref_opts[layer].param_groups:
                    group["lr"] = sched.lr_at(step)
                ref_opts[layer].step()
                for name, t in ref_w[layer].items():
                    t.grad = None
                    ref_out[layer][name].copy_(t)
            # New: layer 2 alone, then layers 0 and 1 as one group.
            done: list[int] = []
            for group in ([2], [0, 1]):
                opt.step_layers(
                    {layer: {n: g.clone() for n, g in grads[layer].items()} for layer in group},
                    step,
                    clip_coef=coef,
                    outs={layer: new_out[layer] for layer in group},
                    on_layer_done=done.append,
                )
            assert done == [2, 0, 1]
            for layer, tensors in ref_w.items():
                for name, t in tensors.items():
                    assert torch.equal(t, new_w[layer][name]), (step, layer, name)
                    assert torch.equal(ref_out[layer][name], new_out[layer][name])
                    state = ref_opts[layer].state[t]
                    ours = opt.state_dict()["tensors"]
                    assert torch.equal(state["exp_avg"], ours[f"{layer}.{name}.exp_avg"])
                    assert torch.equal(state["exp_avg_sq"], ours[f"{layer}.{name}.exp_avg_sq"])
    finally:
        torch.set_num_threads(default)


def test_step_layers_checks_everything_before_touching_anything() -> None:
    w = _big_layers()
    before = {i: {n: t.clone() for n, t in d.items()} for i, d in w.items()}
    opt = LayerwiseOptimizer(w, schedule=LRSchedule(lr=0.1))
    good = {n: torch.ones_like(t) for n, t in w[0].items()}
    with pytest.raises(OptimizerStepError, match="layer 1: gradients missing"):
        opt.step_layers({0: good, 1: {}}, 1)
    assert all(torch.equal(before[i][n], t) for i, d in w.items() for n, t in d.items())
    assert opt.last_step(0) == 0


def test_threads_sets_the_intra_op_team() -> None:
    default = torch.get_num_threads()
    try:
        opt = LayerwiseOptimizer({0: {"w": torch.zeros(3)}}, schedule=LRSchedule(lr=0.1), threads=3)
        opt.step_layer(0, {"w": torch.ones(3)}, 1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(default)


def test_default_threads_leave_cores_to_the_workers() -> None:
    assert [default_threads(c) for c in (1, 2, 3, 8, 16, 64)] == [1, 1, 1, 4, 8, 16]


# -- SGD through the same path ------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum,nesterov,grad_clip", [(0.0, False, None), (0.9, False, 0.5), (0.9, True, None)]
)
def test_sgd_is_bitwise_torch_sgd(momentum: float, nesterov: bool, grad_clip: float | None) -> None:
    """step_layers with algorithm="sgd" against one torch.optim.SGD(fused=True) over all
    layers (the Hugging Face parameter groups), bitwise, and against torch's default
    (for-loop) SGD to rounding."""
    sched = LRSchedule(lr=0.05, schedule="linear", warmup_steps=1, total_steps=5)
    ours_w, fused_w, loop_w = _big_layers(), _big_layers(), _big_layers()

    def torch_sgd(w: dict[int, dict[str, torch.Tensor]], fused: bool) -> torch.optim.SGD:
        named = [(n, t) for d in w.values() for n, t in d.items()]
        on = [t for n, t in named if decays(n, HF_NO_DECAY)]
        off = [t for n, t in named if not decays(n, HF_NO_DECAY)]
        return torch.optim.SGD(
            [{"params": on}, {"params": off, "weight_decay": 0.0}],
            lr=sched.lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=0.1,
            fused=fused,
        )

    refs = [(fused_w, torch_sgd(fused_w, True)), (loop_w, torch_sgd(loop_w, False))]
    opt = LayerwiseOptimizer(
        ours_w,
        schedule=sched,
        weight_decay=0.1,
        grad_clip=grad_clip,
        no_decay=HF_NO_DECAY,
        algorithm="sgd",
        momentum=momentum,
        nesterov=nesterov,
    )
    assert opt.kinds == (("momentum_buffer",) if momentum else ())
    for step in range(1, 6):
        grads, coef = _random_grads(ours_w, 200 + step, grad_clip)
        for w, ref in refs:
            for layer, d in w.items():
                for name, t in d.items():
                    g = grads[layer][name].clone()
                    t.grad = g.mul_(coef) if coef is not None else g
            for group in ref.param_groups:
                group["lr"] = sched.lr_at(step)
            ref.step()
        opt.step_layers(
            {i: {n: g.clone() for n, g in d.items()} for i, d in grads.items()},
            step,
            clip_coef=coef,
        )
        for layer, d in ours_w.items():
            for name, t in d.items():
                assert torch.equal(t, fused_w[layer][name]), (step, layer, name)
                torch.testing.assert_close(t, loop_w[layer][name], rtol=1e-5, atol=1e-6)


def test_sgd_state_round_trip_continues_identically() -> None:
    sched = LRSchedule(lr=0.05)
    a_w, b_w = _big_layers(), _big_layers()
    kw = dict(schedule=sched, algorithm="sgd", momentum=0.9)
    a = LayerwiseOptimizer(a_w, **kw)

    def grads(step: int) -> dict[int, dict[str, torch.Tensor]]:
        torch.manual_seed(300 + step)
        return {i: {n: torch.randn_like(t) for n, t in d.items()} for i, d in a_w.items()}

    for step in (1, 2):
        a.step_layers(grads(step), step)
    state = a.state_dict()
    assert {k.rsplit(".", 1)[1] for k in state["tensors"]} == {"momentum_buffer"}
    for layer, d in b_w.items():
        for name, t in d.items():
            t.copy_(a_w[layer][name])
    b = LayerwiseOptimizer(b_w, **kw)
    b.load_state_dict({**state, "tensors": {k: v.clone() for k, v in state["tensors"].items()}})
    for step in (3, 4):
        a.step_layers(grads(step), step)
        b.step_layers(grads(step), step)
    assert all(torch.equal(a_w[i][n], b_w[i][n]) for i, d in a_w.items() for n in d)
    with pytest.raises(ValueError, match="optimizer state tensors differ"):
        LayerwiseOptimizer(_big_layers(), schedule=sched).load_state_dict(state)


def test_one_overflowing_gradient_element_costs_one_update_not_a_block() -> None:
    """A finite gradient above ~6e20 makes its second moment inf. With fp32 states its
    update is zero (m / inf) and the other weights train on. With 8-bit states the
    block's scale became inf and all 256 moments, then weights, NaN; clamping the
    infinity instead left a huge first moment over a finite second one, which moved the
    weight by ~1e6 a step. Now the element restarts its moments: it moves as little as
    in fp32, and its block trains as a clean run's does."""

    def run(state_dtype: str, spike: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        w = torch.randn(1024)
        w0 = w.clone()
        opt = LayerwiseOptimizer(
            {0: {"w": w}}, schedule=LRSchedule(lr=1e-3), state_dtype=state_dtype, weight_decay=0.0
        )
        for step in range(1, 41):
            g = torch.randn(1024) * 1e-3
            if spike and step == 1:
                g[3] = 1e30
            opt.step_layer(0, {"w": g}, step)
        return w, w0

    w, w0 = run("int8", spike=True)
    assert torch.isfinite(w).all()
    assert abs(float(w[3] - w0[3])) < 0.1  # fp32: 0 (frozen); int8 clamped: ~4e7
    clean, _ = run("int8", spike=False)
    block = [i for i in range(256) if i != 3]  # its neighbours train as without the spike
    assert torch.allclose(w[block], clean[block], atol=2e-3), float((w - clean)[block].abs().max())


@pytest.mark.parametrize("numel", [1024, 1000])  # whole blocks; a partial last block
def test_one_nan_gradient_element_costs_one_weight_not_a_block(numel: int) -> None:
    """A NaN gradient element makes its weight NaN, with fp32 states as with
    torch.optim.AdamW: one weight. With 8-bit states its NaN moments made its block's
    scale NaN, and the next step all 256 weights of the block were NaN."""

    def run(state_dtype: str, bad: bool) -> torch.Tensor:
        torch.manual_seed(0)
        w = torch.randn(numel)
        opt = LayerwiseOptimizer(
            {0: {"w": w}}, schedule=LRSchedule(lr=1e-3), state_dtype=state_dtype, weight_decay=0.0
        )
        for step in range(1, 6):
            g = torch.randn(numel) * 1e-3
            if bad and step == 1:
                g[3] = float("nan")
                g[numel - 2] = float("nan")  # in the last block, partial when numel is 1000
            opt.step_layer(0, {"w": g}, step)
        return w

    for state_dtype in ("float32", "int8"):
        w = run(state_dtype, bad=True)
        nan = torch.isnan(w).nonzero().flatten().tolist()
        assert nan == [3, numel - 2], (state_dtype, len(nan))
        clean = run(state_dtype, bad=False)
        others = torch.ones(numel, dtype=torch.bool)
        others[[3, numel - 2]] = False
        assert torch.allclose(w[others], clean[others], atol=2e-3), state_dtype


def test_int8_states_keep_updates_near_the_learning_rate_across_gradient_scales() -> None:
    """Note [8-bit second moment]: gradients whose scales spread over a few orders of
    magnitude in one block (exp(1.5 x randn)). Stored as itself, an element's second
    moment below ~1.4e-7 of its block's largest rounded to zero while its first moment
    did not: updates of up to 127 x lr (Adam's are about lr) and 626% drift from fp32
    states. Stored as its root, it keeps up with the first moment."""
    n = 256 * 64
    torch.manual_seed(0)
    init = torch.randn(n)
    scale = torch.exp(1.5 * torch.randn(n))
    masters = {kind: {0: {"w": init.clone()}} for kind in ("float32", "int8")}
    opts = {
        kind: LayerwiseOptimizer(
            m, schedule=LRSchedule(lr=1e-3), weight_decay=0.0, state_dtype=kind, kernel="torch"
        )
        for kind, m in masters.items()
    }
    gen = torch.Generator().manual_seed(1)
    largest = 0.0
    for step in range(1, 61):
        g = torch.randn(n, generator=gen) * scale * 1e-3
        before = masters["int8"][0]["w"].clone()
        for opt in opts.values():
            opt.step_layer(0, {"w": g.clone()}, step)
        largest = max(largest, float((masters["int8"][0]["w"] - before).abs().max()) / 1e-3)
    assert largest < 2.0, largest  # fp32 states: about 1
    moved = masters["float32"][0]["w"] - init
    drift = (masters["int8"][0]["w"] - masters["float32"][0]["w"]).norm() / moved.norm()
    assert drift < 0.3, float(drift)
