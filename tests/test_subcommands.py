"""Snakemake's standard subcommands on every preset and overlay, as a user types them in a fresh copy (the
default config's, after its real run, are tests/test_user_path.py's). Nothing here downloads or trains: the
presets' DAGs are planned from their sources' shard lists."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from builders import SUBCOMMANDS, fresh_copy, run_subcommand, user_env

pytestmark = pytest.mark.slow

PRESET = "--configfile configs/llama3-1b-fineweb.yaml"
CONFIGS = {
    "llama3-1b": PRESET,
    "gpt-500m": "--configfile configs/gpt-500m-fineweb.yaml",
    "llama3-1b+4nodes": f"{PRESET} configs/overlays/llama3-1b-4nodes.yaml",
    "llama3-8b": "--configfile configs/llama3-8b-fineweb.yaml",
    "llama3-8b+4nodes": "--configfile configs/llama3-8b-fineweb.yaml configs/overlays/llama3-8b-4nodes.yaml",
}


@pytest.fixture(scope="module")
def preset_copy(tmp_path_factory) -> Path:
    return fresh_copy(tmp_path_factory.mktemp("presets"))


def test_every_preset_and_overlay_is_listed(root):
    files = {f"--configfile {p.relative_to(root)}" for p in (root / "configs").glob("*.yaml")}
    overlays = {str(p.relative_to(root)) for p in (root / "configs/overlays").glob("*.yaml")}
    assert files == {c for c in CONFIGS.values() if c.count(" ") == 1}
    assert overlays == {c.split()[-1] for c in CONFIGS.values() if c.count(" ") == 2}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("sub", list(SUBCOMMANDS))
def test_snakemake_subcommands(preset_copy, snakemake_cli, config, sub):
    run_subcommand(preset_copy, sub, CONFIGS[config], SUBCOMMANDS[sub], snakemake_cli)


def test_a_cluster_run_of_all_cores_jobs_is_refused_before_submitting(preset_copy):
    """hardware.cpus_per_task 0 (all cores) cannot be an sbatch request: a real SLURM run stops with one
    line before any job is submitted, while its dry run (and every subcommand above) goes through."""
    proc = subprocess.run(["bash", "-c", "snakemake --executor slurm --jobs 1"], cwd=preset_copy, env=user_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "hardware.cpus_per_task is 0" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "sbatch" not in proc.stdout + proc.stderr
