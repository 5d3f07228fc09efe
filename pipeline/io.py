"""Shared I/O helpers: atomic writes, provenance metadata, hashing, progress bars, logging.

Every stage writes its outputs through these helpers so that (1) a file either exists complete or
not at all (temp file in the same directory + fsync + rename), and (2) each output carries
metadata saying what made it (stage, parameters, inputs, versions, time). See docs/data-contract.md.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from pipeline.errors import PipelineError

__all__ = [
    "atomic_path",
    "atomic_dir",
    "sweep_stale_temps",
    "pid_alive",
    "atomic_write",
    "write_json",
    "read_json",
    "write_parquet",
    "read_parquet_meta",
    "provenance",
    "sha256_file",
    "verify_sha256",
    "HashingFile",
    "progress",
    "get_logger",
    "run_cli",
]

META_KEY = b"tokenfarm"


# A temp file is `.<name>.tmp-<host>-<pid>`: the host, because directories may be shared by the nodes
# of a cluster, where a PID means nothing on another host.
_HOST = platform.node().replace(os.sep, "_") or "localhost"
_TEMP_RE = re.compile(r"^\..+\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")
_swept: set[Path] = set()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill(0)


def sweep_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove the `atomic_path` temp files (and `atomic_dir` temp directories) in `directory` left by
    dead processes of this host.

    A process killed with SIGKILL (or a machine that lost power) cannot clean up after itself; its
    temps are removed by the next process that writes into the same directory (`atomic_path` calls
    this once per directory and process). Temps of live processes, and of other hosts, are kept.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for e in entries:
        m = _TEMP_RE.match(e.name)
        if not m or m["host"] not in (None, _HOST) or pid_alive(int(m["pid"])) or e.is_symlink():
            continue
        with contextlib.suppress(FileNotFoundError):  # a concurrent sweep got it first
            if e.is_dir(follow_symlinks=False):  # an `atomic_dir` temp
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            removed.append(Path(e.path))
            get_logger(__name__).info("removed %s, left by process %s (no longer running)", e.path, m["pid"])
    return removed


@functools.cache
def _umask() -> int:
    """This process's umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _usual_mode(path: Path) -> None:
    """Give a finished output the permissions a plain `open()` would have: 0666 less the umask (plus
    the execute bits it has). Some writers create their file 0600 (safetensors writes through a
    private temp file), which would leave one output of a directory unreadable to the group."""
    st = path.lstat()
    if stat.S_ISREG(st.st_mode):
        want = (0o666 | (st.st_mode & 0o111)) & ~_umask()
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(path, want)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync and rename it onto `path`.

    On any exception (and on SIGTERM in a `run_cli` stage, which raises SystemExit) the temporary file
    is removed and `path` is left untouched, so a crashed or interrupted writer never leaves a partial
    output behind. What a SIGKILL leaves is swept by the next writer into the same directory
    (`sweep_stale_temps`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent not in _swept:
        sweep_stale_temps(path.parent)
        _swept.add(path.parent)
    tmp = path.parent / f".{path.name}.tmp-{_HOST}-{os.getpid()}"
    try:
        yield tmp
        if tmp.exists():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            _usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a new empty temporary directory next to `path`; on success rename it onto `path`.

    A `path` that exists is an error unless `replace`: then it is renamed aside to a temp name and
    removed after the new directory is in place. On any exception the temporary directory is removed
    and `path` is left untouched; what a SIGKILL leaves is swept like `atomic_path`'s temps. Its
    files get the usual permissions (0666 less the umask), whatever mode their writer chose.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent not in _swept:
        sweep_stale_temps(path.parent)
        _swept.add(path.parent)
    tmp = path.parent / f".{path.name}.tmp-{_HOST}-{os.getpid()}"
    old = path.parent / f".{path.name}.old.tmp-{_HOST}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                _usual_mode(Path(root, name))
        if path.exists() or path.is_symlink():
            if not replace:
                raise FileExistsError(f"{path} exists")
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[Any]:
    """Open a file for writing atomically: `with atomic_write(p) as f: f.write(...)`."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as f:
            yield f


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_parquet(path: str | os.PathLike, table: Any, meta: dict | None = None) -> None:
    """Write a pyarrow Table atomically, embedding `meta` as JSON under the 'tokenfarm' key."""
    import pyarrow.parquet as pq

    if meta is not None:
        md = dict(table.schema.metadata or {})
        md[META_KEY] = json.dumps(meta, default=_json_default).encode()
        table = table.replace_schema_metadata(md)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_parquet_meta(path: str | os.PathLike) -> dict:
    import pyarrow.parquet as pq

    md = pq.read_schema(path).metadata or {}
    raw = md.get(META_KEY)
    return json.loads(raw) if raw else {}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_verified: dict[tuple, str] = {}


def verify_sha256(path: str | os.PathLike, expected: str, recorded_in: str, fix: str) -> None:
    """Check that `path` still has the sha256 recorded (in `recorded_in`) when it was written, or raise
    one PipelineError: "<path> is corrupt (sha256 mismatch with <recorded_in>); <fix>".

    For the large artifacts a job consumes (packed rows, checkpoints), streamed (1 MiB at a time) and
    once per process: a second check of the same unchanged file (device, inode, size, mtime) is free,
    so every reader may call it where it opens the file."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _verified:
        _verified[key] = sha256_file(path)
    if _verified[key] != expected:
        raise PipelineError(f"{path} is corrupt (sha256 mismatch with {recorded_in}); {fix}")


class HashingFile:
    """A binary file object's `write` that also hashes what is written (`sha256.hexdigest()`), for
    writers that stream into a file (torch.save, pack's rows): the checksum costs no second read."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@functools.cache
def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("tokenfarm", "torch", "pyarrow", "polars", "tiktoken", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def provenance(stage: str, params: Any = None, inputs: Iterable[str | os.PathLike] = (), **extra: Any) -> dict:
    """Metadata that says what made an output: stage, params, inputs (path + size), versions, time."""
    ins = []
    for p in inputs:
        p = Path(p)
        ins.append({"path": str(p), "bytes": p.stat().st_size if p.exists() else None})
    return {
        "stage": stage,
        "params": params,
        "inputs": ins,
        "versions": dict(_versions()),
        "host": platform.node(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def progress(iterable: Iterable | None = None, *, desc: str = "", total: int | None = None, unit: str = "it"):
    """A tqdm progress bar, shown when stderr is an interactive terminal, silent in logs and CI.
    TOKENFARM_PROGRESS=1 forces it on (e.g. under Snakemake, whose rules tee stderr to a log) and
    TOKENFARM_PROGRESS=0 forces it off."""
    forced = os.environ.get("TOKENFARM_PROGRESS", "")
    disable = forced == "0" or (forced != "1" and not sys.stderr.isatty())
    if disable and iterable is not None:  # the usual case in a job: no tqdm import
        return _Silent(iterable)
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, unit_scale=True, leave=False)


class _Silent:
    """What `progress` returns when no bar is shown: the iterable itself, with tqdm's `disable`."""

    disable = True

    def __init__(self, iterable: Iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)


def get_logger(name: str) -> logging.Logger:
    """Module logger; stage CLIs (run_cli) send records to stderr, which rules redirect to logs/."""
    return logging.getLogger(name)


def setup_logging() -> None:
    """One timestamped line per record on stderr. Called by stage entry points only, never on
    import, so importing pipeline modules (the Snakefile does) leaves the caller's logging alone."""
    logging.basicConfig(
        level=os.environ.get("TOKENFARM_LOGLEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )




RESOURCE_LINE = re.compile(r"resources: cpu (?P<cpu_s>[0-9.]+) s \(user \+ sys\), peak rss (?P<max_rss_mb>[0-9.]+) MB")


def resource_usage() -> str:
    """This process's CPU seconds (user + sys, every thread, from start-up and imports on) and peak RSS,
    as the one line `RESOURCE_LINE` reads back (benchmarks/data_scale.py)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return f"resources: cpu {r.ru_utime + r.ru_stime:.3f} s (user + sys), peak rss {r.ru_maxrss / 1024:.1f} MB"


def _exit_on_sigterm(signum, frame):
    """SIGTERM (Snakemake or a scheduler cancelling a job) unwinds like an error, so `atomic_path` removes
    its temp files; Python's default would end the process on the spot."""
    raise SystemExit(128 + signum)


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def filesystem_error_message(e: OSError) -> str | None:
    """One line for an OSError that says a file or directory cannot be written (permissions, an
    immutable or read-only directory, a full disk), naming the directory; None for any other error.

    Outputs are written through `atomic_path` / `atomic_dir`, so the failing name is usually one of
    their temps (`.<name>.tmp-<host>-<pid>`), which means nothing to a user: the directory is named."""
    if e.errno not in _UNWRITABLE + _FULL or not e.filename:
        return None
    path = Path(os.fsdecode(e.filename))
    why = e.strerror or os.strerror(e.errno)
    if e.errno in _FULL:
        return f"cannot write into {path.parent}: {why}; free space there (or point results_dir elsewhere) and rerun"
    if path.exists() and not _TEMP_RE.match(path.name):
        return (f"{path}: {why}; check its permissions and attributes (ls -l, lsattr; chmod u+rw, chattr -i) "
                "and rerun")
    return (f"cannot write into directory {path.parent}: {why} (read-only, immutable or not owned by you); make it "
            "writable (chmod u+w, chattr -i) or point results_dir elsewhere, and rerun")


def _trace_calls(out_dir: Path) -> None:
    """TOKENFARM_TRACE_CALLS=DIR: record every function of the package this process runs from here on (its code
    flagged CO_OPTIMIZED, 1: a module's or a class's body, run by an import, is not a function), written
    at its exit to DIR/<pid>.json as [file, first line, qualified name] with the `python -m` module (the test
    that a rule's code hash, pipeline/codehash.py, covers what the rule runs: tests/test_workflow.py)."""
    import atexit
    import threading

    package = str(Path(__file__).resolve().parent) + os.sep
    seen: set = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code)

    def write() -> None:
        sys.setprofile(None)
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        calls = sorted({(c.co_filename, c.co_firstlineno, c.co_qualname) for c in seen  # functions only: not
                        if c.co_filename.startswith(package) and c.co_flags & 1})  # a module's or class's body
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{os.getpid()}.json").write_text(json.dumps({"main": spec and spec.name, "calls": calls}))

    def write_then(exec_fn):
        def replaced(*args):
            write()  # the process image is replaced: no exit, no atexit
            return exec_fn(*args)
        return replaced

    atexit.register(write)
    # a process that replaces itself (pipeline.training.rendezvous execs torchrun) writes its record first:
    # os.execvp/execvpe/execl* all end in one of these two
    os.execv, os.execve = write_then(os.execv), write_then(os.execve)
    threading.setprofile(profile)
    sys.setprofile(profile)


def run_cli(main_fn, argv=None) -> None:
    """Run a stage's main(argv); a PipelineError (or ConfigError), or an output that cannot be written
    (`filesystem_error_message`), becomes one 'error:' line and exit 1. A stage that succeeds ends its
    log with the process's own CPU time and peak RSS (`resource_usage`), from its start to the end of
    its work (the interpreter's exit after it is not in it), where Snakemake's `benchmark:`
    files sample the job's processes (every second, then every 30 s) and miss a job's last moments."""
    setup_logging()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if os.environ.get("TOKENFARM_TRACE_CALLS"):
        _trace_calls(Path(os.environ["TOKENFARM_TRACE_CALLS"]))
    try:
        main_fn(argv)
        logging.getLogger("pipeline").info("%s", resource_usage())
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as e:
        message = filesystem_error_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
