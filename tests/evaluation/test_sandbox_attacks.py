"""The sandbox's attack table: every completion is a wrong body plus one attack, run as root ("namespaces")
and as `nobody` ("user-namespaces", where the kernel allows them), each asserted *contained* — the item
fails, the attack's own evidence says it did not get through, and the host is checked afterwards: the
listeners (TCP, abstract and path Unix sockets, one of them the user's own) received nothing, no System V
segment or queue of ours is left, no planted file exists, no program process is alive. The IPC rows lift
the ctypes refusal (the namespace's limits are checked on their own). Scores on the default run's HumanEval
items: `TOKENFARM_SANDBOX_ITEMS=1` (all 164 canonical solutions pass; wrong bodies and always-equal
results fail; docs/sandbox.md)."""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from pipeline.evaluation import sandbox
from pipeline.evaluation.sandbox import SandboxLimits, humaneval_program, isolation, run_program

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or isolation() != "namespaces",
                                reason="the attack table runs as root (namespaces) and from there as nobody")

NOBODY = 65534
FAST = SandboxLimits(timeout_s=5, cpu_s=3, memory_mb=512, nproc=8, output_bytes=64 << 10, disk_mb=8)
# a bound of 2 x 160 MB of address space + 8 MB of tmpfs, which SysV shared memory must not get past
SHM_LIMITS = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=160, nproc=2, output_bytes=64 << 10, disk_mb=8)
PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
WRONG = "    return a - b\n"
WITH_CTYPES = tuple(n for n in sandbox.NATIVE if "ctypes" not in n)
TRY = '''
def attempt(name, f):
    try:
        print(name, 'ok', f(), flush=True)
    except BaseException as e:
        print(name, 'refused', type(e).__name__, e, flush=True)
'''
CTYPES = '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes, libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
libc.shmdt.argtypes = [ctypes.c_void_p]
libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
'''
FORGE = '''
import os
def spray(found):  # everything found, to every descriptor (one of them is the result pipe)
    blob = b'\\n'.join(x if isinstance(x, bytes) else str(x).encode() for x in found)
    for fd in range(3, 1024):
        try:
            os.write(fd, blob)
        except OSError:
            pass
'''
# indented as the attacks below are, so that one dedent makes a program of both
TRY, CTYPES, FORGE = (textwrap.indent(code, " " * 12) for code in (TRY, CTYPES, FORGE))


class Host:
    """What the attacks aim at on the host: listeners, planted paths, IPC keys, a secret home."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:12]
        self.anywhere = tempfile.mkdtemp(prefix="tokenfarm-sandbox-socks-", dir="/")  # not /tmp, /run or $HOME
        os.chmod(self.anywhere, 0o1777)
        self.own = tempfile.mkdtemp(prefix="tokenfarm-sandbox-own-", dir="/")  # like /run/user/$UID: nobody's, 0700
        self.run = tempfile.mkdtemp(prefix="tokenfarm-sandbox-run-", dir="/run")  # like /var/run/docker.sock
        os.chmod(self.run, 0o1777)
        self.home = tempfile.mkdtemp(prefix="tokenfarm-sandbox-home-", dir="/")
        Path(self.home, "token").write_text("hf_file_secret_17")
        for d in (self.own, self.home, os.path.join(self.home, "token")):
            os.chown(d, NOBODY, NOBODY)
        self.listeners, self.paths = [], {}
        for name, d, kind in (("anywhere", self.anywhere, socket.SOCK_STREAM), ("run", self.run, socket.SOCK_STREAM),
                              ("own", self.own, socket.SOCK_STREAM), ("dgram", self.anywhere, socket.SOCK_DGRAM)):
            s = socket.socket(socket.AF_UNIX, kind)
            path = os.path.join(d, f"{name}.sock")
            s.bind(path)
            os.chmod(path, 0o777)
            if name == "own":
                os.chown(path, NOBODY, NOBODY)
            if kind == socket.SOCK_STREAM:
                s.listen(8)
            s.setblocking(False)
            self.listeners.append(s)
            self.paths[name] = path
        s = socket.socket(socket.AF_UNIX)
        s.bind(f"\0tokenfarm-sandbox-{self.tag}")
        s.listen(8)
        s.setblocking(False)
        self.listeners.append(s)
        tcp = socket.socket()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        tcp.setblocking(False)
        self.listeners.append(tcp)
        self.port = tcp.getsockname()[1]
        self.key = random.randrange(1 << 28, 1 << 30)
        self.sysctls = self.ipc_sysctls()  # the host's IPC limits, unchanged afterwards
        mark = f"tokenfarm-sandbox-planted-{self.tag}"
        self.private = [f"{d}/{mark}" for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)]
        self.planted = self.private + [f"{self.anywhere}/{mark}", f"/{mark}", f"{self.home}/{mark}", f"/etc/{mark}"]

    def received(self) -> list[str]:
        """Listeners that got a connection or a datagram."""
        got = []
        for s in self.listeners:
            try:
                if s.type == socket.SOCK_DGRAM:
                    s.recv(1 << 16)
                else:
                    s.accept()[0].close()
                got.append(str(s.getsockname()))
            except BlockingIOError:
                pass
        return got

    @staticmethod
    def ipc_sysctls() -> dict[str, str]:
        return {k: Path(f"/proc/sys/kernel/{k}").read_text() for k in sandbox._ipc_sysctls(FAST)}

    def ipc_left(self) -> list[str]:
        keys = set(range(self.key, self.key + 64))
        return [line for f in ("shm", "msg") for line in Path(f"/proc/sysvipc/{f}").read_text().splitlines()[1:]
                if int(line.split()[0]) in keys]

    def close(self):
        for s in self.listeners:
            s.close()
        for t in self.planted:
            if os.path.exists(t):
                os.remove(t)
        for line in self.ipc_left():
            kind = "-M" if len(line.split()) > 14 else "-Q"
            subprocess.run(["ipcrm", kind, line.split()[0]], capture_output=True)
        for d in (self.anywhere, self.own, self.run, self.home):
            shutil.rmtree(d, ignore_errors=True)


def program(attack: str) -> str:
    """A wrong completion of `add`, then `attack` at module level (before the tests run)."""
    return humaneval_program(PROMPT, WRONG + textwrap.dedent(attack) + "\n", TEST, "add")


def attacks(h: Host) -> dict[str, tuple[str, SandboxLimits, bool]]:
    """name -> (module-level attack after a wrong body, limits, whether ctypes is let through)."""
    p = h.paths
    disk = SandboxLimits(timeout_s=5, cpu_s=3, memory_mb=512, output_bytes=1 << 20, disk_mb=8)
    bomb = SandboxLimits(timeout_s=3, cpu_s=3, nproc=8, output_bytes=64 << 10)
    return {
        "exit()": ("exit()", FAST, False),
        "sys.exit(0)": ("import sys\nsys.exit(0)", FAST, False),
        "raise SystemExit": ("raise SystemExit(0)", FAST, False),
        "os._exit(0)": ("import os\nos._exit(0)", FAST, False),
        "atexit exit 0": ("import atexit, os\natexit.register(os._exit, 0)", FAST, False),
        "printed markers": ("print('passed', 'ok', 'PASS', 0)\nimport os\nos._exit(0)", FAST, False),
        "self-kill": ("import os\nos.kill(os.getpid(), 9)", FAST, False),
        "signals": ('''
            import os, signal
            for pid in (-1, 1, os.getppid()):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            os.killpg(0, signal.SIGKILL)''', FAST, False),
        "fork bomb": ('''
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass''', bomb, False),
        "disk fill": ('''
            n = 0
            try:
                while True:
                    open(f'/tmp/f{n}', 'wb').write(b'x' * (1 << 19))
                    n += 1
            except OSError as e:
                print('disk stopped at', n / 2, 'MiB', e)''', disk, False),
        "output flood": ("for _ in range(256):\n    print('x' * (1 << 20))", FAST, False),
        "tcp": (TRY + f'''
            import socket
            attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {h.port}), timeout=2))''', FAST, False),
        "abstract socket": (TRY + f'''
            import socket
            attempt('abstract', lambda: socket.socket(socket.AF_UNIX).connect('\\0tokenfarm-sandbox-{h.tag}'))''',
                            FAST, False),
        "unix sockets": (TRY + f'''
            import socket
            def connect(path):
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(2)
                s.connect(path)
                s.sendall(b'pwned')
            for name, path in {[(n, p[n]) for n in ("anywhere", "run", "own")]!r}:
                attempt(name, lambda: connect(path))
            attempt('dgram', lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', {p['dgram']!r}))
            attempt('docker', lambda: connect('/var/run/docker.sock'))
            attempt('pair', lambda: len(socket.socketpair()))''', FAST, False),
        "sysv shm past the bound": (CTYPES + f'''
            for i in range(6):  # 600 MB through 100 MB segments, each detached after use
                sid = libc.shmget({h.key} + i, 100 << 20, 0o1000 | 0o600)  # IPC_CREAT
                if sid < 0:
                    print('shmget', ctypes.get_errno())
                    continue
                addr = libc.shmat(sid, None, 0)
                if addr in (None, 2**64 - 1):
                    print('shmat', ctypes.get_errno())
                    continue
                ctypes.memset(addr, 1, 100 << 20)
                libc.shmdt(addr)
            rows = open('/proc/sysvipc/shm').read().splitlines()[1:]
            print('held', sum(int(r.split()[14]) for r in rows), 'in', len(rows), 'segments')''', SHM_LIMITS, True),
        "sysv message queues": (CTYPES + f'''
            msg = ctypes.create_string_buffer(8 + 8192)
            msg[0] = b'\\x01'
            queues = sent = 0
            for i in range(40):
                q = libc.msgget({h.key} + 32 + i, 0o1000 | 0o600)
                if q < 0:
                    continue
                queues += 1
                while libc.msgsnd(q, msg, 8192, 0o4000) == 0:  # IPC_NOWAIT
                    sent += 8192
            print('queues', queues, 'bytes', sent)''', FAST, True),
        "new namespaces": (CTYPES + '''
            for flags in (0x10000000, 0x08000000, 0x18000000):  # CLONE_NEWUSER, CLONE_NEWIPC
                print('unshare', hex(flags), libc.unshare(flags), ctypes.get_errno())
            import threading
            t = threading.Thread(target=print, args=('thread ran',))
            t.start()
            t.join()''', FAST, True),
        "writes": (f'''
            wrote = []
            for t in {h.planted!r}:
                try:
                    open(t, 'w').write('pwned')
                    wrote.append(t)
                except OSError:
                    pass
            print('wrote', wrote)''', FAST, False),
        "parent environ": ('''
            import glob, os
            print(dict(os.environ))
            for p in glob.glob('/proc/*/environ'):
                try:
                    print(open(p, 'rb').read())
                except OSError:
                    pass''', FAST, False),
        "private files": (TRY + f'''
            attempt('home', lambda: open({h.home + '/token'!r}).read())''', FAST, False),
        "frame walk": ('''
            import os, sys
            f = sys._getframe(1).f_locals
            os.write(f['result'], f['token'].encode())
            os._exit(0)''', FAST, False),
        "every frame": (FORGE + '''
            import sys
            found, f = [], sys._getframe(0)
            while f:
                for d in (f.f_locals, f.f_globals):
                    found += [v for v in d.values() if isinstance(v, (str, bytes, int))]
                f = f.f_back
            spray(found)
            os._exit(0)''', FAST, False),
        "gc walk": (FORGE + TRY + '''
            import gc
            attempt('gc', lambda: spray([o for o in gc.get_objects() if isinstance(o, (str, bytes))]))
            os._exit(0)''', FAST, False),
        "early exit handlers": (FORGE + TRY + '''
            import atexit, sys
            seen = []
            attempt('hook', lambda: sys.addaudithook(lambda e, a: seen.append(a)))
            sys.settrace(lambda f, e, a: seen.append(f.f_locals) or None)
            atexit._run_exitfuncs()
            sys.settrace(None)
            spray([bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else v
                   for a in seen for v in (a.values() if isinstance(a, dict) else a)])
            os._exit(0)''', FAST, False),
        "signal at the report": (TRY + '''
            import atexit, os, signal
            def grab(sig, frame):  # the audit hook's arguments, read while it holds the token at the report
                args = frame.f_locals.get('args') if frame.f_code.co_name == 'hook' else None
                if args and not isinstance(args[0], str):
                    print('got', bytes(args[0]), flush=True)
                    os._exit(0)
            attempt('handler', lambda: signal.signal(signal.SIGALRM, grab))
            signal.setitimer(signal.ITIMER_REAL, 0.00002, 0.00002)
            atexit._run_exitfuncs()
            os._exit(0)''', FAST, False),
        "/proc/self/mem": (FORGE + TRY + '''
            def scan():
                found = []
                with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb') as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                        try:
                            mem.seek(lo)
                            found.append(mem.read(hi - lo))
                        except OSError:
                            pass
                spray(found)
            attempt('mem', scan)
            os._exit(0)''', FAST, False),
        "memory scan": (TRY + '''
            import os, re
            os.mkdir('/tmp/d')
            os.symlink('/proc/self/mem', '/tmp/d/x')
            def scan():
                found, size = set(), 0
                maps = open('/proc/self/maps').read()
                print('secretmem mapped', 'secretmem' in maps, flush=True)
                mem = os.open('x', os.O_RDONLY, dir_fd=os.open('/tmp/d', os.O_RDONLY))  # past the path check
                for line in maps.splitlines():
                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                    if line.split()[1].startswith('---'):  # reserved, never written (malloc's arena of a thread)
                        continue
                    try:
                        chunk = os.pread(mem, min(hi - lo, 64 << 20), lo)
                    except (OSError, OverflowError):
                        continue
                    size += len(chunk)
                    found.update(re.findall(rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', chunk))
                return size, sorted(found)
            attempt('scan', scan)''', FAST, False),
        "always-equal": ('''
            class Any:
                __eq__ = lambda s, o: True
                __ne__ = lambda s, o: False
            add = lambda a, b: Any()''', FAST, False),
        "always-equal subclass": ('''
            class I(int):
                __eq__ = lambda s, o: True
                __ne__ = lambda s, o: False
            class L(list):
                __iter__ = lambda s: iter([5])
            add = lambda a, b: I(7) if a == 2 else L([I(7)])''', FAST, False),
        "ctypes": (TRY + '''
            import glob, importlib.util
            attempt('ctypes', lambda: __import__('ctypes'))
            path = glob.glob('/tmp/.python/lib/python3*/lib-dynload/_ctypes*')
            attempt('by path', lambda: importlib.util.module_from_spec(
                importlib.util.spec_from_file_location('_ctypes', path[0])))''', FAST, False),
        "exec": (TRY + '''
            import os, posix, subprocess, _posixsubprocess
            sh = ['/bin/sh', '-c', 'exit 0']
            attempt('posix.execv', lambda: posix.execv('/bin/sh', sh))
            attempt('os.execv', lambda: os.execv('/bin/sh', sh))
            attempt('os.execve', lambda: os.execve('/bin/sh', sh, {}))
            attempt('os.spawnv', lambda: os.spawnv(os.P_WAIT, '/bin/sh', sh))
            attempt('os.posix_spawn', lambda: os.posix_spawn('/bin/sh', sh, {}))
            attempt('os.system', lambda: os.system('exit 0'))
            attempt('subprocess', lambda: subprocess.run(sh))
            attempt('fork_exec', lambda: _posixsubprocess.fork_exec(*([None] * 23)))''', FAST, False),
    }


def contained(name: str, r: dict, h: Host) -> None:
    """The item failed and the attack's own evidence says it did not get through (the host is checked apart)."""
    out = r["output"]
    assert not r["passed"], (name, r)
    if name in ("exit()", "sys.exit(0)", "raise SystemExit", "os._exit(0)", "atexit exit 0", "printed markers",
                "frame walk", "every frame", "gc walk", "early exit handlers", "/proc/self/mem"):
        assert r["status"] in ("failed (exit 0 before its end)", "failed (exit 1)"), (name, r)
    if name == "signal at the report":  # no handler: the program runs in a thread of its own
        assert "handler refused ValueError" in out and "got" not in out, out
    if name in ("self-kill", "signals"):  # killed inside: the init reports 128 + 9; -9 would be unshare itself
        assert r["returncode"] == 137 and r["status"] == "killed (SIGKILL)", (name, r)
    if name == "disk fill":
        assert "No space left on device" in out and float(out.split("disk stopped at ")[1].split()[0]) <= 8, out
    if name == "output flood":
        assert len(out.encode()) <= FAST.output_bytes
    if name in ("tcp", "abstract socket", "unix sockets", "private files", "ctypes", "exec", "gc walk",
                "/proc/self/mem"):
        lines = [line for line in out.splitlines() if " ok " in line or " refused " in line]
        assert lines and all(" refused " in line for line in lines if line.split()[0] not in ("pair", "os.spawnv")), \
            (name, out)
    if name == "unix sockets":
        assert out.count("PermissionError") == 5 and "pair ok 2" in out, out
    if name == "exec":
        assert out.count("does not allow") == 7 and "os.spawnv ok 127" in out, out  # spawnv: its child's exec
    if name == "sysv shm past the bound":
        held = int(out.split("held ")[1].split()[0])
        assert held <= SHM_LIMITS.memory_mb << 20 and "shmget" not in out, out  # made, used, and gone on shmdt
    if name == "sysv message queues":
        queues, sent = int(out.split("queues ")[1].split()[0]), int(out.split("bytes ")[1].split()[0])
        assert 0 < queues <= 8 and sent <= 8 * 16384, out
    if name == "new namespaces":
        assert out.count("unshare") == 3 and all(line.split()[2:] == ["-1", "1"] for line in out.splitlines()
                                                   if line.startswith("unshare")) and "thread ran" in out, out
    if name == "writes":
        wrote = out.split("wrote ")[1].splitlines()[0]
        hidden = {f"{h.home}/{os.path.basename(h.private[0])}"}  # nobody's home is an empty tmpfs of its own
        assert set(h.private) <= set(eval(wrote)) <= set(h.private) | hidden, out  # only its own tmpfs
    if name in ("parent environ",):
        assert "hf_attack_secret_42" not in out
    if name in ("always-equal", "always-equal subclass"):
        assert "not plain data" in out or "AssertionError" in out, out
    if name == "memory scan":  # the token: KNOWN (the test's draw); secret memory is not even in /proc/self/mem
        assert "scan ok" in out and KNOWN not in out, out
        assert "secretmem mapped True" in out or not SECRETMEM, out
    if name == "private files":
        assert "hf_file_secret_17" not in out and ("FileNotFoundError" in out or "PermissionError" in out), out


KNOWN = "0123456789abcdef" * 2  # the token the tests draw (a real run draws secrets.token_hex(16))


def memfd_secret() -> bool:
    import ctypes

    fd = ctypes.CDLL(None, use_errno=True).syscall(447, 0)
    if fd >= 0:
        os.close(fd)
    return fd >= 0


SECRETMEM = memfd_secret()


def host_clean(h: Host) -> None:
    assert h.received() == []
    assert h.ipc_left() == [] and h.ipc_sysctls() == h.sysctls
    assert [t for t in h.planted if os.path.exists(t)] == []
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    assert [line for line in ps.splitlines() if "tokenfarm.ended" in line] == []


@pytest.fixture(scope="module")
def host():
    h = Host()
    yield h
    h.close()


def run_attack(body: str, limits: SandboxLimits, lift: bool) -> dict:
    saved = sandbox.NATIVE
    sandbox.NATIVE = WITH_CTYPES if lift else saved
    try:
        return run_program(program(body), limits).to_dict()
    finally:
        sandbox.NATIVE = saved


# Runs as `nobody` (python -c, the checkout on PYTHONPATH): the attacks from stdin, every result as one JSON line.
AS_NOBODY = r'''
import json, sys
from pipeline.evaluation import sandbox
from pipeline.evaluation.sandbox import NATIVE, SandboxLimits, isolation, run_program
table, known = json.loads(sys.stdin.read())
sandbox.secrets.token_hex = lambda n: known
if isolation() == "none":
    print(json.dumps({"mode": "none"}))
    sys.exit(0)
out = {"mode": isolation()}
for name, (src, limits, lift) in table.items():
    sandbox.NATIVE = tuple(n for n in NATIVE if "ctypes" not in n) if lift else NATIVE
    out[name] = run_program(src, SandboxLimits(**limits)).to_dict()
print(json.dumps(out))
'''


@pytest.mark.slow  # every attack a sandboxed process
def test_every_attack_is_contained_as_root(host, monkeypatch):
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda n: KNOWN)
    monkeypatch.setenv("HF_TOKEN", "hf_attack_secret_42")
    monkeypatch.setenv("HOME", host.home)  # the evaluating user's home, hidden
    results = {name: run_attack(body, limits, lift) for name, (body, limits, lift) in attacks(host).items()}
    for name, r in results.items():
        assert r["isolation"] == "namespaces"
        contained(name, r, host)
    host_clean(host)
    assert run_program(humaneval_program(PROMPT, "    return a + b\n", TEST, "add"), FAST).passed


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="switching to nobody needs setpriv")
@pytest.mark.slow
def test_every_attack_is_contained_as_nobody(host):
    checkout = str(Path(sandbox.__file__).resolve().parents[2])
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    cmd = [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-I", "-c"]
    env = {"PATH": "/usr/bin:/bin", "HOME": host.home, "HF_TOKEN": "hf_attack_secret_42"}
    ok = subprocess.run([*cmd, "import sys; sys.path.insert(0, sys.argv[1]); import pipeline.evaluation.sandbox",
                         checkout], env=env, capture_output=True)
    if ok.returncode != 0:
        pytest.skip(f"`nobody` cannot run {python} with {checkout} (not world-readable here): {ok.stderr[-200:]!r}")
    table = {name: (program(body), limits.__dict__, lift) for name, (body, limits, lift) in attacks(host).items()}
    r = subprocess.run([*cmd, f"import sys; sys.path.insert(0, {checkout!r})\n" + AS_NOBODY], env=env,
                       input=json.dumps([table, KNOWN]), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    if out["mode"] == "none":
        pytest.skip("the kernel refuses unprivileged user namespaces here: the sandbox refuses as nobody "
                    "(tests/evaluation/test_sandbox.py checks the refusal)")
    for name in table:
        assert out[name]["isolation"] == "user-namespaces"
        contained(name, out[name], host)
    host_clean(host)


def test_a_correct_program_that_closes_stdout_passes():
    for close in ("import sys\nsys.stdout.close()", "import os\nos.close(1)", "import sys\nsys.stdout = None"):
        r = run_program(humaneval_program(PROMPT, "    return a + b\n" + close + "\n", TEST, "add"), FAST)
        assert r.passed, (close, r)


def test_the_seccomp_filter_refuses_new_namespaces_in_any_program():
    """The filter itself, on a process outside the sandbox: STAGE installs it and execs unshare, which cannot make
    a user namespace (nor an IPC one); a plain program still runs."""
    cfg = {"seccomp": sandbox.seccomp_filter(os.uname().machine).hex(), "secret_fd": 9}
    stage = [sys.executable, "-I", "-S", "-c", sandbox.STAGE, json.dumps(cfg)]
    r = subprocess.run([*stage, shutil.which("unshare"), "--user", "--ipc", "true"], input=b"0" * 32,
                       capture_output=True)
    assert r.returncode != 0 and b"Operation not permitted" in r.stderr, r
    assert subprocess.run([*stage, shutil.which("true")], input=b"0" * 32).returncode == 0


ALWAYS_EQUAL = ("    class _Any:\n        __eq__ = lambda s, o: True\n        __ne__ = lambda s, o: False\n"
                "        __lt__ = __le__ = __gt__ = __ge__ = lambda s, o: True\n"
                "        __bool__ = lambda s: True\n        __len__ = lambda s: 0\n"
                "        __iter__ = lambda s: iter(())\n        __hash__ = lambda s: 0\n"
                "    return _Any()\n")


@pytest.mark.skipif(not os.environ.get("TOKENFARM_SANDBOX_ITEMS"), reason="all 164 HumanEval items (minutes): "
                    "TOKENFARM_SANDBOX_ITEMS=1")
def test_the_default_run_items_score_as_before():
    """Every canonical solution passes; every wrong body (`return None`) and every always-equal result fails."""
    from pipeline.data.eval_data import build_chat_task, wheel_record
    from pipeline.data.tasks import chat_task_spec
    from pipeline.evaluation import chat_core as C

    items = build_chat_task(chat_task_spec("humaneval"), *wheel_record(), seed=0)["items"]
    limits = SandboxLimits()
    right = [run_program(C.humaneval_item_program(it, it["canonical_solution"]), limits) for it in items]
    wrong = [run_program(C.humaneval_item_program(it, "    return None\n"), limits) for it in items]
    equal = [run_program(C.humaneval_item_program(it, ALWAYS_EQUAL), limits) for it in items]
    print(f"\nitems {len(items)}: canonical passed {sum(r.passed for r in right)}, wrong passed "
          f"{sum(r.passed for r in wrong)}, always-equal passed {sum(r.passed for r in equal)}")
    assert [it["id"] for it, r in zip(items, right) if not r.passed] == []
    assert [it["id"] for it, r in zip(items, wrong + equal) if r.passed] == []
