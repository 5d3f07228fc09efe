"""The dedup index: what a run's dedup has seen, in the form a later run (or a later segment) dedups against.

An index directory holds `index.json` and one directory per segment (a set of shards deduplicated
together, against every segment before it); formats in docs/data-contract.md ("Dedup index").
Standard library only: the Snakefile reads it at parse time.

- `resolve_references`: `dedup.reference` entries as index directories and their segments in order (each
  index's own references first), checked (format, hashing parameters, manifest hashes, file sizes).
- `verify_segments`: each file's sha256 against its segment manifest (the dedup_index job).
- `plan_segments`: the run's segments at parse time: the recorded ones that still hold, then one new
  segment of every other shard.
- `append`: copy (hard-link) an index's segments into a standalone index directory, one kept index.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from pipeline.config.layout import RunLayout
from pipeline.errors import PipelineError

FORMAT = "tokenfarm-dedup-index/1"
HASH_KEYS = ("ngram", "num_perm", "bands", "rows", "seed")
INDEX_FILE, SEGMENT_FILE = "index.json", "segment.json"


def digest(obj) -> str:
    """sha256 of `obj` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def segment_digest(seg: dict) -> str:
    """A segment's content hash: its shards, parameters and every file's sha256."""
    return digest({k: seg[k] for k in ("shards", "docs", "parts", "hash", "flags", "files")})


def index_digest(index: dict) -> str:
    """An index's content hash: its segments' and its references' hashes, in order."""
    return digest({"segments": [s["sha256"] for s in index["segments"]],
                   "references": [r["sha256"] for r in index["references"]]})


def find_index(entry: str | os.PathLike) -> Path:
    """The index directory a `dedup.reference` entry names: the directory itself, a run's dedup
    directory (`R/dedup`) or a run's results directory (`R`)."""
    p = Path(entry).expanduser()
    for cand in (p, p / "index", Path(RunLayout.at(p).dedup_index_dir())):
        if (cand / INDEX_FILE).is_file():
            return cand.resolve()
    raise PipelineError(f"dedup.reference: {entry} holds no dedup index ({INDEX_FILE} in it, in index/ or in "
                        "dedup/index/); name an earlier run's results directory after its dedup has run, or a "
                        "kept index directory")


def read_index(path: Path, entry: str) -> dict:
    try:
        index = json.loads((path / INDEX_FILE).read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"dedup.reference: {path / INDEX_FILE} is not readable ({e}); rerun that run's "
                            "dedup or drop the entry") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise PipelineError(f"dedup.reference: {path / INDEX_FILE} is not a {FORMAT} index; rerun that run's "
                            "dedup with this version")
    if index.get("sha256") != index_digest(index) or any(s.get("sha256") != segment_digest(s)
                                                         for s in index["segments"]):
        raise PipelineError(f"dedup.reference: {path / INDEX_FILE} was edited (its content hash does not match); "
                            f"rerun the dedup of the run that wrote it, or drop {entry} from dedup.reference")
    return index


def check_compatible(index: dict, path: Path, dd: dict) -> None:
    want = {k: dd[k] for k in HASH_KEYS}
    if index["hash"] != want:
        raise PipelineError(f"dedup.reference: {path} was hashed with {index['hash']}, this run with {want}; "
                            "use the same dedup hashing keys (ngram, num_perm, bands, rows, seed) or drop it")
    flags = index["flags"]
    if not flags["enabled"] or (dd["near"] and not flags["near"]) or (dd["exact"] and not flags["exact"]):
        raise PipelineError(f"dedup.reference: {path} was built with dedup {flags}, which lacks what this run "
                            f"matches (exact {dd['exact']}, near {dd['near']}); rebuild it with those on")


def resolve_references(entries: list[str], dd: dict, own: str | os.PathLike | None = None) -> dict:
    """{"indexes": [{"path", "sha256"}] for each entry, "segments": every segment in order, each its
    manifest plus `dir` (absolute)}. An index's own references come before its segments; a segment met
    twice is used once; this run's own index (`own`) is refused."""
    own = Path(own).resolve() if own else None
    indexes, segments, seen = [], [], set()

    def visit(path: Path, entry: str, want_sha: str | None, chain: tuple) -> str:
        if own is not None and path == own:
            raise PipelineError(f"dedup.reference: {entry} is this run's own dedup index; name earlier runs only")
        if path in chain:
            raise PipelineError(f"dedup.reference: {path} references itself through {' -> '.join(map(str, chain))}")
        index = read_index(path, entry)
        if want_sha is not None and index["sha256"] != want_sha:
            raise PipelineError(f"dedup.reference: {chain[-1]} was deduplicated against {path} as it was (sha256 "
                                f"{want_sha[:12]}), which has changed since ({index['sha256'][:12]}); rerun the dedup "
                                f"of {chain[-1]} or reference {path} directly instead")
        check_compatible(index, path, dd)
        for ref in index["references"]:
            visit(Path(ref["path"]), entry, ref["sha256"], (*chain, path))
        for seg in index["segments"]:
            if seg["sha256"] in seen:
                continue
            seen.add(seg["sha256"])
            d = path / seg["dir"]
            for f in seg["files"]:
                size = (d / f["path"]).stat().st_size if (d / f["path"]).is_file() else None
                if size != f["bytes"]:
                    raise PipelineError(f"dedup.reference: {d / f['path']} is missing or changed ({size} bytes, "
                                        f"the index says {f['bytes']}); restore {path} or drop {entry} from "
                                        "dedup.reference")
            segments.append({**seg, "dir": str(d), "index": str(path)})
        return index["sha256"]

    for entry in entries:
        path = find_index(entry)
        indexes.append({"path": str(path), "sha256": visit(path, entry, None, ())})
    return {"indexes": indexes, "segments": segments}


def verify_segments(segments: list[dict]) -> None:
    """Every file of the segments against the sha256 its manifest records (one line naming the first
    that differs)."""
    for seg in segments:
        for f in seg["files"]:
            path = Path(seg["dir"]) / f["path"]
            if not path.is_file() or file_sha256(path) != f["sha256"]:
                raise PipelineError(f"dedup reference: {path} is not the file its index recorded (sha256 differs); "
                                    f"the index {seg.get('index', seg['dir'])} was edited after it was written: "
                                    "rebuild it (rerun that run's dedup) or drop it from dedup.reference")


def plan_segments(index_dir: str | os.PathLike, shards: list[str], fingerprint: str) -> list[list[str]]:
    """The run's segments (sorted lists of `source/shard`): those `index_dir/index.json` records, as long as
    each still holds (its shards all configured, the same dedup settings: `fingerprint`), then one
    segment of every configured shard not in them. Without a usable record: one segment of all."""
    try:
        index = json.loads((Path(index_dir) / INDEX_FILE).read_text())
        recorded = [s["shards"] for s in index["segments"]] if index.get("fingerprint") == fingerprint else []
    except (OSError, ValueError, KeyError, TypeError):
        recorded = []
    configured, kept = set(shards), []
    for seg in recorded:
        names = sorted(s["name"] for s in seg)
        if not names or not set(names) <= configured:
            break
        kept.append(names)
    done = {n for seg in kept for n in seg}
    rest = sorted(n for n in shards if n not in done)
    return kept + ([rest] if rest or not kept else [])


def segment_manifests(names: list[str], groups: dict[str, dict[str, list[str]]], prefix: str) -> list[str]:
    """The group manifests `prefix/{source}/_manifest/{group}.json` of the groups holding the segment's
    shards `names` (`source/shard`); `groups`: each source's groups (name -> shards)."""
    names = set(names)
    return [f"{prefix}/{s}/_manifest/{g}.json" for s, by_name in groups.items() for g, members in by_name.items()
            if any(f"{s}/{m}" in names for m in members)]


def write_index(index_dir: str | os.PathLike, segments: list[dict], references: list[dict], dd: dict,
                run: str, fingerprint: str, meta: dict) -> dict:
    """The index manifest `index_dir/index.json` over `segments` (their manifests, `dir` relative)."""
    index = {"format": FORMAT, "run": run, "hash": {k: dd[k] for k in HASH_KEYS},
             "flags": {k: dd[k] for k in ("enabled", "exact", "near")},
             "segments": segments, "references": references, "fingerprint": fingerprint}
    index["sha256"] = index_digest(index)
    index["meta"] = meta
    tmp = Path(index_dir) / f".{INDEX_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, Path(index_dir) / INDEX_FILE)
    return index


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def append(kept: str | os.PathLike, source: str | os.PathLike, dd: dict) -> dict:
    """Append to the kept index `kept` (created if absent) every segment of the index `source` names
    (its references' too) that `kept` does not hold yet, hard-linked (copied across devices); each
    checked against its sha256 first. The result holds everything itself: no references."""
    kept = Path(kept)
    kept.mkdir(parents=True, exist_ok=True)
    have = read_index(kept, str(kept)) if (kept / INDEX_FILE).exists() else None
    if have is not None:
        check_compatible(have, kept, dd)
    segments = list(have["segments"]) if have else []
    held = {s["sha256"] for s in segments}
    new = [s for s in resolve_references([str(source)], dd)["segments"] if s["sha256"] not in held]
    verify_segments(new)
    for seg in new:
        name = f"{len(segments)}"
        for f in seg["files"]:
            _link(Path(seg["dir"]) / f["path"], kept / name / f["path"])
        segments.append({**{k: v for k, v in seg.items() if k != "index"}, "dir": name})
    flags = {k: all(s["flags"][k] for s in segments) for k in ("enabled", "exact", "near")}
    return write_index(kept, segments, [], {**dd, **flags}, run=str(kept), fingerprint="",
                       meta={"stage": "dedup_index_append", "from": str(source)})
