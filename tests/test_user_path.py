"""What a user types, run as typed, in a fresh copy of the project: every command of README's code blocks
and every Makefile target, in README order, on the default config (`user_run`); then Snakemake's own
subcommands on the default config, after that real run, through the Snakemake server as tests/test_subcommands.py
runs the presets' (README's commands, `snakemake -n` and `--unlock` among them, run the installed script).

A command that needs a GPU node, a cluster or this test suite itself runs in its dry-run form, listed
below with the reason; any README command or Makefile target missing from these tables fails the suite.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from builders import (
    ROOT,
    SUBCOMMANDS,
    fresh_copy,
    kill_group,
    logged_steps,
    past_checkpoint,
    run_subcommand,
    user_env,
    wait_for,
)

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Step:
    """How the test runs one README command: as typed (`run` None), or as `run` instead, for `reason`."""

    run: str | None = None
    reason: str = ""
    stdin: str | None = None


PRESET = "configs/llama3-1b-fineweb.yaml"
RETRAINS = ("retrains the default model's stages (minutes each on CPU): its dry run here; test_workflow runs "
            "the same kind of rerun for real on the tiny config")
COMPARE = "python -m pipeline.evaluation.compare results/tiny/eval/pretrain results/tiny/eval/sft"
# README's commands in README order. Keys are the commands exactly as README writes them (continuations
# joined, comments dropped).
README = {
    "make run": Step(reason="run as typed, killed with SIGKILL during training, then README's recovery "
                            "commands (see test_readme_commands_in_order)"),
    "make test": Step("make test PYTEST_ARGS='--collect-only -q'", "this test suite itself: collected, not rerun"),
    "python -m pipeline.evaluation.chat --ckpt results/tiny/train/sft/final.pt": Step(stdin="Hi!\nHow are you?\n"),
    'python -m pipeline.evaluation.chat --ckpt results/tiny/train/sft/final.pt --prompt "Hi!"': Step(),
    COMPARE: Step(),
    "python -c \"import polars as pl; print(pl.read_ndjson('results/tiny/eval/sft/core_items.jsonl', "
    "infer_schema_length=None).group_by('task').agg(pl.col('correct').mean(), pl.len()))\"": Step(),
    f"snakemake --cores all --configfile {PRESET}": Step(
        f"snakemake -n --configfile {PRESET}", "8×H100 and 1,823 downloaded shards: its dry run"),
    "snakemake --cores all -R dedup": Step("snakemake --cores all -R dedup -n", RETRAINS),
    "snakemake --cores all --until count": Step(),
    "snakemake -n": Step(),
    "python -m pipeline.codehash --why dedup": Step(),
    f"python -m pipeline.plan --configfile {PRESET}": Step(),
    f"python -m pipeline.plan --configfile {PRESET} --json": Step(),
    f"snakemake -n --configfile {PRESET}": Step(),
    "snakemake --cores all plan": Step(),
    "make dryrun": Step(),
    "python -m pipeline.plan --configfile configs/llama3-8b-fineweb.yaml": Step(),
    "snakemake --cores all --config seed=7 train='{target_tokens: 300000, lr: 1e-2, betas: [0.9, 0.99]}'": Step(
        "snakemake --cores all -n --config seed=7 train='{target_tokens: 300000, lr: 1e-2, betas: [0.9, 0.99]}'",
        RETRAINS),
    "snakemake --cores all --config mixes='{midtrain: {weights: {web: 0.25, chat: 0.75}}}'": Step(
        "snakemake --cores all -n --config mixes='{midtrain: {weights: {web: 0.25, chat: 0.75}}}'", RETRAINS),
    "snakemake --cores all scaling": Step(
        "snakemake --cores all scaling -n", "12 trainings of the IsoFLOP sweep (minutes on 2 cores): its dry run; "
        "tests/test_scaling_workflow.py runs a sweep on the tiny config for real"),
    "python -m pipeline.evaluation.export --ckpt results/tiny/train/sft/final.pt "
    "--tokenizer results/tiny/tokenizer/encoding.json --out my-model": Step(),
    "python -m pipeline.evaluation.export --from-hf my-model --out imported.pt": Step(),
    "python -c \"from transformers import AutoTokenizer, LlamaForCausalLM as L; "
    "t = AutoTokenizer.from_pretrained('my-model'); m = L.from_pretrained('my-model'); "
    "print(t.decode(m.generate(**t('The history of', return_tensors='pt'), max_new_tokens=20)[0]))\"": Step(),
    "python -c \"from pipeline.evaluation.lmeval_harness import LocalTask, write_tasks; "
    "write_tasks('my_tasks', [LocalTask('my_task', 'multiple_choice', "
    "[{'context': 'The cat sat on the', 'choices': ['mat', 'sky'], 'gold': 0}])])\"": Step(),
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf --model_args pretrained=my-model,dtype=float32 "
    "--include_path my_tasks/ --tasks my_task --device cpu --batch_size 8 --log_samples --output_path lmeval-out":
        Step(),
    "snakemake --unlock": Step(),
    "snakemake --cores all --rerun-incomplete": Step(),
    "snakemake --cores all --config train='{resume: never}'": Step(
        "snakemake --cores all -n --config train='{resume: never}'", RETRAINS),
    f"python -m pipeline.plan --configfile {PRESET} --data-cpus 512": Step(),
    "snakemake --workflow-profile workflow/profiles/slurm --configfile configs/llama3-1b-fineweb.yaml "
    "--config hardware='{cpus_per_task: 32}'": Step(
        "snakemake --workflow-profile workflow/profiles/slurm --configfile configs/llama3-1b-fineweb.yaml "
        "--config hardware='{cpus_per_task: 32}' -n", "a SLURM cluster with 8-GPU nodes: its dry run"),
    "snakemake --workflow-profile workflow/profiles/slurm "
    "--configfile configs/llama3-1b-fineweb.yaml configs/overlays/llama3-1b-4nodes.yaml": Step(
        "snakemake --workflow-profile workflow/profiles/slurm "
        "--configfile configs/llama3-1b-fineweb.yaml configs/overlays/llama3-1b-4nodes.yaml -n",
        "4 SLURM nodes of 8 GPUs: its dry run"),
    "snakemake --workflow-profile workflow/profiles/slurm "
    "--configfile configs/llama3-8b-fineweb.yaml configs/overlays/llama3-8b-4nodes.yaml": Step(
        "snakemake --workflow-profile workflow/profiles/slurm "
        "--configfile configs/llama3-8b-fineweb.yaml configs/overlays/llama3-8b-4nodes.yaml -n",
        "4 SLURM nodes of 8 GPUs: its dry run"),
    "snakemake -n --configfile configs/llama3-8b-fineweb.yaml --config hardware='{max_job_hours: 24}'": Step(),
    "snakemake --workflow-profile workflow/profiles/slurm --configfile configs/llama3-8b-fineweb.yaml "
    "--config hardware='{max_job_hours: 24, cpus_per_task: 32}'": Step(
        "snakemake --workflow-profile workflow/profiles/slurm --configfile configs/llama3-8b-fineweb.yaml "
        "--config hardware='{max_job_hours: 24, cpus_per_task: 32}' -n",
        "a SLURM cluster with 8-GPU nodes and a 24-hour limit: its dry run (tests/slurm rehearses a long run)"),
}
# Every Makefile target: None where README's sequence runs it already, else how it runs, after README's.
MAKE_TARGETS = {
    "run": None, "test": None, "dryrun": None,
    "install": Step(),
    "plan": Step(),
    "report": Step(),
    "lint": Step(),
    "gpu-check": Step(),  # on CPU: the CUDA rows skipped with their reason
    "test-fast": Step("make -n test-fast", "a subset of make test, which runs the whole suite (CI too)"),
    "test-slurm": Step("make -n test-slurm", "installs and starts SLURM daemons as root (CI runs it: .ci/run)"),
    "clean": Step(),  # last: it removes the run
}
RECOVERY = ["snakemake --unlock", "snakemake --cores all --rerun-incomplete"]


def readme_commands(text: str) -> list[str]:
    """The commands of README's ```bash blocks: continuation lines joined, comments and blank lines dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+", " ", strip_comment(line)).strip()
            if line:
                out.append(line)
    return out


def strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def make_targets(text: str) -> list[str]:
    return re.findall(r"(?m)^([a-z][\w-]*):", text)


def test_every_readme_command_and_make_target_is_in_the_tables():
    assert readme_commands((ROOT / "README.md").read_text()) == list(README), "README changed: update README here"
    assert sorted(make_targets((ROOT / "Makefile").read_text())) == sorted(MAKE_TARGETS)
    assert all(c in README for c in RECOVERY)


SECONDS: dict[str, float] = {}  # each command's wall time in README's sequence: written beside ran.json


def sh(path: Path, command: str, stdin: str | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", command], cwd=path, env=user_env(), input=stdin, capture_output=True,
                          text=True, timeout=timeout)
    SECONDS[command] = SECONDS.get(command, 0) + time.monotonic() - t0
    assert proc.returncode == 0, f"`{command}` ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def kill_during_training(path: Path, command: str) -> None:
    """Start `command` as from a terminal, SIGKILL its process group once pretraining has logged a step
    past a checkpoint (a step the resume redoes), and check that no process of it is left."""
    train = path / "results/tiny/train/pretrain"
    log = open(path / "killed-run.log", "w")
    t0 = time.monotonic()
    run = subprocess.Popen(["bash", "-c", command], cwd=path, env=user_env(), stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    wait_for(lambda: past_checkpoint(train), run, "pretraining logged a step after a checkpoint", timeout=2400)
    kill_group(run, path)
    SECONDS[f"{command} (until killed)"] = time.monotonic() - t0
    assert not (train / "final.pt").exists()


FAILED: list[str] = []  # a failed user_run is reported once, not rerun for every test that uses it


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> Path:
    """README's commands and the Makefile's targets, in order, in one fresh copy; the copy, finished."""
    if FAILED:
        pytest.fail(f"README's sequence failed earlier: {FAILED[0]}")
    try:
        return readme_sequence(fresh_copy(tmp_path_factory.mktemp("user")))
    except BaseException as e:
        FAILED.append(str(e)[:2000])
        raise


def readme_sequence(path: Path) -> Path:
    ran: dict[str, subprocess.CompletedProcess] = {}
    for command, step in README.items():
        if command == "make run":
            kill_during_training(path, command)
            for c in RECOVERY:  # README "When a run is interrupted", as written
                ran[c] = sh(path, c)
            steps = logged_steps(path / "results/tiny/train/pretrain")
            assert steps == sorted(set(steps)) and steps, "every step logged exactly once"
        run = step.run or command
        # a dry run README repeats (a preset's run replaced by its dry run, then that dry run as typed): once
        same = next((p for c, p in ran.items() if (README[c].run or c) == run), None) if " -n" in run else None
        ran[command] = same or sh(path, run, step.stdin)
    for target, step in MAKE_TARGETS.items():
        if step is not None and target != "clean":
            ran[f"make {target}"] = sh(path, step.run or f"make {target}")
    path.joinpath("seconds.json").write_text(json.dumps(SECONDS, indent=1))
    path.joinpath("ran.json").write_text(json.dumps({c: p.stdout[-2000:] + p.stderr[-2000:] for c, p in ran.items()}))
    return path


def test_readme_commands_in_order(user_run):
    ran = json.loads((user_run / "ran.json").read_text())
    R = user_run / "results/tiny"
    assert all((R / f"eval/{s}/report.json").exists() for s in ("pretrain", "midtrain", "sft"))
    assert "Nothing to be done" in ran["snakemake -n"]
    assert json.loads((R / "plan.json").read_text())["num_steps"] > 0
    assert "you> " in ran["python -m pipeline.evaluation.chat --ckpt results/tiny/train/sft/final.pt"]
    assert "95 % interval" in ran[COMPARE]
    assert (user_run / "my-model/model.safetensors").exists() and (user_run / "imported.pt").exists()
    assert list((user_run / "lmeval-out").rglob("*.json"))
    assert "1,823" in ran[f"python -m pipeline.plan --configfile {PRESET}"]


def test_make_report_has_the_loss_and_core_plots(user_run):
    html = (user_run / "results/report.html").read_text(errors="replace")
    assert "loss.png" in html and "core.png" in html and "stages.png" in html


# ----------------------------------------------------------------------------- Snakemake's subcommands

# after a real run only (they read what it wrote); the presets' subcommands are tests/test_subcommands.py's
AFTER_A_RUN = {
    "--report results/report-2.html": r"Report created",
    "--cleanup-metadata results/tiny/plan.md": r"",
}


@pytest.mark.parametrize("sub", [*SUBCOMMANDS, *AFTER_A_RUN])
def test_snakemake_subcommands_after_the_run(user_run, snakemake_cli, sub):
    run_subcommand(user_run, sub, "", {**SUBCOMMANDS, **AFTER_A_RUN}[sub], snakemake_cli)


def test_make_clean_last(user_run):
    sh(user_run, "make clean")
    assert not (user_run / "results").exists() and not (user_run / ".snakemake").exists()
