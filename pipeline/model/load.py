"""The one way a stage gets a trained model: `load_model(path, device)` (`load_trained` with the
checkpoint dict beside it)."""
from __future__ import annotations

import os

import torch

from pipeline.errors import PipelineError
from pipeline.model.checkpoint_io import load_checkpoint
from pipeline.model.model import ModelConfig, Transformer
from pipeline.model.state_dict_adapter import is_hf_dir, read_hf

__all__ = ["load_model", "load_trained"]


def load_trained(path: str | os.PathLike, device: torch.device | str) -> tuple[Transformer, dict]:
    """The trained Transformer of a ``final.pt`` or a step checkpoint (verified against its sha256
    sidecar first: `load_checkpoint`), or of a Hugging Face directory (one ``python -m
    pipeline.evaluation.export`` wrote, or any compatible Llama: `read_hf`), in fp32 and eval mode on
    ``device``, with the checkpoint dict it came from (its ``params``, ``plan``, ``summary``). A file
    that is not a tokenfarm training checkpoint is a PipelineError naming it."""
    state = read_hf(path) if is_hf_dir(path) else load_checkpoint(path)
    if not isinstance(state, dict) or "model" not in state or "params" not in state:
        raise PipelineError(f"{path} is not a tokenfarm training checkpoint (no model weights and params)")
    model = Transformer(ModelConfig.from_config(state["params"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state


def load_model(path: str | os.PathLike, device: torch.device | str) -> Transformer:
    """The model of `load_trained`, for callers that need only the model."""
    return load_trained(path, device)[0]
