"""Group manifests: the declared "done" output of a job that processed a group of shards.

Per-shard stages run one Snakemake job per *group* of `shards_per_job` shards (1 by default, 16 in
the FineWeb presets) so that the DAG over thousands of shards stays small enough to plan in seconds.
Each shard's own outputs are still written atomically by its stage; when every shard of the group
is done, the job writes this manifest listing them (path and size) with provenance metadata.

    python -m pipeline.manifest --stage count --out R/counts/web/_manifest/shard_00000.json FILE...
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.io import PipelineError, provenance, run_cli, write_json


def write_manifest(stage: str, out: str | Path, files: list[str]) -> dict:
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise PipelineError(f"{stage}: expected outputs are missing: {', '.join(missing[:5])}"
                            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    manifest = {
        "stage": stage,
        "files": [{"path": str(f), "bytes": Path(f).stat().st_size} for f in files],
        "meta": provenance("manifest", {"stage": stage}),
    }
    write_json(out, manifest)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.manifest", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    write_manifest(args.stage, args.out, args.files)


if __name__ == "__main__":
    run_cli(main)
