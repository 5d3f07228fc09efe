"""The IsoFLOP sweep as a Snakemake DAG on tiny data (`snakemake scaling`, workflow/rules/scaling.smk): a
few tiny points train, evaluate and are fitted into the report; adding a budget reruns only its points."""
from __future__ import annotations

import copy
import json

import pytest
from builders import TINY, make_project, planned_jobs, snakemake, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("snakemake_cli")]  # Snakemake imported once

# 2 budgets × 3 depths of 8·depth-dim models; the largest point trains ~100 steps of 512 tokens
SWEEP = {"budgets": [1.5e9, 3e9], "depths": [1, 2, 3], "aspect": 8, "head_dim": 8, "global_batch_tokens": 512,
         "bootstrap": 50}


def sweep_config(**scaling) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["eval"]["core_interval"] = 0
    cfg["scaling"] = {**SWEEP, **scaling}
    return cfg


def test_sweep_trains_its_points_fits_them_and_a_new_budget_reruns_only_its_points(tmp_path):
    path = make_project(tmp_path, sweep_config())
    snakemake(path, "scaling")
    R = path / "results/t/scaling"
    for f in ("fit.json", "report.md", "scaling.png"):
        assert (R / f).stat().st_size > 0, f
    fit = json.loads((R / "fit.json").read_text())
    assert len(fit["points"]) == 6 and len(fit["minima"]) == 2
    for p in fit["points"]:  # each point trained its own budget: its tokens × its FLOPs per token ≈ C
        rep = json.loads((R / p["budget"] / str(p["depth"]) / "report.json").read_text())
        assert rep["summary"]["tokens_trained"] == p["tokens"] and rep["val_bpb"] > 0
        assert abs(p["tokens"] * p["flops_per_token"] / p["flops"] - 1) < 0.1
    assert "| budget C |" in (R / "report.md").read_text()
    assert not (path / "results/t/train").exists()  # the sweep trains no stage of the run
    # adding a budget: only its points (and the fit) are planned
    write_config(path, sweep_config(budgets=[1.5e9, 2e9, 3e9]))
    jobs = planned_jobs(snakemake(path, "scaling", "-n"))
    assert jobs == {"scaling_point": 3, "scaling": 1}, jobs
    # the points train with the run's optimizer: an lr edit reruns every point (and no data stage)
    cfg = sweep_config(budgets=[1.5e9, 2e9, 3e9])
    cfg["train"]["lr"] = 2e-2
    write_config(path, cfg)
    jobs = planned_jobs(snakemake(path, "scaling", "-n"))
    assert jobs == {"scaling_point": 9, "scaling": 1}, jobs
