"""The planner's per-family FLOP model (roundpipe.coordinator.planning.model_flops)."""

from __future__ import annotations

import pytest
from model_helpers import tiny_config

from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.model_flops import (
    MoeShape,
    active_matmul_params,
    token_mixer_flops,
)
from roundpipe.shared.model import LayeredModel


def _costs(model: LayeredModel, seq_len: int = 64):
    return estimate_costs(
        model, microbatch_rows=2, seq_len=seq_len, compute_dtype="float32", flops_per_s=1e12
    )


@pytest.mark.parametrize(
    ("arch", "experts_key"), [("qwen3_moe", "num_experts"), ("gpt_oss", "num_local_experts")]
)
def test_moe_layers_count_active_experts_only(arch: str, experts_key: str) -> None:
    model = LayeredModel.from_config(tiny_config(arch))
    moe = MoeShape(model.config)
    assert (moe.num_experts, moe.top_k) == (4, 2)
    layer = 1  # an MoE layer in both tiny configs
    specs = model.layer_params(layer)
    active, routed = active_matmul_params(specs, moe)
    assert routed
    experts = sum(s.numel for s in specs if ".experts." in s.name and len(s.shape) == 3)
    dense = sum(
        s.numel
        for s in specs
        if len(s.shape) == 2 and ".experts." not in s.name and not s.name.endswith("bias")
    )
    # Half the experts' weights (top-2 of 4), all dense matmuls, no biases.
    assert active == pytest.approx(dense + experts / 2)
    # Doubling the experts at the same top-k leaves the active FLOPs (nearly) unchanged,
    # while the parameter bytes double for the experts.
    wide = LayeredModel.from_config(tiny_config(arch, **{experts_key: 8}))
    a, b = _costs(model)[layer], _costs(wide)[layer]
    router = model.hidden_size * 4  # the router grows with the expert count
    assert b.param_bytes > 1.5 * a.param_bytes - router * 4
    wide_active, _ = active_matmul_params(wide.layer_params(layer), MoeShape(wide.config))
    assert wide_active - active == pytest.approx(router)


def test_linear_attention_layers_cost_linear_in_sequence() -> None:
    model = LayeredModel.from_config(tiny_config("qwen3_5_text", max_position_embeddings=8192))
    linear, full = 1, 2
    assert model.mask_kind(linear) == "recurrent" and model.mask_kind(full) == "full"
    short = {layer: token_mixer_flops(model, layer, 1024, 1024) for layer in (linear, full)}
    long = {layer: token_mixer_flops(model, layer, 8192, 8192) for layer in (linear, full)}
    # Same token count per row length: full attention grows with the sequence, linear not.
    assert long[linear] / 8 == pytest.approx(short[linear])
    assert long[full] / 8 == pytest.approx(8 * short[full])
    costs = _costs(model, seq_len=4096)
    assert costs[linear].forward_s > 0 and costs[full].forward_s > costs[linear].forward_s


def test_sliding_window_layers_attend_to_the_window() -> None:
    model = LayeredModel.from_config(tiny_config("gpt_oss", max_position_embeddings=4096))
    sliding, full = 1, 2
    window = model.config.sliding_window
    assert token_mixer_flops(model, sliding, 4096, 4096) == pytest.approx(
        4 * 4096 * window * (1 - window / (2 * 4096)) * 4 * 8
    )
    assert token_mixer_flops(model, full, 4096, 4096) == pytest.approx(4 * 4096 * 2048 * 4 * 8)
