"""pipeline.io helpers: progress bars and atomic writes."""
from __future__ import annotations

import sys

import pytest

from pipeline.io import atomic_write, progress


@pytest.mark.parametrize("env, tty, shown", [
    (None, True, True), (None, False, False),  # by default: only on an interactive terminal
    ("1", False, True),                        # forced on: under Snakemake, stderr is a pipe into tee
    ("0", True, False),                        # forced off
])
def test_progress_bar_follows_the_terminal_unless_forced(monkeypatch, env, tty, shown):
    if env is None:
        monkeypatch.delenv("TOKENFARM_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("TOKENFARM_PROGRESS", env)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    bar = progress(range(3), desc="x")
    assert bar.disable is (not shown)
    assert list(bar) == [0, 1, 2]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_write(target) as f:
            f.write("partial")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_write(target) as f:
        f.write("whole")
    assert target.read_text() == "whole" and list(tmp_path.iterdir()) == [target]


WRITER = """
import os, signal, sys, time
from pipeline.io import atomic_write, run_cli

def main(argv):
    with atomic_write(sys.argv[1]) as f:
        f.write("partial")
        f.flush()
        print("writing", flush=True)
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

run_cli(main)
"""


def start_writer(tmp_path, how: str):
    import subprocess

    from builders import ROOT

    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "out" / "x.bin"), how],
                            stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.readline().strip() == "writing"
    return proc


def temps(directory):
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_sigterm_unwinds_a_stage_and_removes_its_temp(tmp_path):
    import signal

    proc = start_writer(tmp_path, "sleep")
    assert len(temps(tmp_path / "out")) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list((tmp_path / "out").iterdir()) == []


def test_temps_of_a_killed_writer_are_swept_by_the_next_writer(tmp_path):
    """SIGKILL leaves the temp behind (nothing can run); the next process writing into the same directory
    removes it, but never a temp of a live process or of another host."""
    import os

    from pipeline import io

    proc = start_writer(tmp_path, "kill")
    proc.wait(timeout=30)
    out = tmp_path / "out"
    (dead,) = temps(out)
    live = out / f".y.bin.tmp-{io._HOST}-{os.getpid()}"
    other_host = out / f".z.bin.tmp-another-host.example-{proc.pid}"
    live.write_text("being written")
    other_host.write_text("being written elsewhere")
    io._swept.discard(out)  # this process has not written there yet
    with atomic_write(out / "x.bin") as f:
        f.write("whole")
    assert temps(out) == sorted([live.name, other_host.name])
    assert (out / "x.bin").read_text() == "whole" and dead not in os.listdir(out)


def test_atomic_dir_is_whole_or_absent_and_a_dead_writers_temp_dir_is_swept(tmp_path):
    import os
    import subprocess
    import sys

    from pipeline import io
    from pipeline.io import atomic_dir

    target = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as d:
            (d / "config.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target) as d:
        (d / "a").write_text("first")
    with pytest.raises(FileExistsError):
        with atomic_dir(target) as d:
            (d / "b").write_text("second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and (target / "a").read_text() == "first"
    with atomic_dir(target, replace=True) as d:
        (d / "b").write_text("second")
    assert [p.name for p in target.iterdir()] == ["b"] and list(tmp_path.iterdir()) == [target]
    # a writer killed with SIGKILL leaves its temp directory; the next writer there removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".model.tmp-{io._HOST}-{int(dead.stdout)}"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "weights").write_text("partial")
    live = tmp_path / f".other.tmp-{io._HOST}-{os.getpid()}"
    live.mkdir()
    io._swept.discard(tmp_path)
    with atomic_dir(tmp_path / "next") as d:
        (d / "c").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", "next", live.name])


def test_outputs_get_the_usual_permissions_whatever_mode_their_writer_chose(tmp_path):
    # safetensors (0.8) creates its file 0600; every output of a stage must be readable like the others
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from pipeline.io import atomic_dir, atomic_path

    umask = os.umask(0o022)
    os.umask(umask)
    with atomic_path(tmp_path / "private.bin") as tmp:
        os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))
    with atomic_dir(tmp_path / "hf") as d:
        save_file({"w": torch.zeros(2)}, d / "model.safetensors")
        (d / "config.json").write_text("{}")
        (d / "run.sh").write_text("")
        os.chmod(d / "run.sh", 0o700)
    usual = 0o666 & ~umask
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "private.bin", *(tmp_path / "hf").iterdir()]}
    assert mode == {"private.bin": usual, "model.safetensors": usual, "config.json": usual,
                    "run.sh": usual | 0o100}  # the execute bit its writer gave it is kept


PLOTTER = """
import sys
from pipeline.evaluation.evaluate import plot_loss
from pipeline.io import run_cli
run_cli(lambda argv: plot_loss([{"step": 1, "loss": 3.0}, {"step": 1, "val_loss": 3.1}], sys.argv[1], 2.5))
"""


def _lock(directory):
    """Make `directory` unwritable for this process: immutable (chattr +i) as root, read-only else."""
    import os
    import subprocess

    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("chattr +i is not supported here")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_an_unwritable_output_directory_is_one_line_naming_it(tmp_path):
    # the evaluation's plot (PIL opens the atomic temp) in a directory made immutable: one error line
    import subprocess

    out = tmp_path / "eval"
    out.mkdir()
    unlock = _lock(out)
    try:
        proc = subprocess.run([sys.executable, "-c", PLOTTER, str(out / "loss.png")], capture_output=True, text=True,
                              timeout=120)
    finally:
        unlock()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith(f"error: cannot write into directory {out}: ") and "chattr -i" in line, line
    assert list(out.iterdir()) == []


def test_a_stage_that_succeeds_ends_its_log_with_its_own_cpu_and_peak_memory():
    """`run_cli`'s last line is the process's CPU (user + sys) and peak RSS, which the data-scale benchmark
    reads per job (Snakemake's benchmark tables sample them); a failing stage ends with its error instead."""
    import subprocess

    from pipeline.io import RESOURCE_LINE

    busy = "import sys; from pipeline.io import run_cli; run_cli(lambda argv: sum(i * i for i in range(3_000_000)))"
    out = subprocess.run([sys.executable, "-c", busy], capture_output=True, text=True, check=True)
    last = out.stderr.strip().splitlines()[-1]
    m = RESOURCE_LINE.search(last)
    assert m, out.stderr
    assert 0.05 < float(m["cpu_s"]) < 60 and float(m["max_rss_mb"]) > 5
    fail = ("from pipeline.io import run_cli; from pipeline.errors import PipelineError\n"
            "def main(argv): raise PipelineError('no such shard')\nrun_cli(main)")
    bad = subprocess.run([sys.executable, "-c", fail], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == "error: no such shard"
    assert not RESOURCE_LINE.search(bad.stderr)
