# The trained model (the last stage of train.stages) as a Hugging Face transformers Llama directory
# (`snakemake export`): config.json,
# model.safetensors, tokenizer.json / tokenizer_config.json / chat_template.jinja, generation_config.json,
# tokenfarm.json. transformers and lm-eval load it offline (README, "Export to Hugging Face").
rule export:
    input:
        ckpt=L.final(list(STAGES)[-1]),
        tokenizer=L.tokenizer(),
    output:
        directory(L.export_hf()),
    params:
        p=rule_params("export"),
        code=rule_code("export"),
    log:
        L.log("export"),
    threads: job_threads("export")
    resources:
        **job_resources("export"),
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m pipeline.evaluation.export --params {params.p:q} --ckpt {input.ckpt:q} "
        "--tokenizer {input.tokenizer:q} --out {output:q} --force 2>&1 | tee {log:q}"
