# Compiled DDP training launched by torchrun: one node, nproc_per_node processes (gloo on CPU, nccl on GPU).
NPROC = config["hardware"]["nproc_per_node"]


rule train:
    input:
        plan=f"{R}/plan.json",
        train=f"{R}/pack/{TRAIN_MIX}/train.json",
        val=f"{R}/pack/{TRAIN_MIX}/val.json",
        tokenizer=TOKENIZER,
        accounting=f"{R}/accounting.json",
    output:
        final=f"{R}/train/final.pt",
        metrics=f"{R}/train/metrics.jsonl",
    params:
        p=P("train"),
        code=CODE("train", "model", "optim", "losses", "checkpoint", "metrics", "loader", "plan", "tokenizer"),
        nproc=NPROC,
    log:
        f"{LOGS}/train.log",
    threads: ALL_CORES if config["hardware"]["device"] == "cpu" else NPROC * 2
    resources:
        gpus=NPROC if config["hardware"]["device"] == "cuda" else 0,
        nodes=config["hardware"]["nodes"],
    conda:
        "../../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS=$(( {threads} / {params.nproc} > 0 ? {threads} / {params.nproc} : 1 )) "
        "torchrun --standalone --nproc_per_node {params.nproc} -m pipeline.train --params {params.p:q} "
        "--plan {input.plan:q} --train {input.train:q} --val {input.val:q} "
        "--tokenizer {input.tokenizer:q} --outdir {R}/train 2>&1 | tee {log:q}"
