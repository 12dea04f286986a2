"""MoE layer speed on a worker: a Qwen3-30B-A3B-shaped decoder layer against the dense layer
of the same active parameter count, forward task + backward task (with recompute), as the
executor runs them.

The MoE layer's experts run through transformers' experts implementations: ``grouped_mm``
(one grouped matmul over all experts' tokens; what the worker uses, transformers' default)
and ``eager`` (a Python loop over the experts that got tokens); ``--batched`` adds
``batched_mm``, which gathers a weight copy per (token, expert) pair: gigabytes at the
default size, so it is off by default. The dense layer is Qwen3 with ``intermediate_size = top_k x
moe_intermediate_size``: the same matmul FLOPs per token as the routed experts.

    python benchmarks/moe.py                 # Qwen3-30B-A3B scaled to fit a CPU
    python benchmarks/moe.py --shape full --device cuda --dtype bfloat16
    python benchmarks/moe.py --smoke         # seconds; what the test runs

Last line: ``RESULT moe_vs_dense=<grouped MoE time / dense time> grouped_vs_eager=<eager
time / grouped time>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roundpipe.shared.model import LayeredModel
from roundpipe.worker.executor import StageExecutor


def _shape(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    expert_width: int,
    experts: int,
    top_k: int,
) -> dict[str, int]:
    """A MoE decoder layer's sizes, as the ``Qwen3MoeConfig`` fields."""
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=expert_width,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )


# Qwen3-30B-A3B's decoder layer (config.json of the released model) and a CPU-sized
# version: every width / 4, the expert count and top-k kept (so is the routing pattern).
SHAPES: dict[str, dict[str, int]] = {
    "full": _shape(2048, 32, 4, 128, expert_width=768, experts=128, top_k=8),
    "scaled": _shape(512, 8, 1, 64, expert_width=192, experts=128, top_k=8),
    "smoke": _shape(64, 4, 1, 16, expert_width=32, experts=16, top_k=4),
}


def layer_model(shape: dict[str, int], moe: bool, experts: str = "grouped_mm") -> LayeredModel:
    """A one-decoder-layer model (embedding and head tiny: only layer 1 is timed)."""
    common = dict(
        vocab_size=256,
        num_hidden_layers=1,
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=32768,
    )
    if moe:
        config = dict(
            common,
            model_type="qwen3_moe",
            moe_intermediate_size=shape["moe_intermediate_size"],
            num_experts=shape["num_experts"],
            num_experts_per_tok=shape["num_experts_per_tok"],
            norm_topk_prob=True,
        )
    else:
        active = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
        config = dict(common, model_type="qwen3", intermediate_size=active)
    model = LayeredModel.from_config(config)
    if moe:
        model.skeleton.set_experts_implementation(experts)
    return model


def active_params(model: LayeredModel) -> float:
    """Matmul parameters one token uses in layer 1 (routed experts: top_k of them)."""
    from roundpipe.coordinator.planning.model_flops import MoeShape, active_matmul_params

    return active_matmul_params(model.layer_params(1), MoeShape(model.config))[0]


def time_layer(
    model: LayeredModel,
    *,
    device: str,
    dtype: torch.dtype,
    rows: int,
    seq: int,
    repeats: int,
    warmup: int,
) -> list[float]:
    """Seconds of forward task + backward task of layer 1 over one microbatch."""
    ex = StageExecutor(model, device, dtype)
    weights = model.init_weights(seed=0, dtype=dtype)
    w = {n: t.to(device) for n, t in model.range_weights(weights, 1, 2).items()}
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(rows, seq, model.hidden_size, generator=g) * 0.5).to(device, dtype)
    dy = (torch.randn(rows, seq, model.hidden_size, generator=g) * 1e-3).to(device, dtype)
    times = []
    for i in range(warmup + repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ex.forward(1, 2, w, [x]).outputs[0]
        ex.backward(1, 2, w, [x], [dy])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        del out
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="scaled")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-eager", action="store_true", help="skip the slow per-expert loop")
    p.add_argument("--batched", action="store_true", help="also time batched_mm (memory!)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, one repeat")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.rows, args.seq, args.repeats, args.warmup = "smoke", 1, 32, 1, 1
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    shape = SHAPES[args.shape]
    systems = [("moe grouped_mm (worker)", True, "grouped_mm")]
    if args.batched:
        systems.append(("moe batched_mm", True, "batched_mm"))
    if not args.no_eager:
        systems.append(("moe eager (expert loop)", True, "eager"))
    systems.append(("dense, same active params", False, ""))
    tokens = args.rows * args.seq
    print(
        f"# Qwen3-30B-A3B-shaped layer ({args.shape}: {shape}), {tokens} tokens, "
        f"{dtype_name} on {args.device}; forward task + backward task (recompute)"
    )
    print(f"{'system':<28}{'active params':>15}{'median ms':>12}{'tokens/s':>12}")
    medians: dict[str, float] = {}
    for name, moe, experts in systems:
        model = layer_model(shape, moe, experts)
        times = time_layer(
            model,
            device=args.device,
            dtype=dtype,
            rows=args.rows,
            seq=args.seq,
            repeats=args.repeats,
            warmup=args.warmup,
        )
        med = statistics.median(times)
        medians[name] = med
        print(f"{name:<28}{active_params(model):>15,.0f}{med * 1e3:>12.1f}{tokens / med:>12,.0f}")
    grouped = medians["moe grouped_mm (worker)"]
    dense = medians["dense, same active params"]
    eager = medians.get("moe eager (expert loop)")
    extra = f" grouped_vs_eager={eager / grouped:.2f}" if eager is not None else ""
    print(f"RESULT moe_vs_dense={grouped / dense:.2f}{extra}")


if __name__ == "__main__":
    main()
