# tokenfarm: raw web-text shards -> filter (language, quality, PII) -> tokenizer -> tokenize (with each shard's exact counts) -> dedup +
# decontaminate -> split -> mixes -> packed rows; plan (from a sample of the counts) -> DDP training ->
# evaluation. Configuration and helpers: workflow/rules/common.smk.


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/filter.smk"
include: "workflow/rules/filter_report.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/count.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/dedup.smk"
include: "workflow/rules/eval_data.smk"
include: "workflow/rules/decontaminate.smk"
include: "workflow/rules/split.smk"
include: "workflow/rules/mix.smk"
include: "workflow/rules/pack.smk"
include: "workflow/rules/accounting.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/scaling.smk"  # `snakemake --cores all scaling`: a target outside `all`


rule all:
    default_target: True
    input:
        f"{RUN_DIR}/plan.json",
        f"{RUN_DIR}/accounting.json",
        f"{RUN_DIR}/filtered/report.json",
        expand(f"{RUN_DIR}/eval/{{stage}}/report.json", stage=list(STAGES)),
        f"{RUN_DIR}/eval/stages.json",
