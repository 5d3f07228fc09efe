# Compiled DDP training launched by torchrun, one job per training stage (train.stages): one node,
# nproc_per_node processes (gloo on CPU, nccl on GPU). torchrun runs under pipeline.training.launch,
# which owns the job's processes: a kill of the job (its process group, or SIGTERM/SIGINT) ends every
# worker within seconds, which torchrun alone does not do. The declared output is final.pt only:
# metrics.jsonl, summary.json and ckpt/ are not outputs, so a rerun after a kill (--rerun-incomplete)
# keeps the metric history and the checkpoints it resumes from.
# A stage with init_from starts from that stage's final.pt. A stage reruns when its own params (its
# view of the config), its packed rows, its init checkpoint or the training code change — and for
# nothing else: plan.json and accounting.json (which change with any stage or mix) are not inputs;
# the trainer derives its batch layout from its params (pipeline.budget, what the plan computes).
# (Not even as ancient() inputs: Snakemake skips the params check of a job downstream of one that
# reruns, so an edited stage behind a rerunning plan would not rerun.)
import shlex

NPROC = config["hardware"]["nproc_per_node"]
NODES = config["hardware"]["nodes"]
TRAIN_ARGS = (
    "-m pipeline.training.train --params {params.p:q} --train {input.train:q} "
    "--val {input.val:q} --tokenizer {input.tokenizer:q} --outdir {params.outdir:q} {params.init}"
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
        f"The data is ready; for each stage, in order, on each node k = 0..{NODES - 1} run: torchrun "
        f"--nnodes {NODES} --node_rank k --nproc_per_node {NPROC} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
        f"-m pipeline.training.train --configfile CONFIG --stage STAGE "
        f"--train {RUN_DIR}/pack/MIX/train.json --val {RUN_DIR}/pack/MIX/val.json --tokenizer {TOKENIZER} "
        f"--outdir {RUN_DIR}/train/STAGE [--init {RUN_DIR}/train/PREVIOUS/final.pt]"
    )
    TRAIN_CMD = f"echo {shlex.quote(_msg)} | tee {{log:q}} >&2; exit 1"


rule train:
    input:
        train=stage_pack("train"),
        val=stage_pack("val"),
        tokenizer=TOKENIZER,
        init=stage_init,
    output:
        final=f"{RUN_DIR}/train/{{stage}}/final.pt",
    params:
        p=training_stage_params("train"),
        code=code_version(
            "training.train", "training.launch", "training.processes", "training.step", "training.distributed",
            "training.model", "training.attention", "training.optim", "training.losses", "training.checkpoint",
            "training.metrics", "training.sampling", "data.loader", "budget", "stages", "data.encoding",
        ),
        nproc=NPROC,
        outdir=lambda w, output: Path(output.final).parent,
        init=lambda w, input: f"--init {shlex.quote(str(input.init[0]))}" if input.init else "",
    log:
        f"{LOG_DIR}/train/{{stage}}.log",
    threads: ALL_CORES if config["hardware"]["device"] == "cpu" else NPROC * 2
    resources:
        gpus=NPROC if config["hardware"]["device"] == "cuda" else 0,
        nodes=NODES,
    conda:
        "../../envs/train.yaml"
    shell:
        TRAIN_CMD
