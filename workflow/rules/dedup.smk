# MinHash dedup across all shards and sources: per-shard signatures, then one global clustering job.
rule dedup_signatures:
    input:
        shard=f"{D}/{{source}}/{{shard}}.parquet",
        tokens=f"{R}/tokens/{{source}}/{{shard}}.json",
    output:
        f"{R}/dedup/sig/{{source}}/{{shard}}.parquet",
    params:
        p=P("dedup_sig"),
        code=CODE("dedup"),
    log:
        f"{LOGS}/dedup/sig/{{source}}/{{shard}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.dedup signatures --params {params.p:q} --input {input.shard:q} "
        "--tokens {input.tokens:q} --source {wildcards.source} --shard {wildcards.shard} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule dedup:
    input:
        all_shards(f"{R}/dedup/sig/{{source}}/{{shard}}.parquet"),
    output:
        keep=all_shards(f"{R}/dedup/keep/{{source}}/{{shard}}.parquet"),
        report=f"{R}/dedup/report.json",
    params:
        p=P("dedup"),
        code=CODE("dedup"),
    log:
        f"{LOGS}/dedup/clusters.log",
    threads: workflow.cores
    conda:
        "../../envs/data.yaml"
    shell:
        "POLARS_MAX_THREADS={threads} python -m pipeline.dedup clusters --params {params.p:q} "
        "--inputs {input:q} --outdir {R}/dedup --report {output.report:q} 2>&1 | tee {log:q}"
