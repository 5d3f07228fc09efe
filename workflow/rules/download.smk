# Ingest: place each shard of each source under {data_dir}/{source}/{shard}.parquet, verified.
rule download:
    output:
        shard=f"{D}/{{source}}/{{shard}}.parquet",
        meta=f"{D}/{{source}}/{{shard}}.parquet.json",
    params:
        p=P("download"),
        code=CODE("download"),
    log:
        f"{LOGS}/download/{{source}}/{{shard}}.log",
    resources:
        downloads=1,
    retries: 0
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.download --params {params.p:q} --source {wildcards.source} "
        "--shard {wildcards.shard} --out {output.shard:q} 2>&1 | tee {log:q}"
