"""The lease on a training folder (pipeline/training/lease.py): one writer across processes, jobs and controllers."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.training import lease as lease_mod
from pipeline.training.lease import Lease, live_holder, wait_for_writers

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pipeline.training.lease import Lease
Lease(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_in_subprocess(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_refused_and_a_killed_one_is_taken_over(tmp_path):
    holder = hold_in_subprocess(tmp_path)
    try:
        assert live_holder(tmp_path)["pid"] == holder.pid
        with pytest.raises(PipelineError, match=rf"PID {holder.pid}.*two trainers must never write"):
            Lease(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert live_holder(tmp_path) is None  # its file is still there, its process is not
    with Lease(tmp_path) as mine:
        assert json.loads((tmp_path / "LEASE").read_text())["pid"] == os.getpid() == mine.me["pid"]
    assert not (tmp_path / "LEASE").exists()  # released


def write_holder(directory: Path, **fields) -> None:
    now = time.time()
    holder = {"id": "x", "host": "elsewhere", "pid": 1, "slurm_job_id": None, "since": now, "beat": now, **fields}
    (directory / "LEASE").write_text(json.dumps(holder))


@pytest.mark.parametrize(("state", "taken"), [("RUNNING", False), ("PENDING", False), ("REQUEUED", False),
                                              ("COMPLETED", True), ("CANCELLED", True), ("", True)])
def test_a_slurm_holder_is_live_while_its_job_is_queued_or_running(tmp_path, monkeypatch, state, taken):
    monkeypatch.setattr(lease_mod, "slurm_state", lambda job: state)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    write_holder(tmp_path, id="slurm-41", slurm_job_id="41")
    if taken:
        Lease(tmp_path).acquire().release()
    else:
        with pytest.raises(PipelineError, match="SLURM job 41 .*scancel 41"):
            Lease(tmp_path).acquire()


def test_a_requeued_job_takes_its_own_lease_back(tmp_path, monkeypatch):
    """`scontrol requeue`: the same job id runs again while squeue still calls it running; the lease is its own."""
    monkeypatch.setattr(lease_mod, "slurm_state", lambda job: "RUNNING")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    write_holder(tmp_path, id="slurm-41", slurm_job_id="41", pid=999999)
    with Lease(tmp_path) as mine:
        assert mine.me["id"] == "slurm-41" and json.loads((tmp_path / "LEASE").read_text())["pid"] == os.getpid()


def test_without_slurm_a_stale_heartbeat_is_a_dead_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "slurm_state", lambda job: None)  # squeue cannot be asked
    write_holder(tmp_path, slurm_job_id="7", beat=time.time() - 10)
    with pytest.raises(PipelineError):
        Lease(tmp_path).acquire()
    write_holder(tmp_path, slurm_job_id="7", beat=time.time() - lease_mod.STALE_S - 1)
    Lease(tmp_path).acquire().release()


def test_a_holder_whose_lease_was_taken_stops(tmp_path):
    lost = threading.Event()
    mine = Lease(tmp_path, beat_s=0.05, on_lost=lost.set).acquire()
    try:
        write_holder(tmp_path, id="someone-else")
        assert lost.wait(5)
        assert json.loads((tmp_path / "LEASE").read_text())["id"] == "someone-else"  # never written over
    finally:
        mine.release()
    assert (tmp_path / "LEASE").exists()  # not ours: release leaves it


def _race(directory: str, start: float, won) -> None:
    time.sleep(max(0.0, start - time.time()))
    try:
        Lease(directory, beat_s=60).acquire()
        won.put(os.getpid())
        time.sleep(1.0)  # hold while the others try
    except PipelineError:
        won.put(None)


def test_of_many_takers_of_a_dead_lease_one_wins(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_holder(tmp_path, host=os.uname().nodename, pid=int(dead.stdout))  # a process that has ended
    ctx = mp.get_context("fork")
    won = ctx.Queue()
    start = time.time() + 0.5
    procs = [ctx.Process(target=_race, args=(str(tmp_path), start, won)) for _ in range(6)]
    for p in procs:
        p.start()
    results = [won.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    assert len([r for r in results if r is not None]) == 1, results


def test_a_restarted_controller_waits_for_the_earlier_writer(tmp_path):
    holder = hold_in_subprocess(tmp_path / "pretrain")
    said = []
    threading.Timer(1.0, holder.kill).start()
    t0 = time.monotonic()
    wait_for_writers([tmp_path / "pretrain", tmp_path / "sft"], workdir=tmp_path, poll_s=0.1, say=said.append)
    holder.wait()
    assert time.monotonic() - t0 >= 0.9
    assert len(said) == 1 and f"PID {holder.pid}" in said[0] and "earlier snakemake" in said[0]
