"""PackedLoader: rank-disjoint coverage, determinism, exact resumption, refusals, exhaustion, masks."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from builders import pack_params, schedule_rows, true_tokens, write_pack, write_schedule

from pipeline.data.contract import pack_paths as output_paths
from pipeline.data.loader import DataExhausted, PackedLoader, epoch_permutation
from pipeline.data.pack import pack
from pipeline.errors import PipelineError

SEQ = 8
C = SEQ + 1


def rows_of(batch):
    """Row indices of a batch of the synthetic pack (first input token = row * C)."""
    return (batch[0][:, 0] // C).tolist()


def drain(loader, n):
    return [next(loader) for _ in range(n)]


def test_ranks_are_disjoint_and_cover_each_step(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=50)
    world, mb = 4, 3
    loaders = [PackedLoader(meta, mb, rank=r, world_size=world, seed=5) for r in range(world)]
    assert loaders[0].steps_per_epoch == 50 // 12
    perm = epoch_permutation(50, 5, 0)
    seen = []
    for step in range(loaders[0].steps_per_epoch):
        per_rank = [rows_of(next(ld)) for ld in loaders]
        flat = sum(per_rank, [])
        assert len(set(flat)) == world * mb  # disjoint across ranks
        assert flat == perm[step * 12:(step + 1) * 12].tolist()  # rank r holds block slice [r*B, (r+1)*B)
        seen += flat
    assert len(set(seen)) == len(seen) == 48  # an epoch never repeats a row; 50 % 12 rows unused


def test_batches_are_the_rows_shifted(tmp_path):
    loader = PackedLoader(write_pack(tmp_path / "p.json", n_rows=20), 4, seed=1)
    x, y, m = next(loader)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ) and m is None
    starts = torch.tensor(rows_of((x, y))) * C
    assert torch.equal(x, starts[:, None] + torch.arange(SEQ)) and torch.equal(y, x + 1)


def test_determinism_by_seed_and_epoch(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=40)
    a = [rows_of(b) for b in drain(PackedLoader(meta, 4, seed=3, max_epochs=2), 20)]
    b = [rows_of(b) for b in drain(PackedLoader(meta, 4, seed=3, max_epochs=2), 20)]
    c = [rows_of(b) for b in drain(PackedLoader(meta, 4, seed=4, max_epochs=2), 20)]
    assert a == b and a != c
    assert sorted(sum(a[:10], [])) == sorted(sum(a[10:], [])) == list(range(40)) and a[:10] != a[10:]
    ordered = [rows_of(b) for b in drain(PackedLoader(meta, 4, shuffle=False), 10)]
    assert sum(ordered, []) == list(range(40))


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_exact_anywhere(tmp_path, world):
    meta = write_pack(tmp_path / "p.json", n_rows=23, with_mask=True)
    kw = dict(world_size=world, seed=9, max_epochs=3, with_doc_ids=True)
    total = PackedLoader(meta, 2, **kw).steps_available()
    for rank in range(world):
        ref = drain(PackedLoader(meta, 2, rank=rank, **kw), total)
        for k in range(total + 1):  # every position, including each epoch boundary and the very end
            first = PackedLoader(meta, 2, rank=rank, **kw)
            drain(first, k)
            state = json.loads(json.dumps(first.state_dict()))  # survives serialization
            resumed = PackedLoader(meta, 2, rank=rank, **kw)
            resumed.load_state_dict(state)
            rest = drain(resumed, total - k)
            assert all(all(torch.equal(u, v) for u, v in zip(p, q)) for p, q in zip(rest, ref[k:]))
            with pytest.raises(DataExhausted):
                next(resumed)


def test_resume_refuses_other_settings(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=30)
    other = write_pack(tmp_path / "q.json", n_rows=30, salt=1)  # same shape, different data
    state = PackedLoader(meta, 2, world_size=2, seed=1).state_dict()
    for loader, key in [
        (PackedLoader(meta, 3, world_size=2, seed=1), "micro_batch"),
        (PackedLoader(meta, 2, world_size=2, seed=2), "seed"),
        (PackedLoader(other, 2, world_size=2, seed=1), "data_sha256"),
    ]:
        with pytest.raises(PipelineError, match=key):
            loader.load_state_dict(state)



def step_rows(loaders, accum: int, steps: int) -> list[list[int]]:
    """Per optimizer step, the rows all ranks' loaders serve over `accum` micro-steps (micro-step, then rank order)."""
    return [sum((rows_of(next(ld)) for _ in range(accum) for ld in loaders), []) for _ in range(steps)]


@pytest.mark.parametrize("total_rows", [None, 61])
def test_a_state_maps_to_another_world_size_at_every_optimizer_step(tmp_path, total_rows):
    """Global batch 8 rows, micro-batch 2: 4 ranks × 1 micro-step or 2 ranks × 2 or 1 rank × 4 per
    optimizer step. Stopped after any step on one world size and resumed on another, the loaders serve
    the rows an uninterrupted run on the new world size would (the same rows per step as the old one):
    none twice, none skipped. Rows mode (an SFT stage's epochs) runs across the epoch boundary of its
    stream (61 rows of a 23-row pack), its last step padded."""
    meta = write_pack(tmp_path / "p.json", n_rows=23 if total_rows else 41)
    mk = lambda world, rank=0: PackedLoader(meta, 2, rank=rank, world_size=world, seed=4,
                                            total_rows=total_rows)
    steps = 8 if total_rows else 41 // 8
    ref = {w: step_rows([mk(w, r) for r in range(w)], 4 // w, steps) for w in (1, 2, 4)}
    assert ref[4] == ref[2] == ref[1]  # the global order does not depend on the world size
    for old, new in [(4, 2), (2, 4), (2, 1), (1, 4)]:
        for k in range(steps + 1):
            first = [mk(old, r) for r in range(old)]
            assert step_rows(first, 4 // old, k) == ref[old][:k]
            state = json.loads(json.dumps(first[0].state_dict()))
            assert all(ld.state_dict() == state for ld in first)  # one global position
            resumed = [mk(new, r) for r in range(new)]
            for ld in resumed:
                ld.load_state_dict(state)
            assert step_rows(resumed, 4 // new, steps - k) == ref[new][k:], (old, new, k)
            if total_rows is None:
                with pytest.raises(DataExhausted):
                    next(resumed[0])


def test_a_position_between_the_new_micro_steps_is_refused(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=30)
    loader = PackedLoader(meta, 2, world_size=2, seed=1)
    next(loader)  # 4 rows of epoch 0 consumed: not a whole micro-step of 3 ranks × 2 rows
    with pytest.raises(PipelineError, match=r"saved by 2 stopped after 4 rows of epoch 0, not a whole number of "
                                            r"micro-steps of world_size × micro_batch = 6 rows; resume with 2"):
        PackedLoader(meta, 2, world_size=3, seed=1).load_state_dict(loader.state_dict())
    alone = PackedLoader(meta, 2, seed=1)  # 4 rows = 2 micro-steps of 1 rank × 2 rows
    alone.load_state_dict(loader.state_dict())
    assert alone.position == 2 and rows_of(next(alone)) == epoch_permutation(30, 1, 0)[4:6].tolist()


def test_data_exhausted(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=25)
    loader = PackedLoader(meta, 4, world_size=2, max_epochs=2)  # 25 // 8 = 3 micro-steps per epoch
    assert loader.steps_available() == 6 and loader.steps_available(16) == 3 and loader.steps_available(24) == 2
    with pytest.raises(PipelineError, match="multiple"):
        loader.steps_available(12)
    drain(loader, 6)
    with pytest.raises(DataExhausted, match=r"25 rows .* 3 micro-steps .* max_epochs=2") as e:
        next(loader)
    assert isinstance(e.value, PipelineError) and "mixes.<mix>.tokens" in str(e.value)
    with pytest.raises(DataExhausted, match="fewer than one micro-step"):
        PackedLoader(meta, 16, world_size=2)


def test_mask_and_doc_ids(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=12, with_mask=True, doc_len=4)
    loader = PackedLoader(meta, 3, seed=2, with_doc_ids=True, loss="assistant")
    x, y, m, d = next(loader)
    assert m.dtype == torch.bool and m.shape == d.shape == (3, SEQ) and d.dtype == torch.int64
    pos = x.numpy()  # synthetic tokens are their flat positions
    assert np.array_equal(m.numpy(), (pos + 1) * 7 % 3 > 0)  # the assistant bit of the targets
    x, y, m, d = next(PackedLoader(meta, 3, seed=2, with_doc_ids=True))  # loss "all": every real target
    assert m.all()
    expect = pos // 4 - pos[:, :1] // 4  # docs start every 4 tokens; ids count from the row's first doc
    assert np.array_equal(d.numpy(), expect)


def test_real_pack_doc_ids_follow_documents(data, tmp_path):
    rows = schedule_rows(data, [("web", "a")], epochs=1)
    sched = write_schedule(tmp_path / "s.parquet", rows, true_tokens(data, rows))
    out = tmp_path / "pack/m/train.json"
    meta = pack(pack_params("concat", seq_len=SEQ), "m", "train", sched, data / "tokens", out)
    bos = json.loads((data / "tokens/web/a.json").read_text())["bos_id"]
    loader = PackedLoader(out, 4, with_doc_ids=True, shuffle=False)
    for _ in range(meta["n_rows"] // 4):
        x, _, m, d = next(loader)
        assert m is None
        # with the bos policy a new document id starts exactly at each <|bos|> after position 0
        step = (d[:, 1:] - d[:, :-1]).numpy()
        assert np.array_equal(step == 1, x[:, 1:].numpy() == bos) and (step >= 0).all() and (d[:, 0] == 0).all()


def test_loss_all_skips_padding_and_assistant_needs_a_mask(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=4, with_mask=True, pad=3)
    _, _, m = next(PackedLoader(meta, 2, shuffle=False))
    assert m[:, :SEQ - 3].all() and not m[:, SEQ - 3:].any()  # targets at the 3 padded positions: not counted
    plain = write_pack(tmp_path / "q.json", n_rows=4)
    with pytest.raises(PipelineError, match="loss 'assistant' needs a bestfit pack"):
        PackedLoader(plain, 2, loss="assistant")


def test_rows_mode_uses_every_row_of_each_epoch_then_pads_the_last_step(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=5, with_mask=True)
    # 2 epochs of 5 rows = 10 rows; micro-batch 2 on 2 ranks: 3 micro-steps, the last with 2 empty rows
    loaders = [PackedLoader(meta, 2, rank=r, world_size=2, seed=1, total_rows=10, with_doc_ids=True)
               for r in range(2)]
    seen = []
    for _ in range(3):
        for ld in loaders:
            x, y, m, d = next(ld)
            for row in range(2):
                if m[row].any():
                    seen.append(int(x[row, 0]) // C)
                else:  # an empty row: pad tokens, nothing counted, one document
                    assert (x[row] == 0).all() and not d[row].any()
    assert len(seen) == 10 and sorted(seen[:5]) == sorted(seen[5:]) == [0, 1, 2, 3, 4]
    assert seen[:5] != seen[5:]  # each epoch reshuffled
    # exact resume in rows mode
    a = PackedLoader(meta, 2, seed=1, total_rows=7)
    next(a)
    b = PackedLoader(meta, 2, seed=1, total_rows=7)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        assert all(torch.equal(u, v) for u, v in zip(next(a), next(b)))
    with pytest.raises(PipelineError, match="total_rows: saved 7, now 8"):
        PackedLoader(meta, 2, seed=1, total_rows=8).load_state_dict(a.state_dict())


def _damage(path, at: int, n: int = 16):
    """Zero `n` bytes of `path` at offset `at` in place: same size (and a later mtime)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(n))


@pytest.mark.parametrize("part", ["bin", "mask"])
def test_a_same_size_corruption_of_a_real_pack_is_one_error_naming_the_file(data, tmp_path, part):
    # The size check passes; the sha256 pack recorded in train.json does not (streamed, once per process)
    rows = schedule_rows(data, [("web", "a")], epochs=1)
    sched = write_schedule(tmp_path / "s.parquet", rows, true_tokens(data, rows))
    out = tmp_path / "pack/m/train.json"
    meta = pack(pack_params("bestfit", seq_len=SEQ), "m", "train", sched, data / "tokens", out)
    assert meta["mask_sha256"] == hashlib.sha256(output_paths(out)["mask"].read_bytes()).hexdigest()
    PackedLoader(out, 2)  # intact: opens
    target = output_paths(out)[part]
    _damage(target, target.stat().st_size // 2)
    with pytest.raises(PipelineError) as e:
        PackedLoader(out, 2)
    assert str(e.value).startswith(f"{target} is corrupt (sha256 mismatch with train.json); delete ")
    assert "the pack rule rewrites it" in str(e.value)
    PackedLoader(out, 2, rank=1, world_size=2)  # only rank 0 reads the whole file: once per job, not per rank
