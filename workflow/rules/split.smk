# Train/val split decided per duplicate cluster, so no cluster spans both sides; documents flagged by
# decontaminate are in neither. Writes
# R/split/{source}/{shard}.parquet for every shard and, last, the report (its declared output).
rule split:
    input:
        dedup=L.dedup_report(),
        decontam=L.decontam_report(),
        tokens=group_manifests(L.stage_dir("tokens")),
    output:
        report=L.split_report(),
    params:
        p=rule_params("split"),
        code=rule_code("split"),
        keep=shard_files(L.dedup_keep()),
        tokens=shard_files(L.tokens()),
        decontam=shard_files(L.decontam()),
        outdir=lambda w, output: Path(output.report).parent,
    log:
        L.log("split"),
    benchmark:
        L.bench("split")
    threads: job_threads("split")
    resources:
        **job_resources("split"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.split --params {params.p:q} --keep {params.keep:q} --tokens {params.tokens:q} "
        "--decontam {params.decontam:q} --outdir {params.outdir:q} --report {output.report:q} 2>&1 | tee {log:q}"
