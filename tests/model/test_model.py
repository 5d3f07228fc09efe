"""The Llama-3-style Transformer: shapes, causality, GQA, document masking, checkpointing, init, generation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.model import Attention, ModelConfig, Transformer, apply_rope

TINY = dict(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, rope_theta=10000.0, max_seq_len=24)


def tiny(seed: int = 0, **over) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**TINY, **over}))


def tokens(B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_dtypes():
    model = tiny()
    idx = tokens(3, 10)
    assert model.hidden(idx).shape == (3, 10, 32)
    logits = model(idx)
    assert logits.shape == (3, 10, 97) and logits.dtype == torch.float32
    assert model.lm_head_weight.shape == (97, 32)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.hidden(tokens(1, 25))


def test_from_run_config():
    cfg = {
        "model": {"vocab_size": 97, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "rope_theta": 500000, "norm_eps": 1e-6, "tie_embeddings": False},
        "train": {"seq_len": 128, "activation_checkpointing": "every_n", "checkpoint_every_n": 3},
    }
    mc = ModelConfig.from_config(cfg)
    assert (mc.max_seq_len, mc.rope_theta, mc.norm_eps, mc.tie_embeddings) == (128, 500000.0, 1e-6, False)
    assert Transformer(mc).checkpoint_blocks == (True, False, False)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(**{**TINY, "n_kv_heads": 3})


def test_parameter_names_and_tied_vs_untied_counts():
    tied, untied = tiny(tie_embeddings=True), tiny(tie_embeddings=False)
    names = {n for n, _ in untied.named_parameters()}
    for n in ("tok_embeddings.weight", "layers.2.attention.q_proj.weight", "layers.0.attention.o_proj.weight",
              "layers.1.feed_forward.gate_proj.weight", "layers.1.feed_forward.down_proj.weight",
              "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "norm.weight", "lm_head.weight"):
        assert n in names, n
    assert not any(n.startswith("lm_head") for n, _ in tied.named_parameters())
    assert tied.lm_head_weight is tied.tok_embeddings.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 97 * 32
    assert not any(n.endswith("bias") for n in names)


def test_causal_future_tokens_do_not_change_the_past():
    model = tiny()
    idx = tokens(2, 16)
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 5) % 97
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_gqa_equals_explicit_repeated_kv_attention():
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 12, cfg.dim)
    cos, sin = Transformer(cfg).rope_cos[:12], Transformer(cfg).rope_sin[:12]
    got = attn(x, cos, sin, None)

    B, T, H, KV, hd = 2, 12, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = apply_rope(attn.q_proj(x).view(B, T, H, hd), cos, sin).transpose(1, 2)
    k = apply_rope(attn.k_proj(x).view(B, T, KV, hd), cos, sin).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, KV, hd).transpose(1, 2)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    want = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, cfg.dim))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_rotates_by_relative_position():
    cfg = ModelConfig(**TINY)
    model = Transformer(cfg)
    q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)

    def score(m, n):
        qm = apply_rope(q, model.rope_cos[m:m + 1], model.rope_sin[m:m + 1])
        kn = apply_rope(k, model.rope_cos[n:n + 1], model.rope_sin[n:n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(7, 3), score(14, 10))
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_doc_mask_blocks_cross_document_attention():
    model = tiny()
    idx = tokens(2, 16)
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    out = model(idx, doc_mask=docs)
    # Row 0: the second document sees only itself, so (RoPE being relative) it matches running it alone.
    torch.testing.assert_close(out[0, 6:], model(idx[:1, 6:])[0], rtol=1e-4, atol=1e-4)
    # Changing the first document leaves the second untouched; a single-document row is plain causal.
    changed = idx.clone()
    changed[0, :6] = (changed[0, :6] + 1) % 97
    torch.testing.assert_close(model(changed, doc_mask=docs)[0, 6:], out[0, 6:])
    torch.testing.assert_close(out[1], model(idx[1:])[0], rtol=1e-5, atol=1e-5)
    # Without the mask, the second document does see the first.
    assert not torch.allclose(model(changed)[0, 6:], model(idx)[0, 6:])


def _loss_and_grads(model: Transformer, idx: torch.Tensor, docs=None):
    model.zero_grad(set_to_none=True)
    h = model.hidden(idx[:, :-1], None if docs is None else docs[:, :-1])
    loss = F.cross_entropy(F.linear(h, model.lm_head_weight).float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["mlp", "attention", "block", "every_n"])
@pytest.mark.parametrize("with_docs", [False, True])
def test_checkpointing_matches_no_checkpointing(mode, with_docs):
    ref = tiny(tie_embeddings=False)
    model = Transformer(ModelConfig(**{**TINY, "tie_embeddings": False, "activation_checkpointing": mode}))
    model.load_state_dict(ref.state_dict())
    idx = tokens(2, 17)
    docs = torch.tensor([[0] * 5 + [1] * 12, [0] * 9 + [2] * 8]) if with_docs else None
    loss_ref, grads_ref = _loss_and_grads(ref, idx, docs)
    loss, grads = _loss_and_grads(model, idx, docs)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpointing_modes_select_the_right_blocks():
    every = Transformer(ModelConfig(**{**TINY, "n_layers": 5, "activation_checkpointing": "every_n",
                                       "checkpoint_every_n": 2}))
    assert every.checkpoint_blocks == (True, False, True, False, True)
    assert all(tiny(activation_checkpointing="block").checkpoint_blocks)
    mlp = tiny(activation_checkpointing="mlp")
    assert not any(mlp.checkpoint_blocks)
    assert all(b.checkpoint_mlp and not b.checkpoint_attention for b in mlp.layers)


def test_init_std():
    dim, n_layers, ffn = 256, 6, 768
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=2000, dim=dim, n_layers=n_layers, n_heads=8, n_kv_heads=4, ffn_dim=ffn,
                                    tie_embeddings=False, max_seq_len=16))
    layer = model.layers[0]
    out_std = dim ** -0.5 / math.sqrt(2 * n_layers)
    expected = {
        layer.attention.q_proj.weight: dim ** -0.5,
        layer.attention.k_proj.weight: dim ** -0.5,
        layer.feed_forward.gate_proj.weight: dim ** -0.5,
        layer.feed_forward.up_proj.weight: dim ** -0.5,
        model.lm_head.weight: dim ** -0.5,
        layer.attention.o_proj.weight: out_std,
        layer.feed_forward.down_proj.weight: out_std,
        model.tok_embeddings.weight: 0.02,
    }
    for w, std in expected.items():
        assert abs(w.std().item() / std - 1) < 0.03, (w.shape, w.std().item(), std)
        assert abs(w.mean().item()) < 0.05 * std
    assert torch.equal(layer.ffn_norm.weight, torch.ones(dim)) and torch.equal(model.norm.weight, torch.ones(dim))


def test_meta_device_build_then_materialize():
    with torch.device("meta"):
        model = Transformer(ModelConfig(**TINY))
    model.to_empty(device="cpu")
    model.init_weights()
    ref = Transformer(ModelConfig(**TINY))
    torch.testing.assert_close(model.rope_cos, ref.rope_cos)
    assert torch.isfinite(model(tokens(1, 8))).all()


def test_generate_greedy_is_deterministic_and_sampling_respects_top_k():
    model = tiny()
    prompt = tokens(2, 5)
    a = model.generate(prompt, 6)
    b = model.generate(prompt, 6)
    assert a.shape == (2, 11) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    # Greedy: each new token is the argmax of the logits given everything before it.
    torch.testing.assert_close(a[:, 5], model(prompt)[:, -1].argmax(-1))
    # Longer than max_seq_len: the context is cropped rather than failing.
    assert model.generate(prompt, 30).shape == (2, 35)
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(prompt, 1, temperature=1.0, top_k=1, generator=g)
    torch.testing.assert_close(sampled[:, -1], a[:, 5])


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    model = tiny(activation_checkpointing="every_n")
    idx = tokens(2, 16)
    docs = torch.tensor([[0] * 8 + [1] * 8] * 2)
    hidden = torch.compile(model.hidden, fullgraph=True)  # fullgraph: any graph break is an error
    for d in (None, docs):
        h = hidden(idx, d)
        torch.testing.assert_close(h, model.hidden(idx, d), rtol=1e-4, atol=1e-4)
        h.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_packed_row_equals_each_document_alone_forward_and_backward():
    """Document-masked attention: the logits of a packed row equal each document run alone, and the
    gradients of the row's summed loss equal the sum of the documents' separate gradients (fp32)."""
    torch.set_float32_matmul_precision("highest")
    model = tiny()
    lengths = [5, 9, 3, 7]  # one row of 24 = max_seq_len tokens
    idx = tokens(1, sum(lengths), seed=3)
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    packed = model(idx, doc_mask=docs)
    for s, n in zip(starts, lengths):
        torch.testing.assert_close(packed[0, s:s + n], model(idx[:, s:s + n])[0], rtol=0, atol=1e-5)

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss_fn().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    def doc_loss(logits, ids):  # next-token loss inside one document, as a share of the row's mean
        return F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / (sum(lengths) - len(lengths))

    together = grads(lambda: sum(doc_loss(model(idx, doc_mask=docs)[:, s:s + n], idx[:, s:s + n])
                                 for s, n in zip(starts, lengths)))
    alone = grads(lambda: sum(doc_loss(model(idx[:, s:s + n]), idx[:, s:s + n]) for s, n in zip(starts, lengths)))
    for k in together:
        torch.testing.assert_close(together[k], alone[k], rtol=0, atol=1e-5)


def test_flex_block_mask_computes_the_same_attention_as_the_sdpa_mask():
    """The CUDA kernel's mask (flex_attention BlockMask) and the CPU one (boolean SDPA mask) encode the
    same predicate; flex_attention's eager forward runs on CPU, so the two are compared here."""
    import warnings

    from pipeline.model.attention import attend, document_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8,
                                                                                                         generator=g)
    docs = torch.tensor([[0] * 4 + [1] * 11 + [2] * 5, [0] * 20])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile": the eager reference
        flex = attend(q, k, v, document_mask(docs, kernel="flex"))
    torch.testing.assert_close(flex, attend(q, k, v, document_mask(docs, kernel="sdpa")), rtol=0, atol=1e-5)
    assert type(document_mask(docs)).__name__ == "Tensor" and document_mask(None) is None  # CPU default: sdpa


def test_document_block_mask_equals_create_block_mask_without_a_t_by_t_tensor():
    """The BlockMask built block by block from the document ids is create_block_mask's (every index tensor
    and the dense mask) for packed and shuffled ids, lengths that are and are not whole 128-blocks, and
    arbitrary id values; and it never holds a [T, T] tensor, which an uncompiled create_block_mask builds
    every micro-step on the FSDP path (the largest tensor here is [B, T / 128, T])."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.model.attention import document_block_mask

    def reference(doc_ids):
        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        B, T = doc_ids.shape
        return create_block_mask(same_document_causal, B=B, H=None, Q_LEN=T, KV_LEN=T, device="cpu")

    g = torch.Generator().manual_seed(0)
    cases = [torch.zeros(2, 300, dtype=torch.long),  # one document
             torch.repeat_interleave(torch.arange(4), 256)[None].repeat(2, 1),  # documents of whole blocks
             torch.sort(torch.randint(0, 9, (3, 700), generator=g), dim=1).values,  # packed rows
             torch.randint(0, 3, (2, 520), generator=g),  # shuffled
             torch.randint(-5, 1000, (1, 77), generator=g)]  # shorter than a block, any id values
    for docs in cases:
        got, want = document_block_mask(docs), reference(docs)
        pairs = list(zip(got.as_tuple(), want.as_tuple(), strict=True))
        tensors = [(a, b) for a, b in pairs if isinstance(a, torch.Tensor)]
        assert len(tensors) >= 8 and all(torch.equal(a, b) for a, b in tensors), docs.shape
        assert torch.equal(got.to_dense(), want.to_dense()) and got.to_dense().any()

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    T = 2048
    docs = torch.sort(torch.randint(0, 12, (1, T), generator=g), dim=1).values
    for build, bound in ((document_block_mask, T * T // 128), (reference, T * T)):
        with LargestTensor() as mode:
            build(docs)
        assert (mode.largest <= bound) if build is document_block_mask else mode.largest >= bound, build
