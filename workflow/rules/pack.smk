# Fixed rows of seq_len + 1 tokens (concat) or best-fit rows with a loss mask (bestfit).
rule pack:
    input:
        schedule=L.mix(),
        tokens=lambda w: group_manifests(L.stage_dir("tokens"), mix_sources(w.mix)),
    output:
        bin=L.pack(ext="bin"),
        docs=L.pack(ext="docs.npy"),
        meta=L.pack(),
    params:
        p=rule_params("pack"),
        code=rule_code("pack"),
        tokens_dir=L.stage_dir("tokens"),
    log:
        L.log("pack", "{mix}", "{split}"),
    benchmark:
        L.bench("pack", "{mix}", "{split}")
    threads: job_threads("pack")
    resources:
        **job_resources("pack"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.pack --params {params.p:q} --mix {wildcards.mix} --split {wildcards.split} "
        "--schedule {input.schedule:q} --tokens-dir {params.tokens_dir:q} --out {output.meta:q} 2>&1 | tee {log:q}"
