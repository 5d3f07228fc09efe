"""Processes of a training run: workers that die with their parent, the supervisor's view of its trainers.

- `die_with_parent()`: the train CLI calls it first (``PR_SET_PDEATHSIG``, Linux only);
- `register_worker()` / `report_exit(code)`: a trainer's ``<pid>.worker`` and ``<pid>.exit`` files in the
  supervisor's status directory (`STATUS_DIR_ENV`), which pipeline/training/launch.py reads;
- `EXIT_STOPPED` (75: stopped cleanly, resume from its checkpoint), `EXIT_HUNG` (70: the watchdog fired).

Exit codes and why: docs/training.md, "Processes of a training run".
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

from pipeline.io import get_logger, pid_alive

__all__ = ["die_with_parent", "set_parent_death_signal", "set_child_subreaper", "SUPERVISOR_ENV",
           "STATUS_DIR_ENV", "EXIT_STOPPED", "EXIT_HUNG", "STOP_SIGNALS", "ignore_stop_signals", "register_worker",
           "report_exit", "worker_statuses"]

log = get_logger(__name__)

SUPERVISOR_ENV = "TOKENFARM_SUPERVISOR_PID"  # set by the supervisor (launch.py) for everything it starts
STATUS_DIR_ENV = "TOKENFARM_STATUS_DIR"  # the supervisor's status directory (docs/training.md)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly at a checkpoint before the target; rerun to resume
EXIT_HUNG = 70     # the step watchdog fired (a rank made no progress)
# The signals that ask a job to stop: the trainers handle them; the launchers between the supervisor and the
# trainers (torchrun, pipeline.training.rendezvous) ignore them (`ignore_stop_signals`, docs/training.md).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux; False elsewhere)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> bool:
    """Make orphaned descendants of this process its children instead of PID 1's (Linux; False elsewhere)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def ignore_stop_signals() -> None:
    """Ignore `STOP_SIGNALS` in this process and, across exec, in the launcher it becomes (an ignored
    disposition survives exec; a handler does not). The trainer installs its own handlers."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def die_with_parent() -> None:
    """Called first by a worker: die (SIGKILL) when the parent that started it exits.

    Only a process started by torchrun (LOCAL_RANK set) or by the supervisor: one run by hand from a
    shell (`nohup python -m pipeline.training.train … &`) must outlive that shell. The parent may already
    have gone before the call (a kill during start-up): then this process was adopted by PID 1 or by the
    supervisor, or the supervisor itself is gone; in each case it exits now rather than train
    unsupervised.
    """
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if ("LOCAL_RANK" not in os.environ and not supervisor) or not set_parent_death_signal(signal.SIGKILL):
        return
    orphaned = os.getppid() == 1
    if supervisor and supervisor.isdigit():
        sup = int(supervisor)
        # A worker's parent is torchrun (or the supervisor itself for a single-process launch without
        # torchrun, which sets no LOCAL_RANK); adopted by the supervisor means its launcher is gone.
        orphaned = orphaned or not pid_alive(sup) or (os.getppid() == sup and "LOCAL_RANK" in os.environ)
    if orphaned:
        print(f"error: process {os.getpid()} lost its launcher during start-up; exiting", file=sys.stderr)
        os._exit(1)


# ----------------------------------------------------------------------------- the status directory

def _status_file(suffix: str) -> Path | None:
    directory = os.environ.get(STATUS_DIR_ENV)
    return Path(directory) / f"{os.getpid()}{suffix}" if directory else None


def _write_status(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (temp file + rename), ignoring a vanished directory (the supervisor
    is gone: nobody reads it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def register_worker(rank: int | str = "") -> None:
    """Tell the supervisor (if any) that this process takes stop requests (SIGUSR1): call once its handlers
    are installed. Before that a SIGUSR1 would kill it, so the supervisor signals registered workers only."""
    path = _status_file(".worker")
    if path is not None:
        _write_status(path, f"{rank}\n")


def report_exit(code: int) -> None:
    """Tell the supervisor (if any) the code this process is about to exit with (torchrun does not pass it on)."""
    path = _status_file(".exit")
    if path is not None:
        _write_status(path, f"{code}\n")


def worker_statuses(directory: str | os.PathLike) -> tuple[set[int], dict[int, int]]:
    """(registered worker PIDs, {PID: reported exit code}) of a status directory."""
    workers, exits = set(), {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            stem, _, kind = entry.name.partition(".")
            if not stem.isdigit() or kind not in ("worker", "exit"):
                continue
            if kind == "worker":
                workers.add(int(stem))
                continue
            with contextlib.suppress(OSError, ValueError):
                exits[int(stem)] = int(Path(entry.path).read_text(encoding="utf-8").strip())
    return workers, exits
