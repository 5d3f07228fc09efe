# Validation loss, bits per byte, unigram baseline, CORE-style per-task table, generations, loss and CORE curves.
rule evaluate:
    input:
        ckpt=f"{RUN_DIR}/train/final.pt",
        val=f"{RUN_DIR}/pack/{TRAIN_MIX}/val.json",
        train=f"{RUN_DIR}/pack/{TRAIN_MIX}/train.json",
        tokenizer=TOKENIZER,
        tasks=f"{RUN_DIR}/eval_data/tasks.json",
    output:
        json=f"{RUN_DIR}/eval/report.json",
        md=report(f"{RUN_DIR}/eval/report.md", category="Evaluation", caption="../report/eval.rst"),
        png=report(f"{RUN_DIR}/eval/loss.png", category="Evaluation", caption="../report/loss.rst"),
        core=report(f"{RUN_DIR}/eval/core.png", category="Evaluation", caption="../report/core.rst"),
    params:
        p=stage_params("evaluate"),
        code=code_version(
            "evaluation.evaluate", "training.model", "training.losses", "data.loader", "training.checkpoint",
            "training.sampling", "data.encoding", "evaluation.core", "evaluation.tasks",
        ),
        eval_data=lambda w, input: Path(input.tasks).parent,
        outdir=lambda w, output: Path(output.json).parent,
        metrics=lambda w, input: Path(input.ckpt).parent / "metrics.jsonl",  # train's, complete with final.pt
    log:
        f"{LOG_DIR}/evaluate.log",
    threads: job_threads("evaluate")
    resources:
        **job_resources("evaluate"),
    conda:
        "../../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m pipeline.evaluation.evaluate --params {params.p:q} --ckpt {input.ckpt:q} "
        "--val {input.val:q} --train {input.train:q} --tokenizer {input.tokenizer:q} "
        "--metrics {params.metrics:q} --eval-data {params.eval_data:q} --outdir {params.outdir:q} 2>&1 | tee {log:q}"
