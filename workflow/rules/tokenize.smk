# Encode each shard into R/tokens/{source}/{shard}.{bin,idx.npy,json} with exactly one delimiter
# policy (docs/data-contract.md); one job (one process) per group of shards.
rule tokenize:
    input:
        filtered=L.manifest("filtered"),
        tokenizer=L.tokenizer(),
    output:
        L.manifest("tokens"),
    params:
        p=rule_params("tokenize"),
        code=rule_code("tokenize"),
        inputs=group_files(L.filtered()),
        files=group_files(L.tokens()),
    log:
        L.log("tokenize", "{source}", "{group}"),
    benchmark:
        L.bench("tokenize", "{source}", "{group}")
    group:
        job_group("tokenize")
    priority: sample_priority
    threads: job_threads("tokenize")
    resources:
        **job_resources("tokenize"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.tokenize --params {params.p:q} --tokenizer {input.tokenizer:q} "
        "--source {wildcards.source} --inputs {params.inputs:q} --outputs {params.files:q} --manifest {output:q} "
        "2>&1 | tee {log:q}"
