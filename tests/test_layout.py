"""The package's shape, checked with `ast` over pipeline/: no import circle, no stage importing another
stage (a stage is a module a rule runs: `python -m pipeline.…` in workflow/rules/*.smk), a torch-free
top level, and no snakemake import anywhere in the package."""
import ast
import re

from conftest import ROOT

from pipeline.codehash import imported_modules, module_name, package_modules

PACKAGE = ROOT / "pipeline"


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """Package module -> the package modules it imports (the walk the rules' code hashes use)."""
    return {m: imported_modules(m, top_level_only=top_level_only) for m in package_modules()}


def stages() -> set[str]:
    found = set()
    for smk in (ROOT / "workflow/rules").glob("*.smk"):
        found |= set(re.findall(r"-m (pipeline(?:\.\w+)+)", smk.read_text()))
    return found


def test_rules_run_modules_that_exist():
    mods = set(modules())
    assert stages() and stages() <= mods, sorted(stages() - mods)


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_no_stage_imports_another_stage():
    g, st = graph(), stages()
    crossing = {(m, n) for m in st for n in g[m] if n in st}
    assert not crossing, (f"stage modules import each other: {sorted(crossing)}; "
                          "move what they share to a library module")


def test_top_level_is_torch_free():
    mods, g = modules(), graph(top_level_only=True)
    for top in ("pipeline.errors", "pipeline.io", "pipeline.budget", "pipeline.config", "pipeline.plan"):
        seen, todo = set(), [top]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += g[m]
        heavy = {m for m in seen for node in mods[m].body if isinstance(node, (ast.Import, ast.ImportFrom))
                 for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
                 if name.split(".")[0] in ("torch", "polars")}
        assert not heavy, f"{top} imports torch/polars at module level through {sorted(heavy)}"


def test_package_never_imports_snakemake():
    for m, tree in modules().items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "snakemake" for n in names), f"{m} imports snakemake"


def test_errors_is_a_leaf():
    assert graph()["pipeline.errors"] == set()
