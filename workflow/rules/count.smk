# The run's count tables, joined from the tokenize jobs' metadata (each tokenized shard carries its exact
# counts: nothing is tokenized twice; pipeline/data/count.py). `count`: every shard's, the exact table the
# accounting reconciles. `count_sample`: the plan's sample, count.sample_shards shards of each source,
# so the plan rule waits for those shards' tokenize jobs only.
localrules:
    count,
    count_sample,


rule count:
    input:
        group_manifests(f"{RUN_DIR}/tokens"),
    output:
        table=f"{RUN_DIR}/counts/counts.parquet",
        summary=f"{RUN_DIR}/counts/summary.json",
    params:
        code=rule_code("count"),
        files=shard_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
    log:
        f"{LOG_DIR}/count/aggregate.log",
    benchmark:
        f"{BENCH_DIR}/count.tsv"
    threads: job_threads("count")
    resources:
        **job_resources("count"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.count --inputs {params.files:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"


rule count_sample:
    input:
        sorted({f"{RUN_DIR}/tokens/{s}/_manifest/{g}.json" for s in SOURCES for sh in SAMPLE[s] for g in GROUPS[s]
                if sh in GROUPS[s][g]}),
    output:
        table=f"{RUN_DIR}/counts/sample.parquet",
        summary=f"{RUN_DIR}/counts/sample.json",
    params:
        code=rule_code("count_sample"),
        files=[f"{RUN_DIR}/tokens/{s}/{sh}.json" for s in SOURCES for sh in SAMPLE[s]],
    log:
        f"{LOG_DIR}/count/sample.log",
    benchmark:
        f"{BENCH_DIR}/count_sample.tsv"
    priority: SAMPLE_PRIORITY
    threads: job_threads("count_sample")
    resources:
        **job_resources("count_sample"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.count --inputs {params.files:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"
