"""Packing modes side by side: the same conversations as rows packed three ways.

For ``none`` (one conversation per padded row), ``documents`` (shared rows, no
cross-document attention) and ``concat`` (shared rows, attention across documents) this
builds the rows of the bundled demo conversations with the chat tokenizer, runs one
training step (forward, loss, backward through StageExecutor, every row in one global
batch) per mode on the same weights, and prints rows, padding, trained tokens, step time
and trained tokens per second, then the ``documents`` / ``none`` step-time ratio as the
last line (``RESULT key=value``). ``documents`` and ``none`` give the same loss (checked
here, printed as the loss column); ``concat`` does not and is only there for its time.

    python benchmarks/packing.py [--conversations N] [--seq-len S] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from roundpipe.coordinator.spec.data import build_dataset
from roundpipe.coordinator.spec.paths import DEMO_DATA_DIR
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.worker.executor import StageExecutor
from roundpipe.worker.reference import run_iteration  # one iteration, in this process

MODES = ("none", "documents", "concat")


def _step(layered, weights, ds, executor, microbatch_rows: int) -> tuple[float, float]:
    """(loss, seconds) of one step over every row of ``ds``."""
    index = torch.arange(ds.num_rows)
    ids, labels = ds.rows(index)
    pos = ds.position_ids(index)
    mbs = list(zip(ids.split(microbatch_rows), labels.split(microbatch_rows)))
    plan = Plan.parse(f"F[0:2] T[2:{layered.num_layers}] B[0:2]")
    start = time.perf_counter()
    res = run_iteration(
        layered, plan, weights, mbs, executor, position_ids=list(pos.split(microbatch_rows))
    )
    if executor.device.type == "cuda":
        torch.cuda.synchronize()
    return res.loss, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--microbatch-rows", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--smoke", action="store_true", help="16 conversations, a narrow model of the same depth"
    )
    a = p.parse_args(argv)
    if a.smoke:
        # The default's 4 layers (so the same F / T / B stages) and enough conversations
        # that every mode still has more than one microbatch.
        a.conversations, a.hidden = 16, 64
    from transformers import AutoTokenizer, Qwen3Config

    tok = AutoTokenizer.from_pretrained(
        str(DEMO_DATA_DIR / "chat_tokenizer"), local_files_only=True
    )
    chats = [json.loads(line) for line in (DEMO_DATA_DIR / "demo_chat.jsonl").open()][
        : a.conversations
    ]
    tmp = tempfile.TemporaryDirectory(prefix="roundpipe-packing-")
    data = Path(tmp.name) / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.hidden // 4,
        max_position_embeddings=max(512, a.seq_len),
    )
    layered = LayeredModel(config)
    weights = layered.init_weights(0)
    executor = StageExecutor(layered, a.device)
    print(
        f"{a.conversations} demo conversations, seq_len {a.seq_len}, Qwen3 hidden {a.hidden} "
        f"x {a.layers} layers, {a.device}, one step over all rows"
    )
    print(
        f"{'mode':<10} {'rows':>5} {'pad %':>6} {'trained':>8} {'loss':>9} {'step s':>7} {'trained/s':>10}"
    )
    results = {}
    for mode in MODES:
        ds = build_dataset(data, seq_len=a.seq_len, tokenizer=tok, packing=mode)
        _step(layered, weights, ds, executor, a.microbatch_rows)  # warm-up
        loss, seconds = _step(layered, weights, ds, executor, a.microbatch_rows)
        results[mode] = (loss, seconds)
        pad = 1 - ds.num_tokens / (ds.num_rows * ds.seq_len)
        print(
            f"{mode:<10} {ds.num_rows:>5} {pad:>6.1%} {ds.num_trained_tokens:>8} {loss:>9.5f} "
            f"{seconds:>7.3f} {ds.num_trained_tokens / seconds:>10.0f}"
        )
    same = abs(results["documents"][0] - results["none"][0]) <= 1e-5 * abs(results["none"][0])
    print(f"documents loss equals none: {same}")
    ratio = results["documents"][1] / results["none"][1]
    print(f"RESULT documents_over_none_step_time={ratio:.3f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
