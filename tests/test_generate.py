"""python -m anectypes.generate: greedy ids from llama2.c model files against a float64 numpy
implementation of run.c's math, run folders and checkpoints, the sampler, and the bad-input catalogue."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from anectypes.formats.checkpoint import save_checkpoint
from anectypes.data.corpus import builtin_dataset
from anectypes.errors import AnectypesError
from anectypes.generate import Sampler, main
from anectypes.formats.llama2c import write_model
from anectypes.model.config import ModelConfig, init_params
from anectypes.runs import RunDir
from anectypes.data.tokenizer import Tokenizer
from support.llama2c import read_v0

pytestmark = pytest.mark.usefixtures("builtin_cache")

# GQA, head_size = dim / heads as llama2.c requires; vocab above the 259 control and byte tokens
CFG = ModelConfig(dim=64, hidden=160, heads=8, kv_heads=2, head_dim=8, layers=3, seq=96, vocab=320)
STEPS = 80


# --- run.c's forward in float64, from its file (version 0), written from run.c's math -------------------

def runc_greedy(path, prompt, steps):
    """run.c's generate() with temperature 0: forward(token, pos) one position at a time."""
    t, (dim, hidden, L, H, KV, V, seq) = read_v0(path)
    hs, kv_mul = dim // H, H // KV
    kcache, vcache = np.zeros((L, seq, KV * hs)), np.zeros((L, seq, KV * hs))

    def rmsnorm(x, w):
        return w * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def forward(token, pos):
        x = t["emb"][token].copy()
        for l in range(L):
            xb = rmsnorm(x, t["rms_att"][l])
            q, k, v = t["wq"][l] @ xb, t["wk"][l] @ xb, t["wv"][l] @ xb
            for i in range(0, dim, 2):                  # RoPE: pairs (i, i+1), frequency by i within the head
                angle = pos / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(angle), np.sin(angle)
                for vec in (q, k) if i < KV * hs else (q,):
                    vec[i], vec[i + 1] = vec[i] * c - vec[i + 1] * s, vec[i] * s + vec[i + 1] * c
            kcache[l, pos], vcache[l, pos] = k, v
            att = np.zeros(dim)
            for h in range(H):
                g = h // kv_mul
                scores = kcache[l, :pos + 1, g * hs:(g + 1) * hs] @ q[h * hs:(h + 1) * hs] / np.sqrt(hs)
                p = np.exp(scores - scores.max())
                att[h * hs:(h + 1) * hs] = (p / p.sum()) @ vcache[l, :pos + 1, g * hs:(g + 1) * hs]
            x = x + t["wo"][l] @ att
            xb = rmsnorm(x, t["rms_ffn"][l])
            h1 = t["w1"][l] @ xb
            x = x + t["w2"][l] @ (h1 / (1 + np.exp(-h1)) * (t["w3"][l] @ xb))
        return t["wcls"] @ rmsnorm(x, t["rms_final"])

    ids, gaps = list(prompt), []
    for pos in range(steps):
        logits = forward(ids[pos], pos)
        if pos + 1 < len(prompt):
            continue
        top2 = np.sort(logits)[-2:]
        gaps.append((top2[1] - top2[0]) / np.abs(logits).max())
        ids.append(int(np.argmax(logits)))
        assert ids[-1] != 1, "the reference produced BOS: choose another model seed"
    return ids, min(gaps)


def tokenizer_of(vocab):
    tok = builtin_dataset()[0]
    extra = vocab - 259
    return Tokenizer(tok.pieces[:259] + [" w%d" % i for i in range(extra)], [0.0] * 259 + [-float(i) for i in range(extra)])


def random_model(seed=3):
    """Weights large enough that every step's two largest logits are well apart; BOS's logit 0."""
    rng = np.random.default_rng(seed)
    params = {k: v * np.float32(4 if v.ndim == 2 else 1) for k, v in init_params(CFG, rng).items()}
    params["embed"] *= 20
    classifier = rng.standard_normal((CFG.vocab, CFG.dim)).astype(np.float32)
    classifier[1] = 0
    params["embed"][1] = 0
    return params, classifier


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("version, shared", [(0, False), (1, True), (0, True)])
def test_greedy_ids_equal_runc_math_in_float64(tmp_path, capsys, version, shared):
    params, classifier = random_model()
    write_model(tmp_path / "model.bin", CFG, params, None if shared else classifier, version=version)
    tokenizer_of(CFG.vocab).save(tmp_path / "tokenizer.bin")
    if version == 0:
        ref_path = tmp_path / "model.bin"
    else:                                          # the reference reads version 0: the same model as one
        ref_path = tmp_path / "v0.bin"
        write_model(ref_path, CFG, params, None if shared else classifier, version=0)
    prompt = tokenizer_of(CFG.vocab).encode(" w3 w7 w1", bos=True)
    expected, gap = runc_greedy(ref_path, prompt, STEPS)
    assert gap > 1e-4                               # the premise: no near-ties for float32 to break differently
    code, out, err = run([tmp_path / "model.bin", "--prompt", " w3 w7 w1", "--steps", STEPS, "--temperature", 0,
                          "--json"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["ids"] == expected and len(expected) - len(prompt) >= 64
    assert got["n_prompt"] == len(prompt) and got["n_generated"] == STEPS - len(prompt) + 1
    assert got["text"] == tokenizer_of(CFG.vocab).decode(expected)
    assert err.startswith("achieved ") and " tok/s (" in err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder on the built-in corpus with a best and a latest checkpoint (random weights)."""
    tok, _ = builtin_dataset()
    cfg = ModelConfig(dim=32, hidden=64, heads=4, kv_heads=2, head_dim=8, layers=2, seq=48, vocab=tok.vocab_size)
    rd = RunDir(tmp_path_factory.mktemp("run"))
    rd.write_config(dict(run_id="x", spec={"model": "tiny"}, model=cfg.to_dict()))
    for name, seed in (("best", 0), ("latest", 1)):
        params = init_params(cfg, np.random.default_rng(seed))
        zero = {k: np.zeros_like(v) for k, v in params.items()}
        save_checkpoint(rd.checkpoints / f"{name}.ckpt", cfg, params, dict(t=0, m=zero, v=zero), {"step": 5})
    return rd.path


def test_a_run_folder_streams_its_text_and_greedy_repeats(run_dir, capsys):
    code, out, err = run([run_dir, "--prompt", "Once upon a time", "--steps", 40, "--seed", 7], capsys)
    assert code == 0 and out.startswith("Once upon a time") and out.endswith("\n")
    assert err.startswith("achieved ") and err.count("\n") == 1
    greedy = [json.loads(run([run_dir, "--temperature", 0, "--json"], capsys)[1]) for _ in range(2)]
    assert greedy[0]["ids"] == greedy[1]["ids"]
    doc = greedy[0]
    assert set(doc) == {"ids", "text", "tokens_per_s", "ms_first_token", "n_prompt", "n_generated"}
    assert doc["ids"][0] == 1 and doc["n_prompt"] == 1 and doc["text"] == builtin_dataset()[0].decode(doc["ids"])
    latest = json.loads(run([run_dir, "--checkpoint", "latest", "--temperature", 0, "--json"], capsys)[1])
    ckpt = json.loads(run([run_dir / "checkpoints" / "latest.ckpt", "--temperature", 0, "--json"], capsys)[1])
    assert latest["ids"] == ckpt["ids"] != doc["ids"]


def test_a_closed_stdout_ends_it_quietly(run_dir):
    """`generate ... | head`: the reader goes away, and the command stops without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "anectypes.generate", str(run_dir), "--steps", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                               # before it writes anything
    assert proc.wait(120) == 141 and proc.stderr.read() == b""


def test_interactive_answers_each_line(run_dir, capsys, monkeypatch):
    import io
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Once\nThe dog\n")))
    code, out, err = run([run_dir, "--interactive", "--json", "--temperature", 0, "--steps", 10], capsys)
    docs = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [d["text"][:4] for d in docs] == ["Once", "The "] and err.count("achieved") == 2


def test_interactive_takes_a_line_that_is_not_utf8_as_the_same_bytes_in_prompt(run_dir):
    """Under a UTF-8 locale stdin's text is strict (a traceback at the first bad byte): a line of other bytes is
    a prompt like any other, as an argv --prompt of those bytes."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    cmd = [sys.executable, "-m", "anectypes.generate", str(run_dir), "--temperature", "0", "--steps", "10", "--json"]
    piped = subprocess.run([*cmd, "--interactive"], input=b"caf\xe9 \xff\n", capture_output=True, env=env)
    argv = subprocess.run([*cmd, "--prompt", os.fsdecode(b"caf\xe9 \xff")], capture_output=True, env=env)
    assert piped.returncode == argv.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["ids"] == json.loads(argv.stdout)["ids"]


def test_sampler():
    logits = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert Sampler(4, temperature=0)(logits) == 1
    assert {Sampler(4, top_k=1, top_p=1, seed=s)(logits) for s in range(20)} == {1}
    # the nucleus: 1 and 3 hold about 0.93 of the mass, so with top_p 0.9 only they are drawn, about evenly
    draws = [Sampler(4, top_p=0.9, seed=s)(logits) for s in range(400)]
    assert set(draws) == {1, 3} and 150 < draws.count(3) < 250
    assert set(Sampler(4, top_p=1.0, seed=0)(logits) for _ in range(1)) <= {0, 1, 2, 3}
    all_draws = {Sampler(4, top_p=1, temperature=5, seed=s)(logits) for s in range(200)}
    assert all_draws == {0, 1, 2, 3}


def test_a_tiny_temperature_is_greedy(run_dir, capsys):
    """Any temperature above 0 samples: below about 1e-38, logits / T overflowed float32 and the sampler
    raised IndexError. In the limit, sampling is greedy (with every top-k and top-p)."""
    logits = np.array([0.0, 3.0, 1.0, 2.9, -1e30], np.float32)
    for t in (1e-38, 1e-45, 5e-324):
        for top_k, top_p in ((0, 1.0), (50, 0.9), (2, 1.0), (0, 0.5)):
            assert {Sampler(5, t, top_p, top_k, seed=s)(logits) for s in range(5)} == {1}, (t, top_k, top_p)
    greedy = json.loads(run([run_dir, "--temperature", 0, "--json", "--steps", 20], capsys)[1])["ids"]
    for t in ("1e-39", "5e-324"):
        code, out, err = run([run_dir, "--temperature", t, "--json", "--steps", 20, "--seed", 1], capsys)
        assert code == 0 and json.loads(out)["ids"] == greedy, err


def test_non_finite_logits_are_an_error_not_an_index_error():
    """A model whose weights overflowed (a diverged run's sample) gives NaN or inf logits: every sampler
    setting says so instead of raising IndexError or drawing from NaN probabilities."""
    for bad in (np.nan, np.inf, -np.inf):
        logits = np.array([0.0, bad, 1.0], np.float32) if bad != -np.inf else np.full(3, bad, np.float32)
        for t, top_k, top_p in ((0.8, 0, 0.9), (1.0, 2, 1.0), (1e-38, 0, 1.0)):
            with pytest.raises(AnectypesError, match="not finite"):
                Sampler(3, t, top_p, top_k, seed=0)(logits)


def bad_cases(tmp):
    params, classifier = random_model()
    write_model(tmp / "model.bin", CFG, params, classifier)
    tokenizer_of(CFG.vocab).save(tmp / "tokenizer.bin")
    data = (tmp / "model.bin").read_bytes()
    (tmp / "cut").mkdir()
    (tmp / "cut" / "model.bin").write_bytes(data[:-100])
    (tmp / "empty").mkdir()
    (tmp / "text.txt").write_text("Once upon a time there was a file that was not a model at all.\n" * 20)
    tokenizer_of(CFG.vocab + 1).save(tmp / "other_tokenizer.bin")
    return {
        "not a model": ([tmp / "text.txt"], "not a llama2.c model"),
        "truncated": ([tmp / "cut" / "model.bin", "--tokenizer", tmp / "tokenizer.bin"], f"is {len(data)} bytes"),
        "tokenizer size": ([tmp / "model.bin", "--tokenizer", tmp / "other_tokenizer.bin"], "321 tokens"),
        "steps beyond seq": ([tmp / "model.bin", "--steps", 97], "beyond the model's seq (96)"),
        "prompt beyond steps": ([tmp / "model.bin", "--steps", 3, "--prompt", " w1 w2 w3"], "--steps is 3"),
        "no such file": ([tmp / "nothing.bin"], "no such file"),
        "not a run folder": ([tmp / "empty"], "config.json"),
        "temperature": ([tmp / "model.bin", "--temperature", "nan"], "--temperature"),
        "top-p": ([tmp / "model.bin", "--top-p", "1.5"], "--top-p"),
        "threads": ([tmp / "model.bin", "--threads", "0"], "--threads: must be >= 1, got 0"),
        "steps 0": ([tmp / "model.bin", "--steps", "0"], "--steps: must be >= 1, got 0"),
        "seed -1": ([tmp / "model.bin", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        "top-k -1": ([tmp / "model.bin", "--top-k", "-1"], "--top-k: must be >= 0, got -1"),
        "interactive and prompt": ([tmp / "model.bin", "--interactive", "--prompt", "Once"],
                                   "--interactive reads every prompt from stdin"),
    }


@pytest.mark.parametrize("case", ["not a model", "truncated", "tokenizer size", "steps beyond seq",
                                  "prompt beyond steps", "no such file", "not a run folder", "temperature",
                                  "top-p", "threads", "steps 0", "seed -1", "top-k -1", "interactive and prompt"])
def test_bad_input_is_one_error_line(tmp_path, capsys, case):
    argv, message = bad_cases(tmp_path)[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    try:
        code, out, err = run(argv, capsys)
    except SystemExit as e:                           # usage errors: argparse's exit 2
        code, (out, err) = e.code, capsys.readouterr()
    assert code != 0 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_command_called_in_process_leaves_the_blas_thread_count_as_it_was(run_dir, capsys):
    """generate and bench generate with --threads 1 set OpenBLAS's threads for their run only: a caller's
    later sgemms otherwise ran on one thread and added in another order (a training run in the same
    process then differed in its last bits from the same run in a fresh process)."""
    from anectypes.bench.cli import main as bench
    from anectypes.host import blas
    blas.set_num_threads(2)
    assert main([str(run_dir), "--steps", "4", "--threads", "1", "--temperature", "0"]) == 0
    assert blas.get_num_threads() == 2
    assert bench(["generate", "--model", str(run_dir), "--steps", "4", "--rounds", "1", "--threads", "1",
                  "--lanes", "1"]) == 0
    assert blas.get_num_threads() == 2
