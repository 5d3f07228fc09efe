"""A Llama-3-style decoder-only transformer, built from small torchtitan-style components.

Pre-norm blocks ``x + Attention(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``; RoPE (rotate-half), grouped-query
attention, optional document masking (pipeline/model/attention.py), activation checkpointing, an output
projection tied to the embedding when ``tie_embeddings`` is set.

    model = Transformer(ModelConfig.from_config(cfg))   # on the meta device too; then init_weights()
    h = model.hidden(idx, doc_mask)                     # the trainer's loss reads h and lm_head_weight
    logits = model(idx)                                 # fp32 logits, evaluation and generation

`Transformer.generate` / `sample_next`: cache-less sampling (the engine's reference).
`pipeline.planning.compute.count_params` counts its parameters analytically. The architecture, the
parameter names the optimizer groups use: docs/model.md, "The transformer".
"""
from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.attention import attend, document_mask
from pipeline.run_config import run_config

CHECKPOINT_MODES = ("none", "mlp", "attention", "block", "every_n")


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    activation_checkpointing: str = "none"
    checkpoint_every_n: int = 2

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim} must be n_heads {self.n_heads} × an even head dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.activation_checkpointing not in CHECKPOINT_MODES:
            raise ValueError(f"activation_checkpointing {self.activation_checkpointing!r} is not one of "
                             f"{CHECKPOINT_MODES}")
        if self.checkpoint_every_n < 1:
            raise ValueError("checkpoint_every_n must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, cfg: Mapping) -> ModelConfig:
        """Build from a resolved run config (or a slice, a checkpoint's params): ``model`` plus
        ``train.seq_len`` (as ``max_seq_len``), ``train.activation_checkpointing`` and ``train.checkpoint_every_n``."""
        c = run_config(cfg)
        model, train = c.model, c.train
        return cls(
            vocab_size=model.vocab_size,
            dim=model.dim,
            n_layers=model.n_layers,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            ffn_dim=model.ffn_dim,
            rope_theta=float(model.rope_theta),
            norm_eps=float(model.norm_eps),
            tie_embeddings=model.tie_embeddings,
            max_seq_len=train.seq_len,
            # optional in a slice: an export's params and a foreign model's carry seq_len only
            activation_checkpointing=train.get("activation_checkpointing", "none"),
            checkpoint_every_n=train.get("checkpoint_every_n", 2),
        )


# ----------------------------------------------------------------------------- components

def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * theta^(-2i/head_dim)``, each [max_seq_len, head_dim // 2], fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, head_dim] by position; cos/sin are [T, head_dim // 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _run(fn, use_checkpoint: bool, *args):
    """fn(*args), recomputed in backward instead of storing its activations when use_checkpoint."""
    if use_checkpoint and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of fp32 ``logits`` [B, vocab] -> int64 [B]: greedy (arg-max) at temperature 0,
    else softmax(logits / temperature) over the ``top_k`` most likely tokens, drawn with ``generator``.
    The one sampling rule of ``Transformer.generate`` and the KV-cache engine (pipeline/model/engine.py)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, checkpoint_attention: bool = False, checkpoint_mlp: bool = False):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.checkpoint_attention = checkpoint_attention
        self.checkpoint_mlp = checkpoint_mlp

    def _attention(self, x, cos, sin, mask):
        return self.attention(self.attention_norm(x), cos, sin, mask)

    def _feed_forward(self, x):
        return self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + _run(self._attention, self.checkpoint_attention, x, cos, sin, mask)
        return x + _run(self._feed_forward, self.checkpoint_mlp, x)


# ----------------------------------------------------------------------------- the model

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        mode = cfg.activation_checkpointing
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, checkpoint_attention=mode == "attention", checkpoint_mlp=mode == "mlp")
            for _ in range(cfg.n_layers)
        )
        self.checkpoint_blocks = tuple(
            mode == "block" or (mode == "every_n" and i % cfg.checkpoint_every_n == 0) for i in range(cfg.n_layers)
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not sin.is_meta:  # a meta-device model has no values: it is initialised after to_empty
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, load: Callable[[nn.Parameter, torch.Tensor], None] | None = None) -> None:
        """Linears ~ N(0, 1/fan_in) (std = fan_in^-1/2); the residual-branch outputs o_proj and
        down_proj ~ N(0, (dim^-1/2 / sqrt(2 n_layers))^2); embeddings ~ N(0, 0.02^2); norms = 1.
        Also (re)computes the RoPE tables, which ``to_empty`` leaves uninitialized.

        Without `load` each weight is drawn in place (from the generator of its device). With `load`,
        each weight's value is drawn into a fresh fp32 CPU tensor of its (global) shape — the CPU
        generator, in the same order, so the values of a host-built model — and handed to
        ``load(weight, value)``, which writes it (this rank's shard of it, for a sharded weight): a model
        materialized on an accelerator or sharded is initialised holding one weight on the host at a time."""
        out_std = self.cfg.dim ** -0.5 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = out_std if name.endswith(("o_proj", "down_proj")) else module.in_features ** -0.5
                fill = functools.partial(nn.init.normal_, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                fill = functools.partial(nn.init.normal_, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                fill = nn.init.ones_
            else:
                continue
            if load is None:
                fill(module.weight)
            else:
                value = torch.empty(module.weight.shape, dtype=torch.float32, device="cpu")
                fill(value)
                load(module.weight, value)
                del value
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                               device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def replay_construction_draws(self) -> None:
        """Advance the CPU generator past the values that building this model on the CPU draws — each
        layer's own ``reset_parameters`` at construction (which `init_weights` then overwrites) — by
        drawing them again, one layer at a time into a discarded host copy of it. A model built on the
        ``meta`` device draws nothing; after this, its ``init_weights(load=...)`` draws the values a
        host-built model of the same seed has, bit for bit. Layers are constructed in registration
        order, so ``self.modules()`` is the construction order. Call before fp8 conversion (it replays
        the plain layers' initialisation)."""
        for module in self.modules():
            if hasattr(module, "reset_parameters") and next(module.parameters(recurse=False), None) is not None:
                twin = copy.deepcopy(module).to_empty(device="cpu")
                twin.reset_parameters()
                del twin

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, dim] output projection: the token embedding when tied."""
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, idx: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> final-normed hidden states [B, T, dim]. ``doc_mask``: optional [B, T]
        document ids restricting attention to the same document."""
        return self._hidden(idx, doc_mask)

    def _hidden(self, idx: torch.Tensor, doc_mask: torch.Tensor | None) -> torch.Tensor:
        # `hidden` and `forward` each call this, never one another: under FSDP both are forward methods
        # (pipeline.training.parallelize.shard_model), and one nested in the other would reshard the root early.
        T = idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        mask = document_mask(doc_mask)
        x = self.tok_embeddings(idx)
        for layer, use_checkpoint in zip(self.layers, self.checkpoint_blocks):
            x = _run(layer, use_checkpoint, x, cos, sin, mask)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [B, T, vocab] (for evaluation and generation; training uses ``hidden``)."""
        return F.linear(self._hidden(idx, doc_mask), self.lm_head_weight).float()

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens to ``idx`` [B, T]: greedy at temperature 0, else sampled
        from softmax(logits / temperature), restricted to the ``top_k`` most likely when given.
        The context is cropped to the last ``max_seq_len`` tokens (no KV cache: eval-sized use)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.max_seq_len:])[:, -1]
            idx = torch.cat((idx, sample_next(logits, temperature, top_k, generator)[:, None]), dim=1)
        return idx
