"""`RunLayout`: the one owner of every path a run writes (docs/data-contract.md names each one).

    L = RunLayout.of(cfg)              # R = results_dir/run_name, logs under logs/run_name
    L.tokens("web", "00000")           # R/tokens/web/00000.json
    L.tokens()                         # R/tokens/{source}/{shard}.json: the Snakemake pattern

Every method takes the wildcard values of its path; one left out stays a `{wildcard}` for Snakemake.
The .smk files, the stages that read a whole run (accounting, the plan, the stage report, compare) and
the tests ask it; nothing else joins paths under R.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

S, SH, G = "{source}", "{shard}", "{group}"


@dataclass(frozen=True)
class RunLayout:
    root: str   # R: results_dir/run_name
    logs: str   # logs/run_name (beside R, so a cleaned results tree keeps its logs)

    @classmethod
    def of(cls, cfg: dict) -> RunLayout:
        return cls(str(Path(cfg["results_dir"]) / cfg["run_name"]), f"logs/{cfg['run_name']}")

    @classmethod
    def at(cls, run_dir: str | Path) -> RunLayout:
        """The layout of an existing run directory (its logs are not looked at)."""
        run = Path(run_dir)
        return cls(str(run), f"logs/{run.name}")

    def _r(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    # ---- per-shard data stages: R/<stage>/<source>/<shard>.<ext>, one manifest per group of shards
    def manifest(self, stage: str, source: str = S, group: str = G) -> str:
        """R/<stage>/<source>/_manifest/<group>.json, stage one of filtered, tokens, dedup/sig, decontam."""
        return self._r(stage, source, "_manifest", f"{group}.json")

    def filtered(self, source: str = S, shard: str = SH, ext: str = "parquet") -> str:
        """The filtered shard (ext parquet) or its per-document decisions (ext decisions.parquet)."""
        return self._r("filtered", source, f"{shard}.{ext}")

    def filter_report(self, ext: str = "json") -> str:
        """The filter funnel: report.json, report.md, funnel.png (ext png)."""
        return self._r("filtered", "funnel.png" if ext == "png" else f"report.{ext}")

    def tokenizer(self) -> str:
        return self._r("tokenizer", "encoding.json")

    def tokens(self, source: str = S, shard: str = SH, ext: str = "json") -> str:
        """A tokenized shard: its metadata (json), tokens (bin) and document index (idx.npy)."""
        return self._r("tokens", source, f"{shard}.{ext}")

    def counts(self, name: str) -> str:
        """R/counts/<name>: sample.parquet, sample.json, counts.parquet, summary.json."""
        return self._r("counts", name)

    def plan(self, ext: str = "json") -> str:
        return self._r(f"plan.{ext}")

    def dedup_signatures(self, source: str = S, shard: str = SH) -> str:
        return self._r("dedup", "sig", source, f"{shard}.parquet")

    def dedup_segment(self, seg: str | int = "{seg}", name: str = "index.json") -> str:
        """R/dedup/seg/<seg>/<name>: a dedup segment's job inputs (index.json, pairs/<part>.parquet)."""
        return self._r("dedup", "seg", str(seg), name)

    def dedup_pairs(self, seg: str | int = "{seg}", part: str | int = "{part}") -> str:
        return self.dedup_segment(seg, f"pairs/{part}.parquet")

    def dedup_index_dir(self) -> str:
        """R/dedup/index: the run's dedup index (its manifest index.json and one directory per segment), which a
        later run names in dedup.reference."""
        return self._r("dedup", "index")

    def dedup_index_part(self, seg: str | int = "{seg}", name: str = "segment.json") -> str:
        """R/dedup/index/<seg>/<name>: a segment's part of the index (segment.json, bands/<part>.npy, ...)."""
        return self._r("dedup", "index", str(seg), name)

    def dedup_keep(self, source: str = S, shard: str = SH) -> str:
        return self._r("dedup", "keep", source, f"{shard}.parquet")

    def dedup_report(self) -> str:
        return self._r("dedup", "report.json")

    def eval_tasks(self) -> str:
        """The CORE tasks (eval_data): R/eval_data/tasks.json."""
        return self._r("eval_data", "tasks.json")

    def decontam(self, source: str = S, shard: str = SH, ext: str = "parquet") -> str:
        """A shard's contamination flags (parquet) and their summary (json)."""
        return self._r("decontam", source, f"{shard}.{ext}")

    def decontam_grams(self) -> str:
        return self._r("decontam", "grams.parquet")

    def decontam_report(self) -> str:
        return self._r("decontam", "report.json")

    def split(self, source: str = S, shard: str = SH) -> str:
        return self._r("split", source, f"{shard}.parquet")

    def split_report(self) -> str:
        return self._r("split", "report.json")

    def mix(self, mix: str = "{mix}", split: str = "{split}") -> str:
        """A mix's schedule of documents (split train or val), or its report (split report)."""
        return self._r("mix", mix, "report.json" if split == "report" else f"{split}.parquet")

    def pack(self, mix: str = "{mix}", split: str = "{split}", ext: str = "json") -> str:
        """Packed rows: metadata (json), tokens (bin), document ids (docs.npy)."""
        return self._r("pack", mix, f"{split}.{ext}")

    def accounting(self, ext: str = "json") -> str:
        return self._r(f"accounting.{ext}")

    # ---- training and evaluation
    def train_dir(self, stage: str = "{stage}") -> str:
        """R/train/<stage>: checkpoints, metrics.jsonl, summary.json, the lease."""
        return self._r("train", stage)

    def final(self, stage: str = "{stage}") -> str:
        return self._r("train", stage, "final.pt")

    def train_summary(self, stage: str = "{stage}") -> str:
        return self._r("train", stage, "summary.json")

    def segment(self, stage: str = "{stage}", k: int | str = "{segment}") -> str:
        """The marker of the k-th job of a stage's chain of jobs."""
        return self.segment_in(self.train_dir(stage), k)

    @staticmethod
    def segment_in(train_dir: str | Path, k: int | str) -> str:
        """The k-th job's marker inside a train directory (what the trainer writes, given its --outdir)."""
        return f"{train_dir}/segments/{k}.json"

    def eval(self, stage: str = "{stage}", name: str = "report.json") -> str:
        """R/eval/<stage>/<name>: report.json, report.md, loss.png, core.png, core_items.jsonl, ..."""
        return self._r("eval", stage, name)

    def stages_report(self, ext: str = "json") -> str:
        return self._r("eval", f"stages.{ext}")

    def export_hf(self) -> str:
        return self._r("export", "hf")

    def scaling(self, name: str) -> str:
        """R/scaling/<name>: the sweep's fit.json, report.md, scaling.png."""
        return self._r("scaling", name)

    def scaling_point(self, budget: str = "{budget}", depth: str | int = "{depth}", name: str = "report.json") -> str:
        """R/scaling/<budget>/<depth>/<name>: a point's report.json, its train/ directory (name "train"),
        train/final.pt and train/metrics.jsonl."""
        return self._r("scaling", str(budget), str(depth), name)

    def benchmarks(self) -> str:
        return self._r("benchmarks")

    def stage_dir(self, stage: str) -> str:
        """A data stage's directory (filtered, tokens, dedup/sig, decontam, ...), for a rule's --outdir."""
        return self._r(stage)

    # ---- beside R
    def log(self, *parts: str) -> str:
        """logs/<run_name>/<parts>.log"""
        return "/".join((self.logs, *parts)) + ".log"

    def bench(self, *parts: str) -> str:
        """R/benchmarks/<parts>.tsv: Snakemake's benchmark table of a job."""
        return "/".join((self.root, "benchmarks", *parts)) + ".tsv"
