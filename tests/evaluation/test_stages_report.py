"""Stages report: per-stage token reconciliation, the table, and one plot of all stages' curves."""
from __future__ import annotations

import json

import pytest

from pipeline.config import resolve_config
from pipeline.errors import PipelineError
from pipeline.evaluation.stages_report import stages_report
from pipeline.io import write_json

SOURCES = {"web": {"type": "local", "glob": "data/sample/web/*.parquet"},
           "chat": {"type": "local", "glob": "data/sample/chat/*.parquet", "format": "chat"}}
MIXES = {"pretrain": {"weights": {"web": 1.0}},
         "sft": {"weights": {"chat": 1.0}, "tokens": 20000, "packing": "bestfit"}}


def fake_run(tmp_path, tokens_trained=None):
    params = resolve_config({"sources": SOURCES, "mixes": MIXES,
                             "train": {"stages": [{"name": "pretrain", "steps": 4},
                                                  {"name": "sft", "mix": "sft", "epochs": 1, "loss": "assistant"}]}})
    for name, steps, loss in (("pretrain", 4, 5.0), ("sft", 2, 3.0)):
        d = tmp_path / "train" / name
        d.mkdir(parents=True)
        trained = steps * 1000 if tokens_trained is None or name == "pretrain" else tokens_trained
        write_json(d / "summary.json", {"num_steps": steps, "tokens_per_step": 1000, "tokens_trained": trained,
                                        "tokens_planned": steps * 1000, "loss_tokens": steps * 400})
        with open(d / "metrics.jsonl", "w") as f:
            for s in range(1, steps + 1):
                f.write(json.dumps({"step": s, "tokens": s * 1000, "loss": loss - s * 0.1,
                                    **({"val_loss": loss} if s == steps else {})}) + "\n")
        write_json(tmp_path / "eval" / name / "report.json",
                   {"val_loss": loss, "core": {"score_name": "core_2", "baselines": "dclm-v1",
                                               "tasks": {"copa": {"shots": 0, "random_baseline": 0.5},
                                                         "hellaswag": {"shots": 10, "random_baseline": 0.25}}},
                    **({"chat_val_loss": 2.5, "answers": [{"question": "Hi?", "answer": "Hello."}]}
                                         if name == "sft" else {})})
    return params


def test_stages_report_table_plot_and_totals(tmp_path):
    params = fake_run(tmp_path)
    out = stages_report(params, tmp_path, tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png")
    assert [r["stage"] for r in out["stages"]] == ["pretrain", "sft"]
    assert out["total_steps"] == 6 and out["total_tokens"] == 6000
    md = (tmp_path / "s.md").read_text()
    assert "| sft | sft | assistant | pretrain | 2 | 2,000 | 800 | 3.0000 | 2.5000 |" in md
    assert "| **total** | | | | 6 | 6,000 | 2,400 | | |" in md and "**Hi?**" in md and "Hello." in md
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "- sft: 2 tasks (copa, hellaswag); random baselines dclm-v1" in md


def test_a_stage_whose_tokens_do_not_reconcile_fails_naming_it(tmp_path):
    params = fake_run(tmp_path, tokens_trained=1500)
    with pytest.raises(PipelineError, match="stage 'sft': trained 1500 tokens"):
        stages_report(params, tmp_path, tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png")
    assert not (tmp_path / "s.json").exists()
