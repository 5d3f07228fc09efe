# MinHash dedup across all shards and sources: per-shard signatures (one job per group of shards),
# then one global clustering job that writes R/dedup/keep/{source}/{shard}.parquet for every shard
# and, last, the report (its declared output).
rule dedup_signatures:
    input:
        download=f"{D}/{{source}}/_manifest/{{group}}.json",
        tokens=f"{R}/tokens/{{source}}/_manifest/{{group}}.json",
    output:
        f"{R}/dedup/sig/{{source}}/_manifest/{{group}}.json",
    params:
        p=P_source("dedup_sig"),
        code=CODE("dedup", "minhash"),
        shards=group_shards,
        files=group_paths(f"{R}/dedup/sig/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOGS}/dedup/sig/{{source}}/{{group}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "(for sh in {params.shards}; do"
        " python -m pipeline.dedup signatures --params {params.p:q} --input {D}/{wildcards.source}/$sh.parquet"
        " --tokens {R}/tokens/{wildcards.source}/$sh.json --source {wildcards.source} --shard $sh"
        " --out {R}/dedup/sig/{wildcards.source}/$sh.parquet; done;"
        " python -m pipeline.manifest --stage dedup_signatures --out {output:q} {params.files:q}) 2>&1 | tee {log:q}"


rule dedup:
    input:
        manifests(f"{R}/dedup/sig"),
    output:
        report=f"{R}/dedup/report.json",
    params:
        p=P("dedup"),
        code=CODE("dedup", "minhash"),
        files=shard_paths(f"{R}/dedup/sig/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOGS}/dedup/clusters.log",
    threads: ALL_CORES
    conda:
        "../../envs/data.yaml"
    shell:
        "POLARS_MAX_THREADS={threads} python -m pipeline.dedup clusters --params {params.p:q} "
        "--inputs {params.files:q} --outdir {R}/dedup --report {output.report:q} 2>&1 | tee {log:q}"
