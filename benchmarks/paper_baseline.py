"""The paper's library (PyPI ``roundpipe`` 0.1.1, LGPL-3.0) as a baseline, one run.

Started by ``benchmarks/gpu_throughput.py`` in its own process, with the library's
install directory first on PYTHONPATH: its import name is also ``roundpipe``, so this
file imports nothing of ours. Only its public API is called (wrap a transformers model,
``forward_backward``, ``step``, ``synchronize``); nothing of it is copied here.

It trains the given config with random weights on random tokens (labels = inputs) and
prints one JSON line: tokens/s over the timed steps and the peak GPU memory.

Usage (see gpu_throughput.py): python paper_baseline.py --job JSON
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="JSON: the benchmark job")
    job = json.loads(parser.parse_args().job)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # it claims every visible GPU

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, job["dtype"])
    cap_bytes = job.get("memory_limit_bytes")
    if cap_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, 0)
    config = AutoConfig.for_model(job["model_type"], **job["config"])
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    lora = job.get("lora")
    if lora:
        from peft import LoraConfig, LoraModel

        cfg = LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"]
        )
        # Its presets match the transformers class; peft's LoraModel injects the
        # adapters in place and keeps that class (the library's documented LoRA path).
        model = LoraModel(model, cfg, "default").model
        for name, param in model.named_parameters():
            param.requires_grad = "lora_" in name

    import roundpipe as paper  # the paper's library, not ours
    from roundpipe.optim import Adam
    from roundpipe.scheduler import ModelExecutePlan

    m = job["num_microbatches"]
    wrapped = paper.wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=paper.RoundPipeRunConfig(num_microbatch=m),
        optim_dtype=torch.float32,
    )
    optim = Adam(wrapped.optim_parameters(), lr=job["lr"], decoupled_weight_decay=True)

    def optimizer_step() -> None:
        optim.step()
        optim.zero_grad()

    run_config = None
    if cap_bytes:
        # It budgets 60% of the free GPU memory it saw at import; under an emulated cap
        # that must be 60% of the cap, as on a real card of that size.
        def run_config():  # noqa: E306 -- recomputed per step: it re-plans from timings
            plan = ModelExecutePlan.auto(
                "fused", wrapped, model_memory_limit=0.6 * cap_bytes / 2**30
            )
            return paper.RoundPipeRunConfig(num_microbatch=m, execute_plan=plan)

    rows, seq = job["microbatch_rows"] * m, job["seq_len"]
    gen = torch.Generator().manual_seed(1)
    start = None
    for step in range(1, job["warmup"] + job["steps"] + 1):
        if step == job["warmup"] + 1:
            wrapped.synchronize()
            torch.cuda.synchronize()
            start = time.perf_counter()
        ids = torch.randint(0, config.vocab_size, (rows, seq), generator=gen)
        kwargs = {"input_ids": ids, "labels": ids, "return_logits": False}
        extra = {"run_config": run_config()} if run_config is not None else {}
        wrapped.forward_backward(
            input_kwargs=kwargs, loss_fn=lambda out, _label: out.loss / m, **extra
        )
        wrapped.step(optimizer_step, is_async=True)
    wrapped.synchronize()
    torch.cuda.synchronize()
    assert start is not None
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "tokens_per_s": rows * seq * job["steps"] / seconds,
                "gpu_peak_mib": torch.cuda.max_memory_reserved() / 2**20,
                # its runtime type checks, on by its own rule (beartype >= 0.23, Python
                # >= 3.12): they slow it, so the figure says whether they ran
                "beartype_checks": bool(getattr(paper, "ENABLE_BEAR", False)),
            }
        ),
        flush=True,
    )
    os._exit(0)  # its worker threads do not stop on their own


if __name__ == "__main__":
    main()
