# Ingest: place each shard of each source at {data_dir}/{source}/{shard}.parquet, verified, with a
# {shard}.parquet.json metadata sidecar; one job per group of shards (see pipeline/manifest.py).
rule download:
    output:
        f"{D}/{{source}}/_manifest/{{group}}.json",
    params:
        p=P_source("download"),
        code=CODE("download"),
        shards=group_shards,
        files=group_paths(f"{D}/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOGS}/download/{{source}}/{{group}}.log",
    resources:
        downloads=1,
    conda:
        "../../envs/data.yaml"
    shell:
        "(for sh in {params.shards}; do"
        " python -m pipeline.download --params {params.p:q} --source {wildcards.source} --shard $sh"
        " --out {D}/{wildcards.source}/$sh.parquet; done;"
        " python -m pipeline.manifest --stage download --out {output:q} {params.files:q}) 2>&1 | tee {log:q}"
