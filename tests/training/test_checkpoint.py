"""pipeline.model.checkpoint (the file format) and pipeline.training.checkpoint: RNG capture,
weights_only round trips, atomic writes, the latest pointer, which configs may resume."""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.model.checkpoint import checksum_path, load_checkpoint, save_checkpoint, versions
from pipeline.training.checkpoint import (
    checkpoint_name,
    clear_checkpoints,
    latest_checkpoint,
    newest_readable,
    prune_checkpoints,
    resume_mismatch,
    rng_state,
    set_rng_state,
    write_latest,
)


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()


def test_rng_state_round_trips_every_generator():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    draws()
    state = rng_state()
    first = draws()
    draws()
    set_rng_state(state)
    assert draws() == first


def test_checkpoint_with_optimizer_and_rng_loads_weights_only(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / checkpoint_name(7)
    assert path.name == "step_000007.pt"
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": [rng_state()], "step": 7,
             "best_val_loss": float("inf"), "params": {"train": {"lr": 0.1, "betas": [0.9, 0.95]}},
             "versions": versions()}
    save_checkpoint(path, state)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7 and loaded["params"] == state["params"]
    assert torch.equal(loaded["model"]["weight"], model.weight)
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    fresh.load_state_dict(loaded["optimizer"])
    set_rng_state(loaded["rng"][0])


def test_failed_save_leaves_nothing_behind(tmp_path):
    path = tmp_path / "step_000001.pt"
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(path, {"bad": lambda: None})  # not picklable
    assert list(tmp_path.iterdir()) == []


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "step_000001.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(PipelineError, match="step_000001.pt cannot be read"):
        load_checkpoint(bad)
    with pytest.raises(PipelineError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_latest_pointer_prune_and_clear(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for s in (1, 2, 3, 4):
        save_checkpoint(tmp_path / checkpoint_name(s), {"step": s})
    write_latest(tmp_path, checkpoint_name(3))
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003.pt"
    prune_checkpoints(tmp_path, keep=1)  # keeps the newest (4) and the one `latest` names (3)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003.pt", "step_000003.pt.sha256",
                                                                "step_000004.pt", "step_000004.pt.sha256"]
    (tmp_path / "step_000003.pt").unlink()
    with pytest.raises(PipelineError, match="not an existing checkpoint"):
        latest_checkpoint(tmp_path)
    (tmp_path / "other.txt").write_text("kept")
    clear_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt"]


def _zero(path, at: int, n: int = 4096) -> None:
    """Zero `n` bytes of `path` at `at`, in place (the same size)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(n))


def test_a_checkpoint_damaged_on_disk_does_not_load(tmp_path):
    # final.pt with 4 KB zeroed used to load (torch does not check its zip CRCs) and pass the damage on
    # to evaluation and the next stage; its sha256, recorded as it was written, now refuses it
    import hashlib

    torch.manual_seed(0)
    path = tmp_path / "train" / "sft" / "final.pt"
    save_checkpoint(path, {"model": torch.nn.Linear(256, 256).state_dict(), "params": {}})
    digest, name = checksum_path(path).read_text().split()
    assert (digest, name) == (hashlib.sha256(path.read_bytes()).hexdigest(), "final.pt")  # `sha256sum -c` format
    assert torch.equal(load_checkpoint(path)["model"]["bias"], torch.load(path, weights_only=True)["model"]["bias"])
    _zero(path, path.stat().st_size // 2)
    with pytest.raises(PipelineError) as e:
        load_checkpoint(path)
    assert str(e.value) == (f"{path} is corrupt (sha256 mismatch with final.pt.sha256); delete it and rerun snakemake: "
                            "the train rule rewrites it (and reruns what was made from it; `snakemake -R train` "
                            "retrains every stage)")
    with pytest.raises(PipelineError, match="is a directory, not a checkpoint file.*--from-hf"):
        load_checkpoint(tmp_path / "train")


def test_a_step_checkpoint_not_matching_its_checksum_is_moved_aside_and_the_previous_one_taken(tmp_path, caplog):
    for s in (1, 2):
        save_checkpoint(tmp_path / checkpoint_name(s), {"step": s, "w": torch.ones(4096)})
    write_latest(tmp_path, checkpoint_name(2))
    _zero(tmp_path / "step_000002.pt", 2048, 64)  # inside the tensor's bytes: it would load
    with caplog.at_level("WARNING"):
        path, state = newest_readable(tmp_path)
    assert (path.name, state["step"]) == ("step_000001.pt", 1)
    assert "step_000002.pt is corrupt (sha256 mismatch" in caplog.text and "moved it aside" in caplog.text
    assert sorted(p.name for p in (tmp_path / "unreadable").iterdir()) == ["step_000002.pt", "step_000002.pt.sha256"]
    assert latest_checkpoint(tmp_path) == path


def test_a_checkpoint_of_another_world_size_may_resume_but_not_of_another_config():
    from builders import make_params

    state = {"params": make_params(nproc=4, micro_batch=2), "world_size": 4}
    assert resume_mismatch(state, make_params(nproc=2, micro_batch=2)) is None  # resharded
    assert resume_mismatch(state, make_params(nproc=2, micro_batch=2, log_interval=5)) is None  # logging only
    assert resume_mismatch(state, make_params(nproc=2, micro_batch=2, parallel="fsdp", lr=5e-3)) == \
        "it was made with a different config (keys differing: train.lr, train.parallel)"
    assert resume_mismatch(state, {**make_params(nproc=2, micro_batch=2), "seed": 8}) == \
        "it was made with a different config (keys differing: seed)"
