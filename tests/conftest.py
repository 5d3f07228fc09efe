"""Fixtures shared by every test module, and the test environment (builders: tests/builders.py)."""
from __future__ import annotations

import os
from pathlib import Path


def own_cores() -> None:
    """Under `pytest -n N`, worker i keeps CPUs i, i+N, ... of the machine's set (before torch starts its threads).

    Every subprocess a test starts inherits the set, so `snakemake --cores all`, a training job's threads and
    torch in this process size themselves to the worker's share. Unpinned, two workers on 2 cores each ran
    2-thread training beside the other's jobs, and OpenMP's spinning threads made a step 4x slower."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")):
        return
    cpus, n = sorted(os.sched_getaffinity(0)), int(count)
    if len(cpus) >= n:
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % n::n])


own_cores()


def cache_bytecode() -> None:
    """Write .pyc files (and pytest's rewritten test modules) even where the shell sets PYTHONDONTWRITEBYTECODE,
    as this VM does: otherwise every Snakemake, job and rank process the suite starts compiles the package anew."""
    import sys

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


cache_bytecode()

import pytest  # noqa: E402
import torch  # noqa: E402
from builders import ROOT, served_snakemake, trained_run_inputs  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENFARM_PROGRESS", "0")


# The longest files first (`make test` prints the slowest tests): xdist hands whole files to the workers in
# collection order (the Makefile's --no-loadscope-reorder), so README's sequence (~13 min on one core) starts
# at once and the other files fill the second worker around it.
LONGEST_FIRST = ("test_user_path.py", "test_schema_extremes.py", "test_workflow.py", "test_fsdp.py",
                 "test_subcommands.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within a file


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


@pytest.fixture(scope="module")
def snakemake_cli():
    """A module's `builders.snakemake(...)` commands (and any it passes the server to) run Snakemake's CLI in fresh
    children of one process that imported Snakemake once (builders.SnakemakeServer). Commands started as from a
    terminal (README's, the killed runs') and the `snakemake` script a user's shell finds are not served."""
    with served_snakemake() as server:
        yield server
