"""The HumanEval sandbox: planted hostile completions are each contained, fail their item, and the next
item still evaluates correctly. The fork bomb runs only where the PID namespace + own-uid containment
works (checked first with a bounded bomb), never under RLIMIT_NPROC alone as root. The unprivileged mode
(user namespaces) is tested by running the sandbox as `nobody` (`setpriv`) from a root test run, as CI
runs; where the kernel forbids user namespaces that run checks the refusal instead."""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.evaluation import sandbox
from pipeline.evaluation.sandbox import UID_BASE, SandboxLimits, humaneval_program, isolation, run_program

NAMESPACED = isolation() == "namespaces"
needs_ns = pytest.mark.skipif(not NAMESPACED, reason="needs root + unshare/setpriv (net/PID/IPC/mount namespaces)")
pytestmark = pytest.mark.skipif(isolation() == "none" and os.geteuid() != 0,
                                reason="no user namespaces here: the sandbox refuses (test_nobody_is_contained...)")

FAST = SandboxLimits(timeout_s=5, cpu_s=3, memory_mb=512, nproc=8, output_bytes=64 << 10)

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
GOOD = "    return a + b\n"


def good_item_passes() -> bool:
    return run_program(humaneval_program(PROMPT, GOOD, TEST, "add"), FAST).passed


def sandbox_processes() -> list[str]:
    """Processes of any sandbox uid still alive on this machine."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.split() and int(line.split()[0]) >= UID_BASE]


def hostile(body: str) -> str:
    """A completion of `add` whose body is `body` (then it returns the right answer, so only containment
    can fail it)."""
    return humaneval_program(PROMPT, "".join(f"    {line}\n" for line in body.splitlines()) + GOOD, TEST, "add")


def test_correct_and_wrong_completions():
    assert good_item_passes()
    wrong = run_program(humaneval_program(PROMPT, "    return a - b\n", TEST, "add"), FAST)
    assert not wrong.passed and wrong.status == "failed (exit 1)" and "AssertionError" in wrong.output
    assert run_program("raise SystemExit(3)", FAST).status == "failed (exit 3)"


def test_infinite_loop_is_stopped_by_the_timeout():
    r = run_program(hostile("while True:\n    pass"), SandboxLimits(timeout_s=1.5, cpu_s=30))
    assert not r.passed and r.status == "timeout" and r.seconds < 10
    assert good_item_passes()


def test_cpu_limit_kills_a_spinning_program():
    r = run_program(hostile("while True:\n    pass"), SandboxLimits(timeout_s=20, cpu_s=1))
    assert not r.passed and r.status.startswith("killed"), r.status
    assert r.seconds < 15


def test_ten_gigabytes_is_refused():
    r = run_program(hostile("x = bytearray(10 * 2**30)"), FAST)
    assert not r.passed and "MemoryError" in r.output
    assert good_item_passes()


def test_output_is_capped():
    r = run_program(hostile("for _ in range(1024):\n    print('x' * (1 << 20))"), FAST)  # 1 GB
    assert not r.passed
    assert len(r.output.encode()) <= FAST.output_bytes
    assert good_item_passes()


def test_no_inherited_secret(monkeypatch):
    secret = "hf_planted_secret_0123456789"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    body = ("import os, glob\n"
            "print(dict(os.environ))\n"
            f"for p in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ']:\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print(p, e)\n"
            "token = os.environ['HF_TOKEN']")
    r = run_program(hostile(body), FAST)
    assert not r.passed and "KeyError: 'HF_TOKEN'" in r.output
    assert secret not in r.output
    assert good_item_passes()


def test_os_system_and_subprocess_fail_the_item(tmp_path):
    mark = tmp_path / "pwned"
    r = run_program(hostile(f"import os\nos.system('touch {mark}')"), FAST)
    assert not r.passed and "does not allow" in r.output and not mark.exists()
    r = run_program(hostile(f"import subprocess\nsubprocess.run(['touch', '{mark}'])"), FAST)
    assert not r.passed and not mark.exists()
    assert good_item_passes()


def test_workdir_is_fresh_and_private():
    r = run_program("import os\nprint(os.getcwd(), sorted(os.listdir('.')))\nopen('left.txt', 'w').write('x')", FAST)
    assert r.passed, r
    cwd = r.output.split()[0]
    assert cwd == "/tmp/work" and "['program.py']" in r.output and not os.path.exists(os.path.join(cwd, "left.txt"))


EARLY_EXITS = {  # each completion stops before `check` has run to its end; the answer would be wrong anyway
    "exit()": "    exit()\n    return a - b\n",
    "sys.exit(0)": "    import sys\n    sys.exit(0)\n    return a - b\n",
    "os._exit(0)": "    import os\n    os._exit(0)\n    return a - b\n",
    "atexit": "    import atexit, os\n    atexit.register(os._exit, 0)\n    return a - b\n",
    "module-level": "    return a - b\nimport sys\nsys.exit(0)\n",
}


@pytest.mark.parametrize("name", EARLY_EXITS)
def test_exiting_with_status_0_does_not_pass(name):
    r = run_program(humaneval_program(PROMPT, EARLY_EXITS[name], TEST, "add"), FAST)
    assert r.returncode == 0 and not r.passed and r.status == "failed (exit 0 before its end)", r


def test_the_pass_token_cannot_be_found_or_forged():
    """The program looks for the token wherever it could read it (argv, environment, stdin, its fds, /proc) and
    writes everything it found, and garbage, to every descriptor before exiting 0."""
    body = ("import os\n"
            "found = [open('/proc/self/cmdline', 'rb').read(), open('/proc/self/environ', 'rb').read()]\n"
            "for fd in range(64):\n"
            "    try:\n        os.set_blocking(fd, False)\n        found.append(os.read(fd, 1 << 16))\n"
            "    except OSError:\n        pass\n"
            "blob = b'\\n'.join(found) + b'passed ok 0' * 4\n"
            "for fd in range(3, 64):\n"
            "    try:\n        os.write(fd, blob)\n    except OSError:\n        pass\n"
            "os._exit(0)")
    r = run_program(hostile(body), FAST)
    assert r.returncode == 0 and not r.passed, r
    assert good_item_passes()


def test_a_forked_child_running_to_the_end_is_not_a_second_pass():
    """Only the harness's own process reports: a program whose fork also runs off the end passes once."""
    r = run_program("import os\npid = os.fork()\nif pid:\n    os.waitpid(pid, 0)\nprint('done')", FAST)
    assert r.passed and r.output.count("done") == 2, r


@needs_ns
def test_no_network():
    body = ("import socket\n"
            "s = socket.socket()\ns.settimeout(2)\n"
            "s.connect(('1.1.1.1', 80))")
    r = run_program(hostile(body), FAST)
    assert not r.passed and ("unreachable" in r.output or "OSError" in r.output), r.output
    assert good_item_passes()


@needs_ns
def test_runs_as_its_own_uid():
    r = run_program("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", FAST)
    uid, gid, groups = r.output.split(maxsplit=2)
    assert int(uid) >= UID_BASE and int(gid) == int(uid) and groups.strip() == "[]"


@needs_ns
def test_a_venv_under_tmp_still_runs(monkeypatch):
    """The private tmpfs hides /tmp, where a clone's venv (its sys.executable) may live: the child runs the base
    interpreter through the read-only bound prefix."""
    monkeypatch.setattr("sys.executable", "/tmp/a-clone/.venv/bin/python")  # gone inside the namespace
    assert good_item_passes()


@needs_ns
def test_fork_bomb_is_contained():
    # A bounded bomb first: at most nproc processes, every one gone afterwards.
    r = run_program("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        os.fork(); n += 1\n"
                    "    except OSError:\n        break\ntime.sleep(0.2)\nprint('forked', n)", FAST)
    assert "forked" in r.output and sandbox_processes() == []
    assert max(int(line.split()[1]) for line in r.output.splitlines() if line.startswith("forked")) < FAST.nproc
    # Then the real one, stopped by RLIMIT_NPROC (own uid) and the wall clock; its namespace dies with it.
    r = run_program(hostile("import os\nwhile True:\n    os.fork()"), SandboxLimits(timeout_s=3, cpu_s=3, nproc=8))
    assert not r.passed
    assert sandbox_processes() == []
    assert good_item_passes()


@pytest.mark.skipif(os.geteuid() != 0, reason="root only")
def test_root_without_namespaces_refuses():
    for mode in ("none", "user-namespaces"):  # root's processes escape RLIMIT_NPROC: no mode but its own uid
        with pytest.raises(PipelineError, match="unshare"):
            run_program("print(1)", FAST, mode=mode)


def shm_keys() -> set[int]:
    """The keys of the System V shared-memory segments on this host (IPC namespace)."""
    return {int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]}


WITH_CTYPES = tuple(n for n in sandbox.NATIVE if "ctypes" not in n)  # the guard lifted for ctypes only
SHM = ("import ctypes\n"  # three 64 MiB System V segments, never attached (no memory used)
       "libc = ctypes.CDLL(None, use_errno=True)\n"
       "libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]\n"
       "ids = [libc.shmget({key} + i, 64 << 20, 0o1000 | 0o600) for i in range(3)]\n"  # IPC_CREAT
       "print('shm', ids)\n"
       "assert min(ids) >= 0, ctypes.get_errno()")


def test_shared_memory_does_not_survive_the_item(monkeypatch):
    """With the native-code guard lifted (ctypes is refused to programs), the IPC namespace still holds: the
    segments are the item's own."""
    monkeypatch.setattr(sandbox, "NATIVE", WITH_CTYPES)
    key = random.randrange(1 << 28, 1 << 30)
    try:
        r = run_program(hostile(SHM.format(key=key)), FAST)
        assert r.passed, r.output  # the segments were made (in the item's own IPC namespace) ...
        assert not {key, key + 1, key + 2} & shm_keys()  # ... and are gone with it
    finally:
        for k in (key, key + 1, key + 2):
            subprocess.run(["ipcrm", "-M", str(k)], capture_output=True)
    assert good_item_passes()


def test_writing_anywhere_does_not_reach_the_host(tmp_path):
    mark = f"tokenfarm-sandbox-planted-{uuid.uuid4().hex}"
    # writable inside (private), and places of ours it must not reach
    private = [f"{d}/{mark}" for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)]
    host = [str(tmp_path / mark), os.path.abspath(mark), os.path.expanduser(f"~/{mark}"), f"/etc/{mark}"]
    body = (f"wrote = []\n"
            f"for t in {private + host!r}:\n"
            "    try:\n        open(t, 'w').write('pwned')\n        wrote.append(t)\n"
            "    except OSError:\n        pass\n"
            f"assert wrote == {private!r}, wrote")
    try:
        r = run_program(hostile(body), FAST)
        assert r.passed, r.output
        assert not [t for t in private + host if os.path.exists(t)]
    finally:
        for t in private + host:
            if os.path.exists(t):
                os.remove(t)
    assert good_item_passes()


def test_disk_is_capped_in_total():
    """One tmpfs of disk_mb holds the working dir and /tmp, /dev/shm, /var/tmp, /run/lock: 80 MiB in 1 MiB
    files spread over them stops at disk_mb."""
    body = ("import os\nn = 0\n"
            "try:\n"
            "    for d in ('.', '/tmp', '/dev/shm', '/var/tmp', '/run/lock'):\n"
            "        for i in range(16):\n"
            "            with open(f'{d}/f{i}', 'wb') as f:\n                f.write(b'x' * (1 << 20))\n"
            "            n += 1\n"
            "except OSError as e:\n    print('stopped:', e)\n"
            "print('wrote', n, 'MiB')")
    limits = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512, output_bytes=1 << 20, disk_mb=8)
    r = run_program(hostile(body), limits)
    assert "No space left on device" in r.output, r.output
    assert int(r.output.split("wrote ")[1].split()[0]) < limits.disk_mb


def forks_touching(n: int, mb: int) -> str:
    """A program whose `n` children each touch `mb` MiB at once, then report how many finished."""
    return ("import os, time\npids = []\n"
            f"for _ in range({n}):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            f"        b = bytearray({mb} << 20)\n"
            "        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
            "        time.sleep(0.5)\n        os._exit(0)\n"
            "    pids.append(pid)\n"
            "print('finished', sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids))")


@needs_ns
def test_memory_is_bounded_for_the_whole_item():
    probe = sandbox._memory_cgroups(FAST)
    sandbox._remove_cgroups(probe)
    if not probe:
        pytest.skip("no writable memory cgroup controller here (the bound is nproc x memory_mb; module docstring)")
    limits = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512, nproc=8, total_memory_mb=256)
    one = run_program(forks_touching(1, 128), limits)
    assert one.passed and "finished 1" in one.output, one  # one child under both bounds
    four = run_program(forks_touching(4, 128), limits)  # each under RLIMIT_AS, together over the cgroup
    assert "finished 4" not in four.output, four
    parent = os.path.dirname(probe[0])
    assert not [d for d in os.listdir(parent) if d.startswith(f"tokenfarm-sandbox-{os.getpid()}-")]
    assert good_item_passes()


@needs_ns
def test_it_cannot_signal_or_see_us():
    body = (f"import os, signal\nassert not os.path.exists('/proc/{os.getpid()}')\n"
            "for pid in (os.getppid(), -1, " + str(os.getpid()) + "):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass")
    r = run_program(hostile(body), FAST)
    assert r.passed, r.output  # it only signalled what it could see: itself excluded, nothing of ours
    assert good_item_passes()


def test_a_setup_step_that_fails_refuses_with_its_reason(monkeypatch):
    """Any failing step of the namespace's setup (here: binding a prefix that does not exist) makes the probe,
    and so the sandbox, refuse, and the message quotes the step's error."""
    monkeypatch.setattr("sys.base_prefix", "/nonexistent-prefix")
    sandbox._probe.cache_clear()
    try:
        assert isolation() == "none"
        with pytest.raises(PipelineError, match="nonexistent-prefix.*remove humaneval from eval.chat_tasks"):
            run_program("print(1)", FAST)
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()
    assert isolation() != "none"


def test_a_missing_sandbox_refuses_before_generating(monkeypatch):
    from pipeline.evaluation import chat_core

    monkeypatch.setattr(sandbox, "isolation", lambda: "none")
    humaneval = {"kind": "humaneval", "items": [], "random_baseline": 0.0}
    with pytest.raises(PipelineError, match="remove humaneval from eval.chat_tasks"):
        chat_core.evaluate_chat(None, None, {"humaneval": humaneval}, max_items=None, max_new_tokens=1,
                                batch_tokens=1)


# ----------------------------------------------------------------------------- without root: as `nobody`

NOBODY = 65534
# Runs as `nobody` (python -c, the checkout on PYTHONPATH): hostile programs in the unprivileged sandbox,
# every result as one JSON line. argv: the secret home, the victim file in it, a file of its own elsewhere,
# the test's pid.
AS_NOBODY = r'''
import json, os, socket, sys
from pipeline.errors import PipelineError
from pipeline.evaluation import sandbox
from pipeline.evaluation.sandbox import NATIVE, SandboxLimits, humaneval_program, isolation, run_program

WITH_CTYPES = tuple(n for n in NATIVE if "ctypes" not in n)
home, victim, elsewhere, tester = sys.argv[1:]
fast = SandboxLimits(timeout_s=5, cpu_s=3, memory_mb=512, nproc=8, output_bytes=64 << 10)
if isolation() == "none":
    try:
        run_program("print(1)", fast)
        print(json.dumps({"mode": "none", "refused": None}))
    except PipelineError as e:
        print(json.dumps({"mode": "none", "refused": str(e)}))
    sys.exit(0)
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(8)
programs = {
    "environ": "import glob\nfor p in glob.glob('/proc/*/environ') + ['/proc/%s/environ' % os.getppid()]:\n"
               "    try:\n        print(open(p, 'rb').read())\n    except OSError:\n        pass\n"
               f"print(os.getppid(), os.path.exists('/proc/{os.getpid()}'))",
    "read_home": f"print(open({victim!r}).read())",
    "write_elsewhere": f"open({elsewhere!r}, 'a').write('pwned')",
    "loopback": f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)",
    "daemon": "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)",
    "kill": f"for pid in ({os.getpid()}, {tester}, -1):\n    try:\n        os.kill(pid, 9)\n    except OSError:\n"
            "        pass",
    "os._exit(0)": "os._exit(0)",
    "fork_bomb": "n = 0\nfor _ in range(40):\n    try:\n        os.fork(); n += 1\n    except OSError:\n        break\n"
                 "print('forked', n)\ntime.sleep(0.2)",
    "shm": sys.stdin.read(),
}
out = {"mode": isolation(), "uid": os.getuid()}
for name, body in programs.items():
    src = "import os, socket, time\n" + body + "\n"
    sandbox.NATIVE = WITH_CTYPES if name == "shm" else NATIVE  # ctypes for the shm program only
    out[name] = run_program(src, fast).to_dict()
left = []  # our sandbox programs (uid nobody, the harness in their command line) still alive
for p in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):  # this script names it too
    try:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            if os.stat(f"/proc/{p}").st_uid == os.getuid() and b"_harness()" in f.read():
                left.append(p)
    except OSError:
        pass
out["left_behind"] = left
out["shm_keys"] = [int(line.split()[0]) for line in open("/proc/sysvipc/shm").read().splitlines()[1:]]
print(json.dumps(out))
'''


def run_as_nobody(home: str, victim: str, elsewhere: str, stdin: str, path: str = "/usr/bin:/bin") -> dict:
    """AS_NOBODY's JSON; `path`: its PATH (where it looks for unshare and setpriv)."""
    checkout = str(Path(sandbox.__file__).resolve().parents[2])
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    cmd = [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-I", "-c"]
    env = {"PATH": path, "HOME": home, "HF_TOKEN": "hf_nobody_secret_42"}
    ok = subprocess.run([*cmd, "import sys; sys.path.insert(0, sys.argv[1]); import pipeline.evaluation.sandbox",
                         checkout], env=env, capture_output=True)
    if ok.returncode != 0:
        pytest.skip(f"`nobody` cannot run {python} with {checkout} (not world-readable here): {ok.stderr[-200:]!r}")
    script = f"import sys; sys.path.insert(0, {checkout!r})\n" + AS_NOBODY
    r = subprocess.run([*cmd, script, home, victim, elsewhere, str(os.getpid())], env=env, input=stdin,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="switching to nobody needs root")
def test_nobody_is_contained_or_refused():
    """Without root: user namespaces where the kernel allows them, else a refusal that names the fix. Its home
    and a file it owns elsewhere are outside /tmp (the sandbox replaces /tmp anyway), under /run."""
    home = tempfile.mkdtemp(prefix="tokenfarm-sandbox-home-", dir="/run")
    victim = os.path.join(home, "token")  # hidden with its $HOME
    elsewhere = home + "-elsewhere"  # visible, read-only
    Path(victim).write_text("hf_file_secret_17")
    Path(elsewhere).write_text("mine")
    for path in (home, victim, elsewhere):
        os.chown(path, NOBODY, NOBODY)
    key = random.randrange(1 << 28, 1 << 30)
    try:
        out = run_as_nobody(home, victim, elsewhere, SHM.format(key=key))
    finally:
        content = Path(victim).read_text(), Path(elsewhere).read_text()
        shutil.rmtree(home)
        os.remove(elsewhere)
        for k in (key, key + 1, key + 2):
            subprocess.run(["ipcrm", "-M", str(k)], capture_output=True)
    if out["mode"] == "none":
        assert out["refused"] and "remove humaneval from eval.chat_tasks" in out["refused"], out
        return
    assert out["mode"] == "user-namespaces" and out["uid"] == NOBODY
    assert content == ("hf_file_secret_17", "mine")  # nothing of its user's written ...
    assert "FileNotFoundError" in out["read_home"]["output"]  # ... nor read: $HOME is hidden
    assert "Read-only file system" in out["write_elsewhere"]["output"], out["write_elsewhere"]
    env = out["environ"]
    assert env["passed"] and "hf_nobody_secret_42" not in env["output"], env  # no parent environ to read
    assert env["output"].split()[-1] == "False"  # our pid is not in its /proc
    assert not out["loopback"]["passed"], out["loopback"]
    assert out["daemon"]["passed"] and out["left_behind"] == [], out["left_behind"]
    assert out["kill"]["passed"]  # and this process survived to report it
    assert out["os._exit(0)"]["status"] == "failed (exit 0 before its end)"
    bomb = out["fork_bomb"]
    assert "forked" in bomb["output"] and max(int(line.split()[1]) for line in bomb["output"].splitlines()) < FAST.nproc
    assert out["shm"]["passed"] and not {key, key + 1, key + 2} & set(out["shm_keys"]), out["shm"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="switching to nobody needs root")
def test_nobody_without_namespaces_is_refused():
    """The refusal, whatever this kernel allows: as nobody with no unshare on PATH the sandbox cannot isolate,
    so it runs nothing and says how to go on."""
    out = run_as_nobody("/nonexistent", "/nonexistent/token", "/nonexistent-file", "", path="/nonexistent")
    assert out["mode"] == "none" and "not root" in out["refused"] and "no unshare/setpriv" in out["refused"], out
    assert "remove humaneval from eval.chat_tasks" in out["refused"]
