# Fixed rows of seq_len + 1 tokens (concat) or best-fit rows with a loss mask (bestfit).
rule pack:
    input:
        schedule=f"{R}/mix/{{mix}}/{{split}}.parquet",
        tokens=lambda w: manifests(f"{R}/tokens", mix_sources(w.mix)),
    output:
        bin=f"{R}/pack/{{mix}}/{{split}}.bin",
        docs=f"{R}/pack/{{mix}}/{{split}}.docs.npy",
        meta=f"{R}/pack/{{mix}}/{{split}}.json",
    params:
        p=P("pack"),
        code=CODE("pack"),
    log:
        f"{LOGS}/pack/{{mix}}/{{split}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.pack --params {params.p:q} --mix {wildcards.mix} --split {wildcards.split} "
        "--schedule {input.schedule:q} --tokens-dir {R}/tokens --out {output.meta:q} 2>&1 | tee {log:q}"
