"""pipeline.io helpers: progress bars and atomic writes."""
from __future__ import annotations

import sys

import pytest

from pipeline.io import atomic_write, progress


@pytest.mark.parametrize("env, tty, shown", [
    (None, True, True), (None, False, False),  # by default: only on an interactive terminal
    ("1", False, True),                        # forced on: under Snakemake, stderr is a pipe into tee
    ("0", True, False),                        # forced off
])
def test_progress_bar_follows_the_terminal_unless_forced(monkeypatch, env, tty, shown):
    if env is None:
        monkeypatch.delenv("TOKENFARM_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("TOKENFARM_PROGRESS", env)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    bar = progress(range(3), desc="x")
    assert bar.disable is (not shown)
    assert list(bar) == [0, 1, 2]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_write(target) as f:
            f.write("partial")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_write(target) as f:
        f.write("whole")
    assert target.read_text() == "whole" and list(tmp_path.iterdir()) == [target]
