"""pipeline.codehash's cache of each source's imports: the same closures and hashes with it or without it, a
source whose text changed parsed again, and a cache it cannot read or write only slower."""
from __future__ import annotations

import json

import pytest

from pipeline import codehash
from pipeline.codehash import code_version, import_closure

ENTRIES = ("pipeline.data.tokenize", "pipeline.training.train", "pipeline.evaluation.evaluate", "pipeline.plan")


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "__pycache__" / "codehash-imports.json"
    monkeypatch.setattr(codehash, "IMPORTS_CACHE", path)
    fresh(monkeypatch)
    return path


def fresh(monkeypatch) -> None:
    """A new process's view: nothing in memory, the file as it is."""
    monkeypatch.setattr(codehash, "_IMPORTS", codehash._ImportsCache())


def test_closures_are_the_same_from_the_cache(cache_file, monkeypatch):
    cold = {e: (import_closure(e), code_version(e)) for e in ENTRIES}
    entries = json.loads(cache_file.read_text())
    assert len(entries) >= len(cold["pipeline.training.train"][0])
    fresh(monkeypatch)
    parsed = []
    monkeypatch.setattr(codehash, "_imported_names", lambda *a: parsed.append(a[0]) or set())
    assert {e: (import_closure(e), code_version(e)) for e in ENTRIES} == cold
    assert parsed == []  # every source came from the file


def test_a_changed_source_is_parsed_again(cache_file, monkeypatch):
    import_closure("pipeline.plan")
    entries = json.loads(cache_file.read_text())
    # the cache's claim about an older text of pipeline.plan: that it imported pipeline.training.train
    stale = {k.rpartition(" ")[0] + " " + "0" * 64: ["pipeline.training.train"] for k in entries
             if k.startswith("pipeline.plan ")}
    others = {k: v for k, v in entries.items() if not k.startswith("pipeline.plan ")}
    cache_file.write_text(json.dumps({**stale, **others}))
    fresh(monkeypatch)
    closure = import_closure("pipeline.plan")
    assert "pipeline.training.train" not in closure and "pipeline.perf" in closure
    kept = json.loads(cache_file.read_text())
    assert not any(k.endswith(" " + "0" * 64) for k in kept)  # the older text's entry is dropped


def test_an_unreadable_cache_is_parsed_again_and_rewritten(cache_file, monkeypatch):
    expected = {e: import_closure(e) for e in ENTRIES}
    cache_file.write_text("{not json")
    fresh(monkeypatch)
    assert {e: import_closure(e) for e in ENTRIES} == expected
    assert len(json.loads(cache_file.read_text())) >= len(expected["pipeline.training.train"])


def test_an_unwritable_cache_is_only_slower(cache_file, tmp_path, monkeypatch):
    expected = {e: import_closure(e) for e in ENTRIES}
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(codehash, "IMPORTS_CACHE", tmp_path / "a-file" / "codehash-imports.json")  # a read-only install
    fresh(monkeypatch)
    assert {e: import_closure(e) for e in ENTRIES} == expected
