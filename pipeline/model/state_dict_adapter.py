"""Our parameter names <-> transformers' LlamaForCausalLM, and a Hugging Face Llama directory read back
as our checkpoint (the state-dict adapter beside the model, as torchtitan keeps ``state_dict_adapter.py``
beside each of its models).

``NAME_MAP`` is the one mapping table: plain renames, no reshaping (both models apply RoPE in the
half-split layout). Writing a directory is pipeline/evaluation/export.py; reading one (``read_hf``:
the weights, config.json checked against them and against what our model can express, our
``tokenfarm.json`` provenance when present) is here, because `load_model` accepts such a directory
wherever a checkpoint is expected (chat).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from pipeline.config import cut, export_slice
from pipeline.errors import PipelineError
from pipeline.io import read_json
from pipeline.model.checkpoint_io import versions
from pipeline.model.model import ModelConfig, Transformer
from pipeline.run_config import run_config

# Ours <-> transformers' LlamaForCausalLM: the one mapping table. "{i}" is the layer index.
NAME_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
# model.* config keys the export expresses; any other key that is switched on is refused.
MODEL_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps",
              "tie_embeddings")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PROVENANCE = "tokenfarm.json"
TRANSFORMERS_DEFAULT_EPS = 1e-6  # what LlamaConfig assumes when config.json has no rms_norm_eps


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_TO_HF = [(_pattern(ours), hf) for ours, hf in NAME_MAP]
_TO_OURS = [(_pattern(hf), ours) for ours, hf in NAME_MAP]


def _rename(name: str, table) -> str | None:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group("i")) if "i" in m.groupdict() else target
    return None


def hf_name(name: str) -> str | None:
    """transformers' name of our parameter `name` (None: no equivalent)."""
    return _rename(name, _TO_HF)


def our_name(name: str) -> str | None:
    """Our name of transformers' parameter `name` (None: no equivalent)."""
    return _rename(name, _TO_OURS)


# ----------------------------------------------------------------------------- checks

def differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """Key paths where two nested dicts differ: [(path, a's value, b's value)]."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [(prefix, a, b)]


def check_same_config(ckpt_params: dict, config_params: dict, where: str) -> None:
    """The checkpoint's run must have the config the caller passes (its `export` slice; a checkpoint
    imported from a foreign directory knows only its model and seq_len, so only those are compared)."""
    if "tokenizer" in ckpt_params:
        ours = cut(export_slice, ckpt_params)
    else:
        ours = {"model": ckpt_params["model"], "train": {"seq_len": ckpt_params["train"]["seq_len"]}}
        config_params = {k: config_params[k] for k in ours}
        config_params["train"] = {"seq_len": config_params["train"]["seq_len"]}
    diffs = differences(ours, config_params)
    if diffs:
        path, ours, theirs = diffs[0]
        raise PipelineError(f"{where} comes from another config: its {path} is {ours!r} but the config says "
                            f"{theirs!r}; export the checkpoint of this config (rerun its training) or pass the "
                            "config it was trained with")


# ----------------------------------------------------------------------------- reading a directory

def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's model.safetensors or its index's shards."""
    from safetensors.torch import load_file

    if (hf_dir / WEIGHTS_INDEX).exists():
        files = sorted(set(read_hf_json(hf_dir / WEIGHTS_INDEX, "weight_map")["weight_map"].values()))
    elif (hf_dir / WEIGHTS).exists():
        files = [WEIGHTS]
    else:
        raise PipelineError(f"{hf_dir}: no {WEIGHTS} or {WEIGHTS_INDEX}; export a model with safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(hf_dir / f))
        except Exception as e:  # missing, truncated or not safetensors
            raise PipelineError(f"{hf_dir / f}: cannot read its weights ({type(e).__name__}: {e}); re-export the "
                                "model") from None
    return state


def read_hf_json(path: Path, *required: str) -> dict:
    """A JSON object file of a Hugging Face directory that has the `required` keys, or one
    PipelineError naming the file (and the missing key)."""
    try:
        obj = read_json(path)
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path}: not readable JSON ({e}); fix the file or re-export the model") from None
    if not isinstance(obj, dict):
        raise PipelineError(f"{path}: holds a JSON {type(obj).__name__}, not an object; fix the file or re-export")
    missing = [k for k in required if k not in obj]
    if missing:
        raise PipelineError(f"{path}: no {', '.join(map(repr, missing))} key; fix the file or re-export the model")
    return obj


HF_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "max_position_embeddings")


@dataclass(frozen=True)
class HFLlamaConfig:
    """The keys of a Hugging Face config.json our model reads (not our run config): the sizes
    (`HF_CONFIG_KEYS`, required), and the optional ones with the default transformers' LlamaConfig assumes
    when the file omits them (None: "not given")."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str | None = "silu"
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    pretraining_tp: int | None = 1
    rms_norm_eps: float = TRANSFORMERS_DEFAULT_EPS
    tie_word_embeddings: bool = True
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None

    @classmethod
    def of(cls, obj: dict) -> HFLlamaConfig:
        """The keys of a config.json's object this class names (a key it holds, even null, is kept as given)."""
        return cls(**{f.name: obj[f.name] for f in fields(cls) if f.name in obj})

    @property
    def derived_head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads


def _rope_theta(hf: HFLlamaConfig) -> float:
    rp = hf.rope_parameters or {}
    rs = hf.rope_scaling or {}
    kind = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if kind != "default":
        raise PipelineError(f"rope_type {kind!r} (RoPE scaling) is a feature our model cannot express")
    theta = rp.get("rope_theta", hf.rope_theta)
    return float(theta if theta is not None else 10000.0)


def check_config_fits_weights(hf: HFLlamaConfig, shapes: dict[str, tuple], where: str) -> None:
    """Refuse a config.json whose sizes disagree with its weights, naming the key that is wrong and
    the tensor that shows it (before the sizes are derived from each other: a wrong hidden_size
    would otherwise surface as an inexpressible head_dim)."""
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    emb, gate = "model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight"
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    checks = []
    if emb in shapes:
        checks += [("vocab_size", shapes[emb][0], f"{emb} has {shapes[emb][0]} rows"),
                   ("hidden_size", shapes[emb][1], f"{emb} has {shapes[emb][1]} columns")]
    if gate in shapes:
        checks.append(("intermediate_size", shapes[gate][0], f"{gate} has {shapes[gate][0]} rows"))
    if layers:
        checks.append(("num_hidden_layers", len(layers), f"the weights hold {len(layers)} layers"))
    if hf.head_dim and q in shapes:
        checks.append(("num_attention_heads", shapes[q][0] // hf.head_dim,
                       f"{q} has {shapes[q][0]} rows = num_attention_heads × head_dim {hf.head_dim}"))
    for key, value, why in checks:
        given = getattr(hf, key)
        if given != value:
            raise PipelineError(f"{where}: {key} = {given!r} does not fit the weights ({why}); set {key} to "
                                f"{value} or re-export the model")
    head_dim = hf.head_dim or hf.derived_head_dim
    if k in shapes and hf.kv_heads * head_dim != shapes[k][0]:
        raise PipelineError(f"{where}: num_key_value_heads = {hf.kv_heads!r} does not fit the weights ({k} has "
                            f"{shapes[k][0]} rows = num_key_value_heads × head_dim {head_dim}); fix "
                            "num_key_value_heads or re-export")


def model_params_from_hf(hf: HFLlamaConfig, where: str) -> tuple[dict, int]:
    """Our `model` config slice and seq_len from a config.json; refuses what our model cannot express."""
    unsupported = [
        ("model_type", hf.model_type != "llama"),
        ("hidden_act", hf.hidden_act != "silu"),
        ("attention_bias", bool(hf.attention_bias)),
        ("mlp_bias", bool(hf.mlp_bias)),
        ("pretraining_tp", hf.pretraining_tp not in (None, 1)),
    ]
    for key, bad in unsupported:
        if bad:
            raise PipelineError(f"{where}: {key} = {getattr(hf, key)!r} is a feature our model cannot express")
    if hf.head_dim not in (None, hf.derived_head_dim):
        raise PipelineError(f"{where}: head_dim = {hf.head_dim!r} is not hidden_size / num_attention_heads = "
                            f"{hf.hidden_size} / {hf.num_attention_heads}: a head size decoupled from the "
                            "width is a feature our model cannot express")
    try:
        theta = _rope_theta(hf)
    except PipelineError as e:
        raise PipelineError(f"{where}: {e}") from None
    model = {
        "vocab_size": hf.vocab_size,
        "dim": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.kv_heads,
        "ffn_dim": hf.intermediate_size,
        "rope_theta": theta,
        "norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(hf.tie_word_embeddings),
    }
    return model, int(hf.max_position_embeddings)


def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a Hugging Face model directory (what `export` writes, or transformers saves)."""
    return Path(path).is_dir() and (Path(path) / "config.json").exists()


def read_hf(hf_dir: str | os.PathLike, config_params: dict | None = None) -> dict:
    """A transformers Llama directory as a checkpoint dict of the final.pt format (fp32 weights), in
    memory. Params come from its tokenfarm.json when it is one of our exports, else from config.json
    (`model` and `train.seq_len` = max_position_embeddings)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise PipelineError(f"{hf_dir}: no config.json; pass a Hugging Face model directory to --from-hf")
    hf = HFLlamaConfig.of(read_hf_json(hf_dir / "config.json", *HF_CONFIG_KEYS))
    hf_state = read_weights(hf_dir)
    check_config_fits_weights(hf, {n: tuple(t.shape) for n, t in hf_state.items()}, str(hf_dir / "config.json"))
    model, seq_len = model_params_from_hf(hf, str(hf_dir / "config.json"))
    ours = read_hf_json(hf_dir / PROVENANCE, "params") if (hf_dir / PROVENANCE).exists() else None
    if ours is not None:
        params, plan, summary = ours["params"], ours.get("plan"), ours.get("summary")
        export = run_config(params)  # the export slice the model was written with
        diffs = differences({k: export.model.get(k) for k in MODEL_KEYS}, model)
        if diffs or export.train.seq_len != seq_len:
            raise PipelineError(f"{hf_dir}: {PROVENANCE} does not describe its config.json "
                                f"({diffs[0][0] if diffs else 'seq_len'} differs); delete {PROVENANCE} or re-export")
    else:
        params, plan, summary = {"model": model, "train": {"seq_len": seq_len}}, None, None
    if config_params is not None:
        check_same_config(params, config_params, str(hf_dir))

    if model["tie_embeddings"]:
        hf_state.pop("lm_head.weight", None)  # a tied checkpoint may store the shared tensor twice
    state = {}
    for name, t in hf_state.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer old transformers versions saved
            continue
        mine = our_name(name)
        if mine is None:
            raise PipelineError(f"{hf_dir}: tensor {name!r} has no equivalent in our model; it is not a plain Llama")
        state[mine] = t.to(torch.float32)
    target = Transformer(ModelConfig.from_config({"model": model, "train": {"seq_len": seq_len}}))
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise PipelineError(f"{hf_dir}: its weights do not fit its config.json ({e})") from None
    return {"model": state, "params": params, "plan": plan, "summary": summary or {"imported_from": str(hf_dir)},
            "versions": versions()}
