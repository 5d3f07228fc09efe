# Weighted, seeded document schedules per named mix (train) plus the mix's validation documents.
rule mix:
    input:
        split=L.split_report(),
    output:
        train=L.mix(split="train"),
        val=L.mix(split="val"),
        report=L.mix(split="report"),
    params:
        p=rule_params("mix"),
        code=rule_code("mix"),
        split_dir=lambda w, input: Path(input.split).parent,
        outdir=lambda w, output: Path(output.report).parent,
    log:
        L.log("mix", "{mix}"),
    benchmark:
        L.bench("mix", "{mix}")
    threads: job_threads("mix")
    resources:
        **job_resources("mix"),
    conda:
        "../../envs/data.yaml"
    shell:
        "POLARS_MAX_THREADS={threads} python -m pipeline.data.mix --params {params.p:q} --mix {wildcards.mix} --split-dir {params.split_dir:q} "
        "--outdir {params.outdir:q} 2>&1 | tee {log:q}"
