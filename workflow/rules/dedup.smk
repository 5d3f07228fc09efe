# MinHash dedup across all shards and sources: signatures per group of shards (one process each), then
# dedup.partitions candidate jobs (each a bounded slice of the band keys, see pipeline/data/dedup.py),
# then one merge job that writes R/dedup/keep/{source}/{shard}.parquet for every shard and, last,
# the report (its declared output).
rule dedup_signatures:
    input:
        filtered=L.manifest("filtered"),
        tokens=L.manifest("tokens"),
    output:
        L.manifest("dedup/sig"),
    params:
        p=rule_params("dedup_signatures"),
        code=rule_code("dedup_signatures"),
        inputs=group_files(L.filtered()),
        tokens=group_files(L.tokens()),
        files=group_files(L.dedup_signatures()),
    log:
        L.log("dedup", "sig", "{source}", "{group}"),
    benchmark:
        L.bench("dedup_signatures", "{source}", "{group}")
    group:
        job_group("dedup_signatures")
    threads: job_threads("dedup_signatures")
    resources:
        **job_resources("dedup_signatures"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup signatures --params {params.p:q} --source {wildcards.source} "
        "--inputs {params.inputs:q} --tokens {params.tokens:q} --outputs {params.files:q} --manifest {output:q} "
        "2>&1 | tee {log:q}"


# One file naming every signature file: the candidate and merge jobs depend on it, not on every group
# manifest (200 candidate jobs × 114 groups of edges made the preset's dry run 10× slower).
localrules:
    dedup_index,


rule dedup_index:
    input:
        group_manifests(L.stage_dir("dedup/sig")),
    output:
        L.dedup_index(),
    params:
        code=rule_code("dedup_index"),
    log:
        L.log("dedup", "index"),
    benchmark:
        L.bench("dedup_index")
    threads: job_threads("dedup_index")
    resources:
        **job_resources("dedup_index"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup index --manifests {input:q} --out {output:q} 2>&1 | tee {log:q}"


rule dedup_candidates:
    input:
        L.dedup_index(),
    output:
        # read by the merge job only: removed once it has run (a rerun of the merge reruns its candidates)
        temp(L.dedup_pairs()),
    params:
        p=rule_params("dedup_candidates"),
        code=rule_code("dedup_candidates"),
    log:
        L.log("dedup", "candidates", "{part}"),
    benchmark:
        L.bench("dedup_candidates", "{part}")
    threads: job_threads("dedup_candidates")
    resources:
        **job_resources("dedup_candidates"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup candidates --params {params.p:q} --index {input:q} "
        "--part {wildcards.part} --out {output:q} 2>&1 | tee {log:q}"


rule dedup:
    input:
        index=L.dedup_index(),
        pairs=[L.dedup_pairs(p) for p in range(config["dedup"]["partitions"])],
    output:
        report=L.dedup_report(),
    params:
        p=rule_params("dedup"),
        code=rule_code("dedup"),
        outdir=lambda w, output: Path(output.report).parent,
    log:
        L.log("dedup", "clusters"),
    benchmark:
        L.bench("dedup")
    threads: job_threads("dedup")
    resources:
        **job_resources("dedup"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup clusters --params {params.p:q} --index {input.index:q} "
        "--pairs {input.pairs:q} --outdir {params.outdir:q} --report {output.report:q} 2>&1 | tee {log:q}"
