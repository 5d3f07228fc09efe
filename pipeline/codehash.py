"""The code a rule runs, as a hash: its entry modules and everything in `pipeline` they import.

A rule declares `code=code_version("pipeline.data.tokenize")` (the modules its shell command runs
with `python -m`) as a param, so Snakemake reruns the rule when that code changes. The modules hashed
are the import closure, found with `ast` over the package's source (never by importing it): every
package-internal import, transitively, wherever it is written (module level or inside a function,
absolute or relative), plus the `__init__` of every package on the way, which Python runs too.
Nothing outside `pipeline` is hashed (installed libraries are pinned by the environment).

Every Snakemake call (a dry run too) hashes every rule's closure, and parsing the package's sources is most of
that (~0.4 s). The names each source imports are kept in `__pycache__/codehash-imports.json` beside the
bytecode, keyed by the source's own hash, so an edited module is parsed again and an unchanged one never; a
package where that file cannot be written (installed read-only) parses every call.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
PACKAGE_NAME = PACKAGE.name
IMPORTS_CACHE = PACKAGE / "__pycache__" / "codehash-imports.json"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@cache
def package_modules(root: Path = PACKAGE) -> frozenset[str]:
    return frozenset(module_name(p) for p in root.rglob("*.py"))


def imported_modules(name: str, top_level_only: bool = False) -> set[str]:
    """The package modules that module `name` imports (anywhere in it, or at module level only)."""
    source = module_path(name).read_bytes()
    key = f"{name} {int(top_level_only)} {hashlib.sha256(source).hexdigest()}"
    cache = _IMPORTS.load()
    if key not in cache:
        cache[key] = sorted(_imported_names(name, source, top_level_only))
        _IMPORTS.added = True
    _IMPORTS.used.add(key)
    return set(cache[key]) & (package_modules() - {name})


class _ImportsCache:
    """IMPORTS_CACHE in memory: loaded once, written back (only if it grew) at the end of import_closure."""

    def __init__(self) -> None:
        self.entries: dict[str, list[str]] | None = None
        self.used: set[str] = set()
        self.added = False

    def load(self) -> dict[str, list[str]]:
        if self.entries is None:
            try:
                self.entries = json.loads(IMPORTS_CACHE.read_text())
            except (OSError, ValueError):
                self.entries = {}
        return self.entries

    def save(self) -> None:
        """Temp + rename (concurrent Snakemake calls each write a whole file); an entry for an older source of
        a module this process read is dropped, so the file holds about one entry per module."""
        if not self.added:
            return
        current = {k.rpartition(" ")[0] for k in self.used}
        keep = {k: v for k, v in self.load().items() if k in self.used or k.rpartition(" ")[0] not in current}
        try:
            IMPORTS_CACHE.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=IMPORTS_CACHE.parent, prefix=".codehash-")
        except OSError:  # a read-only install: parse again next time
            return
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)  # as readable as the bytecode beside it
                json.dump(keep, f)
            os.replace(tmp, IMPORTS_CACHE)
            self.added = False
        except OSError:
            Path(tmp).unlink(missing_ok=True)


_IMPORTS = _ImportsCache()


def _imported_names(name: str, source: bytes, top_level_only: bool) -> set[str]:
    """Every dotted name an import statement of `source` could bind (absolute, relative ones resolved):
    filtered against the package's modules when used, so the cache holds no view of the package."""
    tree = ast.parse(source)
    package = name if module_path(name).name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..data import y`
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(names)
    return out


def with_parents(name: str) -> set[str]:
    """`a.b.c` and the packages Python initialises to import it: `a`, `a.b`."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def import_closure(*entries: str) -> list[str]:
    """Every package module that running `entries` can execute, sorted."""
    known = package_modules()
    missing = [e for e in entries if e not in known]
    if missing:
        raise ValueError(f"not modules of {PACKAGE_NAME}: {missing}")
    seen: set[str] = set()
    todo = [m for e in entries for m in with_parents(e)]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for n in imported_modules(m):
            todo += sorted(with_parents(n) - seen)
    _IMPORTS.save()
    return sorted(seen)


def code_version(*entries: str) -> str:
    """Short hash of the source of every module in the import closure of `entries` (dotted names,
    e.g. "pipeline.data.tokenize"): a change to any of them changes it, to any other module does not."""
    h = hashlib.sha256()
    for m in import_closure(*entries):
        h.update(m.encode() + b"\0" + module_path(m).read_bytes() + b"\0")
    return h.hexdigest()[:16]
