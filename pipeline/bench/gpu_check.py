"""`make gpu-check` (`python -m pipeline.bench --gpu-check`): the acceptance check of a user's first GPU node.

    python -m pipeline.bench --gpu-check [--out results/gpu-check] [--device cuda|cpu] [--smoke-steps 5]
        [--steps 10] [--warmup 3] [--budget-s 600] [--configfile configs/llama3-1b-fineweb.yaml]

`run_gpu_check` runs, within a time budget (`Budget`, rows estimated first by `row_seconds`), in order:
smoke steps of the trainer's own step under each CUDA feature against a CPU fp32 reference (`SMOKE_ROWS`,
the fsdp rows `run_fsdp_row`), the compiled loss's memory (`LOSS_MEMORY_ROWS`), checkpoint save and
resume (pipeline/bench/ckpt.py), the reference suite (pipeline/bench/suite.py), and measured against
predicted. Each part is written to ``--out`` as it finishes; exit 1 when a smoke row is outside its
tolerance.

The rows, the tolerances and the files: docs/bench.md, "`make gpu-check`".
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.bench.ckpt import CKPT_ROWS, ckpt_row_seconds, format_ckpt, row_config, row_params, run_ckpt_rows
from pipeline.bench.suite import (
    REFERENCE_SUITE,
    format_suite,
    predict,
    release_device,
    run_suite,
    skip_reason,
    suite_config,
    write_suite,
)
from pipeline.config import deep_merge, load_config, resolve_config
from pipeline.distributed import one_rank_group, seed_everything
from pipeline.errors import PipelineError
from pipeline.io import atomic_write, get_logger, write_json
from pipeline.planning.compute import gpu_type_of
from pipeline.run_config import run_config
from pipeline.training.metrics import memory_stats
from pipeline.training.optim import build_optimizer
from pipeline.training.parallelize import (
    LossModel,
    autocast_dtype,
    build_model,
    ce_matmul,
    gathered,
    set_matmul_precision,
    shard_model,
    use_compile,
    wrap,
)
from pipeline.training.step import accumulate_gradients, clip_gradients, zero_gradients

log = get_logger(__name__)

SMOKE_MODEL = {"vocab_size": 4096, "dim": 1536, "n_layers": 2, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 4608}
# On a machine without CUDA no fp8 row runs, so the CPU path (CI) uses a smaller model of the same kind.
CPU_SMOKE_MODEL = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192}
CPU_SUITE_MODEL = {"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
SMOKE_BATCH, SMOKE_SEQ, SMOKE_DOCS = 4, 256, 3  # rows, tokens per row, documents per row (masked rows)
TOLERANCE = {"fp32": 1e-3, "bf16": 0.02, "fp8": 0.10}  # max `loss_diff` over the steps

# (name, device, train overrides, document masking, what it checks)
SMOKE_ROWS = [
    ("cpu fp32 chunked CE", "cpu", {"precision": "fp32", "compile": False}, False,
     "the fused chunked fp32 CE and its backward vs full logits"),
    ("cuda fp32 eager", "cuda", {"precision": "fp32", "compile": False}, False, "the CUDA kernels, fp32"),
    ("cuda compile bf16 chunked CE", "cuda", {"precision": "bf16", "compile": True}, False,
     "torch.compile + bf16 autocast body + chunked fp32 CE (bf16 logit matmuls)"),
    ("cuda compile bf16 flex doc-mask", "cuda", {"precision": "bf16", "compile": True}, True,
     "flex_attention document masking (block mask) vs the SDPA boolean mask"),
    ("cuda compile bf16 fp8 tensorwise", "cuda", {"precision": "bf16", "compile": True, "fp8": "tensorwise"}, False,
     "torchao fp8 (tensorwise) on the filtered linears"),
    ("cuda compile bf16 fp8 rowwise", "cuda", {"precision": "bf16", "compile": True, "fp8": "rowwise"}, False,
     "torchao fp8 (rowwise) on the filtered linears"),
    ("cpu fsdp fp32", "cpu", {"precision": "fp32", "compile": False, "parallel": "fsdp"}, False,
     "FSDP2 on a 1-rank gloo group: sharded steps, then a validation and a sample under gathered()"),
    ("cuda fsdp compile bf16", "cuda", {"precision": "bf16", "compile": True, "parallel": "fsdp"}, False,
     "FSDP2 on a 1-rank nccl group: bf16 gathers, per-block compile, a validation and a sample under gathered()"),
]
SAMPLE_TOKENS = 8  # greedy tokens the fsdp rows sample from the gathered model

# The compiled loss's memory (docs/bench.md): the preset's compiled bf16 step with every block checkpointed at
# 16 / 32 / 64 rows, peak allocated after one warm-up step against pipeline.planning (suite rows: name, micro-batch,
# checkpointing, fp8, optimizer).
LOSS_MEMORY_ROWS = [(f"loss memory {mb} block", mb, "block", "none", "adamw") for mb in (16, 32, 64)]
LOSS_MEMORY_STEPS, LOSS_MEMORY_WARMUP = 1, 1
# The time budget (`Budget`): one H100 lent for 15 minutes, of which start-up and transfers take some.
BUDGET_S = 600.0
# Assumed seconds per row beyond its predicted steps, not measured yet (gpu-check.json records each row's real
# seconds beside its estimate, so the next GPU run can correct them): building the model and optimizer and
# releasing them, and torch.compile of a smoke model (2 layers) or of the preset (16 layers, checkpointed).
ROW_SETUP_S = 5.0
COMPILE_S = {"smoke": 40.0, "preset": 75.0}


class Budget:
    """The rows of a gpu-check in order of priority (smoke rows, the fsdp rows, the loss-memory rows, then the
    reference suite), each estimated before it runs (`row_seconds`): a row runs when the time used so far —
    the seconds spent, or the admitted rows' estimates if more — plus its estimate fits `seconds` (None: no
    budget), else it is listed as left out. ``rows`` keeps every row's estimate and, once run, its real seconds."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start, self.rows, self.planned = seconds, time.perf_counter(), [], 0.0

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def admit(self, name: str, estimate_s: float) -> str | None:
        """None when the row may run (its timing starts now), else the reason it is left out."""
        self._close()
        used = max(self.spent(), self.planned)
        fits = self.seconds is None or used + estimate_s <= self.seconds
        self.rows.append({"name": name, "estimate_s": round(estimate_s, 1), "ran": fits, "seconds": None,
                          "_start": time.perf_counter()})
        if fits:
            self.planned += estimate_s
            return None
        return f"left out: {used:.0f} s used + {estimate_s:.0f} s estimated > the {self.seconds:.0f} s budget"

    def _close(self) -> None:
        if self.rows and self.rows[-1]["ran"] and self.rows[-1]["seconds"] is None:
            self.rows[-1]["seconds"] = round(time.perf_counter() - self.rows[-1]["_start"], 1)

    def report(self) -> list[dict]:
        self._close()
        return [{k: v for k, v in r.items() if k != "_start"} for r in self.rows]


def row_seconds(cfg: dict, steps: int, compile_kind: str) -> float:
    """A row's estimated seconds: `ROW_SETUP_S`, `COMPILE_S` when it compiles, and `steps` predicted steps
    (pipeline.planning; on CPU its nominal 1 TFLOP/s)."""
    compiled = use_compile(cfg, torch.device(run_config(cfg).hardware.device))
    return ROW_SETUP_S + (COMPILE_S[compile_kind] if compiled else 0.0) + steps * predict(cfg)["step_time_s"]


def smoke_config(device: str, model: dict | None = None) -> dict:
    """The resolved config every smoke row starts from (one GPU, no accumulation, AdamW at a constant 1e-3)."""
    model = model or (SMOKE_MODEL if device == "cuda" else CPU_SMOKE_MODEL)
    tokens = SMOKE_BATCH * SMOKE_SEQ
    return resolve_config({
        "tokenizer": {"vocab_size": model["vocab_size"]},
        "model": model,
        "train": {"seq_len": SMOKE_SEQ, "micro_batch": SMOKE_BATCH, "global_batch_tokens": tokens,
                  "ce_chunk_tokens": tokens // 4, "lr": 1e-3, "warmup_steps": 0, "grad_clip": 1.0,
                  "optimizer": "adamw", "activation_checkpointing": "none"},
        "hardware": {"device": device, "gpu_type": "H100" if device == "cuda" else "cpu"},
    })


def smoke_batch(cfg: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, doc ids) of the fixed batch: uniform random ids; each row holds SMOKE_DOCS
    documents of random lengths (ids 0, 1, 2 by position)."""
    g = torch.Generator().manual_seed(seed)
    c = run_config(cfg)
    B, T, V = c.train.micro_batch, c.train.seq_len, c.model.vocab_size
    rows = torch.randint(0, V, (B, T + 1), generator=g)
    doc_ids = torch.zeros(B, T, dtype=torch.int64)
    for r in range(B):
        cuts = sorted(torch.randint(1, T, (SMOKE_DOCS - 1,), generator=g).tolist())
        for c in cuts:
            doc_ids[r, c:] += 1
    return rows[:, :-1], rows[:, 1:], doc_ids


def loss_diff(losses: list[float], reference: list[float]) -> float:
    """The largest per-step |loss − reference| / max(1, reference): nats where the reference loss is
    below 1 nat, a fraction of it above (docs/bench.md, "`make gpu-check`")."""
    return max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, reference, strict=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_losses(cfg: dict, steps: int, masked: bool) -> dict:
    """The oracle: `steps` AdamW steps on the CPU in fp32, eager, unchunked CE over model.forward's logits:
    ``{"losses": per step, "val_loss": the trained model's CE on the validation batch (`smoke_batch` seed 1)}``."""
    cfg = deep_merge(cfg, {"hardware": {"device": "cpu"}, "train": {"precision": "fp32", "compile": False,
                                                                     "fp8": "none"}})
    c = run_config(cfg)
    set_matmul_precision("fp32")
    seed_everything(c.seed)
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, c.train, "cpu")
    x, y, doc_ids = smoke_batch(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for _ in range(steps):
        logits = model(x, doc_ids if masked else None)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        clip_gradients(params, c.train.grad_clip)
        optimizer.step()
        zero_gradients(optimizer)
        losses.append(float(loss.detach()))
    vx, vy, _ = smoke_batch(cfg, seed=1)
    with torch.no_grad():
        logits = model(vx)
        val = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), vy.reshape(-1))
    return {"losses": losses, "val_loss": float(val)}


def run_smoke_row(cfg: dict, steps: int, masked: bool) -> dict:
    """`steps` optimizer steps of the trainer's step on the fixed batch on cfg's device: per-step losses,
    the median step time after the first, and on CUDA the peak allocated memory (GB)."""
    c = run_config(cfg)
    device = torch.device(c.hardware.device)
    train = c.train
    set_matmul_precision(ce_matmul(cfg))
    seed_everything(c.seed)
    model = build_model(cfg, device)  # initialised on the CPU from the seed: the reference's weights
    optimizer = build_optimizer(model, train, device.type)
    loss_model = LossModel(model, autocast_dtype(cfg, device), train.ce_chunk_tokens, ce_matmul(cfg))
    fwd = loss_model.compiled() if use_compile(cfg, device) else loss_model
    x, y, doc_ids = (v.to(device) for v in smoke_batch(cfg))

    def loss_and_backward():
        loss_sum, count = fwd(x, y, None, doc_ids if masked else None)
        (loss_sum / count).backward()
        return loss_sum.detach() / count

    return _timed_steps(model, optimizer, train.grad_clip, device, steps, loss_and_backward)


def _timed_steps(model, optimizer, grad_clip: float, device: torch.device, steps: int, loss_and_backward) -> dict:
    """`steps` optimizer steps, each `loss_and_backward()` (the forward and backward; it returns the step's mean
    loss), gradient clipping, the update: the per-step losses, the median step time after the first, and on
    CUDA the peak allocated and reserved memory (GB)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        loss = loss_and_backward()
        clip_gradients(params, grad_clip)
        optimizer.step()
        zero_gradients(optimizer)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    mem = memory_stats(device)
    return {"losses": losses, "step_time_s": statistics.median(times[1:] or times), "peak_gb": mem.get("mem/peak_gb"),
            "reserved_gb": mem.get("mem/reserved_gb")}


def run_fsdp_row(cfg: dict, steps: int, masked: bool) -> dict:
    """`run_smoke_row` under FSDP2 as the trainer shards (`shard_model`: blocks compiled one by one when
    compiling, bf16 gathers in a bf16 run; `accumulate_gradients`), on a 1-rank group; then, as training
    validates, under `gathered` in eval mode: the CE of the validation batch (``val_loss``, compared with
    the reference's) and a greedy sample of `SAMPLE_TOKENS` tokens (``sample``)."""
    c = run_config(cfg)
    device = torch.device(c.hardware.device)
    train = c.train
    set_matmul_precision(ce_matmul(cfg))
    seed_everything(c.seed)
    model = build_model(cfg, device)  # the reference's weights, sharded below
    x, y, doc_ids = (v.to(device) for v in smoke_batch(cfg))
    batch = (x, y, None, doc_ids if masked else None)
    n_targets = torch.tensor(y.numel(), device=device)
    with one_rank_group(device) as dist:
        compiled = use_compile(cfg, device)
        shard_model(model, cfg, dist, compiled)
        optimizer = build_optimizer(model, train, device.type)
        loss_model = LossModel(model, autocast_dtype(cfg, device), train.ce_chunk_tokens, ce_matmul(cfg))
        root, fwd = wrap(loss_model, dist, compiled)
        row = _timed_steps(model, optimizer, train.grad_clip, device, steps,
                           lambda: accumulate_gradients(root, fwd, [batch], n_targets, dist.world_size) / y.numel())
        vx, vy, _ = (v.to(device) for v in smoke_batch(cfg, seed=1))
        model.eval()
        with gathered(model), torch.no_grad():
            val_sum, val_count = loss_model(vx, vy)
            sample = model.generate(x[:1, :SAMPLE_TOKENS], SAMPLE_TOKENS, temperature=0.0)[0, SAMPLE_TOKENS:]
        model.train()
    return {**row, "val_loss": float(val_sum / val_count), "sample": sample.tolist()}


def _skip_reason(device: str, overrides: dict, cuda: bool) -> str | None:
    if device == "cuda" and not cuda:
        return "needs CUDA: no CUDA device is visible"
    if overrides.get("fp8", "none") != "none":
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            return "needs torchao (pip install torchao) for fp8"
    return None


def _smoke_row_config(cuda: bool, device: str, overrides: dict, gpu: str) -> dict:
    cfg = deep_merge(smoke_config("cuda" if cuda else "cpu"), {"hardware": {"device": device}, "train": overrides})
    return deep_merge(cfg, {"hardware": {"gpu_type": gpu if device == "cuda" else "cpu"}})  # predict for it


def run_smoke(steps: int, cuda: bool, on_row=None, gpu: str = "H100", budget: Budget | None = None) -> list[dict]:
    """Every SMOKE_ROWS row: {name, checks, device, precision, tolerance, losses, reference, max_abs_diff,
    loss_diff, passed, step_time_s, peak_gb, predicted, skipped} (fsdp rows: also val_loss,
    reference_val_loss, sample). A row's exception is recorded (skipped), never raised; a row the
    `budget` has no time for is left out (skipped, with the reason)."""
    budget = budget or Budget(None)
    references: dict[tuple[str, bool], list[float]] = {}
    rows = []
    for name, device, overrides, masked, checks in SMOKE_ROWS:
        cfg = _smoke_row_config(cuda, device, overrides, gpu)
        kind = "fp8" if overrides.get("fp8", "none") != "none" else overrides["precision"]
        row = {"name": name, "checks": checks, "device": device, "precision": kind, "doc_mask": masked,
               "tolerance": TOLERANCE[kind], "model": run_config(cfg).model.to_dict(), "losses": None,
               "reference": None, "max_abs_diff": None, "loss_diff": None, "passed": None, "step_time_s": None,
               "peak_gb": None, "predicted": predict(cfg), "skipped": _skip_reason(device, overrides, cuda)}
        if row["skipped"] is None:
            row["skipped"] = budget.admit(name, row_seconds(cfg, steps, "smoke"))
        if row["skipped"] is None:
            try:
                key = (str(row["model"]), masked)
                if key not in references:
                    references[key] = reference_losses(cfg, steps, masked)
                row["reference"] = references[key]["losses"]
                fsdp = overrides.get("parallel") == "fsdp"
                row.update((run_fsdp_row if fsdp else run_smoke_row)(cfg, steps, masked))
                row["max_abs_diff"] = max(abs(a - b) for a, b in zip(row["losses"], row["reference"]))
                row["loss_diff"] = loss_diff(row["losses"], row["reference"])
                row["passed"] = row["loss_diff"] <= row["tolerance"]
                if fsdp:  # the validation after training is held to the same tolerance; the sample must exist
                    row["reference_val_loss"] = references[key]["val_loss"]
                    val_diff = loss_diff([row["val_loss"]], [row["reference_val_loss"]])
                    row["passed"] = row["passed"] and val_diff <= row["tolerance"] and \
                        len(row["sample"]) == SAMPLE_TOKENS
            except Exception as e:  # one row's failure is that row's result
                row["skipped"] = skip_reason(e)
                log.warning("smoke row %r: %s", name, row["skipped"])
                del e
            finally:
                release_device(device)
        rows.append(row)
        if on_row:
            on_row(row, rows)
    return rows


def _ratio(measured, predicted) -> str:
    return "—" if measured is None or not predicted else f"{measured / predicted:.2f}"


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def format_check(smoke: list[dict], suite: list[dict], title: str) -> str:
    """Markdown: the smoke rows' loss check, then measured vs predicted step time and peak memory of
    every row with the ratio measured / predicted."""
    lines = [f"# {title}", "", "## Smoke steps vs the CPU fp32 reference", "",
             "| row | checks | result | loss diff (tolerance) | max abs loss diff | first / last loss (reference) |",
             "|---|---|---|---|---|---|"]
    for r in smoke:
        if r["skipped"]:
            result, diff, loss = f"skipped: {r['skipped']}", "— | —", "—"
        else:
            result = "pass" if r["passed"] else "FAIL"
            diff = f"{r['loss_diff']:.2e} ({r['tolerance']:g}) | {r['max_abs_diff']:.2e}"
            loss = (f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f} "
                    f"({r['reference'][0]:.4f} / {r['reference'][-1]:.4f})")
        lines.append(f"| {r['name']} | {r['checks']} | {result} | {diff} | {loss} |")
    lines += ["", "## Measured vs predicted (pipeline.planning)", "",
              "| row | step s (meas. / pred. / ratio) | peak allocated GB (meas. / pred. / ratio) |", "|---|---|---|"]
    for r in [*smoke, *({**s, "step_time_s": (s["measured"] or {}).get("step_time_s"),
                         "peak_gb": (s["measured"] or {}).get("peak_gb"), "name": f"suite: {s['name']}"}
                        for s in suite)]:
        p = r["predicted"]
        if r["skipped"]:
            lines.append(f"| {r['name']} | {r['skipped']}; pred. {p['step_time_s']:.3g} | — / {p['peak_gb']:.3g} / — |")
            continue
        lines.append(f"| {r['name']} | {_num(r['step_time_s'], '.3g')} / {p['step_time_s']:.3g} / "
                     f"{_ratio(r['step_time_s'], p['step_time_s'])} | {_num(r['peak_gb'], '.3g')} / "
                     f"{p['peak_gb']:.3g} / {_ratio(r['peak_gb'], p['peak_gb'])} |")
    lines += ["", "Predicted: pipeline.planning (a model, not a measurement). Measured: this run. On CPU the "
              "predictions use a nominal 1 TFLOP/s and no memory is measured: the table checks the plumbing."]
    return "\n".join(lines) + "\n"


def format_loss_memory(rows: list[dict]) -> str:
    """Markdown: the loss-memory rows' peak allocated GB, measured / predicted / ratio."""
    lines = ["## The compiled loss's memory (issue 28): peak allocated vs pipeline.planning", "",
             "| row | peak allocated GB (meas. / pred. / ratio) |", "|---|---|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        if m is None:
            lines.append(f"| {r['name']} | {r['skipped']}; pred. {p['peak_gb']:.1f} |")
        else:
            lines.append(f"| {r['name']} | {_num(m['peak_gb'], '.1f')} / {p['peak_gb']:.1f} / "
                         f"{_ratio(m['peak_gb'], p['peak_gb'])} |")
    return "\n".join(lines) + "\n"


def format_budget(budget: dict) -> str:
    """Markdown: the time budget, and every row's estimated and real seconds."""
    limit = "none" if budget["seconds"] is None else f"{budget['seconds']:.0f} s"
    lines = ["## Time (`Budget`)", "", f"Budget {limit}; every row estimated {budget['estimate_all_s']:.0f} s; "
             f"this run took {budget['spent_s']:.0f} s.", "", "| row | estimated s | real s |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['estimate_s']:.0f} | {'left out' if not r['ran'] else _num(r['seconds'], '.0f')} |"
              for r in budget["rows"]]
    return "\n".join(lines) + "\n"


def run_gpu_check(out: str | Path, bench, configfile: str, device: str | None = None, steps: int = 5,
                  suite_steps: int = 10, suite_warmup: int = 3, budget_s: float | None = None) -> dict:
    """The parts (docs/bench.md), the suite's and the loss-memory rows timed by ``bench(cfg, steps, warmup)``
    (`pipeline.bench.throughput.run_bench`) on `configfile` (CUDA only), within `budget_s` seconds (None: `BUDGET_S`
    on CUDA, no budget on CPU; ≤ 0: no budget); returns {device, smoke, loss_memory, suite, budget, passed}."""
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise PipelineError("--device cuda: no CUDA device is visible")
    if budget_s is None:
        budget_s = BUDGET_S if cuda else 0
    budget = Budget(budget_s if budget_s > 0 else None)
    out = Path(out)
    name = torch.cuda.get_device_properties(0).name if cuda else "cpu"
    gpu = gpu_type_of(name)  # an unknown GPU is refused here, before any work
    header = {"device": name, "gpu_type": gpu}
    if cuda:
        suite_cfg = deep_merge(load_config(configfile), {"hardware": {"device": "cuda", "gpu_type": gpu}})
        title = f"Reference suite on {name}: {configfile}"
    else:  # the plumbing on a tiny model
        suite_cfg = resolve_config({"tokenizer": {"vocab_size": CPU_SUITE_MODEL["vocab_size"]},
                                    "model": CPU_SUITE_MODEL,
                                    "train": {"seq_len": 32, "micro_batch": 4, "global_batch_tokens": 128,
                                              "precision": "fp32", "compile": False, "ce_chunk_tokens": 50},
                                    "hardware": {"device": "cpu", "gpu_type": "cpu"}})
        suite_steps, suite_warmup = 1, 0
        title = "Reference suite on cpu: a tiny model (the plumbing, not the GPU)"
    estimates = [row_seconds(_smoke_row_config(cuda, device_, overrides, gpu if cuda else "H100"), steps, "smoke")
                 for _, device_, overrides, *_ in SMOKE_ROWS if cuda or device_ == "cpu"]
    estimates += [row_seconds(suite_config(suite_cfg, *r[1:]), LOSS_MEMORY_STEPS + LOSS_MEMORY_WARMUP, "preset")
                  for r in LOSS_MEMORY_ROWS if cuda]
    estimates += [ckpt_row_seconds(row_params(cfg), run_config(cfg).hardware.storage_gb_per_s)
                  for cfg in (row_config(preset) for _, preset, _ in CKPT_ROWS) if cuda]
    estimates += [row_seconds(suite_config(suite_cfg, *r[1:]), suite_steps + suite_warmup, "preset")
                  for r in REFERENCE_SUITE]
    estimate_all = sum(estimates)
    limit = "no budget" if budget.seconds is None else f"budget {budget.seconds:.0f} s"
    print(f"gpu-check: every row estimated at {estimate_all:.0f} s ({limit}; rows over it are left out)", flush=True)

    def smoke_progress(row: dict, rows: list[dict]) -> None:
        write_json(out / "smoke.json", {**header, "rows": rows})
        print(f"smoke {row['name']}: {row['skipped'] or ('pass' if row['passed'] else 'FAIL')}", flush=True)

    smoke = run_smoke(steps, cuda, on_row=smoke_progress, gpu=gpu if cuda else "H100", budget=budget)

    def admit(compile_kind: str, n_steps: int):
        def skip(row_name: str, row_cfg: dict) -> str | None:
            if not cuda and compile_kind == "preset" and row_name.startswith("loss memory"):
                return "needs CUDA: the preset's compiled step on a GPU"
            return budget.admit(row_name, row_seconds(row_cfg, n_steps, compile_kind))
        return skip

    def row_progress(kind: str):
        def progress(row: dict, rows: list[dict]) -> None:
            m = row["measured"]
            print(f"{kind} {row['name']}: {row['skipped'] or format(m['step_time_s'], '.3f') + ' s'}", flush=True)
        return progress

    loss_memory = run_suite(suite_cfg, LOSS_MEMORY_STEPS, LOSS_MEMORY_WARMUP, bench, on_row=row_progress("loss"),
                            suite=LOSS_MEMORY_ROWS, skip=admit("preset", LOSS_MEMORY_STEPS + LOSS_MEMORY_WARMUP))

    def ckpt_progress(row: dict, rows: list[dict]) -> None:
        m = row["measured"]
        print(f"ckpt {row['name']}: " + (row["skipped"] or
              f"{m['checkpoint_gb']:.1f} GB, save blocks {m['blocked_s']:.2f} s (first {m['first_blocked_s']:.2f} s), "
              f"background write {m['write_s']:.1f} s, resume verify {m['verify_s']:.1f} s + load {m['load_s']:.1f} s; "
              "the job's (meas. / pred.): " + ", ".join(f"{k.removesuffix('_s')} {m['job'][k]:.3g} / "
                                                        f"{m['predicted'][k]:.3g} s" for k in m["job"])), flush=True)

    ckpt_rows = run_ckpt_rows(cuda, out, admit=budget.admit, on_row=ckpt_progress)
    suite_header = {**header, "configfile": configfile if cuda else None}

    def suite_progress(row: dict, rows: list[dict]) -> None:
        write_suite(out / "reference.md", format_suite(rows, title), suite_header, rows)
        row_progress("suite")(row, rows)

    suite = run_suite(suite_cfg, suite_steps, suite_warmup, bench, on_row=suite_progress,
                      skip=admit("preset", suite_steps + suite_warmup))
    passed = all(r["passed"] is not False for r in smoke)
    timing = {"seconds": budget.seconds, "estimate_all_s": round(estimate_all, 1), "spent_s": round(budget.spent(), 1),
              "rows": budget.report()}
    result = {**header, "passed": passed, "smoke": smoke, "loss_memory": loss_memory, "ckpt": ckpt_rows,
              "suite": suite, "budget": timing}
    text = (format_check(smoke, suite, f"make gpu-check on {name} ({gpu})") + "\n" + format_loss_memory(loss_memory)
            + "\n" + format_ckpt(ckpt_rows) + "\n" + format_budget(timing))
    with atomic_write(out / "gpu-check.md", encoding="utf-8") as f:
        f.write(text)
    write_json(out / "gpu-check.json", result)
    print(text)
    if not passed:
        failed = ", ".join(r["name"] for r in smoke if r["passed"] is False)
        raise PipelineError(f"gpu-check: smoke row(s) outside their loss tolerance: {failed} "
                            f"(see {out / 'gpu-check.md'})")
    return result
