"""A tokenizer that reads, writes and encodes like llama2.c's `tokenizer.bin`, and trains its own BPE.

File layout (all little-endian): int32 max_token_length, then for each id in order: float32 score,
int32 byte length, the piece's raw bytes. Id conventions: 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS),
3..258 the byte tokens `<0x00>`..`<0xFF>`, then ordinary pieces.

Encoding is llama2.c's: prepend a dummy-prefix " " to non-empty text, look each codepoint up as a
piece (unknown ones become byte tokens, byte + 3), then repeatedly merge the adjacent pair whose
concatenation is a piece with the highest score, leftmost first on ties.

Speed: the text is cut into chunks ``" ?\\S+"`` (a word with at most one leading space) or a single
whitespace character, each chunk is encoded alone and cached. When every mergeable piece has
such a chunk's shape, no concatenation across a chunk boundary can be a piece (it would contain
whitespace after its first character, or a non-space whitespace followed by more text), so no
merge ever crosses a boundary and the result is identical to encoding the whole string at once,
for any text. Vocabularies from `train_bpe` always qualify. A foreign vocabulary with pieces like
"\\n\\n" or ". " does not; it is then encoded as one whole string, exactly, just without the cache.

Deliberate differences from run.c: a concatenation is never looked up among the control and byte
tokens (so text like "<0x41>" stays text, and decode(encode(s)) == s), and when a vocabulary holds
the same piece twice the lower id wins (run.c's binary search picks either).
"""

from __future__ import annotations

import heapq
import os
import re
import struct

from ..host.files import atomic_write
from ..host.untrusted import open_regular
from ..errors import DataError

UNK, BOS, EOS = 0, 1, 2
N_BYTE_TOKENS = 256
FIRST_PIECE = 3 + N_BYTE_TOKENS  # first id after the control and byte tokens
CONTROL_PIECES = (b"<unk>", b"<s>", b"</s>")
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
_CHUNK = re.compile(r" ?\S+|\s")
_CACHE_LIMIT = 1 << 18  # chunks remembered before the cache is cleared, bounding memory on huge inputs


def byte_piece(b):
    return b"<0x%02X>" % b


class Tokenizer:
    """A llama2.c vocabulary: pieces (bytes) and float scores indexed by token id."""

    stop = frozenset([BOS])   # a generation ends where the model begins another text, as run.c's
    chat_template = None      # tokenizer.bin holds none

    def __init__(self, pieces, scores, max_token_length=None):
        self.pieces = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in pieces]
        self.scores = [float(s) for s in scores]
        if len(self.pieces) != len(self.scores):
            raise DataError(f"{len(self.pieces)} pieces but {len(self.scores)} scores")
        if len(self.pieces) < FIRST_PIECE:
            raise DataError(f"vocabulary has {len(self.pieces)} pieces; "
                            f"the llama2.c layout needs at least {FIRST_PIECE}")
        for b in range(N_BYTE_TOKENS):  # byte fallback (id = byte + 3) is only right if these are the byte tokens
            if self.pieces[3 + b] != byte_piece(b):
                raise DataError(f"id {3 + b} is {self.pieces[3 + b]!r}, "
                                f"expected byte token {byte_piece(b)!r} (llama2.c layout)")
        longest = max(map(len, self.pieces))
        self.max_token_length = longest if max_token_length is None else int(max_token_length)
        if self.max_token_length < longest:  # llama2.c sizes its merge buffer from this field
            raise DataError(f"max_token_length {self.max_token_length} is less than the longest piece "
                            f"({longest} bytes)")
        self._piece_id = {}  # codepoint / piece lookup, lower id wins on duplicates
        for i, p in enumerate(self.pieces):
            self._piece_id.setdefault(p, i)
        self._merges = {}  # piece -> (score, id), only pieces a merge may produce
        for i, p in enumerate(self.pieces[FIRST_PIECE:], FIRST_PIECE):
            if p not in self._merges and not _BYTE_PIECE.fullmatch(p) and p not in CONTROL_PIECES:
                self._merges[p] = (self.scores[i], i)
        self._chunked = all(_chunk_shaped(p) for p in self._merges)
        self._cache = {}
        # decode table: byte tokens become their byte, control tokens no text
        self._decoded = [b"" if i < 3 else _decoded_piece(p) for i, p in enumerate(self.pieces)]

    @property
    def vocab_size(self):
        return len(self.pieces)

    def __len__(self):
        return len(self.pieces)

    # ---- file format -------------------------------------------------------------------------

    def to_bytes(self):
        out = [struct.pack("<i", self.max_token_length)]
        for p, s in zip(self.pieces, self.scores):
            out.append(struct.pack("<fi", s, len(p)))
            out.append(p)
        return b"".join(out)

    def save(self, path):
        data = self.to_bytes()
        atomic_write(path, lambda f: f.write(data))

    @classmethod
    def from_bytes(cls, data, name="<bytes>"):
        if len(data) == 0:
            raise DataError(f"{name}: tokenizer file is empty")
        if len(data) < 4:
            raise DataError(f"{name}: truncated at byte offset 0: {len(data)} bytes, no int32 max_token_length")
        (max_len,) = struct.unpack_from("<i", data, 0)
        if max_len <= 0:
            raise DataError(f"{name}: max_token_length {max_len} at byte offset 0 is not positive; "
                            "not a llama2.c tokenizer.bin")
        pieces, scores, off = [], [], 4
        while off < len(data):
            if off + 8 > len(data):
                raise DataError(f"{name}: truncated at byte offset {off} in token {len(pieces)}: "
                                f"{len(data) - off} bytes left, a score and a length need 8")
            score, n = struct.unpack_from("<fi", data, off)
            if n < 0 or n > max_len:
                raise DataError(f"{name}: token {len(pieces)} at byte offset {off} has length {n}, "
                                f"outside 0..max_token_length {max_len}; corrupt file")
            if off + 8 + n > len(data):
                raise DataError(f"{name}: truncated at byte offset {off + 8} in token {len(pieces)}: "
                                f"needs {n} bytes, {len(data) - off - 8} left")
            pieces.append(data[off + 8:off + 8 + n])
            scores.append(score)
            off += 8 + n
        try:
            return cls(pieces, scores, max_len)
        except DataError as e:
            raise DataError(f"{name}: {e}") from None

    @classmethod
    def load(cls, path):
        path = os.fspath(path)
        try:
            with open_regular(path) as f:
                data = f.read()
        except OSError as e:
            raise DataError(f"{path}: cannot read tokenizer file ({e.strerror})") from None
        return cls.from_bytes(data, path)

    # ---- encode / decode -----------------------------------------------------------------------

    def encode(self, text, bos=True, eos=False):
        """Token ids of `text`, as llama2.c's encode() computes them (see the module notes)."""
        ids = [BOS] if bos else []
        if text:
            text = " " + text  # dummy prefix, as sentencepiece and llama2.c add it
            if self._chunked:
                cache = self._cache
                if len(cache) > _CACHE_LIMIT:
                    cache.clear()
                for chunk in _CHUNK.findall(text):
                    got = cache.get(chunk)
                    if got is None:
                        got = cache[chunk] = self._bpe(chunk)
                    ids.extend(got)
            else:
                ids.extend(self._bpe(text))
        if eos:
            ids.append(EOS)
        return ids

    def _bpe(self, text):
        """llama2.c's merge loop over one string, in O(n log n) with a heap and a linked list."""
        keys, ids = [], []  # key None marks a byte-fallback token, which never merges
        for ch in text:
            b = ch.encode("utf-8", "surrogatepass")
            i = self._piece_id.get(b)
            if i is None:
                keys.extend([None] * len(b))
                ids.extend(x + 3 for x in b)
            else:
                keys.append(b)
                ids.append(i)
        n = len(keys)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        heap, merges = [], self._merges

        def push(i):  # offer the pair starting at position i; (-score, i) picks best, then leftmost
            j = nxt[i]
            if j < n and keys[i] is not None and keys[j] is not None:
                m = merges.get(keys[i] + keys[j])
                if m is not None:
                    heapq.heappush(heap, (-m[0], i, keys[i], keys[j]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if keys[i] != left or j >= n or keys[j] != right:
                continue  # stale: one side was merged since this pair was offered
            keys[i] = left + right
            ids[i] = merges[keys[i]][1]
            keys[j] = False  # dead position; never equal to a key
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        out, i = [], 0
        while i < n:
            out.append(ids[i])
            i = nxt[i]
        return out

    def decode(self, ids):
        """Text of `ids`. Byte tokens become bytes, control tokens nothing, and the dummy-prefix
        space right after BOS is dropped, as llama2.c does; invalid UTF-8 is replaced, not raised."""
        out, prev = [], None
        for t in ids:
            out.append(self.piece(prev, t))
            prev = t
        return b"".join(out).decode("utf-8", "replace")

    def piece(self, prev, t):
        """The bytes token t adds to a text after token prev (None at the start): see decode."""
        t, n = int(t), len(self.pieces)
        if not 0 <= t < n:
            raise DataError(f"token id {t} is outside the vocabulary (size {n})")
        piece = self._decoded[t]
        return piece[1:] if prev == BOS and self.pieces[t][:1] == b" " else piece


def _decoded_piece(p):
    m = _BYTE_PIECE.fullmatch(p)
    return bytes([int(m.group(1), 16)]) if m else p


def _chunk_shaped(piece):
    try:
        return _CHUNK.fullmatch(piece.decode("utf-8")) is not None
    except UnicodeDecodeError:
        return True  # never produced by merging codepoints, so it cannot join chunks


# ---- training ------------------------------------------------------------------------------------


def train_bpe(text, vocab_size):
    """Train a byte-pair vocabulary of at most `vocab_size` ids in the llama2.c layout.

    `text` is one string or a list of documents; each gets the dummy prefix, as encode() does.
    After the 259 control and byte tokens come the codepoints (most frequent first when they do
    not all fit, then stored in codepoint order), then one piece per merge with score -k for the
    k-th merge, so encode() replays the merges in training order. Pairs are counted over unique
    chunks weighted by their count, and only the chunks holding the merged pair are re-counted.
    Ties go to the pair with the smallest (left id, right id). Training stops early when no pair
    is left, so tiny texts give smaller vocabularies.
    """
    if not FIRST_PIECE < vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in {FIRST_PIECE + 1}..65536, got {vocab_size}")
    docs = [text] if isinstance(text, str) else list(text)
    counts = {}
    for doc in docs:
        if doc:
            for chunk in _CHUNK.findall(" " + doc):
                counts[chunk] = counts.get(chunk, 0) + 1

    char_count = {}
    for chunk, c in counts.items():
        for ch in chunk:
            char_count[ch] = char_count.get(ch, 0) + c
    chars = sorted(char_count, key=lambda ch: (-char_count[ch], ord(ch)))[:vocab_size - FIRST_PIECE]
    chars.sort()  # ascending codepoint: a layout independent of counting order
    pieces = list(CONTROL_PIECES) + [byte_piece(b) for b in range(N_BYTE_TOKENS)]
    pieces += [c.encode("utf-8") for c in chars]
    scores = [0.0] * len(pieces)
    piece_id = {p: i for i, p in enumerate(pieces)}

    words, freqs = [], []
    for chunk, c in counts.items():
        sym = []
        for ch in chunk:
            b = ch.encode("utf-8", "surrogatepass")
            sym.extend([piece_id[b]] if b in piece_id else [x + 3 for x in b])
        words.append(sym)
        freqs.append(c)

    pair_count, where = {}, {}
    for w, sym in enumerate(words):
        for p in zip(sym, sym[1:]):
            if p[0] >= FIRST_PIECE and p[1] >= FIRST_PIECE:  # byte-fallback tokens never merge
                pair_count[p] = pair_count.get(p, 0) + freqs[w]
                where.setdefault(p, set()).add(w)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    reserved, banned = set(pieces[:FIRST_PIECE]), set()
    n_merges = 0
    while len(pieces) < vocab_size and heap:
        c, a, b = heapq.heappop(heap)
        if pair_count.get((a, b)) != -c:
            continue  # stale count; the current one was pushed when it changed
        merged = pieces[a] + pieces[b]
        if merged in reserved:  # would read back as a control or byte token
            del pair_count[(a, b)]
            banned.add((a, b))
            continue
        new = piece_id.get(merged)
        if new is None:  # the same string may already exist via another split
            new = piece_id[merged] = len(pieces)
            pieces.append(merged)
            scores.append(-float(n_merges))
            n_merges += 1
        touched = {}  # pair -> count change from this merge

        def change(p, d, w):
            if p[0] >= FIRST_PIECE and p[1] >= FIRST_PIECE and p not in banned:
                touched[p] = touched.get(p, 0) + d
                if d > 0:
                    where.setdefault(p, set()).add(w)

        for w in sorted(where.pop((a, b))):
            sym, f = words[w], freqs[w]
            out, i, n, merged_last = [], 0, len(sym), False
            while i < n:  # only the pairs next to each merged occurrence change
                if sym[i] == a and i + 1 < n and sym[i + 1] == b:
                    change((a, b), -f, w)
                    if out:  # left neighbour: (x, a) becomes (x, new); after a merge it was (new, a)
                        change((new, a) if merged_last else (sym[i - 1], a), -f, w)
                        change((out[-1], new), f, w)
                    if i + 2 < n:  # right neighbour: (b, y) becomes (new, y)
                        change((b, sym[i + 2]), -f, w)
                        change((new, sym[i + 2]), f, w)
                    out.append(new)
                    i, merged_last = i + 2, True
                else:
                    out.append(sym[i])
                    i, merged_last = i + 1, False
            words[w] = out
        for p in sorted(touched):
            c = pair_count.get(p, 0) + touched[p]
            if c > 0:
                pair_count[p] = c
                heapq.heappush(heap, (-c, p[0], p[1]))
            elif p in pair_count:
                del pair_count[p]
                where.pop(p, None)
    return Tokenizer(pieces, scores)
