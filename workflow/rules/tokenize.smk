# Encode each shard into RUN_DIR/tokens/{source}/{shard}.{bin,idx.npy,json} with exactly one delimiter
# policy (docs/data-contract.md); one job (one process) per group of shards.
rule tokenize:
    input:
        filtered=f"{RUN_DIR}/filtered/{{source}}/_manifest/{{group}}.json",
        tokenizer=TOKENIZER,
    output:
        f"{RUN_DIR}/tokens/{{source}}/_manifest/{{group}}.json",
    params:
        p=rule_params("tokenize"),
        code=rule_code("tokenize"),
        inputs=group_files(f"{RUN_DIR}/filtered/{{source}}/{{shard}}.parquet"),
        files=group_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
    log:
        f"{LOG_DIR}/tokenize/{{source}}/{{group}}.log",
    benchmark:
        f"{BENCH_DIR}/tokenize/{{source}}/{{group}}.tsv"
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
