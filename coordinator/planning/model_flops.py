"""Per-family FLOP counts of a decoder layer, for the planner's cold-start cost model.

A decoder layer's work is its matmuls (``2 x tokens x active matmul parameters``
forward) plus its token mixer:

- softmax attention (full or sliding window): ``4 x tokens x span x (heads x
  head_dim)``, span = the mean number of keys a query sees (seq / 2 causal, about the
  window when it is shorter);
- linear attention (Qwen3.5's Gated DeltaNet, chunked): per token and value head a
  ``d_k x d_v`` state read and update (``4 d_k d_v``) and the intra-chunk attention over
  ``CHUNK`` tokens (``2 CHUNK (d_k + d_v)``); linear in the sequence.

MoE layers count only the active experts: a routed expert tensor (leading dimension
``num_experts``) contributes ``top_k / num_experts`` of its parameters; shared experts
and the router are dense. Biases and norm weights are not matmuls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel, ParamSpec

__all__ = [
    "LINEAR_ATTENTION_CHUNK",
    "MoeShape",
    "active_matmul_params",
    "attention_widths",
    "token_mixer_flops",
]

LINEAR_ATTENTION_CHUNK = 64
"""Chunk length of transformers' chunked Gated DeltaNet (torch and fla paths)."""


class MoeShape:
    """Routed-expert sizes of a config (all zero for a dense model)."""

    def __init__(self, config: Any) -> None:
        c = config
        # Qwen3-MoE / Qwen3.5-MoE: num_experts; GPT-OSS: num_local_experts.
        self.num_experts = int(
            getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
        )
        self.top_k = int(getattr(c, "num_experts_per_tok", 0) or 0) if self.num_experts else 0
        # GPT-OSS sizes its experts with intermediate_size; Qwen MoEs with moe_intermediate_size.
        self.expert_intermediate = int(
            getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", 0) or 0
        )

    @property
    def active_fraction(self) -> float:
        return self.top_k / self.num_experts if self.num_experts else 1.0


def _is_routed_expert(spec: ParamSpec, moe: MoeShape) -> bool:
    return (
        moe.num_experts > 0
        and ".experts." in f"{spec.name}."
        and len(spec.shape) >= 2
        and spec.shape[0] == moe.num_experts
    )


def active_matmul_params(
    specs: list[ParamSpec], moe: MoeShape, *, trainable_only: bool = False
) -> tuple[float, bool]:
    """(matmul parameters one token uses, whether the layer has routed experts)."""
    total = 0.0
    routed = False
    for s in specs:
        if trainable_only and not s.trainable:
            continue
        if _is_routed_expert(s, moe):
            routed = True
            if len(s.shape) >= 3:  # [experts, in, out]; [experts, out] is a bias
                total += s.numel * moe.active_fraction
        elif len(s.shape) >= 2 and not s.name.endswith("conv1d.weight"):
            total += s.numel
    return total, routed


def attention_widths(cfg: Any) -> tuple[int, int]:
    """Widths of a softmax-attention layer's query and of its key (= value) projections:
    ``heads x head_dim`` and ``kv_heads x head_dim``, with the config's defaults (a head
    as wide as hidden / heads, as many KV heads as query heads) where it names none."""
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    return heads * head_dim, kv_heads * head_dim


def token_mixer_flops(model: LayeredModel, layer: int, tokens: int, seq_len: int) -> float:
    """Forward FLOPs of decoder ``layer``'s attention (or linear attention) over
    ``tokens`` tokens in rows of ``seq_len``."""
    cfg = model.config
    if model.mask_kind(layer) == "recurrent":
        heads = int(getattr(cfg, "linear_num_value_heads", 0) or cfg.num_attention_heads)
        d_k = int(getattr(cfg, "linear_key_head_dim", 0) or 128)
        d_v = int(getattr(cfg, "linear_value_head_dim", 0) or 128)
        chunk = min(LINEAR_ATTENTION_CHUNK, seq_len)
        return tokens * heads * (4 * d_k * d_v + 2 * chunk * (d_k + d_v))
    q_width, _ = attention_widths(cfg)
    window = getattr(cfg, "sliding_window", None)
    if model.mask_kind(layer) == "sliding" and window and seq_len > int(window):
        w = int(window)
        span = w * (1 - w / (2 * seq_len))
    else:
        span = seq_len / 2
    return 4 * tokens * span * q_width
