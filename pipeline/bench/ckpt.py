"""`make gpu-check`'s checkpoint rows: one asynchronous save and one resume of a preset's per-rank
checkpoint on one GPU, through the trainer's own `pipeline.training.checkpoint.Checkpointer`, against
pipeline.planning.train_jobs's prediction.

`run_ckpt_rows(cuda, out)` runs `CKPT_ROWS`: per row a module of one rank's parameter count with its AdamW
state, two saves (``blocked_s``, ``write_s``), then the resume read from storage (``verify_s``,
``load_s``), beside `predicted` (pipeline.planning.train_jobs.checkpointing); `format_ckpt` is the table.
On CPU the same code runs at a tiny size (tests/bench/test_ckpt_row.py).

What a row builds and measures, and how the prediction is scaled: docs/bench.md, "The checkpoint rows".
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import torch

from pipeline.config import load_config
from pipeline.distributed import Dist, one_rank_group
from pipeline.io import get_logger
from pipeline.planning.compute import count_params
from pipeline.run_config import run_config

log = get_logger(__name__)

# (name, preset, what it checks)
CKPT_ROWS = [
    ("ckpt fsdp 8B rank shard", "configs/llama3-8b-fineweb.yaml",
     "one rank's DCP checkpoint of the 8B preset (1/8 of weights + AdamW): async save (staging, background write) "
     "and resume"),
    ("ckpt ddp 1.2B file", "configs/llama3-1b-fineweb.yaml",
     "the 1.24B preset's rank-0 checkpoint file (weights + AdamW): async save (staging, background write) and "
     "resume"),
]
BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments
BLOCK_COLS = 4096
BLOCK_ROWS = 16384    # 64M parameters (256 MB fp32) per block
# Assumed for the time budget's estimate (gpu-check.json records the real seconds): pinned staging, sha256 (one
# core); storage from pipeline.planning.train_jobs.
STAGING_GB_S, HASH_GB_S = 10.0, 1.0


def row_config(preset: str) -> dict:
    """The resolved preset (a path relative to the project root)."""
    return load_config(Path(__file__).resolve().parents[2] / preset)


def row_params(cfg: dict) -> int:
    """The parameters one rank saves: the whole model under ddp, its share under fsdp."""
    c = run_config(cfg)
    n = count_params(c.model)[0]
    if c.train.parallel == "fsdp":
        return -(-n // (c.hardware.nodes * c.hardware.nproc_per_node))
    return n


def ckpt_row_seconds(n_params: int, storage_gb_s: float) -> float:
    """The budget's estimate of a row: set-up, two saves (staging, write, hash), the resume (a verifying read
    with its hash, and the load's read), at the preset's `hardware.storage_gb_per_s`."""
    gb = n_params * BYTES_PER_PARAM / 1e9
    return 10.0 + gb * (2 * (1 / STAGING_GB_S + 1 / storage_gb_s + 1 / HASH_GB_S) + 2 / storage_gb_s + 1 / HASH_GB_S)


def predicted(cfg: dict) -> dict:
    """The plan's figures for the preset (`pipeline.planning.train_jobs.checkpointing`)."""
    from pipeline.planning import train_jobs

    ck = train_jobs.checkpointing(run_config(cfg))
    return {"blocked_s": ck["block_s"], "write_s": ck["write_s"], "verify_s": ck["startup"]["verify"],
            "load_s": ck["startup"]["load"]}


class _Blocks(torch.nn.Module):
    """Exactly `n_params` fp32 parameters: 2-D blocks of up to `BLOCK_ROWS` × `cols`, the rest a vector."""

    def __init__(self, n_params: int, device: torch.device, cols: int = BLOCK_COLS):
        super().__init__()
        blocks, left = [], n_params
        while left > 0:
            rows = min(BLOCK_ROWS, left // cols)
            shape = (rows, cols) if rows else (left,)
            blocks.append(torch.nn.Parameter(torch.randn(shape, device=device)))
            left -= blocks[-1].numel()
        self.blocks = torch.nn.ParameterList(blocks)


def _drop_cache(path: Path) -> None:
    """Evict `path`'s files (a directory's, recursively) from the page cache: the next read is from storage."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        with contextlib.suppress(OSError, AttributeError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Loader:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ckpt_row(preset_cfg: dict, device: torch.device, out: Path, n_params: int | None = None) -> dict:
    """One row (docs/bench.md) on `device`, its checkpoints under `out` (removed at the end). `n_params`
    overrides the preset's per-rank count (the CPU test's tiny size). Returns the measured and predicted
    figures."""
    from pipeline.training import checkpoint as C

    c = run_config(preset_cfg)  # preset_cfg itself (plain) is what the checkpoints save as their params
    fsdp = c.train.parallel == "fsdp"
    n = row_params(preset_cfg) if n_params is None else n_params
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    group = one_rank_group(device) if fsdp else contextlib.nullcontext(Dist(0, 0, 1, device))
    try:
        with group as dist:
            model = _Blocks(n, device)
            if fsdp:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh(device.type, (1,))
                fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()  # the moments exist
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            saver = C.Checkpointer(out, dist, keep=1, async_save=True)
            state = C.TrainState()
            figures = {}
            for i in (1, 2):
                state.step = i
                saver.save(model=model, optimizer=optimizer, loader=_Loader(), params=preset_cfg, plan={},
                           state=state)
                blocked = saver.blocked_s
                start = time.perf_counter()
                saver.wait()
                figures[i] = (blocked, time.perf_counter() - start)
            saver.close()
            path = out / C.checkpoint_name(2, sharded=fsdp)
            size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
            _drop_cache(path)
            start = time.perf_counter()
            newest, _ = C.newest_readable(out)
            verify_s = time.perf_counter() - start
            assert newest == path, (newest, path)
            _drop_cache(path)
            start = time.perf_counter()
            if fsdp:
                C._load_sharded(path, model, optimizer)
            else:
                from pipeline.model.checkpoint_io import load_checkpoint

                loaded = load_checkpoint(path, verify=False)
                model.load_state_dict(loaded["model"])
                optimizer.load_state_dict(loaded["optimizer"])
            _sync(device)
            load_s = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    gb = size / 1e9
    (first_blocked, _), (blocked, write_s) = figures[1], figures[2]
    total_gb = count_params(c.model)[0] * BYTES_PER_PARAM / 1e9
    node_gb = total_gb / c.hardware.nodes if fsdp else total_gb

    def scaled(seconds: float, to_gb: float) -> float:  # this row's rate applied to the job's bytes
        return seconds * to_gb / gb

    job = {"blocked_s": blocked, "write_s": scaled(write_s, node_gb), "verify_s": scaled(verify_s, total_gb),
           "load_s": scaled(load_s, node_gb)}
    return {"n_params": n, "checkpoint_gb": gb, "first_blocked_s": first_blocked, "blocked_s": blocked,
            "write_s": write_s, "verify_s": verify_s, "load_s": load_s,
            "gb_s": {k: gb / v if v > 0 else None for k, v in
                     (("staging", blocked), ("write", write_s), ("verify", verify_s), ("load", load_s))},
            "job": job, "predicted": predicted(preset_cfg)}


def format_ckpt(rows: list[dict]) -> str:
    """Markdown: every checkpoint row's figures, applied to the job's bytes, beside the plan's (`predicted`)."""
    lines = ["## Checkpoint save and resume: async staging, background write, resume", "",
             "| row | GB | save blocks s, first save (meas. / pred.) | background write s | resume: verify s | "
             "resume: load s |", "|---|---|---|---|---|---|"]

    def pair(m: dict, key: str) -> str:
        return f"{m['job'][key]:.3g} / {m['predicted'][key]:.3g}"

    for r in rows:
        m, p = r["measured"], r["predicted"]
        if m is None:
            lines.append(f"| {r['name']} | {r['skipped']} | pred. {p['blocked_s']:.3g} | pred. {p['write_s']:.3g} | "
                         f"pred. {p['verify_s']:.3g} | pred. {p['load_s']:.3g} |")
            continue
        lines.append(f"| {r['name']} | {m['checkpoint_gb']:.2f} | {pair(m, 'blocked_s')} ({m['first_blocked_s']:.2f}) "
                     f"| {pair(m, 'write_s')} | {pair(m, 'verify_s')} | {pair(m, 'load_s')} |")
    lines += ["", "Measured on one rank's share (one GPU), its rates applied to the bytes the prediction covers: a "
              "node's for the write and the load, the whole checkpoint for rank 0's verify. Save blocks: what "
              "`Checkpointer.save` held training (staging into pinned host memory; the first save also pins its "
              "buffers). Background write: written, fsynced, hashed, renamed. Resume: read from storage (page cache "
              "dropped). Predicted: pipeline.planning.train_jobs.checkpointing, the plan's figures."]
    return "\n".join(lines) + "\n"


def run_ckpt_rows(cuda: bool, out: Path, admit=None, on_row=None) -> list[dict]:
    """Every CKPT_ROWS row: {name, preset, checks, n_params, predicted, measured (or None), skipped}. Skipped
    without CUDA; `admit(name, estimate_s)` (the gpu-check's `Budget.admit`) may leave a row out; a row's exception
    is its result ("failed: ...")."""
    from pipeline.bench.suite import release_device, skip_reason

    rows = []
    for name, preset, checks in CKPT_ROWS:
        cfg = row_config(preset)
        n = row_params(cfg)
        estimate = ckpt_row_seconds(n, run_config(cfg).hardware.storage_gb_per_s)
        row = {"name": name, "preset": preset, "checks": checks, "n_params": n, "predicted": predicted(cfg),
               "estimate_s": round(estimate, 1), "measured": None,
               "skipped": None if cuda else "needs CUDA: no CUDA device is visible"}
        if row["skipped"] is None and admit is not None:
            row["skipped"] = admit(name, estimate)
        if row["skipped"] is None:
            try:
                row["measured"] = run_ckpt_row(cfg, torch.device("cuda", torch.cuda.current_device()),
                                               Path(out) / "ckpt-row")
            except Exception as e:  # one row's failure is that row's result
                row["skipped"] = skip_reason(e)
                log.warning("checkpoint row %r: %s", name, row["skipped"])
            finally:
                release_device("cuda")
        rows.append(row)
        if on_row:
            on_row(row, rows)
    return rows
