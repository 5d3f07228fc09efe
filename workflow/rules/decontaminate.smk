# Flag every tokenized document that shares a word n-gram with a benchmark item (before the split, which
# takes flagged documents out of train and val). A changed task list reruns this and what follows, never
# tokenize. Three steps, as dedup's: the eval n-gram table once (R/decontam/grams.parquet, a small job
# over the task files), one flags job per shard group (R/decontam/{source}/{shard}.parquet and its
# report part {shard}.json), and the report joining the parts (R/decontam/report.json: the output split
# and accounting wait for; they read the per-shard flag files).
rule decontaminate_grams:
    input:
        tasks=f"{RUN_DIR}/eval_data/tasks.json",
    output:
        f"{RUN_DIR}/decontam/grams.parquet",
    params:
        p=rule_params("decontaminate_grams"),
        code=rule_code("decontaminate_grams"),
        eval_data=lambda w, input: Path(input.tasks).parent,
    log:
        f"{LOG_DIR}/decontaminate/grams.log",
    benchmark:
        f"{BENCH_DIR}/decontaminate_grams.tsv"
    threads: job_threads("decontaminate_grams")
    resources:
        **job_resources("decontaminate_grams"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.decontaminate grams --params {params.p:q} --eval-data {params.eval_data:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule decontaminate_flags:
    input:
        grams=f"{RUN_DIR}/decontam/grams.parquet",
        filtered=f"{RUN_DIR}/filtered/{{source}}/_manifest/{{group}}.json",
        tokens=f"{RUN_DIR}/tokens/{{source}}/_manifest/{{group}}.json",
    output:
        f"{RUN_DIR}/decontam/{{source}}/_manifest/{{group}}.json",
    params:
        p=rule_params("decontaminate_flags"),
        code=rule_code("decontaminate_flags"),
        inputs=group_files(f"{RUN_DIR}/filtered/{{source}}/{{shard}}.parquet"),
        tokens=group_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        files=group_files(f"{RUN_DIR}/decontam/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOG_DIR}/decontaminate/flags/{{source}}/{{group}}.log",
    benchmark:
        f"{BENCH_DIR}/decontaminate_flags/{{source}}/{{group}}.tsv"
    threads: job_threads("decontaminate_flags")
    resources:
        **job_resources("decontaminate_flags"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.decontaminate flags --params {params.p:q} --grams {input.grams:q} "
        "--source {wildcards.source} --inputs {params.inputs:q} --tokens {params.tokens:q} "
        "--outputs {params.files:q} --manifest {output:q} 2>&1 | tee {log:q}"


# The report reads one small JSON per shard and runs in seconds: on a cluster, in the main process.
localrules:
    decontaminate,


rule decontaminate:
    input:
        grams=f"{RUN_DIR}/decontam/grams.parquet",
        flags=group_manifests(f"{RUN_DIR}/decontam"),
    output:
        report=f"{RUN_DIR}/decontam/report.json",
    params:
        p=rule_params("decontaminate"),
        code=rule_code("decontaminate"),
        parts=shard_files(f"{RUN_DIR}/decontam/{{source}}/{{shard}}.json"),
    log:
        f"{LOG_DIR}/decontaminate/report.log",
    benchmark:
        f"{BENCH_DIR}/decontaminate.tsv"
    threads: job_threads("decontaminate")
    resources:
        **job_resources("decontaminate"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.decontaminate report --params {params.p:q} --grams {input.grams:q} "
        "--parts {params.parts:q} --report {output.report:q} 2>&1 | tee {log:q}"
