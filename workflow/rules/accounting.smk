# Reconcile every token: counted -> tokenized -> kept -> train/val -> mixed -> packed (+ tail).
rule accounting:
    input:
        counts=f"{R}/counts/summary.json",
        tokens=manifests(f"{R}/tokens"),
        split=f"{R}/split/report.json",
        dedup=f"{R}/dedup/report.json",
        packs=expand(f"{R}/pack/{{mix}}/{{split}}.json", mix=list(config["mixes"]), split=["train", "val"]),
    output:
        json=f"{R}/accounting.json",
        md=report(f"{R}/accounting.md", category="Data", caption="../report/accounting.rst"),
    params:
        p=P("accounting"),
        code=CODE("accounting"),
    log:
        f"{LOGS}/accounting.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.accounting --params {params.p:q} --run-dir {R} --out {output.json:q} "
        "--out-md {output.md:q} 2>&1 | tee {log:q}"
