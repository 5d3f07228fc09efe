"""The train job owns its processes: the supervisor the train rule runs around torchrun.

It starts the launcher in the job's process group, becomes a child subreaper and kills every descendant
still alive once the launcher exits; on SIGUSR1 / SIGTERM / SIGINT / SIGHUP it asks the trainers for a
clean stop (SIGUSR1), gives them ``--grace`` seconds, then kills everything. Its exit code is 75 when every
trainer stopped cleanly, 70 when one hung, else the launcher's.

Usage (what the train rule runs)::

    python -m pipeline.training.launch [--grace 300] -- torchrun --standalone --nproc_per_node N -m ...

Why it is needed and how it finds the trainers: docs/training.md, "The launcher and its processes".
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

from pipeline.errors import PipelineError
from pipeline.io import get_logger, run_cli
from pipeline.training.processes import (
    EXIT_HUNG,
    EXIT_STOPPED,
    STATUS_DIR_ENV,
    STOP_SIGNALS,
    SUPERVISOR_ENV,
    ignore_stop_signals,
    set_child_subreaper,
    set_parent_death_signal,
    worker_statuses,
)

__all__ = ["supervise"]

log = get_logger(__name__)

DEFAULT_GRACE_S = 300.0
# torchrun installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT unless told otherwise: its --signals-to-handle
# (read from PET_SIGNALS_TO_HANDLE; it then sets TORCHELASTIC_SIGNALS_TO_HANDLE, which its agent reads). SIGQUIT
# only: the stop signals stay ignored in the agent.
AGENT_ENV = {"PET_SIGNALS_TO_HANDLE": "SIGQUIT", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGQUIT"}


# ----------------------------------------------------------------------------- the supervisor

def _children(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (from /proc; empty where there is none)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _kill_all(pids) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _reap() -> list[tuple[int, int]]:
    """Reap exited children, without waiting: [(pid, wait status)]."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _launcher_preexec() -> None:
    """In the launcher, before exec: die with the supervisor, ignore the stop signals (docs/training.md)."""
    set_parent_death_signal(signal.SIGKILL)
    ignore_stop_signals()


def supervise(cmd: list[str], grace: float = DEFAULT_GRACE_S, poll: float = 0.1) -> int:
    """Run `cmd` as described in docs/training.md, "The launcher and its processes"; return the job's exit code."""
    set_child_subreaper()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    status_dir = tempfile.mkdtemp(prefix="tokenfarm-job-")
    env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid()), STATUS_DIR_ENV: status_dir}, **AGENT_ENV)
    try:
        child = subprocess.Popen(cmd, env=env, preexec_fn=_launcher_preexec)
    except OSError as e:
        shutil.rmtree(status_dir, ignore_errors=True)
        for s, h in previous.items():
            signal.signal(s, h)
        raise PipelineError(f"cannot start {cmd[0]!r}: {e}") from None
    status, deadline, handled, signalled, hung, killed = None, None, 0, set(), False, False
    try:
        while status is None:
            for pid, st in _reap():
                if pid == child.pid:
                    status = st
            if status is not None:
                break
            workers, exits = worker_statuses(status_dir)
            if not hung and EXIT_HUNG in exits.values():
                hung = True
                log.error("a trainer's watchdog found a hung rank (exit %d): killing the job", EXIT_HUNG)
                _kill_all([child.pid, *_descendants(child.pid)])
            for i in range(handled, len(received)):
                sig = received[i]
                if deadline is None:
                    log.warning("received %s: asking the trainers to stop at their next step boundary (SIGUSR1); "
                                "killing the job in %gs if they have not", signal.Signals(sig).name, grace)
                    deadline = time.monotonic() + grace
                elif sig == signal.SIGINT and signal.SIGINT in received[:i]:
                    log.warning("received SIGINT again: killing the job now")
                    deadline = 0.0
            handled = len(received)
            if deadline is not None and not killed:
                if time.monotonic() > deadline:
                    log.warning("the trainers did not stop within %gs: killing the job", grace)
                    _kill_all([child.pid, *_descendants(child.pid)])
                    killed = True
                elif workers - signalled:
                    alive = set(_descendants(os.getpid()))
                    for pid in sorted(workers - signalled):
                        if pid in alive and pid not in exits:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGUSR1)
                    signalled |= workers
            time.sleep(poll)
    finally:
        child.returncode = 0 if status is None else _exit_code(status)  # reaped here, not by Popen
        # Whatever the launcher left behind (workers re-parented to us as the subreaper) dies now.
        leftovers = _descendants(os.getpid())
        if leftovers:
            log.warning("killing %d process(es) the launcher left running: %s", len(leftovers),
                        " ".join(map(str, leftovers)))
            _kill_all(leftovers)
            end = time.monotonic() + 5
            while _descendants(os.getpid()) and time.monotonic() < end:
                _reap()
                time.sleep(0.02)
            _reap()
        workers, exits = worker_statuses(status_dir)
        shutil.rmtree(status_dir, ignore_errors=True)
        for s, h in previous.items():
            signal.signal(s, h)
    return _job_code(_exit_code(status), workers, exits, hung or EXIT_HUNG in exits.values(),
                     received[0] if killed else None)


def _job_code(launcher: int, workers: set[int], exits: dict[int, int], hung: bool, killed_after: int | None) -> int:
    """The job's exit code (docs/training.md, "The launcher and its processes")."""
    if hung:
        return EXIT_HUNG
    if killed_after is not None:
        return 128 + killed_after
    if launcher != 0 and workers and all(exits.get(pid) == EXIT_STOPPED for pid in workers):
        log.info("the trainers stopped cleanly (exit %d): the next attempt resumes from their checkpoint",
                 EXIT_STOPPED)
        return EXIT_STOPPED
    return launcher


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.training.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                   help="seconds the trainers get to stop cleanly after a SIGUSR1/SIGTERM/SIGINT/SIGHUP before the "
                        "job is killed (their next step boundary and a checkpoint save)")
    p.add_argument("--exec", action="store_true",
                   help="no supervision: become the command with the stop signals ignored (a torchrun agent that srun "
                        "starts on another node: its trainers, not the agent, handle SLURM's signals)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the launcher command (e.g. torchrun ...)")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given after --")
    if args.exec:
        ignore_stop_signals()
        os.execvpe(cmd[0], cmd, dict(os.environ, **AGENT_ENV))
    raise SystemExit(supervise(cmd, grace=args.grace))


if __name__ == "__main__":
    run_cli(main)
