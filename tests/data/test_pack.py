"""Pack stage: concat and best-fit rows hold exactly the scheduled tokens; counts balance; bad input fails."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import pack_params, schedule_rows, spans_of, true_tokens, write_schedule

from pipeline.data import pack as pack_mod
from pipeline.data.contract import pack_paths as output_paths
from pipeline.data.pack import best_fit_decreasing, main, pack
from pipeline.errors import PipelineError
from pipeline.io import read_json

SEQ = 16
C = SEQ + 1


def read_pack(out):
    meta = read_json(out)
    paths = output_paths(out)
    rows = np.fromfile(paths["bin"], dtype=meta["dtype"]).reshape(-1, meta["seq_len"] + 1)
    mask = np.fromfile(paths["mask"], np.uint8).reshape(rows.shape) if meta["has_mask"] else None
    return meta, rows, mask, np.load(paths["docs"])


@pytest.mark.parametrize("chunk_tokens", [7, 1 << 22])
def test_concat_is_the_schedule_in_order(data, tmp_path, monkeypatch, chunk_tokens):
    monkeypatch.setattr(pack_mod, "CHUNK_TOKENS", chunk_tokens)
    rows = schedule_rows(data, [("web", "a"), ("web", "b")])
    sched = write_schedule(tmp_path / "mix/m/train.parquet", rows, true_tokens(data, rows))
    out = tmp_path / "pack/m/train.json"
    meta = pack(pack_params("concat"), "m", "train", sched, data / "tokens", out)

    spans = [spans_of(data, s, sh)[d][0] for s, sh, d, _ in rows]
    flat = np.concatenate(spans)
    _, got, _, docs = read_pack(out)
    n_rows = len(flat) // C
    assert meta["n_rows"] == n_rows == len(got) and meta["tokens_in"] == len(flat)
    assert np.array_equal(got.reshape(-1), flat[: n_rows * C])
    assert meta["dropped_tail_tokens"] == len(flat) - n_rows * C < C
    assert meta["tokens_packed"] + meta["dropped_tail_tokens"] == meta["tokens_in"] and meta["pad_tokens"] == 0
    starts = np.cumsum([0] + [len(s) for s in spans[:-1]])
    assert np.array_equal(docs, starts[starts < n_rows * C])
    assert meta["sha256"] == hashlib.sha256(output_paths(out)["bin"].read_bytes()).hexdigest()
    assert meta["tokens_by_source"] == {"web": len(flat)} and not output_paths(out)["mask"].exists()


def segments(rows, mask, docs, pad_id):
    """Cut best-fit rows back into (tokens, mask) pieces: at every doc start, and before the padding
    (trailing pad ids with mask 0; no real piece ends that way since <|bos|> only starts a document)."""
    out = []
    for r in range(len(rows)):
        real = np.flatnonzero(~((rows[r] == pad_id) & (mask[r] == 0)))
        end = int(real[-1]) + 1
        cuts = [int(p) - r * C for p in docs if r * C <= p < (r + 1) * C] + [end]
        assert cuts[0] == 0, "a best-fit row must start with a document"
        out += [(tuple(rows[r, a:b]), tuple(mask[r, a:b])) for a, b in zip(cuts[:-1], cuts[1:])]
        assert (rows[r, end:] == pad_id).all() and (mask[r, end:] == 0).all()
    return out


def test_bestfit_rows_hold_every_piece_once(data, tmp_path):
    rows = schedule_rows(data, [("web", "b"), ("chat", "c")], epochs=1)
    sched = write_schedule(tmp_path / "mix/m/train.parquet", rows, true_tokens(data, rows))
    out = tmp_path / "pack/m/train.json"
    meta = pack(pack_params("bestfit"), "m", "train", sched, data / "tokens", out, rows_per_chunk=3)
    got, mask, docs = read_pack(out)[1:]

    expect = []  # documents longer than a row are split into full rows plus a remainder
    for s, sh, d, _ in rows:
        t, m = spans_of(data, s, sh)[d]
        expect += [(tuple(t[i:i + C]), tuple(m[i:i + C])) for i in range(0, len(t), C)]
    assert Counter(segments(got, mask, docs, meta["pad_id"])) == Counter(expect)
    tokens_in = sum(len(t) for t, _ in expect)
    assert meta["tokens_in"] == meta["tokens_packed"] == tokens_in and meta["truncated_tokens"] == 0
    assert meta["n_rows"] * C == tokens_in + meta["pad_tokens"] and meta["dropped_tail_tokens"] == 0
    assert int(mask.sum()) == sum(int(np.sum(m)) for _, m in expect)
    assert meta["split_docs"] == sum(len(spans_of(data, s, sh)[d][0]) > C for s, sh, d, _ in rows) > 0
    assert meta["n_rows"] < tokens_in / C * 1.3  # best-fit leaves little padding on these lengths


def naive_bfd_fills(lengths, cap):
    """Reference best-fit decreasing (quadratic): the final fill of every row."""
    fills = []
    for s in sorted(lengths, reverse=True):
        fit = [i for i, f in enumerate(fills) if f + s <= cap]
        if fit:
            best = max(fit, key=lambda i: fills[i])
            fills[best] += s
        else:
            fills.append(s)
    return sorted(fills)


@pytest.mark.parametrize("seed", range(4))
def test_best_fit_decreasing_matches_reference(seed):
    rng = np.random.default_rng(seed)
    cap = 64
    lengths = np.concatenate([rng.integers(1, cap + 1, 300), np.full(5, cap)])
    row, off = best_fit_decreasing(lengths, cap)
    fills = np.zeros(row.max() + 1, np.int64)
    np.add.at(fills, row, lengths)
    assert sorted(fills.tolist()) == naive_bfd_fills(lengths.tolist(), cap)
    used = np.zeros((row.max() + 1, cap), np.int64)  # items tile their rows without overlap
    for r, o, n in zip(row, off, lengths):
        used[r, o:o + n] += 1
    assert used.max() == 1 and (used.sum(1) == fills).all()


def test_schedule_errors(data, tmp_path):
    rows = [("web", "a", 0, 0), ("web", "a", 1, 0)]
    real = true_tokens(data, rows)
    out = tmp_path / "pack/m/train.json"
    cases = [
        (write_schedule(tmp_path / "stale.parquet", rows, [real[0], real[1] + 1]), "schedule is stale"),
        (write_schedule(tmp_path / "range.parquet", [("web", "a", 10_000, 0)], [5]), "out of range"),
        (write_schedule(tmp_path / "missing.parquet", [("web", "zz", 0, 0)], [5]), "run the tokenize stage"),
        (write_schedule(tmp_path / "small.parquet", rows[:1], real[:1]), "do not fill one row"),
    ]
    for sched, match in cases:
        with pytest.raises(PipelineError, match=match):
            pack(pack_params("concat", seq_len=200), "m", "train", sched, data / "tokens", out)
        assert not out.parent.exists() or list(out.parent.iterdir()) == []
    pq.write_table(pa.table({"source": ["web"], "doc": [0]}), tmp_path / "cols.parquet")
    with pytest.raises(PipelineError, match="lacks column"):
        pack(pack_params("concat"), "m", "train", tmp_path / "cols.parquet", data / "tokens", out)


def test_incomplete_token_shard_is_named(data, tmp_path):
    shutil.copytree(data / "tokens", tmp_path / "tokens")
    (tmp_path / "tokens/web/a.bin").unlink()
    rows = [("web", "a", 0, 0)]
    sched = write_schedule(tmp_path / "s.parquet", rows, true_tokens(data, rows))
    with pytest.raises(PipelineError, match=r"a.json: its a.bin is missing; rerun the tokenize stage"):
        pack(pack_params("concat", seq_len=4), "m", "train", sched, tmp_path / "tokens", tmp_path / "pack/m/train.json")


def test_schedule_tokens_may_exclude_delimiters(data, tmp_path):
    rows = schedule_rows(data, [("web", "a")], epochs=1)
    with_delims = write_schedule(tmp_path / "with.parquet", rows, true_tokens(data, rows))
    without = write_schedule(tmp_path / "without.parquet", rows, [n - 1 for n in true_tokens(data, rows)])
    a = pack(pack_params("concat"), "m", "train", with_delims, data / "tokens", tmp_path / "a/train.json")
    b = pack(pack_params("concat"), "m", "train", without, data / "tokens", tmp_path / "b/train.json")
    assert a["sha256"] == b["sha256"] and a["tokens_in"] == b["tokens_in"]
    mixed = write_schedule(tmp_path / "mixed.parquet", rows[:2],
                           [true_tokens(data, rows[:1])[0] - 1, true_tokens(data, rows[1:2])[0]])
    with pytest.raises(PipelineError, match="row 1 .* stale"):
        pack(pack_params("concat"), "m", "train", mixed, data / "tokens", tmp_path / "c/train.json")


def test_cli(data, tmp_path):
    rows = schedule_rows(data, [("chat", "c")], epochs=1)
    sched = write_schedule(tmp_path / "mix/m/val.parquet", rows, true_tokens(data, rows))
    out = tmp_path / "pack/m/val.json"
    main(["--params", json.dumps(pack_params("bestfit")), "--mix", "m", "--split", "val", "--schedule", str(sched),
          "--tokens-dir", str(data / "tokens"), "--out", str(out)])
    meta = read_json(out)
    assert meta["packing"] == "bestfit" and meta["split"] == "val" and output_paths(out)["mask"].exists()
