"""Shared test helpers: tiny parquet shards and a resolved default config."""
from __future__ import annotations

import os
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
