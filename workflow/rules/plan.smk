# The token budget from measured counts: params, tokens, steps, grad accumulation, shards, memory, time.
localrules:
    plan,


rule plan:
    input:
        counts=f"{RUN_DIR}/counts/counts.parquet",
    output:
        json=f"{RUN_DIR}/plan.json",
        md=report(f"{RUN_DIR}/plan.md", category="Plan", caption="../report/plan.rst"),
    params:
        p=rule_params("plan"),
        code=code_version("pipeline.plan"),
    log:
        f"{LOG_DIR}/plan.log",
    benchmark:
        f"{BENCH_DIR}/plan.tsv"
    threads: job_threads("plan")
    resources:
        **job_resources("plan"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.plan --params {params.p:q} --counts {input.counts:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
