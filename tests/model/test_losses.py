"""Chunked fp32 cross-entropy against an fp64 reference on the same logits."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.losses import chunked_cross_entropy, chunked_eval_stats

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
    from pipeline.model.model import ModelConfig, Transformer
    from pipeline.training.parallelize import LossModel

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


# ----------------------------------------------------------------------------- train.ce_matmul

def _trained_scale_inputs(seed=0, d=512, masked=True):
    """bf16 hidden states (what a bf16 autocast body hands the loss, RMS-normed scale) and an fp32
    weight giving logits of std ≈ 3.5, a trained language model's scale."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, d, generator=g).bfloat16()
    weight = torch.randn(V, d, generator=g) * 0.5 * (48 / d) ** 0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long() if masked else None
    return hidden, weight, targets, mask


@pytest.mark.parametrize("matmul,tol", [("bf16", 1e-3), ("fp32", 1e-4), ("tf32", 1e-4)])
def test_ce_matmul_precision_matches_fp64(matmul, tol):
    """The loss stays within `tol` nats per token of fp64 (tf32 is fp32 on CPU; its CUDA error is TF32's)."""
    hidden, weight, targets, mask = _trained_scale_inputs()
    d = hidden.shape[-1]
    logits = hidden.double().reshape(-1, d) @ weight.double().T
    ref = (F.cross_entropy(logits, targets.reshape(-1), reduction="none") * mask.reshape(-1).double()).sum()
    n = mask.sum().item()
    loss_sum, count = chunked_cross_entropy(hidden, weight, targets, mask, chunk=17, matmul=matmul)
    assert count.item() == n and loss_sum.dtype == torch.float32
    assert abs(loss_sum.item() - ref.item()) / n < tol
    if matmul == "bf16":  # the rounding is real: bf16 is not fp32 under another name
        fp32, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk=17, matmul="fp32")
        assert abs(loss_sum.item() - fp32.item()) / n > 1e-6


def test_bf16_matmul_gradients_are_close_to_fp64():
    hidden, weight, targets, mask = _trained_scale_inputs(seed=1)
    h = hidden.float().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss_sum, count = chunked_cross_entropy(h, w, targets, mask, chunk=17, matmul="bf16")
    (loss_sum / count).backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = (F.cross_entropy(h64.reshape(-1, h64.shape[-1]) @ w64.T, targets.reshape(-1), reduction="none")
           * mask.reshape(-1).double()).sum() / count.double()
    ref.backward()
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert got.dtype == torch.float32
        assert (got.double() - want).norm() / want.norm() < 1e-2


def test_unknown_ce_matmul_is_refused():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match="matmul must be one of"):
        chunked_cross_entropy(hidden, weight, targets, matmul="fp16")


# ----------------------------------------------------------------------------- compiled

def _tiny_loss_model(vocab=4096, dim=64, seq=64, matmul="bf16"):
    from pipeline.model.model import ModelConfig, Transformer
    from pipeline.training.parallelize import LossModel

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128,
                                    max_seq_len=seq))
    return LossModel(model, None, ce_chunk=32, ce_matmul=matmul)


def test_compiled_step_breaks_its_graph_only_at_the_loss():
    """The body compiles as one graph; the loss is the one, deliberate, graph break (losses.py:
    ``torch.compiler.disable``)."""
    loss_model = _tiny_loss_model(vocab=512, dim=32, seq=16)
    loss_model.keep_loss_eager()  # what LossModel.compiled does before compiling
    x, y = torch.randint(0, 512, (4, 16)), torch.randint(0, 512, (4, 16))
    explained = torch._dynamo.explain(loss_model)(x, y, (torch.rand(4, 16) > 0.5).float())
    assert explained.graph_count == 1 and len(explained.break_reasons) == 1, explained.break_reasons
    assert "torch.compiler.disable" in explained.break_reasons[0].reason
    assert "parallelize.py" in explained.break_reasons[0].user_stack[-1].filename  # LossModel's call of the loss
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert any("scaled_dot_product_attention" in op for op in ops)  # the body is in the graph


def test_compiled_step_matches_eager_and_its_graphs_hold_no_logits():
    """The forward and backward graphs aot_autograd makes of the step (what inductor compiles) are the
    body's: nothing in them is vocab-sized beyond the embedding; loss and gradients equal the eager ones."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    vocab, rows, seq = 4096, 4, 64
    loss_model = _tiny_loss_model(vocab=vocab, seq=seq)
    x, y = torch.randint(0, vocab, (rows, seq)), torch.randint(0, vocab, (rows, seq))
    compiled = loss_model.compiled(backend=backend)
    loss_sum, count = compiled(x, y)
    (loss_sum / count).backward()
    grads = {n: p.grad.clone() for n, p in loss_model.named_parameters()}
    loss_model.zero_grad(set_to_none=True)
    eager_sum, eager_count = loss_model(x, y)
    (eager_sum / eager_count).backward()

    assert len(graphs) == 2  # the body's forward and backward
    largest = max(n.meta["val"].numel() for g in graphs for n in g.graph.nodes
                  if isinstance(n.meta.get("val"), torch.Tensor))
    assert largest <= vocab * loss_model.model.cfg.dim, largest  # the embedding (and its gradient)
    assert torch.allclose(loss_sum, eager_sum, rtol=1e-5)
    for n, p in loss_model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-4), n


def _most_alive(code: str, numel: int) -> int:
    """The most buffers of `numel` elements alive at once in Inductor's generated wrapper code: allocated by
    ``empty_strided_cpu``, handed on by ``bufB = bufA; del bufA  # reuse``, freed by ``del``."""
    alive, most = set(), 0
    for line in code.splitlines():
        if m := re.match(r"\s*(buf\d+) = empty_strided_cpu\(\(([\d, ]+)\)", line):
            if math.prod(int(v) for v in m.group(2).split(",") if v.strip()) == numel:
                alive.add(m.group(1))
                most = max(most, len(alive))
        elif (m := re.match(r"\s*(buf\d+) = (buf\d+); del \2", line)) and m.group(2) in alive:
            alive.add(m.group(1))
        alive -= set(re.findall(r"del (buf\d+)", line))
    return most


def test_compiled_step_holds_no_weight_product_whatever_the_chunk_count(monkeypatch):
    """Issue 28: traced into the compiled step, the CUDA bf16 form of d(W)'s accumulation
    (``d(W) += product``, forced here on CPU) let Inductor fuse the chain of adds into one kernel after
    the chunks' matmuls, so the compiled code held several chunks' fp32 [vocab, dim] products at once, more
    with more chunks (before this fix this test counted 3 at 2 chunks, 4 at 8). The loss is no longer
    compiled: the step's Inductor code holds no
    [vocab, dim] buffer at any chunk count, and the eager loss holds one product at a time
    (`test_backward_accumulates_the_weight_gradient_in_place` counts its allocations)."""
    from torch._inductor.utils import run_and_get_code

    from pipeline.model import losses

    monkeypatch.setattr(losses, "_accumulates_in_place", lambda device, bf16: not bf16)
    vocab, dim, n = 1000, 24, 64  # vocab × dim matches no other tensor's size
    g = torch.Generator().manual_seed(0)
    x, proj = torch.randn(n, dim, generator=g), torch.randn(dim, dim, generator=g) / dim ** 0.5
    weight, targets = torch.randn(vocab, dim, generator=g), torch.randint(0, vocab, (n,), generator=g)

    loss_fn = losses.eager_cross_entropy()  # what a compiled step calls (LossModel.compiled)

    def most_alive(chunks: int) -> int:
        p, w = proj.clone().requires_grad_(True), weight.clone().requires_grad_(True)

        def step():
            hidden = torch.tanh(x @ p)  # a compiled body feeding the loss
            loss, count = loss_fn(hidden, w, targets, chunk=n // chunks, matmul="bf16")
            return loss / count

        torch._dynamo.reset()
        _, code = run_and_get_code(lambda: torch.compile(step)().backward())
        assert code and all("empty_strided_cpu" in c for c in code)  # the body was compiled
        assert w.grad is not None and torch.isfinite(w.grad).all()
        return max(_most_alive(c, vocab * dim) for c in code)

    assert most_alive(2) == most_alive(8) == 0


# ----------------------------------------------------------------------------- issue 18, item 5

class _NewTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of the tensors ops return that are *new* allocations (not in-place or out=)."""

    def __init__(self):
        super().__init__()
        self.fresh = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not mutates and isinstance(out, torch.Tensor):
            self.fresh.append((func.__name__, tuple(out.shape)))
        return out


@pytest.mark.parametrize("matmul", ["fp32", "tf32", "bf16"])
def test_backward_accumulates_the_weight_gradient_in_place(matmul):
    """Before: every chunk formed d(W)'s [vocab, dim] fp32 product and added it (a 1.07 GB
    temporary at the 1.2B preset). Now only the accumulator itself is a [vocab, dim] allocation."""
    hidden, weight, targets, _ = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _NewTensors() as rec:
        loss, _ = chunked_cross_entropy(hidden, weight, targets, chunk=16, matmul=matmul)  # 6 chunks
    # dtype copies of the weight (its bf16 operand; on CPU the exact fp32 upcasts that stand in for
    # CUDA's bf16 matmul) aside, the only [vocab, dim] allocation is the accumulator
    vocab_dim = [name for name, shape in rec.fresh if shape == (V, D) and name != "_to_copy.default"]
    assert vocab_dim == ["zeros.default"], vocab_dim
    loss.backward()
    ref_h = hidden.detach().double().requires_grad_(True)
    ref_w = weight.detach().double().requires_grad_(True)
    _reference(ref_h, ref_w, targets, None).backward()
    tol = 2e-2 if matmul == "bf16" else 1e-5
    assert torch.allclose(hidden.grad.double(), ref_h.grad, rtol=tol, atol=tol)
    assert torch.allclose(weight.grad.double(), ref_w.grad, rtol=tol, atol=tol)


def test_an_eager_unsharded_process_never_imports_dynamo_or_dtensor():
    """The graph break is marked when a step is compiled (LossModel.compiled), not at import, and DTensors are
    recognised without importing their module (pipeline.distributed.is_dtensor): torch._dynamo and
    torch.distributed.tensor are large imports that every rank of an eager DDP run and every evaluation would
    pay otherwise."""
    code = textwrap.dedent("""
        import sys
        import torch
        import pipeline.training.train, pipeline.evaluation.evaluate, pipeline.evaluation.chat
        from pipeline.model.model import ModelConfig, Transformer
        from pipeline.training.parallelize import LossModel
        model = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                        max_seq_len=8))
        loss, count = LossModel(model, None, ce_chunk=4)(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
        loss.backward()
        assert "torch._dynamo" not in sys.modules, "an eager step imported torch._dynamo"
        assert "torch.distributed.tensor" not in sys.modules, "an unsharded step imported torch.distributed.tensor"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
