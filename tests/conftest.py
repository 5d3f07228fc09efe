"""Shared test helpers: tiny parquet shards, and watching a run's processes and metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENFARM_PROGRESS", "0")


def write_text_shard(path, texts, ids=None, column="text") -> Path:
    """Write a FineWeb-shaped parquet shard (id + text) with the given documents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = ids if ids is not None else [f"{path.stem}-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, column: texts}), path)
    return path


def write_chat_shard(path, conversations, ids=None) -> Path:
    """conversations: list of [{'role': 'user'|'assistant', 'content': str}, ...]."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = ids if ids is not None else [f"{path.stem}-{i}" for i in range(len(conversations))]
    typ = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.table({"id": ids, "messages": pa.array(conversations, type=typ)}), path)
    return path


@pytest.fixture
def root() -> Path:
    return ROOT


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"snakemake ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def processes_in(path: Path) -> list[str]:
    """Processes whose working directory is the project (every job of the run's): 'pid cmdline'."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(path):
                out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ').decode()}")
        except OSError:
            pass
    return out


def logged_steps(train_dir: Path) -> list[int]:
    path = train_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln)["step"] for ln in lines if ln.endswith("}")]


def past_checkpoint(train_dir: Path) -> bool:
    """A checkpoint, and a step logged after it (one the resume redoes)."""
    latest = train_dir / "ckpt/latest"
    return latest.exists() and any(s > int(latest.read_text().strip()[5:11]) for s in logged_steps(train_dir))


def kill_group(proc: subprocess.Popen, path: Path) -> None:
    """kill -9 the run's process group; within seconds no process of the run may be left."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := processes_in(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"processes survived the kill: {left}"
