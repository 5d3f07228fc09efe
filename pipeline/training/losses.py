"""Chunked fp32 cross-entropy from the final hidden states, without materialising [tokens, vocab].

Why fp32, and where: the transformer body may run under bf16 autocast, but the loss never does.
Each chunk's logits are computed as ``hidden.float() @ weight.float().T`` with autocast disabled:
the bf16 hidden states are upcast exactly, the lm-head weight is the fp32 master copy, the matmul
accumulates and *stores* fp32 logits, and log-sum-exp runs in fp32. A bf16 matmul that upcasts its
output afterwards would round every logit to 8 mantissa bits (an absolute error of ~0.06 at a logit
of 16) before the softmax — exactly the silent "bf16 cross-entropy" failure that makes a training
loss look better than the true loss. (On CUDA the trainer lets fp32 matmuls use TF32 tensor cores
when the body is bf16: inputs rounded to 10 mantissa bits, accumulation and output in fp32.)

Why chunked: a full fp32 logits tensor for 131K tokens × 2^17 vocab is 68 GB. The tokens are split
into chunks of ``chunk`` rows; only one chunk's [chunk, vocab] logits exist at a time. The backward
is fused into the forward (custom autograd function): while a chunk's softmax is in hand, its
gradients d(hidden) = (softmax − onehot)·W and d(W) += (softmax − onehot)ᵀ·hidden are computed, so
backward keeps only d(hidden) [tokens, dim] and d(W) [vocab, dim] alive and recomputes nothing.
Under ``torch.no_grad`` (validation) no gradient work is done at all.

The function always runs eagerly (``torch.compiler.disable``): under a compiled trainer the body is
compiled and the loss is a graph break, so the one-chunk-at-a-time memory bound holds exactly as
written instead of depending on how a compiler schedules the unrolled chunk loop.

The loss is returned as a **sum** with a token **count** so that callers can form the exact
token-weighted mean over micro-steps and ranks (see pipeline/training/train.py).
"""
from __future__ import annotations

import torch

__all__ = ["chunked_cross_entropy", "chunked_eval_stats"]


def _flatten(hidden, targets, mask):
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    m = None if mask is None else mask.reshape(-1).to(torch.float32)
    return h, t, m


def _chunk_logits(h_chunk: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """fp32 logits [chunk, vocab] of one chunk (autocast must be off around this call)."""
    return h_chunk.float() @ w32.T


class _FusedChunkedCE(torch.autograd.Function):
    """Sum of per-token CE over chunks; gradients are computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, h, weight, t, m, chunk):
        w32 = weight.float()
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        grad_w = torch.zeros(w32.shape, dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            h_c, t_c = h[s:s + chunk].float(), t[s:s + chunk]
            logits = _chunk_logits(h_c, w32)
            lse = torch.logsumexp(logits, dim=-1)
            tok_loss = lse - logits.gather(1, t_c[:, None]).squeeze(1)
            # d(loss)/d(logits) = softmax - onehot(target), times the loss mask; built in place.
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, t_c[:, None], torch.full_like(lse[:, None], -1.0))
            if m is not None:
                m_c = m[s:s + chunk]
                tok_loss = tok_loss * m_c
                probs.mul_(m_c[:, None])
            loss = loss + tok_loss.sum()
            grad_h[s:s + chunk] = probs @ w32
            grad_w.addmm_(probs.T, h_c)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_out).to(h_dtype), (grad_w * grad_out).to(w_dtype), None, None, None


def _forward_only(h, weight, t, m, chunk, with_accuracy: bool):
    """Loss sum (and number of correct top-1 predictions) without any gradient bookkeeping."""
    w32 = weight.float()
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    correct = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        t_c = t[s:s + chunk]
        logits = _chunk_logits(h[s:s + chunk], w32)
        tok_loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, t_c[:, None]).squeeze(1)
        hit = (logits.argmax(dim=-1) == t_c).float() if with_accuracy else None
        if m is not None:
            tok_loss = tok_loss * m[s:s + chunk]
            hit = hit * m[s:s + chunk] if with_accuracy else None
        loss = loss + tok_loss.sum()
        if with_accuracy:
            correct = correct + hit.sum()
    return loss, correct


@torch.compiler.disable
def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cross-entropy of ``hidden @ lm_head_weight.T`` against ``targets``, chunked over tokens.

    hidden: [..., dim] (any float dtype, e.g. bf16 from an autocast body); lm_head_weight: [vocab, dim];
    targets: [...] int64; mask: optional [...] loss mask (1 = count the token, 0 = ignore it).
    Returns ``(loss_sum, count)``: the fp32 sum of per-token losses over counted tokens (differentiable
    w.r.t. hidden and lm_head_weight) and the number of counted tokens (fp32 tensor, no grad).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    h, t, m = _flatten(hidden, targets, mask)
    count = m.sum() if m is not None else torch.tensor(float(t.numel()), device=h.device)
    with torch.autocast(device_type=h.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
            loss = _FusedChunkedCE.apply(h, lm_head_weight, t, m, chunk)
        else:
            loss, _ = _forward_only(h, lm_head_weight, t, m, chunk, with_accuracy=False)
    return loss, count


@torch.no_grad()
def chunked_eval_stats(hidden, lm_head_weight, targets, mask=None, chunk: int = 8192) -> dict:
    """Evaluation statistics of the fp32 CE: ``{"loss_sum", "correct", "count"}`` as Python floats
    (``correct`` = counted tokens whose arg-max logit is the target)."""
    h, t, m = _flatten(hidden, targets, mask)
    with torch.autocast(device_type=h.device.type, enabled=False):
        loss, correct = _forward_only(h, lm_head_weight, t, m, chunk, with_accuracy=True)
    count = float(m.sum()) if m is not None else float(t.numel())
    return {"loss_sum": float(loss), "correct": float(correct), "count": count}
