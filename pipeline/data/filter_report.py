r"""The filter funnel of a run: what every filter removed, per source, in removal order, with examples.

    python -m pipeline.data.filter_report --params JSON --raw <raw shards> --decisions <decisions files> \
        [--tokens <tokenized shard .json files>] --out-json R/filtered/report.json \
        --out-md R/filtered/report.md --out-png R/filtered/funnel.png

`filter_report` reads the filter stage's per-shard decisions (docs/filters.md) and writes, per source,
the funnel (documents and characters each filter removed, by rule), lines and spans edited, the language
distribution, the kept tokens (with ``--tokens``) and sampled examples of each filter's removals.

The inputs, the identities the funnel holds and the outputs: docs/data-stages.md, "The filter funnel".
"""
from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import add_config_args, filter_report_slice, params_from_args
from pipeline.data.contract import doc_text, load_shard_meta, open_parquet, source_column
from pipeline.data.text_filters import DECISION_COLUMNS, PII, Filter, build_chain
from pipeline.errors import PipelineError
from pipeline.io import atomic_path, atomic_write, get_logger, provenance, run_cli, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)

EXCERPT_CHARS = 400  # of a removed document's raw text shown in the report
TOP_LANGUAGES = 8  # languages listed by name per source; the rest are summed as "other"


def _shard_key(path: str | Path, suffix: str) -> tuple[str, str]:
    """(source, shard) of `{dir}/{source}/{shard}{suffix}`."""
    p = Path(path)
    return p.parent.name, p.name.removesuffix(suffix)


def read_decisions(raw: str | Path, decisions: str | Path) -> dict[str, np.ndarray]:
    """One shard's decisions as columns, checked against its raw shard (one row per raw row)."""
    if _shard_key(raw, ".parquet") != _shard_key(decisions, ".decisions.parquet"):
        raise PipelineError(f"{decisions}: not the decisions of {raw} (source/shard names differ); pass --raw and "
                            "--decisions in the same order")
    if not Path(decisions).exists():
        raise PipelineError(f"{decisions}: decisions file not found; run the filter rule for {raw}")
    table = pq.read_table(decisions)
    missing = [c for c in DECISION_COLUMNS if c not in table.column_names]
    if missing:
        raise PipelineError(f"{decisions}: no column(s) {', '.join(missing)}; it was not written by the filter "
                            "stage (or by an older one): rerun the filter rule")
    n_raw = open_parquet(raw).metadata.num_rows
    if table.num_rows != n_raw:
        raise PipelineError(f"{decisions}: {table.num_rows} decisions for the {n_raw} rows of {raw}; the raw shard "
                            "changed after filtering: rerun the filter rule")
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in DECISION_COLUMNS}


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([p[c] for p in parts]) for c in DECISION_COLUMNS}


def raw_excerpts(raw: str | Path, rows: list[int], source: dict) -> list[str]:
    """The first EXCERPT_CHARS characters of the given rows' text (a conversation's contents joined)."""
    pf = open_parquet(raw)
    column = source_column(pf, raw, source)
    # only the row groups that hold the rows: a web shard's text column can be gigabytes
    starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
    group_of = {r: int(np.searchsorted(starts, r, side="right")) - 1 for r in rows}
    groups = sorted(set(group_of.values()))
    shift, before = {}, 0  # a row's place in the table of the groups read: r - starts[g] + rows of earlier groups
    for g in groups:
        shift[g] = before - int(starts[g])
        before += int(starts[g + 1] - starts[g])
    out = []
    table = pf.read_row_groups(groups, columns=[column])
    for v in table.column(column).take([r + shift[group_of[r]] for r in rows]).to_pylist():
        text = v.decode("utf-8", "replace") if isinstance(v, bytes) else doc_text(v or "")
        out.append(text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else ""))
    return out


def source_funnel(name: str, chain: list[Filter], raws: list[str], dec: list[dict], source: dict, seed: int,
                  examples: int) -> dict:
    """The funnel of one source (docs/data-stages.md, "The filter funnel") from its shards' raw paths and decisions."""
    d = _concat(dec)
    shard_of = np.concatenate([np.full(len(p["kept"]), i) for i, p in enumerate(dec)])
    row_of = np.concatenate([np.arange(len(p["kept"])) for p in dec])
    order = [f.name for f in chain]
    unknown = sorted(set(d["filter"][~d["kept"]].tolist()) - set(order))
    if unknown:
        raise PipelineError(f"source {name}: decisions name filter(s) {', '.join(unknown)} that the filter list "
                            f"({', '.join(order)}) does not enable; the decisions are stale: rerun the filter rule")
    kept = d["kept"]
    n_in, chars_in = len(kept), int(d["chars_in"].sum())
    left_docs, left_chars, steps, picks = n_in, chars_in, [], []
    for f in chain:
        hit = (~kept) & (d["filter"] == f.name)
        removed, chars = int(hit.sum()), int(d["chars_in"][hit].sum())
        left_docs, left_chars = left_docs - removed, left_chars - chars
        idx = np.nonzero(hit)[0].tolist()
        picked = sorted(random.Random(f"{seed}/{name}/{f.name}").sample(idx, min(examples, len(idx))))
        samples = [{"shard": Path(raws[shard_of[i]]).name, "row": int(row_of[i]), "rule": str(d["rule"][i]),
                    "value": float(d["value"][i]), "threshold": float(d["threshold"][i])} for i in picked]
        picks += zip(picked, samples)
        steps.append({"filter": f.name, "documents_removed": removed, "chars_removed": chars,
                      "rules": dict(Counter(d["rule"][hit].tolist()).most_common()), "documents_left": left_docs,
                      "chars_left": left_chars,
                      # the edits each filter makes to the documents it keeps (c4 removes lines, pii replaces spans)
                      "lines_removed": int(d["lines_removed"][kept].sum()) if f.line_filter else 0,
                      "spans_replaced": int(d["spans_replaced"][kept].sum()) if isinstance(f, PII) else 0,
                      "examples": samples})
    for s, shard in enumerate(raws):  # one read of each shard's text column for all its examples
        mine = [(i, e) for i, e in picks if shard_of[i] == s]
        for (_, e), text in zip(mine, raw_excerpts(shard, [e["row"] for _, e in mine], source) if mine else []):
            e["excerpt"] = text
    chars_out = int(d["chars_out"][kept].sum())
    languages = Counter(lang or "(not identified)" for lang in d["language"].tolist())
    top = dict(languages.most_common(TOP_LANGUAGES))
    if len(languages) > TOP_LANGUAGES:
        top["other"] = n_in - sum(top.values())
    return {
        "source": name, "shards": len(raws), "documents_in": n_in, "chars_in": chars_in,
        "documents_kept": int(kept.sum()), "chars_kept_in": int(d["chars_in"][kept].sum()), "chars_out": chars_out,
        "chars_edited": int(d["chars_in"][kept].sum()) - chars_out,
        "lines_removed": int(d["lines_removed"][kept].sum()), "spans_replaced": int(d["spans_replaced"][kept].sum()),
        "languages": top, "funnel": steps,
    }


def check_filtered(decisions: Path, kept: int) -> None:
    """The filtered shard beside the decisions (``{shard}.parquet``), where there is one (a run; not
    scripts/filter_funnel.py), must hold exactly the documents they keep."""
    filtered = decisions.with_name(decisions.name.removesuffix(".decisions.parquet") + ".parquet")
    if filtered.exists() and (n := open_parquet(filtered).metadata.num_rows) != kept:
        raise PipelineError(f"{filtered}: {n} documents but its decisions keep {kept}; the filter job was "
                            "interrupted or its outputs mixed: rerun the filter rule")


def add_tokens(report: dict, tokens: list[str], kept_per_shard: dict[tuple[str, str], int]) -> None:
    """Add each source's tokens after tokenize (the tokenized shards' `counts`); every shard's row count must
    equal the documents the filter kept there (the filtered shard is what tokenize read)."""
    by_source: dict[str, int] = {}
    for path in tokens:
        meta = load_shard_meta(path)
        key = (meta["source"], meta["shard"])
        if key not in kept_per_shard:
            raise PipelineError(f"{path}: tokenized shard {key[0]}/{key[1]} has no decisions among --decisions; "
                                "pass the tokenized metadata of the filtered shards only")
        counts = meta["counts"]
        rows = int(counts["documents"])  # every row tokenize read, empty and invalid ones included
        if rows != kept_per_shard[key]:
            raise PipelineError(f"{path}: tokenize read {rows} rows of {key[0]}/{key[1]} but the filter kept "
                                f"{kept_per_shard[key]}; the tokenized shard is stale: rerun tokenize")
        by_source[key[0]] = by_source.get(key[0], 0) + int(counts["tokens"])
    for s in report["sources"]:
        s["tokens_kept"] = by_source.get(s["source"])


def plot_funnel(sources: list[dict], out_png: str | Path) -> None:
    """One panel per source: the documents left after each filter (bars), labelled with what it removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sources), 1, figsize=(8, 0.5 + 0.45 * (2 + max(len(s["funnel"]) for s in sources))
                                                       * len(sources)), dpi=120, squeeze=False)
    for ax, s in zip(axes[:, 0], sources):
        labels = ["input"] + [st["filter"] for st in s["funnel"]]
        left = [s["documents_in"]] + [st["documents_left"] for st in s["funnel"]]
        y = np.arange(len(labels))[::-1]
        ax.barh(y, left, color=["C7"] + ["C0"] * len(s["funnel"]))
        for yi, st in zip(y[1:], s["funnel"]):
            note = f"−{st['documents_removed']:,}"
            if st["lines_removed"]:
                note += f" ({st['lines_removed']:,} lines)"
            if st["spans_replaced"]:
                note += f" ({st['spans_replaced']:,} spans)"
            ax.text(st["documents_left"], yi, f" {note}", va="center", fontsize=7)
        ax.set_yticks(y, labels)
        ax.set_xlim(0, max(s["documents_in"], 1) * 1.25)
        ax.set_title(f"{s['source']}: {s['documents_kept']:,} of {s['documents_in']:,} documents kept", fontsize=9)
        ax.set_xlabel("documents left")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f} %" if b else "–"


def markdown(report: dict, png_name: str) -> str:
    lines = ["# Filter funnel", "", f"![documents left after each filter]({png_name})", ""]
    for s in report["sources"]:
        tokens = "" if s.get("tokens_kept") is None else f", {s['tokens_kept']:,} tokens after tokenize"
        lines += [f"## {s['source']}", "",
                  f"{s['documents_in']:,} documents ({s['chars_in']:,} characters) in {s['shards']} shard(s); "
                  f"{s['documents_kept']:,} kept ({_pct(s['documents_kept'], s['documents_in'])}), "
                  f"{s['chars_out']:,} characters after line removal and scrubbing{tokens}.", "",
                  "| filter | documents removed | % of input | characters removed | documents left | rules |",
                  "|---|---|---|---|---|---|"]
        for st in s["funnel"]:
            rules = ", ".join(f"{r} {n:,}" for r, n in st["rules"].items()) or "–"
            lines.append(f"| {st['filter']} | {st['documents_removed']:,} | "
                         f"{_pct(st['documents_removed'], s['documents_in'])} | {st['chars_removed']:,} | "
                         f"{st['documents_left']:,} | {rules} |")
        lines += ["", f"In the kept documents: {s['lines_removed']:,} lines removed, {s['spans_replaced']:,} spans "
                  f"replaced (e-mails, IPs), {s['chars_edited']:,} characters changed by these edits.", "",
                  "Languages (every input document): "
                  + ", ".join(f"{lang} {n:,}" for lang, n in s["languages"].items()) + "."]
        for st in s["funnel"]:
            if not st["examples"]:
                continue
            lines += ["", f"### {s['source']}: removed by {st['filter']}", ""]
            for e in st["examples"]:
                lines += [f"**{e['shard']} row {e['row']}**: {e['rule']} {e['value']:.4g} "
                          f"(threshold {e['threshold']:.4g})", "", "```", e["excerpt"].replace("```", "'''"), "```",
                          ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def filter_report(params: dict, raw: list[str], decisions: list[str], out_json, out_md, out_png,
                  tokens: list[str] = (), examples: int = 3) -> dict:
    if len(raw) != len(decisions):
        raise PipelineError(f"{len(raw)} raw shards but {len(decisions)} decisions files; pass one decisions "
                            "file per raw shard, in the same order")
    if not raw:
        raise PipelineError("no shards given; pass the raw shards with --raw and their decisions with --decisions")
    view = run_config(params)
    # build_chain validates the list as the filter rule does; its enabled filters are the removal order
    chain = [f for f in build_chain(params.get("filter")) if f.enabled]
    by_source: dict[str, tuple[list[str], list[dict]]] = {}
    kept_per_shard = {}
    for r, dpath in zip(raw, decisions):
        d = read_decisions(r, dpath)
        name = _shard_key(r, ".parquet")[0]
        if name not in view.sources:
            raise PipelineError(f"{r}: source {name!r} is not in sources: ({', '.join(view.sources)}); pass "
                                "the shards of the run's sources")
        by_source.setdefault(name, ([], []))
        by_source[name][0].append(str(r))
        by_source[name][1].append(d)
        kept = kept_per_shard[_shard_key(r, ".parquet")] = int(d["kept"].sum())
        check_filtered(Path(dpath), kept)
    seed = view.seed
    report = {"filters": [f.name for f in chain], "seed": seed, "sources": [
        source_funnel(n, chain, rs, ds, view.sources[n], seed, examples) for n, (rs, ds) in by_source.items()]}
    if tokens:
        add_tokens(report, tokens, kept_per_shard)
    plot_funnel(report["sources"], out_png)
    with atomic_write(out_md, encoding="utf-8") as f:
        f.write(markdown(report, Path(out_png).name))
    report["meta"] = provenance("filter_report", params, [*raw, *decisions, *tokens])
    write_json(out_json, report)
    for s in report["sources"]:
        log.info("%s: %d of %d documents kept", s["source"], s["documents_kept"], s["documents_in"])
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.data.filter_report", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--raw", nargs="+", required=True, help="the raw shards, {data_dir}/{source}/{shard}.parquet")
    p.add_argument("--decisions", nargs="+", required=True,
                   help="their decisions, R/filtered/{source}/{shard}.decisions.parquet, in the same order")
    p.add_argument("--tokens", nargs="*", default=[], help="optional: tokenized shards' metadata, R/tokens/…/*.json")
    p.add_argument("--examples", type=int, default=3, help="removed documents shown per filter and source")
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    p.add_argument("--out-png", required=True)
    args = p.parse_args(argv)
    filter_report(params_from_args(args, filter_report_slice), args.raw, args.decisions, args.out_json, args.out_md,
                  args.out_png, args.tokens, args.examples)


if __name__ == "__main__":
    run_cli(main)
