r"""Step benchmark: time steady-state full training steps of a config's model on random tokens.

    python -m pipeline.bench --configfile configs/llama3-1b-fineweb.yaml --micro-batch 16 --device cuda \
        [--compile | --no-compile] [--checkpoint none|mlp|attention|block|every_n] [--fp8 none|tensorwise|rowwise] \
        [--precision bf16|fp32] [--optimizer adamw|adamw8bit|muon] [--ce-matmul auto|bf16|tf32|fp32] [--json]
    python -m pipeline.bench --suite reference [...]      (pipeline/bench/suite.py)
    python -m pipeline.bench --gpu-check [--out DIR]      (make gpu-check: pipeline/bench/gpu_check.py)

`run_bench(cfg, steps, warmup)` times the trainer's own step (pipeline.training.parallelize and
pipeline.training.optim) and reports median step time, tokens/s, MFU and memory; the plan reads back its
``--json``. What a step is and how MFU is computed: docs/bench.md, "The step benchmark".
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.bench.gpu_check import run_gpu_check
from pipeline.bench.suite import format_suite, run_suite, write_suite
from pipeline.config import deep_merge, load_config
from pipeline.distributed import seed_everything
from pipeline.errors import PipelineError
from pipeline.io import get_logger, run_cli
from pipeline.planning.compute import flops_per_token, gpu_type_of, peak_flops
from pipeline.run_config import run_config
from pipeline.training.metrics import memory_stats, mfu
from pipeline.training.optim import build_optimizer
from pipeline.training.parallelize import (
    LossModel,
    autocast_dtype,
    build_model,
    ce_matmul,
    set_matmul_precision,
    use_compile,
)
from pipeline.training.step import clip_gradients, zero_gradients

log = get_logger(__name__)
SUITE_CONFIG = "configs/llama3-1b-fineweb.yaml"


def bench_config(cfg: dict, micro_batch: int | None = None, compile_model: bool | None = None,
                 checkpoint: str | None = None, fp8: str | None = None, precision: str | None = None,
                 device: str | None = None, optimizer: str | None = None, ce_matmul: str | None = None) -> dict:
    """`cfg` with the benchmark's overrides applied (None keeps the config's value)."""
    overrides = {"micro_batch": micro_batch, "compile": compile_model, "activation_checkpointing": checkpoint,
                 "fp8": fp8, "precision": precision, "optimizer": optimizer, "ce_matmul": ce_matmul}
    train = {k: v for k, v in overrides.items() if v is not None}
    hardware = {"device": device} if device is not None else {}
    return deep_merge(cfg, {"train": train, "hardware": hardware})


def device_name(device: torch.device) -> str:
    """"cpu", or the CUDA device's exact name (`torch.cuda.get_device_properties`)."""
    return torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu"


def gpu_type(name: str) -> str:
    """The GPU type (pipeline.planning.compute.GPU_SPECS key) of the device actually used, by its exact name;
    an unknown GPU is refused with the list of known ones (`pipeline.planning.compute.gpu_type_of`)."""
    return gpu_type_of(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(cfg: dict, steps: int = 10, warmup: int = 3, on_step=None) -> dict:
    """Time `steps` training steps after `warmup` untimed ones; returns the result fields.
    `on_step(i, seconds, timed)` is called after every step (for progress lines)."""
    if steps < 1 or warmup < 0:
        raise PipelineError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    c = run_config(cfg)
    train = c.train
    device = torch.device(c.hardware.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError("--device cuda: no CUDA device is visible")
    seed_everything(c.seed)
    body_dtype = autocast_dtype(cfg, device)
    set_matmul_precision(ce_matmul(cfg))
    model = build_model(cfg, device)
    optimizer = build_optimizer(model, train, device.type)
    loss_model = LossModel(model, body_dtype, train.ce_chunk_tokens, ce_matmul(cfg))
    fwd = loss_model.compiled() if use_compile(cfg, device) else loss_model
    params = [p for p in model.parameters() if p.requires_grad]
    B, T, V = train.micro_batch, train.seq_len, c.model.vocab_size
    rows = torch.randint(0, V, (B, T + 1), device=device)
    x, y = rows[:, :-1], rows[:, 1:]

    times = []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        loss_sum, count = fwd(x, y)
        (loss_sum / count).backward()
        clip_gradients(params, train.grad_clip)
        optimizer.step()
        zero_gradients(optimizer)
        _sync(device)
        seconds = time.perf_counter() - start
        if i >= warmup:
            times.append(seconds)
        if on_step:
            on_step(i, seconds, i >= warmup)

    step_time = statistics.median(times)
    tokens_per_s = B * T / step_time
    fpt, name = flops_per_token(c), device_name(device)
    peak = peak_flops(run_config(deep_merge(cfg, {"hardware": {"gpu_type": gpu_type(name)}})))
    return {
        "device": name,
        "n_params": sum(p.numel() for p in model.parameters()),
        "micro_batch": B,
        "seq_len": T,
        "compile": use_compile(cfg, device),
        "precision": "bf16" if body_dtype is not None else "fp32",
        "activation_checkpointing": train.activation_checkpointing,
        "fp8": train.fp8,
        "optimizer": train.optimizer,
        "ce_matmul": ce_matmul(cfg),
        "steps": steps,
        "warmup": warmup,
        "step_time_s": step_time,
        "step_time_mean_s": statistics.fmean(times),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": mfu(fpt, tokens_per_s, 1, peak),
        "loss": float(loss_sum.detach() / count),
        **memory_stats(device),
    }


def format_result(r: dict) -> str:
    lines = [
        f"device {r['device']}: {r['n_params'] / 1e6:.1f}M params, micro-batch [{r['micro_batch']}, {r['seq_len']}], "
        f"compile={r['compile']}, precision={r['precision']}, checkpointing={r['activation_checkpointing']}, "
        f"fp8={r['fp8']}, optimizer={r['optimizer']}",
        f"step time      {r['step_time_s'] * 1e3:.1f} ms "
        f"(median of {r['steps']}, mean {r['step_time_mean_s'] * 1e3:.1f} ms)",
        f"tokens/s       {r['tokens_per_s']:,.0f}",
        f"MFU            {r['mfu'] * 100:.2f}% "
        f"({r['flops_per_token'] / 1e9:.3f} GFLOP/token, peak {r['peak_flops'] / 1e12:.0f} TFLOP/s)",
    ]
    if "mem/allocated_gb" in r:
        lines.append(f"memory         allocated {r['mem/allocated_gb']:.2f} GB, peak {r['mem/peak_gb']:.2f} GB, "
                     f"reserved {r['mem/reserved_gb']:.2f} GB")
    return "\n".join(lines)


def main_suite(args) -> None:
    """`--suite reference` (pipeline.bench.suite) on the visible GPU, or the device given."""
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        raise PipelineError("--suite reference: no CUDA device is visible; pass --device cpu with a small "
                            "--configfile (the CPU path checks the plumbing, not the GPU)")
    configfile = args.configfile or SUITE_CONFIG
    cfg = bench_config(load_config(configfile), compile_model=args.compile, precision=args.precision, device=device,
                       ce_matmul=args.ce_matmul)
    name = device_name(torch.device(device))
    cfg = deep_merge(cfg, {"hardware": {"gpu_type": gpu_type(name)}})  # predict for the GPU actually used

    title = f"Reference suite on {name}: {configfile}, {args.steps} timed steps after {args.warmup} warm-up"
    header = {"device": name, "configfile": str(configfile)}

    def progress(row: dict, rows: list[dict]) -> None:
        if args.out:  # rewritten after every row: a crash or kill keeps the finished rows
            write_suite(args.out, format_suite(rows, title), header, rows)
        if not args.json:
            m = row["measured"]
            print(f"{row['name']}: {row['skipped'] or format(m['step_time_s'], '.3f') + ' s'}", flush=True)

    rows = run_suite(cfg, args.steps, args.warmup, run_bench, on_row=progress)
    text = format_suite(rows, title)
    print(json.dumps({**header, "rows": rows}) if args.json else text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--configfile", help="a full config YAML (model, train, hardware); with --suite the default "
                                         f"is {SUITE_CONFIG}")
    p.add_argument("--micro-batch", type=int, help="rows per step (required without --suite)")
    p.add_argument("--suite", choices=("reference",), help="run the reference's rows (pipeline.bench.suite)")
    p.add_argument("--gpu-check", action="store_true",
                   help="the GPU acceptance check (pipeline.bench.gpu_check; `make gpu-check`): smoke steps vs the "
                        "CPU fp32 reference, the reference suite, measured vs predicted; --out is its directory")
    p.add_argument("--smoke-steps", type=int, default=5, help="--gpu-check: optimizer steps per smoke row")
    p.add_argument("--budget-s", type=float, help="--gpu-check: seconds it may take; rows that would not fit are "
                                                  "left out (default 600 on CUDA, no budget on CPU; 0: no budget)")
    p.add_argument("--out", help="--suite: also write the table here (markdown) and its rows beside it (.json); "
                                 "--gpu-check: the output directory (default results/gpu-check)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the step (default: train.compile of the config)")
    p.add_argument("--checkpoint", choices=("none", "mlp", "attention", "block", "every_n"),
                   help="activation checkpointing mode (default: the config's)")
    p.add_argument("--fp8", choices=("none", "tensorwise", "rowwise"), help="fp8 linears (CUDA; default: the config's)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="body precision (default: the config's)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit", "muon"), help="default: the config's")
    p.add_argument("--ce-matmul", choices=("auto", "bf16", "tf32", "fp32"), help="default: the config's")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: hardware.device of the config")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.gpu_check:
        if args.smoke_steps < 2:
            p.error("--smoke-steps must be >= 2 (the first step is compilation, not timed)")
        run_gpu_check(args.out or "results/gpu-check", run_bench, args.configfile or SUITE_CONFIG, args.device,
                      args.smoke_steps, args.steps, args.warmup, args.budget_s)
        return None
    if args.suite:
        return main_suite(args)
    if args.configfile is None or args.micro_batch is None:
        p.error("--configfile and --micro-batch are required (unless --suite)")
    cfg = bench_config(load_config(args.configfile), args.micro_batch, args.compile, args.checkpoint, args.fp8,
                       args.precision, args.device, args.optimizer, args.ce_matmul)

    def progress_line(i: int, seconds: float, timed: bool) -> None:
        if not args.json:
            print(f"step {i}: {seconds * 1e3:.1f} ms{'' if timed else ' (warm-up)'}", flush=True)

    result = run_bench(cfg, args.steps, args.warmup, on_step=progress_line)
    print(json.dumps(result) if args.json else format_result(result))


if __name__ == "__main__":
    run_cli(main)
