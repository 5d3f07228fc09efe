"""Fixtures shared by every test module, and the test environment (builders: tests/builders.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from builders import ROOT, trained_run_inputs

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENFARM_PROGRESS", "0")


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> dict:
    """The tiny trained run's inputs (builders.trained_run_inputs); tests/data overrides `data` with its shards."""
    return trained_run_inputs(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one intra-op thread (no contention on shared CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
