# MinHash dedup across all shards and sources: signatures per group of shards (one process each); then, per
# segment, an index job (its inputs in one file), dedup.partitions candidate jobs (each a bounded slice of the
# band keys, see pipeline/data/dedup.py) and one merge job (rule dedup) that writes R/dedup/keep/{source}/
# {shard}.parquet for the segment's shards and its part of the run's dedup index; last, dedup_report (the report
# and the index manifest). A segment is a set of shards deduplicated together against dedup.reference and the
# run's earlier segments: a fresh run is one segment; shards added to a finished run are a new one, so only
# their jobs run (pipeline.data.dedup_index.plan_segments).
from pipeline.data import dedup_index as tfdi
from pipeline.errors import PipelineError

DEDUP_INDEX_DIR = L.dedup_index_dir()
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
        filtered=L.manifest("filtered"),
        tokens=L.manifest("tokens"),
    output:
        L.manifest("dedup/sig"),
    params:
        p=rule_params("dedup_signatures"),
        code=rule_code("dedup_signatures"),
        inputs=group_files(L.filtered()),
        tokens=group_files(L.tokens()),
        files=group_files(L.dedup_signatures()),
    log:
        L.log("dedup", "sig", "{source}", "{group}"),
    benchmark:
        L.bench("dedup_signatures", "{source}", "{group}")
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
        manifests=lambda w: tfdi.segment_manifests(DEDUP_SEGMENTS[int(w.seg)], GROUPS, L.stage_dir("dedup/sig")),
        earlier=lambda w: [L.dedup_index_part(k) for k in range(int(w.seg))],
    output:
        L.dedup_segment(),
    params:
        p=rule_params("dedup_index"),
        code=rule_code("dedup_index"),
        shards=lambda w: DEDUP_SEGMENTS[int(w.seg)],
        earlier=lambda w, input: " ".join(shlex.quote(str(f)) for f in input.earlier),
        reference=[r["sha256"] for r in DEDUP_REFERENCE],  # a rebuilt reference reruns the dedup
        index_dir=DEDUP_INDEX_DIR,
    log:
        L.log("dedup", "index", "{seg}"),
    benchmark:
        L.bench("dedup_index", "{seg}")
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
        L.dedup_segment(),
    output:
        # read by the merge job only: removed once it has run (a rerun of the merge reruns its candidates)
        pairs=temp(L.dedup_pairs()),
        bands=L.dedup_index_part(name="bands/{part}.npy"),
    params:
        p=rule_params("dedup_candidates"),
        code=rule_code("dedup_candidates"),
    log:
        L.log("dedup", "candidates", "{seg}", "{part}"),
    benchmark:
        L.bench("dedup_candidates", "{seg}", "{part}")
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
        index=L.dedup_segment(),
        pairs=lambda w: [L.dedup_pairs(w.seg, p) for p in range(config["dedup"]["partitions"])],
        bands=lambda w: [L.dedup_index_part(w.seg, f"bands/{p}.npy") for p in range(config["dedup"]["partitions"])],
    output:
        L.dedup_index_part(),
    params:
        p=rule_params("dedup"),
        code=rule_code("dedup"),
        outdir=lambda w, output: Path(output[0]).parents[2],  # R/dedup (snakemake --lint: from the output)
        segdir=lambda w: L.dedup_index_part(w.seg, "").rstrip("/"),
        run=config["run_name"],
    log:
        L.log("dedup", "clusters", "{seg}"),
    benchmark:
        L.bench("dedup", "{seg}")
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
        [L.dedup_index_part(k) for k in range(len(DEDUP_SEGMENTS))],
    output:
        report=L.dedup_report(),
    params:
        p=rule_params("dedup_report"),
        code=rule_code("dedup_report"),
        fingerprint=DEDUP_FINGERPRINT,
        index_dir=lambda w, input: Path(input[0]).parents[1],  # R/dedup/index
        run=config["run_name"],
    log:
        L.log("dedup", "report"),
    benchmark:
        L.bench("dedup_report")
    threads: job_threads("dedup_report")
    resources:
        **job_resources("dedup_report"),
    conda:
        "../../envs/data.yaml"
    shell:
        "python -m pipeline.data.dedup report --params {params.p:q} --segments {input:q} "
        "--index-dir {params.index_dir:q} --run {params.run:q} --fingerprint {params.fingerprint:q} "
        "--out {output.report:q} 2>&1 | tee {log:q}"
