"""Run untrusted generated code (HumanEval completions) in a contained child process.

    result = run_program(source, SandboxLimits(timeout_s=10))   # result.passed: it ran to its end, in time

**Pass means the program ran to its end.** The parent draws a random token for each run and hands it to
the child's harness on its stdin, which the harness reads (and replaces by /dev/null) before the
program starts; after the program's last statement returns (for HumanEval: ``check(entry_point)``) the
harness writes the token to a pipe (from its own process only: a forked child running off the end does
not report) and only then exits. The parent scores ``passed`` iff the exit status is 0 **and** the pipe
holds exactly that token. So ``exit()``, ``sys.exit(0)``, ``raise SystemExit``, ``os._exit(0)``, an
``atexit`` handler that exits 0 after a failed assert, or a process that kills itself all fail ("failed
(exit 0 before its end)" when the status was 0): the token is in no argument, environment variable,
file, descriptor or /proc entry the program can read, and printing cannot forge it. (Out of scope, like
any in-process trick: code that rewrites how the tests themselves run — an object whose ``__eq__``
always holds, a ``sys.settrace`` hook that jumps over the asserts, or walking the interpreter's frames
to the harness's token; none of these is an exit.)

Every program runs in its own, fresh ``python -I`` process (isolated mode: no PYTHON* variables, no
user site, the script's directory not on sys.path), started in a new session, inside fresh **network,
PID, IPC and mount namespaces** (``unshare --net --pid --ipc --mount --mount-proc --fork --kill-child``),
with:

* **no network**: only a loopback that is down, so not even a server of ours on 127.0.0.1;
* **its own PID namespace**: it sees none of our processes (no ``/proc/<ppid>/environ``, nothing to
  signal); a ``/bin/sh`` is the namespace's init and when it exits or is killed every process in the
  namespace dies, so no daemon outlives the item;
* **its own IPC namespace**: System V shared memory, semaphores and message queues it creates die with
  the item;
* **a read-only filesystem**: in the private mount namespace every mount is remounted read-only and
  the evaluating user's ``$HOME`` is hidden under an empty tmpfs; the only writable places are one
  tmpfs of ``disk_mb`` and 16384 inodes (memory-backed, gone with the namespace) that holds the working
  directory ``/tmp/work`` (HOME and TMPDIR) and, bound from it, ``/tmp``, ``/var/tmp``, ``/dev/shm``
  and ``/run/lock``: what the program writes anywhere is capped by ``disk_mb`` in total and never
  reaches the host. The interpreter's prefix is bound read-only at ``/tmp/.python`` and run from there
  (the program's uid may not enter where it lives, e.g. a pyenv under /root, and a venv under /tmp is
  hidden);
* **no privileges**: it runs under ``setpriv --no-new-privs`` with an empty capability bounding set
  (no setuid binary, no mount, no remount); as root, also as a **uid of its own** (from a high range no
  account uses, different for each program run by this process) with no groups;
* **rlimits** set by the harness before the program runs: CPU seconds (``cpu_s``, SIGXCPU), address
  space (``memory_mb``: a 10 GB allocation is a MemoryError), processes (``nproc``, threads included:
  ``while True: os.fork()`` stops there — counted per uid, which is why the root mode needs its own
  uid), file size (``output_bytes``: the cap on stdout+stderr, which go to one file the parent opened,
  and on any file the program writes), open files (64) and no core dumps;
* **an aggregate memory bound** as root: a memory cgroup (v1 ``memory.limit_in_bytes`` +
  ``memory.memsw.limit_in_bytes``, or a delegated v2 ``memory.max`` + ``memory.swap.max`` = 0) of
  ``total_memory_mb`` holds the whole item, its tmpfs pages included; when the cgroup cannot be made
  (no writable memory controller) and without root, the bound is ``nproc`` × ``memory_mb`` of address
  space plus ``disk_mb`` of tmpfs;
* a **wall-clock timeout** (``timeout_s``): then the whole process group is killed (SIGKILL), and with
  it the PID namespace;
* an **environment built from nothing** (PATH, LANG, HOME/TMPDIR = its working dir): no variable of
  the parent (tokens, keys) is inherited;
* ``os.system``, ``os.popen``, ``subprocess`` and friends replaced by functions that raise: a program
  that shells out fails (the limits above hold even for one that gets around this, e.g. by ``os.exec*``).

The modes (``isolation()``, recorded in the evaluation report):

* ``"namespaces"``: running as root (as in our containers and CI); the program drops to its own uid.
* ``"user-namespaces"``: not root, where the kernel allows unprivileged user namespaces (``unshare
  --user --map-root-user``): the same namespaces, owned by a new user namespace in which the program is
  a capability-less "root" mapped to the evaluating user; the read-only remount keeps it from writing
  that user's files (without capabilities it cannot remount, and a user namespace it makes itself gets
  every mount locked read-only), the hidden ``$HOME`` from reading the usual token files there, and
  RLIMIT_NPROC counts only the processes in its user namespace (its init shell included, so the limit
  is ``nproc`` + 1). No memory cgroup (see above).
* ``"none"``: neither works (not root and user namespaces forbidden, or no ``unshare``/``setpriv``):
  ``run_program`` refuses to run generated code (``PipelineError``); there is no unisolated mode.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shlex
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
BOUND = "/tmp/.python"  # where the child sees the interpreter's prefix (read-only)
WORK = "/tmp/work"  # the child's working directory, HOME and TMPDIR (on its private tmpfs)
SHARED = ("/var/tmp", "/dev/shm", "/run/lock")  # world-writable places, bound from the private tmpfs
UNSHARE = ["--net", "--pid", "--ipc", "--mount", "--mount-proc", "--fork", "--kill-child"]

# Runs in the child (python -I -c BOOT cfg): token and program from stdin, limits, guards, the program,
# then the token to the result pipe. Stand-alone (it must not import the package: the child has no
# access to our files beyond the interpreter).
BOOT = r'''
import json, os, resource, sys


def _harness():
    cfg = json.loads(sys.argv[1])
    with open(0, "rb", closefd=False) as f:
        token, source = f.read().decode("utf-8").split("\n", 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with open("program.py", "w", encoding="utf-8") as f:
        f.write(source)
    for name, v in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (v, v))
    if os.path.isdir(cfg["bound"] + "/lib"):  # the interpreter's prefix, readable by the program's uid
        def _moved(paths):
            return [cfg["bound"] + p[len(cfg["prefix"]):] if p.startswith(cfg["prefix"]) else p for p in paths]
        sys.path = _moved(sys.path)
        for m in list(sys.modules.values()):  # packages already imported (collections, encodings, ...)
            if isinstance(getattr(m, "__path__", None), list):
                m.__path__[:] = _moved(m.__path__)
        sys.path_importer_cache.clear()

    def _refused(*a, **k):
        raise PermissionError("the sandbox does not allow starting a shell or a subprocess")

    for n in ("system", "popen", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
              "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn",
              "posix_spawnp", "startfile"):
        if hasattr(os, n):
            setattr(os, n, _refused)
    import subprocess
    for n in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, n, _refused)
    sys.argv = ["program.py"]
    # bound now: a program that replaces os.write or os.getpid cannot drop the token
    write, result, getpid, me = os.write, cfg["result_fd"], os.getpid, os.getpid()
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    # Reached only when the program's last statement returned (no exit, no exception): the token says so,
    # from this process only (a forked child that runs off the end is not the program finishing).
    sys.stdout.flush()
    sys.stderr.flush()
    if getpid() == me:
        write(result, token.encode())


_harness()
'''


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole process group killed after it
    cpu_s: int = 10  # RLIMIT_CPU per process
    memory_mb: int = 1024  # RLIMIT_AS per process
    nproc: int = 8  # processes (threads count too) the program may have at once
    output_bytes: int = 1 << 20  # stdout + stderr (and any file it writes): RLIMIT_FSIZE
    open_files: int = 64
    disk_mb: int = 32  # the one tmpfs for its working dir, /tmp, /var/tmp, /dev/shm and /run/lock
    total_memory_mb: int = 2048  # the memory cgroup of the whole item (root only; module docstring)


@dataclass
class SandboxResult:
    passed: bool  # exit status 0 and the harness's token: the program ran to its end, within the limits
    status: str  # "passed", "failed (exit N)", "failed (exit 0 before its end)", "killed (SIGNAME)" or "timeout"
    returncode: int | None
    output: str  # the first output_bytes of stdout + stderr (decoded with replacement)
    seconds: float
    isolation: str

    def to_dict(self) -> dict:
        return asdict(self)


def _setup(uid: int | None, disk_mb: int, cgroups: list[str]) -> str:
    """The namespace init's shell script (root in its namespaces, before the program): join the memory
    cgroups, remount every mount read-only, hide $HOME, then the one private tmpfs and the places bound
    from it. "$0" is the interpreter's prefix, "$1" the evaluating user's home; "$@" after a shift the
    program's command."""
    q = shlex.quote
    owner = f"chown {uid}:{uid} {WORK}; " if uid is not None else ""
    return ("set -e; "  # each step its own command: set -e ignores a failing `a` in `a && b`
            + "".join(f"echo 0 > {q(d)}/cgroup.procs; " for d in cgroups)
            # a private mount namespace: nothing here propagates to the host
            + r'while read -r _ _ _ _ mp _; do case $mp in *\\*) mp=$(printf %b "$mp");; esac; '  # \040: a space
            + 'mount -o remount,bind,ro "$mp"; done < /proc/self/mountinfo; '
            + f"mount -t tmpfs -o size={int(disk_mb)}m,nr_inodes=16384,mode=1777 tmpfs /tmp; "
            + f'mkdir {BOUND}; mount --bind "$0" {BOUND}; mount -o remount,bind,ro {BOUND}; '
            + 'case $1 in /|/tmp|/tmp/*) ;; *) if [ -d "$1" ]; then mount -t tmpfs -o size=64k,mode=755 tmpfs "$1"; '
            + 'fi;; esac; shift; '  # a $HOME under /tmp is hidden already
            + "".join(f"if [ -d {d} ]; then mkdir -p -m 1777 /tmp/.{d[1:].replace('/', '-')}; "
                      f"mount --bind /tmp/.{d[1:].replace('/', '-')} {d}; fi; " for d in SHARED)
            + f"mkdir -m 700 {WORK}; {owner}cd {WORK}; "
            + '"$@"')  # sh stays the namespace's init, the program its child


def _command(mode: str, uid: int | None, cfg: dict, limits: SandboxLimits, cgroups: list[str]) -> list[str]:
    drop = [shutil.which("setpriv"), "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if uid is not None:
        drop += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    user = ["--user", "--map-root-user"] if mode == "user-namespaces" else []
    python = [_bound_interpreter(), "-I", "-c", BOOT, json.dumps(cfg)]
    return [shutil.which("unshare"), *user, *UNSHARE, "/bin/sh", "-c", _setup(uid, limits.disk_mb, cgroups),
            cfg["prefix"], os.path.expanduser("~"), *drop, "--", *python]


def isolation() -> str:
    """"namespaces" (root), "user-namespaces" (not root, user namespaces allowed) or "none" (module
    docstring): whether the whole setup of a run works here, tried once with `true` as the program."""
    return _probe()[0]


@lru_cache(maxsize=1)
def _probe() -> tuple[str, str]:
    """(isolation(), why "none": the setup's first line of error)."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "none", "no unshare/setpriv (util-linux) on PATH"
    mode = "namespaces" if os.geteuid() == 0 else "user-namespaces"
    user = ["--user", "--map-root-user"] if mode == "user-namespaces" else []
    setpriv = [shutil.which("setpriv"), "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    try:
        r = subprocess.run([shutil.which("unshare"), *user, *UNSHARE, "/bin/sh", "-c", _setup(None, 1, []),
                            sys.base_prefix, os.path.expanduser("~"), *setpriv, "--", "/bin/true"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           timeout=30, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        return (mode, "") if r.returncode == 0 else ("none", (r.stderr.strip().splitlines() or ["failed"])[0])
    except (OSError, subprocess.SubprocessError) as e:
        return "none", str(e)


def check_isolation(mode: str | None = None) -> str:
    """The sandbox's mode (`isolation()`, or `mode` forced by tests); PipelineError where generated code
    must not run: no working namespaces, or the unprivileged mode as root (root's processes are not
    counted by RLIMIT_NPROC: a fork bomb would not be contained)."""
    mode = mode or isolation()
    if mode == "namespaces" and os.geteuid() == 0 or mode == "user-namespaces" and os.geteuid() != 0:
        return mode
    why = f" ({_probe()[1]})" if _probe()[1] else ""
    if os.geteuid() == 0:
        raise PipelineError("the HumanEval sandbox runs as root but cannot set itself up here: `unshare --net --pid "
                            "--ipc --mount` with read-only remounts and tmpfs mounts is refused (e.g. a container "
                            f"without CAP_SYS_ADMIN) or util-linux's unshare/setpriv are missing{why}; allow them, or "
                            "remove humaneval from eval.chat_tasks")
    raise PipelineError("the HumanEval sandbox cannot isolate generated code here: not root and `unshare --user "
                        "--map-root-user --net --pid --ipc --mount` is refused (user namespaces disabled, e.g. "
                        "kernel.unprivileged_userns_clone=0 or user.max_user_namespaces=0) or util-linux's "
                        f"unshare/setpriv are missing{why}; run the evaluation as root, allow unprivileged user "
                        "namespaces, or remove humaneval from eval.chat_tasks")


def _bound_interpreter() -> str:
    """The base interpreter as the child sees it, under BOUND: the private tmpfs hides /tmp, where a venv (a
    clone in /tmp) may keep sys.executable, and $HOME (pyenv); the bound prefix holds the real binary."""
    real, prefix = os.path.realpath(getattr(sys, "_base_executable", sys.executable)), os.path.realpath(sys.base_prefix)
    return BOUND + real[len(prefix):] if real.startswith(prefix + os.sep) else sys.executable


def _memory_cgroups(limits: SandboxLimits) -> list[str]:
    """New memory cgroups of `total_memory_mb` (swap included) under this process's own, for one run; [] when
    there is no memory controller we may write (not root, read-only cgroupfs, v2 without delegation)."""
    if os.geteuid() != 0:
        return []
    try:
        with open("/proc/self/cgroup") as f:
            mine = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    limit = str(int(limits.total_memory_mb) << 20)
    name = f"tokenfarm-sandbox-{os.getpid()}-{next(_counter)}"
    for m in mounts:
        sep = m.index("-")
        fstype, root, point, opts = m[sep + 1], m[3], m[4], m[sep + 3].split(",")
        v1 = fstype == "cgroup" and "memory" in opts
        path = next((p for _, ctrls, p in mine if ("memory" in ctrls.split(",") if v1 else ctrls == "")), None)
        if not (v1 or fstype == "cgroup2") or path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
            continue
        base = os.path.join(point, path[len(root.rstrip("/")):].lstrip("/"))
        d = os.path.join(base, name)
        try:
            if not v1:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            os.makedirs(d)
            files = (["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"] if v1 else ["memory.max"])
            for fname in files:
                if os.path.exists(os.path.join(d, fname)):
                    with open(os.path.join(d, fname), "w") as f:
                        f.write(limit)
            if not v1 and os.path.exists(os.path.join(d, "memory.swap.max")):
                with open(os.path.join(d, "memory.swap.max"), "w") as f:
                    f.write("0")
            return [d]
        except OSError:
            _remove_cgroups([d])
    return []


def _remove_cgroups(dirs: list[str]) -> None:
    """rmdir each (its processes are dead or dying with their namespace: retried for up to 2 s)."""
    for d in dirs:
        for _ in range(200):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(rc: int | None, timed_out: bool, token_ok: bool) -> str:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "passed" if token_ok else "failed (exit 0 before its end)"
    if rc is not None and rc > 128:  # the init shell reports a killed child as 128 + N
        rc = 128 - rc
    if rc is not None and rc < 0:
        try:
            return f"killed ({signal.Signals(-rc).name})"
        except ValueError:
            return f"killed (signal {-rc})"
    return f"failed (exit {rc})"


def run_program(source: str, limits: SandboxLimits = SandboxLimits(), mode: str | None = None) -> SandboxResult:
    """Run `source` as a program in the sandbox (module docstring); never raises for what the program does,
    raises PipelineError where the sandbox cannot isolate it (`check_isolation`). `mode` (tests): forced."""
    mode = check_isolation(mode)
    uid = UID_BASE + (os.getpid() % 100_000) * 1000 + next(_counter) % 1000 if mode == "namespaces" else None
    # In a user namespace the init shell (its uid 0 too) counts against RLIMIT_NPROC: one more.
    nproc = int(limits.nproc) + (mode == "user-namespaces")
    token = secrets.token_hex(16)
    result_r, result_w = os.pipe()
    cfg = {"prefix": sys.base_prefix, "bound": BOUND, "result_fd": result_w,
           "limits": {"RLIMIT_CPU": int(limits.cpu_s), "RLIMIT_AS": int(limits.memory_mb) << 20,
                      "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": int(limits.output_bytes),
                      "RLIMIT_NOFILE": int(limits.open_files), "RLIMIT_CORE": 0}}
    cgroups = _memory_cgroups(limits)
    private = tempfile.mkdtemp(prefix="tokenfarm-sandbox-out-")  # ours only (0700): the output file
    t0 = time.perf_counter()
    try:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": WORK, "TMPDIR": WORK,
               "PYTHONIOENCODING": "utf-8"}
        out_path = os.path.join(private, "output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(_command(mode, uid, cfg, limits, cgroups), cwd="/", env=env, stdin=subprocess.PIPE,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    pass_fds=(result_w,))
            os.close(result_w)
            result_w = -1
            with contextlib.suppress(BrokenPipeError):  # died before reading it (its setup failed): its status says
                with proc.stdin:
                    proc.stdin.write(f"{token}\n{source}".encode("utf-8", "replace"))  # lone surrogates: "?"
            timed_out = False
            try:
                rc = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            _kill_group(proc.pid)  # also what a finished program left running in its group
            if timed_out:
                proc.wait()
        os.set_blocking(result_r, False)
        try:
            said = os.read(result_r, 4096)
        except BlockingIOError:
            said = b""
        with open(out_path, "rb") as f:
            output = f.read(limits.output_bytes).decode("utf-8", errors="replace")
        status = _describe(rc, timed_out, said == token.encode())
        return SandboxResult(status == "passed", status, rc, output, time.perf_counter() - t0, mode)
    finally:
        for fd in (result_r, result_w):
            if fd >= 0:
                os.close(fd)
        _remove_cgroups(cgroups)
        shutil.rmtree(private, ignore_errors=True)


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program a HumanEval item runs: the prompt (signature, docstring), the completion (the body),
    the task's tests (`check`) and the call that runs them; passed = it ran to its end (every assert held,
    and no exit before: module docstring)."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
