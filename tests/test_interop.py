"""Export and import (anectypes.formats, anectypes.sources, python -m anectypes.export, train --init-from): each exported file
read by an independent float64 numpy implementation of its target's math (run.c's, Hugging Face Llama's
through safetensors, llama.cpp's through the gguf package's reader) against our decoder's logits;
transformers itself; byte-identical round trips; the tokenizer.json against our tokenizer; bad input."""

import builtins
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.hf_folders import LLAMA3_ROPE, SPLIT, arch_hf_folder, bpe_tokenizer
from support.llama2c import read_v0

from anectypes import sources
from anectypes.data.corpus import builtin_dataset
from anectypes.export import main
from anectypes.formats.export import export
from anectypes.formats.portable import Portable, fold, scaled_params, unfold
from anectypes.formats.llama2c import write_model
from anectypes.model.config import ModelConfig, init_params
from anectypes.generate.decoder import Decoder
from anectypes.data.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("builtin_cache")

# GQA, head_dim = dim / heads (run.c's), 3 layers: α = 1/√6 is not a power of two, so folding it rounds
CFG = dict(dim=64, hidden=160, heads=8, kv_heads=2, head_dim=8, layers=3, seq=48)
TEXT = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog."
FORMATS = [("llama2c", "f32"), ("hf", "f32"), ("hf", "f16"), ("gguf", "f32"), ("gguf", "f16")]


def random_model(seed=0, **changes):
    """A Portable of CFG on the built-in vocabulary, weights large enough for sharp logits, norms not 1."""
    tok = builtin_dataset()[0]
    cfg = ModelConfig(**{**CFG, "vocab": tok.vocab_size, **changes})
    rng = np.random.default_rng(seed)
    params = {k: (rng.uniform(0.5, 1.5, v.shape) if v.ndim == 1 else 3 * v).astype(np.float32)
              for k, v in init_params(cfg, rng).items()}
    params["embed"] *= 20
    return Portable(cfg, params, tok)


def our_logits(model, ids):
    return Decoder(model.cfg, model.params).forward(np.array(ids), all_logits=True)


def written(tmp_path, model, fmt, dtype="f32", name="out"):
    out = tmp_path / (name + ".gguf" if fmt == "gguf" else name)
    export(model, fmt, out, dtype)
    return out


# --- float64 Llama, as each target computes it ------------------------------------------------------------

def llama64(w, ids, heads, kv_heads, theta, eps, halves, factors=None):
    """Logits [P, vocab] of tokens ids at positions 0.. from w (emb, final_norm, layers: att_norm, q, k, v, o,
    ffn_norm, gate, up, down as [out, in], and with QK-norm q_norm, k_norm; out, an untied classifier); RoPE
    on interleaved pairs (run.c, llama.cpp's NORM rope) or on the halves of each head (Hugging Face's
    rotate_half, llama.cpp's NEOX), each pair's angle divided by its factor (llama.cpp's rope_freqs);
    query head h reads kv head h // (heads/kv_heads)."""
    f = lambda a: np.asarray(a, np.float64)
    x = f(w["emb"])[ids]
    P, hd = len(ids), f(w["layers"][0]["q"]).shape[0] // heads
    freq = theta ** (-np.arange(0, hd, 2) / hd) / (1 if factors is None else f(factors))
    angle = np.arange(P)[:, None] * freq[None, :]                                      # [P, hd/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(v):                                      # v [P, n heads, hd]
        if halves:
            a, b = v[..., :hd // 2], v[..., hd // 2:]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
        a, b = v[..., 0::2], v[..., 1::2]
        return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(v.shape)

    norm = lambda v, g: v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * f(g)
    mask = np.triu(np.full((P, P), -np.inf), 1)
    for lw in w["layers"]:
        xn = norm(x, lw["att_norm"])
        q, k = (xn @ f(lw["q"]).T).reshape(P, heads, hd), (xn @ f(lw["k"]).T).reshape(P, kv_heads, hd)
        if "q_norm" in lw:                            # Qwen3: each head RMS-normed before RoPE
            q, k = norm(q, lw["q_norm"]), norm(k, lw["k_norm"])
        q, k = rope(q), rope(k)
        v = (xn @ f(lw["v"]).T).reshape(P, kv_heads, hd)
        k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))                 # repeat_kv
        s = np.einsum("phd,khd->hpk", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hpk,khd->phd", p / p.sum(-1, keepdims=True), v).reshape(P, -1)
        x = x + att @ f(lw["o"]).T
        xn = norm(x, lw["ffn_norm"])
        g = xn @ f(lw["gate"]).T
        x = x + (g / (1 + np.exp(-g)) * (xn @ f(lw["up"]).T)) @ f(lw["down"]).T
    return norm(x, w["final_norm"]) @ f(w.get("out", w["emb"])).T


def runc_logits(folder, ids):
    t, (dim, hidden, L, H, KV, V, seq) = read_v0(folder / "model.bin")
    assert V > 0 and t["wcls"] is t["emb"]          # positive vocab_size: the shared classifier
    keys = dict(att_norm="rms_att", q="wq", k="wk", v="wv", o="wo", ffn_norm="rms_ffn", gate="w1", up="w3", down="w2")
    layers = [{ours: t[theirs][i] for ours, theirs in keys.items()} for i in range(L)]
    return llama64(dict(emb=t["emb"], final_norm=t["rms_final"], layers=layers), ids, H, KV, 10000.0, 1e-5, False)


def hf_logits(folder, ids):
    from safetensors.numpy import load_file
    c, t = json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")
    assert c["tie_word_embeddings"] and "lm_head.weight" not in t
    keys = dict(att_norm="input_layernorm", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                o="self_attn.o_proj", ffn_norm="post_attention_layernorm", gate="mlp.gate_proj", up="mlp.up_proj",
                down="mlp.down_proj")
    layers = [{ours: t[f"model.layers.{i}.{theirs}.weight"] for ours, theirs in keys.items()}
              for i in range(c["num_hidden_layers"])]
    w = dict(emb=t["model.embed_tokens.weight"], final_norm=t["model.norm.weight"], layers=layers)
    return llama64(w, ids, c["num_attention_heads"], c["num_key_value_heads"], c["rope_theta"], c["rms_norm_eps"], True)


def gguf_logits(path, ids):
    """llama.cpp's llama (NORM RoPE) or qwen3 (NEOX RoPE, QK-norm), with rope_freqs' divisors and output.weight
    (without one, the classifier is token_embd) when the file has them."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    kv = lambda key: r.get_field(key).contents()
    arch = kv("general.architecture")
    assert arch in ("llama", "qwen3")
    t = {x.name: x.data for x in r.tensors}            # numpy order: [ne1, ne0] = [out, in]
    keys = dict(att_norm="attn_norm", q="attn_q", k="attn_k", v="attn_v", o="attn_output", ffn_norm="ffn_norm",
                gate="ffn_gate", up="ffn_up", down="ffn_down", **({"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
                                                                  if arch == "qwen3" else {}))
    layers = [{ours: t[f"blk.{i}.{theirs}.weight"] for ours, theirs in keys.items()}
              for i in range(kv(f"{arch}.block_count"))]
    w = dict(emb=t["token_embd.weight"], final_norm=t["output_norm.weight"], layers=layers,
             **({"out": t["output.weight"]} if "output.weight" in t else {}))
    return llama64(w, ids, kv(f"{arch}.attention.head_count"), kv(f"{arch}.attention.head_count_kv"),
                   kv(f"{arch}.rope.freq_base"), kv(f"{arch}.attention.layer_norm_rms_epsilon"), arch == "qwen3",
                   t.get("rope_freqs.weight"))


def llama_cpp_logits(path, ids):
    """llama.cpp's own logits of a GGUF file at every position (llama-cpp-python; f32 KV cache, as ours)."""
    import llama_cpp
    llm = llama_cpp.Llama(str(path), n_ctx=max(64, len(ids)), logits_all=True, n_threads=2, type_k=0, type_v=0,
                          verbose=False)
    try:
        llm.eval([int(i) for i in ids])
        return np.array(llm.scores[:len(ids)], np.float64)
    finally:
        llm.close()


def llama_cpp_tokens(path, text):
    """llama.cpp's tokens of a text by the GGUF's tokenizer (BOS as the file says)."""
    import llama_cpp
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        add_bos = llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
        return llm.tokenize(text.encode(), add_bos=add_bos, special=True)
    finally:
        llm.close()


TARGETS = {"llama2c": runc_logits, "hf": hf_logits, "gguf": gguf_logits}


@pytest.mark.parametrize("fmt", TARGETS)
def test_the_targets_math_in_float64_reproduces_our_logits(tmp_path, fmt):
    model = random_model()
    ids = model.tokenizer.encode(TEXT)
    ours = our_logits(model, ids)
    theirs = TARGETS[fmt](written(tmp_path, model, fmt), ids)
    assert np.abs(ours).max() > 5                      # sharp logits, not a near-constant model
    assert np.abs(theirs - ours).max() <= 1e-4 * np.abs(ours).max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


@pytest.mark.parametrize("fmt, dtype", FORMATS)
def test_export_import_export_is_byte_identical(tmp_path, fmt, dtype):
    model = random_model(seed=1)
    first = written(tmp_path, model, fmt, dtype, "first")
    back = sources.resolve(first)
    second = written(tmp_path, back, fmt, dtype, "second")
    files = [first] if fmt == "gguf" else sorted(first.iterdir())
    assert [p.read_bytes() for p in files] == [(second / p.name if fmt != "gguf" else second).read_bytes()
                                               for p in files]
    assert back.cfg == model.cfg and back.tokenizer.pieces == model.tokenizer.pieces
    ids = model.tokenizer.encode(TEXT)
    ours, again = our_logits(model, ids), our_logits(back, ids)
    tol = 1e-5 if dtype == "f32" else 1e-2                 # f16: the weights' own rounding
    assert np.abs(again - ours).max() <= tol * np.abs(ours).max()


def test_unfold_gives_back_the_float32_that_folds_to_the_same_bits():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-6, 3, 200_000)).astype(np.float32)
    for layers in (3, 6, 12, 28):
        alpha = 1 / np.sqrt(2 * layers)
        y = fold(x, alpha)
        assert np.array_equal(fold(unfold(y, alpha), alpha), y)


def test_llama2c_v1_and_v0_import_alike_and_unfold_alpha(tmp_path):
    model = random_model()
    folded = scaled_params(model.params, model.cfg, fold)
    for version in (0, 1):
        write_model(tmp_path / f"v{version}.bin", model.cfg, folded, version=version)
    v0, v1 = (sources.resolve(tmp_path / f"v{v}.bin") for v in (0, 1))
    assert v0.cfg == v1.cfg == model.cfg and v0.tokenizer is None   # no tokenizer.bin beside them
    again = scaled_params(v0.params, v0.cfg, fold)
    for name, a in model.params.items():
        assert np.array_equal(v0.params[name], v1.params[name]) and np.array_equal(again[name], folded[name]), name
        close = np.abs(v0.params[name] - a) <= np.spacing(np.abs(a))  # α divided out: within one step of ours
        assert close.all(), name


def test_tokenizer_json_encodes_and_decodes_as_we_do(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    tok = builtin_dataset()[0]
    folder = written(tmp_path, random_model(), "hf")
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.encode_special_tokens = True                      # as tokenizer_config.json's split_special_tokens
    texts = [TEXT, "", "a", " leading", "trailing ", "  two  spaces\n\nnew line\ttab", "émoji 🙂 und ünïcode ∑",
             "<0x41> <s> </s> <unk> tricky", "Tom said, \"Yes!\" and ran... away?"]
    texts += builtin_dataset()[0].decode(builtin_dataset()[1][:3000]).split("\n")[:40]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), text


@pytest.mark.slow
def test_transformers_loads_the_folder_and_computes_our_logits(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = random_model()
    folder = written(tmp_path, model, "hf")
    hf = AutoModelForCausalLM.from_pretrained(folder)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = model.tokenizer.encode(TEXT)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    ours = our_logits(model, ids)
    assert np.abs(theirs - ours).max() <= 1e-4 * np.abs(ours).max()
    tok = AutoTokenizer.from_pretrained(folder)
    for text in (TEXT, "<s> and é🙂", "  spaces  "):
        assert tok(text)["input_ids"] == model.tokenizer.encode(text)
        assert tok.decode(model.tokenizer.encode(text), skip_special_tokens=True) == text


# --- the command and its bad input -----------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path):
    """An anectypes checkpoint of random_model() with its tokenizer beside the export's output folder."""
    from anectypes.formats.checkpoint import save_checkpoint
    model = random_model()
    zero = {k: np.zeros_like(v) for k, v in model.params.items()}
    path = tmp_path / "m.ckpt"
    save_checkpoint(path, model.cfg, model.params, dict(t=0, m=zero, v=zero), {})
    model.tokenizer.save(tmp_path / "tokenizer.bin")
    return path


def run(argv, capsys):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:                              # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_says_what_it_wrote(tmp_path, ckpt, capsys):
    code, out, err = run([ckpt, "--tokenizer", tmp_path / "tokenizer.bin", "--format", "hf", "--out", tmp_path / "hf"],
                         capsys)
    assert code == 0 and err == ""
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.bin", "tokenizer.json",
             "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == names
    for name in names:
        assert f"{tmp_path / 'hf' / name}  {(tmp_path / 'hf' / name).stat().st_size:,} bytes" in out


def bad_cases(tmp):
    """(argv, a phrase of the error) for every kind of bad input."""
    (tmp / "text.txt").write_text("hello, not a model\n" * 10)
    model = random_model()
    folded = scaled_params(model.params, model.cfg, fold)
    write_model(tmp / "full.bin", model.cfg, folded)
    (tmp / "cut.bin").write_bytes((tmp / "full.bin").read_bytes()[:-100])
    write_model(tmp / "unshared.bin", model.cfg, folded, classifier=model.params["embed"])
    export(model, "gguf", tmp / "m.gguf")
    (tmp / "cut.gguf").write_bytes((tmp / "m.gguf").read_bytes()[:5000])
    wide = random_model(head_dim=16)                       # q_dim 128 != dim 64: qwen3_06b's shape
    export(wide, "hf", tmp / "wide")
    export(model, "hf", tmp / "mistral")
    conf = json.loads((tmp / "mistral" / "config.json").read_text())
    (tmp / "mistral" / "config.json").write_text(json.dumps({**conf, "architectures": ["MistralForCausalLM"]}))
    small = Tokenizer(model.tokenizer.pieces[:300], model.tokenizer.scores[:300])
    small.save(tmp / "small.bin")
    (tmp / "exists").mkdir()
    out = ["--format", "llama2c", "--out", tmp / "out"]
    return {
        "truncated model.bin": ([tmp / "cut.bin", *out], "truncated"),
        "foreign file": ([tmp / "text.txt", *out], "not a llama2.c model"),
        "truncated gguf": ([tmp / "cut.gguf", *out], "not a readable GGUF file"),
        "unshared classifier": ([tmp / "unshared.bin", *out], "unshared"),
        "head_dim not dim / heads": ([tmp / "wide", *out], "head_size as dim / n_heads"),
        "unsupported architecture": ([tmp / "mistral", *out], "only LlamaForCausalLM"),
        "vocabulary mismatch": ([tmp / "m.gguf", "--tokenizer", tmp / "small.bin", *out], "300 tokens"),
        "existing output": ([tmp / "m.gguf", "--format", "hf", "--out", tmp / "exists"], "--force"),
        "no such source": ([tmp / "nothing", *out], "no such file"),
        "f16 for run.c": ([tmp / "m.gguf", "--dtype", "f16", *out], "float32 only"),
        "bad format": ([tmp / "m.gguf", "--format", "onnx", "--out", tmp / "x"], "invalid choice"),
        "checkpoint of a file": ([tmp / "m.gguf", "--checkpoint", "latest", *out], "needs a run folder"),
    }


@pytest.mark.parametrize("case", ["truncated model.bin", "foreign file", "truncated gguf", "unshared classifier",
                                  "head_dim not dim / heads", "unsupported architecture", "vocabulary mismatch",
                                  "existing output", "no such source", "f16 for run.c", "bad format",
                                  "checkpoint of a file"])
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys, case):
    argv, phrase = bad_cases(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    code, out, err = run(argv, capsys)
    assert code in (1, 2) and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and phrase in err, err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "exists") == []


def test_a_missing_library_names_the_extra(tmp_path, monkeypatch, capsys, ckpt):
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("gguf") else real(name, *a, **k))
    code, out, err = run([ckpt, "--tokenizer", tmp_path / "tokenizer.bin", "--format", "gguf", "--out",
                          tmp_path / "m.gguf"], capsys)
    assert code == 1 and err == "error: this needs the gguf package: pip install 'anectypes[export]'\n"
    assert not (tmp_path / "m.gguf").exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("fmt", ["llama2c", "hf", "gguf"])
def test_a_killed_exports_temporary_files_go_at_the_next_export_to_the_same_place(tmp_path, ckpt, fmt):
    out = tmp_path / ("m.gguf" if fmt == "gguf" else "m")
    argv = [str(a) for a in (ckpt, "--tokenizer", tmp_path / "tokenizer.bin", "--format", fmt, "--out", out)]
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "support" / "kill_export.py"), *argv], capture_output=True)
    assert r.returncode == -signal.SIGKILL and not out.exists()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]
    assert len(left) == 1 and left[0].stat().st_size > 0
    live = tmp_path / f".{out.name}.{os.getpid()}.0123456789ab.tmp"       # an export this live process is writing
    live.mkdir()
    r = subprocess.run([sys.executable, "-m", "anectypes.export", *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")) == [live.name]
    assert sources.resolve(out, tokenizer=tmp_path / "tokenizer.bin").cfg == random_model().cfg


def test_every_file_an_export_writes_has_the_mode_a_plain_open_gives(tmp_path, ckpt):
    """Under the umask 027, a plain open() makes 0640 files: every exported file, and a checkpoint, too
    (safetensors' own writer made model.safetensors 0600)."""
    script = """if True:
        import os, sys
        from anectypes import sources
        from anectypes.formats.checkpoint import load_checkpoint, save_checkpoint
        from anectypes.formats.export import export
        os.umask(0o027)
        with open("plain", "w"):
            pass
        model = sources.resolve("m.ckpt", tokenizer="tokenizer.bin")
        for fmt, out in (("llama2c", "l"), ("hf", "h"), ("gguf", "g.gguf")):
            export(model, fmt, out)
        c = load_checkpoint("m.ckpt")
        save_checkpoint("c.ckpt", c.config, c.params, c.optimizer, c.state)
    """
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True)
    files = [tmp_path / "c.ckpt", tmp_path / "g.gguf", *(tmp_path / "l").iterdir(), *(tmp_path / "h").iterdir()]
    assert len(files) == 10 and (tmp_path / "plain").stat().st_mode & 0o777 == 0o640
    assert {str(f.relative_to(tmp_path)): oct(f.stat().st_mode & 0o777) for f in files} == \
        {str(f.relative_to(tmp_path)): "0o640" for f in files}


# --- train --init-from -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A tiny run from the seeded init saved as our checkpoint (an imported model's run: over the whole vocabulary),
    and that init as a Portable (tiny's α = 1/2 folds exactly)."""
    from support.training import FAST, losses

    from anectypes.formats.checkpoint import save_checkpoint
    from anectypes.model.config import PRESETS
    from anectypes.train import main as train
    folder = tmp_path_factory.mktemp("scratch")
    cfg = PRESETS["tiny"]
    init = init_params(cfg, np.random.default_rng(42))
    zero = {k: np.zeros_like(v) for k, v in init.items()}
    save_checkpoint(folder / "init.ckpt", cfg, init, dict(t=7, m=zero, v=zero), {"step": 3})
    assert train(["--init-from", str(folder / "init.ckpt"), "--run-dir", str(folder / "run"), "--seed", "42",
                  "--steps", "6", "--accum", "2", *FAST]) == 0
    return losses(folder / "run"), Portable(cfg, init, builtin_dataset()[0])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["llama2c", "hf", "gguf", "ckpt"])
def test_training_from_an_export_trains_like_its_weights(tmp_path, scratch, fmt):
    from support.training import FAST, losses

    from anectypes.formats.checkpoint import save_checkpoint
    from anectypes.train import main as train
    expected, model = scratch
    if fmt == "ckpt":
        source = tmp_path / "init.ckpt"
        zero = {k: np.zeros_like(v) for k, v in model.params.items()}
        save_checkpoint(source, model.cfg, model.params, dict(t=7, m=zero, v=zero), {"step": 3})
    else:
        source = written(tmp_path, model, fmt)
    assert train(["--init-from", str(source), "--run-dir", str(tmp_path / "run"), "--seed", "42", "--steps", "6",
                  "--accum", "2", *FAST]) == 0
    assert losses(tmp_path / "run") == expected


def test_init_from_needs_the_sources_vocabulary(tmp_path, capsys):
    from anectypes.train import main as train
    source = written(tmp_path, random_model(), "gguf")
    small = Tokenizer(*(lambda t: (t.pieces[:300], t.scores[:300]))(builtin_dataset()[0]))
    small.save(tmp_path / "small.bin")
    tokens = np.array(small.encode(TEXT * 20), np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    code = train(["--init-from", str(source), "--data", str(tmp_path / "tokens.bin"), "--tokenizer",
                  str(tmp_path / "small.bin"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "the tokenizer has another vocabulary (300 tokens) than" in err, err
    assert not (tmp_path / "run").exists()


# --- the dashboard's POST /api/runs/{id}/export ----------------------------------------------------------

def test_the_dashboard_exports_a_run(tmp_path):
    import io
    import zipfile

    from fastapi.testclient import TestClient

    from anectypes.formats.checkpoint import save_checkpoint
    from anectypes.runs import RunDir, RunSpec
    from anectypes.web.app import create_app
    for run_id, changes in (("run", {}), ("wide", {"head_dim": 16})):
        model = random_model(**changes)
        rd = RunDir(tmp_path / "runs" / run_id)
        rd.checkpoints.mkdir(parents=True)                   # a run folder's writes never make its folder
        rd.write_config(dict(run_id=run_id, spec=RunSpec(model="tiny").resolved().to_dict(), model=model.cfg.to_dict()))
        zero = {k: np.zeros_like(v) for k, v in model.params.items()}
        save_checkpoint(rd.latest, model.cfg, model.params, dict(t=0, m=zero, v=zero), {"step": 5})
    expected = written(tmp_path, sources.resolve(tmp_path / "runs" / "run"), "hf", "f16", "expected")
    with TestClient(create_app(tmp_path / "runs"), base_url="http://127.0.0.1:8000") as c:
        r = c.post("/api/runs/run/export", json={"format": "hf", "dtype": "f16"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
        assert 'filename="run-hf.zip"' in r.headers["content-disposition"]
        files = zipfile.ZipFile(io.BytesIO(r.content))
        assert sorted(files.namelist()) == sorted(f"run-hf/{p.name}" for p in expected.iterdir())
        for p in expected.iterdir():
            assert files.read(f"run-hf/{p.name}") == p.read_bytes(), p.name
        r = c.post("/api/runs/run/export", json={"format": "gguf", "checkpoint": "latest"})
        assert r.status_code == 200 and r.content[:4] == b"GGUF"
        assert r.headers["content-type"] == "application/octet-stream"
        r = c.post("/api/runs/wide/export", json={"format": "llama2c"})
        assert r.status_code == 409 and "head_size as dim / n_heads" in r.json()["detail"]
        assert c.post("/api/runs/run/export", json={"format": "onnx"}).status_code == 422
        assert c.post("/api/runs/run/export", json={"format": "hf", "checkpoint": "best"}).status_code == 409
        assert c.post("/api/runs/nope/export", json={"format": "hf"}).status_code == 404
        assert "/api/runs/{run_id}/export" in c.get("/openapi.json").json()["paths"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run", "wide"]


def test_a_bf16_hf_folder_imports_as_its_float32_values(tmp_path):
    """BF16 is float32's upper half: the folder's weights cut to BF16 by hand import as those values."""
    model = random_model()
    folder = written(tmp_path, model, "hf")
    data = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body, out = json.loads(data[8:8 + n]), np.frombuffer(data[8 + n:], np.uint32), b""
    for name, t in header.items():
        if name != "__metadata__":
            start, end = t["data_offsets"]
            t.update(dtype="BF16", data_offsets=[len(out), len(out) + (end - start) // 2])
            out += (body[start // 4:end // 4] >> 16).astype("<u2").tobytes()
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + out)
    cut = scaled_params(sources.resolve(tmp_path / "out").params, model.cfg, fold)
    for name, a in scaled_params(model.params, model.cfg, fold).items():
        bf16 = (a.view(np.uint32) >> 16 << 16).view(np.float32)
        # wo and w2 went through α: a BF16 value need not be a fold, so within one float32 step of it
        assert (np.abs(cut[name] - bf16) <= (np.spacing(np.abs(bf16)) if name[-2:] in ("wo", "w2") else 0)).all(), name


# --- GGUF of real checkpoints: Qwen3, Llama 3, a LoRA run, a Hugging Face tokenizer ------------------------

GGUF_TEXTS = ["Once upon a time, Lily's dog ran 12345 times.\n\nThe end!", "naïve café — 東京 ✓ emoji 🙂",
              "  two  spaces\tand <|im_end|> inside", ""]


@pytest.mark.parametrize("arch, tied", [("qwen3", True), ("llama3", False)])
def test_a_hf_folders_gguf_gives_transformers_logits_and_reads_back(tmp_path, capsys, arch, tied):
    """A tiny Qwen3 (QK-norm, NEOX RoPE, head_dim ≠ dim/heads, a vocabulary padded past its tokenizer's) and an
    untied Llama 3 (llama3 RoPE as rope_freqs, output.weight) with their byte-level BPE: llama.cpp's math on
    the GGUF's tensors (through gguf's reader) gives transformers' logits of the folder; the file reads back
    as the same model and tokenizer (ids, chat template)."""
    import torch
    from gguf import GGUFReader

    from anectypes.data.hf_tokenizer import HFTokenizer
    hf = arch_hf_folder(tmp_path / "src", arch, tied)
    bpe_tokenizer(tmp_path / "src", "" if arch == "qwen3" else "{1,3}", bos=arch == "llama3",
                  vocab=280 if arch == "qwen3" else 300)     # Qwen3's vocabulary is padded past its tokenizer's
    capsys.readouterr()                                  # save_pretrained's progress bar
    code, out, err = run([tmp_path / "src", "--format", "gguf", "--out", tmp_path / "m.gguf"], capsys)
    assert code == 0 and err == "", err
    ids = np.random.default_rng(3).integers(0, 300, 40)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids[None])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(gguf_logits(tmp_path / "m.gguf", ids) - theirs).max() <= 1e-4 * scale
    assert np.abs(llama_cpp_logits(tmp_path / "m.gguf", ids) - theirs).max() <= 1e-4 * scale
    r = GGUFReader(tmp_path / "m.gguf")
    kv = lambda key: r.get_field(key).contents()
    src = HFTokenizer.load(tmp_path / "src")
    assert kv("general.architecture") == ("qwen3" if arch == "qwen3" else "llama")
    assert kv("tokenizer.ggml.model") == "gpt2" and kv("tokenizer.ggml.pre") == ("qwen2" if arch == "qwen3" else "llama-bpe")
    assert kv("tokenizer.ggml.add_bos_token") == (arch == "llama3") and kv("tokenizer.ggml.eos_token_id") == src.eos
    assert kv("tokenizer.chat_template") == src.chat_template and len(kv("tokenizer.ggml.tokens")) == 300
    assert kv("tokenizer.ggml.token_type").count(5) == 300 - src.vocab_size == (20 if arch == "qwen3" else 0)
    assert ("output.weight" in {t.name for t in r.tensors}) != tied
    back = sources.resolve(tmp_path / "m.gguf")
    assert back.cfg == sources.resolve(tmp_path / "src").cfg
    assert np.abs(our_logits(back, ids) - theirs).max() <= 1e-4 * scale
    for text in GGUF_TEXTS:
        assert back.tokenizer.encode(text) == src.encode(text), text
        assert llama_cpp_tokens(tmp_path / "m.gguf", text) == src.tok.encode(text).ids, text    # tokenizers' own
        assert back.tokenizer.decode(src.encode(text)) == src.decode(src.encode(text)), text
    chat = [dict(role="user", content="Hi"), dict(role="assistant", content="Hello!")]
    assert back.tokenizer.render_chat(chat, True) == src.render_chat(chat, True)
    again = run([tmp_path / "m.gguf", "--format", "gguf", "--out", tmp_path / "again.gguf"], capsys)
    assert again[0] == 0 and (tmp_path / "again.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_a_lora_runs_gguf_is_the_merged_model_peft_computes(tmp_path, capsys):
    """A LoRA run's GGUF holds base + adapters: llama.cpp's math on it gives peft's logits of the base folder
    with the run's adapter (--format peft), α = 1 (wo and w2 as they are)."""
    import torch
    from peft import PeftModel
    from support.hf_folders import lora_llama_folder
    from transformers import LlamaForCausalLM

    from anectypes.train import main as train
    base, run_dir = lora_llama_folder(tmp_path / "base"), tmp_path / "run"
    assert train(["--init-from", str(base), "--lora", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--run-dir",
                  str(run_dir), "--steps", "6", "--accum", "1", "--lr", "0.05", "--warmup", "1", "--backend", "sim",
                  "--sample-every", "0", "--log-every", "1000"]) == 0
    for fmt, out in (("peft", tmp_path / "adapter"), ("gguf", tmp_path / "m.gguf")):
        assert run([run_dir, "--format", fmt, "--out", out], capsys)[0] == 0
    ids = np.random.default_rng(4).integers(0, 1024, 32)
    with torch.no_grad():
        plain = LlamaForCausalLM.from_pretrained(base, dtype=torch.float64)
        before = plain(torch.tensor(ids[None])).logits[0].numpy()
        theirs = PeftModel.from_pretrained(plain, tmp_path / "adapter")(torch.tensor(ids[None])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(theirs - before).max() > 1e-2 * scale                    # the adapters change the logits
    assert np.abs(gguf_logits(tmp_path / "m.gguf", ids) - theirs).max() <= 1e-4 * scale
    assert np.abs(llama_cpp_logits(tmp_path / "m.gguf", ids) - theirs).max() <= 1e-4 * scale
    back = sources.resolve(tmp_path / "m.gguf")
    assert back.cfg.residual_scaled is False and back.lora is None
    assert np.abs(our_logits(back, ids) - theirs).max() <= 1e-4 * scale


def test_an_alpha_scaled_qwen3_with_its_own_classifier_round_trips_through_gguf(tmp_path):
    """Our α-scaled model with QK-norm and an untied classifier: wo and w2 folded into the file (llama.cpp's math
    gives our logits), and export → import → export byte-identical, f32 and f16."""
    model = random_model(qk_norm=True, head_dim=16, tied=False)
    model.params["classifier"] = np.random.default_rng(7).standard_normal((model.cfg.vocab, 64)).astype(np.float32)
    ids = model.tokenizer.encode(TEXT)
    ours = our_logits(model, ids)
    path = written(tmp_path, model, "gguf")
    for theirs in (gguf_logits(path, ids), llama_cpp_logits(path, ids)):
        assert np.abs(theirs - ours).max() <= 1e-4 * np.abs(ours).max()
    for dtype in ("f32", "f16"):
        first = written(tmp_path, model, "gguf", dtype, f"first-{dtype}")
        back = sources.resolve(first)
        assert back.cfg == model.cfg
        assert written(tmp_path, back, "gguf", dtype, f"second-{dtype}").read_bytes() == first.read_bytes()


@pytest.mark.parametrize("case", ["sentencepiece tokenizer.json", "unknown pre-tokenizer", "qwen3 with llama3 RoPE"])
def test_what_gguf_cannot_hold_is_one_error_line_and_nothing_written(tmp_path, capsys, case):
    arch_hf_folder(tmp_path / "src", "llama3" if case != "qwen3 with llama3 RoPE" else "qwen3", True,
                   **({"rope_scaling": dict(LLAMA3_ROPE)} if case == "qwen3 with llama3 RoPE" else {}))
    bpe_tokenizer(tmp_path / "src", "{1,3}", bos=True)
    doc = json.loads((tmp_path / "src" / "tokenizer.json").read_text())
    if case == "sentencepiece tokenizer.json":
        doc["decoder"] = dict(type="Sequence", decoders=[dict(type="Replace", pattern=dict(String="▁"), content=" "),
                                                         dict(type="ByteFallback"), dict(type="Fuse")])
        doc["model"]["byte_fallback"] = True
    if case == "unknown pre-tokenizer":
        doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    (tmp_path / "src" / "tokenizer.json").write_text(json.dumps(doc))
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()
    code, out, err = run([tmp_path / "src", "--format", "gguf", "--out", tmp_path / "m.gguf"], capsys)
    phrase = {"sentencepiece tokenizer.json": "only as byte-level BPE", "unknown pre-tokenizer": "none llama.cpp knows",
              "qwen3 with llama3 RoPE": "gguf's qwen3 has no llama3 RoPE"}[case]
    assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and phrase in err, err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
def test_each_pre_tokenizer_llama_cpp_knows_is_named_and_reads_back_splitting_alike(tmp_path, capsys, pre):
    """A tokenizer.json whose pre_tokenizer `tokenizers` itself serialized (GPT-2's ByteLevel; SmolLM2's single
    digits then ByteLevel; Qwen2's and Llama 3's Split then ByteLevel without its regex) is written with
    llama.cpp's name for it, and the GGUF's tokenizer encodes as the folder's; `generate` on the file runs."""
    from tokenizers import Regex, Tokenizer as Tok, pre_tokenizers as pt
    from support.hf_folders import text_llama_folder

    from anectypes.data.hf_tokenizer import HFTokenizer
    folder = text_llama_folder(tmp_path / "src")
    tok = Tok.from_file(str(folder / "tokenizer.json"))
    split = pt.Split(Regex(SPLIT % ("{1,3}" if pre == "llama-bpe" else "")), "isolated")
    tok.pre_tokenizer = {"gpt-2": pt.ByteLevel(add_prefix_space=False),
                         "smollm": pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]),
                         "qwen2": pt.Sequence([split, pt.ByteLevel(add_prefix_space=False, use_regex=False)]),
                         "llama-bpe": pt.Sequence([split, pt.ByteLevel(add_prefix_space=False, use_regex=False)])}[pre]
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = pre == "llama-bpe"
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    assert run([folder, "--format", "gguf", "--out", tmp_path / "m.gguf"], capsys)[0] == 0
    from gguf import GGUFReader
    assert GGUFReader(tmp_path / "m.gguf").get_field("tokenizer.ggml.pre").contents() == pre
    src, back = HFTokenizer.load(folder), sources.resolve(tmp_path / "m.gguf").tokenizer
    for text in GGUF_TEXTS:
        assert back.encode(text) == src.encode(text), text
    r = subprocess.run([sys.executable, "-m", "anectypes.generate", str(tmp_path / "m.gguf"), "--prompt", "Once upon",
                        "--steps", "8", "--temperature", "0"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Once upon"), r.stderr


@pytest.mark.parametrize("case", ["rope_freqs not llama3's", "no pre-tokenizer"])
def test_a_gguf_anectypes_cannot_compute_is_one_error_line(tmp_path, capsys, monkeypatch, case):
    """A rope_freqs tensor no llama3 settings give (each pair's divisor made up), and a gpt2 tokenizer without
    tokenizer.ggml.pre (llama.cpp's "default" split, which anectypes does not compute): generate and export say
    so in one line and write nothing."""
    from anectypes.formats import gguf
    folder = tmp_path / "src"
    arch_hf_folder(folder, "llama3", True)
    bpe_tokenizer(folder, "{1,3}", bos=True)
    if case == "rope_freqs not llama3's":
        monkeypatch.setattr(gguf, "LLAMA3", {})
        monkeypatch.setattr(gguf, "rope_factors", lambda cfg: np.array([1.0, 3.0, 2.0, 8.0], np.float32))
    else:
        monkeypatch.setattr(gguf.need("gguf").GGUFWriter, "add_tokenizer_pre", lambda self, pre: None)
    assert run([folder, "--format", "gguf", "--out", tmp_path / "m.gguf"], capsys)[0] == 0
    monkeypatch.undo()
    before = sorted(os.listdir(tmp_path))
    phrase = {"rope_freqs not llama3's": "rope_freqs.weight is not Llama 3's RoPE scaling",
              "no pre-tokenizer": "pre-tokenizer None"}[case]
    code, out, err = run([tmp_path / "m.gguf", "--format", "hf", "--out", tmp_path / "hf"], capsys)
    assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and phrase in err, err
    r = subprocess.run([sys.executable, "-m", "anectypes.generate", str(tmp_path / "m.gguf"), "--steps", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1 and phrase in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("rope", [dict(LLAMA3_ROPE, original_max_position_embeddings=8192, high_freq_factor=32.0),
                                  dict(LLAMA3_ROPE),
                                  dict(LLAMA3_ROPE, factor=32.0, low_freq_factor=0.5, high_freq_factor=1.5,
                                       original_max_position_embeddings=256)],
                         ids=["two pairs blended", "one pair blended", "none blended"])
def test_a_llama3_gguf_with_rope_freqs_alone_reads_as_its_model(tmp_path, capsys, monkeypatch, rope):
    """A Llama 3 GGUF as llama.cpp's converter writes it, rope_freqs without our anectypes.rope.* settings: the
    settings found from its divisors give them and transformers' logits of the folder, through generate's model
    and an export to Hugging Face read by transformers."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from anectypes.formats import gguf
    hf = arch_hf_folder(tmp_path / "src", "llama3", True, head_dim=16, rope_scaling=rope)
    bpe_tokenizer(tmp_path / "src", "{1,3}", bos=True)
    monkeypatch.setattr(gguf, "LLAMA3", {})
    assert run([tmp_path / "src", "--format", "gguf", "--out", tmp_path / "m.gguf"], capsys)[0] == 0
    monkeypatch.undo()
    assert not any(k.startswith("anectypes.rope") for k in GGUFReader(tmp_path / "m.gguf").fields)
    ids = np.random.default_rng(5).integers(0, 300, 40)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids[None])).logits[0].numpy()
    back = sources.resolve(tmp_path / "m.gguf")
    assert back.cfg.rope_type == "llama3" and back.cfg.rope_factor == rope["factor"]
    assert np.abs(our_logits(back, ids) - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert run([tmp_path / "m.gguf", "--format", "hf", "--out", tmp_path / "hf"], capsys)[0] == 0
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(torch.tensor(ids[None])).logits[0].numpy()
    assert np.abs(again - theirs).max() <= 1e-4 * np.abs(theirs).max()
