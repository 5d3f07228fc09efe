# Compiled DDP training, one job per training stage (train.stages; a chain of jobs for a stage longer than
# hardware.max_job_hours, below), launched by torchrun (gloo on CPU,
# nccl on GPU) through pipeline.training.rendezvous: one node: torchrun --standalone, nproc_per_node
# processes; hardware.nodes = N > 1: the job is one SLURM allocation of N nodes (resources
# nodes/tasks/gres from pipeline/planning/job_sizes.py) and the launcher runs `srun torchrun --nnodes N …
# --rdzv-backend c10d` with the rendezvous on the first node.
# It runs under pipeline.training.launch, which owns the job's processes: a kill of the job (its process
# group, or SIGTERM/SIGINT) ends every worker (or the srun step) within seconds, which torchrun alone
# does not do. The declared output is final.pt (a segment's marker) only: metrics.jsonl, summary.json and ckpt/ are not
# outputs, so a rerun after a kill (--rerun-incomplete) keeps the metric history and the checkpoints it
# resumes from.
# A stage with init_from starts from that stage's final.pt. A stage reruns when its own params (its
# view of the config), its packed rows, its init checkpoint or the training code change — and for
# nothing else: plan.json and accounting.json (which change with any stage or mix) are not inputs;
# the trainer derives its batch layout from its params (pipeline.planning.compute, what the plan computes) and
# checks the launched world against it. (Not even as ancient() inputs: Snakemake skips the params
# check of a job downstream of one that reruns, so an edited stage behind a rerunning plan would not
# rerun.)
# A stage longer than the cluster's job limit (hardware.max_job_hours) runs as a chain of TRAIN_JOBS[stage]["jobs"]
# jobs: train_segment 1 … N-1, each training to step ceil(K × num_steps / N) and ending with a checkpoint and its
# marker, then train (K = N) to the last step and final.pt. Each resumes from the newest checkpoint; one stopped
# early (its deadline, a signal, a lost node) fails and is retried (hardware.train_retries), resuming again.
# Without a limit a stage is one train job (N = 1). docs/architecture.md, "Long runs on a cluster".
rule train_segment:
    input:
        **train_inputs(),
        previous=previous_segment,
    output:
        marker=L.segment(),
    params:
        **train_params(lambda w: f"{w.segment}/{TRAIN_JOBS[w.stage]['jobs']}"),
    log:
        L.log("train", "{stage}", "segment-{segment}"),
    threads: job_threads("train_segment")
    resources:
        **{**job_resources("train_segment"), "runtime": lambda w: TRAIN_JOBS[w.stage]["runtime_min"]},
    retries: TRAIN_RETRIES
    conda:
        "../../envs/train.yaml"
    shell:
        TRAIN_SHELL


rule train:
    input:
        **train_inputs(),
        previous=last_segment,
    output:
        final=L.final(),
    params:
        **train_params(lambda w: f"{TRAIN_JOBS[w.stage]['jobs']}/{TRAIN_JOBS[w.stage]['jobs']}"),
    log:
        L.log("train", "{stage}"),
    threads: job_threads("train")
    resources:
        **{**job_resources("train"), "runtime": lambda w: TRAIN_JOBS[w.stage]["runtime_min"]},
    retries: TRAIN_RETRIES
    conda:
        "../../envs/train.yaml"
    shell:
        TRAIN_SHELL
