"""The chunked LM head and cross-entropy of a fused tail (docs/model-execution.md,
"Chunked LM head"): the loss and its gradients without ever materialising the
``[tokens, vocab]`` logits."""

from __future__ import annotations

import torch

from roundpipe.shared.model import IGNORE_INDEX

__all__ = ["chunked_lm_head_loss"]


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_label_tokens: int,
    chunk_tokens: int,
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    positions: torch.Tensor | None = None,
    grad_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Cross-entropy of ``hidden @ weight.T`` against already shifted ``labels``.

    hidden ``[T, H]`` (compute dtype), weight ``[V, H]``, labels ``[T]`` with -100 for
    no loss. ``positions`` (the indices of labels that are not -100) may be given,
    computed on the host, so that no ``nonzero()`` synchronises a GPU. Returns (fp32 loss = sum of token losses / num_label_tokens, d loss / d
    hidden in hidden's dtype or None, fp32 d loss / d weight or None). At most
    ``chunk_tokens`` rows of logits exist at a time. Note [chunked LM head].
    The gradients are those of ``grad_scale`` times the loss (float16 loss scaling: a
    power of two, so 1.0 and any other scale round alike); the loss is not scaled.
    """
    # Gradients are formed explicitly here; autograd would keep every chunk's logits.
    with torch.no_grad():
        return _chunked_lm_head_loss(
            hidden,
            weight,
            labels,
            num_label_tokens,
            chunk_tokens,
            need_hidden_grad,
            need_weight_grad,
            positions,
            grad_scale,
        )


def _chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_label_tokens: int,
    chunk_tokens: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    positions: torch.Tensor | None,
    grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    dev = hidden.device
    # d(scaled loss)/d(logits) = (softmax - onehot) * grad_scale / N: the denominator
    # below is N / grad_scale (exact: the scale is a power of two).
    denominator = num_label_tokens if grad_scale == 1.0 else num_label_tokens / grad_scale
    rows = positions if positions is not None else (labels != IGNORE_INDEX).nonzero().squeeze(1)
    num_rows = rows.numel()
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    grad_h = torch.zeros_like(hidden) if need_hidden_grad else None
    grad_w = (
        torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_weight_grad else None
    )
    need_grad = need_hidden_grad or need_weight_grad
    # One fp32 buffer reused by every chunk: the peak stays at one chunk of logits, and
    # on the CPU the pages stay mapped instead of faulting in afresh for each chunk.
    buf = torch.empty(
        (min(chunk_tokens, num_rows), weight.shape[0]), dtype=torch.float32, device=dev
    )
    for i in range(0, num_rows, chunk_tokens):
        idx = rows[i : i + chunk_tokens]
        h = hidden.index_select(0, idx)
        y = labels.index_select(0, idx).unsqueeze(1)
        logits = buf[: idx.numel()]
        # Logits in the compute dtype, then fp32, as HF's lm_head + ForCausalLMLoss do.
        if hidden.dtype == torch.float32:
            torch.matmul(h, weight.t(), out=logits)
        else:
            logits.copy_(torch.matmul(h, weight.t()))
        # Stable log-sum-exp done in place: logits -> exp(logits - max).
        logits.sub_(logits.amax(dim=1, keepdim=True))
        target = logits.gather(1, y)
        logits.exp_()
        sumexp = logits.sum(dim=1, keepdim=True)
        loss += (sumexp.log() - target).sum()
        if not need_grad:
            continue
        # d(loss)/d(logits) = (softmax - onehot(label)) / N, still in place.
        logits.div_(sumexp.mul_(denominator))
        logits.scatter_add_(
            1, y, torch.full(y.shape, -1.0 / denominator, dtype=logits.dtype, device=dev)
        )
        g = logits if hidden.dtype == torch.float32 else logits.to(hidden.dtype)
        if grad_h is not None:
            grad_h.index_copy_(0, idx, torch.matmul(g, weight))
        if grad_w is not None:
            grad_w.add_(torch.matmul(g.t(), h))
        del g
    return loss / num_label_tokens, grad_h, grad_w
