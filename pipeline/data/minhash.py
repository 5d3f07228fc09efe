"""Vectorised text normalisation, shingling and MinHash signatures (the maths behind pipeline.data.dedup).

    wh, off = doc_word_hashes(texts)                 # normalised words, per document
    sh, soff = shingle_hashes(wh, off, ngram)        # its n-gram shingles
    sig = signatures(sh, soff, permutations(num_perm, seed))   # uint64 [docs, num_perm]; band_keys(sig, b, r)

Every function is pure; `pipeline.data.dedup` does the file handling. The normalisation, the hashes and the
band keys, defined exactly: docs/data-stages.md, "MinHash".
"""
from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

__all__ = [
    "normalize_text",
    "word_hash",
    "shingle_hash32",
    "doc_word_hashes",
    "exact_hashes",
    "shingle_hashes",
    "permutations",
    "signatures",
    "band_keys",
    "estimated_jaccard",
    "fmix64",
]

U64 = np.uint64
U32 = np.uint32
U8 = np.uint8
WORD_SEED = U64(0x2545F4914F6CDD1D)
CHAIN_MULT = U64(0xFF51AFD7ED558CCD)
SHINGLE_SEED = U64(0x9E3779B97F4A7C15)
SHINGLE_MULT = U64(0xD6E8FEB86659FD93)
# Mask keeping the first `n` bytes of a little-endian uint64, n = 0..8.
_BYTE_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=U64)
_ASCII_FOLD = {c: (chr(c).lower() if chr(c).isalnum() else " ") for c in range(128)}


# ----------------------------------------------------------------------------- hash primitives

def _mix(acc: np.ndarray, x: np.ndarray) -> np.ndarray:
    m = (acc ^ x) * CHAIN_MULT
    return m ^ (m >> U64(32))


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser on uint64 arrays: a bijection that avalanches every bit."""
    h = h ^ (h >> U64(33))
    h = h * U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> U64(33))
    h = h * U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> U64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3 32-bit finaliser: datasketch's pre-mix for the affine32 scheme."""
    h = h ^ (h >> U32(16))
    h = h * U32(0x85EBCA6B)
    h = h ^ (h >> U32(13))
    h = h * U32(0xC2B2AE35)
    return h ^ (h >> U32(16))


def _shingle32(word_hashes: np.ndarray) -> int:
    """32-bit hash of one shingle from its word hashes (see module doc)."""
    acc = np.array([SHINGLE_SEED], dtype=U64)
    for h in word_hashes:
        acc = acc * SHINGLE_MULT + h
    return int(acc[0] >> U64(32))


def word_hash(word: bytes) -> int:
    """Scalar reference of the 64-bit word hash (see module doc)."""
    acc = np.array([len(word) + 1], dtype=U64) * WORD_SEED
    for i in range(0, len(word), 8):
        acc = _mix(acc, U64(int.from_bytes(word[i:i + 8], "little")))
    return int(acc[0])


def shingle_hash32(shingle: bytes) -> int:
    """32-bit hash of one shingle given as its words joined by single spaces.

    The scalar reference: passed as `hashfunc` to `datasketch.MinHash` it reproduces `signatures`.
    """
    return _shingle32(np.array([word_hash(w) for w in shingle.split()], dtype=U64))


# ----------------------------------------------------------------------------- normalisation

def _ascii_words(text: str) -> list[str]:
    return [w for w in text.translate(_ASCII_FOLD).split(" ") if w]


def _fold_word(word: str) -> list[str]:
    """Step 2 of the normalisation, for a word containing non-ASCII characters: 0 or more words."""
    folded = unicodedata.normalize("NFKC", word).lower()
    return _ascii_words("".join(c if c.isascii() or unicodedata.category(c)[0] in "LNM" else " " for c in folded))


def normalize_text(text: str) -> str:
    """The normalised text of one document (scalar reference of `doc_word_hashes`)."""
    words = _ascii_words(text)
    return " ".join(v for w in words for v in ([w] if w.isascii() else _fold_word(w)))


def _lowered_bytes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of all documents back to back with ASCII A-Z lower-cased (plus 8 zero bytes of
    padding for the 8-byte loads), and the int64 byte offsets of the documents (n_docs + 1)."""
    texts = pc.fill_null(texts.cast(pa.large_string()), "")
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset:texts.offset + len(texts) + 1]
    data = np.frombuffer(texts.buffers()[2] or b"", dtype=U8)[int(offsets[0]):int(offsets[-1])]
    buf = np.zeros(len(data) + 8, dtype=U8)
    np.add(data, ((data - U8(65)) < U8(26)).view(U8) * U8(32), out=buf[:len(data)])
    return buf, offsets - offsets[0]


def _is_word_byte(data: np.ndarray) -> np.ndarray:
    """Which bytes of lower-cased text belong to words: a-z, 0-9 and every byte >= 0x80."""
    is_word = data.view(np.int8) < 0
    scratch, flag = np.empty_like(data), np.empty_like(is_word)
    for first, count in ((ord("a"), 26), (ord("0"), 10)):
        np.less(np.subtract(data, U8(first), out=scratch), U8(count), out=flag)
        np.logical_or(is_word, flag, out=is_word)
    return is_word


def _word_bounds(buf: np.ndarray, doc_off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) byte positions of every word; a word never runs across two documents."""
    data = buf[:-8]
    is_word = _is_word_byte(data)
    change = np.empty(len(data) + 1, dtype=bool)  # word/separator transitions, at 0 and N too
    change[0], change[-1] = is_word[:1].any(), is_word[-1:].any()
    np.not_equal(is_word[1:], is_word[:-1], out=change[1:-1])
    inner = np.unique(doc_off[1:-1])  # empty documents repeat an offset
    inner = inner[(inner > 0) & (inner < len(data))]
    cut = inner[is_word[inner] & is_word[inner - 1]]  # a word touching the next document's word
    bounds = np.flatnonzero(change)
    if len(cut):  # a cut is both the end of one word and the start of the next
        bounds = np.insert(bounds, np.searchsorted(bounds, cut).repeat(2), cut.repeat(2))
    return bounds[0::2], bounds[1::2]


def _hash_words(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Vectorised `word_hash` of the words at `buf[starts[i]:starts[i] + lengths[i]]`."""
    loads = np.ndarray(shape=(len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))  # unaligned 8-byte loads
    acc = _mix((lengths.astype(U64) + U64(1)) * WORD_SEED, loads[starts] & _BYTE_MASKS[np.minimum(lengths, 8)])
    todo = np.flatnonzero(lengths > 8)  # words with more 8-byte chunks (few)
    for k in range(8, int(lengths.max(initial=0)), 8):
        rem = np.minimum(lengths[todo] - k, 8)
        acc[todo] = _mix(acc[todo], loads[starts[todo] + k] & _BYTE_MASKS[rem])
        todo = todo[lengths[todo] > k + 8]
    return acc


def _expand(wh: np.ndarray, which: np.ndarray, replacements: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Replace word `which[i]` by the words hashed in `replacements[i]` (0 or more). Returns the new
    hash array and `new_index` (n_words + 1) mapping old word positions to new ones."""
    counts = np.ones(len(wh), dtype=np.int64)
    counts[which] = [len(r) for r in replacements]
    new_index = np.zeros(len(wh) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_index[1:])
    out = np.repeat(wh, counts)
    if replacements:
        flat = np.concatenate(replacements)
        first = np.cumsum(counts[which]) - counts[which]  # index in `flat` of each group's first word
        out[np.repeat(new_index[which] - first, counts[which]) + np.arange(len(flat))] = flat
    return out, new_index


def doc_word_hashes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Normalise a string array of documents (nulls count as empty) and hash every word.

    Returns (uint64 word hashes of all documents in order, int64 offsets of n_docs + 1): document
    `d`'s normalised words hash to `wh[off[d]:off[d+1]]`.
    """
    buf, doc_off = _lowered_bytes(texts)
    starts, ends = _word_bounds(buf, doc_off)
    wh = _hash_words(buf, starts, ends - starts)
    word_off = np.searchsorted(starts, doc_off).astype(np.int64)
    non_ascii = np.unique(np.searchsorted(starts, np.flatnonzero(buf >= 0x80), side="right") - 1)
    if len(non_ascii) == 0:
        return wh, word_off
    raw = [buf[s:e].tobytes().decode("utf-8") for s, e in zip(starts[non_ascii], ends[non_ascii])]
    hashed = {w: np.array([word_hash(v.encode()) for v in _fold_word(w)], dtype=U64) for w in set(raw)}
    wh, new_index = _expand(wh, non_ascii, [hashed[w] for w in raw])
    return wh, new_index[word_off]


def exact_hashes(wh: np.ndarray, word_off: np.ndarray) -> np.ndarray:
    """Per-document exact hash: xxh3_64 of the document's word hashes (little-endian uint64 bytes)."""
    data = wh.astype("<u8")
    return np.fromiter((xxhash.xxh3_64_intdigest(data[a:b].tobytes()) for a, b in zip(word_off[:-1], word_off[1:])),
                       dtype=U64, count=len(word_off) - 1)


# ----------------------------------------------------------------------------- shingles

def shingle_hashes(wh: np.ndarray, word_off: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hash every shingle of every document: returns (uint32 hashes, int64 offsets of n_docs + 1).

    Document `d` owns hashes `[off[d], off[d+1])`: its `n_words - ngram + 1` word n-grams in order,
    or exactly one shingle of all its words when it has fewer than `ngram` words.
    """
    n_words = np.diff(word_off)
    short = n_words < ngram
    off = np.zeros(len(n_words) + 1, dtype=np.int64)
    np.cumsum(np.where(short, 1, n_words - ngram + 1), out=off[1:])

    n_windows = max(len(wh) - ngram + 1, 0)
    windows = np.empty(0, dtype=U32)
    if n_windows:  # ngram <= the batch's words: the loops below are bounded by the data, not by `ngram`
        acc = np.full(n_windows, SHINGLE_SEED, dtype=U64)
        for j in range(ngram):  # Horner's rule over every window of `ngram` consecutive words
            np.multiply(acc, SHINGLE_MULT, out=acc)
            np.add(acc, wh[j:j + n_windows], out=acc)
        within_doc = np.ones(n_windows, dtype=bool)  # windows that end before their document's end
        for j in range(1, ngram):
            last = word_off[1:] - j
            within_doc[last[(last >= 0) & (last < n_windows)]] = False
        windows = (acc[within_doc] >> U64(32)).astype(U32)
    if not short.any():
        return windows, off
    out = np.empty(int(off[-1]), dtype=U32)
    short_slot = np.zeros(len(out), dtype=bool)
    short_slot[off[:-1][short]] = True
    out[~short_slot] = windows
    out[short_slot] = [_shingle32(wh[word_off[d]:word_off[d + 1]]) for d in np.flatnonzero(short)]
    return out, off


# ----------------------------------------------------------------------------- MinHash

def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) uint32 permutation parameters, drawn exactly as datasketch's affine32 MinHash draws them."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=U32) * U32(2) + U32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=U32)
    return a, b


def signatures(hashes: np.ndarray, offsets: np.ndarray, perms: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """MinHash signatures, (n_docs, num_perm) uint32, of documents whose shingle hashes are
    `hashes[offsets[d]:offsets[d+1]]` (every document has at least one shingle).

    One permutation at a time over all shingles of the batch (a row that stays in cache), then
    the per-document minimum with one `np.minimum.reduceat`.
    """
    a, b = perms
    sig = np.empty((len(offsets) - 1, len(a)), dtype=U32)
    if not len(sig):
        return sig
    pre = _fmix32(hashes)
    row = np.empty_like(pre)
    for k in range(len(a)):
        np.multiply(pre, a[k], out=row)
        np.add(row, b[k], out=row)
        sig[:, k] = np.minimum.reduceat(row, offsets[:-1])
    return sig


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n_docs, bands) uint64 keys, one per LSH band of `rows` consecutive signature values."""
    grid = sig[:, :bands * rows].reshape(len(sig), bands, rows).astype(U64)
    acc = np.broadcast_to(fmix64(np.arange(1, bands + 1, dtype=U64)), grid.shape[:2])
    for r in range(rows):
        acc = _mix(acc, grid[:, :, r])
    return fmix64(acc)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Row-wise fraction of equal signature positions: the MinHash estimate of Jaccard similarity."""
    return (sig_a == sig_b).mean(axis=-1)
