"""The code a rule runs, as a hash of what it does: the package definitions its entry points can reach.

A rule declares ``code=rule_code("tokenize")`` as a param: the hash of the package definitions reachable
from the modules its shell command runs (its spec's `modules`, pipeline/rules.py), each hashed as its
normalised AST without docstrings or comments, so Snakemake reruns the rule when that code changes, and
only then.

- `code_version(*entries, record=DIR)`: the hash (and the record of its definitions);
- `imported_modules`, `package_modules`, `module_name`: the package's import graph (tests/test_layout.py);
- ``python -m pipeline.codehash --why RULE``: the definitions changed since the rule's outputs were made.

What is hashed, what is reachable, the limits, why a rule reruns, the per-module cache: docs/code-hash.md.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from pipeline.errors import PipelineError

PACKAGE = Path(__file__).resolve().parent
PACKAGE_NAME = PACKAGE.name
SUMMARY_VERSION = "1"  # in every cache key: a summary of another shape (an older codehash) is never read
MAIN_GUARD = "<main>"  # the key of a module's `if __name__ == "__main__":` block
RECORD_DIR = Path(".snakemake/tokenfarm-codehash")  # relative to the Snakemake working directory


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str, root: Path = PACKAGE) -> Path:
    base = root.parent.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def with_parents(name: str) -> set[str]:
    """`a.b.c` and the packages Python initialises to import it: `a`, `a.b`."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


# ----------------------------------------------------------------------------- one module's summary

def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:]


def _chain(node: ast.AST) -> str | None:
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _mentions(node: ast.AST) -> tuple[set[str], set[str]]:
    """The longest name/attribute chains under `node` (`m.f` is mentioned, not `m` alone), and its strings."""
    chains, strings = set(), set()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            continue  # a name bound here (a local variable, a parameter's use aside) reads nothing
        c = _chain(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
        if c is not None:
            chains.add(c)
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            strings.add(n.value)
        todo.extend(ast.iter_child_nodes(n))
    return chains, strings


def _import_time(stmt: ast.stmt) -> tuple[list[ast.AST], list[ast.AST]]:
    """The parts of a top-level definition that run when its module is imported: (expressions evaluated, and
    expressions called: decorators, and base classes, whose hooks creating a subclass calls)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [*stmt.decorator_list, *stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d)], \
            list(stmt.decorator_list)
    if isinstance(stmt, ast.ClassDef):
        run, called = [*stmt.decorator_list, *stmt.bases, *(k.value for k in stmt.keywords)], \
            [*stmt.decorator_list, *stmt.bases]
        for s in stmt.body:
            r, c = _import_time(s)
            run += r
            called += c
        return run, called
    return [stmt], []


def _callees(stmt: ast.stmt) -> list[str]:
    """What the import-time part of `stmt` calls, as chains ("?" for a callee that is not one)."""
    run, called = _import_time(stmt)
    out = [_chain(c) or "?" for c in called if not isinstance(c, ast.Call)]
    for part in run:
        out += [_chain(n.func) or "?" for n in ast.walk(part) if isinstance(n, ast.Call)]
    return out


def _binding(node: ast.Import | ast.ImportFrom, package: str) -> dict[str, list[list[str]]]:
    """The names an import statement binds: {name: [["module", dotted]] or [["from", module, attr]]}."""
    out: dict[str, list[list[str]]] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            out[a.asname or a.name.split(".")[0]] = [["module", a.name if a.asname else a.name.split(".")[0]]]
        return out
    base = node.module or ""
    if node.level:  # relative: `from . import x`, `from ..data import y`
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    for a in node.names:
        out[a.asname or a.name] = [["from", base, a.name]]
    return out


def _imported(bindings: dict[str, list[list[str]]]) -> set[str]:
    """Every dotted module name those bindings could have imported (the package's modules filter them)."""
    out = set()
    for targets in bindings.values():
        for t in targets:
            out |= {t[1], f"{t[1]}.{t[2]}"} if t[0] == "from" else {t[1]}
    return out


def _is_main_guard(stmt: ast.stmt) -> bool:
    t = getattr(stmt, "test", None)
    return (isinstance(stmt, ast.If) and isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == "__name__" and len(t.comparators) == 1
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == "__main__")


def summarise(name: str, source: bytes, is_package: bool) -> dict:
    """What codehash needs of one module, JSON-ready: its bindings (module-level names -> their definitions or
    imports), the modules it imports at module level, and each definition's hash, mentions, the modules it
    imports in its body, its import-time callees and kind ("def", "effect" or "main")."""
    tree = ast.parse(source)
    _strip_docstrings(tree)
    package = name if is_package else name.rpartition(".")[0]
    bindings: dict[str, list[list[str]]] = {}
    imports: dict[str, list[list[str]]] = {}  # the module-level import bindings, for the definitions' hashes
    top_imports: set[str] = set()
    stars: list[str] = []
    defs: dict[str, dict] = {}
    effects = 0
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if isinstance(stmt, ast.ImportFrom) and stmt.names[0].name == "*":
                stars.append(next(iter(_binding(stmt, package).values()))[0][1])
                top_imports.add(stars[-1])
                continue
            b = _binding(stmt, package)
            top_imports |= _imported(b)
            for k, v in b.items():
                bindings.setdefault(k, []).extend(v)
                imports.setdefault(k, []).extend(v)
            continue
        names = _bound_names(stmt)
        if names is None:  # an effect: runs at import; what it binds (an `if`/`try` block's names) is its own
            key = MAIN_GUARD if _is_main_guard(stmt) else f"<effect {effects}>"
            effects += key != MAIN_GUARD
            names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            names |= {n.name for n in ast.walk(stmt) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            for n in ast.walk(stmt):  # an import inside the block binds too (`try: import x except ...`)
                if isinstance(n, (ast.Import, ast.ImportFrom)) and n.names[0].name != "*":
                    b = _binding(n, package)
                    top_imports |= _imported(b)
                    for k, v in b.items():
                        bindings.setdefault(k, []).extend(v)
            kind = "main" if key == MAIN_GUARD else "effect"
        else:
            key = names[0]
            while key in defs:  # a name bound twice (or augmented): each statement is its own definition
                key += "'"
            kind = "def"
        for n in names:
            bindings.setdefault(n, []).append(["def", key])
        chains, strings = _mentions(stmt)
        local: dict[str, list[list[str]]] = {}
        if kind == "def":  # imports in a body bind names there (an effect's were bound module-level above)
            for n in ast.walk(stmt):
                if isinstance(n, (ast.Import, ast.ImportFrom)) and n.names[0].name != "*":
                    for k, v in _binding(n, package).items():
                        local.setdefault(k, []).extend(v)
        used = {c.split(".")[0] for c in chains}
        h = hashlib.sha256(ast.dump(stmt).encode())
        h.update(json.dumps({u: imports[u] for u in sorted(used & set(imports))}).encode())
        function = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        defs[key] = {
            "kind": kind, "value": kind == "def" and not function, "hash": h.hexdigest()[:16],
            "mentions": sorted(chains), "local": local, "imports": sorted(_imported(local)),
            "strings": sorted(s for s in strings if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", s)),
            "callees": _callees(stmt) if kind == "def" else [],
        }
    return {"bindings": bindings, "imports": sorted(top_imports), "stars": stars, "defs": defs}


def _bound_names(stmt: ast.stmt) -> list[str] | None:
    """The names a definition statement binds, in order; None for an effect."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = []
        for t in targets:
            for n in ([t] if isinstance(t, ast.Name) else t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if not isinstance(n, ast.Name):  # `obj.x = ...`, `d[k] = ...`: changes something else
                    return None
                names.append(n.id)
        return names
    return None


def definition_at(name: str, line: int, root: Path = PACKAGE) -> str | None:
    """The key of the top-level definition of module `name` that holds source line `line` (a function's
    code object starts at its first decorator), as `summarise` names it; None for an import or the docstring."""
    tree = ast.parse(module_path(name, root).read_bytes())
    effects, seen = 0, set()
    body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) \
        and isinstance(tree.body[0].value, ast.Constant) and isinstance(tree.body[0].value.value, str) else tree.body
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        names = _bound_names(stmt)
        if names is None:
            key = MAIN_GUARD if _is_main_guard(stmt) else f"<effect {effects}>"
            effects += key != MAIN_GUARD
        else:
            key = names[0]
            while key in seen:
                key += "'"
        seen.add(key)
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
        if first <= line <= stmt.end_lineno:
            return key
    return None


# ----------------------------------------------------------------------------- the package

class Package:
    """The package's modules as summaries (read through the cache file) and what an entry reaches."""

    def __init__(self, root: Path = PACKAGE, cache_file: Path | None = None) -> None:
        self.root = root
        self.cache_file = root / "__pycache__" / "codehash-defs.json" if cache_file is None else cache_file
        self.modules = frozenset(module_name(p, root) for p in root.rglob("*.py"))
        self._summaries: dict[str, dict] = {}
        self._cache: dict[str, dict] | None = None
        self._used: set[str] = set()
        self._added = False
        self._reached: dict[tuple[str, ...], dict[str, str]] = {}
        self._edges: dict[tuple[str, str], tuple[list[tuple[str, str]], list[str]]] = {}
        self._roots: dict[str, list[str]] = {}
        self._names: dict[tuple[str, str], set[tuple[str, ...]]] = {}

    def summary(self, name: str) -> dict:
        if name not in self._summaries:
            path = module_path(name, self.root)
            source = path.read_bytes()
            key = f"{name} {SUMMARY_VERSION} {hashlib.sha256(source).hexdigest()}"
            cache = self._load()
            if key not in cache:
                cache[key] = summarise(name, source, path.name == "__init__.py")
                self._added = True
            self._used.add(key)
            self._summaries[name] = cache[key]
        return self._summaries[name]

    def _load(self) -> dict[str, dict]:
        if self._cache is None:
            try:
                self._cache = json.loads(self.cache_file.read_text())
            except (OSError, ValueError):
                self._cache = {}
        return self._cache

    def save(self) -> None:
        """Temp + rename (concurrent Snakemake calls each write a whole file); an entry for an older source of
        a module this process read is dropped, so the file holds about one entry per module."""
        if not self._added:
            return
        current = {k.rpartition(" ")[0] for k in self._used}
        keep = {k: v for k, v in self._load().items() if k in self._used or k.rpartition(" ")[0] not in current}
        try:
            self.cache_file.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, prefix=".codehash-")
        except OSError:  # a read-only install: parse again next time
            return
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)  # as readable as the bytecode beside it
                f.write(json.dumps(keep, separators=(",", ":")))  # json.dumps encodes in C; json.dump in Python
            os.replace(tmp, self.cache_file)
            self._added = False
        except OSError:
            Path(tmp).unlink(missing_ok=True)

    def imported_modules(self, name: str, top_level_only: bool = False) -> set[str]:
        """The package modules that module `name` imports (anywhere in it, or when it is imported only)."""
        s = self.summary(name)
        found = set(s["imports"])
        if not top_level_only:
            for d in s["defs"].values():
                found.update(d["imports"])
        return found & (self.modules - {name})

    # -- name resolution: a target is ("def", module, key) or ("module", dotted)

    def resolve_name(self, module: str, name: str, seen: frozenset = frozenset()) -> set[tuple[str, ...]]:
        if not seen:
            if (module, name) not in self._names:
                self._names[module, name] = self.resolve_name(module, name, frozenset({("", "")}))
            return self._names[module, name]
        if (module, name) in seen:  # an import cycle of re-exports
            return set()
        seen = seen | {(module, name)}
        s = self.summary(module)
        targets = s["bindings"].get(name)
        if targets is None:
            found = set()
            for star in s["stars"]:
                if star in self.modules:
                    found |= self.resolve_name(star, name, seen)
            return found
        return set().union(*(self._target(module, t, seen) for t in targets))

    def _target(self, module: str, t: list[str], seen: frozenset) -> set[tuple[str, ...]]:
        if t[0] == "def":
            return {("def", module, t[1])}
        if t[0] == "module":
            return {("module", t[1])} if t[1] in self.modules else set()
        base, attr = t[1], t[2]
        if f"{base}.{attr}" in self.modules:
            return {("module", f"{base}.{attr}")}
        return self.resolve_name(base, attr, seen) if base in self.modules else set()

    def resolve_chain(self, module: str, local: dict, chain: str) -> tuple[set[tuple], set[str]]:
        """(the definitions, the modules) that `chain`, mentioned in a definition of `module` whose body binds
        `local`, can name: every definition met on the way; a module if the chain ends on one."""
        first, *attrs = chain.split(".")
        targets = set(self.resolve_name(module, first))  # a copy: resolve_name's are kept
        for t in local.get(first, []):
            targets |= self._target(module, t, frozenset())
        defs = {t for t in targets if t[0] == "def"}
        mods = {t[1] for t in targets if t[0] == "module"}
        for attr in attrs:
            nxt = set()
            for m in mods:
                nxt |= {("module", f"{m}.{attr}")} if f"{m}.{attr}" in self.modules else self.resolve_name(m, attr)
            defs |= {t for t in nxt if t[0] == "def"}
            mods = {t[1] for t in nxt if t[0] == "module"}
        return defs, mods

    def definitions(self, *entries: str) -> dict[str, str]:
        """{"module:definition": hash} of every definition running `python -m` each of `entries` can run."""
        entries = tuple(sorted(set(entries)))
        if entries in self._reached:
            return self._reached[entries]
        missing = [e for e in entries if e not in self.modules]
        if missing:
            raise ValueError(f"not modules of {self.root.name}: {missing}")
        imported: set[str] = set()
        reached: set[tuple[str, str]] = set()
        todo: list[tuple[str, str]] = []

        def reach(module: str, key: str) -> None:
            if (module, key) not in reached:
                reached.add((module, key))
                todo.append((module, key))

        def load(name: str) -> None:
            """Module `name` is imported: its parents' and its own module-level code runs."""
            for m in sorted(with_parents(name) & self.modules - imported):
                imported.add(m)
                for key in self._import_roots(m):
                    reach(m, key)
                for n in sorted(set(self.summary(m)["imports"]) & self.modules):
                    load(n)

        def enter(name: str) -> None:
            load(name)
            defs = self.summary(name)["defs"]
            if MAIN_GUARD in defs:
                reach(name, MAIN_GUARD)
            for t in self.resolve_name(name, "main"):
                if t[0] == "def":
                    reach(t[1], t[2])

        for e in entries:
            enter(e)
        while todo:
            module, key = todo.pop()
            d = self.summary(module)["defs"][key]
            for n in sorted(set(d["imports"]) & self.modules):
                load(n)
            for s in d["strings"]:
                if s in self.modules:
                    enter(s)
            defs, mods = self._named(module, key)
            for m, k in defs:
                reach(m, k)
            for m in mods:  # a module used as a value: any of its definitions may be looked up
                load(m)
                for k in self.summary(m)["defs"]:
                    if k != MAIN_GUARD:
                        reach(m, k)
        self.save()
        out = {f"{m}:{k}": self.summary(m)["defs"][k]["hash"] for m, k in sorted(reached)}
        self._reached[entries] = out
        return out

    def _import_roots(self, module: str) -> list[str]:
        """The definitions of `module` that run when it is imported: its effects, and the definitions whose
        import-time part calls package code (or a callee it cannot name)."""
        if module not in self._roots:
            self._roots[module] = [k for k, d in self.summary(module)["defs"].items() if d["kind"] == "effect" or any(
                c == "?" or self._is_package(module, c) for c in d["callees"])]
        return self._roots[module]

    def _named(self, module: str, key: str) -> tuple[list[tuple[str, str]], list[str]]:
        """(the definitions, the modules as values) that definition `key` of `module` mentions; once a process."""
        if (module, key) not in self._edges:
            d = self.summary(module)["defs"][key]
            defs, mods = set(), set()
            for chain in d["mentions"]:
                found = self.resolve_chain(module, d["local"], chain)
                defs |= {(m, k) for _, m, k in found[0]}
                mods |= found[1]
            self._edges[module, key] = sorted(defs), sorted(mods)
        return self._edges[module, key]

    def _is_package(self, module: str, chain: str, seen: frozenset = frozenset()) -> bool:
        """Whether calling `chain` can run package code: it names a package function, class or module, or a
        value (`U64 = np.uint64`, `f = partial(g, 1)`) that mentions one."""
        defs, mods = self.resolve_chain(module, {}, chain)
        if mods:
            return True
        for _, m, k in defs:
            d = self.summary(m)["defs"][k]
            if not d["value"] or (m, k) not in seen and any(
                    self._is_package(m, c, seen | {(m, k)}) for c in d["mentions"]):
                return True
        return False


_PACKAGE: Package | None = None


def package() -> Package:
    """The installed package's index (one per process: Snakemake hashes every rule at parse time)."""
    global _PACKAGE
    if _PACKAGE is None:
        _PACKAGE = Package()
    return _PACKAGE


def package_modules() -> frozenset[str]:
    return package().modules


def imported_modules(name: str, top_level_only: bool = False) -> set[str]:
    return package().imported_modules(name, top_level_only)


def digest(definitions: dict[str, str]) -> str:
    h = hashlib.sha256()
    for k, v in sorted(definitions.items()):
        h.update(f"{k}\0{v}\0".encode())
    return h.hexdigest()[:16]


def code_version(*entries: str, record: Path | None = None) -> str:
    """Short hash of the definitions that running `entries` (dotted module names, e.g. "pipeline.data.tokenize")
    can execute; with `record`, those definitions are kept in record/<hash>.json for `--why`."""
    defs = package().definitions(*entries)
    version = digest(defs)
    if record is not None:
        path = Path(record) / f"{version}.json"
        if not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".codehash-")
                with os.fdopen(fd, "w") as f:
                    json.dump({"entries": sorted(set(entries)), "definitions": defs}, f, indent=0)
                os.replace(tmp, path)
            except OSError:  # --why is an explanation: no record, no explanation, the hash stands
                pass
    return version


# ----------------------------------------------------------------------------- --why

def recorded_versions(workdir: Path, rule: str) -> dict[str, int]:
    """{code hash: how many outputs} Snakemake's metadata records for `rule`'s outputs: a param value that
    names a record of `code_version(record=...)`."""
    meta, records = workdir / ".snakemake" / "metadata", workdir / RECORD_DIR
    found: dict[str, int] = {}
    for path in sorted(p for p in meta.rglob("*") if p.is_file()):  # (a long output path is split into dirs)
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if m.get("rule") != rule:
            continue
        for param in m.get("params") or []:  # each as repr(): a code hash is "'0123456789abcdef'"
            v = param.strip("'\"") if isinstance(param, str) else ""
            if re.fullmatch(r"[0-9a-f]{16}", v) and (records / f"{v}.json").exists():
                found[v] = found.get(v, 0) + 1
    return found


def why(workdir: Path, rule: str) -> str:
    """What changed in the code `rule` runs since its outputs were made, one definition a line."""
    versions = recorded_versions(workdir, rule)
    if not versions:
        raise PipelineError(f"{workdir / '.snakemake/metadata'}: no output of rule {rule} made with a recorded "
                            f"code hash (has {rule} run, in this directory?): run it, or give its working "
                            "directory with --directory")
    lines = []
    for version, count in sorted(versions.items()):
        old = json.loads((workdir / RECORD_DIR / f"{version}.json").read_text())
        now = package().definitions(*old["entries"])
        new_version = digest(now)
        lines.append(f"rule {rule}: {count} output(s) made with code {version}, now {new_version}"
                     f" ({' '.join(old['entries'])})")
        if new_version == version:
            lines.append("  unchanged: it does not rerun for its code")
            continue
        was = old["definitions"]
        for k in sorted(set(was) | set(now)):
            if k not in now:
                lines.append(f"  removed  {k}")
            elif k not in was:
                lines.append(f"  added    {k}")
            elif was[k] != now[k]:
                lines.append(f"  changed  {k}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.codehash",
                                description="Name the definitions whose change makes a rule rerun.")
    p.add_argument("--why", required=True, metavar="RULE", help="a rule of the workflow, e.g. dedup")
    p.add_argument("--directory", type=Path, default=Path("."), help="Snakemake's working directory")
    args = p.parse_args(argv)
    print(why(args.directory, args.why))


if __name__ == "__main__":
    from pipeline.io import run_cli

    run_cli(main)
