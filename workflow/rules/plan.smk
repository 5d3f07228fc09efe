# The token budget: params, tokens, steps, grad accumulation, shards, memory, time. Tokens per shard from the
# plan's sample of tokenized shards (count_sample), so the budget is checked before every shard is tokenized.
localrules:
    plan,


rule plan:
    input:
        counts=L.counts("sample.parquet"),
    output:
        json=L.plan(),
        md=report(L.plan("md"), category="Plan", caption="../report/plan.rst"),
    params:
        p=rule_params("plan"),
        code=rule_code("plan"),
    log:
        L.log("plan"),
    benchmark:
        L.bench("plan")
    priority: SAMPLE_PRIORITY
    threads: job_threads("plan")
    resources:
        **job_resources("plan"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.plan --params {params.p:q} --counts {input.counts:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
