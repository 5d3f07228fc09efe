"""Talk to a trained model in the terminal, or answer one prompt for a script.

    python -m pipeline.evaluation.chat --ckpt R/train/<stage>/final.pt            # interactive
    python -m pipeline.evaluation.chat --ckpt R/train/sft/final.pt --prompt "Hi"   # one answer, then exit
    python -m pipeline.evaluation.chat --ckpt R/export/hf                         # an exported directory

`ChatSession` renders the conversation with the run's chat template and answers with the KV-cache engine
(pipeline/model/engine.py), dropping the oldest turns when the context is full; `answer_questions` is the
evaluate stage's one-shot use. Commands: ``/clear``, ``/history``, ``/quit``.

When an answer ends, the history, the tokenizer lookup and sampling: docs/evaluation.md, "Chat in the
terminal".
"""
from __future__ import annotations

import argparse
import codecs
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import RunLayout
from pipeline.data.encoding import ASSISTANT_END, ASSISTANT_START, BOS, EOS, USER_START, load_tokenizer
from pipeline.errors import PipelineError
from pipeline.io import get_logger, run_cli
from pipeline.model.engine import Engine
from pipeline.model.load import load_model
from pipeline.model.state_dict_adapter import PROVENANCE, is_hf_dir, read_hf_json

log = get_logger(__name__)

COMMANDS = ("/clear", "/history", "/quit")


def find_tokenizer(ckpt_path: str | Path) -> Path:
    """The run's encoding.json next to the checkpoint's run directory (docs/evaluation.md, "Chat in the terminal")."""
    for parent in Path(ckpt_path).resolve().parents:
        candidate = Path(RunLayout.at(parent).tokenizer())
        if candidate.exists():
            return candidate
    raise PipelineError(f"no tokenizer/encoding.json in any parent directory of {ckpt_path}; pass --tokenizer "
                        "R/tokenizer/encoding.json of the run that trained it")


def check_exported_tokenizer(ckpt_path: str | Path, tokenizer) -> None:
    """An exported directory names the tokenizer it was exported with (tokenfarm.json): refuse another.
    (Its own tokenizer.json is the Hugging Face rendering of ours; chat needs ours.)"""
    if not is_hf_dir(ckpt_path) or not (Path(ckpt_path) / PROVENANCE).exists():
        return
    want = read_hf_json(Path(ckpt_path) / PROVENANCE).get("tokenizer_sha256")
    if want and want != tokenizer.sha256:
        raise PipelineError(f"{tokenizer.path} is not the tokenizer {ckpt_path} was exported with (sha256 {want[:12]}… "
                            "in its tokenfarm.json); pass --tokenizer R/tokenizer/encoding.json of the run that "
                            "trained it")


def stop_ids(tokenizer) -> list[int]:
    """Tokens that end an answer (docs/evaluation.md, "Chat in the terminal")."""
    names = (ASSISTANT_END, BOS, EOS, USER_START, ASSISTANT_START)
    return [tokenizer.special[t] for t in names if t in tokenizer.special]


class ChatSession:
    """A conversation with a model: history, rendering with the template, streamed answers."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, temperature: float = 0.8,
                 top_k: int | None = 50, seed: int = 0):
        self.engine = Engine(model)
        self.tokenizer = tokenizer
        self.context = model.cfg.max_seq_len
        self.max_new_tokens = max(1, min(max_new_tokens, self.context - 1))
        self.temperature, self.top_k = temperature, top_k
        self.generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        self.stop = stop_ids(tokenizer)
        self.history: list[dict] = []

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """Drop the oldest turns until the prompt leaves room for the answer (docs/evaluation.md)."""
        while True:
            ids = self.tokenizer.render_prompt(messages)
            if len(ids) + self.max_new_tokens <= self.context or len(messages) == 1:
                break
            messages = messages[2:] if len(messages) > 2 else messages[-1:]
        if len(ids) >= self.context:
            raise PipelineError(f"the message takes {len(ids)} tokens with the template, more than the model's "
                                f"context of {self.context}; send a shorter one")
        return messages, ids

    def reply(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """Answer ``text`` given the history; stream pieces of the answer to ``on_text``."""
        messages, ids = self.fit(self.history + [{"role": "user", "content": text}])
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces = []
        for (tok,) in self.engine.stream([ids], self.max_new_tokens, self.temperature, self.top_k, self.stop,
                                         self.generator):
            if tok is None:
                break
            piece = decoder.decode(self.tokenizer.enc.decode_single_token_bytes(tok))
            pieces.append(piece)
            if on_text and piece:
                on_text(piece)
        pieces.append(decoder.decode(b"", final=True))
        answer = "".join(pieces)
        self.history = messages + [{"role": "assistant", "content": answer}]
        return answer

    def rendered_history(self) -> str:
        if not self.history:
            return "(empty)"
        return self.tokenizer.decode(self.tokenizer.render_prompt(self.history)[:-1])


def answer_questions(model, tokenizer, questions: list[str], max_new_tokens: int) -> list[dict]:
    """Greedy single-turn answers to `questions`, one batch through the engine (the stage report's
    sample answers): ``[{"question", "answer", "ended"}]``, `ended` = why the answer stopped."""
    if not questions:
        return []
    room = model.cfg.max_seq_len - max(len(tokenizer.render_prompt([{"role": "user", "content": q}]))
                                       for q in questions)
    if room < 1:
        raise PipelineError(f"a chat question does not fit the model's context of {model.cfg.max_seq_len} tokens; "
                            "shorten eval.chat_questions")
    prompts = [tokenizer.render_prompt([{"role": "user", "content": q}]) for q in questions]
    out = Engine(model).generate(prompts, min(max_new_tokens, room), stop_ids=stop_ids(tokenizer))
    return [{"question": q, "answer": tokenizer.decode(g.tokens), "ended": g.reason} for q, g in zip(questions, out)]


def interactive(session: ChatSession, banner: str) -> None:
    print(banner, flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            return
        if text == "/clear":
            session.history = []
            print("(history cleared)", flush=True)
            continue
        if text == "/history":
            print(session.rendered_history(), flush=True)
            continue
        print("assistant> ", end="", flush=True)
        try:
            session.reply(text, on_text=lambda s: print(s, end="", flush=True))
        except PipelineError as e:
            print(f"\nerror: {e}", flush=True)
            continue
        print(flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluation.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="R/train/<stage>/final.pt, or an exported Hugging Face directory")
    p.add_argument("--tokenizer", default=None, help="encoding.json (default: the run's, found from --ckpt)")
    p.add_argument("--prompt", default=None, help="answer this one message on stdout and exit (for scripts)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PipelineError("--device cuda but no CUDA device is visible; use --device cpu")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    model = load_model(args.ckpt, device)  # first: a wrong --ckpt is named as such, not as a missing tokenizer
    tokenizer = load_tokenizer(args.tokenizer or find_tokenizer(args.ckpt))
    check_exported_tokenizer(args.ckpt, tokenizer)
    if tokenizer.n_vocab > model.cfg.vocab_size:
        raise PipelineError(f"{tokenizer.path} has {tokenizer.n_vocab} ids but the model of {args.ckpt} only "
                            f"{model.cfg.vocab_size}: pass the --tokenizer of the run that trained it")
    session = ChatSession(model, tokenizer, args.max_new_tokens, args.temperature, args.top_k or None, args.seed)
    if args.prompt is not None:
        print(session.reply(args.prompt))
        return
    interactive(session, f"tokenfarm chat: {args.ckpt} ({', '.join(COMMANDS)}; Ctrl-D exits)")


if __name__ == "__main__":
    run_cli(main)
