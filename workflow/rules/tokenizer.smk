# Train (or load) the run's tokenizer on a sample of the training sources.
rule tokenizer:
    input:
        manifests(D, tfc.tokenizer_sources(config)),
    output:
        TOKENIZER,
    params:
        p=P("tokenizer"),
        code=CODE("tokenizer"),
        files=shard_paths(f"{D}/{{source}}/{{shard}}.parquet", tfc.tokenizer_sources(config)),
    log:
        f"{LOGS}/tokenizer.log",
    threads: ALL_CORES
    conda:
        "../../envs/data.yaml"
    shell:
        "RAYON_NUM_THREADS={threads} python -m pipeline.tokenizer --params {params.p:q} "
        "--inputs {params.files:q} --out {output:q} 2>&1 | tee {log:q}"
