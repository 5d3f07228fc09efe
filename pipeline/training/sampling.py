"""Text generation for monitoring and evaluation: prompts as the model saw documents start, greedy
samples during training, seeded generations in the evaluation report."""
from __future__ import annotations

import torch

from pipeline.training.model import Transformer


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the model saw documents start: BOS first (every delimiter policy reserves it)."""
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


@torch.no_grad()
def greedy_sample(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
    out = model.generate(ids, max_new_tokens, temperature=0.0)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:].tolist())


def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
                   device: torch.device) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
        new = model.generate(ids, max_new_tokens, temperature=temperature, generator=gen)[0, ids.shape[1]:]
        out.append({"prompt": prompt, "completion": tokenizer.decode(new.tolist())})
    return out
