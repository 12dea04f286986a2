"""Issue 36's numerics: a job at 8K tokens per row, with recompute at layer grain, the
long-row attention (Note [long-row attention]) and the sequence-chunked MLP (Note
[sequence-chunked MLP]) all on, packed documents included, trains what the plain
single-process loop over the transformers model trains (fp32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import (
    TINY_QWEN3,
    assert_params_match,
    oracle_train,
    tiny_spec,
    trained_in_process,
)

from roundpipe.worker import document_attention, mlp_chunks
from roundpipe.worker.executor import StageExecutor

SEQ = 8192


@pytest.mark.slow
def test_8k_rows_with_layer_recompute_match_the_plain_loop(
    tmp_path, arena_dir, monkeypatch
) -> None:
    config = dict(TINY_QWEN3, num_hidden_layers=3, max_position_embeddings=SEQ)
    spec = tiny_spec(
        tmp_path,
        steps=2,
        config=config,
        microbatch_size=1,
        num_microbatches=2,
        seq_len=SEQ,
        packing="documents",
        plan="F[0:3] T[3:5] B[0:3]",
        train={"recompute": "layer"},
    )
    # What ran: backward tasks at layer grain, rows attended document by document (the
    # packed rows have many), the MLP over sequence chunks.
    grains: list[str] = []
    documents: list[int] = []
    chunked: list[int] = []
    backward = StageExecutor.backward
    long_rows = document_attention.long_rows
    run_chunked = mlp_chunks._chunked

    def spy_backward(self, *args, recompute: str = "stage", **kwargs):
        grains.append(recompute)
        return backward(self, *args, recompute=recompute, **kwargs)

    def spy_long_rows(spans):
        documents.append(len(spans[0]))
        return long_rows(spans)

    def spy_chunked(*args, **kwargs):
        chunked.append(1)
        return run_chunked(*args, **kwargs)

    monkeypatch.setattr(StageExecutor, "backward", spy_backward)
    monkeypatch.setattr("roundpipe.worker.executor.long_rows", spy_long_rows)
    monkeypatch.setattr(mlp_chunks, "_chunked", spy_chunked)
    with trained_in_process(spec, arena_dir, 2, job_id="job-long", namespace="longctx") as trainer:
        runtime_losses = [e.loss for e in trainer.progress]
        runtime = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
    assert grains and set(grains) == {"layer"}
    assert documents and min(documents) > 1  # packed documents took the long-row path
    assert chunked
    losses: list[float] = []
    oracle = oracle_train(spec, losses=losses)
    assert len(runtime_losses) == len(losses) == 2
    for got, want in zip(runtime_losses, losses):
        assert abs(got - want) <= 1e-5 * abs(want), (runtime_losses, losses)
    assert_params_match(runtime, oracle, rtol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_the_chunked_mlp_equals_the_whole_one(lora, monkeypatch) -> None:
    """Note [sequence-chunked MLP]: above the long-row threshold the MLP sees at most a
    chunk of the sequence, in the forward and in the layer-grain backward's recompute;
    outputs and gradients equal the unchunked MLP's (fp32, float noise)."""
    from model_helpers import LORA_SPEC, tiny_config

    from roundpipe.shared.model import LayeredModel
    from roundpipe.worker.executor import RngKey

    spec = dict(LORA_SPEC, target_modules=["gate_proj", "down_proj"]) if lora else None
    model = LayeredModel(tiny_config("qwen3"), spec)
    weights = model.init_weights(seed=1)
    last = model.num_layers - 1
    seq, chunk = 300, 64
    ids = torch.randint(0, model.vocab_size, (2, seq), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(document_attention, "LONG_ROW_TOKENS", 256)
    heights: list[int] = []
    mlp0 = model.decoder_part(1)[0].mlp
    gate = mlp0.gate_proj.base_layer if lora else mlp0.gate_proj
    hook = gate.register_forward_pre_hook(lambda m, args: heights.append(args[0].shape[1]))
    results = {}
    try:
        for mode, tokens in (("whole", 1 << 30), ("chunked", chunk)):
            heights.clear()
            monkeypatch.setattr(mlp_chunks, "MLP_CHUNK_TOKENS", tokens)
            ex = StageExecutor(model)
            w = model.range_weights(weights, 0, last)
            out = ex.forward(0, last, w, [ids]).outputs
            g = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(3))
            back = ex.backward(0, last, w, [ids], [g], rng=RngKey(1, 1), recompute="layer")
            results[mode] = (out[0], back.weight_grads)
            assert back.weight_grads
            if mode == "chunked":
                assert heights and max(heights) == chunk, sorted(set(heights))
            else:
                assert set(heights) == {seq}
    finally:
        hook.remove()
    (out_w, grads_w), (out_c, grads_c) = results["whole"], results["chunked"]
    torch.testing.assert_close(out_c, out_w, rtol=1e-6, atol=1e-6)
    assert grads_c.keys() == grads_w.keys()
    for name, g in grads_w.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_capped_cpu_worker_fails_loudly_naming_the_cap() -> None:
    """Note [CPU memory cap]: past the cap an allocation fails at once (no swapping, no
    OOM kill) and the worker's failure message names the cap."""
    import subprocess
    import sys

    script = """
import torch
from roundpipe.worker import memory_cap
cap = memory_cap.private_bytes() + 64 * 2**20
memory_cap.apply_cpu_memory_cap(cap)
small = torch.ones(2**20)  # 4 MiB: fits
try:
    torch.ones(2**26)  # 256 MiB: does not
except RuntimeError as exc:
    print(memory_cap.describe_failure(exc))
else:
    print("allocated past the cap")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "the worker's memory cap of" in out.stdout, out.stdout
    assert "RLIMIT_DATA" in out.stdout
