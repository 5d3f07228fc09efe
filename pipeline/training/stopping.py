"""Stopping a training job cleanly before its time runs out, and failing it fast when a rank hangs.

Every early stop (time limit, preemption, requeue, a person) takes one path: at a step boundary the ranks
agree to stop, checkpoint there and exit `EXIT_STOPPED` (75); the next attempt resumes from it. A rank that
makes no progress within its allowance dumps its stacks and exits `EXIT_HUNG` (70).

- `StopControl`: what the trainer holds; it combines `Deadline` + `StopClock` (the clock, rank 0),
  `StopSignals` (SIGUSR1 / SIGTERM) and the vote carried in the step's token all-reduce;
- `Watchdog`, `hang_allowances(params)`: the per-phase step watchdog;
- `slurm_end_time(job_id)`: the SLURM job's end time from ``squeue``.

How the clock decides, the agreement without an extra collective, the watchdog's allowances:
docs/training.md, "Clean stops and the watchdog".
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.io import get_logger
from pipeline.run_config import run_config
from pipeline.training.processes import EXIT_HUNG, EXIT_STOPPED, report_exit

__all__ = ["DEADLINE_ENV", "MARGIN_ENV", "Deadline", "slurm_end_time", "StopSignals", "StopClock", "Stopped",
           "Watchdog", "hang_allowances", "StopControl", "SIGNALS", "EXIT_STOPPED", "EXIT_HUNG"]

log = get_logger(__name__)

DEADLINE_ENV = "TOKENFARM_DEADLINE"         # epoch seconds: the job must be gone by then
MARGIN_ENV = "TOKENFARM_STOP_MARGIN_S"      # seconds kept in hand at a clock stop
DEFAULT_MARGIN_S = 30.0
SQUEUE_REFRESH_S = 300.0
SQUEUE_TIMEOUT_S = 30.0
RECENT_STEPS = 20          # the window of step times whose max predicts the next step
UNMEASURED_CORE_S = 60.0   # a CORE scoring not yet measured in this job (no planner figure for it)
MIN_HANG_S = 300.0
BACKSTOP_S = 60.0


class Stopped(Exception):
    """The run stopped cleanly at `step` (a checkpoint there) before `target`: the CLI exits `EXIT_STOPPED`."""

    def __init__(self, step: int, target: int, reason: str):
        super().__init__(f"stopped at step {step} before step {target} ({reason})")
        self.step, self.target, self.reason = step, target, reason


# ----------------------------------------------------------------------------- the deadline

def slurm_end_time(job_id: str, timeout: float = SQUEUE_TIMEOUT_S) -> float | None:
    """The end time of SLURM job `job_id` (epoch seconds), None for a job without one; raises OSError or
    ValueError when squeue fails or prints something else. squeue's ``%e`` is local time
    ``YYYY-MM-DDTHH:MM:SS``."""
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%e"], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise OSError(f"squeue exited {out.returncode}: {out.stderr.strip()[:200]}")
    text = out.stdout.strip()
    if text in ("N/A", "NONE", "Unknown", "UNLIMITED"):
        return None
    if not text:
        raise ValueError("squeue printed nothing (the job is not known to it)")
    return time.mktime(time.strptime(text.splitlines()[0].strip(), "%Y-%m-%dT%H:%M:%S"))


class Deadline:
    """When the job must be gone, or None: ``TOKENFARM_DEADLINE``, else SLURM's end time of the job (module
    docstring). `get()` never blocks: squeue runs in a background thread."""

    def __init__(self, environ=None, refresh_s: float = SQUEUE_REFRESH_S, query=slurm_end_time):
        environ = os.environ if environ is None else environ
        self._value: float | None = None
        self._stop = threading.Event()
        self._thread = None
        self.source = None
        if environ.get(DEADLINE_ENV):
            self._value, self.source = float(environ[DEADLINE_ENV]), DEADLINE_ENV
        elif environ.get("SLURM_JOB_ID"):
            self.source = f"SLURM job {environ['SLURM_JOB_ID']}"
            self._job, self._query, self._refresh = environ["SLURM_JOB_ID"], query, refresh_s
            self._read()
            self._thread = threading.Thread(target=self._poll, name="deadline", daemon=True)
            self._thread.start()
        if self._value is not None:
            log.info("deadline %s (%s): a clean stop before it", time.strftime("%Y-%m-%d %H:%M:%S",
                                                                               time.localtime(self._value)),
                     self.source)

    def _read(self) -> None:
        try:
            value = self._query(self._job)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            log.warning("cannot read the end time of %s (%s); keeping %s", self.source, e,
                        "none" if self._value is None else time.strftime("%H:%M:%S", time.localtime(self._value)))
            return
        if value != self._value and self._value is not None:
            log.info("%s now ends at %s", self.source, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
                     if value else "no time limit")
        self._value = value

    def _poll(self) -> None:
        while not self._stop.wait(self._refresh):
            self._read()

    def get(self) -> float | None:
        return self._value

    def close(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- signals

class StopSignals:
    """SIGUSR1 and SIGTERM as a stop request (a flag read at the next step boundary). `install` replaces
    the handlers (run_cli's SIGTERM-as-error among them) and restores the default SIGINT / SIGHUP actions
    when the supervisor started this process with them ignored (pipeline/training/launch.py)."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self.installed = False  # by the CLI (a worker process), not by an in-process caller

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def install(self) -> StopSignals:
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
        self.installed = True
        return self

    def reason(self) -> str | None:
        return None if self.received is None else f"{signal.Signals(self.received).name} received"


SIGNALS = StopSignals()  # the process's: the CLI installs it, the loop reads it


# ----------------------------------------------------------------------------- the clock

@dataclass
class StopClock:
    """The time the next steps, evaluations and saves will take, measured in this job (docs/training.md),
    and the stop rule against a `Deadline`."""

    predicted_step_s: float
    predicted_save_s: float
    margin_s: float = DEFAULT_MARGIN_S

    def __post_init__(self):
        self.steps: list[float] = []  # the job's first step, then a window of the recent ones
        self._recent: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self.save_s: float | None = None
        self.val_s: float | None = None
        self.core_s: float | None = None

    @classmethod
    def for_params(cls, params: dict, environ=None) -> StopClock:
        from pipeline.planning.train_jobs import predicted_save_s, predicted_step_s

        environ = os.environ if environ is None else environ
        view = run_config(params)
        return cls(predicted_step_s(view), predicted_save_s(view),
                   float(environ.get(MARGIN_ENV) or DEFAULT_MARGIN_S))

    def step_done(self, seconds: float) -> None:
        if not self.steps:
            self.steps.append(seconds)
        else:
            self._recent.append(seconds)

    def step_s(self) -> float:
        if self._recent:
            return max(self._recent)
        return self.steps[0] if self.steps else self.predicted_step_s

    def save(self) -> float:
        return self.predicted_save_s if self.save_s is None else self.save_s

    def cost(self, val: bool, core: bool, save: bool) -> float:
        """Seconds of one step with the validation / CORE / periodic save due at it."""
        step = self.step_s()
        return (step + (0.0 if not val else step if self.val_s is None else self.val_s)
                + (0.0 if not core else UNMEASURED_CORE_S if self.core_s is None else self.core_s)
                + (self.save() if save else 0.0))

    def short(self, now: float, deadline: float | None, ahead_s: float) -> bool:
        """True when `ahead_s` (the work before the next chance to stop) plus a save and the margin would
        end after `deadline`."""
        return deadline is not None and now + ahead_s + self.save() + self.margin_s > deadline


# ----------------------------------------------------------------------------- the watchdog

def hang_allowances(params: dict) -> dict[str, float]:
    """Seconds each phase may take before the watchdog fires (docs/training.md, "Clean stops and the watchdog")."""
    from pipeline.planning.train_jobs import predicted_save_s, predicted_startup_s, predicted_step_s

    view = run_config(params)
    minutes = view.hardware.get("hang_timeout_min")
    step = 60.0 * minutes if minutes else max(MIN_HANG_S, 20 * predicted_step_s(view))
    save = step + 3 * predicted_save_s(view)
    start = save + 2 * predicted_startup_s(view)  # process start, checkpoint load, compile
    return {"step": step, "validation": 2 * step, "core": 4 * step, "checkpoint": save, "start-up": start,
            "first step": start, "finish": 2 * save}


class Watchdog:
    """A daemon thread that ends this process with `EXIT_HUNG` when the current phase outlives its allowance
    (docs/training.md). `beat(step, phase, seconds)` starts a phase; `close()` ends the watch."""

    def __init__(self, rank: int, poll_s: float = 1.0, backstop: bool = False,
                 on_expire: Callable[[str], None] | None = None):
        self.rank, self.poll_s, self.backstop = rank, poll_s, backstop
        self._lock = threading.Lock()
        self._deadline = math.inf
        self._what = (0, "start-up", 0.0)
        self._closed = threading.Event()
        self._on_expire = on_expire or self._die
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str, seconds: float) -> None:
        with self._lock:
            self._deadline = time.monotonic() + seconds
            self._what = (step, phase, seconds)
        if self.backstop:
            faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                late, (step, phase, seconds) = time.monotonic() > self._deadline, self._what
            if late:
                self._on_expire(f"rank {self.rank} hung: no progress for {seconds:.0f} s (phase {phase}, step "
                                f"{step}; the watchdog's allowance, hardware.hang_timeout_min): failing the job")
                return

    def _die(self, message: str) -> None:
        print(f"--- watchdog: stacks of rank {self.rank} (pid {os.getpid()}) ---", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"error: {message}", file=sys.stderr, flush=True)
        report_exit(EXIT_HUNG)
        os._exit(EXIT_HUNG)

    def close(self) -> None:
        self._closed.set()
        if self.backstop:
            faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- one job's control

class StopControl:
    """What a training job consults at its step boundaries: the stop requests (signals, and on rank 0 the
    clock), the measured times, and the watchdog with its allowances. `close()` ends the threads."""

    def __init__(self, params: dict, rank: int, environ=None, signals: StopSignals = SIGNALS):
        self.clock = StopClock.for_params(params, environ)
        self.deadline = Deadline(environ) if rank == 0 else None  # rank 0's vote suffices (OR-reduced)
        self.signals = signals
        self.allow = hang_allowances(params)
        self.watchdog = Watchdog(rank, backstop=signals.installed)
        self.watchdog.beat(0, "start-up", self.allow["start-up"])
        self.reason: str | None = None

    def vote(self, ahead_s: float) -> bool:
        """This rank's vote at a step boundary: stop (a signal came, or the time left cannot cover `ahead_s`
        of work, a save and the margin) or go on."""
        reason = self.signals.reason()
        deadline = self.deadline.get() if self.deadline is not None else None
        if reason is None and self.clock.short(now := time.time(), deadline, ahead_s):
            reason = (f"the deadline is {deadline - now:.0f} s away: {ahead_s:.1f} s of steps, a "
                      f"{self.clock.save():.1f} s save and a {self.clock.margin_s:.0f} s margin would not fit")
        if reason is not None and self.reason is None:
            self.reason = reason
            log.warning("asking to stop at the next step boundary: %s", reason)
        return reason is not None

    def close(self) -> None:
        self.watchdog.close()
        if self.deadline is not None:
            self.deadline.close()
