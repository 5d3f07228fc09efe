# The IsoFLOP sweep, a target outside `all`: `snakemake --cores all scaling`. One job per point
# {budget}/{depth} (scaling.budgets × scaling.depths; pipeline/planning/sweep.py: the shape rule and the point's
# budget, optimizer and schedule) trains with the train rule's supervisor and trainer (one process: one GPU,
# or one core, no torchrun) on the packed rows of the run's first stage's mix, then evaluates the point on
# the same validation rows as the evaluate rule (val loss, bits per byte). A point's params are its own
# view of the config (no budget or depth list in them): adding a budget adds its points and reruns none
# of the others. The fit (rule scaling) writes R/scaling/fit.json (which `train.tokens_per_param: scaling`
# reads), report.md and the plot.

from pipeline.planning import sweep as tfsc  # noqa: E402

SCALING_MIX = STAGES[next(iter(STAGES))]["mix"]
try:
    SCALING_POINTS = tfsc.points(RC)
    if workflow.is_main_process and SWEEP_TARGETED:  # every point must get its tokens from the mix, 10+ steps
        _mix = config["mixes"][SCALING_MIX]["tokens"]
        tfsc.check_sweep(RC, mix_targets(RC, SCALING_MIX) if _mix == "plan" else _mix)
except ConfigError as _e:
    stop(_e)


rule scaling_point:
    input:
        train=L.pack(SCALING_MIX, "train"),
        val=L.pack(SCALING_MIX, "val"),
        tokenizer=L.tokenizer(),
    output:
        json=L.scaling_point(),
    params:
        # the point's own view of the config (pipeline.planning.sweep.point_params); the code is what the job runs:
        # pipeline.planning.sweep only computes the params (an edit of the fit or the plot must not retrain the points)
        p=rule_params("scaling_point"),
        code=rule_code("scaling_point"),
        outdir=lambda w: L.scaling_point(w.budget, w.depth, "").rstrip("/"),
        train=lambda w: L.scaling_point(w.budget, w.depth, "train"),
        ckpt=lambda w: L.scaling_point(w.budget, w.depth, "train/final.pt"),
        metrics=lambda w: L.scaling_point(w.budget, w.depth, "train/metrics.jsonl"),
    log:
        L.log("scaling", "{budget}", "{depth}"),
    wildcard_constraints:
        budget=r"[0-9.]+e[0-9]+",
        depth=r"\d+",
    # one process per point: one GPU, or on CPU one core (points run side by side on --cores)
    threads: job_threads("scaling_point")
    resources:
        # runtime: the planner's predicted hours of the point (its own config through plan.train_hours) × 1.5
        **{**job_resources("scaling_point"), "runtime": lambda w: tfsz.train_minutes(
            train_hours(tfsc.point_run_config(RC, float(w.budget), int(w.depth))))},
    conda:
        "../../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m pipeline.training.launch -- python -m pipeline.training.train "
        "--params {params.p:q} --train {input.train:q} --val {input.val:q} --tokenizer {input.tokenizer:q} "
        "--outdir {params.train:q} 2>&1 | tee {log:q}; "
        "OMP_NUM_THREADS={threads} python -m pipeline.evaluation.evaluate --params {params.p:q} --ckpt {params.ckpt:q} "
        "--val {input.val:q} --train {input.train:q} --tokenizer {input.tokenizer:q} --metrics {params.metrics:q} "
        "--outdir {params.outdir:q} 2>&1 | tee -a {log:q}"


rule scaling:
    input:
        points=[L.scaling_point(p["budget"], p["depth"]) for p in SCALING_POINTS],
    output:
        json=L.scaling("fit.json"),
        md=report(L.scaling("report.md"), category="Scaling", caption="../report/scaling.rst"),
        png=report(L.scaling("scaling.png"), category="Scaling", caption="../report/scaling.rst"),
    params:
        p=rule_params("scaling"),
        code=rule_code("scaling"),
    log:
        L.log("scaling", "fit"),
    threads: job_threads("scaling")
    resources:
        **job_resources("scaling"),
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m pipeline.evaluation.scaling --params {params.p:q} --points {input.points:q} --out-json {output.json:q} "
        "--out-md {output.md:q} --out-png {output.png:q} 2>&1 | tee {log:q}"
