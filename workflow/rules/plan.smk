# The token budget from measured counts: params, tokens, steps, grad accumulation, shards, memory, time.
rule plan:
    input:
        counts=f"{R}/counts/counts.parquet",
    output:
        json=f"{R}/plan.json",
        md=report(f"{R}/plan.md", category="Plan", caption="../report/plan.rst"),
    params:
        p=P("plan"),
        code=CODE("plan", "model"),
    log:
        f"{LOGS}/plan.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.plan --params {params.p:q} --counts {input.counts:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
