r"""Launch the trainer on this node or on every node of a SLURM allocation (the train rule's command).

    python -m pipeline.training.rendezvous --params JSON --cpus-per-node C [--plan R/plan.json] \
        -- -m pipeline.training.train ARGS...

One node: ``torchrun --standalone`` here. N > 1 nodes (inside the SLURM job): ``srun`` one torchrun agent
per node with a c10d rendezvous on the first node. Both check ``nodes × nproc_per_node`` against the
plan's ``world_size`` first and export ``hardware.nccl_env`` (`NCCL_PRESETS`) to every worker.
Details: docs/training.md, "Launching on one node or many".
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys

from pipeline.config import add_config_args, params_from_args, train_slice
from pipeline.errors import PipelineError
from pipeline.io import get_logger, run_cli
from pipeline.training.processes import STATUS_DIR_ENV, ignore_stop_signals

log = get_logger(__name__)

# hardware.nccl_env presets. "default" leaves NCCL to pick its transports (NVLink/P2P, InfiniBand).
# "socket" is the set the reference run needed on cloud GPUs without InfiniBand or working P2P, where
# NCCL's defaults hang at the first all-reduce: plain sockets, no P2P, no IB, no network plugins.
# "socket-lo" adds the loopback interface: one node only (multi-node traffic cannot use lo).
NCCL_PRESETS = {
    "default": {},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none",
               "NCCL_DEBUG": "WARN"},
    "socket-lo": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none",
                  "NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "lo"},
}


def nccl_env(setting, nodes: int = 1) -> dict[str, str]:
    """The NCCL variables of `hardware.nccl_env`: a preset name or a {NCCL_*: value} mapping."""
    if isinstance(setting, str):
        if setting not in NCCL_PRESETS:
            raise PipelineError(f"hardware.nccl_env: unknown preset '{setting}'; use one of "
                                f"{', '.join(NCCL_PRESETS)} or a mapping of NCCL_* variables")
        env = dict(NCCL_PRESETS[setting])
    else:
        env = {str(k): str(v) for k, v in (setting or {}).items()}
    if nodes > 1 and env.get("NCCL_SOCKET_IFNAME") == "lo":
        raise PipelineError(f"hardware.nccl_env sets NCCL_SOCKET_IFNAME=lo but hardware.nodes is {nodes}: nodes "
                            "cannot talk over loopback; use the 'socket' preset or name the cluster's interface")
    return env


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PipelineError(f"scontrol {' '.join(args)} failed ({e}); is this a SLURM job?") from None


def _field(record: str, name: str) -> str:
    m = re.search(rf"(?:^|\s){name}=(\S+)", record)
    if not m:
        raise PipelineError(f"scontrol output has no {name}=: {record[:200]}")
    return m.group(1)


def allocation(job_id: str) -> list[tuple[str, str]]:
    """(node name, address) of every node of SLURM job `job_id`, in SLURM's order."""
    job = _scontrol("show", "job", "-o", job_id)
    names = _scontrol("show", "hostnames", _field(job, "NodeList")).split()
    nodes = []
    for name in names:
        addr = _field(_scontrol("show", "node", "-o", name), "NodeAddr")
        nodes.append((name, addr))
    return nodes


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now (the OS's choice); the rendezvous binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_world(nodes: int, nproc: int, plan_path) -> None:
    if plan_path is None:
        return
    with open(plan_path) as f:
        planned = json.load(f)["world_size"]
    if nodes * nproc != planned:
        raise PipelineError(f"{plan_path}: the plan is for world_size {planned}, but this launch is {nodes} node(s) "
                            f"× {nproc} process(es) = {nodes * nproc}; rerun the plan rule for the current "
                            "hardware.nodes / hardware.nproc_per_node")


def launch_command(nodes: int, nproc: int, cpus: int, gpus: int, train_args: list[str],
                   job_id: str | None = None) -> list[str]:
    """The torchrun (single node) or srun + torchrun (N nodes, inside SLURM job `job_id`) argv."""
    torchrun = shutil.which("torchrun") or "torchrun"
    if nodes == 1:
        return [torchrun, "--standalone", "--nproc_per_node", str(nproc), *train_args]
    if not job_id:
        raise PipelineError(f"hardware.nodes is {nodes}: a multi-node run is one SLURM job of {nodes} nodes; run "
                            "Snakemake with --workflow-profile workflow/profiles/slurm (see README, 'On a SLURM "
                            "cluster'), or set hardware.nodes: 1")
    hosts = allocation(job_id)
    if len(hosts) != nodes:
        raise PipelineError(f"SLURM job {job_id} has {len(hosts)} node(s) ({', '.join(h for h, _ in hosts)}) but "
                            f"hardware.nodes is {nodes}; the train rule's resources must request nodes={nodes}")
    host = hosts[0][1]
    port = free_port()
    step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
            "--kill-on-bad-exit=1", "--export=ALL"]
    if gpus:
        step.append(f"--gres=gpu:{gpus}")
    # each node's agent ignores the stop signals, as the supervisor's launcher does here (docs/training.md)
    agent = [sys.executable, "-m", "pipeline.training.launch", "--exec", "--", torchrun]
    return [*step, *agent, "--nnodes", str(nodes), "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", f"tokenfarm-{job_id}", "--max-restarts", "0",
            *train_args]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.training.rendezvous", description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--cpus-per-node", type=int, default=1, help="CPUs for the torchrun agent and its workers")
    ap.add_argument("--plan", help="R/plan.json: the launch must match its world_size")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then torchrun's script arguments (-m MODULE ...)")
    args = ap.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_args:
        ap.error("give the trainer after --, e.g. -- -m pipeline.training.train ...")
    hw = params_from_args(args, train_slice)["hardware"]
    nodes, nproc = hw["nodes"], hw["nproc_per_node"]
    check_world(nodes, nproc, args.plan)
    env = dict(os.environ, **nccl_env(hw["nccl_env"], nodes))
    env["OMP_NUM_THREADS"] = str(max(1, args.cpus_per_node // nproc))
    cmd = launch_command(nodes, nproc, args.cpus_per_node, nproc if hw["device"] == "cuda" else 0, train_args,
                         os.environ.get("SLURM_JOB_ID"))
    log.info("launching %d node(s) × %d process(es): %s", nodes, nproc, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    if STATUS_DIR_ENV in os.environ:  # under the supervisor: its launcher ignores the stop signals (run_cli
        ignore_stop_signals()         # set a SIGTERM handler, which exec would reset to the default: death)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    run_cli(main)
