"""pipeline.codehash: a rule's code hash is over the definitions its entry modules can reach, normalised (a
docstring, comment or formatting edit changes nothing), read through a cache of each source's summary (the same
hashes with it or without it, a source whose text changed parsed again, a cache it cannot read or write only
slower). The dry-run reruns and the tracer check on a real run are tests/test_workflow.py's."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import ROOT, insert_pass, reword_docs, user_env

from pipeline import codehash
from pipeline.codehash import Package, code_version

ENTRIES = ("pipeline.data.tokenize", "pipeline.training.train", "pipeline.evaluation.evaluate", "pipeline.plan")
DATA = ("pipeline.data.download", "pipeline.data.train_tokenizer", "pipeline.data.tokenize")


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A copy of the package a test may edit (restoring what it edits), and a cache file shared by its tests."""
    root = tmp_path_factory.mktemp("pkg") / "pipeline"
    shutil.copytree(ROOT / "pipeline", root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def package(root: Path) -> Package:
    """A new process's view of `root`: nothing in memory, the shared cache file as it is."""
    return Package(root, cache_file=root.parent / "cache.json")


def edited(path: Path, edit) -> str:
    """Apply `edit` (source -> source) to `path`; the old text, to restore."""
    source = path.read_text()
    path.write_text(edit(source))
    return source


def rule_versions(root: Path, entries=ENTRIES + DATA) -> dict[str, str]:
    p = package(root)
    return {e: codehash.digest(p.definitions(e)) for e in entries}


def test_docstrings_comments_and_formatting_change_no_hash(copy):
    before = rule_versions(copy)
    old = {p: edited(p, reword_docs) for p in copy.rglob("*.py")}
    try:
        assert all(p.read_text() != text for p, text in old.items())  # every module's bytes differ
        assert rule_versions(copy) == before
    finally:
        for p, text in old.items():
            p.write_text(text)


def test_a_minhash_body_edit_changes_the_dedup_hash_only(copy):
    """`signatures` is dedup's maths: tokenize, which imports minhash (data/contract.py's fmix64), is not rerun."""
    before = rule_versions(copy, ("pipeline.data.dedup", *DATA))
    path = copy / "data/minhash.py"
    old = edited(path, lambda s: insert_pass(s, "signatures"))
    try:
        after = rule_versions(copy, ("pipeline.data.dedup", *DATA))
    finally:
        path.write_text(old)
    assert after["pipeline.data.dedup"] != before["pipeline.data.dedup"]
    assert {e: after[e] for e in DATA} == {e: before[e] for e in DATA}
    # what the data rules hash of minhash: none of its functions but the one contract.py's names use
    p = package(copy)
    for e in DATA:
        assert {k for k in p.definitions(e) if k.startswith("pipeline.data.minhash:") and k[22].islower()} <= {
            "pipeline.data.minhash:fmix64"}, e


def test_what_is_reached(copy):
    p = package(copy)
    dedup, train, evaluate = (p.definitions(e) for e in ("pipeline.data.dedup", "pipeline.training.train",
                                                         "pipeline.evaluation.evaluate"))
    assert {"pipeline.data.dedup:main", "pipeline.data.dedup:<main>", "pipeline.data.minhash:signatures",
            "pipeline.io:run_cli"} <= set(dedup)
    assert "pipeline.data.minhash:signatures" not in train
    # imported inside a function: train scores CORE during training (pipeline.evaluation.core_benchmark)
    assert any(k.startswith("pipeline.evaluation.core_benchmark:") for k in train)
    assert "pipeline.evaluation.core_benchmark:<main>" not in train  # another module's __main__ block is not run
    assert "pipeline.training.train:main" not in evaluate


def test_a_module_run_by_name_or_used_as_a_value_is_reached_whole(copy):
    path = copy / "bench/by_name.py"
    path.write_text("import subprocess\nimport sys\n\nfrom pipeline.planning import compute as budget\n\n\n"
                    "def main():\n    subprocess.run([sys.executable, '-m', 'pipeline.data.count'])\n"
                    "    return getattr(budget, sys.argv[1])\n")
    try:
        reached = package(copy).definitions("pipeline.bench.by_name")
    finally:
        path.unlink()
    assert {"pipeline.data.count:main", "pipeline.data.count:<main>"} <= set(reached)
    assert {k for k in reached if k.startswith("pipeline.planning.compute:")} == {
        f"pipeline.planning.compute:{k}" for k in package(copy).summary("pipeline.planning.compute")["defs"]}


def test_an_import_a_definition_uses_is_part_of_its_hash(copy):
    path = copy / "data/minhash.py"
    before = rule_versions(copy, ("pipeline.data.dedup",))
    old = edited(path, lambda s: s.replace("import numpy as np\n", "import numpy as np_\nimport numpy.ma as np\n"))
    try:
        assert rule_versions(copy, ("pipeline.data.dedup",)) != before
    finally:
        path.write_text(old)


def test_hashes_are_the_same_from_the_cache(copy, monkeypatch):
    cache = copy.parent / "cache.json"
    cache.unlink(missing_ok=True)
    cold = rule_versions(copy)
    assert len(json.loads(cache.read_text())) >= 40
    parsed = []
    monkeypatch.setattr(codehash, "summarise", lambda *a: parsed.append(a[0]))
    assert rule_versions(copy) == cold
    assert parsed == []  # every source came from the file


def test_a_changed_source_is_parsed_again(copy):
    cache = copy.parent / "cache.json"
    rule_versions(copy, ("pipeline.plan",))
    entries = json.loads(cache.read_text())
    # the cache's claim about an older text of pipeline.plan: that main is `pass`
    fake = codehash.summarise("pipeline.plan", b"def main():\n    pass\n", False)
    stale = {k.rpartition(" ")[0] + " " + "0" * 64: fake for k in entries if k.startswith("pipeline.plan ")}
    others = {k: v for k, v in entries.items() if not k.startswith("pipeline.plan ")}
    cache.write_text(json.dumps({**stale, **others}))
    assert "pipeline.planning.parallel:resolve_parallel" in package(copy).definitions("pipeline.plan")
    kept = json.loads(cache.read_text())
    assert not any(k.endswith(" " + "0" * 64) for k in kept)  # the older text's entry is dropped


def test_an_unreadable_cache_is_parsed_again_and_rewritten(copy):
    cache = copy.parent / "cache.json"
    expected = rule_versions(copy)
    cache.write_text("{not json")
    assert rule_versions(copy) == expected
    assert len(json.loads(cache.read_text())) >= 40


def test_an_unwritable_cache_is_only_slower(copy, tmp_path):
    expected = rule_versions(copy)
    (tmp_path / "a-file").write_text("")
    p = Package(copy, cache_file=tmp_path / "a-file" / "codehash-defs.json")  # a read-only install
    assert {e: codehash.digest(p.definitions(e)) for e in expected} == expected


def test_code_version_records_its_definitions(tmp_path):
    version = code_version("pipeline.data.tokenize", record=tmp_path)
    record = json.loads((tmp_path / f"{version}.json").read_text())
    assert record["entries"] == ["pipeline.data.tokenize"]
    assert codehash.digest(record["definitions"]) == version and "pipeline.data.tokenize:main" in record["definitions"]


def test_why_without_a_run_names_the_rule_and_the_fix_and_the_tracer_records_it(tmp_path):
    """One error line; with TOKENFARM_TRACE_CALLS (pipeline.io.run_cli) the process's record names its module
    and the package functions it ran, as tests/test_workflow.py's check of whole runs reads them."""
    proc = subprocess.run([sys.executable, "-m", "pipeline.codehash", "--why", "dedup", "--directory", str(tmp_path)],
                          cwd=ROOT, env=dict(user_env(), TOKENFARM_TRACE_CALLS=str(tmp_path / "traced")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no output of rule dedup" in proc.stderr and "--directory" in proc.stderr
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "traced").glob("*.json")]
    ran = {(Path(f).relative_to(ROOT).as_posix(), q) for f, _, q in record["calls"]}
    assert record["main"] == "pipeline.codehash"
    assert {("pipeline/codehash.py", "main"), ("pipeline/codehash.py", "why"),
            ("pipeline/codehash.py", "recorded_versions")} <= ran
    assert not {q for _, q in ran if q in ("run_cli", "_trace_calls")}  # from the tracer's start on only


def test_why_names_what_changed_since_the_recorded_hash(tmp_path):
    """Snakemake's metadata of two outputs of rule dedup holds a code hash recorded earlier: one definition
    changed since, one removed, one added; an output of another rule is not read."""
    now = codehash.package().definitions("pipeline.data.dedup")
    was = {k: v for k, v in now.items() if k != "pipeline.data.minhash:signatures"}
    was["pipeline.data.dedup:main"] = "0" * 16
    was["pipeline.data.dedup:gone"] = "1" * 16
    old = "0123456789abcdef"
    (tmp_path / codehash.RECORD_DIR).mkdir(parents=True)
    (tmp_path / codehash.RECORD_DIR / f"{old}.json").write_text(json.dumps(
        {"entries": ["pipeline.data.dedup"], "definitions": was}))
    meta = tmp_path / ".snakemake/metadata"
    meta.mkdir()
    for i, rule in enumerate(("dedup", "dedup", "split")):
        (meta / f"out{i}").write_text(json.dumps({"rule": rule, "params": ["'{\"x\": 1}'", f"'{old}'"]}))
    assert codehash.why(tmp_path, "dedup").splitlines() == [
        f"rule dedup: 2 output(s) made with code {old}, now {codehash.digest(now)} (pipeline.data.dedup)",
        "  removed  pipeline.data.dedup:gone",
        "  changed  pipeline.data.dedup:main",
        "  added    pipeline.data.minhash:signatures"]
