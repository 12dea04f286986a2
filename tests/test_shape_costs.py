"""The shape-aware cost model (coordinator/planning/shape_costs.py, gpus.py) and its
check against the paper's published runs (benchmarks/paper_table.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from roundpipe.coordinator.planning.gpus import GPUS, gpu_model
from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.search import evaluate_plan, plan_stages
from roundpipe.coordinator.planning.shape_costs import (
    EAGER_KERNEL_S,
    estimate_costs_on_gpu,
    gemm_seconds,
)
from roundpipe.plan_command import plan_main
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.units import GiB

ROOT = Path(__file__).resolve().parent.parent
RTX4090 = GPUS["rtx4090"]


def _flops_rate(gpu, m, n, k, *, fp16_accumulation=True) -> float:
    t = gemm_seconds(gpu, m, n, k, dtype_size=2, fp16_accumulation=fp16_accumulation)
    return 2 * m * n * k / t


def test_a_large_gemm_runs_near_the_gpus_sustained_peak() -> None:
    rate = _flops_rate(RTX4090, 26624, 6144, 4096)
    ceiling = RTX4090.fp16_accumulation_flops * RTX4090.gemm_efficiency
    assert 0.9 * ceiling < rate <= ceiling


def test_fp16_accumulation_doubles_a_geforce_gemm_but_not_a_data_centre_one() -> None:
    shape = (26624, 6144, 4096)
    fast = _flops_rate(RTX4090, *shape, fp16_accumulation=True)
    slow = _flops_rate(RTX4090, *shape, fp16_accumulation=False)
    assert fast == pytest.approx(2 * slow, rel=0.01)
    a100 = GPUS["a100"]
    assert _flops_rate(a100, *shape, fp16_accumulation=True) == pytest.approx(
        _flops_rate(a100, *shape, fp16_accumulation=False)
    )


def test_an_experts_few_tokens_waste_most_of_a_wave() -> None:
    # 128 experts, top-8, 13K tokens: about 820 tokens per expert fill 84 of 128 SMs.
    expert = _flops_rate(RTX4090, 820, 1536, 4096)
    dense = _flops_rate(RTX4090, 26624, 1536, 4096)
    assert expert < 0.75 * dense


def test_a_thin_gemm_is_bound_by_memory() -> None:
    m, n, k = 26624, 32, 4096  # a LoRA adapter's down-projection
    t = gemm_seconds(RTX4090, m, n, k, dtype_size=2, fp16_accumulation=True)
    streamed = (m * k + k * n + m * n) * 2 / (RTX4090.memory_bandwidth * RTX4090.memory_efficiency)
    assert t == pytest.approx(streamed)


def test_unknown_gpu_names_the_known_ones() -> None:
    assert gpu_model("RTX-4090") is RTX4090
    with pytest.raises(ValueError, match="known ones are a100, a800, h100, rtx4090"):
        gpu_model("gtx1080")


def _dense(hidden: int, inter: int, layers: int) -> LayeredModel:
    return LayeredModel.from_config(
        dict(
            model_type="qwen3",
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 128,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        )
    )


def test_a_narrow_model_reaches_a_smaller_fraction_of_the_peak() -> None:
    """What one --efficiency cannot express: per FLOP, a 2,048-wide layer streams more
    elementwise bytes than a 4,096-wide one, so it runs further below the peak."""

    def fraction(model: LayeredModel) -> float:
        costs = estimate_costs_on_gpu(
            model,
            RTX4090,
            microbatch_rows=13,
            seq_len=2048,
            compute_dtype="float16",
            fp16_accumulation=True,
        )
        layer = costs[2]
        tokens = 13 * 2048
        matmul = sum(s.numel for s in model.layer_params(2) if len(s.shape) == 2)
        return 2 * tokens * matmul / layer.forward_s / RTX4090.fp16_accumulation_flops

    narrow, wide = fraction(_dense(2048, 6144, 2)), fraction(_dense(4096, 14336, 2))
    assert narrow < 0.85 * wide < 0.85 * RTX4090.gemm_efficiency
    # and fp16 accumulation needs a 16-bit dtype
    with pytest.raises(ValueError, match="16-bit"):
        estimate_costs_on_gpu(
            _dense(256, 512, 2),
            RTX4090,
            microbatch_rows=1,
            seq_len=64,
            compute_dtype="float32",
            fp16_accumulation=True,
        )


def test_one_process_for_every_gpu_puts_its_kernels_under_the_iteration() -> None:
    model = _dense(1024, 2048, 4)
    costs = estimate_costs_on_gpu(model, RTX4090, microbatch_rows=1, seq_len=128)
    assert all(c.forward_kernels > 0 and c.backward_kernels > 0 for c in costs[1:])
    separate = HardwareSpec(num_workers=4, memory_limit_bytes=24 * GiB)
    free = plan_stages(costs, separate, 5, tokens_per_iteration=5 * 128)
    shared = HardwareSpec(num_workers=4, memory_limit_bytes=24 * GiB, shared_launch_s=1e-3)
    bound = evaluate_plan(free.plan, costs, shared, 5, tokens_per_iteration=5 * 128)
    kernels = sum(c.forward_kernels for a, b in free.plan.forward for c in costs[a:b])
    kernels += sum(
        c.backward_kernels for a, b in [free.plan.tail, *free.plan.backward] for c in costs[a:b]
    )
    assert bound.predicted_iteration_s == pytest.approx(5 * kernels * 1e-3)
    assert bound.predicted_iteration_s > free.predicted_iteration_s
    assert any(n.startswith("host-bound") for n in bound.notes)
    assert not any(n.startswith("host-bound") for n in free.notes)
    assert EAGER_KERNEL_S < 1e-3


def test_plan_command_prices_shapes_on_a_named_gpu(capsys) -> None:
    args = ["--architecture", "qwen3", "--workers", "2", "--seq-len", "256"]
    assert plan_main([*args, "--gpu", "rtx4090", "--dtype", "float16", "--fp16-accumulation"]) == 0
    out = capsys.readouterr().out
    assert "RTX 4090 (fp16 accumulation, shape-aware costs)" in out and "tokens/s" in out
    assert plan_main([*args, "--fp16-accumulation"]) == 2
    assert "--fp16-accumulation needs --gpu and --dtype float16" in capsys.readouterr().err


@pytest.mark.slow
def test_paper_table_predicts_every_published_run_within_15_percent() -> None:
    """`python benchmarks/paper_table.py`, its documented default: five published runs,
    one server description, RESULT worst <= 0.15."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paper_table.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    last = lines[-1].split()
    assert last[0] == "RESULT" and last[2] == "rows=5", result.stdout
    assert float(last[1].removeprefix("worst=")) <= 0.15, result.stdout
    for model in ("Qwen3-1.7B", "Llama-3.1-8B", "GPT-OSS-20B", "Qwen3-32B", "Qwen3-235B-A22B"):
        assert any(line.startswith(model) for line in lines), result.stdout
    # The 235B LoRA run is bound by one process issuing every GPU's kernels.
    row = next(line for line in lines if line.startswith("Qwen3-235B-A22B"))
    assert " host " in row, row
