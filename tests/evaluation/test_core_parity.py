"""The CORE-style scorer against an independent implementation: lm-eval (`lm-eval[hf]`, offline, on task
YAMLs generated from our task files) scoring the transformers export of the same weights. One
multiple-choice (COPA), one schema (WinoGrande) and one language-modeling task (LAMBADA), real items
with few-shot prefixes and a context short enough that some requests are left-truncated: every
request's log-likelihood equals ours within 1e-4 in fp32, and lm-eval's greedy flag equals ours.

What differs by definition (pipeline/evaluation/core_benchmark.py): our multiple-choice and schema accuracy
picks the lowest *mean* per-token loss; lm-eval's `acc` the highest *summed* log-likelihood and
`acc_norm` the summed log-likelihood per byte. lm-eval scores a schema item as one multiple-choice
request per filled-in context ("partial evaluation"); here each is its own loglikelihood request.
"""
from __future__ import annotations

import pytest
import torch
from builders import parity_model_config

from pipeline.data.eval_data import build_eval_data
from pipeline.evaluation import core_benchmark as core
from pipeline.evaluation import export as ex
from pipeline.evaluation.lmeval_harness import LocalTask, run_lmeval, write_tasks  # lm-eval: the dev extra
from pipeline.model.checkpoint_io import save_checkpoint, versions
from pipeline.model.model import ModelConfig, Transformer
from pipeline.rules import rule_params

pytestmark = pytest.mark.slow
TOL = 1e-4
SEQ = 128
ITEMS = 6
TASKS = ["copa", "winogrande", "lambada"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    cfg, tok = parity_model_config(d, SEQ)
    params = rule_params(cfg, "train")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_config(params))
    with torch.no_grad():  # weights off their initialisation, so log-probabilities are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    save_checkpoint(d / "final.pt", {"model": model.state_dict(), "params": params, "plan": {},
                                     "summary": {}, "versions": versions()})
    hf_dir = ex.export(d / "final.pt", d / "encoding.json", d / "hf")
    build_eval_data({"tasks": TASKS, "pool_size": 20, "seed": 0}, d / "eval_data")
    tasks = core.load_tasks(d / "eval_data", TASKS)
    return d, tok, model, hf_dir, tasks


def requests_of(task: dict, shots: int) -> list[list[tuple[str, str]]]:
    return [core.item_requests(task, item, shots, seed=0) for item in task["items"][:ITEMS]]


def test_lmeval_loglikelihoods_equal_ours(setup):
    d, tok, model, hf_dir, tasks = setup
    reqs = {"copa": requests_of(tasks["copa"], 2), "winogrande": requests_of(tasks["winogrande"], 2),
            "lambada": requests_of(tasks["lambada"], 1)}
    local = [
        # multiple choice: lm-eval's request is (context, target_delimiter + choice) = our continuation
        LocalTask("core_copa", "multiple_choice", [
            {"context": r[0][0], "choices": [c[1:] for _, c in r], "gold": it["gold"]}
            for r, it in zip(reqs["copa"], tasks["copa"]["items"])]),
        # schema: one loglikelihood request per filled-in context
        LocalTask("core_winogrande", "loglikelihood", [
            {"context": c, "continuation": x} for r in reqs["winogrande"] for c, x in r], target_delimiter=""),
        LocalTask("core_lambada", "loglikelihood", [
            {"context": c, "continuation": x} for r in reqs["lambada"] for c, x in r], target_delimiter=""),
    ]
    assert all(c.startswith(" ") for r in reqs["copa"] for _, c in r)
    out = run_lmeval(hf_dir, write_tasks(d / "tasks", local), [t.name for t in local], d / "lmeval.json",
                     timeout=900)
    truncated = 0
    for name in TASKS:
        theirs = out["requests"][f"core_{name}"]
        flat = [pair for r in reqs[name] for pair in r]
        assert len(theirs) == len(flat)
        ours = core.score_requests(model, [core.encode_pair(tok, c, x) for c, x in flat], SEQ, 512,
                                   torch.device("cpu"))
        for (c, x), mine, lm in zip(flat, ours, theirs):  # lm-eval's: by document, then choice
            assert (lm["context"] + lm["continuation"]) == c + x
            assert abs(mine.logprob - lm["loglikelihood"]) < TOL, (name, c[-60:], x, mine, lm)
            assert mine.greedy == lm["is_greedy"]
            truncated += mine.truncated
    assert truncated > 0  # the left-truncation path was compared too
