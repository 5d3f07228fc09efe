"""Fixtures of the data-stage tests."""
from __future__ import annotations

import pytest
from builders import tokenized_shards


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tokenized shards web/a, web/b (text) and chat/c (chat) with a real tiny BPE (builders.tokenized_shards)."""
    return tokenized_shards(tmp_path_factory.mktemp("pack"))
