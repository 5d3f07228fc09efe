"""The six BIG-bench tasks of DCLM's CORE, from the `bigbench==1.0.0` source distribution (data only).

- `task_files()`: the six ``task.json`` files, from the cache (``$TOKENFARM_CACHE`` or
  ``$XDG_CACHE_HOME/tokenfarm``) or streamed once from PyPI, sha256-checked against `SDIST_SHA256`
  (``$TOKENFARM_BIGBENCH_SDIST`` names a local copy instead);
- `items(task, subtask, multiple_choice)`: a task's items rendered as DCLM's llm-foundry files hold them.

The download, the licence and the rendering: docs/data-stages.md, "BIG-bench tasks".
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import atomic_dir, get_logger, sha256_file, write_json

log = get_logger(__name__)

SDIST = "bigbench"
SDIST_VERSION = "1.0.0"
SDIST_FILE = f"{SDIST}-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
INDEX_URL = f"https://pypi.org/simple/{SDIST}/"
LICENCE = "Apache-2.0"
LICENCE_NOTE = ("github.com/google/BIG-bench LICENSE (Apache-2.0); the sdist itself ships no LICENSE and its "
                "PKG-INFO says License: UNKNOWN")
TASK_DIRS = ("qa_wikidata", "dyck_languages", "operators", "repeat_copy_logic", "cs_algorithms",
             "language_identification")
_MEMBER = re.compile(rf"^{SDIST}-{SDIST_VERSION}/bigbench/benchmark_tasks/({'|'.join(TASK_DIRS)})(/[^/]+)?/task\.json$")
SDIST_ENV, CACHE_ENV = "TOKENFARM_BIGBENCH_SDIST", "TOKENFARM_CACHE"
FIX = (f"set {SDIST_ENV} to a downloaded {SDIST_FILE} (sha256 {SDIST_SHA256[:12]}…, from pypi.org/project/{SDIST}), "
       "or drop the bigbench_* tasks from eval.tasks")


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenfarm"


def sdist_url(index_url: str) -> tuple[str, str]:
    """(URL, sha256) of the sdist, from the package index's PEP 503 page."""
    try:
        with urllib.request.urlopen(index_url, timeout=60) as r:
            page = r.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError) as e:
        raise PipelineError(f"the BIG-bench tasks need {SDIST_FILE} but the package index {index_url} is not "
                            f"reachable ({e}); {FIX}") from None
    m = re.search(rf'href="([^"#]*{re.escape(SDIST_FILE)})#sha256=([0-9a-f]{{64}})"', page)
    if m is None:
        raise PipelineError(f"{index_url} lists no {SDIST_FILE} with a sha256; {FIX}")
    return urllib.parse.urljoin(index_url, m.group(1)), m.group(2)


class _Hashing(io.RawIOBase):
    """A read-only stream that hashes every byte read through it."""

    def __init__(self, raw):
        self.raw, self.sha, self.bytes = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.raw.read(len(b))
        self.sha.update(data)
        self.bytes += len(data)
        b[:len(data)] = data
        return len(data)


def _open(source: str):
    if re.match(r"^[a-z]+://", source):
        return urllib.request.urlopen(source, timeout=120)
    return open(source, "rb")


def extract(source: str, expected: str) -> dict[str, bytes]:
    """The six tasks' task.json files ({path in the sdist: bytes}) from a streamed sdist whose sha256 must
    be `expected` (the whole archive is read, so that its digest covers every byte)."""
    files = {}
    try:
        with _open(source) as raw:
            stream = _Hashing(raw)
            with tarfile.open(fileobj=io.BufferedReader(stream, 1 << 20), mode="r|gz") as tar:
                for m in tar:
                    if m.isfile() and _MEMBER.match(m.name):
                        files[m.name] = tar.extractfile(m).read()
            while stream.read(1 << 20):  # the tar's end padding and anything after it
                pass
    except (OSError, urllib.error.URLError, tarfile.TarError, EOFError) as e:
        raise PipelineError(f"{source}: cannot read {SDIST_FILE} ({e!r}); {FIX}") from None
    digest = stream.sha.hexdigest()
    if digest != expected:
        raise PipelineError(f"{source}: sha256 {digest[:12]}… but {SDIST_FILE} has {expected[:12]}… (a corrupted "
                            f"or different archive, {stream.bytes} bytes); nothing was cached; {FIX}")
    missing = [t for t in TASK_DIRS if not any(_MEMBER.match(n).group(1) == t for n in files)]
    if missing:
        raise PipelineError(f"{source}: no task.json for {', '.join(missing)} in {SDIST_FILE}; {FIX}")
    return files


def task_files(index_url: str | None = None) -> tuple[Path, dict[str, str]]:
    """(cache root, {path in the sdist: sha256}) of the six tasks' task.json files, downloading and
    extracting the sdist only when the cache lacks them (docs/data-stages.md); `index_url`: INDEX_URL."""
    index_url = index_url or INDEX_URL
    root = cache_dir() / f"{SDIST}-{SDIST_VERSION}"
    manifest = root / "files.json"
    if manifest.exists():
        try:
            record = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError) as e:
            raise PipelineError(f"{manifest}: unreadable ({e!r}); delete {root} to fetch it again") from None
        for rel, digest in record.items():
            if not (root / rel).exists() or sha256_file(root / rel) != digest:
                raise PipelineError(f"{root / rel}: missing or corrupted in the BIG-bench cache; delete {root} "
                                    "to fetch it again")
        return root, record
    if os.environ.get(SDIST_ENV):
        source, expected = os.environ[SDIST_ENV], SDIST_SHA256
    else:
        source, expected = sdist_url(index_url)
        if expected != SDIST_SHA256:
            raise PipelineError(f"{index_url} publishes sha256 {expected[:12]}… for {SDIST_FILE}, not the "
                                f"{SDIST_SHA256[:12]}… these task converters were written for; {FIX}")
    log.info("fetching %s from %s (the six BIG-bench task.json files; cached in %s)", SDIST_FILE, source, root)
    files = extract(source, expected)
    root.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(root, replace=True) as tmp:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        write_json(tmp / "files.json", {"sdist": SDIST_FILE, "sha256": expected, "source": source,
                                        "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}})
    return task_files(index_url)


# ----------------------------------------------------------------------------- rendering

def _gold(example: dict) -> str | None:
    """The target: the first listed one, or the choice scored 1 (exactly one)."""
    if "target" in example:
        t = example["target"]
        t = t[0] if isinstance(t, list) and t else t
        return t if isinstance(t, str) else None
    best = [k for k, v in (example.get("target_scores") or {}).items() if v == 1]
    return best[0] if len(best) == 1 else None


def items(task: dict, subtask: str, multiple_choice: bool) -> tuple[list[dict | None], int]:
    """(items, or None for a malformed example, and the number of examples) of one task.json, in our
    normalized shape (pipeline/data/tasks.py), rendered as docs/data-stages.md, "BIG-bench tasks" says."""
    prefix = task.get("task_prefix", "")
    in_prefix = task.get("example_input_prefix", "\nQ: ")
    out_prefix = task.get("example_output_prefix", "\nA: ").rstrip(" ")
    out = []
    for i, ex in enumerate(task.get("examples", [])):
        gold, inp = _gold(ex), ex.get("input")
        if not isinstance(inp, str) or not inp.strip() or gold is None or not gold.strip():
            out.append(None)
            continue
        id_ = f"{subtask}/{i}"
        if multiple_choice:
            choices = list(ex["target_scores"])
            ctx = prefix + in_prefix + inp + "".join(f"\n  choice: {c}" for c in choices) + out_prefix
            out.append({"id": id_, "contexts": [ctx.lstrip()], "continuations": [" " + c.strip() for c in choices],
                        "gold": choices.index(gold), "text": f"{inp} {gold}"})
        else:
            out.append({"id": id_, "contexts": [(prefix + in_prefix + inp + out_prefix).lstrip()],
                        "continuations": [" " + gold.strip()], "gold": 0, "text": f"{inp} {gold}"})
    return out, len(task.get("examples", []))
