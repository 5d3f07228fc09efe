"""`make gpu-check`'s checkpoint rows (pipeline/bench/ckpt.py) on CPU at a tiny size: the code path the GPU
runs — the trainer's `Checkpointer` asynchronous save (DCP async_save on a 1-rank group for the fsdp row, the
background file write for the ddp row), the page cache dropped, the resume's verification and load — with
its figures and the comparison with pipeline.planning.train_jobs."""
from __future__ import annotations

import pytest
import torch

from pipeline.bench import ckpt
from pipeline.planning.train_jobs import checkpointing
from pipeline.run_config import run_config


@pytest.mark.parametrize("preset", [row[1] for row in ckpt.CKPT_ROWS])
def test_a_checkpoint_row_runs_its_path_on_cpu_at_a_tiny_size(preset, tmp_path):
    cfg = ckpt.row_config(preset)
    n = 3 * ckpt.BLOCK_COLS + 100  # a 3 × 4096 block and a 100-vector
    m = ckpt.run_ckpt_row(cfg, torch.device("cpu"), tmp_path / "ckpt-row", n_params=n)
    assert m["n_params"] == n and m["checkpoint_gb"] * 1e9 >= ckpt.BYTES_PER_PARAM * n  # weights + both moments
    assert all(m[k] > 0 for k in ("first_blocked_s", "blocked_s", "write_s", "verify_s", "load_s"))
    ck = checkpointing(run_config(cfg))  # the plan's figures, and the row's scaled to the same bytes
    assert m["predicted"] == {"blocked_s": ck["block_s"], "write_s": ck["write_s"],
                              "verify_s": ck["startup"]["verify"], "load_s": ck["startup"]["load"]}
    assert m["job"]["verify_s"] == pytest.approx(m["verify_s"] * ck["size_gb_total"] / m["checkpoint_gb"], rel=0.01)
    assert not (tmp_path / "ckpt-row").exists()  # the row cleans up
    assert not torch.distributed.is_initialized()  # the fsdp row's 1-rank group is gone


def test_the_rows_are_the_presets_per_rank_checkpoints_and_skipped_without_cuda(tmp_path):
    sizes = {name: ckpt.row_params(ckpt.row_config(preset)) for name, preset, _ in ckpt.CKPT_ROWS}
    assert sizes == {"ckpt fsdp 8B rank shard": 1_003_782_656, "ckpt ddp 1.2B file": 1_241_581_568}  # 8.03B / 8
    rows = ckpt.run_ckpt_rows(False, tmp_path)
    assert [r["skipped"] for r in rows] == ["needs CUDA: no CUDA device is visible"] * 2
    assert all(r["predicted"]["write_s"] > r["predicted"]["blocked_s"] > 0 and r["estimate_s"] > 0 for r in rows)
    text = ckpt.format_ckpt(rows)
    assert "| ckpt fsdp 8B rank shard | needs CUDA" in text and "pipeline.planning.train_jobs.checkpointing" in text
