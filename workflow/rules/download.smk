# Ingest: place each shard of each source at {data_dir}/{source}/{shard}.parquet, verified, with a
# {shard}.parquet.json metadata sidecar; one job (one process) per group of shards.
rule download:
    output:
        f"{DATA_DIR}/{{source}}/_manifest/{{group}}.json",
    params:
        p=rule_params("download"),
        # local sources: each shard file's sha256, so an edited shard reruns its download and what follows,
        # while a file only touched (same content, new mtime) reruns nothing
        content=lambda w: tfc.local_shard_hashes(config, w.source, GROUPS[w.source][w.group]),
        code=rule_code("download"),
        shards=group_shards,
        files=group_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
    log:
        L.log("download", "{source}", "{group}"),
    benchmark:
        L.bench("download", "{source}", "{group}")
    group:
        job_group("download")
    priority: sample_priority
    threads: job_threads("download")
    resources:
        downloads=1,
        **job_resources("download"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.download --params {params.p:q} --source {wildcards.source} "
        "--shards {params.shards:q} --outputs {params.files:q} --manifest {output:q} 2>&1 | tee {log:q}"
