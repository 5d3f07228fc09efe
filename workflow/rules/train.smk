# Compiled DDP training launched by torchrun: one node, nproc_per_node processes (gloo on CPU, nccl on GPU).
# torchrun runs under pipeline.training.launch, which owns the job's processes: a kill of the job (its
# process group, or SIGTERM/SIGINT) ends every worker within seconds, which torchrun alone does not do.
# The declared output is final.pt only: metrics.jsonl and ckpt/ are not outputs, so a rerun after a kill
# (--rerun-incomplete) keeps the metric history and the checkpoints it resumes from.
import shlex

NPROC = config["hardware"]["nproc_per_node"]
NODES = config["hardware"]["nodes"]
TRAIN_ARGS = (
    "-m pipeline.training.train --params {params.p:q} --plan {input.plan:q} --train {input.train:q} "
    "--val {input.val:q} --tokenizer {input.tokenizer:q} --outdir {params.outdir:q} {params.core}"
)
if NODES == 1:
    TRAIN_CMD = (
        "OMP_NUM_THREADS=$(( {threads} / {params.nproc} > 0 ? {threads} / {params.nproc} : 1 )) "
        "python -m pipeline.training.launch -- "
        f"torchrun --standalone --nproc_per_node {{params.nproc}} {TRAIN_ARGS} 2>&1 | tee {{log:q}}"
    )
else:  # the data stages run as usual; the job itself cannot span nodes
    _msg = (
        f"error: hardware.nodes is {NODES} but the train rule launches one node (torchrun --standalone). "
        f"The data is ready; on each node k = 0..{NODES - 1} run: torchrun --nnodes {NODES} --node_rank k "
        f"--nproc_per_node {NPROC} --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m pipeline.training.train "
        f"--configfile CONFIG --plan {RUN_DIR}/plan.json --train {RUN_DIR}/pack/{TRAIN_MIX}/train.json "
        f"--val {RUN_DIR}/pack/{TRAIN_MIX}/val.json --tokenizer {TOKENIZER} --outdir {RUN_DIR}/train"
    )
    TRAIN_CMD = f"echo {shlex.quote(_msg)} | tee {{log:q}} >&2; exit 1"


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
            "training.sampling", "data.loader", "budget", "data.encoding", "evaluation.core", "evaluation.tasks",
        ),
        nproc=NPROC,
        core=lambda w, input: f"--eval-data {Path(input.tasks[0]).parent}" if input.tasks else "",
        outdir=lambda w, output: Path(output.final).parent,
    log:
        f"{LOG_DIR}/train.log",
    threads: ALL_CORES if config["hardware"]["device"] == "cpu" else NPROC * 2
    resources:
        gpus=NPROC if config["hardware"]["device"] == "cuda" else 0,
        nodes=NODES,
    conda:
        "../../envs/train.yaml"
    shell:
        TRAIN_CMD
