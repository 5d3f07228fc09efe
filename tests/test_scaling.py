"""The IsoFLOP sweep's pure parts (pipeline/planning/sweep.py): the fit recovers known exponents from losses of a
Chinchilla-form law with noise, the shape rule, a point's params, and the plan's fitted ratio."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml
from builders import ROOT, snakemake, user_env, write_config

from pipeline.config import load_config, params_json
from pipeline.errors import ConfigError, PlanError
from pipeline.planning import sweep as sc
from pipeline.planning.compute import count_params, flops_per_token
from pipeline.planning.token_plan import format_plan, make_plan
from pipeline.run_config import run_config

# Hoffmann et al. 2022, approach 3: L(N, D) = E + A / N^alpha + B / D^beta
E, A, B = 1.69, 406.4, 410.7


def chinchilla_rows(alpha: float, beta: float, noise: float, seed: int = 0, per_budget: int = 9) -> list[dict]:
    """Losses of the law on an IsoFLOP grid (C = 6ND), N spread over 1/8..8 × the true optimum."""
    rng = np.random.default_rng(seed)
    g = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    rows = []
    for c in np.geomspace(1e18, 1e21, 5):
        n_opt = g * (c / 6) ** (beta / (alpha + beta))
        for f in np.geomspace(1 / 8, 8, per_budget):
            n = n_opt * f
            d = c / (6 * n)
            rows.append({"flops": c, "n_params": n, "tokens": d,
                         "val_loss": E + A / n ** alpha + B / d ** beta + rng.normal(0, noise)})
    return rows


@pytest.mark.parametrize("alpha,beta", [(0.34, 0.28), (0.3, 0.3), (0.28, 0.34)])
def test_fit_recovers_the_exponents_of_a_chinchilla_law(alpha, beta):
    g = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    n_run = g * (1e20 / 6) ** (beta / (alpha + beta))  # the law's optimal N at C = 1e20
    fit = sc.fit_sweep(chinchilla_rows(alpha, beta, noise=0.004), n_boot=300, seed=1, run_n_params=n_run)
    a_true, b_true = beta / (alpha + beta), alpha / (alpha + beta)
    assert fit["a"] == pytest.approx(a_true, abs=0.01) and fit["b"] == pytest.approx(b_true, abs=0.01)
    assert fit["a"] + fit["b"] == pytest.approx(1, abs=0.01)  # C = 6ND: N*·D* ∝ C
    # the intervals are real intervals around the estimate, and wider with more noise
    for k in ("a", "b"):
        lo, hi = fit[f"{k}_ci"]
        assert lo < fit[k] < hi and hi - lo < 0.05
    noisier = sc.fit_sweep(chinchilla_rows(alpha, beta, noise=0.03), n_boot=300, seed=1)
    assert np.diff(noisier["a_ci"])[0] > np.diff(fit["a_ci"])[0]
    assert all(m["inside"] for m in fit["minima"])
    # the implied tokens per parameter of that model and where it is optimal, against the law's own
    assert fit["run"]["flops"] == pytest.approx(1e20, rel=0.25)
    assert fit["run"]["tokens_per_param"] == pytest.approx(1e20 / 6 / n_run ** 2, rel=0.1)
    lo, hi = fit["run"]["ci"]
    assert lo < fit["run"]["tokens_per_param"] < hi


def test_fit_flags_a_budget_without_a_minimum_and_refuses_too_few_depths():
    rows = chinchilla_rows(0.34, 0.28, noise=0.0)
    c0 = rows[0]["flops"]
    for r in rows:  # the smallest budget's losses fall monotonically with N: no vertex inside
        if r["flops"] == c0:
            r["val_loss"] = 5 - 0.1 * math.log(r["n_params"])
    fit = sc.fit_sweep(rows, n_boot=20)
    assert not next(m for m in fit["minima"] if m["flops"] == c0)["inside"]
    with pytest.raises(PlanError, match="at least 3 depths"):
        sc.fit_sweep([r for i, r in enumerate(rows) if i % 9 < 2], n_boot=10)


@pytest.fixture
def cfg():
    return load_config("config.yaml")


def test_the_run_model_is_on_the_ladder_by_default(cfg):
    run = cfg["model"]
    cfg = {**cfg, "scaling": {**cfg["scaling"], "aspect": None, "head_dim": None, "kv_group": None, "ffn_ratio": None}}
    assert sc.depth_model(run_config(cfg), run["n_layers"]) == run
    shallow = sc.depth_model(run_config(cfg), 1)
    assert shallow["n_layers"] == 1 and shallow["dim"] == run["dim"] // run["n_layers"]
    assert shallow["dim"] % shallow["n_heads"] == 0 and shallow["n_heads"] % shallow["n_kv_heads"] == 0
    assert shallow["ffn_dim"] == shallow["dim"] * run["ffn_dim"] // run["dim"]


def test_a_point_trains_budget_over_flops_per_token_and_holds_no_sweep_list(cfg):
    budget, depth = cfg["scaling"]["budgets"][0], cfg["scaling"]["depths"][0]
    p = sc.point_params(run_config(cfg), budget, depth)
    t = p["train"]
    assert t["target_tokens"] % t["global_batch_tokens"] == 0
    steps = t["target_tokens"] // t["global_batch_tokens"]
    assert steps == round(budget / (flops_per_token(run_config(p)) * t["global_batch_tokens"]))
    assert p["model"]["n_layers"] == depth and p["hardware"]["nproc_per_node"] == 1 and "scaling" not in p
    assert p["stage"]["name"] == cfg["train"]["mix"] and p["train"]["optimizer"] == cfg["train"]["optimizer"]
    assert t["warmup_steps"] == round(sc.warmup_fraction(run_config(cfg)) * steps) and t["val_interval"] == steps
    # another budget list leaves the point's params as they were: adding a budget reruns no other point
    more = {**cfg, "scaling": {**cfg["scaling"], "budgets": [*cfg["scaling"]["budgets"], 1e13]}}
    assert params_json(sc.point_params(run_config(more), budget, depth)) == params_json(p)
    assert sc.budget_name(3e11) == "3e11" and sc.budget_name(1.5e12) == "1.5e12" and float("6.6e11") == 6.6e11
    # two budgets with one name would be the same jobs, one curve's points twice: refused, naming both
    with pytest.raises(ConfigError, match=r"'scaling.budgets': 1.001e\+18 and 1.002e\+18 name the same points"):
        sc.points(run_config({**cfg, "scaling": {**cfg["scaling"], "budgets": [1.001e18, 3e18, 1.002e18]}}))


def test_the_default_sweep_fits_its_mix_and_the_preset_sweep_is_priced(cfg):
    from pipeline.planning.stages import mix_targets

    sc.check_sweep(run_config(cfg), mix_targets(run_config(cfg), cfg["train"]["mix"]))
    small = {**cfg, "scaling": {**cfg["scaling"], "budgets": [1e13]}}
    with pytest.raises(Exception, match="supplies"):
        sc.check_sweep(run_config(small), mix_targets(run_config(cfg), cfg["train"]["mix"]))
    for p in sc.points(run_config(cfg)):
        assert p["n_params"] < 1_000_000
    preset = load_config("configs/gpt-500m-fineweb.yaml")
    text = format_plan(make_plan(run_config(preset), allow_short=True))
    assert "scaling sweep" in text and "GPU-hours" in text
    sweep = make_plan(run_config(preset), allow_short=True).scaling_sweep
    assert sweep["n_points"] == len(sweep["points"]) and all(p["est_gpu_hours"] > 0 for p in sweep["points"])
    assert sweep["est_gpu_hours"] == pytest.approx(sum(p["est_gpu_hours"] for p in sweep["points"]))


def test_tokens_per_param_scaling_reads_the_fit_or_names_the_command(cfg, tmp_path):
    cfg = {**cfg, "results_dir": str(tmp_path), "train": {**cfg["train"], "tokens_per_param": "scaling",
                                                          "target_tokens": None},
           "mixes": {**cfg["mixes"], "pretrain": {**cfg["mixes"]["pretrain"], "tokens": 10**9}}}
    with pytest.raises(PlanError, match="snakemake --cores all scaling"):
        sc.resolve_tokens_per_param(run_config(cfg))
    fit = sc.fit_sweep(chinchilla_rows(0.34, 0.28, noise=0.004), n_boot=100, seed=0)
    path = sc.fit_path(run_config(cfg))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(fit))
    resolved, info = sc.resolve_tokens_per_param(run_config(cfg))
    n = count_params(run_config(cfg).model)[0]
    assert resolved.train.tokens_per_param == pytest.approx(sc.run_ratio(fit, n)["tokens_per_param"], rel=1e-3)
    plan = make_plan(resolved, allow_short=True, tokens_per_param_fit=info)
    assert plan.target_tokens == math.ceil(resolved.train.tokens_per_param * n)
    assert "train.tokens_per_param: scaling" in format_plan(plan) and str(path) in format_plan(plan)
    # a sweep whose budgets have no minimum on the ladder has no exponent: refused, not used
    path.write_text(json.dumps({**fit, "a": math.nan}))
    with pytest.raises(PlanError, match="no compute-optimal size"):
        sc.resolve_tokens_per_param(run_config(cfg))
    # the sweep's mix sized by the plan would change with the fit and rerun the sweep: refused
    with pytest.raises(Exception, match="fixed number of tokens"):
        sc.resolve_tokens_per_param(run_config({**cfg, "mixes": {**cfg["mixes"], "pretrain": {"weights": {"web": 1.0},
                                                                                  "tokens": "plan"}}}))


@pytest.mark.parametrize("text", [
    '{"a": 0.5, "ln_kn": 1.0, "b": 0.5, "ln_kd"',  # truncated
    "",
    "\udcff",  # not UTF-8
    "[1, 2]",
    '{"a": 0.5, "ln_kn": 1.0, "b": 0.5, "ln_kd": 1.0}',  # no bootstrap draws
    '{"a": "0.5", "ln_kn": 1.0, "b": 0.5, "ln_kd": 1.0, "bootstrap": {"samples": []}}',
    '{"a": 0.5, "ln_kn": 1.0, "b": 0.5, "ln_kd": 1.0, "bootstrap": {"samples": [[0.5, 1.0]]}}',
], ids=["truncated", "empty", "not-utf8", "a-list", "no-bootstrap", "a-string", "short-draw"])
def test_a_corrupt_fit_is_one_error_naming_it_and_the_command_that_rewrites_it(cfg, tmp_path, text):
    cfg = {**cfg, "results_dir": str(tmp_path), "train": {**cfg["train"], "tokens_per_param": "scaling",
                                                          "target_tokens": None},
           "mixes": {**cfg["mixes"], "pretrain": {**cfg["mixes"]["pretrain"], "tokens": 10**9}}}
    path = sc.fit_path(run_config(cfg))
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(PlanError) as e:
        sc.resolve_tokens_per_param(run_config(cfg))
    msg = str(e.value)
    assert msg.startswith(str(path)) and "delete it and run `snakemake --cores all scaling`" in msg
    assert "\n" not in msg


@pytest.mark.slow  # Snakemake's parse
def test_a_truncated_fit_stops_the_plan_and_snakemakes_parse_with_one_line(tmp_path):
    """The two readers of fit.json a user meets: `python -m pipeline.plan` and the Snakefile's parse."""
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["train"].update(tokens_per_param="scaling", target_tokens=None)
    raw["mixes"]["pretrain"]["tokens"] = 10**6
    write_config(tmp_path, raw)
    (tmp_path / "data").symlink_to(ROOT / "data")
    fit = tmp_path / "results/tiny/scaling/fit.json"
    fit.parent.mkdir(parents=True)
    fit.write_text('{"a": 0.5, "ln_kn": ')
    plan = subprocess.run([sys.executable, "-m", "pipeline.plan", "--configfile", "config.yaml"], cwd=tmp_path,
                          env=user_env(), capture_output=True, text=True, timeout=300)
    parse = snakemake(tmp_path, "-n", check=False)
    for proc, mark in ((plan, "error: "), (parse, "tokenfarm: ")):
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
        lines = [ln for ln in out.splitlines() if ln.startswith(mark)]
        assert len(lines) == 1 and "results/tiny/scaling/fit.json is not readable JSON" in lines[0], out[-3000:]
        assert "snakemake --cores all scaling" in lines[0]


def test_the_scaling_stage_writes_the_fit_report_and_plot_of_its_points(cfg, tmp_path):
    """`python -m pipeline.evaluation.scaling` (the `scaling` rule's command) on reports shaped like the points'
    evaluate reports, their losses on a Chinchilla law: the fit, the tables (one row a point) and the plot; a
    report that trained other tokens than its point plans is refused, naming the command that reruns the sweep."""
    from pipeline.evaluation import scaling

    params = sc.fit_params(run_config(cfg))
    reports = []
    for p in params["points"]:
        loss = 1.7 + 400 / p["n_params"] ** 0.34 + 410 / p["tokens"] ** 0.28
        path = tmp_path / "scaling" / p["budget"] / str(p["depth"]) / "report.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"val_loss": loss, "val_bpb": loss / math.log(2) / 4,
                                    "summary": {"tokens_trained": p["tokens"]}}))
        reports.append(str(path))
    out = {k: tmp_path / f"fit.{k}" for k in ("json", "md", "png")}
    argv = ["--params", json.dumps(params), "--points", *reports,
            "--out-json", str(out["json"]), "--out-md", str(out["md"]), "--out-png", str(out["png"])]
    scaling.main(argv)
    fit = json.loads(out["json"].read_text())
    assert len(fit["points"]) == len(params["points"]) and fit["meta"]["stage"] == "scaling"
    assert math.isfinite(fit["a"]) and math.isfinite(fit["b"]) and fit["a_ci"][0] <= fit["a"] <= fit["a_ci"][1]
    budgets = {f"| {p['flops']:.3g} |" for p in params["points"]}
    rows = [ln for ln in out["md"].read_text().splitlines() if ln[:ln.find(" |", 2) + 2] in budgets]
    assert len(rows) == len(params["points"]) + len(budgets)  # a row a point, then a row a budget's minimum
    assert out["png"].read_bytes()[:4] == b"\x89PNG"

    first = json.loads(open(reports[0]).read())
    first["summary"]["tokens_trained"] += 1
    open(reports[0], "w").write(json.dumps(first))
    with pytest.raises(PlanError, match=sc.SCALING_COMMAND):
        scaling.main(argv)
