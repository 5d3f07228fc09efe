"""The train job owns its processes: workers die with their launcher, the supervisor asks the trainers to stop
(and kills the job after its grace, or at once when a rank hung) and kills what is left, and one trainer per
output directory (pipeline.training.launch).

Real processes throughout: torchrun with two workers that only call `die_with_parent` and sleep (or register
as trainers that exit 75 on SIGUSR1), killed the ways a user, Snakemake or a scheduler kills a job.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from builders import ROOT

from pipeline.io import pid_alive

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORKER = textwrap.dedent("""
    import os, sys, time
    from pipeline.training.processes import die_with_parent
    die_with_parent()
    out = sys.argv[1]
    with open(os.path.join(out, f"worker-{os.environ.get('LOCAL_RANK', 'x')}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
""")


def start(tmp_path: Path, *, supervised: bool, nproc: int = 2) -> tuple[subprocess.Popen, list[int]]:
    """Start torchrun with `nproc` sleeping workers (under the supervisor or bare) in a new session, as
    Snakemake's job would be in Snakemake's; return the session leader and the workers' PIDs."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), str(script), str(tmp_path)]
    if supervised:
        cmd = [sys.executable, "-m", "pipeline.training.launch", "--grace", "3", "--", *cmd]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(pids := sorted(tmp_path.glob("worker-*.pid"))) < nproc or any(not p.read_text() for p in pids):
        assert proc.poll() is None, "launcher exited early"
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    return proc, [int(p.read_text()) for p in pids]


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "bare-torchrun"])
def test_sigkill_of_the_group_ends_every_worker(tmp_path, supervised):
    """torchrun puts its workers in sessions of their own: without the parent-death signal they would
    survive this kill (the bug this fixes)."""
    proc, workers = start(tmp_path, supervised=supervised)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_gone(workers, 10) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_ends_the_job(tmp_path, sig):
    """Workers that never registered as trainers (nothing to ask to stop): killed after the grace, 128 + N."""
    proc, workers = start(tmp_path, supervised=True)
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=20) == 128 + sig
    assert wait_gone(workers, 5) == []


def test_supervisor_kills_what_the_launcher_leaves(tmp_path):
    """A launcher that exits leaving a process behind (here a setsid'ed sleeper that never asked to die
    with its parent): the supervisor, as subreaper, kills it before exiting with the launcher's status."""
    marker = tmp_path / "orphan.pid"
    code = f"setsid sleep 300 & echo $! > {marker}; exit 3"
    proc = subprocess.run([sys.executable, "-m", "pipeline.training.launch", "--", "bash", "-c", code],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=30, capture_output=True, text=True)
    assert proc.returncode == 3
    assert "killing 1 process(es)" in proc.stderr
    assert wait_gone([int(marker.read_text())], 5) == []


PDEATHSIG = """
import ctypes
from pipeline.training.processes import die_with_parent
die_with_parent()
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(sig.value)
"""


@pytest.mark.parametrize("env, expected", [({}, 0), ({"LOCAL_RANK": "0"}, signal.SIGKILL)],
                         ids=["by-hand", "torchrun-worker"])
def test_only_launched_workers_die_with_their_parent(env, expected):
    """A trainer run by hand (`nohup python -m pipeline.training.train … &`) must outlive its shell."""
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TOKENFARM_SUPERVISOR_PID")}
    out = subprocess.run([sys.executable, "-c", PDEATHSIG], env={**base, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(int(expected)), out.stderr


# ----------------------------------------------------------------------------- clean stops, hangs

STOPPABLE = textwrap.dedent("""
    import os, signal, sys, time
    from pipeline.training.processes import die_with_parent, register_worker, report_exit
    die_with_parent()
    out, mode = sys.argv[1], sys.argv[2]
    def stop(signum, frame):
        report_exit(75)
        os._exit(75)
    signal.signal(signal.SIGUSR1, stop)
    register_worker()
    with open(os.path.join(out, f"worker-{os.environ['LOCAL_RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if mode == "hang" and os.environ["LOCAL_RANK"] == "0":
        time.sleep(1)
        report_exit(70)  # what the step watchdog does
        os._exit(70)
    time.sleep(300)
""")


def start_stoppable(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "stoppable.py"
    script.write_text(STOPPABLE)
    cmd = [sys.executable, "-m", "pipeline.training.launch", "--grace", "60", "--", TORCHRUN, "--standalone",
           "--nproc_per_node", "2", str(script), str(tmp_path), mode]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(pids := sorted(tmp_path.glob("worker-*.pid"))) < 2 or any(not p.read_text() for p in pids):
        assert proc.poll() is None, f"launcher exited early: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    return proc, [int(p.read_text()) for p in pids]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_reaches_the_trainers_and_their_exit_75_is_the_jobs(tmp_path, sig):
    """The supervisor sends SIGUSR1 to the registered workers (not SIGTERM to torchrun, which ignores the stop
    signals); they exit 75, torchrun exits 1, and the supervisor exits 75, their code."""
    proc, workers = start_stoppable(tmp_path, "stop")
    started = time.monotonic()
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=60) == 75, proc.stderr.read()[-3000:]
    assert time.monotonic() - started < 30  # not the 60 s grace
    assert wait_gone(workers, 5) == []


def test_a_hung_rank_ends_the_job_at_once_with_70(tmp_path):
    """A worker's watchdog reports 70 and exits: the supervisor kills the job at once (torchrun would give the
    other worker 30 s) and exits 70."""
    proc, workers = start_stoppable(tmp_path, "hang")
    started = time.monotonic()
    assert proc.wait(timeout=60) == 70, proc.stderr.read()[-3000:]
    assert time.monotonic() - started < 15
    assert wait_gone(workers, 5) == []


def test_exec_mode_becomes_the_agent_with_the_stop_signals_ignored():
    """What srun starts on each node of a multi-node job (pipeline.training.rendezvous): the torchrun agent
    itself, ignoring the stop signals and told to handle SIGQUIT only, so that SLURM's SIGTERM reaches its
    trainers and not a teardown."""
    code = ("import os, signal; print(all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, "
            "signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)), os.environ['PET_SIGNALS_TO_HANDLE'], os.getppid())")
    r = subprocess.run([sys.executable, "-m", "pipeline.training.launch", "--exec", "--", sys.executable, "-c", code],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
    ignored, handled, parent = r.stdout.split()
    assert (ignored, handled, int(parent)) == ("True", "SIGQUIT", os.getpid()), r.stderr  # exec'd: no process between
