"""GGUF files for llama.cpp, Ollama and LM Studio (docs/ane-reference.md §8.3), of architecture llama or
qwen3 (QK-norm), with the model's keys, its tokenizer and its tensors, read and written with the `gguf`
package (the `export` extra): read of any type gguf-py dequantizes (a quantized file as a float32 copy),
written F32 or F16. Names and keys are gguf-py's (constants.py), the conventions llama.cpp's
convert_hf_to_gguf.py's:

- llama rotates interleaved pairs, as we do; qwen3 the two halves of each head (llama.cpp's NEOX RoPE),
  so its wq, wk, q_norm and k_norm rows are Hugging Face's (hf.rows).
- llama3 RoPE scaling is the tensor rope_freqs.weight, each pair's divisor of its angle; our ANECTYPES
  keys keep the four settings it came from (llama.cpp ignores them), and α's mark as config.json's.
- An untied classifier is output.weight (llama.cpp ties to token_embd without one).
- A llama2.c tokenizer.bin is tokenizer model "llama" (tokens, scores, types); a Hugging Face folder's
  byte-level BPE is "gpt2" (tokens, types, merges) with the pre-tokenizer llama.cpp names by its regex
  (PRE), BOS/EOS, add_bos_token and the chat template; ids past the tokenizer's, in a padded vocabulary,
  are UNUSED "[PAD<id>]" tokens, as convert_hf_to_gguf.py writes them.
"""

import json
import mmap
import os
import struct
from dataclasses import replace

import numpy as np

from ..data.hf_tokenizer import HFTokenizer
from ..data.tokenizer import BOS, EOS, FIRST_PIECE, UNK, Tokenizer
from ..errors import AnectypesError
from ..model.config import ModelConfig, rope_frequencies
from ..host.untrusted import open_regular
from .hf import MAX_CONTEXT, PERMUTED, rows
from .portable import SPACE, FormatError, Portable, fold, from_names, need, piece_text, scaled_params, unfold

# our layer kinds -> GGUF's tensor names (§8.3); qwen3 adds QK_NAMES
NAMES = dict(rms_att="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output", rms_ffn="ffn_norm",
             w1="ffn_gate", w2="ffn_down", w3="ffn_up")
QK_NAMES = dict(q_norm="attn_q_norm", k_norm="attn_k_norm")
ROPE_FREQS = "rope_freqs.weight"
# our keys (llama.cpp reads none of them): the llama3 RoPE settings, and whether α is folded into wo and w2
LLAMA3 = {"anectypes.rope.factor": "rope_factor", "anectypes.rope.low_freq_factor": "rope_low_freq",
          "anectypes.rope.high_freq_factor": "rope_high_freq",
          "anectypes.rope.original_context_length": "rope_original_context"}
RESIDUAL_SCALED = "anectypes.residual_scaled"
EXACT = {"F32", "F16", "BF16"}          # the tensor types float32 holds exactly: the rest are quantized

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) by the tokenizer.json pre_tokenizer it splits text as
_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_level(regex):
    return dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=regex)


def _split(digits):
    return dict(type="Split", pattern=dict(Regex=_SPLIT % digits), behavior="Isolated", invert=False)


PRE = {"gpt-2": _byte_level(True),
       "smollm": dict(type="Sequence", pretokenizers=[dict(type="Digits", individual_digits=True), _byte_level(True)]),
       "qwen2": dict(type="Sequence", pretokenizers=[_split(""), _byte_level(False)]),
       "llama-bpe": dict(type="Sequence", pretokenizers=[_split("{1,3}"), _byte_level(False)])}
IGNORE_MERGES = {"llama-bpe"}           # llama.cpp's llama3 pre-tokenizer takes a whole word in the vocabulary


def _steps(pre):
    """What of a tokenizer.json pre_tokenizer decides how it splits text."""
    items = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    return [(p.get("type"), p.get("use_regex", True), p.get("add_prefix_space", False), p.get("individual_digits"),
             json.dumps(p.get("pattern"), sort_keys=True), p.get("behavior"), p.get("invert", False))
            if isinstance(p, dict) else p for p in items or [None]]


def pre_name(tok):
    """The llama.cpp pre-tokenizer of a Hugging Face byte-level BPE tokenizer, or FormatError saying why none."""
    doc = json.loads(tok.files["tokenizer.json"])
    model, pre = doc.get("model") or {}, doc.get("pre_tokenizer")
    if model.get("type") != "BPE" or model.get("byte_fallback") or (doc.get("decoder") or {}).get("type") != "ByteLevel":
        raise FormatError("gguf holds a Hugging Face tokenizer.json only as byte-level BPE (llama.cpp's gpt2); this one "
                          f"is {model.get('type')} with the decoder {(doc.get('decoder') or {}).get('type')}")
    if (doc.get("normalizer") or {}).get("type", "NFC") != "NFC":
        raise FormatError(f"the tokenizer's normalizer {doc['normalizer'].get('type')} has no llama.cpp equivalent")
    for name, known in PRE.items():
        if _steps(pre) == _steps(known) and bool(model.get("ignore_merges")) == (name in IGNORE_MERGES):
            return name
    raise FormatError(f"the tokenizer's pre_tokenizer {json.dumps(pre)[:300]} (with ignore_merges "
                      f"{bool(model.get('ignore_merges'))}) is none llama.cpp knows ({', '.join(PRE)}): gguf cannot hold it")


def check(model):
    """Refuse, with the reason, a model a GGUF cannot hold."""
    cfg, tok = model.cfg, model.tokenizer
    if cfg.qk_norm and cfg.rope_type != "default":
        raise FormatError(f"gguf's qwen3 has no {cfg.rope_type} RoPE scaling: export this model with --format hf")
    if isinstance(tok, HFTokenizer):
        pre_name(tok)
        _add_bos(tok)


def _add_bos(tok):
    """Whether the tokenizer's post-processor puts BOS before a text (the one thing gguf can say of it)."""
    plain, added = (tok.tok.encode("a", add_special_tokens=s).ids for s in (False, True))
    if added != plain and not (tok.bos is not None and added == [tok.bos, *plain]):
        raise FormatError(f"the tokenizer adds {[i for i in added if i not in plain]} around a text, which gguf "
                          "cannot hold (only BOS before it)")
    return added != plain


# --- reading ---------------------------------------------------------------------------------------------

def read(path):
    """A GGUF file of architecture llama or qwen3, its tensors of any type gguf-py dequantizes (F32, F16, BF16, the
    Q*, K-quants and IQ types), read as float32."""
    gguf = need("gguf")
    check_metadata(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise FormatError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key, default=None):
        field = reader.get_field(key)
        return default if field is None else field.contents()

    def f32(key, default):  # a float32 field as the shortest decimal that rounds to it (1e-05, not 9.99e-06)
        return float(str(np.float32(value(key, default))))

    arch = value("general.architecture")
    if arch not in ("llama", "qwen3"):
        raise FormatError(f"{path}: architecture {str(arch)[:40]!r}; only llama and qwen3 are supported")
    tensors, quantized = {}, set()
    for t in reader.tensors:
        try:            # gguf-py's own dequantization into a float32 [rows, columns] array of its own, which
            #             from_names takes as it is: one tensor's temporaries at a time beside the weights
            tensors[t.name] = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError:
            raise FormatError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                              "dequantize") from None
        if t.tensor_type.name not in EXACT:
            quantized.add(t.tensor_type.name)
    heads, dim = value(f"{arch}.attention.head_count"), value(f"{arch}.embedding_length")
    tokens, context = value("tokenizer.ggml.tokens") or [], value(f"{arch}.context_length")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if tokens and value(key) is not None and not (type(value(key)) is int and 0 <= value(key) < len(tokens)):
            raise FormatError(f"{path}: its {key} {str(value(key))[:20]} lies outside its {len(tokens)} tokens")
    llama3 = {ours: value(key) for key, ours in LLAMA3.items() if value(key) is not None}
    if llama3 and ROPE_FREQS not in tensors:
        raise FormatError(f"{path}: anectypes.rope.* settings without {ROPE_FREQS}")
    try:
        cfg = ModelConfig(dim=dim, hidden=value(f"{arch}.feed_forward_length"), heads=heads,
                          kv_heads=value(f"{arch}.attention.head_count_kv", heads),
                          head_dim=value(f"{arch}.attention.key_length", dim // heads),
                          layers=value(f"{arch}.block_count"),
                          seq=min(context, MAX_CONTEXT) if type(context) is int else context,     # as a folder's
                          vocab=value(f"{arch}.vocab_size", len(tokens)),
                          rope_theta=f32(f"{arch}.rope.freq_base", 10000.0),
                          norm_eps=f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), qk_norm=arch == "qwen3",
                          residual_scaled=value(RESIDUAL_SCALED) is True,
                          tied="output.weight" not in tensors).validate()
    except (TypeError, ValueError, ZeroDivisionError, AnectypesError) as e:
        raise FormatError(f"{path}: its {arch}.* keys do not make a model ({type(e).__name__}: {e})") from None
    if ROPE_FREQS in tensors:            # llama.cpp's converter writes the tensor alone: its settings found from it
        divisors = tensors[ROPE_FREQS]
        try:
            cfg = replace(cfg, rope_type="llama3", **(llama3 or llama3_settings(divisors, cfg))).validate()
            fits = np.allclose(divisors, rope_factors(cfg), rtol=1e-6, atol=0)
        except (TypeError, ValueError, ZeroDivisionError, AnectypesError):
            fits = False
        if not fits:
            raise FormatError(f"{path}: {ROPE_FREQS} is not what its anectypes.rope.* settings give" if llama3 else
                              f"{path}: {ROPE_FREQS} is not Llama 3's RoPE scaling (no factor, low and high frequency "
                              "factors give it), which is the one anectypes computes")
    top = {"embed": "token_embd.weight", "rms_final": "output_norm.weight",
           **({} if cfg.tied else {"classifier": "output.weight"})}
    params = from_names(path, cfg, tensors, top, "blk.{i}.{name}.weight", {**NAMES, **(QK_NAMES if cfg.qk_norm else {})})
    if arch == "qwen3":
        params = halves(params, cfg, to_hf=False)
    tokenizer = None
    if value("tokenizer.ggml.model") == "llama" and tokens:
        tokenizer = Tokenizer([t.replace(SPACE, " ") for t in tokens], value("tokenizer.ggml.scores"))
    elif value("tokenizer.ggml.model") == "gpt2" and tokens:
        tokenizer = read_gpt2(path, value, tokens)
    return Portable(cfg, scaled_params(params, cfg, unfold), tokenizer, dequantized=tuple(sorted(quantized)),
                    context=context)


# GGUF's value types (gguf-py's GGUFValueType) -> their size in bytes; STRING and ARRAY have their own layout
WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def check_metadata(path):
    """Refuse, before gguf-py reads it, metadata it would allocate or loop for without bound: counts and lengths
    beyond the file's bytes, an array of arrays (no model key is one), a tensor of more than 4 dimensions."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return                              # gguf-py says what is wrong with it
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    order = ">" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF == 0 else "<"     # gguf-py reads big-endian too
    at = 24

    def room(n, what):                          # each item takes a byte or more: a count is bounded by the file
        if n > size - at:
            raise FormatError(f"{path}: not a readable GGUF file ({what} claims {n:,} bytes or more, beyond its end)")

    def take(n, what):
        nonlocal at
        room(n, what)
        at += n
        return at - n

    def number(form, what):
        return struct.unpack_from(order + form, m, take(struct.calcsize(form), what))[0]

    def string(what):
        n = number("Q", what)
        return m[take(n, what):at].decode("utf-8", "replace")

    with m:
        tensors, keys = struct.unpack_from(order + "QQ", m, 8)
        room(keys, f"a count of {keys:,} metadata keys")
        for _ in range(keys):
            key = string("a metadata key")[:80]
            kind, count = number("I", key), 1
            if kind == ARRAY:
                kind, count = number("I", key), number("Q", key)
                room(count, key)
                if kind == ARRAY:
                    raise FormatError(f"{path}: its metadata {key} is an array of arrays, which no model key is")
            if kind == STRING:              # a tokenizer's 150,000 strings: the loop kept tight
                length = struct.Struct(order + "Q").unpack_from
                for _ in range(count):
                    if at + 8 > size or (at := at + 8 + length(m, at)[0]) > size:
                        raise FormatError(f"{path}: not a readable GGUF file ({key}'s strings run beyond its end)")
            elif kind in WIDTHS:
                take(count * WIDTHS[kind], key)
            else:
                raise FormatError(f"{path}: its metadata {key} has the unknown type {kind}")
        room(tensors, f"a count of {tensors:,} tensors")
        for _ in range(tensors):
            name = string("a tensor name")[:80]
            dims = number("I", name)
            if dims > 4:
                raise FormatError(f"{path}: tensor {name} claims {dims} dimensions; GGUF's tensors have at most 4")
            take(8 * dims + 12, name)


def halves(params, cfg, to_hf):
    """params with the rows of wq, wk, q_norm and k_norm reordered between our pairs and NEOX's halves."""
    return {k: rows(v, PERMUTED[k.rsplit(".", 1)[-1]](cfg), to_hf) if k.rsplit(".", 1)[-1] in PERMUTED else v
            for k, v in params.items()}


def llama3_settings(divisors, cfg):
    """The llama3 settings that give rope_freqs' divisors (of the pairs' frequencies, 1/wavelength x): the factor is
    the largest; the pairs between 1 and it are blended linearly in x from x_low = low/original_context (the
    factor) to x_high = high/original_context (1), which two of them fix; one, or none, leaves a choice that any
    value within the pairs' gaps makes alike. original_context is then Llama 3's 8192: the divisors depend on
    the ratios alone. read() checks that the settings give the divisors."""
    d = np.asarray(divisors, np.float64)
    factor, tol = float(np.float32(d.max())), 1e-6
    x = cfg.rope_theta ** (-2.0 * np.arange(cfg.head_dim // 2) / cfg.head_dim) / (2 * np.pi)
    kept = d <= 1 + tol
    slow = ~kept & (d >= factor * (1 - tol))
    mid = ~(slow | kept)
    blend = (1 / d[mid] - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        slope, at = np.polyfit(x[mid], blend, 1)
        low, high = -at / slope, (1 - at) / slope
    else:          # low above every slowed pair's x, high below every kept one's, away from both
        floor = x[slow].max() if slow.any() else x.min() / 2
        ceiling = x[kept].min() if kept.any() else 2 * x.max()
        if mid.any():                   # and the one blended pair's blend (x − low)/(high − low)
            at, share = x[mid][0], blend[0]
            high = (at + ceiling) / 2
            low = (at - share * high) / (1 - share)
            if low <= floor:
                low = (floor + at) / 2
                high = low + (at - low) / share
        else:
            low, high = floor + (ceiling - floor) / 3, floor + 2 * (ceiling - floor) / 3
    exact = dict(rope_factor=factor, rope_low_freq=float(8192 * low), rope_high_freq=float(8192 * high),
                 rope_original_context=8192)
    short = {**exact, **{k: float(f"{exact[k]:.6g}") for k in ("rope_low_freq", "rope_high_freq")}}   # Llama 3's 1, 4
    return short if np.allclose(rope_factors(replace(cfg, rope_type="llama3", **short)), d, rtol=1e-7, atol=0) else exact


def rope_factors(cfg):
    """rope_freqs.weight: each pair's divisor of its unscaled frequency, as convert_hf_to_gguf.py's."""
    plain = cfg.rope_theta ** (-2.0 * np.arange(cfg.head_dim // 2) / cfg.head_dim)
    return (plain / rope_frequencies(cfg)).astype(np.float32)


def read_gpt2(path, value, tokens):
    """The HFTokenizer of a "gpt2" tokenizer: its tokenizer.json and tokenizer_config.json made again."""
    pre, types = value("tokenizer.ggml.pre"), value("tokenizer.ggml.token_type") or []
    if pre not in PRE or len(types) != len(tokens):
        raise FormatError(f"{path}: its gpt2 tokenizer (pre-tokenizer {str(pre)[:40]}, {len(types)} types for "
                          f"{len(tokens)} tokens) is none anectypes reads ({', '.join(PRE)})")
    T = need("gguf").TokenType
    kept = [i for i, t in enumerate(types) if t != T.UNUSED]
    added = [dict(id=i, content=tokens[i], single_word=False, lstrip=False, rstrip=False, normalized=False,
                  special=types[i] == T.CONTROL) for i in kept if types[i] in (T.CONTROL, T.USER_DEFINED)]
    bos, eos = (i if type(i) is int and 0 <= i < len(tokens) else None
                for i in (value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")))
    template = dict(type="TemplateProcessing", single=[dict(SpecialToken=dict(id=tokens[bos], type_id=0)),
                                                       dict(Sequence=dict(id="A", type_id=0))],
                    pair=[dict(SpecialToken=dict(id=tokens[bos], type_id=0)), dict(Sequence=dict(id="A", type_id=0)),
                          dict(Sequence=dict(id="B", type_id=1))],
                    special_tokens={tokens[bos]: dict(id=tokens[bos], ids=[bos], tokens=[tokens[bos]])}
                    ) if value("tokenizer.ggml.add_bos_token") and bos is not None else None
    doc = dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None, pre_tokenizer=PRE[pre],
               post_processor=template, decoder=dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True,
                                                     use_regex=True),
               model=dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None,
                          end_of_word_suffix=None, fuse_unk=False, byte_fallback=False,
                          ignore_merges=pre in IGNORE_MERGES, vocab={tokens[i]: i for i in kept},
                          merges=[m.split(" ", 1) for m in value("tokenizer.ggml.merges") or []]))
    conf = {k: tokens[i] for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    if value("tokenizer.chat_template") is not None:
        conf["chat_template"] = value("tokenizer.chat_template")
    try:
        return HFTokenizer({"tokenizer.json": json.dumps(doc).encode(), "tokenizer_config.json": json.dumps(conf).encode()},
                           path)
    except AnectypesError as e:
        raise FormatError(f"{path}: its gpt2 tokenizer does not load ({e})") from None


# --- writing ---------------------------------------------------------------------------------------------

def write(model, path, dtype="f32"):
    cfg, tok = model.cfg, model.tokenizer
    gguf = need("gguf")
    arch = "qwen3" if cfg.qk_norm else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    keys = dict(name="anectypes", context_length=cfg.seq, embedding_length=cfg.dim, block_count=cfg.layers,
                feed_forward_length=cfg.hidden, head_count=cfg.heads, head_count_kv=cfg.kv_heads,
                key_length=cfg.head_dim, value_length=cfg.head_dim, rope_dimension_count=cfg.head_dim,
                rope_freq_base=cfg.rope_theta, layer_norm_rms_eps=cfg.norm_eps, vocab_size=cfg.vocab,
                file_type=gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32,
                **(gpt2_keys(tok, cfg, gguf.TokenType) if isinstance(tok, HFTokenizer) else llama_keys(tok, gguf.TokenType)))
    for key, value in keys.items():                   # the writer's add_<key> methods, in this order
        getattr(w, f"add_{key}")(value)
    w.add_bool(RESIDUAL_SCALED, cfg.residual_scaled)
    if cfg.rope_type == "llama3":
        for key, ours in LLAMA3.items():
            (w.add_uint32 if ours == "rope_original_context" else w.add_float32)(key, getattr(cfg, ours))
    params = scaled_params(model.params, cfg, fold)
    if arch == "qwen3":
        params = halves(params, cfg, to_hf=True)
    names = {"token_embd.weight": "embed"}
    for i in range(cfg.layers):
        names.update({f"blk.{i}.{v}.weight": f"layers.{i}.{k}"
                      for k, v in {**NAMES, **(QK_NAMES if cfg.qk_norm else {})}.items()})
    names["output_norm.weight"] = "rms_final"
    if not cfg.tied:
        names["output.weight"] = "classifier"
    for name, ours in names.items():
        a = params[ours]
        w.add_tensor(name, np.ascontiguousarray(a, np.float16 if dtype == "f16" and a.ndim == 2 else np.float32))
    if cfg.rope_type == "llama3":
        w.add_tensor(ROPE_FREQS, rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_keys(tok, T):
    """The tokenizer keys of a llama2.c tokenizer.bin: sentencepiece-style tokens with scores."""
    return dict(tokenizer_model="llama", token_list=[piece_text(p) for p in tok.pieces], token_scores=tok.scores,
                token_types=[T.UNKNOWN if i == UNK else T.CONTROL if i in (BOS, EOS) else T.BYTE if i < FIRST_PIECE
                             else T.NORMAL for i in range(len(tok.pieces))],
                bos_token_id=BOS, eos_token_id=EOS, unk_token_id=UNK, add_bos_token=True, add_eos_token=False,
                add_space_prefix=True)


def gpt2_keys(tok, cfg, T):
    """The tokenizer keys of a Hugging Face byte-level BPE tokenizer (see the module), over cfg's vocabulary."""
    added = tok.tok.get_added_tokens_decoder()
    tokens = [tok.tok.id_to_token(i) if i < tok.vocab_size else None for i in range(cfg.vocab)]
    types = [T.UNUSED if t is None else T.NORMAL if i not in added else T.CONTROL if added[i].special
             else T.USER_DEFINED for i, t in enumerate(tokens)]
    merges = json.loads(tok.files["tokenizer.json"])["model"].get("merges") or []
    keys = dict(tokenizer_model="gpt2", tokenizer_pre=pre_name(tok),
                token_list=[f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)], token_types=types,
                token_merges=[m if isinstance(m, str) else " ".join(m) for m in merges],
                **({} if tok.bos is None else dict(bos_token_id=tok.bos)),
                **({} if tok.eos is None else dict(eos_token_id=tok.eos)), add_bos_token=_add_bos(tok))
    return {**keys, **({} if tok.chat_template is None else dict(chat_template=tok.chat_template))}
