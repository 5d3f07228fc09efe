"""Optimizers and learning-rate schedules for training.

- `build_optimizer(model, tcfg, device_type)`: AdamW, 8-bit AdamW or Muon (+ AdamW for the non-matrix
  groups, `CombinedOptimizer`) over the `param_groups` (embedding, lm_head, matrix, no_decay);
- `lr_factor(step, num_steps, tcfg)`, `set_lr(optimizer, factor)`: warmup + cosine or WSD, a pure function
  of the step (nothing to checkpoint);
- `Muon`: torch's Muon, with one owner rank per matrix under fsdp (`muon_owners`) and an fp32
  `newton_schulz` on the CPU.

Usage: ``opt = build_optimizer(model, cfg.train, "cuda"); set_lr(opt, lr_factor(step, n, cfg.train))``.
The groups, the optimizers and sharded Muon: docs/training.md, "Optimizers and schedules".
"""
from __future__ import annotations

import math

import torch

from pipeline.distributed import is_dtensor
from pipeline.errors import PipelineError
from pipeline.io import get_logger

__all__ = ["param_groups", "build_optimizer", "CombinedOptimizer", "Muon", "newton_schulz", "member_optimizers",
           "lr_factor", "set_lr"]

log = get_logger(__name__)

EMBEDDING = "tok_embeddings.weight"
LM_HEAD = "lm_head.weight"


def param_groups(model: torch.nn.Module, tcfg: dict) -> list[dict]:
    """Split the parameters of an unwrapped model into the named groups of the table above.

    Groups with no parameters are left out. Each group is a dict with ``name``, ``params``, ``lr``,
    ``base_lr`` and ``weight_decay`` (extra keys are kept by torch optimizers and their state dicts).
    """
    lr, wd = tcfg["lr"], tcfg["weight_decay"]
    embed_lr = tcfg.get("embed_lr") or lr
    lm_head_lr = tcfg.get("lm_head_lr") or lr
    buckets: dict[str, list] = {"embedding": [], "lm_head": [], "matrix": [], "no_decay": []}
    names = dict(model.named_parameters())  # shared (tied) tensors appear once
    if LM_HEAD not in names and tcfg.get("lm_head_lr") is not None:
        log.warning("train.lm_head_lr is ignored: the lm head is tied to the embedding, which uses train.embed_lr")
    for name, p in names.items():
        if not p.requires_grad:
            continue
        if name == EMBEDDING:
            buckets["embedding"].append(p)
        elif name == LM_HEAD:
            buckets["lm_head"].append(p)
        elif p.ndim >= 2:
            buckets["matrix"].append(p)
        else:
            buckets["no_decay"].append(p)
    settings = {"embedding": (embed_lr, 0.0), "lm_head": (lm_head_lr, wd), "matrix": (lr, wd), "no_decay": (lr, 0.0)}
    return [
        {"name": n, "params": ps, "lr": settings[n][0], "base_lr": settings[n][0], "weight_decay": settings[n][1]}
        for n, ps in buckets.items() if ps
    ]


class CombinedOptimizer:
    """Several optimizers stepped as one (Muon for block matrices + AdamW for the rest).

    ``param_groups`` is the concatenation of the members' groups; the state dict is
    ``{"optimizers": [member state dicts]}``.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["optimizers"]) != len(self.optimizers):
            raise PipelineError("checkpoint optimizer state does not match train.optimizer; "
                                "resume with the same optimizer")
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)


def muon_owners(shapes: list[tuple[int, int]], world_size: int) -> list[tuple[int, int]]:
    """(round, owner rank) of each matrix of `shapes` for sharded Muon (docs/training.md): the matrices in
    order of decreasing Newton-Schulz cost (4m²n + 2m³ per iteration, m ≤ n; ties keep their order) dealt
    one per rank per round. A function of the shapes alone, so every rank computes the same."""
    def cost(shape: tuple[int, int]) -> int:
        m, n = sorted(shape)
        return 4 * m * m * n + 2 * m ** 3

    order = sorted(range(len(shapes)), key=lambda i: -cost(shapes[i]))
    owners = [(0, 0)] * len(shapes)
    for k, i in enumerate(order):
        owners[i] = divmod(k, world_size)
    return owners


def newton_schulz(x: torch.Tensor, group: dict, on: str | None = None) -> torch.Tensor:
    """Muon's Newton-Schulz orthogonalisation of the matrix `x` with `group`'s coefficients, steps and eps, for
    a step on device type `on` (default: `x`'s): torch's iteration in bf16, or on the CPU the same iteration
    in fp32 (docs/training.md, "Optimizers and schedules")."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    if (on or x.device.type) != "cpu":
        return _zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
    a, b, c = group["ns_coefficients"]
    tall = x.size(0) > x.size(1)
    y = x.float().T if tall else x.float()
    y = y / y.norm().clamp(min=group["eps"])  # out of place: for an fp32 `x`, x.float() is `x` itself
    for _ in range(group["ns_steps"]):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


class Muon(torch.optim.Muon):
    """torch.optim.Muon that also steps sharded (DTensor) matrices, each orthogonalised by one owner rank,
    and orthogonalises with `newton_schulz` (docs/training.md); plain tensors off the CPU take torch's own
    step."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import _adjust_lr

        if not any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            if not any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                return super().step(closure)
            return self._plain_step(closure)
        if closure is not None:
            raise PipelineError("Muon on sharded parameters takes no closure")
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for grad, buf in zip(grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
            for i, ortho in _orthogonalised_sharded(grads, bufs, group):
                p = params[i]
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return None

    def _plain_step(self, closure):
        """torch's step (torch.optim._muon._single_tensor_muon) with `newton_schulz` orthogonalising."""
        from torch.optim._muon import _adjust_lr

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)  # (it refuses complex and sparse, as torch's step)
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                ortho = newton_schulz(grad.lerp(buf, momentum) if group["nesterov"] else buf, group)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _orthogonalised_sharded(grads: list, bufs: list, group: dict):
    """Yields (i, the Newton-Schulz orthogonalisation of matrix i's momentum-corrected update), a DTensor
    sharded like the update in the dtype the iteration returns, round by round of `muon_owners`: the
    updates of a round made (Nesterov: from the gradient and the updated momentum `bufs`), gathered by
    their owners, orthogonalised, scattered back as shards."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    def update(i: int):
        return grads[i].lerp(bufs[i], group["momentum"]) if group["nesterov"] else bufs[i]

    if not bufs:
        return
    mesh = bufs[0].device_mesh
    if mesh.ndim != 1 or any(b.device_mesh != mesh or tuple(b.placements) != (Shard(0),) for b in bufs):
        raise PipelineError("Muon steps parameters sharded on dim 0 over one 1-D mesh (train.parallel: fsdp); "
                            f"got placements {sorted({str(b.placements) for b in bufs})}")
    pg, W, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    owners = muon_owners([tuple(b.shape) for b in bufs], W)
    # the dtype the iteration returns (torch's: bf16; fp32 on the CPU), in which the owners send: found on the
    # meta device
    on = bufs[0].to_local().device.type
    sent = {dtype: newton_schulz(torch.empty(1, 1, dtype=dtype, device="meta"), group, on).dtype
            for dtype in {b.dtype for b in bufs}}
    for r in range(max(k for k, _ in owners) + 1):
        members = [i for i, (k, _) in enumerate(owners) if k == r]
        updates = {i: update(i) for i in members}
        # rows of the largest shard (Shard(0) cuts like torch.chunk): every shard padded to it for the collectives
        rows = {i: -(-updates[i].shape[0] // W) for i in members}
        src = {i: dist.get_global_rank(pg, owners[i][1]) for i in members}
        mine, sends, works = None, [], []  # (the sent tensors kept alive until the collectives finish)
        for i in members:
            local = updates[i].to_local()
            sends.append(local.new_zeros(rows[i], *local.shape[1:]))
            sends[-1][:local.shape[0]] = local
            parts = [torch.empty_like(sends[-1]) for _ in range(W)] if owners[i][1] == rank else None
            mine = (i, parts) if parts is not None else mine
            works.append(dist.gather(sends[-1], parts, dst=src[i], group=pg, async_op=True))
        for w in works:
            w.wait()
        pieces = None
        if mine is not None:  # this rank's matrix of the round, whole: orthogonalised, cut into padded shards
            i, parts = mine
            ortho = newton_schulz(torch.cat(parts)[:updates[i].shape[0]], group)
            padded = ortho.new_zeros(rows[i] * W, *ortho.shape[1:])
            padded[:ortho.shape[0]] = ortho
            pieces = list(padded.chunk(W))
        received, works = {}, []
        for i in members:
            u = updates[i]
            received[i] = torch.empty((rows[i], *u.shape[1:]), dtype=sent[u.dtype], device=u.to_local().device)
            works.append(dist.scatter(received[i], pieces if owners[i][1] == rank else None, src=src[i], group=pg,
                                      async_op=True))
        for w in works:
            w.wait()
        for i in members:
            u = updates[i]
            local = received[i][:u.to_local().shape[0]]
            yield i, DTensor.from_local(local, mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())


def member_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers an optimizer of `build_optimizer` consists of (one, or a CombinedOptimizer's)."""
    return list(optimizer.optimizers) if isinstance(optimizer, CombinedOptimizer) else [optimizer]


def _adamw(groups: list[dict], tcfg: dict, device_type: str) -> torch.optim.Optimizer:
    kernel = {"fused": True} if device_type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=tcfg["lr"], betas=tuple(tcfg["betas"]), weight_decay=tcfg["weight_decay"],
                             **kernel)


def _adamw8bit(groups: list[dict], tcfg: dict, device_type: str) -> torch.optim.Optimizer:
    from pipeline.planning.stages import ADAMW8BIT_FSDP

    if any(is_dtensor(p) for g in groups for p in g["params"]):  # the config checks refuse it first
        raise PipelineError(f"train.optimizer: {ADAMW8BIT_FSDP}; use adamw or muon, or train.parallel: ddp")
    if device_type != "cuda":
        raise PipelineError("train.optimizer: adamw8bit needs hardware.device: cuda "
                            "(bitsandbytes kernels are CUDA-only)")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise PipelineError(
            "train.optimizer: adamw8bit needs the bitsandbytes package: pip install bitsandbytes "
            "(or set train.optimizer: adamw)"
        ) from None
    return bnb.optim.AdamW8bit(groups, lr=tcfg["lr"], betas=tuple(tcfg["betas"]), weight_decay=tcfg["weight_decay"])


def build_optimizer(model: torch.nn.Module, tcfg: dict, device_type: str):
    """The optimizer for `train.optimizer` over `param_groups(model, tcfg)` (model unwrapped)."""
    groups = param_groups(model, tcfg)
    kind = tcfg["optimizer"]
    if kind == "adamw":
        return _adamw(groups, tcfg, device_type)
    if kind == "adamw8bit":
        return _adamw8bit(groups, tcfg, device_type)
    if kind == "muon":
        matrix = [g for g in groups if g["name"] == "matrix"]
        rest = [g for g in groups if g["name"] != "matrix"]
        muon = Muon(matrix, lr=tcfg["lr"], weight_decay=tcfg["weight_decay"],
                                adjust_lr_fn="match_rms_adamw")
        return CombinedOptimizer([muon, _adamw(rest, tcfg, device_type)])
    raise PipelineError(f"train.optimizer: unknown optimizer {kind!r} (adamw, adamw8bit, muon)")


def lr_factor(step: int, num_steps: int, tcfg: dict) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based) of `num_steps`.

    Warm-up (``step < W``, W = `warmup_steps`): ``(step + 1) / W`` — linear, reaching 1 at step W−1.
    Then, with r = `min_lr_ratio`:

    * ``cosine``: ``r + (1 − r)·½(1 + cos(π·p))``, p = (step − W) / (num_steps − W − 1), so the
      factor is 1 at step W and exactly r at the last step.
    * ``wsd`` (warmup-stable-decay): 1 until the last ``n_d = round(decay_frac·num_steps)`` steps,
      then linear ``1 − (1 − r)·k / n_d`` for the k-th decay step (k = 1..n_d): r at the last step.
    * ``decay``: linear ``1 − (1 − r)·p`` with p as for cosine: WSD's decay phase as a training stage
      of its own (e.g. a mid-training stage after a stable pretraining stage).
    """
    w = tcfg["warmup_steps"]
    if step < w:
        return (step + 1) / w
    r = tcfg["min_lr_ratio"]
    if tcfg["schedule"] == "cosine":
        p = min(1.0, (step - w) / max(1, num_steps - w - 1))
        return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
    if tcfg["schedule"] == "wsd":
        n_decay = round(tcfg["decay_frac"] * num_steps)
        k = step - (num_steps - n_decay) + 1
        return 1.0 if k <= 0 else 1 - (1 - r) * min(k, n_decay) / n_decay
    if tcfg["schedule"] == "decay":  # WSD's decay phase as a stage of its own
        return 1 - (1 - r) * min(1.0, (step - w) / max(1, num_steps - w - 1))
    raise PipelineError(f"train.schedule: unknown schedule {tcfg['schedule']!r} (cosine, wsd, decay)")


def set_lr(optimizer, factor: float) -> None:
    """Set every group's lr to its base_lr × factor."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * factor
