"""Job sizes for a cluster (pipeline.planning.data_cost), the data-stage cost in the plan CLI, and the launcher's
multi-node command (pipeline.training.rendezvous) — without a cluster (tests/slurm runs a real one)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from builders import ROOT, SNAKEMAKE, snakemake_workflow

from pipeline.config import resolve_config, shard_groups
from pipeline.errors import PipelineError
from pipeline.planning import data_cost as cluster
from pipeline.planning import job_sizes as sizes
from pipeline.planning.stages import mix_targets
from pipeline.planning.token_plan import train_hours
from pipeline.run_config import RunConfig, run_config
from pipeline.training import rendezvous

PRESET = yaml.safe_load((ROOT / "configs/llama3-1b-fineweb.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "config.yaml").read_text())


def preset(**hardware) -> RunConfig:
    """The 1.2B preset on hardware.nodes nodes (micro-batch 64 / nodes: the same 2^20-token global batch)."""
    micro = PRESET["train"]["micro_batch"] // hardware.get("nodes", 1)
    return run_config(resolve_config({**PRESET, "hardware": {**PRESET["hardware"], **hardware},
                                      "train": {**PRESET["train"], "micro_batch": micro}}))


def test_train_job_is_one_allocation_of_n_nodes_with_gpus_per_node():
    cfg = preset(nodes=4, cpus_per_task=32)
    r = cluster.job_resources(cfg, "train", train_hours=train_hours(cfg))
    assert r["threads"] == 32
    res = r["resources"]
    assert res["nodes"] == 4 and res["tasks"] == 4 and res["mpi"] == "srun"
    assert res["gres"] == "gpu:8" and "gpu" not in res  # per node, not a total spread over nodes
    assert res["cpus_per_task"] == 32 and res["runtime"] > 60
    one_node = preset(cpus_per_task=32)
    one = cluster.job_resources(one_node, "train", train_hours=train_hours(one_node))["resources"]
    assert one["runtime"] == math.ceil(90 * train_hours(one_node)) + 30 and one["runtime"] > 10 * 60
    assert one["gpu"] == 8 and one["nodes"] == 1 and "gres" not in one and "mpi" not in one
    # 4× the world: the planned hours (and the requested runtime) shrink
    assert res["runtime"] < one["runtime"]
    cpu = cluster.job_resources(run_config(resolve_config({})), "train")
    assert cpu["threads"] == 256 and "gpu" not in cpu["resources"]  # 0 = all cores: --cores caps it locally


def test_dedup_candidate_jobs_stay_under_1gb_on_the_preset_and_grow_with_fewer_partitions():
    cfg = preset()
    c = sizes.corpus(cfg)
    assert c["shards"] == 1823 and 90e6 < c["documents"] < 110e6
    # before any count: the estimate's GPT-2 tokens at 4.6 bytes each, ~250 MB of text a shard
    assert c["bytes"] == pytest.approx(c["tokens"] * sizes.BYTES_PER_ESTIMATED_TOKEN)
    mem = cluster.job_resources(cfg, "dedup_candidates", c["documents"], c["tokens"])["resources"]["mem_mb"]
    assert mem <= 1000
    fewer = run_config(resolve_config({**PRESET, "dedup": {"partitions": 20}}))
    more = cluster.job_resources(fewer, "dedup_candidates", c["documents"], c["tokens"])["resources"]["mem_mb"]
    assert more > 3 * mem


def test_every_rule_has_resources(workflow_rules):
    """Every rule Snakemake parses (but the `all` target) asks for memory and a runtime (a cluster job without
    them gets whatever the profile's defaults are), as job_resources sizes them on the default config."""
    for name, rule in workflow_rules.items():
        if name != "all":
            mem, runtime = rule.resources["mem_mb"], rule.resources["runtime"]
            assert mem.value > 0 and (runtime.is_evaluable() or runtime.value >= 10), name  # (scaling_point: per point)


@pytest.fixture(scope="module")
def workflow_rules(tmp_path_factory) -> dict:
    """{name: rule} of the workflow Snakemake parses on the default config."""
    path = tmp_path_factory.mktemp("workflow")
    (path / "data").symlink_to(ROOT / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        with snakemake_workflow(path, ROOT / "config.yaml") as workflow:
            return {r.name: r for r in workflow.rules}


def test_the_cost_plan_and_the_rehearsal_cover_every_data_rule(workflow_rules):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import data_scale

    rules = {name for name, r in workflow_rules.items() if r.benchmark}  # every data rule has a benchmark table
    assert "decontaminate_flags" in rules and "pack" in rules and "dedup_index" in rules
    assert set(cluster.RATES) == rules
    assert set(cluster.stage_work(preset())) == rules  # every stage has its jobs in the DAG the plan schedules
    # the rehearsal reads each job's own CPU from its log: the globs are the rules' `log:` paths (under
    # logs/{run_name}/), each wildcard a *
    for name in rules:
        log = "/".join(Path(str(workflow_rules[name].log[0])).parts[2:])
        assert re.sub(r"\{[^}]*\}", "*", log) == data_scale.LOGS[name], name


def jobs(*spec) -> list[dict]:
    return [{"name": n, "stage": "tokenizer" if t > 1 else "tokenize", "cpu_s": c, "after": list(a), "threads": t}
            for n, c, a, t in spec]


def test_schedule_runs_jobs_on_the_cores_after_what_they_wait_for():
    dag = jobs(("a", 2.0, (), 1), ("b", 3.0, ("a",), 1), ("c", 4.0, (), 1))
    one, two = cluster.schedule(dag, 1), cluster.schedule(dag, 2)
    assert max(e for _, e in one.values()) == 9.0  # one core: one job after another
    assert two == {"a": (0.0, 2.0), "c": (0.0, 4.0), "b": (2.0, 5.0)}  # b waits for a, not for c
    assert cluster.critical_path(dag, 2) == 5.0
    # a multi-threaded job (the tokenizer) holds every core it uses, and runs TOKENIZER_PARALLELISM × faster
    wide = cluster.schedule(jobs(("t", 3.7, (), 8), ("x", 1.0, (), 1)), 2)
    assert wide["t"] == (0.0, pytest.approx(3.7 / min(2, cluster.TOKENIZER_PARALLELISM)))
    assert wide["x"][0] == wide["t"][1]


def test_a_job_listed_before_what_it_waits_for_moves_after_it():
    """data_jobs lists a data rule its order does not place last (`_dependency_order`): a job moves after the
    jobs it waits for, the others keep their order, and a list already in order comes back as it is."""
    dag = [{"name": n, "after": list(a)} for n, a in (("b", "c"), ("a", ""), ("c", ""), ("d", "a"))]
    assert [j["name"] for j in cluster._dependency_order(dag)] == ["a", "c", "b", "d"]
    jobs = cluster.data_jobs(preset())
    assert cluster._dependency_order(jobs) == jobs
    with pytest.raises(Exception, match="make a cycle"):
        cluster._dependency_order([{"name": "x", "after": ["y"]}, {"name": "y", "after": ["x"]}])


def test_data_costs_cover_every_stage_and_scale_with_cores_and_partitions():
    cfg = preset()
    small, big = cluster.data_costs(cfg, data_cpus=64), cluster.data_costs(cfg, data_cpus=1024)
    assert set(small["stages"]) == set(cluster.RATES)  # every data rule (checked against the workflow above)
    assert small["cpu_hours"] == pytest.approx(big["cpu_hours"]) and big["wall_hours"] < small["wall_hours"]
    for c in (small, big):  # the wall time is bounded by the cores and by the longest chain of jobs
        assert c["wall_hours"] >= max(c["cpu_hours"] / c["data_cpus"], c["critical_path_hours"]) * 0.999
    st = small["stages"]
    assert st["dedup_candidates"]["jobs"] == 200 and st["tokenize"]["jobs"] == 114
    assert st["decontaminate_flags"]["jobs"] == 114 and st["pack"]["jobs"] == 2
    # the plan's sample (the first and last shards' groups) is tokenized first and is all count_sample waits for
    jobs, sample = cluster.data_jobs(cfg), ["tokenize/fineweb/0", "tokenize/fineweb/113"]
    assert [j["name"] for j in jobs if j["stage"] == "tokenize"][:2] == sample
    assert next(j for j in jobs if j["stage"] == "count_sample")["after"] == sample
    # filter: after its group's download, before its tokenize; priced on the shards' bytes like tokenize
    assert next(j for j in jobs if j["name"] == "filter/fineweb/0")["after"] == ["download/fineweb/0"]
    assert "filter/fineweb/0" in next(j for j in jobs if j["name"] == "tokenize/fineweb/0")["after"]
    # priced by the preset's own chain (language ID + PII): the sum of their measured rates and the job's base
    r = cluster.rate(cfg, "filter")
    assert r.unit == "bytes" and r.per_s == pytest.approx(1e6 / cluster.filter_cpu_s_per_mb(cfg.filter))
    # and each job fills language ID's word cache: a preset's job (16 shards, GBs) refills it many times over
    job_bytes = [j["units"] for j in jobs if j["stage"] == "filter"]
    assert r.fill(job_bytes[0]) == pytest.approx(cluster.filter_fill_cpu_s(cfg.filter, job_bytes[0]))
    assert r.fill(job_bytes[0]) > 0 and r.fill(2 * job_bytes[0]) == pytest.approx(2 * r.fill(job_bytes[0]))
    assert st["filter"]["jobs"] == len(job_bytes) == 114 and st["filter"]["cpu_hours"] == pytest.approx(
        (small["bytes"] / r.per_s + sum(r.per_job + r.fill(b) for b in job_bytes)) / 3600, rel=1e-6)
    # the default config's six-filter chain costs more per byte than the presets' two filters
    assert cluster.rate(run_config(resolve_config(DEFAULT)), "filter").per_s < r.per_s
    # tokenize: the shards' text in bytes (no vocabulary in the unit) ÷ the rate, plus each job's start
    unit, rate, per_job, _ = cluster.RATES["tokenize"]
    assert unit == "bytes" and st["tokenize"]["cpu_hours"] == pytest.approx(
        (small["bytes"] / rate + 114 * per_job) / 3600, rel=1e-6)
    # pack: the mix's tokens (the plan's 20 tokens/param) and its val, not the corpus
    assert st["pack"]["units"] == pytest.approx(mix_targets(cfg, "pretrain") + cfg.split.val_tokens, rel=1e-6)
    # each candidate job reads its 1/P of the band keys: twice the jobs cost only their start-up again
    more = cluster.data_costs(run_config(resolve_config({**PRESET, "dedup": {"partitions": 400}})), data_cpus=64)
    assert more["stages"]["dedup_candidates"]["cpu_hours"] == pytest.approx(
        st["dedup_candidates"]["cpu_hours"] + 200 * sizes.job_cpu_s(cluster.RATES["dedup_candidates"], 0, 1823) / 3600)


def test_data_costs_use_the_measured_sample_sizes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "sample.parquet"
    pq.write_table(pa.table({"source": ["fineweb"] * 2, "documents": [40_000, 60_000], "tokens": [3e7, 5e7],
                             "bytes": [2e8, 3e8]}), table)
    measured = sizes.measured_sizes(table)
    assert measured == {"fineweb": {"documents": 50_000, "tokens": 4e7, "bytes": 2.5e8}}
    c = cluster.data_costs(preset(), measured, data_cpus=64)
    assert c["basis"] == "measured counts" and c["bytes"] == round(1823 * 2.5e8)
    assert c["stages"]["dedup_signatures"]["units"] == pytest.approx(1823 * 2.5e8)
    assert c["stages"]["dedup"]["units"] == pytest.approx(1823 * 50_000)
    assert sizes.measured_sizes(tmp_path / "absent.parquet") == {}


def test_plan_cli_prints_the_data_stage_cost():
    out = subprocess.run([sys.executable, "-m", "pipeline.plan", "--configfile", "configs/llama3-1b-fineweb.yaml",
                          "--data-cpus", "128"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "data stages on 128 CPU cores" in out
    row = re.search(r"dedup_candidates\s+200\s+([\d.,]+)\s+([\d.,]+)\s+0\.\dGB", out)
    assert row, out
    assert re.search(r"total\s+\d{3},?\d*\s+[\d.,]+\s+[\d.,]+", out)


@pytest.mark.slow  # Snakemake's dry run
def test_dry_run_shows_the_train_job_as_one_n_node_allocation(tmp_path):
    cfg = {**PRESET, "hardware": {**PRESET["hardware"], "nodes": 2, "cpus_per_task": 16},
           "train": {**PRESET["train"], "micro_batch": 32}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    first = resolve_config(cfg)["train"]["stages"][0]["name"] if cfg["train"].get("stages") else "pretrain"
    target = f"{cfg.get('results_dir', 'results')}/{cfg['run_name']}/train/{first}/final.pt"  # a stage's train job
    out = subprocess.run([SNAKEMAKE, target, "-s", str(ROOT / "Snakefile"),
                          "-d", str(tmp_path), "-n", "--configfile", str(tmp_path / "c.yaml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    block = out.stdout[out.stdout.index("rule train:"):]
    res = re.search(r"resources: (.*)", block).group(1)
    assert "nodes=2" in res and "tasks=2" in res and "gres=gpu:8" in res and "mpi=srun" in res, res
    assert "cpus_per_task=16" in res, res


def test_launcher_runs_torchrun_standalone_on_one_node_and_refuses_n_nodes_without_slurm(tmp_path):
    cmd = rendezvous.launch_command(1, 4, 8, 0, ["-m", "pipeline.training.train"])
    assert cmd[1:5] == ["--standalone", "--nproc_per_node", "4", "-m"]
    with pytest.raises(PipelineError, match="one SLURM job of 2 nodes.*workflow/profiles/slurm"):
        rendezvous.launch_command(2, 4, 8, 4, ["-m", "x"], job_id=None)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"world_size": 8}))
    rendezvous.check_world(2, 4, plan)
    with pytest.raises(PipelineError, match="world_size 8, but this launch is 1 node"):
        rendezvous.check_world(1, 4, plan)


def test_nccl_presets_and_mappings():
    assert rendezvous.nccl_env("default") == {}
    sock = rendezvous.nccl_env("socket", nodes=4)
    assert sock["NCCL_P2P_DISABLE"] == "1" and sock["NCCL_IB_DISABLE"] == "1" and "NCCL_SOCKET_IFNAME" not in sock
    assert rendezvous.nccl_env({"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": 1}) == {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "1"}
    with pytest.raises(PipelineError, match="loopback"):
        rendezvous.nccl_env("socket-lo", nodes=2)
    with pytest.raises(Exception, match="nccl_env"):
        resolve_config({"hardware": {"nccl_env": {"OMP_NUM_THREADS": 1}}})


@pytest.mark.parametrize("preset_file, parallel",
                         [("llama3-1b-fineweb.yaml", "ddp"), ("llama3-8b-fineweb.yaml", "fsdp")])
def test_train_job_memory_is_the_host_memory_the_config_implies(preset_file, parallel):
    """issue 28 item 2: the train job's mem_mb is `train_host_memory`, no constant per GPU: 8 ranks'
    footprint + twice the largest fp32 weight each (the 128,256 × d embedding) + the loader, and under fsdp
    the whole fp32 model rank 0 gathers for final.pt, with the margin — for both presets between 8 ranks'
    fixed footprint and the 256,000 MB the rule asked a node for before (8 × 32,000), the 8B's the larger."""
    from pipeline.config import load_config
    from pipeline.planning.parallel import resolve_parallel

    cfg = resolve_parallel(run_config(load_config(ROOT / "configs" / preset_file)))
    assert cfg.train.parallel == parallel and cfg.hardware.nproc_per_node == 8
    h = sizes.train_host_memory(cfg)
    res = cluster.job_resources(cfg, "train", train_hours=1.0)["resources"]
    assert res["mem_mb"] == h["node_mb"]
    largest = 4 * cfg.model.vocab_size * cfg.model.dim  # the embedding is the largest weight
    assert h["init_mb"] == pytest.approx(sizes.TRAIN_INIT_WEIGHTS * largest / 2**20, abs=0.1)
    assert 0 < h["loader_mb"] < 100 and h["state_mb"] == 0  # on CUDA the training state is on the GPU
    gather = 4 * sizes.count_params(cfg.model)[0] / 2**20 if parallel == "fsdp" else 0
    assert h["final_gather_mb"] == pytest.approx(gather, abs=0.1)
    rank = sizes.TRAIN_RANK_HOST_MB["cuda"] + h["init_mb"] + h["loader_mb"]
    assert h["node_mb"] == math.ceil(sizes.TRAIN_HOST_MARGIN * (8 * rank + gather))
    assert 8 * sizes.TRAIN_RANK_HOST_MB["cuda"] < h["node_mb"] < 256_000
    # half the ranks on each of 2 nodes: each node asks for less (the gather is rank 0's, on the first node)
    two = resolve_parallel(run_config(load_config(ROOT / "configs" / preset_file,
                                                  {"hardware": {"nproc_per_node": 4, "nodes": 2}})))
    assert sizes.train_host_memory(two)["node_mb"] < h["node_mb"]


def test_cpu_train_job_memory_counts_the_training_state_on_the_host():
    """On the CPU the training state lives on the host: the predicted per-rank total of pipeline.planning is
    part of each rank's request."""
    from pipeline.planning.memory import StepSetup, memory

    cfg = run_config(resolve_config({"hardware": {"nproc_per_node": 2}}))
    h = sizes.train_host_memory(cfg)
    assert h["state_mb"] > 0
    assert h["state_mb"] == pytest.approx(memory(StepSetup.from_config(cfg))["total"] * 1e9 / 2**20, abs=0.1)
    want = sizes.TRAIN_HOST_MARGIN * (2 * h["rank_mb"] + h["final_gather_mb"])
    assert h["node_mb"] == pytest.approx(want, abs=1)  # the parts are rounded to 0.1 MB


def snakemake_jobs(workdir: Path, configfile: Path) -> dict[tuple[str, tuple], set[tuple[str, tuple]]]:
    """The DAG Snakemake builds for `configfile` (as `snakemake -n` does):
    {(rule, wildcards): the (rule, wildcards) of the jobs it depends on}."""

    def key(job):
        return job.rule.name, tuple(sorted(job.wildcards.items()))

    with snakemake_workflow(workdir, configfile) as workflow:
        workflow._prepare_dag(forceall=False, ignore_incomplete=True, lock_warn_only=True)
        workflow._build_dag()
        dag = workflow.dag
        return {key(j): {key(d) for d in dag.dependencies[j]} for j in dag.jobs}


@pytest.mark.parametrize("configfile", ["config.yaml", "configs/llama3-1b-fineweb.yaml"])
def test_the_cost_plans_job_graph_has_snakemakes_edges(configfile, tmp_path, monkeypatch):
    """The plan schedules the data jobs on the edges Snakemake builds, job for job and edge for edge (a
    drift such as mix waiting for plan, which mix.smk does not, fails here)."""
    (tmp_path / "data").symlink_to(ROOT / "data")  # the default config's sample shards (the preset needs none)
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(yaml.safe_load((ROOT / configfile).read_text()))
    group_index = {(s, g): i for s in cfg["sources"] for i, g in enumerate(shard_groups(cfg, s))}

    def name(rule: str, wildcards: tuple) -> str:  # a Snakemake job as data_jobs names it
        w = dict(wildcards)
        if "group" in w:
            return f"{rule}/{w['source']}/{group_index[w['source'], w['group']]}"
        return "/".join([rule, *(w[k] for k in ("mix", "split", "part") if k in w)])

    jobs = cluster.data_jobs(run_config(cfg))
    data_rules = {j["stage"] for j in jobs}
    built = {name(*job): {name(*d) for d in deps if d[0] in data_rules}
             for job, deps in snakemake_jobs(tmp_path, ROOT / configfile).items() if job[0] in data_rules}
    assert {j["name"]: set(j["after"]) for j in jobs} == built
