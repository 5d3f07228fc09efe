# Train (or load) the run's tokenizer on a sample of the training sources.
rule tokenizer:
    input:
        group_manifests(f"{RUN_DIR}/filtered", tokenizer_sources(config)),
    output:
        TOKENIZER,
    params:
        p=rule_params("tokenizer"),
        code=rule_code("tokenizer"),
        files=shard_files(f"{RUN_DIR}/filtered/{{source}}/{{shard}}.parquet", tokenizer_sources(config)),
    log:
        f"{LOG_DIR}/tokenizer.log",
    benchmark:
        f"{BENCH_DIR}/tokenizer.tsv"
    threads: job_threads("tokenizer")
    resources:
        **job_resources("tokenizer"),
    conda:
        "../../envs/data.yaml"
    shell:
        "RAYON_NUM_THREADS={threads} python -m pipeline.data.tokenizer --params {params.p:q} "
        "--inputs {params.files:q} --out {output:q} 2>&1 | tee {log:q}"
