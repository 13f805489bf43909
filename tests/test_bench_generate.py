"""python -m anectypes.bench generate: its report validates against tools/bench_schema.json and its
figures are consistent (the roofline from the bytes of the model's weights); --write gives a model.bin
and tokenizer.bin that read back as the same model. Correctness only, never speed."""

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from jsonschema import validate

from anectypes.host import blas
from anectypes.bench import cli, generate
from anectypes.formats.llama2c import read_model
from anectypes.model.config import PRESETS
from anectypes.generate.lanes import lanes_for
from anectypes.data.tokenizer import Tokenizer

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "tools" / "bench_schema.json").read_text())
pytestmark = pytest.mark.usefixtures("builtin_cache")


def report(capsys, *argv):
    assert cli.main(["generate", *map(str, argv), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    r = json.loads(out[0])
    validate(r, SCHEMA)
    return r


def test_generate_json_and_the_model_it_writes(capsys, tmp_path):
    r = report(capsys, "--model", "tiny", "--steps", 40, "--rounds", 2, "--threads", 1, "--write", tmp_path)
    g, cfg = r["benchmarks"]["generate"], PRESETS["tiny"]
    assert r["system"]["backend"] == "cpu" and g["note"] == "CPU figures" and r["system"]["blas"]["threads"] == 1
    assert r["system"]["blas"]["library"] == blas.library_path()
    # tied: the embedding is read as the classifier; the norms' weights are folded into the matrices
    assert g["weight_bytes"] == 4 * (cfg.n_params() - (2 * cfg.layers + 1) * cfg.dim)
    assert g["decode"]["tokens"] == len(g["decode"]["ms_all"]) == 2 * 39 and g["prefill"]["tokens"] == 40
    assert g["decode"]["tokens_per_s"] == pytest.approx(78 / sum(g["decode"]["ms_all"]) * 1e3, rel=1e-3)
    assert g["roofline_tokens_per_s"] == pytest.approx(g["bandwidth_gbs"] * 1e9 / g["weight_bytes"])
    assert g["roofline_ratio"] == pytest.approx(g["roofline_tokens_per_s"] / g["decode"]["tokens_per_s"])
    assert r["summary"]["decode_tokens_per_s"] == g["decode"]["tokens_per_s"]
    parts = g["breakdown_ms"]
    assert parts["classifier"] > 0 and parts["layer_products"] > 0
    assert parts["rest"] == pytest.approx(max(0, g["decode"]["ms_median"] - parts["classifier"] - parts["layer_products"]))
    model = read_model(tmp_path / "model.bin")
    assert model.cfg == cfg and model.classifier is None
    assert Tokenizer.load(tmp_path / "tokenizer.bin").vocab_size == cfg.vocab
    assert g["lanes"] == 1
    r = report(capsys, "--model", tmp_path / "model.bin", "--steps", 8)  # the file it wrote, as run.c reads it
    assert r["benchmarks"]["generate"]["config"] == cfg.to_dict()
    assert r["benchmarks"]["generate"]["lanes"] == lanes_for(os.cpu_count())
    assert report(capsys, "--model", "tiny", "--steps", 8, "--lanes", 3)["benchmarks"]["generate"]["lanes"] == 3


@pytest.mark.parametrize("measured", [(3e9, 5e9), (5e9, 3e9)])
def test_the_roofline_takes_the_better_of_the_bandwidths_before_and_after_decoding(capsys, monkeypatch, measured):
    calls = itertools.cycle(measured)
    monkeypatch.setattr(generate, "read_bandwidth", lambda: next(calls))
    g = report(capsys, "--model", "tiny", "--steps", 8, "--threads", 1)["benchmarks"]["generate"]
    assert g["bandwidth_before_after_gbs"] == [m / 1e9 for m in measured]
    assert g["bandwidth_gbs"] == 5.0
    assert g["roofline_tokens_per_s"] == pytest.approx(5e9 / g["weight_bytes"])
    assert cli.main(["generate", "--model", "tiny", "--steps", "8", "--threads", "1"]) == 0
    assert "5.0 GB/s" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["preset", "qwen3 folder"])
def test_compare_llama_cpp_times_it_on_the_models_gguf_and_its_greedy_tokens_are_ours(capsys, tmp_path, source):
    """llama.cpp itself on our GGUF export of the model: a preset's random model (a llama2.c tokenizer), and a
    Hugging Face Qwen3 folder (QK-norm, NEOX RoPE, byte-level BPE): every greedy token equals our decoder's, and the
    ratios are the two rates'."""
    from support.hf_folders import arch_hf_folder, bpe_tokenizer
    model = "tiny"
    if source == "qwen3 folder":
        arch_hf_folder(tmp_path / "qwen3", "qwen3", tied=True)
        bpe_tokenizer(tmp_path / "qwen3", "", bos=False)
        capsys.readouterr()
        model = tmp_path / "qwen3"
    r = report(capsys, "--model", model, "--steps", 24, "--threads", 1, "--compare", "llama.cpp")
    g = r["benchmarks"]["generate"]
    theirs = g["compare"]["llama.cpp"]
    assert theirs["greedy_equal"] == 23 and theirs["threads"] == 1 and theirs["decode"]["tokens"] == 23
    assert len(set(theirs["decode"]["ms_all"])) > 1                       # timed token by token
    assert theirs["decode_ratio"] == pytest.approx(theirs["decode"]["tokens_per_s"] / g["decode"]["tokens_per_s"])
    assert theirs["prefill_ratio"] == pytest.approx(theirs["prefill"]["tokens_per_s"] / g["prefill"]["tokens_per_s"])
    assert r["summary"]["decode_time_ratio_vs_llama_cpp"] == theirs["decode_ratio"]
    assert cli.main(["generate", "--model", str(model), "--steps", "8", "--threads", "1", "--compare", "llama.cpp"]) == 0
    assert "greedy tokens equal for the first 7 of 7" in capsys.readouterr().out


def test_compare_llama_cpp_without_the_extra_is_one_error_line_before_any_work(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)                  # as if not installed: import fails
    monkeypatch.setattr(generate, "run", lambda args: pytest.fail("the benchmark ran"))
    assert cli.main(["generate", "--model", "tiny", "--compare", "llama.cpp"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --compare llama.cpp needs llama-cpp-python: pip install 'anectypes[llamacpp]'\n"


@pytest.mark.parametrize("argv, words", [(["--steps", "0"], "--steps: must be >= 1, got 0"),
                                         (["--write", "x", "--model", "m.bin"], "preset"),
                                         (["--model", "no-such-model.bin"], "no such file"),
                                         (["--lanes", "0"], "--lanes: must be >= 1, got 0")])
def test_bad_flags_are_one_error_line(capsys, argv, words):
    try:
        assert cli.main(["generate", *argv]) == 1
    except SystemExit as e:                               # usage errors: argparse's exit 2
        assert e.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
