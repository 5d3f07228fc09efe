"""The tiny DAG on a real SLURM cluster through Snakemake's executor plugin (run by `make test-slurm`).

tests/slurm/cluster.sh installs Debian's slurm-wlm and munge and starts munged, slurmctld and two
slurmd "nodes" on this host (2 CPUs and 2 fake GPUs each). The DAG then runs with the shipped profile
(workflow/profiles/slurm): every rule an sbatch job sized by its declared resources, the train rule
one 2-node allocation in which `srun` starts a torchrun agent per node and the agents meet at a c10d
rendezvous (world 2, gloo), training with FSDP2 (train.parallel: fsdp). A second run with a broken
config must fail, naming the failed job's SLURM log. Needs root (apt, /etc/slurm); skipped elsewhere,
and outside `make test-slurm`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import ROOT, TINY, make_project, user_env

from pipeline import sizes

sys.path.insert(0, str(ROOT / "tests"))

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
RUN_TIMEOUT = 720  # s, the whole DAG (its evaluations run the sandbox check too); also under `timeout -s KILL`

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TOKENFARM_SLURM_TESTS") != "1",
                       reason="starts a SLURM cluster as root: run by `make test-slurm`"),
    pytest.mark.skipif(os.geteuid() != 0, reason="installing and starting SLURM needs root"),
    pytest.mark.skipif(shutil.which("sbatch") is None and shutil.which("apt-get") is None,
                       reason="neither SLURM nor apt-get to install it"),
]

SLURM_CONFIG = {
    **TINY,
    "shards_per_job": 4,
    "dedup": {"partitions": 2},
    # 2 nodes × 1 process: the plan's world size is 2, global batch 1024 = 16 rows × 32 tokens × 2
    "hardware": {"nodes": 2, "nproc_per_node": 1, "cpus_per_task": 1, "nccl_env": "socket"},
    # FSDP2 across the two nodes: each node's rank holds half of every parameter, writes its own shards
    # of every step checkpoint into the shared results directory, and rank 0 gathers final.pt
    "train": {**TINY["train"], "parallel": "fsdp"},
}


def run_snakemake(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = user_env()
    cmd = ["timeout", "-s", "KILL", str(RUN_TIMEOUT), SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(path),
           "--configfile", str(path / "config.yaml"), "--workflow-profile", str(ROOT / "workflow/profiles/slurm"),
           # this cluster has no accounting: no account; jobs here take seconds, so poll every 2 s
           "--slurm-no-account", "--slurm-init-seconds-before-status-checks", "2", "--jobs", "4",
           "--latency-wait", "5", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)


def scontrol_job(job_id: str) -> str:
    return subprocess.run(["timeout", "-s", "KILL", "30", "scontrol", "show", "job", "-o", job_id],
                          capture_output=True, text=True, check=True).stdout


def slurm_job_ids(output: str, rule: str) -> list[str]:
    """SLURM job ids Snakemake reported for `rule` ("... submitted with SLURM jobid N (log: …/rule_R/…")."""
    return re.findall(rf"SLURM jobid (\d+) \(log: \S*/rule_{rule}/", output)


@pytest.fixture(scope="module")
def slurm():
    start = subprocess.run(["timeout", "-s", "KILL", "900", "bash", str(CLUSTER), "start"], capture_output=True,
                           text=True)
    assert start.returncode == 0, start.stdout + start.stderr
    yield
    subprocess.run(["timeout", "-s", "KILL", "60", "bash", str(CLUSTER), "stop"], capture_output=True, text=True)


@pytest.fixture(scope="module")
def dag(slurm, tmp_path_factory):
    path = make_project(tmp_path_factory.mktemp("slurm-dag"), SLURM_CONFIG)
    proc = run_snakemake(path, "--set-resources", "train:gres='gpu:1'")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return path, out


def test_the_dag_runs_end_to_end_as_slurm_jobs(dag):
    path, out = dag
    report = json.loads((path / "results/t/eval/pretrain/report.json").read_text())
    assert (path / "results/t/eval/stages.json").exists()  # every stage trained and evaluated
    assert report["val_loss"] < report["unigram_baseline"]
    # every job went through sbatch but the target and the small reducers (the workflow's localrules) ...
    submitted = re.findall(r"SLURM jobid \d+ \(log: \S*/rule_(\w+)/", out)
    assert {"download", "tokenizer", "dedup_candidates", "dedup", "decontaminate_grams", "decontaminate_flags",
            "split", "mix", "pack", "accounting", "train", "evaluate"} <= set(submitted)
    assert submitted.count("dedup_candidates") == 2
    assert set(re.findall(r"^localrule (\w+)", out, flags=re.M)) == {"all", "count", "count_sample", "plan",
                                                                       "stages_report", "dedup_index", "decontaminate",
                                                                       "filter_report"}
    # ... and the per-shard chain went as one job per shard group (shards_per_job 4: one group a source), the
    # download and filter included where the tokenizer does not sit between (chat; web trains the tokenizer)
    assert not {"tokenize", "dedup_signatures"} & set(submitted)
    groups = dict(re.findall(r"SLURM jobid \d+ \(log: \S*/group_shards-(web|chat)-(\S+?)/", out))
    assert set(groups) == {"web", "chat"}, out[-3000:]
    assert groups["web"].endswith("_dedup_signatures_tokenize"), groups
    assert groups["chat"].endswith("_dedup_signatures_download_filter_tokenize"), groups
    assert submitted.count("download") == 1 and submitted.count("filter") == 1


def test_parse_time_plan_prints_only_in_the_main_process(dag):
    path, out = dag
    # the parse-time plan, and the plan rule's own CLI (a local rule: its output is the main process's)
    assert out.count("token-budget plan (") == 2
    logs = list((path / ".snakemake/slurm_logs").rglob("*.log"))
    assert len(logs) >= 20
    for log in logs:  # every job re-parsed the Snakefile on its "node" and printed no plan ...
        text = log.read_text()
        assert "Finished jobid" in text, log
        assert "token-budget plan" not in text, log


def test_jobs_request_the_resources_their_rules_declare(dag):
    _, out = dag
    cand = scontrol_job(slurm_job_ids(out, "dedup_candidates")[0])
    assert "NumNodes=1 " in cand and "NumCPUs=1 " in cand
    # pipeline.sizes.dedup_job_mb(documents / 2 partitions): a few hundred documents -> its fixed part
    mem = int(re.search(r"MinMemoryNode=(\d+)M", cand).group(1))
    assert sizes.DEDUP_JOB_BASE_MB <= mem <= sizes.dedup_job_mb(1000), cand


def test_train_is_one_two_node_allocation_with_a_torchrun_rendezvous(dag):
    path, out = dag
    train_ids = slurm_job_ids(out, "train")
    assert len(train_ids) == 3  # one job per training stage (pretrain, midtrain, sft)
    for train_id in train_ids:
        job = scontrol_job(train_id)
        assert "NumNodes=2 " in job and re.search(r"NodeList=tf\[1-2\]", job), job
        assert "gres/gpu=2" in job or "gpu:1" in job, job  # one fake GPU on each node
    log = (path / "logs/t/train/pretrain.log").read_text()
    launch = re.search(r"launching 2 node\(s\) × 1 process\(es\): (srun .*)", log)
    assert launch, log[-3000:]
    cmd = launch.group(1)
    assert "--nodes=2" in cmd and "--ntasks-per-node=1" in cmd
    assert re.search(r"torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d "
                     r"--rdzv-endpoint 127\.0\.0\.1:\d+", cmd)
    # the launched world is the plan's: each rank logs it, and the trainer checked it against plan.json
    plan = json.loads((path / "results/t/plan.json").read_text())
    assert plan["world_size"] == 2
    assert re.search(r"× world 2\b", log), log[-3000:]
    assert "trained" in log
    for stage in ("pretrain", "midtrain", "sft"):  # every stage trained sharded, each node writing its part
        ckpt = path / "results/t/train" / stage / "ckpt"
        latest = ckpt / (ckpt / "latest").read_text().strip()
        assert latest.suffix == ".dcp", latest
        assert sorted(p.name for p in latest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], stage


def test_a_failing_job_fails_the_run_and_names_its_slurm_log(slurm, tmp_path):
    config = {**SLURM_CONFIG, "sources": {
        "web": {"type": "local", "glob": "src/web/*.parquet", "text_column": "body"},
        "chat": SLURM_CONFIG["sources"]["chat"]}}
    path = make_project(tmp_path, config)
    proc = run_snakemake(path)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-4000:]  # failed, not killed by the timeout
    logs = re.findall(r"(\S*/\.snakemake/slurm_logs/(?:rule|group)_[\w.-]+/\S*?\d+\.log)", out)
    failed = [Path(p) for p in logs if Path(p).exists() and "no column 'body'" in Path(p).read_text()]
    assert failed, out[-4000:]
    assert "Error in rule" in out
    assert not (path / "results/t/eval/pretrain/report.json").exists()


def test_a_cluster_run_must_size_its_multithreaded_jobs(slurm, tmp_path):
    """hardware.cpus_per_task 0 means "all cores", which an sbatch request cannot say: one line, no job."""
    config = {**SLURM_CONFIG, "hardware": {**SLURM_CONFIG["hardware"], "cpus_per_task": 0}}
    path = make_project(tmp_path, config)
    proc = run_snakemake(path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "hardware.cpus_per_task is 0" in proc.stderr and "Traceback" not in proc.stderr
    assert "submitted with SLURM jobid" not in proc.stdout + proc.stderr
