# The run's count tables, joined from the tokenize jobs' metadata (each tokenized shard carries its exact
# counts: nothing is tokenized twice; pipeline/data/count.py). `count`: every shard's, the exact table the
# accounting reconciles. `count_sample`: the plan's sample, count.sample_shards shards of each source,
# so the plan rule waits for those shards' tokenize jobs only.
localrules:
    count,
    count_sample,


rule count:
    input:
        group_manifests(L.stage_dir("tokens")),
    output:
        table=L.counts("counts.parquet"),
        summary=L.counts("summary.json"),
    params:
        code=rule_code("count"),
        files=shard_files(L.tokens()),
    log:
        L.log("count", "aggregate"),
    benchmark:
        L.bench("count")
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
        sorted({L.manifest("tokens", s, g) for s in SOURCES for sh in SAMPLE[s] for g in GROUPS[s]
                if sh in GROUPS[s][g]}),
    output:
        table=L.counts("sample.parquet"),
        summary=L.counts("sample.json"),
    params:
        code=rule_code("count_sample"),
        files=[L.tokens(s, sh) for s in SOURCES for sh in SAMPLE[s]],
    log:
        L.log("count", "sample"),
    benchmark:
        L.bench("count_sample")
    priority: SAMPLE_PRIORITY
    threads: job_threads("count_sample")
    resources:
        **job_resources("count_sample"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.count --inputs {params.files:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"
