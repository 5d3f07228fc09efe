# Train/val split decided per duplicate cluster, so no cluster spans both sides; documents flagged by
# decontaminate are in neither. Writes
# RUN_DIR/split/{source}/{shard}.parquet for every shard and, last, the report (its declared output).
rule split:
    input:
        dedup=f"{RUN_DIR}/dedup/report.json",
        decontam=f"{RUN_DIR}/decontam/report.json",
        tokens=group_manifests(f"{RUN_DIR}/tokens"),
    output:
        report=f"{RUN_DIR}/split/report.json",
    params:
        p=rule_params("split"),
        code=rule_code("split"),
        keep=shard_files(f"{RUN_DIR}/dedup/keep/{{source}}/{{shard}}.parquet"),
        tokens=shard_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        decontam=shard_files(f"{RUN_DIR}/decontam/{{source}}/{{shard}}.parquet"),
        outdir=lambda w, output: Path(output.report).parent,
    log:
        f"{LOG_DIR}/split.log",
    benchmark:
        f"{BENCH_DIR}/split.tsv"
    threads: job_threads("split")
    resources:
        **job_resources("split"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.split --params {params.p:q} --keep {params.keep:q} --tokens {params.tokens:q} "
        "--decontam {params.decontam:q} --outdir {params.outdir:q} --report {output.report:q} 2>&1 | tee {log:q}"
