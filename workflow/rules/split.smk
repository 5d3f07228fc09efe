# Train/val split decided per duplicate cluster, so no cluster spans both sides. Writes
# R/split/{source}/{shard}.parquet for every shard and, last, the report (its declared output).
rule split:
    input:
        dedup=f"{R}/dedup/report.json",
        tokens=manifests(f"{R}/tokens"),
    output:
        report=f"{R}/split/report.json",
    params:
        p=P("split"),
        code=CODE("split"),
        keep=shard_paths(f"{R}/dedup/keep/{{source}}/{{shard}}.parquet"),
        tokens=shard_paths(f"{R}/tokens/{{source}}/{{shard}}.json"),
    log:
        f"{LOGS}/split.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.split --params {params.p:q} --keep {params.keep:q} --tokens {params.tokens:q} "
        "--outdir {R}/split --report {output.report:q} 2>&1 | tee {log:q}"
