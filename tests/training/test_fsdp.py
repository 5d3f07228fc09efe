"""train.parallel: fsdp (FSDP2) on CPU gloo under the supervisor, ranks as torchrun starts them: the same
losses as DDP (both optimizers), sharded DCP checkpoints that resume exactly (2 and 4 processes) and
resharded (4 processes resumed by 2), a kill -9 whose rerun finishes with the uninterrupted run's
artifacts, a bf16 compiled run on the CUDA precision path (TOKENFARM_CPU_AS_CUDA_PRECISION=1: bf16-gathered
blocks) that validates, samples and scores CORE, the pieces (gathering for evaluation, in fp32 and bf16,
accumulation modes, Muon on DTensors, the adamw8bit refusal, the planner's evaluation term) in a 1-process
group, and sharded Muon's one owner per matrix on 2 gloo ranks.

The tiny run of test_train.py: 12 steps of 256 tokens (8 rows of 32), micro-batch 2, so 2 processes
accumulate 2 micro-steps per step and 4 processes one; validation at steps 10 and 12, checkpoints every 3.
The ranks are forked by tests/forkrun.py after one import of torch and the trainer (builders.ranks; the
same metrics, bit for bit, as under torchrun); the kill -9 test launches torchrun itself, whose process
tree it kills.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
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
    kill_group,
    logged_steps,
    make_params,
    make_plan,
    ranks,
)

from pipeline.io import write_json
from pipeline.run_config import run_config

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12  # past the resumes' step 7 and the kill's step 9; the loss falls by ~1.7 in 12 steps

# The train CLI with test-only hooks, chosen by environment variables: TF_HANG_AT_STEP=k makes rank 0 hang
# while writing step k's checkpoint (its DCP files written, the train state not yet: a partial temporary
# directory), after touching TF_HANG_MARKER — the moment the kill test kills the job.
LAUNCH = """
import os, time
import pipeline.training.checkpoint as C
from pipeline.io import run_cli
import pipeline.training.train as T

hang = int(os.environ.get("TF_HANG_AT_STEP", 0))
_save = C.save_checkpoint
def save_checkpoint(path, state):
    if hang and state.get("step") == hang and path.name == C.TRAIN_STATE:
        open(os.environ["TF_HANG_MARKER"], "w").close()
        time.sleep(600)
    return _save(path, state)
C.save_checkpoint = save_checkpoint
run_cli(T.main)
"""


def command(data, outdir: Path, params: dict, nproc: int, *extra: str, torchrun: bool = False) -> list[str]:
    plan_path = outdir.parent / f"{outdir.name}-plan.json"
    write_json(plan_path, make_plan(params).to_json())
    script = outdir.parent / "launch_fsdp.py"
    script.write_text(textwrap.dedent(LAUNCH))
    return [sys.executable, "-m", "pipeline.training.launch", "--", *ranks(nproc, torchrun), str(script),
            "--params", json.dumps(params), "--plan", str(plan_path), "--train", data["train"], "--val", data["val"],
            "--tokenizer", data["tokenizer"], "--outdir", str(outdir), *extra]


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def run_ranks(data, outdir: Path, params: dict, nproc: int = 2, *extra: str, **environ) -> None:
    r = subprocess.run(command(data, outdir, params, nproc, *extra), capture_output=True, text=True,
                       env=env(**environ), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def read_metrics(outdir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (outdir / "metrics.jsonl").read_text().splitlines()]


def final_model(outdir: Path) -> dict:
    return torch.load(outdir / "final.pt", weights_only=True)["model"]


def params_for(nproc: int = 2, parallel: str = "fsdp", **train) -> dict:
    p = make_params(nproc=nproc, steps=STEPS, micro_batch=2, ckpt_interval=3, val_interval=10, parallel=parallel,
                    **train)
    assert make_plan(p).grad_accum_steps == 4 // nproc
    return p


# ----------------------------------------------------------------------------- equality with DDP

@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_trains_like_ddp(data, fsdp_full, tmp_path, optimizer):
    """12 steps, 2 processes, 2 accumulation micro-steps: the loss and gradient-norm trajectories and the
    final weights of fsdp equal DDP's within fp32 rounding (gradient sums in another order), and final.pt
    is one consolidated file with the plain model's names. The AdamW fsdp run is `fsdp_full`'s 2-process
    run (the same params).

    Muon runs its Newton-Schulz iteration in fp32 on the CPU (pipeline.training.optim.newton_schulz): torch's
    bf16 one (on CUDA) turns the fp32 rounding differences of the two runs' gradients into bf16 rounding flips
    of the update (measured: losses up to 6e-5 apart, gradient norms 7e-4 relative, not growing over 20
    steps) — the same amplification between any two DDP runs that sum gradients in another order, not a
    difference between the parallelisms, which fp32 shows."""
    runs = {}
    for parallel in ("ddp", "fsdp"):
        params = params_for(parallel=parallel, optimizer=optimizer)
        if parallel == "fsdp" and params == params_for(2):
            runs[parallel] = fsdp_full[2]
            continue
        runs[parallel] = tmp_path / parallel
        run_ranks(data, runs[parallel], params)
    assert (runs["fsdp"] == fsdp_full[2]) == (optimizer == "adamw")
    ddp, fsdp = read_metrics(runs["ddp"]), read_metrics(runs["fsdp"])
    assert [r["step"] for r in fsdp] == list(range(1, STEPS + 1))
    assert ddp[-1]["loss"] < ddp[0]["loss"] - 0.5  # it trains
    assert np.allclose([r["loss"] for r in fsdp], [r["loss"] for r in ddp], rtol=0, atol=2e-5)
    assert np.allclose([r["grad_norm"] for r in fsdp], [r["grad_norm"] for r in ddp], rtol=1e-4)
    for key in ("grad_norm/block_first", "param_norm/embedding", "update_ratio/block_last", "val_loss", "ce_fp32"):
        got, want = [r.get(key) for r in fsdp], [r.get(key) for r in ddp]
        assert [g is None for g in got] == [w is None for w in want], key
        assert np.allclose([g for g in got if g is not None], [w for w in want if w is not None], rtol=1e-3), key
    assert [r.get("sample") for r in fsdp] == [r.get("sample") for r in ddp]
    a, b = final_model(runs["ddp"]), final_model(runs["fsdp"])
    assert a.keys() == b.keys() and all(type(v) is torch.Tensor and v.device.type == "cpu" for v in b.values())
    assert all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in a)
    ckpt = runs["fsdp"] / "ckpt"
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:06d}.dcp"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == \
        [f"step_{STEPS - 3:06d}.dcp", f"step_{STEPS:06d}.dcp"]
    assert sorted(p.name for p in (ckpt / f"step_{STEPS:06d}.dcp").iterdir()) == \
        [".metadata", "SHA256SUMS", "__0_0.distcp", "__1_0.distcp", "train_state.pt", "train_state.pt.sha256"]


@pytest.mark.slow
def test_fsdp_stage_from_an_earlier_stage_with_its_optimizer_like_ddp(data, tmp_path):
    """A second stage starting from the first's final.pt and carrying its optimizer state (read back from the
    first stage's sharded checkpoint): the same losses as the DDP run of the same two stages."""
    stages = [{"name": "base"}, {"name": "more", "steps": 4, "lr": 5e-3, "carry_optimizer": True}]
    losses = {}
    for parallel in ("ddp", "fsdp"):
        base, more = (make_params(nproc=2, steps=6, micro_batch=2, parallel=parallel, stages=stages, stage=name)
                      for name in ("base", "more"))
        run_ranks(data, tmp_path / parallel / "base", base)
        run_ranks(data, tmp_path / parallel / "more", more, 2, "--init", str(tmp_path / parallel / "base" / "final.pt"))
        losses[parallel] = [r["loss"] for r in read_metrics(tmp_path / parallel / "more")]
    assert len(losses["fsdp"]) == 4 and np.allclose(losses["fsdp"], losses["ddp"], rtol=0, atol=2e-5)
    state = torch.load(tmp_path / "ddp" / "more" / "ckpt" / "step_000004.pt", weights_only=True)["optimizer"]
    assert {float(s["step"]) for s in state["state"].values()} == {6 + 4}  # the DDP run carried it: so did fsdp


# ----------------------------------------------------------------------------- the CUDA precision path

@pytest.fixture(scope="module")
def precision_data(data, tmp_path_factory):
    return cuda_precision_inputs(data, tmp_path_factory.mktemp("bf16"))


@pytest.mark.slow
def test_fsdp_bf16_compiled_run_validates_samples_and_scores_core(precision_data, tmp_path):
    """2 processes on the CUDA precision path (TOKENFARM_CPU_AS_CUDA_PRECISION=1: the blocks all-gathered in
    bf16, the body under bf16 autocast), blocks compiled: validation, the fixed batch, the sample and CORE
    inside the run, on the gathered bf16 blocks. Before the fix rank 0 died at the first validation
    ("expected m1 and m2 to have the same dtype": the fp32 residual reached a bf16 linear)."""
    params, out = cuda_precision_params("fsdp"), tmp_path / "train"
    run_ranks(precision_data, out, params, 2, "--eval-data", precision_data["eval_data"],
              TOKENFARM_CPU_AS_CUDA_PRECISION="1")
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records[1::2]:  # steps 2 and 4
        assert {"val_loss", "ce_fp32", "top1_acc", "sample", "core_1", "core/copa"} <= r.keys(), r.keys()
        assert np.isfinite([r["val_loss"], r["ce_fp32"], r["core_1"]]).all()
        assert r["ce_fp32"] == pytest.approx(r["val_loss"], rel=0.05)  # the fixed batch is validation's first rows
        assert r["sample"].startswith(params["eval"]["prompts"][0])
    assert records[-1]["loss"] < records[0]["loss"]


# ----------------------------------------------------------------------------- exact resume, kill -9

@pytest.fixture(scope="module")
def fsdp_full(data, tmp_path_factory):
    """Uninterrupted fsdp runs (AdamW) with 2 and 4 processes, the references of the resumes (and the 2, the
    fsdp run of test_fsdp_trains_like_ddp[adamw]). Nothing writes into them."""
    out = {}
    for nproc in (2, 4):
        out[nproc] = tmp_path_factory.mktemp(f"fsdp{nproc}") / "train"
        run_ranks(data, out[nproc], params_for(nproc), nproc)
    return out


@pytest.fixture(scope="module")
def fsdp4_to_step_7(data, tmp_path_factory):
    """4 processes stopped by --max-steps 7 (step 7's checkpoint): the first part of
    test_fsdp_resume_is_exact[4] and of the world-size test, each of which resumes its own copy of it."""
    out = tmp_path_factory.mktemp("fsdp4-7") / "train"
    run_ranks(data, out, params_for(4), 4, "--max-steps", "7")
    return out


def to_step_7(data, out: Path, nproc: int, request) -> None:
    """`out`: a run of params_for(nproc) stopped by --max-steps 7 (4 processes: a copy of fsdp4_to_step_7's)."""
    if nproc == 4:
        shutil.copytree(request.getfixturevalue("fsdp4_to_step_7"), out)
    else:
        run_ranks(data, out, params_for(nproc), nproc, "--max-steps", "7")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_resume_is_exact(data, fsdp_full, tmp_path, nproc, request):
    params = params_for(nproc)
    out = tmp_path / "train"
    to_step_7(data, out, nproc, request)
    assert not (out / "final.pt").exists() and (out / "ckpt" / "latest").read_text().strip() == "step_000007.dcp"
    state = torch.load(out / "ckpt" / "step_000007.dcp" / "train_state.pt", weights_only=True)
    assert "model" not in state and "optimizer" not in state  # the tensors are the ranks' shards
    assert state["world_size"] == nproc and len(state["loader"]) == len(state["rng"]) == nproc
    assert len(list((out / "ckpt" / "step_000007.dcp").glob("__*_*.distcp"))) == nproc  # every rank wrote its part
    run_ranks(data, out, params, nproc, "--resume", "require")
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(fsdp_full[nproc])]
    assert [r.get("val_loss") for r in read_metrics(out)] == [r.get("val_loss") for r in read_metrics(fsdp_full[nproc])]
    a, b = final_model(fsdp_full[nproc]), final_model(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fsdp_kill_9_and_rerun_finishes_like_the_uninterrupted_run(data, fsdp_full, tmp_path):
    """kill -9 of the job's process group while rank 0 writes step 9's checkpoint (steps logged past the
    step-6 checkpoint, a partial temporary checkpoint directory on disk): no process survives, and the
    rerun (train.resume: auto) resumes from step 6 and ends with the uninterrupted run's final.pt and
    metric history, every step once, no temporary left."""
    params, out = params_for(2), tmp_path / "train"
    marker = tmp_path / "hung"
    proc = subprocess.Popen(command(data, out, params, 2, torchrun=True),
                            env=env(TF_HANG_AT_STEP="9", TF_HANG_MARKER=str(marker)),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, "the run ended before its hang"
            assert time.monotonic() < deadline, "timed out waiting for the hang"
            time.sleep(0.1)
    finally:
        kill_group(proc, tmp_path)  # and no process of the run is left
    assert logged_steps(out) == list(range(1, 10)) and not (out / "final.pt").exists()
    assert (out / "ckpt" / "latest").read_text().strip() == "step_000006.dcp"
    assert [p.name for p in (out / "ckpt").glob(".step_000009.dcp.tmp-*")]  # the partial checkpoint

    run_ranks(data, out, params, 2)
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(fsdp_full[2])]
    a, b = final_model(fsdp_full[2]), final_model(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [p for p in out.rglob("*") if ".tmp-" in p.name] == []



@pytest.mark.slow
def test_fsdp_resumes_on_another_world_size_like_the_uninterrupted_run(data, fsdp_full, tmp_path, request):
    """4 processes to step 7's checkpoint, then resumed by 2 (a node lost; the plan re-made for 2: 2
    accumulation micro-steps instead of 1) with train.resume: require. DCP reshards the 4 ranks' model and
    optimizer shards onto 2, the loader continues with the same global rows: steps 1-7 are the 4-process
    run's, steps 8-12 the uninterrupted 2-process run's within fp32 rounding (the tolerances of
    test_fsdp_trains_like_ddp: gradients summed in another order), every step logged once, the planned
    tokens trained."""
    out = tmp_path / "train"
    to_step_7(data, out, 4, request)
    assert len(list((out / "ckpt" / "step_000007.dcp").glob("__*_*.distcp"))) == 4
    run_ranks(data, out, params_for(2), 2, "--resume", "require")
    recs, four, two = read_metrics(out), read_metrics(fsdp_full[4]), read_metrics(fsdp_full[2])
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs[:7]] == [r["loss"] for r in four[:7]]  # kept from the 4-process part
    for key, tol in (("loss", {"rtol": 0, "atol": 2e-5}), ("grad_norm", {"rtol": 1e-4}), ("val_loss", {"rtol": 1e-4}),
                     ("param_norm/embedding", {"rtol": 1e-4})):
        got, want = [r.get(key) for r in recs[7:]], [r.get(key) for r in two[7:]]
        assert [g is None for g in got] == [w is None for w in want], key
        assert np.allclose([g for g in got if g is not None], [w for w in want if w is not None], **tol), key
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_trained"] == summary["tokens_planned"] == STEPS * 256 and summary["world_size"] == 2
    a, b = final_model(fsdp_full[2]), final_model(out)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in a)
    last = out / "ckpt" / f"step_{STEPS:06d}.dcp"
    assert len(list(last.glob("__*_*.distcp"))) == 2
    assert torch.load(last / "train_state.pt", weights_only=True)["world_size"] == 2

# ----------------------------------------------------------------------------- the pieces, one process

@pytest.fixture
def group(tmp_path):
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def _sharded_pair(params: dict):
    from pipeline.distributed import Dist
    from pipeline.training.parallelize import build_model

    dist = Dist(0, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    plain = build_model(params, dist.device)
    torch.manual_seed(0)
    sharded = build_model(params, dist.device, dist)  # sharded on the meta device, then initialised
    return plain, sharded, dist


def _batches(n: int, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 300, (2, TRAIN_SEQ), generator=g), torch.randint(0, 300, (2, TRAIN_SEQ), generator=g),
             torch.rand(2, TRAIN_SEQ, generator=g) < 0.6, None) for _ in range(n)]


@pytest.mark.parametrize("keep", [True, False])
def test_sharded_accumulation_equals_plain_in_both_modes(group, keep):
    """Gradient accumulation over 3 micro-steps, the whole model kept gathered between them (no
    resharding, one reduce-scatter) or resharded every micro-step (gradients accumulated sharded): the
    gradients, clipped norm and one Muon + AdamW step equal the unsharded model's; afterwards every
    parameter is sharded again."""
    from torch.distributed.tensor import DTensor

    from pipeline.training.optim import build_optimizer
    from pipeline.training.parallelize import LossModel, wrap
    from pipeline.training.step import accumulate_gradients, clip_gradients, count_tokens

    params = make_params(optimizer="muon")
    plain, sharded, dist = _sharded_pair(params)
    sharded.keep_unsharded = keep
    batches = _batches(3)
    n = count_tokens(batches, dist)[0]
    norms = []
    for model in (plain, sharded):
        root, fwd = wrap(LossModel(model, None, 40), dist, compile_model=False)
        accumulate_gradients(root, fwd, batches, n, world_size=1)
        norms.append(clip_gradients([p for p in model.parameters()], 0.05))
        opt = build_optimizer(model, params["train"], "cpu")
        opt.step()
    assert float(norms[1]) == pytest.approx(float(norms[0]), rel=1e-6) and float(norms[0]) > 0.05
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    for (name, a), b in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.allclose(a, b.full_tensor(), atol=1e-6), name


def test_gathered_model_evaluates_without_collectives_and_reshards(group):
    from torch.distributed.tensor import DTensor

    from pipeline.training.parallelize import gathered

    plain, sharded, _ = _sharded_pair(make_params())
    x = torch.randint(0, 300, (2, TRAIN_SEQ))
    with torch.no_grad(), gathered(sharded):
        assert not any(isinstance(p, DTensor) for p in sharded.parameters())
        for _ in range(2):  # stays gathered across forwards
            assert torch.allclose(sharded(x), plain(x), atol=1e-5)
        assert not any(isinstance(p, DTensor) for p in sharded.parameters())
    assert all(isinstance(p, DTensor) for p in sharded.parameters())


def test_gathered_bf16_blocks_evaluate_in_the_training_precision(group, data, monkeypatch):
    """The CUDA precision path (bf16-gathered blocks): every evaluation inside training takes them without
    an fp32/bf16 mix — the fixed batch is fp32 compute on the bf16-rounded block weights (the plain model
    with those weights), the sample and the CORE / ChatCORE scorers run the body under bf16 autocast like
    the plain model under the same autocast. Before the fix each of them failed on the bf16 linears."""
    import copy

    from pipeline.data.encoding import load_tokenizer
    from pipeline.evaluation import chat_core
    from pipeline.evaluation import core_benchmark as core
    from pipeline.model.engine import greedy_sample
    from pipeline.training.parallelize import gathered
    from pipeline.training.train import fixed_batch_stats

    monkeypatch.setenv("TOKENFARM_CPU_AS_CUDA_PRECISION", "1")
    plain, sharded, dist = _sharded_pair(make_params(precision="bf16"))
    rounded = copy.deepcopy(plain)
    for p in rounded.layers.parameters():
        p.data = p.data.bfloat16().float()
    tok, cpu, bf16 = load_tokenizer(data["tokenizer"]), torch.device("cpu"), torch.bfloat16
    batch = _batches(1)[0]
    prompts = [[tok.bos_id, *tok.encode(t)] for t in ("The old king", "A small red bird sees", "Every dog")]
    pairs = [(p[:-2], p[-2:]) for p in prompts]

    def under_bf16(fn):
        with torch.autocast("cpu", dtype=bf16):
            return fn()

    sharded.eval()
    with torch.no_grad(), gathered(sharded):
        assert {p.dtype for p in sharded.layers.parameters()} == {bf16}
        assert sharded.lm_head_weight.dtype == torch.float32
        got = fixed_batch_stats(sharded, batch, chunk=40)
        want = fixed_batch_stats(rounded, batch, chunk=40)
        assert got["ce_fp32"] == pytest.approx(want["ce_fp32"], rel=1e-6) and got["top1_acc"] == want["top1_acc"]
        assert fixed_batch_stats(plain, batch, chunk=40)["ce_fp32"] != want["ce_fp32"]  # the rounding shows
        assert greedy_sample(sharded, tok, "The old king", 6, cpu, bf16) == \
            under_bf16(lambda: greedy_sample(plain, tok, "The old king", 6, cpu))
        assert core.body_dtype(sharded, cpu) is bf16 and core.body_dtype(plain, cpu) is None
        got = core.score_requests(sharded, pairs, TRAIN_SEQ, 64, cpu, core.body_dtype(sharded, cpu))
        want = core.score_requests(plain, pairs, TRAIN_SEQ, 64, cpu, bf16)
        assert [s.logprob for s in got] == pytest.approx([s.logprob for s in want], rel=1e-5)
        letters = [[5, 6, 7]] * len(prompts)
        assert chat_core.letter_answers(sharded, prompts, letters, 64, cpu, bf16) == \
            chat_core.letter_answers(plain, prompts, letters, 64, cpu, bf16)
        assert chat_core.greedy_answers(sharded, prompts, 5, [], cpu) == \
            under_bf16(lambda: chat_core.greedy_answers(plain, prompts, 5, [], cpu))

def test_the_planner_counts_what_gathered_holds(group):
    """pipeline.planning's evaluation term (`fsdp_evaluation_gathered_bytes`) is the bytes of the unsharded
    parameters `gathered()` really holds (fp32 here: the CPU gathers in fp32, as the planner's setup says)."""
    from pipeline.planning.memory import StepSetup, fsdp_evaluation_gathered_bytes
    from pipeline.training.parallelize import gathered

    for tied in (True, False):
        params = make_params()
        params["model"] = {**params["model"], "tie_embeddings": tied, "n_layers": 3}  # > the 2 a step holds
        _, sharded, _ = _sharded_pair(params)
        with torch.no_grad(), gathered(sharded):
            held = sum(p.numel() * p.element_size() for p in sharded.parameters())
        assert held == fsdp_evaluation_gathered_bytes(StepSetup.from_config(run_config(params), parallel="fsdp")), tied


def test_the_trainer_refuses_adamw8bit_on_sharded_parameters(group):
    """The backstop behind the config checks: bitsandbytes on DTensor shards would hit an illegal memory
    access on the GPU; build_optimizer refuses before it looks for CUDA or bitsandbytes."""
    from pipeline.errors import PipelineError
    from pipeline.training.optim import build_optimizer

    params = make_params()  # (the config checks refuse adamw8bit on the CPU, and under fsdp)
    _, sharded, _ = _sharded_pair(params)
    with pytest.raises(PipelineError, match=r"^train\.optimizer: adamw8bit cannot step train\.parallel: fsdp's "
                                            r"sharded parameters .*use adamw or muon, or train\.parallel: ddp$"):
        build_optimizer(sharded, {**params["train"], "optimizer": "adamw8bit"}, "cuda")


# Two gloo ranks step the same matrices, sharded and whole (our Muon: on the CPU torch's step with its
# Newton-Schulz iteration in fp32, tests/training/test_optim.py), and write what they find.
MUON_RANKS = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import pipeline.training.optim as O
from pipeline.training.optim import Muon, muon_owners

out = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo")  # RANK, WORLD_SIZE 2: tests/forkrun.py
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
shapes = [(8, 16), (5, 8), (1, 8), (16, 8), (8, 16), (12, 12), (3, 7)]  # uneven and empty shards too
g = torch.Generator().manual_seed(0)
whole = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
start = [p.detach().clone() for p in whole]
sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in whole]
settings = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
plain, ours = Muon(whole, **settings), Muon(sharded, **settings)
seen, ns = [], O.newton_schulz
def counted(x, *a):
    if x.device.type != "meta":
        seen.append(tuple(x.shape))
    return ns(x, *a)
for step in range(3):
    for p, q in zip(whole, sharded):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)])
    plain.step()
    O.newton_schulz = counted
    ours.step()
    O.newton_schulz = ns
equal = [torch.equal(p.detach(), q.detach().full_tensor()) for p, q in zip(whole, sharded)]
mine = sorted(tuple(s) for s, (_, owner) in zip(shapes, muon_owners(shapes, 2)) if owner == rank)
json.dump({"equal": equal, "moved": [not torch.equal(p.detach(), p0) for p, p0 in zip(whole, start)],
           "orthogonalised": sorted(seen), "owned": mine * 3}, open(out.format(rank=rank), "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow  # 2 gloo processes
def test_sharded_muon_gives_each_matrix_one_owner_and_the_whole_matrices_update_bit_for_bit(tmp_path):
    """Three Muon steps on 2 gloo ranks: the sharded matrices end bit for bit where Muon takes the
    whole ones (uneven shards, an empty one, 7 matrices of 4 shapes), and each rank ran Newton-Schulz on
    its own matrices only (`muon_owners`), not on all seven as when every rank orthogonalised everything."""
    script = tmp_path / "muon_ranks.py"
    script.write_text(MUON_RANKS)
    r = subprocess.run([*ranks(2), str(script), str(tmp_path / "{rank}.json")], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for r in found:
        assert r["equal"] == r["moved"] == [True] * 7
        assert [tuple(s) for s in r["orthogonalised"]] == sorted(tuple(s) for s in r["owned"])
    assert sorted(len(r["owned"]) for r in found) == [3 * 3, 3 * 4]  # 7 matrices dealt over 2 ranks, 3 steps


def test_muon_owners_deal_rounds_by_cost():
    from pipeline.training.optim import muon_owners

    shapes = [(4, 4), (64, 8), (8, 64), (2, 2), (16, 16)]  # costs 384, 3072, 3072, 48, 24576
    assert muon_owners(shapes, 2) == [(1, 1), (0, 1), (1, 0), (2, 0), (0, 0)]
    assert muon_owners(shapes, 8) == [(0, 3), (0, 1), (0, 2), (0, 4), (0, 0)]
    assert muon_owners(shapes, 1) == [(3, 0), (1, 0), (2, 0), (4, 0), (0, 0)]


def test_parallelism_as_a_launch_runs_it():
    """auto, should the plan not have resolved it, is ddp on one process or the CPU; without a process group
    (no torchrun) a single process trains plain whatever the setting."""
    from pipeline.distributed import Dist
    from pipeline.training.parallelize import parallelism

    class Grouped(Dist):
        distributed = True

    cpu2, one = Grouped(0, 0, 2, torch.device("cpu")), Grouped(0, 0, 1, torch.device("cpu"))
    for setting, dist, want in [("auto", cpu2, "ddp"), ("auto", one, "ddp"), ("fsdp", cpu2, "fsdp"),
                                ("ddp", cpu2, "ddp"), ("fsdp", Dist(0, 0, 1, torch.device("cpu")), "ddp")]:
        assert parallelism({"train": {"parallel": setting}}, dist) == want, (setting, dist)
