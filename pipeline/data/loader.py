"""The training data loader: deterministic, DDP-sharded, exactly resumable batches of packed rows.

`PackedLoader` memory-maps a packed split (`R/pack/{mix}/{split}.json` and its `.bin`, `.mask.bin`,
`.docs.npy`; pipeline/data/pack.py) and yields micro-batches of rows
of seq_len + 1 tokens; `state_dict()` / `load_state_dict(state)` resume it exactly, on another world size
too; `steps_available(global_batch_rows)` checks a plan up front; past ``max_epochs`` it raises
`DataExhausted`.

    loader = PackedLoader(meta, micro_batch=B, rank=r, world_size=W, seed=seed)
    inputs, targets, mask = next(loader)[:3]     # a doc_ids fourth with with_doc_ids=True

The batch layout, the order, rows mode, resumption on another world size and the integrity check:
docs/data-stages.md, "The training data loader".
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.data.contract import MASK_ASSISTANT, MASK_REAL, span_index
from pipeline.errors import PipelineError
from pipeline.io import read_json, verify_sha256


class DataExhausted(PipelineError):
    """The packed data cannot supply the requested number of steps."""


# What a saved state must match (the world size is mapped instead, docs/data-stages.md, "The training data loader")
STATE_KEYS = ("seed", "shuffle", "micro_batch", "n_rows", "seq_len", "data_sha256", "total_rows")
LOSSES = {"all": MASK_REAL, "assistant": MASK_ASSISTANT}


def epoch_permutation(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The row order of one epoch: a permutation seeded by (seed, epoch), or 0..n_rows-1."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n_rows).astype(np.int64)


def _open_pack(meta_path: Path, verify: bool = True) -> tuple[dict, np.ndarray, np.ndarray | None, np.ndarray]:
    """Memory-map a packed split: (metadata, rows [n_rows, C], mask rows or None, doc starts); with
    `verify`, its files are first checked against their recorded sha256 (docs/data-stages.md)."""
    if not meta_path.exists():
        raise PipelineError(f"{meta_path}: packed data not found; run the pack stage for this mix and split")
    meta = read_json(meta_path)
    stem = meta_path.parent / meta_path.name.removesuffix(".json")
    row_len = meta["seq_len"] + 1
    bin_path = Path(f"{stem}.bin")
    expect = meta["n_rows"] * row_len * np.dtype(meta["dtype"]).itemsize
    if not bin_path.exists() or bin_path.stat().st_size != expect:
        raise PipelineError(f"{bin_path}: missing or not {expect} bytes as {meta_path} says; rerun the pack stage")
    fix = (f"delete {bin_path} and rerun: the pack rule rewrites it (`snakemake -R pack` repacks every mix)")
    if verify:
        verify_sha256(bin_path, meta["sha256"], meta_path.name, fix)
    rows = np.memmap(bin_path, dtype=meta["dtype"], mode="r", shape=(meta["n_rows"], row_len))
    mask = None
    if meta.get("has_mask"):
        mask_path = Path(f"{stem}.mask.bin")
        if not mask_path.exists() or mask_path.stat().st_size != meta["n_rows"] * row_len:
            raise PipelineError(f"{mask_path}: missing or not {meta['n_rows'] * row_len} bytes as {meta_path} says; "
                                f"{fix}")
        if verify and meta.get("mask_sha256"):  # (packs written before it was recorded have none)
            verify_sha256(mask_path, meta["mask_sha256"], meta_path.name, fix)
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(meta["n_rows"], row_len))
    docs = np.load(Path(f"{stem}.docs.npy"), mmap_mode="r")
    return meta, rows, mask, docs


class PackedLoader:
    """Deterministic, rank-disjoint, resumable micro-batches of a packed split (docs/data-stages.md)."""

    def __init__(
        self,
        meta_path: str | os.PathLike,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int = 1,
        with_doc_ids: bool = False,
        loss: str = "all",
        total_rows: int | None = None,
    ):
        if not 0 <= rank < world_size:
            raise PipelineError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch < 1 or max_epochs < 1:
            raise PipelineError(f"micro_batch ({micro_batch}) and max_epochs ({max_epochs}) must be >= 1")
        self.path = Path(meta_path)
        self.meta, self._rows, self._mask, self._docs = _open_pack(self.path, verify=rank == 0)
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size
        self.seed, self.shuffle, self.max_epochs = seed, shuffle, max_epochs
        self.with_doc_ids = with_doc_ids
        if loss not in LOSSES:
            raise PipelineError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
        if loss == "assistant" and self._mask is None:
            raise PipelineError(f"{self.path}: loss 'assistant' needs a bestfit pack of chat sources (this one has no "
                                "loss mask); give the stage a bestfit chat mix or use loss: all")
        self.loss, self.total_rows = loss, total_rows
        self.n_rows = self.meta["n_rows"]
        self.seq_len = self.meta["seq_len"]
        self.pad_id = int(self.meta.get("pad_id") or 0)
        self.rows_per_step = micro_batch * world_size
        self.steps_per_epoch = self.n_rows // self.rows_per_step
        if total_rows is not None and (total_rows < 1 or self.n_rows < 1):
            raise PipelineError(f"{self.path}: rows mode needs total_rows >= 1 and a non-empty pack")
        if self.steps_per_epoch == 0 and total_rows is None:
            raise DataExhausted(
                f"{self.path} holds {self.n_rows} rows, fewer than one micro-step of micro_batch × world_size = "
                f"{self.rows_per_step} rows; give the mix more tokens or lower train.micro_batch"
            )
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, None

    # ------------------------------------------------------------------ planning

    def steps_available(self, global_batch_rows: int | None = None) -> int:
        """Steps of `global_batch_rows` rows (all ranks × all accumulation micro-steps) that
        `max_epochs` epochs supply from the start; without an argument, micro-steps per rank."""
        if global_batch_rows is None:
            global_batch_rows = self.rows_per_step
        if global_batch_rows % self.rows_per_step:
            raise PipelineError(
                f"global batch of {global_batch_rows} rows is not a multiple of micro_batch × world_size = "
                f"{self.rows_per_step}"
            )
        return self.steps_per_epoch * self.max_epochs // (global_batch_rows // self.rows_per_step)

    # ------------------------------------------------------------------ iteration

    def __iter__(self):
        return self

    def __next__(self):
        if self.total_rows is not None:
            lo = (self.position * self.world_size + self.rank) * self.micro_batch
            self.position += 1
            self.epoch = self.position * self.rows_per_step // self.n_rows  # of the next row: one for every rank
            return self.batch(self._stream_rows(np.arange(lo, lo + self.micro_batch)))
        epoch, position = (self.epoch + 1, 0) if self.position == self.steps_per_epoch else (self.epoch, self.position)
        if epoch >= self.max_epochs:
            raise DataExhausted(self._exhausted_message())
        self.epoch, self.position = epoch, position + 1
        lo = (position * self.world_size + self.rank) * self.micro_batch
        return self.batch(self._permutation()[lo : lo + self.micro_batch])

    def _permutation(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        if self._perm_epoch != epoch:
            self._perm = epoch_permutation(self.n_rows, self.seed, epoch, self.shuffle)
            self._perm_epoch = epoch
        return self._perm

    def _stream_rows(self, g: np.ndarray) -> np.ndarray:
        """Row indices of global stream positions `g` in rows mode; -1 (an empty row) past total_rows."""
        out = np.full(len(g), -1, np.int64)
        for i, pos in enumerate(g.tolist()):
            if pos < self.total_rows:
                out[i] = self._permutation(pos // self.n_rows)[pos % self.n_rows]
        return out

    def batch(self, idx: np.ndarray) -> tuple:
        """The (inputs, targets, mask[, doc_ids]) tensors for the given row indices (-1: an empty row)."""
        import torch

        idx = np.asarray(idx, np.int64)
        real = idx >= 0
        rows = self._rows[np.where(real, idx, 0)].astype(np.int64)
        rows[~real] = self.pad_id
        x = torch.from_numpy(rows)
        mask = None
        if self._mask is not None:
            bits = self._mask[np.where(real, idx, 0)] & LOSSES[self.loss]
            bits[~real] = 0
            mask = torch.from_numpy(bits[:, 1:] != 0)
        elif self.total_rows is not None:  # rows mode always masks, so empty rows never count
            mask = torch.from_numpy(np.repeat(real[:, None], self.seq_len, axis=1))
        out = (x[:, :-1], x[:, 1:], mask)
        if self.with_doc_ids:
            docs = self.doc_ids(np.where(real, idx, 0))
            docs[~real] = 0
            out += (torch.from_numpy(docs),)
        return out

    def doc_ids(self, idx: np.ndarray) -> np.ndarray:
        """int64 [len(idx), seq_len]: per input position, its document's index within the row.

        Marks each document start that falls strictly inside a row's inputs and takes a running
        sum along the row: O(rows × seq_len) numpy work, no per-token Python.
        """
        row_start = np.asarray(idx, np.int64) * (self.seq_len + 1)
        lo = np.searchsorted(self._docs, row_start, side="right")
        hi = np.searchsorted(self._docs, row_start + self.seq_len, side="left")
        row = np.repeat(np.arange(len(row_start)), hi - lo)
        marks = np.zeros((len(row_start), self.seq_len), np.int8)
        marks[row, self._docs[span_index(lo, hi - lo)] - row_start[row]] = 1
        return np.cumsum(marks, axis=1, dtype=np.int64)

    def _exhausted_message(self) -> str:
        m = self.meta
        return (
            f"{self.path} is exhausted: {self.n_rows} rows ({m['n_rows'] * (self.seq_len + 1)} tokens of mix "
            f"'{m.get('mix')}') give {self.steps_per_epoch} micro-steps of {self.rows_per_step} rows per epoch and "
            f"max_epochs={self.max_epochs} allows {self.steps_per_epoch * self.max_epochs}; all were used. "
            f"Give the mix more tokens (mixes.<mix>.tokens), lower train.target_tokens / global_batch_tokens, "
            f"or allow more epochs over the packed data"
        )

    # ------------------------------------------------------------------ resumption

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "n_rows": self.n_rows,
            "seq_len": self.seq_len,
            "data_sha256": self.meta["sha256"],
            "total_rows": self.total_rows,
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (docs/data-stages.md, "The training data loader"): this loader's world size
        may differ."""
        mine = self._identity()
        diff = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in STATE_KEYS if state.get(k) != mine[k]]
        if diff:
            raise PipelineError(
                f"cannot resume {self.path}: the loader state was saved for different settings ({'; '.join(diff)}); "
                "resume with the same micro_batch, seed and packed data, or start a fresh run"
            )
        epoch, position = state["epoch"], state["position"]
        if state["world_size"] != self.world_size:
            position = self._mapped_position(state)
        limit = self.steps_per_epoch if self.total_rows is None else float("inf")
        if not (0 <= position <= limit and epoch >= 0):
            raise PipelineError(f"cannot resume {self.path}: position {position} of epoch {epoch} is out of range")
        self.epoch, self.position = epoch, position

    def _mapped_position(self, state: dict) -> int:
        """The position of this loader's world size at which a loader of `state`'s world size stopped:
        the same number of global rows consumed (of the epoch, or of the stream in rows mode)."""
        rows = state["position"] * state["world_size"] * self.micro_batch
        if rows % self.rows_per_step:
            where = "of the stream" if self.total_rows is not None else f"of epoch {state['epoch']}"
            raise PipelineError(
                f"cannot resume {self.path} on {self.world_size} process(es): the loader state saved by "
                f"{state['world_size']} stopped after {rows} rows {where}, not a whole number of micro-steps of "
                f"world_size × micro_batch = {self.rows_per_step} rows; resume with {state['world_size']} "
                "process(es), or from a checkpoint at an optimizer step of a global batch both world sizes divide"
            )
        return rows // self.rows_per_step
