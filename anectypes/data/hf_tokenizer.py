"""The tokenizer of a Hugging Face model folder: `tokenizer.json` through the `tokenizers` library (byte-level
BPE, sentencepiece-style BPE with byte fallback, anything that library reads), the special tokens, BOS and EOS
as `tokenizer_config.json`, `generation_config.json` and `config.json` declare them, and the chat template
(`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja`) rendered as transformers renders it, in
jinja2's sandbox: a template is data from disk, never code that runs unconfined.

It answers to what the rest of the code asks of data/tokenizer.py's Tokenizer: encode, decode, vocab_size,
piece (the bytes a token adds, for streaming) and stop (the ids that end a generation).
"""

import atexit
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..host.untrusted import JSON_BYTES, parse_json, read_regular, text_of
from . import template_sandbox
from .tokenizer import Tokenizer

EXTRA = "pip install 'anectypes[hf]'"
TOKENIZER_BYTES = 64 << 20      # tokenizer.json: Gemma 3's, among the largest, is 33 MB
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars():
    """GPT-2's map from each byte to the printable character byte-level BPE writes for it, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json", "chat_template.jinja")


def _json(files, name, where):
    """The JSON object in files[name], {} when absent."""
    if name not in files:
        return {}
    doc = parse_json(files[name], where / name)
    if not isinstance(doc, dict):
        raise DataError(f"{where / name}: not a JSON object")
    return doc


def _content(token):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer:
    """A Hugging Face folder's tokenizer (see the module notes)."""

    def __init__(self, files, where):
        """From the folder's files ({name: bytes} of FILES, tokenizer.json among them); `where` names the
        folder in errors."""
        where = Path(where)
        try:
            import tokenizers
        except ImportError:
            raise DataError(f"reading {where / 'tokenizer.json'} needs the tokenizers package: {EXTRA}") from None
        self.files = files
        if "tokenizer.json" not in files:
            raise DataError(f"{where}: no tokenizer.json in it")
        try:
            text = files["tokenizer.json"].decode("utf-8")
            self.tok = tokenizers.Tokenizer.from_str(text)
            decoder = json.loads(text).get("decoder")
        except Exception as e:           # the library's own exception type for a bad file
            raise DataError(f"{where / 'tokenizer.json'}: not a tokenizers file ({str(e)[:200]})") from None
        conf, gen, model = (_json(files, name, where) for name in FILES[1:4])
        vocab = self.tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"{where / 'tokenizer.json'}: its vocabulary is empty")
        self.vocab_size = max(vocab.values()) + 1
        self.special = {k: _content(v) for k, v in conf.items()
                        if k.endswith("_token") and isinstance(_content(v), str)}
        for k, v in self.special.items():
            if self.tok.token_to_id(v) is None:
                raise DataError(f"{where / 'tokenizer_config.json'}: its {k} {v!r} is not in tokenizer.json")
        self.tok.encode_special_tokens = bool(conf.get("split_special_tokens", False))
        # BOS and EOS as the first of the three files that declares them; every EOS named ends a generation
        bos = [self._ids(where, [d]) for d in (self.special.get("bos_token"), gen.get("bos_token_id"),
                                               model.get("bos_token_id"))]
        eos = self._ids(where, [self.special.get("eos_token"), gen.get("eos_token_id"), model.get("eos_token_id")])
        self.bos = next((ids[0] for ids in bos if ids), None)
        self.eos = eos[0] if eos else None
        self.stop = frozenset(eos)
        self.chat_template = (files["chat_template.jinja"].decode("utf-8", "replace") if "chat_template.jinja" in files
                              else conf.get("chat_template"))
        if isinstance(self.chat_template, list):     # a list of named templates: the default one
            self.chat_template = next((t.get("template") for t in self.chat_template
                                       if isinstance(t, dict) and t.get("name") == "default"), None)
        if not (self.chat_template is None or isinstance(self.chat_template, str)):
            raise DataError(f"{where / 'tokenizer_config.json'}: its chat_template is not text")
        self.template_file = where / ("chat_template.jinja" if "chat_template.jinja" in files else
                                      "tokenizer_config.json")
        self._pieces = self._piece_table(decoder)

    @classmethod
    def load(cls, folder):
        """The tokenizer of a Hugging Face folder (its tokenizer.json and what FILES names beside it)."""
        folder = Path(folder)
        try:
            return cls({name: read_regular(folder / name, TOKENIZER_BYTES if name == "tokenizer.json" else JSON_BYTES)
                        for name in FILES if (folder / name).is_file()}, folder)
        except OSError as e:
            raise DataError(f"{folder}: cannot read the tokenizer ({e.strerror})") from None

    def _ids(self, folder, declared):
        """The ids of declared tokens (names or ids, or lists of ids); None entries are skipped."""
        out = []
        for d in declared:
            for x in d if isinstance(d, list) else [d]:
                if x is None:
                    continue
                i = self.tok.token_to_id(x) if isinstance(x, str) else x
                if not (type(i) is int and 0 <= i < self.vocab_size):
                    raise DataError(f"{folder}: its special token {str(x)[:80]} is not in tokenizer.json "
                                    f"(ids 0..{self.vocab_size - 1})")
                out.append(i)
        return out

    def _piece_table(self, decoder):
        """The bytes each id decodes to: none for a special token (as llama2.c's control tokens); byte-level
        BPE through GPT-2's byte alphabet; otherwise the sentencepiece conventions (▁ is a space, <0xNN> a byte)."""
        decoders = [d for d in (decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else [])
                    if isinstance(d, dict)]
        kinds = [d.get("type") for d in decoders]
        self._strip_first = "Strip" in kinds or any(                   # the decoder drops the first space
            d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never" for d in decoders)
        chars = _byte_level_chars() if "ByteLevel" in kinds else None
        self._special = special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        table = []
        for i in range(self.vocab_size):
            t = self.tok.id_to_token(i)
            if t is None or i in special:
                table.append(b"")
            elif chars is not None:
                table.append(bytes(chars[c] for c in t) if all(c in chars for c in t) else t.encode("utf-8"))
            elif "ByteFallback" in kinds and _BYTE_FALLBACK.fullmatch(t):
                table.append(bytes([int(t[3:5], 16)]))
            else:
                table.append(t.replace("\u2581", " ").encode("utf-8"))
        return table

    def __len__(self):
        return self.vocab_size

    def encode(self, text, bos=True, eos=False):
        """Token ids of text: with bos, the special tokens the tokenizer adds to a text (its post-processor,
        as transformers' encode adds them); an empty text starts at BOS (without one, at EOS: after another
        text), as a generation needs one token. Text with a lone surrogate (undecodable bytes of a prompt), which
        tokenizers cannot take, is refused."""
        ids = self.tok.encode(text_of(text, "the text"), add_special_tokens=bos).ids
        if bos and not ids:
            ids = [t for t in (self.bos, self.eos) if t is not None][:1]
        if eos and self.eos is not None:
            ids.append(self.eos)
        return ids

    def encode_offsets(self, text):
        """(ids, where each token starts in text) of text as it is (the special tokens it holds, no others)."""
        enc = self.tok.encode(text_of(text, "the text"), add_special_tokens=False)
        return enc.ids, np.array([a for a, _ in enc.offsets], np.int64)

    def decode(self, ids):
        """Text of ids without its special tokens (transformers' decode with skip_special_tokens)."""
        for t in ids:
            self.piece(None, t)
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=True)

    def piece(self, prev, t):
        """The bytes token t adds to a text after token prev (None at the start); an id past the tokenizer's,
        in a model's padded vocabulary, adds nothing (as transformers decodes it). A sentencepiece-style
        tokenizer drops the space its first word carries (after BOS, as llama2.c's)."""
        t = int(t)
        if t < 0:
            raise DataError(f"token id {t} is outside the vocabulary")
        piece = self._pieces[t] if t < self.vocab_size else b""
        first = prev is None or int(prev) in self._special
        return piece[1:] if first and self._strip_first and piece[:1] == b" " else piece

    # ---- the chat template ---------------------------------------------------------------------------

    def render_chat(self, messages, add_generation_prompt=False):
        """The conversation as the chat template writes it (transformers' apply_chat_template, untokenized),
        rendered in the sandbox process (template_sandbox) within its limits."""
        reply = _sandbox_render(self.chat_template, dict(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.special))
        if "error" in reply:
            raise DataError(f"{self.template_file}: {reply['error']}")
        return text_of(reply["text"], f"{self.template_file}: what its chat template wrote")


_SANDBOX = []      # the running sandbox process (template_sandbox), started on the first rendering


@atexit.register
def _end_sandbox():
    """End the sandbox process: it stops at the end of its input."""
    for proc in _SANDBOX:
        proc.communicate()


def _sandbox_render(template, context):
    """template_sandbox's reply to rendering template with context: a new process when the last one ended
    (a template over the limits ends its process)."""
    request = json.dumps(dict(template=template, context=context)) + "\n"     # ASCII: escapes for the rest
    if not (_SANDBOX and _SANDBOX[0].poll() is None):
        # no environment and / as its folder: nothing of this process' secrets or files is at hand in there
        _SANDBOX[:] = [subprocess.Popen([sys.executable, "-I", template_sandbox.__file__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={},
                                        cwd="/")]
    proc = _SANDBOX[0]
    try:
        proc.stdin.write(request)
        proc.stdin.flush()
        reply = proc.stdout.readline()
    except OSError:                          # it ended before reading the request: the reply is empty
        reply = ""
    if reply:
        return json.loads(reply)
    proc.communicate()                      # its pipes closed, the process reaped
    code = proc.returncode
    return {"error": f"its chat template went over the time limit ({template_sandbox.SECONDS} s)"
            if code == -signal.SIGALRM else f"its chat template went over the memory limit "
            f"({template_sandbox.MEMORY >> 20} MiB): the sandbox ended with exit {code}"}


def load_tokenizer(path):
    """The tokenizer at path: a Hugging Face folder holding tokenizer.json (or that file itself), else a
    llama2.c tokenizer.bin."""
    path = Path(path)
    if path.name == "tokenizer.json" and path.is_file():
        return HFTokenizer.load(path.parent)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer.load(path)
    return Tokenizer.load(path)
