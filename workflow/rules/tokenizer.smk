# Train (or load) the run's tokenizer on a sample of the training sources.
rule tokenizer:
    input:
        lambda w: [f"{D}/{s}/{sh}.parquet" for s in tfc.tokenizer_sources(config) for sh in SHARDS[s]],
    output:
        TOKENIZER,
    params:
        p=P("tokenizer"),
        code=CODE("tokenizer"),
    log:
        f"{LOGS}/tokenizer.log",
    threads: workflow.cores
    conda:
        "../../envs/data.yaml"
    shell:
        "RAYON_NUM_THREADS={threads} python -m pipeline.tokenizer --params {params.p:q} "
        "--inputs {input:q} --out {output:q} 2>&1 | tee {log:q}"
