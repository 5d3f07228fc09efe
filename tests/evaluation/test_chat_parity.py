"""ChatCORE against lm-eval per item (issue 20 item 3): the same items, our prompt, lm-eval (`lm-eval[hf]`,
offline, local task files from `chat_lmeval_task`) running the transformers export of the same weights.

* ARC-Easy, ARC-Challenge, MMLU: lm-eval's multiple_choice over the continuations "A", "B", … (no
  delimiter) after our rendered prompt. Each continuation is one token at the position our scorer reads,
  so lm-eval's pick (highest log-likelihood) is the highest letter logit: the picks agree item by item
  (an item whose top two letters are within TOL would be a tie, left out), and every letter's
  log-likelihood equals ours within TOL.
* GSM8K: lm-eval's own gsm8k task (its strict-match and flexible-extract filters, exact_match) with our
  prompt, greedy `generate_until` our stop tokens, `max_gen_toks` = our max_new_tokens, batch size 1 (no
  left padding). Its generated text equals our KV-cache engine's answer item by item, and our
  correctness equals its exact_match (strict-match where that filter finds "#### n", else
  flexible-extract: our reading of the answer, tests/evaluation/test_chat_core.py).

The model is trained a few steps to repeat the gold answer of half the items (letters and GSM8K
solutions), so both sides score some items right and some wrong.
"""
from __future__ import annotations

import pytest
import torch
from builders import parity_model_config

from pipeline.data.eval_data import build_chat_task, wheel_record
from pipeline.data.tasks import chat_task_spec
from pipeline.evaluation import chat_core as C
from pipeline.evaluation import export as ex
from pipeline.evaluation.lmeval_harness import chat_lmeval_task, run_lmeval, write_tasks  # lm-eval: the dev extra
from pipeline.model.checkpoint_io import save_checkpoint, versions
from pipeline.model.model import ModelConfig, Transformer
from pipeline.rules import rule_params

pytestmark = pytest.mark.slow
TOL = 1e-4
SEQ = 512
MAX_NEW = 112
ITEMS = {"arc_easy": 6, "arc_challenge": 6, "mmlu": 6, "gsm8k": 4}
STEPS = 50


def fits(tok, task, item) -> bool:
    """The prompt fits the context (GSM8K: with MAX_NEW new tokens), and a GSM8K solution fits MAX_NEW
    (so a learnt answer reaches its "#### n")."""
    n = len(tok.render_prompt([{"role": "user", "content": C.user_message(task, item)}]))
    if task["kind"] == "categorical":
        return n <= SEQ
    return n + MAX_NEW <= SEQ and len(tok.encode(item["solution"])) < MAX_NEW


def train_on_answers(model, tok, task) -> None:
    """AdamW on the first half of the GSM8K items' conversations (question, upstream solution), loss on
    the assistant's answer only: the model learns to answer them (and "#### n" in them)."""
    rows = []
    for it in task["items"][:len(task["items"]) // 2]:
        ids, mask = tok.render_chat([{"role": "user", "content": C.user_message(task, it)},
                                     {"role": "assistant", "content": it["solution"]}])
        rows.append((tok.delimit(ids), [0] + mask))
    width = max(len(ids) for ids, _ in rows)
    x = torch.zeros(len(rows), width - 1, dtype=torch.long)
    y = torch.full((len(rows), width - 1), -100)
    for r, (ids, mask) in enumerate(rows):
        x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[r, :len(ids) - 1] = torch.tensor([t if m else -100 for t, m in zip(ids[1:], mask[1:])])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_parity")
    cfg, tok = parity_model_config(d, SEQ)
    wheel = wheel_record()
    tasks = {}
    for name, n in ITEMS.items():
        task = build_chat_task(chat_task_spec(name), *wheel, seed=0)
        tasks[name] = {**task, "items": [it for it in task["items"] if fits(tok, task, it)][:n]}
    params = rule_params(cfg, "train")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_config(params))
    train_on_answers(model, tok, tasks["gsm8k"])
    save_checkpoint(d / "final.pt", {"model": model.state_dict(), "params": params, "plan": {},
                                     "summary": {}, "versions": versions()})
    hf_dir = ex.export(d / "final.pt", d / "encoding.json", d / "hf")
    ours = C.evaluate_chat(model, tok, tasks, max_items=None, max_new_tokens=MAX_NEW, batch_tokens=4 * SEQ)
    local = [chat_lmeval_task(f"chat_{name}", tok, task, task["items"], MAX_NEW) for name, task in tasks.items()]
    theirs = run_lmeval(hf_dir, write_tasks(d / "tasks", local), [t.name for t in local], d / "lmeval.json",
                        batch_size=1, timeout=900)
    return tok, model, hf_dir, tasks, ours, theirs


def prompt_ids(tok, task, item) -> list[int]:
    return tok.render_prompt([{"role": "user", "content": C.user_message(task, item)}])


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge", "mmlu"])
def test_letter_picks_agree_with_lmeval_per_item(runs, name):
    tok, model, hf_dir, tasks, ours, theirs = runs
    task, mine = tasks[name], [r for r in ours["item_log"] if r["task"] == name]
    reqs = theirs["requests"][f"chat_{name}"]
    docs = theirs["docs"][f"chat_{name}"]
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    agree = ties = 0
    for k, (it, row, doc) in enumerate(zip(task["items"], mine, docs, strict=True)):
        ids = prompt_ids(tok, task, it)
        mine_reqs = [r for r in reqs if r["doc_id"] == k]
        assert [r["continuation"] for r in mine_reqs] == list(C.LETTERS[:len(it["choices"])])
        # lm-eval's context is our prompt, token for token (the tokenizer reads the special tokens back)
        assert all(r["context"] == tok.decode(ids) for r in mine_reqs)
        assert hf_tok(mine_reqs[0]["context"], add_special_tokens=False)["input_ids"] == ids
        # each letter's log-likelihood is ours at the answer position
        with torch.no_grad():
            logp = model(torch.tensor([ids]))[0, -1].log_softmax(-1)[C.letter_ids(tok, len(it["choices"]))]
        lls = torch.tensor([r["loglikelihood"] for r in mine_reqs])
        assert (logp - lls).abs().max() < TOL
        top2 = lls.topk(2).values
        if top2[0] - top2[1] < TOL:
            ties += 1
            continue
        pick = C.LETTERS[int(lls.argmax())]
        assert row["pick"] == pick, (name, k, row, lls)
        assert row["correct"] == (doc["metrics"]["acc"] == 1.0) == (pick == C.LETTERS[it["gold"]])
        agree += 1
    print(f"{name}: {agree}/{len(mine)} picks agree, {ties} ties; ours {ours['tasks'][name]['correct']} correct, "
          f"lm-eval acc {theirs['results'][f'chat_{name}']['acc,none']}")
    assert ties <= 1 and agree == len(mine) - ties == ITEMS[name] - ties
    assert theirs["results"][f"chat_{name}"]["acc,none"] == pytest.approx(ours["tasks"][name]["accuracy"], abs=1e-9) \
        or ties


def test_gsm8k_generations_agree_with_lmeval_per_item(runs):
    tok, model, hf_dir, tasks, ours, theirs = runs
    task, mine = tasks["gsm8k"], [r for r in ours["item_log"] if r["task"] == "gsm8k"]
    docs = theirs["docs"]["chat_gsm8k"]
    by_filter = {f: [d for d in docs if d["filter"] == f] for f in ("strict-match", "flexible-extract")}
    texts = correct = strict_found = 0
    for k, it in enumerate(task["items"]):
        strict, flexible = by_filter["strict-match"][k], by_filter["flexible-extract"][k]
        assert strict["doc_id"] == flexible["doc_id"] == k
        assert strict["context"] == tok.decode(prompt_ids(tok, task, it))
        assert strict["generation"] == flexible["generation"]
        texts += strict["generation"] == mine[k]["pick"]
        lm_correct = (strict if strict["filtered"] != "[invalid]" else flexible)["metrics"]["exact_match"] == 1.0
        assert mine[k]["correct"] == lm_correct, (k, mine[k], strict, flexible)
        correct += lm_correct
        strict_found += strict["filtered"] != "[invalid]"
    print(f"gsm8k: {texts}/{len(mine)} generations identical; {correct} correct on both sides, "
          f"{strict_found} read by strict-match")
    assert texts == len(mine) == ITEMS["gsm8k"]
    assert 0 < correct < len(mine)  # the comparison covers right and wrong answers,
    assert 0 < strict_found < len(mine)  # and both of lm-eval's filters
