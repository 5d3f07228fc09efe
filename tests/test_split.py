"""Split: clusters never straddle train/val, val sizes hit their targets, results are deterministic,
held-out shards pull their clusters into val, and real planted duplicates never leak."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_dedup import add_shard, make_config, run_dedup, write_token_index

from pipeline import split
from pipeline.config import stage_params
from pipeline.io import PipelineError


def write_keep(path, cluster: list[int], keep: list[bool]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    reason = ["keep" if k else "near" for k in keep]
    pq.write_table(pa.table({"doc": np.arange(len(keep), dtype=np.int64), "cluster": np.asarray(cluster, np.int64),
                             "keep": keep, "reason": reason}), path)


def synthetic_run(root, seed: int = 0, shards: dict | None = None) -> tuple[list, list]:
    """Keep lists + token indexes for sources/shards; ~10% of documents are duplicates of a document
    in another shard (cluster = the keeper's key). Returns (keep paths, token paths)."""
    rng = random.Random(seed)
    shards = shards or {"web": ["s0", "s1", "s2"], "chat": ["c0", "c1"]}
    layout = {(s, sh): rng.randint(150, 250) for s, names in shards.items() for sh in names}
    keys = {name: [(i << 32) | d for d in range(n)] for i, (name, n) in enumerate(layout.items())}
    cluster = {k: list(v) for k, v in keys.items()}
    keep = {k: [True] * n for k, n in layout.items()}
    names = list(layout)
    for _ in range(sum(layout.values()) // 10):
        a, b = rng.sample(names, 2)
        i, j = rng.randrange(layout[a]), rng.randrange(layout[b])
        if keep[b][j] and cluster[b][j] == keys[b][j] and cluster[a][i] == keys[a][i] and keep[a][i]:
            cluster[b][j], keep[b][j] = keys[a][i], False  # b's doc duplicates a's keeper
    keep_paths, token_paths = [], []
    for (s, sh), n in layout.items():
        kp, tp = root / "keep" / s / f"{sh}.parquet", root / "tokens" / s / f"{sh}.json"
        write_keep(kp, cluster[(s, sh)], keep[(s, sh)])
        write_token_index(tp, list(range(n)), [rng.randint(20, 600) for _ in range(n)], s, sh)
        keep_paths.append(kp)
        token_paths.append(tp)
    return keep_paths, token_paths


def params(method="hash", val_tokens=20_000, val_shards=None, seed=1337) -> dict:
    return {"split": {"method": method, "val_tokens": val_tokens, "val_shards": val_shards or {}}, "seed": seed}


def read_all(outdir) -> dict:
    out = {}
    for p in sorted(outdir.glob("*/*.parquet")):
        out[(p.parent.name, p.stem)] = pq.read_table(p).to_pydict()
    return out


def sides_per_cluster(tables: dict) -> dict:
    sides: dict[int, set] = {}
    for t in tables.values():
        for c, s in zip(t["cluster"], t["split"]):
            if s != "dup":
                sides.setdefault(c, set()).add(s)
    return sides


def test_hash_split_no_cluster_on_both_sides_and_dups_follow_dedup(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    report = split.run_split(params(), keep_paths, token_paths, tmp_path / "split", tmp_path / "split" / "report.json")
    tables = read_all(tmp_path / "split")
    assert all(len(s) == 1 for s in sides_per_cluster(tables).values())
    assert report["leak_check"]["clusters_on_both_sides"] == 0
    assert report["shards"] == {s: sorted(sh for src, sh in tables if src == s) for s, _ in tables}
    for kp in keep_paths:
        k = pq.read_table(kp).to_pydict()
        t = tables[(kp.parent.name, kp.stem)]
        assert t["doc"] == k["doc"] and t["cluster"] == k["cluster"]
        assert [s == "dup" for s in t["split"]] == [not x for x in k["keep"]]
        spans = np.diff(np.load(kp.parents[2] / "tokens" / kp.parent.name / f"{kp.stem}.idx.npy"))
        assert t["tokens"] == spans.tolist()


def test_hash_split_val_close_to_target_per_source(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    report = split.run_split(params(val_tokens=20_000), keep_paths, token_paths, tmp_path / "o", tmp_path / "r.json")
    tables = read_all(tmp_path / "o")
    for source in ("web", "chat"):
        val = sum(tok for (s, _), t in tables.items() if s == source
                  for tok, sp in zip(t["tokens"], t["split"]) if sp == "val")
        assert val == report["per_source"][source]["val"]["tokens"]
        assert abs(val - 20_000) <= 300  # within half of the longest document (600 tokens)
        assert report["per_source"][source]["val_target"]["target_tokens"] == 20_000


def test_val_never_takes_more_than_half_a_source(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path, shards={"web": ["s0"], "tiny": ["t0"]})
    report = split.run_split(params(val_tokens=10**9), keep_paths, token_paths, tmp_path / "o", tmp_path / "r.json")
    for s in ("web", "tiny"):
        per = report["per_source"][s]
        assert 0 < per["val"]["tokens"] <= (per["val"]["tokens"] + per["train"]["tokens"]) // 2
        assert per["val"]["tokens"] >= (per["val"]["tokens"] + per["train"]["tokens"]) // 2 - 600


def test_val_prefix_rule():
    cum = np.array([10, 20, 30, 100])
    assert split.val_prefix(cum, 24, cap=1000) == 2  # 20 is closer to 24 than 30
    assert split.val_prefix(cum, 26, cap=1000) == 3
    assert split.val_prefix(cum, 26, cap=29) == 2  # 30 would exceed the cap
    assert split.val_prefix(cum, 5, cap=1000) == 0
    assert split.val_prefix(cum, 10**6, cap=10**6) == 4


def test_split_is_deterministic_and_seeded(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    split.run_split(params(), keep_paths, token_paths, tmp_path / "a", tmp_path / "a" / "r.json")
    split.run_split(params(), keep_paths[::-1], token_paths[::-1], tmp_path / "b", tmp_path / "b" / "r.json")
    split.run_split(params(seed=7), keep_paths, token_paths, tmp_path / "c", tmp_path / "c" / "r.json")
    a, b, c = (read_all(tmp_path / x) for x in "abc")
    assert a == b
    assert [t["split"] for t in a.values()] != [t["split"] for t in c.values()]


def test_shards_method_pulls_clusters_into_val(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    p = params("shards", val_shards={"web": ["s2"]})
    report = split.run_split(p, keep_paths, token_paths, tmp_path / "o", tmp_path / "o" / "r.json")
    tables = read_all(tmp_path / "o")
    held = tables[("web", "s2")]
    assert all(s in ("val", "dup") for s in held["split"])
    val_clusters = set(held["cluster"])
    pulled = 0
    for name, t in tables.items():
        for c, s in zip(t["cluster"], t["split"]):
            if s != "dup":
                assert (s == "val") == (c in val_clusters)
                pulled += name != ("web", "s2") and s == "val"
    assert pulled > 0  # keepers in other shards whose duplicates lie in the held-out shard
    chat_val = sum(s == "val" for (src, _), t in tables.items() if src == "chat" for s in t["split"])
    assert report["per_source"]["chat"]["val"]["documents"] == chat_val  # only keepers pulled in by web/s2
    assert report["leak_check"]["clusters_on_both_sides"] == 0


def test_unknown_val_shard_fails(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    with pytest.raises(PipelineError, match="web/nope"):
        split.run_split(params("shards", val_shards={"web": ["nope"]}), keep_paths, token_paths, tmp_path / "o",
                        tmp_path / "r.json")


def test_inconsistent_inputs_fail_without_output(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    with pytest.raises(PipelineError, match="differ for web/s0"):
        split.run_split(params(), keep_paths[1:], token_paths, tmp_path / "o", tmp_path / "o" / "r.json")
    write_keep(keep_paths[0], [1, 2], [True, True])  # fewer documents than the tokenized shard
    with pytest.raises(PipelineError, match="rerun the dedup stage"):
        split.run_split(params(), keep_paths, token_paths, tmp_path / "o", tmp_path / "o" / "r.json")
    assert not (tmp_path / "o").exists()


def test_planted_cross_shard_duplicates_never_leak(tmp_path):
    """Real dedup on documents copied across shards and sources, then both split methods."""
    rng = random.Random(3)
    vocab = [f"v{i}" for i in range(20_000)]
    base = [" ".join(rng.choice(vocab) for _ in range(rng.randint(60, 120))) for _ in range(200)]
    copies = [base[i].upper() if i % 2 else base[i] + " extra" for i in range(0, 200, 3)]
    shards = [add_shard(tmp_path, "web", "a", base[:100]), add_shard(tmp_path, "web", "b", base[100:] + copies[:30]),
              add_shard(tmp_path, "chat", "c", copies[30:], chat=True)]
    keep, _ = run_dedup(tmp_path, shards, make_config())
    keep_paths = sorted((tmp_path / "dedup" / "keep").glob("*/*.parquet"))
    token_paths = sorted((tmp_path / "tokens").glob("*/*.json"))
    assert sum(not k for t in keep.values() for k in t["keep"]) == len(copies)
    for i, p in enumerate([params(val_tokens=2_000), params("shards", val_shards={"web": ["b"]})]):
        out = tmp_path / f"split{i}"
        report = split.run_split(p, keep_paths, token_paths, out, out / "report.json")
        tables = read_all(out)
        assert all(len(s) == 1 for s in sides_per_cluster(tables).values())
        assert report["leak_check"]["clusters_on_both_sides"] == 0
        assert report["total"]["dup"]["documents"] == len(copies)
        assert report["total"]["val"]["documents"] > 0
        # by content: of each planted original and its copy exactly one is trained or validated on
        side = {(s, sh, d): x for (s, sh), t in tables.items() for d, x in zip(t["doc"], t["split"])}
        for j in range(len(copies)):
            i = 3 * j
            original = ("web", "a", i) if i < 100 else ("web", "b", i - 100)
            copy = ("web", "b", 100 + j) if j < 30 else ("chat", "c", j - 30)
            assert sorted([side[original], side[copy]]) in (["dup", "train"], ["dup", "val"]), (j, original, copy)


def test_cli(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    split.main(["--params", json.dumps(params()), "--keep", *map(str, keep_paths), "--tokens", *map(str, token_paths),
                "--outdir", str(tmp_path / "o"), "--report", str(tmp_path / "o" / "report.json")])
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["meta"]["stage"] == "split" and set(report["per_source"]) == {"web", "chat"}
    assert pq.read_schema(tmp_path / "o" / "web" / "s0.parquet").names == ["doc", "cluster", "tokens", "split"]


def test_stage_params_slice():
    p = stage_params(make_config(), "split")
    assert set(p) == {"split", "seed"} and p["split"]["method"] == "hash"
