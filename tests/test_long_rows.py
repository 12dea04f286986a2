"""Long rows without seq x seq masks (Note [long-row attention], worker/document_attention.py):
packed documents and sliding windows attended piece by piece, equal to the masked
computation; a layer-grain backward at a long row equal to the stage-grain one."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import tiny_config

from roundpipe.shared.model import LayeredModel
from roundpipe.worker import document_attention
from roundpipe.worker.document_attention import document_spans, long_rows
from roundpipe.worker.executor import RngKey, StageExecutor


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def _reference(q, k, v, spans, window: int | None) -> torch.Tensor:
    """Masked SDPA over the whole row: a key is visible when it is in the query's
    document, not after it, and (with a window) within it."""
    seq = q.shape[2]
    doc = torch.empty(seq, dtype=torch.long)
    for i, (a, b) in enumerate(spans[0]):
        doc[a:b] = i
    qi, ki = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    mask = (doc.unsqueeze(1) == doc.unsqueeze(0)) & (ki <= qi)
    if window is not None:
        mask &= ki > qi - window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


@pytest.mark.parametrize("window", [None, 700])
def test_documents_and_windows_attended_piece_by_piece_equal_the_mask(window) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [1500, 37, 2600, 963]  # a document longer than a block, one shorter
    seq = sum(lengths)
    q = torch.randn(1, 4, seq, 16, generator=g)
    k, v = torch.randn(1, 2, seq, 16, generator=g), torch.randn(1, 2, seq, 16, generator=g)
    spans = document_spans(_packed_positions(lengths))
    assert spans == [[(0, 1500), (1500, 1537), (1537, 4137), (4137, 5100)]]
    with long_rows(spans):
        out, _ = document_attention._attention(
            _Module(), q, k, v, None, scaling=1 / math.sqrt(16), sliding_window=window
        )
    torch.testing.assert_close(out, _reference(q, k, v, spans, window), rtol=1e-5, atol=1e-6)
    # Without declared documents (or with a mask) it is transformers' SDPA, untouched.
    plain, _ = document_attention._attention(_Module(), q, k, v, None, scaling=0.25)
    assert plain.shape == out.shape


@pytest.mark.parametrize("window", [None, 700])
def test_keys_repeated_to_every_query_head_attend_as_the_groups_do(window, monkeypatch) -> None:
    """fp32 grouped heads on CUDA take the repeated-keys path (SDPA's only streaming
    kernel for them there); forced here on the CPU, it gives the grouped result."""
    g = torch.Generator().manual_seed(1)
    lengths = [1200, 1900]
    seq = sum(lengths)
    q = torch.randn(1, 4, seq, 16, generator=g)
    k, v = torch.randn(1, 2, seq, 16, generator=g), torch.randn(1, 2, seq, 16, generator=g)
    spans = document_spans(_packed_positions(lengths))
    args = dict(scaling=0.25, sliding_window=window)
    assert not document_attention._needs_full_heads(_Module(), q)  # a CPU tensor
    with long_rows(spans):
        grouped, _ = document_attention._attention(_Module(), q, k, v, None, **args)
    monkeypatch.setattr(document_attention, "_needs_full_heads", lambda module, query: True)
    with long_rows(spans):
        repeated, _ = document_attention._attention(_Module(), q, k, v, None, **args)
    torch.testing.assert_close(repeated, grouped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(repeated, _reference(q, k, v, spans, window), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_a_long_fp32_grouped_row_on_cuda_runs_on_a_streaming_kernel() -> None:
    """With the math kernel ruled out, an fp32 grouped-query row still attends: it does
    not need the seq x seq scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    seq = 8192
    q = torch.randn(1, 4, seq, 64, device="cuda", generator=g)
    k = torch.randn(1, 2, seq, 64, device="cuda", generator=g)
    v = torch.randn(1, 2, seq, 64, device="cuda", generator=g)
    spans = [[(0, 3000), (3000, seq)]]
    with long_rows(spans), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out, _ = document_attention._attention(_Module(), q, k, v, None, scaling=0.125)
    assert out.shape == (1, seq, 4, 64) and torch.isfinite(out).all()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # a plain causal row: no spans
        plain, _ = document_attention._attention(_Module(), q, k, v, None, scaling=0.125)
    assert plain.shape == (1, seq, 4, 64) and torch.isfinite(plain).all()


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_a_long_packed_row_matches_the_masked_computation(arch, monkeypatch) -> None:
    """The executor at LONG_ROW_TOKENS: forward and layer-grain backward of a row of
    packed documents (mistral: a sliding window too) against the same with transformers'
    masks, fp32, within 1e-5."""
    model = LayeredModel.from_config(tiny_config(arch))
    weights = model.init_weights(seed=1)
    last = model.num_layers - 1
    lengths = [1200, 2000, 896]
    seq = sum(lengths)
    assert seq >= document_attention.LONG_ROW_TOKENS
    ids = torch.randint(0, model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(2))
    positions = [_packed_positions(lengths)]
    grads = None
    results = {}
    calls: list[int] = []  # query lengths of the SDPA calls
    sdpa = document_attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(document_attention, "sdpa_attention_forward", counted)
    threshold = document_attention.LONG_ROW_TOKENS
    for mode, tokens in (("masked", 1 << 30), ("pieces", threshold)):
        calls.clear()
        monkeypatch.setattr(document_attention, "LONG_ROW_TOKENS", tokens)
        ex = StageExecutor(model)
        w = model.range_weights(weights, 0, last)
        out = ex.forward(0, last, w, [ids], position_ids=positions).outputs
        if grads is None:
            grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(3)) for o in out]
        back = ex.backward(
            0, last, w, [ids], grads, rng=RngKey(1, 1), position_ids=positions, recompute="layer"
        )
        results[mode] = (out[0], back.weight_grads)
        # masks: one call per layer over the whole row; pieces: per document or block
        assert (max(calls) == seq) == (mode == "masked"), (mode, sorted(set(calls)))
    (out_m, grads_m), (out_p, grads_p) = results["masked"], results["pieces"]
    torch.testing.assert_close(out_p, out_m, rtol=1e-5, atol=1e-5)
    for name, g in grads_m.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-5, atol=1e-5, msg=name)
