"""One writer per training folder, across hosts, jobs and controllers: a lease file with a heartbeat.

    with Lease("R/train/pretrain"):          # the trainer's rank 0, for the whole run
        ...
    wait_for_writers(["R/train/pretrain"])   # a restarted controller, before it schedules anything

``R/train/<stage>/LEASE`` (JSON) names its holder: ``id`` (``slurm-<job id>`` inside a SLURM job, else
``<host>-<pid>``), ``host``, ``pid``, ``slurm_job_id``, ``since`` and ``beat`` (epoch seconds, rewritten every
`BEAT_S`). A holder is live while its SLURM job is queued or running (squeue), or, where SLURM cannot be asked,
while its process is alive (same host) or its heartbeat is fresh (`STALE_S`). A live holder's lease is never
taken: the second trainer fails at once, naming it. A dead holder's lease is taken over (a requeued SLURM job is
the same job id: it takes its own lease back). Acquiring is atomic on a shared filesystem (link, rename); a
holder that finds its lease taken by another stops beating and ends its process (`on_lost`). Torch-free.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import get_logger, pid_alive

__all__ = ["Lease", "live_holder", "slurm_train_jobs", "wait_for_writers", "EXIT_LEASE_LOST"]

log = get_logger(__name__)

NAME = "LEASE"
BEAT_S = 30.0        # heartbeat interval
STALE_S = 300.0      # a heartbeat older than this, where SLURM cannot be asked, is a dead holder's
EXIT_LEASE_LOST = 73  # a holder whose lease another took: it stops writing at once
ALIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


def _me() -> dict:
    job = os.environ.get("SLURM_JOB_ID")
    host = socket.gethostname()
    now = time.time()
    return {"id": f"slurm-{job}" if job else f"{host}-{os.getpid()}", "host": host, "pid": os.getpid(),
            "slurm_job_id": job, "since": now, "beat": now}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being replaced, or cut short: treat as a holder of unknown liveness
        return {"id": "unreadable", "beat": path.stat().st_mtime if path.exists() else 0}


def slurm_state(job_id: str) -> str | None:
    """The SLURM state of `job_id` (RUNNING, PENDING, ...), "" when squeue no longer knows it, None when SLURM
    cannot be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:  # "Invalid job id specified" once the job is gone from the controller
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def is_live(holder: dict | None, me: dict | None = None) -> bool:
    """Whether `holder` (a lease's content) still writes. Holding `me`'s id (the same SLURM job, requeued) it is
    live only while its process still runs on this host (this very process included)."""
    if not holder:
        return False
    if me is not None and holder.get("id") == me["id"]:  # our own SLURM job, requeued (or this very process)
        return holder.get("host") == me["host"] and pid_alive(int(holder.get("pid") or 0))
    job = holder.get("slurm_job_id")
    if job:
        state = slurm_state(job)
        if state is not None:
            return state in ALIVE_STATES
    if holder.get("host") == socket.gethostname() and holder.get("pid"):
        return pid_alive(int(holder["pid"]))
    return time.time() - float(holder.get("beat", 0)) < STALE_S


def live_holder(directory: str | os.PathLike) -> dict | None:
    """The live holder of `directory`'s lease, or None."""
    holder = _read(Path(directory) / NAME)
    return holder if is_live(holder) else None


def _describe(holder: dict) -> str:
    who = f"SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else f"PID {holder.get('pid')}"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
    return f"{who} on {holder.get('host', '?')} (since {since})"


class Lease:
    """The lease on `directory` (module docstring). `acquire` raises a PipelineError naming a live holder."""

    def __init__(self, directory: str | os.PathLike, beat_s: float = BEAT_S, on_lost=None):
        self.dir = Path(directory)
        self.path = self.dir / NAME
        self.beat_s = beat_s
        self.on_lost = on_lost or (lambda: os._exit(EXIT_LEASE_LOST))
        self.me: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write_new(self) -> bool:
        """Create the lease file holding `self.me`, atomically; False when one exists."""
        tmp = self.dir / f".{NAME}.{self.me['id']}.{os.getpid()}"
        tmp.write_text(json.dumps(self.me), encoding="utf-8")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> Lease:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.me = _me()
        for _ in range(5):
            if self._write_new():
                break
            holder = _read(self.path)
            if is_live(holder, self.me):
                raise PipelineError(
                    f"{self.dir} is being trained by {_describe(holder)} ({self.path}): two trainers must never write "
                    "one checkpoint folder. Wait for it to end (a restarted snakemake waits by itself), or stop it "
                    f"(scancel {holder['slurm_job_id']})" if holder.get("slurm_job_id") else
                    f"{self.dir} is being trained by {_describe(holder)} ({self.path}): two trainers must never write "
                    f"one checkpoint folder; wait for it to end or stop it (kill {holder.get('pid')}), then rerun")
            # a dead holder's (or our own requeued job's) lease: move it aside (of two takers one rename wins) and
            # check it is the one judged dead, not a live lease another taker wrote meanwhile (then put it back)
            taken = self.dir / f".{NAME}.taken.{self.me['id']}.{os.getpid()}"
            try:
                os.rename(self.path, taken)
            except FileNotFoundError:
                continue
            moved = _read(taken)
            if moved and holder and any(moved.get(k) != holder.get(k) for k in ("id", "pid", "since")):
                with contextlib.suppress(FileExistsError):
                    os.link(taken, self.path)
                taken.unlink(missing_ok=True)
                continue
            taken.unlink(missing_ok=True)
            if holder and holder.get("id") != self.me["id"]:
                log.warning("took over the lease of %s from %s, which is no longer running", self.dir,
                            _describe(holder))
        else:
            raise PipelineError(f"{self.path}: could not take the lease (contended); rerun")
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            holder = _read(self.path)
            if not holder or holder.get("id") != self.me["id"] or holder.get("pid") != self.me["pid"]:
                log.error("the lease %s was taken by %s: this trainer stops writing now", self.path,
                          _describe(holder) if holder else "nobody (removed)")
                self.on_lost()
                return
            self.me["beat"] = time.time()
            tmp = self.dir / f".{NAME}.beat.{os.getpid()}"
            with contextlib.suppress(OSError):
                tmp.write_text(json.dumps(self.me), encoding="utf-8")
                os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        holder = _read(self.path)
        if self.me and holder and holder.get("id") == self.me["id"] and holder.get("pid") == self.me["pid"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def slurm_train_jobs(workdir: str | os.PathLike, rules=("train", "train_segment")) -> list[dict]:
    """This user's SLURM jobs of `rules` submitted from `workdir` (the Snakemake SLURM executor's comment names
    the rule) that are still queued or running: [] where SLURM cannot be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "--me", "-o", "%i|%T|%k|%Z"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    jobs, here = [], os.path.realpath(workdir)
    for line in out.stdout.splitlines() if out.returncode == 0 else ():
        job_id, state, comment, cwd = (line.split("|", 3) + ["", "", ""])[:4]
        rule = comment.split("_wildcards_")[0].removeprefix("rule_")
        if rule in rules and state in ALIVE_STATES and os.path.realpath(cwd) == here:
            jobs.append({"slurm_job_id": job_id, "state": state, "comment": comment})
    return jobs


def wait_for_writers(directories, workdir: str | os.PathLike = ".", poll_s: float | None = None, say=print) -> None:
    """Block while an earlier controller's train job may still write: a live holder of any of `directories`'
    leases, or (under SLURM) a train job of this workdir still queued or running. A restarted controller must not
    start a second writer into a folder a job it no longer tracks still writes; it goes on once they end."""
    poll_s = float(os.environ.get("TOKENFARM_LEASE_POLL_S", 30)) if poll_s is None else poll_s
    told = set()
    while True:
        busy = [(str(d), h) for d in directories if (h := live_holder(d))]
        held = {h.get("slurm_job_id") for _, h in busy}
        busy += [(j["comment"], {**j, "id": f"slurm-{j['slurm_job_id']}"}) for j in slurm_train_jobs(workdir)
                 if j["slurm_job_id"] not in held]
        if not busy:
            return
        for what, h in busy:
            if h.get("id") not in told:  # one line per holder, found by its lease or by name
                told.add(h.get("id"))
                who = _describe(h) if h.get("since") else f"SLURM job {h['slurm_job_id']} ({h['state'].lower()})"
                say(f"tokenfarm: waiting for {who}, which is still training {what} (started by an earlier "
                    "snakemake); the run continues from its checkpoint once it ends")
        time.sleep(poll_s)
