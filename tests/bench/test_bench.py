"""pipeline.bench: the CPU path of the step benchmark on a tiny config."""
from __future__ import annotations

import json

import pytest
import yaml
from builders import BENCH_TINY

from pipeline.bench.throughput import bench_config, main
from pipeline.config import load_config
from pipeline.errors import PipelineError


@pytest.fixture
def configfile(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(BENCH_TINY))
    return path


def test_json_fields(configfile, capsys):
    main(["--configfile", str(configfile), "--micro-batch", "2", "--steps", "3", "--warmup", "1", "--json",
          "--checkpoint", "block"])
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and r["micro_batch"] == 2 and r["seq_len"] == 32 and r["steps"] == 3
    assert r["activation_checkpointing"] == "block" and r["compile"] is False and r["precision"] == "fp32"
    assert r["step_time_s"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_time_s"])
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / r["peak_flops"])
    assert r["n_params"] > 0 and r["loss"] > 0
    assert "mem/allocated_gb" not in r  # CUDA only


def test_text_output_has_every_field(configfile, capsys):
    main(["--configfile", str(configfile), "--micro-batch", "2", "--steps", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert "step 0:" in out and "(warm-up)" in out and "step 2:" in out
    for field in ("step time", "tokens/s", "MFU"):
        assert field in out


def test_overrides_and_errors(configfile):
    cfg = bench_config(load_config(configfile), micro_batch=8, compile_model=True, checkpoint="mlp", fp8="rowwise")
    assert (cfg["train"]["micro_batch"], cfg["train"]["compile"], cfg["train"]["activation_checkpointing"],
            cfg["train"]["fp8"]) == (8, True, "mlp", "rowwise")
    assert bench_config(load_config(configfile))["train"]["micro_batch"] == 4  # None keeps the config's
    with pytest.raises(PipelineError, match="fp8 needs hardware.device: cuda"):
        main(["--configfile", str(configfile), "--micro-batch", "2", "--fp8", "tensorwise", "--steps", "1"])
