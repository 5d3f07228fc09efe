r"""Export a trained checkpoint as a Hugging Face ``transformers`` Llama directory, and import one back.

    python -m pipeline.evaluation.export --ckpt R/train/{stage}/final.pt --tokenizer R/tokenizer/encoding.json \
        --out R/export/hf [--params JSON | --configfile FILE] [--force]
    python -m pipeline.evaluation.export --from-hf DIR --out CKPT.pt [--params JSON | --configfile FILE] [--force]

The directory (docs/data-contract.md, "Hugging Face export") loads offline with
``LlamaForCausalLM.from_pretrained(DIR)`` / ``AutoTokenizer.from_pretrained(DIR)`` and so with lm-eval.
`export(...)` writes it, `import_hf(...)` reads one back (exact for our own exports).

Why it computes the same function as our model (weights, config.json, tokenizer) and what is refused:
docs/evaluation.md, "Hugging Face export".
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch

from pipeline.config import cut, export_slice, params_from_args, tokenizer_slice
from pipeline.data.encoding import ASSISTANT_END, BOS, CHAT_TOKENS, EOS, chat_template, load_tokenizer
from pipeline.errors import PipelineError
from pipeline.io import atomic_dir, get_logger, provenance, read_json, run_cli, write_json
from pipeline.model.checkpoint_io import load_checkpoint, save_checkpoint
from pipeline.model.model import ModelConfig, Transformer
from pipeline.model.state_dict_adapter import (
    MODEL_KEYS,
    PROVENANCE,
    WEIGHTS_INDEX,
    check_same_config,
    differences,
    hf_name,
    read_hf,
)
from pipeline.run_config import run_config

log = get_logger(__name__)

MAX_SHARD_BYTES = 5 * 10**9  # shards of at most 5 GB (transformers 5's default is 50 GB)
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
    for key, value in run_config(params).model.items():
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
    vocab = run_config(ckpt_params).model.vocab_size
    if tok.n_vocab > vocab:
        raise PipelineError(f"{tok.path} has {tok.n_vocab} token ids but {where} has model.vocab_size {vocab}: "
                            "the tokenizer is from another run; pass the tokenizer the checkpoint was trained with")
    made_with = (read_json(tok.path).get("meta") or {}).get("params")
    if made_with is None or not {"tokenizer", "sources", "seed"} <= set(ckpt_params):
        log.warning("cannot check that %s belongs to %s (one of them records no config)", tok.path, where)
        return
    diffs = differences(cut(tokenizer_slice, ckpt_params), made_with)
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
    """The LlamaConfig arguments for our ModelConfig `mcfg` (fp32 weights): config.json is
    `LlamaConfig(**this)` as transformers writes it."""
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
        "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": mcfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.special[doc_end_token(tok)],
        "dtype": "float32",
    }


def generation_config(tok) -> dict:
    """Greedy by default; stops at the end of a document or of an assistant turn."""

    return {"bos_token_id": tok.bos_id, "eos_token_id": [tok.special[doc_end_token(tok)], tok.special[ASSISTANT_END]],
            "do_sample": False}


# ----------------------------------------------------------------------------- tokenizer

def _ranks_file_and_pattern(tok) -> tuple[Path, str]:
    """(the tiktoken ranks file, split pattern) of a Tokenizer, from its spec file."""

    spec = read_json(tok.path)
    return Path(tok.path).parent / spec["ranks_file"], spec["pattern"]


# A possessive interval X{n,m}+ (tiktoken's patterns use it) means (X{n,m})+ to Oniguruma, the regex
# engine of `tokenizers`: it becomes the atomic group (?>X{n,m}), which is what possessive means.
_POSSESSIVE_INTERVAL = re.compile(r"(\\[pP]\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\()\[\]{}|])(\{\d+(?:,\d*)?\})\+")


def onig_pattern(pattern: str) -> str:
    """`pattern` (tiktoken's regex dialect) as Oniguruma reads it the same way."""
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


def hf_tokenizer(tok):
    """`tok` as a `tokenizers.Tokenizer`, by transformers' tiktoken converter (byte-level BPE: every
    two-token split of a token is a merge, ordered by the token's rank, `ignore_merges`), with the
    split pattern rewritten for Oniguruma, our special tokens at their ids (in the vocabulary too,
    since the ids of a stock encoding such as cl100k_base leave gaps that added tokens would close)
    and a post-processor that puts <|bos|> first."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        def extract_vocab_merges_from_model(self, tiktoken_url: str):
            vocab, merges = super().extract_vocab_merges_from_model(tiktoken_url)
            return {**vocab, **tok.special}, merges

    ranks_file, pattern = _ranks_file_and_pattern(tok)
    hf = Converter(vocab_file=str(ranks_file), pattern=onig_pattern(pattern),
                   extra_special_tokens=sorted(tok.special, key=tok.special.get)).converted()
    hf.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                                      special_tokens=[(BOS, tok.bos_id)])
    return hf


def tokenizer_json(tok) -> dict:
    """tokenizer.json (the `tokenizers` library's format) of `hf_tokenizer(tok)`."""
    return json.loads(hf_tokenizer(tok).to_str())


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of a PreTrainedTokenizerFast:
    <|bos|> first, no clean-up of spaces on decode, the chat template of `Tokenizer.render_chat`."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=hf_tokenizer(tok), bos_token=BOS, eos_token=doc_end_token(tok),
        extra_special_tokens=list(CHAT_TOKENS), clean_up_tokenization_spaces=False, model_max_length=max_len,
        chat_template=chat_template(),
    ).save_pretrained(out)


def check_exported_tokenizer(hf_dir: Path, tok, texts=PROBE_TEXTS) -> None:
    """The tokenizer `AutoTokenizer` loads from `hf_dir` must encode `texts` to our ids (BOS first)
    and decode them back."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    for text in texts:
        ours = [tok.bos_id] + tok.encode(text)
        theirs = hf(text, verbose=False)["input_ids"]  # (a probe may be longer than the model's window)
        if theirs != ours or hf.decode(theirs, skip_special_tokens=True) != text:
            raise PipelineError(f"{tok.path}: the exported tokenizer encodes {text!r} to {theirs[:20]}... instead of "
                                f"{ours[:20]}...; this tokenizer cannot be exported exactly (please report it)")


# ----------------------------------------------------------------------------- weights

def save_model(hf_state: dict[str, torch.Tensor], config: dict, gen_config: dict, out: Path,
               max_shard_bytes: int) -> list[str]:
    """config.json, generation_config.json and the weights (model.safetensors, or shards of at most
    `max_shard_bytes` with model.safetensors.index.json) by `LlamaForCausalLM.save_pretrained`, of a
    model built on the meta device and given our tensors (no copy). Returns the weight files."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    missing, unexpected = model.load_state_dict(hf_state, strict=False, assign=True)
    if llama.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:  # NAME_MAP and the config disagree with transformers' model
        raise PipelineError(f"the weights do not fit transformers' LlamaForCausalLM (missing {missing}, unexpected "
                            f"{unexpected}); pipeline/model/state_dict_adapter.py NAME_MAP is out of date")
    model.generation_config = GenerationConfig(**gen_config)
    model.save_pretrained(out, max_shard_size=max_shard_bytes)
    return sorted(p.name for p in out.iterdir() if p.name == WEIGHTS_INDEX or p.suffix == ".safetensors")


# ----------------------------------------------------------------------------- directories

def _claim(out: Path, force: bool) -> None:
    """Refuse an existing non-empty target unless `force`."""
    if out.exists() and not force and (out.is_file() or any(out.iterdir())):
        raise PipelineError(f"{out} exists; choose another --out or pass --force to replace it")


# ----------------------------------------------------------------------------- export

def export(ckpt_path: str | os.PathLike, tokenizer_path: str | os.PathLike, out: str | os.PathLike,
           config_params: dict | None = None, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the checkpoint `ckpt_path` (final.pt format) and its tokenizer as a transformers Llama
    directory `out` (docs/evaluation.md, "Hugging Face export"). `config_params`: the `export` slice of the config the
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
    hf_state = {hf_name(k): v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    with atomic_dir(out, replace=True) as tmp:  # _claim refused an existing target unless force
        save_tokenizer(tok, tmp, mcfg.max_seq_len)
        check_exported_tokenizer(tmp, tok)  # a failed check leaves nothing: atomic_dir removes tmp
        files = save_model(hf_state, hf_config(mcfg, tok), generation_config(tok), tmp, max_shard_bytes)
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
    ap.add_argument("--tokenizer", help="its tokenizer (R/tokenizer/encoding.json)")
    ap.add_argument("--from-hf", metavar="DIR", help="import this Hugging Face Llama directory instead")
    ap.add_argument("--out", required=True, help="export: the directory to write; --from-hf: the checkpoint file")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--params", help="the export slice of the run config as JSON (what the rule passes)")
    g.add_argument("--configfile", help="a full config YAML the checkpoint must come from")
    args = ap.parse_args(argv)
    config_params = params_from_args(args, export_slice) if (args.params or args.configfile) else None
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
