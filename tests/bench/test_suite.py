"""`python -m pipeline.bench --suite reference`: its CPU path on a tiny config (the CI check of the GPU suite)."""
from __future__ import annotations

import json

import pytest
import yaml
from test_bench import TINY
from test_train import one_thread  # noqa: F401 (autouse fixture)

from pipeline.bench.step import main
from pipeline.bench.suite import CUDA_ONLY, REFERENCE_SUITE, format_suite
from pipeline.errors import PipelineError


@pytest.fixture
def configfile(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
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
