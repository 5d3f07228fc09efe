"""`python -m pipeline.plan`: the token-budget plan of a config, before anything is downloaded.

    python -m pipeline.plan --configfile configs/llama3-1b-fineweb.yaml [--json] [--data-cpus 512]

Prints (or writes, --out/--out-md) parameters, tokens, steps, grad accumulation, shards needed vs
available, memory per GPU, GPU-hours and the data stages' cost (pipeline.planning.token_plan)."""
from __future__ import annotations

import argparse
import json

from pipeline.config import add_config_args, load_config, params_from_args, parse_overrides, plan_slice, run_dir
from pipeline.io import atomic_write, get_logger, provenance, run_cli, write_json
from pipeline.planning import data_cost, job_sizes
from pipeline.planning.memory import LOGITS_MODES
from pipeline.planning.parallel import resolve_parallel
from pipeline.planning.sweep import resolve_tokens_per_param
from pipeline.planning.token_plan import format_plan, format_plan_md, make_plan, read_measured_step, run_counts
from pipeline.run_config import run_config

log = get_logger(__name__)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.plan", description=__doc__.split("\n\n")[0])
    add_config_args(ap)
    ap.add_argument("--counts", help="a count table (R/counts/sample.parquet or counts.parquet): measured tokens per "
                                     "shard")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON only")
    ap.add_argument("--no-check", action="store_true",
                    help="show the plan even when the shards fall short (display only)")
    ap.add_argument("--out", help="write plan.json here (with provenance under 'meta')")
    ap.add_argument("--out-md", help="write the plan as a markdown table here")
    ap.add_argument("--logits", choices=LOGITS_MODES, default="ours",
                    help="the loss the memory/time model describes: ours (default) or bf16-materialized "
                         "(the reference trainer's [tokens, vocab] bf16 logits; display only)")
    ap.add_argument("--measured-step", metavar="SECONDS|BENCH_JSON",
                    help="a step measured with python -m pipeline.bench on this config (seconds, or its --json "
                         "output file): the hours use it instead of the prediction")
    ap.add_argument("--data-cpus", type=int, default=256,
                    help="CPU cores for the data stages' jobs: the wall time of the data-stage estimate (--configfile)")
    args = ap.parse_args(argv)
    if (args.no_check or args.logits != "ours") and (args.out or args.out_md):
        ap.error("--no-check and --logits are for display only; they cannot be combined with --out/--out-md")
    counts, strict = args.counts, True
    if args.configfile:  # by hand: the whole config (estimates included) and the run's counts, once measured
        params = load_config(args.configfile, parse_overrides(args.set))
        found = run_counts(run_dir(params))  # the exact table, else the plan's sample, else None
        if counts is None and found is not None:
            counts, strict = found, False
            log.info("tokens per shard from the measured counts in %s", found)
    else:
        params = params_from_args(args, plan_slice)

    # typed once here (pipeline.planning takes a RunConfig; each step that resolves a key returns one)
    cfg, fitted = run_config(params), None
    if "results_dir" in cfg:
        cfg, fitted = resolve_tokens_per_param(cfg)
    requested = cfg.train.parallel
    if not args.no_check:  # a parallelism that does not fit is refused, as at the Snakefile's parse
        cfg = resolve_parallel(cfg)
    params = cfg.to_dict()  # the resolved config as plain data (the plan's provenance)
    measured = None if args.measured_step is None else read_measured_step(args.measured_step, cfg)
    plan = make_plan(cfg, counts=counts, allow_short=args.no_check, strict_counts=strict, logits=args.logits,
                     measured_step=measured, tokens_per_param_fit=fitted, parallel_requested=requested)
    if args.out:
        write_json(args.out, {**plan.to_json(), "meta": provenance("plan", params, [counts] if counts else [])})
    if args.out_md:
        with atomic_write(args.out_md, encoding="utf-8") as f:
            f.write(format_plan_md(plan))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return
    print(format_plan(plan))
    if args.configfile:  # the data stages' cost on a cluster (pipeline/planning/data_cost.py)
        costs = data_cost.data_costs(cfg, job_sizes.measured_sizes(found), args.data_cpus)
        print("\n" + data_cost.format_costs(costs))


if __name__ == "__main__":
    run_cli(main)
