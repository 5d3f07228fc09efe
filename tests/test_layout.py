"""The package's shape, checked with `ast` over pipeline/: no import circle, the floors (no package
importing one above it: `model` and `data` below `evaluation`, below `training`, below `bench`), no
rule module importing another (a rule module is what a rule runs: `python -m pipeline.…` in
workflow/rules/*.smk), a torch-free top level, and no snakemake import anywhere in the package."""
import ast
import re

from builders import ROOT, workflow_rule_facts

from pipeline.codehash import imported_modules, module_name, package_modules

PACKAGE = ROOT / "pipeline"


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """Package module -> the package modules it imports (the walk the rules' code hashes use)."""
    return {m: imported_modules(m, top_level_only=top_level_only) for m in package_modules()}


def rule_modules() -> set[str]:
    """The `python -m` modules of every rule's command, as Snakemake parses the workflow."""
    return {m for f in workflow_rule_facts().values() for m in f["modules"]}


def test_rules_run_modules_that_exist():
    mods = set(modules())
    assert rule_modules() and rule_modules() <= mods, sorted(rule_modules() - mods)


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


# The floors, bottom up: a module may import its own package and the packages of lower floors only.
# The top-level modules (errors, io, plan, rules, distributed, …) and the `config` and `planning`
# packages are the ground floor; `model` and `data` stand side by side on the next one and import
# nothing from each other.
FLOORS = {"model": 1, "data": 1, "evaluation": 2, "training": 3, "bench": 4}
GROUND = {"config", "planning"}  # packages whose modules are top-level ones for the floors (read by all)


def package_of(module: str) -> str:
    """`model` for pipeline.model.engine; "" for a top-level module (pipeline.io, pipeline itself) and
    for the modules of a ground-floor package (pipeline.config.resolve)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] not in GROUND else ""


def test_floors_cover_every_package():
    assert {package_of(m) for m in package_modules()} - {""} == set(FLOORS)


def test_no_import_from_a_floor_above():
    upward = sorted((m, n) for m, ns in graph().items() for n in ns
                    if package_of(n) != package_of(m)
                    and FLOORS.get(package_of(n), 0) >= FLOORS.get(package_of(m), 0))
    assert not upward, f"imports from a package on the same or a higher floor: {upward}"


def test_the_named_floors():
    """The floors the layout is for, spelled out: the model layer stands alone, evaluation never reaches
    into training, the data stages reach into neither."""
    g = graph()
    for pkg, forbidden in (("model", {"data", "training", "evaluation", "bench"}),
                           ("evaluation", {"training", "bench"}),
                           ("data", {"model", "training", "evaluation", "bench"}),
                           ("", set(FLOORS))):
        bad = sorted((m, n) for m, ns in g.items() if package_of(m) == pkg for n in ns if package_of(n) in forbidden)
        assert not bad, f"pipeline.{pkg or '<top level>'} imports {sorted({package_of(n) for _, n in bad})}: {bad}"


def test_no_rule_module_imports_another():
    g, rules = graph(), rule_modules()
    crossing = {(m, n) for m in rules for n in g[m] if n in rules}
    assert not crossing, (f"rule modules import each other: {sorted(crossing)}; "
                          "move what they share to a library module")


def test_top_level_is_torch_free():
    mods, g = modules(), graph(top_level_only=True)
    for top in ("pipeline.errors", "pipeline.io", "pipeline.planning.compute", "pipeline.config", "pipeline.plan"):
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


def test_readmes_first_screen_is_short_and_the_detail_is_in_docs():
    """README's first screen (what it is, the two commands, what they make, where to look: everything before its
    second section) fits 60 lines; the architecture it links to is in docs/."""
    readme = (ROOT / "README.md").read_text().splitlines()
    sections = [i for i, line in enumerate(readme) if line.startswith("## ")]
    assert readme[sections[0]] == "## Set-up on a fresh machine" and len(sections) > 2
    assert sections[1] <= 60, f"README's first screen is {sections[1]} lines"
    assert "make run" in "\n".join(readme[:sections[1]]) and "make test" in "\n".join(readme[:sections[1]])
    assert "(docs/architecture.md)" in "\n".join(readme[:sections[1]]) and (ROOT / "docs/architecture.md").exists()


# ----------------------------------------------------------------------------- one owner of the run's paths

RUN_SUBDIRS = ("filtered", "tokens", "tokenizer", "counts", "dedup", "decontam", "split", "mix", "pack", "train",
               "eval", "eval_data", "scaling", "export", "benchmarks", "segments")
_NAMES = "|".join(RUN_SUBDIRS)
JOIN = re.compile(rf'/\s*"(?:{_NAMES})"|f"\{{[^}}"]*\}}/(?:{_NAMES})\b')


def test_no_run_dir_path_is_built_outside_the_layout():
    """RunLayout (pipeline/config/layout.py) owns every path under R: no module joins a run's sub-directory
    by hand, and the .smk files name none but through it (`L.…`) or `rules.X.output`."""
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name == "layout.py":
            continue
        found += [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(p.read_text().splitlines(), 1)
                  if JOIN.search(line) and not line.lstrip().startswith("#")]
    for p in sorted((ROOT / "workflow").rglob("*.smk")) + [ROOT / "Snakefile"]:
        found += [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(p.read_text().splitlines(), 1)
                  if "RUN_DIR" in line or JOIN.search(line) or re.search(r'f"\{L\.root\}', line)]
    assert not found, "paths under R built outside RunLayout:\n" + "\n".join(found)


def test_the_layout_gives_snakemake_patterns_and_concrete_paths():
    from pipeline.config.layout import RunLayout

    L = RunLayout.of({"results_dir": "results", "run_name": "tiny"})
    assert L.tokens() == "results/tiny/tokens/{source}/{shard}.json"
    assert L.tokens("web", "00001", "bin") == "results/tiny/tokens/web/00001.bin"
    assert L.manifest("dedup/sig", "web", "0") == "results/tiny/dedup/sig/web/_manifest/0.json"
    assert L.log("dedup", "candidates", "{part}") == "logs/tiny/dedup/candidates/{part}.log"
    assert L.bench("tokenize", "{source}", "{group}") == "results/tiny/benchmarks/tokenize/{source}/{group}.tsv"
    assert RunLayout.at("results/tiny") == L


def named_modules(source: str) -> set[str]:
    """The package modules a test file names: its imports (a name imported from a package counts for the module
    that defines it) and the modules it runs (`python -m pipeline.…`, `-m`, "pipeline.…" strings)."""
    import importlib

    names = set(re.findall(r"\bpipeline(?:\.\w+)+", source))
    names |= {f"{m}.__main__" for m in re.findall(r"-m (pipeline(?:\.\w+)+)", source)}  # a package run with -m
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            names.add(node.module)
            package = importlib.import_module(node.module)
            for alias in node.names:
                defined = getattr(getattr(package, alias.name, None), "__module__", None)
                names |= {f"{node.module}.{alias.name}", *([defined] if defined else [])}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_make_test_fast_names_every_module():
    """`make test-fast` (the tests not marked slow) reaches every module of the package: each is named by a test
    file with tests not marked slow, not only by the slow end-to-end runs."""
    fast = [p for p in ROOT.joinpath("tests").rglob("test_*.py")
            if not re.search(r"^pytestmark\s*=.*\bslow\b", p.read_text(), re.M)]
    named = set().union(*(named_modules(p.read_text()) for p in fast))
    unnamed = [m for m in package_modules() if not any(n == m or n.startswith(m + ".") for n in named)]
    assert not unnamed, f"only slow tests (or none) name: {unnamed}"
