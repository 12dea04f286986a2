"""StageExecutor: chunked loss, memory, statelessness, argument checks, streaming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import LORA_SPEC, batch, rel_err, split_rows, tiny_config  # noqa: E402

from roundpipe.shared.model import LayeredModel, count_label_tokens, shift_labels  # noqa: E402
from roundpipe.shared.plan import Plan  # noqa: E402
from roundpipe.worker.executor import (  # noqa: E402
    RngKey,
    StageExecutor,
    chunked_lm_head_loss,
)
from roundpipe.worker.reference import run_iteration  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_loss_matches_full_cross_entropy(dtype: torch.dtype, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g).to(dtype)
    weight = (torch.randn(50, 8, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, 50, (10,), generator=g)
    labels[[1, 4, 9]] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (h @ w.t()).float()
    ref = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / 13
    ref.backward()
    loss, gh, gw = chunked_lm_head_loss(
        hidden, weight, labels, num_label_tokens=13, chunk_tokens=chunk
    )
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert loss.dtype == torch.float32 and not loss.requires_grad
    torch.testing.assert_close(loss, ref.detach(), rtol=tol, atol=tol)
    assert gh.dtype == dtype and gw.dtype == torch.float32
    torch.testing.assert_close(gh.float(), h.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(gw, w.grad.float(), rtol=tol, atol=tol)
    assert not gh[[1, 4, 9]].any()
    none_loss, none_h, none_w = chunked_lm_head_loss(
        hidden, weight, torch.full((10,), -100), num_label_tokens=13, chunk_tokens=chunk
    )
    assert float(none_loss) == 0 and not none_h.any() and not none_w.any()


# Run in a fresh interpreter: ru_maxrss is the process's all-time peak, so only a new
# process measures the tail alone. The same process also runs a whole iteration with
# every weight in a read-only mapping, as workers see the shared-memory arenas: a
# single write into a weight would kill it with SIGSEGV.
_CHILD = textwrap.dedent(
    """
    import json, mmap, os, resource, sys
    import numpy as np
    import torch
    torch.set_num_threads(1)
    from transformers import LlamaConfig
    from roundpipe.shared.model import LayeredModel
    from roundpipe.shared.plan import Plan
    from roundpipe.worker.executor import StageExecutor

    from roundpipe.worker.reference import run_iteration

    out = {}
    # 1. Read-only weights.
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LayeredModel.from_config(cfg)
    weights = model.init_weights(0)
    path = sys.argv[1]
    flat = [(l, n, t) for l, per in weights.items() for n, t in per.items()]
    with open(path, "wb") as f:
        for _, _, t in flat:
            f.write(t.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    ro, off = {}, 0
    for l, n, t in flat:
        arr = np.frombuffer(mm, dtype=np.float32, count=t.numel(), offset=off).reshape(t.shape)
        off += t.numel() * 4
        ro.setdefault(l, {})[n] = torch.from_numpy(arr)
    ids = torch.randint(0, 64, (3, 8))
    ex = StageExecutor(model)
    plan = Plan.parse("F[0:1,1:3] T[3:4] B[2:3,0:2]")
    a = run_iteration(model, plan, ro, [(ids, ids)], ex)
    b = run_iteration(model, plan, weights, [(ids, ids)], ex)
    out["readonly_ok"] = a.loss == b.loss and all(torch.equal(a.grads[k], b.grads[k]) for k in b.grads)

    # 2. Peak memory of the tail at 8192 tokens x 32k vocab.
    cfg = LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LayeredModel.from_config(cfg)
    n = model.num_layers
    w = model.range_weights(model.init_weights(0), n - 1, n)
    ex = StageExecutor(model)
    x = torch.randn(8, 1024, 16)
    y = torch.randint(0, 32000, (8, 1024))
    ex.tail(n - 1, n, w, [x[:1, :16]], [y[:1, :16]], 15)  # warm up kernels and allocator
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = ex.tail(n - 1, n, w, [x], [y], int((y[:, 1:] != -100).sum()))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(peak_bytes=after - before, chunk_tokens=ex.chunk_tokens, loss=res.loss_sum,
               grad_shape=list(res.grad_inputs[0].shape))
    print("RESULT" + json.dumps(out))
    """
)


def test_tail_peak_memory_and_read_only_weights(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "arena.bin")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    print(out)
    assert out["readonly_ok"]
    full_logits = 8192 * 32000 * 4  # 1 GiB
    assert out["chunk_tokens"] * 32000 * 4 <= 128 * 2**20  # the default chunk budget
    # One chunk of fp32 logits is 128 MiB; allow slack for the allocator, but well under
    # the full logits (which alone would add 1 GiB, twice that with their gradient).
    assert out["peak_bytes"] < full_logits // 4, out
    assert out["grad_shape"] == [8, 1024, 16]
    assert 9.0 < out["loss"] < 12.0  # about ln(32000) for random weights


def _tiny(arch: str = "qwen3", lora: dict | None = None) -> tuple[LayeredModel, dict]:
    model = LayeredModel.from_config(tiny_config(arch), lora)
    return model, model.init_weights(seed=0)


def test_skeleton_holds_no_weights_after_tasks() -> None:
    model, weights = _tiny()
    ex = StageExecutor(model)
    ids, labels = batch(seed=1)
    run_iteration(
        model, Plan.parse("F[0:2,2:4] T[4:6] B[3:4,0:3]"), weights, split_rows(ids, labels, 3), ex
    )
    run_iteration(model, Plan.parse("F[] T[0:6] B[]"), weights, [(ids, labels)], ex)
    assert all(p.is_meta for p in model.skeleton.parameters())
    assert all(b.is_meta for b in model.skeleton.buffers())
    assert all(not p.requires_grad or p.grad is None for p in model.skeleton.parameters())


def test_forward_saves_boundaries_and_streams() -> None:
    model, weights = _tiny()
    ex = StageExecutor(model)
    ids, labels = batch(seed=2)
    mbs = [m[0] for m in split_rows(ids, labels, 3)]
    w = model.range_weights(weights, 0, 4)
    res = ex.forward(0, 4, w, mbs, save_layers={0, 2, 5})
    assert sorted(res.saved) == [0, 2]
    assert all(torch.equal(a, b) for a, b in zip(res.saved[0], mbs))  # layer 0 keeps ids
    assert [tuple(o.shape) for o in res.outputs] == [(3, 12, 32), (1, 12, 32), (3, 12, 32)]
    assert all(not o.requires_grad for o in res.outputs)
    # The saved input of layer 2 is what a stage starting there receives.
    mid = ex.forward(0, 2, model.range_weights(weights, 0, 2), mbs).outputs
    assert all(torch.equal(a, b) for a, b in zip(res.saved[2], mid))
    outs, saved = [], []
    streamed = ex.forward(
        0,
        4,
        w,
        mbs,
        save_layers=[2],
        on_output=lambda m, t: outs.append((m, t)),
        on_saved=lambda layer, m, t: saved.append((layer, m, t)),
    )
    assert streamed.outputs == [] and streamed.saved == {}
    assert [m for m, _ in outs] == [0, 1, 2] and [(la, m) for la, m, _ in saved] == [
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert all(torch.equal(t, res.outputs[m]) for m, t in outs)


def test_backward_is_idempotent_and_returns_trainable_only() -> None:
    model, weights = _tiny("llama", LORA_SPEC)
    ex = StageExecutor(model)
    ids, labels = batch(seed=3)
    mbs = split_rows(ids, labels, 3)
    fwd = ex.forward(0, 3, model.range_weights(weights, 0, 3), [m[0] for m in mbs], {1})
    grads = [torch.randn_like(o) for o in fwd.outputs]
    w = model.range_weights(weights, 1, 3)
    a = ex.backward(1, 3, w, fwd.saved[1], grads, rng=RngKey(1, 2))
    b = ex.backward(1, 3, w, fwd.saved[1], grads, rng=RngKey(1, 2))
    assert set(a.weight_grads) == {
        s.name for layer in (1, 2) for s in model.layer_params(layer) if s.trainable
    }
    assert all(torch.equal(a.weight_grads[n], b.weight_grads[n]) for n in a.weight_grads)
    assert all(torch.equal(x, y) for x, y in zip(a.grad_inputs, b.grad_inputs))
    assert all(g.dtype == torch.float32 for g in a.weight_grads.values())
    streamed: list[tuple[int, torch.Tensor]] = []
    c = ex.backward(
        1,
        3,
        w,
        fwd.saved[1],
        grads,
        rng=RngKey(1, 2),
        on_grad_input=lambda m, t: streamed.append((m, t)),
    )
    assert c.grad_inputs == [] and [m for m, _ in streamed] == [0, 1, 2]
    assert all(torch.equal(t, a.grad_inputs[m]) for m, t in streamed)
    assert all(torch.equal(a.weight_grads[n], c.weight_grads[n]) for n in a.weight_grads)
    # The LoRA prefix has nothing to learn and nothing upstream: an empty result.
    empty = ex.backward(
        0, 1, model.range_weights(weights, 0, 1), [m[0] for m in mbs], a.grad_inputs
    )
    assert empty.grad_inputs is None and empty.weight_grads == {}


def test_tail_microbatch_without_labels() -> None:
    model, weights = _tiny()
    ids, labels = batch(seed=4)
    labels[3:] = -100
    mbs = split_rows(ids, labels, 2)
    ex = StageExecutor(model)
    res = run_iteration(model, Plan.parse("F[0:5] T[5:6] B[0:5]"), weights, mbs, ex)
    assert res.microbatch_losses[1] == 0.0 and res.microbatch_losses[0] > 0
    # The tail streams input gradients like backward does.
    hidden = ex.forward(0, 4, model.range_weights(weights, 0, 4), [m[0] for m in mbs]).outputs
    tw = model.range_weights(weights, 4, 6)
    n = count_label_tokens(labels)
    plain = ex.tail(4, 6, tw, hidden, [m[1] for m in mbs], n)
    got: dict[int, torch.Tensor] = {}
    streamed = ex.tail(4, 6, tw, hidden, [m[1] for m in mbs], n, on_grad_input=got.__setitem__)
    assert streamed.grad_inputs == [] and sorted(got) == [0, 1]
    assert all(torch.equal(got[m], plain.grad_inputs[m]) for m in got)
    assert streamed.loss_sum == plain.loss_sum
    assert count_label_tokens(labels) == int((shift_labels(labels) != -100).sum())


def test_argument_errors() -> None:
    model, weights = _tiny()
    ex = StageExecutor(model)
    ids, labels = batch(seed=5)
    w = model.range_weights(weights, 0, 2)
    with pytest.raises(ValueError, match="runs only in the fused tail"):
        ex.forward(0, 6, model.range_weights(weights, 0, 6), [ids])
    with pytest.raises(ValueError, match="tail range 2:5 must be non-empty and end at 6"):
        ex.tail(2, 5, w, [ids], [labels], 10)
    with pytest.raises(ValueError, match="non-empty"):
        ex.forward(2, 2, w, [ids])
    with pytest.raises(KeyError, match="missing .* weight"):
        ex.forward(0, 3, w, [ids])
    with pytest.raises(TypeError, match="compute dtype"):
        StageExecutor(model, "cpu", torch.bfloat16).forward(0, 2, w, [ids])
    with pytest.raises(TypeError, match="input_ids"):
        ex.forward(0, 2, w, [ids.float()])
    hidden = ex.forward(0, 2, w, [ids]).outputs
    with pytest.raises(ValueError, match=r"hidden states \[rows, seq, 32\]"):
        ex.forward(2, 3, model.range_weights(weights, 2, 3), [ids])
    with pytest.raises(ValueError, match="2 saved inputs but 1 output gradients"):
        ex.backward(2, 3, model.range_weights(weights, 2, 3), hidden * 2, hidden)
    tw = model.range_weights(weights, 2, 6)
    with pytest.raises(ValueError, match="num_label_tokens must be >= 1"):
        ex.tail(2, 6, tw, hidden, [labels], 0)
    with pytest.raises(ValueError, match="labels of microbatch 0 have shape"):
        ex.tail(2, 6, tw, hidden, [labels[:, :5]], 10)
    with pytest.raises(ValueError, match="compute_dtype"):
        StageExecutor(model, "cpu", torch.float64)


@pytest.mark.parametrize(
    ("arch", "lora", "dtype", "dropout"),
    [
        ("qwen3", None, torch.float32, 0.0),
        ("llama", LORA_SPEC, torch.float32, 0.0),
        ("qwen3", None, torch.bfloat16, 0.1),
    ],
)
def test_layer_grain_recompute_gives_stage_grains_gradients_bitwise(
    arch: str, lora: dict | None, dtype: torch.dtype, dropout: float
) -> None:
    """Note [recompute grain]: the same input and weight gradients, bit for bit, from a
    stage that starts at the embedding and from one in the middle, dropout replayed."""
    model = LayeredModel.from_config(tiny_config(arch, attention_dropout=dropout), lora)
    weights = model.init_weights(seed=0, dtype=dtype)
    ex = StageExecutor(model, compute_dtype=dtype)
    ids, labels = batch(seed=5)
    mbs = [m[0] for m in split_rows(ids, labels, 2)]
    last = model.num_layers - 1
    fwd = ex.forward(0, last, model.range_weights(weights, 0, last), mbs, {2})
    grads = [torch.randn_like(o) for o in fwd.outputs]
    for start, inputs in ((0, mbs), (2, fwd.saved[2])):
        if start == 2:  # the gradient arriving at layer `last` comes from the tail
            grads = [torch.randn_like(o) for o in fwd.outputs]
        w = model.range_weights(weights, start, last)
        rng = RngKey(7, 3)
        by_stage = ex.backward(start, last, w, inputs, grads, rng=rng)
        by_layer = ex.backward(start, last, w, inputs, grads, rng=rng, recompute="layer")
        assert by_stage.weight_grads.keys() == by_layer.weight_grads.keys()
        for name, g in by_stage.weight_grads.items():
            assert torch.equal(g, by_layer.weight_grads[name]), name
        if start == 0:
            assert by_stage.grad_inputs is None and by_layer.grad_inputs is None
        else:
            assert all(
                torch.equal(a, b) for a, b in zip(by_stage.grad_inputs, by_layer.grad_inputs)
            )
    with pytest.raises(ValueError, match="recompute must be one of"):
        ex.backward(2, last, w, fwd.saved[2], grads, recompute="block")


def test_layer_grain_keeps_one_layers_saved_tensors_at_a_time() -> None:
    """What layer grain is for: autograd holds the saved tensors of one layer, not of
    the whole range, between two backward passes."""
    model, weights = _tiny()
    ex = StageExecutor(model)
    ids, labels = batch(seed=6)
    last = model.num_layers - 1
    fwd = ex.forward(0, last, model.range_weights(weights, 0, last), [ids], {1})
    grads = [torch.randn_like(o) for o in fwd.outputs]
    w = model.range_weights(weights, 1, last)

    def peak_saved(recompute: str) -> int:
        held, peak = 0, 0
        backprop = ex._backprop

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal held, peak
            held += t.numel() * t.element_size()
            peak = max(peak, held)
            return t

        def counted(*args, **kwargs):
            nonlocal held
            result = backprop(*args, **kwargs)
            held = 0  # the graph just backpropagated is freed
            return result

        ex._backprop = counted  # type: ignore[method-assign]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                ex.backward(1, last, w, fwd.saved[1], grads, recompute=recompute)
        finally:
            del ex._backprop
        return peak

    stage, layer = peak_saved("stage"), peak_saved("layer")
    layers = last - 1
    assert layer * (layers - 0.5) < stage, (stage, layer)


def _packed(*lengths: int) -> torch.Tensor:
    """One row's position ids for documents of ``lengths`` tokens packed together."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_dynamic_rotary_depends_on_its_own_microbatch_only() -> None:
    """Note [dynamic rotary]: transformers' dynamic NTK rotary keeps the table of the
    longest sequence it saw. Microbatch 0 (documents of 36 and 4 tokens: positions up to
    35) and 1 (up to 39) both pass the model's 32: a staged plan recomputed microbatch 0
    with microbatch 1's table (a weight gradient 2.7% off), and one forward task gave
    other outputs after a longer one had run."""
    config = tiny_config(
        "llama",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=32,
    )
    model = LayeredModel.from_config(config)
    weights = model.init_weights(seed=3)
    n = model.num_layers
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mbs = [(ids[:1], ids[:1].clone()), (ids[1:], ids[1:].clone())]
    positions = [_packed(36, 4), _packed(40)]
    fused, staged = (
        run_iteration(model, plan, weights, mbs, StageExecutor(model), position_ids=positions)
        for plan in (
            Plan(forward=(), tail=(0, n), backward=()),
            Plan(forward=((0, 2),), tail=(2, n), backward=((0, 2),)),
        )
    )
    for name, grad in fused.grads.items():
        assert rel_err(staged.grads[name], grad) < 1e-5, name
    w = model.range_weights(weights, 0, 3)
    fresh = StageExecutor(model).forward(0, 3, w, [ids[:1]], position_ids=[positions[0]])
    used = StageExecutor(model)
    used.forward(0, 3, w, [ids[1:]], position_ids=[positions[1]])  # a longer row first
    again = used.forward(0, 3, w, [ids[:1]], position_ids=[positions[0]])
    assert torch.equal(fresh.outputs[0], again.outputs[0])


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_an_interrupted_moe_task_leaves_no_router_logits_behind(kind: str) -> None:
    """A task stopped mid-microbatch (its job torn down: ``before_layer`` raises) drops
    the router logits it captured: kept, they held the microbatch's autograd graph and
    activations on the compute thread past the job's end."""
    from roundpipe.worker import executor as executor_module

    model = LayeredModel.from_config(
        tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    )
    assert model.router_aux is not None
    weights = model.init_weights(seed=0)
    ex = StageExecutor(model)
    ids, _ = batch(seed=4)
    fwd = ex.forward(0, 4, model.range_weights(weights, 0, 4), [ids], save_layers={1})
    calls = []

    def torn_down() -> None:
        calls.append(1)
        if len(calls) == 3:  # two decoder layers in: one of them routed
            raise RuntimeError("job torn down")

    ex.before_layer = torn_down
    with pytest.raises(RuntimeError, match="torn down"):
        if kind == "forward":
            ex.forward(0, 4, model.range_weights(weights, 0, 4), [ids])
        else:
            w = model.range_weights(weights, 1, 4)
            grads = [torch.randn_like(fwd.outputs[0])]
            counts = [torch.zeros(model.router_aux.num_experts)]
            ex.backward(
                1, 4, w, fwd.saved[1], grads, router_counts=counts, batch_tokens=ids.numel()
            )
    assert getattr(executor_module._ROUTER_LOGITS, "captured", None) is None


def test_dynamic_rotary_keyed_by_layer_type_depends_on_its_own_microbatch_only() -> None:
    """Note [dynamic rotary], Gemma 3's rotary (one table per layer type): growing adds
    ``full_attention_max_seq_len_cached``, which the reset left behind, so a later
    microbatch between the model's maximum and that length got the unscaled table."""
    config = tiny_config(
        "gemma3_text",
        max_position_embeddings=32,
        rope_parameters={
            "full_attention": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    model = LayeredModel.from_config(config)
    w = model.range_weights(model.init_weights(seed=3), 0, 3)
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    fresh = StageExecutor(model).forward(0, 3, w, [ids[:1]], position_ids=[_packed(36, 4)])
    used = StageExecutor(model)
    used.forward(0, 3, w, [ids[1:]], position_ids=[_packed(40)])  # a longer row first
    again = used.forward(0, 3, w, [ids[:1]], position_ids=[_packed(36, 4)])
    assert torch.equal(fresh.outputs[0], again.outputs[0])
