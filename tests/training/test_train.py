"""pipeline.training.train: the training loop, loss normalisation, DDP, exact resume, the token count.

A tiny run: a 300-token BPE, a 2-layer dim-32 model, rows of 32 tokens packed from a small
repetitive corpus. Single-process runs happen in-process; 2-process DDP runs with the gloo backend
(marked slow) get torchrun's worker environment from tests/forkrun.py, which forks the ranks after one
import of torch and the trainer (builders.ranks).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
from builders import (
    ROOT,
    TRAIN_SEQ,
    cuda_precision_inputs,
    cuda_precision_params,
    make_params,
    make_plan,
    ranks,
    run_inprocess,
)

from pipeline.errors import PipelineError
from pipeline.io import write_json

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run faster on one intra-op thread


def read_metrics(outdir) -> list[dict]:
    return [json.loads(ln) for ln in Path(outdir, "metrics.jsonl").read_text().splitlines()]


def final_state(outdir) -> dict:
    return torch.load(Path(outdir) / "final.pt", weights_only=True)["model"]


# ----------------------------------------------------------------------------- single process

@pytest.fixture(scope="module")
def full_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    params = make_params()
    summary = run_inprocess(data, out, params)
    return out, params, summary


def test_run_writes_outputs_and_trains_the_planned_tokens(full_run):
    out, params, summary = full_run
    plan = make_plan(params)
    assert summary["tokens_trained"] == plan.num_steps * plan.tokens_per_step == 12 * 256
    assert summary["loss_tokens"] == 12 * 256  # concat packing: every target counts
    final = torch.load(out / "final.pt", weights_only=True)
    assert final["summary"]["tokens_trained"] == 12 * 256 and final["params"] == params
    assert not any(k.startswith(("module.", "_orig_mod.", "model.")) for k in final["model"])
    assert json.loads((out / "summary.json").read_text())["tokens_planned"] == 12 * 256
    assert (out / "ckpt" / "latest").read_text().strip() == "step_000012.pt"
    assert sorted(p.name for p in (out / "ckpt").glob("step_*.pt")) == ["step_000009.pt", "step_000012.pt"]

    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert [r["tokens"] for r in recs] == [256 * s for s in range(1, 13)]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    first = recs[0]
    for key in ("lr/embedding", "lr/matrix", "lr/no_decay", "grad_norm", "grad_norm/embedding",
                "grad_norm/block_first", "grad_norm/block_last", "param_norm/embedding", "update_ratio/block_last",
                "tokens_per_s", "mfu"):
        assert key in first, key
    assert first["lr/matrix"] == pytest.approx(params["train"]["lr"] / 2)  # warmup step 1 of 2
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8, 12]
    assert all({"ce_fp32", "top1_acc", "sample"} <= set(r) for r in val)
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    assert val[0]["sample"].startswith("The old king")
    # fp32 run: the fixed-batch fp32 CE is the same quantity as the training-precision val loss
    assert abs(val[-1]["ce_fp32"] - val[-1]["val_loss"]) < 0.5


def test_resume_is_bitwise_exact(data, full_run, tmp_path):
    out_full, params, _ = full_run
    assert run_inprocess(data, tmp_path, params, max_steps=5) is None
    assert not (tmp_path / "final.pt").exists()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000005.pt"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    run_inprocess(data, tmp_path, params, resume="auto")
    full, resumed = read_metrics(out_full), read_metrics(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in full]
    a, b = final_state(out_full), final_state(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_never_starts_over_and_clears_old_checkpoints(data, tmp_path):
    params = make_params(steps=4)
    run_inprocess(data, tmp_path, params, max_steps=3)
    run_inprocess(data, tmp_path, params, resume="never", max_steps=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.pt")) == ["step_000002.pt"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_crash_after_last_checkpoint_resumes_to_final(data, tmp_path):
    params = make_params(steps=4)
    first = run_inprocess(data, tmp_path, params)
    (tmp_path / "final.pt").unlink()  # as if killed between the last checkpoint and final.pt
    again = run_inprocess(data, tmp_path, params)
    assert again == first
    assert torch.load(tmp_path / "final.pt", weights_only=True)["summary"] == first


def test_checkpoint_from_another_config_is_never_resumed(data, tmp_path):
    params = make_params(steps=4)
    run_inprocess(data, tmp_path, params, max_steps=2)
    changed = make_params(steps=4, lr=5e-3)
    with pytest.raises(PipelineError, match=r"different config \(keys differing: train.lr\)"):
        run_inprocess(data, tmp_path, changed, resume="require")
    # auto (what the rule uses: Snakemake reruns train after a config edit) starts over and keeps the
    # old checkpoints aside; the result equals a fresh run of the new config.
    rerun = run_inprocess(data, tmp_path, changed)
    assert rerun == run_inprocess(data, tmp_path / "fresh", changed)
    stale = list(tmp_path.glob("ckpt/stale-*/step_*.pt"))
    assert [p.name for p in stale] == ["step_000002.pt"]
    run_inprocess(data, tmp_path, make_params(steps=4, lr=2e-3), max_steps=1)  # another edit: one stale dir kept
    assert len(list(tmp_path.glob("ckpt/stale-*"))) == 1
    assert "step_000002.pt" not in [p.name for p in tmp_path.glob("ckpt/stale-*/step_*.pt")]  # the older run's
    logging_only = make_params(steps=4, log_interval=2, val_interval=2)  # observability keys may change
    run_inprocess(data, tmp_path / "obs", params, max_steps=2)
    assert run_inprocess(data, tmp_path / "obs", logging_only, resume="require")["tokens_trained"] == 4 * 256



def test_another_world_size_needs_one_global_loader_position(data, tmp_path):
    """A checkpoint of another world size whose ranks' loader states differ (not PackedLoader's: a
    position per rank) has no global position to map: one error naming it, before any step."""
    from pipeline.model.checkpoint_io import load_checkpoint, save_checkpoint

    params = make_params(steps=4)
    run_inprocess(data, tmp_path, params, max_steps=2)
    path = tmp_path / "ckpt" / "step_000002.pt"
    state = load_checkpoint(path)
    loader = state["loader"][0]
    save_checkpoint(path, {**state, "params": make_params(nproc=2, steps=4), "world_size": 2, "rng": state["rng"] * 2,
                           "loader": [loader, {**loader, "position": loader["position"] + 1}]})
    with pytest.raises(PipelineError, match="step_000002.pt cannot be resumed on another world size: its ranks' "
                                            r"loader states differ.*resume with 2 process\(es\)"):
        run_inprocess(data, tmp_path, params, resume="require")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]

def test_too_little_data_fails_before_training(data, tmp_path):
    params = make_params(steps=5000)
    with pytest.raises(PipelineError, match=r"supply \d+ steps.*needs 5000 steps.*mixes.pretrain.tokens"):
        run_inprocess(data, tmp_path, params)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_plan_for_another_world_size_is_refused(data, tmp_path):
    from pipeline.training.train import train

    params = make_params()
    plan = dataclasses.replace(make_plan(params), world_size=2)
    with pytest.raises(PipelineError, match="launched with 1 process.*world_size 2"):
        train(params, plan, data["train"], data["val"], data["tokenizer"], str(tmp_path))


def test_tokenizer_larger_than_the_model_vocab_is_refused(data, tmp_path):
    """Token ids >= model.vocab_size would index past the embedding: refused before any step runs."""
    params = make_params(steps=4)
    params["model"]["vocab_size"] = 256  # the tokenizer has 300 ids
    with pytest.raises(PipelineError, match=r"has 300 token ids but model.vocab_size is 256.*at least 300"):
        run_inprocess(data, tmp_path, params)
    assert not (tmp_path / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- stages

def stage_params_of(name: str, stages: list[dict]) -> dict:
    """The params the train rule passes for stage `name` of a tiny run with these stages."""
    mixes = {"pretrain": {"weights": {"web": 1.0}, "tokens": 100_000}}  # fixed size: an epochs stage counts it
    return make_params(steps=8, stages=stages, stage=name, mixes=mixes)


STAGES = [{"name": "base"}, {"name": "more", "steps": 3, "lr": 1e-3, "warmup_steps": 0, "schedule": "decay"},
          {"name": "again", "epochs": 1.5, "init_from": "base"}]


def test_a_stage_starts_from_the_previous_stages_weights(data, tmp_path):
    base = stage_params_of("base", STAGES)
    first = run_inprocess(data, tmp_path / "base", base)
    more = stage_params_of("more", STAGES)
    assert more["stage"]["init_from"] == "base" and more["train"]["schedule"] == "decay"
    with pytest.raises(PipelineError, match="starts from stage 'base': pass --init R/train/base/final.pt"):
        run_inprocess(data, tmp_path / "more", more)
    with pytest.raises(PipelineError, match="stage 'base' starts from scratch .* but --init"):
        run_inprocess(data, tmp_path / "base2", base, init=str(tmp_path / "base" / "final.pt"))
    summary = run_inprocess(data, tmp_path / "more", more, init=str(tmp_path / "base" / "final.pt"))
    assert summary["num_steps"] == 3 and summary["tokens_trained"] == 3 * 256 and summary["init_from"] == "base"
    recs, base_recs = read_metrics(tmp_path / "more"), read_metrics(tmp_path / "base")
    assert recs[0]["loss"] < base_recs[0]["loss"] - 1.0  # it starts trained, not from scratch
    assert abs(recs[0]["loss"] - base_recs[-1]["loss"]) < 0.5
    assert recs[-1]["lr/matrix"] == pytest.approx(1e-3 * more["train"]["min_lr_ratio"])  # the decay schedule's end
    final = torch.load(tmp_path / "more" / "final.pt", weights_only=True)
    assert len(final["params"]["stage"]["init_sha256"]) == 64 and first["num_steps"] == 8
    # a checkpoint of this stage made from another init is never resumed
    run_inprocess(data, tmp_path / "more2", more, init=str(tmp_path / "base" / "final.pt"), max_steps=1)
    other = tmp_path / "other.pt"
    state = torch.load(tmp_path / "base" / "final.pt", weights_only=True)
    state["model"] = {k: v + 0.01 for k, v in state["model"].items()}
    torch.save(state, other)
    with pytest.raises(PipelineError, match="different config .*stage"):
        run_inprocess(data, tmp_path / "more2", more, init=str(other), resume="require")


def test_carry_optimizer_continues_the_previous_stages_optimizer_state(data, tmp_path):
    stages = [{"name": "base"}, {"name": "more", "steps": 3, "lr": 1e-3, "carry_optimizer": True}]
    run_inprocess(data, tmp_path / "base", stage_params_of("base", stages))
    more = stage_params_of("more", stages)
    run_inprocess(data, tmp_path / "more", more, init=str(tmp_path / "base" / "final.pt"))
    state = torch.load(tmp_path / "more" / "ckpt" / "step_000003.pt", weights_only=True)["optimizer"]
    steps = {float(s["step"]) for s in state["state"].values()}
    assert steps == {8 + 3}  # AdamW's step count went on from the base stage's 8 steps
    assert {g["base_lr"] for g in state["param_groups"]} == {1e-3}  # with this stage's learning rate
    fresh = stage_params_of("more", [stages[0], {**stages[1], "carry_optimizer": False}])
    run_inprocess(data, tmp_path / "fresh", fresh, init=str(tmp_path / "base" / "final.pt"))
    state = torch.load(tmp_path / "fresh" / "ckpt" / "step_000003.pt", weights_only=True)["optimizer"]
    assert {float(s["step"]) for s in state["state"].values()} == {3}


def test_init_from_another_model_shape_is_one_clear_error(data, tmp_path):
    run_inprocess(data, tmp_path / "base", stage_params_of("base", STAGES))
    wider = stage_params_of("more", STAGES)
    wider["model"] = {**wider["model"], "dim": 64, "ffn_dim": 128}
    with pytest.raises(PipelineError, match=r"stage 'more' cannot start from .*base/final.pt: it holds another model "
                                            r"shape \(tok_embeddings.weight \(320, 32\) vs \(320, 64\)"):
        run_inprocess(data, tmp_path / "more", wider, init=str(tmp_path / "base" / "final.pt"))
    assert not (tmp_path / "more" / "metrics.jsonl").exists()


def test_epochs_budget_reads_every_row_and_pads_the_last_step(data, tmp_path):
    from pipeline.data.loader import PackedLoader

    again = stage_params_of("again", STAGES)
    n_rows = PackedLoader(data["train"], 1).n_rows
    rows = -(-3 * n_rows // 2)  # 1.5 epochs, rounded up
    run_inprocess(data, tmp_path / "base", stage_params_of("base", STAGES))
    summary = run_inprocess(data, tmp_path / "again", again, init=str(tmp_path / "base" / "final.pt"))
    steps = -(-rows // 8)  # 8 rows per step
    assert summary["num_steps"] == steps and summary["empty_rows"] == steps * 8 - rows
    assert summary["tokens_trained"] == steps * 256  # the empty rows' inputs are processed (fixed shapes) ...
    assert summary["loss_tokens"] == rows * TRAIN_SEQ  # ... but never counted by the loss


# ----------------------------------------------------------------------------- loss normalisation

def _tiny_loss_model(seed=0):
    from pipeline.model.model import ModelConfig, Transformer
    from pipeline.training.parallelize import LossModel

    torch.manual_seed(seed)
    return LossModel(Transformer(ModelConfig.from_config(make_params())), None, ce_chunk=40)


def _micro_batches(n=3, masked=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randint(0, 300, (2, TRAIN_SEQ), generator=g)
        y = torch.randint(0, 300, (2, TRAIN_SEQ), generator=g)
        m = (torch.rand(2, TRAIN_SEQ, generator=g) < 0.3 + 0.3 * i) if masked else None  # uneven counts
        out.append((x, y, m))
    return out


def _reference_grads(batches, seed=0):
    """Gradient of (sum of per-token losses over all counted tokens) / (their number), one pass."""
    lm = _tiny_loss_model(seed)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    m = torch.cat([b[2] for b in batches]) if batches[0][2] is not None else None
    s, c = lm(x, y, m)
    (s / c).backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters()}


def test_accumulated_gradient_is_the_global_token_mean():
    from pipeline.distributed import Dist
    from pipeline.training.step import accumulate_gradients, count_tokens

    batches = _micro_batches()
    lm = _tiny_loss_model()
    dist = Dist(0, 0, 1, torch.device("cpu"))
    counts = count_tokens(batches, dist)
    assert counts.tolist() == [int(sum(b[2].sum() for b in batches)), 3 * 2 * TRAIN_SEQ]
    accumulate_gradients(lm, lm, batches, counts[0], world_size=1)
    ref = _reference_grads(batches)
    for n, p in lm.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6, rtol=1e-4), n


def test_no_sync_on_all_but_the_last_micro_step(tmp_path, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipeline.distributed import Dist
    from pipeline.training.parallelize import wrap
    from pipeline.training.step import accumulate_gradients, count_tokens

    entered = []
    original = DDP.no_sync

    def spy(self):
        entered.append(len(entered))
        return original(self)

    monkeypatch.setattr(DDP, "no_sync", spy)
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist = Dist(0, 0, 1, torch.device("cpu"))
        ddp, fwd = wrap(_tiny_loss_model(), dist, compile_model=False)
        assert isinstance(ddp, DDP) and fwd is ddp
        batches = _micro_batches(n=4)
        accumulate_gradients(ddp, fwd, batches, count_tokens(batches, dist)[0], world_size=1)
        assert len(entered) == 3
        ref = _reference_grads(batches)
        for n, p in ddp.module.named_parameters():
            assert torch.allclose(p.grad, ref[n], atol=1e-6, rtol=1e-4), n
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_ddp_path_runs_on_cpu_and_matches_eager(data, tmp_path):
    """torch.compile(DDP(LossModel)) with gradient accumulation (no_sync) in a 1-process gloo group
    the caller initialised; the first compile takes ~25 s."""
    params = make_params(steps=3, compile=True, val_interval=3)
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summary = run_inprocess(data, tmp_path / "compiled", params)
        assert torch_dist.is_initialized()  # the caller's group is left alone
    finally:
        torch_dist.destroy_process_group()
    assert summary["tokens_trained"] == 3 * 256
    run_inprocess(data, tmp_path / "eager", make_params(steps=3, val_interval=3))
    compiled, eager = read_metrics(tmp_path / "compiled"), read_metrics(tmp_path / "eager")
    assert np.allclose([r["loss"] for r in compiled], [r["loss"] for r in eager], atol=1e-4)
    assert compiled[-1]["val_loss"] == pytest.approx(eager[-1]["val_loss"], abs=1e-4)


# ----------------------------------------------------------------------------- metrics

def wandb_records(path: Path) -> list:
    """The records of a .wandb transaction log, decoded with wandb's own protobuf `Record`.

    wandb 0.31 ships no Python reader for the file, so the framing is read here: a 7-byte header
    (b":W&B", magic, version), then LevelDB log format — 32 KiB blocks of chunks, each with a
    7-byte header (crc32c, little-endian length, type: 1 full, 2 first, 3 middle, 4 last); a block's
    tail shorter than a chunk header is zero padding.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block end (preallocated tail)
            pos += left
            continue
        if pos + 7 + n > len(data):  # a chunk still being written
            break
        pending = data[pos + 7:pos + 7 + n] if kind in (1, 2) else pending + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def finished_wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The records of a finished run's .wandb file, once its exit record is on disk: `run.finish()`
    can return before wandb's service has flushed the file (seen: only the 7-byte header)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)


def wandb_history(records: list) -> list[dict]:
    """The logged history rows among .wandb records: {key: decoded JSON value}."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_metrics_logger_resume_truncation_and_offline_wandb(tmp_path, monkeypatch):
    from pipeline.training.metrics import MetricsLogger

    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    path = tmp_path / "metrics.jsonl"
    cfg = {"mode": "offline", "project": "tokenfarm-test"}
    m = MetricsLogger(path, cfg, tmp_path, {"train": {"lr": 1}}, "t")
    run_id = m.wandb_id
    for step in (1, 2, 3):
        m.log({"step": step, "loss": 1.0 / step})
    m.close()
    m = MetricsLogger(path, cfg, tmp_path, {"train": {"lr": 1}}, "t", resume_step=2, wandb_id=run_id)
    m.log({"step": 3, "loss": 0.25})
    m.close()
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 0.25}]
    # one offline run directory per start; a second start within the same second gets a "-1" suffix
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2, "an offline wandb run directory under outdir/wandb per start"
    # The optimizer step is logged as the metric "step", the x-axis of every other metric, not as
    # wandb's own step: wandb silently drops rows at or below its last step, and a resumed run
    # re-logs the steps after its checkpoint (here step 3). Offline there is no server whose last
    # step could drop them, so what is checked is what the run files say was logged and declared.
    (first,), (second,) = (r.glob("run-*.wandb") for r in runs)
    records = [finished_wandb_records(first), finished_wandb_records(second)]
    rows = [wandb_history(recs) for recs in records]
    assert [[(r["step"], r["loss"]) for r in rs] for rs in rows] == [[(1, 1.0), (2, 0.5), (3, 1 / 3)], [(3, 0.25)]]
    for recs in records:
        defined = [r.metric for r in recs if r.WhichOneof("record_type") == "metric"]
        assert any(d.name == "step" for d in defined)
        assert any(d.glob_name == "*" and d.step_metric == "step" for d in defined)
    assert not any(secret.encode() in f.read_bytes() for f in tmp_path.rglob("*") if f.is_file())


def test_mfu_norms_and_update_ratio():
    from pipeline.model.model import ModelConfig, Transformer
    from pipeline.training.metrics import UpdateRatio, group_norms, mfu, watched_groups

    assert mfu(8.25e9, 4.0e5, 8, 989e12) == pytest.approx(8.25e9 * 4.0e5 / (8 * 989e12))
    model = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    tie_embeddings=False, max_seq_len=8))
    groups = watched_groups(model)
    assert set(groups) == {"embedding", "lm_head", "block_first", "block_last"}
    assert len(groups["block_last"]) == len(groups["block_first"]) == 9
    norms = group_norms(groups, "param_norm")
    assert norms["param_norm/lm_head"] == pytest.approx(model.lm_head.weight.norm().item(), rel=1e-6)
    tracker = UpdateRatio(groups)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    ratios = tracker.ratios()
    assert ratios["update_ratio/lm_head"] == pytest.approx(0.5, rel=1e-5)
    assert ratios["update_ratio/embedding"] == 0.0


# ----------------------------------------------------------------------------- 2-process DDP (gloo)

TEARDOWN_SCRIPT = """
import sys, weakref
import torch, torch.distributed as torch_dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from pipeline.distributed import Dist, close_distributed

def worker(rank, store, n):
    torch.set_num_threads(1)
    for i in range(n):
        torch_dist.init_process_group("gloo", init_method=f"file://{store}-{i}", rank=rank, world_size=2)
        ddp = DDP(torch.nn.Linear(8, 8))
        for _ in range(2):
            ddp(torch.randn(4, 8)).sum().backward()
            torch_dist.all_reduce(torch.ones(2))
        for _ in range(2):  # collectives whose tensors' Python objects die before the gloo work
            torch_dist.all_gather_object([None, None], {"step": i})
        ref = weakref.ref(ddp)
        del ddp
        close_distributed(Dist(rank, rank, 2, torch.device("cpu"), owns_group=True), ref)

if __name__ == "__main__":
    # forked: the workers start with torch imported (spawn re-imports it in each, ~3 CPU-s a worker)
    mp.start_processes(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, start_method="fork")
"""


@pytest.mark.slow
def test_process_group_teardown_never_deadlocks(tmp_path):
    """100 gloo process groups used by DDP and all_gather_object, each closed by close_distributed.
    Destroying the group while the DDP module was alive deadlocked within ~50 such cycles."""
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), "100"], capture_output=True,
                           text=True, env=env, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("a process group teardown hung")
    assert r.returncode == 0, r.stderr[-3000:]


def run_ranks(data, outdir: Path, params: dict, *extra: str) -> None:
    """Run the train CLI on 2 gloo processes (builders.ranks); each rank also dumps its final
    parameters to outdir/rank{r}.pt (through a wrapper script, test-only)."""
    plan_path = outdir.parent / f"{outdir.name}-plan.json"
    write_json(plan_path, make_plan(params).to_json())
    script = outdir.parent / f"{outdir.name}-launch.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import pipeline.training.train as T
        from pipeline.io import run_cli
        _finish = T.finish
        def finish(outdir, d, model, *a):
            torch.save(model.state_dict(), outdir / f"rank{d.rank}.pt")
            return _finish(outdir, d, model, *a)
        T.finish = finish
        run_cli(T.main)
    """))
    cmd = [*ranks(2), str(script), "--params", json.dumps(params), "--plan", str(plan_path), "--train", data["train"],
           "--val", data["val"], "--tokenizer", data["tokenizer"], "--outdir", str(outdir), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_run(data, tmp_path_factory):
    """2 ranks × micro-batch 2 × 32 tokens = 128 tokens per micro-step: 2 accumulation micro-steps per
    rank for the 256-token global batch, so the first of them runs under no_sync and the second's
    backward all-reduces the accumulated gradients across the ranks."""
    out = tmp_path_factory.mktemp("ddp") / "train"
    params = make_params(nproc=2, steps=6, ckpt_interval=2, val_interval=3, micro_batch=2)
    assert make_plan(params).grad_accum_steps == 2
    run_ranks(data, out, params)
    return out, params


@pytest.mark.slow
def test_ddp_ranks_agree_and_equal_single_process_accumulation(data, ddp_run, tmp_path):
    out, _ = ddp_run
    r0, r1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert json.loads((out / "summary.json").read_text())["tokens_trained"] == 6 * 256

    # Same rows per optimizer step. The loader's micro-step i takes the block perm[i*W*B : (i+1)*W*B]
    # of the epoch permutation (the same permutation for any W and B: seeded by seed and epoch only)
    # and rank r its slice [r*B, (r+1)*B) of it. Both runs have W*B = 4 rows per micro-step and 2
    # micro-steps per optimizer step, so step s takes perm[8s : 8s+8] in both:
    #   DDP (W=2, B=2):    micro-step 2s: rank 0 perm[8s:8s+2],   rank 1 perm[8s+2:8s+4]
    #                      micro-step 2s+1: rank 0 perm[8s+4:8s+6], rank 1 perm[8s+6:8s+8]
    #   single (W=1, B=4): micro-step 2s: perm[8s:8s+4], micro-step 2s+1: perm[8s+4:8s+8]
    # and both normalise by the same global token count, so the gradients agree up to fp32
    # summation order.
    single = make_params(nproc=1, steps=6, ckpt_interval=2, val_interval=3)  # micro-batch 4, 2 micro-steps
    assert make_plan(single).grad_accum_steps == 2
    from pipeline.data.loader import PackedLoader

    def step_inputs(world: int, micro_batch: int) -> list[torch.Tensor]:
        """Per optimizer step, the inputs of all micro-steps and ranks, in micro-step then rank order."""
        its = [iter(PackedLoader(data["train"], micro_batch, rank=r, world_size=world, seed=single["seed"]))
               for r in range(world)]
        return [torch.cat([next(it)[0] for _ in range(2) for it in its]) for _ in range(6)]

    assert all(torch.equal(a, b) for a, b in zip(step_inputs(2, 2), step_inputs(1, 4), strict=True))
    run_inprocess(data, tmp_path, single)
    s = final_state(tmp_path)
    # The two runs sum the same per-token gradients in different orders (fp32 rounding ~1e-10 of a
    # coordinate). AdamW's first update, lr·g/(|g| + eps) with eps 1e-8, turns that into a parameter
    # difference of up to lr·1e-10/eps ≈ 5e-5 for a coordinate whose gradient is within a few eps
    # of 0 (one embedding coordinate here: ~1.8e-5; all others agree to < 1e-6); hence atol 1e-4,
    # 1 % of the lr. A wrong reduction or normalisation moves the losses and gradient norms below.
    assert all(torch.allclose(s[k], r0[k], atol=1e-4, rtol=1e-4) for k in s)
    ddp_recs, single_recs = read_metrics(out), read_metrics(tmp_path)
    assert np.allclose([r["loss"] for r in ddp_recs], [r["loss"] for r in single_recs], atol=1e-5)
    assert np.allclose([r["grad_norm"] for r in ddp_recs], [r["grad_norm"] for r in single_recs], rtol=1e-5)


@pytest.mark.slow
def test_ddp_bf16_compiled_run_validates_samples_and_scores_core(data, tmp_path_factory, monkeypatch):
    """torch.compile(DDP) on 2 gloo processes on the CUDA precision path (TOKENFARM_CPU_AS_CUDA_PRECISION=1:
    the body under bf16 autocast, fp32 master weights): validation, the fixed batch, the sample and CORE
    inside the run, and the ranks end with the same weights."""
    inputs = cuda_precision_inputs(data, tmp_path_factory.mktemp("bf16"))
    params, out = cuda_precision_params("ddp"), tmp_path_factory.mktemp("ddp_bf16") / "train"
    monkeypatch.setenv("TOKENFARM_CPU_AS_CUDA_PRECISION", "1")
    run_ranks(inputs, out, params, "--eval-data", inputs["eval_data"])
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["loss"] < records[0]["loss"]
    for r in records[1::2]:  # steps 2 and 4
        assert {"val_loss", "ce_fp32", "top1_acc", "sample", "core_1", "core/copa"} <= r.keys(), r.keys()
        assert np.isfinite([r["val_loss"], r["ce_fp32"], r["core_1"]]).all()
        assert r["sample"].startswith(params["eval"]["prompts"][0])
    r0, r1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)


@pytest.fixture(scope="module")
def ddp_to_step_3(data, ddp_run, tmp_path_factory):
    """ddp_run's settings stopped by --max-steps 3: the first part of the two DDP resume tests below, each of
    which resumes its own copy of it."""
    out = tmp_path_factory.mktemp("ddp3") / "train"
    run_ranks(data, out, ddp_run[1], "--max-steps", "3")
    return out


@pytest.mark.slow
def test_ddp_resume_is_bitwise_exact(data, ddp_run, ddp_to_step_3, tmp_path):
    out_full, params = ddp_run
    out = tmp_path / "train"
    shutil.copytree(ddp_to_step_3, out)
    assert not (out / "final.pt").exists()
    state = torch.load(out / "ckpt" / "step_000003.pt", weights_only=True)
    assert len(state["loader"]) == 2 and len(state["rng"]) == 2 and state["world_size"] == 2
    # every rank's loader is 3 steps × 2 micro-steps into epoch 0
    assert [(ls["epoch"], ls["position"], ls["micro_batch"], ls["world_size"]) for ls in state["loader"]] == \
        [(0, 6, 2, 2)] * 2
    run_ranks(data, out, params, "--resume", "auto")
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(out_full)]
    a, b = torch.load(out_full / "rank1.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)



@pytest.mark.slow
def test_ddp_checkpoint_resumes_in_one_process_like_the_uninterrupted_run(data, ddp_run, ddp_to_step_3, tmp_path):
    """2 DDP processes to step 3, resumed by 1 process (micro-batch 2, now 4 accumulation micro-steps,
    the plan re-made for it): the consolidated state loads whole, the loader continues with the same
    global rows; steps 4-6 equal the uninterrupted 2-process run's within fp32 rounding (the tolerances of
    test_ddp_ranks_agree_and_equal_single_process_accumulation)."""
    out_full, params = ddp_run
    out = tmp_path / "train"
    shutil.copytree(ddp_to_step_3, out)
    alone = make_params(nproc=1, steps=6, ckpt_interval=2, val_interval=3, micro_batch=2)
    assert make_plan(alone).grad_accum_steps == 4
    summary = run_inprocess(data, out, alone, resume="require")
    assert summary["tokens_trained"] == summary["tokens_planned"] == 6 * 256 and summary["world_size"] == 1
    recs, full = read_metrics(out), read_metrics(out_full)
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert [r["loss"] for r in recs[:3]] == [r["loss"] for r in full[:3]]  # kept from the 2-process part
    assert np.allclose([r["loss"] for r in recs], [r["loss"] for r in full], rtol=0, atol=1e-5)
    assert np.allclose([r["grad_norm"] for r in recs], [r["grad_norm"] for r in full], rtol=1e-5)
    a, b = torch.load(out_full / "rank0.pt"), final_state(out)
    assert all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in a)

# ----------------------------------------------------------------------------- interrupted runs

def test_resume_replaces_the_steps_logged_after_the_checkpoint(data, full_run, tmp_path):
    """Killed after logging steps 4 and 5 past the step-3 checkpoint (and mid-line): the resumed log has
    every step exactly once, with the uninterrupted run's losses."""
    out_full, params, _ = full_run
    run_inprocess(data, tmp_path, params, max_steps=5)
    (tmp_path / "ckpt" / "step_000005.pt").unlink()  # the kill came before step 5's checkpoint
    (tmp_path / "ckpt" / "latest").write_text("step_000003.pt\n")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.2')  # cut short by the kill
    run_inprocess(data, tmp_path, params)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 13))
    assert [r["loss"] for r in read_metrics(tmp_path)] == [r["loss"] for r in read_metrics(out_full)]


def test_unreadable_newest_checkpoint_is_moved_aside_and_the_previous_one_resumed(data, full_run, tmp_path, caplog):
    out_full, params, _ = full_run
    run_inprocess(data, tmp_path, params, max_steps=5)
    newest = tmp_path / "ckpt" / "step_000005.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    with caplog.at_level("WARNING"):
        run_inprocess(data, tmp_path, params)
    assert "step_000005.pt is corrupt (sha256 mismatch" in caplog.text and "moved it aside" in caplog.text
    assert (tmp_path / "ckpt" / "unreadable" / "step_000005.pt").exists()
    a, b = final_state(out_full), final_state(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 13))


def test_config_key_starts_over(data, tmp_path):
    params = make_params(steps=4)
    run_inprocess(data, tmp_path, params, max_steps=3)
    never = make_params(steps=4, resume="never")
    run_inprocess(data, tmp_path, never, max_steps=2)  # no resume= argument: train.resume decides
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.pt")) == ["step_000002.pt"]
    # a checkpoint made under resume: never is resumed under auto (the key does not change the trajectory)
    assert run_inprocess(data, tmp_path, params)["tokens_trained"] == 4 * 256


def test_a_run_ending_with_its_history_missing_fails(data, tmp_path):
    """What a trainer left running after a kill used to cause: it finished first, the rerun resumed from the
    last checkpoint with nothing to train and an emptied log, and exited 0."""
    params = make_params(steps=4)
    run_inprocess(data, tmp_path, params)
    (tmp_path / "final.pt").unlink()
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PipelineError, match=r"metrics.jsonl ends at step None, not at step 4"):
        run_inprocess(data, tmp_path, params)
    assert not (tmp_path / "final.pt").exists()


def test_second_trainer_on_the_same_outdir_is_refused(data, tmp_path):
    from pipeline.training.lease import Lease

    with Lease(tmp_path):
        with pytest.raises(PipelineError, match=rf"PID {os.getpid()} .*two trainers must never write"):
            run_inprocess(data, tmp_path, make_params(steps=4))
    assert not (tmp_path / "metrics.jsonl").exists()
