"""Run untrusted generated code (HumanEval completions) in a contained child process.

    result = run_program(source, SandboxLimits(timeout_s=10))   # result.passed: exit status 0 in time

Every program runs in its own, fresh ``python -I`` process (isolated mode: no PYTHON* variables, no
user site, the script's directory not on sys.path), started in a new session, with:

* a **wall-clock timeout** (``timeout_s``): then the whole process group is killed (SIGKILL), and in
  the namespaced mode the whole PID namespace dies with its init;
* **rlimits** set by the child before the program runs: CPU seconds (``cpu_s``, SIGXCPU), address
  space (``memory_mb``: a 10 GB allocation is a MemoryError), processes (``nproc``), file size
  (``output_bytes``: the cap on stdout+stderr, which go to one file the parent opened, and on any file
  the program writes), open files (64) and no core dumps;
* an **environment built from nothing** (PATH, LANG, HOME/TMPDIR = its working dir): no variable of
  the parent (tokens, keys) is inherited;
* a **fresh temporary working directory** (mode 0700), removed afterwards with everything in it;
* ``os.system``, ``os.popen``, ``subprocess`` and friends replaced by functions that raise: a program
  that shells out fails (the rlimits below hold even for one that gets around this, e.g. by ``os.exec*``).

Namespaced mode (``isolation() == "namespaces"``: running as root with a working ``unshare``, as in
our containers). The child is started as ``unshare --net --pid --mount --mount-proc --fork
--kill-child``: a network namespace with only a loopback that is down (**no network**), its own PID
namespace (it sees none of our processes; when its init exits or is killed every process in it
dies: a fork bomb cannot outlive the item), a private mount namespace in which ``/tmp``,
``/var/tmp`` and ``/dev/shm`` are small empty tmpfs (nothing it writes there persists) and a fresh
``/proc``. Then it drops root: setgroups([]), setgid/setuid to a **uid of its own** (from a high range
no account uses, different for each program run by this process), so it can write only to its
working dir (and the private tmpfs), cannot read our files that are not world-readable, cannot
signal or ptrace any other process, and — because root ignores RLIMIT_NPROC but that uid does not —
``nproc`` bounds its processes (``while True: os.fork()`` stops at ``nproc``).

Fallback (``isolation() == "rlimits"``: not root, or ``unshare`` refused): the same fresh process,
environment, working dir, timeout, output cap and rlimits, as our own user: **no network
isolation** and no private /tmp; RLIMIT_NPROC counts every process of our user, so it is set to
the user's current count + ``nproc``. The evaluation report records which mode ran (``isolation``).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache

from pipeline.errors import PipelineError

# The sandbox uids: a high range no account uses (uid_t is 32 bits; 2**31 + run counter).
UID_BASE = 2_000_000_000
_counter = itertools.count()
BOUND = "/tmp/.python"  # where the namespaced child sees the interpreter's prefix (read-only)

# Runs in the child (python -I -c BOOT cfg): limits, privileges, guards, then the program. Stand-alone
# (it must not import the package: the child has no access to our files beyond the interpreter).
BOOT = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
if cfg["nproc_relative"]:
    uid = os.getuid()
    mine = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status") as f:
                    mine += any(l.startswith("Uid:") and int(l.split()[1]) == uid for l in f)
            except OSError:
                pass
    cfg["limits"]["RLIMIT_NPROC"] += mine
for name, v in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (v, v))
if cfg["bound"] and os.path.isdir(cfg["bound"] + "/lib"):  # the interpreter's prefix, readable after setuid
    def _moved(paths):
        return [cfg["bound"] + p[len(cfg["prefix"]):] if p.startswith(cfg["prefix"]) else p for p in paths]
    sys.path = _moved(sys.path)
    for _m in list(sys.modules.values()):  # packages already imported (collections, encodings, ...)
        if isinstance(getattr(_m, "__path__", None), list):
            _m.__path__[:] = _moved(_m.__path__)
    sys.path_importer_cache.clear()
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
with open("program.py", encoding="utf-8") as f:
    source = f.read()

def _refused(*a, **k):
    raise PermissionError("the sandbox does not allow starting a shell or a subprocess")

for _n in ("system", "popen", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
           "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn",
           "posix_spawnp", "startfile"):
    if hasattr(os, _n):
        setattr(os, _n, _refused)
import subprocess
for _n in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
    setattr(subprocess, _n, _refused)
del _n, _refused, cfg, json, resource, f
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole process group killed after it
    cpu_s: int = 10  # RLIMIT_CPU per process
    memory_mb: int = 1024  # RLIMIT_AS per process
    nproc: int = 8  # processes (threads count too) the program may have at once
    output_bytes: int = 1 << 20  # stdout + stderr (and any file it writes): RLIMIT_FSIZE
    open_files: int = 64


@dataclass
class SandboxResult:
    passed: bool  # exit status 0 within the timeout
    status: str  # "passed", "failed (exit N)", "killed (SIGNAME)" or "timeout"
    returncode: int | None
    output: str  # the first output_bytes of stdout + stderr (decoded with replacement)
    seconds: float
    isolation: str

    def to_dict(self) -> dict:
        return asdict(self)


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@lru_cache(maxsize=1)
def isolation() -> str:
    """"namespaces" (root and unshare can make net, PID and mount namespaces) or "rlimits" (module docstring)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return "rlimits"
    ok = _works([unshare, "--net", "--pid", "--mount", "--mount-proc", "--fork", "--kill-child", "/bin/sh", "-c",
                 "mount -t tmpfs -o size=1m tmpfs /tmp"])
    return "namespaces" if ok else "rlimits"


def _bound_interpreter() -> str:
    """The base interpreter as the namespaced child sees it, under BOUND: the private tmpfs hides /tmp, where a
    venv (a clone in /tmp) may keep sys.executable; the bound prefix holds the real binary."""
    real, prefix = os.path.realpath(getattr(sys, "_base_executable", sys.executable)), os.path.realpath(sys.base_prefix)
    return BOUND + real[len(prefix):] if real.startswith(prefix + os.sep) else sys.executable


def _command(mode: str, cfg: dict) -> list[str]:
    if mode != "namespaces":
        return [sys.executable, "-I", "-c", BOOT, json.dumps(cfg)]
    python = [_bound_interpreter(), "-I", "-c", BOOT, json.dumps(cfg)]
    # In the new mount namespace (private propagation: nothing leaks out) the world-writable places are
    # replaced by small private tmpfs before the program starts; its cwd (set by Popen) stays on disk.
    # The interpreter's prefix is bound read-only under the private /tmp, so that the program's uid can
    # import the standard library even when the prefix lies under a directory it cannot enter (/root).
    private = ("for d in /tmp /var/tmp /dev/shm; do [ -d $d ] && mount -t tmpfs -o size=4m,mode=1777 tmpfs $d; done; "
               f"mkdir {BOUND} && mount --bind \"$0\" {BOUND} && mount -o remount,bind,ro {BOUND}; ")
    return [shutil.which("unshare"), "--net", "--pid", "--mount", "--mount-proc", "--fork", "--kill-child",
            "/bin/sh", "-c", private + '"$@"', cfg["prefix"], *python]  # sh is the namespace's init, python its child


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(rc: int | None, timed_out: bool, mode: str) -> str:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "passed"
    if mode == "namespaces" and rc is not None and rc > 128:  # the init shell reports a killed child as 128 + N
        rc = 128 - rc
    if rc is not None and rc < 0:
        try:
            return f"killed ({signal.Signals(-rc).name})"
        except ValueError:
            return f"killed (signal {-rc})"
    return f"failed (exit {rc})"


def run_program(source: str, limits: SandboxLimits = SandboxLimits(), mode: str | None = None) -> SandboxResult:
    """Run `source` as a program in the sandbox (module docstring); never raises for what the program does.
    `mode` (tests): force "rlimits"; default `isolation()`."""
    mode = mode or isolation()
    if mode == "rlimits" and os.geteuid() == 0:
        raise PipelineError("the HumanEval sandbox runs as root but `unshare` cannot create network, PID and mount "
                            "namespaces here (root ignores RLIMIT_NPROC, so a fork bomb would not be contained); "
                            "run the evaluation as an unprivileged user, allow unshare, or remove codex_humaneval "
                            "from eval.chat_tasks")
    uid = UID_BASE + (os.getpid() % 100_000) * 1000 + next(_counter) % 1000 if mode == "namespaces" else None
    cfg = {"uid": uid, "nproc_relative": mode != "namespaces", "prefix": sys.base_prefix,
           "bound": BOUND if mode == "namespaces" else None,
           "limits": {"RLIMIT_CPU": int(limits.cpu_s), "RLIMIT_AS": int(limits.memory_mb) << 20,
                      "RLIMIT_NPROC": int(limits.nproc), "RLIMIT_FSIZE": int(limits.output_bytes),
                      "RLIMIT_NOFILE": int(limits.open_files), "RLIMIT_CORE": 0}}
    work = tempfile.mkdtemp(prefix="tokenfarm-sandbox-")
    private = tempfile.mkdtemp(prefix="tokenfarm-sandbox-out-")  # ours only (0700): the output file
    t0 = time.perf_counter()
    try:
        with open(os.path.join(work, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        if uid is not None:
            os.chown(work, uid, uid)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work,
               "PYTHONIOENCODING": "utf-8"}
        out_path = os.path.join(private, "output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(_command(mode, cfg), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            _kill_group(proc.pid)  # also what a finished program left running in its group
            if timed_out:
                proc.wait()
        with open(out_path, "rb") as f:
            output = f.read(limits.output_bytes).decode("utf-8", errors="replace")
        status = _describe(rc, timed_out, mode)
        return SandboxResult(status == "passed", status, rc, output, time.perf_counter() - t0, mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program a HumanEval item runs: the prompt (signature, docstring), the completion (the body),
    the task's tests (`check`) and the call that runs them; exit 0 = every assert held."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
