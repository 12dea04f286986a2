"""The partitioner: plan validity, memory, asymmetry, errors, mixed GPUs, profiles, CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from model_helpers import ALL_ARCHS, tiny_config

from roundpipe.coordinator.planning.costs import LayerCost, estimate_costs
from roundpipe.coordinator.planning.hardware import HardwareSpec, cpu_hardware
from roundpipe.coordinator.planning.profile import ProfileAggregator
from roundpipe.coordinator.planning.search import (
    evaluate_plan,
    initial_plan,
    plan_stages,
    replan_if_better,
)
from roundpipe.plan_command import describe, plan_main
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import GiB, MiB, parse_quantity

BIG = 1 << 50  # "unlimited" memory


def layer(
    f: float = 1.0,
    b: float | None = None,
    *,
    p: int = 0,
    g: int | None = None,
    act: int = 0,
    work: int = 0,
    name: str = "",
) -> LayerCost:
    return LayerCost(
        forward_s=f,
        backward_s=3 * f if b is None else b,
        param_bytes=p,
        grad_bytes=2 * p if g is None else g,
        activation_bytes=act,
        work_bytes=work,
        forward_work_bytes=work // 4,
        name=name,
    )


def hw(n: int = 4, mem: int = BIG, **kw) -> HardwareSpec:
    kw.setdefault("reserved_bytes", 0)
    return HardwareSpec(num_workers=n, memory_limit_bytes=mem, **kw)


def llm_costs(n_decoder: int = 16, head: float = 6.0, **kw) -> list[LayerCost]:
    """A prefix, equal decoder layers and an LM head ``head`` times a decoder layer."""
    return (
        [layer(0.01, p=kw.get("p_embed", 0))]
        + [layer(1.0, p=kw.get("p", 0), act=kw.get("act", 0), work=kw.get("work", 0))] * n_decoder
        + [layer(head, p=kw.get("p_embed", 0))]
    )


@pytest.fixture(scope="module")
def tiny_qwen() -> LayeredModel:
    return LayeredModel(tiny_config("qwen3"))


# ------------------------------------------------------------------- search results


def test_hand_computed_objective() -> None:
    # 5 layers, forward 1, backward 3, M = 1, 2 workers, no bytes. Tail [4:5] costs 3, so
    # the cap is >= 3: B needs 4 single layers, F 2 stages (the min-max split of 4 layers
    # in 2 is [0:2],[2:4]): 7 stages x 3 = 21, better than any other cap or tail (cap 4:
    # F[0:4] + 4 single B = 6 x 4; two-layer tail: 4 stages x 6; whole model: 2 x 15).
    costs = [layer(1.0)] * 5
    r = plan_stages(costs, hw(2), 1, select="objective")
    assert str(r.plan) == "F[0:2,2:4] T[4:5] B[3:4,2:3,1:2,0:1]"
    assert r.objective_s == pytest.approx(21.0)
    assert r.stage_times == pytest.approx((2, 2, 3, 3, 3, 3, 3))


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_plan_is_valid_for_the_model(arch: str) -> None:
    model = LayeredModel(tiny_config(arch))
    costs = estimate_costs(
        model, microbatch_rows=2, seq_len=64, compute_dtype="float32", flops_per_s=1e12
    )
    assert len(costs) == model.num_layers
    assert all(c.forward_s > 0 and c.backward_s > c.forward_s for c in costs)
    r = plan_stages(costs, hw(3), 4, tokens_per_iteration=4 * 2 * 64)
    r.plan.validate(model.num_layers)
    assert len(r.stages) == len(r.plan.stages())
    assert r.predicted_iteration_s > 0 and r.predicted_tokens_per_s > 0
    assert [e.label for e in r.stages][len(r.plan.forward)] == "T"


def test_one_worker_fuses_the_whole_model() -> None:
    # One worker: every stage runs on it in turn, so the fewest, largest stages win; a
    # whole-model tail skips the separate forward pass entirely.
    r = plan_stages(llm_costs(8, head=2.0), hw(1), 2)
    assert r.plan == Plan(forward=(), tail=(0, 10), backward=())


def test_more_workers_more_stages() -> None:
    costs = llm_costs(24, head=3.0)
    counts = [len(plan_stages(costs, hw(n), n + 1).stages) for n in (1, 2, 4, 8)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert counts[-1] >= 8


def test_heavier_backward_gets_more_backward_stages() -> None:
    costs = llm_costs(24, head=3.0)
    r = plan_stages(costs, hw(8), 9)
    assert len(r.plan.backward) > len(r.plan.forward)
    # Asymmetric: backward stages hold fewer layers.
    fwd_sizes = [b - a for a, b in r.plan.forward]
    bwd_sizes = [b - a for a, b in r.plan.backward]
    assert max(bwd_sizes) < max(fwd_sizes)
    # Balanced: no stage is far below the slowest (the tail sets the cap here).
    assert max(r.stage_times) <= 1.35 * min(
        t for t, e in zip(r.stage_times, r.stages) if e.kind == "B"
    )


def test_memory_limit_is_respected_and_forces_smaller_stages() -> None:
    costs = llm_costs(16, head=2.0, p=1 * GiB, act=16 * MiB, work=512 * MiB, p_embed=2 * GiB)
    loose = plan_stages(costs, hw(4), 5)
    tight_limit = 24 * GiB
    tight = plan_stages(costs, hw(4, mem=tight_limit, reserved_bytes=GiB), 5)
    for r, limit in ((tight, tight_limit),):
        assert max(r.per_stage_memory) <= limit
        assert max(r.per_worker_memory) <= limit
    # Each stage holds its weights + fp32 grads (3 GiB per decoder layer in B stages):
    # with two stages resident, backward stages of at most a few layers fit.
    assert len(tight.plan.backward) > len(loose.plan.backward)
    assert max(b - a for a, b in tight.plan.backward) <= 3
    for e in tight.stages:
        largest = max(x.resident_bytes for x in tight.stages)
        assert e.memory_bytes == e.run_bytes + largest + GiB


def test_a_layer_too_big_for_one_gpu_is_named() -> None:
    costs = llm_costs(4) + []
    costs[3] = layer(1.0, p=10 * GiB, work=GiB, name="model.layers.2")
    with pytest.raises(ValueError, match=r"layer 3 \(model\.layers\.2\) does not fit") as e:
        plan_stages(costs, hw(2, mem=24 * GiB, reserved_bytes=GiB), 3)
    text = str(e.value)
    assert "weights 10.0 GiB" in text and "fp32 gradients 20.0 GiB" in text
    assert "limit is 24.0 GiB" in text


def test_no_fit_with_prefetch_is_explained() -> None:
    # Each layer fits alone (8 GiB of weights + grads) but not next to a prefetched one.
    costs = [layer(1.0, p=3 * GiB, g=5 * GiB)] * 4
    with pytest.raises(ValueError, match="no plan fits 12.0 GiB per GPU.*prefetched"):
        plan_stages(costs, hw(2, mem=12 * GiB), 3)
    # The layer named is the one that binds, its need counted with the prefetched
    # stage: here the tail (it named layer 0, whose need was under the limit).
    heavy_tail = [layer(1.0, p=GiB, g=GiB)] * 3 + [layer(1.0, p=GiB, g=GiB, work=8 * GiB)]
    with pytest.raises(ValueError) as e:
        plan_stages(heavy_tail, hw(2, mem=10 * GiB, reserved_bytes=0), 3)
    text = str(e.value)
    assert "the tail's layer 3" in text, text
    need = parse_quantity(text.split("alone needs about ")[1].split(" that way")[0])
    assert need > 10 * GiB, text


def test_transfer_time_counts() -> None:
    # Slow PCIe: uploading a layer's weights (4.3 s) takes longer than its forward of
    # two microbatches (2 s).
    costs = llm_costs(8, head=2.0, p=4 * GiB)
    slow = hw(4, bandwidth_bytes_per_s=1e9)
    r = plan_stages(costs, slow, 2)
    assert any(e.bound == "upload" for e in r.stages)
    uploads = sum(e.upload_s for e in r.stages)
    assert r.predicted_iteration_s >= uploads / 4 * 0.95
    fast = plan_stages(costs, hw(4), 2)
    assert fast.predicted_iteration_s < r.predicted_iteration_s


def test_mixed_speed_workers() -> None:
    costs = llm_costs(24, head=3.0)
    m = 9
    uniform = plan_stages(costs, hw(4), m)
    mixed_hw = hw(4, speeds=(1.0, 1.0, 0.5, 0.5))
    mixed = plan_stages(costs, mixed_hw, m)
    mixed.plan.validate(len(costs))
    slow = plan_stages(costs, hw(4, speeds=(0.5,) * 4), m)
    assert uniform.predicted_iteration_s < mixed.predicted_iteration_s < slow.predicted_iteration_s
    # Better than the plan made for equal GPUs, run on the mixed ones.
    naive = evaluate_plan(uniform.plan, costs, mixed_hw, m)
    assert mixed.predicted_iteration_s <= naive.predicted_iteration_s
    assert any("mixed worker speeds" in n for n in mixed.notes)
    with pytest.raises(ValueError, match="speeds lists 2 workers"):
        hw(4, speeds=(1.0, 0.5))


def test_estimates_track_the_model(tiny_qwen: LayeredModel) -> None:
    kw = dict(microbatch_rows=1, compute_dtype="bfloat16", flops_per_s=100e12)
    short = estimate_costs(tiny_qwen, seq_len=64, **kw)
    long = estimate_costs(tiny_qwen, seq_len=256, **kw)
    n = tiny_qwen.num_layers
    for i in range(1, n - 1):
        assert long[i].forward_s > 4 * short[i].forward_s * 0.99  # attention is quadratic
        assert long[i].activation_bytes == 256 * tiny_qwen.hidden_size * 2
        assert long[i].param_bytes == 2 * sum(s.numel for s in tiny_qwen.layer_params(i))
        assert long[i].grad_bytes == 2 * long[i].param_bytes
    assert short[0].activation_bytes == 64 * 8  # token ids
    lora = LayeredModel(tiny_config("qwen3"), {"r": 4, "alpha": 8})
    lc = estimate_costs(lora, seq_len=64, **kw)
    assert lc[0].backward_s == 0.0 and lc[0].grad_bytes == 0  # frozen embedding, no adapters
    assert lc[1].grad_bytes < short[1].grad_bytes / 4
    assert lc[1].backward_s < short[1].backward_s  # no weight gradients of the base


def test_the_tail_holds_the_logits_chunk_its_workers_use() -> None:
    """A GPU worker's chunked LM head holds 4,096 tokens of fp32 logits at a time (2.3 GiB
    at Qwen3's vocabulary), a CPU worker's 128 MiB: the planner prices the one the job's
    workers use (shared.logits_chunks, as the executor chunks)."""
    from roundpipe.shared.logits_chunks import logits_chunk_tokens
    from roundpipe.worker.executor import StageExecutor

    vocab = 151_936
    model = LayeredModel(tiny_config("qwen3", vocab_size=vocab))
    kw = dict(microbatch_rows=1, seq_len=8192, compute_dtype="bfloat16", flops_per_s=100e12)
    gpu, cpu = estimate_costs(model, **kw), estimate_costs(model, on_gpu=False, **kw)
    rest = gpu[-1].work_bytes - 4096 * vocab * 6  # fp32 chunk + its bf16 matmul output
    assert rest == cpu[-1].work_bytes - (128 * MiB // (4 * vocab)) * vocab * 6
    assert 0 < rest < 8192 * model.hidden_size * 16
    assert StageExecutor(model).chunk_tokens == logits_chunk_tokens(vocab, on_gpu=False)
    # a sequence shorter than a chunk holds only its own tokens' logits
    short = estimate_costs(model, **{**kw, "seq_len": 1024})
    assert short[-1].work_bytes - (1024 * vocab * 6) == 1024 * model.hidden_size * (3 * 2 + 8)


def test_initial_plan_for_cpu_and_gpu_workers_price_their_own_logits_chunk() -> None:
    vocab = 151_936
    model = LayeredModel(tiny_config("qwen3", vocab_size=vocab))
    kw = dict(microbatch_rows=1, seq_len=2048, num_microbatches=2, compute_dtype="float32")
    gpu = initial_plan(model, hw(2), **kw)
    cpu = initial_plan(model, cpu_hardware(2), **kw)
    cpu_chunk = 128 * MiB // (4 * vocab)  # 220 tokens; a GPU's chunk takes all 2,048
    assert gpu.costs[-1].work_bytes - cpu.costs[-1].work_bytes == (2048 - cpu_chunk) * vocab * 4


def test_replan_only_when_clearly_better() -> None:
    costs = llm_costs(16, head=2.0)
    h = hw(4)
    best = plan_stages(costs, h, 5)
    assert replan_if_better(best.plan, costs, h, 5) is None
    bad = Plan.uniform(18, num_forward=1, num_backward=1, tail_layers=1)
    new = replan_if_better(bad, costs, h, 5)
    assert new is not None and new.plan != bad


def test_describe_lists_every_stage() -> None:
    r = plan_stages(llm_costs(8, head=2.0), hw(2), 3, tokens_per_iteration=3000)
    text = describe(r)
    assert str(r.plan) in text
    for e in r.stages:
        assert f"\n{e.label} " in text
    assert "tokens/s" in text and "peak memory per worker" in text


def test_initial_plan_for_cpu_workers(tiny_qwen: LayeredModel) -> None:
    r = initial_plan(
        tiny_qwen,
        cpu_hardware(2),
        microbatch_rows=2,
        seq_len=16,
        num_microbatches=3,
        compute_dtype="float32",
    )
    r.plan.validate(tiny_qwen.num_layers)
    assert len(r.costs) == tiny_qwen.num_layers and r.hardware is not None
    assert r.tokens_per_iteration == 3 * 2 * 16
    ProfileAggregator(r.costs, 3)  # the prior for re-planning


def test_slow_cpu_optimizer_throttles_and_sync_is_slower() -> None:
    costs = llm_costs(16, head=2.0, p=GiB)  # 0.5 G trainable parameters per decoder layer
    fast = plan_stages(costs, hw(4), 5)
    slow_hw = hw(4, optimizer_params_per_s=2e7)  # 27 s per decoder layer
    throttled = evaluate_plan(fast.plan, costs, slow_hw, 5)
    assert throttled.predicted_iteration_s > 2 * fast.predicted_iteration_s
    assert any("CPU optimizer" in n for n in throttled.notes)
    some_hw = hw(4, optimizer_params_per_s=2e9)
    sync = evaluate_plan(fast.plan, costs, some_hw, 5, staleness=0)
    asyn = evaluate_plan(fast.plan, costs, some_hw, 5, staleness=1)
    assert sync.predicted_iteration_s > asyn.predicted_iteration_s


# ----------------------------------------------------------------- measured profiles


def test_profile_aggregator_ema_warmup_and_settling() -> None:
    prior = [layer(1.0, 3.0), layer(1.0, 3.0), layer(2.0, 6.0)]
    agg = ProfileAggregator(prior, num_microbatches=2, alpha=0.5, settle_iterations=2)

    def iteration(k: int, f: float, b: float) -> None:
        # Per task seconds for all 2 microbatches.
        agg.record(k, "forward", {"0.fwd": 2 * f, "1.fwd": 2 * f})
        agg.record(k, "tail", {"2": 2 * 2 * b})
        agg.record(k, "backward", {"1.fwd": 2 * f, "1.bwd": 2 * (b - f), "0": 2 * b})
        agg.end_iteration(k)

    iteration(1, 100.0, 100.0)  # warm-up: dropped
    assert agg.ema == {}
    iteration(2, 0.5, 2.0)
    assert agg.ema[(0, "fwd")] == pytest.approx(0.5)
    assert agg.ema[(1, "bwd")] == pytest.approx(2.0)
    assert agg.ema[(2, "bwd")] == pytest.approx(4.0)
    assert not agg.settled
    iteration(3, 1.5, 2.0)
    assert agg.ema[(0, "fwd")] == pytest.approx(1.0)  # 0.5 * 1.5 + 0.5 * 0.5
    assert not agg.settled
    for k in (4, 5, 6, 7, 8, 9):
        iteration(k, 1.0, 2.0)
    assert agg.last_change is not None and agg.last_change < 0.05
    assert agg.settled
    costs = agg.costs()
    assert costs[0].forward_s == pytest.approx(1.0, rel=0.05)
    assert costs[1].backward_s == pytest.approx(2.0)
    # Layer 2 only ran in the tail: forward inferred from the prior's 1:3 ratio.
    assert costs[2].forward_s == pytest.approx(4.0 / 3)
    assert costs[2].param_bytes == prior[2].param_bytes


def test_profile_aggregator_normalises_speed_and_fills_gaps() -> None:
    prior = [layer(1.0, 3.0)] * 3
    agg = ProfileAggregator(prior, num_microbatches=4, warmup_iterations=0)
    # A half-speed worker takes twice as long: its 8 s for 4 microbatches count as 1 s.
    agg.record(1, "F", {"0.fwd": 8.0}, worker_speed=0.5)
    agg.record(1, "B", {"0": 24.0}, worker_speed=0.5)
    agg.record(1, "B", {"junk": 1.0, "99": 5.0})  # ignored
    agg.end_iteration(1)
    assert agg.ema[(0, "fwd")] == pytest.approx(1.0)
    assert not agg.covered  # layers 1 and 2 were never measured
    costs = agg.costs()
    assert costs[1].forward_s == pytest.approx(1.0)  # median measured/prior ratio (1.0)
    with pytest.raises(ValueError, match="unknown task kind"):
        agg.record(1, "sideways", {})


def test_profile_aggregator_task_messages_and_lora_prefix() -> None:
    # LoRA's prefix has no backward (prior backward_s == 0): settling does not wait for it.
    prior = [layer(0.1, 0.0), layer(1.0, 3.0), layer(2.0, 6.0)]
    agg = ProfileAggregator(prior, num_microbatches=3, warmup_iterations=0)
    for k in (1, 2, 3):
        fwd = SimpleNamespace(iteration=k, kind="forward", num_microbatches=3)
        bwd = SimpleNamespace(iteration=k, kind="backward", num_microbatches=3)
        tail = SimpleNamespace(iteration=k, kind="tail", num_microbatches=3)
        agg.record_done(fwd, SimpleNamespace(layer_times={"0.fwd": 0.3, "1.fwd": 3.0}))
        agg.record_done(tail, SimpleNamespace(layer_times={"2.fwd": 6.0, "2.bwd": 12.0}))
        agg.record_done(bwd, SimpleNamespace(layer_times={"1": 9.0}))
        agg.end_iteration(k)
    assert agg.settled
    assert agg.ema[(2, "bwd")] == pytest.approx(6.0)
    assert [c.backward_s for c in agg.costs()] == pytest.approx([0.0, 3.0, 6.0])


def test_replanning_from_measurements_changes_the_plan() -> None:
    # The cold start thought the head was cheap; measurements say it is 6 layers' worth.
    prior = llm_costs(16, head=1.0)
    h = hw(4)
    cold = plan_stages(prior, h, 5)
    agg = ProfileAggregator(prior, num_microbatches=5, warmup_iterations=0)
    measured = llm_costs(16, head=6.0)
    for k in (1, 2, 3, 4):
        for i, c in enumerate(measured):
            agg.record(k, "forward", {f"{i}.fwd": 5 * c.forward_s})
            agg.record(k, "backward", {f"{i}": 5 * c.backward_s})
        agg.end_iteration(k)
    assert agg.settled
    new = replan_if_better(cold.plan, agg.costs(), h, 5)
    assert new is not None
    assert (
        new.predicted_iteration_s
        < evaluate_plan(cold.plan, agg.costs(), h, 5).predicted_iteration_s
    )


# ----------------------------------------------------------------------------- CLI


def test_parse_quantity() -> None:
    assert parse_quantity("24GiB") == 24 * GiB
    assert parse_quantity("25GB/s") == 25e9
    assert parse_quantity("165T") == 165e12
    assert parse_quantity("82.6TFLOPS") == pytest.approx(82.6e12)
    assert parse_quantity("3e9") == 3e9
    with pytest.raises(ValueError, match="cannot read"):
        parse_quantity("lots")


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--architecture",
        "qwen3",
        "--set",
        "hidden_size=64",
        "--set",
        "intermediate_size=128",
        "--set",
        "num_hidden_layers=6",
        "--set",
        "num_attention_heads=4",
        "--set",
        "num_key_value_heads=2",
        "--set",
        "vocab_size=1000",
        "--workers",
        "3",
        "--seq-len",
        "128",
        "--flops",
        "1T",
        "--compare",
        "--grid",
    ]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "SIMULATED PREDICTION" in out
    assert "tokens/s" in out and "bubble" in out and "peak memory per worker" in out
    assert "gpipe" in out and "1f1b" in out
    assert "w0: " in out
    assert plan_main(args + ["--memory-limit", "2MiB", "--reserve", "0"]) == 2
    err = capsys.readouterr().err
    assert "does not fit one GPU" in err
    assert plan_main(["--workers", "2", "--seq-len", "8"]) == 2  # no model given
    capsys.readouterr()
    assert plan_main(args + ["--microbatches", "0"]) == 2  # not N + 1 in silence
    assert "--microbatches must be >= 1" in capsys.readouterr().err


def test_plan_command_prints_the_host_memory_admission_checks(capsys) -> None:
    """`roundpipe plan` gives the host-memory figure the coordinator checks a job
    against (roundpipe.coordinator.training.memory), for the plan it chose."""
    import json

    import torch

    from roundpipe.coordinator.training.job_planner import replan_pool_capacity
    from roundpipe.coordinator.training.layout import JobLayout
    from roundpipe.coordinator.training.memory import host_memory_needed
    from roundpipe.shared.model import LayeredModel

    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6}
    config |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    sets = [x for k, v in config.items() for x in ("--set", f"{k}={v}")]
    args = ["--architecture", "qwen3", *sets, "--workers", "2", "--seq-len", "256"]
    assert plan_main(args + ["--microbatch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "this job needs" in out and "of host memory (arenas" in out
    assert "bytes per parameter" in out
    assert plan_main(args + ["--microbatch-size", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    model = LayeredModel.from_config({"model_type": "qwen3", **config})
    layout = JobLayout.plan_layout(
        model,
        Plan.parse(doc["plan"]),
        compute_dtype=torch.bfloat16,
        microbatch_rows=2,
        seq_len=256,
        num_microbatches=3,
        grad_buffer_layers=JobLayout.grad_buffer_layers_for(Plan.parse(doc["plan"]), 2),
        # the planner's plan: the job may re-plan, so its slot pools have headroom
        **replan_pool_capacity(model.num_layers, Plan.parse(doc["plan"])),
    )
    need = host_memory_needed(layout)
    host = doc["host_memory"]
    assert host["arenas"] == need.arenas
    assert {k: host[k] for k in need.components()} == need.components()
    params = sum(p.numel() for p in model.hf_model(seed=0).parameters())
    assert host["bytes_per_parameter"] == pytest.approx(need.total / params)


def test_layer_grain_holds_one_layers_work_for_one_more_forward() -> None:
    """Note [recompute grain]: a multi-layer backward stage at layer grain keeps each
    layer's input and one layer's saved tensors, and computes one more forward."""
    from roundpipe.coordinator.planning.costs import CostModel

    costs = llm_costs(8, act=64 * MiB, work=1 * GiB)
    stage = CostModel(costs, hw(4), 5, "stage").parts("B", 1, 5)
    by_layer = CostModel(costs, hw(4), 5, "layer").parts("B", 1, 5)
    assert stage[4] - by_layer[4] == 4 * GiB - (1 * GiB + 3 * 64 * MiB)  # run bytes
    assert by_layer[0] == pytest.approx(stage[0] + 5 * 4 * 1.0)  # M x one more forward
    with pytest.raises(ValueError, match="recompute must be one of"):
        CostModel(costs, hw(4), 5, "block")


def test_auto_recompute_takes_layer_grain_where_it_predicts_faster() -> None:
    # Saved tensors dominate (6 GiB per layer): at stage grain a backward stage of six
    # decoder layers cannot fit 24 GiB; at layer grain it can.
    costs = llm_costs(16, head=2.0, p=64 * MiB, act=32 * MiB, work=6 * GiB)
    limited = hw(4, mem=24 * GiB, reserved_bytes=GiB, task_overhead_s=2.0)
    long_stages = Plan.parse("F[0:17] T[17:18] B[11:17,5:11,0:5]")
    over = evaluate_plan(long_stages, costs, limited, 5, recompute="stage")
    fits = evaluate_plan(long_stages, costs, limited, 5, recompute="layer")
    assert max(over.per_stage_memory) > 24 * GiB >= max(fits.per_stage_memory)
    assert fits.recompute == "layer"
    stage = plan_stages(costs, limited, 5, recompute="stage")
    layer_grain = plan_stages(costs, limited, 5, recompute="layer")
    auto = plan_stages(costs, limited, 5, recompute="auto")
    assert stage.recompute == "stage" and layer_grain.recompute == "layer"
    best = min((stage, layer_grain), key=lambda r: r.predicted_iteration_s)
    assert auto.recompute == best.recompute
    assert auto.predicted_iteration_s == best.predicted_iteration_s
    # Without a memory limit layer grain would only add a forward: never chosen.
    assert plan_stages(costs, hw(4), 5, recompute="auto").recompute == "stage"


def test_longest_sequence_is_the_boundary_and_says_where_memory_goes(tiny_qwen) -> None:
    """``roundpipe plan --max-seq-len``: the longest sequence whose plan fits, exactly
    (one token more does not), with its fullest stage's memory by kind."""
    from roundpipe.coordinator.planning.sequence import longest_sequence

    def costs_for(seq_len: int) -> list[LayerCost]:
        return estimate_costs(tiny_qwen, microbatch_rows=1, seq_len=seq_len, flops_per_s=1e12)

    limited = hw(2, mem=256 * MiB, reserved_bytes=8 * MiB)
    fit = longest_sequence(costs_for, limited, 3, rows=1, hi=1 << 20)
    assert fit is not None and 2 < fit.seq_len < 1 << 20
    assert fit.needed == max(e.memory_bytes for e in fit.result.stages) <= 256 * MiB
    assert {"weights", "working memory", "activations", "reserve"} <= fit.parts.keys()
    with pytest.raises(ValueError, match="no plan fits 256.0 MiB per GPU"):
        plan_stages(costs_for(fit.seq_len + 1), limited, 3, recompute="auto")


def test_longest_sequence_beyond_the_range(tiny_qwen) -> None:
    from roundpipe.coordinator.planning.sequence import longest_sequence

    def costs_for(seq_len: int) -> list[LayerCost]:
        return estimate_costs(tiny_qwen, microbatch_rows=1, seq_len=seq_len, flops_per_s=1e12)

    roomy = longest_sequence(costs_for, hw(2, mem=64 * GiB), 3, rows=1, hi=4096)
    assert roomy is not None and roomy.seq_len == 4096  # the top of the range fits
    # Below one stage's weights not even 2 tokens fit (the loss chunk is as large as
    # the tokens' logits, no larger: a 1 MiB worker takes a few hundred tokens).
    assert longest_sequence(costs_for, hw(2, mem=16 * 1024), 3, rows=1, hi=4096) is None


def test_plan_command_max_seq_len(capsys) -> None:
    small = ("hidden_size=256", "intermediate_size=512", "num_hidden_layers=4")
    small += ("num_attention_heads=4", "num_key_value_heads=2", "head_dim=64")
    small += ("vocab_size=1000", "max_position_embeddings=1048576")
    args = ["--architecture", "qwen3", "--workers", "2", "--memory-limit", "2GiB"]
    for setting in small:
        args += ["--set", setting]
    assert plan_main([*args, "--max-seq-len"]) == 0
    out = capsys.readouterr().out
    assert "the longest sequence that fits is" in out and "working memory" in out
    assert plan_main(args) == 2
    assert "give --seq-len TOKENS, or --max-seq-len" in capsys.readouterr().err
    # With --plan, the longest sequence that plan fits (it searched for its own plan,
    # and the given one did not fit the length it printed).
    tight = ["--architecture", "qwen3", "--workers", "2", "--memory-limit", "1.05GiB"]
    tight += [*args[6:], "--set", "num_hidden_layers=2"]
    assert plan_main([*tight, "--max-seq-len", "--plan", "F[] T[0:4] B[]"]) == 0
    out = capsys.readouterr().out
    tokens = int(out.split("the longest sequence that fits is ")[1].split()[0].replace(",", ""))
    assert "F[] T[0:4] B[]" in out
    assert plan_main([*tight, "--seq-len", str(tokens), "--plan", "F[] T[0:4] B[]"]) == 0
    assert "over the" not in capsys.readouterr().out
    # --json is JSON here too; nothing fitting is exit 2 with the reason (it was 1).
    assert plan_main([*tight, "--max-seq-len", "--plan", "F[] T[0:4] B[]", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["max_seq_len"] == tokens and printed["plan"] == "F[] T[0:4] B[]"
    assert plan_main([*tight[:5], "1MiB", *tight[6:], "--max-seq-len", "--reserve", "0"]) == 2
    assert "not even a 2-token sequence fits" in capsys.readouterr().err
    # The default 1 GiB reserve above a limit leaves nothing: said so (it blamed a layer).
    assert plan_main([*tight[:5], "64MiB", *tight[6:], "--max-seq-len"]) == 2
    assert "--reserve (1GiB) leaves nothing of --memory-limit (64MiB)" in capsys.readouterr().err
    # A sequence the model's positions cannot hold is refused, as a job spec's is (a
    # plan was printed for it).
    assert plan_main([*args, "--seq-len", str(1048576 + 1)]) == 2
    assert "longer than the model's max_position_embeddings" in capsys.readouterr().err


def test_the_whole_model_as_one_stage_must_fit_beside_its_prefetched_copy() -> None:
    """One worker: the whole model's running memory fit the limit, but not beside the
    next task's prefetched copy of the same stage, as every other tail must; that plan
    (38.5 GiB on a 24 GiB worker) was chosen and admitted."""

    def layer(f: float) -> LayerCost:
        return LayerCost(
            forward_s=f, backward_s=3 * f, param_bytes=GiB, grad_bytes=2 * GiB,
            activation_bytes=16 * MiB, work_bytes=256 * MiB, forward_work_bytes=64 * MiB,
        )  # fmt: skip

    costs = [layer(0.01)] + [layer(1.0)] * 4 + [layer(2.0)]
    hw = HardwareSpec(num_workers=1, memory_limit_bytes=24 * GiB, reserved_bytes=GiB)
    result = plan_stages(costs, hw, 2)
    assert result.plan != Plan(forward=(), tail=(0, 6), backward=()), result.plan
    assert max(result.per_worker_memory) <= result.memory_limit_bytes, result.notes


def test_admission_prices_a_pinned_plan_at_the_grain_the_job_runs(tmp_path) -> None:
    """A pinned train.plan with train.recompute: layer runs its backward stages a layer
    at a time; admission priced it at stage grain and refused a plan that fits."""
    import torch
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.planning.costs import estimate_costs
    from roundpipe.coordinator.planning.hardware import gpu_hardware
    from roundpipe.coordinator.service.admission import validate_spec
    from roundpipe.coordinator.spec.errors import JobSpecError
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec

    config = {"hidden_size": 64, "intermediate_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512, "max_position_embeddings": 8192}  # fmt: skip
    plan = "F[0:9] T[9:10] B[0:9]"

    def spec(recompute: str):
        return tiny_spec(tmp_path / "out", config=config, seq_len=4096, microbatch_size=4,
                         num_microbatches=3, dtype="bfloat16", plan=plan,
                         train={"recompute": recompute})  # fmt: skip

    model = LayeredModel(model_config_from_spec(spec("layer").model))
    costs = estimate_costs(model, microbatch_rows=4, seq_len=4096,
                           compute_dtype=torch.bfloat16, flops_per_s=82.6e12)  # fmt: skip
    big = gpu_hardware(2, 1 << 40)
    need = {g: max(evaluate_plan(Plan.parse(plan), costs, big, 3, recompute=g).per_worker_memory)
            for g in ("stage", "layer")}  # fmt: skip
    assert need["layer"] < need["stage"]
    between = gpu_hardware(2, (need["stage"] + need["layer"]) // 2)
    validate_spec(spec("layer").to_dict(), hardware=between)  # fits at layer grain
    with pytest.raises(JobSpecError, match="train.plan: needs about"):
        validate_spec(spec("stage").to_dict(), hardware=between)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_roundpipe_plan_states_the_host_memory_admission_checks(tmp_path, dtype) -> None:
    """`roundpipe plan` says how much host memory the coordinator will require. The
    trainer sizes a re-planning job's slot pools with headroom for more stages; plan
    left it out and said 11% less here, so a job it said fits could be refused. float16
    trains with loss scaling, whose gradient buffer holds every layer: plan shared it."""
    import contextlib
    import io
    import json

    import torch
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.planning.hardware import gpu_hardware
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec
    from roundpipe.coordinator.training.job_planner import JobPlanner

    config = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
              "vocab_size": 512, "max_position_embeddings": 8192}  # fmt: skip
    job = tiny_spec(tmp_path / "out", config=config, seq_len=4096, microbatch_size=1,
                    num_microbatches=5, dtype=dtype, staleness=1)  # fmt: skip
    assert job.train.replan and not job.train.plan
    model = LayeredModel(model_config_from_spec(job.model))
    planner = JobPlanner("j", job, hardware=gpu_hardware(4, 24 * GiB), arena_dir=tmp_path,
                         node_microbatches=5, compute_dtype=getattr(torch, dtype))  # fmt: skip
    layout, _ = planner.first_layout(model)
    admitted = planner.host_memory(layout)
    args = [
        "--architecture",
        "qwen3",
        "--workers",
        "4",
        "--memory-limit",
        "24GiB",
        "--seq-len",
        "4096",
        "--microbatches",
        "5",
        "--dtype",
        dtype,
        "--json",
    ]
    for key, value in config.items():
        args += ["--set", f"{key}={value}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(args) == 0
    doc = json.loads(out.getvalue())
    assert doc["plan"] == str(layout.plan)
    assert doc["host_memory"]["total"] == admitted.total, (doc["host_memory"], admitted)


def test_a_model_with_the_router_auxiliary_loss_is_planned_at_stage_grain(capsys) -> None:
    """Its backward tasks recompute whole stages (the router counts are a stage's), so a
    layer-grain plan, chosen by auto where it fits a tight limit, needed more memory than
    its prediction on the GPU; an asked-for layer grain is refused by roundpipe plan."""
    from roundpipe.coordinator.planning.search import initial_plan

    moe = {
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
        "num_hidden_layers": 12,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1024,
    }
    args = ["--architecture", "qwen3_moe", "--workers", "2", "--seq-len", "16384"]
    args += ["--bandwidth", "1GB/s", "--memory-limit", "2.8GiB", "--json"]
    for key, value in moe.items():
        args += ["--set", f"{key}={value}"]
    assert plan_main(args) == 0  # without the auxiliary loss, layer grain fits best
    assert json.loads(capsys.readouterr().out)["recompute"] == "layer"
    with_aux = [*args, "--set", "output_router_logits=true"]
    if plan_main(with_aux) == 0:
        assert json.loads(capsys.readouterr().out)["recompute"] == "stage"
    else:  # or nothing fits at stage grain: said so, not a layer-grain plan
        assert "no plan fits" in capsys.readouterr().err
    assert plan_main([*with_aux, "--recompute", "layer"]) == 2
    assert "recomputes whole stages only" in capsys.readouterr().err
    model = LayeredModel.from_config(
        {"model_type": "qwen3_moe", **moe, "output_router_logits": True}
    )
    hw = HardwareSpec(num_workers=2, memory_limit_bytes=64 * GiB)
    for asked in ("auto", "layer"):
        result = initial_plan(
            model, hw, microbatch_rows=1, seq_len=256, num_microbatches=3, recompute=asked
        )
        assert result.recompute == "stage", asked


def test_split_variants_fit_beside_the_largest_resident_stage() -> None:
    """A split (staleness 0) variant was checked against its workers' peaks only, where
    every other plan's stages must fit beside the largest resident stage: one was chosen
    whose own table said a stage was over the limit."""
    import random

    rng = random.Random(7)
    n = rng.randint(3, 10)
    costs = []
    for _ in range(n):
        p, f = rng.randint(1, 200) * MiB, rng.uniform(0.001, 0.05)
        costs.append(
            LayerCost(
                forward_s=f,
                backward_s=3 * f,
                param_bytes=p,
                grad_bytes=2 * p,
                activation_bytes=rng.randint(1, 20) * MiB,
                work_bytes=rng.randint(0, 300) * MiB,
                forward_work_bytes=rng.randint(0, 100) * MiB,
            )
        )
    workers, limit = rng.randint(2, 3), rng.randint(500, 3000) * MiB
    hw = HardwareSpec(num_workers=workers, memory_limit_bytes=limit, reserved_bytes=0)
    result = plan_stages(
        costs, hw, rng.randint(2, 5), staleness=0, recompute="stage", sim_iterations=3
    )
    assert max(result.per_stage_memory) <= limit, (str(result.plan), result.notes)
    assert not [note for note in result.notes if "over the" in note]
    assert len(set(result.notes)) == len(result.notes)


def test_roundpipe_plan_prices_tasks_as_the_coordinator_does(capsys) -> None:
    """The same model and workers give the coordinator's plan (GPU workers' per-task
    overhead): roundpipe plan priced tasks at no overhead and showed another plan."""
    from roundpipe.coordinator.planning.hardware import gpu_hardware
    from roundpipe.coordinator.planning.search import initial_plan

    cfg = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    cfg |= {"num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "num_hidden_layers": 4}
    model = LayeredModel.from_config({"model_type": "qwen3", **cfg})
    coordinator = initial_plan(
        model, gpu_hardware(2, 24 * GiB), microbatch_rows=1, seq_len=128, num_microbatches=3
    )
    args = ["--architecture", "qwen3", "--workers", "2", "--seq-len", "128", "--json"]
    for key, value in cfg.items():
        args += ["--set", f"{key}={value}"]
    assert plan_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["plan"] == str(coordinator.plan)
    # Qwen3-MoE's config declares no head_dim, though its model reads it.
    moe = ["--architecture", "qwen3_moe", "--workers", "2", "--seq-len", "128"]
    assert plan_main([*moe, "--set", "head_dim=64", "--set", "num_attention_heads=4"]) == 0
    capsys.readouterr()


def test_a_layer_grain_backward_is_re_priced_at_what_it_measured() -> None:
    """A layer-grain backward task's times hold one more forward of its layers, which
    the cost model adds itself: re-pricing the plan from its own measurements counted
    that forward twice (60 s for a 48 s task here), so re-planning misjudged it."""
    from roundpipe.coordinator.planning.costs import CostModel

    m = 4
    prior = [
        LayerCost(
            forward_s=1.0,
            backward_s=3.0,
            param_bytes=0,
            grad_bytes=0,
            activation_bytes=0,
            work_bytes=0,
        )
    ] * 4
    hw = HardwareSpec(num_workers=2, memory_limit_bytes=1 << 40, reserved_bytes=0)
    model = CostModel(prior, hw, m, "layer")
    backward, tail, forward = (
        model.parts(k, a, b)[0] for k, a, b in (("B", 0, 3), ("T", 3, 4), ("F", 0, 3))
    )
    profile = ProfileAggregator(prior, m, warmup_iterations=0)
    for iteration in range(3):  # as the worker reports them (worker/runtime.py)
        profile.record(iteration, "forward", {f"{layer}.fwd": forward / 3 for layer in range(3)})
        profile.record(
            iteration,
            "backward",
            {f"{layer}": backward / 3 for layer in range(3)},
            extra_forward=True,
        )
        profile.record(iteration, "tail", {"3": tail})
        profile.end_iteration(iteration)
    again = CostModel(profile.costs(), hw, m, "layer")
    assert again.parts("B", 0, 3)[0] == pytest.approx(backward)
    assert [c.backward_s for c in profile.costs()] == pytest.approx([3.0] * 4)


def test_plan_command_plans_an_mxfp4_checkpoint_dequantised(tmp_path, capsys) -> None:
    """GPT-OSS's hub config declares MXFP4-packed experts: `roundpipe plan` refused it and
    pointed at the job spec's model.dequantize, which it had no way to say. --dequantize
    plans it as a job with model.dequantize: true trains it."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    ).to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--model-config", str(tmp_path), "--workers", "2", "--seq-len", "64"]
    assert plan_main(args) == 2
    assert "roundpipe plan --dequantize" in capsys.readouterr().err
    assert plan_main([*args, "--dequantize"]) == 0
    assert "SIMULATED PREDICTION" in capsys.readouterr().out
    assert (
        plan_main(["--architecture", "qwen3", "--workers", "2", "--seq-len", "8", "--dequantize"])
        == 2
    )
    assert "--dequantize needs --model-config" in capsys.readouterr().err
