# Train/val split decided per duplicate cluster, so no cluster spans both sides.
rule split:
    input:
        keep=all_shards(f"{R}/dedup/keep/{{source}}/{{shard}}.parquet"),
        tokens=all_shards(f"{R}/tokens/{{source}}/{{shard}}.json"),
    output:
        parts=all_shards(f"{R}/split/{{source}}/{{shard}}.parquet"),
        report=f"{R}/split/report.json",
    params:
        p=P("split"),
        code=CODE("split"),
    log:
        f"{LOGS}/split.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.split --params {params.p:q} --keep {input.keep:q} --tokens {input.tokens:q} "
        "--outdir {R}/split --report {output.report:q} 2>&1 | tee {log:q}"
