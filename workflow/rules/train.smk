# Compiled DDP training, one job per training stage (train.stages), launched by torchrun (gloo on CPU,
# nccl on GPU) through pipeline.training.rendezvous: one node: torchrun --standalone, nproc_per_node
# processes; hardware.nodes = N > 1: the job is one SLURM allocation of N nodes (resources
# nodes/tasks/gres from pipeline/sizes.py) and the launcher runs `srun torchrun --nnodes N …
# --rdzv-backend c10d` with the rendezvous on the first node.
# It runs under pipeline.training.launch, which owns the job's processes: a kill of the job (its process
# group, or SIGTERM/SIGINT) ends every worker (or the srun step) within seconds, which torchrun alone
# does not do. The declared output is final.pt only: metrics.jsonl, summary.json and ckpt/ are not
# outputs, so a rerun after a kill (--rerun-incomplete) keeps the metric history and the checkpoints it
# resumes from.
# A stage with init_from starts from that stage's final.pt. A stage reruns when its own params (its
# view of the config), its packed rows, its init checkpoint or the training code change — and for
# nothing else: plan.json and accounting.json (which change with any stage or mix) are not inputs;
# the trainer derives its batch layout from its params (pipeline.budget, what the plan computes) and
# checks the launched world against it. (Not even as ancient() inputs: Snakemake skips the params
# check of a job downstream of one that reruns, so an edited stage behind a rerunning plan would not
# rerun.)
import shlex

TRAIN_ARGS = (
    "-m pipeline.training.train --params {params.p:q} --train {input.train:q} --val {input.val:q} "
    "--tokenizer {input.tokenizer:q} --outdir {params.outdir:q} {params.init} {params.core}"
)


rule train:
    input:
        train=stage_pack("train"),
        val=stage_pack("val"),
        tokenizer=TOKENIZER,
        init=stage_init,
        # the quick CORE subset scored during training (eval.core_interval > 0 only)
        tasks=[f"{RUN_DIR}/eval_data/tasks.json"] if config["eval"]["core_interval"] else [],
    output:
        final=f"{RUN_DIR}/train/{{stage}}/final.pt",
    params:
        p=rule_params("train"),
        code=rule_code("train"),
        outdir=lambda w, output: Path(output.final).parent,
        init=lambda w, input: f"--init {shlex.quote(str(input.init[0]))}" if input.init else "",
        core=lambda w, input: f"--eval-data {Path(input.tasks[0]).parent}" if input.tasks else "",
    log:
        f"{LOG_DIR}/train/{{stage}}.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    conda:
        "../../envs/train.yaml"
    shell:
        "python -m pipeline.training.launch -- python -m pipeline.training.rendezvous --params {params.p:q} "
        f"--cpus-per-node {{threads}} -- {TRAIN_ARGS} 2>&1 | tee -a {{log:q}}"
