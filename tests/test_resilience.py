"""pipeline/planning/train_jobs.py: checkpoint costs, the Young/Daly interval, and each stage's chain of jobs."""
from __future__ import annotations

import math

import pytest
from builders import ROOT

from pipeline.config import load_config
from pipeline.errors import PlanError
from pipeline.planning.parallel import resolve_parallel
from pipeline.planning.train_jobs import checkpointing, predicted_save_s, resolve_ckpt_interval, stage_jobs
from pipeline.run_config import RunConfig, run_config, with_section


def preset(name: str, **hardware) -> RunConfig:
    """The preset resolved as the Snakefile resolves it (a test edits it with `with_section`)."""
    return resolve_parallel(run_config(load_config(ROOT / f"configs/{name}.yaml",
                                                   {"hardware": hardware} if hardware else None)))


def test_the_interval_is_young_daly_at_the_jobs_mtbf():
    cfg = preset("llama3-8b-fineweb")
    ck = checkpointing(cfg)
    mtbf_s = cfg.hardware.gpu_mtbf_hours / 8 * 3600  # 8 GPUs
    assert ck["mtbf_hours"] * 3600 == pytest.approx(mtbf_s)
    assert ck["young_daly_s"] == pytest.approx(math.sqrt(2 * ck["block_s"] * mtbf_s))
    assert ck["interval_steps"] == round(ck["young_daly_s"] / ck["step_s"])  # the preset's ckpt_interval: auto
    assert ck["lost_hours_per_failure"] * 3600 == pytest.approx(
        ck["interval_steps"] * ck["step_s"] / 2 + ck["write_s"] + ck["startup_s"])
    # a cheaper save or a less reliable cluster checkpoints more often
    flaky = checkpointing(preset("llama3-8b-fineweb", gpu_mtbf_hours=5000))
    assert flaky["interval_steps"] < ck["interval_steps"]


def test_the_8b_checkpoint_is_sharded_and_written_in_the_background():
    ck = checkpointing(preset("llama3-8b-fineweb"))
    # fp32 weights + AdamW's two fp32 moments: 12 bytes a parameter (+ the small train state), 1/8 per rank (fsdp)
    assert 12 * 8.03e9 / 1e9 < ck["size_gb_total"] < 12 * 8.04e9 / 1e9 + 0.1
    assert ck["size_gb_rank"] == pytest.approx(ck["size_gb_total"] / 8, rel=0.01)
    assert ck["async"] and ck["block_s"] < 1 < ck["write_s"]  # staging blocks, the write does not
    sync = with_section(preset("llama3-8b-fineweb"), "train", async_ckpt=False)
    assert predicted_save_s(sync) == pytest.approx(ck["block_s"] + ck["write_s"])
    assert ck["startup"]["verify"] > 0 and ck["startup"]["compile"] > 0  # every restart verifies and recompiles


@pytest.mark.parametrize(("name", "at_least"), [("llama3-8b-fineweb", 676 // 24), ("llama3-1b-fineweb", 1)])
def test_a_24_hour_limit_splits_a_stage_into_jobs_that_fit_it(name, at_least):
    jobs = stage_jobs(preset(name, max_job_hours=24))["pretrain"]
    assert jobs["jobs"] >= at_least and jobs["runtime_min"] == 24 * 60
    assert jobs["hours_per_job"] <= 24
    assert jobs["wall_hours"] > jobs["compute_hours"]  # saves and every restart's start-up on top
    assert jobs["restarts"] >= jobs["jobs"] - 1


def test_without_a_limit_a_stage_is_one_job_sized_by_its_own_hours():
    cfg = resolve_parallel(run_config(load_config(ROOT / "config.yaml")))
    jobs = stage_jobs(cfg)
    assert {s["jobs"] for s in jobs.values()} == {1}
    # the short stages ask less than the long one: each stage's own hours, not the run's
    assert jobs["pretrain"]["runtime_min"] >= jobs["sft"]["runtime_min"]
    assert all(s["runtime_min"] == math.ceil(90 * s["compute_hours"] + 90 * s["checkpoints"] *
                                             checkpointing(cfg)["block_s"] / 3600) + 30 for s in jobs.values())


def test_a_limit_too_short_to_train_is_refused_naming_the_key():
    with pytest.raises(PlanError, match=r"hardware.max_job_hours = 0.05 h leaves no time to train"):
        stage_jobs(preset("llama3-8b-fineweb", max_job_hours=0.05))


def test_auto_resolves_to_steps_and_a_number_stays():
    cfg = preset("llama3-1b-fineweb")
    assert cfg.train.ckpt_interval == "auto"
    resolved = resolve_ckpt_interval(cfg).train.ckpt_interval
    assert isinstance(resolved, int) and 1 <= resolved <= stage_jobs(cfg)["pretrain"]["num_steps"]
    typed = with_section(cfg, "train", ckpt_interval=250)
    assert resolve_ckpt_interval(typed) is typed and checkpointing(typed)["interval_steps"] == 250
