# The token budget: params, tokens, steps, grad accumulation, shards, memory, time. Tokens per shard from the
# plan's sample of tokenized shards (count_sample), so the budget is checked before every shard is tokenized.
localrules:
    plan,


rule plan:
    input:
        counts=f"{RUN_DIR}/counts/sample.parquet",
    output:
        json=f"{RUN_DIR}/plan.json",
        md=report(f"{RUN_DIR}/plan.md", category="Plan", caption="../report/plan.rst"),
    params:
        p=rule_params("plan"),
        code=rule_code("plan"),
    log:
        f"{LOG_DIR}/plan.log",
    benchmark:
        f"{BENCH_DIR}/plan.tsv"
    priority: SAMPLE_PRIORITY
    threads: job_threads("plan")
    resources:
        **job_resources("plan"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.plan --params {params.p:q} --counts {input.counts:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
