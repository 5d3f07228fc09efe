"""Adding a data rule touches four files (docs/adding-a-rule.md): in a copy of the project, a throwaway rule made
of its module, its .smk and its spec entry, with a test of its own, and nothing else, is parsed and linted by
Snakemake, scheduled by `snakemake -n`, priced by the cost plan, and accepted by the checks of tests/test_rules.py
and tests/test_cluster.py (its spec is what Snakemake parses; the plan's jobs are Snakemake's DAG)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import ROOT

from pipeline.config import load_config, shard_groups

MODULE = '''"""Each filtered shard's documents and characters, per shard group.

    python -m pipeline.data.doc_lengths --params JSON --inputs F [F ...] --out R/doc_lengths/S/_manifest/G.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import Keys, add_config_args, params_from_args
from pipeline.config.rule_params import TEXT_KEYS
from pipeline.io import run_cli, write_json

SLICE = Keys("seed", sources=TEXT_KEYS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.doc_lengths", description=__doc__.split("\\n")[0])
    add_config_args(ap)
    ap.add_argument("--inputs", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    params = params_from_args(args, SLICE)
    texts = {Path(f).stem: pq.read_table(f, columns=["text"])["text"].to_pylist() for f in args.inputs}
    write_json(args.out, {"params": params, "shards": {
        name: {"documents": len(t), "chars": sum(map(len, t))} for name, t in texts.items()}})


if __name__ == "__main__":
    run_cli(main)
'''

SMK = '''# Each filtered shard's documents and characters (pipeline/data/doc_lengths.py), one job per shard group.
TARGETS += group_manifests(L.stage_dir("doc_lengths"))


rule doc_lengths:
    input:
        L.manifest("filtered"),
    output:
        L.manifest("doc_lengths"),
    params:
        p=rule_params("doc_lengths"),
        code=rule_code("doc_lengths"),
        inputs=group_files(L.filtered()),
    log:
        L.log("doc_lengths", "{source}", "{group}"),
    benchmark:
        L.bench("doc_lengths", "{source}", "{group}")
    threads: job_threads("doc_lengths")
    resources:
        **job_resources("doc_lengths"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.doc_lengths --params {params.p:q} --inputs {params.inputs:q} --out {output:q} "
        "2>&1 | tee {log:q}"
'''

SPEC = '''    Rule("doc_lengths", ("data.doc_lengths",), MODULE_SLICE, job_sizes.small_size, "source",
         rate=("bytes", 50e6, 0.5), after=("filter",)),
'''

OWN_TEST = '''"""doc_lengths (pipeline/data/doc_lengths.py) by hand, from a full config."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
from builders import ROOT

from pipeline.config import load_config
from pipeline.data import doc_lengths
from pipeline.rules import rule_params


def test_doc_lengths_counts_each_shards_documents_and_characters(tmp_path):
    pq.write_table(pa.table({"text": ["one", "three"]}), tmp_path / "00000.parquet")
    doc_lengths.main(["--configfile", str(ROOT / "config.yaml"), "--inputs", str(tmp_path / "00000.parquet"),
                      "--out", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["shards"] == {"00000": {"documents": 2, "chars": 8}}
    assert out["params"] == rule_params(load_config(ROOT / "config.yaml"), "doc_lengths")
'''

NEW_FILES = {"pipeline/data/doc_lengths.py": MODULE, "workflow/rules/doc_lengths.smk": SMK,
             "tests/test_doc_lengths.py": OWN_TEST}
COPIED = ("pipeline", "workflow", "tests", "benchmarks", "envs", "configs", "Snakefile", "config.yaml",
          "pyproject.toml")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the project (its sample data linked) with the rule doc_lengths added."""
    dest = tmp_path_factory.mktemp("project")
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("*.pyc", ".pytest_cache"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    (dest / "data").symlink_to(ROOT / "data")
    for path, text in NEW_FILES.items():
        (dest / path).write_text(text)
    rules = dest / "pipeline/rules.py"
    anchor = '    Rule("tokenizer",'  # its entry in DAG order: after filter
    assert anchor in rules.read_text()
    rules.write_text(rules.read_text().replace(anchor, SPEC + anchor, 1))
    return dest


def run(project: Path, *cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(project),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=cwd or project, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_the_rule_is_its_module_its_smk_its_spec_entry_and_its_test(project):
    def same(p: Path) -> bool:
        orig = ROOT / p.relative_to(project)
        return orig.is_file() and orig.read_bytes() == p.read_bytes()

    files = [p for name in COPIED for p in [project / name, *(project / name).rglob("*")] if p.is_file()]
    changed = {p.relative_to(project).as_posix() for p in files if "__pycache__" not in p.parts and not same(p)}
    assert changed == {*NEW_FILES, "pipeline/rules.py"}


@pytest.mark.slow
def test_snakemake_parses_and_schedules_it_and_the_cost_plan_prices_it(project, tmp_path):
    cfg = load_config(ROOT / "config.yaml")
    groups = sum(len(shard_groups(cfg, s)) for s in cfg["sources"])
    run(project, "snakemake", "--lint", "-s", str(project / "Snakefile"))
    (tmp_path / "data").symlink_to(ROOT / "data")
    dry = run(project, "snakemake", "-n", "-s", str(project / "Snakefile"), "-d", str(tmp_path), cwd=tmp_path)
    assert re.search(rf"^doc_lengths\s+{groups}$", dry.stdout, re.M), dry.stdout[-3000:]
    plan = run(project, sys.executable, "-m", "pipeline.plan", "--configfile", "config.yaml", "--data-cpus", "8")
    assert re.search(rf"^\s+doc_lengths\s+{groups}\s", plan.stdout, re.M), plan.stdout[-3000:]


@pytest.mark.slow
def test_the_rule_checks_accept_it(project):
    checks = ("tests/test_doc_lengths.py", "tests/test_rules.py",
              "tests/test_cluster.py::test_the_cost_plans_job_graph_has_snakemakes_edges",
              "tests/test_cluster.py::test_the_cost_plan_and_the_rehearsal_cover_every_data_rule",
              "tests/test_cluster.py::test_every_rule_has_resources")
    out = run(project, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not llama3 and not gpt",
              *checks).stdout
    assert re.search(r"\b\d+ passed", out) and "failed" not in out and "error" not in out, out[-3000:]
