"""`python -m pipeline.bench ...`: the training-step benchmark (`pipeline.bench.throughput`)."""
from pipeline.bench.throughput import main
from pipeline.io import run_cli

run_cli(main)
