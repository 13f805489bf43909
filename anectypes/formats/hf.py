"""Hugging Face Llama and Qwen3 folders (docs/ane-reference.md §8.2): config.json, model.safetensors (or its
shards), tokenizer.json and tokenizer_config.json for transformers, and our tokenizer.bin beside them.

Hugging Face rotates the two halves of each head where we (and llama2.c and llama.cpp) rotate
interleaved pairs: its wq and wk rows (and Qwen3's q_norm and k_norm) are permuted per head. The
reader parses safetensors with numpy; the writer needs the `export` extra (safetensors, tokenizers).
A checkpoint trained elsewhere has no residual scale (α = 1); our own exports of an α-scaled model
say so in config.json (RESIDUAL_SCALED), and read back as they were.
"""

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..data.tokenizer import BOS, EOS, FIRST_PIECE, UNK, Tokenizer
from ..errors import AnectypesError
from ..host.untrusted import open_regular, parse_json, read_json
from ..model.config import ModelConfig
from .portable import SPACE, FormatError, Portable, fold, from_names, need, piece_text, scaled_params, unfold

# our layer kinds -> Hugging Face Llama's tensor names (§8.2); Qwen3 adds QK_NAMES
NAMES = dict(rms_att="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj",
             wo="self_attn.o_proj", rms_ffn="post_attention_layernorm", w1="mlp.gate_proj", w2="mlp.down_proj",
             w3="mlp.up_proj")
QK_NAMES = dict(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}     # Qwen3's: Llama with QK-norm
# the longest context a folder's model gets (the decoder's buffers grow with its square); train --seq picks
# the training context
MAX_CONTEXT = 2048
RESIDUAL_SCALED = "anectypes_residual_scaled"   # config.json's mark of our α-scaled model (wo, w2 folded)
# what a config may hold that anectypes does not compute: refused, naming the field
NOT_COMPUTED = ("attention_bias", "mlp_bias", "use_sliding_window", "num_experts", "num_local_experts",
                "n_routed_experts")
HEADER_BYTES = 100_000_000     # a safetensors header's limit, as the safetensors library's
# the llama3 RoPE's fields in rope_scaling or rope_parameters -> ours
LLAMA3 = dict(factor="rope_factor", low_freq_factor="rope_low_freq", high_freq_factor="rope_high_freq",
              original_max_position_embeddings="rope_original_context")


def rows(w, heads, to_hf):
    """wq or wk [heads·hd, dim] with each head's rows reordered between interleaved pairs (2j, 2j+1)
    and Hugging Face's halves (j, j + hd/2)."""
    hd = w.shape[0] // heads
    shape = (heads, hd // 2, 2, -1) if to_hf else (heads, 2, hd // 2, -1)
    return np.ascontiguousarray(w.reshape(shape).swapaxes(1, 2).reshape(w.shape))


# --- reading ---------------------------------------------------------------------------------------------

def is_hf(path):
    """Whether a folder's config.json is a Hugging Face model's (a run folder's has our format); DataError when
    it is there but not a regular file of JSON."""
    if not (path / "config.json").exists():
        return False
    try:
        conf = read_json(path / "config.json")      # a FIFO or unreadable JSON: refused, naming it
    except OSError:
        return False
    return isinstance(conf, dict) and "model_type" in conf


def read_safetensors(path):
    """{name: float32 array} of a safetensors file (F32, F16 or BF16 tensors), parsed with numpy: each tensor read
    into an array of its own (F32's is that array; the others' a temporary of one tensor), so that a model's
    import holds its weights in float32 once (from_names takes these arrays as they are)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 2 <= n <= min(size - 8, HEADER_BYTES):
            raise FormatError(f"{path}: not a safetensors file (no JSON header of at most {HEADER_BYTES:,} bytes)")
        header = parse_json(f.read(n), f"{path}: its header")
        if not isinstance(header, dict):
            raise FormatError(f"{path}: not a safetensors file (its header is not a JSON object)")
        return {name: read_tensor(path, f, name, t, 8 + n, size) for name, t in header.items() if name != "__metadata__"}


def read_tensor(path, f, name, t, body, size):
    """Tensor `name` of header entry `t` from open safetensors file f, whose data starts at byte `body` of `size`."""
    dtype = t.get("dtype") if isinstance(t, dict) else None
    kind = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}.get(dtype if isinstance(dtype, str) else None)
    if kind is None:
        raise FormatError(f"{path}: tensor {name} is {str(t)[:200]}; only F32, F16 and BF16 tensors are read")
    shape = t.get("shape")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise FormatError(f"{path}: tensor {name}'s shape {str(shape)[:80]} is not a list of sizes")
    offsets, count = t.get("data_offsets"), math.prod(shape)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise FormatError(f"{path}: tensor {name}'s data_offsets {str(offsets)[:80]} are not two byte offsets")
    start, end = offsets
    inside = 0 <= start <= end <= size - body and end - start == count * np.dtype(kind).itemsize
    if not inside:
        raise FormatError(f"{path}: tensor {name} lies outside the file (truncated or damaged)")
    f.seek(body + start)
    a = np.fromfile(f, kind, count)
    a.shape = shape                              # in place: the array stays its own (from_names copies a view)
    if kind == "<f4":
        return a.astype(np.float32, copy=False)
    if kind == "<f2":
        return a.astype(np.float32)
    out = np.empty(shape, np.float32)            # bf16: the upper half of a float32
    bits = out.view(np.uint32)
    bits[...] = a
    bits <<= 16
    return out


def read_config(path):
    """The ModelConfig of a Hugging Face Llama or Qwen3 folder's config.json (what it holds that anectypes does not
    compute refused)."""
    return config_and_context(path)[0]


def config_and_context(path):
    """(read_config's answer, config.json's max_position_embeddings when an integer, else None)."""
    try:
        conf = read_json(path / "config.json")
    except OSError as e:
        raise FormatError(f"{path / 'config.json'}: cannot read ({e.strerror})") from None
    if not isinstance(conf, dict):
        raise FormatError(f"{path / 'config.json'}: not a JSON object")
    arch = conf.get("architectures") or [conf.get("model_type")]
    arch = arch[0] if isinstance(arch, list) and arch else arch
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise FormatError(f"{path}: a {str(arch)[:80]} model; only {' and '.join(ARCHITECTURES)} are supported")
    refuse_unsupported(path / "config.json", conf)
    try:
        cfg = config_of(conf, qk_norm=ARCHITECTURES[arch] == "qwen3").validate()
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AnectypesError) as e:
        raise FormatError(f"{path / 'config.json'}: not a usable {arch} config ({type(e).__name__}: {e})") from None
    context = conf.get("max_position_embeddings")
    return cfg, context if type(context) is int else None


def read(path):
    """A Hugging Face Llama folder: config.json and model.safetensors (or its shards)."""
    cfg, context = config_and_context(path)
    index = path / "model.safetensors.index.json"
    doc = read_json(index) if index.is_file() else {"weight_map": {"": "model.safetensors"}}
    weights = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weights, dict):
        raise FormatError(f"{index}: not a safetensors index (no weight_map object)")
    names = list(weights.values())
    if not all(isinstance(name, str) and Path(name).name == name for name in names):   # no path out of the folder
        raise FormatError(f"{index}: its weight_map names files other than those in the folder")
    files = sorted(set(names))
    tensors = {}
    for name in files:
        if not (path / name).is_file():
            raise FormatError(f"{path / name}: missing (anectypes reads safetensors weights)")
        tensors.update(read_safetensors(path / name))
    top = {"embed": "model.embed_tokens.weight", "rms_final": "model.norm.weight",
           **({} if cfg.tied else {"classifier": "lm_head.weight"})}
    params = from_names(path, cfg, tensors, top, "model.layers.{i}.{name}.weight",
                        {**NAMES, **(QK_NAMES if cfg.qk_norm else {})})
    for i in range(cfg.layers):
        for k, h in PERMUTED.items():
            if f"layers.{i}.{k}" in params:
                params[f"layers.{i}.{k}"] = rows(params[f"layers.{i}.{k}"], h(cfg), to_hf=False)
    beside = path / "tokenizer.bin"
    return Portable(cfg, scaled_params(params, cfg, unfold), Tokenizer.load(beside) if beside.is_file() else None,
                    context=context)


# the rows of each kind Hugging Face orders by halves, and the heads they hold (a QK-norm weight: one head)
PERMUTED = {"wq": lambda cfg: cfg.heads, "wk": lambda cfg: cfg.kv_heads, "q_norm": lambda cfg: 1,
            "k_norm": lambda cfg: 1}


def refuse_unsupported(where, conf):
    """Refuse, naming the field, what a config holds that anectypes does not compute: biases, sliding
    windows, experts, an activation other than SiLU, a RoPE other than the default and llama3."""
    for key in NOT_COMPUTED:
        if conf.get(key):
            raise FormatError(f"{where}: {key} is {str(conf[key])[:40]}; anectypes computes none (no biases, "
                              "sliding windows or experts)")
    if conf.get("hidden_act", "silu") != "silu":
        raise FormatError(f"{where}: hidden_act is {str(conf['hidden_act'])[:40]}; anectypes computes silu only")
    kinds = conf.get("layer_types") or []
    if not isinstance(kinds, list) or any(k != "full_attention" for k in kinds):
        raise FormatError(f"{where}: layer_types is {str(kinds)[:60]}; anectypes computes full_attention only")
    for key, rope in rope_settings(conf).items():
        if not isinstance(rope, dict):
            raise FormatError(f"{where}: {key} is {str(rope)[:40]}, not an object")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise FormatError(f"{where}: {key}'s rope_type is {str(kind)[:40]}; anectypes computes default and "
                              "llama3 only")
        if missing := [k for k in LLAMA3 if k not in rope] if kind == "llama3" else []:
            raise FormatError(f"{where}: {key} of rope_type llama3 lacks {', '.join(missing)}")


def rope_settings(conf):
    """{field: value} of the RoPE settings present: transformers 4's rope_scaling, 5's rope_parameters."""
    return {k: conf[k] for k in ("rope_scaling", "rope_parameters") if conf.get(k) is not None}


def config_of(conf, qk_norm=False):
    """The ModelConfig of a Hugging Face Llama or Qwen3 config.json (refuse_unsupported's checks passed);
    seq is max_position_embeddings, at most MAX_CONTEXT."""
    heads = conf["num_attention_heads"]
    rope = {k: v for settings in rope_settings(conf).values() for k, v in settings.items()}
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    return ModelConfig(dim=conf["hidden_size"], hidden=conf["intermediate_size"], heads=heads,
                       kv_heads=conf.get("num_key_value_heads") or heads,
                       head_dim=conf.get("head_dim") or conf["hidden_size"] // heads, layers=conf["num_hidden_layers"],
                       seq=min(conf.get("max_position_embeddings", MAX_CONTEXT), MAX_CONTEXT), vocab=conf["vocab_size"],
                       rope_theta=float(conf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                       norm_eps=float(conf.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm,
                       rope_type="llama3" if llama3 else "default",
                       **({ours: rope[theirs] for theirs, ours in LLAMA3.items()} if llama3 else {}),
                       residual_scaled=conf.get(RESIDUAL_SCALED) is True,
                       tied=conf.get("tie_word_embeddings", False) is True)


# --- writing ---------------------------------------------------------------------------------------------

def merges(tok):
    """The merges that make each mergeable piece from two others, best score first: Hugging Face's BPE
    then merges what llama2.c's score-driven loop merges (§8.2 says where they can differ)."""
    ids = {p: i for i, p in reversed(list(enumerate(tok.pieces)))}
    found = []
    for i, p in enumerate(tok.pieces[FIRST_PIECE:], FIRST_PIECE):
        if p in tok._merges and tok._merges[p][1] == i:
            text = p.decode("utf-8", "surrogateescape")
            for k in range(1, len(text)):
                left, right = (ids.get(s.encode("utf-8", "surrogateescape")) for s in (text[:k], text[k:]))
                if left is not None and right is not None:
                    found.append((-tok.scores[i], i, left, right))
    return [(piece_text(tok.pieces[a]), piece_text(tok.pieces[b])) for _, _, a, b in sorted(found)]


def tokenizer_json(tok):
    """tokenizer.json's Tokenizer: llama2.c's BPE with byte fallback, the dummy-prefix space, BOS."""
    tk = need("tokenizers")
    vocab = {}
    for i, p in enumerate(tok.pieces):
        vocab.setdefault(piece_text(p), i)
    if len(vocab) != len(tok.pieces):
        raise FormatError("the vocabulary holds the same piece twice, which tokenizer.json cannot hold")
    t = tk.Tokenizer(tk.models.BPE(vocab, merges(tok), unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend(SPACE), tk.normalizers.Replace(" ", SPACE)])
    t.decoder = tk.decoders.Sequence([tk.decoders.Replace(SPACE, " "), tk.decoders.ByteFallback(),
                                      tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([piece_text(tok.pieces[i]) for i in (UNK, BOS, EOS)])
    bos = piece_text(tok.pieces[BOS])
    t.post_processor = tk.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                        special_tokens=[(bos, BOS)])
    return t


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def config_json(cfg, dtype="f32", bos=BOS, eos=EOS):
    """A Hugging Face config.json of a model (Qwen3 with QK-norm, else Llama); an α-scaled one says so."""
    llama3 = dict(rope_type="llama3", **{theirs: getattr(cfg, ours) for theirs, ours in LLAMA3.items()})
    return dict(
        architectures=["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        model_type="qwen3" if cfg.qk_norm else "llama", hidden_size=cfg.dim, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.seq, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        # both spellings: transformers 4 reads rope_scaling, 5 rope_parameters
        rope_scaling=llama3 if cfg.rope_type == "llama3" else None,
        rope_parameters=dict(rope_theta=cfg.rope_theta, **(llama3 if cfg.rope_type == "llama3" else
                                                            dict(rope_type="default"))),
        vocab_size=cfg.vocab, tie_word_embeddings=cfg.tied, hidden_act="silu", attention_bias=False, mlp_bias=False,
        bos_token_id=bos, eos_token_id=eos, torch_dtype={"f32": "float32", "f16": "float16"}[dtype],
        **{RESIDUAL_SCALED: cfg.residual_scaled})


def tensors_of(params, cfg):
    """Our parameters under Hugging Face's names, wq and wk in its row order, α folded into wo and w2."""
    params = scaled_params(params, cfg, fold)
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["rms_final"],
               **({} if cfg.tied else {"lm_head.weight": params["classifier"]})}
    for i in range(cfg.layers):
        for k, name in {**NAMES, **(QK_NAMES if cfg.qk_norm else {})}.items():
            w = params[f"layers.{i}.{k}"]
            if k in PERMUTED:
                w = rows(w, PERMUTED[k](cfg), to_hf=True)
            tensors[f"model.layers.{i}.{name}.weight"] = w
    return tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write(model, folder, dtype="f32"):
    cfg, tok = model.cfg, model.tokenizer
    st = need("safetensors.numpy")
    ours = isinstance(tok, Tokenizer)           # else a Hugging Face folder's own tokenizer, written as it came
    hf_tok = tokenizer_json(tok) if ours else None
    bos, eos = (BOS, EOS) if ours else (tok.bos, tok.eos)
    write_json(folder / "config.json", config_json(cfg, dtype, bos, eos))
    write_json(folder / "generation_config.json", dict(bos_token_id=bos, eos_token_id=eos if ours else sorted(tok.stop)))
    tensors = tensors_of(model.params, cfg)
    cast = np.float16 if dtype == "f16" else np.float32
    # bytes written here: safetensors' and tokenizers' own file writers make a 0600 file (a mkstemp-like
    # temporary one, renamed) and raise their own exception types on a full disk
    (folder / "model.safetensors").write_bytes(st.save({k: np.ascontiguousarray(v, cast) for k, v in tensors.items()},
                                                       metadata={"format": "pt"}))
    if not ours:                                # its tokenizer.json, tokenizer_config.json and chat template
        for name in TOKENIZER_FILES:
            if name in tok.files:
                (folder / name).write_bytes(tok.files[name])
        return
    (folder / "tokenizer.json").write_text(hf_tok.to_str(pretty=True))
    special = {k: piece_text(tok.pieces[i]) for k, i in (("bos_token", BOS), ("eos_token", EOS), ("unk_token", UNK))}
    write_json(folder / "tokenizer_config.json", dict(tokenizer_class="PreTrainedTokenizerFast", **special,
                                                      clean_up_tokenization_spaces=False, split_special_tokens=True,
                                                      model_max_length=cfg.seq))
    tok.save(folder / "tokenizer.bin")
