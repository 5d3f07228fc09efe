"""Ingest stage: hf downloads through the real huggingface_hub client against tests/mockhub.py,
retries, resume, hash/pin/parquet verification, atomic placement with a metadata sidecar, skipping
shards already placed, one commit per source, local copies.

hf downloads run `python -m pipeline.data.download` in a subprocess: huggingface_hub reads HF_ENDPOINT,
HF_HUB_OFFLINE and telemetry settings at import, so a fresh process is the honest end-to-end path.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import ROOT, write_chat_shard, write_text_shard
from mockhub import MockHub

from pipeline.config import resolve_config
from pipeline.data import download
from pipeline.data.download import download_shard, main, sidecar_path
from pipeline.errors import PipelineError
from pipeline.rules import rule_params

REPO = "org/fineweb-mini"
PATTERN = "data/shard_{index:05d}.parquet"
FILE0 = "data/shard_00000.parquet"


def params_for(source: dict, **download) -> dict:
    """The --params a rule would pass for a one-source config (schema defaults filled in)."""
    dl = {"retries": 2, "backoff_seconds": 0.01, "timeout_seconds": 10, **download}
    cfg = resolve_config({"sources": {"web": source}, "download": dl, "mixes": {"pretrain": {"weights": {"web": 1.0}}}})
    return rule_params(cfg, "download")


def hf_source(**over) -> dict:
    return {"type": "hf", "repo": REPO, "pattern": PATTERN, "shards": [0, 3], **over}


def shard_bytes(tmp_path: Path, texts: list[str], name: str = "src.parquet") -> bytes:
    return write_text_shard(tmp_path / "upstream" / name, texts).read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(directory: Path) -> list[str]:
    """Hidden temp/partial files the stage left in the output directory."""
    return sorted(p.name for p in directory.glob(".*")) if directory.exists() else []


@pytest.fixture
def hub():
    with MockHub() as h:
        yield h


def run_download(params: dict, out: Path, env: dict, shard: str = "shard_00000") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.data.download", "--params", json.dumps(params), "--source", "web",
           "--shards", shard, "--outputs", str(out)]
    hermetic = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # no developer token or endpoint
    full_env = {**hermetic, "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENFARM_PROGRESS": "0", **env}
    return subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def hub_env(hub: MockHub, tmp_path: Path, **extra) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf_home"), **extra}


# ----------------------------------------------------------------------------- hf: success

@pytest.mark.parametrize("lfs", [True, False], ids=["lfs-sha256", "plain-git-sha1"])
def test_hf_download_verifies_and_writes_sidecar(hub, tmp_path, lfs):
    data = shard_bytes(tmp_path, ["first document", "second document", "third"])
    hub.add_file(REPO, FILE0, data, lfs=lfs)
    params = params_for(hf_source(revision=hub.commit, sha256={FILE0: sha256(data)}))
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params, out, hub_env(hub, tmp_path, HF_TOKEN="hf_secret_token_123"))

    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["sha256"] == sha256(data) and meta["bytes"] == len(data)
    assert meta["rows"] == 3 and meta["row_groups"] == 1 and "text" in meta["columns"]
    assert (meta["source"], meta["shard"], meta["type"]) == ("web", "shard_00000", "hf")
    assert (meta["repo"], meta["repo_type"], meta["filename"]) == (REPO, "dataset", FILE0)
    assert meta["revision"] == meta["commit"] == hub.commit
    assert meta["origin"] == f"{hub.url}/datasets/{REPO}/resolve/{hub.commit}/{FILE0}"
    assert meta["meta"]["stage"] == "download" and meta["meta"]["params"] == params
    assert leftovers(out.parent) == []
    # The token authenticates Hub requests, never reaches the CDN host, and is never logged or stored.
    for r in hub.requests:
        expected = "Bearer hf_secret_token_123" if r["path"].startswith("/datasets/") else None
        assert r["authorization"] == expected, r
    assert "hf_secret_token_123" not in proc.stderr + sidecar_path(out).read_text()


@pytest.mark.parametrize("fault", [{"errors": 2}, {"short": 2}, {"corrupt": 1}, {"drop": 1}])
def test_transient_faults_are_retried(hub, tmp_path, fault):
    data = shard_bytes(tmp_path, [f"document {i} " * 50 for i in range(40)])
    hub.add_file(REPO, FILE0, data)
    hub.fault(REPO, FILE0, **fault)
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(), retries=2), out, hub_env(hub, tmp_path))

    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data
    assert json.loads(sidecar_path(out).read_text())["sha256"] == sha256(data)
    assert leftovers(out.parent) == []


def test_server_errors_beyond_retries_fail_then_rerun_succeeds(hub, tmp_path):
    data = shard_bytes(tmp_path, ["only document"])
    hub.add_file(REPO, FILE0, data)
    hub.fault(REPO, FILE0, errors=3)
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(), retries=1), out, hub_env(hub, tmp_path))
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and "after 2 attempts" in err and "500" in err and FILE0 in err
    assert not out.exists() and not sidecar_path(out).exists()
    assert len(hub.requests_for(FILE0, "HEAD")) == 2

    proc = run_download(params_for(hf_source(), retries=1), out, hub_env(hub, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data


# ----------------------------------------------------------------------------- hf: failures

def test_truncated_body_fails_cleanly_and_rerun_resumes(hub, tmp_path):
    data = shard_bytes(tmp_path, [f"document {i} " * 30 for i in range(60)])
    f = hub.add_file(REPO, FILE0, data)
    hub.fault(REPO, FILE0, short=1)
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(), retries=0), out, hub_env(hub, tmp_path))
    assert proc.returncode == 1
    assert "after 1 attempt (" in proc.stderr and "ending early; rerun to resume" in proc.stderr
    assert not out.exists() and not sidecar_path(out).exists()
    partial = out.parent / f".{out.name}.{f.sha256[:16]}.part"
    assert partial.stat().st_size == len(data) // 2  # the bytes received so far, kept for resuming

    proc = run_download(params_for(hf_source(), retries=0), out, hub_env(hub, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data
    assert [r["range"] for r in hub.requests_for(f.sha256)] == [None, f"bytes={len(data) // 2}-"]
    assert leftovers(out.parent) == []


def test_corrupt_content_fails_and_is_not_kept(hub, tmp_path):
    data = shard_bytes(tmp_path, ["a document"])
    hub.add_file(REPO, FILE0, data)
    hub.fault(REPO, FILE0, corrupt=10)
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(), retries=1), out, hub_env(hub, tmp_path))

    assert proc.returncode == 1
    assert "does not match the Hub's ETag" in proc.stderr and "after 2 attempts" in proc.stderr
    assert not out.exists() and not sidecar_path(out).exists()
    assert leftovers(out.parent) == []  # the bad copy is deleted, so no rerun can trust it


def test_wrong_sha256_pin_fails_and_places_nothing(hub, tmp_path):
    data = shard_bytes(tmp_path, ["a document"])
    hub.add_file(REPO, FILE0, data)
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(sha256={FILE0: "0" * 64})), out, hub_env(hub, tmp_path))

    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert f"sources.web.sha256['{FILE0}'] pins {'0' * 64}" in err and sha256(data) in err
    assert not out.exists() and not sidecar_path(out).exists()
    assert leftovers(out.parent) == []


@pytest.mark.parametrize(
    "source, shard, expected",
    [
        (hf_source(), "shard_00002",
         f"file data/shard_00002.parquet not found in dataset repo {REPO} at revision main"),
        (hf_source(revision="v9.9"), "shard_00000", f"revision 'v9.9' not found in dataset repo {REPO}"),
        (hf_source(repo="org/nope"), "shard_00000", "dataset repo org/nope not found or not accessible"),
    ],
    ids=["missing-file", "missing-revision", "missing-repo"],
)
def test_not_found_is_a_clear_error_without_retries(hub, tmp_path, source, shard, expected):
    hub.add_file(REPO, FILE0, shard_bytes(tmp_path, ["a document"]))
    out = tmp_path / f"raw/web/{shard}.parquet"

    proc = run_download(params_for(source, retries=3), out, hub_env(hub, tmp_path), shard=shard)

    assert proc.returncode == 1
    assert expected in proc.stderr and "HTTP 404" in proc.stderr
    assert len([r for r in hub.requests if r["method"] == "HEAD"]) == 1
    assert not out.exists()


def test_unreachable_hub_names_the_endpoint(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "raw/web/shard_00000.parquet"

    proc = run_download(params_for(hf_source(), retries=2), out, {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path)})

    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: could not download") and "after 3 attempts" in err
    assert f"HF_ENDPOINT (now {endpoint})" in err and "HF_HUB_OFFLINE" in err and FILE0 in err
    assert not out.exists()


def test_offline_mode_is_named(hub, tmp_path):
    out = tmp_path / "raw/web/shard_00000.parquet"
    proc = run_download(params_for(hf_source()), out, hub_env(hub, tmp_path, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 1
    assert "HF_HUB_OFFLINE is set" in proc.stderr
    assert hub.requests_for(FILE0, "HEAD") == []


# ----------------------------------------------------------------------------- hf: shards already placed

FILE2 = "data/shard_00002.parquet"


def body_requests(hub: MockHub, since: int = 0) -> list[dict]:
    """GETs (of a file's bytes: on the CDN for LFS files, at the resolve URL for plain ones) after request `since`."""
    return [r for r in hub.requests[since:] if r["method"] == "GET"]


@pytest.mark.parametrize("lfs", [True, False], ids=["lfs-sha256", "plain-git-sha1"])
def test_placed_shard_is_not_downloaded_again(hub, tmp_path, lfs):
    data = shard_bytes(tmp_path, ["first document", "second document"])
    hub.add_file(REPO, FILE0, data, lfs=lfs)
    params = params_for(hf_source(sha256={FILE0: sha256(data)}))
    out = tmp_path / "raw/web/shard_00000.parquet"
    assert run_download(params, out, hub_env(hub, tmp_path)).returncode == 0
    stat, sidecar, seen = out.stat(), sidecar_path(out).read_text(), len(hub.requests)

    proc = run_download(params, out, hub_env(hub, tmp_path))

    assert proc.returncode == 0, proc.stderr
    assert "already present and verified" in proc.stderr and ": placed " not in proc.stderr
    assert [r["method"] for r in hub.requests[seen:]] == ["HEAD"]  # metadata only, no body
    assert out.read_bytes() == data
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # not rewritten
    assert sidecar_path(out).read_text() == sidecar
    assert leftovers(out.parent) == []


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:], lambda b: b[:-10]],
    ids=["bytes-flipped", "truncated"],
)
def test_placed_shard_damaged_on_disk_is_downloaded_again(hub, tmp_path, damage):
    data = shard_bytes(tmp_path, [f"document {i}" for i in range(20)])
    f = hub.add_file(REPO, FILE0, data)
    out = tmp_path / "raw/web/shard_00000.parquet"
    assert run_download(params_for(hf_source()), out, hub_env(hub, tmp_path)).returncode == 0
    sidecar = json.loads(sidecar_path(out).read_text())
    out.write_bytes(damage(data))  # the sidecar is intact and still describes the good file

    proc = run_download(params_for(hf_source()), out, hub_env(hub, tmp_path))

    assert proc.returncode == 0, proc.stderr
    assert "no longer matches the size and sha256" in proc.stderr and "already present" not in proc.stderr
    assert len(hub.requests_for(f.sha256)) == 2  # the body, fetched on both runs
    assert out.read_bytes() == data
    assert json.loads(sidecar_path(out).read_text())["sha256"] == sidecar["sha256"] == sha256(data)
    assert leftovers(out.parent) == []


def test_file_changed_upstream_is_downloaded_again(hub, tmp_path):
    old, new = (shard_bytes(tmp_path, ["old document"], "old.parquet"),
                shard_bytes(tmp_path, ["new document", "added"], "new.parquet"))
    hub.add_file(REPO, FILE0, old)
    out = tmp_path / "raw/web/shard_00000.parquet"
    assert run_download(params_for(hf_source()), out, hub_env(hub, tmp_path)).returncode == 0
    hub.add_file(REPO, FILE0, new)
    hub.commit = "b" * 40  # a new commit on main: the only shard placed is this one, so no mixing

    proc = run_download(params_for(hf_source()), out, hub_env(hub, tmp_path))

    assert proc.returncode == 0, proc.stderr
    assert "already present" not in proc.stderr
    assert len(hub.requests_for(sha256(new))) == 1
    assert out.read_bytes() == new
    meta = json.loads(sidecar_path(out).read_text())
    assert (meta["etag"], meta["sha256"], meta["commit"], meta["rows"]) == (sha256(new), sha256(new), "b" * 40, 2)


@pytest.mark.parametrize(
    "over, expected",
    [({"sha256": {FILE0: "0" * 64}}, f"sources.web.sha256['{FILE0}'] pins {'0' * 64}"),
     ({"text_column": "body"}, "has no column 'body'")],
    ids=["pin", "text-column"],
)
def test_placed_shard_is_checked_against_the_current_config(hub, tmp_path, over, expected):
    data = shard_bytes(tmp_path, ["a document"])
    hub.add_file(REPO, FILE0, data)
    out = tmp_path / "raw/web/shard_00000.parquet"
    assert run_download(params_for(hf_source()), out, hub_env(hub, tmp_path)).returncode == 0
    seen = len(hub.requests)

    proc = run_download(params_for(hf_source(**over)), out, hub_env(hub, tmp_path))

    assert proc.returncode == 1
    assert expected in proc.stderr.strip().splitlines()[-1]
    assert body_requests(hub, seen) == []  # a download would give the same bytes: fail without one


# ----------------------------------------------------------------------------- hf: revision consistency

def test_branch_moving_between_shards_fails_and_pinning_fixes_it(hub, tmp_path):
    data0, data2 = shard_bytes(tmp_path, ["shard zero"], "0.parquet"), shard_bytes(tmp_path, ["shard two"], "2.parquet")
    hub.add_file(REPO, FILE0, data0)
    hub.add_file(REPO, FILE2, data2)
    out0, out2 = tmp_path / "raw/web/shard_00000.parquet", tmp_path / "raw/web/shard_00002.parquet"
    old = hub.commit
    assert run_download(params_for(hf_source()), out0, hub_env(hub, tmp_path)).returncode == 0
    hub.commit = new = "b" * 40  # main moves between the two shards

    proc = run_download(params_for(hf_source()), out2, hub_env(hub, tmp_path), shard="shard_00002")

    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: source 'web': shard 'shard_00002'") and "shard 'shard_00000'" in err
    assert old in err and new in err and "pin sources.web.revision to a commit sha" in err
    assert not out2.exists() and not sidecar_path(out2).exists()
    assert hub.requests_for(sha256(data2)) == []  # failed on the HEAD, before fetching the body
    assert leftovers(out2.parent) == []

    # The fix: pin the revision. Shard 0's bytes are the same at the new commit, so it is kept and
    # only re-recorded, and both shards then record one commit.
    pinned = params_for(hf_source(revision=new))
    proc = run_download(pinned, out2, hub_env(hub, tmp_path), shard="shard_00002")
    assert proc.returncode == 0, proc.stderr
    proc = run_download(pinned, out0, hub_env(hub, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "already present and verified" in proc.stderr and len(hub.requests_for(sha256(data0))) == 1
    for out in (out0, out2):
        meta = json.loads(sidecar_path(out).read_text())
        assert meta["revision"] == meta["commit"] == new and new in meta["origin"]
        assert meta["meta"]["params"] == pinned


def test_commit_is_checked_again_before_placing(hub, tmp_path, monkeypatch):
    """Another job may place a shard from another commit while this one downloads (in-process run:
    the endpoint is read from HF_ENDPOINT at call time)."""
    hub.add_file(REPO, FILE0, shard_bytes(tmp_path, ["a document"]))
    out0, out2 = tmp_path / "raw/web/shard_00000.parquet", tmp_path / "raw/web/shard_00002.parquet"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fetch = download.fetch_hf

    def fetch_while_another_job_places(*args, **kwargs):
        got = fetch(*args, **kwargs)
        out2.write_bytes(b"placed by another job")
        other = {"source": "web", "shard": "shard_00002", "type": "hf", "repo": REPO, "repo_type": "dataset",
                 "revision": "main"}
        sidecar_path(out2).write_text(json.dumps({**other, "commit": "b" * 40}))
        return got

    monkeypatch.setattr(download, "fetch_hf", fetch_while_another_job_places)
    with pytest.raises(PipelineError, match=f"shard 'shard_00000' .* to commit {hub.commit}, "
                                            f"but shard 'shard_00002' .* commit {'b' * 40}"):
        download_shard(params_for(hf_source()), "web", "shard_00000", out0)
    assert not out0.exists() and not sidecar_path(out0).exists()
    assert leftovers(out0.parent) == []


# ----------------------------------------------------------------------------- local sources

def local_params(tmp_path: Path, **over) -> dict:
    return params_for({"type": "local", "glob": str(tmp_path / "src" / "*.parquet"), **over})


def test_local_shard_is_copied_and_verified(tmp_path):
    src = write_text_shard(tmp_path / "src/shard_00000.parquet", ["one", "two"])
    out = tmp_path / "raw/web/shard_00000.parquet"

    main(["--params", json.dumps(local_params(tmp_path)), "--source", "web", "--shards", "shard_00000",
          "--outputs", str(out)])

    assert out.read_bytes() == src.read_bytes()
    assert out.stat().st_ino != src.stat().st_ino  # a copy, not a link
    meta = json.loads(sidecar_path(out).read_text())
    assert (meta["type"], meta["origin"], meta["rows"]) == ("local", str(src.resolve()), 2)
    assert meta["sha256"] == sha256(src.read_bytes()) and meta["bytes"] == src.stat().st_size
    assert meta["meta"]["inputs"] == [{"path": str(src), "bytes": src.stat().st_size}]
    write_text_shard(src, ["edited upstream"])
    assert pq.read_table(out)["text"].to_pylist() == ["one", "two"]
    assert leftovers(out.parent) == []


def test_local_chat_shard_checks_the_messages_column(tmp_path):
    write_chat_shard(tmp_path / "src/chat_0.parquet",
                     [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]])
    out = tmp_path / "raw/web/chat_0.parquet"
    record = download_shard(local_params(tmp_path, format="chat"), "web", "chat_0", out)
    assert record["rows"] == 1 and out.exists()


def _truncated(path: Path) -> None:
    write_text_shard(path, ["doc"] * 50)
    path.write_bytes(path.read_bytes()[:-40])


def _corrupt_pages(path: Path) -> None:
    """Overwrite the text column's pages with garbage, leaving the footer intact."""
    write_text_shard(path, [f"document number {i}" for i in range(500)])
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(1)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start + 30 : start + chunk.total_compressed_size - 10] = b"\xff" * (chunk.total_compressed_size - 40)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "make, over, expected",
    [
        (_truncated, {}, "is not a readable parquet file"),
        (_corrupt_pages, {}, "is corrupt: column 'text' cannot be decoded"),
        (lambda p: write_text_shard(p, ["doc"], column="body"), {},
         "has no column 'text' (columns present: id, body); set sources.web.text_column"),
        (lambda p: write_text_shard(p, []), {}, "has zero rows"),
        (lambda p: pq.write_table(pa.table({"text": [1, 2]}), p), {}, "column 'text' has type int64, expected string"),
        (lambda p: pq.write_table(pa.table({"text": [None, None]}), p), {},
         "column 'text' holds no text, every row is null (parquet type null); fix the export"),
        (lambda p: write_text_shard(p, ["doc"]), {"format": "chat"}, "has no column 'messages'"),
        (lambda p: pq.write_table(pa.table({"messages": pa.array(
            [[{"role": None, "content": "hi"}], [{"role": None, "content": "hi"}, {"role": 2, "content": "x"}]],
            pa.list_(pa.struct([("role", pa.int64()), ("content", pa.string())])))}), p),
         {"format": "chat"}, ": row 1, message 1: field 'role' of column 'messages' is 2 (int64), not a string"),
        (lambda p: write_text_shard(p, ["doc"]), {"sha256": {"shard_00000.parquet": "f" * 64}},
         "sources.web.sha256['shard_00000.parquet'] pins"),
    ],
    ids=["truncated", "corrupt-pages", "missing-column", "empty", "wrong-type", "all-null", "chat-without-messages",
         "chat-role-not-a-string", "pin-mismatch"],
)
def test_bad_local_shard_is_a_clear_error_and_places_nothing(tmp_path, make, over, expected):
    src = tmp_path / "src/shard_00000.parquet"
    src.parent.mkdir(parents=True)
    make(src)
    out = tmp_path / "raw/web/shard_00000.parquet"

    with pytest.raises(PipelineError) as e:
        download_shard(local_params(tmp_path, **over), "web", "shard_00000", out)

    assert str(src) in str(e.value) and expected in str(e.value)
    assert not out.exists() and not sidecar_path(out).exists()
    assert leftovers(out.parent) == []


@pytest.mark.parametrize("typ", [pa.large_string(), pa.binary(), pa.large_binary()], ids=str)
def test_text_column_may_be_large_string_or_binary(tmp_path, typ):
    """The readers downstream take text as bytes and count a row that is not UTF-8 as invalid."""
    from pipeline.data.contract import iter_documents

    src = tmp_path / "src/shard_00000.parquet"
    src.parent.mkdir(parents=True)
    values = ["ok", "fine"] if pa.types.is_large_string(typ) else [b"ok", b"\xff\xfe not utf-8"]
    pq.write_table(pa.table({"text": pa.array(values, typ)}), src)
    out = tmp_path / "raw/web/shard_00000.parquet"

    record = download_shard(local_params(tmp_path), "web", "shard_00000", out)

    assert record["rows"] == 2 and out.read_bytes() == src.read_bytes()
    batches = list(iter_documents(out, {"format": "text", "text_column": "text"}, batch_size=10))
    assert sum(b.invalid_utf8 for b in batches) == (0 if pa.types.is_large_string(typ) else 1)
    assert [d for b in batches for d in b.docs][0] == "ok"


def test_local_shard_already_placed_is_copied_again(tmp_path):
    src = write_text_shard(tmp_path / "src/shard_00000.parquet", ["one"])
    out = tmp_path / "raw/web/shard_00000.parquet"
    download_shard(local_params(tmp_path), "web", "shard_00000", out)
    out.write_bytes(b"damaged")

    download_shard(local_params(tmp_path), "web", "shard_00000", out)

    assert out.read_bytes() == src.read_bytes()


def test_unknown_shard_and_source_are_clear_errors(tmp_path):
    write_text_shard(tmp_path / "src/shard_00000.parquet", ["doc"])
    params = local_params(tmp_path)
    with pytest.raises(PipelineError,
                       match=r"'shard_00009' is not a shard of source 'web' \(its shards: shard_00000\)"):
        download_shard(params, "web", "shard_00009", tmp_path / "out.parquet")
    with pytest.raises(PipelineError, match=r"unknown source 'chat' \(sources: web\)"):
        download_shard(params, "chat", "shard_00000", tmp_path / "out.parquet")


def test_a_group_resolves_the_revision_once(hub, tmp_path, monkeypatch):
    """The group's first shard resolves `main`; every later request of the job (HEAD and body) is at
    that commit, so a branch moving during the job cannot mix versions (in-process run: the
    endpoint is read from HF_ENDPOINT at call time)."""
    hub.add_file(REPO, FILE0, shard_bytes(tmp_path, ["shard zero"], "0.parquet"))
    hub.add_file(REPO, FILE2, shard_bytes(tmp_path, ["shard two"], "2.parquet"), lfs=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out0, out2 = tmp_path / "raw/web/shard_00000.parquet", tmp_path / "raw/web/shard_00002.parquet"

    main(["--params", json.dumps(params_for(hf_source())), "--source", "web",
          "--shards", "shard_00000", "shard_00002", "--outputs", str(out0), str(out2)])

    resolve = f"/datasets/{REPO}/resolve"
    assert [(r["method"], r["path"]) for r in hub.requests if not r["path"].startswith("/cdn/")] == [
        ("HEAD", f"{resolve}/main/{FILE0}"),
        ("HEAD", f"{resolve}/{hub.commit}/{FILE2}"), ("GET", f"{resolve}/{hub.commit}/{FILE2}")]
    for out, name in ((out0, FILE0), (out2, FILE2)):
        meta = json.loads(sidecar_path(out).read_text())
        assert (meta["revision"], meta["commit"]) == ("main", hub.commit)
        assert meta["origin"] == f"{hub.url}{resolve}/{hub.commit}/{name}"
