"""Training stages: pretrain → midtrain → SFT (or any ordered list) from `train.stages`.

Each entry names a stage and may set its ``mix``, a budget (``tokens``, ``steps`` or ``epochs``), its
``loss`` (``all`` / ``assistant``), ``init_from`` (+ ``carry_optimizer``), ``doc_mask`` and optimizer and
schedule overrides (`STAGE_TRAIN_KEYS`). ``train.stages: []`` is one stage named after ``train.mix``.

- `stage_list(cfg)`: the stages resolved, in order; `get_stage`, `stage_names`, `is_chat_stage`;
- `stage_config(cfg, name)`: the view of the config one stage's train and evaluate jobs get;
- `stage_budget`, `epoch_steps`, `mix_targets`.

The keys and their defaults: docs/planning.md, "Training stages".
"""
from __future__ import annotations

import copy
import math

from pipeline.errors import ConfigError
from pipeline.planning.compute import count_params, flops_per_token, token_target, trained_tokens
from pipeline.run_config import RunConfig, plain

STAGE_TRAIN_KEYS = ("mix", "optimizer", "lr", "embed_lr", "lm_head_lr", "weight_decay", "betas", "grad_clip",
                    "schedule", "warmup_steps", "min_lr_ratio", "decay_frac")
BUDGET_KEYS = ("tokens", "steps", "epochs")
LOSSES = ("all", "assistant")


def stage_list(cfg: RunConfig) -> list[dict]:
    """The run's stages in order, resolved: ``name``, ``index``, ``mix``, ``budget`` (``{"kind":
    tokens|steps|epochs|run, "value"}``), ``loss``, ``init_from`` (a stage name or None),
    ``carry_optimizer``, ``doc_mask`` and ``train`` (the stage's effective `train` section)."""
    raw = cfg.train.get("stages") or [{"name": cfg.train.mix}]
    out: list[dict] = []
    for i, st in enumerate(raw):
        key = f"train.stages[{i}]"
        name = st["name"]
        if any(s["name"] == name for s in out):
            raise ConfigError(f"config key '{key}.name': stage '{name}' is listed twice; stage names must be unique")
        train = {k: v for k, v in cfg.train.items() if k != "stages"}
        train.update({k: copy.deepcopy(st[k]) for k in STAGE_TRAIN_KEYS if k in st})
        mix = train["mix"]
        if mix not in cfg.mixes:
            raise ConfigError(f"config key '{key}.mix': unknown mix '{mix}' (mixes: {', '.join(cfg['mixes'])})")
        budgets = [k for k in BUDGET_KEYS if st.get(k) is not None]
        if len(budgets) > 1:
            raise ConfigError(f"config key '{key}': set at most one of tokens, steps, epochs (stage '{name}' sets "
                              f"{' and '.join(budgets)})")
        budget = {"kind": budgets[0], "value": st[budgets[0]]} if budgets else {"kind": "run", "value": None}
        init = st.get("init_from", "previous" if out else "none")
        if init == "previous":
            if not out:
                raise ConfigError(f"config key '{key}.init_from': the first stage '{name}' has no previous stage; "
                                  "use none")
            init = out[-1]["name"]
        elif init == "none":
            init = None
        elif init not in [s["name"] for s in out]:
            raise ConfigError(f"config key '{key}.init_from': '{init}' is not a stage listed before '{name}' "
                              f"(earlier stages: {', '.join(s['name'] for s in out) or 'none'}); use previous, "
                              "none or one of them")
        loss = st.get("loss", "all")
        packing = cfg.mixes[mix].get("packing", "concat")
        if loss == "assistant":
            text = [s for s in cfg.mixes[mix]["weights"] if cfg.sources[s].get("format", "text") != "chat"]
            if text or packing != "bestfit":
                why = (f"its mix '{mix}' includes text source(s) {', '.join(text)}, which have no assistant turns"
                       if text else f"its mix '{mix}' uses packing: {packing}, which keeps no loss mask")
                raise ConfigError(f"config key '{key}.loss': stage '{name}' trains on assistant tokens only but {why}; "
                                  f"use a mix of chat sources with packing: bestfit, or loss: all")
        if budget["kind"] == "epochs" and cfg.mixes[mix]["tokens"] == "plan":
            raise ConfigError(f"config key 'mixes.{mix}.tokens': stage '{name}' counts epochs over mix '{mix}', so "
                              f"the mix needs a fixed size: set mixes.{mix}.tokens to an integer")
        if st.get("carry_optimizer") and init is None:
            raise ConfigError(f"config key '{key}.carry_optimizer': stage '{name}' starts from scratch; "
                              "carry_optimizer needs init_from")
        doc_mask = st.get("doc_mask")
        out.append({
            "name": name, "index": i, "mix": mix, "budget": budget, "loss": loss, "init_from": init,
            "carry_optimizer": bool(st.get("carry_optimizer", False)),
            "doc_mask": packing == "bestfit" if doc_mask is None else bool(doc_mask),
            "train": train,
        })
    return plain(out)


def adamw8bit_keys(cfg: RunConfig) -> list[str]:
    """The config keys that set the optimizer to adamw8bit: ``train.optimizer`` and any stage's override
    (refused under fsdp: `ADAMW8BIT_FSDP`)."""
    train = cfg.train
    keys = ["train.optimizer"] if train["optimizer"] == "adamw8bit" else []
    return keys + [f"train.stages[{i}].optimizer" for i, st in enumerate(train.get("stages") or [])
                   if st.get("optimizer") == "adamw8bit"]


# Why fsdp refuses adamw8bit: pipeline.config's check of train.parallel: fsdp,
# pipeline.planning.parallel.resolve_parallel's
# of auto, the trainer's build_optimizer as a backstop.
ADAMW8BIT_FSDP = ("adamw8bit cannot step train.parallel: fsdp's sharded parameters (bitsandbytes' 8-bit kernels "
                  "take plain CUDA tensors, not FSDP2's DTensor shards: an illegal memory access)")


def stage_names(cfg: RunConfig) -> list[str]:
    return [s["name"] for s in stage_list(cfg)]


def get_stage(cfg: RunConfig, name: str) -> dict:
    for s in stage_list(cfg):
        if s["name"] == name:
            return s
    raise ConfigError(f"unknown stage '{name}' (train.stages: {', '.join(stage_names(cfg))})")


def tokenizer_sources(cfg: RunConfig) -> list[str]:
    """The sources the tokenizer is trained on: tokenizer.train_sources, else every text source."""
    tok = cfg.tokenizer
    if tok.get("train_sources"):
        return list(tok["train_sources"])
    return [n for n, s in cfg.sources.items() if s["format"] == "text"] or list(cfg.sources)


def is_chat_stage(view: RunConfig) -> bool:
    """A stage's view (`stage_config`) trains a chat model: its mix has a chat source and a bestfit pack
    (its report adds the chat evaluation: assistant-only val loss, fixed answers, ChatCORE)."""
    mix = view.mixes[view.stage["mix"]]
    return mix.get("packing") == "bestfit" and any(view.sources[s].get("format") == "chat" for s in mix["weights"])


def stage_config(cfg: RunConfig, name: str) -> dict:
    """`cfg` as one stage sees it: `train` replaced by the stage's effective train section, `mixes`
    and `sources` narrowed to the stage's own mix and the sources its data is made of (the mix's and
    the tokenizer's), and the resolved stage (without its train section) under ``stage``. What the
    trainer and the evaluation of that stage receive, so an edit to another stage, mix or source
    leaves this stage's params (and Snakemake's rerun decision, and its checkpoints' resume check)
    unchanged. Plain data (a rule's params): type it with `pipeline.run_config.run_config` to read it."""
    st = get_stage(cfg, name)
    out = {k: v for k, v in cfg.items() if k != "train"}
    out["train"] = st["train"]
    out["mixes"] = {st["mix"]: cfg.mixes[st["mix"]]}
    if "sources" in cfg:  # what its data is made of: its mix's sources and the tokenizer's
        reads = set(cfg.mixes[st["mix"]]["weights"]) | set(tokenizer_sources(cfg))
        out["sources"] = {s: v for s, v in cfg.sources.items() if s in reads}
    out["stage"] = {k: v for k, v in st.items() if k != "train"}
    return plain(out)


# ----------------------------------------------------------------------------- budgets

def stage_budget(cfg: RunConfig, stage: dict) -> dict:
    """A stage's steps and trained tokens from the config alone: ``num_steps``, ``trained_tokens``
    (= num_steps × tokens_per_step) and ``basis``; both None for an epochs budget (known from the
    packed rows only; `epoch_steps`). A stage without a budget of its own trains the run's (`token_target` of
    ``cfg.train``: the budget keys are the run's, no stage overrides them)."""
    step = stage["train"]["global_batch_tokens"]
    kind, value = stage["budget"]["kind"], stage["budget"]["value"]
    key = f"train.stages[{stage['index']}].{kind}" if cfg.train.get("stages") else f"train.{kind}"
    if kind == "epochs":
        return {"num_steps": None, "trained_tokens": None, "basis": key}
    if kind == "steps":
        steps = int(value)
    else:
        if kind == "tokens":
            target = int(value)
        else:
            n_params, _ = count_params(cfg.model)
            target, key = token_target(cfg.train, n_params, flops_per_token(cfg))
        steps = -(-target // step)
    return {"num_steps": steps, "trained_tokens": steps * step, "basis": key}


def epoch_steps(epochs: float, n_rows: int, rows_per_step: int) -> tuple[int, int]:
    """(optimizer steps, rows read) of `epochs` passes over `n_rows` packed rows at `rows_per_step`
    rows per step (all ranks and micro-steps): rows = ceil(epochs × n_rows), steps = ceil(rows /
    rows_per_step); the last step's missing rows are empty (fully masked) rows of the same shape."""
    rows = -(-round(epochs * n_rows * 1_000_000) // 1_000_000)
    return -(-rows // rows_per_step), rows


def estimated_epoch_steps(cfg: RunConfig, stage: dict) -> int:
    """An epochs stage's optimizer steps before its mix is packed: its mix's integer `tokens` as rows of
    seq_len targets, no padding (a lower bound; the trainer counts the packed rows, `epoch_steps`)."""
    rows = -(-int(cfg.mixes[stage["mix"]]["tokens"]) // cfg.train.seq_len)
    rows_per_step = cfg.train.global_batch_tokens // cfg.train.seq_len
    return -(-math.ceil(stage["budget"]["value"] * rows) // rows_per_step)


def mix_targets(cfg: RunConfig, mix: str) -> int:
    """Training targets a mix with ``tokens: plan`` must supply: the most any stage training on it
    consumes (each stage reads its mix from the start); the run budget when no stage uses it."""
    used = [stage_budget(cfg, s)["trained_tokens"] for s in stage_list(cfg) if s["mix"] == mix]
    used = [t for t in used if t is not None]
    return max(used) if used else trained_tokens(cfg)
