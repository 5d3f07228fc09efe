"""What a checkpoint save costs the training step, synchronous vs asynchronous (`train.async_ckpt`; issue 36):
the trainer's step on CPU with `pipeline.training.checkpoint.Checkpointer` saves, one process.

    OMP_NUM_THREADS=2 python benchmarks/ckpt_async.py [--configfile config.yaml] [--dim 512] [--layers 8] \\
        [--ffn-dim 1536] [--vocab 32768] [--micro-batch 2] [--seq-len 128] [--rounds 3] [--between 4] \\
        [--dir /tmp/ckpt-bench] [--json OUT]

The model is `--configfile`'s with the shape flags (default ≈ 59M parameters, untied, AdamW: a ≈ 0.7 GB
checkpoint, so that a save is measurable next to a CPU step). After two warm-up steps:

* **no save**: `--between` × `--rounds` steps; the median step time;
* **sync** (``async_ckpt: false``): `--rounds` rounds of one step followed by a save, then `--between` steps;
  the save's blocking seconds (the whole write: staging is the write);
* **async** (the default): the same rounds with an asynchronous save: its blocking seconds (staging copies;
  the previous save is complete by then), the steps while the background thread writes (their median, the
  contention of the write with the step on shared cores), and the seconds the write took in the background
  (`Checkpointer.wait` at the round's end adds what is left).

Printed as a table and one JSON object (``--json`` writes it too). The checkpoints go to ``--dir`` (a temporary
directory under /tmp by default, removed at the end).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipeline.config import deep_merge, load_config
from pipeline.distributed import Dist, seed_everything
from pipeline.training.checkpoint import Checkpointer, TrainState
from pipeline.training.optim import build_optimizer
from pipeline.training.parallelize import LossModel, build_model
from pipeline.training.step import clip_gradients, zero_gradients


class _Loader:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 0}


def bench_config(args) -> dict:
    cfg = load_config(args.configfile)
    model = {"dim": args.dim, "n_layers": args.layers, "ffn_dim": args.ffn_dim, "vocab_size": args.vocab,
             "n_heads": max(1, args.dim // 64), "n_kv_heads": max(1, args.dim // 128), "tie_embeddings": False}
    return deep_merge(cfg, {"model": model, "tokenizer": {"vocab_size": args.vocab},
                            "train": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "precision": "fp32",
                                      "compile": False, "optimizer": "adamw", "activation_checkpointing": "none",
                                      "ce_chunk_tokens": args.micro_batch * args.seq_len},
                            "hardware": {"device": "cpu", "gpu_type": "cpu"}})


def run(args) -> dict:
    cfg = bench_config(args)
    train = cfg["train"]
    seed_everything(cfg["seed"])
    device = torch.device("cpu")
    model = build_model(cfg, device)
    optimizer = build_optimizer(model, train, "cpu")
    loss_model = LossModel(model, None, train["ce_chunk_tokens"], "fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    rows = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1))
    x, y = rows[:, :-1], rows[:, 1:]
    state = TrainState()

    def step() -> float:
        start = time.perf_counter()
        loss_sum, count = loss_model(x, y)
        (loss_sum / count).backward()
        clip_gradients(params, train["grad_clip"])
        optimizer.step()
        zero_gradients(optimizer)
        state.step += 1
        return time.perf_counter() - start

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    dist = Dist(0, 0, 1, device)
    try:
        for _ in range(2):
            step()
        plain = [step() for _ in range(args.rounds * args.between)]
        out = {"n_params": sum(p.numel() for p in params), "dir": str(root),
               "torch_threads": torch.get_num_threads(), "step_s": statistics.median(plain)}
        for mode in ("sync", "async"):
            saver = Checkpointer(root / mode, dist, keep=1, async_save=mode == "async")
            blocked, save_steps, during, background = [], [], [], []
            for _ in range(args.rounds):
                t = step()
                saver.save(model=model, optimizer=optimizer, loader=_Loader(), params=cfg, plan={}, state=state)
                blocked.append(saver.blocked_s)
                save_steps.append(t + saver.blocked_s)
                start = time.perf_counter()
                while saver.in_flight is not None and not saver._pending.future.done():
                    during.append(step())
                background.append(time.perf_counter() - start)
                saver.wait()
                for _ in range(max(0, args.between - 1)):
                    step()
            saver.close()
            size = sum(f.stat().st_size for f in (root / mode).iterdir() if f.name.startswith("step_"))
            out[mode] = {"blocked_s": statistics.median(blocked), "step_with_save_s": statistics.median(save_steps),
                         "checkpoint_gb": size / 1e9}
            if mode == "async":
                out[mode].update({"background_write_s": statistics.median(background),
                                  "steps_during_write": len(during),
                                  "step_during_write_s": statistics.median(during) if during else None})
        return out
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def format_result(r: dict) -> str:
    s, a = r["sync"], r["async"]
    during = "—" if a["step_during_write_s"] is None else f"{a['step_during_write_s']:.3f}"
    return "\n".join([
        f"{r['n_params'] / 1e6:.1f}M params, checkpoint {s['checkpoint_gb']:.2f} GB, {r['torch_threads']} threads",
        "| | step s | save blocks s | step with save s | step while writing s (n) | background write s |",
        "|---|---|---|---|---|---|",
        f"| no save | {r['step_s']:.3f} | — | — | — | — |",
        f"| sync | {r['step_s']:.3f} | {s['blocked_s']:.3f} | {s['step_with_save_s']:.3f} | — | — |",
        f"| async | {r['step_s']:.3f} | {a['blocked_s']:.3f} | {a['step_with_save_s']:.3f} | {during} "
        f"({a['steps_during_write']}) | {a['background_write_s']:.2f} |",
    ])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", default="config.yaml")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn-dim", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="saves per mode")
    ap.add_argument("--between", type=int, default=4, help="steps per round (the save's step included)")
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary directory, removed)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    result = run(args)
    print(format_result(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
