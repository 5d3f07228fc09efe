# Encode each shard into R/tokens/{source}/{shard}.{bin,idx.npy,json} with exactly one delimiter
# policy (docs/data-contract.md); one job per group of shards.
rule tokenize:
    input:
        download=f"{D}/{{source}}/_manifest/{{group}}.json",
        tokenizer=TOKENIZER,
    output:
        f"{R}/tokens/{{source}}/_manifest/{{group}}.json",
    params:
        p=P_source("tokenize"),
        code=CODE("tokenize", "tokenizer"),
        shards=group_shards,
        files=group_paths(f"{R}/tokens/{{source}}/{{shard}}.json"),
    log:
        f"{LOGS}/tokenize/{{source}}/{{group}}.log",
    conda:
        "../../envs/data.yaml"
    shell:
        "(for sh in {params.shards}; do"
        " python -m pipeline.tokenize --params {params.p:q} --tokenizer {input.tokenizer:q}"
        " --input {D}/{wildcards.source}/$sh.parquet --source {wildcards.source} --shard $sh"
        " --out {R}/tokens/{wildcards.source}/$sh.json; done;"
        " python -m pipeline.manifest --stage tokenize --out {output:q} {params.files:q}) 2>&1 | tee {log:q}"
