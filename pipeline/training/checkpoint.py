"""Training checkpoints: atomic, `weights_only`-loadable, enough state to resume bit-exactly.

Layout under ``R/train/``::

    ckpt/step_000100.pt   one file per saved step (the newest `keep` are kept)
    ckpt/latest           text: the file name of the newest complete checkpoint (written after it)
    final.pt              the trained model (no optimizer state), written last

Each checkpoint file is written, checksummed and loaded by pipeline/model/checkpoint.py (the file
format the evaluation stages read too); this module keeps what only training needs: RNG state, the
``latest`` pointer, the newest readable checkpoint of a resume, pruning.

A resumable checkpoint is a dict of tensors and plain Python values only (so that
``torch.load(path, weights_only=True)`` can read it — no pickled objects):

* ``model``: state dict of the plain model (the trainer keeps a reference to it; DDP and
  torch.compile wrap only the `LossModel` around it, so no ``module.`` / ``_orig_mod.`` prefixes);
* ``optimizer``: the optimizer's state dict; ``schedule``: ``{"step": …}`` (the LR is a pure
  function of the step, see pipeline/training/optim.py);
* ``loader``: one loader state per rank, indexed by rank (gathered to rank 0 at save time), so a
  resumed rank r continues exactly where rank r stopped; resuming needs the same world size. (With
  pipeline.data.loader the states are equal — a position in the global row order — but storing every
  rank's keeps the format independent of how a loader shards);
* ``rng``: one RNG snapshot per rank (`rng_state()`: Python, NumPy, torch CPU, and the CUDA
  generator of the rank's own device — not every visible device, which would create a context on
  each);
* ``step``, ``tokens_seen`` (global input tokens), ``loss_tokens`` (global target tokens counted
  by the loss), ``best_val_loss``, ``last_val_loss``, ``world_size``, ``wandb_id``, ``params`` (the run config),
  ``plan``, ``versions``.

Only rank 0 writes. Each write goes to a temporary file that is renamed into place, and the
``latest`` pointer is replaced after the checkpoint it names is complete, so a crash at any moment
leaves the previous checkpoint usable. A resume takes the newest checkpoint that loads
(`newest_readable`): one that does not, or does not match its checksum, is moved (with its sidecar) to
``ckpt/unreadable/`` with a warning.
"""
from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError
from pipeline.io import atomic_write, get_logger
from pipeline.model.checkpoint import NAME_RE, SUFFIX, checksum_path, load_checkpoint

__all__ = [
    "rng_state",
    "set_rng_state",
    "checkpoint_name",
    "latest_checkpoint",
    "step_checkpoints",
    "newest_readable",
    "write_latest",
    "prune_checkpoints",
    "clear_checkpoints",
]

log = get_logger(__name__)
LATEST = "latest"


def rng_state() -> dict:
    """This process's RNG states as tensors and plain lists/ints (weights_only-safe); `cuda` is the
    current device's generator state, or None when CUDA is not in use."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {"kind": np_kind, "keys": np_keys.tolist(), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


def write_latest(ckpt_dir: str | Path, name: str) -> None:
    """Point `ckpt_dir/latest` at checkpoint file `name` (atomically)."""
    with atomic_write(Path(ckpt_dir) / LATEST) as f:
        f.write(name + "\n")


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint named by `ckpt_dir/latest`, or None when there is no pointer."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not NAME_RE.match(name) or not (Path(ckpt_dir) / name).exists():
        raise PipelineError(f"{pointer} names {name!r}, which is not an existing checkpoint; fix or delete the pointer")
    return Path(ckpt_dir) / name


def step_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The step checkpoints in `ckpt_dir`, newest (highest step) first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    steps = [p for p in ckpt_dir.iterdir() if NAME_RE.match(p.name)]
    return sorted(steps, key=lambda p: int(NAME_RE.match(p.name).group(1)), reverse=True)


def newest_readable(ckpt_dir: str | Path) -> tuple[Path | None, dict | None]:
    """(path, state) of the newest step checkpoint that loads, or (None, None) when there is none.

    Each step file is complete once it exists (written to a temp file, then renamed), so the newest by step
    is taken even when `latest` still names the one before (a kill between the rename and the pointer
    update); `latest` is then rewritten. A file that does not load (truncated by a full disk, damaged, or
    written by another program) is moved aside to `ckpt_dir/unreadable/` with a warning naming it, and the
    next newest is tried. Call on the main rank only.
    """
    ckpt_dir = Path(ckpt_dir)
    for path in step_checkpoints(ckpt_dir):
        try:
            state = load_checkpoint(path)
        except PipelineError as e:
            dest = ckpt_dir / "unreadable" / path.name
            dest.parent.mkdir(exist_ok=True)
            path.rename(dest)
            if checksum_path(path).exists():
                checksum_path(path).rename(checksum_path(dest))
            log.warning("%s; moved it aside to %s and trying the next newest checkpoint", e, dest)
            continue
        pointer = ckpt_dir / LATEST
        if not pointer.exists() or pointer.read_text(encoding="utf-8").strip() != path.name:
            write_latest(ckpt_dir, path.name)
        return path, state
    return None, None


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> None:
    """Delete all but the `keep` newest step checkpoints (never the one `latest` points to)."""
    ckpt_dir = Path(ckpt_dir)
    current = latest_checkpoint(ckpt_dir)
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := NAME_RE.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else steps:
        if p != current:
            p.unlink()
            checksum_path(p).unlink(missing_ok=True)
            log.info("pruned old checkpoint %s", p)


def _is_step_file(name: str) -> bool:
    """A step checkpoint, its checksum sidecar, or the `latest` pointer."""
    return bool(NAME_RE.match(name.removesuffix(SUFFIX))) or name == LATEST


def archive_checkpoints(ckpt_dir: str | Path) -> Path:
    """Move a run's step checkpoints and `latest` pointer aside to `ckpt_dir/stale-<time>/`, the one
    such directory kept: an earlier one is removed (each can hold a whole run's checkpoints)."""
    ckpt_dir = Path(ckpt_dir)
    for old in ckpt_dir.glob("stale-*"):
        shutil.rmtree(old, ignore_errors=True)
        log.info("removed older stale checkpoints %s", old)
    dest = ckpt_dir / time.strftime("stale-%Y%m%dT%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    for p in ckpt_dir.iterdir():
        if _is_step_file(p.name):
            p.rename(dest / p.name)
    return dest


def clear_checkpoints(ckpt_dir: str | Path) -> None:
    """Remove the step checkpoints and the `latest` pointer (a fresh start must not leave stale ones)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        return
    for p in ckpt_dir.iterdir():
        if _is_step_file(p.name):
            p.unlink()
