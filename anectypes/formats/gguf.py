"""GGUF files of architecture llama, for llama.cpp, Ollama and LM Studio (docs/ane-reference.md §8.3):
the model's keys, its tokenizer (tokens, scores, types, BOS/EOS) and F32 or F16 tensors, read and
written with the `gguf` package (the `export` extra).
"""

import struct

import numpy as np

from ..data.tokenizer import BOS, EOS, FIRST_PIECE, UNK, Tokenizer
from ..errors import AnectypesError
from ..model.config import ModelConfig
from .portable import SPACE, FormatError, Portable, fold, from_names, need, piece_text, scaled_params, unfold

# our layer kinds -> GGUF's tensor names (§8.3)
NAMES = dict(rms_att="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output", rms_ffn="ffn_norm",
             w1="ffn_gate", w2="ffn_down", w3="ffn_up")


def read(path):
    """A GGUF file of architecture llama with F32/F16 tensors."""
    gguf = need("gguf")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise FormatError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key, default=None):
        field = reader.get_field(key)
        return default if field is None else field.contents()

    def f32(key, default):  # a float32 field as the shortest decimal that rounds to it (1e-05, not 9.99e-06)
        return float(str(np.float32(value(key, default))))

    if value("general.architecture") != "llama":
        raise FormatError(f"{path}: architecture {value('general.architecture')!r}; only llama is supported")
    heads, dim = value("llama.attention.head_count"), value("llama.embedding_length")
    tokens = value("tokenizer.ggml.tokens") or []
    try:
        cfg = ModelConfig(dim=dim, hidden=value("llama.feed_forward_length"), heads=heads,
                          kv_heads=value("llama.attention.head_count_kv", heads),
                          head_dim=value("llama.attention.key_length", dim // heads),
                          layers=value("llama.block_count"),
                          seq=value("llama.context_length"), vocab=value("llama.vocab_size", len(tokens)),
                          rope_theta=f32("llama.rope.freq_base", 10000.0),
                          norm_eps=f32("llama.attention.layer_norm_rms_epsilon", 1e-5)).validate()
    except (TypeError, ValueError, ZeroDivisionError, AnectypesError) as e:
        raise FormatError(f"{path}: its llama.* keys do not make a model ({type(e).__name__}: {e})") from None
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise FormatError(f"{path}: tensor {t.name} is {t.tensor_type.name}; only F32 and F16 are read")
        tensors[t.name] = np.asarray(t.data, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    if "output.weight" in tensors:
        raise FormatError(f"{path}: its output matrix is not the embedding (untied), but ours is tied")
    params = from_names(path, cfg, tensors, {"embed": "token_embd.weight", "rms_final": "output_norm.weight"},
                        "blk.{i}.{name}.weight", NAMES)
    tokenizer = None
    if value("tokenizer.ggml.model") == "llama" and tokens:
        tokenizer = Tokenizer([t.replace(SPACE, " ") for t in tokens], value("tokenizer.ggml.scores"))
    return Portable(cfg, scaled_params(params, cfg, unfold), tokenizer)


def write(model, path, dtype="f32"):
    cfg, tok = model.cfg, model.tokenizer
    gguf = need("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    T = gguf.TokenType
    keys = dict(name="anectypes", context_length=cfg.seq, embedding_length=cfg.dim, block_count=cfg.layers,
                feed_forward_length=cfg.hidden, head_count=cfg.heads, head_count_kv=cfg.kv_heads,
                key_length=cfg.head_dim, value_length=cfg.head_dim, rope_dimension_count=cfg.head_dim,
                rope_freq_base=cfg.rope_theta, layer_norm_rms_eps=cfg.norm_eps, vocab_size=cfg.vocab,
                file_type=gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32,
                tokenizer_model="llama", token_list=[piece_text(p) for p in tok.pieces], token_scores=tok.scores,
                token_types=[T.UNKNOWN if i == UNK else T.CONTROL if i in (BOS, EOS) else T.BYTE if i < FIRST_PIECE
                             else T.NORMAL for i in range(len(tok.pieces))],
                bos_token_id=BOS, eos_token_id=EOS, unk_token_id=UNK, add_bos_token=True, add_eos_token=False,
                add_space_prefix=True)
    for key, value in keys.items():                   # the writer's add_<key> methods, in this order
        getattr(w, f"add_{key}")(value)
    params = scaled_params(model.params, cfg, fold)
    names = {"token_embd.weight": "embed"}
    for i in range(cfg.layers):
        names.update({f"blk.{i}.{v}.weight": f"layers.{i}.{k}" for k, v in NAMES.items()})
    names["output_norm.weight"] = "rms_final"
    for name, ours in names.items():
        a = params[ours]
        w.add_tensor(name, np.ascontiguousarray(a, np.float16 if dtype == "f16" and a.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
