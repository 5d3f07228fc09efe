"""`torchrun --standalone --nproc_per_node N SCRIPT ARGS...` for the tests, without the start-up a rank pays.

    python tests/forkrun.py --nproc_per_node N SCRIPT [ARGS...]

Under torchrun each rank is a fresh interpreter that imports torch, torch._dynamo (the optimizer's
constructor imports it), FSDP, DCP and the trainer before its first step, and torchrun imports torch
too: most of a tiny test run's cost (BENCHMARKS.md "Test time"). Here one process imports them once and forks the
ranks, as torch's DataLoader forks its workers after the same imports; each rank then runs SCRIPT as
`python SCRIPT ARGS...` would (``__main__``, ``sys.argv``, ``sys.path[0]``) with the environment torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*: the agent's store,
hosted here like torchrun's agent hosts it, every rank a client), in a session of its own as torchrun
starts them. Like torchrun it waits for every rank, stops the others when one fails (SIGTERM, then
SIGKILL) and exits 1, passes SIGTERM / SIGINT / SIGHUP on to the ranks, and OMP_NUM_THREADS defaults to 1.

Only what torchrun does for a test's trainers is imitated: tests of torchrun's own behaviour (its signal
handling, a kill of the job's process group, the supervisor and rendezvous around it) launch torchrun.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
import uuid

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "torch.nn.parallel",
           "pipeline.training.train")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 30  # torchrun's default before SIGKILL


def _rank(rank: int, nproc: int, port: int, run_id: str, script: str, args: list[str], listener: socket.socket) -> int:
    listener.close()
    os.setsid()
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.stdout.reconfigure(write_through=True)  # torchrun runs its workers with `python -u`
    sys.stderr.reconfigure(write_through=True)
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:  # as the interpreter turns it into an exit status
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter would print, then its exit status
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--nproc_per_node":
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    nproc, script, args = int(argv[1]), argv[2], argv[3:]
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port, run_id = listener.getsockname()[1], str(uuid.uuid4())
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank(rank, nproc, port, run_id, script, args, listener)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)

    import torch.distributed as td

    store = td.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # the agent's store
                        master_listen_fd=listener.fileno())
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: [_kill(p, s) for p in pids])
    running, failed = set(pids), 0
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code
            print(f"forkrun: rank {pids.index(pid)} (pid {pid}) exited with {code}; stopping the others",
                  file=sys.stderr)
            _stop(running)
    del store
    return 1 if failed else 0


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(pids: set[int]) -> None:
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            if os.waitpid(pid, os.WNOHANG)[0]:
                pids.discard(pid)
        time.sleep(0.05)
    for pid in pids:
        _kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pids.clear()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
