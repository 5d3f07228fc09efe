"""Document-masked attention for packed rows: a token attends to earlier tokens of its own document.

With ``doc_ids`` [B, T] (the loader's, ``with_doc_ids=True``), query ``q`` attends to key ``k`` iff
``k <= q`` and ``doc_ids[q] == doc_ids[k]``: every document gets the outputs it would get alone.

- `document_mask(doc_ids, kernel)`: None (plain causal), a ``flex`` BlockMask (CUDA, built block by block
  by `document_block_mask`) or an ``sdpa`` boolean mask (CPU);
- `attend(q, k, v, mask)`: grouped-query causal attention under that mask.

The two kernels and why the BlockMask is built from the ids: docs/model.md, "Document-masked attention".
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


BLOCK = 128  # flex_attention's default sparse block size (queries and keys)


def _block_classes(doc_ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) [B, 1, n, n] int8 over the n = ⌈T / block⌉ query × key blocks of
    `document_causal_mask`: blocks where some but not every (query, key) pair may attend, and blocks
    where every pair may — what ``create_block_mask`` finds by summing the dense mask padded to whole
    blocks (padding masked), here from which documents each block holds: O(B·T·n), no [T, T] tensor.

    A key block before a query block holds an allowed pair iff the two share a document (every key
    of it precedes every query); a diagonal block always does (a query attends to itself); a later
    key block never. Every pair is allowed iff the key block precedes, the query block is whole
    (not padded) and both hold one and the same document."""
    B, T = doc_ids.shape
    n = -(-T // block)
    # dense per-row ranks of the ids (0..T-1): arbitrary ids without a host sync
    sorted_ids, order = doc_ids.sort(dim=1)
    ranks = torch.zeros_like(doc_ids, dtype=torch.long)
    ranks[:, 1:] = (sorted_ids[:, 1:] != sorted_ids[:, :-1]).long().cumsum(dim=1)
    label = torch.empty_like(ranks).scatter_(1, order, ranks)
    position_block = (torch.arange(T, device=doc_ids.device) // block).expand(B, T)
    holds = torch.zeros(B, n, T, device=doc_ids.device)  # holds[b, i, d]: block i of row b holds document d
    holds[torch.arange(B, device=doc_ids.device)[:, None], position_block, label] = 1.0
    shared = (holds @ holds.transpose(1, 2)) > 0  # [B, query block, key block]
    qi = torch.arange(n, device=doc_ids.device)
    before, diagonal = qi[None, :] < qi[:, None], qi[None, :] == qi[:, None]  # key block j vs query block i
    some = (shared & before) | diagonal
    pad = torch.full((B, n * block - T), -1, dtype=torch.long, device=doc_ids.device)  # matches no document
    blocks = torch.cat((label, pad), dim=1).view(B, n, block)
    single = blocks.amin(dim=2) == blocks.amax(dim=2)  # one document, whole (padding is -1)
    lone = torch.where(single, blocks[:, :, 0], -2)
    every = before & (lone[:, :, None] == lone[:, None, :]) & single[:, :, None]
    partial = (some & ~every).to(torch.int8)[:, None]
    return partial, every.to(torch.int8)[:, None]


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of blocks per row, their indices first) as flex_attention orders a dense block mask."""
    blocks = blocks.to(torch.int32)
    return blocks.sum(dim=-1).to(torch.int32), torch.argsort(blocks, dim=-1, descending=True, stable=True).to(
        torch.int32)


def document_block_mask(doc_ids: torch.Tensor):
    """The same predicate as `document_causal_mask`, as a flex_attention BlockMask (heads broadcast),
    built from the document ids block by block (`_block_classes`): ``create_block_mask``'s BlockMask
    without its [B, T, T] evaluation of the predicate."""
    from torch.nn.attention.flex_attention import BlockMask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    T = doc_ids.shape[1]
    partial, full = _block_classes(doc_ids, BLOCK)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


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
