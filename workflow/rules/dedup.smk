# MinHash dedup across all shards and sources: signatures per group of shards (one process each); then, per
# segment, an index job (its inputs in one file), dedup.partitions candidate jobs (each a bounded slice of the
# band keys, see pipeline/data/dedup.py) and one merge job (rule dedup) that writes RUN_DIR/dedup/keep/{source}/
# {shard}.parquet for the segment's shards and its part of the run's dedup index; last, dedup_report (the report
# and the index manifest). A segment is a set of shards deduplicated together against dedup.reference and the
# run's earlier segments: a fresh run is one segment; shards added to a finished run are a new one, so only
# their jobs run (pipeline.data.dedup_index.plan_segments).
from pipeline.data import dedup_index as tfdi
from pipeline.errors import PipelineError

DEDUP_DIR = f"{RUN_DIR}/dedup"
DEDUP_INDEX_DIR = f"{DEDUP_DIR}/index"
try:  # each entry's index, checked (format, hashing keys, manifest hashes, sizes); its files' sha256 at dedup_index
    DEDUP_REFERENCE = tfdi.resolve_references(config["dedup"]["reference"], config["dedup"],
                                              own=DEDUP_INDEX_DIR)["indexes"]
except PipelineError as _e:
    stop(_e)
# What the recorded segments were made with: any change (a setting, the code, a reference) makes one segment again.
DEDUP_FINGERPRINT = tfdi.digest([rule_params("dedup"), rule_code("dedup"), DEDUP_REFERENCE])
DEDUP_SEGMENTS = tfdi.plan_segments(DEDUP_INDEX_DIR, [f"{s}/{sh}" for s in SOURCES for sh in SHARDS[s]],
                                    DEDUP_FINGERPRINT)


wildcard_constraints:
    seg=r"\d+",


rule dedup_signatures:
    input:
        filtered=f"{RUN_DIR}/filtered/{{source}}/_manifest/{{group}}.json",
        tokens=f"{RUN_DIR}/tokens/{{source}}/_manifest/{{group}}.json",
    output:
        f"{DEDUP_DIR}/sig/{{source}}/_manifest/{{group}}.json",
    params:
        p=rule_params("dedup_signatures"),
        code=rule_code("dedup_signatures"),
        inputs=group_files(f"{RUN_DIR}/filtered/{{source}}/{{shard}}.parquet"),
        tokens=group_files(f"{RUN_DIR}/tokens/{{source}}/{{shard}}.json"),
        files=group_files(f"{DEDUP_DIR}/sig/{{source}}/{{shard}}.parquet"),
    log:
        f"{LOG_DIR}/dedup/sig/{{source}}/{{group}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup_signatures/{{source}}/{{group}}.tsv"
    group:
        job_group("dedup_signatures")
    threads: job_threads("dedup_signatures")
    resources:
        **job_resources("dedup_signatures"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup signatures --params {params.p:q} --source {wildcards.source} "
        "--inputs {params.inputs:q} --tokens {params.tokens:q} --outputs {params.files:q} --manifest {output:q} "
        "2>&1 | tee {log:q}"


# One file per segment naming its signature files, its earlier segments and its reference (whose files' sha256
# it checks): the candidate and merge jobs depend on it, not on every group manifest (200 candidate jobs × 114
# groups of edges made the preset's dry run 10× slower).
localrules:
    dedup_index,


rule dedup_index:
    input:
        manifests=lambda w: tfdi.segment_manifests(DEDUP_SEGMENTS[int(w.seg)], GROUPS, f"{DEDUP_DIR}/sig"),
        earlier=lambda w: [f"{DEDUP_INDEX_DIR}/{k}/segment.json" for k in range(int(w.seg))],
    output:
        f"{DEDUP_DIR}/seg/{{seg}}/index.json",
    params:
        p=rule_params("dedup_index"),
        code=rule_code("dedup_index"),
        shards=lambda w: DEDUP_SEGMENTS[int(w.seg)],
        earlier=lambda w, input: " ".join(shlex.quote(str(f)) for f in input.earlier),
        reference=[r["sha256"] for r in DEDUP_REFERENCE],  # a rebuilt reference reruns the dedup
        index_dir=lambda w, output: Path(output[0]).parents[2] / "index",
    log:
        f"{LOG_DIR}/dedup/index/{{seg}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup_index/{{seg}}.tsv"
    threads: job_threads("dedup_index")
    resources:
        **job_resources("dedup_index"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup index --params {params.p:q} --manifests {input.manifests:q} "
        "--shards {params.shards:q} --earlier {params.earlier} --index-dir {params.index_dir:q} --out {output:q} "
        "2>&1 | tee {log:q}"


rule dedup_candidates:
    input:
        f"{DEDUP_DIR}/seg/{{seg}}/index.json",
    output:
        # read by the merge job only: removed once it has run (a rerun of the merge reruns its candidates)
        pairs=temp(f"{DEDUP_DIR}/seg/{{seg}}/pairs/{{part}}.parquet"),
        bands=f"{DEDUP_INDEX_DIR}/{{seg}}/bands/{{part}}.npy",
    params:
        p=rule_params("dedup_candidates"),
        code=rule_code("dedup_candidates"),
    log:
        f"{LOG_DIR}/dedup/candidates/{{seg}}/{{part}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup_candidates/{{seg}}/{{part}}.tsv"
    threads: job_threads("dedup_candidates")
    resources:
        **job_resources("dedup_candidates"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup candidates --params {params.p:q} --index {input:q} "
        "--part {wildcards.part} --out {output.pairs:q} --bands-out {output.bands:q} 2>&1 | tee {log:q}"


rule dedup:
    input:
        index=f"{DEDUP_DIR}/seg/{{seg}}/index.json",
        pairs=lambda w: [f"{DEDUP_DIR}/seg/{w.seg}/pairs/{p}.parquet" for p in range(config["dedup"]["partitions"])],
        bands=lambda w: [f"{DEDUP_INDEX_DIR}/{w.seg}/bands/{p}.npy" for p in range(config["dedup"]["partitions"])],
    output:
        f"{DEDUP_INDEX_DIR}/{{seg}}/segment.json",
    params:
        p=rule_params("dedup"),
        code=rule_code("dedup"),
        outdir=lambda w, output: Path(output[0]).parents[2],
        segdir=lambda w, output: Path(output[0]).parent,
        run=RUN_NAME,
    log:
        f"{LOG_DIR}/dedup/clusters/{{seg}}.log",
    benchmark:
        f"{BENCH_DIR}/dedup/{{seg}}.tsv"
    threads: job_threads("dedup")
    resources:
        **job_resources("dedup"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup clusters --params {params.p:q} --index {input.index:q} "
        "--pairs {input.pairs:q} --outdir {params.outdir:q} --segment-dir {params.segdir:q} --run {params.run:q} "
        "2>&1 | tee {log:q}"


rule dedup_report:
    input:
        [f"{DEDUP_INDEX_DIR}/{k}/segment.json" for k in range(len(DEDUP_SEGMENTS))],
    output:
        report=f"{DEDUP_DIR}/report.json",
    params:
        p=rule_params("dedup_report"),
        code=rule_code("dedup_report"),
        fingerprint=DEDUP_FINGERPRINT,
        index_dir=lambda w, input: Path(input[0]).parents[1],
        run=RUN_NAME,
    log:
        f"{LOG_DIR}/dedup/report.log",
    benchmark:
        f"{BENCH_DIR}/dedup_report.tsv"
    threads: job_threads("dedup_report")
    resources:
        **job_resources("dedup_report"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup report --params {params.p:q} --segments {input:q} "
        "--index-dir {params.index_dir:q} --run {params.run:q} --fingerprint {params.fingerprint:q} "
        "--out {output.report:q} 2>&1 | tee {log:q}"
