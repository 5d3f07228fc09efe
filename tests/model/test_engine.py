"""KV-cache engine: the same logits as the cache-less forward (fp32, 1e-5), batching of prompts of
different lengths, sampling, stop tokens and the context limit."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.engine import Engine, sample_next
from pipeline.model.model import ModelConfig, Transformer

CFG = dict(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, rope_theta=10000.0, max_seq_len=32)


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**CFG)).eval()


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def test_prefill_and_decode_logits_equal_the_cacheless_forward():
    model, engine = tiny(), Engine(tiny())
    rows = prompts([7, 3, 11])
    logits, cache = engine.prefill(rows, max_len=20)
    for b, p in enumerate(rows):  # every real prompt position of every (right-padded) row
        ref = model(torch.tensor([p]))[0]
        torch.testing.assert_close(logits[b, :len(p)], ref, rtol=0, atol=1e-5)
    # Decode 6 arbitrary tokens per row, one step at a time: each step's logits are those of the
    # whole sequence so far run through the model without a cache.
    feed = prompts([6, 6, 6], seed=2)
    seqs = [list(p) for p in rows]
    for step in range(6):
        tok = torch.tensor([f[step] for f in feed])
        out = engine.decode(tok, cache)
        for b in range(len(rows)):
            seqs[b].append(feed[b][step])
            ref = model(torch.tensor([seqs[b]]))[0, -1]
            torch.testing.assert_close(out[b], ref, rtol=0, atol=1e-5)
    assert cache.pos.tolist() == [13, 9, 17]


def test_greedy_generation_equals_generate_without_cache_and_batch_equals_single():
    model = tiny()
    engine = Engine(model)
    rows = prompts([5, 9, 2])
    batch = engine.generate(rows, max_new_tokens=8)
    for p, g in zip(rows, batch):
        ref = model.generate(torch.tensor([p]), 8)[0, len(p):].tolist()
        assert g.tokens == ref and g.reason == "length"
        assert engine.generate([p], max_new_tokens=8)[0].tokens == ref


def test_stop_token_ends_a_row_and_is_not_emitted():
    model = tiny()
    engine = Engine(model)
    rows = prompts([4, 6])
    free = engine.generate(rows, max_new_tokens=10)
    stop = free[0].tokens[3]
    first = free[0].tokens.index(stop)
    out = engine.generate(rows, max_new_tokens=10, stop_ids=[stop])
    assert out[0].tokens == free[0].tokens[:first] and out[0].reason == "stop"
    other = free[1].tokens[:free[1].tokens.index(stop)] if stop in free[1].tokens else free[1].tokens
    assert out[1].tokens == other
    # stream yields None for a row once it has ended
    steps = list(engine.stream(rows, max_new_tokens=10, stop_ids=[stop]))
    assert [s[0] for s in steps[first:]] == [None] * (len(steps) - first)


def test_context_limit_ends_generation_without_cropping():
    engine = Engine(tiny())
    (g,) = engine.generate(prompts([30]), max_new_tokens=10)
    assert len(g.tokens) == 3 and g.reason == "context"  # positions 30, 31 fed; the 3rd token has no slot
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate(prompts([33]), max_new_tokens=1)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    engine = Engine(tiny())
    rows = prompts([5, 5])
    greedy = engine.generate(rows, 6)

    def sampled(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return [g.tokens for g in engine.generate(rows, 6, temperature=1.0, generator=gen, **kw)]

    assert sampled(3) == sampled(3)
    assert sampled(3, top_k=1) == [g.tokens for g in greedy]
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    draws = {int(sample_next(logits, 1.0, 2, torch.Generator().manual_seed(s))) for s in range(50)}
    assert draws == {1, 2}


def test_benchmark_checks_both_paths_agree():
    from pipeline.model.engine import benchmark

    out = benchmark(tiny(), batch=2, prompt_len=4, new_tokens=5)
    assert out["engine_tokens_per_s"] > 0 and out["no_cache_tokens_per_s"] > 0 and out["batch"] == 2
