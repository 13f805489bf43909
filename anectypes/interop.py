"""Models in other tools' formats (docs/ane-reference.md §8): written for llama2.c's run.c, Hugging Face
transformers and llama.cpp (GGUF), and read back, with any anectypes source, as a starting point.

A `Portable` is a model in our own terms: the ModelConfig, the parameters by our names in training's
convention (residual branches scaled by α = 1/√(2L) at run time, §4.3) and the tokenizer when known.
The other tools have no residual scale, so writing folds α into wo and w2 and reading divides it out
again, choosing for each weight the float32 that folds back to the same bits (`unfold`): export →
import → export is byte-identical. Hugging Face rotates the two halves of each head where we (and
llama2.c and llama.cpp) rotate interleaved pairs: its wq and wk rows are permuted per head (§8.2).

The readers need numpy only (safetensors files are parsed here), except GGUF's, which uses the `gguf`
package; the writers need the `export` extra (safetensors, tokenizers, gguf).
"""

import contextlib
import glob
import json
import math
import os
import re
import secrets
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import REFERENCE_MAGIC, load_checkpoint, read_reference_checkpoint
from .errors import AnectypesError
from .llama2c import read_model, write_model
from .model.config import ModelConfig, param_shapes
from .runs import RunDir
from .host.processes import process_start
from .data.tokenizer import BOS, EOS, FIRST_PIECE, UNK, Tokenizer

FORMATS = ("llama2c", "hf", "gguf")
SPACE = "\u2581"            # SentencePiece's visible space, in the pieces of HF's and GGUF's vocabularies
# our layer kinds <-> Hugging Face Llama's and GGUF's tensor names (§8.2, §8.3)
HF_NAMES = dict(rms_att="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj",
                wo="self_attn.o_proj", rms_ffn="post_attention_layernorm", w1="mlp.gate_proj", w2="mlp.down_proj",
                w3="mlp.up_proj")
GGUF_NAMES = dict(rms_att="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output", rms_ffn="ffn_norm",
                  w1="ffn_gate", w2="ffn_down", w3="ffn_up")


class InteropError(AnectypesError):
    """A model that cannot be read or written in a format, saying why."""


@dataclass
class Portable:
    cfg: ModelConfig
    params: dict                # our names and shapes, float32, α applied at run time
    tokenizer: object = None    # Tokenizer, or None when the source has none


def need(module):
    """Import one of the export extra's libraries, or stop with one line naming the extra."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise InteropError(f"this needs the {module.split('.')[0]} package: pip install 'anectypes[export]'") from None


# --- α: folded into wo and w2 for the tools that have no residual scale ----------------------------------

def fold(x, alpha):
    """x·α rounded once to float32."""
    return (np.asarray(x, np.float64) * alpha).astype(np.float32)


def unfold(y, alpha):
    """The float32 x nearest y/α, moved by one step where needed so that fold(x) == y whenever y is a fold."""
    y = np.asarray(y, np.float32)
    x = (y.astype(np.float64) / alpha).astype(np.float32)
    for toward in (np.inf, -np.inf):
        miss = fold(x, alpha) != y
        nudged = np.nextafter(x, np.float32(toward))
        x = np.where(miss & (fold(nudged, alpha) == y), nudged, x)
    return x


def scaled_params(params, cfg, scale):
    """params with each layer's wo and w2 mapped by scale(w, α); the rest as they are."""
    return {k: scale(v, cfg.alpha) if k.rsplit(".", 1)[-1] in ("wo", "w2") else v for k, v in params.items()}


def hf_rows(w, heads, to_hf):
    """wq or wk [heads·hd, dim] with each head's rows reordered between interleaved pairs (2j, 2j+1)
    and Hugging Face's halves (j, j + hd/2)."""
    hd = w.shape[0] // heads
    shape = (heads, hd // 2, 2, -1) if to_hf else (heads, 2, hd // 2, -1)
    return np.ascontiguousarray(w.reshape(shape).swapaxes(1, 2).reshape(w.shape))


# --- reading: any source ---------------------------------------------------------------------------------

def load(source, checkpoint=None, tokenizer=None):
    """The Portable of SOURCE, detected from its content: a run folder or anectypes .ckpt, a reference
    v2/v4 checkpoint, a llama2.c model.bin (v0/v1), a Hugging Face Llama folder or a GGUF file. The
    tokenizer: `tokenizer` (a tokenizer.bin) if given, else the run's, the one in the file or beside it."""
    path = Path(source)
    if checkpoint and not (path.is_dir() and RunDir(path).exists()):
        raise InteropError(f"{source}: --checkpoint needs a run folder")
    if path.is_dir():
        model = (read_hf(path) if is_hf(path) else read_run(path, checkpoint) if RunDir(path).exists() else
                 read_llama2c(path / "model.bin") if
                 (path / "model.bin").is_file() else None)
        if model is None:
            raise InteropError(f"{source}: not a run folder, a Hugging Face model folder (config.json) or a "
                               "llama2.c folder (model.bin)")
    elif path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        model = (read_ckpt(path) if magic == b"PK\x03\x04" else read_gguf(path) if magic == b"GGUF" else
                 read_reference(path) if magic == struct.pack("<I", REFERENCE_MAGIC) else read_llama2c(path))
    else:
        raise InteropError(f"{source}: no such file or folder")
    if tokenizer:
        model.tokenizer = Tokenizer.load(tokenizer)
    if model.tokenizer is not None and model.tokenizer.vocab_size != model.cfg.vocab:
        raise InteropError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary has "
                           f"{model.cfg.vocab}; pass the model's own with --tokenizer")
    check_finite(source, model.params)
    return model


def check_finite(source, params):
    """Refuse weights that hold NaN or inf: the model's text would be noise (its sampler has nothing to
    draw from), its training NaN."""
    for name, a in params.items():
        if not np.isfinite(a).all():
            raise InteropError(f"{source}: its {name} holds NaN or inf; the model is damaged")


def is_hf(path):
    """Whether a folder's config.json is a Hugging Face model's (a run folder's has our format)."""
    try:
        conf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(conf, dict) and "model_type" in conf


def foreign(path):
    """Whether SOURCE is a model anectypes.generate leaves to `load`: a Hugging Face or llama2.c folder,
    a GGUF file or the reference's checkpoint."""
    path = Path(path)
    if path.is_dir():
        return is_hf(path) or (path / "model.bin").is_file() and not RunDir(path).exists()
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(4) in (b"GGUF", struct.pack("<I", REFERENCE_MAGIC))
    return False


def read_run(path, checkpoint=None):
    """A run folder's checkpoint (best, else latest; or `checkpoint`) with the run's tokenizer."""
    rd = RunDir(path)
    ckpt = {"best": rd.best, "latest": rd.latest}.get(checkpoint or "best", Path(checkpoint or ""))
    if not checkpoint and not ckpt.is_file():
        ckpt = rd.latest                              # a run that has not validated yet
    if not ckpt.is_file():
        raise InteropError(f"{ckpt}: no such checkpoint (--checkpoint latest, best or a file)")
    return read_ckpt(ckpt, path)


def read_ckpt(path, run=None):
    """An anectypes checkpoint, with the tokenizer of its run folder (`run`, else the one it is in, if any)."""
    from .generate import run_vocabulary         # generate reads these sources too
    ckpt = load_checkpoint(path)
    rd = RunDir(run or Path(path).resolve().parent.parent)
    tokenizer = run_vocabulary(rd.read_config()[0])[0] if rd.exists() else None
    return Portable(ModelConfig(**ckpt.config), ckpt.params, tokenizer)


def read_reference(path):
    ref = read_reference_checkpoint(path)
    return Portable(ref.config, ref.params)


def read_llama2c(path):
    m = read_model(path)
    if m.classifier is not None:
        raise InteropError(f"{path}: its classifier is not the embedding (unshared), but ours is tied: "
                           "this model cannot be trained or exported here")
    beside = Path(path).parent / "tokenizer.bin"
    return Portable(m.cfg, scaled_params(m.params, m.cfg, unfold), Tokenizer.load(beside) if beside.is_file() else None)


def read_safetensors(path):
    """{name: float32 array} of a safetensors file (F32, F16 or BF16 tensors), parsed with numpy."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            header = json.loads(f.read(n)) if 2 <= n <= size - 8 else None
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise InteropError(f"{path}: not a safetensors file (no JSON header)")
    body, out = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8), {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype = t.get("dtype") if isinstance(t, dict) else None
        kind = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}.get(dtype if isinstance(dtype, str) else None)
        if kind is None:
            raise InteropError(f"{path}: tensor {name} is {str(t)[:200]}; only F32, F16 and BF16 tensors are read")
        shape = t.get("shape")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise InteropError(f"{path}: tensor {name}'s shape {str(shape)[:80]} is not a list of sizes")
        try:
            (start, end), n_bytes = t["data_offsets"], math.prod(shape) * np.dtype(kind).itemsize
            inside = 0 <= start <= end <= len(body) and end - start == n_bytes
        except (KeyError, TypeError, ValueError):
            inside = False
        if not inside:
            raise InteropError(f"{path}: tensor {name} lies outside the file (truncated or damaged)")
        a = np.frombuffer(body[start:end], kind).reshape(t["shape"])
        out[name] = (a.astype(np.uint32) << 16).view(np.float32) if kind == "<u2" else a.astype(np.float32)
    return out


def read_hf(path):
    """A Hugging Face Llama folder: config.json and model.safetensors (or its shards)."""
    try:
        conf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{path / 'config.json'}: not readable JSON ({e})") from None
    arch = conf.get("architectures") or [conf.get("model_type")]
    arch = arch[0] if isinstance(arch, list) else arch
    if arch != "LlamaForCausalLM":
        raise InteropError(f"{path}: a {str(arch)[:80]} model; only LlamaForCausalLM (Llama) is supported")
    unsupported = {k: conf[k] for k in ("rope_scaling", "attention_bias", "mlp_bias") if conf.get(k)}
    if conf.get("hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = conf["hidden_act"]
    if unsupported:
        raise InteropError(f"{path}: {unsupported} is not supported (anectypes trains plain Llama)")
    try:
        cfg = hf_config(conf).validate()
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AnectypesError) as e:
        raise InteropError(f"{path / 'config.json'}: not a usable Llama config ({type(e).__name__}: {e})") from None
    index = path / "model.safetensors.index.json"
    try:
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else
                 ["model.safetensors"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InteropError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not all(isinstance(name, str) and Path(name).name == name for name in files):   # no path out of the folder
        raise InteropError(f"{index}: its weight_map names files other than those in the folder")
    tensors = {}
    for name in files:
        if not (path / name).is_file():
            raise InteropError(f"{path / name}: missing (anectypes reads safetensors weights)")
        tensors.update(read_safetensors(path / name))
    embed = tensors.get("model.embed_tokens.weight")
    if "lm_head.weight" in tensors and not np.array_equal(tensors["lm_head.weight"], embed):
        raise InteropError(f"{path}: its lm_head is not the embedding (tie_word_embeddings false), but ours is tied")
    params = from_names(path, cfg, tensors, {"embed": "model.embed_tokens.weight", "rms_final": "model.norm.weight"},
                        "model.layers.{i}.{name}.weight", HF_NAMES)
    for i in range(cfg.layers):
        for k, h in (("wq", cfg.heads), ("wk", cfg.kv_heads)):
            params[f"layers.{i}.{k}"] = hf_rows(params[f"layers.{i}.{k}"], h, to_hf=False)
    beside = path / "tokenizer.bin"
    return Portable(cfg, scaled_params(params, cfg, unfold), Tokenizer.load(beside) if beside.is_file() else None)


def hf_config(conf):
    """The ModelConfig of a Hugging Face Llama config.json."""
    heads = conf["num_attention_heads"]
    rope = conf.get("rope_parameters") or {}
    return ModelConfig(dim=conf["hidden_size"], hidden=conf["intermediate_size"], heads=heads,
                       kv_heads=conf.get("num_key_value_heads") or heads,
                       head_dim=conf.get("head_dim") or conf["hidden_size"] // heads, layers=conf["num_hidden_layers"],
                       seq=conf.get("max_position_embeddings", 2048), vocab=conf["vocab_size"],
                       rope_theta=float(conf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                       norm_eps=float(conf.get("rms_norm_eps", 1e-6)))


def from_names(path, cfg, tensors, top, layer, kinds):
    """Our parameters from a file's tensors, each checked against its shape: `top` names the embedding's
    and the final norm's, `layer` (with i and name) each layer's, for its kinds {ours: theirs}."""
    need = len(kinds) * cfg.layers + len(top)
    if need > len(tensors):                       # before naming them: a config may claim 10^9 layers
        raise InteropError(f"{path}: its config's {cfg.layers} layers need {need} tensors, the file holds "
                           f"{len(tensors)}")
    names = dict(top, **{f"layers.{i}.{k}": layer.format(i=i, name=v) for i in range(cfg.layers)
                         for k, v in kinds.items()})
    params = {}
    for ours, shape in param_shapes(cfg.validate()).items():
        a = tensors.get(names[ours])
        if a is None or a.shape != shape:
            found = "missing" if a is None else f"{list(a.shape)}"
            raise InteropError(f"{path}: tensor {names[ours]} is {found}; the config needs {list(shape)}")
        params[ours] = np.array(a, np.float32)              # our own, writable copy (training updates it)
    return params


def read_gguf(path):
    """A GGUF file of architecture llama with F32/F16 tensors (read with the gguf package)."""
    gguf = need("gguf")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise InteropError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key, default=None):
        field = reader.get_field(key)
        return default if field is None else field.contents()

    def f32(key, default):  # a float32 field as the shortest decimal that rounds to it (1e-05, not 9.99e-06)
        return float(str(np.float32(value(key, default))))

    if value("general.architecture") != "llama":
        raise InteropError(f"{path}: architecture {value('general.architecture')!r}; only llama is supported")
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
        raise InteropError(f"{path}: its llama.* keys do not make a model ({type(e).__name__}: {e})") from None
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise InteropError(f"{path}: tensor {t.name} is {t.tensor_type.name}; only F32 and F16 are read")
        tensors[t.name] = np.asarray(t.data, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    if "output.weight" in tensors:
        raise InteropError(f"{path}: its output matrix is not the embedding (untied), but ours is tied")
    params = from_names(path, cfg, tensors, {"embed": "token_embd.weight", "rms_final": "output_norm.weight"},
                        "blk.{i}.{name}.weight", GGUF_NAMES)
    tokenizer = None
    if value("tokenizer.ggml.model") == "llama" and tokens:
        tokenizer = Tokenizer([t.replace(SPACE, " ") for t in tokens], value("tokenizer.ggml.scores"))
    return Portable(cfg, scaled_params(params, cfg, unfold), tokenizer)


# --- writing ---------------------------------------------------------------------------------------------

def check_target(model, fmt):
    """Refuse, with the reason, a model the target cannot represent."""
    cfg = model.cfg
    if fmt == "llama2c":
        if cfg.head_dim * cfg.heads != cfg.dim:
            raise InteropError(f"llama2.c's run.c computes head_size as dim / n_heads ({cfg.dim} / {cfg.heads}), "
                               f"but this model's head_dim is {cfg.head_dim}: export it as hf or gguf")
        fixed = {k: v for k, v in (("rope_theta", 10000.0), ("norm_eps", 1e-5)) if getattr(cfg, k) != v}
        if fixed:
            want = ", ".join(f"{k} = {v}" for k, v in fixed.items())
            have = ", ".join(f"{k} = {getattr(cfg, k)}" for k in fixed)
            raise InteropError(f"llama2.c's run.c fixes {want}; this model has {have}: export it as hf or gguf")
    if model.tokenizer is None:
        raise InteropError("the source has no tokenizer (a run on --data without --tokenizer): pass --tokenizer")


def write_llama2c(model, folder, dtype="f32"):
    params = scaled_params(model.params, model.cfg, fold)
    write_model(folder / "model.bin", model.cfg, params, version=0)
    model.tokenizer.save(folder / "tokenizer.bin")


def hf_piece(piece):
    try:
        return piece.decode("utf-8").replace(" ", SPACE)
    except UnicodeDecodeError:
        raise InteropError(f"the vocabulary's piece {piece!r} is not UTF-8, which tokenizer.json cannot hold") from None


def hf_merges(tok):
    """The merges that make each mergeable piece from two others, best score first: Hugging Face's BPE
    then merges what llama2.c's score-driven loop merges (§8.2 says where they can differ)."""
    ids = {p: i for i, p in reversed(list(enumerate(tok.pieces)))}
    merges = []
    for i, p in enumerate(tok.pieces[FIRST_PIECE:], FIRST_PIECE):
        if p in tok._merges and tok._merges[p][1] == i:
            text = p.decode("utf-8", "surrogateescape")
            for k in range(1, len(text)):
                left, right = (ids.get(s.encode("utf-8", "surrogateescape")) for s in (text[:k], text[k:]))
                if left is not None and right is not None:
                    merges.append((-tok.scores[i], i, left, right))
    return [(hf_piece(tok.pieces[a]), hf_piece(tok.pieces[b])) for _, _, a, b in sorted(merges)]


def hf_tokenizer(tok):
    """tokenizer.json's Tokenizer: llama2.c's BPE with byte fallback, the dummy-prefix space, BOS."""
    tk = need("tokenizers")
    vocab = {}
    for i, p in enumerate(tok.pieces):
        vocab.setdefault(hf_piece(p), i)
    if len(vocab) != len(tok.pieces):
        raise InteropError("the vocabulary holds the same piece twice, which tokenizer.json cannot hold")
    t = tk.Tokenizer(tk.models.BPE(vocab, hf_merges(tok), unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend(SPACE), tk.normalizers.Replace(" ", SPACE)])
    t.decoder = tk.decoders.Sequence([tk.decoders.Replace(SPACE, " "), tk.decoders.ByteFallback(),
                                      tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([hf_piece(tok.pieces[i]) for i in (UNK, BOS, EOS)])
    bos = hf_piece(tok.pieces[BOS])
    t.post_processor = tk.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                        special_tokens=[(bos, BOS)])
    return t


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_hf(model, folder, dtype="f32"):
    cfg, tok = model.cfg, model.tokenizer
    st = need("safetensors.numpy")
    hf_tok = hf_tokenizer(tok)
    torch_dtype = {"f32": "float32", "f16": "float16"}[dtype]
    write_json(folder / "config.json", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=cfg.dim, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.seq, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        vocab_size=cfg.vocab, tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
        bos_token_id=BOS, eos_token_id=EOS, torch_dtype=torch_dtype))
    write_json(folder / "generation_config.json", dict(bos_token_id=BOS, eos_token_id=EOS))
    params = scaled_params(model.params, cfg, fold)
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["rms_final"]}
    for i in range(cfg.layers):
        for k, name in HF_NAMES.items():
            w = params[f"layers.{i}.{k}"]
            if k in ("wq", "wk"):
                w = hf_rows(w, cfg.heads if k == "wq" else cfg.kv_heads, to_hf=True)
            tensors[f"model.layers.{i}.{name}.weight"] = w
    cast = np.float16 if dtype == "f16" else np.float32
    # bytes written here: safetensors' and tokenizers' own file writers make a 0600 file (a mkstemp-like
    # temporary one, renamed) and raise their own exception types on a full disk
    (folder / "model.safetensors").write_bytes(st.save({k: np.ascontiguousarray(v, cast) for k, v in tensors.items()},
                                                       metadata={"format": "pt"}))
    (folder / "tokenizer.json").write_text(hf_tok.to_str(pretty=True))
    special = {k: hf_piece(tok.pieces[i]) for k, i in (("bos_token", BOS), ("eos_token", EOS), ("unk_token", UNK))}
    write_json(folder / "tokenizer_config.json", dict(tokenizer_class="PreTrainedTokenizerFast", **special,
                                                      clean_up_tokenization_spaces=False, split_special_tokens=True,
                                                      model_max_length=cfg.seq))
    tok.save(folder / "tokenizer.bin")


def write_gguf(model, path, dtype="f32"):
    cfg, tok = model.cfg, model.tokenizer
    gguf = need("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    T = gguf.TokenType
    keys = dict(name="anectypes", context_length=cfg.seq, embedding_length=cfg.dim, block_count=cfg.layers,
                feed_forward_length=cfg.hidden, head_count=cfg.heads, head_count_kv=cfg.kv_heads,
                key_length=cfg.head_dim, value_length=cfg.head_dim, rope_dimension_count=cfg.head_dim,
                rope_freq_base=cfg.rope_theta, layer_norm_rms_eps=cfg.norm_eps, vocab_size=cfg.vocab,
                file_type=gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32,
                tokenizer_model="llama", token_list=[hf_piece(p) for p in tok.pieces], token_scores=tok.scores,
                token_types=[T.UNKNOWN if i == UNK else T.CONTROL if i in (BOS, EOS) else T.BYTE if i < FIRST_PIECE
                             else T.NORMAL for i in range(len(tok.pieces))],
                bos_token_id=BOS, eos_token_id=EOS, unk_token_id=UNK, add_bos_token=True, add_eos_token=False,
                add_space_prefix=True)
    for key, value in keys.items():                   # the writer's add_<key> methods, in this order
        getattr(w, f"add_{key}")(value)
    params = scaled_params(model.params, cfg, fold)
    names = {"token_embd.weight": "embed"}
    for i in range(cfg.layers):
        names.update({f"blk.{i}.{v}.weight": f"layers.{i}.{k}" for k, v in GGUF_NAMES.items()})
    names["output_norm.weight"] = "rms_final"
    for name, ours in names.items():
        a = params[ours]
        w.add_tensor(name, np.ascontiguousarray(a, np.float16 if dtype == "f16" and a.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


WRITERS = {"llama2c": write_llama2c, "hf": write_hf, "gguf": write_gguf}


def clean_temp(out):
    """Remove what exports to `out` that were killed left beside it: their temporary file or folder
    (".NAME.<pid>.<hex>.tmp") and the one being replaced (".tmp.old"), if their process is gone."""
    name = re.compile(re.escape(f".{out.name}.") + r"(\d+)\.[0-9a-f]{12}\.tmp(\.old)?")
    for p in out.parent.glob(glob.escape(f".{out.name}.") + "*.tmp*"):
        found = name.fullmatch(p.name)
        if found and process_start(int(found[1])) is None:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def export(model, fmt, out, dtype="f32", force=False):
    """Write `model` as `fmt` to `out` (a folder for llama2c and hf, a file for gguf) through a temporary
    name beside it, then rename; an existing `out` is replaced only with force. The files written."""
    check_target(model, fmt)
    if dtype == "f16" and fmt == "llama2c":
        raise InteropError("llama2.c's run.c reads float32 only: --dtype f16 is for hf and gguf")
    if dtype == "f16":
        for name, w in scaled_params(model.params, model.cfg, fold).items():
            top = np.abs(w).max()
            if top >= 65520:                                      # float16 rounds these to inf
                raise InteropError(f"{name} holds values up to {top:.4g}, beyond float16's 65504: export with "
                                   "--dtype f32")
    out = Path(out)
    if out.name in ("", ".."):
        raise InteropError(f"{out}: name the file or folder to write, not . or ..")
    if (out.exists() or out.is_symlink()) and not force:
        raise InteropError(f"{out} exists; pass --force to replace it")
    if out.is_dir() != (fmt != "gguf") and out.exists():
        raise InteropError(f"{out} is a {'folder' if out.is_dir() else 'file'}; {fmt} writes a "
                           f"{'file' if fmt == 'gguf' else 'folder'}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_temp(out)
        if fmt == "gguf":
            WRITERS[fmt](model, tmp, dtype)
        else:
            tmp.mkdir()
            WRITERS[fmt](model, tmp, dtype)
            old = out.with_name(tmp.name + ".old")
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return sorted(out.iterdir())
        os.replace(tmp, out)
        return [out]
    except OSError as e:
        where = f"{e.filename}: " if e.filename and tmp.name not in str(e.filename) else ""   # out's parents
        reason = e.strerror or f"a write was cut short ({e}); is the disk full?"   # numpy's tofile gives no errno
        raise InteropError(f"cannot write {out}: {where}{reason}") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():                        # (unlinking a missing file on a read-only disk is EROFS)
            tmp.unlink()


def zip_folder(folder, dest):
    """An uncompressed zip of a folder's files (under the folder's name), for a download."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(Path(folder).iterdir()):
            zf.write(p, f"{Path(folder).name}/{p.name}")
