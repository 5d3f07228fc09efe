"""Training metrics: the JSONL + wandb logger, MFU, norms of watched parameter groups, memory.

- `MetricsLogger`: rank 0's writer of ``R/train/{stage}/metrics.jsonl`` (one JSON object per logged step)
  and of the wandb run;
- `mfu(flops_per_token, tokens_per_s, world_size, peak_flops)`, `watched_groups(model)`, `group_norms`,
  `UpdateRatio`, `memory_stats(device)`.

The keys of metrics.jsonl, the watched groups and the MFU formula: docs/training.md, "Metrics".
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from pipeline.distributed import is_dtensor
from pipeline.io import atomic_write, get_logger

__all__ = [
    "mfu",
    "watched_groups",
    "group_norms",
    "UpdateRatio",
    "memory_stats",
    "MetricsLogger",
]

log = get_logger(__name__)
RESUME_ATTEMPTS, RESUME_WAIT_S = 10, 3  # wandb run id still held after a kill: wait up to ~30 s

def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak FLOP/s of all devices."""
    return flops_per_token * tokens_per_s / (world_size * peak_flops)


def watched_groups(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The watched parameter groups of an unwrapped model (see docs/training.md, "Metrics")."""
    n_layers = len(model.layers)
    prefixes = {"embedding": "tok_embeddings.", "lm_head": "lm_head.", "block_first": "layers.0.",
                "block_last": f"layers.{n_layers - 1}."}
    groups = {k: [p for n, p in model.named_parameters() if n.startswith(pre)] for k, pre in prefixes.items()}
    return {k: ps for k, ps in groups.items() if ps}


def _norm(tensors: list[torch.Tensor]) -> float:
    """L2 norm of the tensors together; of sharded (DTensor) ones the whole tensors' (one all-reduce, so
    every rank must call it: the trainer computes every record on every rank)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))
    return float(norm.full_tensor() if is_dtensor(norm) else norm)


def group_norms(groups: dict[str, list[torch.Tensor]], prefix: str, grads: bool = False) -> dict[str, float]:
    """``{prefix/group: L2 norm}`` of the parameters (or, with grads=True, their gradients)."""
    out = {}
    for name, params in groups.items():
        ts = [p.grad for p in params if p.grad is not None] if grads else [p.detach() for p in params]
        if ts:
            out[f"{prefix}/{name}"] = _norm(ts)
    return out


class UpdateRatio:
    """‖θ_after − θ_before‖ / ‖θ_before‖ per watched group: snapshot before the optimizer step,
    compute after it. Only used on log steps: the snapshot copies the watched tensors (the embedding
    and two blocks, in fp32) after backward has freed the activations,
    so it stays below the step's peak memory."""

    def __init__(self, groups: dict[str, list[torch.Tensor]]):
        self.groups = groups
        self.before = {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}

    def ratios(self) -> dict[str, float]:
        out = {}
        for k, ps in self.groups.items():
            delta = _norm([p.detach() - b for p, b in zip(ps, self.before[k], strict=True)])
            out[f"update_ratio/{k}"] = delta / max(_norm(self.before[k]), 1e-12)
        return out


def memory_stats(device: torch.device) -> dict[str, float]:
    """CUDA memory allocated / peak allocated / reserved in GB (empty on CPU)."""
    if device.type != "cuda":
        return {}
    gb = 1e9
    return {
        "mem/allocated_gb": torch.cuda.memory_allocated(device) / gb,
        "mem/peak_gb": torch.cuda.max_memory_allocated(device) / gb,
        "mem/reserved_gb": torch.cuda.memory_reserved(device) / gb,
    }


class MetricsLogger:
    """Append metric records to a JSONL file and, unless wandb is disabled, to a wandb run.

    Only the main process should construct one. `wandb_cfg` is the config's `wandb` section
    (`mode`: offline | online | disabled, `project`, `entity`); the API key is read by wandb itself
    from the WANDB_API_KEY environment variable and never passes through here. The wandb run
    directory is under `<outdir>/wandb/`; each record goes to wandb whole, its ``step`` as an ordinary
    metric that is every metric's x-axis (wandb's own step is left to wandb). `resume_step`: keep the
    records of steps <= it (a resumed run redoes the later ones); None starts a fresh file. `steps`: the
    steps the file holds, in order.
    """

    def __init__(self, path: str | Path, wandb_cfg: dict, outdir: str | Path, config: dict,
                 run_name: str, resume_step: int | None = None, wandb_id: str | None = None):
        self.path = Path(path)
        self._truncate(resume_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.wandb_run = None
        if wandb_cfg.get("mode", "offline") != "disabled":
            self.wandb_run = self._init_wandb(wandb_cfg, Path(outdir), config, run_name, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def _truncate(self, resume_step: int | None) -> None:
        """Keep the records of steps <= `resume_step` (all of them logged before the checkpoint the run
        resumes from); drop the later ones, which the resumed run logs again, and a last line cut short
        by a kill."""
        keep = []
        if resume_step is not None and self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        log.warning("%s line %d is cut short (a kill while it was written): dropped", self.path, n)
                        continue
                    if record["step"] <= resume_step:
                        keep.append(record)
        self.steps = [r["step"] for r in keep]
        with atomic_write(self.path) as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)

    @staticmethod
    def _init_wandb(wandb_cfg: dict, outdir: Path, config: dict, run_name: str, wandb_id: str | None):
        import wandb

        outdir.mkdir(parents=True, exist_ok=True)  # wandb writes its run under outdir/wandb/
        os.environ.setdefault("WANDB_SILENT", "true")
        kwargs = dict(project=wandb_cfg.get("project", "tokenfarm"), entity=wandb_cfg.get("entity"),
                      mode=wandb_cfg.get("mode", "offline"), dir=str(outdir), name=run_name, config=config,
                      id=wandb_id, resume="allow" if wandb_id else None)
        # A run resumed right after a kill -9 can find the killed trainer's wandb service still holding
        # the run id (the service watches its parent's pid and exits a little later): wait for it.
        for attempt in range(RESUME_ATTEMPTS):
            try:
                run = wandb.init(**kwargs)
                break
            except Exception as e:
                if not wandb_id or "in use" not in str(e):
                    raise
                if attempt == RESUME_ATTEMPTS - 1:  # metrics.jsonl stays complete: the history is not lost
                    log.warning("wandb run %s is still held by another process (%s): this run logs to %s only",
                                wandb_id, e, outdir / "metrics.jsonl")
                    return None
                log.warning("wandb run %s is still held by a stopped trainer's service; retrying in %d s",
                            wandb_id, RESUME_WAIT_S)
                time.sleep(RESUME_WAIT_S)
        # The optimizer step is an ordinary metric and every other metric's x-axis, not wandb's own
        # `step`: wandb drops rows logged at or below its last step, and a run resumed from a
        # checkpoint redoes the steps after it, which a killed run may already have sent.
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.steps.append(record["step"])
        if self.wandb_run is not None:
            self.wandb_run.log(dict(record))  # "step" included: the x-axis metric (see _init_wandb)

    def close(self) -> None:
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
