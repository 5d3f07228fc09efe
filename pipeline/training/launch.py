"""The train job owns its processes: the supervisor the train rule runs around torchrun.

Why: torchrun starts every worker in a session of its own, so a signal to the job's process group
(Snakemake killed with ``kill -9 -PGID``, Ctrl-C, a scheduler cancelling the job) reaches torchrun but
not the workers. Killed with SIGKILL, torchrun cannot pass anything on, and its workers trained on,
orphaned, writing checkpoints beside the rerun's. Three mechanisms close that:

* workers die with their parent (`pipeline.training.processes.die_with_parent`, PR_SET_PDEATHSIG);
* this supervisor: it starts the launcher in the job's process group (so the group's signals reach it)
  with PR_SET_PDEATHSIG too, becomes a child subreaper (orphaned descendants are re-parented to it, not
  to PID 1), forwards SIGTERM/SIGINT/SIGHUP to the launcher, kills it with SIGKILL after `--grace`
  seconds, and, once the launcher has exited, kills every descendant still alive before exiting itself
  with the launcher's status (128 + N after signal N);
* one trainer per output directory (`pipeline.training.processes.RunLock`, held by rank 0).

Usage (what the train rule runs)::

    python -m pipeline.training.launch [--grace 10] -- torchrun --standalone --nproc_per_node N -m ...
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time

from pipeline.errors import PipelineError
from pipeline.io import get_logger, run_cli
from pipeline.training.processes import SUPERVISOR_ENV, set_child_subreaper, set_parent_death_signal

__all__ = ["supervise"]

log = get_logger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


def supervise(cmd: list[str], grace: float = 10.0, poll: float = 0.1) -> int:
    """Run `cmd` as described in the module docstring; return its exit code (128 + N if killed by N)."""
    set_child_subreaper()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
    try:
        child = subprocess.Popen(cmd, env=env, preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
    except OSError as e:
        raise PipelineError(f"cannot start {cmd[0]!r}: {e}") from None
    status, deadline, forwarded = None, None, 0
    try:
        while status is None:
            for pid, st in _reap():
                if pid == child.pid:
                    status = st
            if status is not None:
                break
            if len(received) > forwarded:
                sig = received[-1]
                forwarded = len(received)
                log.warning("received %s: stopping %s (SIGKILL after %gs)", signal.Signals(sig).name, cmd[0], grace)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)
                deadline = deadline or time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                _kill_all([child.pid, *_descendants(child.pid)])
                deadline = float("inf")
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
        for s, h in previous.items():
            signal.signal(s, h)
    if received:
        return 128 + received[0]
    return _exit_code(status)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.training.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between forwarding SIGTERM/SIGINT/SIGHUP to the command and killing it")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the launcher command (e.g. torchrun ...)")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given after --")
    raise SystemExit(supervise(cmd, grace=args.grace))


if __name__ == "__main__":
    run_cli(main)
