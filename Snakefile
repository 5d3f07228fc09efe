# tokenfarm: raw web-text shards -> filter (language, quality, PII) -> tokenizer -> tokenize (with each shard's exact counts) -> dedup +
# decontaminate -> split -> mixes -> packed rows; plan (from a sample of the counts) -> DDP training ->
# evaluation. Configuration and helpers: workflow/rules/common.smk.


include: "workflow/rules/common.smk"
# Every other rule file, in name order: a new rule is its .smk under workflow/rules/, found here (docs/adding-a-rule.md).
# `scaling` (`snakemake --cores all scaling`) is a target outside `all`.
for _rules in sorted(Path(workflow.basedir, "workflow/rules").glob("*.smk")):
    if _rules.name != "common.smk":
        include: str(_rules.relative_to(workflow.basedir))


rule all:
    default_target: True
    input:
        L.plan(),
        L.accounting(),
        L.filter_report(),
        expand(L.eval(), stage=list(STAGES)),
        L.stages_report(),
        TARGETS,
