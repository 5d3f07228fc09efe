"""pipeline.evaluation.core_benchmark: the CORE-style scorer.

Oracles: a bigram "model" whose log-probabilities are written by hand (the micro example), the model's
own full-logits forward pass (batching, padding, position selection, truncation), and the scorer run
single-process (the 2-process torchrun run must give the same table).
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.data.eval_data import build_eval_data
from pipeline.errors import PipelineError
from pipeline.evaluation import core_benchmark as core
from pipeline.run_config import run_config

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the hand-computed micro example

class CharTokenizer:
    """Greedy longest match over a tiny vocabulary; id 0 is BOS."""

    def __init__(self, vocab):
        self.vocab = ["<bos>"] + list(vocab)
        self.bos_id = 0

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            tok = max((t for t in self.vocab[1:] if text.startswith(t, i)), key=len)
            ids.append(self.vocab.index(tok))
            i += len(tok)
        return ids


class Bigram(torch.nn.Module):
    """p(next | previous) from a table: hidden = one-hot of the input token, the head = log p."""

    def __init__(self, probs: dict, vocab: list[str], max_seq_len=64):
        super().__init__()
        V = len(vocab)
        logp = torch.full((V, V), 0.0)
        for prev, row in probs.items():
            rest = (1.0 - sum(row.values())) / (V - len(row))
            for j, tok in enumerate(vocab):
                logp[vocab.index(prev), j] = math.log(row.get(tok, rest))
        self.head = torch.nn.Parameter(logp.T.contiguous())  # logits[j] = head[j, prev] = log p(j | prev)
        self.cfg = type("Cfg", (), {"max_seq_len": max_seq_len})()

    @property
    def lm_head_weight(self):
        return self.head

    def hidden(self, idx):
        return F.one_hot(idx, self.head.shape[1]).float()


VOCAB = ["a", "b", " c", " d", "e", " "]
TABLE = {  # every row not listed spreads its remaining mass evenly
    "<bos>": {"a": 0.5, "b": 0.3},
    "a": {"b": 0.5, " c": 0.1},
    "b": {" c": 0.25, " d": 0.5},
    " d": {"e": 0.25},
}


def micro_tasks():
    mc = {"task": "mc", "type": "multiple_choice", "shots": 0, "random_baseline": 0.5, "pool": [],
          "items": [{"id": "0", "contexts": ["ab"], "continuations": [" c", " de"], "gold": 1, "text": ""}]}
    schema = {"task": "schema", "type": "schema", "shots": 0, "random_baseline": 0.5, "pool": [],
              "items": [{"id": "0", "contexts": ["a", "b"], "continuations": [" c"], "gold": 1, "text": ""}]}
    lm = {"task": "lm", "type": "language_modeling", "shots": 0, "random_baseline": 0.0, "pool": [],
          "items": [{"id": "0", "contexts": ["a"], "continuations": ["b"], "gold": 0, "text": ""},
                    {"id": "1", "contexts": ["ab"], "continuations": [" c"], "gold": 0, "text": ""}]}
    return {"mc": mc, "schema": schema, "lm": lm}


def test_micro_example_by_hand():
    tok, model = CharTokenizer(VOCAB), Bigram(TABLE, ["<bos>"] + VOCAB)
    pairs = [core.encode_pair(tok, "ab", " c"), core.encode_pair(tok, "ab", " de")]
    assert pairs == [([0, 1, 2], [3]), ([0, 1, 2], [4, 5])]
    s = core.score_requests(model, pairs, 64, 1000, torch.device("cpu"))
    # " c" after b: 0.25.  " d" after b, then e after " d": 0.5 × 0.25.
    assert s[0].logprob == pytest.approx(math.log(0.25), abs=1e-6) and s[0].n_tokens == 1
    assert s[1].logprob == pytest.approx(math.log(0.5) + math.log(0.25), abs=1e-6) and s[1].n_tokens == 2
    # by summed log-likelihood " c" would win (-1.386 > -2.079); by mean per-token loss " de" does (-1.040)
    assert core.item_correct("multiple_choice", 1, s)
    # " c" is not the argmax after b (" d" is, 0.5); " d" then e (0.25 vs 0.125 for the rest) are
    assert not s[0].greedy and s[1].greedy
    result = core.evaluate_tasks(model, tok, micro_tasks(), seed=0, batch_tokens=1000)
    t = result["tasks"]
    assert t["mc"]["accuracy"] == 1.0 and t["mc"]["centered"] == 1.0
    # schema: " c" after a is 0.1, after b 0.25 -> the gold context b wins
    assert t["schema"]["accuracy"] == 1.0
    # lm: b is the argmax after a (0.5) -> correct; " c" after b is not the argmax -> wrong
    assert t["lm"]["accuracy"] == 0.5 and t["lm"]["centered"] == 0.5
    assert result["score_name"] == "core_3" and result["score"] == pytest.approx((1.0 + 1.0 + 0.5) / 3)
    assert result["items"] == 4 and t["mc"]["requests"] == 2 and t["lm"]["truncated"] == 0
    # the report says which tasks and which baseline table the score is over
    assert result["baselines"] == "dclm-v2"
    assert "Tasks (3): mc, schema, lm; random baselines: dclm-v2" in core.markdown_table(result)


def test_clean_subset_leaves_out_the_seen_items_and_says_what_was_not_checked():
    """`seen` marks lm's item 1 (the wrong one) contaminated: lm's clean accuracy is item 0's alone; a task
    `seen` does not name is "not checked" (None, never clean) and then there is no clean aggregate."""
    tok, model = CharTokenizer(VOCAB), Bigram(TABLE, ["<bos>"] + VOCAB)
    r = core.evaluate_tasks(model, tok, micro_tasks(), seed=0, batch_tokens=1000, seen={"lm": {"1"}, "mc": set()})
    t = r["tasks"]
    assert (t["lm"]["contaminated"], t["lm"]["clean_items"], t["lm"]["clean_accuracy"]) == (1, 1, 1.0)
    assert t["lm"]["clean_centered"] == 1.0 and t["lm"]["clean_centered_ci"] == [1.0, 1.0]
    assert t["mc"]["contaminated"] == 0 and t["mc"]["clean_accuracy"] == t["mc"]["accuracy"]
    assert t["schema"]["contaminated"] is None and t["schema"]["clean_accuracy"] is None
    assert r["clean_score"] is None and r["clean_score_ci"] is None
    assert [(i["task"], i["id"], i["contaminated"]) for i in r["item_log"]] == [
        ("mc", "0", False), ("schema", "0", None), ("lm", "0", False), ("lm", "1", True)]
    md = core.markdown_table(r)
    assert "| 1 | 1.0000 [1.000, 1.000] | +1.0000 [+1.000, +1.000] |" in md
    assert "| not checked | – | – |" in md and "not checked for schema" in md
    every = core.evaluate_tasks(model, tok, micro_tasks(), seed=0, batch_tokens=1000,
                                seen={"lm": {"1"}, "mc": set(), "schema": {"0"}})
    # schema's only item is seen: no clean item left, so the clean mean is over mc and lm
    assert every["tasks"]["schema"]["clean_items"] == 0 and every["tasks"]["schema"]["clean_accuracy"] is None
    assert every["clean_score"] == 1.0 and every["score"] == pytest.approx(2.5 / 3)
    assert "(2 scored items share a decontamination n-gram" in core.markdown_table(every)
    unchecked = core.evaluate_tasks(model, tok, micro_tasks(), seed=0, batch_tokens=1000)
    assert all(i["contaminated"] is None for i in unchecked["item_log"]) and unchecked["clean_score"] is None


def test_boundary_whitespace_moves_to_the_continuation():
    tok = CharTokenizer(VOCAB)
    # "ab " + "c": the context's trailing space joins the continuation, so " c" stays one token
    assert core.split_boundary("ab ", "c") == ("ab", " c")
    assert core.encode_pair(tok, "ab ", "c") == ([0, 1, 2], [3])
    assert core.split_boundary("ab\n\n", "x") == ("ab", "\n\nx")


def test_centered_accuracy():
    assert core.centered(0.25, 0.25) == 0.0 and core.centered(1.0, 0.62) == 1.0
    assert core.centered(0.81, 0.62) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- a real (tiny) model and tokenizer

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from builders import write_text_shard

    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.train_tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    words = "the a man woman cat dog sees likes water flowed from spout because therefore he she it".split()
    docs = [" ".join(rng.choice(words) for _ in range(60)) + "." for _ in range(300)]
    shard = write_text_shard(d / "web" / "s.parquet", docs)
    build_tokenizer({"tokenizer": {"kind": "bpe", "vocab_size": 300, "train_chars": 20_000, "max_doc_chars": 2000,
                                   "delimiter": "bos"},
                     "sources": {"web": {"type": "local", "format": "text", "text_column": "text", "min_chars": 0}},
                     "seed": 0}, [str(shard)], d / "encoding.json")
    return load_tokenizer(d / "encoding.json")


def tiny_model(max_seq_len=64, seed=0):
    from pipeline.model.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=max_seq_len)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_data")
    build_eval_data({"tasks": ["copa", "winogrande", "lambada"], "pool_size": 20, "seed": 1}, out)
    return out


@torch.no_grad()
def reference(model, pairs, max_len):
    """Per request: the sum of the continuation's log-probs from the full-logits forward of the
    left-truncated ids, one request at a time (no batching, padding or position selection)."""
    out = []
    for ctx, cont in pairs:
        ids = (ctx + cont)[-(max_len + 1):]
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0], dim=-1)
        tgt = torch.tensor(ids[1:])
        lp = logp[torch.arange(len(tgt)), tgt][-len(cont):]
        out.append((float(lp.sum()), bool((logp.argmax(-1) == tgt)[-len(cont):].all())))
    return out


def test_encode_pair_splits_the_whole_string(tokenizer):
    ctx, cont = core.encode_pair(tokenizer, "the man sees ", "the water")
    assert ctx[0] == tokenizer.bos_id
    assert ctx[1:] + cont == tokenizer.encode("the man sees the water")
    assert tokenizer.decode(cont) == " the water"


def test_batched_scores_equal_the_full_forward_and_truncation_is_counted(tokenizer):
    model = tiny_model(max_seq_len=24)
    rng = random.Random(1)
    words = "the a man cat sees water because he".split()
    pairs = [core.encode_pair(tokenizer, " ".join(rng.choice(words) for _ in range(rng.randint(1, 30))),
                              " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
             for _ in range(40)]
    ref = reference(model, pairs, 24)
    for batch_tokens in (1, 50, 10_000):  # one request per batch, a few, all at once
        got = core.score_requests(model, pairs, 24, batch_tokens, torch.device("cpu"))
        for g, (lp, greedy), (c, x) in zip(got, ref, pairs):
            assert g.logprob == pytest.approx(lp, abs=1e-4) and g.greedy == greedy and g.n_tokens == len(x)
            assert g.truncated == (len(c) + len(x) > 25)
    assert any(g.truncated for g in got) and not all(g.truncated for g in got)


def test_continuation_longer_than_the_window_is_scored_on_its_last_tokens():
    model = tiny_model()
    [s] = core.score_requests(model, [([0, 1], [5, 6, 7, 8, 9])], 4, 100, torch.device("cpu"))
    logp = torch.log_softmax(model(torch.tensor([[5, 6, 7, 8]]))[0], dim=-1).detach()
    assert s.truncated and s.n_tokens == 4
    assert s.logprob == pytest.approx(float(sum(logp[i, t] for i, t in enumerate([6, 7, 8, 9]))), abs=1e-5)
    with pytest.raises(PipelineError, match="encodes to no token"):
        core.score_requests(model, [([0, 1], [])], 4, 100, torch.device("cpu"))


def test_fewshot_examples_are_seeded_from_the_pool_and_never_the_item(tasks_dir):
    tasks = core.load_tasks(tasks_dir, ["copa"])
    copa = tasks["copa"]
    item = copa["items"][0]
    a = core.fewshot_prefix(copa, item, 3, seed=5)
    assert a == core.fewshot_prefix(copa, item, 3, seed=5) != core.fewshot_prefix(copa, item, 3, seed=6)
    shots = a.split(core.FEWSHOT_SEPARATOR)[:-1]
    pool_examples = {core.gold_example(ex, "multiple_choice") for ex in copa["pool"]}
    assert len(shots) == 3 and set(shots) <= pool_examples
    assert core.gold_example(item, "multiple_choice") not in shots
    reqs = core.item_requests(copa, item, 3, seed=5)
    assert [r[0] for r in reqs] == [a + item["contexts"][0]] * 2 and [r[1] for r in reqs] == item["continuations"]
    with pytest.raises(PipelineError, match="copa.*50 shots.*pool has 10"):
        core.fewshot_prefix(copa, item, 50, seed=5)


def test_suite_on_real_tasks_fits_the_shots_and_never_truncates(tokenizer, tasks_dir):
    """Issue 20 item 4: per task the largest k <= the asked shots that fits FIT_FRACTION of its items,
    items that do not fit take fewer shots or (not even alone) are left out; no request is truncated."""
    tasks = core.load_tasks(tasks_dir, ["copa", "winogrande", "lambada"])
    model = tiny_model(max_seq_len=384)
    r = core.evaluate_tasks(model, tokenizer, tasks, seed=0, batch_tokens=512, shots=4, max_items=12)
    assert r["score_name"] == "core_3"
    for name, t in r["tasks"].items():
        assert t["truncated"] == 0 and t["shots_asked"] == 4
        assert t["items"] + t["too_long"] == 12
        # the table's k is the rule's, recomputed here from each item's own fit
        fits = [core.item_fit(tokenizer, tasks[name], it, 4, 0, 384)[0] for it in tasks[name]["items"][:12]]
        k = max([j for j in range(5) if sum(f >= j for f in fits) >= math.ceil(0.9 * 12)], default=0)
        assert t["shots"] == k and t["fewer_shots"] == sum(0 <= f < k for f in fits)
        assert t["too_long"] == sum(f < 0 for f in fits)
        assert t["centered"] == pytest.approx((t["accuracy"] - t["random_baseline"]) / (1 - t["random_baseline"]))
    # at this window copa keeps its 4 shots, winogrande takes fewer, some LAMBADA passages fit not even alone
    t = r["tasks"]
    assert t["copa"]["shots"] == 4 and t["winogrande"]["shots"] < 4 and t["lambada"]["too_long"] > 0
    assert r["tasks"]["copa"]["requests"] == 24
    assert r["score"] == pytest.approx(sum(t["centered"] for t in r["tasks"].values()) / 3)
    assert "| copa | multiple_choice | 4 (4) | 12 |" in core.markdown_table(r)
    with pytest.raises(PipelineError, match="task 'hellaswag'.*does not exist.*eval_data"):
        core.load_tasks(tasks_dir, ["hellaswag"])
    # a window that no LAMBADA item fits: the task is reported, not scored, and left out of the mean
    two = {"copa": tasks["copa"], "lambada": tasks["lambada"]}
    small = core.evaluate_tasks(tiny_model(max_seq_len=16), tokenizer, two, seed=0, batch_tokens=512, shots=0,
                                max_items=3)
    lam = small["tasks"]["lambada"]
    assert lam["items"] == 0 and lam["too_long"] == 3 and lam["accuracy"] is None and lam["centered"] is None
    if small["tasks"]["copa"]["items"]:
        assert small["score_name"] == "core_1" and small["score"] == small["tasks"]["copa"]["centered"]
    else:
        assert small["score_name"] == "core_0" and small["score"] is None and core.core_record(small) == {}
    assert "| lambada | language_modeling | 0 (0) | 0 | – |" in core.markdown_table(small)


def test_item_fit_is_the_most_shots_that_fit(tokenizer, tasks_dir):
    copa = core.load_tasks(tasks_dir, ["copa"])["copa"]
    item = copa["items"][0]
    lengths = [max(len(c) + len(x) for c, x in (core.encode_pair(tokenizer, *r)
                                                for r in core.item_requests(copa, item, j, 0, 6))) for j in range(7)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[6]
    for max_len in (lengths[0] - 2, lengths[0] - 1, lengths[3] - 1, lengths[3] + 5, lengths[6] - 1, 10_000):
        j, reqs = core.item_fit(tokenizer, copa, item, 6, 0, max_len)
        want = max([j for j in range(7) if lengths[j] <= max_len + 1], default=-1)
        assert j == want
        assert (reqs is None) == (want < 0)
    # fewer shots are the first ones of the same draw
    assert core.fewshot_prefix(copa, item, 6, 0).startswith(core.fewshot_prefix(copa, item, 2, 0, k_max=6))


def test_task_k_rule():
    assert core.task_k([10] * 9 + [-1], 10) == 10  # 90 % fit with all shots
    assert core.task_k([10] * 8 + [3, 3], 10) == 3
    assert core.task_k([5, 5, 5, 5, 5, 5, 5, 5, 5, 2], 3) == 3  # never more than asked
    assert core.task_k([-1] * 5 + [10] * 5, 10) == 0


def test_a_corrupted_task_file_is_refused(tasks_dir, tmp_path):
    import shutil

    copy = tmp_path / "eval_data"
    shutil.copytree(tasks_dir, copy)
    text = (copy / "copa.json").read_text()
    (copy / "copa.json").write_text(text.replace('"gold": 0', '"gold": 1', 1))
    with pytest.raises(PipelineError, match=r"task 'copa'.*copa.json is corrupted.*rerun the eval_data rule"):
        core.load_tasks(copy, ["copa"])


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_table(tokenizer, tasks_dir, tmp_path):
    model = tiny_model(max_seq_len=384)
    params = {"seed": 3, "hardware": {"device": "cpu", "process_group_timeout_min": 60},
              "train": {"micro_batch": 4, "seq_len": 384, "ce_chunk_tokens": 8192},
              "eval": {"tasks": ["copa", "winogrande", "lambada"], "core_shots": 1, "core_max_items": 7,
                       "core_batch_tokens": 256}}
    torch.save({"model": model.state_dict(), "params": {
        "model": {"vocab_size": 320, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64,
                  "rope_theta": 10000, "norm_eps": 1e-5, "tie_embeddings": True},
        "train": {"seq_len": 384}}}, tmp_path / "final.pt")
    single = core.evaluate_tasks(model, tokenizer, core.load_tasks(tasks_dir, params["eval"]["tasks"]),
                                 **core.core_settings(params))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "pipeline.evaluation.core_benchmark", "--params", json.dumps(params), "--ckpt", str(tmp_path / "final.pt"),
           "--tokenizer", tokenizer.path, "--tasks-dir", str(tasks_dir), "--out", str(tmp_path / "core.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ddp = json.loads((tmp_path / "core.json").read_text())
    assert ddp["world_size"] == 2 and ddp["items"] == single["items"]
    assert single["items"] + sum(t["too_long"] for t in single["tasks"].values()) == 21
    for name, t in single["tasks"].items():
        for key in ("accuracy", "centered", "items", "requests", "truncated", "shots", "fewer_shots", "too_long"):
            assert ddp["tasks"][name][key] == pytest.approx(t[key]), (name, key)
    assert ddp["score"] == pytest.approx(single["score"])


def test_batch_tokens_default_is_bounded_by_memory_not_the_training_batch():
    """Issue 18 item 1. null was micro_batch × seq_len (131,072 tokens on the preset, scored in fp32: an
    OOM on an 80 GB H100 beside the training state). Now: the most tokens whose predicted scoring peak
    (pipeline.planning.memory.eval_memory, in the loop) fits the configured GPU; independent of the micro-batch."""
    from pipeline.config import load_config
    from pipeline.planning.memory import StepSetup, capacity_gb, eval_memory

    cfg = load_config(ROOT / "configs/llama3-1b-fineweb.yaml")
    settings = core.core_settings(cfg)
    assert settings["max_items"] is None and settings["head_chunk"] == cfg["train"]["ce_chunk_tokens"]
    n = settings["batch_tokens"]
    s = StepSetup.from_config(run_config(cfg))
    assert n % 2048 == 0 and eval_memory(s, n, in_loop=True)["total"] <= capacity_gb(80, "cuda")
    other_batch = {**cfg, "train": {**cfg["train"], "micro_batch": 4}}
    assert core.core_settings(other_batch)["batch_tokens"] == n  # not the training micro-batch
    # (a 24 GB card no longer holds the training state, the CUDA context and NCCL's buffers: 26.9 GB at 2048)
    small_gpu = {**cfg, "hardware": {**cfg["hardware"], "gpu_memory_gb": 32}}
    n_small = core.core_settings(small_gpu)["batch_tokens"]
    assert 2048 <= n_small < n
    assert eval_memory(s, n_small, in_loop=True)["total"] <= capacity_gb(32, "cuda") < \
        eval_memory(s, n_small + 2048, in_loop=True)["total"]
    assert core.core_settings(cfg, "core_interval_items")["max_items"] == cfg["eval"]["core_interval_items"]
    explicit = {**cfg, "eval": {**cfg["eval"], "core_batch_tokens": 512}}
    assert core.core_settings(explicit)["batch_tokens"] == 512


def test_scoring_dtype_is_bf16_on_cuda_only():
    assert core.scoring_dtype(torch.device("cuda", 0)) is torch.bfloat16
    assert core.scoring_dtype(torch.device("cpu")) is None


def test_cuda_scoring_runs_the_body_under_bf16_autocast_with_fp32_logits(tokenizer, tasks_dir, monkeypatch):
    """The CUDA branch forced on CPU (CPU autocast has bf16 too): before, evaluate_tasks called
    model.hidden without autocast — fp32 on CUDA, where GQA attention only has the math kernel."""
    model = tiny_model(max_seq_len=384)
    seen = []
    real_hidden, real_linear = model.hidden, F.linear

    def spy_hidden(x, *a):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_hidden(x, *a)

    heads = []

    def spy_linear(x, w, *a):
        out = real_linear(x, w, *a)
        if w.shape == model.lm_head_weight.shape:  # the LM head, not the body's linears
            heads.append(out.dtype)
        return out

    tasks = core.load_tasks(tasks_dir, ["copa", "lambada"])
    fp32 = core.evaluate_tasks(model, tokenizer, tasks, seed=0, batch_tokens=256, shots=1, max_items=5)
    monkeypatch.setattr(model, "hidden", spy_hidden)
    monkeypatch.setattr(core, "scoring_dtype", lambda device: torch.bfloat16)
    monkeypatch.setattr(core.F, "linear", spy_linear)
    bf16 = core.evaluate_tasks(model, tokenizer, tasks, seed=0, batch_tokens=256, shots=1, max_items=5)
    assert seen and all(s == (True, torch.bfloat16) for s in seen)
    assert heads and all(d == torch.float32 for d in heads)  # the LM head (outside autocast) is fp32
    assert bf16["items"] == fp32["items"] and abs(bf16["score"] - fp32["score"]) <= 0.5  # same table, bf16 noise


def test_lm_head_chunks_give_the_same_scores(tokenizer):
    """The LM head takes head_chunk continuation positions at a time: one [chunk, vocab] fp32 logits
    tensor per step instead of one per batch; the scores do not depend on the chunk."""
    model = tiny_model(max_seq_len=24)
    rng = random.Random(2)
    words = "the a man cat sees water because he".split()
    pairs = [core.encode_pair(tokenizer, " ".join(rng.choice(words) for _ in range(rng.randint(1, 20))),
                              " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
             for _ in range(30)]
    whole = core.score_requests(model, pairs, 24, 10_000, torch.device("cpu"), head_chunk=10_000)
    for chunk in (1, 7):
        got = core.score_requests(model, pairs, 24, 10_000, torch.device("cpu"), head_chunk=chunk)
        assert [(g.n_tokens, g.greedy) for g in got] == [(w.n_tokens, w.greedy) for w in whole]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in whole], abs=1e-5)
