"""Run untrusted generated code (HumanEval completions) in a contained child process.

    result = run_program(source, SandboxLimits(timeout_s=10))   # result.passed: it ran to its end, in time
    isolation()   # "namespaces" (root), "user-namespaces" (not root) or "none": run_program then refuses

Each program runs in a fresh ``python -I`` inside new network, PID, IPC and mount namespaces (util-linux
``unshare``, ``setsid``, ``setpriv``): a read-only filesystem with $HOME and /run hidden and one size-capped
tmpfs for its writes, no network and no Unix socket of the host (seccomp), no privileges (as root, a uid of
its own), rlimits, an aggregate memory bound, a wall-clock timeout, an environment built from nothing, and
an audit hook that refuses starting processes and loading native code. It passes iff it exits 0 after its
last statement returned (HumanEval's ``check(f)`` sees f's results as plain data only): a random token, kept
in secret memory the program has no handle on, reaches the parent only then. What each layer holds, the
attacks it is tested with and what is out of scope: docs/sandbox.md.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import struct
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

# The first stage in the child (python -I -S -c STAGE cfg python -I -c BOOT cfg): installs the seccomp filter
# (`seccomp_filter`), puts the token (the first 32 bytes of stdin) into secret memory (memfd_secret: not readable
# even through /proc/self/mem; a plain memfd where the kernel lacks it) at cfg.secret_fd, then execs the
# harness. It is the only process that loads ctypes: the program's interpreter never has it.
STAGE = r"""
import ctypes, json, mmap, os, sys, types
cfg = types.SimpleNamespace(**json.loads(sys.argv[1]))  # the parent's ChildConfig (seccomp and secret_fd only)
libc = ctypes.CDLL(None, use_errno=True)
prog = bytes.fromhex(cfg.seccomp)
buf = ctypes.create_string_buffer(prog, len(prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
if libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, ctypes.addressof(buf))), 0, 0):  # PR_SET_SECCOMP, FILTER
    sys.exit("sandbox: the seccomp filter was refused: " + os.strerror(ctypes.get_errno()))
token = b""
while len(token) < 32:
    chunk = os.read(0, 32 - len(token))
    if not chunk:
        break
    token += chunk
fd = libc.syscall(447, 0)  # memfd_secret (the same number on x86_64 and aarch64)
if fd < 0:
    fd = os.memfd_create("token")
os.ftruncate(fd, 32)
m = mmap.mmap(fd, 32)
m[:] = token.ljust(32)
m.close()
if fd != cfg.secret_fd:
    os.dup2(fd, cfg.secret_fd)
    os.close(fd)
os.set_inheritable(cfg.secret_fd, True)
os.execv(sys.argv[2], sys.argv[2:])
"""

# Runs in the child after STAGE (python -I -c BOOT cfg): the program from stdin, limits, the audit hook, the
# program, then the "ended" event from the harness's own frame. Stand-alone (it must not import the package: the
# child has no access to our files beyond the interpreter).
BOOT = r"""
import json, os, resource, sys, types


def _guard(me, line, result, pid, native):
    # The audit hook: refuses starting processes, walking the heap or other threads' frames, adding hooks,
    # loading native code (`native`) and opening /proc/*/mem; sets `ended` when the harness's frame `me` raises
    # "tokenfarm.ended" from `line` (the program ran to its end), and then, only then and once, writes what the
    # atexit callback hands it (the token) to `result`. It holds the token at no other time.
    ended = []
    getframe, getpid, write, basename, realpath = sys._getframe, os.getpid, os.write, os.path.basename, os.path.realpath
    is_a, as_str, decode, partition = isinstance, str.__str__, bytes.decode, str.partition
    spawn = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile", "subprocess.Popen", "pty.spawn"}
    walks = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
             "sys._current_exceptions", "sys.addaudithook"}

    def text(x):  # a name or path as a plain str (a str subclass could answer our questions its own way)
        return as_str(x) if is_a(x, str) else decode(x, "utf-8", "surrogateescape") if is_a(x, bytes) else ""

    def hook(event, args):
        if event == "tokenfarm.report":
            if ended and getpid() == pid:
                ended.clear()
                try:
                    write(result, args[0])
                except OSError:
                    pass
        elif event == "tokenfarm.ended":
            if getframe(1) is me and me.f_lineno == line and getpid() == pid:
                ended.append(True)
        elif event in spawn:
            raise PermissionError("the sandbox does not allow starting a shell or a subprocess")
        elif event in walks:  # a RuntimeError: sys.addaudithook then quietly adds nothing
            raise RuntimeError(f"the sandbox does not allow {event}")
        elif event == "import" and partition(text(args[0]), ".")[0] in native:
            raise ImportError(f"the sandbox does not allow importing {text(args[0])}")
        elif event == "open":
            path = text(args[0])
            real = realpath(path) if path else ""
            if basename(path) == "mem" or real[:6] == "/proc/" and real[-4:] == "/mem":
                raise PermissionError("the sandbox does not allow reading process memory")
    return hook


def _refused(*a, **k):
    raise PermissionError("the sandbox does not allow starting a shell or a subprocess")


def _plain_results():
    # f -> a function returning f's result as plain data: bool, int, float, complex, str, bytes, None, and tuples,
    # lists, dicts, sets of them (subclasses made their base type, read through the base type's own methods);
    # anything else is a TypeError. Made before the program runs, so it holds the real builtins.
    atoms = (bool, int, float, complex, str, bytes, type(None))
    made = ((int, int.__int__), (float, float.__float__), (complex, complex.__complex__), (str, str.__str__),
            (bytes, bytes.__bytes__))
    tp, sub = type, issubclass
    seqs = ((tuple, tuple.__iter__, tuple), (list, list.__iter__, list), (set, set.__iter__, set),
            (frozenset, frozenset.__iter__, frozenset))
    items = dict.items

    def plain(v, depth):
        t = tp(v)
        for a in atoms:
            if t is a:
                return v
        if depth > 64:
            raise TypeError("the result nests too deep")
        for base, to in made:
            if sub(t, base):
                return to(v)
        for base, it, new in seqs:
            if sub(t, base):
                return new([plain(x, depth + 1) for x in it(v)])
        if sub(t, dict):
            return {plain(k, depth + 1): plain(x, depth + 1) for k, x in items(v)}
        raise TypeError("the candidate's result is not plain data (the sandbox compares only builtin values)")

    def calls(f):
        def candidate(*args, **kwargs):
            return plain(f(*args, **kwargs), 0)
        return candidate
    return calls


def _run(source, cfg, pid, done, box):
    # The program's thread: the hook, the program, the "ended" event from this frame, then the exit handlers (the
    # program's, then the report). Not the main thread, so no code of the program can install a signal handler:
    # one could otherwise read the hook's frame while it holds the token.
    import atexit, io, traceback
    run_exitfuncs, excepthook, getpid, exit_now = atexit._run_exitfuncs, sys.excepthook, os.getpid, os._exit
    audit, me = sys.audit, sys._getframe()
    sys.addaudithook(_guard(me, cfg.ended_line, cfg.result_fd, pid, frozenset(cfg.native)))
    code = 1
    try:
        # HumanEval's last line, check(f), runs from here with f's results made plain data (an object whose __eq__
        # always holds is no pass); the program cannot rebind what this frame holds.
        body, _, last = source.rstrip("\n").rpartition("\n")
        name = last[6:-1] if last.startswith("check(") and last.endswith(")") and last[6:-1].isidentifier() else None
        plain, g = _plain_results(), {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(body if name else source, "program.py", "exec"), g)
        if name:
            g["check"](plain(g[name]))
        audit("tokenfarm.ended")  # ENDED: reached only when the program's last statement returned
        code = 0
    except SystemExit as e:  # what the interpreter would do with it
        code = e.code if e.code is None or isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
        code = code or 0
    except BaseException:
        try:
            excepthook(*sys.exc_info())
        except BaseException:
            traceback.print_exc()
    if getpid() != pid:  # a forked child that ran off the end: its output, its status, no report
        for f in (sys.__stdout__, sys.__stderr__):
            try:
                io.TextIOWrapper.flush(f)
            except BaseException:
                pass
        exit_now(code & 0xFF if isinstance(code, int) else 1)
    try:
        run_exitfuncs()
    finally:
        box.append(code)
        done.release()


def _harness():
    cfg = types.SimpleNamespace(**json.loads(sys.argv[1]))  # the parent's ChildConfig
    if os.path.isdir(cfg.bound + "/lib"):  # the interpreter's prefix, readable by the program's uid
        def _moved(paths):
            return [cfg.bound + p[len(cfg.prefix):] if p.startswith(cfg.prefix) else p for p in paths]
        sys.path = _moved(sys.path)
        for m in list(sys.modules.values()):  # packages already imported (collections, encodings, ...)
            if isinstance(getattr(m, "__path__", None), list):
                m.__path__[:] = _moved(m.__path__)
        sys.path_importer_cache.clear()
    import _posixsubprocess, _thread, atexit, io, mmap, subprocess  # noqa: F401 (subprocess: its import, not ours)
    secret = mmap.mmap(cfg.secret_fd, 32)  # the token, in STAGE's secret memory
    os.close(cfg.secret_fd)
    with open(0, "rb", closefd=False) as f:
        source = f.read().decode("utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with open("program.py", "w", encoding="utf-8") as f:
        f.write(source)
    for name, v in cfg.limits.items():
        resource.setrlimit(getattr(resource, name), (v, v))
    _posixsubprocess.fork_exec = _refused  # what subprocess and multiprocessing start processes with
    # The token leaves through the hook when the exit handlers run: atexit's list is no Python object, and this
    # callback runs after every exit handler of the program.
    atexit.register(sys.audit, "tokenfarm.report", secret)
    del secret
    sys.argv = ["program.py"]
    out, err, flush, exit_now, is_a = sys.stdout, sys.stderr, io.TextIOWrapper.flush, os._exit, isinstance
    done, box = _thread.allocate_lock(), []
    done.acquire()
    _thread.start_new_thread(_run, (source, cfg, os.getpid(), done, box))
    done.acquire()
    for f in (out, err):  # the streams we made (the program may have replaced sys.stdout), by the C method
        try:
            flush(f)
        except BaseException:
            pass
    code = box[-1] if box else 1
    exit_now(int.__and__(code, 0xFF) if is_a(code, int) else 1)  # no finalization: it would run the program's code


_harness()
"""
ENDED_LINE = next(i for i, line in enumerate(BOOT.splitlines(), 1) if "# ENDED:" in line)
# Extension modules the program may not load (the harness loads none of them): native memory access, interpreters
# without our hook, and process creation past it.
NATIVE = ("ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_testbuffer", "_xxsubinterpreters",
          "_xxinterpchannels", "_posixsubprocess")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole process group killed after it
    cpu_s: int = 10  # RLIMIT_CPU per process
    memory_mb: int = 1024  # RLIMIT_AS per process
    nproc: int = 8  # processes (threads count too) the program may have at once
    output_bytes: int = 1 << 20  # stdout + stderr (and any file it writes): RLIMIT_FSIZE
    open_files: int = 64
    disk_mb: int = 32  # the one tmpfs for its working dir, /tmp, /var/tmp, /dev/shm and /run/lock
    total_memory_mb: int = 2048  # the memory cgroup of the whole item (root only; docs/sandbox.md)


@dataclass(frozen=True)
class ChildConfig:
    """What the child's STAGE and BOOT read, passed as JSON on their command lines (they read it back as
    attributes): the prefix and where it is bound, the result and secret fds, the seccomp program, the line
    of BOOT's "ended" event, the native modules refused, and the rlimits."""

    prefix: str
    bound: str
    result_fd: int
    secret_fd: int
    seccomp: str
    ended_line: int
    native: list[str]
    limits: dict[str, int]

    def to_json(self) -> str:
        return json.dumps(asdict(self))


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


def _ipc_sysctls(limits: SandboxLimits) -> dict[str, str]:
    """The item's IPC namespace's limits (written by its init, before the read-only remount; the host's are not
    touched): System V shared memory exists only while attached (so counted in an attacher's RLIMIT_AS), at most
    memory_mb of it; message queues at most 8 x 16 KiB; few semaphores."""
    mem = int(limits.memory_mb) << 20
    return {"shm_rmid_forced": "1", "shmmax": str(mem), "shmall": str(mem // 4096), "shmmni": "64",
            "msgmni": "8", "msgmnb": "16384", "msgmax": "8192", "sem": "32 256 32 8"}


def _setup(uid: int | None, limits: SandboxLimits, cgroups: list[str]) -> str:
    """The namespace init's shell script (root in its namespaces, before the program): join the memory
    cgroups, bound IPC, remount every mount read-only, hide $HOME and /run (where host sockets live), then the
    one private tmpfs and the places bound from it. "$0" is the interpreter's prefix, "$1" the evaluating
    user's home; "$@" after a shift the program's command."""
    q = shlex.quote
    owner = f"chown {uid}:{uid} {WORK}; " if uid is not None else ""
    empty = "mount -t tmpfs -o size=64k,nr_inodes=64,mode=755 tmpfs"
    return ("set -e; "  # each step its own command: set -e ignores a failing `a` in `a && b`
            + "".join(f"echo 0 > {q(d)}/cgroup.procs; " for d in cgroups)
            + "".join(f"echo {q(v)} > /proc/sys/kernel/{k}; " for k, v in _ipc_sysctls(limits).items())
            # a private mount namespace: nothing here propagates to the host
            + r'while read -r _ _ _ _ mp _; do case $mp in *\\*) mp=$(printf %b "$mp");; esac; '  # \040: a space
            + 'mount -o remount,bind,ro "$mp"; done < /proc/self/mountinfo; '
            + f"mount -t tmpfs -o size={int(limits.disk_mb)}m,nr_inodes=16384,mode=1777 tmpfs /tmp; "
            + f'mkdir {BOUND}; mount --bind "$0" {BOUND}; mount -o remount,bind,ro {BOUND}; '
            + f'case $1 in /|/tmp|/tmp/*) ;; *) if [ -d "$1" ]; then {empty} "$1"; '
            + 'fi;; esac; shift; '  # a $HOME under /tmp is hidden already
            + "".join(f"if [ -d {d} ] && [ ! -L {d} ]; then {empty} {d}; mkdir -p {d}/lock; "
                      f"mount -o remount,bind,ro {d}; fi; " for d in ("/run", "/var/run"))
            + "".join(f"if [ -d {d} ]; then mkdir -p -m 1777 /tmp/.{d[1:].replace('/', '-')}; "
                      f"mount --bind /tmp/.{d[1:].replace('/', '-')} {d}; fi; " for d in SHARED)
            + f"mkdir -m 700 {WORK}; {owner}cd {WORK}; "
            + '"$@"')  # sh stays the namespace's init, the program its child


# seccomp (per architecture: AUDIT_ARCH, socket, clone, unshare; clone3 and io_uring_setup are 435 and 425 on both)
_ARCH = {"x86_64": (0xC000003E, 41, 56, 272), "aarch64": (0xC00000B7, 198, 220, 97)}
_NEW_NAMESPACES = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME


def seccomp_filter(machine: str) -> bytes | None:
    """The classic-BPF program the child installs before the harness (None: no filter for this architecture):
    socket(AF_UNIX) is EACCES (no Unix socket of the host, at any path, is reachable); unshare and clone with
    a namespace flag are EPERM, clone3 and io_uring_setup ENOSYS (glibc falls back to clone; io_uring would
    bypass the socket rule), so no new user or IPC namespace escapes the item's limits; other ABIs on the same
    kernel (i386, x32) are EPERM."""
    if machine not in _ARCH:
        return None
    arch, socket_nr, clone_nr, unshare_nr = _ARCH[machine]
    allow, eperm, eacces, enosys = 0x7FFF0000, 0x50000 | 1, 0x50000 | 13, 0x50000 | 38  # SECCOMP_RET_*
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    ops = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm), (ld, 0, 0, 0)]  # seccomp_data: nr @0, arch @4
    if machine == "x86_64":
        ops += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # x32
    for nr, err in ((unshare_nr, eperm), (435, enosys), (425, enosys)):
        ops += [(jeq, 0, 1, nr), (ret, 0, 0, err)]
    ops += [(jeq, 0, 4, socket_nr), (ld, 0, 0, 16), (jeq, 0, 1, 1), (ret, 0, 0, eacces), (ret, 0, 0, allow)]
    ops += [(jeq, 0, 4, clone_nr), (ld, 0, 0, 16), (jset, 0, 1, _NEW_NAMESPACES), (ret, 0, 0, eperm),
            (ret, 0, 0, allow)]
    ops += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in ops)


def _command(mode: str, uid: int | None, cfg: ChildConfig, limits: SandboxLimits, cgroups: list[str]) -> list[str]:
    drop = [shutil.which("setpriv"), "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if uid is not None:
        drop += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    user = ["--user", "--map-root-user"] if mode == "user-namespaces" else []
    python = _bound_interpreter()
    child = [python, "-I", "-S", "-c", STAGE, cfg.to_json(), python, "-I", "-c", BOOT, cfg.to_json()]
    # setsid: the init shell leads its own session and process group inside the PID namespace, so a signal to
    # the program's group (killpg(0)) cannot reach unshare outside it
    return [shutil.which("unshare"), *user, *UNSHARE, shutil.which("setsid"), "/bin/sh", "-c",
            _setup(uid, limits, cgroups), cfg.prefix, os.path.expanduser("~"), *drop, "--", *child]


def isolation() -> str:
    """"namespaces" (root), "user-namespaces" (not root, user namespaces allowed) or "none"
    (docs/sandbox.md): whether the whole setup of a run works here (namespaces, mounts, the seccomp filter,
    secret memory), tried once with `true` as the program."""
    return _probe()[0]


@lru_cache(maxsize=1)
def _probe() -> tuple[str, str]:
    """(isolation(), why "none": the setup's first line of error)."""
    if None in (shutil.which("unshare"), shutil.which("setpriv"), shutil.which("setsid")):
        return "none", "no unshare/setpriv/setsid (util-linux) on PATH"
    if seccomp_filter(platform.machine()) is None:
        return "none", f"no seccomp filter for this architecture ({platform.machine()}; x86_64 and aarch64 have one)"
    mode = "namespaces" if os.geteuid() == 0 else "user-namespaces"
    user = ["--user", "--map-root-user"] if mode == "user-namespaces" else []
    setpriv = [shutil.which("setpriv"), "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    cfg = {"seccomp": seccomp_filter(platform.machine()).hex(), "secret_fd": 3}  # the first stage, then `true`
    stage = [_bound_interpreter(), "-I", "-S", "-c", STAGE, json.dumps(cfg)]
    try:
        r = subprocess.run([shutil.which("unshare"), *user, *UNSHARE, shutil.which("setsid"), "/bin/sh", "-c",
                            _setup(None, SandboxLimits(disk_mb=1), []), sys.base_prefix, os.path.expanduser("~"),
                            *setpriv, "--", *stage, "/bin/true"],
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
    """Run `source` as a program in the sandbox (docs/sandbox.md); never raises for what the program does,
    raises PipelineError where the sandbox cannot isolate it (`check_isolation`). `mode` (tests): forced."""
    mode = check_isolation(mode)
    uid = UID_BASE + (os.getpid() % 100_000) * 1000 + next(_counter) % 1000 if mode == "namespaces" else None
    # In a user namespace the init shell (its uid 0 too) counts against RLIMIT_NPROC: one more; and the harness
    # runs the program in a thread of its own.
    nproc = int(limits.nproc) + (mode == "user-namespaces") + 1  # + the program's thread
    token = secrets.token_hex(16)
    result_r, result_w = os.pipe()
    cfg = ChildConfig(prefix=sys.base_prefix, bound=BOUND, result_fd=result_w, secret_fd=max(result_w, 2) + 1,
                      seccomp=seccomp_filter(platform.machine()).hex(), ended_line=ENDED_LINE, native=list(NATIVE),
                      limits={"RLIMIT_CPU": int(limits.cpu_s), "RLIMIT_AS": int(limits.memory_mb) << 20,
                              "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": int(limits.output_bytes),
                              "RLIMIT_NOFILE": int(limits.open_files), "RLIMIT_CORE": 0, "RLIMIT_MSGQUEUE": 0})
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
                    proc.stdin.write(f"{token}{source}".encode("utf-8", "replace"))  # lone surrogates: "?"
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
    and no exit before: docs/sandbox.md)."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
