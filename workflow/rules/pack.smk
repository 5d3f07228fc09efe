# Fixed rows of seq_len + 1 tokens (concat) or best-fit rows with a loss mask (bestfit).
rule pack:
    input:
        schedule=f"{RUN_DIR}/mix/{{mix}}/{{split}}.parquet",
        tokens=lambda w: group_manifests(f"{RUN_DIR}/tokens", mix_sources(w.mix)),
    output:
        bin=f"{RUN_DIR}/pack/{{mix}}/{{split}}.bin",
        docs=f"{RUN_DIR}/pack/{{mix}}/{{split}}.docs.npy",
        meta=f"{RUN_DIR}/pack/{{mix}}/{{split}}.json",
    params:
        p=rule_params("pack"),
        code=rule_code("pack"),
        tokens_dir=f"{RUN_DIR}/tokens",
    log:
        f"{LOG_DIR}/pack/{{mix}}/{{split}}.log",
    benchmark:
        f"{BENCH_DIR}/pack/{{mix}}/{{split}}.tsv"
    threads: job_threads("pack")
    resources:
        **job_resources("pack"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.pack --params {params.p:q} --mix {wildcards.mix} --split {wildcards.split} "
        "--schedule {input.schedule:q} --tokens-dir {params.tokens_dir:q} --out {output.meta:q} 2>&1 | tee {log:q}"
