# Weighted, seeded document schedules per named mix (train) plus the mix's validation documents.
rule mix:
    input:
        split=f"{RUN_DIR}/split/report.json",
    output:
        train=f"{RUN_DIR}/mix/{{mix}}/train.parquet",
        val=f"{RUN_DIR}/mix/{{mix}}/val.parquet",
        report=f"{RUN_DIR}/mix/{{mix}}/report.json",
    params:
        p=rule_params("mix"),
        code=rule_code("mix"),
        split_dir=lambda w, input: Path(input.split).parent,
        outdir=lambda w, output: Path(output.report).parent,
    log:
        f"{LOG_DIR}/mix/{{mix}}.log",
    benchmark:
        f"{BENCH_DIR}/mix/{{mix}}.tsv"
    threads: job_threads("mix")
    resources:
        **job_resources("mix"),
    conda:
        "../../envs/data.yaml"
    shell:
        "POLARS_MAX_THREADS={threads} python -m pipeline.data.mix --params {params.p:q} --mix {wildcards.mix} --split-dir {params.split_dir:q} "
        "--outdir {params.outdir:q} 2>&1 | tee {log:q}"
