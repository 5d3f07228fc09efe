# Weighted, seeded document schedules per named mix (train) plus the mix's validation documents.
rule mix:
    input:
        split=f"{R}/split/report.json",
    output:
        train=f"{R}/mix/{{mix}}/train.parquet",
        val=f"{R}/mix/{{mix}}/val.parquet",
        report=f"{R}/mix/{{mix}}/report.json",
    params:
        p=P("mix"),
        code=CODE("mix"),
    log:
        f"{LOGS}/mix/{{mix}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.mix --params {params.p:q} --mix {wildcards.mix} --split-dir {R}/split "
        "--outdir {R}/mix/{wildcards.mix} 2>&1 | tee {log:q}"
