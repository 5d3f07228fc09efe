"""Process-group helpers of the training library: join a torchrun job (gloo on CPU, nccl on CUDA) or
run alone, all-reduce / all-gather, seeding, and a teardown that cannot deadlock."""
from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as torch_dist

from pipeline.errors import PipelineError
from pipeline.io import get_logger

log = get_logger(__name__)


def is_dtensor(t: object) -> bool:
    """Whether `t` is a sharded tensor (DTensor). A DTensor exists only once torch.distributed.tensor is imported
    (FSDP2 and DCP import it), so a process without one never pays that large import to ask."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# hardware.process_group_timeout_min's default. Rank 0 alone writes a checkpoint (the whole model
# and optimizer state: minutes on a network filesystem) while the other ranks already wait in the next step's
# collectives; torch's default (10 min for NCCL) would kill such a job at its first checkpoint.
# The step watchdog (pipeline/training/stopping.py) is what catches a hung rank, phase by phase, with the
# stacks; this timeout is the backstop behind it and should exceed the watchdog's longest allowance (the
# trainer warns when it does not), so that a hang is reported by the watchdog, not by a collective's timeout.
DEFAULT_TIMEOUT_MIN = 60


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # this process created the process group (and destroys it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return torch_dist.is_available() and torch_dist.is_initialized()


def init_distributed(device_type: str, timeout_min: float = DEFAULT_TIMEOUT_MIN) -> Dist:
    """Join the torchrun job (gloo on CPU, nccl on CUDA; one GPU per local rank), use a process
    group the caller already initialised, or run alone (world size 1, no process group).
    `timeout_min` (``hardware.process_group_timeout_min``) bounds how long a collective waits for the
    other ranks before the job is aborted (`DEFAULT_TIMEOUT_MIN`)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PipelineError("hardware.device is cuda but no CUDA device is visible; set hardware.device: cpu")
    joined = torch_dist.is_initialized()
    if not joined and "RANK" not in os.environ:
        return Dist(0, 0, 1, torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not joined:
        backend = "nccl" if device_type == "cuda" else "gloo"
        torch_dist.init_process_group(backend=backend, device_id=device if device_type == "cuda" else None,
                                      timeout=timedelta(minutes=timeout_min))
    return Dist(torch_dist.get_rank(), local_rank, torch_dist.get_world_size(), device, owns_group=not joined)


def all_reduce_sum(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.distributed:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t


def close_distributed(dist: Dist, ddp_ref: weakref.ref) -> None:
    """End of training: a barrier, then free the DDP module (`ddp_ref`; the caller has dropped its
    references), then destroy the process group if this process created it.

    The order matters. The DDP reducer holds a reference to the process group, and pybind frees the
    reducer without releasing the GIL. Were the reducer the group's last holder, ~ProcessGroupGloo
    would join gloo's worker threads under the GIL while a worker waits for the GIL to free a
    finished collective's tensors (those whose Python objects are gone, as all_gather_object's
    are): a deadlock at exit, seen in about one 2-process run in fifteen. Freed first (by refcount,
    else by the cycle collector, else after dropping torch.compile's caches), the module leaves the
    group's own Python object as its last holder, and that one's destructor releases the GIL.
    """
    if not dist.distributed:
        return
    if dist.owns_group:
        torch_dist.barrier()
    if ddp_ref() is not None:  # not freed by refcount alone: reference cycles
        gc.collect()
    if ddp_ref() is not None:  # held by torch.compile's caches
        torch._dynamo.reset()
        gc.collect()
    if ddp_ref() is not None:
        log.warning("the DDP module is still referenced after training; destroying the process group may hang")
    if dist.owns_group:
        torch_dist.destroy_process_group()


def gather_objects(obj, dist: Dist) -> list:
    """`obj` of every rank, indexed by rank (a collective: every rank must call it)."""
    if not dist.distributed:
        return [obj]
    out = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of this process alone (gloo on CPU, nccl on CUDA; an in-process store, no
    torchrun): what FSDP2 needs to shard over one rank. Destroyed at the exit."""
    if torch_dist.is_initialized():
        raise PipelineError("a 1-rank process group of its own cannot start inside a torchrun job: run it "
                            "without torchrun")
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # nccl's device_id names one GPU
        device = torch.device("cuda", torch.cuda.current_device())
    torch_dist.init_process_group("nccl" if cuda else "gloo", store=torch_dist.HashStore(), rank=0, world_size=1,
                                  device_id=device if cuda else None)
    try:
        yield Dist(0, 0, 1, device, owns_group=True)
    finally:
        torch_dist.destroy_process_group()
