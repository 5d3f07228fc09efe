# The filter funnel (pipeline/data/filter_report.py): per source and per filter, in removal order, the
# documents and characters removed, the lines removed and spans replaced, the languages, the tokens left
# after tokenize, and a few seeded removed documents each; a funnel plot. Reads the filter rule's decisions
# (R/filtered/{source}/{shard}.decisions.parquet, one row per raw row) beside the raw shards they judge.
localrules:
    filter_report,


rule filter_report:
    input:
        filtered=group_manifests(L.stage_dir("filtered")),
        tokens=group_manifests(L.stage_dir("tokens")),
    output:
        json=L.filter_report(),
        md=report(L.filter_report("md"), category="Data", caption="../report/filter.rst"),
        png=report(L.filter_report("png"), category="Data", caption="../report/filter.rst"),
    params:
        p=rule_params("filter_report"),
        code=rule_code("filter_report"),
        raw=shard_files(f"{DATA_DIR}/{{source}}/{{shard}}.parquet"),
        decisions=shard_files(L.filtered(ext="decisions.parquet")),
        tokens=shard_files(L.tokens()),
    log:
        L.log("filter_report"),
    benchmark:
        L.bench("filter_report")
    threads: job_threads("filter_report")
    resources:
        **job_resources("filter_report"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.filter_report --params {params.p:q} --raw {params.raw:q} "
        "--decisions {params.decisions:q} --tokens {params.tokens:q} --out-json {output.json:q} "
        "--out-md {output.md:q} --out-png {output.png:q} 2>&1 | tee {log:q}"
