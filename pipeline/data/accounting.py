"""Accounting stage: reconcile every token from the counts to the packed rows, exactly.

    python -m pipeline.data.accounting --params JSON --run-dir R --out R/accounting.json --out-md R/accounting.md

Follows each shard's documents and tokens from the download through filter, tokenize, dedup (removals within
the run and against `dedup.reference`), decontamination, split, mix and pack, per source and over the run
(`reconcile`); one unbalanced equation fails the stage with a PipelineError listing each. The flow and the
equations: docs/data-stages.md, "Accounting".
"""
from __future__ import annotations

import argparse
import os
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.config import accounting_slice, add_config_args, params_from_args
from pipeline.config.layout import RunLayout
from pipeline.data.contract import DROP_REASONS, shard_keys, token_column_mismatches
from pipeline.errors import PipelineError
from pipeline.io import atomic_write, get_logger, provenance, read_json, run_cli, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)

SPLIT_CODES = {"train": 0, "val": 1, "dup": 2, "contam": 3}  # code = position in this order


@dataclass
class Line:
    """One balance equation: `lhs` (named `lhs_label`) must equal `rhs`."""

    arrow: str
    scope: str
    check: str
    lhs_label: str
    lhs: int
    rhs_label: str
    rhs: int

    @property
    def ok(self) -> bool:
        return self.lhs == self.rhs

    def __str__(self) -> str:
        return (f"[{self.arrow}] {self.scope}: {self.check}: {self.lhs_label} = {self.lhs} "
                f"but {self.rhs_label} = {self.rhs} (off by {self.rhs - self.lhs:+d})")


# (arrow, check, lhs terms, rhs terms): terms are quantity names of a shard, summed
SHARD_EQUATIONS = [
    ("download → filter", "rows", ["downloaded_rows"], ["decision_rows"]),
    ("filter → tokenize", "rows", ["filter_kept_rows"], ["counted_rows"]),
    ("filter → tokenize", "characters", ["filter_chars_out"], ["counted_chars"]),
    ("count → tokenize", "rows", ["counted_rows"], ["tokenized_rows"]),
    ("count → tokenize", "documents", ["counted_rows"],
     ["tokenized_docs", "dropped_empty", "dropped_invalid_utf8", "dropped_short", "dropped_null_content",
      "dropped_no_assistant", "dropped_long"]),
    ("count → tokenize", "empty documents", ["counted_empty"], ["dropped_empty"]),
    ("count → tokenize", "invalid-UTF-8 documents", ["counted_invalid_utf8"], ["dropped_invalid_utf8"]),
    ("count → tokenize", "short documents", ["counted_short"], ["dropped_short"]),
    ("count → tokenize", "conversations with a null content", ["counted_null_content"], ["dropped_null_content"]),
    ("count → tokenize", "conversations without an assistant turn", ["counted_no_assistant"],
     ["dropped_no_assistant"]),
    ("count → tokenize", "conversations over max_conversation_tokens", ["counted_long"], ["dropped_long"]),
    ("count → tokenize", "document tokens", ["counted_tokens"],
     ["tokenized_doc_tokens", "dropped_short_tokens", "dropped_long_tokens"]),
    ("tokenize", "tokens", ["tokenized_doc_tokens", "tokenized_delimiter_tokens"], ["tokenized_tokens"]),
    ("tokenize", "tokens in the token file", ["tokenized_tokens"], ["span_tokens"]),
    ("tokenize", "delimiter tokens", ["expected_delimiter_tokens"], ["tokenized_delimiter_tokens"]),
    ("tokenize → dedup", "keep-file rows", ["tokenized_docs"], ["dedup_rows"]),
    ("tokenize → dedup", "distinct documents", ["tokenized_docs"], ["dedup_docs"]),
    ("tokenize → dedup", "tokens", ["span_tokens"], ["kept_tokens", "removed_tokens"]),
    ("tokenize → dedup", "removed tokens", ["removed_tokens"], ["removed_within_tokens", "removed_reference_tokens"]),
    ("dedup → split", "split-file rows", ["tokenized_docs"], ["split_rows"]),
    ("dedup → split", "distinct documents", ["tokenized_docs"], ["split_docs"]),
    ("tokenize → decontaminate", "flag-file rows", ["tokenized_docs"], ["decontam_rows"]),
    ("tokenize → decontaminate", "distinct documents", ["tokenized_docs"], ["decontam_docs"]),
    ("dedup → split", "kept tokens", ["kept_tokens"], ["train_tokens", "val_tokens", "contam_tokens"]),
    ("dedup → split", "removed tokens", ["removed_tokens"], ["dup_tokens"]),
    ("dedup → split", "documents whose split disagrees with dedup", [], ["split_keep_disagreements"]),
    ("dedup → split", "documents whose `tokens` disagrees with the span", [], ["split_token_mismatches"]),
    ("decontaminate → split", "flagged kept tokens", ["flagged_kept_tokens"], ["contam_tokens"]),
    ("decontaminate → split", "documents whose split disagrees with the flags", [], ["split_flag_disagreements"]),
]


class Ledger:
    """Collects balance lines; shard-level lines are kept only when they fail."""

    def __init__(self):
        self.lines: list[Line] = []
        self.failures: list[Line] = []

    def add(self, line: Line, keep: bool = True) -> None:
        if keep:
            self.lines.append(line)
        if not line.ok:
            self.failures.append(line)

    def equations(self, q: dict, scope: str, keep: bool) -> None:
        for arrow, check, lhs, rhs in SHARD_EQUATIONS:
            self.add(Line(arrow, scope, check, " + ".join(lhs) or "0", sum(q[k] for k in lhs),
                          " + ".join(rhs), sum(q[k] for k in rhs)), keep)

    def raise_if_unbalanced(self) -> None:
        if self.failures:
            shown = "; ".join(map(str, self.failures[:20]))
            more = f" (and {len(self.failures) - 20} more)" if len(self.failures) > 20 else ""
            raise PipelineError(f"token accounting does not balance in {len(self.failures)} line(s): {shown}{more}")


# ----------------------------------------------------------------------------- reading

def _read_table(path: Path, columns: list[str], fix: str):
    import pyarrow.parquet as pq

    if not path.exists():
        raise PipelineError(f"{path}: not found; {fix}")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise PipelineError(f"{path}: not readable parquet ({e}); {fix}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise PipelineError(f"{path}: lacks column(s) {', '.join(missing)}; {fix}")
    return table


def _coverage(doc: np.ndarray, n_docs: int) -> tuple[int, np.ndarray]:
    """(distinct valid document indices, boolean 'first valid occurrence' per row)."""
    valid = (doc >= 0) & (doc < n_docs)
    first = np.zeros(len(doc), bool)
    _, idx = np.unique(np.where(valid, doc, -1), return_index=True)
    first[idx] = True
    first &= valid
    return int(first.sum()), first


@dataclass
class ShardData:
    """What the mix check needs of one shard: span lengths, each document's split (-1: none)."""

    spans: np.ndarray
    split: np.ndarray
    delimiters_per_doc: int


def filter_quantities(data_dir: Path, run: RunLayout, source: str, shard: str) -> dict:
    """The download and filter numbers of one shard: the placed shard's rows (its download sidecar) and the
    filter's decisions (rows, kept rows, their characters after filtering)."""
    side = data_dir / source / f"{shard}.parquet.json"
    if not side.exists():
        raise PipelineError(f"{side}: not found; run the download stage for {source}/{shard}")
    d = _read_table(Path(run.filtered(source, shard, "decisions.parquet")), ["kept", "chars_out"],
                    f"run the filter stage for {source}/{shard}")
    kept = d.column("kept").to_numpy(zero_copy_only=False)
    return {"downloaded_rows": int(read_json(side)["rows"]), "decision_rows": d.num_rows,
            "filter_kept_rows": int(kept.sum()), "filter_chars_out": int(d.column("chars_out").to_numpy().sum())}


def shard_quantities(run: RunLayout, count: dict, dedup_enabled: bool, decontam_enabled: bool, data_dir: Path
                     ) -> tuple[dict, ShardData]:
    """Every number of one shard's flow (names as in SHARD_EQUATIONS); `data_dir`: where its raw shard was
    placed (the config's data_dir)."""
    source, shard = count["source"], count["shard"]
    tok_json = Path(run.tokens(source, shard))
    if not tok_json.exists():
        raise PipelineError(f"{tok_json}: not found; run the tokenize stage for {source}/{shard}")
    tok = read_json(tok_json)
    off = np.load(tok_json.parent / f"{shard}.idx.npy")
    spans = np.diff(off)
    n = tok["n_docs"]
    if len(spans) != n:
        raise PipelineError(f"{tok_json}: offsets hold {len(spans)} documents, metadata {n}; rerun tokenize for this "
                            "shard")
    q = {
        **filter_quantities(data_dir, run, source, shard),
        "counted_rows": count["documents"],
        "counted_chars": count["chars"],
        "counted_empty": count["empty_documents"],
        "counted_invalid_utf8": count["invalid_utf8_documents"],
        "counted_short": count["short_documents"],
        "counted_null_content": count["null_content_documents"],
        "counted_no_assistant": count["no_assistant_documents"],
        "counted_long": count["long_documents"],
        "counted_tokens": count["tokens"],
        "tokenized_rows": tok["n_rows"],
        "tokenized_docs": n,
        **{f"dropped_{k}": tok["dropped"][k] for k in DROP_REASONS},
        "dropped_short_tokens": tok["dropped_tokens"]["short"],
        "dropped_long_tokens": tok["dropped_tokens"]["long"],
        "tokenized_doc_tokens": tok["n_doc_tokens"],
        "tokenized_delimiter_tokens": tok["n_delimiter_tokens"],
        "expected_delimiter_tokens": n * tok["delimiters_per_doc"],
        "tokenized_tokens": tok["n_tokens"],
        "span_tokens": int(spans.sum()),
    }
    keep = _dedup_keep(run, source, shard, n, q, spans, dedup_enabled)
    flags = _decontam_flags(run, source, shard, n, q, spans, keep, decontam_enabled)
    split = _split_codes(run, source, shard, n, q, spans, keep, tok["delimiters_per_doc"])
    q["split_flag_disagreements"] = int(((split == SPLIT_CODES["contam"]) != (flags & keep)).sum())
    return q, ShardData(spans, split, tok["delimiters_per_doc"])


def _dedup_keep(run: RunLayout, source: str, shard: str, n: int, q: dict, spans: np.ndarray,
                enabled: bool) -> np.ndarray:
    """Fill the dedup quantities; return keep (bool per document)."""
    path = Path(run.dedup_keep(source, shard))
    against = np.zeros(n, bool)  # removed against dedup.reference (the keep list's `reference`), not within the run
    if not enabled and not path.exists():
        keep = np.ones(n, bool)
        q.update(dedup_rows=n, dedup_docs=n)
    else:
        t = _read_table(path, ["doc", "keep"], "run the dedup stage")
        doc = t["doc"].to_numpy().astype(np.int64)
        q["dedup_docs"], first = _coverage(doc, n)
        q["dedup_rows"] = len(doc)
        keep = np.zeros(n, bool)
        keep[doc[first]] = t["keep"].to_numpy(zero_copy_only=False).astype(bool)[first]
        if "reference" in t.column_names:
            against[doc[first]] = t["reference"].to_numpy(zero_copy_only=False).astype(bool)[first]
    against &= ~keep
    q["kept_tokens"] = int(spans[keep].sum())
    q["removed_tokens"] = int(spans[~keep].sum())
    q["removed_reference_docs"] = int(against.sum())
    q["removed_within_docs"] = int((~keep).sum()) - q["removed_reference_docs"]
    q["removed_reference_tokens"] = int(spans[against].sum())
    q["removed_within_tokens"] = q["removed_tokens"] - q["removed_reference_tokens"]
    return keep


def _decontam_flags(run: RunLayout, source: str, shard: str, n: int, q: dict, spans: np.ndarray, keep: np.ndarray,
                    enabled: bool) -> np.ndarray:
    """Fill the decontamination quantities; return contaminated (bool per document)."""
    path = Path(run.decontam(source, shard))
    flags = np.zeros(n, bool)
    if not enabled and not path.exists():
        q.update(decontam_rows=n, decontam_docs=n)
    else:
        t = _read_table(path, ["doc", "contaminated"], "run the decontaminate stage")
        doc = t["doc"].to_numpy().astype(np.int64)
        q["decontam_docs"], first = _coverage(doc, n)
        q["decontam_rows"] = len(doc)
        flags[doc[first]] = t["contaminated"].to_numpy(zero_copy_only=False).astype(bool)[first]
    q["flagged_tokens"] = int(spans[flags].sum())
    q["flagged_kept_tokens"] = int(spans[flags & keep].sum())
    return flags


def _split_codes(run: RunLayout, source: str, shard: str, n: int, q: dict, spans: np.ndarray, keep: np.ndarray,
                 delimiters_per_doc: int) -> np.ndarray:
    """Fill the split quantities; return the split code (SPLIT_CODES, -1 = unassigned) per document."""
    t = _read_table(Path(run.split(source, shard)), ["doc", "split", "tokens"], "run the split stage")
    import pyarrow as pa
    import pyarrow.compute as pc

    doc = t["doc"].to_numpy().astype(np.int64)
    codes = pc.index_in(t["split"], value_set=pa.array(list(SPLIT_CODES))).fill_null(-1).to_numpy().astype(np.int8)
    if (codes < 0).any():
        unknown = pc.unique(t["split"].filter(pa.array(codes < 0))).to_pylist()
        raise PipelineError(f"{run.split(source, shard)}: unknown split value(s) {unknown}; expected train "
                            "/ val / dup, rerun split")
    q["split_docs"], first = _coverage(doc, n)
    q["split_rows"] = len(doc)
    code = np.full(n, -1, np.int8)
    code[doc[first]] = codes[first]
    for name, c in SPLIT_CODES.items():
        q[f"{name}_tokens"] = int(spans[code == c].sum())
    q["split_keep_disagreements"] = int(((code == SPLIT_CODES["dup"]) != ~keep).sum())
    tokens = t["tokens"].to_numpy().astype(np.int64)[first]
    q["split_token_mismatches"] = len(token_column_mismatches(tokens, spans[doc[first]], delimiters_per_doc))
    return code


# ----------------------------------------------------------------------------- mixes

def mix_flow(run: RunLayout, mix: str, split: str, shards: dict[str, ShardData], ledger: Ledger) -> dict:
    """Scheduled vs available tokens per source, and the pack's balance, for one mix split."""
    scope = f"{mix}/{split}"
    sched = _read_table(Path(run.mix(mix, split)), ["source", "shard", "doc", "tokens", "epoch"],
                        "run the mix stage")
    names, shard_id = shard_keys(sched)
    doc = sched["doc"].to_numpy().astype(np.int64)
    epoch = sched["epoch"].to_numpy().astype(np.int64)
    spans = np.zeros(len(doc), np.int64)
    wrong = 0
    for k, name in enumerate(names):
        if name not in shards:
            raise PipelineError(f"{run.mix(mix, split)} schedules shard {name}, which was not counted; "
                                "rerun the pipeline")
        sel = shard_id == k
        d = doc[sel]
        ok = (d >= 0) & (d < len(shards[name].spans))
        spans[sel] = np.where(ok, shards[name].spans[np.where(ok, d, 0)], 0)
        wrong += int((~ok).sum() + (shards[name].split[d[ok]] != SPLIT_CODES[split]).sum())
    repeats = len(doc) - np.unique(np.stack([shard_id, doc, epoch]), axis=1).shape[1] if len(doc) else 0
    per_doc = shards[names[0]].delimiters_per_doc if names else 0
    mismatches = len(token_column_mismatches(sched["tokens"].to_numpy().astype(np.int64), spans, per_doc))
    for check, value in (("scheduled documents not in the split", wrong),
                         ("documents scheduled twice in one epoch", repeats),
                         ("documents whose `tokens` disagrees with the span", mismatches)):
        ledger.add(Line("split → mix", scope, check, "0", 0, "count", value))

    sources = (np.asarray([n.split("/", 1)[0] for n in names], dtype=object)[shard_id] if len(doc)
               else np.zeros(0, object))
    by_source = {}
    for s in sorted(set(sources)):
        sel = sources == s
        available = sum(int(d.spans[d.split == SPLIT_CODES[split]].sum())
                        for n, d in shards.items() if n.split("/", 1)[0] == s)
        epochs = int(epoch[sel].max()) + 1
        scheduled = int(spans[sel].sum())
        by_source[s] = {"available": available, "epochs": epochs, "scheduled": scheduled,
                        "unused": available * epochs - scheduled}
    flow = {"scheduled": int(spans.sum()), "documents": len(doc), "sources": by_source}
    flow["pack"] = pack_flow(run, mix, split, flow, ledger)
    return flow


def pack_flow(run: RunLayout, mix: str, split: str, flow: dict, ledger: Ledger) -> dict:
    scope = f"{mix}/{split}"
    path = Path(run.pack(mix, split))
    if not path.exists():
        raise PipelineError(f"{path}: not found; run the pack stage for {scope}")
    p = read_json(path)
    row_tokens = p["n_rows"] * (p["seq_len"] + 1)
    ledger.add(Line("mix → pack", scope, "tokens", "scheduled", flow["scheduled"], "tokens_in", p["tokens_in"]))
    for s, f in flow["sources"].items():
        ledger.add(Line("mix → pack", scope, f"{s} tokens", "scheduled", f["scheduled"], "packed tokens_in",
                        p["tokens_by_source"].get(s, 0)))
    ledger.add(Line("pack", scope, "tokens in", "tokens_in", p["tokens_in"], "packed + dropped tail + truncated",
                    p["tokens_packed"] + p["dropped_tail_tokens"] + p["truncated_tokens"]))
    ledger.add(Line("pack", scope, "row tokens", "rows × (seq_len + 1)", row_tokens, "packed + pad",
                    p["tokens_packed"] + p["pad_tokens"]))
    keys = ("packing", "seq_len", "n_rows", "tokens_in", "tokens_packed", "dropped_tail_tokens", "pad_tokens",
            "truncated_tokens")
    return {k: p[k] for k in keys} | {"row_tokens": row_tokens}


# ----------------------------------------------------------------------------- the stage

def reconcile(params: dict, run_dir: str | os.PathLike) -> dict:
    """Reconcile the run's token flow; returns the report, raises PipelineError if unbalanced."""
    view = run_config(params)
    run = RunLayout.at(run_dir)
    columns = ["source", "shard", "documents", "empty_documents", "invalid_utf8_documents", "short_documents",
               "null_content_documents", "no_assistant_documents", "long_documents", "tokens", "chars"]
    counts = _read_table(Path(run.counts("counts.parquet")), columns, "run the count rule").to_pylist()
    missing = sorted(set(view.sources) - {c["source"] for c in counts})
    if missing:
        raise PipelineError(f"{run.counts('counts.parquet')} has no shards of source(s) {', '.join(missing)}; "
                            "rerun the "
                            "count rule")
    ledger = Ledger()
    by_source: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    shards: dict[str, ShardData] = {}
    for c in counts:
        q, shards[f"{c['source']}/{c['shard']}"] = shard_quantities(run, c, view.dedup.enabled,
                                                                     view.decontaminate.enabled, Path(view.data_dir))
        ledger.equations(q, f"{c['source']}/{c['shard']}", keep=False)
        for k, v in q.items():
            by_source[c["source"]][k] += v
    total = defaultdict(int)
    for s, q in sorted(by_source.items()):
        ledger.equations(q, s, keep=True)
        for k, v in q.items():
            total[k] += v
    ledger.equations(total, "all sources", keep=True)
    decontam_report(run, by_source, view.decontaminate.enabled, ledger)
    mixes = {m: {split: mix_flow(run, m, split, shards, ledger) for split in ("train", "val")} for m in view.mixes}
    ledger.raise_if_unbalanced()
    return {
        "ok": True,
        "sources": {s: dict(q) for s, q in sorted(by_source.items())},
        "total": dict(total),
        "mixes": mixes,
        "lines": [asdict(line) for line in ledger.lines],
    }


def decontam_report(run: RunLayout, by_source: dict, enabled: bool, ledger: Ledger) -> None:
    """The decontaminate report's flagged tokens per source against its flag files."""
    path = Path(run.decontam_report())
    if not enabled and not path.exists():
        return
    if not path.exists():
        raise PipelineError(f"{path}: not found; run the decontaminate stage")
    per_source = read_json(path)["per_source"]
    for s, q in sorted(by_source.items()):
        reported = per_source.get(s, {}).get("flagged", {}).get("tokens", 0)
        ledger.add(Line("tokenize → decontaminate", s, "flagged tokens", "flag files", q["flagged_tokens"],
                        "decontaminate report", reported))


def markdown(report: dict) -> str:
    """The report as markdown tables: flow per source, per mix, and every balance line."""
    out = ["# Token accounting", "",
           "Every number is exact; token counts from *tokenized* on include document delimiters.", "",
           "## Sources", "",
           "| source | counted rows | counted doc tokens | dropped empty / invalid / short "
           "| dropped null content / no assistant / long | tokenized docs "
           "| tokenized tokens (doc + delim) | dup removed | benchmark-contaminated removed | train | val |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, q in [*report["sources"].items(), ("**all**", report["total"])]:
        out.append(f"| {name} | {q['counted_rows']:,} | {q['counted_tokens']:,} | {q['dropped_empty']:,} / "
                   f"{q['dropped_invalid_utf8']:,} / "
                   f"{q['dropped_short']:,} ({q['dropped_short_tokens']:,} tok) | {q['dropped_null_content']:,} / "
                   f"{q['dropped_no_assistant']:,} / {q['dropped_long']:,} ({q['dropped_long_tokens']:,} tok) | "
                   f"{q['tokenized_docs']:,} | "
                   f"{q['tokenized_tokens']:,} "
                   f"({q['tokenized_doc_tokens']:,} + {q['tokenized_delimiter_tokens']:,}) | {q['dup_tokens']:,} | "
                   f"{q['contam_tokens']:,} | "
                   f"{q['train_tokens']:,} | {q['val_tokens']:,} |")
    out += ["", "## Dedup", "", "| source | removed within the run | removed against dedup.reference |",
            "|---|---:|---:|"]
    for name, q in [*report["sources"].items(), ("**all**", report["total"])]:
        out.append(f"| {name} | {q['removed_within_docs']:,} docs ({q['removed_within_tokens']:,} tok) | "
                   f"{q['removed_reference_docs']:,} docs ({q['removed_reference_tokens']:,} tok) |")
    out += ["", "## Mixes", "", "| mix / split | source | available | epochs | scheduled | unused |",
            "|---|---|---:|---:|---:|---:|"]
    for m, splits in report["mixes"].items():
        for split, f in splits.items():
            for s, v in f["sources"].items():
                out.append(f"| {m}/{split} | {s} | {v['available']:,} | {v['epochs']} | {v['scheduled']:,} | "
                           f"{v['unused']:,} |")
    out += ["", "| mix / split | packing | scheduled | packed | dropped tail | truncated | pad | rows × (seq_len+1) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for m, splits in report["mixes"].items():
        for split, f in splits.items():
            p = f["pack"]
            out.append(f"| {m}/{split} | {p['packing']} | {f['scheduled']:,} | {p['tokens_packed']:,} | "
                       f"{p['dropped_tail_tokens']:,} | "
                       f"{p['truncated_tokens']:,} | {p['pad_tokens']:,} | {p['n_rows']:,} × {p['seq_len'] + 1} = "
                       f"{p['row_tokens']:,} |")
    out += ["", "## Balance checks", "", "| arrow | scope | check | left | right | ok |", "|---|---|---|---:|---:|---|"]
    for ln in report["lines"]:
        ok = "✓" if ln["lhs"] == ln["rhs"] else "✗"
        out.append(f"| {ln['arrow']} | {ln['scope']} | {ln['check']} | {ln['lhs_label']} = {ln['lhs']:,} | "
                   f"{ln['rhs_label']} = {ln['rhs']:,} | {ok} |")
    return "\n".join(out) + "\n"


def run_accounting(params: dict, run_dir, out_json, out_md) -> dict:
    report = reconcile(params, run_dir)
    report["meta"] = provenance("accounting", params, [RunLayout.at(run_dir).counts("counts.parquet")])
    with atomic_write(out_md, "w", encoding="utf-8") as f:
        f.write(markdown(report))
    write_json(out_json, report)
    t = report["total"]
    log.info("balanced: %d counted document tokens -> %d tokenized -> %d train + %d val; %d lines checked",
             t["counted_tokens"], t["tokenized_tokens"], t["train_tokens"], t["val_tokens"], len(report["lines"]))
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.accounting", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--run-dir", required=True, help="R = {results_dir}/{run_name}")
    ap.add_argument("--out", required=True, help="R/accounting.json")
    ap.add_argument("--out-md", required=True, help="R/accounting.md")
    args = ap.parse_args(argv)
    run_accounting(params_from_args(args, accounting_slice), args.run_dir, args.out, args.out_md)


if __name__ == "__main__":
    run_cli(main)
