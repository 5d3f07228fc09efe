"""fastText's supervised prediction (lid.176's language ID) read from the model file and run in numpy.

`load(path)` parses a model once per process (Args, the dictionary with its pruned n-gram index, the product-
quantized or dense input matrix, the hierarchical-softmax output); `Model.predict(text, k)` returns what
fasttext-predict's ``predict`` returns for ``text`` as one line (``k`` 1, or -1 for every label it returns);
`Model.predict_many(texts)` is ``predict(t)`` of each, computed in batches. A line's hidden vector is the mean of
the input rows of its tokens (its UTF-8 split at fastText's seven whitespace bytes; a word's dictionary id and the
FNV-1a hashes of the character 2..4-grams of ``<word>``; the end-of-line token), so each distinct word's row sum
and row count are cached: a batch of documents costs a numpy split, a look-up per word and one sum. It holds at most
`CACHE_WORDS` words and is emptied when full; no result depends on its state. The output is fastText's hierarchical
softmax (sigmoids clipped as log(x + 1e-5), the top label's score summed root to leaf in float32, its depth-first
search when the top two labels nearly tie); the sums are float64 where fastText's are float32, so a probability can
differ from fasttext-predict's in its last digits. docs/filters.md, "Language ID on a sample": design, agreement.
"""
from __future__ import annotations

import functools
import math
import struct
from collections import Counter
from itertools import repeat
from pathlib import Path
from typing import Sequence

import numpy as np

CACHE_WORDS = 1 << 20
"""The most distinct words whose row sums a process keeps (`Model`'s cache, emptied when full): 17 float64, two 64-bit
keys and two places of the index per word (docs/filters.md has its memory measured)."""

EOS = b"</s>"  # fastText's end-of-line token: a word equal to it ends the line
_FNV_OFFSET, _FNV_PRIME = np.uint32(2166136261), np.uint32(16777619)
_TIE = 1e-3  # log-probability gap under which the top label is found by fastText's own tree search
_FLOOR = np.float32(math.log(0.0 + 1e-5))  # std_log(threshold 0): the search skips a subtree scoring under it
_CHUNK_WORDS = 8192  # new words whose n-grams are hashed at once (bounds the temporary arrays)
_CHUNK_BYTES = 1 << 20  # text read at once (bounds the temporary arrays)
_SPACE = np.zeros(256, dtype=bool)
_SPACE[list(b" \t\n\v\f\r")] = True  # where readWord splits (and at NUL, replaced by a space first)
_MASK = np.array([(1 << 8 * i) - 1 for i in range(9)], dtype=np.uint64)  # the low i bytes


def _unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(key, axis=0, return_index=True, return_inverse=True)`` of n x 2 keys, by one sort."""
    order = np.argsort(key[:, 0]) if not key[:, 1].any() else np.lexsort((key[:, 1], key[:, 0]))
    ordered = key[order]
    new = np.ones(len(key), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    group = np.cumsum(new) - 1
    inverse = np.empty(len(key), dtype=np.intp)
    inverse[order] = group
    return ordered[new], order[new], inverse


def _home(k0: np.ndarray, k1: np.ndarray, size: int) -> np.ndarray:
    """A key's first place in an open-addressing index of ``size`` (a power of two) places."""
    h = k0 * np.uint64(0x9E3779B97F4A7C15) ^ k1 * np.uint64(0xC2B2AE3D27D4EB4F)
    return (h >> np.uint64(64 - size.bit_length() + 1)).astype(np.intp)


Prediction = tuple[tuple[str, ...], tuple[float, ...]]


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple:
        out = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return out

    def array(self, dtype: str, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += out.nbytes
        return out

    def word(self) -> bytes:
        end = self.data.index(b"\0", self.at)
        out, self.at = self.data[self.at:end], end + 1
        return out


def _matrix(r: _Reader, quantized: bool) -> np.ndarray:
    """A float32 matrix as fastText's QuantMatrix or DenseMatrix loads it; quantized rows decoded exactly as
    ProductQuantizer::addcode adds them (each centroid value times the row's norm, in float32)."""
    if not quantized:
        m, n = r.take("qq")
        return r.array("<f4", m * n).reshape(m, n)
    qnorm, m, n, codesize = r.take("?qqi")
    codes = r.array("u1", codesize)

    def quantizer() -> tuple[int, int, int, int, np.ndarray]:
        dim, nsubq, dsub, lastdsub = r.take("iiii")
        return dim, nsubq, dsub, lastdsub, r.array("<f4", dim * 256)

    dim, nsubq, dsub, lastdsub, centroids = quantizer()
    codes = codes.reshape(m, nsubq)
    out = np.empty((m, n), dtype=np.float32)
    for j in range(nsubq):
        d = lastdsub if j == nsubq - 1 else dsub
        block = centroids[j * 256 * dsub:j * 256 * dsub + 256 * d].reshape(256, d)
        out[:, j * dsub:j * dsub + d] = block[codes[:, j]]
    if qnorm:
        norm_codes = r.array("u1", m)
        norms = quantizer()[4]
        out *= norms[norm_codes][:, None]
    return out


class Model:
    """A supervised fastText model (hierarchical softmax, no word n-grams) with its per-process word cache."""

    def __init__(self, path: str | Path):
        r = _Reader(Path(path).read_bytes())
        magic, version = r.take("ii")
        if magic != 793712314 or version > 12:
            raise ValueError(f"{path}: not a fastText model file")
        (self.dim, _, _, _, _, word_ngrams, loss, model, self.bucket, self.minn, self.maxn, _), _ = \
            r.take("12i"), r.take("d")
        if version == 11 and model == 3:
            self.maxn = 0  # fastText: old supervised models use no character n-grams
        if model != 3 or loss != 1 or word_ngrams > 1:
            raise ValueError(f"{path}: only supervised models with a hierarchical softmax and no word n-grams")
        size, self.nwords, _, _, prune_size = r.take("iiiqq")
        entries = [(r.word(), *r.take("qb")) for _ in range(size)]
        pairs = r.array("<i4", 2 * max(prune_size, 0)).reshape(-1, 2)
        quant_input, = r.take("?")
        rows = _matrix(r, quant_input)
        quant_output, = r.take("?")
        out = _matrix(r, quant_input and quant_output).astype(np.float64)
        self._rows = rows.astype(np.float64)
        self._rows_t = np.ascontiguousarray(self._rows.T)  # dim x rows: a gather's sums run along rows
        self.word_id = {w: i for i, (w, _, _) in enumerate(entries[:self.nwords])}
        self.eos = self.word_id.get(EOS, -1)
        self.labels = tuple(w.decode() for w, _, kind in entries if kind == 1)
        # n-gram bucket -> input row (Dictionary::pushHash): all buckets, none, or the pruned index's
        if prune_size < 0:
            self._bucket_row = self._bucket_bits = None
        else:
            self._bucket_row = np.full(self.bucket, -1, dtype=np.int32)
            self._bucket_row[pairs[:, 0]] = self.nwords + pairs[:, 1]
            self._bucket_bits = np.packbits(self._bucket_row >= 0, bitorder="little")
        self._tree([c for _, c, kind in entries if kind == 1])
        self._out = out[:self._osz - 1]  # the tree's internal nodes' rows (the matrix has one per label)
        self._out_t = np.ascontiguousarray(self._out.T)
        self.clear()

    def _tree(self, counts: list[int]) -> None:
        """HierarchicalSoftmaxLoss::buildTree: each label's path from the root, as indices into a line's terms
        (`_terms`: each internal node's left-child term, then its right-child term, then a 0)."""
        osz = len(counts)
        count = [*counts, *[10 ** 15] * (osz - 1)]
        parent, right, left_of, right_of = [-1] * (2 * osz - 1), [False] * (2 * osz - 1), {}, {}
        leaf, node = osz - 1, osz
        for i in range(osz, 2 * osz - 1):
            mini = []
            for _ in range(2):
                if leaf >= 0 and count[leaf] < count[node]:
                    mini.append(leaf)
                    leaf -= 1
                else:
                    mini.append(node)
                    node += 1
            left_of[i], right_of[i] = mini
            count[i] = count[mini[0]] + count[mini[1]]
            parent[mini[0]] = parent[mini[1]] = i
            right[mini[1]] = True
        self._left, self._right, self._osz = left_of, right_of, osz
        paths = []
        for i in range(osz):
            path, j = [], i
            while parent[j] != -1:
                path.append((parent[j] - osz) + (osz - 1) * right[j])
                j = parent[j]
            paths.append(path[::-1])
        depth = max(map(len, paths))
        zero = 2 * (osz - 1)  # the 0 term pads the shorter paths
        self._paths = np.array([p + [zero] * (depth - len(p)) for p in paths], dtype=np.intp)  # label x depth

    # ------------------------------------------------------------------------------------------ the word cache

    def clear(self) -> None:
        """Empty the word cache (a new process starts so)."""
        self._n = 0  # words cached: each has a slot
        self._table = np.zeros((self.dim + 1, 1024))  # by slot: its rows' sum, then their count
        self._key = np.zeros((1024, 2), dtype=np.uint64)  # a slot's word, when it is at most 16 bytes
        self._index0 = np.zeros(1 << 12, dtype=np.uint64)  # open addressing: key -> slot, (0, 0) empty
        self._index1 = np.zeros(1 << 12, dtype=np.uint64)
        self._index_slot = np.zeros(1 << 12, dtype=np.intp)
        self._long: dict[bytes, int] = {}  # words over 16 bytes -> slot

    def word_rows(self, words: Sequence[bytes]) -> np.ndarray:
        """Each word's row sum and row count (``(len(words), dim + 1)`` float64): its dictionary id's row and
        its character n-grams' (Dictionary::computeSubwords, FNV-1a of the UTF-8 bytes, the pruned index)."""
        out = np.zeros((len(words), self.dim + 1))
        for a in range(0, len(words), _CHUNK_WORDS):
            out[a:a + _CHUNK_WORDS] = self._word_rows(words[a:a + _CHUNK_WORDS])
        return out

    def _word_rows(self, words: Sequence[bytes]) -> np.ndarray:
        n = len(words)
        out = np.zeros((n, self.dim + 1))
        joined = b"><".join(words)
        if b"__label__" in joined:  # a label ("__label__..." as a word) adds no row
            words = [b"" if w.startswith(b"__label__") else w for w in words]
            joined = b"><".join(words)
        ids = np.fromiter(map(self.word_id.get, words, repeat(-1)), dtype=np.intp, count=n)
        has = ids >= 0
        out[has, :-1] = self._rows[ids[has]]
        out[has, -1] = 1
        lengths = np.fromiter(map(len, words), dtype=np.intp, count=n)
        if self.maxn <= 0 or not lengths.any():
            return out
        buf = np.frombuffer(b"<" + joined + b">", dtype=np.uint8)  # each word as "<word>", one after another
        ends = np.cumsum(lengths + 2)
        if buf.max() < 0x80:  # ASCII: a byte is a character
            starts = np.arange(len(buf))
            owner = np.repeat(np.arange(n), lengths + 2)
            nchars = lengths + 2
        else:
            starts = np.flatnonzero((buf & 0xC0) != 0x80)  # the first byte of each character
            owner = np.searchsorted(ends, starts, side="right")  # the word each character is in
            nchars = np.bincount(owner, minlength=n)
        place = np.arange(len(starts)) - (np.cumsum(nchars) - nchars)[owner]  # the character's place in its word
        left = nchars[owner] - place  # characters from it to its word's end
        left[(lengths == 0)[owner]] = 0  # no n-gram of "<>" (a label, or no word)
        after = np.append(starts, len(buf))
        width = np.diff(after)  # each character's bytes
        signed = np.zeros(len(buf) + 4 * self.maxn, np.uint32)
        signed[:len(buf)] = buf.view(np.int8)  # fastText hashes each byte as a signed char
        # FNV-1a of the n-grams from each character, extended one character at a time: lengths minn..maxn
        h = np.full(len(starts), _FNV_OFFSET, dtype=np.uint32)
        rows, who = [], []
        ascii_only = len(starts) == len(buf)
        for size in range(1, self.maxn + 1):
            if ascii_only:  # the character added is the next byte
                h = (h ^ signed[size - 1:size - 1 + len(h)]) * _FNV_PRIME
            else:
                at = np.minimum(np.arange(size - 1, len(starts) + size - 1), len(starts) - 1)  # the character added
                byte, w = after[at], width[at]
                for k in range(int(w.max(initial=0))):
                    step = (h ^ signed[byte + k]) * _FNV_PRIME
                    h = step if k == 0 else np.where(w > k, step, h)
            if size < self.minn:
                continue
            ok = left >= size
            if size == 1:  # no 1-gram of "<" or ">"
                ok &= (place > 0) & (left > 1)
            bucket = h % np.uint32(self.bucket)
            if self._bucket_bits is not None:  # the pruned index keeps few buckets: test a bit first
                ok &= ((self._bucket_bits[bucket >> 3] >> (bucket & 7)) & 1).astype(bool)
            first = np.flatnonzero(ok)
            rows.append(bucket[first] + self.nwords if self._bucket_row is None
                        else self._bucket_row[bucket[first]])
            who.append(owner[first])
        row, who = np.concatenate(rows), np.concatenate(who)
        order = np.argsort(who, kind="stable")  # the n-grams that have a row, grouped by word
        row, who = row[order], who[order]
        count = np.bincount(who, minlength=n)
        some = count > 0
        sums = np.add.reduceat(self._rows_t.take(row, axis=1), (np.cumsum(count) - count)[some], axis=1)
        out[some, :-1] += sums.T
        out[:, -1] += count
        return out

    def _find(self, key: np.ndarray) -> np.ndarray:
        """The slots of words given as keys (n x 2, `_keys`), -1 for a word not cached."""
        size = len(self._index0)
        k0, k1 = key[:, 0].copy(), key[:, 1].copy()
        at = _home(k0, k1, size)
        stored = self._index0[at]
        hit = (stored == k0) & (self._index1[at] == k1)
        out = np.where(hit, self._index_slot[at], -1)
        todo = np.flatnonzero(~hit & (stored != 0))
        while len(todo):  # probe on
            at[todo] = (at[todo] + 1) & (size - 1)
            where = at[todo]
            stored = self._index0[where]
            hit = (stored == k0[todo]) & (self._index1[where] == k1[todo])
            out[todo[hit]] = self._index_slot[where[hit]]
            todo = todo[~hit & (stored != 0)]
        return out

    def _place(self, key: np.ndarray, slots: np.ndarray) -> None:
        """Enter distinct keys, none of them there, into the open-addressing index."""
        size = len(self._index0)
        at = _home(key[:, 0], key[:, 1], size)
        todo = np.arange(len(key))
        while len(todo):
            free = self._index0[at[todo]] == 0
            cand = todo[free]
            _, first = np.unique(at[cand], return_index=True)  # one key per free place per round
            won = cand[first]
            self._index0[at[won]] = key[won, 0]
            self._index1[at[won]] = key[won, 1]
            self._index_slot[at[won]] = slots[won]
            rest = np.ones(len(todo), dtype=bool)
            rest[np.flatnonzero(free)[first]] = False
            todo = todo[rest]
            at[todo] = (at[todo] + 1) & (size - 1)

    def _add(self, key: np.ndarray, words: list[bytes]) -> np.ndarray:
        """Cache new words (distinct, not cached; ``key`` their keys, rows of zeros for those over 16 bytes):
        their slots. Empties the cache first when they do not fit."""
        if self._n + len(words) > CACHE_WORDS:
            self.clear()
        first, need = self._n, self._n + len(words)
        if need > len(self._key):
            grow = max(need, min(2 * len(self._key), CACHE_WORDS))
            self._table = np.concatenate([self._table[:, :first], np.zeros((self.dim + 1, grow - first))], axis=1)
            self._key = np.concatenate([self._key[:first], np.zeros((grow - first, 2), dtype=np.uint64)])
        self._table[:, first:need] = self.word_rows(words).T
        self._key[first:need] = key
        self._n = need
        slots = np.arange(first, need)
        short = key[:, 0] != 0
        self._long.update((w, i) for w, i, s in zip(words, slots.tolist(), short.tolist()) if not s)
        if 2 * (need - len(self._long)) > len(self._index0):  # keep the index at most half full
            size = len(self._index0)
            while 2 * (need - len(self._long)) > size:
                size *= 2
            self._index0 = np.zeros(size, dtype=np.uint64)
            self._index1 = np.zeros(size, dtype=np.uint64)
            self._index_slot = np.zeros(size, dtype=np.intp)
            old = np.flatnonzero(self._key[:need, 0] != 0)
            self._place(self._key[old], old)
        else:
            self._place(key[short], slots[short])
        return slots

    def line_sums(self, texts: Sequence[str]) -> np.ndarray:
        """Each text's input-row sum and row count, read as one line (``(len(texts), dim + 1)`` float64): its
        tokens' and the end-of-line token's."""
        parts = [t.encode() for t in texts]
        out = np.zeros((len(parts), self.dim + 1))
        a = 0
        while a < len(parts):  # chunks of about _CHUNK_BYTES
            b, n = a + 1, len(parts[a])
            while b < len(parts) and n + len(parts[b]) <= _CHUNK_BYTES:
                n += len(parts[b]) + 1
                b += 1
            out[a:b] = self._sums(parts[a:b])
            a = b
        if self.eos >= 0:  # the end-of-line token closes every line
            out[:, :-1] += self._rows[self.eos]
            out[:, -1] += 1
        return out

    def _sums(self, parts: list[bytes], retry: bool = False) -> np.ndarray:
        for i, p in enumerate(parts):
            if EOS in p:  # a word "</s>" ends the line
                toks = p.replace(b"\0", b" ").split()
                if EOS in toks:
                    parts[i] = b" ".join(toks[:toks.index(EOS)])
        raw = b" " + b" ".join(parts) + b" "
        raw = raw.replace(b"\0", b" ") if b"\0" in raw else raw  # readWord splits at NUL too
        padded = raw + bytes(16)
        buf = np.frombuffer(padded, dtype=np.uint8)
        edge = np.diff(_SPACE[buf[:len(raw)]].view(np.int8))
        starts = np.flatnonzero(edge == -1) + 1
        ends = np.flatnonzero(edge == 1) + 1
        length = ends - starts
        first_byte = np.cumsum([1] + [len(p) + 1 for p in parts[:-1]])
        line = np.searchsorted(first_byte, starts, side="right") - 1
        # a word of at most 16 bytes is its own key (its bytes, little-endian, zero-padded: no word holds a 0)
        at8 = np.ndarray((len(raw) + 8,), dtype="<u8", buffer=padded, strides=(1,))
        key = np.zeros((len(starts), 2), dtype=np.uint64)
        key[:, 0] = at8[starts] & _MASK[np.minimum(length, 8)]
        key[:, 1] = at8[starts + 8] & _MASK[np.clip(length - 8, 0, 8)]
        longer = np.flatnonzero(length > 16)
        key[longer] = 0
        slot = self._find(key)
        long_words = [raw[s:e] for s, e in zip(starts[longer].tolist(), ends[longer].tolist())]
        slot[longer] = [self._long.get(w, -1) for w in long_words]
        missing = np.flatnonzero(slot < 0)
        if len(missing):  # new words: their rows computed, cached
            short = missing[key[missing, 0] != 0]
            _, first, inverse = _unique_rows(key[short])
            reps = short[first]
            words = [raw[a:b] for a, b in zip(starts[reps].tolist(), ends[reps].tolist())]
            long_at = dict(zip(longer.tolist(), long_words))
            long_new = list(dict.fromkeys(long_at[i] for i in missing[key[missing, 0] == 0].tolist()))
            if len(words) + len(long_new) > CACHE_WORDS:  # more than the cache holds: no cache for them
                return self._uncached(parts)
            before = self._n
            added = self._add(np.concatenate([key[reps], np.zeros((len(long_new), 2), dtype=np.uint64)]),
                              words + long_new)
            if self._n != before + len(added) and len(missing) < len(slot):  # emptied for them: the rest again
                return self._uncached(parts) if retry else self._sums(parts, retry=True)
            slot[short] = added[inverse]
            for i in missing[key[missing, 0] == 0].tolist():
                slot[i] = self._long[long_at[i]]
        out = np.zeros((len(parts), self.dim + 1))
        counts = np.bincount(line, minlength=len(parts))
        some = counts > 0
        if some.any():
            out[some] = np.add.reduceat(self._table.take(slot, axis=1), (np.cumsum(counts) - counts)[some], axis=1).T
        return out

    def _uncached(self, parts: list[bytes]) -> np.ndarray:
        """Line sums without the cache (a chunk with more distinct words than it holds)."""
        out = np.zeros((len(parts), self.dim + 1))
        for i, p in enumerate(parts):
            counts = Counter(p.replace(b"\0", b" ").split())
            words = list(counts)
            out[i] = np.array([counts[w] for w in words], dtype=np.float64) @ self.word_rows(words)
        return out

    # ------------------------------------------------------------------------------------------ the output

    def predict(self, text: str, k: int = 1) -> Prediction:
        """fasttext-predict's ``predict(text, k)`` for ``text`` read as one line (newlines are whitespace):
        the top label (``k=1``) or every label it returns, best first (``k=-1``), and their probabilities."""
        if k == 1:
            return self.predict_many([text])[0]
        if k != -1:
            raise ValueError("k must be 1 or -1 (every label)")
        total = self.line_sums([text])[0]
        if total[-1] == 0:  # no input row: fastText predicts nothing
            return (), ()
        # every label the search reaches (none of its partial sums under the floor), fastText's float32 steps
        f32 = np.float32
        hidden = (total[:-1].astype(f32) * f32(1.0 / total[-1])).astype(np.float64)  # computeHidden's float32 mean
        z = np.einsum("ij,j->i", self._out, hidden).astype(f32).astype(np.float64)
        f = (1.0 / (f32(1) + np.exp(np.minimum(-z, 88.0)).astype(f32)).astype(np.float64)).astype(f32)
        terms = self._terms(f.astype(np.float64)[None], float32_left=True)[0]
        prefix = np.cumsum(terms[self._paths], axis=1, dtype=f32)
        score = prefix[:, -1]
        leaves = np.flatnonzero((prefix >= _FLOOR).all(axis=1))
        leaves = leaves[np.argsort(-score[leaves], kind="stable")]
        return tuple(self.labels[i] for i in leaves), tuple(float(f32(math.exp(score[i]))) for i in leaves)

    def _terms(self, f: np.ndarray, float32_left: bool = False) -> np.ndarray:
        """std_log(x) = log(x + 1e-5), as float32, of each node's sigmoid ``f`` (lines x nodes): the left child's
        term (of 1 - f), the right child's (of f), then 0 (padding)."""
        m = f.shape[1]
        both = np.empty((len(f), 2 * m + 1))
        both[:, :m] = 1.0 - f
        if float32_left:  # fastText rounds 1 - f to a float before the log
            both[:, :m] = both[:, :m].astype(np.float32)
        both[:, m:2 * m] = f
        both[:, -1] = 1.0 - 1e-5
        both += 1e-5
        return np.log(both, out=both).astype(np.float32)

    def predict_many(self, texts: Sequence[str]) -> list[Prediction]:
        """``predict(t)`` (the top label) of each of ``texts``, computed in numpy batches."""
        totals = self.line_sums(texts)
        n = totals[:, -1:]
        empty = n[:, 0] == 0
        # each internal node's dot product with the mean row (einsum and gathers, not BLAS: one thread)
        z = np.einsum("ij,jk->ik", totals[:, :-1] / np.where(empty[:, None], 1, n), self._out_t)
        f = 1.0 / (1.0 + np.exp(np.minimum(-z, 700.0)))  # its sigmoid
        terms = self._terms(f)
        score = np.zeros((len(texts), self._osz))  # each label's log-probability: its path's terms
        for d in range(self._paths.shape[1]):
            score += terms[:, self._paths[:, d]]
        rows = np.arange(len(texts))
        best = score.argmax(axis=1)
        top = score[rows, best]
        score[rows, best] = -np.inf
        near = (score.max(axis=1, initial=-np.inf) > top - _TIE) | (top < _FLOOR + 1)
        for i in np.flatnonzero(near & ~empty):  # a near tie: fastText's own search decides
            best[i] = self._search(terms[i])
            empty[i] = best[i] < 0  # every label under the floor: fastText predicts nothing
        # the top label's score as the search adds it: in float32, root to leaf
        top = np.cumsum(terms[rows[:, None], self._paths[best]], axis=1, dtype=np.float32)[:, -1]
        probs = np.exp(top.astype(np.float64)).astype(np.float32).tolist()
        return [((), ()) if e else ((self.labels[i],), (p,)) for i, p, e in zip(best.tolist(), probs, empty)]

    def _search(self, terms: np.ndarray) -> int:
        """HierarchicalSoftmaxLoss::dfs with k=1: the tree searched left child first, a subtree skipped when its
        score is under the floor or under the best leaf's so far (a later leaf wins a tie)."""
        osz, best = self._osz, [None, -1]

        def dfs(node: int, score: np.float32) -> None:
            if score < _FLOOR or best[0] is not None and score < best[0]:
                return
            if node < osz:
                best[:] = [score, node]
                return
            i = node - osz
            dfs(self._left[node], score + terms[i])
            dfs(self._right[node], score + terms[osz - 1 + i])

        dfs(2 * osz - 2, np.float32(0.0))
        return best[1]


@functools.cache
def load(path: str | Path) -> Model:
    """The model at ``path``, parsed once per process."""
    return Model(path)
