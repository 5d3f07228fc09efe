"""Training checkpoints: atomic, `weights_only`-loadable, enough state to resume bit-exactly.

Layout under ``R/train/{stage}/``: ``ckpt/step_000100.pt`` (under fsdp a sharded ``ckpt/step_000100.dcp/``),
``ckpt/latest`` (the newest complete one), ``final.pt`` (the model only, always one consolidated file).
The file format itself is pipeline/model/checkpoint_io.py's; this module keeps what only training needs.

- `Checkpointer(ckpt_dir, dist, keep, async_save)`: built once per run; ``save(...)`` at every checkpoint
  step (staged, then written in the background), ``wait()`` / ``close()`` / ``abort()``;
- `save_training_checkpoint(...)`: the synchronous save (``train.async_ckpt: false``);
- `resume(ckpt_dir, mode, dist, model=..., optimizer=..., loader=..., params=...)`: how a launch starts
  (the newest readable checkpoint of the same config, at any world size, else afresh or from ``--init``);
- `newest_readable`, `prune_checkpoints`, `rng_state` / `set_rng_state`, `trajectory_params`.
The contents, the sharded (DCP) layout, resuming on another world size, async saves: docs/training.md,
"Checkpoints".
"""
from __future__ import annotations

import contextlib
import math
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from pipeline.distributed import Dist, gather_objects
from pipeline.errors import PipelineError
from pipeline.io import atomic_dir, atomic_write, get_logger, sha256_file, verify_sha256
from pipeline.model.checkpoint_io import NAME_RE, SUFFIX, checksum_path, load_checkpoint, save_checkpoint, versions
from pipeline.run_config import run_config
from pipeline.training.optim import member_optimizers
from pipeline.training.parallelize import is_sharded

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
    "archive_checkpoints",
    "OBSERVABILITY_KEYS",
    "WORLD_SIZE_KEYS",
    "TrainState",
    "trajectory_params",
    "resume_mismatch",
    "load_init",
    "resume",
    "save_training_checkpoint",
    "Checkpointer",
    "full_model_state",
    "load_step_checkpoint",
]

log = get_logger(__name__)
LATEST = "latest"
DCP = ".dcp"  # a sharded step checkpoint is a directory step_NNNNNN.dcp
TRAIN_STATE = "train_state.pt"  # in it: the non-tensor train state (rank 0)
SUMS = "SHA256SUMS"  # in it: the sha256 of every DCP file


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


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step_{step:06d}{DCP if sharded else '.pt'}"


def _remove(path: Path) -> None:
    """Delete a step checkpoint: a file (and its sidecar) or a sharded checkpoint's directory."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    checksum_path(path).unlink(missing_ok=True)


def _fix(path: Path) -> str:
    return "delete it (a resume takes the checkpoint before it), or start over with train.resume: never"


def load_step_checkpoint(path: str | Path, verify: bool = True) -> dict:
    """A step checkpoint's dict: a file's (`load_checkpoint`), or a sharded directory's non-tensor
    ``train_state.pt`` after its DCP files were verified against ``SHA256SUMS`` (`verify`: every file
    listed there exists with that sha256; the tensor state stays on disk for `_load_sharded`)."""
    path = Path(path)
    if path.suffix != DCP:
        return load_checkpoint(path, verify=verify)
    if verify:
        sums = path / SUMS
        try:
            listed = [ln.split(maxsplit=1) for ln in sums.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except OSError as e:
            raise PipelineError(f"{sums}: not readable ({e.strerror or e}); {_fix(path)}") from None
        if not any(name == ".metadata" for _, name in listed):
            raise PipelineError(f"{sums} lists no .metadata: not a complete checkpoint; {_fix(path)}")
        for digest, name in listed:
            if not (path / name).is_file():
                raise PipelineError(f"{path / name} is missing (listed in {SUMS}); {_fix(path)}")
            verify_sha256(path / name, digest, f"{path.name}/{SUMS}", _fix(path))
    return load_checkpoint(path / TRAIN_STATE, verify=verify)


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
            state = load_step_checkpoint(path)
        except PipelineError as e:
            dest = ckpt_dir / "unreadable" / path.name
            dest.parent.mkdir(exist_ok=True)
            if dest.is_dir():  # an earlier unreadable copy of the same step
                shutil.rmtree(dest)
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


def prune_checkpoints(ckpt_dir: str | Path, keep: int, protect: tuple = ()) -> None:
    """Delete all but the `keep` newest step checkpoints: never the one `latest` points to, nor those in
    `protect` (paths; a `Checkpointer` protects the checkpoint its run resumed from until a newer one is
    complete). A checkpoint being written has a temporary name until complete: never a step checkpoint's."""
    ckpt_dir = Path(ckpt_dir)
    kept = {latest_checkpoint(ckpt_dir), *(Path(p) for p in protect)}
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := NAME_RE.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else steps:
        if p not in kept:
            _remove(p)
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
            _remove(p)


# ----------------------------------------------------------------------------- resume

# Config keys that change what is logged but not the training trajectory: a checkpoint made under
# other values of these may be resumed.
OBSERVABILITY_KEYS = {
    "wandb": None,
    "eval": None,
    "hardware": ("assumed_mfu", "gpu_memory_gb", "process_group_timeout_min", "hang_timeout_min", "gpu_mtbf_hours",
                 "storage_gb_per_s"),
    "train": ("log_interval", "val_interval", "val_batches", "ckpt_interval", "resume", "async_ckpt"),
}
# Config keys that set the world size: a checkpoint made under other values is resumed, resharded
# (docs/training.md, "Checkpoints").
WORLD_SIZE_KEYS = {"hardware": ("nodes", "nproc_per_node")}


@dataclass
class TrainState:
    """Where a run stands after `step` optimizer steps: what a checkpoint carries besides the model,
    optimizer, loader and RNG states (its keys of the same names)."""

    step: int = 0
    tokens_seen: int = 0          # global input tokens
    loss_tokens: int = 0          # global target tokens counted by the loss
    best_val_loss: float = math.inf
    last_val_loss: float = math.nan
    wandb_id: str | None = None


def _without(params: dict, drop: dict) -> dict:
    """`params` without the sections (None) and section keys of `drop`."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    for section, keys in drop.items():
        if keys is None:
            out.pop(section, None)
        elif section in out:
            for k in keys:
                out[section].pop(k, None)
    return out


def trajectory_params(params: dict) -> dict:
    """`params` without the OBSERVABILITY_KEYS (what must match for a resume to be exact)."""
    return _without(params, OBSERVABILITY_KEYS)


def resume_mismatch(state: dict, params: dict) -> str | None:
    """Why a checkpoint cannot be resumed by this launch, or None when it can: its config differs
    beyond the OBSERVABILITY_KEYS and the WORLD_SIZE_KEYS (another world size is resharded)."""
    old, new = (_without(trajectory_params(p), WORLD_SIZE_KEYS) for p in (state["params"], params))
    diff = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):  # name the keys within a section
            diff += [f"{k}.{sub}" for sub in sorted(set(a) | set(b)) if a.get(sub) != b.get(sub)]
        elif a != b:
            diff.append(k)
    return f"it was made with a different config (keys differing: {', '.join(diff)})" if diff else None


def load_init(model, optimizer, path: str, params: dict) -> None:
    """Start a stage from an earlier stage's final.pt (and, with carry_optimizer, that stage's last
    optimizer state, keeping this stage's learning rates and weight decay)."""
    st = run_config(params).stage
    state = load_checkpoint(path)
    mine, theirs = model.state_dict(), state.get("model", {})
    differ = sorted(set(mine) ^ set(theirs))
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
              if k in theirs and theirs[k].shape != v.shape]
    if differ or shapes:
        what = ", ".join(shapes[:3]) or f"parameters {', '.join(differ[:3])}"
        raise PipelineError(f"stage '{st['name']}' cannot start from {path}: it holds another model shape ({what}); "
                            f"every stage trains the same model config: retrain '{st['init_from']}' with this "
                            f"model or set init_from: none")
    if is_sharded(model):  # each rank keeps its shards of the whole tensors
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, theirs, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(theirs)
    log.info("stage %s starts from %s", st["name"], path)
    if st["carry_optimizer"]:
        latest = latest_checkpoint(Path(path).parent / "ckpt")
        if latest is None:
            raise PipelineError(f"stage '{st['name']}' carries the optimizer of '{st['init_from']}' but "
                                f"{Path(path).parent / 'ckpt'} holds no checkpoint; rerun that stage or set "
                                "carry_optimizer: false")
        if (latest.suffix == DCP) != is_sharded(model):
            raise PipelineError(f"stage '{st['name']}' carries the optimizer of '{st['init_from']}' but {latest} "
                                "was written under another train.parallel; retrain that stage or set "
                                "carry_optimizer: false")
        keep = [{k: g[k] for k in ("lr", "base_lr", "weight_decay") if k in g} for g in optimizer.param_groups]
        if is_sharded(model):
            _load_sharded(latest, model, optimizer, with_model=False)
        else:
            optimizer.load_state_dict(load_checkpoint(latest)["optimizer"])
        for g, k in zip(optimizer.param_groups, keep, strict=True):
            g.update(k)


def resume(ckpt_dir: Path, mode: str, dist: Dist, *, model, optimizer, loader, params: dict,
           init: str | None = None) -> TrainState:
    """A fresh start, or an exact resume from the newest readable checkpoint in `ckpt_dir`.

    `mode` is auto | require | never (docs/training.md, "The trainer"). Rank 0 picks the
    checkpoint (moving unreadable ones aside); the others load the one it names. One made with another
    config is never resumed: `require` fails, `auto` moves the run's checkpoints aside to
    `stale-<time>/` and starts over; one made by another world size is resumed resharded (module
    docstring). A fresh start loads `init` (a stage starting from an earlier one) and removes any step
    checkpoints left in `ckpt_dir`. Loads the model, optimizer, this rank's loader and RNG states in
    place and returns where the run stands."""
    latest, state = newest_readable(ckpt_dir) if mode != "never" and dist.is_main else (None, None)
    latest = gather_objects(latest, dist)[0]
    if latest is not None and state is None:
        state = load_step_checkpoint(latest, verify=False)  # rank 0's newest_readable verified it
    stale = resume_mismatch(state, params) if state is not None else None
    if stale:
        if mode == "require":
            raise PipelineError(f"{latest} cannot be resumed: {stale}; resume with the same config, or set "
                                "train.resume: auto to start over")
        # A rerun after a config edit (what Snakemake does when the rule's params change) starts over;
        # the old checkpoints are kept aside, never silently resumed into a different run.
        log.warning("%s cannot be resumed (%s): starting over", latest, stale)
        state = None
    if dist.distributed:
        torch_dist.barrier()  # every rank has read the checkpoint before rank 0 moves it aside
    if state is not None and (latest.suffix == DCP) != is_sharded(model):
        raise PipelineError(f"{latest} was written under another train.parallel than this launch's "
                            "(a sharded checkpoint needs train.parallel: fsdp and a process group); resume with the "
                            "same setting, or set train.resume: never to start over")
    if state is not None:
        if latest.suffix == DCP:
            _load_sharded(latest, model, optimizer)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        same_world = state["world_size"] == dist.world_size
        loader.load_state_dict(state["loader"][dist.rank] if same_world else _global_loader_state(latest, state))
        set_rng_state(state["rng"][dist.rank if same_world else 0])
        resumed = TrainState(step=state["step"], tokens_seen=state["tokens_seen"], loss_tokens=state["loss_tokens"],
                             best_val_loss=state["best_val_loss"], last_val_loss=state["last_val_loss"],
                             wandb_id=state["wandb_id"])
        log.info("resumed from %s at step %d (%d tokens)%s", latest, resumed.step, resumed.tokens_seen,
                 "" if same_world else f", resharded from {state['world_size']} to {dist.world_size} process(es)")
        return resumed
    if init is not None:
        load_init(model, optimizer, init, params)
    if dist.is_main:
        if stale:
            log.warning("stale checkpoints moved to %s", archive_checkpoints(ckpt_dir))
        clear_checkpoints(ckpt_dir)
    return TrainState()


def _global_loader_state(path: Path, state: dict) -> dict:
    """The loader state a resume on another world size maps (docs/training.md, "Checkpoints"): the saved ranks' states,
    which must be one global position."""
    first = state["loader"][0]
    if any(other != first for other in state["loader"][1:]):
        raise PipelineError(f"{path} cannot be resumed on another world size: its ranks' loader states differ, "
                            f"so they are no global position to map; resume with {state['world_size']} process(es)")
    return first


def _train_state(dist: Dist, loader, params: dict, plan: dict, state: TrainState) -> dict:
    """A checkpoint's non-tensor part: every rank's loader and RNG state gathered (a collective), the
    `TrainState`, world size, params, plan, versions."""
    loaders = gather_objects(loader.state_dict(), dist)
    rngs = gather_objects(rng_state(), dist)
    return {"schedule": {"step": state.step}, "loader": loaders, "rng": rngs, **asdict(state),
            "world_size": dist.world_size, "params": params, "plan": plan, "versions": versions()}


def save_training_checkpoint(ckpt_dir: Path, dist: Dist, *, model, optimizer, loader, params: dict, plan: dict,
                             state: TrainState, keep: int) -> None:
    """Gather every rank's loader and RNG state, then rank 0 writes step_XXXXXX.pt and `latest` (and
    prunes all but the `keep` newest). A sharded model: every rank writes its part of
    step_XXXXXX.dcp/ (docs/training.md, "Checkpoints"), then rank 0 the rest and `latest`. Synchronous: the asynchronous
    saves are `Checkpointer`'s."""
    train_state = _train_state(dist, loader, params, plan, state)
    sharded = is_sharded(model)
    name = checkpoint_name(state.step, sharded=sharded)
    if sharded:
        _save_sharded(ckpt_dir / name, dist, model, optimizer, train_state)
    if not dist.is_main:
        return
    if not sharded:
        save_checkpoint(ckpt_dir / name, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                          **train_state})
    write_latest(ckpt_dir, name)
    prune_checkpoints(ckpt_dir, keep)
    log.info("checkpoint %s", ckpt_dir / name)


# ----------------------------------------------------------------------------- sharded (fsdp)

def _save_sharded(path: Path, dist: Dist, model, optimizer, train_state: dict) -> None:
    """Write the sharded checkpoint directory `path` (docs/training.md): DCP from every rank into rank 0's
    temporary directory, each rank's sha256 of its files, then rank 0's ``train_state.pt`` and
    ``SHA256SUMS``, and the rename (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from pipeline.distributed import gather_objects as gather

    with atomic_dir(path, replace=True) if dist.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(gather(str(tmp) if dist.is_main else None, dist)[0])
        model_sd, optim_sd = get_state_dict(model, member_optimizers(optimizer))
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        mine = {f.name: sha256_file(f) for f in sorted(tmp.glob(f"__{dist.rank}_*"))}
        hashed = {k: v for d in gather(mine, dist) for k, v in d.items()}  # every rank's files are complete
        if dist.is_main:
            for f in sorted(tmp.iterdir()):  # .metadata (rank 0 wrote it)
                if f.is_file() and f.name not in hashed:
                    hashed[f.name] = sha256_file(f)
            with atomic_write(tmp / SUMS) as out:
                out.writelines(f"{digest}  {name}\n" for name, digest in sorted(hashed.items()))
            save_checkpoint(tmp / TRAIN_STATE, train_state)


def _load_sharded(path: Path, model, optimizer, with_model: bool = True) -> None:
    """Load a sharded checkpoint's model (unless not `with_model`) and optimizer state in place, each rank
    reading what its own shards hold — written by the same ranks, or by another world size's (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, set_state_dict

    optimizers = member_optimizers(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    if with_model:
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        dcp.load({"optimizer": optim_sd}, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizers, optim_sd)


# ----------------------------------------------------------------------------- asynchronous saves

class _InFlight:
    """A save whose write is under way: its final path, the background future (a file: the write, `latest`
    and the pruning; a sharded directory: DCP's write and this rank's file hashes), and under fsdp rank 0's
    `atomic_dir` context (entered: the temporary directory; exited at the finalization)."""

    def __init__(self, path: Path, future: Future, sharded: bool, tmp_dir=None, tmp: Path | None = None):
        self.path, self.future, self.sharded, self.tmp_dir, self.tmp = path, future, sharded, tmp_dir, tmp


class Checkpointer:
    """A run's step checkpoints (docs/training.md, "Checkpoints"): made once per run on every rank.

    * `resume` — load the newest readable checkpoint into the model, optimizer and loader (or start fresh:
      the module function `resume`); the checkpoint resumed from is protected from pruning until a newer one
      is complete.
    * `save` at a checkpoint step, every rank (as `save_training_checkpoint`, whose keyword arguments it
      takes): waits for the save in flight (and finalizes it), then starts this one — synchronous when
      `async_save` is false (``train.async_ckpt``), else staged and written in the background.
    * `wait` — every rank, at the same point: the save in flight complete, finalized, its errors raised. Call
      it before final.pt is written and at a clean stop (a collective under fsdp).
    * `close` — `wait`, then the writer thread and the staging buffers released: the end of a run.
    * `abort` — on an exception path, this rank alone (no collective): waits for this rank's own background
      write (a file checkpoint is then complete; a sharded one is left unfinalized), logs its error rather
      than raising it, releases everything.

    ``blocked_s`` is what the last `save` blocked training (waiting for the previous save included);
    ``in_flight`` the path of the checkpoint being written, or None.
    """

    def __init__(self, ckpt_dir: str | Path, dist: Dist, keep: int = 2, async_save: bool = True):
        self.ckpt_dir, self.dist, self.keep, self.async_save = Path(ckpt_dir), dist, keep, async_save
        self.resumed_from = None
        self._protect_latest()
        self.blocked_s = 0.0
        self.write_s: float | None = None  # the last background write's seconds (None: none finished yet)
        self._pending: _InFlight | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None  # DCP's DefaultStager: pinned (CUDA) staging buffers, reused by every save
        self._group = None   # the gloo group of DCP's async coordination (fsdp)

    @property
    def save_s(self) -> float | None:
        """Seconds a save costs a job that must end right after it (a clean stop waits for the write): the
        last save's blocking part plus the last background write, None while no background write has finished."""
        if not self.async_save:
            return self.blocked_s
        return None if self.write_s is None else self.blocked_s + self.write_s

    @property
    def in_flight(self) -> Path | None:
        return self._pending.path if self._pending is not None else None

    # -- the API the trainer calls

    def resume(self, mode: str, *, model, optimizer, loader, params: dict, init: str | None = None) -> TrainState:
        """Where the run stands: a fresh start or an exact resume (`resume`, every rank)."""
        state = resume(self.ckpt_dir, mode, self.dist, model=model, optimizer=optimizer, loader=loader,
                       params=params, init=init)
        self._protect_latest()
        return state

    def _protect_latest(self) -> None:
        self.resumed_from = None
        if self.dist.is_main:
            with contextlib.suppress(PipelineError):  # a broken pointer: nothing to protect (resume rewrote it)
                self.resumed_from = latest_checkpoint(self.ckpt_dir)

    def save(self, *, model, optimizer, loader, params: dict, plan: dict, state: TrainState) -> None:
        """Save step `state.step` (every rank; docs/training.md, "Checkpoints"): the previous save finalized first."""
        start = time.perf_counter()
        self.wait()
        if not self.async_save:
            save_training_checkpoint(self.ckpt_dir, self.dist, model=model, optimizer=optimizer, loader=loader,
                                     params=params, plan=plan, state=state, keep=self.keep)
        else:
            train_state = _train_state(self.dist, loader, params, plan, state)
            sharded = is_sharded(model)
            path = self.ckpt_dir / checkpoint_name(state.step, sharded=sharded)
            if sharded:
                self._start_sharded(path, model, optimizer, train_state)
            elif self.dist.is_main:
                staged = self._stage({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                future = self._writer().submit(self._write_file, path, {**staged, **train_state}, time.perf_counter())
                self._pending = _InFlight(path, future, sharded=False)
        self.blocked_s = time.perf_counter() - start
        if self.async_save and self.dist.is_main:
            log.info("checkpoint %s: training blocked %.2f s (staging); written in the background",
                     self.ckpt_dir / checkpoint_name(state.step, sharded=is_sharded(model)), self.blocked_s)

    def wait(self) -> None:
        """The save in flight complete and finalized (every rank at the same point under fsdp: a collective);
        an error of its background write raised here (PipelineError, the cause chained)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.sharded:
            self._finalize_sharded(pending)
            return
        try:
            pending.future.result()
        except Exception as e:
            raise PipelineError(f"writing checkpoint {pending.path} in the background failed ({type(e).__name__}: "
                                f"{e}); the previous checkpoint stays the newest") from e

    def close(self) -> None:
        """`wait`, then release the writer thread and the staging buffers (every rank: the end of a run)."""
        try:
            self.wait()
        finally:
            self._release()

    def abort(self) -> None:
        """On an exception path, this rank alone (no collective): wait for this rank's background write, log
        its error instead of raising it (the exception in flight is the one to report), release everything. A
        file checkpoint finished by then is complete (its `latest` moved); a sharded one is not finalized: the
        previous checkpoint stays the newest; its temporary directory is removed or swept by the next run."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                try:
                    pending.future.result()
                except BaseException as e:  # reported, not raised over the exception in flight
                    log.error("the background write of checkpoint %s failed too: %s: %s", pending.path,
                              type(e).__name__, e)
                else:
                    if pending.sharded:
                        log.warning("checkpoint %s was written but not finalized (the run stopped on an error): "
                                    "the previous checkpoint stays the newest", pending.path)
        finally:
            self._release()

    # -- the pieces

    def _writer(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _staging(self):
        """DCP's `DefaultStager`, synchronous: CPU copies, or on CUDA pinned host buffers filled by non-blocking
        copies and one synchronize; it keeps its buffers (per source storage) for the next save."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.dist.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def _stage(self, state: dict) -> dict:
        """`state` (nested dicts / lists of tensors and plain values) with every tensor copied off the live
        ones: the training may change them as soon as this returns."""
        return self._staging().stage(state)

    def _protected(self) -> tuple:
        return (self.resumed_from,) if self.resumed_from is not None else ()

    def _write_file(self, path: Path, state: dict, began: float) -> None:
        """The writer thread's job for a file checkpoint (rank 0): the file, then `latest`, then pruning."""
        save_checkpoint(path, state)
        write_latest(self.ckpt_dir, path.name)
        self.resumed_from = None  # a newer checkpoint is complete
        prune_checkpoints(self.ckpt_dir, self.keep, self._protected())
        self.write_s = time.perf_counter() - began
        log.info("checkpoint %s complete (written in %.2f s)", path, self.write_s)

    def _start_sharded(self, path: Path, model, optimizer, train_state: dict) -> None:
        """Rank 0's temporary directory (`atomic_dir`, entered now, exited at the finalization) and
        ``train_state.pt`` in it; every rank's shards staged and handed to DCP's writer thread
        (`torch.distributed.checkpoint.async_save`), then to ours, which hashes this rank's files."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        dist = self.dist
        if self._group is None and dist.distributed:  # a collective: every rank saves at the same step
            self._group = torch_dist.new_group(backend="gloo")
        tmp_dir = atomic_dir(path, replace=True) if dist.is_main else None
        tmp = tmp_dir.__enter__() if tmp_dir is not None else None
        try:
            tmp = Path(gather_objects(str(tmp) if dist.is_main else None, dist)[0])
            if dist.is_main:
                save_checkpoint(tmp / TRAIN_STATE, train_state)
            model_sd, optim_sd = get_state_dict(model, member_optimizers(optimizer))
            upload = dcp.async_save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp,
                                    process_group=self._group, async_stager=self._staging())
        except BaseException as e:
            if tmp_dir is not None:
                tmp_dir.__exit__(type(e), e, e.__traceback__)
            raise
        self._pending = _InFlight(path, self._writer().submit(self._hash_shards, upload, tmp, time.perf_counter()),
                                  sharded=True, tmp_dir=tmp_dir, tmp=tmp)

    def _hash_shards(self, upload: Future, tmp: Path, began: float) -> dict:
        """The writer thread's job for a sharded checkpoint: DCP's write done (on rank 0 that means every
        rank's: DCP writes .metadata after gathering every rank's results), this rank's files hashed (rank 0's
        with .metadata)."""
        upload.result()
        rank = self.dist.rank
        mine = {f.name: sha256_file(f) for f in sorted(tmp.glob(f"__{rank}_*"))}
        if self.dist.is_main:
            mine.update({f.name: sha256_file(f) for f in sorted(tmp.iterdir())
                         if f.is_file() and not f.name.startswith("__")
                         and f.name not in (TRAIN_STATE, checksum_path(TRAIN_STATE).name)})
        self.write_s = time.perf_counter() - began
        return mine

    def _finalize_sharded(self, pending: _InFlight) -> None:
        """Every rank's hashes (or its error) gathered; rank 0 writes ``SHA256SUMS``, renames the directory
        into place, moves `latest` and prunes. A collective; an error on any rank is raised on every rank (the
        temporary directory removed), so that no rank waits for the others in vain."""
        try:
            mine, error = pending.future.result(), None
        except Exception as e:  # reported on every rank below
            mine, error = {}, f"rank {self.dist.rank}: {type(e).__name__}: {e}"
            log.error("the background write of %s failed on rank %d", pending.path, self.dist.rank, exc_info=e)
        results = gather_objects((mine, error), self.dist)
        errors = [err for _, err in results if err]
        if self.dist.is_main:
            fail = PipelineError(f"writing checkpoint {pending.path} in the background failed ({'; '.join(errors)}); "
                                 "the previous checkpoint stays the newest") if errors else None
            try:
                if fail is None:
                    hashed = {k: v for d, _ in results for k, v in d.items()}
                    with atomic_write(pending.tmp / SUMS) as out:
                        out.writelines(f"{digest}  {name}\n" for name, digest in sorted(hashed.items()))
            except BaseException as e:
                pending.tmp_dir.__exit__(type(e), e, e.__traceback__)
                raise
            if fail is not None:
                pending.tmp_dir.__exit__(PipelineError, fail, None)  # removes the temporary directory
                raise fail
            pending.tmp_dir.__exit__(None, None, None)  # renamed into place
            write_latest(self.ckpt_dir, pending.path.name)
            self.resumed_from = None
            prune_checkpoints(self.ckpt_dir, self.keep, self._protected())
            log.info("checkpoint %s complete", pending.path)
        elif errors:
            raise PipelineError(f"writing checkpoint {pending.path} in the background failed ({'; '.join(errors)}); "
                                "the previous checkpoint stays the newest")

    def _release(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def full_model_state(model) -> dict:
    """The model's whole state dict (plain tensors): a sharded model's gathered to rank 0 on the CPU —
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, a collective every rank calls; the
    other ranks get ``{}`` — else ``model.state_dict()``. What final.pt holds."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
