"""IsoFLOP scaling sweep: the points, the fit, the report, and the fitted tokens-per-parameter ratio.

`snakemake --cores all scaling` trains one model per point (budget × depth), evaluates it, then fits
(`pipeline.evaluation.scaling` runs `fit_sweep`). This is the library the Snakefile, the planner and that
stage share; torch-free.

- `depth_model(cfg, depth)`: the model shape at a depth; `point_config` / `points(cfg)`: the points;
- `fit_sweep(...)`: per-budget parabolas, the power laws N* = k_N·C^a and D* = k_D·C^b, bootstrap intervals;
- `run_ratio(fit, n_params)` / `resolve_tokens_per_param(cfg)`: the tokens per parameter at the run's budget
  (``train.tokens_per_param: scaling``).

The shape rule, a point's training, the fit and the ratio: docs/planning.md, "The IsoFLOP sweep".
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

from pipeline.config import cut, train_slice
from pipeline.config.layout import RunLayout
from pipeline.errors import ConfigError, PlanError
from pipeline.io import read_json
from pipeline.planning.compute import count_params, flops_of, parts_of
from pipeline.planning.stages import stage_budget, stage_config, stage_list
from pipeline.run_config import RunConfig, plain, run_config, with_section

SCALING_COMMAND = "snakemake --cores all scaling"


# ----------------------------------------------------------------------------- the points

def budget_name(budget: float) -> str:
    """A budget as its wildcard: 3e11, 1.5e12 (three significant digits, no '+')."""
    exponent = math.floor(math.log10(budget))
    mantissa = round(budget / 10 ** exponent, 2)
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:g}e{exponent}"


def depth_model(cfg: RunConfig, depth: int) -> dict:
    """The model section of the ladder's model at `depth` (docs/planning.md, "The IsoFLOP sweep"), plain data."""
    s, m = cfg.scaling, cfg.model
    aspect = s["aspect"] or m["dim"] / m["n_layers"]
    head_dim = s["head_dim"] or m["dim"] // m["n_heads"]
    kv_group = s["kv_group"] or max(1, m["n_heads"] // m["n_kv_heads"])
    ffn_ratio = s["ffn_ratio"] or m["ffn_dim"] / m["dim"]
    n_heads = max(1, math.floor(aspect * depth / head_dim + 0.5))  # half up (round() would go to even)
    dim = n_heads * head_dim
    cap = max(1, n_heads // kv_group)
    divisors = {d for i in range(1, math.isqrt(n_heads) + 1) if n_heads % i == 0 for d in (i, n_heads // i)}
    n_kv = max(d for d in divisors if d <= cap)
    return {**m.to_dict(), "dim": dim, "n_layers": int(depth), "n_heads": n_heads, "n_kv_heads": n_kv,
            "ffn_dim": max(1, round(ffn_ratio * dim))}


def warmup_fraction(cfg: RunConfig) -> float:
    """`scaling.warmup_frac`, else the run's first stage's warmup steps / its steps."""
    if cfg.scaling.warmup_frac is not None:
        return cfg.scaling.warmup_frac
    if cfg.train.tokens_per_param == "scaling" and cfg.train.target_tokens is None \
            and cfg.train.target_flops is None:
        raise ConfigError("config key 'scaling.warmup_frac': the run's length comes from the sweep "
                          "(train.tokens_per_param: scaling), so the sweep cannot take its warmup fraction from "
                          "it; set scaling.warmup_frac (e.g. 0.1)")
    first = stage_list(cfg)[0]
    steps = stage_budget(cfg, first)["num_steps"]
    return min(1.0, first["train"]["warmup_steps"] / steps) if steps else 0.0


def _shape(model: dict) -> tuple[int, int, int, int, int, int]:
    """A plain model section's shape (`depth_model`'s) as `parts_of` and `flops_of` take it."""
    return (model["vocab_size"], model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"],
            model["ffn_dim"])


def point_config(cfg: RunConfig, budget: float, depth: int) -> dict:
    """The full run config of one point (docs/planning.md, "The IsoFLOP sweep"), without the `scaling` section:
    plain data (its rule's params are cut from it); `point_run_config` types it."""
    first = stage_list(cfg)[0]
    train = {k: copy.deepcopy(v) for k, v in first["train"].items()}
    model = depth_model(cfg, depth)
    step = cfg.scaling.global_batch_tokens or train["global_batch_tokens"]
    T = train["seq_len"]
    micro = min(train["micro_batch"], max(1, step // T))
    if step % (micro * T):
        raise ConfigError(f"config key 'scaling.global_batch_tokens': {step} is not a multiple of micro_batch × "
                          f"seq_len = {micro} × {T}; choose a multiple of {micro * T}")
    fpt = flops_of(*_shape(model), T)
    steps = max(1, round(budget / (fpt * step)))
    train.update(global_batch_tokens=step, micro_batch=micro, target_tokens=steps * step, target_flops=None,
                 tokens_per_param=20, stages=[], warmup_steps=round(warmup_fraction(cfg) * steps),
                 val_interval=steps, ckpt_interval=steps, log_interval=max(1, min(train["log_interval"], steps)))
    out = {k: copy.deepcopy(v) for k, v in cfg.items() if k != "scaling"}
    out.update(model=model, train=train,
               hardware={**cfg.hardware, "nproc_per_node": 1, "nodes": 1},
               eval={**cfg.eval, "core_interval": 0, "prompts": [], "chat_questions": []})
    return plain(out)


def point_run_config(cfg: RunConfig, budget: float, depth: int) -> RunConfig:
    """`point_config` as a RunConfig: a point's config is a new config, typed here where it is made (what the
    plan prices a point's hours by, `pipeline.planning.token_plan.train_hours`)."""
    return run_config(point_config(cfg, budget, depth))


def point_params(cfg: RunConfig, budget: float, depth: int) -> dict:
    """What one point's train and evaluate commands get (`stage_config` of the point's config, typed where its
    train slice is cut)."""
    pc = point_config(cfg, budget, depth)
    return stage_config(run_config(cut(train_slice, pc)), pc["train"]["mix"])


def points(cfg: RunConfig) -> list[dict]:
    """Every point of the sweep: budget (its name and FLOPs), depth, N, FLOPs per token, steps, tokens.
    Two budgets with one name (`budget_name`) are a ConfigError: their points would be the same jobs."""
    named: dict[str, float] = {}
    for budget in cfg.scaling.budgets:  # equal budgets the schema refuses; equal names are caught here
        if budget_name(budget) in named:
            raise ConfigError(f"config key 'scaling.budgets': {named[budget_name(budget)]!r} and {budget!r} name the "
                              f"same points (scaling/{budget_name(budget)}/<depth>: a budget is named by its three "
                              "significant digits); give budgets that differ within three digits")
        named[budget_name(budget)] = budget
    out = []
    for budget in cfg.scaling.budgets:
        c = float(budget_name(budget))  # what the job's wildcard says
        for depth in cfg.scaling.depths:
            pc = point_config(cfg, c, int(depth))
            out.append({"budget": budget_name(budget), "flops": c, "depth": int(depth),
                        "n_params": sum(parts_of(*_shape(pc["model"]), pc["model"]["tie_embeddings"]).values()),
                        "flops_per_token": flops_of(*_shape(pc["model"]), pc["train"]["seq_len"]),
                        "tokens": pc["train"]["target_tokens"],
                        "steps": pc["train"]["target_tokens"] // pc["train"]["global_batch_tokens"]})
    return out


def check_sweep(cfg: RunConfig, mix_tokens: int | None) -> None:
    """Refuse a sweep whose points cannot train: fewer than 10 steps, or more tokens than the mix's
    `mix_tokens` targets (None: not known, not checked)."""
    mix = stage_list(cfg)[0]["mix"]
    for p in points(cfg):
        where = f"scaling point {p['budget']}/{p['depth']} ({p['n_params']:,} parameters)"
        if p["steps"] < 10:
            raise ConfigError(f"config key 'scaling.budgets': {where} gets {p['steps']} optimizer step(s) "
                              "(budget / FLOPs per token / tokens per step); raise the smallest budget, drop the "
                              "deepest depth or lower scaling.global_batch_tokens")
        if mix_tokens is not None and p["tokens"] > mix_tokens:
            raise ConfigError(f"config key 'scaling.budgets': {where} trains on {p['tokens']:,} tokens but mix "
                              f"'{mix}' supplies {mix_tokens:,}; lower the largest budget, drop the shallowest "
                              f"depth or give the mix more tokens (mixes.{mix}.tokens)")


# ----------------------------------------------------------------------------- the fit (numpy only)

def parabola_vertex(x, y) -> tuple[float, list[float]]:
    """(vertex x, [c2, c1, c0]) of the least-squares parabola y = c2·x² + c1·x + c0; nan when it
    opens downwards (no minimum)."""
    import numpy as np

    c = np.polyfit(np.asarray(x, float), np.asarray(y, float), 2)
    return (float(-c[1] / (2 * c[0])) if c[0] > 0 else math.nan), [float(v) for v in c]


def power_law(c, v) -> tuple[float, float]:
    """(exponent, ln prefactor) of v = k·c^e by least squares in log-log."""
    import numpy as np

    e, lnk = np.polyfit(np.log(np.asarray(c, float)), np.log(np.asarray(v, float)), 1)
    return float(e), float(lnk)


def _minima(flops, n, d, loss) -> dict:
    """Per budget the vertices in ln N and ln D, then the two power laws (nan when < 2 minima)."""
    import numpy as np

    flops, n, d, loss = (np.asarray(v, float) for v in (flops, n, d, loss))
    rows = []
    def near(x, xs):  # a vertex farther outside the sampled range than its width is no minimum
        lo, hi = float(xs.min()), float(xs.max())
        return x if lo - (hi - lo) <= x <= hi + (hi - lo) else math.nan

    for c in np.unique(flops):
        i = flops == c
        xn, cn = parabola_vertex(np.log(n[i]), loss[i])
        xd, _ = parabola_vertex(np.log(d[i]), loss[i])
        inside = bool(np.log(n[i]).min() <= xn <= np.log(n[i]).max()) if not math.isnan(xn) else False
        xn, xd = near(xn, np.log(n[i])), near(xd, np.log(d[i]))
        rows.append({"flops": float(c), "n_opt": math.exp(xn) if not math.isnan(xn) else math.nan,
                     "d_opt": math.exp(xd) if not math.isnan(xd) else math.nan, "inside": inside,
                     "loss_opt": float(np.polyval(cn, xn)) if not math.isnan(xn) else math.nan, "coef": cn})
    ok = [r for r in rows if not (math.isnan(r["n_opt"]) or math.isnan(r["d_opt"]))]
    if len(ok) < 2:
        return {"minima": rows, "a": math.nan, "ln_kn": math.nan, "b": math.nan, "ln_kd": math.nan}
    a, ln_kn = power_law([r["flops"] for r in ok], [r["n_opt"] for r in ok])
    b, ln_kd = power_law([r["flops"] for r in ok], [r["d_opt"] for r in ok])
    return {"minima": rows, "a": a, "ln_kn": ln_kn, "b": b, "ln_kd": ln_kd}


def ratio_at(a: float, ln_kn: float, b: float, ln_kd: float, n_params: float) -> tuple[float, float]:
    """(C at which n_params is compute-optimal, tokens per parameter there)."""
    ln_c = (math.log(n_params) - ln_kn) / a
    return math.exp(ln_c), math.exp(ln_kd + b * ln_c) / n_params


def _interval(values, level: float = 0.95) -> list[float]:
    import numpy as np

    v = np.asarray([x for x in values if math.isfinite(x)], float)
    if not v.size:
        return [math.nan, math.nan]
    q = (1 - level) / 2
    return [float(np.quantile(v, q)), float(np.quantile(v, 1 - q))]


def fit_sweep(rows: list[dict], n_boot: int = 1000, seed: int = 0, run_n_params: float | None = None) -> dict:
    """The fit of docs/planning.md, "The IsoFLOP sweep", over `rows` ({flops, n_params, tokens, val_loss} each)."""
    import numpy as np

    flops = np.array([r["flops"] for r in rows], float)
    n = np.array([r["n_params"] for r in rows], float)
    d = np.array([r["tokens"] for r in rows], float)
    loss = np.array([r["val_loss"] for r in rows], float)
    budgets = np.unique(flops)
    if any((flops == c).sum() < 3 for c in budgets):
        raise PlanError("every budget needs at least 3 depths for a parabola: list 3 or more in scaling.depths")
    fit = _minima(flops, n, d, loss)
    # residual bootstrap around each budget's parabola in ln N
    yhat = np.empty_like(loss)
    for r in fit["minima"]:
        i = flops == r["flops"]
        yhat[i] = np.polyval(r["coef"], np.log(n[i]))
    resid = loss - yhat
    dof = len(loss) - 3 * len(budgets)
    resid = resid * math.sqrt(len(loss) / dof) if dof > 0 else resid
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_boot):
        f = _minima(flops, n, d, yhat + rng.choice(resid, size=len(resid), replace=True))
        draws.append([f["a"], f["ln_kn"], f["b"], f["ln_kd"]])
    draws_arr = np.asarray(draws, float)
    out = {
        "a": fit["a"], "b": fit["b"], "ln_kn": fit["ln_kn"], "ln_kd": fit["ln_kd"],
        # no interval around an estimate that does not exist (draws that happen to fit are no evidence)
        "a_ci": _interval(draws_arr[:, 0]) if math.isfinite(fit["a"]) else [math.nan, math.nan],
        "b_ci": _interval(draws_arr[:, 2]) if math.isfinite(fit["b"]) else [math.nan, math.nan],
        "minima": [{k: v for k, v in m.items() if k != "coef"} | {"parabola": m["coef"]} for m in fit["minima"]],
        "residual_sd": float(np.std(loss - yhat)),
        "bootstrap": {"draws": n_boot, "seed": seed, "valid": int(np.isfinite(draws_arr).all(axis=1).sum()),
                      "samples": [[round(v, 6) for v in row] for row in draws if all(map(math.isfinite, row))]},
    }
    if run_n_params is not None and math.isfinite(fit["a"]):
        out["run"] = run_ratio(out, run_n_params)
    return out


def run_ratio(fit: dict, n_params: float) -> dict:
    """The fitted tokens per parameter at the compute where `n_params` is optimal, with its interval."""
    c, ratio = ratio_at(fit["a"], fit["ln_kn"], fit["b"], fit["ln_kd"], n_params)
    samples = [ratio_at(*s, n_params)[1] for s in fit["bootstrap"]["samples"] if s[0] > 0]
    return {"n_params": int(n_params), "flops": c, "tokens_per_param": ratio, "ci": _interval(samples)}


# ----------------------------------------------------------------------------- the plan's ratio

def fit_path(cfg: RunConfig) -> Path:
    return Path(RunLayout.of(cfg).scaling("fit.json"))


def read_fit(path: Path) -> dict:
    """The sweep's fit.json, with what `run_ratio` reads of it; a file that is not (truncated, edited, another
    file's bytes) is one PlanError naming it and the command that rewrites it."""
    fix = f"delete it and run `{SCALING_COMMAND}`, which fits it again from the points' reports"
    try:
        fit = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: JSON syntax, or bytes that are not UTF-8
        raise PlanError(f"{path} is not readable JSON, it is corrupt or truncated ({e}); {fix}") from None

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    boot = fit.get("bootstrap") if isinstance(fit, dict) else None
    samples = boot.get("samples") if isinstance(boot, dict) else None
    if not (isinstance(samples, list) and all(number(fit.get(k)) for k in ("a", "ln_kn", "b", "ln_kd"))
            and all(isinstance(s, list) and len(s) == 4 and all(map(number, s)) for s in samples)):
        raise PlanError(f"{path} is not a scaling fit (it needs numbers a, ln_kn, b, ln_kd and bootstrap.samples "
                        f"of four numbers each); {fix}")
    return fit


def resolve_tokens_per_param(cfg: RunConfig, required: bool = True) -> tuple[RunConfig, dict | None]:
    """A RunConfig of `cfg` with ``train.tokens_per_param: scaling`` replaced by the fitted ratio where the run's
    model is compute-optimal (`run_ratio`), and what the plan says of it: {tokens_per_param, ci,
    fit, flops, n_params}; (cfg, None) when the run sets a number. Without a fit: PlanError naming the
    command to run when `required`, else `cfg` unchanged with {"missing": True, ...} (a Snakemake parse
    that builds only the sweep; anything sized by the run's budget fails in `token_target`)."""
    t = cfg.train
    if t.get("tokens_per_param") != "scaling" or t.get("target_tokens") is not None \
            or t.get("target_flops") is not None:
        return cfg, None  # a number, or an explicit budget that overrides the ratio
    mix = stage_list(cfg)[0]["mix"]
    if cfg.mixes[mix]["tokens"] == "plan":
        raise ConfigError(f"config key 'mixes.{mix}.tokens': train.tokens_per_param: scaling sizes the run from the "
                          f"sweep, which trains on mix '{mix}'; sized by the plan ('plan') that mix would change "
                          "with the fit and rerun the sweep: give it a fixed number of tokens")
    path = fit_path(cfg)
    if not path.exists():
        if required:
            raise PlanError(f"train.tokens_per_param: scaling needs the sweep's fit {path}: run `{SCALING_COMMAND}` "
                            "first (or set a number)")
        return cfg, {"missing": True, "fit": str(path)}
    fit = read_fit(path)
    if not math.isfinite(fit["a"]) or fit["a"] <= 0:
        raise PlanError(f"{path}: the sweep found no compute-optimal size (a = {fit['a']}; see its report.md): "
                        "widen scaling.depths or scaling.budgets and rerun `" + SCALING_COMMAND + "`, or set a number")
    info = {**run_ratio(fit, count_params(cfg.model)[0]), "fit": str(path)}
    return with_section(cfg, "train", tokens_per_param=float(f"{info['tokens_per_param']:.4g}")), info


def describe_ratio(info: dict) -> str:
    """One line for the plan: which ratio, from where, its interval."""
    if info.get("missing"):
        return f"train.tokens_per_param: scaling — no fit yet ({info['fit']}); run `{SCALING_COMMAND}`"
    lo, hi = info["ci"]
    return (f"train.tokens_per_param: scaling = {info['tokens_per_param']:.3g} tokens/param [95 % CI {lo:.3g}–"
            f"{hi:.3g}], the sweep's D*/N* where {info['n_params']:,} parameters are compute-optimal "
            f"(C = {info['flops']:.3g} FLOPs), from {info['fit']}")


def fit_params(cfg: RunConfig) -> dict:
    """What the fit depends on: the points (N, D, C of each), the bootstrap, the run's N."""
    return {"points": points(cfg), "bootstrap": cfg.scaling.bootstrap, "seed": cfg.seed,
            "run_n_params": count_params(cfg.model)[0]}
