"""The compiled one-pass AdamW kernel is torch's fused AdamW bit for bit, its bf16 cast is
``copy_``'s, and the optimizer falls back to torch's kernel cleanly (Note [compiled AdamW
kernel])."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from runtime_helpers import tiny_spec

from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.training import adamw_kernel
from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer, LRSchedule


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """An optimizer with ``threads`` sets torch's process-wide thread count: put it back,
    or later tests in this process would train with another count (and other bits)
    than their subprocesses."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


kernel, why_not = adamw_kernel.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"no compiled kernel: {why_not}")

# Sizes with every kind of tail: none, shorter than 8, exactly 8, longer than 8, alone.
SIZES = (1, 7, 8, 9, 15, 16, 17, 16 * 33 + 8, 16 * 40 + 13, 4096 + 5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@needs_kernel
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95), (0.0, 0.5)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_kernel_is_bitwise_torch_fused_adamw(
    betas: tuple[float, float], weight_decay: float
) -> None:
    """Masters, moments, scaled gradients and the bf16 copy against ``torch._fused_adamw_``
    (what ``torch.optim.AdamW(fused=True)`` calls) then ``copy_``, over six steps, with a
    large learning rate (so the update is not lost in the master's rounding), gradients
    of mixed scales with zeros, and clipping on some steps. Each tensor is cut into
    ranges at odd places, as threads would be given them."""
    gen = torch.Generator().manual_seed(7)
    lr, eps = 3e-2, 1e-8
    for numel in SIZES:
        ref = [torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)]
        ours = [t.clone() for t in ref]
        out = torch.empty(numel, dtype=torch.bfloat16)
        step_t = torch.zeros(())
        cuts = sorted({0, numel, numel // 3, (2 * numel) // 3 + 1})
        for step in range(1, 7):
            scale = torch.tensor(0.5) if step % 3 == 0 else None
            grad = torch.randn(numel, generator=gen) * torch.logspace(-8, 0, numel)
            grad[::11] = 0.0
            g_ref = grad.clone()
            if scale is not None:
                g_ref.mul_(scale)  # what clip_grads_with_norm_ does
            step_t.add_(1)
            torch._fused_adamw_(
                [ref[0]], [g_ref], [ref[1]], [ref[2]], [], [step_t], amsgrad=False, lr=lr,
                beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                maximize=False,
            )  # fmt: skip
            c = adamw_kernel.constants(
                lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                step=step,
            )  # fmt: skip
            g = grad.clone()
            arrays = [adamw_kernel.flat_array(t) for t in (*ours[:1], g, *ours[1:], out)]
            s = None if scale is None else np.float32(scale.item())
            for lo, hi in zip(cuts, cuts[1:]):
                adamw_kernel.step_range(kernel, *arrays, lo, hi, c, s)
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
                assert torch.equal(_bits(a), _bits(b)), (numel, step, name)
            assert torch.equal(_bits(g), _bits(g_ref)), (numel, step, "grad")
            assert torch.equal(_bits(out), _bits(ref[0].to(torch.bfloat16))), (numel, step)


@needs_kernel
def test_bf16_cast_is_torch_copy_including_nan_inf_denormals_and_ties() -> None:
    """The kernel's bf16 bits equal ``copy_``'s for special values: a zero step (lr tiny,
    moments zero, gradient zero) leaves each master as it was, so the cast sees them."""
    special = [0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001]
    special += [0x80000001, 0x007FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x80000000]
    rng = np.random.default_rng(0)
    bits = np.concatenate([np.array(special, np.uint32), rng.integers(0, 2**32, 4000, np.uint32)])
    for numel in (len(special), len(bits)):  # all tail, then mostly vector body
        master = torch.from_numpy(bits[:numel].view(np.float32).copy())
        expected = master.to(torch.bfloat16)
        grad, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
        out = torch.empty(numel, dtype=torch.bfloat16)
        c = adamw_kernel.constants(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, step=1)
        arrays = [adamw_kernel.flat_array(t) for t in (master, grad, m, v, out)]
        adamw_kernel.step_range(kernel, *arrays, 0, numel, c)
        assert torch.equal(_bits(out), _bits(expected))


@needs_kernel
def test_division_by_the_step_constant_is_correctly_rounded() -> None:
    """Note [division by a constant]: the division-free quotient equals ``a / b`` for
    sqrt outputs ``a`` (every float32 in one binade, and random ones over the whole range
    from sqrt of the smallest denormal to sqrt of the largest float, plus 0, inf, NaN),
    for the bias corrections of common betas and steps and for random divisors."""
    from roundpipe.coordinator.training.adamw_numba import quotient_array

    rng = np.random.default_rng(1)
    divisors = [
        np.float32(math.sqrt(1 - beta2 ** float(step)))
        for beta2 in (0.999, 0.99, 0.95)
        for step in (1, 2, 3, 10, 1000)
    ]
    divisors += list(rng.uniform(1e-3, 1.0, 8).astype(np.float32)) + [np.float32(1.0)]
    lo = np.float32(math.sqrt(np.float32(1.4e-45))).view(np.uint32)
    hi = np.float32(math.sqrt(np.finfo(np.float32).max)).view(np.uint32)
    one_binade = np.arange(0x3F800000, 0x40000000, dtype=np.uint32)
    anywhere = rng.integers(lo, hi + 1, 1 << 21, dtype=np.uint32)
    special = np.array([0, 0x7F800000, 0x7FC00000, 0x7FC12345], dtype=np.uint32)
    a = np.concatenate([one_binade, anywhere, special]).view(np.float32)
    for b in divisors:
        got = quotient_array(a, b, np.float32(1.0) / b)
        with np.errstate(invalid="ignore"):
            expected = a / b
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), b


def test_split_covers_every_element_once_on_unit_boundaries() -> None:
    sizes = [5, 1 << 20, 17, 3 * (1 << 18) + 3, 1]
    for threads in (1, 2, 3, 8):
        shares = adamw_kernel.split(sizes, threads)
        assert 1 <= len(shares) <= threads
        seen = [np.zeros(s, dtype=int) for s in sizes]
        for share in shares:
            for i, lo, hi in share:
                assert lo < hi
                seen[i][lo:hi] += 1
                assert lo % adamw_kernel.UNIT == 0 or lo == 0
        assert all((s == 1).all() for s in seen)
    assert len(adamw_kernel.split([1000], 4)) == 1  # too small to share


def _layers() -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return {
        0: {
            "w": torch.randn(300, 129, generator=gen),
            "norm.weight": torch.randn(129, generator=gen),
        },
        1: {"w": torch.randn(1000, 131, generator=gen)},
    }


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_optimizer_on_the_kernel_equals_the_torch_kernel(threads: int) -> None:
    """kernel="auto" (compiled) against kernel="torch" (the chunked torch path), several
    steps with weight-decay groups, clipping and bf16 outs: bitwise everywhere."""
    sched = LRSchedule(lr=1e-2, schedule="cosine", warmup_steps=1, total_steps=5)
    runs = {}
    for kind in ("auto", "torch"):
        w = _layers()
        opt = LayerwiseOptimizer(
            w, schedule=sched, weight_decay=0.1, grad_clip=1.0, no_decay=("norm",),
            threads=threads, kernel=kind,
        )  # fmt: skip
        outs = {
            i: {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in d.items()}
            for i, d in w.items()
        }
        gen = torch.Generator().manual_seed(11)
        for step in range(1, 5):
            grads = {
                i: {n: torch.randn(t.shape, generator=gen) for n, t in d.items()}
                for i, d in w.items()
            }
            opt.step_layers(grads, step, clip_coef=torch.tensor(0.25), outs=outs)
        runs[kind] = (opt.kernel_in_use, w, outs, opt.state_dict()["tensors"])
    assert runs["auto"][0] == "compiled" and runs["torch"][0] == "torch"
    for i in (1, 2, 3):
        a, b = runs["auto"][i], runs["torch"][i]
        if i == 3:
            assert all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert all(torch.equal(a[layer][n], b[layer][n]) for layer in a for n in a[layer])


def test_falls_back_to_torch_with_one_log_line(monkeypatch, caplog) -> None:
    monkeypatch.setattr(adamw_kernel, "load", lambda: (None, "numba is not installed (test)"))
    with caplog.at_level(logging.WARNING):
        opt = LayerwiseOptimizer(_layers(), schedule=LRSchedule(lr=0.1))
    assert opt.kernel_in_use == "torch"
    lines = [r.getMessage() for r in caplog.records if "compiled AdamW kernel" in r.getMessage()]
    assert len(lines) == 1 and "numba is not installed (test)" in lines[0]
    opt.step_layers(
        {i: {n: torch.ones_like(t) for n, t in d.items()} for i, d in _layers().items()}, 1
    )


@needs_kernel
def test_a_kernel_that_disagrees_with_torch_is_not_used(monkeypatch, caplog) -> None:
    monkeypatch.setattr(adamw_kernel, "self_check", lambda *a, **k: False)
    with caplog.at_level(logging.WARNING):
        opt = LayerwiseOptimizer(_layers(), schedule=LRSchedule(lr=0.1))
    assert opt.kernel_in_use == "torch"
    assert "differ from this torch build" in caplog.text


def test_kernel_choice_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        LayerwiseOptimizer(_layers(), schedule=LRSchedule(lr=0.1), kernel="numba")
    with pytest.raises(JobSpecError, match=r"optimizer\.kernel.*'auto', 'torch'"):
        tiny_spec(tmp_path, optimizer={"kernel": "fast"})
    spec = tiny_spec(tmp_path, optimizer={"kernel": "torch"})
    assert LayerwiseOptimizer.from_spec(spec, _layers()).kernel_in_use == "torch"
    # SGD and int8 states keep torch's kernels whatever the choice.
    sgd = LayerwiseOptimizer(_layers(), schedule=LRSchedule(lr=0.1), algorithm="sgd")
    int8 = LayerwiseOptimizer(_layers(), schedule=LRSchedule(lr=0.1), state_dtype="int8")
    assert sgd.kernel_in_use == int8.kernel_in_use == "torch"


@needs_kernel
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_special_values_match_torch(weight_decay: float) -> None:
    """Every (master, gradient) pair of zeros of both signs, denormals, infinities, NaN
    and ordinary values, placed in the vector body and in both kinds of tail: every
    non-NaN result is torch's bit for bit, NaN exactly where torch has NaN, and the bf16
    copy is ``copy_``'s (Note [compiled AdamW kernel], NaNs)."""
    values = [0.0, -0.0, 1e-40, -1e-40, math.inf, -math.inf, math.nan, 1.0, -3.0, 1e30]
    pairs = torch.tensor([(p, g) for p in values for g in values])
    for numel in (len(pairs), len(pairs) + 16 * 3 + 9):  # tail of 4, then of 13
        master, grad = torch.ones(numel), torch.ones(numel)
        at = torch.arange(len(pairs)) + (numel - len(pairs))  # the pairs end the tensor
        master[at], grad[at] = pairs[:, 0], pairs[:, 1]
        ref = [master.clone(), torch.zeros(numel), torch.zeros(numel)]
        ours = [t.clone() for t in ref]
        out = torch.empty(numel, dtype=torch.bfloat16)
        step_t = torch.zeros(())
        for step in (1, 2):
            step_t.add_(1)
            torch._fused_adamw_(
                [ref[0]], [grad.clone()], [ref[1]], [ref[2]], [], [step_t], amsgrad=False,
                lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8,
                maximize=False,
            )  # fmt: skip
            c = adamw_kernel.constants(
                lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, step=step
            )
            arrays = [adamw_kernel.flat_array(t) for t in (ours[0], grad.clone(), *ours[1:], out)]
            adamw_kernel.step_range(kernel, *arrays, 0, numel, c)
            for a, b in zip(ours, ref):
                assert torch.equal(a.isnan(), b.isnan()), step
                numbers = ~a.isnan()
                assert torch.equal(_bits(a)[numbers], _bits(b)[numbers]), step
            assert torch.equal(_bits(out), _bits(ref[0].to(torch.bfloat16)))
