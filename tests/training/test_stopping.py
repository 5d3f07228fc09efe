"""Runs that outlive their jobs (pipeline/training/stopping.py): segments, clean stops from the clock and from
signals, exact continuation, and the step watchdog.

The tiny run of test_train.py. In-process single-process runs for the segments and the clock; 2-process gloo
runs through the supervisor, rendezvous and torchrun (marked slow) for signals (DDP and FSDP) and a hung rank;
the uninterrupted references and the reruns after a stop, which no signal reaches, under the supervisor with
the ranks forked by tests/forkrun.py (torchrun's worker environment, one import of torch: builders.ranks). The
test-only launch script below slows each step down (TF_STEP_SLEEP seconds) so that a signal lands mid-run,
and records each rank's PID (TF_PID_DIR).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from builders import ROOT, logged_steps, make_params, make_plan, processes_in, ranks, run_inprocess

import pipeline.training.train as T
from pipeline.io import write_json
from pipeline.training import stopping
from pipeline.training.processes import EXIT_HUNG, EXIT_STOPPED
from pipeline.training.stopping import DEADLINE_ENV, MARGIN_ENV, Deadline, StopClock, Stopped

pytestmark = pytest.mark.usefixtures("one_thread")

TIMING = ("tokens_per_s", "mfu")  # differ between any two runs


def read_metrics(outdir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (outdir / "metrics.jsonl").read_text().splitlines()]


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("mem/")} for r in records]


def final_model(outdir: Path) -> dict:
    return torch.load(outdir / "final.pt", weights_only=True)["model"]


def same_weights(a: Path, b: Path) -> bool:
    x, y = final_model(a), final_model(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def latest_step(outdir: Path) -> int:
    return int((outdir / "ckpt" / "latest").read_text().strip()[5:11])


# ----------------------------------------------------------------------------- pieces

def test_schedule_does_not_depend_on_where_a_job_ends():
    s = T.Schedule(num_steps=10, val_interval=4, log_interval=3, ckpt_interval=3)
    assert [d for d in range(1, 11) if s.is_log(d)] == [1, 3, 4, 6, 8, 9, 10]
    assert [s.last_logged(d) for d in (0, 1, 2, 5, 7, 10)] == [None, 1, 1, 4, 6, 10]
    assert [T.segment_target((k, 3), 10) for k in (1, 2, 3)] == [4, 7, 10]
    assert T.parse_segment("2/5") == (2, 5)
    for bad in ("0/3", "4/3", "x", "1/2/3"):
        with pytest.raises(Exception, match="--segment"):
            T.parse_segment(bad)


def test_clock_rule_measures_steps_and_saves():
    clock = StopClock(predicted_step_s=2.0, predicted_save_s=5.0, margin_s=1.0)
    assert clock.step_s() == 2.0 and clock.save() == 5.0  # the plan's figures before any measurement
    clock.step_done(30.0)  # the first step (compile): the estimate until another is measured
    assert clock.step_s() == 30.0
    for s in (1.0, 3.0, 2.0):
        clock.step_done(s)
    assert clock.step_s() == 3.0  # the recent max, the first step left out
    clock.save_s, clock.val_s = 4.0, 7.0
    assert clock.cost(val=True, core=False, save=True) == 3.0 + 7.0 + 4.0
    assert clock.short(now=100.0, deadline=100.0 + 3 + 4 + 1.5, ahead_s=3.0) is False
    assert clock.short(now=100.0, deadline=100.0 + 3 + 4 + 0.5, ahead_s=3.0) is True
    assert clock.short(now=100.0, deadline=None, ahead_s=1e9) is False


SQUEUE = """#!/bin/sh
[ "$*" = "-h -j 4242 -o %e" ] || exit 3
cat "$(dirname "$0")/answer"
"""


def test_deadline_from_the_environment_or_squeue(tmp_path, monkeypatch, caplog):
    assert Deadline({DEADLINE_ENV: "1700000000.5", "SLURM_JOB_ID": "4242"}).get() == 1700000000.5
    assert Deadline({}).get() is None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (bin_dir / "answer").write_text("2031-02-03T04:05:06\n")
    d = Deadline({"SLURM_JOB_ID": "4242"}, refresh_s=0.05)
    try:
        assert d.get() == time.mktime((2031, 2, 3, 4, 5, 6, 0, 0, -1))  # squeue prints local time
        (bin_dir / "answer").write_text("2031-02-03T06:05:06\n")  # an admin extended the job
        end = time.monotonic() + 10
        while d.get() != time.mktime((2031, 2, 3, 6, 5, 6, 0, 0, -1)) and time.monotonic() < end:
            time.sleep(0.05)
        assert d.get() == time.mktime((2031, 2, 3, 6, 5, 6, 0, 0, -1))
        with caplog.at_level("WARNING"):
            (bin_dir / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error' >&2; exit 1\n")
            time.sleep(0.3)
        assert "cannot read the end time of SLURM job 4242" in caplog.text
        assert d.get() == time.mktime((2031, 2, 3, 6, 5, 6, 0, 0, -1))  # the last value kept
    finally:
        d.close()
    (bin_dir / "squeue").write_text(SQUEUE)
    (bin_dir / "answer").write_text("N/A\n")
    assert Deadline({"SLURM_JOB_ID": "4242"}).get() is None  # no time limit


# ----------------------------------------------------------------------------- in process: segments, the clock

def params_10(**kw) -> dict:
    """10 steps; records at 1, 3, 4, 6, 8, 9, 10 (log 3, validation 4); checkpoints every 3."""
    return make_params(steps=10, log_interval=3, val_interval=4, ckpt_interval=3, **kw)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    run_inprocess(data, out, params_10())
    return out


def test_segments_equal_the_uninterrupted_run(data, uninterrupted, tmp_path, monkeypatch):
    params = params_10()
    for k, target in ((1, 4), (2, 7)):
        assert run_inprocess(data, tmp_path, params, segment=(k, 3)) is None
        assert latest_step(tmp_path) == target and not (tmp_path / "final.pt").exists()
        marker = json.loads((tmp_path / "segments" / f"{k}.json").read_text())
        assert {key: marker[key] for key in ("stage", "segment", "of", "target_step", "step", "num_steps",
                                             "tokens_seen")} == \
            {"stage": "pretrain", "segment": k, "of": 3, "target_step": target, "step": target, "num_steps": 10,
             "tokens_seen": target * 256}
        assert marker["meta"]["stage"] == "train"
        # no record for the job's last step unless the schedule has one (7 has none)
        assert logged_steps(tmp_path) == [s for s in (1, 3, 4, 6, 8, 9, 10) if s <= target]
    summary = run_inprocess(data, tmp_path, params, segment=(3, 3))
    assert summary["tokens_trained"] == 10 * 256 and not (tmp_path / "segments" / "3.json").exists()
    assert same_weights(uninterrupted, tmp_path)
    assert untimed(read_metrics(tmp_path)) == untimed(read_metrics(uninterrupted))

    # A segment rerun after its target was reached (its controller died): the marker, nothing trained, no model.
    (tmp_path / "segments" / "2.json").unlink()
    monkeypatch.setattr(T, "set_up", lambda *a, **k: pytest.fail("built a model for a segment already done"))
    assert run_inprocess(data, tmp_path, params, segment=(2, 3)) is None
    marker = json.loads((tmp_path / "segments" / "2.json").read_text())
    assert (marker["target_step"], marker["step"], marker["tokens_seen"]) == (7, 10, 10 * 256)
    assert untimed(read_metrics(tmp_path)) == untimed(read_metrics(uninterrupted))


def slow_steps(monkeypatch, seconds: float) -> None:
    accumulate = T.accumulate_gradients

    def slow(*a, **k):
        time.sleep(seconds)
        return accumulate(*a, **k)

    monkeypatch.setattr(T, "accumulate_gradients", slow)


def test_the_clock_stops_before_the_deadline_and_the_rerun_continues_exactly(data, uninterrupted, tmp_path,
                                                                               monkeypatch):
    """A deadline ~1.6 s after the first step starts, steps of ~0.3 s: the run stops at a step boundary with
    a checkpoint, before the deadline, and the rerun (no deadline) ends as the uninterrupted run did."""
    params = params_10()
    slow_steps(monkeypatch, 0.3)
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() + 3600))  # the deadline is rank 0's; read before set-up
    monkeypatch.setenv(MARGIN_ENV, "0.2")
    origin = []  # the deadline counts from the first vote (set-up time varies on a shared machine)

    def deadline(self):
        origin.append(origin[0] if origin else time.time())
        return origin[0] + 1.6

    monkeypatch.setattr(Deadline, "get", deadline)
    with pytest.raises(Stopped) as stop:
        run_inprocess(data, tmp_path, params)
    assert time.time() < origin[0] + 1.6
    step = stop.value.step
    assert 1 <= step < 10 and stop.value.target == 10 and "deadline" in stop.value.reason
    assert latest_step(tmp_path) == step and not (tmp_path / "final.pt").exists()
    assert logged_steps(tmp_path) == [s for s in (1, 3, 4, 6, 8, 9, 10) if s <= step]

    monkeypatch.undo()
    run_inprocess(data, tmp_path, params)
    assert same_weights(uninterrupted, tmp_path)
    assert untimed(read_metrics(tmp_path)) == untimed(read_metrics(uninterrupted))


def test_a_job_without_time_for_one_step_stops_without_training(data, tmp_path, monkeypatch):
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() + 5))  # less than the 30 s margin
    with pytest.raises(Stopped) as stop:
        run_inprocess(data, tmp_path, params_10())
    assert stop.value.step == 0 and not (tmp_path / "ckpt" / "latest").exists()


# ----------------------------------------------------------------------------- 2 processes: signals, a hang

LAUNCH = """
import os, time
import pipeline.training.train as T
from pipeline.io import run_cli

if os.environ.get("TF_PID_DIR"):
    with open(os.path.join(os.environ["TF_PID_DIR"], f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
delay = float(os.environ.get("TF_STEP_SLEEP") or 0)
if delay:
    _accumulate = T.accumulate_gradients
    def accumulate_gradients(*a, **k):
        time.sleep(delay)
        return _accumulate(*a, **k)
    T.accumulate_gradients = accumulate_gradients
run_cli(T.main)
"""


def command(data, outdir: Path, params: dict, *extra: str, grace: float = 120, torchrun: bool = True) -> list[str]:
    plan_path = outdir.parent / f"{outdir.name}-plan.json"
    write_json(plan_path, make_plan(params).to_json())
    script = outdir.parent / "launch_stopping.py"
    script.write_text(textwrap.dedent(LAUNCH))
    # what the train rule runs: the supervisor, then rendezvous, which execs torchrun (or, torchrun=False, the
    # supervisor over tests/forkrun.py's ranks)
    job = [sys.executable, "-m", "pipeline.training.rendezvous", "--params", json.dumps(params), "--plan",
           str(plan_path), "--cpus-per-node", "2", "--"] if torchrun else ranks(2)
    return [sys.executable, "-m", "pipeline.training.launch", "--grace", str(grace), "--", *job, str(script),
            "--params", json.dumps(params), "--plan", str(plan_path), "--train", data["train"], "--val", data["val"],
            "--tokenizer", data["tokenizer"], "--outdir", str(outdir), *extra]


def env(**extra) -> dict:
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # rendezvous finds torchrun on PATH
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PATH=path, **extra)


def run(data, outdir: Path, params: dict) -> None:
    """An uninterrupted run, or a rerun after a stop, to the end (no signal: tests/forkrun.py's ranks)."""
    assert params["hardware"]["nproc_per_node"] == 2
    r = subprocess.run(command(data, outdir, params, torchrun=False), capture_output=True, text=True, env=env(),
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def start(data, outdir: Path, params: dict, **environ) -> subprocess.Popen:
    return subprocess.Popen(command(data, outdir, params), env=env(**environ), cwd=outdir.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, outdir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in logged_steps(outdir)):
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before step {step}: " \
                                    f"{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for step {step}"
        time.sleep(0.05)


def params_2(parallel: str) -> dict:
    """12 steps on 2 processes (2 accumulation micro-steps each); records at 1, 2, 4, 6, 8, 10, 12 (log 2,
    validation 4); checkpoints every 5, so a stop checkpoints a step of its own."""
    return make_params(nproc=2, steps=12, micro_batch=2, log_interval=2, val_interval=4, ckpt_interval=5,
                       parallel=parallel)


@pytest.fixture(scope="module")
def whole_2(data, tmp_path_factory):
    """The uninterrupted 2-process runs, DDP and FSDP."""
    out = {}
    for parallel in ("ddp", "fsdp"):
        out[parallel] = tmp_path_factory.mktemp(f"whole-{parallel}") / "train"
        run(data, out[parallel], params_2(parallel))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel, to_group", [("ddp", False), ("fsdp", False), ("ddp", True)],
                         ids=["ddp-sigusr1", "fsdp-sigusr1", "ddp-sigterm-to-the-group"])
def test_a_stop_signal_stops_cleanly_and_the_rerun_is_exact(data, whole_2, tmp_path, parallel, to_group):
    """SIGUSR1 to the supervisor (or SIGTERM to the job's process group, which torchrun ignores) once a random
    step is logged: the trainers agree on a step boundary, checkpoint it and exit 75 (so does the
    supervisor); the rerun ends with the uninterrupted run's final weights and metric history, bitwise."""
    params, out = params_2(parallel), tmp_path / "train"
    at = random.choice([1, 2, 4, 6, 8])
    proc = start(data, out, params, TF_STEP_SLEEP="0.4")
    try:
        wait_for_step(proc, out, at)
        sent = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGUSR1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_STOPPED, f"step {at}: {output[-4000:]}"
    assert "death signal" not in output  # torchrun did not take the signal (it would tear the workers down)
    stopped = latest_step(out)
    assert at < stopped < 12 and not (out / "final.pt").exists(), (at, stopped)
    assert f"stopped at step {stopped} of this job's target 12" in output
    assert time.monotonic() - sent < 60
    name = f"step_{stopped:06d}" + (".dcp" if parallel == "fsdp" else ".pt")
    assert (out / "ckpt" / name).exists() and not [p for p in out.rglob("*") if ".tmp-" in p.name]
    assert logged_steps(out) == [s for s in (1, 2, 4, 6, 8, 10, 12) if s <= stopped]

    run(data, out, params)
    assert same_weights(whole_2[parallel], out)
    got, want = read_metrics(out), read_metrics(whole_2[parallel])
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert untimed(got) == untimed(want)


@pytest.mark.slow
def test_a_stopped_rank_is_caught_by_the_watchdog_and_the_job_ends(data, tmp_path):
    """SIGSTOP of rank 1 mid-run with hardware.hang_timeout_min 0.25: rank 0's watchdog dumps its stacks and
    exits 70 about 15 s later, the supervisor kills the job at once and exits 70, and no process is left."""
    params = make_params(nproc=2, steps=40, micro_batch=2, val_interval=100, ckpt_interval=100)
    params["hardware"] = {**params["hardware"], "hang_timeout_min": 0.25}
    out = tmp_path / "train"
    proc = start(data, out, params, TF_STEP_SLEEP="0.3", TF_PID_DIR=str(tmp_path))
    try:
        wait_for_step(proc, out, 3)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_HUNG, output[-4000:]
    assert 14 < took < 15 + 15, (took, output[-4000:])
    assert "rank 0 hung: no progress for 15 s (phase step, step " in output
    assert "Thread" in output and "most recent call first" in output  # faulthandler's stacks
    end = time.monotonic() + 10
    while (left := processes_in(tmp_path)) and time.monotonic() < end:
        time.sleep(0.1)
    assert left == []


def test_stop_signals_install_and_restore_ignored_defaults():
    """A trainer started with SIGINT / SIGHUP ignored (the supervisor's launcher) gets their defaults back;
    SIGUSR1 / SIGTERM become stop requests."""
    code = textwrap.dedent("""
        import os, signal
        from pipeline.training.stopping import StopSignals
        s = StopSignals().install()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        print(s.reason())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=env(), preexec_fn=lambda: [signal.signal(s, signal.SIG_IGN)
                                                      for s in (signal.SIGINT, signal.SIGHUP)])
    assert r.returncode == 0 and r.stdout.strip() == "SIGTERM received", r.stderr
    assert stopping.SIGNALS.installed is False  # nothing in this test process installed it


def test_the_stop_vote_travels_with_the_step_counts(data):
    """One process: the vote cast with a step's counts is what stop_agreed reads after it; the counts are
    unchanged by it."""
    from builders import CPU

    from pipeline.data.loader import PackedLoader
    from pipeline.training.step import StepBatches, count_tokens

    steps = StepBatches(PackedLoader(data["train"], 4, seed=0), 2, CPU, prefetch=False)
    assert not steps.stop_agreed()
    batches, counts = steps.next_step(True)
    assert steps.stop_agreed() and counts.tolist() == count_tokens(batches, CPU).tolist() == [256, 256]
    steps.next_step(False)
    assert not steps.stop_agreed()
