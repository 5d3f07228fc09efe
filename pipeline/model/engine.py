"""KV-cache inference engine for the Transformer: prefill + decode over a batch of prompts.

    engine = Engine(model, autocast_dtype=torch.bfloat16)      # None on CPU: fp32
    outs = engine.generate(prompts, max_new_tokens=64, temperature=0.0, stop_ids=[end_id])

Right-padded prompts at their true positions, greedy or top-k sampling with the caller's generator,
each row stopping at a stop id, ``max_new_tokens`` or the model's context (`Generation.reason`). Tested
against ``Transformer.generate``. Also: `prompt_ids` (BOS first), `greedy_sample` (training's samples),
`generate_texts` (the report's), and ``python -m pipeline.model.engine`` (a CPU benchmark).

The cache layout and the sampling rule: docs/model.md, "The KV-cache engine".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.io import run_cli
from pipeline.model.model import ModelConfig, Transformer, apply_rope, sample_next

__all__ = ["Engine", "Generation", "KVCache", "sample_next", "prompt_ids", "greedy_sample", "generate_texts"]


@dataclass
class KVCache:
    """Keys/values of every layer for a batch, and the next free position of each row."""

    k: torch.Tensor  # [n_layers, B, max_len, n_kv_heads, head_dim]
    v: torch.Tensor
    pos: torch.Tensor  # int64 [B]: tokens cached per row (= position of the row's next token)

    @classmethod
    def empty(cls, model: Transformer, batch: int, max_len: int, dtype: torch.dtype) -> KVCache:
        c = model.cfg
        shape = (c.n_layers, batch, max_len, c.n_kv_heads, c.head_dim)
        device = model.tok_embeddings.weight.device
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int64, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@dataclass
class Generation:
    """One row's new tokens (stop token excluded) and why it ended: ``stop`` (a stop token),
    ``length`` (max_new_tokens) or ``context`` (the model's max_seq_len)."""

    tokens: list[int] = field(default_factory=list)
    reason: str = ""



class Engine:
    """Batched generation with a KV cache (docs/model.md, "The KV-cache engine")."""

    def __init__(self, model: Transformer, autocast_dtype: torch.dtype | None = None):
        self.model = model.eval()
        self.autocast_dtype = autocast_dtype
        self.device = model.tok_embeddings.weight.device

    # ------------------------------------------------------------------ the forward with a cache

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """fp32 logits [B, T, vocab] of tokens ``idx`` [B, T] at positions ``pos`` [B, T], writing
        their keys/values into ``cache`` at those positions; each query attends to the cached slots
        at positions <= its own. (``cache.pos`` is left to the caller.)"""
        m = self.model
        B, T = idx.shape
        flat = pos.reshape(-1)
        cos, sin = m.rope_cos[flat], m.rope_sin[flat]  # [B*T, head_dim/2]
        L = int(pos.max()) + 1
        mask = (torch.arange(L, device=idx.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, L]
        rows = torch.arange(B, device=idx.device)[:, None]

        def rope(t: torch.Tensor) -> torch.Tensor:  # per-token positions: the batch flattened into time
            return apply_rope(t.reshape(1, B * T, *t.shape[2:]), cos, sin).view(t.shape)

        on = self.autocast_dtype is not None
        with torch.autocast(idx.device.type, dtype=self.autocast_dtype or torch.float32, enabled=on):
            x = m.tok_embeddings(idx)
            for i, layer in enumerate(m.layers):
                a = layer.attention
                h = layer.attention_norm(x)
                q = rope(a.q_proj(h).view(B, T, a.n_heads, a.head_dim))
                k = rope(a.k_proj(h).view(B, T, a.n_kv_heads, a.head_dim))
                v = a.v_proj(h).view(B, T, a.n_kv_heads, a.head_dim)
                cache.k[i][rows, pos] = k.to(cache.k.dtype)
                cache.v[i][rows, pos] = v.to(cache.v.dtype)
                keys, values = cache.k[i][:, :L].transpose(1, 2), cache.v[i][:, :L].transpose(1, 2)
                y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
                x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, -1))
                x = x + layer._feed_forward(x)
            hidden = m.norm(x)
        return F.linear(hidden.float(), m.lm_head_weight.float())

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], max_len: int) -> tuple[torch.Tensor, KVCache]:
        """Run the (right-padded) prompts through the model into a fresh cache of ``max_len`` slots.
        Returns (fp32 logits [B, T_max, vocab], cache); row b's real logits are ``[:len(prompts[b])]``."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (e.g. <|bos|>)")
        longest = max(map(len, prompts))
        if longest > max_len or max_len > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens and a cache of {max_len} slots do not fit the model's "
                             f"max_seq_len {self.model.cfg.max_seq_len}")
        idx = torch.zeros(len(prompts), longest, dtype=torch.int64)
        for b, p in enumerate(prompts):
            idx[b, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
        idx = idx.to(self.device)
        cache = KVCache.empty(self.model, len(prompts), max_len, self._cache_dtype())
        pos = torch.arange(longest, device=self.device).expand(len(prompts), longest)
        logits = self.forward(idx, pos, cache)
        cache.pos = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=self.device)
        return logits, cache

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, cache: KVCache, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row at the row's next position: fp32 logits [B, vocab]. Rows where
        ``active`` is False do not advance (their slot is rewritten with a token nobody reads)."""
        if active is None:
            active = torch.ones_like(cache.pos, dtype=torch.bool)
        if bool((cache.pos[active] >= cache.max_len).any()):
            raise ValueError(f"the cache of {cache.max_len} slots is full")
        pos = torch.where(active, cache.pos, cache.pos.clamp(max=cache.max_len - 1))
        logits = self.forward(tokens.to(self.device)[:, None], pos[:, None], cache)[:, 0]
        cache.pos = cache.pos + active.long()
        return logits

    def _cache_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.model.tok_embeddings.weight.dtype

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
               top_k: int | None = None, stop_ids: Iterable[int] = (), generator: torch.Generator | None = None
               ) -> Iterator[list[int | None]]:
        """Yield, per decoding step, each row's new token (None once the row has ended)."""
        for step in self._steps(prompts, max_new_tokens, temperature, top_k, stop_ids, generator):
            yield [tok for tok, _ in step]

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, stop_ids: Iterable[int] = (), generator: torch.Generator | None = None
                 ) -> list[Generation]:
        """Each row's new tokens and why it ended (docs/model.md, "The KV-cache engine")."""
        out = [Generation() for _ in prompts]
        for step in self._steps(prompts, max_new_tokens, temperature, top_k, stop_ids, generator):
            for g, (tok, reason) in zip(out, step):
                if tok is not None:
                    g.tokens.append(tok)
                if reason:
                    g.reason = reason
        return out

    def _steps(self, prompts, max_new_tokens, temperature, top_k, stop_ids, generator):
        """Per step, each row's (new token or None, end reason or "")."""
        if max_new_tokens < 1:
            return
        limit = self.model.cfg.max_seq_len
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        max_len = min(limit, max(map(len, prompts)) + max_new_tokens)
        logits, cache = self.prefill(prompts, max_len)
        last = logits[torch.arange(len(prompts), device=self.device), lengths - 1]
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=self.device)
        active = torch.ones(len(prompts), dtype=torch.bool, device=self.device)
        for step in range(max_new_tokens):
            nxt = sample_next(last, temperature, top_k, generator)
            stopped = active & torch.isin(nxt, stop)
            emitted = active & ~stopped
            length_end = emitted & (step == max_new_tokens - 1)
            context_end = emitted & ~length_end & (cache.pos >= cache.max_len)
            reasons = ["stop" if s else "length" if n else "context" if c else ""
                       for s, n, c in zip(stopped.tolist(), length_end.tolist(), context_end.tolist())]
            yield [(t if e else None, r) for t, e, r in zip(nxt.tolist(), emitted.tolist(), reasons)]
            active = emitted & ~length_end & ~context_end
            if not bool(active.any()):
                return
            last = self.decode(nxt, cache, active)


# ----------------------------------------------------------------------------- cache-less sampling

def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the model saw documents start: BOS first (every delimiter policy reserves it)."""
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


@torch.no_grad()
def greedy_sample(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, device: torch.device,
                  autocast_dtype: torch.dtype | None = None) -> str:
    """A greedy continuation of `prompt` for training's monitoring samples (``Transformer.generate``),
    under the training body's `autocast_dtype` (None: fp32): under FSDP the blocks are gathered in it."""
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        out = model.generate(ids, max_new_tokens, temperature=0.0)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:].tolist())


def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
                   device: torch.device) -> list[dict]:
    """Seeded generations of the evaluation report, one per prompt (``Transformer.generate``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
        new = model.generate(ids, max_new_tokens, temperature=temperature, generator=gen)[0, ids.shape[1]:]
        out.append({"prompt": prompt, "completion": tokenizer.decode(new.tolist())})
    return out


# ----------------------------------------------------------------------------- benchmark

def benchmark(model: Transformer, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    """Greedy decoding throughput (new tokens / s over the batch) of the engine and of the cache-less
    ``Transformer.generate`` on the same random prompts; the two must produce the same tokens."""
    import time

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), generator=g)
    engine = Engine(model)
    t0 = time.perf_counter()
    out = engine.generate(prompts.tolist(), new_tokens)
    t1 = time.perf_counter()
    with torch.inference_mode():
        ref = model.generate(prompts, new_tokens)[:, prompt_len:]
    t2 = time.perf_counter()
    if [o.tokens for o in out] != ref.tolist():
        raise RuntimeError("the engine and the cache-less forward generated different tokens")
    n = batch * new_tokens
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "engine_tokens_per_s": n / (t1 - t0), "no_cache_tokens_per_s": n / (t2 - t1)}


def main(argv=None) -> None:
    import argparse
    import json


    p = argparse.ArgumentParser(prog="python -m pipeline.model.engine",
                                description="Benchmark KV-cache decoding against the cache-less forward (CPU).")
    p.add_argument("--configfile", default="config.yaml", help="the model of this config, randomly initialised")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_config(load_config(args.configfile))).eval()
    for b in args.batch:
        print(json.dumps(benchmark(model, b, args.prompt_len, args.new_tokens)))


if __name__ == "__main__":
    run_cli(main)
