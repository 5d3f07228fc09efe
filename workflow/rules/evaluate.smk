# Validation loss, bits per byte, unigram baseline, generations, loss curve.
rule evaluate:
    input:
        ckpt=f"{R}/train/final.pt",
        metrics=f"{R}/train/metrics.jsonl",
        val=f"{R}/pack/{TRAIN_MIX}/val.json",
        train=f"{R}/pack/{TRAIN_MIX}/train.json",
        tokenizer=TOKENIZER,
    output:
        json=f"{R}/eval/report.json",
        md=report(f"{R}/eval/report.md", category="Evaluation", caption="../report/eval.rst"),
        png=report(f"{R}/eval/loss.png", category="Evaluation", caption="../report/loss.rst"),
    params:
        p=P("evaluate"),
        code=CODE("evaluate", "model", "losses", "loader", "checkpoint", "train", "tokenizer"),
    log:
        f"{LOGS}/evaluate.log",
    threads: ALL_CORES
    conda:
        "../../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m pipeline.evaluate --params {params.p:q} --ckpt {input.ckpt:q} "
        "--val {input.val:q} --train {input.train:q} --tokenizer {input.tokenizer:q} "
        "--metrics {input.metrics:q} --outdir {R}/eval 2>&1 | tee {log:q}"
