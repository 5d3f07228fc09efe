# MinHash dedup across all shards and sources: signatures per group of shards (one process each), then
# dedup.partitions candidate jobs (each a bounded slice of the band keys, see pipeline/data/dedup.py),
# then one merge job that writes RUN_DIR/dedup/keep/{source}/{shard}.parquet for every shard and, last,
# the report (its declared output).
rule dedup_signatures:
    input:
        filtered=f"{RUN_DIR}/filtered/{{source}}/_manifest/{{group}}.json",
        tokens=f"{RUN_DIR}/tokens/{{source}}/_manifest/{{group}}.json",
    output:
        f"{RUN_DIR}/dedup/sig/{{source}}/_manifest/{{group}}.json",
    params:
        p=rule_params("dedup_signatures"),
        code=rule_code("dedup_signatures"),
        inputs=group_files(f"{RUN_DIR}/filtered/{{source}}/{{shard}}.parquet"),
        tokens=group_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        files=group_files(f"{RUN_DIR}/dedup/sig/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOG_DIR}/dedup/sig/{{source}}/{{group}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup_signatures/{{source}}/{{group}}.tsv"
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
        group_manifests(f"{RUN_DIR}/dedup/sig"),
    output:
        f"{RUN_DIR}/dedup/sig/index.json",
    params:
        code=rule_code("dedup_index"),
    log:
        f"{LOG_DIR}/dedup/index.log",
    benchmark:
        f"{BENCH_DIR}/dedup_index.tsv"
    threads: job_threads("dedup_index")
    resources:
        **job_resources("dedup_index"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup index --manifests {input:q} --out {output:q} 2>&1 | tee {log:q}"


rule dedup_candidates:
    input:
        f"{RUN_DIR}/dedup/sig/index.json",
    output:
        # read by the merge job only: removed once it has run (a rerun of the merge reruns its candidates)
        temp(f"{RUN_DIR}/dedup/pairs/{{part}}.parquet"),
    params:
        p=rule_params("dedup_candidates"),
        code=rule_code("dedup_candidates"),
    log:
        f"{LOG_DIR}/dedup/candidates/{{part}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup_candidates/{{part}}.tsv"
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
        index=f"{RUN_DIR}/dedup/sig/index.json",
        pairs=[f"{RUN_DIR}/dedup/pairs/{p}.parquet" for p in range(config["dedup"]["partitions"])],
    output:
        report=f"{RUN_DIR}/dedup/report.json",
    params:
        p=rule_params("dedup"),
        code=rule_code("dedup"),
        outdir=lambda w, output: Path(output.report).parent,
    log:
        f"{LOG_DIR}/dedup/clusters.log",
    benchmark:
        f"{BENCH_DIR}/dedup.tsv"
    threads: job_threads("dedup")
    resources:
        **job_resources("dedup"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup clusters --params {params.p:q} --index {input.index:q} "
        "--pairs {input.pairs:q} --outdir {params.outdir:q} --report {output.report:q} 2>&1 | tee {log:q}"
