# Flag every tokenized document that shares a word n-gram with a benchmark item (before the split, which
# takes flagged documents out of train and val). A changed task list reruns this and what follows, never
# tokenize. Three steps, as dedup's: the eval n-gram table once (R/decontam/grams.parquet, a small job
# over the task files), one flags job per shard group (R/decontam/{source}/{shard}.parquet and its
# report part {shard}.json), and the report joining the parts (R/decontam/report.json: the output split
# and accounting wait for; they read the per-shard flag files).
rule decontaminate_grams:
    input:
        tasks=L.eval_tasks(),
    output:
        L.decontam_grams(),
    params:
        p=rule_params("decontaminate_grams"),
        code=rule_code("decontaminate_grams"),
        eval_data=lambda w, input: Path(input.tasks).parent,
    log:
        L.log("decontaminate", "grams"),
    benchmark:
        L.bench("decontaminate_grams")
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
        grams=L.decontam_grams(),
        filtered=L.manifest("filtered"),
        tokens=L.manifest("tokens"),
    output:
        L.manifest("decontam"),
    params:
        p=rule_params("decontaminate_flags"),
        code=rule_code("decontaminate_flags"),
        inputs=group_files(L.filtered()),
        tokens=group_files(L.tokens()),
        files=group_files(L.decontam()),
    log:
        L.log("decontaminate", "flags", "{source}", "{group}"),
    benchmark:
        L.bench("decontaminate_flags", "{source}", "{group}")
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
        grams=L.decontam_grams(),
        flags=group_manifests(L.stage_dir("decontam")),
    output:
        report=L.decontam_report(),
    params:
        p=rule_params("decontaminate"),
        code=rule_code("decontaminate"),
        parts=shard_files(L.decontam(ext="json")),
    log:
        L.log("decontaminate", "report"),
    benchmark:
        L.bench("decontaminate")
    threads: job_threads("decontaminate")
    resources:
        **job_resources("decontaminate"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.decontaminate report --params {params.p:q} --grams {input.grams:q} "
        "--parts {params.parts:q} --report {output.report:q} 2>&1 | tee {log:q}"
