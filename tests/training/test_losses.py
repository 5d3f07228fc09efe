"""Chunked fp32 cross-entropy against an fp64 reference on the same logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.training.losses import chunked_cross_entropy, chunked_eval_stats

V, D, B, T = 300, 48, 3, 32


def _inputs(seed=0, masked=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long() if masked else None
    return hidden, weight, targets, mask


def _reference(hidden, weight, targets, mask):
    """fp64 CE sum over counted tokens of the logits hidden @ weight.T."""
    logits = hidden.double().reshape(-1, D) @ weight.double().T
    tok = F.cross_entropy(logits, targets.reshape(-1), reduction="none")
    if mask is not None:
        tok = tok * mask.reshape(-1).double()
    return tok.sum()


@pytest.mark.parametrize("chunk", [1, 7, 32, 10_000])
@pytest.mark.parametrize("masked", [False, True])
def test_fp32_body_matches_fp64_reference(chunk, masked):
    hidden, weight, targets, mask = _inputs(masked=masked)
    loss_sum, count = chunked_cross_entropy(hidden, weight, targets, mask, chunk=chunk)
    ref = _reference(hidden, weight, targets, mask)
    n = mask.sum().item() if masked else targets.numel()
    assert count.item() == n
    assert abs(loss_sum.item() / n - ref.item() / n) < 1e-4


def test_bf16_body_matches_fp64_reference_on_same_logits():
    """A bf16 autocast body produces bf16 hidden states; the CE itself must still be fp32."""
    hidden, weight, targets, _ = _inputs(seed=1)
    proj = torch.nn.Linear(D, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        body = proj(hidden)
        assert body.dtype == torch.bfloat16
        loss_sum, count = chunked_cross_entropy(body, weight, targets, chunk=16)
    ref = _reference(body.detach(), weight, targets, None)
    assert abs(loss_sum.item() / count.item() - ref.item() / count.item()) < 1e-3
    # Same check as the fp32 tolerance: upcasting bf16 hidden exactly keeps the CE near-exact.
    assert abs(loss_sum.item() - ref.item()) / count.item() < 1e-4


@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_fp64_reference(masked):
    hidden, weight, targets, mask = _inputs(seed=2, masked=masked)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss_sum, count = chunked_cross_entropy(h, w, targets, mask, chunk=13)
    (loss_sum / count).backward()

    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    ref = _reference(h64, w64, targets, mask)
    (ref / count.double()).backward()
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-6)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-6)


def test_bf16_hidden_gets_bf16_grad_and_weight_fp32_grad():
    hidden, weight, targets, _ = _inputs(seed=3)
    h = hidden.bfloat16().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss_sum, _ = chunked_cross_entropy(h, w, targets, chunk=20)
    loss_sum.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert h.grad.shape == h.shape


def test_no_grad_path_and_eval_stats_agree():
    hidden, weight, targets, mask = _inputs(seed=4, masked=True)
    with torch.no_grad():
        loss_sum, count = chunked_cross_entropy(hidden, weight, targets, mask, chunk=9)
    stats = chunked_eval_stats(hidden, weight, targets, mask, chunk=9)
    assert stats["count"] == count.item()
    assert stats["loss_sum"] == pytest.approx(loss_sum.item(), rel=1e-6)
    logits = hidden.reshape(-1, D) @ weight.T
    hits = (logits.argmax(-1) == targets.reshape(-1)).float() * mask.reshape(-1)
    assert stats["correct"] == hits.sum().item()


def test_fully_masked_chunk_contributes_nothing():
    hidden, weight, targets, _ = _inputs(seed=5)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[0, :5] = 1
    h = hidden.clone().requires_grad_(True)
    loss_sum, count = chunked_cross_entropy(h, weight, targets, mask, chunk=8)
    loss_sum.backward()
    assert count.item() == 5
    assert torch.all(h.grad[1:] == 0) and torch.all(h.grad[0, 5:] == 0)
    assert h.grad[0, :5].abs().sum() > 0


# ----------------------------------------------------------------------------- memory: no [tokens, vocab]

def _largest_outputs(fn) -> tuple[int, set[str]]:
    """Run `fn` under a dispatch-mode spy: (the largest numel of any tensor an aten op returned, the
    names of the ops that ran). Sees forward and backward ops alike (autograd runs them under the mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Spy(TorchDispatchMode):
        largest, ops = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Spy.ops.add(func.overloadpacket.__name__)
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            Spy.largest = max([Spy.largest, *sizes])
            return out

    with Spy():
        fn()
    return Spy.largest, Spy.ops


def test_training_step_never_materialises_the_full_logits():
    """Forward and backward of the trainer's LossModel (tiny body, vocab 4096, 4 × 64 tokens, CE
    chunks of 32 tokens): no tensor reaches half of [tokens, vocab]; the largest are one chunk's
    logits (32 × 4096) and the lm-head/embedding weight and its gradient (4096 × 64)."""
    from pipeline.training.model import ModelConfig, Transformer
    from pipeline.training.step import LossModel

    vocab, dim, rows, seq = 4096, 64, 4, 64
    full = rows * seq * vocab
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128,
                                    max_seq_len=seq))
    loss_model = LossModel(model, None, ce_chunk=32)
    x = torch.randint(0, vocab, (rows, seq))
    y = torch.randint(0, vocab, (rows, seq))

    def step():
        loss_sum, count = loss_model(x, y)
        (loss_sum / count).backward()

    largest, ops = _largest_outputs(step)
    assert "silu_backward" in ops, "the spy saw the backward pass"
    assert model.tok_embeddings.weight.grad is not None
    assert largest < full // 2, (largest, full)

    # The spy would catch it: the plain, unchunked CE of the same hidden states materialises
    # [tokens, vocab] logits (and their gradient) in forward and backward.
    model.zero_grad()

    def plain():
        hidden = model.hidden(x)
        logits = hidden.reshape(-1, dim) @ model.lm_head_weight.T
        F.cross_entropy(logits, y.reshape(-1)).backward()

    assert _largest_outputs(plain)[0] >= full
