"""Checkpoint files: atomic, `weights_only`-loadable, verified against a sha256 sidecar.

Each checkpoint file has a sidecar ``<file>.sha256`` (``sha256sum -c`` format), hashed as the file
is written; every load verifies the file against it first (`verify_checkpoint`, streamed), so a
checkpoint damaged on disk is an error naming it, not a model that loads with corrupt weights. What a
training checkpoint holds, and the ``ckpt/`` directory around it: pipeline/training/checkpoint.py.
The model layer owns the file format because every reader of a model (the trainer's resume, chat,
CORE, the report, the Hugging Face export) goes through it.
"""
from __future__ import annotations

import platform
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError
from pipeline.io import HashingFile, atomic_path, atomic_write, verify_sha256

__all__ = ["NAME_RE", "versions", "save_checkpoint", "checksum_path", "verify_checkpoint", "load_checkpoint"]

# a step checkpoint's name (checkpoint_name): a file step_NNNNNN.pt, or a directory step_NNNNNN.dcp of
# sharded state (train.parallel: fsdp, pipeline/training/checkpoint.py)
NAME_RE = re.compile(r"^step_(\d{6,})\.(?:pt|dcp)$")
SUFFIX = ".sha256"


def versions() -> dict:
    return {
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


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
    ranks of a resume). A missing, unreadable or corrupt file is a PipelineError: for a run's own checkpoint
    (final.pt, a step's) what rewrites it, for any other file that it is not a readable checkpoint."""
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
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        if NAME_RE.match(path.name) or path.name == "final.pt":  # a run's own checkpoint, damaged since written
            raise PipelineError(f"checkpoint {path} cannot be read ({why}); {_fix(path)}") from None
        # any other file (`chat --ckpt README.md`): not a checkpoint to rewrite, the wrong file to pass
        if not zipfile.is_zipfile(path):
            why = "not the zip archive torch.save writes"
        raise PipelineError(f"{path} is not a readable PyTorch checkpoint ({why}); pass R/train/<stage>/final.pt of a "
                            "trained run, or an exported Hugging Face directory") from None
