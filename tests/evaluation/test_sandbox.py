"""The HumanEval sandbox: planted hostile completions are each contained, fail their item, and the next
item still evaluates correctly. The fork bomb runs only where the PID namespace + own-uid containment
works (checked first with a bounded bomb), never under RLIMIT_NPROC alone as root."""
import os
import subprocess

import pytest

from pipeline.errors import PipelineError
from pipeline.evaluation.sandbox import UID_BASE, SandboxLimits, humaneval_program, isolation, run_program

NAMESPACED = isolation() == "namespaces"
needs_ns = pytest.mark.skipif(not NAMESPACED, reason="needs root + unshare (net/PID/mount namespaces)")

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


def test_writing_outside_its_dir_is_contained(tmp_path):
    targets = [tmp_path / "planted.txt", "/tmp/tokenfarm-sandbox-planted.txt", os.path.abspath("planted.txt")]
    body = ("ok = 0\n"
            f"for t in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(t, 'w').write('pwned')\n        ok += 1\n    except OSError:\n        pass\n"
            "assert ok == 0, ok")  # /tmp is a private tmpfs: writable, but nothing persists
    r = run_program(hostile(body), FAST)
    assert not any(os.path.exists(t) for t in targets), r
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
