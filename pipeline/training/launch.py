"""The train job owns its processes: a supervisor around the launcher, workers that die with their
parent, and one trainer per output directory.

Why: torchrun starts every worker in a session of its own, so a signal to the job's process group
(Snakemake killed with ``kill -9 -PGID``, Ctrl-C, a scheduler cancelling the job) reaches torchrun but
not the workers. Killed with SIGKILL, torchrun cannot pass anything on, and its workers would train on,
orphaned, writing checkpoints beside the rerun's. Three mechanisms close that, each on its own enough
for the common case:

* **Workers die with their parent** (`die_with_parent`, called first thing by the train CLI):
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the worker when the process that started
  it (torchrun's agent) exits, however it exits. A parent that exited before the call is caught by
  checking for a gone supervisor or adoption by PID 1.
* **A supervisor** (`supervise`, the CLI of this module, which the train rule runs around torchrun):
  it starts the launcher in the job's process group (so the group's signals reach it) with
  PR_SET_PDEATHSIG too, becomes a child subreaper (orphaned descendants are re-parented to it, not to
  PID 1), forwards SIGTERM/SIGINT/SIGHUP to the launcher, kills it with SIGKILL after `grace` seconds,
  and, once the launcher has exited, kills every descendant still alive before exiting itself with the
  launcher's status.
* **A lock** (`RunLock`): the process that writes a run's training outputs (rank 0) holds an exclusive
  ``flock`` on ``<outdir>/.lock`` for the whole run; a second trainer on the same directory fails at
  once with the holder's PID. The kernel releases the lock when the holder dies, SIGKILL included.

Usage (what the train rule runs)::

    python -m pipeline.training.launch [--grace 10] -- torchrun --standalone --nproc_per_node N -m ...

Linux only (prctl); elsewhere the supervisor still forwards signals and cleans up its children, and
workers rely on torchrun's own shutdown.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.io import PipelineError, get_logger, pid_alive

__all__ = ["die_with_parent", "set_parent_death_signal", "supervise", "RunLock", "SUPERVISOR_ENV"]

log = get_logger(__name__)

SUPERVISOR_ENV = "TOKENFARM_SUPERVISOR_PID"  # set by `supervise` for everything it starts
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux; False elsewhere)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with_parent() -> None:
    """Called first by a worker: die (SIGKILL) when the parent that started it exits.

    The parent may already have gone before the call (a kill during start-up): then this process was
    adopted by PID 1 or by the supervisor, or the supervisor itself is gone; in each case it exits now
    rather than train unsupervised.
    """
    if not set_parent_death_signal(signal.SIGKILL):
        return
    supervisor = os.environ.get(SUPERVISOR_ENV)
    orphaned = os.getppid() == 1
    if supervisor and supervisor.isdigit():
        sup = int(supervisor)
        # A worker's parent is torchrun (or the supervisor itself for a single-process launch without
        # torchrun, which sets no LOCAL_RANK); adopted by the supervisor means its launcher is gone.
        orphaned = orphaned or not pid_alive(sup) or (os.getppid() == sup and "LOCAL_RANK" in os.environ)
    if orphaned:
        print(f"error: process {os.getpid()} lost its launcher during start-up; exiting", file=sys.stderr)
        os._exit(1)


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


def _reap(block: bool = False) -> list[tuple[int, int]]:
    """Reap exited children: [(pid, wait status)]."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block and not out else os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def supervise(cmd: list[str], grace: float = 10.0, poll: float = 0.1) -> int:
    """Run `cmd` as described in the module docstring; return its exit code (128 + N if killed by N)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
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


# ----------------------------------------------------------------------------- the lock

def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    return f" ({cmd[:160]})" if cmd else ""


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<directory>/.lock`` holding the holder's PID.

    `acquire` fails with a PipelineError naming the holder's PID when another process holds it. The lock
    lives as long as this object's file descriptor: `release`, or the death of the process (any signal).
    Filesystems without flock support (some network filesystems) get a warning and no lock.
    """

    def __init__(self, directory: str | os.PathLike, what: str = "training run"):
        self.path = Path(directory) / ".lock"
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"PID {holder}{_describe(int(holder))}" if holder.isdigit() else "another process"
                raise PipelineError(
                    f"{self.path.parent} is in use by another {self.what}: {who} holds {self.path}. Two trainers "
                    f"must never write the same directory; wait for it to finish or stop it "
                    f"(kill {holder or '<pid>'}), then rerun"
                ) from None
            log.warning("cannot lock %s (%s): make sure no other %s uses %s", self.path, e, self.what, self.path.parent)
            return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


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
    from pipeline.io import run_cli

    run_cli(main)
