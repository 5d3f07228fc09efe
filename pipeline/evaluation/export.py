"""Export a trained checkpoint as a Hugging Face ``transformers`` Llama directory, and import one back.

    python -m pipeline.evaluation.export --ckpt R/train/{stage}/final.pt --tokenizer R/tokenizer/tokenizer.json \\
        --out R/export/hf [--params JSON | --configfile FILE] [--force]
    python -m pipeline.evaluation.export --from-hf DIR --out CKPT.pt [--params JSON | --configfile FILE] [--force]

The directory (files listed in docs/data-contract.md, "Hugging Face export") loads offline with
``LlamaForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``, and so with
``lm-eval --model hf --model_args pretrained=DIR``. Why it computes the same function as our model
(held by tests/evaluation/test_export.py to 1e-4 in fp32):

* **Weights**: our parameter names map to transformers' by the plain renames of ``NAME_MAP``: both
  models apply RoPE in the half-split ("rotate half") layout, so q/k need no permutation. A tied
  model stores only the embedding (``tie_word_embeddings``).
* **config.json**: ``rms_norm_eps`` is written explicitly (transformers' Llama default is 1e-6, ours
  1e-5: the difference moves logits far beyond the tolerance), ``head_dim`` too, and the RoPE base
  both as ``rope_theta`` (transformers 4.x) and ``rope_parameters`` (5.x). ``max_position_embeddings``
  is the trained ``train.seq_len``.
* **Tokenizer**: the tiktoken ranks become a byte-level BPE (``tokenizer.json`` for
  ``PreTrainedTokenizerFast``): every split of a token into two tokens is a merge, ordered by the
  token's rank, and ``ignore_merges`` makes a whole pre-token that is in the vocabulary one token —
  exactly tiktoken's algorithm. The split regex is the same (a ``Split`` pre-tokenizer; possessive
  intervals rewritten for Oniguruma), bytes map to strings by the GPT-2 byte-level table. Our special
  tokens are added special tokens at their ids. The post-processor puts ``<|bos|>`` first, the prompt
  convention of training (``pipeline.model.engine.prompt_ids``: every document starts with
  ``<|bos|>``, so a prompt does). ``Tokenizer.render_chat`` is the Jinja ``chat_template``. One
  difference is by design: a literal ``<|bos|>`` in text is ordinary text for us but the special
  token for transformers. ``export`` checks the exported tokenizer against ours on probe texts
  before writing anything.

Refused, with one error naming the cause: a checkpoint whose config differs from the tokenizer's
run or from the given ``--params``/``--configfile``, a target that exists (unless ``--force``), and
a model feature transformers' Llama cannot express (an unknown ``model.*`` key that is switched on,
or a parameter ``NAME_MAP`` does not cover). The directory is written in a temporary sibling and
renamed into place, so it exists complete or not at all.

``--from-hf`` reads such a directory (ours or any compatible Llama) back into our checkpoint
format (``{"model", "params", "plan", "summary", "versions"}`` as ``final.pt``, fp32), exact for
our own exports: the same tensors bit for bit and, from ``tokenfarm.json``, the same params.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch

from pipeline.config import params_from_args, stage_params
from pipeline.data.encoding import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    CHAT_TOKENS,
    EOS,
    USER_END,
    USER_START,
    load_ranks,
    load_tokenizer,
)
from pipeline.errors import PipelineError
from pipeline.io import atomic_dir, get_logger, provenance, read_json, run_cli, write_json
from pipeline.model.checkpoint import load_checkpoint, save_checkpoint
from pipeline.model.model import ModelConfig, Transformer
from pipeline.model.state_dict_adapter import (
    MODEL_KEYS,
    PROVENANCE,
    WEIGHTS,
    WEIGHTS_INDEX,
    check_same_config,
    differences,
    hf_name,
    read_hf,
)

log = get_logger(__name__)

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size ("5GB")
# Texts on which the exported tokenizer must give our ids before anything is written.
PROBE_TEXTS = (
    "Hello world! It's 2024: numbers 1234567 and 3.14159.",
    "  leading spaces, trailing tabs\t\t\nnew\r\nlines\n\n\n  and   runs   ",
    "Unicode: naïve café, 日本語のテキスト, 한국어, مرحبا, emoji 😀👍🏽 👨‍👩‍👧, e\u0301.",
    "code: def f(x):\n    return x**2  # don't, we'll, they're, I've, I'M",
)


# ----------------------------------------------------------------------------- checks

def check_exportable(params: dict, state: dict, where: str) -> None:
    """Refuse what transformers' Llama cannot express: a `model.*` key other than MODEL_KEYS that is
    switched on (not false/none/0/null), or a parameter NAME_MAP has no name for."""
    for key, value in params["model"].items():
        if key not in MODEL_KEYS and value not in (False, None, 0, "none"):
            raise PipelineError(
                f"{where}: model.{key} = {value!r} is a model feature transformers' LlamaForCausalLM cannot "
                f"express; this checkpoint cannot be exported as a Llama model (train without model.{key})")
    for name in state:
        if hf_name(name) is None:
            raise PipelineError(f"{where}: parameter {name!r} has no equivalent in transformers' LlamaForCausalLM "
                                "(pipeline/model/state_dict_adapter.py NAME_MAP); this model cannot be exported as "
                                "Llama")


def check_tokenizer(ckpt_params: dict, tok, where: str) -> None:
    """The tokenizer must fit the model and come from the checkpoint's run (its provenance params
    equal the tokenizer slice of the checkpoint's config)."""
    vocab = ckpt_params["model"]["vocab_size"]
    if tok.n_vocab > vocab:
        raise PipelineError(f"{tok.path} has {tok.n_vocab} token ids but {where} has model.vocab_size {vocab}: "
                            "the tokenizer is from another run; pass the tokenizer the checkpoint was trained with")
    made_with = (read_json(tok.path).get("meta") or {}).get("params")
    if made_with is None or not {"tokenizer", "sources", "seed"} <= set(ckpt_params):
        log.warning("cannot check that %s belongs to %s (one of them records no config)", tok.path, where)
        return
    diffs = differences(stage_params(ckpt_params, "tokenizer"), made_with)
    if diffs:
        path, ours, theirs = diffs[0]
        raise PipelineError(f"{tok.path} was made with {path} = {theirs!r} but {where} was trained with {ours!r}: "
                            "the tokenizer is from another run; pass the tokenizer the checkpoint was trained with")


# ----------------------------------------------------------------------------- config.json

def doc_end_token(tok) -> str:
    """The token that ends a document: <|eos|> when the delimiter policy writes it, else the
    <|bos|> that starts the next document (what the model predicts after a document)."""

    return EOS if tok.eos_id is not None else BOS


def hf_config(mcfg, tok) -> dict:
    """config.json of LlamaForCausalLM for our ModelConfig `mcfg` (fp32 weights)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": mcfg.vocab_size,
        "hidden_size": mcfg.dim,
        "intermediate_size": mcfg.ffn_dim,
        "num_hidden_layers": mcfg.n_layers,
        "num_attention_heads": mcfg.n_heads,
        "num_key_value_heads": mcfg.n_kv_heads,
        "head_dim": mcfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": mcfg.max_seq_len,
        "rms_norm_eps": mcfg.norm_eps,
        "rope_theta": mcfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": mcfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.special[doc_end_token(tok)],
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def generation_config(tok) -> dict:
    """Greedy by default; stops at the end of a document or of an assistant turn."""

    return {"bos_token_id": tok.bos_id, "eos_token_id": [tok.special[doc_end_token(tok)], tok.special[ASSISTANT_END]],
            "do_sample": False}


# ----------------------------------------------------------------------------- tokenizer files

def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level table: every byte as a printable character (the ByteLevel pre-tokenizer's)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """A tiktoken rank table as a byte-level BPE vocabulary and merge list. tiktoken merges any
    adjacent pair whose concatenation is a token, lowest resulting rank first; so every split of a
    token into two tokens is a merge, and merges are ordered by the resulting token's rank (then by
    the parts' ranks, which only orders splits of the same token)."""
    table = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return vocab, [[left, right] for *_, left, right in merges]


def _tokenizer_spec(tok) -> tuple[dict[bytes, int], str]:
    """(ranks, split pattern) of a Tokenizer, read from its files."""

    spec = read_json(tok.path)
    return load_ranks(Path(tok.path).parent / spec["ranks_file"])[0], spec["pattern"]


# A possessive interval X{n,m}+ (tiktoken's patterns use it) means (X{n,m})+ to Oniguruma, the regex
# engine of `tokenizers`: it becomes the atomic group (?>X{n,m}), which is what possessive means.
_POSSESSIVE_INTERVAL = re.compile(r"(\\[pP]\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\()\[\]{}|])(\{\d+(?:,\d*)?\})\+")


def onig_pattern(pattern: str) -> str:
    """`pattern` (tiktoken's regex dialect) as Oniguruma reads it the same way."""
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


def tokenizer_json(tok) -> dict:
    """tokenizer.json (the `tokenizers` library's format) reproducing `tok` byte for byte."""

    ranks, pattern = _tokenizer_spec(tok)
    vocab, merges = bpe_vocab_and_merges(ranks)
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for s, i in sorted(tok.special.items(), key=lambda kv: kv[1])]
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": onig_pattern(pattern)}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [tok.bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def chat_template() -> str:
    """Jinja rendering of `Tokenizer.render_chat` after <|bos|>: user and assistant turns between
    their markers, no separators; a system turn's text opens the next user turn (a blank line
    between), or is a user turn of its own when an assistant turn or the end comes first;
    add_generation_prompt opens an assistant turn."""

    def user(text: str) -> str:
        return f"{USER_START}{{{{ {text} }}}}{USER_END}"

    return (
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{% set ns.system = ns.system + '\\n\\n' + message['content'] if ns.system else message['content'] %}"
        "{% elif message['role'] == 'user' %}"
        + user("ns.system + '\\n\\n' + message['content'] if ns.system else message['content']")
        + "{% set ns.system = '' %}"
        "{% elif message['role'] == 'assistant' %}"
        "{% if ns.system %}" + user("ns.system") + "{% set ns.system = '' %}{% endif %}"
        f"{ASSISTANT_START}{{{{ message['content'] }}}}{ASSISTANT_END}"
        "{% else %}{{ raise_exception('chat role ' + message['role'] + ' is not system, user or assistant') }}"
        "{% endif %}{% endfor %}"
        "{% if ns.system %}" + user("ns.system") + "{% endif %}"
        f"{{% if add_generation_prompt %}}{ASSISTANT_START}{{% endif %}}"
    )


def tokenizer_config(tok, max_len: int) -> dict:
    """tokenizer_config.json: PreTrainedTokenizerFast, BOS added, no clean-up of spaces on decode."""

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": doc_end_token(tok),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "additional_special_tokens": list(CHAT_TOKENS),
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for s, i in tok.special.items()},
        "chat_template": chat_template(),
    }


def check_tokenizer_json(spec: dict, tok, texts=PROBE_TEXTS) -> None:
    """The exported tokenizer must encode `texts` to our ids (BOS first) and decode them back."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(json.dumps(spec))
    for text in texts:
        ours = [tok.bos_id] + tok.encode(text)
        theirs = hf.encode(text).ids
        if theirs != ours or hf.decode(theirs, skip_special_tokens=True) != text:
            raise PipelineError(f"{tok.path}: the exported tokenizer encodes {text!r} to {theirs[:20]}... instead of "
                                f"{ours[:20]}...; this tokenizer cannot be exported exactly (please report it)")


# ----------------------------------------------------------------------------- weights

def write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write transformers-named tensors as model.safetensors, or as model-0000k-of-0000n.safetensors
    shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own) plus
    model.safetensors.index.json. Returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / WEIGHTS, metadata={"format": "pt"})
        return [WEIGHTS]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
    return names + [WEIGHTS_INDEX]


# ----------------------------------------------------------------------------- directories

def _claim(out: Path, force: bool) -> None:
    """Refuse an existing non-empty target unless `force`."""
    if out.exists() and not force and (out.is_file() or any(out.iterdir())):
        raise PipelineError(f"{out} exists; choose another --out or pass --force to replace it")


# ----------------------------------------------------------------------------- export

def export(ckpt_path: str | os.PathLike, tokenizer_path: str | os.PathLike, out: str | os.PathLike,
           config_params: dict | None = None, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the checkpoint `ckpt_path` (final.pt format) and its tokenizer as a transformers Llama
    directory `out` (module docstring). `config_params`: the `export` slice of the config the
    checkpoint must come from (None: not checked against a config)."""

    out = Path(out)
    _claim(out, force)
    final = load_checkpoint(ckpt_path)
    if not isinstance(final, dict) or "model" not in final or "params" not in final:
        raise PipelineError(f"{ckpt_path}: not a training checkpoint (no 'model'/'params'); "
                            "pass R/train/<stage>/final.pt")
    params, state = final["params"], final["model"]
    check_exportable(params, state, str(ckpt_path))
    if config_params is not None:
        check_same_config(params, config_params, str(ckpt_path))
    tok = load_tokenizer(tokenizer_path)
    check_tokenizer(params, tok, str(ckpt_path))
    mcfg = ModelConfig.from_config(params)
    model = Transformer(mcfg)  # the checkpoint must be exactly a model of its config
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise PipelineError(f"{ckpt_path}: its weights do not fit its own model config ({e}); "
                            "the file is not a checkpoint of this code") from None
    spec = tokenizer_json(tok)
    check_tokenizer_json(spec, tok)

    hf_state = {hf_name(k): v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    with atomic_dir(out, replace=True) as tmp:  # _claim refused an existing target unless force
        files = write_weights(hf_state, tmp, max_shard_bytes)
        write_json(tmp / "config.json", hf_config(mcfg, tok))
        write_json(tmp / "generation_config.json", generation_config(tok))
        write_json(tmp / "tokenizer.json", spec)
        write_json(tmp / "tokenizer_config.json", tokenizer_config(tok, mcfg.max_seq_len))
        write_json(tmp / PROVENANCE, {
            "params": params, "plan": final.get("plan"), "summary": final.get("summary"),
            "tokenizer_sha256": tok.sha256, "weights": files,
            "meta": provenance("export", config_params, [ckpt_path, tokenizer_path]),
        })
    n = sum(t.numel() for t in hf_state.values())
    log.info("exported %s (%d parameters, %d weight file(s)) to %s", ckpt_path, n, len(files), out)
    return out


# ----------------------------------------------------------------------------- import

def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, config_params: dict | None = None,
              force: bool = False) -> dict:
    """Read a transformers Llama directory into our checkpoint format at `out` (fp32 weights), as
    `read_hf` does. Returns the checkpoint dict."""
    out = Path(out)
    if out.exists() and not force:
        raise PipelineError(f"{out} exists; choose another --out or pass --force to replace it")
    final = read_hf(hf_dir, config_params)
    save_checkpoint(out, final)
    log.info("imported %s (%d parameters) to %s", hf_dir, sum(t.numel() for t in final["model"].values()), out)
    return final


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.evaluation.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="checkpoint to export (R/train/{stage}/final.pt)")
    ap.add_argument("--tokenizer", help="its tokenizer (R/tokenizer/tokenizer.json)")
    ap.add_argument("--from-hf", metavar="DIR", help="import this Hugging Face Llama directory instead")
    ap.add_argument("--out", required=True, help="export: the directory to write; --from-hf: the checkpoint file")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--params", help="the export slice of the run config as JSON (what the rule passes)")
    g.add_argument("--configfile", help="a full config YAML the checkpoint must come from")
    args = ap.parse_args(argv)
    config_params = params_from_args(args, "export") if (args.params or args.configfile) else None
    if args.from_hf:
        if args.ckpt or args.tokenizer:
            ap.error("--from-hf takes no --ckpt/--tokenizer")
        import_hf(args.from_hf, args.out, config_params, args.force)
    else:
        if not (args.ckpt and args.tokenizer):
            ap.error("export needs --ckpt and --tokenizer (or --from-hf DIR to import)")
        export(args.ckpt, args.tokenizer, args.out, config_params, args.force)


if __name__ == "__main__":
    run_cli(main)
