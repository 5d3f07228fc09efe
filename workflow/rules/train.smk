# Compiled DDP training launched by torchrun (gloo on CPU, nccl on GPU) through pipeline.training.rendezvous:
# one node: torchrun --standalone, nproc_per_node processes; hardware.nodes = N > 1: the job is one SLURM
# allocation of N nodes (resources nodes/tasks/gres from pipeline/cluster.py) and the launcher runs
# `srun torchrun --nnodes N … --rdzv-backend c10d` with the rendezvous on the first node.
# It runs under pipeline.training.launch, which owns the job's processes: a kill of the job (its process
# group, or SIGTERM/SIGINT) ends every worker (or the srun step) within seconds, which torchrun alone
# does not do. The declared output is final.pt only: metrics.jsonl and ckpt/ are not outputs, so a rerun
# after a kill (--rerun-incomplete) keeps the metric history and the checkpoints it resumes from.
TRAIN_ARGS = (
    "-m pipeline.training.train --params {params.p:q} --plan {input.plan:q} --train {input.train:q} "
    "--val {input.val:q} --tokenizer {input.tokenizer:q} --outdir {params.outdir:q} {params.core}"
)


rule train:
    input:
        plan=f"{RUN_DIR}/plan.json",
        train=f"{RUN_DIR}/pack/{TRAIN_MIX}/train.json",
        val=f"{RUN_DIR}/pack/{TRAIN_MIX}/val.json",
        tokenizer=TOKENIZER,
        accounting=f"{RUN_DIR}/accounting.json",
        # the quick CORE subset scored during training (eval.core_interval > 0 only)
        tasks=[f"{RUN_DIR}/eval_data/tasks.json"] if config["eval"]["core_interval"] else [],
    output:
        final=f"{RUN_DIR}/train/final.pt",
    params:
        p=stage_params("train"),
        code=code_version(
            "training.train", "training.launch", "training.processes", "training.step", "training.distributed",
            "training.model", "training.optim", "training.losses", "training.checkpoint", "training.metrics",
            "training.sampling", "training.rendezvous", "data.loader", "budget", "data.encoding", "evaluation.core",
            "evaluation.tasks",
        ),
        core=lambda w, input: f"--eval-data {Path(input.tasks[0]).parent}" if input.tasks else "",
        outdir=lambda w, output: Path(output.final).parent,
    log:
        f"{LOG_DIR}/train.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m pipeline.training.launch -- python -m pipeline.training.rendezvous --params {params.p:q} "
        f"--cpus-per-node {{threads}} --plan {{input.plan:q}} -- {TRAIN_ARGS} 2>&1 | tee {{log:q}}"
