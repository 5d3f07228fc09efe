"""The estimators: what a run will cost before it runs, torch-free (the Snakefile imports them at parse time).

- `compute`: parameters, FLOPs per token, GPU peaks, the batch layout, token targets;
- `stages`: the training stages and each one's budget; `sweep`: the IsoFLOP sweep's points and fit;
- `step_setup`, `memory`, `step_time`, `parallel`: one training step's memory and time, ddp or fsdp;
- `train_jobs`: checkpoint interval and the chain of jobs within a job time limit;
- `job_sizes`, `data_cost`: each rule's threads, memory and runtime, the data stages' CPU-hours;
- `token_plan`: `make_plan(cfg)` → `Plan`, the token-budget plan `python -m pipeline.plan` prints.

Every function takes the config typed (`pipeline.run_config.RunConfig`) and never converts it: its callers
(the Snakefile's `RC`, the CLIs, the trainer) call `run_config` once. The formulas and the measurements behind
the fitted constants: docs/planning.md.
"""
