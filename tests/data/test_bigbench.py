"""pipeline.data.bigbench: the six BIG-bench tasks from a (here tiny, fake) bigbench sdist served by a
local package index: streamed extraction, sha256 verification, the cache, and DCLM's rendering of each
task on examples shaped like the real task.json files."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import pytest

from pipeline.data import bigbench as bb
from pipeline.data import eval_data as ed
from pipeline.data.tasks import TASKS, load_task
from pipeline.errors import PipelineError

BASE = "bigbench-1.0.0/bigbench/benchmark_tasks"
# Real-shaped task.json files (fields and examples as in bigbench 1.0.0), a few examples each.
TASK_JSON = {
    "qa_wikidata": {"name": "qa_wikidata", "example_input_prefix": "\n", "example_output_prefix": " ",
                    "examples": [{"input": "The genre of \"Weird Al\" Yankovic is", "target": ["comedy", "parody"]},
                                 {"input": "The language of (I Can't Get No) Satisfaction is", "target": "English"}]},
    "dyck_languages": {"name": "dyck_languages", "task_prefix": "Complete the rest of the sequence, making sure "
                       "that the parentheses are closed properly. \n", "example_input_prefix": "\nInput: ",
                       "example_output_prefix": "\nOutput: ",
                       "examples": [{"input": "{ [ [ [ { [ ] } ] ]", "target_scores": {")": 0, "] }": 1, "> >": 0}}]},
    "operators": {"name": "operators", "task_prefix": "Given the definition of the op operator, compute the result.",
                  "example_input_prefix": "\n", "example_output_prefix": " = ",
                  "examples": [{"input": "op i is the absolute value of i.\nop -58", "target": "58"}]},
    "repeat_copy_logic": {"name": "repeat_copy_logic", "task_prefix": "repeat with logic:\n",
                          "examples": [{"input": "Repeat 5 times hello world", "target": "hello world hello world "
                                        "hello world hello world hello world"},
                                       {"input": "no target here"}]},  # malformed: dropped and counted
    "cs_algorithms": {"name": "cs_algorithms", "keywords": ["algorithms"]},  # the parent of two subtasks
    "cs_algorithms/lcs": {"name": "lcs", "task_prefix": "Given two strings, determine the length of the longest "
                          "common subsequence.\n", "example_input_prefix": "\nStrings: ",
                          "example_output_prefix": "\nLength of longest common subsequence: ",
                          "examples": [{"input": "SZPHKVR ECOUO", "target_scores": {"0": 1, "1": 0, "2": 0}}]},
    "cs_algorithms/valid_parentheses": {
        "name": "valid_parentheses", "task_prefix": "Determine whether the given sequence of parentheses is "
        "properly matched.\n", "example_input_prefix": "\nSequence: ", "example_output_prefix": "\nValid/Invalid? ",
        "examples": [{"input": "{ ( { [ ] } ) }", "target_scores": {"Valid": 1, "Invalid": 0}}]},
    "language_identification": {
        "name": "language_identification", "task_prefix": "Given a sentence, select the correct language among "
        "the choices", "append_choices_to_input": True, "example_input_prefix": "\nSentence: ",
        "example_output_prefix": "\nLanguage: ",
        "examples": [{"input": "Ñõn ro otemjej i Rom.", "target_scores": {"Swedish": 0, "Marshallese": 1,
                                                                          "Zazaki": 0}}]},
    "other_task": {"name": "other_task", "examples": [{"input": "not ours", "target": "x"}]},  # not extracted
}


def make_sdist(path: Path, corrupt: bool = False) -> str:
    """A tar.gz laid out like bigbench-1.0.0.tar.gz; its sha256 (of the uncorrupted bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, task in {"PKG-INFO": None, **TASK_JSON}.items():
            data = b"Name: bigbench\nLicense: UNKNOWN\n" if task is None else json.dumps(task).encode()
            info = tarfile.TarInfo("bigbench-1.0.0/PKG-INFO" if task is None else f"{BASE}/{name}/task.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    if corrupt:
        data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]
    path.write_bytes(data)
    return digest


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local PEP 503 index serving the fake sdist; yields (index URL, request log, sdist path)."""
    sdist = tmp_path / "srv" / bb.SDIST_FILE
    sdist.parent.mkdir()
    digest = make_sdist(sdist)
    monkeypatch.setattr(bb, "SDIST_SHA256", digest)
    monkeypatch.setenv(bb.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(bb.SDIST_ENV, raising=False)
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            if self.path == "/simple/bigbench/":
                body = (f'<a href="../../files/{bb.SDIST_FILE}#sha256={digest}">{bb.SDIST_FILE}</a>').encode()
            elif self.path == f"/files/{bb.SDIST_FILE}":
                body = sdist.read_bytes()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/bigbench/", requests, sdist
    server.shutdown()
    server.server_close()


def test_fetch_extracts_only_the_six_tasks_verified_and_caches_them(index, tmp_path):
    url, requests, _ = index
    root, record = bb.task_files(url)
    assert root == tmp_path / "cache" / "bigbench-1.0.0"
    want = {f"{BASE}/{n}/task.json" for n in TASK_JSON if n != "other_task"}
    assert set(record) == want  # not PKG-INFO, not another task
    for rel, digest in record.items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest
    assert requests == ["/simple/bigbench/", f"/files/{bb.SDIST_FILE}"]
    # a second run downloads nothing (and does not even ask the index)
    assert bb.task_files(url) == (root, record) and len(requests) == 2
    # a corrupted cached file is named, with the fix
    (root / f"{BASE}/operators/task.json").write_text("{}")
    with pytest.raises(PipelineError, match="operators/task.json: missing or corrupted.*delete"):
        bb.task_files(url)


def test_a_corrupted_or_different_archive_is_refused_and_nothing_is_cached(index, tmp_path, monkeypatch):
    url, _, sdist = index
    good = sdist.read_bytes()
    # a readable archive with other bytes (here some appended after the gzip stream): the digest decides
    sdist.write_bytes(good + b"tampered")
    with pytest.raises(PipelineError, match=r"sha256 .* but bigbench-1.0.0.tar.gz has .*TOKENFARM_BIGBENCH_SDIST"):
        bb.task_files(url)
    # a flipped byte inside the compressed data: refused however the reader notices it
    make_sdist(sdist, corrupt=True)
    with pytest.raises(PipelineError, match=r"(sha256 .* but|cannot read) .*TOKENFARM_BIGBENCH_SDIST"):
        bb.task_files(url)
    assert not (tmp_path / "cache" / "bigbench-1.0.0").exists()
    # a registry publishing another digest than the pinned one is refused before downloading
    monkeypatch.setattr(bb, "SDIST_SHA256", "0" * 64)
    with pytest.raises(PipelineError, match="publishes sha256 .* not the 000000000000"):
        bb.task_files(url)


def test_an_unreachable_registry_names_the_fixes_and_a_local_sdist_works(index, tmp_path, monkeypatch):
    _, requests, sdist = index
    with pytest.raises(PipelineError, match="not reachable.*TOKENFARM_BIGBENCH_SDIST.*drop the bigbench_\\* tasks "
                                            "from eval.tasks"):
        bb.task_files("http://127.0.0.1:9/simple/bigbench/")
    monkeypatch.setenv(bb.SDIST_ENV, str(sdist))
    root, record = bb.task_files("http://127.0.0.1:9/simple/bigbench/")
    assert len(record) == 8 and requests == []


def test_the_six_tasks_render_as_dclm_does(index, tmp_path):
    url, _, _ = index
    bb_files = bb.task_files(url)
    names = [n for n, t in TASKS.items() if t.package == "bigbench"]
    assert len(names) == 6
    out = tmp_path / "eval_data"
    out.mkdir()
    for n in names:
        task = ed.build_task(TASKS[n], Path("."), {}, pool_size=0, seed=1, bigbench_files=bb_files)
        assert task["licence"] == "Apache-2.0" and task["shots"] == 10
        assert all(s["sha256"] == bb_files[1][s["path"]] for s in task["sources"])
    def render(name):
        task = ed.build_task(TASKS[name], Path("."), {}, pool_size=0, seed=1, bigbench_files=bb_files)
        return {it["id"]: (it["contexts"], it["continuations"], it["gold"]) for it in task["items"]}, task

    items, _ = render("bigbench_qa_wikidata")
    assert items["qa_wikidata/0"] == (['The genre of "Weird Al" Yankovic is'], [" comedy"], 0)
    items, _ = render("bigbench_dyck_languages")
    assert items["dyck_languages/0"] == (["Complete the rest of the sequence, making sure that the parentheses are "
                                          "closed properly. \n\nInput: { [ [ [ { [ ] } ] ]\nOutput:"], [" ] }"], 0)
    items, _ = render("bigbench_operators")
    assert items["operators/0"] == (["Given the definition of the op operator, compute the result.\nop i is the "
                                     "absolute value of i.\nop -58 ="], [" 58"], 0)
    items, task = render("bigbench_repeat_copy_logic")
    assert items == {"repeat_copy_logic/0": (["repeat with logic:\n\nQ: Repeat 5 times hello world\nA:"],
                                             [" hello world hello world hello world hello world hello world"], 0)}
    assert task["counts"] == {"upstream": 2, "dropped": 1, "pool": 0, "items": 1}
    items, _ = render("bigbench_cs_algorithms")  # as llm-foundry's bigbench_cs_algorithms.jsonl
    assert items == {
        "lcs/0": (["Given two strings, determine the length of the longest common subsequence.\n\nStrings: SZPHKVR "
                   "ECOUO\nLength of longest common subsequence:"], [" 0"], 0),
        "valid_parentheses/0": (["Determine whether the given sequence of parentheses is properly matched.\n\n"
                                 "Sequence: { ( { [ ] } ) }\nValid/Invalid?"], [" Valid"], 0)}
    items, _ = render("bigbench_language_identification")
    assert items["language_identification/0"] == (
        ["Given a sentence, select the correct language among the choices\nSentence: Ñõn ro otemjej i Rom.\n"
         "  choice: Swedish\n  choice: Marshallese\n  choice: Zazaki\nLanguage:"],
        [" Swedish", " Marshallese", " Zazaki"], 1)


def test_eval_data_writes_bigbench_task_files_and_a_small_task_keeps_a_pool_for_its_shots(index, tmp_path,
                                                                                        monkeypatch):
    url, _, _ = index
    monkeypatch.setattr(bb, "INDEX_URL", url)
    out = tmp_path / "eval_data"
    manifest = ed.build_eval_data({"tasks": ["bigbench_operators"], "pool_size": 20, "seed": 3}, out,
                                  wheel=(Path("."), {}))
    task = load_task(out / "bigbench_operators.json")
    assert manifest["tasks"]["bigbench_operators"]["sources"] == task["sources"]
    assert task["sources"][0]["path"] == f"{BASE}/operators/task.json" and "file" not in task["sources"][0]
    assert "bigbench_operators" not in manifest["unavailable"]
    # 11 items with 10 shots: the pool holds the 10 shots, not n // 10 = 1
    items = [{"id": str(i)} for i in range(11)]
    pool, scored = ed.split_pool(items, 20, 3, "t", shots=10)
    assert len(pool) == 10 and len(scored) == 1
