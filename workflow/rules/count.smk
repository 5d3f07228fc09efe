# Exact documents / tokens / bytes / characters per shard (R/counts/{source}/{shard}.json), then
# one table for the run.
rule count_shards:
    input:
        download=f"{D}/{{source}}/_manifest/{{group}}.json",
        tokenizer=TOKENIZER,
    output:
        f"{R}/counts/{{source}}/_manifest/{{group}}.json",
    params:
        p=P_source("count"),
        code=CODE("count", "tokenizer"),
        shards=group_shards,
        files=group_paths(f"{R}/counts/{{source}}/{{shard}}.json"),
    log:
        f"{LOGS}/count/{{source}}/{{group}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "(for sh in {params.shards}; do"
        " python -m pipeline.count shard --params {params.p:q} --tokenizer {input.tokenizer:q}"
        " --input {D}/{wildcards.source}/$sh.parquet --source {wildcards.source} --shard $sh"
        " --out {R}/counts/{wildcards.source}/$sh.json; done;"
        " python -m pipeline.manifest --stage count --out {output:q} {params.files:q}) 2>&1 | tee {log:q}"


rule count:
    input:
        manifests(f"{R}/counts"),
    output:
        table=f"{R}/counts/counts.parquet",
        summary=f"{R}/counts/summary.json",
    params:
        code=CODE("count"),
        files=shard_paths(f"{R}/counts/{{source}}/{{shard}}.json"),
    log:
        f"{LOGS}/count/aggregate.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.count aggregate --inputs {params.files:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"
