# Reconcile every token: downloaded rows -> filtered -> counted -> tokenized -> kept -> train/val -> mixed -> packed (+ tail).
rule accounting:
    input:
        counts=L.counts("summary.json"),
        filtered=group_manifests(L.stage_dir("filtered")),
        tokens=group_manifests(L.stage_dir("tokens")),
        split=L.split_report(),
        dedup=L.dedup_report(),
        decontam=L.decontam_report(),
        packs=expand(L.pack(), mix=list(config["mixes"]), split=["train", "val"]),
    output:
        json=L.accounting(),
        md=report(L.accounting("md"), category="Data", caption="../report/accounting.rst"),
    params:
        p=rule_params("accounting"),
        code=rule_code("accounting"),
        run_dir=lambda w, output: Path(output.json).parent,
    log:
        L.log("accounting"),
    benchmark:
        L.bench("accounting")
    threads: job_threads("accounting")
    resources:
        **job_resources("accounting"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.accounting --params {params.p:q} --run-dir {params.run_dir:q} "
        "--out {output.json:q} --out-md {output.md:q} 2>&1 | tee {log:q}"
