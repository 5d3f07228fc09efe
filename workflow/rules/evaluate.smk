# Per training stage: validation loss, bits per byte, unigram baseline, CORE-style per-task table,
# generations, loss and CORE curves, scores on the items no training document shared a decontamination
# n-gram with; chat stages also a chat-format validation loss and answers to fixed
# questions; 95 % intervals on every score and per-item logs of every benchmark (core_items.jsonl,
# chat_core_items.jsonl: empty where the stage has no chat tasks). Then all stages side by side (token
# reconciliation per stage, loss curves on one plot, paired comparisons of consecutive stages).
# metrics.jsonl and summary.json are the train job's, complete once its final.pt exists.
rule evaluate:
    input:
        ckpt=L.final(),
        val=stage_pack("val"),
        train=stage_pack("train"),
        tokenizer=L.tokenizer(),
        tasks=L.eval_tasks(),
        decontam=L.decontam_report(),  # which items training documents shared n-grams with
    output:
        json=L.eval(),
        md=report(L.eval(name="report.md"), category="Evaluation", subcategory="{stage}",
                  caption="../report/eval.rst"),
        png=report(L.eval(name="loss.png"), category="Evaluation", subcategory="{stage}",
                   caption="../report/loss.rst"),
        core=report(L.eval(name="core.png"), category="Evaluation", subcategory="{stage}",
                    caption="../report/core.rst"),
        core_items=L.eval(name="core_items.jsonl"),
        chat_core_items=L.eval(name="chat_core_items.jsonl"),
    params:
        p=rule_params("evaluate"),
        code=rule_code("evaluate"),
        eval_data=lambda w, input: Path(input.tasks).parent,
        outdir=lambda w, output: Path(output.json).parent,
        metrics=lambda w, input: Path(input.ckpt).parent / "metrics.jsonl",  # train's, complete with final.pt
    log:
        L.log("evaluate", "{stage}"),
    threads: job_threads("evaluate")
    resources:
        **job_resources("evaluate"),
    conda:
        "../../envs/train.yaml"
    shell:
        "OMP_NUM_THREADS={threads} python -m pipeline.evaluation.evaluate --params {params.p:q} --ckpt {input.ckpt:q} "
        "--val {input.val:q} --train {input.train:q} --tokenizer {input.tokenizer:q} "
        "--metrics {params.metrics:q} --eval-data {params.eval_data:q} --decontam {input.decontam:q} "
        "--outdir {params.outdir:q} 2>&1 | tee {log:q}"


localrules:
    stages_report,


rule stages_report:
    input:
        finals=expand(L.final(), stage=list(STAGES)),
        reports=expand(L.eval(), stage=list(STAGES)),
        item_logs=expand(L.eval(name="{kind}_items.jsonl"), stage=list(STAGES), kind=("core", "chat_core")),
    output:
        json=L.stages_report(),
        md=report(L.stages_report("md"), category="Evaluation", caption="../report/stages.rst"),
        png=report(L.stages_report("png"), category="Evaluation", caption="../report/stages.rst"),
    params:
        p=rule_params("stages_report"),
        code=rule_code("stages_report"),
        run_dir=lambda w, output: Path(output.json).parent.parent,
    log:
        L.log("evaluate", "stages"),
    threads: job_threads("stages_report")
    resources:
        **job_resources("stages_report"),
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m pipeline.evaluation.stages_report --params {params.p:q} --run-dir {params.run_dir:q} "
        "--out-json {output.json:q} --out-md {output.md:q} --out-png {output.png:q} 2>&1 | tee {log:q}"
