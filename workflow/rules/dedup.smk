# MinHash dedup across all shards and sources: signatures per group of shards (one process each), then
# one global clustering job that writes RUN_DIR/dedup/keep/{source}/{shard}.parquet for every shard
# and, last, the report (its declared output).
rule dedup_signatures:
    input:
        download=f"{DATA_DIR}/{{source}}/_manifest/{{group}}.json",
        tokens=f"{RUN_DIR}/tokens/{{source}}/_manifest/{{group}}.json",
    output:
        f"{RUN_DIR}/dedup/sig/{{source}}/_manifest/{{group}}.json",
    params:
        p=source_params("dedup_sig"),
        code=code_version("data.dedup", "data.minhash"),
        inputs=group_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
        tokens=group_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        files=group_files(f"{RUN_DIR}/dedup/sig/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOG_DIR}/dedup/sig/{{source}}/{{group}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup signatures --params {params.p:q} --source {wildcards.source} "
        "--inputs {params.inputs:q} --tokens {params.tokens:q} --outputs {params.files:q} --manifest {output:q} "
        "2>&1 | tee {log:q}"


rule dedup:
    input:
        group_manifests(f"{RUN_DIR}/dedup/sig"),
    output:
        report=f"{RUN_DIR}/dedup/report.json",
    params:
        p=stage_params("dedup"),
        code=code_version("data.dedup", "data.minhash"),
        files=shard_files(f"{RUN_DIR}/dedup/sig/{{source}}/{{shard}}.parquet"),
        outdir=lambda w, output: Path(output.report).parent,
    log:
        f"{LOG_DIR}/dedup/clusters.log",
    threads: ALL_CORES
    conda:
        "../../envs/data.yaml"
    shell:
        "POLARS_MAX_THREADS={threads} python -m pipeline.data.dedup clusters --params {params.p:q} "
        "--inputs {params.files:q} --outdir {params.outdir:q} --report {output.report:q} 2>&1 | tee {log:q}"
