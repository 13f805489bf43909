"""Text to train on: a .txt file, a folder of them, or a .jsonl file of {"text": ...} rows or chat rows
{"messages": [{"role", "content"}, ...]}, tokenized once with the model's tokenizer into a token cache.

Each text (a file, a row) is a document: the tokenizer's start of a text (BOS), its tokens, EOS. A chat row
is the conversation as the model's chat template writes it, and only the assistant's messages (each with
the end of its turn the template writes after it) are targets: the mask says which tokens the loss counts.
The cache (a .npz: the tokens, the mask when there are chat rows, the tokenizer's own files and the key of
the source and the tokenizer) is written atomically and read again while both are unchanged.
"""

import hashlib
import sys
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..host.files import atomic_write
from ..host.untrusted import parse_json, text_of
from .hf_tokenizer import FILES, HFTokenizer
from .tokenizer import Tokenizer

SUFFIXES = (".txt", ".jsonl")
CACHE_VERSION = "1"        # bump when the way text becomes tokens changes: it is part of the cache's key
PROGRESS_BYTES = 1 << 20   # sources larger than this show their progress


def is_text(path):
    """Whether --data names text (a .txt or .jsonl file, or a folder) rather than a token file."""
    path = Path(path)
    return path.is_dir() or path.suffix in SUFFIXES


def text_files(path):
    """The files of a text source: itself, or a folder's .txt files below it in sorted order of their path."""
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise DataError(f"{path}: no such file or folder")
        return [path]
    files = sorted((p for p in path.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise DataError(f"{path}: no .txt files in this folder")
    return files


def need_chat(tokenizer):
    """Stop, with one line, unless the model has a chat template."""
    if tokenizer.chat_template is None:
        raise DataError("the model has no chat template (a Hugging Face folder's tokenizer_config.json "
                        "chat_template, or chat_template.jinja), so chat rows and --chat cannot be written for it")


def chat_text(tokenizer, messages, add_generation_prompt=False):
    """The conversation as the model's chat template writes it."""
    need_chat(tokenizer)
    return tokenizer.render_chat(messages, add_generation_prompt)


def documents(files):
    """(where, text or messages) of each document: a .txt file whole, a .jsonl file's rows."""
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        if not raw.strip():
            raise DataError(f"{path}: the file is empty")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise DataError(f"{path}, line {line}: not UTF-8 text (byte {e.start})") from None
        if path.suffix != ".jsonl":
            yield str(path), text
            continue
        for n, line in enumerate(text.split("\n"), 1):     # not splitlines: JSON strings may hold U+2028
            if line.strip():
                yield f"{path}, line {n}", row(line, f"{path}, line {n}")


def row(line, where):
    """A .jsonl row's text (str) or chat (list of {role, content})."""
    doc = parse_json(line, where)
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return text_of(doc["text"], where)
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise DataError(f'{where}: a row must be {{"text": "..."}} or {{"messages": [{{"role": "...", '
                        '"content": "..."}, ...]}')
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: a chat row without an assistant turn: nothing in it to learn")
    return [{"role": text_of(m["role"], where), "content": text_of(m["content"], where)} for m in messages]


def chat_tokens(tokenizer, messages, where):
    """(ids, mask) of a conversation: the mask is True on the assistant's messages and their ends of turn."""
    full = chat_text(tokenizer, messages)
    spans, at = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = full.find(m["content"], at)
        if start < 0:
            raise DataError(f"{where}: the chat template does not write message {k + 1} as it is, so its tokens "
                            "cannot be found")
        end = start + len(m["content"])
        alone = chat_text(tokenizer, messages[:k + 1])          # what the template ends this turn with
        tail = alone[alone.rfind(m["content"]) + len(m["content"]):]
        while tail and not full.startswith(tail, end):
            tail = tail[:-1]
        spans.append((start, end + len(tail)))
        at = end + len(tail)
    ids, starts = tokenizer.encode_offsets(full)
    mask = np.zeros(len(ids), bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids, mask


def tokenizer_files(tokenizer):
    """{name: bytes} that make the tokenizer again (tokenizer_of)."""
    return tokenizer.files if isinstance(tokenizer, HFTokenizer) else {"tokenizer.bin": tokenizer.to_bytes()}


def tokenizer_of(files, where):
    """The tokenizer of tokenizer_files' answer."""
    if "tokenizer.bin" in files:
        return Tokenizer.from_bytes(files["tokenizer.bin"], f"{where}: tokenizer.bin")
    return HFTokenizer(files, where)


def source_key(files, tokenizer):
    """The cache's key: the text's files (names and bytes), the tokenizer's files and CACHE_VERSION."""
    h = hashlib.sha256(CACHE_VERSION.encode())
    for name, data in [*sorted(tokenizer_files(tokenizer).items()), *((str(p), p.read_bytes()) for p in files)]:
        h.update(b"%d:%s%d:" % (len(name.encode()), name.encode(), len(data)) + data)
    return h.hexdigest()


def tokenize(path, tokenizer, out=sys.stderr):
    """(tokens uint32, mask bool or None) of the text at path; the progress goes to out on large sources."""
    files = text_files(path)
    size = sum(p.stat().st_size for p in files)
    parts, masks, chat, done = [], [], False, 0
    for where, doc in documents(files):
        if isinstance(doc, str):
            ids = tokenizer.encode(doc, bos=True, eos=True)
            mask = np.ones(len(ids), bool)
            done += len(doc.encode())
        else:
            ids, mask = chat_tokens(tokenizer, doc, where)
            chat = True
            done += sum(len(m["content"].encode()) for m in doc)
        parts.append(np.asarray(ids, np.uint32))
        masks.append(mask)
        if size > PROGRESS_BYTES and len(parts) % 1000 == 0 and out.isatty():
            out.write(f"\rtokenizing {path}: {min(100, done * 100 // size)}%, {sum(map(len, parts)):,} tokens")
            out.flush()
    tokens = np.concatenate(parts)
    if size > PROGRESS_BYTES and out.isatty():
        out.write("\r")
    print(f"tokenized {path}: {len(parts):,} {'rows' if chat else 'documents'}, {len(tokens):,} tokens", file=out)
    return tokens, np.concatenate(masks) if chat else None


def text_tokens(path, tokenizer, cache, write=True, check=None):
    """(tokens, mask or None) of the text at path with tokenizer: from the cache file when it was made from
    the same text with the same tokenizer, else tokenized and, once check(tokens, mask) has not raised, the
    cache (re)written (unless not `write`)."""
    key = source_key(text_files(path), tokenizer)
    if Path(cache).is_file():
        got = read_cache(cache)
        if got[3] == key:
            return got[0], got[1]
    tokens, mask = tokenize(path, tokenizer)
    if check:
        check(tokens, mask)
    if not write:
        return tokens, mask
    arrays = dict(tokens=tokens, key=np.array(key),
                  **{f"tokenizer/{k}": np.frombuffer(v, np.uint8) for k, v in tokenizer_files(tokenizer).items()},
                  **({} if mask is None else {"mask": mask}))
    atomic_write(cache, lambda f: np.savez(f, **arrays))
    return tokens, mask


def read_cache(cache):
    """(tokens, mask or None, tokenizer, key) of a token cache that text_tokens wrote."""
    try:
        with np.load(cache, allow_pickle=False) as z:
            files = {k.split("/", 1)[1]: z[k].tobytes() for k in z.files if k.startswith("tokenizer/")}
            if not set(files) <= {"tokenizer.bin", *FILES}:
                raise ValueError("unknown tokenizer files")
            tokens, key = z["tokens"], str(z["key"])
            mask = z["mask"] if "mask" in z.files else None
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{cache}: not a token cache ({e}); remove it to tokenize again") from None
    if tokens.dtype != np.uint32 or tokens.ndim != 1 or mask is not None and (mask.dtype != bool or
                                                                                mask.shape != tokens.shape):
        raise DataError(f"{cache}: not a token cache (its arrays); remove it to tokenize again")
    return tokens, mask, tokenizer_of(files, cache), key
