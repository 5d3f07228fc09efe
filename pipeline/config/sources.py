"""A config's sources as shards: the files of a source (a local glob or a Hugging Face repo's shard
range), their names, the groups of `shards_per_job` shards a per-shard rule runs as one job, and the
content hashes of local shards (what the download rule declares, so a changed file reruns it)."""
from __future__ import annotations

import glob
import json
import os
from functools import cache
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.io import sha256_file, write_json


def hf_filenames(src: dict) -> list[str]:
    a, b = src["shards"]
    return [src["pattern"].format(index=i) for i in range(a, b)]


def source_files(cfg: dict, name: str) -> dict[str, str]:
    """Shard name -> origin (local path, or hf file name in the repo), in a stable order."""
    src = cfg["sources"][name]
    if src["type"] == "local":
        paths = sorted(glob.glob(src["glob"]))
        if not paths:
            raise ConfigError(f"config key 'sources.{name}.glob': no files match {src['glob']!r} (relative to "
                              f"{os.getcwd()})")
        out = {Path(p).name.removesuffix(".parquet"): p for p in paths}
        if len(out) != len(paths):
            raise ConfigError(f"config key 'sources.{name}.glob': two files share a name; shard names must be unique")
        return out
    return {Path(f).name.removesuffix(".parquet"): f for f in hf_filenames(src)}


def source_shards(cfg: dict, name: str) -> list[str]:
    return list(source_files(cfg, name))


def shard_groups(cfg: dict, name: str) -> dict[str, list[str]]:
    """Consecutive shards of a source in groups of `shards_per_job`, named by their first shard."""
    shards = source_shards(cfg, name)
    per_job = cfg["shards_per_job"]
    return {shards[i]: shards[i:i + per_job] for i in range(0, len(shards), per_job)}


def sample_shards(cfg: dict, name: str) -> list[str]:
    """The plan's sample of a source: `count.sample_shards` of its shards (all when it has no more),
    spread evenly over its shard list, first and last included (shard lists are often ordered by
    crawl or topic, so the first few alone can be unrepresentative). docs/data-stages.md, "The count table"."""
    shards = source_shards(cfg, name)
    k = min(cfg["count"]["sample_shards"], len(shards))
    if k <= 1:
        return shards[:k]
    return [shards[round(i * (len(shards) - 1) / (k - 1))] for i in range(k)]


# ----------------------------------------------------------------------------- local source contents

SOURCE_HASH_CACHE = ".source-sha256.json"  # under data_dir


@cache
def _local_hashes(data_dir: str, pattern: str) -> dict[str, str]:
    """sha256 of every file `pattern` matches, keyed by shard name; cached on disk by file identity."""
    cache_path = Path(data_dir) / SOURCE_HASH_CACHE
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    out, changed = {}, False
    for p in sorted(glob.glob(pattern)):
        st = os.stat(p)
        key, ident = str(Path(p).resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = cache.get(key)
        if not (isinstance(hit, dict) and hit.get("stat") == ident):
            hit, changed = {"stat": ident, "sha256": sha256_file(p)}, True
            cache[key] = hit
        out[Path(p).name.removesuffix(".parquet")] = hit["sha256"]
    if changed:
        try:
            write_json(cache_path, cache)
        except OSError:
            pass  # a read-only data_dir: hashes are recomputed next time
    return out


def local_shard_hashes(cfg: dict, source: str, shards: list[str]) -> dict[str, str]:
    """Shard -> sha256 of its local source file, for `shards` of a local source ({} for an hf source).

    The download rule declares it as a param: a local shard whose *content* changed reruns its download
    and everything downstream, while a file that was only touched (same content, new mtime) reruns
    nothing, which declaring the file as an input (mtime) would not give. Hashes are cached in
    `{data_dir}/.source-sha256.json` by (path, size, mtime, inode), so a parse hashes only new or
    changed files.
    """
    src = cfg["sources"][source]
    if src["type"] != "local":
        return {}
    hashes = _local_hashes(cfg["data_dir"], src["glob"])
    return {s: hashes[s] for s in shards}
