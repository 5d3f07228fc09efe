"""Training checkpoints: atomic, `weights_only`-loadable, enough state to resume bit-exactly.

Layout under ``R/train/``::

    ckpt/step_000100.pt   one file per saved step (the newest `keep` are kept)
    ckpt/latest           text: the file name of the newest complete checkpoint (written after it)
    final.pt              the trained model (no optimizer state), written last

Each checkpoint file has a sidecar ``<file>.sha256`` (``sha256sum -c`` format), hashed as the file
is written; every load verifies the file against it first (`verify_checkpoint`, streamed), so a
checkpoint damaged on disk is an error naming it, not a model that loads with corrupt weights.

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

import platform
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError
from pipeline.io import HashingFile, atomic_path, atomic_write, get_logger, verify_sha256

__all__ = [
    "rng_state",
    "set_rng_state",
    "versions",
    "checkpoint_name",
    "save_checkpoint",
    "checksum_path",
    "verify_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "step_checkpoints",
    "newest_readable",
    "write_latest",
    "prune_checkpoints",
    "clear_checkpoints",
]

log = get_logger(__name__)
NAME_RE = re.compile(r"^step_(\d{6,})\.pt$")
LATEST = "latest"
SUFFIX = ".sha256"


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


def versions() -> dict:
    return {
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


def checksum_path(path: str | Path) -> Path:
    """The sidecar `<file>.sha256` (`sha256sum` format) that `save_checkpoint` writes next to a checkpoint."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def save_checkpoint(path: str | Path, state: dict) -> None:
    """torch.save `state` to `path` atomically (temp file + fsync + rename), then its sha256 (hashed as
    it is written) to the sidecar `checksum_path(path)`. The old sidecar is removed before the rename,
    so a crash at any moment leaves a file with its own checksum or none, never another file's. Call on
    rank 0 only."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            hashing = HashingFile(f)
            torch.save(state, hashing)
        checksum_path(path).unlink(missing_ok=True)
    with atomic_write(checksum_path(path)) as f:
        f.write(f"{hashing.sha256.hexdigest()}  {path.name}\n")


def _fix(path: Path) -> str:
    """What to do about a damaged checkpoint, by what it is."""
    if NAME_RE.match(path.name):
        return "delete it (a resume takes the checkpoint before it), or start over with train.resume: never"
    if path.name == "final.pt":
        return ("delete it and rerun snakemake: the train rule rewrites it (and reruns what was made from it; "
                "`snakemake -R train` retrains every stage)")
    return "delete it and write it again"


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint against the sha256 its sidecar recorded when it was written (streamed, once
    per process): a file damaged since (bytes zeroed, a bad copy) is a PipelineError naming it. A file
    without a sidecar (written before checksums were recorded) is not checked."""
    path = Path(path)
    sidecar = checksum_path(path)
    try:
        expected = sidecar.read_text(encoding="utf-8").split()[0]
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError, IndexError) as e:
        raise PipelineError(f"{sidecar}: not a readable checksum ({e!r}); delete it, or {_fix(path)}") from None
    verify_sha256(path, expected, sidecar.name, _fix(path))


def load_checkpoint(path: str | Path, verify: bool = True) -> dict:
    """Load a checkpoint with ``weights_only=True``, its tensors memory-mapped from the file
    (``mmap=True``, on CPU): nothing is read into host memory until used, so each rank of a resumed
    job pages in only what it copies (model and optimizer into its own device, its own loader/RNG
    entry) and the page cache is shared between ranks, instead of every rank holding a private copy
    of the whole checkpoint. The file is first verified against its sidecar sha256
    (`verify_checkpoint`; `verify=False` where another process of the job just did, e.g. the other
    ranks of a resume). A missing, unreadable or corrupt file is a PipelineError."""
    path = Path(path)
    if path.is_dir():
        raise PipelineError(f"{path} is a directory, not a checkpoint file; pass R/train/<stage>/final.pt (an exported "
                            f"Hugging Face directory becomes one with: python -m pipeline.evaluation.export --from-hf "
                            f"{path} --out CKPT.pt)")
    if not path.exists():
        raise PipelineError(f"checkpoint {path} does not exist")
    if verify:
        verify_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated / corrupt / not a torch file
        raise PipelineError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); {_fix(path)}") from None


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
