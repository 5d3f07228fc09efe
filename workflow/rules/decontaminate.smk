# Flag every tokenized document that shares a word n-gram with a benchmark item (before the split,
# which takes flagged documents out of train and val). A changed task list reruns this and what
# follows, never tokenize. Writes RUN_DIR/decontam/{source}/{shard}.parquet and, last, the report.
rule decontaminate:
    input:
        tasks=f"{RUN_DIR}/eval_data/tasks.json",
        tokens=group_manifests(f"{RUN_DIR}/tokens"),
    output:
        report=f"{RUN_DIR}/decontam/report.json",
    params:
        p=rule_params("decontaminate"),
        code=code_version("pipeline.data.decontaminate"),
        raw=shard_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
        tokens=shard_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        eval_data=lambda w, input: Path(input.tasks).parent,
        outdir=lambda w, output: Path(output.report).parent,
    log:
        f"{LOG_DIR}/decontaminate.log",
    benchmark:
        f"{BENCH_DIR}/decontaminate.tsv"
    threads: job_threads("decontaminate")
    resources:
        **job_resources("decontaminate"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.decontaminate --params {params.p:q} --eval-data {params.eval_data:q} "
        "--raw {params.raw:q} --tokens {params.tokens:q} --outdir {params.outdir:q} --report {output.report:q} "
        "2>&1 | tee {log:q}"
