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
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import ROOT, SNAKEMAKE, TINY, make_project, user_env, write_config

from pipeline.planning import job_sizes as sizes
from pipeline.run_config import run_config

sys.path.insert(0, str(ROOT / "tests"))

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
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
    # of every step checkpoint into the shared results directory, and rank 0 gathers final.pt. Stages of
    # comparable length (12, 5 and ~6 steps), so that the long-run rehearsal splits each into a few jobs.
    "train": {**TINY["train"], "parallel": "fsdp", "target_tokens": 12 * 1024, "ckpt_interval": 4},
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
    assert report["val_loss"] < math.log(SLURM_CONFIG["model"]["vocab_size"])  # learned (12 steps: not yet unigram)
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
    # pipeline.planning.job_sizes.dedup_job_mb(documents / 2 partitions): a few hundred documents -> its fixed part
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


# ----------------------------------------------------------------------------- a long run, rehearsed

LIMIT_MIN = 2  # the `short` partition's MaxTime (tests/slurm/cluster.sh)
TRAIN_RULES = ("train", "train_segment")


def long_run_config(jobs=(3, 6)) -> dict:
    """SLURM_CONFIG with the short partition's limit as hardware.max_job_hours and an assumed MFU low enough that
    the planner splits every stage into `jobs` jobs (a 2-core VM's steps priced like a long run's): only keys that
    leave the training trajectory unchanged (checkpoint.OBSERVABILITY_KEYS and the scheduling keys)."""
    from pipeline.config import resolve_config
    from pipeline.planning.parallel import resolve_parallel
    from pipeline.planning.train_jobs import stage_jobs

    for mfu in (10.0 ** (-k / 16) for k in range(32, 160)):
        hardware = {**SLURM_CONFIG["hardware"], "max_job_hours": LIMIT_MIN / 60, "assumed_mfu": mfu,
                    "train_retries": 4}
        config = {**SLURM_CONFIG, "hardware": hardware}
        resolved = resolve_parallel(run_config(resolve_config(config)))
        counts = [s["jobs"] for s in stage_jobs(resolved).values()]
        if min(counts) >= jobs[0] and max(counts) <= jobs[1]:
            return config
    raise AssertionError(f"no assumed_mfu splits every stage into {jobs[0]}-{jobs[1]} jobs")


def wait_until(what: str, check, timeout: float, proc: subprocess.Popen | None = None, poll: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake ended ({proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def read_lease(path: Path, stage: str) -> dict:
    try:
        return json.loads((path / "results/t/train" / stage / "LEASE").read_text())
    except (OSError, ValueError):
        return {}


def lease_holder(path: Path, stage: str) -> str | None:
    """The SLURM job id whose trainer holds the stage's lease (pipeline/training/lease.py), if any."""
    return read_lease(path, stage).get("slurm_job_id")


def training_holder(path: Path, stage: str) -> str | None:
    """The lease holder once its trainer has logged a step in this job."""
    holder = read_lease(path, stage)
    metrics = path / "results/t/train" / stage / "metrics.jsonl"
    try:
        return holder.get("slurm_job_id") if holder and metrics.stat().st_mtime > holder["since"] else None
    except OSError:
        return None


def start_snakemake(path: Path, out: Path, *args: str) -> subprocess.Popen:
    cmd = ["timeout", "-s", "KILL", str(RUN_TIMEOUT * 2), SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(path),
           "--configfile", str(path / "config.yaml"), "--workflow-profile", str(ROOT / "workflow/profiles/slurm"),
           "--slurm-no-account", "--slurm-init-seconds-before-status-checks", "2", "--jobs", "4",
           "--latency-wait", "5", "--set-resources", "train:gres='gpu:1'", "train_segment:gres='gpu:1'",
           "train:slurm_partition=short", "train_segment:slurm_partition=short", *args]
    # a session of its own: killing the controller kills its process group (snakemake under `timeout`), not the
    # SLURM jobs it submitted, which run on as on a real cluster
    return subprocess.Popen(cmd, env=dict(user_env(), TOKENFARM_LEASE_POLL_S="2"), stdout=out.open("a"),
                            stderr=subprocess.STDOUT, cwd=path, start_new_session=True)


def running_again(job_id: str) -> str | None:
    """`scontrol show job` of `job_id` once it runs again after a requeue."""
    job = scontrol_job(job_id)
    return job if "JobState=RUNNING" in job and "Restarts=1" in job else None


@pytest.fixture(scope="module")
def long_run(dag, tmp_path_factory):
    """The DAG's training again with a 2-minute job limit: every stage a chain of jobs, and on the way one
    `scontrol requeue`, one job killed with SIGKILL, and the controller killed with SIGKILL and started again
    while a train job still runs. The data half is the `dag` run's (copied with Snakemake's records and mtimes)."""
    ref, _ = dag
    path = tmp_path_factory.mktemp("slurm-long") / "project"
    shutil.copytree(ref, path, symlinks=True, ignore=shutil.ignore_patterns("train", "eval", "slurm_logs"))
    write_config(path, long_run_config())
    out = path / "snakemake.out"
    first = start_snakemake(path, out)
    try:
        # a requeue (preemption, an admin): SIGTERM to the job, back to the queue under the same id; its 2-minute
        # BeginTime hold lifted, as a scheduler that preempts for a short job would
        requeued = wait_until("a pretrain job training", lambda: training_holder(path, "pretrain"), 600, first)
        subprocess.run(["scontrol", "requeue", requeued], check=True, timeout=30)
        wait_until("the requeue", lambda: "PENDING" in scontrol_job(requeued), 60, first)
        subprocess.run(["scontrol", "update", f"JobId={requeued}", "StartTime=now"], timeout=30)
        restarted = wait_until("the requeued job running again", lambda: running_again(requeued), 300, first)
        # a job killed outright (a node lost): no clean stop; Snakemake resubmits it
        killed = wait_until("a midtrain job training", lambda: training_holder(path, "midtrain"), 900, first)
        subprocess.run(["scancel", "--full", "--signal=KILL", killed], check=True, timeout=30)
        # the controller killed while an sft job trains (held by `scontrol suspend` meanwhile, so that it is
        # still running whatever the timing); the new controller must wait for that job, never start a second
        orphan = wait_until("an sft job training", lambda: lease_holder(path, "sft"), 900, first)
        subprocess.run(["scontrol", "suspend", orphan], check=True, timeout=30)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(path), "--configfile",
                        str(path / "config.yaml"), "--unlock"], env=user_env(), capture_output=True, timeout=120)
        second = start_snakemake(path, out)
        wait_until("the new controller waiting", lambda: f"waiting for SLURM job {orphan}" in out.read_text(), 300,
                   second)
        subprocess.run(["scontrol", "resume", orphan], check=True, timeout=30)
        assert second.wait(RUN_TIMEOUT * 2) == 0, out.read_text()[-6000:]
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return path, out.read_text(), {"requeued": requeued, "restarted": restarted, "killed": killed, "orphan": orphan}


TIMING = ("tokens_per_s", "mfu", "mem/", "seconds", "items_per_s")  # what measures time or memory, not the model


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def numeric_history(path: Path, stage: str) -> list[dict]:
    """The stage's metric records without the fields that measure time or memory."""
    return [untimed(json.loads(line)) for line in (path / "results/t/train" / stage / "metrics.jsonl").open()]


def test_a_long_run_goes_through_time_limits_requeue_and_kills_to_the_uninterrupted_result(dag, long_run):
    import torch

    ref, _ = dag
    path, out, events = long_run
    submitted = re.findall(r"SLURM jobid (\d+) \(log: \S*/rule_(train_segment|train)/(\w+?)_?(\d*)/", out)
    # every train job asked for the partition's limit and no more (a longer request would pend forever there)
    asked = re.findall(r"^rule (?:train|train_segment):\n(?:    .*\n)*?    resources: .*\bruntime=(\d+)", out, re.M)
    assert asked and set(asked) == {str(LIMIT_MIN)}, asked
    for stage in ("pretrain", "midtrain", "sft"):
        jobs = {j for j, rule, wildcards, _ in submitted if wildcards.startswith(stage)}
        assert len(jobs) >= 3, (stage, submitted)  # a chain of at least three jobs per stage
        # the same weights, metric history (every logged step once) and evaluation as the uninterrupted run
        a = torch.load(ref / f"results/t/train/{stage}/final.pt", weights_only=True)["model"]
        b = torch.load(path / f"results/t/train/{stage}/final.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage
        assert numeric_history(path, stage) == numeric_history(ref, stage), stage
        core = [untimed(json.loads((p / f"results/t/eval/{stage}/report.json").read_text())["core"])
                for p in (ref, path)]
        assert core[0] == core[1], stage
    assert f"JobId={events['requeued']} " in events["restarted"] and "Restarts=1" in events["restarted"]
    assert f"SLURM jobid {events['killed']}" in out and re.search(r"Trying to restart job|retr", out), out[-3000:]
    # the restarted controller waited for the orphaned job instead of starting a second writer
    assert f"waiting for SLURM job {events['orphan']}" in out, out[-3000:]
    logs = [*(path / "logs/t/train").rglob("*.log"), *(path / ".snakemake/slurm_logs").rglob("*.log")]
    assert not [p for p in logs if "two trainers must never write" in p.read_text(errors="replace")]
