"""`python -m pipeline.bench ...`: the training-step benchmark (`pipeline.bench.step`)."""
from pipeline.bench.step import main
from pipeline.io import run_cli

run_cli(main)
