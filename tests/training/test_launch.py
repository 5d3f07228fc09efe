"""The train job owns its processes: workers die with their launcher, the supervisor forwards signals and
kills what is left, and one trainer per output directory (pipeline.training.launch).

Real processes throughout: torchrun with two workers that only call `die_with_parent` and sleep, killed
the ways a user or Snakemake kills a job.
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

from pipeline.errors import PipelineError
from pipeline.io import pid_alive
from pipeline.training.processes import RunLock

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


HOLD = "import sys, time; from pipeline.training.processes import RunLock; RunLock(sys.argv[1]).acquire(); " \
       "print('locked', flush=True); time.sleep(300)"


def test_second_trainer_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PipelineError, match=rf"in use by another training run: PID {holder.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock
        holder.wait()
    with RunLock(tmp_path) as lock:
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(PipelineError, match=str(os.getpid())):
            RunLock(tmp_path).acquire()  # also within one process: a second descriptor is a second holder
    RunLock(tmp_path).acquire().release()
    assert lock._fd is None


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
