"""Mix stage: a named mix's seeded, weighted document schedule over the train split, plus its val set.

    python -m pipeline.data.mix --params JSON --mix NAME --split-dir R/split --outdir R/mix/NAME

`build_mix` takes each source's share of the token target (`schedule_target`) in seeded hash order,
up-sampling a small source up to ``max_epochs``, balances the realized proportions (`balance`) and
interleaves the documents so proportions hold locally too (`interleave`). Writes ``train.parquet`` (the
schedule), ``val.parquet`` and ``report.json``.

The token target, sampling, the proportions check and the interleaving: docs/data-stages.md, "Mix".
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import add_config_args, mix_slice, params_from_args
from pipeline.data.contract import rank_by_hash
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, read_json, run_cli, write_json, write_parquet
from pipeline.run_config import MixConfig, run_config

log = get_logger(__name__)

TOLERANCE = 0.005
CHECK_MIN_DOCS = 200
TAKE_WINDOW = 4096  # documents looked ahead per step while taking


def schedule_target(tokens: int, seq_len: int) -> int:
    """Schedule tokens needed for `tokens` training targets: ceil(tokens / seq_len) rows of seq_len + 1."""
    return -(-tokens // seq_len) * (seq_len + 1)


def target_tokens(mix_name: str, params: dict) -> int:
    """The mix's `tokens`: an integer, or the params' `trained_tokens` for `plan`."""
    view = run_config(params)
    tokens = view.mixes[mix_name].tokens
    if tokens != "plan":
        return int(tokens)
    trained = params.get("trained_tokens")
    if isinstance(trained, dict):  # per mix: what the stages training on it consume
        trained = trained.get(mix_name)
    if not isinstance(trained, int):
        raise PipelineError(f"mixes.{mix_name}.tokens is 'plan' but the params carry no integer 'trained_tokens'; "
                            "pass --configfile, or params made by pipeline.rules.rule_params(cfg, 'mix')")
    return trained


# ----------------------------------------------------------------------------- inputs

@dataclass
class Pool:
    """One source's documents of one split: shard names and per-document arrays."""

    shards: list[str]
    shard: np.ndarray  # index into `shards`
    doc: np.ndarray
    tokens: np.ndarray

    def take(self, idx: np.ndarray) -> Pool:
        return Pool(self.shards, self.shard[idx], self.doc[idx], self.tokens[idx])


def split_files(split_dir) -> dict[str, list[Path]]:
    """source -> the split files of this run, in shard order: those the split stage's report lists
    (the directory may also hold files of shards no longer configured)."""
    report = Path(split_dir, "report.json")
    try:
        shards = read_json(report)["shards"]
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"{report}: no readable split report listing the shards ({e!r}); "
                            "rerun the split stage") from None
    return {s: [Path(split_dir, s, f"{sh}.parquet") for sh in sorted(names)] for s, names in shards.items()}


SPLIT_COLUMNS = ["doc", "tokens", "split"]


def load_source(paths: list[Path], source: str) -> dict[str, Pool]:
    """The source's train and val documents from its split files `paths`, in (shard, doc) order: one
    lazy polars scan over every shard's table (read in parallel, `POLARS_MAX_THREADS` threads; the
    rule sets the job's), filtered to each split (BENCHMARKS.md "Mix input")."""
    import polars as pl

    if not paths:
        raise PipelineError(f"no split files for source '{source}' in the split report; add it to the config's "
                            "sources and rerun the split stage")
    scans = [pl.scan_parquet(p).select(SPLIT_COLUMNS).with_columns(shard=pl.lit(i, pl.Int64))
             for i, p in enumerate(paths)]
    try:
        rows = pl.concat(scans).collect()
    except (OSError, pl.exceptions.PolarsError) as e:
        raise _unreadable_split_file(paths, e) from None
    names = [p.stem for p in paths]
    out = {}
    for name in ("train", "val"):
        part = rows.filter(pl.col("split") == name)
        out[name] = Pool(names, *(part[c].to_numpy().astype(np.int64) for c in ("shard", "doc", "tokens")))
    return out


def _unreadable_split_file(paths: list[Path], err: Exception) -> PipelineError:
    """The error naming the first split file that cannot be read (the scan's error names none)."""
    for p in paths:
        try:
            pq.read_table(p, columns=SPLIT_COLUMNS)
        except (OSError, pa.ArrowException, KeyError) as e:
            err = e
            break
    else:
        p = paths[0].parent
    return PipelineError(f"{p}: not a readable split file with {', '.join(SPLIT_COLUMNS)} ({err}); rerun the split "
                         "stage")


# ----------------------------------------------------------------------------- sampling

def short_message(mix_name: str, source: str, mix: Mapping, available: int, share: int, weight_frac: float,
                  target: int) -> str:
    mix = MixConfig.from_dict(mix)
    epochs = _over(share / max(available, 1), mix.max_epochs)
    return (f"mix '{mix_name}': source '{source}' has {available:,} train tokens but its share "
            f"{weight_frac:.4g} × {target:,} = {share:,} tokens needs {epochs} epochs, "
            f"over max_epochs {mix.max_epochs}; raise mixes.{mix_name}.max_epochs, lower its weight "
            f"(mixes.{mix_name}.weights.{source}) or mixes.{mix_name}.tokens, or add shards to source '{source}'")


def _over(value: float, cap: float) -> str:
    """`value` with the fewest significant digits (at least 4) that still show it exceeds `cap`
    (1.004 epochs over a cap of 1.0 must not print as 1)."""
    for digits in range(4, 18):
        if float(text := f"{value:.{digits}g}") > cap:
            return text
    return repr(value)


class Stream:
    """One source's train documents in seeded rank order, pass after pass: pass `e` (the `epoch`)
    ranks all documents by `rank_by_hash(..., seed, "mix", source, str(e))`."""

    def __init__(self, pool: Pool, seed: int, source: str, cap_tokens: float):
        self.pool, self.seed, self.source, self.cap_tokens = pool, seed, source, cap_tokens
        self.tokens = 0
        self._taken: list[np.ndarray] = []
        self._epochs: list[np.ndarray] = []
        self._start_pass(0)

    def _start_pass(self, epoch: int) -> None:
        self._epoch, self._pos = epoch, 0
        p = self.pool
        self._order = rank_by_hash(p.shards, p.shard, p.doc, self.seed, "mix", self.source, str(epoch))

    def take_until(self, tokens: int) -> None:
        """Take documents in order until at least `tokens` in all (the crossing document included)."""
        while self.tokens < tokens:
            if self._pos == len(self._order):
                self._start_pass(self._epoch + 1)
            rest = self._order[self._pos:self._pos + TAKE_WINDOW]
            cum = np.cumsum(self.pool.tokens[rest])
            k = min(int(np.searchsorted(cum, tokens - self.tokens)) + 1, len(rest))
            self._taken.append(rest[:k])
            self._epochs.append(np.full(k, self._epoch, np.int64))
            self._pos += k
            self.tokens += int(cum[k - 1])

    def can_grow(self) -> bool:
        return self.tokens < self.cap_tokens

    def picked(self) -> tuple[Pool, np.ndarray]:
        """The taken documents in order and their epochs."""
        return self.pool.take(np.concatenate(self._taken)), np.concatenate(self._epochs)


def balance(streams: dict[str, Stream], proportions: dict[str, float], tolerance: float) -> None:
    """Top up: while some source's share of the scheduled tokens is off its requested proportion by
    more than `tolerance`, the source furthest below its proportion takes its next document (within
    its epoch cap). The crossing documents of long-document sources are thus diluted."""
    while True:
        total = sum(st.tokens for st in streams.values())
        deviation = {s: st.tokens / total - proportions[s] for s, st in streams.items()}
        lowest = min(deviation, key=deviation.get)
        if max(map(abs, deviation.values())) <= tolerance or not streams[lowest].can_grow():
            return
        streams[lowest].take_until(streams[lowest].tokens + 1)


def interleave(picks: dict[str, tuple[Pool, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Stratified merge: (source index, position within that source's picks) in schedule order."""
    frac, src, pos = [], [], []
    for i, name in enumerate(sorted(picks)):
        t = picks[name][0].tokens
        total = max(int(t.sum()), 1)
        frac.append((np.cumsum(t) - t / 2) / total)
        src.append(np.full(len(t), i))
        pos.append(np.arange(len(t)))
    frac, src, pos = (np.concatenate(x) for x in (frac, src, pos))
    order = np.lexsort((src, frac))
    return src[order], pos[order]


def _table(source: np.ndarray, pool: Pool, epoch: np.ndarray) -> pa.Table:
    return pa.table({
        "source": pa.array(source, pa.string()),
        "shard": pa.array(np.asarray(pool.shards, dtype=object)[pool.shard], pa.string()),
        "doc": pa.array(pool.doc, pa.int64()),
        "tokens": pa.array(pool.tokens, pa.int64()),
        "epoch": pa.array(epoch, pa.int64()),
    })


def _concat_pools(pools: list[Pool]) -> Pool:
    """One pool over a non-empty list of pools (shard indices shifted past the earlier pools' names)."""
    names, shard = [], []
    for p in pools:
        shard.append(p.shard + len(names))
        names += p.shards
    return Pool(names, np.concatenate(shard), np.concatenate([p.doc for p in pools]),
                np.concatenate([p.tokens for p in pools]))


def build_mix(params: dict, mix_name: str, split_dir) -> tuple[pa.Table, pa.Table, dict]:
    """(train schedule, val table, report) for one mix (see docs/data-stages.md, "Mix")."""
    view = run_config(params)
    if mix_name not in view.mixes:
        raise PipelineError(f"unknown mix '{mix_name}' (mixes: {', '.join(view.mixes)})")
    mix = view.mixes[mix_name]
    seq_len = view.extra["seq_len"]  # train.seq_len, which the slice carries as a key of its own
    tokens = target_tokens(mix_name, params)
    target = schedule_target(tokens, seq_len)
    sources = sorted(mix.weights)
    weight_sum = sum(mix.weights.values())
    files = split_files(split_dir)
    pools = {s: load_source(files.get(s, []), s) for s in sources}
    proportions = {s: mix.weights[s] / weight_sum for s in sources}
    streams = {}
    for s in sources:
        share = math.ceil(proportions[s] * target)
        available = int(pools[s]["train"].tokens.sum())
        cap = mix.max_epochs * available
        if share > cap:
            raise PipelineError(short_message(mix_name, s, mix, available, share, proportions[s], target))
        streams[s] = Stream(pools[s]["train"], view.seed, s, cap)
        streams[s].take_until(share)
    balance(streams, proportions, TOLERANCE / 2)
    picks = {s: st.picked() for s, st in streams.items()}
    total = sum(st.tokens for st in streams.values())
    per_source = {}
    for s in sources:
        pool, epoch = picks[s]
        available = int(pools[s]["train"].tokens.sum())
        per_source[s] = {"weight": mix.weights[s], "requested_proportion": proportions[s],
                         "share_tokens": math.ceil(proportions[s] * target), "scheduled_tokens": streams[s].tokens,
                         "realized_proportion": streams[s].tokens / total, "documents": len(epoch),
                         "available_tokens": available, "epochs_used": streams[s].tokens / available,
                         "passes": int(epoch.max()) + 1}
    n_docs = sum(v["documents"] for v in per_source.values())
    worst = max(abs(v["realized_proportion"] - v["requested_proportion"]) for v in per_source.values())
    if n_docs >= CHECK_MIN_DOCS and worst > TOLERANCE:
        raise PipelineError(f"mix '{mix_name}': realized proportions are off the requested ones by {worst:.2%} "
                            f"(> {TOLERANCE:.1%}) because documents are long for a target of {tokens:,} tokens: "
                            f"{ {s: round(v['realized_proportion'], 4) for s, v in per_source.items()} }; "
                            f"raise mixes.{mix_name}.tokens or max_epochs")

    src_idx, pos = interleave(picks)
    parts = [picks[s] for s in sources]
    offsets = np.cumsum([0] + [len(epoch) for _, epoch in parts])
    flat = offsets[src_idx] + pos
    train_pool = _concat_pools([pool for pool, _ in parts]).take(flat)
    epochs = np.concatenate([epoch for _, epoch in parts])[flat]
    train = _table(np.asarray(sources, dtype=object)[src_idx], train_pool, epochs)

    val_pools = [pools[s]["val"] for s in sources]
    val_source = np.concatenate([np.full(len(p.doc), s, dtype=object) for s, p in zip(sources, val_pools)])
    val_pool = _concat_pools(val_pools)
    val = _table(val_source, val_pool, np.zeros(len(val_pool.doc), np.int64))
    report = {
        "mix": mix_name,
        "target": {"tokens": tokens, "from": "plan" if mix.tokens == "plan" else "config",
                   "seq_len": seq_len,
                   "rows_needed": -(-tokens // seq_len), "schedule_target_tokens": target,
                   "scheduled_tokens": total, "concat_rows": total // (seq_len + 1)},
        "max_epochs": mix.max_epochs,
        "packing": mix.packing,
        "per_source": per_source,
        "val": {"documents": val.num_rows, "tokens": int(val_pool.tokens.sum()),
                "per_source": {s: {"documents": len(p.doc), "tokens": int(p.tokens.sum())}
                               for s, p in zip(sources, val_pools)}},
        "params": params,
    }
    return train, val, report


def run_mix(params: dict, mix_name: str, split_dir, outdir) -> dict:
    """The stage: build the mix and write train.parquet, val.parquet and report.json."""
    view = run_config(params)
    train, val, report = build_mix(params, mix_name, split_dir)
    files = split_files(split_dir)
    inputs = [Path(split_dir, "report.json"), *(p for s in sorted(view.mixes[mix_name].weights)
                                                for p in files.get(s, []))]
    meta = provenance("mix", params, inputs, mix=mix_name)
    report["meta"] = meta
    outdir = Path(outdir)
    write_parquet(outdir / "train.parquet", train, meta | {"split": "train"})
    write_parquet(outdir / "val.parquet", val, meta | {"split": "val"})
    write_json(outdir / "report.json", report)
    log.info("mix '%s': %d documents, %d tokens (target %d) from %s; %d val documents", mix_name, train.num_rows,
             report["target"]["scheduled_tokens"], report["target"]["schedule_target_tokens"],
             {s: round(v["realized_proportion"], 4) for s, v in report["per_source"].items()}, val.num_rows)
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.mix", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--mix", required=True, help="the mix name (a key of mixes)")
    ap.add_argument("--split-dir", required=True, help="R/split")
    ap.add_argument("--outdir", required=True, help="R/mix/NAME")
    args = ap.parse_args(argv)
    run_mix(params_from_args(args, mix_slice), args.mix, args.split_dir, args.outdir)


if __name__ == "__main__":
    run_cli(main)
