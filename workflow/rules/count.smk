# Exact documents / tokens / bytes / characters per shard, then one table for the run.
rule count_shard:
    input:
        shard=f"{D}/{{source}}/{{shard}}.parquet",
        tokenizer=TOKENIZER,
    output:
        f"{R}/counts/{{source}}/{{shard}}.json",
    params:
        p=P("count"),
        code=CODE("count", "tokenizer"),
    log:
        f"{LOGS}/count/{{source}}/{{shard}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.count shard --params {params.p:q} --tokenizer {input.tokenizer:q} "
        "--input {input.shard:q} --source {wildcards.source} --shard {wildcards.shard} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule count:
    input:
        all_shards(f"{R}/counts/{{source}}/{{shard}}.json"),
    output:
        table=f"{R}/counts/counts.parquet",
        summary=f"{R}/counts/summary.json",
    params:
        code=CODE("count"),
    log:
        f"{LOGS}/count/aggregate.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.count aggregate --inputs {input:q} --out {output.table:q} "
        "--summary {output.summary:q} 2>&1 | tee {log:q}"
