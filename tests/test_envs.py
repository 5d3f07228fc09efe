"""envs/*.yaml (conda environments for `--sdm conda`) parse and list every package the rules import."""
import ast
import re
import sys
from pathlib import Path

import pytest
import yaml
from builders import ROOT, workflow_rule_facts

# import name -> conda (or pip) package name
PACKAGE = {
    "yaml": "pyyaml",
    "torch": "pytorch",
    "xxhash": "python-xxhash",
    "tiktoken_ext": "tiktoken",
    "httpx2": "huggingface_hub",  # the hub client's HTTP library, installed with it
    "fasttext": "fasttext-predict",  # the inference-only wheel that pipeline/data/text_filters.py imports as fasttext
}


def rules():
    """(rule, its conda env file or None, the pipeline modules its shell command runs), as Snakemake parses
    the workflow (tests/builders.py)."""
    for name, f in workflow_rule_facts().items():
        if f["modules"]:
            yield name, Path(f["conda"]) if f["conda"] else None, set(f["modules"])


def third_party_imports(module: str, seen=None) -> set[str]:
    """Top-level third-party imports of a pipeline module and the pipeline modules it imports."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    path = ROOT / (module.replace(".", "/") + ".py")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for n in names:
            top = n.split(".")[0]
            if top == "pipeline":
                if (ROOT / (n.replace(".", "/") + ".py")).exists():
                    out |= third_party_imports(n, seen)
            elif top not in sys.stdlib_module_names and top != "__future__":
                out.add(top)
    return out


def env_packages(path: Path) -> set[str]:
    spec = yaml.safe_load(path.read_text())
    assert spec["name"].startswith("tokenfarm") and spec["channels"]
    pkgs = set()
    for dep in spec["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            pkgs.add(re.split(r"[=<>\s]", item.strip())[0].lower())
    return pkgs


@pytest.mark.parametrize("env", sorted((ROOT / "envs").glob("*.yaml")), ids=lambda p: p.name)
def test_env_files_parse(env):
    assert {"python", "pip"} <= env_packages(env)


@pytest.mark.parametrize("rule, env, mods", list(rules()), ids=lambda x: x if isinstance(x, str) else "")
def test_rule_env_lists_its_imports(rule, env, mods):
    assert env is not None, f"rule {rule}: every rule needs a conda: env"
    assert env.exists(), f"rule {rule}: {env} missing"
    listed = env_packages(env)
    needed = set().union(*(third_party_imports(m) for m in mods))
    missing = {PACKAGE.get(n, n).lower() for n in needed} - listed
    assert not missing, f"rule {rule} runs {sorted(mods)} which import {sorted(missing)}, not listed in {env.name}"
