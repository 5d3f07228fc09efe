"""The training data loader: deterministic, DDP-sharded, exactly resumable batches of packed rows.

`PackedLoader` memory-maps a packed split (`R/pack/{mix}/{split}.json` and its `.bin`, `.mask.bin`,
`.docs.npy`; see pipeline/data/pack.py) and yields micro-batches of rows of C = seq_len + 1 tokens:

    inputs  = rows[:, :-1]   int64 [micro_batch, seq_len]
    targets = rows[:, 1:]    int64 [micro_batch, seq_len]
    mask    = loss mask of the targets, bool [micro_batch, seq_len] (bestfit packs), else None
    doc_ids = int64 [micro_batch, seq_len], only with `with_doc_ids=True`: per input position the
              index of its document within the row (0 for the row's first document), so that
              attention can be restricted to `doc_ids[q] == doc_ids[k]`.

inputs/targets (and mask) are views of one int64 tensor made with a single numpy -> torch
conversion per batch; call `.contiguous()` if a kernel needs it.

Order. Epoch `e` visits the rows in the permutation drawn by `Generator(PCG64(SeedSequence([seed,
e])))` (identity with `shuffle=False`). Micro-step `i` of an epoch takes the global block
`perm[i*W*B : (i+1)*W*B]` (W = world_size, B = micro_batch) and rank `r` takes the contiguous slice
`[r*B, (r+1)*B)` of it: the ranks' rows of one step are disjoint and together form the block.
An epoch has `n_rows // (W*B)` micro-steps; the remaining `n_rows % (W*B)` rows of that epoch's
permutation are not used (every rank takes the same number of steps).

Epochs. After `max_epochs` epochs the loader raises `DataExhausted` naming what the data holds,
what was asked, and the config knobs to change; `steps_available(global_batch_rows)` lets the
trainer check its plan up front.

Resumption. `state_dict()` is `{epoch, position, seed, shuffle, world_size, micro_batch, n_rows,
seq_len, data_sha256}`; after `load_state_dict(state)` the loader yields exactly the batches an
uninterrupted loader would have yielded next. A state made for another world size, micro-batch,
seed or data file (the packed .bin's sha256 from its metadata) is refused.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.data.contract import span_index
from pipeline.errors import PipelineError
from pipeline.io import read_json


class DataExhausted(PipelineError):
    """The packed data cannot supply the requested number of steps."""


STATE_KEYS = ("seed", "shuffle", "world_size", "micro_batch", "n_rows", "seq_len", "data_sha256")


def epoch_permutation(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The row order of one epoch: a permutation seeded by (seed, epoch), or 0..n_rows-1."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n_rows).astype(np.int64)


def _open_pack(meta_path: Path) -> tuple[dict, np.ndarray, np.ndarray | None, np.ndarray]:
    """Memory-map a packed split: (metadata, rows [n_rows, C], mask rows or None, doc starts)."""
    if not meta_path.exists():
        raise PipelineError(f"{meta_path}: packed data not found; run the pack stage for this mix and split")
    meta = read_json(meta_path)
    stem = meta_path.parent / meta_path.name.removesuffix(".json")
    row_len = meta["seq_len"] + 1
    bin_path = Path(f"{stem}.bin")
    expect = meta["n_rows"] * row_len * np.dtype(meta["dtype"]).itemsize
    if not bin_path.exists() or bin_path.stat().st_size != expect:
        raise PipelineError(f"{bin_path}: missing or not {expect} bytes as {meta_path} says; rerun the pack stage")
    rows = np.memmap(bin_path, dtype=meta["dtype"], mode="r", shape=(meta["n_rows"], row_len))
    mask = None
    if meta.get("has_mask"):
        mask = np.memmap(Path(f"{stem}.mask.bin"), dtype=np.uint8, mode="r", shape=(meta["n_rows"], row_len))
    docs = np.load(Path(f"{stem}.docs.npy"), mmap_mode="r")
    return meta, rows, mask, docs


class PackedLoader:
    """Deterministic, rank-disjoint, resumable micro-batches of a packed split (module docstring)."""

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
    ):
        if not 0 <= rank < world_size:
            raise PipelineError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch < 1 or max_epochs < 1:
            raise PipelineError(f"micro_batch ({micro_batch}) and max_epochs ({max_epochs}) must be >= 1")
        self.path = Path(meta_path)
        self.meta, self._rows, self._mask, self._docs = _open_pack(self.path)
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size
        self.seed, self.shuffle, self.max_epochs = seed, shuffle, max_epochs
        self.with_doc_ids = with_doc_ids
        self.n_rows = self.meta["n_rows"]
        self.seq_len = self.meta["seq_len"]
        self.rows_per_step = micro_batch * world_size
        self.steps_per_epoch = self.n_rows // self.rows_per_step
        if self.steps_per_epoch == 0:
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
        epoch, position = (self.epoch + 1, 0) if self.position == self.steps_per_epoch else (self.epoch, self.position)
        if epoch >= self.max_epochs:
            raise DataExhausted(self._exhausted_message())
        self.epoch, self.position = epoch, position + 1
        lo = (position * self.world_size + self.rank) * self.micro_batch
        return self.batch(self._permutation()[lo : lo + self.micro_batch])

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.n_rows, self.seed, self.epoch, self.shuffle)
            self._perm_epoch = self.epoch
        return self._perm

    def batch(self, idx: np.ndarray) -> tuple:
        """The (inputs, targets, mask[, doc_ids]) tensors for the given row indices."""
        import torch

        x = torch.from_numpy(self._rows[idx].astype(np.int64))
        mask = None if self._mask is None else torch.from_numpy(self._mask[idx].astype(bool))[:, 1:]
        out = (x[:, :-1], x[:, 1:], mask)
        if self.with_doc_ids:
            out += (torch.from_numpy(self.doc_ids(idx)),)
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
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()
        diff = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in STATE_KEYS if state.get(k) != mine[k]]
        if diff:
            raise PipelineError(
                f"cannot resume {self.path}: the loader state was saved for different settings ({'; '.join(diff)}); "
                "resume with the same world size, micro_batch, seed and packed data, or start a fresh run"
            )
        if not (0 <= state["position"] <= self.steps_per_epoch and state["epoch"] >= 0):
            raise PipelineError(f"cannot resume {self.path}: position {state['position']} of epoch {state['epoch']} "
                                "is out of range")
        self.epoch, self.position = state["epoch"], state["position"]
