# Encode each shard into a flat token file with exactly one delimiter policy (docs/data-contract.md).
rule tokenize:
    input:
        shard=f"{D}/{{source}}/{{shard}}.parquet",
        tokenizer=TOKENIZER,
    output:
        bin=f"{R}/tokens/{{source}}/{{shard}}.bin",
        idx=f"{R}/tokens/{{source}}/{{shard}}.idx.npy",
        meta=f"{R}/tokens/{{source}}/{{shard}}.json",
    params:
        p=P("tokenize"),
        code=CODE("tokenize", "tokenizer"),
    log:
        f"{LOGS}/tokenize/{{source}}/{{shard}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.tokenize --params {params.p:q} --tokenizer {input.tokenizer:q} "
        "--input {input.shard:q} --source {wildcards.source} --shard {wildcards.shard} "
        "--out {output.meta:q} 2>&1 | tee {log:q}"
