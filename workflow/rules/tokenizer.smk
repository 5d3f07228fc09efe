# Train (or load) the run's tokenizer on a sample of the training sources.
rule tokenizer:
    input:
        group_manifests(L.stage_dir("filtered"), tokenizer_sources(RC)),
    output:
        L.tokenizer(),
    params:
        p=rule_params("tokenizer"),
        code=rule_code("tokenizer"),
        files=shard_files(L.filtered(), tokenizer_sources(RC)),
    log:
        L.log("tokenizer"),
    benchmark:
        L.bench("tokenizer")
    threads: job_threads("tokenizer")
    resources:
        **job_resources("tokenizer"),
    conda:
        "../../envs/data.yaml"
    shell:
        "RAYON_NUM_THREADS={threads} python -m pipeline.data.train_tokenizer --params {params.p:q} "
        "--inputs {params.files:q} --out {output:q} 2>&1 | tee {log:q}"
