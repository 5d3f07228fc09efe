r"""Ingest: place each shard of a group at `{data_dir}/{source}/{shard}.parquet`, verified.

    python -m pipeline.data.download --params JSON --source S --shards SH ... \
        --outputs D/S/SH.parquet ... [--manifest M]

A ``type: local`` shard is copied from its glob; a ``type: hf`` shard is fetched from the Hub at one
resolved commit per job (`fetch_hf`: HEAD, a resumable streamed body, size and hash checked), retried on
transient failures. Every shard is then verified (sha256 pin, the required column, every page, at least
one row) and placed atomically with its metadata sidecar ``{out}.json``. `download_shard` is one shard.

Revision consistency (`check_commit`), shards already placed (`placed_is_current`), retries and
verification: docs/data-stages.md, "Download".
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from pipeline.config import add_config_args, download_slice, params_from_args, source_files
from pipeline.data.contract import chat_field_problem, run_group
from pipeline.errors import PipelineError
from pipeline.io import atomic_path, get_logger, progress, provenance, read_json, run_cli, sha256_file, write_json
from pipeline.run_config import run_config

log = get_logger(__name__)

STAGE = "download"
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")


class TransferError(Exception):
    """An attempt delivered bytes that do not match the Hub's ETag: worth retrying."""


class ShortBody(Exception):
    """A body ended before the size the Hub announced (the bytes so far are kept): worth retrying."""


@dataclass(frozen=True)
class HubFile:
    """One file of a Hub repo at a revision, and the endpoint to ask for it."""

    repo: str
    repo_type: str
    revision: str
    filename: str
    endpoint: str

    @property
    def url(self) -> str:
        return hf_hub_url(self.repo, self.filename, repo_type=self.repo_type, revision=self.revision,
                          endpoint=self.endpoint)

    def at(self, commit: str) -> HubFile:
        """The same file at a commit (what the requested revision resolved to)."""
        return replace(self, revision=commit)

    def __str__(self) -> str:
        return f"{self.filename} of {self.repo_type} repo {self.repo} at revision {self.revision}"


def sidecar_path(out: str | os.PathLike) -> Path:
    """The download metadata file of a placed shard: `{out}.json`."""
    return Path(f"{out}.json")


def hub_endpoint() -> str:
    """HF_ENDPOINT as set now (huggingface_hub itself reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def shard_origin(name: str, spec: dict, shard: str) -> str:
    """Where shard `shard` of source `name` comes from: a local path, or a file name in the hf repo."""
    files = source_files({"sources": {name: spec}}, name)
    if shard not in files:
        known = ", ".join(list(files)[:5]) + (", ..." if len(files) > 5 else "")
        raise PipelineError(
            f"'{shard}' is not a shard of source '{name}' (its shards: {known}); "
            f"check sources.{name}.{'glob' if spec['type'] == 'local' else 'pattern and shards'}"
        )
    return files[shard]


# ----------------------------------------------------------------------------- verification

def required_column(spec: dict) -> tuple[str, str]:
    """(config key, column name) of the column every shard of a source must have."""
    key = "messages_column" if spec["format"] == "chat" else "text_column"
    return key, spec[key]


def _column_type_problem(typ, fmt: str) -> str | None:
    import pyarrow as pa

    if fmt == "text":
        # Binary is fine: the readers downstream (pipeline.data.contract.iter_documents, dedup's
        # document_texts) read text as bytes and count a row that is not UTF-8 as an invalid document.
        kinds = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
        ok = any(is_kind(typ) for is_kind in kinds)
        expected = "string or binary"
    else:
        ok = (
            (pa.types.is_list(typ) or pa.types.is_large_list(typ))
            and pa.types.is_struct(typ.value_type)
            and {"role", "content"} <= {f.name for f in typ.value_type}
        )
        expected = "list<struct<role: string, content: string>>"
    return None if ok else f"has type {typ}, expected {expected}"


def verify_parquet(path: str | os.PathLike, name: str, spec: dict, label: str) -> dict:
    """Check that `path` is a usable shard of source `name`; return its rows, row_groups, columns.

    `label` names the file in error messages (the origin, not the temp copy being checked).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    key, col = required_column(spec)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise PipelineError(f"{label} is not a readable parquet file, "
                            f"it is corrupt or truncated ({e}); replace it") from None
    with pf:
        schema = pf.schema_arrow
        if col not in schema.names:
            raise PipelineError(
                f"{label} has no column '{col}' (columns present: {', '.join(schema.names)}); "
                f"set sources.{name}.{key} to the column holding the "
                f"{'conversations' if key == 'messages_column' else 'documents'}"
            )
        if pf.metadata.num_rows == 0:
            raise PipelineError(f"{label} has zero rows; an empty shard is an error: remove it from the source or fix "
                                "the export that wrote it")
        typ = schema.field(col).type
        if pa.types.is_null(typ):  # what a writer infers from a column of nulls only
            raise PipelineError(f"{label}: column '{col}' holds no text, every row is null (parquet type null); "
                                "fix the export that wrote it, or remove the shard from the source")
        problem = _column_type_problem(typ, spec["format"])
        if problem:
            raise PipelineError(f"{label}: column '{col}' {problem}; check sources.{name}.format and "
                                f"sources.{name}.{key}")
        problem = chat_field_problem(pf, col) if spec["format"] == "chat" else None
        if problem:  # messages shaped right whose role or content is not text: tokenize could not read them
            raise PipelineError(f"{label}: {problem}; every message's role and content must be a string: fix the "
                                "export that wrote it")
        try:
            for _ in pf.iter_batches(columns=[col]):
                pass
        except (pa.ArrowException, OSError) as e:
            raise PipelineError(f"{label} is corrupt: column '{col}' cannot be decoded ({e}); replace it") from None
        return {"rows": pf.metadata.num_rows, "row_groups": pf.metadata.num_row_groups, "columns": schema.names}


def check_pin(name: str, spec: dict, filename: str, sha256: str, label: str) -> None:
    """Fail if `sources.<name>.sha256` pins `filename` to another hash."""
    pin = spec["sha256"].get(filename)
    if pin is not None and pin != sha256:
        raise PipelineError(
            f"{label} has sha256 {sha256} but sources.{name}.sha256['{filename}'] pins {pin}: the file changed "
            "upstream or the pin is wrong; check the file before updating the pin"
        )


def verify_shard(path: Path, name: str, spec: dict, filename: str, label: str, sha256: str) -> dict:
    """All checks of a shard about to be placed; returns its sha256, bytes, rows, row_groups, columns.

    `filename` is the key of its pin in `sources.<name>.sha256`, `label` names it in errors.
    """
    check_pin(name, spec, filename, sha256, label)
    return {"sha256": sha256, "bytes": path.stat().st_size, **verify_parquet(path, name, spec, label)}


# ----------------------------------------------------------------------------- local sources

def ingest_local(name: str, spec: dict, shard: str, path: str, out: Path, params: dict) -> dict:
    """Copy a local shard to `out` (verified, with its sidecar); return the sidecar record.

    A shard already placed is copied again rather than skipped: proving a placed copy current would
    take hashing both the source and the copy (two full reads), while copying is one read and one
    write plus the hash of the copy that verification needs anyway. Skipping would save little and
    add a second path whose staleness rules (source edited in place, copy damaged) must be right.
    """
    src = Path(path)
    fields = {"source": name, "shard": shard, "type": "local", "origin": str(src.resolve())}
    with atomic_path(out) as tmp:
        shutil.copyfile(src, tmp)
        record = {**fields, **verify_shard(tmp, name, spec, src.name, str(src), sha256_file(tmp)),
                  "meta": provenance(STAGE, params, [src])}
        write_json(sidecar_path(out), record)  # before atomic_path renames the shard into place
    log_placed(out, record)
    return record


# ----------------------------------------------------------------------------- placed shards

def read_sidecar(out: Path) -> dict | None:
    """The sidecar record of the shard placed at `out`; None if none is placed there.

    A parquet without a readable sidecar (or a sidecar without its parquet) counts as not placed.
    """
    side = sidecar_path(out)
    if not (out.exists() and side.exists()):
        return None
    try:
        record = read_json(side)
    except (OSError, ValueError) as e:
        log.warning("ignoring %s, it is unreadable (%s): %s counts as not placed", side, e, out)
        return None
    return record if isinstance(record, dict) else None


def placed_shards(directory: Path, name: str) -> list[dict]:
    """The sidecar records of the shards of source `name` placed in `directory` (sorted by shard)."""
    records = (read_sidecar(Path(str(side)[: -len(".json")])) for side in sorted(directory.glob("*.parquet.json")))
    return [r for r in records if r is not None and r.get("source") == name]


def check_commit(name: str, shard: str, out: Path, f: HubFile, commit: str) -> None:
    """Fail if shard `shard` of source `name`, resolved to `commit`, would sit beside shards of the
    same repo and requested revision that were downloaded at another commit (see the module doc)."""
    for other in placed_shards(out.parent, name):
        same_request = (other.get("type"), other.get("repo"), other.get("repo_type"), other.get("revision")) == (
            "hf", f.repo, f.repo_type, f.revision
        )
        if same_request and other.get("shard") != shard and other.get("commit") != commit:
            raise PipelineError(
                f"source '{name}': shard '{shard}' resolves revision '{f.revision}' of {f.repo_type} repo {f.repo} to "
                "commit "
                f"{commit}, but shard '{other.get('shard')}' already placed in {out.parent} came from commit "
                f"{other.get('commit')}: "
                f"the revision moved between downloads and the source would mix two versions of the data; "
                f"pin sources.{name}.revision to a commit sha ({other.get('commit')} keeps the shards already placed)"
            )


def placed_is_current(out: Path, placed: dict | None, f: HubFile, etag: str) -> bool:
    """True if `placed` (the sidecar of the shard at `out`) records file `f` at ETag `etag` and the
    file at `out` still has the recorded size and sha256 (re-hashed: a damaged copy is never kept)."""
    if placed is None:
        return False
    recorded = tuple(placed.get(k) for k in ("type", "repo", "repo_type", "filename", "etag"))
    if recorded != ("hf", f.repo, f.repo_type, f.filename, etag):
        return False
    if out.stat().st_size != placed.get("bytes") or sha256_file(out) != placed.get("sha256"):
        log.warning("%s no longer matches the size and sha256 its sidecar records (changed on disk since): "
                    "downloading it again", out)
        return False
    return True


def keep_placed(name: str, spec: dict, out: Path, fields: dict, placed: dict, params: dict, label: str) -> dict:
    """Re-verify the current shard already at `out` under the current config; return its record.

    `fields` are the sidecar fields from what the Hub resolved now. The sidecar is rewritten only if
    they (or the verification results) differ from what it records.
    """
    checked = verify_shard(out, name, spec, fields["filename"], label, placed["sha256"])
    record = {**fields, **checked}
    if record != {k: v for k, v in placed.items() if k != "meta"}:
        record["meta"] = provenance(STAGE, params)
        write_json(sidecar_path(out), record)
        log.info("%s: re-recorded its sidecar (now commit %s, revision %s)", out, fields["commit"], fields["revision"])
    else:
        record["meta"] = placed["meta"]
    for p in out.parent.glob(f".{out.name}.*.part"):
        log.info("removing %s: the shard is already placed", p)
        p.unlink()
    log.info("%s already present and verified (same ETag as %s, sha256 %s, %d rows): not downloaded again",
             out, label, record["sha256"][:12], record["rows"])
    return record


# ----------------------------------------------------------------------------- hf sources

def _partial_path(out: Path, etag: str) -> Path:
    return out.parent / f".{out.name}.{etag[:16]}.part"


def _remove_stale_partials(out: Path, keep: Path) -> None:
    for p in out.parent.glob(f".{out.name}.*.part"):
        if p != keep:
            log.info("removing %s: the file changed upstream since it was started", p)
            p.unlink()


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _matches_etag(path: Path, etag: str, sha256: str) -> bool:
    if _SHA256.fullmatch(etag):
        return sha256 == etag
    if _GIT_SHA1.fullmatch(etag):
        return _git_blob_sha1(path) == etag
    log.warning("ETag %r is neither a sha256 nor a git sha1: the content of %s is checked for size only", etag, path)
    return True


def _get_body(url: str, part: Path, size: int | None, headers: dict, timeout: float, label: str) -> None:
    """Stream `url` into `part` by huggingface_hub's HTTP session, resuming with a Range request
    from the bytes already there. ShortBody if fewer than `size` bytes arrived in the end."""
    resume = part.stat().st_size if part.exists() else 0
    if size is None or resume > size:
        resume = 0  # cannot tell which bytes of the partial file are good: start over
    if size is not None and resume == size:
        return
    if resume:
        log.info("resuming %s at byte %d of %d", label, resume, size)
        headers = {**headers, "Range": f"bytes={resume}-"}
    with get_session().stream("GET", url, headers=headers, timeout=timeout, follow_redirects=True) as response:
        hf_raise_for_status(response)
        if resume and response.status_code == 200:  # the server ignored the Range: it sends everything
            resume = 0
        bar = progress(desc=label, total=size, unit="B")
        bar.update(resume)
        with bar, open(part, "ab" if resume else "wb") as fh:
            for chunk in response.iter_bytes(chunk_size=1 << 20):
                fh.write(chunk)
                bar.update(len(chunk))
    got = part.stat().st_size
    if size is not None and got != size:
        raise ShortBody(f"the body ended after {got} of {size} bytes")


def _fetch_once(f: HubFile, commit: str | None, out: Path, token: str | bool, timeout: float,
                keep) -> tuple[Path | None, dict]:
    """One attempt: HEAD the file (at `commit` once the job resolved it), then fetch its body at that
    commit (the CDN's content-addressed URL for LFS files) unless `keep` says the placed shard is current."""
    url = f.at(commit).url if commit else f.url
    meta = get_hf_file_metadata(url, token=token, timeout=timeout, endpoint=f.endpoint)
    if meta.commit_hash is None or meta.etag is None:
        raise PipelineError(
            f"{f.endpoint} answered without X-Repo-Commit/ETag for {f}: it is not a Hugging Face Hub endpoint; check "
            "HF_ENDPOINT"
        )
    remote = {"commit": meta.commit_hash, "etag": meta.etag}
    if keep(remote):
        return None, remote
    part = _partial_path(out, meta.etag)
    _remove_stale_partials(out, keep=part)
    # A redirect (LFS: to the CDN, by content hash) is followed; otherwise the body is fetched at the
    # commit, never at a branch that may have moved since the HEAD.
    body_url = meta.location if meta.location != url else f.at(meta.commit_hash).url
    # The token goes to the Hub host only; a redirect to a CDN carries a signed URL instead.
    auth = token if urlsplit(body_url).netloc == urlsplit(f.url).netloc else False
    _get_body(body_url, part, meta.size, build_hf_headers(token=auth), timeout, f.filename)
    sha256 = sha256_file(part)
    if not _matches_etag(part, meta.etag, sha256):
        part.unlink()
        raise TransferError(f"content does not match the Hub's ETag {meta.etag} (got sha256 {sha256})")
    return part, {**remote, "sha256": sha256}


def _is_transient(e: BaseException) -> bool:
    """Connection trouble, timeouts, HTTP 408/429/5xx and bad bodies are worth retrying."""
    if isinstance(e, HfHubHTTPError):
        return getattr(e.response, "status_code", None) in TRANSIENT_STATUS
    return isinstance(e, (httpx2.TransportError, TransferError, ShortBody))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _client_error(f: HubFile, name: str, e: Exception) -> PipelineError:
    """A clear message for a failure that retrying cannot fix."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, OfflineModeIsEnabled):
        msg = f"cannot download {f}: HF_HUB_OFFLINE is set; unset it, or make sources.{name} a local source"
    elif isinstance(e, RevisionNotFoundError):
        msg = (f"revision '{f.revision}' not found in {f.repo_type} repo {f.repo} (HTTP {status} for {f.url}); "
               f"check sources.{name}.revision")
    elif isinstance(e, RemoteEntryNotFoundError):
        msg = (f"file {f.filename} not found in {f.repo_type} repo {f.repo} at revision {f.revision} "
               f"(HTTP {status} for {f.url}); check sources.{name}.pattern and sources.{name}.shards")
    elif isinstance(e, RepositoryNotFoundError):
        msg = (
            f"{f.repo_type} repo {f.repo} not found or not accessible at {f.endpoint} (HTTP {status}); check "
            f"sources.{name}.repo "
            f"and sources.{name}.repo_type, and for a private or gated repo that HF_TOKEN is set to a token with access"
        )
    else:
        msg = (f"HTTP {status} while fetching {f} from {f.url} ({_first_line(e)}); "
               f"check sources.{name} and, if access is denied, HF_TOKEN")
    return PipelineError(msg)


def _gave_up(f: HubFile, attempts: int, e: BaseException) -> PipelineError:
    if isinstance(e, httpx2.TransportError):
        hint = (
            f"check that HF_ENDPOINT (now {f.endpoint}) is right and reachable from this machine "
            "(network, proxy, firewall) and that HF_HUB_OFFLINE is not set"
        )
    elif isinstance(e, HfHubHTTPError):
        hint = "the Hub is failing or rate-limiting; try again later"
    elif isinstance(e, TransferError):
        hint = "the bytes received never matched the Hub's hash; the bad copy was deleted, rerun to try again"
    else:  # ShortBody
        hint = "the transfer kept ending early; rerun to resume from the bytes already received"
    return PipelineError(
        f"could not download {f} from {f.endpoint} after {attempts} attempt{'s' * (attempts > 1)} (last error: "
        f"{_first_line(e)}); "
        f"{hint}. download.retries and download.backoff_seconds control the retrying"
    )


def fetch_hf(
    f: HubFile, name: str, out: Path, *, retries: int, backoff_seconds: float, timeout_seconds: float,
    commit: str | None = None, keep=lambda remote: False
) -> tuple[Path | None, dict]:
    """Download `f` into a partial file next to `out`, checked against the Hub's size and ETag.

    Returns (path of the complete file, {"commit", "etag", "sha256"}). `name` is the source's config
    key, for error messages. `commit`: the commit the job already resolved `f.revision` to (None:
    this file's HEAD resolves it). `keep` is called with {"commit", "etag"} as resolved by each
    attempt's HEAD, before any byte of the body is fetched: it may raise a PipelineError (which is
    not retried), and if it returns True no body is fetched and (None, {"commit", "etag"}) is returned.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    token = os.environ.get("HF_TOKEN") or False
    attempts = retries + 1
    for attempt in itertools.count(1):
        try:
            return _fetch_once(f, commit, out, token, timeout_seconds, keep)
        except Exception as e:
            if not _is_transient(e):
                if isinstance(e, (HfHubHTTPError, OfflineModeIsEnabled)):
                    raise _client_error(f, name, e) from None
                raise
            if attempt == attempts:
                raise _gave_up(f, attempts, e) from None
            wait = backoff_seconds * 2 ** (attempt - 1)
            log.warning("attempt %d/%d for %s failed (%s); retrying in %.3gs",
                        attempt, attempts, f, _first_line(e), wait)
            time.sleep(wait)


def ingest_hf(name: str, spec: dict, shard: str, filename: str, out: Path, params: dict,
              resolved: dict | None = None) -> dict:
    """Download an hf shard to `out` (verified, with its sidecar), unless the shard already placed
    there is current; return the sidecar record. `resolved` maps (endpoint, repo, repo_type,
    revision) to the commit this job resolved it to: the first shard resolves it, every later one
    is fetched at that commit."""
    dl = run_config(params).download
    f = HubFile(spec["repo"], spec["repo_type"], spec["revision"], filename, hub_endpoint())
    resolved = {} if resolved is None else resolved
    request = (f.endpoint, f.repo, f.repo_type, f.revision)
    placed = read_sidecar(out)

    def keep(remote: dict) -> bool:
        check_commit(name, shard, out, f, remote["commit"])
        return placed_is_current(out, placed, f, remote["etag"])

    part, got = fetch_hf(
        f, name, out, retries=dl.retries, backoff_seconds=dl.backoff_seconds,
        timeout_seconds=dl.timeout_seconds, commit=resolved.get(request), keep=keep
    )
    resolved.setdefault(request, got["commit"])
    fields = {
        "source": name, "shard": shard, "type": "hf", "origin": f.at(got["commit"]).url, "endpoint": f.endpoint,
        "repo": f.repo, "repo_type": f.repo_type, "filename": filename, "revision": f.revision,
        "commit": got["commit"], "etag": got["etag"],
    }
    if part is None:
        return keep_placed(name, spec, out, fields, placed, params, str(f))
    with atomic_path(out) as tmp:
        os.replace(part, tmp)  # from here a failed check deletes the file (atomic_path cleans up)
        record = {**fields, **verify_shard(tmp, name, spec, filename, str(f), got["sha256"]),
                  "meta": provenance(STAGE, params)}
        check_commit(name, shard, out, f, got["commit"])  # again: another job may have placed a shard meanwhile
        write_json(sidecar_path(out), record)  # before atomic_path renames the shard into place
    log_placed(out, record)
    return record


# ----------------------------------------------------------------------------- entry points

def download_shard(params: dict, source: str, shard: str, out: str | os.PathLike,
                   resolved: dict | None = None) -> dict:
    """Place shard `shard` of `source` at `out` with its `{out}.json` sidecar; return the sidecar record.

    `params` is `cut(download_slice, cfg)`: {"sources": ..., "download": {retries, ...}}.
    `resolved`: the revisions this job resolved to commits so far (shared by the shards of a group,
    so that one job fetches every shard at one commit).
    """
    sources = run_config(params).sources
    if source not in sources:
        raise PipelineError(f"unknown source '{source}' (sources: {', '.join(sources)})")
    spec = sources[source]
    origin = shard_origin(source, spec, shard)
    if spec.type == "local":
        return ingest_local(source, spec, shard, origin, Path(out), params)
    return ingest_hf(source, spec, shard, origin, Path(out), params, resolved)


def log_placed(out: Path, record: dict) -> None:
    log.info("placed %s: %d rows, %d bytes, sha256 %s (from %s)",
             out, record["rows"], record["bytes"], record["sha256"][:12], record["origin"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.data.download",
                                 description="Place a group of verified source shards (see docs/data-contract.md).")
    add_config_args(ap)
    ap.add_argument("--source", required=True, help="source name (a key of config `sources`)")
    ap.add_argument("--shards", nargs="+", required=True, help="shard names (file stems, e.g. shard_00000)")
    ap.add_argument("--outputs", nargs="+", required=True, help="{data_dir}/{source}/{shard}.parquet, one per shard")
    ap.add_argument("--manifest", help="the group manifest to write last (the rule's declared output)")
    args = ap.parse_args(argv)
    # httpx2 logs every request at INFO, including signed CDN URLs: keep those out of the logs.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    params = params_from_args(args, download_slice)
    resolved: dict = {}  # the group's revision -> commit, resolved once (by its first shard's HEAD)
    run_group(STAGE, args.shards, args.outputs, args.manifest,
              lambda shard, out: download_shard(params, args.source, shard, out, resolved))


if __name__ == "__main__":
    run_cli(main)
