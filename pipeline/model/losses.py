"""Chunked fp32 cross-entropy from the final hidden states, without materialising [tokens, vocab].

- `chunked_cross_entropy(hidden, lm_head_weight, targets, mask, chunk, matmul)`: the training loss as a
  ``(sum, count)`` pair (the caller forms the exact token-weighted mean), fp32 logits one chunk at a time,
  its backward fused into the forward;
- `eager_cross_entropy()`: the same, never traced by torch.compile (a deliberate graph break): what a
  compiled step calls (`LossModel.compiled`, pipeline/training/parallelize.py);
- `chunked_eval_stats(...)`: ``{"loss_sum", "correct", "count"}`` for validation.

``matmul`` (``train.ce_matmul``: fp32, tf32 or bf16) sets only the precision of the logit matmuls'
inputs. Why fp32, why chunked, why never compiled, with the measured errors and memory: docs/model.md,
"The chunked fp32 loss".
"""
from __future__ import annotations

import functools

import torch

__all__ = ["CE_MATMUL", "chunked_cross_entropy", "chunked_eval_stats", "eager_cross_entropy"]

CE_MATMUL = ("bf16", "tf32", "fp32")


def _flatten(hidden, targets, mask):
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    m = None if mask is None else mask.reshape(-1).to(torch.float32)
    return h, t, m


def _operand(x: torch.Tensor, bf16: bool) -> torch.Tensor:
    return x.to(torch.bfloat16) if bf16 else x.float()


def _mm(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> torch.Tensor:
    """a @ b with an fp32 result; bf16 operands are multiplied exactly and accumulated in fp32."""
    if not bf16:
        return a @ b
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _accumulates_in_place(device: torch.device, bf16: bool) -> bool:
    """Whether ``out += a @ b`` (fp32 `out`) can be written in place (``addmm_``): always, except for
    bf16 operands on CUDA — torch's fp32-output ``mm(out_dtype=)`` has no accumulating form (its
    ``addmm(out_dtype=)`` requires the accumulator in the operands' dtype)."""
    return not (bf16 and device.type == "cuda")


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bf16: bool, accumulate: bool) -> None:
    """out (fp32) = a @ b, or out += a @ b when `accumulate`, without a temporary of out's size where
    torch allows it (`_accumulates_in_place`): fp32 operands (fp32/tf32, and bf16-rounded operands on
    CPU, upcast exactly) go through ``addmm_`` / ``mm(out=)``. Otherwise the product is formed in fp32
    and added: a [rows(a), cols(b)] fp32 temporary, for d(W) the 4·V·d bytes that pipeline.planning's
    memory model counts under ``ce_matmul: bf16`` — one at a time, because the loss runs eagerly
    (docs/model.md, "The chunked fp32 loss")."""
    if accumulate and not _accumulates_in_place(a.device, bf16):
        out += _mm(a, b, bf16)
        return
    if bf16 and a.device.type == "cuda":
        torch.mm(a, b, out_dtype=torch.float32, out=out)
        return
    if bf16:
        a, b = a.float(), b.float()
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


class _FusedChunkedCE(torch.autograd.Function):
    """Sum of per-token CE over chunks; gradients are computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, h, weight, t, m, chunk: int, bf16: bool):
        w = _operand(weight, bf16)
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            h_c, t_c = _operand(h[s:s + chunk], bf16), t[s:s + chunk]
            logits = _mm(h_c, w.T, bf16)
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
            p = _operand(probs, bf16)
            _mm_into(grad_h[s:s + chunk], p, w, bf16, accumulate=False)  # rows of grad_h: contiguous
            _mm_into(grad_w, p.T, h_c, bf16, accumulate=True)  # in place: no [vocab, dim] temporary
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        # Scaled in place: the saved gradients are used once (no double backward), so no second
        # [tokens, dim] and [vocab, dim] fp32 copy exists at the loss backward.
        grad_h, grad_w = ctx.saved_tensors
        grad_h.mul_(grad_out)
        grad_w.mul_(grad_out)
        return grad_h.to(ctx.h_dtype), grad_w.to(ctx.w_dtype), None, None, None, None


def _forward_only(h, weight, t, m, chunk: int, bf16: bool, with_accuracy: bool):
    """Loss sum (and number of correct top-1 predictions) without any gradient bookkeeping."""
    w = _operand(weight, bf16)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    correct = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        t_c = t[s:s + chunk]
        logits = _mm(_operand(h[s:s + chunk], bf16), w.T, bf16)
        tok_loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, t_c[:, None]).squeeze(1)
        hit = (logits.argmax(dim=-1) == t_c).float() if with_accuracy else None
        if m is not None:
            tok_loss = tok_loss * m[s:s + chunk]
            hit = hit * m[s:s + chunk] if with_accuracy else None
        loss = loss + tok_loss.sum()
        if with_accuracy:
            correct = correct + hit.sum()
    return loss, correct


def _check(chunk: int, matmul: str) -> None:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if matmul not in CE_MATMUL:
        raise ValueError(f"matmul must be one of {CE_MATMUL}, got {matmul!r}")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk: int = 8192,
    matmul: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cross-entropy of ``hidden @ lm_head_weight.T`` against ``targets``, chunked over tokens.

    hidden: [..., dim] (any float dtype, e.g. bf16 from an autocast body); lm_head_weight: [vocab, dim];
    targets: [...] int64; mask: optional [...] loss mask (1 = count the token, 0 = ignore it);
    matmul: the logit matmuls' input precision (docs/model.md). Returns ``(loss_sum, count)``: the
    fp32 sum of per-token losses over counted tokens (differentiable w.r.t. hidden and
    lm_head_weight) and the number of counted tokens (fp32 tensor, no grad). A compiled step calls
    `eager_cross_entropy()` instead.
    """
    _check(chunk, matmul)
    h, t, m = _flatten(hidden, targets, mask)
    count = m.sum() if m is not None else torch.full((), t.numel(), dtype=torch.float32, device=h.device)
    bf16 = matmul == "bf16"
    with torch.autocast(device_type=h.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
            loss = _FusedChunkedCE.apply(h, lm_head_weight, t, m, chunk, bf16)
        else:
            loss, _ = _forward_only(h, lm_head_weight, t, m, chunk, bf16, with_accuracy=False)
    return loss, count


@functools.cache
def eager_cross_entropy():
    """`chunked_cross_entropy` wrapped in ``torch.compiler.disable``: under torch.compile, a graph break before
    it and the loss run eagerly. Made on first use, not at import: the wrapper imports torch._dynamo, a large
    import that a process which never compiles need not pay."""
    return torch.compiler.disable(chunked_cross_entropy)


@torch.no_grad()
def chunked_eval_stats(hidden, lm_head_weight, targets, mask=None, chunk: int = 8192, matmul: str = "fp32") -> dict:
    """Evaluation statistics of the fp32 CE: ``{"loss_sum", "correct", "count"}`` as Python floats
    (``correct`` = counted tokens whose arg-max logit is the target)."""
    _check(chunk, matmul)
    h, t, m = _flatten(hidden, targets, mask)
    with torch.autocast(device_type=h.device.type, enabled=False):
        loss, correct = _forward_only(h, lm_head_weight, t, m, chunk, matmul == "bf16", with_accuracy=True)
    count = float(m.sum()) if m is not None else float(t.numel())
    return {"loss_sum": float(loss), "correct": float(correct), "count": count}
