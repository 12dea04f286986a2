"""The published models' shapes, in one table for every benchmark that predicts them.

Sizes from each model's ``config.json`` (no download at run time): the models of the
paper's benchmark runs, plus Qwen3-4B (its 24 GiB full fine-tuning figure). The
published 8x RTX 4090 throughputs (tokens/s at sequence 2048) sit beside them, so a
prediction and its reference come from one place.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONFIGS", "PUBLISHED_TOKENS_PER_S"]

# ``model_type`` picks the transformers config class (LayeredModel.from_config).
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-1.7B": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen3-4B": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Llama-3.1-8B": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "GPT-OSS-20B": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        tie_word_embeddings=False,
    ),
    "Qwen3-32B": dict(
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen3-235B-A22B": dict(
        model_type="qwen3_moe",
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}

# The paper's 8x RTX 4090 table (its asynchronous optimizer), tokens/s at sequence 2048.
PUBLISHED_TOKENS_PER_S: dict[str, float] = {
    "Qwen3-1.7B": 65_417,
    "Llama-3.1-8B": 24_275,
    "GPT-OSS-20B": 18_122,
    "Qwen3-32B": 5_516,
    "Qwen3-235B-A22B": 1_820,
}
