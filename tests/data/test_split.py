"""Split: clusters never straddle train/val, val sizes hit their targets, results are deterministic,
held-out shards pull their clusters into val, and real planted duplicates never leak."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import add_shard, make_config, run_dedup, write_token_index

from pipeline.data import split
from pipeline.errors import PipelineError
from pipeline.rules import rule_params


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
    assert split.val_prefix(cum, 5, cap=1000) == 1  # a positive target: at least one cluster, though 0 is closer
    assert split.val_prefix(cum, 5, cap=9) == 0  # unless the first exceeds the cap
    assert split.val_prefix(cum, 0, cap=1000) == 0
    assert split.val_prefix(cum, 10**6, cap=10**6) == 4


def test_split_is_deterministic_and_seeded(tmp_path):
    keep_paths, token_paths = synthetic_run(tmp_path)
    split.run_split(params(), keep_paths, token_paths, tmp_path / "a", tmp_path / "a" / "r.json")
    split.run_split(params(), keep_paths[::-1], token_paths[::-1], tmp_path / "b", tmp_path / "b" / "r.json")
    split.run_split(params(seed=7), keep_paths, token_paths, tmp_path / "c", tmp_path / "c" / "r.json")
    a, b, c = (read_all(tmp_path / x) for x in "abc")
    assert a == b
    assert [t["split"] for t in a.values()] != [t["split"] for t in c.values()]


def add_unique_shard(root, source: str, shard: str, n: int, base: int, seed: int) -> tuple:
    """A shard whose documents are all their own clusters (ids base + doc); (keep path, token path)."""
    rng = random.Random(seed)
    kp, tp = root / "keep" / source / f"{shard}.parquet", root / "tokens" / source / f"{shard}.json"
    write_keep(kp, [base + d for d in range(n)], [True] * n)
    write_token_index(tp, list(range(n)), [rng.randint(20, 600) for _ in range(n)], source, shard)
    return kp, tp


def sides(tables: dict) -> dict:
    """(source, shard) -> (doc, tokens, split) columns: a split result without its cluster ids."""
    return {key: (t["doc"], t["tokens"], t["split"]) for key, t in tables.items()}


def val_docs(tables: dict, source: str) -> set:
    return {(sh, d) for (s, sh), t in tables.items() if s == source
            for d, sp in zip(t["doc"], t["split"]) if sp == "val"}


def test_rank_by_hash_keeps_the_relative_order_when_shards_are_added():
    rng = np.random.default_rng(0)
    old_names, new_names = ["b", "c"], ["a", "b", "c", "d"]  # two shards inserted around the old ones
    shard, doc = np.repeat([0, 1], 500), np.tile(np.arange(500), 2)
    old = [(old_names[s], d) for s, d in zip(shard, doc)]
    new_shard, new_doc = np.repeat([0, 1, 2, 3], 500), np.tile(np.arange(500), 4)
    perm = rng.permutation(len(new_shard))  # input order does not matter either
    new_shard, new_doc = new_shard[perm], new_doc[perm]
    ranked_old = [old[i] for i in split.rank_by_hash(old_names, shard, doc, 3, "x")]
    ranked_new = [(new_names[new_shard[i]], new_doc[i])
                  for i in split.rank_by_hash(new_names, new_shard, new_doc, 3, "x")]
    assert [x for x in ranked_new if x[0] in old_names] == ranked_old
    assert ranked_old != sorted(ranked_old)
    assert [old[i] for i in split.rank_by_hash(old_names, shard, doc, 4, "x")] != ranked_old  # seeded


def test_hash_split_is_stable_when_shards_or_sources_are_added(tmp_path):
    """A document's rank depends on its shard's name and its index, not on which other shards exist
    or on the cluster ids dedup gave it:
    a new source leaves the others' splits as they were, and a new shard of a source only displaces
    val documents (the old ones still in val are a prefix of the same order), it never reorders them."""
    keep_paths, token_paths = synthetic_run(tmp_path, shards={"web": ["s1", "s2"], "chat": ["c1"]})
    split.run_split(params(), keep_paths, token_paths, tmp_path / "a", tmp_path / "a" / "r.json")
    before = read_all(tmp_path / "a")

    # A new source that sorts first: dedup numbers documents by source position, so every old
    # cluster id shifts (simulated by renumbering the old keep lists); the split must not care.
    k, t = add_unique_shard(tmp_path, "aaa", "x0", 300, 0, seed=1)
    renumbered = []
    for kp in keep_paths:
        table = pq.read_table(kp).to_pydict()
        dest = tmp_path / "keep2" / kp.parent.name / kp.name
        write_keep(dest, [c + (1 << 56) for c in table["cluster"]], table["keep"])
        renumbered.append(dest)
    split.run_split(params(), [*renumbered, k], [*token_paths, t], tmp_path / "b", tmp_path / "b" / "r.json")
    after = read_all(tmp_path / "b")
    assert {key: v for key, v in sides(after).items() if key[0] != "aaa"} == sides(before)

    k2, t2 = add_unique_shard(tmp_path, "web", "s0", 300, 60 << 32, seed=2)  # sorts before web's shards
    split.run_split(params(), [*keep_paths, k2], [*token_paths, t2], tmp_path / "c", tmp_path / "c" / "r.json")
    grown = read_all(tmp_path / "c")
    assert ({key: t for key, t in grown.items() if key[0] == "chat"}
            == {key: t for key, t in before.items() if key[0] == "chat"})
    old_val, new_val = val_docs(before, "web"), val_docs(grown, "web")
    kept_old = {x for x in new_val if x[0] != "s0"}
    assert any(x[0] == "s0" for x in new_val), "the new shard's documents take part in val"
    assert kept_old < old_val or old_val <= kept_old
    assert len(kept_old) >= len(old_val) // 2


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
    p = rule_params(make_config(), "split")
    assert set(p) == {"split", "seed"} and p["split"]["method"] == "hash"


def write_flags(path, flags: list[bool]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"doc": np.arange(len(flags), dtype=np.int64), "contaminated": flags,
                             "tasks": ["copa" if f else "" for f in flags]}), path)


@pytest.mark.parametrize("method", ["hash", "shards"])
def test_decontaminated_keepers_leave_train_and_val(tmp_path, method):
    """Flagged keepers become `contam` (neither train nor val); flagged dups stay `dup`; every other
    document is split exactly as without the flags but for the val choice among the rest."""
    keep_paths, token_paths = synthetic_run(tmp_path)
    rng = random.Random(5)
    flag_paths, flagged = [], {}
    for kp in keep_paths:
        n = pq.read_metadata(kp).num_rows
        flags = [rng.random() < 0.1 for _ in range(n)]
        fp = tmp_path / "decontam" / kp.parent.name / kp.name
        write_flags(fp, flags)
        flag_paths.append(fp)
        flagged[(kp.parent.name, kp.stem)] = flags
    p = params(method, val_shards={"web": ["s1"]} if method == "shards" else None)
    report = split.run_split(p, keep_paths, token_paths, tmp_path / "split", tmp_path / "r.json", flag_paths)
    tables = read_all(tmp_path / "split")
    n_contam = 0
    for kp in keep_paths:
        key = (kp.parent.name, kp.stem)
        keep = pq.read_table(kp).column("keep").to_pylist()
        for s, k, f in zip(tables[key]["split"], keep, flagged[key]):
            assert s == ("dup" if not k else "contam" if f else s) and (s in ("train", "val")) == (k and not f)
            n_contam += s == "contam"
    assert n_contam > 0 and report["total"]["contam"]["documents"] == n_contam
    assert all(len(s) == 1 for s in sides_per_cluster(tables).values())
    with pytest.raises(PipelineError, match="decontamination files differ.*web/s0"):
        split.run_split(p, keep_paths, token_paths, tmp_path / "x", tmp_path / "x.json", flag_paths[1:])


def test_a_source_tokenize_kept_nothing_of_is_one_error_naming_the_key(tmp_path):
    """min_chars above every document's length: the split names the source, the drops and the key."""
    keep_paths, token_paths = synthetic_run(tmp_path, shards={"web": ["s0"], "chat": ["c0"]})
    empty = tmp_path / "tokens" / "web" / "s0.json"
    write_token_index(empty, [], [], "web", "s0")
    meta = json.loads(empty.read_text())
    empty.write_text(json.dumps({**meta, "n_rows": 163, "dropped": {"empty": 0, "short": 163, "long": 0}}))
    write_keep(keep_paths[0], [], [])
    with pytest.raises(PipelineError, match=r"source 'web': tokenize kept none of its 163 rows \(dropped: 163 short\); "
                                            r"lower sources\.web\.min_chars$"):
        split.run_split(params(), keep_paths, token_paths, tmp_path / "out", tmp_path / "r.json")
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()
