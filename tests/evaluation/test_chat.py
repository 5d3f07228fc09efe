"""Chat CLI: one-shot answers, the interactive mode through a real pty (history, commands, EOF),
context truncation by the documented rule, and clear errors."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
import zipfile

import pytest
import torch
from builders import ROOT, write_text_shard

from pipeline.config import resolve_config
from pipeline.data.encoding import load_tokenizer
from pipeline.data.train_tokenizer import build_tokenizer
from pipeline.errors import PipelineError
from pipeline.evaluation.chat import ChatSession
from pipeline.evaluation.chat import main as chat_main
from pipeline.model.checkpoint_io import save_checkpoint
from pipeline.model.load import load_model
from pipeline.model.model import ModelConfig, Transformer

WORDS = "the river stone light garden mountain winter hello there how are you fine thanks what is a".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with a real tiny BPE tokenizer and a (random) model checkpoint of a stage."""
    d = tmp_path_factory.mktemp("chatrun")
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) for i in range(200)]
    shard = write_text_shard(d / "raw" / "web" / "s.parquet", texts)
    tok_params = {"tokenizer": {"kind": "bpe", "vocab_size": 300, "train_chars": 20_000, "max_doc_chars": 10_000,
                                "delimiter": "bos"}, "sources": {"web": {"format": "text"}}, "seed": 0}
    build_tokenizer(tok_params, [str(shard)], d / "run" / "tokenizer" / "encoding.json")
    params = resolve_config({"tokenizer": {"vocab_size": 300}, "train": {"seq_len": 64},
                             "model": {"vocab_size": 300, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                       "ffn_dim": 64}})
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_config(params))
    ckpt = d / "run" / "train" / "sft" / "final.pt"
    save_checkpoint(ckpt, {"model": model.state_dict(), "params": params})
    return ckpt


def session(ckpt, **kw) -> ChatSession:
    tok = load_tokenizer(ckpt.parents[2] / "tokenizer" / "encoding.json")
    return ChatSession(load_model(ckpt, torch.device("cpu")), tok, **{"max_new_tokens": 12, "temperature": 0.0, **kw})


def cli(ckpt, *extra) -> list[str]:
    return [sys.executable, "-m", "pipeline.evaluation.chat", "--ckpt", str(ckpt), "--max-new-tokens", "12",
            "--temperature", "0", *extra]


def test_one_shot_prompt_answers_on_stdout(run):
    out = subprocess.run(cli(run, "--prompt", "hello there"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = session(run).reply("hello there")
    assert expected and out.stdout == expected + "\n"


class Pty:
    """A child process on a real pseudo-terminal, with expect-style reads."""

    def __init__(self, args):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True,
                                     env={**os.environ, "TERM": "dumb"})
        os.close(slave)
        self.buf = ""

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until `pattern` (a regex) appears; return the output before it and consume both."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.buf)):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; got {self.buf!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.buf += os.read(self.master, 4096).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"process ended before {pattern!r}; got {self.buf!r}") from None
        before, self.buf = self.buf[:m.start()], self.buf[m.end():]
        return before

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        rc = self.proc.wait(timeout=60)
        os.close(self.master)
        return rc


def test_interactive_chat_through_a_pty_keeps_history(run):
    ref = session(run)
    first, second = ref.reply("hello there"), ref.reply("how are you")
    rendered = ref.rendered_history()
    term = Pty(cli(run))
    try:
        term.expect(r"tokenfarm chat: .*\n")
        term.expect(r"you> ")
        term.send("hello there\n")
        term.expect(r"assistant> ")
        assert term.expect(r"\nyou> ") == first  # same answer as in-process and as --prompt
        term.send("how are you\n")
        term.expect(r"assistant> ")
        assert term.expect(r"\nyou> ") == second  # answered with the first turn in its context
        term.send("/history\n")
        shown = term.expect(r"\nyou> ")
        assert shown.endswith(rendered) and "<|user_start|>hello there<|user_end|><|assistant_start|>" in rendered
        term.send("/clear\n")
        term.expect(r"\(history cleared\)\nyou> ")
        term.send("hello there\n")
        term.expect(r"assistant> ")
        assert term.expect(r"\nyou> ") == first  # history gone: the first answer again
        term.send("\x04")  # Ctrl-D at the prompt ends the session
    finally:
        rc = term.close()
    assert rc == 0


def test_render_prompt_is_the_tokenized_conversation_then_assistant_start(run):
    tok = load_tokenizer(run.parents[2] / "tokenizer" / "encoding.json")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "x"}]
    ids = tok.render_prompt(msgs)
    assert ids == [tok.bos_id] + tok.render_chat(msgs)[0] + [tok.special["<|assistant_start|>"]]
    assert tok.decode(ids) == ("<|bos|><|user_start|>hi<|user_end|><|assistant_start|>hello<|assistant_end|>"
                               "<|user_start|>x<|user_end|><|assistant_start|>")


def test_history_drops_oldest_turns_to_fit_and_refuses_a_message_too_long(run):
    s = session(run, max_new_tokens=20)
    long_turn = " ".join(["mountain garden"] * 8)
    for _ in range(3):
        s.reply(long_turn)
    # context 64: at most one earlier exchange fits beside the new message and the 20-token answer
    messages, ids = s.fit(s.history + [{"role": "user", "content": "hi"}])
    assert len(ids) + 20 <= 64 and messages[-1]["content"] == "hi" and messages[0]["role"] == "user"
    assert messages == (s.history + [{"role": "user", "content": "hi"}])[-len(messages):]
    with pytest.raises(PipelineError, match="more than the model's context of 64"):
        s.reply(" ".join(["winter"] * 80))


def test_bad_checkpoint_is_one_clear_error(run, tmp_path):
    out = subprocess.run(cli(tmp_path / "nope.pt", "--tokenizer", str(run.parents[2] / "tokenizer" / "encoding.json"),
                             "--prompt", "x"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("error: checkpoint")
    # without --tokenizer the checkpoint is still what is named (its run's tokenizer is looked for after it)
    with pytest.raises(PipelineError) as e:
        chat_main(["--ckpt", str(tmp_path / "nope.pt"), "--prompt", "x"])
    assert str(e.value) == f"checkpoint {tmp_path / 'nope.pt'} does not exist"
    # a file that is no checkpoint is the wrong file to pass, not a checkpoint to delete and write again
    for wrong, why in ((ROOT / "README.md", "not the zip archive torch.save writes"),
                       (tmp_path / "notes.zip", "RuntimeError: ")):
        if wrong.suffix == ".zip":
            zipfile.ZipFile(wrong, "w").writestr("notes.txt", "hello")
        with pytest.raises(PipelineError) as e:
            chat_main(["--ckpt", str(wrong), "--tokenizer", str(run.parents[2] / "tokenizer" / "encoding.json"),
                       "--prompt", "x"])
        msg = str(e.value)
        assert msg.startswith(f"{wrong} is not a readable PyTorch checkpoint ({why}") and "\n" not in msg
        assert msg.endswith("); pass R/train/<stage>/final.pt of a trained run, or an exported Hugging Face directory")


def test_an_exported_hugging_face_directory_is_chatted_with_as_its_checkpoint(run, tmp_path):
    # `--ckpt R/export/hf` (the export rule's output) is read through the --from-hf import: the same
    # answer as its final.pt, with the run's tokenizer found from the directory as for a checkpoint
    from pipeline.evaluation.export import export
    from pipeline.model.checkpoint_io import load_checkpoint

    state = load_checkpoint(run)  # (the fixture's params are not its tokenizer's run: keep model and train only)
    save_checkpoint(tmp_path / "final.pt", {"model": state["model"],
                                            "params": {k: state["params"][k] for k in ("model", "train")}})
    tok = run.parents[2] / "tokenizer" / "encoding.json"
    hf = export(tmp_path / "final.pt", tok, run.parents[2] / "export" / "hf", force=True)
    out = subprocess.run(cli(hf, "--prompt", "hello there"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == session(run).reply("hello there") + "\n"
    import shutil  # a copy outside the run: the tokenizer to pass is named
    shutil.copytree(hf, tmp_path / "my-model")
    out = subprocess.run(cli(tmp_path / "my-model", "--prompt", "hi"), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: no tokenizer/encoding.json"), out.stderr
    assert "pass --tokenizer R/tokenizer/encoding.json" in out.stderr


def test_a_damaged_final_pt_is_refused_not_chatted_with(run, tmp_path):
    # 4 KB zeroed inside the weights of a final.pt: it would load (and answer) without its checksum
    import shutil

    from pipeline.model.checkpoint_io import checksum_path

    ckpt = tmp_path / "final.pt"
    shutil.copy(run, ckpt)
    shutil.copy(checksum_path(run), checksum_path(ckpt))
    with open(ckpt, "r+b") as f:
        f.seek(ckpt.stat().st_size // 2)
        f.write(bytes(4096))
    out = subprocess.run(cli(ckpt, "--tokenizer", str(run.parents[2] / "tokenizer" / "encoding.json"),
                             "--prompt", "hi"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {ckpt} is corrupt (sha256 mismatch with final.pt.sha256); delete it and rerun snakemake: the train "
        "rule rewrites it (and reruns what was made from it; `snakemake -R train` retrains every stage)")
