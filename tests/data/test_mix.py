"""Mix: requested proportions are realized (globally and locally), sampling is seeded, short sources
are up-sampled within their epoch cap and fail clearly beyond it, `tokens: plan` is the plan's
trained tokens."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import ROOT

from pipeline.config import load_config
from pipeline.data import mix
from pipeline.errors import PipelineError
from pipeline.planning import token_plan as plan_module
from pipeline.rules import rule_params
from pipeline.run_config import run_config

SEQ_LEN = 64


def write_split_file(root, source: str, shard: str, table: dict) -> None:
    """One shard's split file, listed in the split report as the split stage does (the mix stage
    reads only the report's `shards`)."""
    path = root / source / f"{shard}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path)
    report = root / "report.json"
    listed = json.loads(report.read_text())["shards"] if report.exists() else {}
    listed[source] = sorted({*listed.get(source, []), shard})
    report.write_text(json.dumps({"shards": listed}))


def write_split_dir(root, layout: dict[str, dict[str, int]], seed: int = 0) -> dict:
    """Split files for {source: {shard: n_docs}} with random spans (20-400 tokens) and roughly
    80% train / 10% val / 10% dup. Returns {(source, shard): table as a dict}."""
    rng = random.Random(seed)
    out = {}
    for source, shards in layout.items():
        for shard, n in shards.items():
            t = {"doc": list(range(n)), "cluster": list(range(n)), "tokens": [rng.randint(20, 400) for _ in range(n)],
                 "split": rng.choices(["train", "val", "dup"], weights=[8, 1, 1], k=n)}
            write_split_file(root, source, shard, t)
            out[(source, shard)] = t
    return out


LAYOUT = {"fineweb": {"f0": 600, "f1": 600, "f2": 600}, "chat": {"c0": 500, "c1": 500}}


def params(weights=None, tokens=200_000, max_epochs=1.0, seed=1337) -> dict:
    m = {"weights": weights or {"fineweb": 0.3, "chat": 0.7}, "tokens": tokens, "max_epochs": max_epochs,
         "packing": "concat"}
    return {"mixes": {"m": m}, "seq_len": SEQ_LEN, "seed": seed}


def run(tmp_path, p, name="out"):
    out = tmp_path / name
    report = mix.run_mix(p, "m", tmp_path / "split", out)
    return pq.read_table(out / "train.parquet").to_pydict(), pq.read_table(out / "val.parquet").to_pydict(), report


@pytest.fixture
def split_dir(tmp_path):
    return write_split_dir(tmp_path / "split", LAYOUT)


def tokens_by_source(train: dict) -> dict:
    out: dict[str, int] = {}
    for s, t in zip(train["source"], train["tokens"]):
        out[s] = out.get(s, 0) + t
    return out


def test_proportions_and_token_target(tmp_path, split_dir):
    train, _, report = run(tmp_path, params())
    by_source = tokens_by_source(train)
    total = sum(by_source.values())
    assert abs(by_source["fineweb"] / total - 0.3) <= 0.005
    assert abs(by_source["chat"] / total - 0.7) <= 0.005
    need = mix.schedule_target(200_000, SEQ_LEN)
    assert need == -(-200_000 // SEQ_LEN) * (SEQ_LEN + 1)
    assert total >= need and total // (SEQ_LEN + 1) * SEQ_LEN >= 200_000  # concat rows supply the targets
    assert total - need < 2 * 400  # at most one crossing document per source
    for s, v in report["per_source"].items():
        assert v["scheduled_tokens"] == by_source[s] >= v["share_tokens"]
        assert v["realized_proportion"] == pytest.approx(by_source[s] / total)
    assert report["target"]["schedule_target_tokens"] == need and report["target"]["scheduled_tokens"] == total


def test_schedule_holds_train_documents_once_per_epoch(tmp_path, split_dir):
    train, _, _ = run(tmp_path, params())
    assert list(train) == ["source", "shard", "doc", "tokens", "epoch"]
    seen = set()
    for s, sh, d, t, e in zip(*train.values()):
        split = split_dir[(s, sh)]
        assert split["split"][d] == "train" and split["tokens"][d] == t
        assert (s, sh, d, e) not in seen
        seen.add((s, sh, d, e))
    assert set(train["epoch"]) == {0}


def test_interleave_keeps_proportions_locally(tmp_path, split_dir):
    train, _, _ = run(tmp_path, params())
    n = len(train["doc"])
    for lo in range(0, n - n // 5 + 1, n // 5):  # every fifth of the schedule
        window = {k: v[lo:lo + n // 5] for k, v in train.items()}
        by_source = tokens_by_source(window)
        assert abs(by_source["chat"] / sum(by_source.values()) - 0.7) < 0.03


def test_seeded_determinism(tmp_path, split_dir):
    a, _, _ = run(tmp_path, params(), name="a")
    b, _, _ = run(tmp_path, params(), name="b")
    c, _, _ = run(tmp_path, params(seed=1), name="c")
    assert a == b
    assert a["doc"] != c["doc"]


def test_up_sampling_within_cap(tmp_path, split_dir):
    train_tokens = sum(t for (s, _), tab in split_dir.items() if s == "chat"
                       for t, sp in zip(tab["tokens"], tab["split"]) if sp == "train")
    # chat's share is ~2.4 passes over its train tokens
    target = int(2.4 * train_tokens / 0.7)
    train, _, report = run(tmp_path, params(tokens=target, max_epochs=3))
    chat = report["per_source"]["chat"]
    assert chat["passes"] == 3 and 2.3 < chat["epochs_used"] <= 3
    epochs = [e for s, e in zip(train["source"], train["epoch"]) if s == "chat"]
    assert set(epochs) == {0, 1, 2}
    full_pass = {(sh, d) for s, sh, d, e in zip(train["source"], train["shard"], train["doc"], train["epoch"])
                 if s == "chat" and e == 0}
    assert sum(split_dir[("chat", sh)]["tokens"][d] for sh, d in full_pass) == train_tokens  # pass 0 is complete
    order0 = [d for s, d, e in zip(train["source"], train["doc"], train["epoch"]) if s == "chat" and e == 0]
    order1 = [d for s, d, e in zip(train["source"], train["doc"], train["epoch"]) if s == "chat" and e == 1]
    assert order0 != order1  # a new order per pass


def test_beyond_cap_fails_clearly(tmp_path, split_dir):
    with pytest.raises(PipelineError) as e:
        run(tmp_path, params(tokens=10_000_000, max_epochs=2))
    msg = str(e.value)
    for needle in ("source 'chat'", "train tokens", "max_epochs 2", "mixes.m.max_epochs", "mixes.m.weights.chat",
                   "mixes.m.tokens", "add shards"):
        assert needle in msg
    assert not (tmp_path / "out").exists()


def test_tokens_plan_is_the_plans_trained_tokens(tmp_path, split_dir):
    # The trainer consumes num_steps × tokens_per_step (>= the budget), so that is what the mix supplies:
    # 49,000 target tokens at 5,000 per step are 10 steps, 50,000 tokens.
    cfg = load_config(ROOT / "config.yaml", {"train": {"target_tokens": 49_000, "global_batch_tokens": 5_000,
                                                       "seq_len": 50, "micro_batch": 100}})
    p = rule_params(cfg, "mix", mix="pretrain")
    planned = plan_module.make_plan(run_config(cfg)).trained_tokens
    assert p["trained_tokens"] == {"pretrain": planned} == {"pretrain": 50_000}
    p = {**params(tokens="plan"), "trained_tokens": p["trained_tokens"]["pretrain"]}
    train, _, report = run(tmp_path, p)
    assert report["target"]["tokens"] == 50_000 and report["target"]["from"] == "plan"
    assert sum(train["tokens"]) >= mix.schedule_target(50_000, SEQ_LEN)
    with pytest.raises(PipelineError, match="params carry no integer 'trained_tokens'"):
        run(tmp_path, params(tokens="plan"), name="x")
    assert not (tmp_path / "x").exists()


def test_mix_params_ignore_micro_batch_and_hardware(tmp_path):
    """A micro-batch or world-size edit changes the plan but not what the mix supplies, so it reruns
    no data stage; a budget edit does change the mix's params."""
    base = load_config(ROOT / "config.yaml")
    t = base["train"]
    edits = [{"train": {"micro_batch": t["micro_batch"] // 2}}, {"hardware": {"gpu_memory_gb": 1}}]
    for edit in edits:
        assert rule_params(load_config(ROOT / "config.yaml", edit), "mix") == rule_params(base, "mix")
    budget = load_config(ROOT / "config.yaml",
                         {"train": {"target_tokens": 2 * plan_module.make_plan(run_config(base)).trained_tokens}})
    assert (rule_params(budget, "mix")["trained_tokens"]["pretrain"]
            == 2 * rule_params(base, "mix")["trained_tokens"]["pretrain"])


def test_val_holds_every_val_document(tmp_path, split_dir):
    _, val, report = run(tmp_path, params())
    expected = [(s, sh, d) for (s, sh), t in sorted(split_dir.items())
                for d, sp in zip(t["doc"], t["split"]) if sp == "val"]
    assert list(zip(val["source"], val["shard"], val["doc"])) == expected
    assert set(val["epoch"]) == {0}
    assert report["val"]["documents"] == len(expected)


def write_uniform(root, source: str, n: int, tokens: int) -> None:
    write_split_file(root, source, "s", {"doc": list(range(n)), "cluster": list(range(n)), "tokens": [tokens] * n,
                                         "split": ["train"] * n})


def test_documents_too_long_for_the_target_fail_the_proportion_check(tmp_path):
    write_uniform(tmp_path / "a", "fineweb", 700, 10)
    write_uniform(tmp_path / "a", "chat", 20, 5000)
    # chat takes 2 documents of 5,000 for its 6,093-token share; fineweb cannot top up past its 7,000 tokens
    p = params(weights={"fineweb": 0.5, "chat": 0.5}, tokens=12_000)
    with pytest.raises(PipelineError, match=r"off the requested ones by .*mixes\.m\.tokens"):
        mix.build_mix(p, "m", tmp_path / "a")
    write_uniform(tmp_path / "b", "fineweb", 100, 10)
    write_uniform(tmp_path / "b", "chat", 20, 5000)
    p["mixes"]["m"]["tokens"] = 1_500  # as lopsided, but under CHECK_MIN_DOCS documents: reported, not failed
    report = mix.build_mix(p, "m", tmp_path / "b")[2]
    assert sum(v["documents"] for v in report["per_source"].values()) < mix.CHECK_MIN_DOCS
    assert report["per_source"]["chat"]["realized_proportion"] > 0.8


def test_top_up_dilutes_a_long_crossing_document(tmp_path):
    write_uniform(tmp_path / "split", "fineweb", 1000, 1000)
    write_uniform(tmp_path / "split", "chat", 5000, 50)
    p = params(weights={"fineweb": 0.3, "chat": 0.7}, tokens=100_000)
    train, _, report = run(tmp_path, p)
    by_source = tokens_by_source(train)
    assert abs(by_source["fineweb"] / sum(by_source.values()) - 0.3) <= mix.TOLERANCE / 2
    assert by_source["chat"] >= report["per_source"]["chat"]["share_tokens"]


def test_split_files_of_shards_no_longer_configured_are_ignored(tmp_path, split_dir):
    before, _, _ = run(tmp_path, params(), name="before")
    stale = {"doc": [0], "cluster": [0], "tokens": [100_000], "split": ["train"]}  # a removed shard's file
    pq.write_table(pa.table(stale), tmp_path / "split" / "chat" / "c9.parquet")
    after, _, report = run(tmp_path, params(), name="after")
    assert after == before and "c9" not in set(after["shard"])
    assert not any("c9" in i["path"] for i in report["meta"]["inputs"])


def test_unknown_mix_and_missing_source_fail(tmp_path, split_dir):
    with pytest.raises(PipelineError, match="unknown mix 'nope'"):
        mix.build_mix(params(), "nope", tmp_path / "split")
    with pytest.raises(PipelineError, match="no split files for source 'web'"):
        mix.build_mix(params(weights={"web": 1.0}), "m", tmp_path / "split")


def test_load_source_reads_every_shard_in_order_and_names_a_bad_file(tmp_path, split_dir):
    paths = [tmp_path / "split" / "fineweb" / f"f{i}.parquet" for i in range(3)]
    pools = mix.load_source(paths, "fineweb")
    for name, pool in pools.items():  # (shard, doc) order, each document of its split once
        want = [(i, d) for i in range(3) for d, s in enumerate(split_dir[("fineweb", f"f{i}")]["split"]) if s == name]
        assert list(zip(pool.shard.tolist(), pool.doc.tolist())) == want and pool.shards == ["f0", "f1", "f2"]
        assert pool.tokens.tolist() == [split_dir[("fineweb", f"f{i}")]["tokens"][d] for i, d in want]
    pq.write_table(pa.table({"doc": [0], "tokens": [5]}), paths[1])  # no split column
    with pytest.raises(PipelineError, match=r"f1\.parquet: not a readable split file with doc, tokens, split"):
        mix.load_source(paths, "fineweb")
    paths[2].write_bytes(b"PAR1 not parquet")
    with pytest.raises(PipelineError, match=r"f1\.parquet: not a readable split file"):
        mix.load_source(paths, "fineweb")


def test_cli(tmp_path, split_dir):
    mix.main(["--params", json.dumps(params()), "--mix", "m", "--split-dir", str(tmp_path / "split"),
              "--outdir", str(tmp_path / "o")])
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["meta"]["stage"] == "mix" and report["mix"] == "m"
    assert np.isclose(sum(v["realized_proportion"] for v in report["per_source"].values()), 1.0)


def test_beyond_cap_message_shows_the_unrounded_epochs():
    # 1004 tokens of 1000 available is 1.004 epochs: over max_epochs 1.0, so it must not print as "1"
    msg = mix.short_message("m", "chat", {"max_epochs": 1.0}, available=1000, share=1004, weight_frac=1.0,
                            target=1004)
    assert "needs 1.004 epochs, over max_epochs 1.0" in msg
    msg = mix.short_message("m", "chat", {"max_epochs": 1.0}, available=10**6, share=10**6 + 3, weight_frac=1.0,
                            target=10**6 + 3)
    assert "needs 1.000003 epochs" in msg
