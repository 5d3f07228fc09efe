# Reconcile every token: downloaded rows -> filtered -> counted -> tokenized -> kept -> train/val -> mixed -> packed (+ tail).
rule accounting:
    input:
        counts=f"{RUN_DIR}/counts/summary.json",
        filtered=group_manifests(f"{RUN_DIR}/filtered"),
        tokens=group_manifests(f"{RUN_DIR}/tokens"),
        split=f"{RUN_DIR}/split/report.json",
        dedup=f"{RUN_DIR}/dedup/report.json",
        decontam=f"{RUN_DIR}/decontam/report.json",
        packs=expand(f"{RUN_DIR}/pack/{{mix}}/{{split}}.json", mix=list(config["mixes"]), split=["train", "val"]),
    output:
        json=f"{RUN_DIR}/accounting.json",
        md=report(f"{RUN_DIR}/accounting.md", category="Data", caption="../report/accounting.rst"),
    params:
        p=rule_params("accounting"),
        code=rule_code("accounting"),
        run_dir=lambda w, output: Path(output.json).parent,
    log:
        f"{LOG_DIR}/accounting.log",
    benchmark:
        f"{BENCH_DIR}/accounting.tsv"
    threads: job_threads("accounting")
    resources:
        **job_resources("accounting"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.accounting --params {params.p:q} --run-dir {params.run_dir:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
