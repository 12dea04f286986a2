"""The ``roundpipe plan`` command: a plan for a model on hypothetical hardware, printed."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.planning.baselines import bound_baseline
from roundpipe.coordinator.planning.costs import (
    LayerCost,
    estimate_costs,
)
from roundpipe.coordinator.planning.data_parallel import (
    DataParallelPrediction,
    predict_data_parallel,
)
from roundpipe.coordinator.planning.gpus import GPUS
from roundpipe.coordinator.planning.hardware import GPU_TASK_OVERHEAD_S, HardwareSpec
from roundpipe.coordinator.planning.search import (
    PlanResult,
    evaluate_plan,
    pinned_grain,
    plan_stages,
    runnable_grain,
)
from roundpipe.coordinator.planning.sequence import longest_sequence
from roundpipe.coordinator.planning.shape_costs import estimate_costs_on_gpu
from roundpipe.coordinator.spec.sections import TrainSpec
from roundpipe.shared.families import FAMILIES
from roundpipe.shared.plan import Plan
from roundpipe.shared.units import format_bytes, format_seconds, parse_quantity

if TYPE_CHECKING:
    from roundpipe.shared.model import LayeredModel


def describe(result: PlanResult) -> str:
    """A printable table of a plan: stage, layers, times, transfers, memory."""
    split = sum(1 for s in result.plan.stages() if s.split)
    hw_line = (
        f"plan {result.plan}   ({len(result.plan.forward)} forward, 1 tail, "
        f"{len(result.plan.backward)} backward stages"
        + (f", {split} split by microbatch into two tasks" if split else "")
        + f"; {result.num_workers} workers, {result.num_microbatches} microbatches)"
    )
    headers = ("stage", "layers", "compute", "upload", "download", "time", "bound", "memory")
    rows = []
    for e in result.stages:
        rows.append(
            (
                e.label,
                f"{e.start}:{e.stop}",
                format_seconds(e.compute_s),
                format_seconds(e.upload_s),
                format_seconds(e.download_s),
                format_seconds(e.time_s),
                e.bound,
                format_bytes(e.memory_bytes),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [hw_line, line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    sim = result.simulation
    summary = (
        f"predicted iteration {format_seconds(result.predicted_iteration_s)}, bubble "
        f"{100 * sim.bubble_fraction:.1f}%, slowest stage {format_seconds(result.slowest_stage_s)}"
    )
    tps = result.predicted_tokens_per_s
    if tps is not None:
        summary += f", {tps:,.0f} tokens/s"
    out.append(summary)
    out.append(
        "peak memory per worker: "
        + " ".join(f"w{i} {format_bytes(b)}" for i, b in enumerate(result.per_worker_memory))
        + f" (limit {format_bytes(result.memory_limit_bytes)})"
    )
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _build_model(args: argparse.Namespace) -> LayeredModel:
    from roundpipe.shared.model import LayeredModel

    overrides = _parse_set(args.set or [])
    lora = None
    if args.lora_rank:
        lora = {
            "r": args.lora_rank,
            "alpha": args.lora_alpha,
            "target_modules": args.lora_targets.split(","),
            "base_quantization": args.base_quantization,
        }
    elif args.base_quantization != "none":
        raise ValueError(
            f"--base-quantization {args.base_quantization} needs --lora-rank: a quantised "
            "base is frozen, so it trains only with LoRA"
        )
    if args.model_config:
        path = Path(args.model_config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read model config {str(path)!r}: {e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {str(path)!r} is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(
                f"model config {str(path)!r} holds a JSON {type(config).__name__}, not an "
                "object; expected a Hugging Face config.json"
            )
        _check_set_keys(config.get("model_type"), overrides)
        config.update(overrides)
        for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
            config.pop(key, None)
        return LayeredModel.from_config(config, lora, dequantize_mxfp4=args.dequantize)
    if args.dequantize:
        raise ValueError("--dequantize needs --model-config: it dequantises a checkpoint's config")
    _check_set_keys(args.architecture, overrides)
    return LayeredModel.from_config({"model_type": args.architecture, **overrides}, lora)


def _check_set_keys(model_type: object, overrides: dict[str, Any]) -> None:
    """Refuse a ``--set`` key the model's config has no field for, as a job spec's
    ``model.config`` does: transformers keeps it and the model ignores it, so a typo
    priced the default model without a word."""
    from transformers import CONFIG_MAPPING

    from roundpipe.coordinator.spec.section_checks import unknown_config_keys

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return  # from_config names what it does not know
    unknown = unknown_config_keys(CONFIG_MAPPING[model_type], overrides)
    if unknown:
        raise ValueError("; ".join(f"--set {key}: {problem}" for key, problem in unknown.items()))


def _host_memory(
    model: LayeredModel, plan: Plan, args: argparse.Namespace, num_microbatches: int
) -> tuple[Any, int, bool]:
    """The job's host memory under ``plan`` (what admission control checks), the
    model's parameter count, and whether layers share gradient slots (Note [gradient
    buffer]; a group then reduces one layer at a time, Note [gradient buckets])."""
    import torch

    from roundpipe.coordinator.spec.sections import TrainSpec
    from roundpipe.coordinator.training.job_planner import replan_pool_capacity
    from roundpipe.coordinator.training.layout import JobLayout
    from roundpipe.coordinator.training.memory import host_memory_needed

    # A job whose plan is the planner's may re-plan (train.replan, on by default): its
    # slot pools have room for more stages, and admission counts them. A pinned plan
    # (--plan, as train.plan) never re-plans.
    capacity = {} if args.plan else replan_pool_capacity(model.num_layers, plan)
    layout = JobLayout.plan_layout(
        model,
        plan,
        compute_dtype=getattr(torch, args.dtype),
        microbatch_rows=args.microbatch_size,
        seq_len=args.seq_len,
        num_microbatches=num_microbatches,
        # The job spec's default gradient buffer (Note [gradient buffer]); float16 trains
        # with loss scaling by default, whose overflow test needs every layer's slot.
        grad_buffer_layers=None
        if args.dtype == "float16"
        else JobLayout.grad_buffer_layers_for(plan, TrainSpec().grad_buffer_stages),
        weight_copies=1 if args.staleness == 0 else 2,  # Note [weight copies]
        **capacity,
    )
    return host_memory_needed(layout), max(1, model.parameter_count()), layout.shares_grad_slots


def build_plan_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of ``roundpipe plan`` (on ``parser``, e.g. a CLI sub-parser)."""
    p = parser or argparse.ArgumentParser(
        prog="roundpipe plan",
        description="Choose a RoundPipe plan for a model on hypothetical hardware and predict "
        "its throughput, bubble fraction and memory with the schedule simulator "
        "(a prediction, not a measurement).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model-config", metavar="CONFIG.json", help="a HF config.json (or its directory)"
    )
    src.add_argument("--architecture", choices=tuple(FAMILIES), help="random-init architecture")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="config override (JSON value)"
    )
    p.add_argument("--lora-rank", type=int, default=0, metavar="R", help="plan for LoRA of rank R")
    p.add_argument("--lora-alpha", type=float, default=16.0, metavar="A")
    p.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        metavar="NAMES",
    )
    p.add_argument(
        "--base-quantization",
        default="none",
        choices=("none", "nf4", "int8"),
        help="with --lora-rank: the frozen base stored and uploaded as NF4 or int8 "
        "(the job spec's lora.base_quantization)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="with --model-config: plan an MXFP4-packed checkpoint (GPT-OSS) as the job "
        "spec's model.dequantize: true trains it, its experts dequantised on load",
    )
    p.add_argument("--workers", type=int, required=True, metavar="N")
    p.add_argument(
        "--memory-limit", default="24GiB", metavar="BYTES", help="per GPU (default 24GiB)"
    )
    p.add_argument("--seq-len", type=int, default=None, metavar="TOKENS")
    p.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence that fits --memory-limit per worker (up to the "
        "model's max_position_embeddings) and say where its memory goes",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="per-layer times a job measured (profile.json in its output directory) "
        "instead of the cost model's; give the job's --seq-len and --microbatch-size",
    )
    p.add_argument("--microbatch-size", type=int, default=1, metavar="ROWS")
    p.add_argument("--microbatches", type=int, default=None, metavar="M", help="default N+1")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--bandwidth", default="25GB/s", metavar="RATE", help="PCIe per GPU and direction"
    )
    p.add_argument(
        "--flops", default="82.6T", metavar="RATE", help="peak dense matmul FLOP/s per GPU"
    )
    p.add_argument("--efficiency", type=float, default=0.7, help="fraction of --flops achieved")
    p.add_argument(
        "--gpu",
        default=None,
        choices=sorted(GPUS),
        help="price each GEMM, attention and elementwise pass by its shape on this GPU "
        "(the shape-aware model, docs/planning.md) instead of --flops x --efficiency",
    )
    p.add_argument(
        "--fp16-accumulation",
        action="store_true",
        help="with --gpu and --dtype float16: GEMMs accumulate in fp16 "
        "(torch.backends.cuda.matmul.allow_fp16_accumulation)",
    )
    p.add_argument(
        "--memory-bandwidth", default="1TB/s", metavar="RATE", help="GPU memory bandwidth"
    )
    p.add_argument("--speeds", default=None, metavar="V,V,...", help="relative speed per worker")
    p.add_argument("--reserve", default="1GiB", metavar="BYTES", help="per GPU, not for stages")
    p.add_argument("--staleness", type=int, default=1, choices=(0, 1))
    p.add_argument(
        "--recompute",
        default="auto",
        choices=("auto", "stage", "layer"),
        help="backward tasks recompute their whole stage or one layer at a time "
        "(train.recompute; auto: the planner's choice)",
    )
    p.add_argument("--optimizer-rate", default=None, metavar="PARAMS/S", help="CPU AdamW rate")
    p.add_argument("--max-tail-layers", type=int, default=None, metavar="K")
    p.add_argument(
        "--plan", default=None, metavar="PLAN", help="evaluate this plan instead of searching"
    )
    p.add_argument("--compare", action="store_true", help="also simulate GPipe/1F1B, stages bound")
    p.add_argument("--grid", action="store_true", help="print the simulated schedule per worker")
    p.add_argument(
        "--timeline",
        default=None,
        metavar="FILE.png",
        help="draw the simulated schedule as `roundpipe timeline` draws a measured one",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--nodes", type=int, default=1, metavar="W", help="servers in a data-parallel group"
    )
    p.add_argument(
        "--network-bandwidth",
        default="1.25GB/s",
        metavar="BYTES/S",
        help="between the servers, per direction (default 10 GbE: %(default)s)",
    )
    p.add_argument(
        "--optimizer-sharding",
        choices=("auto", "replicated", "sharded"),
        default="auto",
        help="with --nodes: the job's train.optimizer_sharding (sharded: each node holds "
        "1/W of the fp32 masters and optimizer states; auto, the job spec's default: "
        "sharded; default %(default)s)",
    )
    p.add_argument(
        "--grad-transport",
        choices=("float32", "bfloat16"),
        default="float32",
        help="with --nodes: the job's train.grad_transport (default %(default)s)",
    )
    p.add_argument(
        "--grad-bucket-mb",
        type=float,
        default=TrainSpec.grad_bucket_mb,
        help="with --nodes: the job's train.grad_bucket_mb, which sizes the collectives' "
        "buffers (default %(default)s)",
    )
    p.add_argument(
        "--collectives-share-cores",
        action="store_true",
        help="with --nodes: the collectives move their bytes on the cores the workers "
        "compute on (CPU workers, several nodes on one host): no overlap is credited",
    )
    return p


def _measured_costs(args: argparse.Namespace, model: LayeredModel):
    """``(costs, about)`` of ``--profile``, checked against the model and the shape asked
    for: measured times hold for the sequence and rows they were measured at."""
    from roundpipe.coordinator.planning.profile import load_profile

    if args.max_seq_len:
        raise ValueError("--profile holds times for one sequence length: give --seq-len")
    costs, about = load_profile(Path(args.profile))
    if len(costs) != model.num_layers:
        raise ValueError(
            f"--profile {args.profile} has {len(costs)} layers, the model {model.num_layers}"
        )
    for key, asked, flag in (
        ("seq_len", args.seq_len, "--seq-len"),
        ("microbatch_rows", args.microbatch_size, "--microbatch-size"),
    ):
        if about.get(key) is not None and about[key] != asked:
            raise ValueError(
                f"--profile {args.profile} was measured with {key} {about[key]}; "
                f"give {flag} {about[key]}"
            )
    return costs, about


def run_plan_command(args: argparse.Namespace) -> int:
    """``roundpipe plan`` on parsed arguments; prints to stdout. Raises ValueError on bad input."""
    if args.seq_len is None and not args.max_seq_len:
        raise ValueError("give --seq-len TOKENS, or --max-seq-len to find the longest that fits")
    if args.workers < 1 or (args.seq_len or 1) < 1 or args.microbatch_size < 1:
        raise ValueError("--workers, --seq-len and --microbatch-size must be >= 1")
    m = args.workers + 1 if args.microbatches is None else args.microbatches
    if m < 1:
        raise ValueError("--microbatches must be >= 1")
    speeds = None
    if args.speeds:
        speeds = tuple(float(x) for x in args.speeds.split(","))
    hw = HardwareSpec(
        num_workers=args.workers,
        memory_limit_bytes=int(parse_quantity(args.memory_limit, what="--memory-limit")),
        bandwidth_bytes_per_s=parse_quantity(args.bandwidth, what="--bandwidth"),
        speeds=speeds,
        reserved_bytes=int(parse_quantity(args.reserve, what="--reserve")),
        # as the coordinator prices GPU workers (planning.hardware.gpu_hardware)
        task_overhead_s=GPU_TASK_OVERHEAD_S,
        optimizer_params_per_s=parse_quantity(args.optimizer_rate, what="--optimizer-rate")
        if args.optimizer_rate
        else None,
    )
    model = _build_model(args)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if args.seq_len is not None and isinstance(max_pos, int) and args.seq_len > max_pos:
        # As a job spec's data.seq_len is refused: no plan for a job that cannot run.
        raise ValueError(
            f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings "
            f"({max_pos}); a job with that data.seq_len is refused"
        )
    recompute = runnable_grain(model, args.recompute)
    if args.recompute == "layer" and recompute != "layer":
        raise ValueError(
            "--recompute layer: a model with the router auxiliary loss "
            "(output_router_logits) recomputes whole stages only; use stage or auto"
        )
    args.recompute = recompute
    flops = parse_quantity(args.flops, what="--flops")
    if args.fp16_accumulation and (args.gpu is None or args.dtype != "float16"):
        raise ValueError("--fp16-accumulation needs --gpu and --dtype float16")
    if args.gpu:
        gpu = GPUS[args.gpu]
        speed = (
            f"{gpu.name} ({'fp16' if args.fp16_accumulation else 'fp32'} accumulation, "
            "shape-aware costs)"
        )
    else:
        speed = f"{flops / 1e12:g} TFLOPS x {args.efficiency:g}"
    memory_bandwidth = parse_quantity(args.memory_bandwidth, what="--memory-bandwidth")
    measured = _measured_costs(args, model) if args.profile else None
    if measured is not None:
        speed = f"layer times measured by job {measured[1].get('job', '?')} ({args.profile})"

    def costs_for(seq_len: int) -> list[LayerCost]:
        if measured is not None:
            return measured[0]
        if args.gpu:
            return estimate_costs_on_gpu(
                model,
                GPUS[args.gpu],
                microbatch_rows=args.microbatch_size,
                seq_len=seq_len,
                compute_dtype=args.dtype,
                fp16_accumulation=args.fp16_accumulation,
            )
        return estimate_costs(
            model,
            microbatch_rows=args.microbatch_size,
            seq_len=seq_len,
            compute_dtype=args.dtype,
            flops_per_s=flops,
            efficiency=args.efficiency,
            memory_bandwidth=memory_bandwidth,
        )

    if args.max_seq_len:
        return _print_longest_sequence(model, hw, m, args, costs_for)
    costs = costs_for(args.seq_len)
    tokens = m * args.microbatch_size * args.seq_len
    if args.plan:
        result = evaluate_plan(
            Plan.parse(args.plan),
            costs,
            hw,
            m,
            staleness=args.staleness,
            tokens_per_iteration=tokens,
            recompute=pinned_grain(args.recompute),
        )
    else:
        result = plan_stages(
            costs,
            hw,
            m,
            max_tail_layers=args.max_tail_layers,
            staleness=args.staleness,
            tokens_per_iteration=tokens,
            recompute=args.recompute,
        )
    baselines = []
    if args.compare:
        for schedule in ("gpipe", "1f1b"):
            baselines.append(
                bound_baseline(costs, hw, m, schedule=schedule, tokens_per_iteration=tokens)
            )
    host, params, shares_slots = _host_memory(model, result.plan, args, m)
    base = _base_figures(model, costs, result.plan, args)
    drawn = None
    if args.timeline:  # observability: the prediction as a picture (roundpipe.timeline_plot)
        from roundpipe.timeline_plot import draw_plan_timeline

        what = f"{model.architecture}, {hw.num_workers} workers, {m} microbatches"
        drawn = draw_plan_timeline(result, args.timeline, describe=what)
    header = (
        f"SIMULATED PREDICTION (cost model + schedule simulator, not a measurement): "
        f"{model.architecture}, {model.num_layers} layers"
        f"{' (LoRA r=' + str(args.lora_rank) + ')' if args.lora_rank else ''}, "
        f"{hw.num_workers} workers x {format_bytes(hw.memory_limit_bytes)}, "
        f"PCIe {hw.bandwidth_bytes_per_s / 1e9:g} GB/s, {speed}, "
        f"{args.dtype}, recompute at {result.recompute} grain, {m} microbatches x "
        f"{args.microbatch_size} x "
        f"{args.seq_len} tokens"
    )
    multinode = _multinode_prediction(model, result, args, tokens)
    per_node = _sharded_host_memory(model, host, args, shares_slots=shares_slots)
    if args.json:
        doc = {
            "prediction": "simulated",
            "plan": str(result.plan),
            "predicted_iteration_s": result.predicted_iteration_s,
            "predicted_tokens_per_s": result.predicted_tokens_per_s,
            "bubble_fraction": result.bubble_fraction,
            "recompute": result.recompute,
            "per_worker_memory": list(result.per_worker_memory),
            "stages": [asdict(e) for e in result.stages],
            "notes": list(result.notes),
            "host_memory": {
                "arenas": host.arenas,
                **host.components(),
                "total": host.total,
                "bytes_per_parameter": host.total / params,
            },
            "base": base,
            "baselines": [
                {
                    "schedule": b.schedule,
                    "split": [list(r) for r in b.split],
                    "iteration_s": b.iteration_s,
                    "tokens_per_s": b.simulation.tokens_per_s,
                    "bubble_fraction": b.simulation.bubble_fraction,
                    "stage_memory": list(b.stage_memory),
                    "oom": b.oom,
                }
                for b in baselines
            ],
        }
        if multinode is not None:
            doc["multinode"] = asdict(multinode)
        if per_node is not None:
            for key, figure in zip(
                ("host_memory_per_node_sharded", "host_memory_rank0_writing_sharded"), per_node
            ):
                doc[key] = {
                    **figure.components(),
                    "total": figure.total,
                    "bytes_per_parameter": figure.total / params,
                }
        print(json.dumps(doc, indent=2))
        return 0
    print(header)
    print(describe(result))
    print(
        f"this job needs {host.describe(params)} for {params:,} parameters; the "
        "coordinator refuses a job that does not fit"
    )
    print(
        f"weights uploaded per iteration: {format_bytes(base['weight_upload_bytes_per_iteration'])}"
        + (
            f"; frozen base {base['quantization']}: "
            f"{base['host_bytes_per_frozen_param']:.3f} bytes per quantised parameter"
            if base["quantization"] != "none"
            else ""
        )
    )
    for b in baselines:
        tps = b.simulation.tokens_per_s or 0.0
        print(
            f"{b.schedule} with stages bound to GPUs (balanced split, weights resident, no "
            f"recompute): {tps:,.0f} tokens/s, bubble {100 * b.simulation.bubble_fraction:.1f}%, "
            f"peak memory {format_bytes(max(b.stage_memory))}" + (" -> OOM" if b.oom else "")
        )
    if multinode is not None:
        bandwidth = parse_quantity(args.network_bandwidth, what="--network-bandwidth")
        print(multinode.describe(bandwidth))
    if per_node is not None:
        node, rank0 = per_node
        print(
            f"with the optimizer state sharded over {args.nodes} nodes, each node needs "
            f"{node.describe(params)}; rank 0, while it writes a checkpoint, "
            f"{rank0.describe(params)}"
        )
    if args.grid:
        print("schedule (one line per worker; '|' separates tasks):")
        print(result.simulation.grid(iteration=result.simulation.iterations))
    if drawn is not None:
        print(f"timeline drawn to {drawn}")
    return 0


def _print_longest_sequence(
    model: LayeredModel,
    hw: HardwareSpec,
    m: int,
    args: argparse.Namespace,
    costs_for: Callable[[int], list[LayerCost]],
) -> int:
    """``--max-seq-len``: the longest sequence that fits, its plan and its memory."""
    if not hw.gpu_memory_limited:
        raise ValueError("--max-seq-len needs a finite --memory-limit")
    top = getattr(model.config, "max_position_embeddings", None) or (1 << 20)
    fit = longest_sequence(
        costs_for,
        hw,
        m,
        rows=args.microbatch_size,
        hi=int(top),
        recompute=pinned_grain(args.recompute) if args.plan else args.recompute,
        plan=Plan.parse(args.plan) if args.plan else None,
        staleness=args.staleness,
    )
    if fit is None:
        if hw.reserved_bytes >= hw.memory_limit_bytes:
            raise ValueError(
                f"--reserve ({args.reserve}) leaves nothing of --memory-limit "
                f"({args.memory_limit}) to the job: give a smaller --reserve"
            )
        raise ValueError(
            "not even a 2-token sequence fits: a single layer is too large for one worker"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "max_seq_len": fit.seq_len,
                    "plan": str(fit.result.plan),
                    "recompute": fit.result.recompute,
                    "fullest_stage": fit.stage,
                    "needed_bytes": fit.needed,
                    "memory_parts": fit.parts,
                    "memory_limit_bytes": fit.limit,
                    "predicted_tokens_per_s": fit.result.predicted_tokens_per_s,
                }
            )
        )
        return 0
    print(
        f"SIMULATED PREDICTION (cost model, not a measurement): {model.architecture}, "
        f"{hw.num_workers} workers x {format_bytes(hw.memory_limit_bytes)}, "
        f"{args.microbatch_size} row(s) per microbatch, {m} microbatches, {args.dtype}"
    )
    print(fit.describe())
    if fit.seq_len >= top:
        print(f"(the model's max_position_embeddings, {top:,}, is the limit here)")
    print(f"plan {fit.result.plan}")
    tps = fit.result.predicted_tokens_per_s
    if tps:
        print(f"predicted {tps:,.0f} tokens/s at that length")
    return 0


def _base_figures(
    model: LayeredModel, costs: Sequence[Any], plan: Plan, args: argparse.Namespace
) -> dict[str, Any]:
    """The frozen base's storage (``--base-quantization``): host bytes per quantised
    parameter, and the weight bytes every task of an iteration uploads (each task
    uploads its layers' weights once, in what ``costs`` says they take on the bus)."""
    quantized = model.quantized_base
    per_param = 0.0
    if quantized is not None and quantized.shapes:
        stored = sum(quantized.format.nbytes(shape) for shape in quantized.shapes.values())
        numel = sum(math.prod(shape) for shape in quantized.shapes.values())
        per_param = stored / numel
    uploads = sum(
        costs[layer].param_bytes
        for stage in plan.stages()
        for layer in range(stage.start, stage.stop)
    )
    return {
        "quantization": args.base_quantization,
        "host_bytes_per_frozen_param": per_param,
        "weight_upload_bytes_per_iteration": int(uploads),
    }


def _multinode_prediction(
    model: LayeredModel, result: PlanResult, args: argparse.Namespace, tokens: int
) -> DataParallelPrediction | None:
    """``--nodes`` > 1: the data-parallel step of that many servers, else None."""
    if args.nodes == 1:
        return None
    return predict_data_parallel(
        iteration_s=result.predicted_iteration_s,
        tokens_per_iteration=tokens,
        trainable_params=model.parameter_count(trainable_only=True),
        nodes=args.nodes,
        bandwidth_bytes_per_s=parse_quantity(args.network_bandwidth, what="--network-bandwidth"),
        staleness=args.staleness,
        sharded=args.optimizer_sharding != "replicated",
        weight_bytes=2 if args.dtype in ("bfloat16", "float16") else 4,
        grad_bytes=2 if args.grad_transport == "bfloat16" else 4,
        shared_cores=args.collectives_share_cores,
    )


def _sharded_host_memory(
    model: LayeredModel, host: Any, args: argparse.Namespace, *, shares_slots: bool
) -> tuple[Any, Any] | None:
    """Host memory with the optimizer state sharded over ``--nodes``: a node's (1/W of the
    fp32 masters and states, Note [shard boundaries], and its collectives' buffers) and
    rank 0's while it writes a checkpoint (the same, plus the whole masters and a layer's
    states: Note [streamed checkpoint state]); None without sharding. ``shares_slots``:
    the plan's layers share gradient slots, so the collectives take one layer at a time
    (Note [gradient buckets])."""
    if args.nodes == 1 or args.optimizer_sharding == "replicated":
        return None
    from dataclasses import replace

    from roundpipe.coordinator.training.memory import (
        checkpoint_gather_nbytes,
        collective_buffer_nbytes,
    )
    from roundpipe.coordinator.training.sharded_optimizer import bucket_cap_mb

    node = replace(
        host,
        masters=-(-host.masters // args.nodes),
        moments=-(-host.moments // args.nodes),
        collectives=collective_buffer_nbytes(
            model,
            args.nodes,
            sharded=True,
            transport_bytes=2 if args.grad_transport == "bfloat16" else 4,
            weight_bytes=4 if args.dtype == "float32" else 2,
            bucket_mb=bucket_cap_mb(args.grad_bucket_mb, shares_slots),
        ),
    )
    return node, replace(node, gathered=checkpoint_gather_nbytes(model, host.masters, host.moments))


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``roundpipe plan ...``: 0 ok, 2 usage or input error (message on stderr)."""
    parser = build_plan_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return run_plan_command(args)
    except ValueError as exc:
        print(f"roundpipe plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(plan_main())
