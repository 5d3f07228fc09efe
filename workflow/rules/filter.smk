# Filter each downloaded shard into R/filtered/{source}/{shard}.parquet (the kept documents, filtered)
# and {shard}.decisions.parquet (one decision per document) by the `filter:` chain (docs/data-contract.md,
# docs/filters.md); one job (one process) per group of shards. Every rule that reads documents reads these.
rule filter:
    input:
        download=f"{DATA_DIR}/{{source}}/_manifest/{{group}}.json",
    output:
        L.manifest("filtered"),
    params:
        p=rule_params("filter"),
        code=rule_code("filter"),
        inputs=group_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
        files=group_files(L.filtered()),
    log:
        L.log("filter", "{source}", "{group}"),
    benchmark:
        L.bench("filter", "{source}", "{group}")
    group:
        job_group("filter")
    priority: sample_priority
    threads: job_threads("filter")
    resources:
        **job_resources("filter"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.filter --params {params.p:q} --source {wildcards.source} "
        "--inputs {params.inputs:q} --outputs {params.files:q} --manifest {output:q} 2>&1 | tee {log:q}"
