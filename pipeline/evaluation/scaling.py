"""Scaling stage: the IsoFLOP sweep's fit, report and plot (the `scaling` rule; the fit: pipeline/planning/sweep.py).

    python -m pipeline.evaluation.scaling --params JSON --points R/scaling/C/D/report.json ... \\
        --out-json R/scaling/fit.json --out-md R/scaling/report.md --out-png R/scaling/scaling.png

Each point's val loss and bits per byte come from its evaluate report (every validation row of the mix);
N, D and C from the sweep's own description (`pipeline.planning.sweep.points`, in the params). Outputs (atomic):
``fit.json`` (exponents, intervals, bootstrap draws, per-budget minima, the points, the ratio at the run's
model), ``report.md`` (the tables; marked for `snakemake --report`) and ``scaling.png``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import NamedTuple

from pipeline.config import add_config_args, load_config, parse_overrides
from pipeline.errors import PlanError
from pipeline.io import atomic_path, atomic_write, get_logger, provenance, read_json, run_cli, write_json
from pipeline.planning.sweep import SCALING_COMMAND, fit_params, fit_sweep
from pipeline.run_config import run_config

log = get_logger(__name__)


class FitParams(NamedTuple):
    """The scaling rule's params (`pipeline.planning.sweep.fit_params`): the points (N, D, C of each), the
    bootstrap draws and their seed, the run's N."""

    points: list[dict]
    bootstrap: int
    seed: int
    run_n_params: int


def plot(rows: list[dict], fit: dict, out_png: str | Path) -> None:
    """Loss vs N per budget with the parabolas and minima; N* and D* vs C with the power laws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    budgets = sorted({r["flops"] for r in rows})
    for j, c in enumerate(budgets):
        color = cmap(j / max(1, len(budgets) - 1))
        pts = sorted((r["n_params"], r["val_loss"]) for r in rows if r["flops"] == c)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, label=f"C = {c:.3g}")
        m = next(m for m in fit["minima"] if m["flops"] == c)
        x = np.linspace(math.log(pts[0][0]), math.log(pts[-1][0]), 50)
        ax1.plot(np.exp(x), np.polyval(m["parabola"], x), "-", color=color, alpha=0.6)
        if math.isfinite(m["n_opt"]):
            ax1.plot([m["n_opt"]], [m["loss_opt"]], "*", color=color, markersize=14, markeredgecolor="k")
    ax1.set(xscale="log", xlabel="parameters N", ylabel="val loss (nats/token)", title="IsoFLOP curves")
    ax1.legend(fontsize=8)
    ok = [m for m in fit["minima"] if math.isfinite(m["n_opt"]) and math.isfinite(m["d_opt"])]
    cs = np.array([m["flops"] for m in ok])
    ax2.plot(cs, [m["n_opt"] for m in ok], "o", color="C0", label="N*")
    ax2.plot(cs, [m["d_opt"] for m in ok], "s", color="C1", label="D*")
    if math.isfinite(fit["a"]) and len(ok) >= 2:
        grid = np.geomspace(cs.min() / 2, cs.max() * 2, 20)
        ax2.plot(grid, np.exp(fit["ln_kn"]) * grid ** fit["a"], "-", color="C0",
                 label=f"N* ∝ C^{fit['a']:.2f} [{fit['a_ci'][0]:.2f}, {fit['a_ci'][1]:.2f}]")
        ax2.plot(grid, np.exp(fit["ln_kd"]) * grid ** fit["b"], "-", color="C1",
                 label=f"D* ∝ C^{fit['b']:.2f} [{fit['b_ci'][0]:.2f}, {fit['b_ci'][1]:.2f}]")
    ax2.set(xlabel="compute C (FLOPs)", title="compute-optimal N and D")
    if ok:
        ax2.set(xscale="log", yscale="log")
        ax2.legend(fontsize=8)
    else:  # (a log axis with no point fails to lay out)
        ax2.text(0.5, 0.5, "no budget has an interior minimum yet:\nadd depths around the lowest loss",
                 ha="center", va="center", transform=ax2.transAxes)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _ci(v: list[float]) -> str:
    return f"[{v[0]:.3g}, {v[1]:.3g}]"


def markdown_report(rows: list[dict], fit: dict) -> str:
    lines = ["# IsoFLOP scaling sweep", "",
             f"{len(rows)} points: budgets × depths, each trained from scratch for budget / FLOPs-per-token tokens "
             "(pipeline/planning/sweep.py).", "",
             "| budget C | depth | N (params) | D (tokens) | D/N | val loss | val bpb |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["flops"], r["n_params"])):
        lines.append(f"| {r['flops']:.3g} | {r['depth']} | {r['n_params']:,} | {r['tokens']:,} | "
                     f"{r['tokens'] / r['n_params']:.2f} | {r['val_loss']:.4f} | {r['val_bpb']:.4f} |")
    lines += ["", "| budget C | N* | D* | D*/N* | loss at N* | vertex inside the ladder |", "|---|---|---|---|---|---|"]
    for m in fit["minima"]:
        ratio = m["d_opt"] / m["n_opt"] if math.isfinite(m["n_opt"]) else math.nan
        lines.append(f"| {m['flops']:.3g} | {m['n_opt']:,.0f} | {m['d_opt']:,.0f} | {ratio:.2f} | "
                     f"{m['loss_opt']:.4f} | "
                     f"{'yes' if m['inside'] else 'NO (extrapolated or no minimum)'} |")
    found = sum(math.isfinite(m["n_opt"]) for m in fit["minima"])
    if found < 2:
        lines += ["", f"**Not identifiable**: {found} budget(s) of {len(fit['minima'])} have a minimum on the depth "
                      "ladder; the power laws need two. Where the losses fall towards the smallest model, the optimum "
                      "lies below the ladder: lower scaling.aspect or the smallest depth, or raise the budgets (and "
                      "the mix's tokens)."]
    lines += ["", f"- N* ∝ C^a: **a = {fit['a']:.3f}** {_ci(fit['a_ci'])} (95 % bootstrap)",
              f"- D* ∝ C^b: **b = {fit['b']:.3f}** {_ci(fit['b_ci'])}",
              f"- residual sd around the parabolas: {fit['residual_sd']:.4f} nats; "
              f"{fit['bootstrap']['valid']} of {fit['bootstrap']['draws']} bootstrap draws fitted"]
    if "run" in fit:
        r = fit["run"]
        lines.append(f"- the run's model ({r['n_params']:,} parameters) is compute-optimal at C = {r['flops']:.3g} "
                     f"FLOPs, with **{r['tokens_per_param']:.3g} tokens/param** {_ci(r['ci'])}")
    lines += ["", "Intervals cover the noise of the losses around the parabolas only (module docstring).", ""]
    return "\n".join(lines)


def read_points(planned: list[dict], reports: list[str]) -> list[dict]:
    """The planned points with each one's val loss and bpb from its evaluate report
    (R/scaling/{budget}/{depth}/report.json); a report that trained other tokens is refused."""
    by_key = {(Path(r).parent.parent.name, int(Path(r).parent.name)): r for r in reports}
    rows = []
    for p in planned:
        path = by_key.get((p["budget"], p["depth"]))
        if path is None:
            raise PlanError(f"no report for scaling point {p['budget']}/{p['depth']} among --points")
        rep = read_json(path)
        trained = rep["summary"]["tokens_trained"]
        if trained != p["tokens"]:
            raise PlanError(f"{path}: the point trained {trained} tokens, the sweep plans {p['tokens']}; rerun "
                            f"`{SCALING_COMMAND}`")
        rows.append({**p, "val_loss": rep["val_loss"], "val_bpb": rep["val_bpb"]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.evaluation.scaling", description=__doc__.split("\n\n")[0])
    add_config_args(ap)
    ap.add_argument("--points", nargs="+", required=True, help="R/scaling/{budget}/{depth}/report.json")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--out-png", required=True)
    args = ap.parse_args(argv)
    if args.params is not None:
        params = json.loads(args.params)
    else:
        params = fit_params(run_config(load_config(args.configfile, parse_overrides(args.set))))
    fp = FitParams(**params)
    rows = read_points(fp.points, args.points)
    fit = fit_sweep(rows, fp.bootstrap, fp.seed, fp.run_n_params)
    fit["points"] = rows
    plot(rows, fit, args.out_png)
    with atomic_write(args.out_md, encoding="utf-8") as f:
        f.write(markdown_report(rows, fit))
    write_json(args.out_json, {**fit, "meta": provenance("scaling", params, args.points)})
    log.info("a = %.3f %s, b = %.3f %s", fit["a"], _ci(fit["a_ci"]), fit["b"], _ci(fit["b_ci"]))


if __name__ == "__main__":
    run_cli(main)
