"""The run's encoding as every stage uses it: `Tokenizer` (a `tiktoken.Encoding` plus our special
tokens, the document-delimiter policy and the chat rendering) and `load_tokenizer`, the one reader of
`R/tokenizer/encoding.json` (written by the tokenizer stage, `pipeline.data.train_tokenizer`; format in
docs/data-contract.md).

Special tokens (all inside the vocabulary, at the top ids, in this order): `<|bos|>` (always; the
document delimiter), `<|eos|>` (only for `delimiter: eos|both`), then the chat tokens
`<|user_start|>`, `<|user_end|>`, `<|assistant_start|>`, `<|assistant_end|>`. Ordinary text is always
encoded with `encode_ordinary`, so a literal "<|bos|>" inside a document is just text.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from pipeline.errors import PipelineError

BOS, EOS = "<|bos|>", "<|eos|>"
USER_START, USER_END = "<|user_start|>", "<|user_end|>"
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"


CHAT_TOKENS = (USER_START, USER_END, ASSISTANT_START, ASSISTANT_END)
CHAT_ROLES = ("system", "user", "assistant")


DELIMITERS = ("bos", "eos", "both")


RANKS_FILE = "tokenizer.tiktoken"


DEFAULT_THREADS = 1  # Snakemake runs one job per core; pass more for interactive use.


def special_token_names(delimiter: str) -> list[str]:
    """The special tokens a tokenizer with this delimiter policy reserves, in id order."""
    if delimiter not in DELIMITERS:
        raise PipelineError(f"config key 'tokenizer.delimiter': {delimiter!r} is not one of {', '.join(DELIMITERS)}")
    return [BOS] + ([EOS] if delimiter in ("eos", "both") else []) + list(CHAT_TOKENS)


class Tokenizer:
    """A `tiktoken.Encoding` plus the run's special tokens and document-delimiter policy."""

    def __init__(self, enc: tiktoken.Encoding, special: dict[str, int], delimiter: str, sha256: str, path: str):
        self.enc = enc
        self.special = dict(special)
        self.delimiter = delimiter
        self.sha256 = sha256
        self.path = path
        self.n_vocab = enc.n_vocab
        self.bos_id = self.special[BOS]
        self.eos_id = self.special.get(EOS)

    def __repr__(self) -> str:
        return f"Tokenizer({self.enc.name!r}, n_vocab={self.n_vocab}, delimiter={self.delimiter!r})"

    def encode_batch(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[list[int]]:
        """Token ids of each text as ordinary text (special-token strings are never interpreted)."""
        if num_threads == 1:  # skip tiktoken's thread pool: same result, no per-document future
            return [self.enc.encode_ordinary(t) for t in texts]
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def encode_arrays(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[np.ndarray]:
        """`encode_batch` as uint32 arrays. One thread: tiktoken's `encode_to_numpy` with no special
        token allowed or disallowed (ordinary text, as `encode_ordinary`), which fills a buffer in
        Rust and so skips building a Python list of ints per document."""
        if num_threads == 1:
            return [self.enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        return [np.asarray(ids, np.uint32) for ids in self.enc.encode_ordinary_batch(texts, num_threads=num_threads)]

    def count_tokens(self, texts: list[str], num_threads: int = DEFAULT_THREADS) -> list[int]:
        """Number of tokens of each text, as `map(len, encode_batch(texts))` but without holding all
        the batch's token lists at once (each is freed as soon as it is counted)."""
        if num_threads == 1:
            return [len(self.enc.encode_to_numpy(t, disallowed_special=())) for t in texts]
        return list(map(len, self.enc.encode_ordinary_batch(texts, num_threads=num_threads)))

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def delimit(self, ids: list[int]) -> list[int]:
        """One document's ids with the delimiter policy applied: bos → [bos]+ids, eos → ids+[eos],
        both → [bos]+ids+[eos]."""
        head = [self.bos_id] if self.delimiter in ("bos", "both") else []
        tail = [self.eos_id] if self.delimiter in ("eos", "both") else []
        return head + list(ids) + tail

    def n_delimiters(self) -> int:
        """Delimiter tokens `delimit` adds to every document."""
        return 2 if self.delimiter == "both" else 1

    def render_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Ids and 0/1 loss mask of a conversation under the chat template: the one definition used by
        count and tokenize (mid-training and SFT data), the chat CLI and the evaluation.

        Template (each `<|...|>` is one reserved special id; content is ordinary text)::

            <|user_start|> user text <|user_end|> <|assistant_start|> answer <|assistant_end|>   (repeated)

        Turns may alternate for any number of rounds (multi-turn); roles are `system`, `user` and
        `assistant`. A `system` turn has no markers of its own (no reserved ids, so every tokenizer
        keeps its vocabulary): its content opens the next user turn, followed by a blank line
        (`<|user_start|> system text \n\n user text <|user_end|>`; several system turns join with
        blank lines); with no user turn before the next assistant turn (or the end) it is a user turn
        of its own. So it is rendered and never a loss target. The mask is 1 on exactly the
        assistant's content tokens and its `<|assistant_end|>` (so the model learns to stop), 0 on
        the user and system text and on `<|assistant_start|>`. No delimiter is added: the tokenize
        stage applies `delimit` to the result (a stored conversation is `<|bos|>` + this under the
        bos policy) and `render_prompt` adds the same head. `chat_template()` below is this as Jinja
        (what the Hugging Face export ships): a change here is a change there.

        ValueError (the caller names the file and row): a role other than system/user/assistant, or
        a conversation with no assistant turn (nothing to learn under the assistant-only loss; the
        reader counts those as `no_assistant` and never passes them here). Conversations without any
        content are not rendered: the reader counts them as empty.
        """
        rendered = self._render_turns(messages)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("conversation has no assistant turn")
        return rendered

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """Ids that ask the model for the next assistant turn after `messages` (ending with a user
        turn): the delimiter head a stored conversation starts with, the rendered turns, then
        `<|assistant_start|>`. The engine generates until `<|assistant_end|>`."""
        head = [self.bos_id] if self.delimiter in ("bos", "both") else []
        return head + self._render_turns(messages)[0] + [self.special[ASSISTANT_START]]

    def _render_turns(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        system = ""  # system text waiting for the next user turn

        def user_turn(text: str) -> None:
            part = [self.special[USER_START], *self.encode(text), self.special[USER_END]]
            ids.extend(part)
            mask.extend([0] * len(part))

        for m in messages:
            if m["role"] == "system":
                system = f"{system}\n\n{m['content']}" if system else m["content"]
            elif m["role"] == "user":
                user_turn(f"{system}\n\n{m['content']}" if system else m["content"])
                system = ""
            elif m["role"] == "assistant":
                if system:
                    user_turn(system)
                    system = ""
                content = self.encode(m["content"])
                ids += [self.special[ASSISTANT_START], *content, self.special[ASSISTANT_END]]
                mask += [0] + [1] * (len(content) + 1)
            else:
                raise ValueError(f"chat role {m['role']!r} is not one of {', '.join(map(repr, CHAT_ROLES))}")
        if system:
            user_turn(system)
        return ids, mask


def chat_template() -> str:
    """`Tokenizer.render_chat` as a Jinja chat template (the Hugging Face export ships it; its test
    renders both on the sample conversations): <|bos|>, then user and assistant turns between their
    markers, no separators; a system turn's text opens the next user turn (a blank line
    between), or is a user turn of its own when an assistant turn or the end comes first;
    add_generation_prompt opens an assistant turn."""

    def user(text: str) -> str:
        return f"{USER_START}{{{{ {text} }}}}{USER_END}"

    return (
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{% set ns.system = ns.system + '\\n\\n' + message['content'] if ns.system else message['content'] %}"
        "{% elif message['role'] == 'user' %}"
        + user("ns.system + '\\n\\n' + message['content'] if ns.system else message['content']")
        + "{% set ns.system = '' %}"
        "{% elif message['role'] == 'assistant' %}"
        "{% if ns.system %}" + user("ns.system") + "{% set ns.system = '' %}{% endif %}"
        f"{ASSISTANT_START}{{{{ message['content'] }}}}{ASSISTANT_END}"
        "{% else %}{{ raise_exception('chat role ' + message['role'] + ' is not system, user or assistant') }}"
        "{% endif %}{% endfor %}"
        "{% if ns.system %}" + user("ns.system") + "{% endif %}"
        f"{{% if add_generation_prompt %}}{ASSISTANT_START}{{% endif %}}"
    )


def tokenizer_sha256(ranks_bytes: bytes, special: dict[str, int], pattern: str, delimiter: str) -> str:
    """Identity of a tokenizer: sha256 of canonical JSON of the ranks file's sha256, the special
    tokens, the split pattern and the delimiter policy (bos and both reserve the same tokens but
    tokenize documents differently, so the policy is part of the identity)."""
    ident = {
        "ranks_sha256": hashlib.sha256(ranks_bytes).hexdigest(),
        "special_tokens": dict(sorted(special.items())),
        "pattern": pattern,
        "delimiter": delimiter,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `encoding.json` and its ranks file into a Tokenizer; verifies the sha256."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        ranks_path = path.parent / spec["ranks_file"]
        special, pattern, delimiter, sha256 = spec["special_tokens"], spec["pattern"], spec["delimiter"], spec["sha256"]
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"{path}: not a readable encoding.json ({e!r}); rerun the tokenizer rule") from None
    if not ranks_path.exists():
        raise PipelineError(f"{path}: its ranks file {ranks_path} is missing; rerun the tokenizer rule")
    ranks, ranks_bytes = load_ranks(ranks_path)
    if tokenizer_sha256(ranks_bytes, special, pattern, delimiter) != sha256:
        raise PipelineError(f"{path}: sha256 does not match {ranks_path} (files from different runs?); rerun the "
                            "tokenizer rule")
    enc = tiktoken.Encoding(spec.get("name", path.stem), pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    return Tokenizer(enc, special, delimiter, sha256, str(path))


def format_ranks(ranks: dict[bytes, int]) -> bytes:
    """The bytes `tiktoken.load.dump_tiktoken_bpe` writes (one `base64(token) rank` line per token, by
    rank), for the caller's atomic write: tiktoken's writer itself needs `blobfile` (not a dependency)
    and writes in place. `load_ranks` reads them back with tiktoken's reader."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


def load_ranks(path: str | os.PathLike) -> tuple[dict[bytes, int], bytes]:
    """(ranks, the file's bytes) of a `.tiktoken` ranks file, parsed by tiktoken's own reader
    (`tiktoken.load.load_tiktoken_bpe`). Its read cache is keyed by path, so it is held to the sha256
    of the bytes read here: a tokenizer retrained at the same path is never served stale."""
    data = Path(path).read_bytes()
    try:
        ranks = load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(data).hexdigest())
    except ValueError as e:
        raise PipelineError(f"{path}: not a tiktoken ranks file ({e}); rerun the tokenizer rule") from None
    return ranks, data
