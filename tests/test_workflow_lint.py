"""`snakemake --lint` on the default config and on every preset in configs/ reports nothing.

The same check as `make lint`; snakemake exits 1 when it prints a lint, and the output is checked too.
"""
from __future__ import annotations

import pytest
from builders import ROOT, SNAKEMAKE, user_env

PRESETS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("configfile", [None, *PRESETS], ids=["config.yaml", *PRESETS])
def test_snakemake_lint_reports_nothing(configfile, snakemake_cli):
    cmd = [SNAKEMAKE, "--lint", *(["--configfile", configfile] if configfile else [])]
    proc = snakemake_cli.run(cmd, ROOT, user_env(), 300)  # the CLI as `make lint` runs it, imported once
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Lints for" not in out, out[-3000:]


def test_presets_exist():
    assert PRESETS, "configs/ has no preset to lint"


def test_the_train_log_is_appended_to_not_truncated():
    # A rerun started beside an orphaned trainer (still writing its log) must not truncate the log the
    # orphan's lines go to: the train rule tees with -a (its log holds one run after another).
    import re

    common = (ROOT / "workflow/rules/common.smk").read_text(encoding="utf-8")
    start = common.index("TRAIN_SHELL = (")
    shell = common[start:common.index("\n)\n", start)]  # the command of both train rules
    tees = re.findall(r"\|\s*tee\b([^{]*)\{", shell)
    assert tees and all("-a" in opts.split() for opts in tees), tees
