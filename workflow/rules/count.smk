# Exact documents / tokens / bytes / characters per shard (RUN_DIR/counts/{source}/{shard}.json), one
# process per group of shards, then one table for the run.
rule count_shards:
    input:
        download=f"{DATA_DIR}/{{source}}/_manifest/{{group}}.json",
        tokenizer=TOKENIZER,
    output:
        f"{RUN_DIR}/counts/{{source}}/_manifest/{{group}}.json",
    params:
        p=source_params("count"),
        code=code_version("pipeline.data.count"),
        inputs=group_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
        files=group_files(f"{RUN_DIR}/counts/{{source}}/{{shard}}.json"),
    log:
        f"{LOG_DIR}/count/{{source}}/{{group}}.log",
    benchmark:
        f"{BENCH_DIR}/count_shards/{{source}}/{{group}}.tsv"
    group:
        SHARD_CHAIN
    threads: job_threads("count")
    resources:
        **job_resources("count"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.count shards --params {params.p:q} --tokenizer {input.tokenizer:q} "
        "--source {wildcards.source} --inputs {params.inputs:q} --outputs {params.files:q} --manifest {output:q} "
        "2>&1 | tee {log:q}"


# The reducers (count, plan, stages_report, dedup_index) read small per-shard/per-stage files and run in
# seconds: on a cluster they run in the main Snakemake process instead of waiting for a slot.
localrules:
    count,


rule count:
    input:
        group_manifests(f"{RUN_DIR}/counts"),
    output:
        table=f"{RUN_DIR}/counts/counts.parquet",
        summary=f"{RUN_DIR}/counts/summary.json",
    params:
        code=code_version("pipeline.data.count"),
        files=shard_files(f"{RUN_DIR}/counts/{{source}}/{{shard}}.json"),
    log:
        f"{LOG_DIR}/count/aggregate.log",
    benchmark:
        f"{BENCH_DIR}/count.tsv"
    threads: job_threads("plan")
    resources:
        **job_resources("plan"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.count aggregate --inputs {params.files:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"
