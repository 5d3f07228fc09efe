"""pipeline.evaluation.evaluate: val loss and bits per byte over all rows, the unigram baseline, the reports."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from builders import TRAIN_SEQ, make_params, run_inprocess

from pipeline.data.contract import MASK_ASSISTANT, MASK_REAL
from pipeline.data.encoding import load_tokenizer
from pipeline.data.loader import PackedLoader
from pipeline.evaluation.evaluate import (
    evaluate_rows,
    main,
    per_token_and_bpb,
    token_byte_lengths,
    unigram_baseline,
    unigram_counts,
)
from pipeline.io import write_json
from pipeline.model.model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run faster on one intra-op thread


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A tiny model trained for 40 steps on the repetitive corpus."""
    out = tmp_path_factory.mktemp("eval_train")
    params = make_params(steps=40, val_interval=20, ckpt_interval=40, log_interval=5)
    run_inprocess(data, out, params)
    return out, params


def test_report_beats_unigram_and_writes_files(data, trained, tmp_path):
    out, params = trained
    main(["--params", json.dumps(params), "--ckpt", str(out / "final.pt"), "--val", data["val"],
          "--train", data["train"], "--tokenizer", data["tokenizer"], "--metrics", str(out / "metrics.jsonl"),
          "--outdir", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["beats_unigram"] and report["val_loss"] < report["unigram_baseline"]
    assert report["val_bpb"] < report["unigram_baseline_bpb"]
    assert report["val_tokens"] == PackedLoader(data["val"], 1).n_rows * TRAIN_SEQ  # all rows, no mask
    assert report["val_perplexity"] == pytest.approx(math.exp(report["val_loss"]))
    # 95 % intervals, documents resampled (every validation document starts with <|bos|>)
    assert report["val_loss_ci"][0] < report["val_loss"] < report["val_loss_ci"][1]
    assert report["val_bpb_ci"][0] < report["val_bpb"] < report["val_bpb_ci"][1]
    assert report["val_documents"] > 10
    assert report["summary"]["tokens_trained"] == 40 * 256
    assert [g["prompt"] for g in report["generations"]] == params["eval"]["prompts"]
    assert all(g["completion"] for g in report["generations"])
    md = (tmp_path / "report.md").read_text()
    assert "| beats the unigram baseline | yes |" in md and "![loss curve](loss.png)" in md
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "report.json", "report.md"]


def test_token_byte_lengths(data):
    tok = load_tokenizer(data["tokenizer"])
    lengths = token_byte_lengths(tok, 320)
    assert lengths[tok.bos_id] == 0 and all(lengths[i] == 0 for i in tok.special.values())
    assert lengths[300:].sum() == 0  # model vocab beyond the tokenizer's
    assert lengths[ord("a")] == 1  # byte tokens
    assert lengths[256] == len(tok.decode([256]).encode()) >= 2  # the first BPE merge


def test_a_chat_stages_two_masks_share_one_forward_and_each_equals_its_own_pass(data, tmp_path):
    """A chat stage's loss and its assistant-only loss (`chat_val_loader`) from one forward per batch of rows:
    each mask's sums equal those of the split read with that mask alone."""
    tok = load_tokenizer(data["tokenizer"])
    rows, mask = masked_pack(tmp_path / "val.json", tok)
    assistant = np.zeros_like(mask)
    assistant[:, 5:] = mask[:, 5:]  # assistant targets are real tokens
    stem = tmp_path / "val"
    (mask * MASK_REAL | assistant * MASK_ASSISTANT).astype(np.uint8).tofile(f"{stem}.mask.bin")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=8))
    calls = []
    loader = lambda loss: PackedLoader(tmp_path / "val.json", 1, shuffle=False, loss=loss)
    args = dict(device=torch.device("cpu"), rows=1, chunk=5, byte_lengths=token_byte_lengths(tok, 320),
                delimiters=(tok.bos_id, tok.eos_id))
    hidden = model.hidden
    model.hidden = lambda *a: (calls.append(1), hidden(*a))[1]
    both = evaluate_rows(model, [loader("all"), loader("assistant")], **args)
    assert len(calls) == 2  # 2 rows, one row a batch: one forward each
    alone = [evaluate_rows(model, [loader(loss)], **args)[0] for loss in ("all", "assistant")]
    for a, b in zip(both, alone):
        assert (a["nats"], a["tokens"], a["bytes"]) == (b["nats"], b["tokens"], b["bytes"])
        assert np.array_equal(a["docs"], b["docs"])
    assert both[1]["tokens"] == (assistant[:, 1:] != 0).sum() < both[0]["tokens"]


def masked_pack(path, tok, seq_len=8):
    """Two rows with a loss mask (bestfit-style, the real-token bit: what loss "all" counts), hand-made."""
    ids = tok.delimit(tok.encode("The old king sees a red bird. The cat"))[: 2 * (seq_len + 1)]
    rows = np.asarray(ids, np.uint16).reshape(2, seq_len + 1)
    mask = np.ones_like(rows, dtype=np.uint8)
    mask[0, 3:6] = 0
    mask[1, :4] = 0
    stem = path.parent / path.stem
    rows.tofile(f"{stem}.bin")
    (mask * MASK_REAL).tofile(f"{stem}.mask.bin")
    np.save(f"{stem}.docs.npy", np.asarray([0], np.int64))
    write_json(path, {"seq_len": seq_len, "n_rows": 2, "dtype": "uint16", "packing": "bestfit", "has_mask": True,
                      "tokens_packed": rows.size, "sha256": hashlib.sha256(rows.tobytes()).hexdigest(), "mix": "m"})
    return rows, mask


def test_bits_per_byte_matches_a_hand_computation(data, tmp_path):
    tok = load_tokenizer(data["tokenizer"])
    rows, mask = masked_pack(tmp_path / "val.json", tok)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=8))
    sums, = evaluate_rows(model, [PackedLoader(tmp_path / "val.json", 1, shuffle=False)], torch.device("cpu"), rows=1,
                          chunk=5, byte_lengths=token_byte_lengths(tok, 320))

    x, y, counted = torch.from_numpy(rows[:, :-1].astype(np.int64)), rows[:, 1:], mask[:, 1:].astype(bool)
    with torch.no_grad():
        logits = model(x).double()
    tok_nats = F.cross_entropy(logits.reshape(-1, 320), torch.from_numpy(y.astype(np.int64)).reshape(-1),
                               reduction="none").reshape(y.shape).numpy()
    nats = tok_nats[counted].sum()
    n_bytes = sum(0 if t in tok.special.values() else len(tok.decode([int(t)]).encode()) for t in y[counted])
    assert sums["tokens"] == counted.sum() and sums["bytes"] == n_bytes
    assert sums["nats"] == pytest.approx(nats, rel=1e-5)
    loss, bpb = per_token_and_bpb(sums)
    assert bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert loss == pytest.approx(nats / counted.sum(), rel=1e-5)


def test_unigram_baseline_by_hand(data, tmp_path):
    tok = load_tokenizer(data["tokenizer"])
    rows, mask = masked_pack(tmp_path / "val.json", tok)
    loader = PackedLoader(tmp_path / "val.json", 1, shuffle=False)
    counts = unigram_counts(loader, 320)
    targets = rows[:, 1:][mask[:, 1:].astype(bool)]
    assert counts.sum() == targets.size and counts[targets[0]] == (targets == targets[0]).sum()
    sums = unigram_baseline(counts, loader, 300, token_byte_lengths(tok, 320))
    p = (np.bincount(targets, minlength=300) + 1) / (targets.size + 300)
    assert sums["nats"] == pytest.approx(-np.log(p[targets]).sum())
    assert sums["tokens"] == targets.size
