"""`python -m pipeline.bench --suite reference`: its CPU path on a tiny config (the CI check of the GPU suite)."""
from __future__ import annotations

import json

import pytest
import yaml
from builders import BENCH_TINY

from pipeline.bench.suite import CUDA_ONLY, REFERENCE_SUITE, format_suite
from pipeline.bench.throughput import main
from pipeline.errors import PipelineError


@pytest.fixture
def configfile(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(BENCH_TINY))
    return path


def test_cpu_suite_runs_every_row_and_writes_the_table(configfile, tmp_path, capsys):
    out = tmp_path / "bench" / "reference.md"
    main(["--suite", "reference", "--configfile", str(configfile), "--device", "cpu", "--steps", "1",
          "--warmup", "0", "--out", str(out)])
    text = out.read_text()
    assert text in capsys.readouterr().out
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["name"] for r in rows] == [name for name, *_ in REFERENCE_SUITE]
    for r in rows:
        assert r["predicted"]["step_time_s"] > 0 and r["predicted"]["reserved_gb"] > 0
        cuda_only = r["fp8"] != "none" or r["optimizer"] == "adamw8bit"
        assert (r["skipped"] == CUDA_ONLY) == cuda_only
        if not cuda_only:  # measured on this CPU, with the ratio in the table
            m = r["measured"]
            assert m["device"] == "cpu" and m["step_time_s"] > 0 and m["peak_gb"] is None
            ratio = m["step_time_s"] / r["predicted"]["step_time_s"]
            assert f"{m['step_time_s']:.3f} / {r['predicted']['step_time_s']:.3f} / {ratio:.2f}" in text
        assert f"| {r['name']} |" in text
    modes = {(r["micro_batch"], r["activation_checkpointing"]) for r in rows}
    assert {(16, "none"), (16, "block"), (64, "block"), (16, "mlp"), (16, "attention")} <= modes


def test_oom_row_is_reported_not_fatal():
    row = {"name": "64 block", "predicted": {"step_time_s": 2.0, "tokens_per_s": 65536.0, "mfu": 0.4,
                                             "peak_gb": 60.0, "reserved_gb": 61.0},
           "measured": None, "skipped": "OOM"}
    assert "| 64 block | OOM; pred. 2.000 |" in format_suite([row], "t")


def test_suite_without_a_gpu_needs_an_explicit_device(configfile, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PipelineError, match="no CUDA device is visible; pass --device cpu"):
        main(["--suite", "reference", "--configfile", str(configfile)])


# ----------------------------------------------------------------------------- issue 18, item 2

def _fake_bench(fail_on: dict, seen_files: list, out):
    """A `run_bench` stand-in: raises `fail_on[micro_batch, ckpt]` for that row, records what the
    table file holds when each row starts."""
    def bench(cfg, steps, warmup):
        t = cfg["train"]
        seen_files.append(json.loads(out.with_suffix(".json").read_text())["rows"] if out.with_suffix(
            ".json").exists() else [])
        err = fail_on.get((t["micro_batch"], t["activation_checkpointing"]))
        if err is not None:
            raise err
        return {"step_time_s": 0.5, "tokens_per_s": 1000.0, "mfu": 0.3, "mem/peak_gb": 1.0, "mem/reserved_gb": 1.5,
                "device": "fake"}
    return bench


def test_a_failing_row_is_recorded_and_the_table_written_after_every_row(configfile, tmp_path, monkeypatch):
    """Before: only OutOfMemoryError was caught (any other exception lost every row) and the table
    was written once at the end."""
    import torch

    from pipeline.bench import throughput as step

    out = tmp_path / "reference.md"
    seen: list = []
    fail = {(16, "mlp"): RuntimeError("inductor: C++ compile failed | exit 1\nlong trace"),
            (16, "attention"): torch.OutOfMemoryError("CUDA out of memory")}
    monkeypatch.setattr(step, "run_bench", _fake_bench(fail, seen, out))
    main(["--suite", "reference", "--configfile", str(configfile), "--device", "cpu", "--steps", "1",
          "--warmup", "0", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["name"] for r in rows] == [name for name, *_ in REFERENCE_SUITE]
    by_name = {r["name"]: r for r in rows}
    assert by_name["16 mlp"]["skipped"] == "failed: RuntimeError: inductor: C++ compile failed / exit 1"
    assert by_name["16 attention"]["skipped"] == "OOM"
    assert by_name["16 block"]["measured"]["step_time_s"] == 0.5  # rows after a failure still run
    assert "| 16 mlp | failed: RuntimeError: inductor: C++ compile failed / exit 1; pred." in out.read_text()
    # the table on disk grew row by row: each bench call saw the rows finished before it
    measured_rows = [r for r in REFERENCE_SUITE if r[3] == "none" and r[4] == "adamw"]
    assert [len(s) for s in seen] == [REFERENCE_SUITE.index(r) for r in measured_rows]


def test_rows_release_the_gpu_with_gc_before_empty_cache(monkeypatch):
    """The CUDA branch on CPU: after each row gc.collect() runs before torch.cuda.empty_cache()
    (a model held by a reference cycle is only freed by the collector, and only freed blocks return)."""
    import gc

    import torch

    from pipeline.bench import suite
    from pipeline.config import resolve_config

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    cfg = resolve_config({**BENCH_TINY, "hardware": {"device": "cuda", "gpu_type": "H100"}})

    def bench(cfg, steps, warmup):
        raise ValueError("boom")

    rows = suite.run_suite(cfg, 1, 0, bench, suite=REFERENCE_SUITE[:2])
    assert [r["skipped"] for r in rows] == ["failed: ValueError: boom"] * 2
    assert calls == ["gc", "empty_cache"] * 2
