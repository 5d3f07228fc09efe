"""Chunked fp32 cross-entropy from the final hidden states, without materialising [tokens, vocab].

Why fp32, and where: the transformer body may run under bf16 autocast, but the loss never does
(autocast is disabled around it). Each chunk's logits are an fp32 tensor, log-sum-exp and the
softmax run in fp32. What `matmul` (``train.ce_matmul``) chooses is only the precision of the
*inputs* of the logit matmuls:

* ``fp32``: ``hidden.float() @ weight.T`` in full fp32 (the hidden states upcast exactly);
* ``tf32``: the same fp32 matmul, which torch runs on TF32 tensor cores when the trainer set
  float32 matmul precision ``high`` (inputs rounded to 10 mantissa bits, fp32 accumulation);
* ``bf16``: hidden states and weight rounded to bf16, products accumulated and **stored** in fp32
  (`torch.mm(..., out_dtype=torch.float32)` on CUDA; on CPU, which has no such kernel, an fp32
  matmul of the bf16-rounded inputs — the same products, exact in fp32). Only the inputs are
  rounded (relative 2⁻⁹ per element; the hidden states of a bf16 body are bf16 already, so in
  training it is the weight's rounding); the logits, the softmax, the loss and its gradient w.r.t.
  the logits stay fp32 — unlike the reference's bug, a cross-entropy over bf16 logits inside
  autocast. Measured against an fp64 reference at a trained model's logit scale: ≈ 5e-4 nats per
  token (tested within 1e-3); fp32 and tf32-free runs: ≈ 1e-6 (tested within 1e-4). The trainer's
  ``ce_fp32`` metric (the whole model in full fp32 on a fixed batch) keeps watching the difference.

Why chunked: a full fp32 logits tensor for 131K tokens × 2^17 vocab is 68 GB. The tokens are split
into chunks of ``chunk`` rows; only one chunk's [chunk, vocab] logits exist at a time. The backward
is fused into the forward (custom autograd function): while a chunk's softmax is in hand, its
gradients d(hidden) = (softmax − onehot)·W and d(W) += (softmax − onehot)ᵀ·hidden are computed, so
backward keeps only d(hidden) [tokens, dim] and d(W) [vocab, dim] alive and recomputes nothing.
Both are written in place (``mm(out=)`` into d(hidden)'s rows, ``addmm_`` into d(W)): no chunk
allocates a [vocab, dim] fp32 product beside d(W) (1.07 GB at the 1.2B preset), except with bf16
operands on CUDA, where torch has no fp32 in-place accumulate of bf16 products (`_mm_into`: one
chunk's product at a time, counted by pipeline.planning).
Under ``torch.no_grad`` (validation) no gradient work is done at all.

Never compiled (issue 28): `chunked_cross_entropy` is wrapped in ``torch.compiler.disable``, so
under the trainer's torch.compile it is a deliberate graph break — the body before it compiles as one graph,
the loss runs eagerly, chunk after chunk, and its backward (in-place scaling) runs eagerly too.
Traced into the step's graph (as it was), the chunk loop was unrolled and Inductor fused the chain
``d(W) = d(W) + product_k`` of the CUDA bf16 path into one kernel after all the chunks' matmuls, so
every chunk's fp32 [vocab, dim] product was alive at once (measured on CPU with that form: the
count grew with the number of chunks; tests/model/test_losses.py), and a *smaller*
``ce_chunk_tokens`` *raised* the peak. Eager, each product is freed by the add that consumes it.
The price is the softmax's elementwise work unfused (pipeline.planning prices the loss's memory traffic
as eager whatever ``train.compile`` says).

The loss is returned as a **sum** with a token **count** so that callers can form the exact
token-weighted mean over micro-steps and ranks (see pipeline/training/train.py).
"""
from __future__ import annotations

import torch

__all__ = ["CE_MATMUL", "chunked_cross_entropy", "chunked_eval_stats"]

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
    (module docstring)."""
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


@torch.compiler.disable  # a deliberate graph break: the loss runs eagerly, one chunk at a time (module docstring)
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
    matmul: the logit matmuls' input precision (module docstring). Returns ``(loss_sum, count)``: the
    fp32 sum of per-token losses over counted tokens (differentiable w.r.t. hidden and
    lm_head_weight) and the number of counted tokens (fp32 tensor, no grad). Never traced by
    torch.compile (a graph break): it runs eagerly inside a compiled step.
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
