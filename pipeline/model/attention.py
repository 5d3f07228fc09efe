"""Document-masked attention for packed rows: a token attends to earlier tokens of its own document.

A packed row holds several documents (or conversations) back to back; `doc_ids` [B, T] gives each
input position the index of its document within the row (pipeline loader, ``with_doc_ids=True``).
With the mask, query ``q`` may attend to key ``k`` iff ``k <= q`` and ``doc_ids[q] == doc_ids[k]``.
Since RoPE is relative, every document then gets exactly the outputs (and gradients) it would get run
alone at the start of a row.

Two kernels, chosen by the device (`document_mask`):

* ``sdpa`` (CPU and any device without flex support): a boolean [B, 1, T, T] mask for
  ``F.scaled_dot_product_attention``. Materializes T×T booleans per row and runs the math/efficient
  kernel: right for tests and CPU runs, too slow for long GPU rows.
* ``flex`` (CUDA): ``torch.nn.attention.flex_attention`` with a block-sparse ``BlockMask`` built
  from the same predicate (``create_block_mask``); fully masked 128×128 blocks (other documents,
  the future) are skipped, and the kernel is compiled (``torch.compile(flex_attention)``; under a
  compiled trainer the call is traced into the trainer's graph). flex_attention has no CPU backward,
  so CPU training always uses ``sdpa``; the flex forward on CPU is used by the tests to check that
  both kernels compute the same attention.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["document_causal_mask", "document_block_mask", "document_mask", "attend"]


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, 1, T, T] boolean mask (True = may attend): causal and same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def document_block_mask(doc_ids: torch.Tensor):
    """The same predicate as `document_causal_mask`, as a flex_attention BlockMask (heads broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    B, T = doc_ids.shape
    return create_block_mask(same_document_causal, B=B, H=None, Q_LEN=T, KV_LEN=T, device=doc_ids.device)


def document_mask(doc_ids: torch.Tensor | None, kernel: str | None = None):
    """The mask for `attend`: None (plain causal) without doc ids; else a BlockMask for ``flex``
    (default on CUDA) or a boolean tensor for ``sdpa`` (default elsewhere)."""
    if doc_ids is None:
        return None
    kernel = kernel or ("flex" if doc_ids.device.type == "cuda" else "sdpa")
    return document_block_mask(doc_ids) if kernel == "flex" else document_causal_mask(doc_ids)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Causal grouped-query attention of q [B, H, T, hd] over k, v [B, H_kv, T, hd] under `mask`
    (None, a boolean tensor, or a BlockMask from `document_mask`)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if q.device.type == "cpu":  # eager reference forward (the CPU has no compiled flex backward)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
