"""pipeline.model.checkpoint_io (the file format) and pipeline.training.checkpoint: RNG capture,
weights_only round trips, atomic writes, the latest pointer, which configs may resume."""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.model.checkpoint_io import checksum_path, load_checkpoint, save_checkpoint, versions
from pipeline.training.checkpoint import (
    checkpoint_name,
    clear_checkpoints,
    latest_checkpoint,
    newest_readable,
    prune_checkpoints,
    resume_mismatch,
    rng_state,
    set_rng_state,
    step_checkpoints,
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


# ----------------------------------------------------------------------------- asynchronous saves (Checkpointer)

class _Loader:
    """What a Checkpointer reads of the trainer's loader: a state dict."""

    def __init__(self, position: int):
        self.position = position

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.position}


def _trained(seed: int = 0):
    """A linear model and its AdamW after one step (optimizer state to save)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save(saver, model, opt, step: int) -> None:
    from pipeline.training.checkpoint import TrainState

    saver.save(model=model, optimizer=opt, loader=_Loader(step * 2), params={"train": {"lr": 0.1}},
               plan={"num_steps": 10}, state=TrainState(step=step, tokens_seen=step * 256))


def _same(a, b) -> bool:
    """Nested dicts / lists / tuples of tensors and plain values, equal (tensors bitwise)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN == NaN


def test_async_and_sync_saves_load_to_the_same_state_and_the_step_is_staged(tmp_path, monkeypatch):
    """A save returns once the state is staged: the weights changed while the write is held back (the
    training going on) are not in the checkpoint, which loads to what the synchronous save wrote — model,
    optimizer, loader, RNG, counters — with `latest` moved only once the file is complete."""
    import threading

    import pipeline.training.checkpoint as C
    from pipeline.distributed import Dist

    dist = Dist(0, 0, 1, torch.device("cpu"))
    model, opt = _trained()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    sync = C.Checkpointer(tmp_path / "sync", dist, keep=2, async_save=False)
    _save(sync, model, opt, 5)
    assert sync.in_flight is None and latest_checkpoint(tmp_path / "sync").name == "step_000005.pt"

    release, real_save = threading.Event(), C.save_checkpoint

    def held_save(path, state):
        assert release.wait(60)
        real_save(path, state)

    monkeypatch.setattr(C, "save_checkpoint", held_save)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    saver = C.Checkpointer(tmp_path / "async", dist, keep=2)
    _save(saver, model, opt, 5)
    assert saver.in_flight == tmp_path / "async" / "step_000005.pt"
    assert not (tmp_path / "async" / "step_000005.pt").exists() and latest_checkpoint(tmp_path / "async") is None
    with torch.no_grad():  # the next steps change the live tensors in place
        model.weight.mul_(0)
        next(iter(opt.state.values()))["exp_avg"].add_(1)
    release.set()
    saver.close()
    assert saver.in_flight is None and latest_checkpoint(tmp_path / "async").name == "step_000005.pt"
    a, s = (load_checkpoint(tmp_path / d / "step_000005.pt") for d in ("async", "sync"))
    assert a.keys() == s.keys() and _same(a, s)
    assert a["loader"] == [{"epoch": 0, "position": 10}] and a["step"] == 5 and a["tokens_seen"] == 1280
    assert not torch.equal(a["model"]["weight"], model.weight)  # the staged copy, not the live tensor
    fresh = torch.optim.AdamW(torch.nn.Linear(64, 32).parameters(), lr=0.1)
    fresh.load_state_dict(a["optimizer"])
    set_rng_state(a["rng"][0])


def test_a_background_error_is_raised_at_the_next_save_or_wait(tmp_path, monkeypatch, caplog):
    """The writer thread's error (a full disk) surfaces in the training thread: at the next save (before it
    starts), at the wait before final.pt, or — on an exception path (`abort`) — in the log. `latest` stays."""
    import pipeline.training.checkpoint as C
    from pipeline.distributed import Dist

    dist = Dist(0, 0, 1, torch.device("cpu"))
    model, opt = _trained()
    real_save, failing = C.save_checkpoint, {2, 3, 4}

    def full_disk(path, state):
        if state["step"] in failing:
            raise OSError(28, "No space left on device")
        real_save(path, state)

    monkeypatch.setattr(C, "save_checkpoint", full_disk)
    saver = C.Checkpointer(tmp_path, dist, keep=2)
    _save(saver, model, opt, 1)
    _save(saver, model, opt, 2)  # returns: the error is the writer thread's
    with pytest.raises(PipelineError, match=r"writing checkpoint .*step_000002.pt in the background failed "
                                            r"\(OSError: .*No space left on device\); the previous checkpoint stays"):
        _save(saver, model, opt, 3)  # raised at the next save, before it starts
    assert saver.in_flight is None and latest_checkpoint(tmp_path).name == "step_000001.pt"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001.pt", "step_000001.pt.sha256"]
    _save(saver, model, opt, 3)
    with pytest.raises(PipelineError, match="step_000003.pt in the background failed"):
        saver.close()  # ... or at the wait before final.pt
    aborting = C.Checkpointer(tmp_path, dist, keep=2)
    _save(aborting, model, opt, 4)
    with caplog.at_level("ERROR"):
        aborting.abort()  # an exception path: logged, not raised over the exception in flight
    assert "the background write of checkpoint" in caplog.text and "step_000004.pt failed too" in caplog.text
    assert latest_checkpoint(tmp_path).name == "step_000001.pt" and not list(tmp_path.glob(".*tmp-*"))


def test_pruning_keeps_the_resumed_from_checkpoint_until_a_newer_one_is_complete(tmp_path, monkeypatch):
    """Resumed from step 6 (`latest`), keep 1: while step 9 is written, and after its write failed, step 6 is
    kept; once step 12 is complete, it goes. An explicit `protect` keeps a checkpoint whatever `keep` says."""
    import threading

    import pipeline.training.checkpoint as C
    from pipeline.distributed import Dist

    dist = Dist(0, 0, 1, torch.device("cpu"))
    model, opt = _trained()
    for s in (3, 6):
        save_checkpoint(tmp_path / checkpoint_name(s), {"step": s})
    write_latest(tmp_path, checkpoint_name(6))
    saver = C.Checkpointer(tmp_path, dist, keep=1)
    assert saver.resumed_from == tmp_path / "step_000006.pt"
    release, real_save = threading.Event(), C.save_checkpoint

    def held_then_failing(path, state):
        assert release.wait(60)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(C, "save_checkpoint", held_then_failing)
    _save(saver, model, opt, 9)
    prune_checkpoints(tmp_path, keep=0, protect=saver._protected())  # any pruning while step 9 is written
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_000006.pt"]
    release.set()
    with pytest.raises(PipelineError, match="step_000009.pt in the background failed"):
        saver.wait()
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_000006.pt"]
    assert latest_checkpoint(tmp_path).name == "step_000006.pt" and saver.resumed_from is not None
    monkeypatch.setattr(C, "save_checkpoint", real_save)
    _save(saver, model, opt, 12)
    saver.close()
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_000012.pt"] and saver.resumed_from is None
    save_checkpoint(tmp_path / checkpoint_name(13), {"step": 13})
    write_latest(tmp_path, checkpoint_name(13))
    prune_checkpoints(tmp_path, keep=0, protect=(tmp_path / "step_000012.pt",))
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_000013.pt", "step_000012.pt"]


KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
import pipeline.model.checkpoint_io as M
from pipeline.distributed import Dist
from pipeline.training.checkpoint import Checkpointer, TrainState

out, marker = Path(sys.argv[1]), Path(sys.argv[2])

class SlowFile(M.HashingFile):  # the writer thread stalls 1 MB into the second checkpoint's temporary file
    written = 0
    def write(self, data):
        n = super().write(data)
        SlowFile.written += len(data)
        if slow and SlowFile.written > 2**20:
            self.f.flush()
            marker.with_suffix(".writing").touch()
            time.sleep(600)
        return n

M.HashingFile = SlowFile

class Loader:
    def state_dict(self):
        return {"position": 0}

model = torch.nn.Linear(1024, 1024)  # 4 MB of weights, 12 MB with AdamW's moments
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 1024)).sum().backward()
opt.step()
saver = Checkpointer(out, Dist(0, 0, 1, torch.device("cpu")), keep=2)
slow = False
saver.save(model=model, optimizer=opt, loader=Loader(), params={}, plan={}, state=TrainState(step=1))
saver.wait()
slow, SlowFile.written = True, 0
saver.save(model=model, optimizer=opt, loader=Loader(), params={}, plan={}, state=TrainState(step=2))
marker.with_suffix(".returned").touch()  # the save returned while its file is being written: training goes on
while True:
    opt.step()
    time.sleep(0.01)
"""


def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    """A real process: step 1 complete, step 2's background write stalled mid-file while the training thread
    goes on; SIGKILL. The newest readable checkpoint is step 1 (`latest` never moved), the partial temporary file
    is the only trace, and the next writer sweeps it."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script, out, marker = tmp_path / "writer.py", tmp_path / "ckpt", tmp_path / "marker"
    script.write_text(KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(marker)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                             PYTHONPATH=str(Path(__file__).parents[2])))
    try:
        deadline = time.monotonic() + 120
        while not (marker.with_suffix(".writing").exists() and marker.with_suffix(".returned").exists()):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "timed out waiting for the stalled write"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    temps = [p.name for p in out.iterdir() if ".tmp-" in p.name]
    assert temps == [f".step_000002.pt.tmp-{__import__('platform').node()}-{proc.pid}"]
    assert (out / temps[0]).stat().st_size > 2**20  # a partial file
    assert (out / "latest").read_text().strip() == "step_000001.pt"
    path, state = newest_readable(out)
    assert path == out / "step_000001.pt" and state["step"] == 1
    write_latest(out, path.name)  # any writer into the directory sweeps what the dead process left
    from pipeline.io import sweep_stale_temps

    sweep_stale_temps(out)
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []


def test_async_and_sync_runs_write_the_same_checkpoints(data, tmp_path):
    """The trainer with train.async_ckpt true (the default) and false, 5 steps of the tiny run: the same
    step-3 and step-5 checkpoints (the resume from an asynchronous one: test_train's resume tests, which run
    with the default)."""
    from builders import make_params, run_inprocess

    for name, flag in (("async", True), ("sync", False)):
        run_inprocess(data, tmp_path / name, make_params(steps=6, async_ckpt=flag), max_steps=5)
        assert latest_checkpoint(tmp_path / name / "ckpt").name == "step_000005.pt"
    for step in (3, 5):
        a, s = (load_checkpoint(tmp_path / n / "ckpt" / checkpoint_name(step)) for n in ("async", "sync"))
        assert a["params"]["train"].pop("async_ckpt") and not s["params"]["train"].pop("async_ckpt")
        a.pop("versions"), s.pop("versions")
        a.pop("plan"), s.pop("plan")  # the plan prices each save mode's checkpoints (pipeline.planning.train_jobs)
        assert a.keys() == s.keys() and _same(a, s), step


FSDP_SAVER = """
import sys
from pathlib import Path
import torch
import torch.distributed as td
sys.path.insert(0, sys.argv[2])
from builders import make_params
from pipeline.distributed import Dist, close_distributed, init_distributed
from pipeline.training import checkpoint as C
from pipeline.training.optim import build_optimizer
from pipeline.training.parallelize import build_model

out = Path(sys.argv[1])
params = make_params(nproc=2, micro_batch=2, parallel="fsdp")
dist = init_distributed("cpu")
torch.manual_seed(0)
model = build_model(params, dist.device, dist)
opt = build_optimizer(model, params["train"], "cpu")
x = torch.randint(0, 320, (2, 8), generator=torch.Generator().manual_seed(dist.rank))

def train_step():
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()

class Loader:
    def state_dict(self):
        return {"position": dist.rank}

def local(x):  # x with every DTensor as its local shard's values (lists: comparable with ==)
    if isinstance(x, dict):
        return {k: local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [local(v) for v in x]
    if isinstance(x, torch.Tensor):
        return (x.to_local() if hasattr(x, "to_local") else x).tolist()
    return x

def save(saver, step):
    saver.save(model=model, optimizer=opt, loader=Loader(), params=params, plan={}, state=C.TrainState(step=step))

saver = C.Checkpointer(out / "async", dist, keep=2)
train_step()
save(saver, 1)
train_step()
save(saver, 2)                      # finalizes step 1 (a collective), starts step 2
assert saver.in_flight == out / "async" / "step_000002.dcp"
C.save_training_checkpoint(out / "sync", dist, model=model, optimizer=opt, loader=Loader(), params=params, plan={},
                           state=C.TrainState(step=2), keep=2)
want = {k: v.to_local().clone() for k, v in model.state_dict().items()}
train_step()                        # changes the live shards while step 2 may still be written
saver.close()                       # step 2 finalized
for d in ("async", "sync"):
    if dist.is_main:
        path, state = C.newest_readable(out / d)   # verified against SHA256SUMS
        assert path.name == "step_000002.dcp" and state["loader"] == [{"position": 0}, {"position": 1}], state
    td.barrier()
    C._load_sharded(out / d / "step_000002.dcp", model, opt)
    got = {k: v.to_local() for k, v in model.state_dict().items()}
    assert all(torch.equal(want[k], got[k]) for k in want), d
    osd = {d: local(opt.state_dict())} if d == "async" else osd | {d: local(opt.state_dict())}
assert osd["async"] == osd["sync"]
if dist.is_main:
    assert sorted(p.name for p in (out / "async").iterdir()) == ["latest", "step_000001.dcp", "step_000002.dcp"]
td.barrier()
td.destroy_process_group()
(out / f"ok{dist.rank}").touch()
"""


@pytest.mark.slow
def test_fsdp_async_saves_on_two_gloo_processes(tmp_path):
    """FSDP2 over 2 gloo processes: `Checkpointer` saves through DCP's async_save (its own gloo group), the
    finalization at the next save and at close (SHA256SUMS verified, `latest`), and the asynchronous step-2
    checkpoint loads to the shards the synchronous one holds, though the shards changed after the save."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[2]
    script = tmp_path / "saver.py"
    script.write_text(FSDP_SAVER)
    from builders import ranks  # tests/forkrun.py: torchrun's worker environment, forked after one import of torch

    r = subprocess.run([*ranks(2), str(script), str(tmp_path / "out"), str(root / "tests")], capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root)), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "out" / "ok0").exists() and (tmp_path / "out" / "ok1").exists()
