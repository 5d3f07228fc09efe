"""The token-budget plan: `make_plan(cfg)` → `Plan` (parameters, tokens, steps, batch layout, shards,
memory, time, jobs); `format_plan` renders it. `python -m pipeline.plan` is its command line."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import source_files
from pipeline.config.layout import RunLayout
from pipeline.errors import ConfigError, PipelineError, PlanError
from pipeline.io import get_logger
from pipeline.planning import job_sizes
from pipeline.planning.compute import (
    BatchLayout,
    count_params,
    flops_per_token,
    param_parts,
    peak_flops,
    token_target,
    trained_tokens,
)
from pipeline.planning.memory import StepSetup, capacity_gb, choose_parallel, eval_batch_tokens, eval_memory, memory
from pipeline.planning.stages import estimated_epoch_steps, stage_budget, stage_list
from pipeline.planning.step_time import fsdp_comm, measured_step_seconds, predicted_mfu, step_seconds, step_time
from pipeline.planning.train_jobs import checkpointing, stage_jobs
from pipeline.run_config import RunConfig

log = get_logger(__name__)

@dataclass(frozen=True)
class Plan:
    """The token-budget plan of a run (docs/planning.md defines every figure). `to_json()` is plan.json's
    body (the plan rule adds "meta"); `Plan.from_json` reads it back. The nested tables (per source, per
    stage, memory by term, ...) stay plain JSON: they are shown, not computed with."""

    n_params: int
    n_params_non_embedding: int
    target_tokens: int
    tokens_per_step: int
    micro_batch: int
    world_size: int
    grad_accum_steps: int
    num_steps: int
    flops_per_token: int
    total_flops: int
    tokens_per_shard: int | None  # None until each source's tokens per shard is counted or estimated
    shards_needed: int | None
    shards_available: int
    est_memory_gb: float
    fits_memory: bool
    est_hours: float
    est_gpu_hours: float
    n_params_embedding: int
    n_params_lm_head: int
    target_basis: str
    trained_tokens: int
    seq_len: int
    data_tokens_needed: int
    tokens_available: int | None
    shards_per_source: dict[str, dict]
    memory_gb: dict[str, float]
    step_time_s: float
    step_time_basis: str
    mfu: float
    hardware: dict
    stages: list[dict]
    stages_total: dict
    eval_memory_gb: dict[str, dict]
    fits_eval_memory: bool
    parallel: dict
    notes: list[str]
    tokens_per_param_fit: dict | None
    scaling_sweep: dict | None
    host_memory: dict
    checkpointing: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """A plan from plan.json (its "meta" and any key this version does not know are ignored)."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data]
        if missing:
            raise PlanError(f"the plan file lacks {', '.join(missing)}: it was made by another version; rerun the "
                            "plan rule (snakemake -R plan)")
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


PLAN_KEYS = tuple(f.name for f in dataclasses.fields(Plan))  # plan.json's keys; it adds "meta"






# ----------------------------------------------------------------------------- parameters and FLOPs


# ----------------------------------------------------------------------------- tokens and steps


# ----------------------------------------------------------------------------- shards

def run_counts(run: str | Path) -> Path | None:
    """The run's measured counts, best first: the exact table over every shard (R/counts/counts.parquet,
    joined from the tokenize jobs), else the plan's sample (R/counts/sample.parquet, `count.sample_shards`
    tokenized shards per source), else None (the sources' estimates serve: nothing tokenized yet)."""
    for name in ("counts.parquet", "sample.parquet"):
        path = Path(RunLayout.at(run).counts(name))
        if path.exists():
            return path
    return None


def read_counts(path: str | Path, delimiters_per_doc: int) -> dict[str, tuple[int, int]]:
    """source -> (usable tokens summed over its counted shards, number of counted shards) from the
    count tables (R/counts/sample.parquet or counts.parquet). Usable = tokens + delimiter_tokens − short_tokens −
    short_documents × delimiters_per_doc − long_tokens − long_documents × delimiters_per_doc (what
    tokenize keeps), using whichever of the optional columns exist."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: not a readable counts parquet ({e}); rerun the count_sample / count rule") from None
    missing = {"source", "tokens"} - set(table.column_names)
    if missing:
        raise PlanError(f"{path}: missing column(s) {sorted(missing)}; it must be a count table (R/counts/*.parquet)")
    cols = table.to_pydict()
    zeros = [0] * table.num_rows
    usable = [
        tok + dlm - short - n_short * delimiters_per_doc - long - n_long * delimiters_per_doc
        for tok, dlm, short, n_short, long, n_long in zip(
            cols["tokens"], cols.get("delimiter_tokens", zeros), cols.get("short_tokens", zeros),
            cols.get("short_documents", zeros), cols.get("long_tokens", zeros), cols.get("long_documents", zeros))
    ]
    out: dict[str, tuple[int, int]] = {}
    for source, n in zip(cols["source"], usable):
        total, shards = out.get(source, (0, 0))
        out[source] = (total + n, shards + 1)
    return out


def _tokens_per_shard(cfg: RunConfig, source: str, counted: dict | None, counts_path,
                      strict: bool = True, available: int | None = None) -> tuple[float | None, str]:
    """(mean usable tokens per shard of `source`, where that number comes from). A source missing
    from the counts file is an error when `strict` (the plan rule: the counts are this run's), else
    unknown (a counts file left by an earlier config, e.g. before a source was added or renamed)."""
    if counted and source in counted:
        total, n = counted[source]
        if total > 0:
            where = Path(counts_path).name if counts_path else "the counts file"
            # the counts are of tokenized shards, which tokenize made from the filtered ones
            of = f"in {where}; tokens after the filter stage"
            if available is not None and n < available:
                return total / n, f"sampled ({n} of {available} shards counted {of})"
            return total / n, f"measured ({n} counted shard(s) {of})"
        if strict:  # this run's counts: every document of the source was filtered out
            raise PlanError(f"{counts_path}: source '{source}' has no usable tokens in its {n} counted shard(s): "
                            f"every document was filtered out; check sources.{source}.min_chars and its text column")
        # else an earlier config's counts (Snakemake's parse, before the count rules rerun): not evidence
    estimate = cfg.sources[source].get("tokens_per_shard_estimate")
    if estimate is not None:
        return float(estimate), f"estimate (sources.{source}.tokens_per_shard_estimate)"
    if counted is not None and strict:
        raise PlanError(
            f"{counts_path} has no rows for source '{source}' and sources.{source}.tokens_per_shard_estimate is not "
            "set: rerun the count_sample rule for it or set the estimate"
        )
    return None, (f"unknown until the plan's sample is tokenized and counted (count_sample; or set "
                  f"sources.{source}.tokens_per_shard_estimate)")


def _more_shards_fix(cfg: RunConfig, source: str, needed: int) -> str:
    src = cfg.sources[source]
    if src["type"] == "hf":
        start = src["shards"][0]
        return f"raise sources.{source}.shards to [{start}, {start + needed}]"
    return f"add parquet shards matching sources.{source}.glob"


def shard_budget(cfg: RunConfig, scheduled_tokens: int, basis: str, counted: dict | None, counts_path=None,
                 allow_short: bool = False, strict_counts: bool = True) -> dict[str, dict]:
    """Per source of the train mix (whose schedule holds `scheduled_tokens`): weight, tokens per
    shard (+ basis), val reserve, tokens and shards needed vs available. Raises PlanError when a source is
    short, unless allow_short."""
    mix_name = cfg.train.mix
    mix = cfg.mixes[mix_name]
    weight_sum = sum(mix["weights"].values())
    split = cfg.split
    out = {}
    for source, weight in mix["weights"].items():
        available = len(source_files(cfg, source))
        tps, tps_basis = _tokens_per_shard(cfg, source, counted, counts_path, strict_counts, available)
        val_shards = len(split["val_shards"].get(source, [])) if split["method"] == "shards" else 0
        val_tokens = split["val_tokens"] if split["method"] == "hash" else 0
        train_tokens = math.ceil(weight / weight_sum * scheduled_tokens / mix["max_epochs"])
        row = {
            "weight": weight / weight_sum,
            "tokens_per_shard": None if tps is None else round(tps),
            "tokens_per_shard_basis": tps_basis,
            "max_epochs": mix["max_epochs"],
            "train_tokens_needed": train_tokens,
            "val_tokens_reserved": val_tokens,
            "val_shards_reserved": val_shards,
            "shards_available": available,
            "tokens_available": None if tps is None else round(tps * available),
            "shards_needed": None if tps is None else math.ceil((train_tokens + val_tokens) / tps) + val_shards,
        }
        row["enough"] = None if tps is None else row["shards_needed"] <= available
        if row["enough"] is False and not allow_short:
            raise PlanError(
                f"the budget needs {row['shards_needed']} shards of {source} but only {available} are configured: "
                f"{_more_shards_fix(cfg, source, row['shards_needed'])} or lower {basis}"
                + (f" (or raise mixes.{mix_name}.max_epochs)" if mix["max_epochs"] == 1 else "")
            )
        out[source] = row
    return out


# ----------------------------------------------------------------------------- memory and time

def read_measured_step(value: str, cfg: RunConfig) -> dict:
    """``--measured-step``: seconds of one bench step, or a ``pipeline.bench --json`` file, which must
    describe this config's micro-step (micro-batch, sequence length, parameters, settings)."""
    try:
        seconds = float(value)
    except ValueError:
        return _measured_step_file(Path(value), cfg)
    if not seconds > 0:
        raise PlanError(f"--measured-step {value}: a step time must be > 0 seconds")
    return {"seconds": seconds, "source": "measured: --measured-step"}


def _measured_step_file(path: Path, cfg: RunConfig) -> dict:
    if not path.is_file():
        raise PlanError(f"--measured-step {path}: neither seconds nor a pipeline.bench --json file")
    try:
        bench = json.loads(path.read_text(encoding="utf-8"))
        seconds = float(bench["step_time_s"])
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"{path}: not a pipeline.bench --json result ({type(e).__name__}: {e}); "
                        "rerun python -m pipeline.bench ... --json > FILE") from None
    train = cfg.train
    want = {"micro_batch": train["micro_batch"], "seq_len": train["seq_len"], "n_params": count_params(cfg.model)[0],
            **{k: train[k] for k in ("activation_checkpointing", "fp8", "optimizer")}}
    wrong = {k: (bench.get(k), v) for k, v in want.items() if k in bench and bench[k] != v}
    if wrong:
        diff = ", ".join(f"{k} {got} (config: {v})" for k, (got, v) in wrong.items())
        raise PlanError(f"{path} measured another step than this config's: {diff}; rerun pipeline.bench "
                        "with the config's settings")
    return {"seconds": seconds, "source": f"measured: {path} ({bench.get('device', '?')})"}


def performance(cfg: RunConfig, logits: str = "ours", measured_step: dict | None = None,
                parallel: str | None = None) -> dict:
    """Memory (GB by component), the step time and its basis, and MFU (see docs/planning.md). ``parallel``
    (ddp | fsdp) replaces ``train.parallel`` (`make_plan`'s resolution of auto)."""
    setup = StepSetup.from_config(cfg, logits, parallel)
    mem = memory(setup)
    predicted = step_time(setup)
    hw = cfg.hardware
    if measured_step is not None:
        seconds, basis = measured_step_seconds(setup, measured_step["seconds"]), measured_step["source"]
    else:
        seconds, basis = step_seconds(cfg, logits, parallel)
    n_eval = eval_batch_tokens(cfg, parallel)
    evaluation = {"in_loop": eval_memory(setup, n_eval, in_loop=True),
                  "standalone": eval_memory(setup, n_eval, in_loop=False)}
    return {"memory": mem, "capacity_gb": capacity_gb(hw["gpu_memory_gb"], hw["device"]), "step_time_s": seconds,
            "step_time_basis": basis, "predicted_step": predicted, "mfu": predicted_mfu(setup, seconds),
            "eval_memory": evaluation}


def train_hours(cfg: RunConfig, parallel: str | None = None) -> float:
    """The plan's ``est_hours`` without the data side: num_steps × the step time of `performance`."""
    return (trained_tokens(cfg) // cfg.train.global_batch_tokens * performance(cfg, parallel=parallel)["step_time_s"]
            / 3600)


# ----------------------------------------------------------------------------- the plan

def parallel_options(cfg: RunConfig, num_steps: int, logits: str = "ours", requested: str | None = None) -> dict:
    """The plan's ``parallel``: the parallelism the run uses (``used``), what the config asked
    (``requested``: `requested` when given, e.g. the ``auto`` the Snakefile resolved before planning),
    why (``reason``), and for ddp and fsdp the predicted memory per GPU, whether it fits, the step time,
    hours and GPU-hours (always `pipeline.planning`'s predicted step, whatever the plan's own time basis),
    and fsdp's collectives per step (`pipeline.planning.step_time.fsdp_comm`)."""
    asked = requested or cfg.train.parallel
    choice = choose_parallel(cfg, asked)
    out = {"used": choice["parallel"], "requested": asked, "reason": choice["reason"]}
    for mode in ("ddp", "fsdp"):
        setup = StepSetup.from_config(cfg, logits, parallel=mode)
        t = step_time(setup)
        hours = num_steps * t["total"] / 3600
        out[mode] = {"memory_gb": choice["memory"][mode]["total"], "fits": choice["fits"][mode],
                     "peak_at": choice["memory"][mode]["peak_at"], "step_time_s": t["total"], "est_hours": hours,
                     "est_gpu_hours": hours * setup.world_size}
        if mode == "fsdp":
            comm = fsdp_comm(setup, (t["body"] + t["logits"]) / setup.grad_accum)
            out[mode].update(allgather_bytes=comm["allgather_bytes"], reduce_scatter_bytes=comm["reduce_scatter_bytes"],
                             comm_s=comm["comm_s"], exposed_comm_s=comm["exposed_s"],
                             bus_bytes_per_s=comm["bus_bytes_per_s"])
    return out


def make_plan(cfg: RunConfig, counts: str | Path | None = None, allow_short: bool = False,
              strict_counts: bool = True, logits: str = "ours", measured_step: dict | None = None,
              tokens_per_param_fit: dict | None = None, parallel_requested: str | None = None) -> Plan:
    """The plan of a resolved run config (or its plan-stage slice), with the measured token counts when
    `counts` (a count table: the plan's sample.parquet or the exact counts.parquet) is given. Raises
    PlanError when the batch does not divide or the configured shards cannot supply the budget (the
    latter unless allow_short, for display only). `strict_counts=False` treats a source the counts file
    lacks as not counted yet (the Snakefile's parse-time plan, which may see counts from an earlier
    config). `logits` and `measured_step` (`read_measured_step`): see `performance`.
    `tokens_per_param_fit`: what `pipeline.planning.sweep.resolve_tokens_per_param` says of a fitted ratio
    (shown as the target's basis). A config with a `scaling` section (the whole config, not the plan
    rule's slice) adds the sweep's price (`sweep_cost`). ``train.parallel: auto`` is resolved here
    (`pipeline.planning.parallel.choose_parallel`); `parallel_requested` names what the config asked when the caller
    resolved it already (the Snakefile). A parallelism that does not fit is reported here, refused by
    `pipeline.planning.parallel.resolve_parallel` (the Snakefile's parse and this module's CLI): every figure
    below is of the parallelism used (passed on as ``parallel``). """
    model, train, hw = cfg.model, cfg.train, cfg.hardware
    parts = param_parts(model)
    n_params, non_embedding = count_params(model)
    fpt = flops_per_token(cfg)
    batch = BatchLayout.from_config(cfg)
    target, basis = token_target(train, n_params, fpt)
    trained = trained_tokens(cfg)
    num_steps = trained // batch.tokens_per_step
    data_needed = trained // train["seq_len"] * (train["seq_len"] + 1)  # whole rows: tokens_per_step is a multiple of T

    mix_name = train["mix"]
    mix_tokens = cfg.mixes[mix_name]["tokens"]
    mix_targets = trained if mix_tokens == "plan" else mix_tokens
    if mix_targets < trained:
        raise PlanError(
            f"mixes.{mix_name}.tokens = {mix_tokens} is less than the {trained} tokens training consumes "
            f"({num_steps} steps × {batch.tokens_per_step} tokens): set it to 'plan' or lower {basis}"
        )
    scheduled = math.ceil(mix_targets / train["seq_len"]) * (train["seq_len"] + 1)
    delimiters = 2 if cfg.tokenizer.delimiter == "both" else 1
    counted = None if counts is None else read_counts(counts, delimiters)
    try:
        per_source = shard_budget(cfg, scheduled, basis, counted, counts, allow_short, strict_counts)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    known = all(r["tokens_per_shard"] is not None for r in per_source.values())
    shards_available = sum(r["shards_available"] for r in per_source.values())
    tokens_available = sum(r["tokens_available"] for r in per_source.values()) if known else None

    parallel = parallel_options(cfg, num_steps, logits, parallel_requested)
    used = parallel["used"]
    perf = performance(cfg, logits, measured_step, used)
    memory = perf["memory"]
    total_flops = fpt * trained
    peak = peak_flops(cfg)
    est_hours = num_steps * perf["step_time_s"] / 3600

    notes = [f"{s}: tokens per shard {r['tokens_per_shard_basis']}" for s, r in per_source.items()]
    notes += [f"{s}: SHORT — needs {r['shards_needed']} shards, {r['shards_available']} configured"
              for s, r in per_source.items() if r["enough"] is False]
    # every stage trains with the run's batch layout: the plan's step time prices each stage's steps
    stage_rate = fpt * batch.tokens_per_step / (batch.world_size * perf["step_time_s"])
    stages, stages_total = plan_stages(cfg, fpt, batch, stage_rate)
    # checkpoints and the chain of jobs of each stage within hardware.max_job_hours (pipeline.planning.train_jobs)
    checkpoints = checkpointing(cfg, perf["step_time_s"], used)
    jobs = stage_jobs(cfg, perf["step_time_s"], used)
    for s in stages:
        s.update({k: jobs[s["name"]][k] for k in ("jobs", "runtime_min", "hours_per_job", "checkpoints",
                                                   "expected_failures", "restarts", "wall_hours")})
    stages_total["wall_hours"] = sum(s["wall_hours"] for s in stages)
    stages_total["jobs"] = sum(s["jobs"] for s in stages)
    if any(s["estimate"] for s in stages):
        notes.append("epochs stages: steps estimated from the mix's tokens as if packed without padding; the "
                     "trainer counts the packed rows")
    notes.append("memory and step time are predictions of pipeline.planning (memory, step_time), not measurements"
                 + ("" if measured_step is None else f"; the hours use the {perf['step_time_basis']} step"))
    if logits != "ours":
        notes.append(f"memory and time describe a trainer with {logits} logits, not tokenfarm's")
    if hw["device"] == "cpu":
        notes.append("cpu: peak is a nominal 1 TFLOP/s and memory is host memory")
    notes.append("fsdp's figures rest on stated assumptions (pipeline.planning.fitted: FSDP_*, the link bandwidths, "
                 "COLLECTIVE_EFFICIENCY), not on a measured FSDP step")
    extra = {"tokens_per_param_fit": tokens_per_param_fit, "scaling_sweep": None}
    if tokens_per_param_fit is not None:
        from pipeline.planning.sweep import describe_ratio

        if basis == "train.tokens_per_param":
            basis = describe_ratio(tokens_per_param_fit)
    if "scaling" in cfg:
        try:
            extra["scaling_sweep"] = sweep_cost(cfg, used)
        except (PipelineError, ArithmeticError, ValueError) as e:  # the sweep's own rule names the key
            notes.append(f"scaling sweep not priced: {e}")
    return Plan(
        n_params=n_params,
        n_params_non_embedding=non_embedding,
        target_tokens=target,
        **batch.plan_figures(),
        num_steps=num_steps,
        flops_per_token=fpt,
        total_flops=total_flops,
        tokens_per_shard=round(tokens_available / shards_available) if known else None,
        shards_needed=sum(r["shards_needed"] for r in per_source.values()) if known else None,
        shards_available=shards_available,
        est_memory_gb=memory["total"],
        fits_memory=memory["total"] <= perf["capacity_gb"],
        est_hours=est_hours,
        est_gpu_hours=est_hours * batch.world_size,
        n_params_embedding=parts["embedding"],
        n_params_lm_head=parts["lm_head"],
        target_basis=basis,
        trained_tokens=trained,
        seq_len=train["seq_len"],
        data_tokens_needed=data_needed,
        tokens_available=tokens_available,
        shards_per_source=per_source,
        memory_gb=memory,
        step_time_s=perf["step_time_s"],
        step_time_basis=perf["step_time_basis"],
        mfu=perf["mfu"],
        hardware={"gpu_type": hw["gpu_type"], "gpu_memory_gb": hw["gpu_memory_gb"],
                  "max_job_hours": hw.get("max_job_hours"),
                  "capacity_gb": round(perf["capacity_gb"], 3), "peak_flops": peak, "logits": logits},
        stages=stages,
        stages_total=stages_total,
        eval_memory_gb=perf["eval_memory"],
        fits_eval_memory=all(mem["total"] <= perf["capacity_gb"] for mem in perf["eval_memory"].values()),
        parallel=parallel,
        notes=notes,
        **extra,
        host_memory=job_sizes.train_host_memory(cfg, used),
        checkpointing=checkpoints,
    )


def sweep_cost(cfg: RunConfig, parallel: str | None = None) -> dict:
    """The IsoFLOP sweep's price (`snakemake --cores all scaling`, pipeline/planning/sweep.py): every point on
    one process (one GPU) for its steps at the plan's step time of the point's own config
    (`train_hours`; ``parallel`` replaces its ``train.parallel``), and the total."""
    from pipeline.planning.sweep import point_run_config, points

    out = []
    for p in points(cfg):
        hours = train_hours(point_run_config(cfg, p["flops"], p["depth"]), parallel)
        out.append({**p, "est_gpu_hours": hours})
    total = sum(p["est_gpu_hours"] for p in out)
    return {"points": out, "n_points": len(out), "est_gpu_hours": total,
            "budgets": len(cfg.scaling.budgets), "depths": len(cfg.scaling.depths)}


def plan_stages(cfg: RunConfig, fpt: int, batch: BatchLayout, flops_per_s_per_gpu: float) -> tuple[list[dict], dict]:
    """Every training stage's steps, tokens, FLOPs and (estimated) time, and their sums. An epochs
    budget is estimated from its mix's integer `tokens` (rows of seq_len targets, no padding: a lower
    bound; the trainer counts the packed rows), flagged ``estimate``."""
    out = []
    for st in stage_list(cfg):
        b = stage_budget(cfg, st)
        steps = b["num_steps"]
        estimate = steps is None
        if estimate:
            steps = estimated_epoch_steps(cfg, st)
        tokens = steps * batch.tokens_per_step
        hours = fpt * tokens / (batch.world_size * flops_per_s_per_gpu) / 3600
        out.append({"name": st["name"], "mix": st["mix"], "loss": st["loss"], "init_from": st["init_from"],
                    "basis": b["basis"], "num_steps": steps, "trained_tokens": tokens, "total_flops": fpt * tokens,
                    "est_hours": hours, "est_gpu_hours": hours * batch.world_size, "estimate": estimate})
    keys = ("num_steps", "trained_tokens", "total_flops", "est_hours", "est_gpu_hours")
    return out, {k: sum(s[k] for s in out) for k in keys}


# ----------------------------------------------------------------------------- display

def _num(x: float, unit: str = "") -> str:
    """1.242 B, 973.1 M, 54.85 K: four significant digits with a thousands suffix."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.4g} {suffix}{unit}"
    return f"{x:g} {unit}".rstrip()


def _rows(plan: Plan) -> list[tuple[str, str]]:
    mem = plan.memory_gb
    shards = "; ".join(
        f"{s}: {'?' if r['shards_needed'] is None else r['shards_needed']} of {r['shards_available']} shards"
        f" ({'?' if r['tokens_per_shard'] is None else _num(r['tokens_per_shard'])} tokens/shard)"
        + (" SHORT" if r["enough"] is False else "")
        for s, r in plan.shards_per_source.items()
    )
    parts = ("weights", "optimizer", "autocast_copies", "gradients", "gathered", "reduce_buffers", "activations",
             "logits", "recompute")
    breakdown = ", ".join(f"{k.replace('_', ' ')} {mem[k]:.1f}" for k in parts if mem[k])
    hw = plan.hardware
    nominal = f" ({hw['gpu_memory_gb']:g} GiB)" if hw["capacity_gb"] != hw["gpu_memory_gb"] else ""
    gpu = (f"{plan.world_size} × {hw['gpu_type']} ({_num(hw['peak_flops'], 'FLOP/s')} peak) "
           f"at {plan.mfu:.0%} MFU")
    return [
        ("parameters", f"{_num(plan.n_params)} total, {_num(plan.n_params_non_embedding)} non-embedding"),
        ("target tokens", f"{_num(plan.target_tokens)} (from {plan.target_basis})"),
        ("tokens per step", f"{plan.tokens_per_step:,} = {plan.micro_batch} rows × {plan.seq_len} tokens × "
                            f"{plan.world_size} rank(s) × {plan.grad_accum_steps} accumulation step(s)"),
        ("steps", f"{plan.num_steps:,} → {_num(plan.trained_tokens)} tokens trained"),
        ("compute", f"{plan.flops_per_token / 1e9:.3g} GFLOP/token, {plan.total_flops:.3g} FLOPs total"),
        ("data", f"{_num(plan.data_tokens_needed)} tokens read; {shards}"),
        ("memory per GPU (pred.)", f"{plan.est_memory_gb:.1f} GB of {hw['capacity_gb']:.1f} GB{nominal}: "
                                   f"{'fits' if plan.fits_memory else 'DOES NOT FIT'} "
                                   f"(peak {mem['peak']:.1f} at the {mem['peak_at']}: {breakdown})"),
        ("evaluation memory (pred.)", _eval_row(plan)),
        ("host memory per node", _host_row(plan.host_memory)),
        *_parallel_rows(plan),
        ("step time", f"{plan.step_time_s:.3g} s per optimizer step ({plan.step_time_basis})"),
        ("time", f"{plan.est_hours:.2f} hours on {gpu}, {plan.est_gpu_hours:.1f} GPU-hours"),
        *[(f"stage {i + 1}: {s['name']}",
           f"{'~' if s['estimate'] else ''}{s['num_steps']:,} steps, {_num(s['trained_tokens'])} tokens, "
           f"{s['est_gpu_hours']:.3g} GPU-hours (pred.); mix {s['mix']}, loss {s['loss']}, "
           f"from {s['init_from'] or 'scratch'} ({s['basis']})")
          for i, s in enumerate(plan.stages)],
        ("all stages", f"{plan.stages_total['num_steps']:,} steps, {_num(plan.stages_total['trained_tokens'])} "
                       f"tokens, {plan.stages_total['est_gpu_hours']:.3g} GPU-hours (pred.)"),
        *_job_rows(plan),
        *_sweep_rows(plan),
    ]


def _job_rows(plan: Plan) -> list[tuple[str, str]]:
    """Checkpoints (size, save, interval, loss per failure), a restart's start-up, and each stage's jobs."""
    ck, limit = plan.checkpointing, plan.hardware.get("max_job_hours")
    save = (f"a save blocks {ck['block_s']:.3g} s (staging), written in {ck['write_s']:.3g} s in the background"
            if ck["async"] else f"a save blocks {ck['block_s']:.3g} s")
    start = " + ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in ck["startup"].items() if v)
    rows = [("checkpoints (pred.)", f"{ck['size_gb_rank']:.3g} GB per rank, {ck['size_gb_total']:.3g} GB in all; "
                                    f"{save}; every {ck['interval_steps']:,} steps = {ck['interval_hours']:.3g} h "
                                    f"(Young/Daly {ck['young_daly_s'] / 3600:.3g} h at a {ck['mtbf_hours']:,.0f} h job "
                                    f"MTBF); {ck['lost_hours_per_failure']:.3g} h lost per failure"),
            ("restart (pred.)", f"{ck['startup_s']:.3g} s before the first step = {start} s")]
    within = f"≤ {limit:g} h (hardware.max_job_hours)" if limit else "no job limit (hardware.max_job_hours)"
    for s in plan.stages:
        rows.append((f"jobs: {s['name']}",
                     f"{s['jobs']} job{'s' if s['jobs'] > 1 else ''} × {s['hours_per_job']:.3g} h, "
                     f"each asking {s['runtime_min']:,} min, {within}; "
                     f"{s['checkpoints']:,} checkpoints, {s['restarts']:.3g} restarts "
                     f"({s['expected_failures']:.2g} failures expected); {s['wall_hours']:,.4g} h wall with every "
                     "start-up, save and failure (pred.)"))
    return rows


def _parallel_rows(plan: Plan) -> list[tuple[str, str]]:
    """Which parallelism the run uses and why; ddp's and fsdp's memory, fit, step time and GPU-hours."""
    par, cap = plan.parallel, plan.hardware["capacity_gb"]
    rows = [("parallelism", f"{par['used']}: {par['reason']}")]
    for mode in ("ddp", "fsdp"):
        m = par[mode]
        text = (f"{m['memory_gb']:.1f} GB per GPU of {cap:.1f} GB: {'fits' if m['fits'] else 'DOES NOT FIT'}; "
                f"{m['step_time_s']:.3g} s per step, {m['est_gpu_hours']:,.1f} GPU-hours")
        if mode == "fsdp":
            volume, bus = (m["allgather_bytes"] + m["reduce_scatter_bytes"]) / 1e9, m["bus_bytes_per_s"] / 1e9
            text += (f"; all-gather + reduce-scatter {volume:,.1f} GB per step at {bus:.0f} GB/s bus bandwidth: "
                     f"{m['comm_s']:.3g} s, {m['exposed_comm_s']:.3g} s not hidden by compute")
        rows.append((f"{mode} (pred.)" + (" ← used" if mode == par["used"] else ""), text))
    return rows


def _sweep_rows(plan: Plan) -> list[tuple[str, str]]:
    """The scaling sweep's price: one row per budget (its points' GPU-hours by depth) and the total."""
    sweep = plan.scaling_sweep
    if not sweep:
        return []
    rows = []
    for b in dict.fromkeys(p["budget"] for p in sweep["points"]):
        pts = [p for p in sweep["points"] if p["budget"] == b]
        each = ", ".join(f"d{p['depth']} {_num(p['n_params'])} params {p['steps']:,} steps {p['est_gpu_hours']:.3g} h"
                         for p in pts)
        rows.append((f"scaling C={b}", each))
    rows.append(("scaling sweep", f"{sweep['n_points']} points ({sweep['budgets']} budgets × {sweep['depths']} "
                                  f"depths), {sweep['est_gpu_hours']:.3g} GPU-hours (pred.), one GPU per point: "
                                  "snakemake --cores all scaling"))
    return rows


def _host_row(h: dict) -> str:
    state = f" + {h['state_mb']:,.0f} training state" if h["state_mb"] else ""
    gather = f" + {h['final_gather_mb']:,.0f} final.pt gather" if h["final_gather_mb"] else ""
    return (f"{h['node_mb']:,} MB (2^20 bytes), the train job's mem_mb = {job_sizes.TRAIN_HOST_MARGIN:g} × "
            f"({h['ranks_per_node']} rank(s) × ({h['process_mb']:,.0f} process + {h['init_mb']:,.0f} init + "
            f"{h['loader_mb']:,.0f} loader{state}){gather})")


def _eval_row(plan: Plan) -> str:
    """CORE scoring's predicted peak, in the training loop and standalone, against the GPU."""
    ev, cap = plan.eval_memory_gb, plan.hardware["capacity_gb"]
    loop, alone = ev["in_loop"], ev["standalone"]
    return (f"CORE scoring at {loop['batch_tokens']:,} tokens/batch: in the training loop {loop['total']:.1f} GB "
            f"(beside weights, optimizer and gradients; peak at the {loop['peak_at']}), standalone "
            f"{alone['total']:.1f} GB, of {cap:.1f} GB: {'fits' if plan.fits_eval_memory else 'DOES NOT FIT'}")


def format_plan(plan: Plan) -> str:
    """The plan as an aligned two-column text table (what the Snakefile prints at parse time)."""
    rows = _rows(plan)
    width = max(len(k) for k, _ in rows)
    lines = ["token-budget plan (memory and time are predictions)"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_plan_md(plan: Plan) -> str:
    lines = ["# Token-budget plan", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _rows(plan)]
    lines += ["", *[f"- {n}" for n in plan.notes], ""]
    return "\n".join(lines)
