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
        L.plan(),
        L.accounting(),
        L.filter_report(),
        expand(L.eval(), stage=list(STAGES)),
        L.stages_report(),
