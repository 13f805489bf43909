"""The bad-input catalogue: every case gives exactly one `error:` line, a non-zero exit, no traceback,
and leaves every file as it was. Plus a full disk and a read-only run folder, on real (tmpfs) mounts."""

import fcntl
import json
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from anectypes import sources
from anectypes.formats.export import export
from anectypes.formats.hf import MAX_CONTEXT
from anectypes.formats.checkpoint import load_checkpoint
from anectypes.formats.llama2c import read_model, write_model
from anectypes.model.config import PRESETS
from anectypes.train import main
from support.checkpoints import odd_members, write_odd
from support.training import FAST, one_line_error

ROOT = Path(__file__).resolve().parent.parent
# the phrases of the odd checkpoints (support/checkpoints.py), for the finished tiny run's (only vocab and dim matter)
ODD_PHRASES = {case: phrase for case, (_, phrase) in
               odd_members({"config": PRESETS["tiny"].to_dict(), "state": {}}).items()}
pytestmark = pytest.mark.usefixtures("builtin_cache")
TINY = dict(dim=64, hidden=176, heads=4, kv_heads=4, head_dim=16, layers=2, seq=64)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def model_file(**fields):
    return lambda tmp: write(tmp / "m.json", json.dumps(fields))


def run_config(text):
    return lambda tmp: write(tmp / "run" / "config.json", text)


def tokens_with(bad_id):
    def setup(tmp):
        np.array([1, 2, 3, bad_id] * 100, np.uint16).tofile(tmp / "bad.bin")
    return setup


def copy_run(name):
    return lambda tmp: shutil.copytree(RUNS[name], tmp / "run")


def damaged_run(name, damage):
    """A copy of a run with damage(its latest.ckpt) done."""
    def setup(tmp):
        copy_run(name)(tmp)
        damage(tmp / "run" / "checkpoints" / "latest.ckpt")
    return setup


def a_directory(path):
    path.unlink()
    path.mkdir()


HELD = []      # folders this process holds as a trainer would (an flock on an fd of the folder)


def held_folder(tmp):
    (tmp / "run").mkdir(exist_ok=True)
    HELD.append(os.open(tmp / "run", os.O_RDONLY))
    fcntl.flock(HELD[-1], fcntl.LOCK_EX)


def mil_file(old, new):
    """The example kernel with one edit, as k.mil."""
    text = (ROOT / "anectypes" / "mil" / "examples" / "dynamic_matmul.mil").read_text()
    assert old in text
    return lambda tmp: write(tmp / "k.mil", text.replace(old, new, 1))


def npy_file(name, a):
    return lambda tmp: np.save(tmp / name, a, allow_pickle=True)


def both(*setups):
    return lambda tmp: [setup(tmp) for setup in setups]


def odd_run(case):
    """The finished run with its best.ckpt made odd: test_checkpoint's case `case`."""
    def setup(tmp):
        shutil.copytree(RUNS["finished"], tmp / "run")
        best = tmp / "run" / "checkpoints" / "best.ckpt"
        with zipfile.ZipFile(best) as zf:
            meta = json.loads(zf.read("meta.json"))
        write_odd(best, best, odd_members(meta)[case][0])
    return setup


def hf_folder(edit):
    """The finished run exported as a Hugging Face folder hf/, then edit(hf/)."""
    def setup(tmp):
        export(sources.resolve(RUNS["finished"]), "hf", tmp / "hf")
        edit(tmp / "hf")
    return setup


def arch_folder(edit, **kw):
    """A tiny random Qwen3 saved by transformers in shards as hf/ (support/hf_folders.py), then edit(hf/)."""
    def setup(tmp):
        from support.hf_folders import arch_hf_folder
        arch_hf_folder(tmp / "hf", "qwen3", True, shard_bytes=20000, **kw)
        edit(tmp / "hf")
    return setup


def edit_json(name, **changes):
    def edit(folder):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    return edit


def edit_safetensors_embed(**changes):
    """model.safetensors with its embedding's header entry changed."""
    def edit(folder):
        data = (folder / "model.safetensors").read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header["model.embed_tokens.weight"].update(changes)
        text = json.dumps(header).encode()
        (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return edit


def llama2c_with(value):
    """The finished run exported for llama2.c as l2c/, its embedding's first row set to `value`."""
    def setup(tmp):
        export(sources.resolve(RUNS["finished"]), "llama2c", tmp / "l2c")
        m = read_model(tmp / "l2c" / "model.bin")
        m.params["embed"][0] = value
        write_model(tmp / "l2c" / "model.bin", m.cfg, m.params)
    return setup


RUNS = {}      # finished and stopped tiny runs, made once (fixture `runs`)
DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "h" * 50_000_000

# (id, setup, module, args, words the error line must hold)
CASES = [
    ("resume-folder-without-config", lambda tmp: (tmp / "run").mkdir(), "train",
     ["--resume", "--run-dir", "run"], ["run has no config.json"]),
    ("config-not-json", run_config("{oops"), "train", ["--resume", "--run-dir", "run"],
     ["config.json", "not valid JSON"]),
    ("config-with-infinity", run_config('{"format": "anectypes-run", "version": 1, "spec": {"clip": Infinity}}'),
     "train", ["--resume", "--run-dir", "run"], ["config.json", "Infinity"]),
    ("config-unknown-spec-field", run_config('{"format": "anectypes-run", "version": 1, "spec": {"lrr": 1}}'),
     "train", ["--resume", "--run-dir", "run"], ["unknown field 'lrr'"]),
    ("model-dim-1e9", model_file(**dict(TINY, dim=10**9)), "train", ["--scratch", "--model", "m.json"],
     ["needs about", "GiB", "this machine has"]),
    ("model-dim-64.5", model_file(**dict(TINY, dim=64.5)), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "dim must be a positive integer, got 64.5"]),
    ("model-infinite-rope-theta", lambda tmp: write(tmp / "m.json", '{"dim": 64, "hidden": 176, "heads": 4, '
     '"kv_heads": 4, "head_dim": 16, "layers": 2, "seq": 64, "rope_theta": Infinity}'), "train",
     ["--scratch", "--model", "m.json"], ["rope_theta must be a positive finite number"]),
    ("model-empty-file", lambda tmp: write(tmp / "m.json", ""), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "the file is empty"]),
    ("model-missing-fields", model_file(dim=64), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "missing fields hidden, heads, kv_heads, head_dim, layers"]),
    # the fields of real checkpoints' architectures (issue 35 §1): a bool where a bool belongs, a known RoPE type
    ("model-qk-norm-a-string", model_file(**dict(TINY, qk_norm="yes")), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "qk_norm must be true or false, got 'yes'"]),
    ("model-tied-a-number", model_file(**dict(TINY, tied=1)), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "tied must be true or false, got 1"]),
    ("model-residual-scaled-null", model_file(**dict(TINY, residual_scaled=None)), "train",
     ["--scratch", "--model", "m.json"], ["m.json", "residual_scaled must be true or false, got None"]),
    ("model-rope-type-yarn", model_file(**dict(TINY, rope_type="yarn")), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "rope_type must be 'default' or 'llama3', got 'yarn'"]),
    ("model-rope-factor-zero", model_file(**dict(TINY, rope_type="llama3", rope_factor=0)), "train",
     ["--scratch", "--model", "m.json"], ["m.json", "rope_factor must be a positive finite number, got 0"]),
    ("model-rope-high-freq-under-low", model_file(**dict(TINY, rope_type="llama3", rope_high_freq=0.5)), "train",
     ["--scratch", "--model", "m.json"], ["m.json", "rope_high_freq (0.5) must exceed rope_low_freq (1.0)"]),
    ("model-qk-norm-head-dim-over-dim", model_file(**dict(TINY, qk_norm=True, head_dim=128, heads=1, kv_heads=1)),
     "train", ["--scratch", "--model", "m.json"], ["m.json", "qk_norm needs head_dim (128) <= dim (64)"]),
    ("train-seq-0", None, "train", ["--scratch", "--seq", "0"], ["argument --seq: must be >= 1 and <= 65536, got 0"]),
    ("train-seq-beyond-the-data", tokens_with(4), "train", ["--scratch", "--data", "bad.bin", "--seq", "100",
                                                            "--backend", "sim"],
     ["data has 400 tokens: too short for seq 100"]),
    ("model-vocab-unlike-the-data", model_file(**dict(TINY, vocab=100)), "train", ["--scratch", "--model", "m.json"],
     ["m.json", "vocab is 100 but the data needs 1024"]),
    ("run-dir-is-a-file", lambda tmp: write(tmp / "afile", "x"), "train", ["--scratch", "--run-dir", "afile"],
     ["--run-dir afile is a file"]),
    ("seed-negative", None, "train", ["--scratch", "--seed", "-1"], ["--seed", "got -1"]),
    ("loss-scale-inf", None, "train", ["--scratch", "--loss-scale", "inf"], ["--loss-scale", "finite"]),
    ("lr-inf", None, "train", ["--scratch", "--lr", "inf"], ["--lr", "finite"]),
    ("lr-nan", None, "train", ["--scratch", "--lr", "nan"], ["--lr", "finite"]),
    ("steps-negative", None, "train", ["--scratch", "--steps", "-5"], ["--steps"]),
    ("no-start-flag", None, "train", ["--steps", "5"], ["--scratch"]),
    ("report-to-unknown-library", None, "train", ["--scratch", "--report-to", "wandb,comet"],
     ["--report-to", "some of wandb, tensorboard, mlflow", "got 'wandb,comet'"]),
    ("report-to-twice", None, "train", ["--scratch", "--report-to", "mlflow,mlflow"],
     ["--report-to", "'mlflow,mlflow'"]),
    ("report-to-none-and-more", None, "train", ["--scratch", "--report-to", "none,wandb"],
     ["--report-to", "got 'none,wandb'"]),
    ("data-id-beyond-vocab", tokens_with(60000), "train", ["--scratch", "--data", "bad.bin", *FAST], ["60000"]),
    ("resume-finished-run", copy_run("finished"), "train", ["--resume", "--run-dir", "run"],
     ["is finished: step 8 of 8", "--steps N"]),
    ("resume-changing-clip", copy_run("stopped"), "train", ["--resume", "--run-dir", "run", "--clip", "0.5"],
     ["--clip 0.5 differs from the run's 1.0"]),
    ("resume-scratch-into-a-run", copy_run("stopped"), "train", ["--scratch", "--run-dir", "run"],
     ["already holds a run"]),
    ("mil-list-nested-100000-deep", mil_file("([0, 0, 0, 0])", f"({DEEP})"), "mil", ["check", "k.mil"],
     ["k.mil", "nested more than"]),
    ("mil-50mb-token", mil_file("slice_by_size(x = x,", f"slice_by_size(x = {HUGE},"), "mil", ["check", "k.mil"],
     ["k.mil", "... (50000000 characters)"]),
    ("mil-input-too-large", mil_file("[1, 64, 1, 128]> x", "[1, 1000000000, 1, 1000000]> x"), "mil",
     ["check", "k.mil"], ["k.mil", "GiB", "more than"]),
    ("mil-run-seed-not-a-number", mil_file("", ""), "mil", ["run", "k.mil", "--random", "--seed", "x", "--out", "o"],
     ["--seed"]),
    ("bench-peak-channels-1e9", None, "bench", ["peak", "--channels", "1000000000"],
     ["--channels 1000000000", "GiB", "this machine has"]),
    ("bench-peak-channels-inf", None, "bench", ["peak", "--channels", "inf"], ["--channels"]),
    # the trainer's (issue 32)
    ("resume-latest-is-a-directory", damaged_run("finished", a_directory), "train", ["--resume", "--run-dir", "run"],
     ["latest.ckpt is not a file", "--resume --from best"]),
    ("resume-latest-is-a-directory-and-no-best", damaged_run("stopped", a_directory), "train",
     ["--resume", "--run-dir", "run"], ["latest.ckpt is not a file", "no best.ckpt either"]),
    ("resume-from-best-without-best", copy_run("stopped"), "train", ["--resume", "--from", "best", "--run-dir", "run"],
     ["best.ckpt: no such checkpoint file"]),
    ("from-without-resume", None, "train", ["--scratch", "--from", "best"], ["--from best goes with --resume"]),
    ("resume-missing-folder", None, "train", ["--resume", "--run-dir", "nowhere"], ["nowhere: no such run folder"]),
    ("resume-steps-at-the-runs-step", copy_run("stopped"), "train", ["--resume", "--run-dir", "run", "--steps", "4"],
     ["--steps 4", "at step 4 already", "N > 4"]),
    ("resume-steps-below-the-runs-step", copy_run("finished"), "train",
     ["--resume", "--run-dir", "run", "--steps", "6"], ["--steps 6", "at step 8 already"]),
    ("scratch-into-a-folder-another-process-holds", held_folder, "train", ["--scratch", "--run-dir", "run", *FAST],
     ["run is being trained by another process"]),
    ("resume-a-run-another-process-holds", lambda tmp: [copy_run("stopped")(tmp), held_folder(tmp)], "train",
     ["--resume", "--run-dir", "run"], ["run is being trained by another process"]),
    # the other commands (issue 32): a flag out of range names the flag and its bound, a file what is wrong in it
    ("bench-train-model-nested-100000-deep", lambda tmp: write(tmp / "m.json", DEEP), "bench",
     ["train", "--model", "m.json"], ["m.json: not valid JSON", "maximum recursion depth"]),
    ("bench-train-model-1e9-layers", model_file(**dict(TINY, layers=10**9)), "bench", ["train", "--model", "m.json"],
     ["m.json", "training it needs about", "GiB"]),
    ("doctor-reps-0", None, "doctor", ["--reps", "0"], ["argument --reps: must be >= 1, got 0"]),
    ("doctor-model-unknown", None, "doctor", ["--model", "nope"], ["--model: unknown model 'nope'"]),
    ("doctor-timeout-0", None, "doctor", ["--timeout", "0"], ["argument --timeout: must be >= 1, got 0"]),
    ("doctor-json-and-report", None, "doctor", ["--json", "--report"], ["--report: not allowed with argument --json"]),
    ("generate-steps-0", None, "generate", ["run", "--steps", "0"], ["argument --steps: must be >= 1, got 0"]),
    ("generate-seed-negative", None, "generate", ["run", "--seed", "-1"], ["argument --seed: must be >= 0, got -1"]),
    ("generate-top-k-negative", None, "generate", ["run", "--top-k", "-1"], ["argument --top-k: must be >= 0"]),
    ("generate-interactive-with-prompt", None, "generate", ["run", "--interactive", "--prompt", "X"],
     ["--interactive reads every prompt from stdin", "not with --prompt"]),
    ("bench-train-accum-0", None, "bench", ["train", "--model", "tiny", "--accum", "0"],
     ["argument --accum: must be >= 1, got 0"]),
    ("bench-peak-warmup-negative", None, "bench", ["peak", "--warmup", "-1"], ["argument --warmup: must be >= 0"]),
    ("bench-generate-write-to-a-file", lambda tmp: write(tmp / "afile", "x"), "bench",
     ["generate", "--model", "tiny", "--steps", "4", "--write", "afile"], ["--write afile: ", "File exists"]),
    ("bench-generate-write-onto-a-folder", lambda tmp: (tmp / "w" / "model.bin").mkdir(parents=True), "bench",
     ["generate", "--model", "tiny", "--steps", "4", "--write", "w"], ["--write w: w/model.bin: Is a directory"]),
    ("export-out-holds-the-source", copy_run("finished"), "export",
     ["run", "--format", "hf", "--out", "run", "--force"], ["--out run holds SOURCE run"]),
    ("export-out-dot", copy_run("finished"), "export", ["run/checkpoints/best.ckpt", "--format", "hf", "--out", ".",
                                                       "--force"], ["--out . holds SOURCE"]),
    ("export-out-under-a-file", both(copy_run("finished"), lambda tmp: write(tmp / "afile", "x")), "export",
     ["run", "--format", "gguf", "--out", "afile/m.gguf"], ["cannot write afile/m.gguf: afile: File exists"]),
    ("mil-run-unknown-input", both(mil_file("", ""), npy_file("x.npy", np.zeros((1, 64, 1, 128)))), "mil",
     ["run", "k.mil", "--input", "y=x.npy", "--out", "o"], ["--input y=x.npy: the program has no input named 'y'; "
                                                            "its inputs: x"]),
    ("mil-run-input-twice", both(mil_file("", ""), npy_file("x.npy", np.zeros((1, 64, 1, 128)))), "mil",
     ["run", "k.mil", "--input", "x=x.npy", "--input", "x=x.npy", "--out", "o"], ["--input x is given twice"]),
    ("mil-run-input-npz", both(mil_file("", ""), lambda tmp: np.savez(tmp / "x.npz", x=np.zeros(3))), "mil",
     ["run", "k.mil", "--input", "x=x.npz", "--out", "o"], ["--input x=x.npz: not a readable .npy file"]),
    ("mil-run-input-empty", both(mil_file("", ""), lambda tmp: write(tmp / "x.npy", "")), "mil",
     ["run", "k.mil", "--input", "x=x.npy", "--out", "o"], ["--input x=x.npy: not a readable .npy file (EOF"]),
    ("mil-run-input-objects", both(mil_file("", ""), npy_file("x.npy", np.array([{}], dtype=object))), "mil",
     ["run", "k.mil", "--input", "x=x.npy", "--out", "o"], ["Object arrays cannot be loaded"]),
    ("mil-run-input-complex", both(mil_file("", ""), npy_file("x.npy", np.zeros((1, 64, 1, 128), np.complex64))),
     "mil", ["run", "k.mil", "--input", "x=x.npy", "--out", "o"], ["holds complex64 values"]),
    ("mil-run-seed-negative", mil_file("", ""), "mil", ["run", "k.mil", "--random", "--seed", "-1", "--out", "o"],
     ["argument --seed: must be >= 0, got -1"]),
    ("mil-run-out-is-a-file", both(mil_file("", ""), lambda tmp: write(tmp / "o", "x")), "mil",
     ["run", "k.mil", "--random", "--out", "o"], ["--out o: ", "File exists"]),
    # weights that hold NaN or inf: refused by every command that reads a model (generate's sampler had nothing to
    # draw from: an IndexError)
    *[(f"llama2c-{kind}-weights-{label}", llama2c_with(value), label.split("-")[0], args,
       ["its embed holds NaN or inf"])
      for kind, value in (("nan", np.nan), ("inf", np.inf))
      for label, args in (("generate-file", ["l2c/model.bin", "--steps", "8"]),
                          ("generate-folder", ["l2c", "--steps", "8"]),
                          ("export", ["l2c", "--format", "hf", "--out", "hf"]),
                          ("train", ["--init-from", "l2c", "--run-dir", "new", "--backend", "sim"]),
                          ("bench", ["generate", "--model", "l2c/model.bin", "--steps", "8", "--threads", "1"]))],
    *[(f"export-f16-of-weights-beyond-float16-{fmt}", llama2c_with(70000.0), "export",
       ["l2c", "--format", fmt, "--dtype", "f16", "--out", "o"], ["embed holds values up to 7e+04, beyond float16's"])
      for fmt in ("hf", "gguf")],
    # Hugging Face folders that are odd: every reader of them (sources.resolve) for export and generate
    *[(f"hf-{case}-{module}", hf_folder(edit), module, args, words)
      for case, edit, words in (
          ("1e9-layers", edit_json("config.json", num_hidden_layers=10**9), ["1000000000 layers need 9000000002"]),
          ("nan-hidden-size", edit_json("config.json", hidden_size=float("nan")),
           ["hf/config.json: not a usable LlamaForCausalLM config", "dim must be a positive integer, got nan"]),
          ("architectures-a-string", edit_json("config.json", architectures="MistralForCausalLM"),
           ["a MistralForCausalLM model; only LlamaForCausalLM"]),
          ("index-naming-a-file-outside", lambda f: write(f / "model.safetensors.index.json",
                                                          '{"weight_map": {"a": "../../hf/model.safetensors"}}'),
           ["weight_map names files other than those in the folder"]),
          ("index-not-json", lambda f: write(f / "model.safetensors.index.json", "{oops"),
           ["hf/model.safetensors.index.json: not readable JSON"]),
          ("safetensors-float-shape", edit_safetensors_embed(shape=[1024.0, 64]),
           ["shape [1024.0, 64] is not a list of sizes"]),
          ("safetensors-dtype-a-list", edit_safetensors_embed(dtype=["F32"]), ["only F32, F16 and BF16 tensors"]))
      for module, args in (("export", ["hf", "--format", "gguf", "--out", "o.gguf"]),
                           ("generate", ["hf", "--steps", "4"]))],
    # what real checkpoints use that anectypes does not compute (issue 35 §2): refused naming the field, by every
    # reader of a folder, before anything is written
    *[(f"hf-{case}-{module}", arch_folder(edit), module, args, words)
      for case, edit, words in (
          ("attention-bias", edit_json("config.json", attention_bias=True), ["attention_bias is True"]),
          ("mlp-bias", edit_json("config.json", mlp_bias=True), ["mlp_bias is True"]),
          ("sliding-window", edit_json("config.json", use_sliding_window=True, sliding_window=16),
           ["use_sliding_window is True"]),
          ("sliding-layer", edit_json("config.json", layer_types=["full_attention", "sliding_attention"]),
           ["layer_types is ['full_attention', 'sliding_attention']; anectypes computes full_attention only"]),
          ("experts", edit_json("config.json", num_experts=8), ["num_experts is 8"]),
          ("gelu", edit_json("config.json", hidden_act="gelu"), ["hidden_act is gelu; anectypes computes silu only"]),
          ("rope-yarn", edit_json("config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
           ["rope_parameters's rope_type is yarn; anectypes computes default and llama3 only"]),
          ("rope-scaling-dynamic", edit_json("config.json", rope_scaling={"type": "dynamic", "factor": 2.0}),
           ["rope_scaling's rope_type is dynamic"]),
          ("llama3-without-factor", edit_json("config.json", rope_parameters={
              "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}), ["rope_parameters of rope_type llama3 lacks factor"]),
          ("llama3-context-a-float", edit_json("config.json", rope_parameters={
              "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64.5}), ["rope_original_context must be a positive integer"]),
          ("mixtral", edit_json("config.json", architectures=["MixtralForCausalLM"]),
           ["a MixtralForCausalLM model; only LlamaForCausalLM and Qwen3ForCausalLM are supported"]),
          ("untied-without-lm-head", edit_json("config.json", tie_word_embeddings=False),
           ["2 layers need 25 tensors, the file holds 24"]),
          ("missing-shard", lambda f: (f / "model-00002-of-00007.safetensors").unlink(),
           ["hf/model-00002-of-00007.safetensors: missing"]))
      for module, args in (("generate", ["hf", "--steps", "4"]),
                           ("train", ["--init-from", "hf", "--run-dir", "new", "--backend", "sim"]))],
    # eval: a source it cannot score on the data, data too short, a window it cannot make
    ("eval-text-without-tokenizer", arch_folder(lambda f: None), "eval", ["hf", "--data", "t.txt"],
     ["hf has no tokenizer (no tokenizer.bin or tokenizer.json in it)"]),
    ("eval-one-token", both(copy_run("finished"), lambda tmp: np.array([5], np.uint16).tofile(tmp / "one.bin")),
     "eval", ["run", "--data", "one.bin", "--backend", "sim"], ["one.bin: 1 token; eval needs at least 2"]),
    ("eval-token-beyond-vocabulary", both(copy_run("finished"), tokens_with(5000)), "eval",
     ["run", "--data", "bad.bin", "--backend", "sim"], ["token id 5000 at position 3 is >= vocab_size 1024"]),
    ("eval-seq-0", None, "eval", ["run", "--data", "t.txt", "--seq", "0"], ["argument --seq: must be >= 1, got 0"]),
    ("eval-seq-beyond-context", hf_folder(lambda f: None), "eval", ["hf", "--data", "t.bin", "--seq", "65"],
     ["--seq 65: must be from 1 to the model's context (64)"]),
    ("eval-checkpoint-of-a-folder", hf_folder(lambda f: None), "eval", ["hf", "--data", "t.bin", "--checkpoint",
                                                                       "best"], ["hf: --checkpoint needs a run folder"]),
    ("eval-no-data-file", copy_run("finished"), "eval", ["run", "--data", "t.txt"], ["t.txt: no such file or folder"]),
    # a checkpoint whose zip is well formed but whose metadata or tensors are odd, for every command that reads one
    *[(f"ckpt-{case}-{module}", odd_run(case), module, args, [ODD_PHRASES[case]])
      for case in ODD_PHRASES
      for module, args in (("generate", ["run", "--steps", "4"]),
                           ("export", ["run", "--format", "gguf", "--out", "o.gguf"]),
                           ("eval", ["run", "--data", "t.bin", "--backend", "sim"]),
                           ("train", ["--init-from", "run", "--run-dir", "new", "--backend", "sim"]),
                           ("bench", ["generate", "--model", "run", "--steps", "4", "--threads", "1"]))],
]


# --- a downloaded model folder, GGUF file or dataset is untrusted input (issue 43) --------------------------------

def chat_folder(edit=lambda f: None, **kw):
    """A tiny Llama with a byte-level BPE tokenizer and a chat template (support/hf_folders.py) as hf/, then
    edit(hf/)."""
    def setup(tmp):
        from support.hf_folders import text_llama_folder
        text_llama_folder(tmp / "hf", **kw)
        edit(tmp / "hf")
    return setup


def template(text, where="tokenizer_config.json"):
    """chat_folder's with its chat template `text`, in tokenizer_config.json or chat_template.jinja."""
    def edit(folder):
        if where == "chat_template.jinja":
            write(folder / where, text)
        else:
            edit_json("tokenizer_config.json", chat_template=text)(folder)
    return chat_folder(edit)


def edit_tokenizer_json(**changes):
    def edit(folder):
        doc = json.loads((folder / "tokenizer.json").read_text())
        doc["model"].update(changes)
        doc["added_tokens"] = []
        (folder / "tokenizer.json").write_text(json.dumps(doc))
    return edit


def safetensors_header(folder, text):
    data = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text.encode() + data[8 + n:])


def gstr(s):
    return len(s.encode()).to_bytes(8, "little") + s.encode()


def raw_gguf(tensors, kvs, *kv_bytes):
    """The bytes of a GGUF v3 header claiming `tensors` tensors and `kvs` keys, followed by kv_bytes."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + b"".join(kv_bytes)


ARCH_KV = gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama")
# an array (9) of 3 arrays (9) of 2 uint8 (0): the shape that made gguf-py loop
NESTED_KV = gstr("x.nested") + struct.pack("<IIQ", 9, 9, 3) + struct.pack("<IQ2B", 0, 2, 1, 2) * 3


def gguf_file(name, data):
    return lambda tmp: (tmp / name).write_bytes(data)


def gguf_with(**keys):
    """The finished run exported as m.gguf with its tokenizer keys changed (gguf.llama_keys'), as a file from
    elsewhere may hold them."""
    def setup(tmp):
        from anectypes.formats import gguf
        model, keys_of = sources.resolve(RUNS["finished"], text=True), gguf.llama_keys
        gguf.llama_keys = lambda tok, T: {**keys_of(tok, T), **keys}
        try:
            gguf.write(model, tmp / "m.gguf")
        finally:
            gguf.llama_keys = keys_of
    return setup


def other_tokenizer(tmp):
    from support.hf_folders import text_tokenizer_folder
    text_tokenizer_folder(tmp / "other", vocab=300)


def fifo(name):
    return lambda tmp: os.mkfifo(tmp / name)


CHAT = ["hf", "--chat", "--prompt", "hi", "--steps", "8"]
INIT = ["--init-from", "hf", "--run-dir", "new", "--backend", "sim"]
CHAT_ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "%s"}]}'
DEEP_JSON = "[" * 100_000 + "]" * 100_000
LIMIT = "its chat template went over the"       # its time, memory or output limit, whichever it reaches first
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
# (id, setup, module, args, words): each run within UNTRUSTED_SECONDS and UNTRUSTED_MEMORY
UNTRUSTED = [
    # chat templates: time, output, memory, recursion and the template's own errors, each one line naming the file
    *[(f"template-{case}", template(text, where), "generate", CHAT, [f"hf/{where}", *words])
      for case, text, where, words in (
          ("nested-loops", NESTED_LOOPS, "tokenizer_config.json", ["over the time limit (2 s)"]),
          ("nested-loops-jinja-file", NESTED_LOOPS, "chat_template.jinja", ["over the time limit (2 s)"]),
          ("lipsum-huge", "{{ lipsum(1000000, False, 20, 100000) }}", "tokenizer_config.json",
           ["over the time limit"]),
          ("string-times-1e7", "{{ 'x' * 10000000 }}", "tokenizer_config.json",
           ["over the output limit (4,194,304 characters)"]),
          ("string-times-1e8", "{{ 'x' * 100000000 }}", "tokenizer_config.json", [LIMIT]),
          ("string-times-1e10", "{{ 'x' * 10000000000 }}", "tokenizer_config.json",
           ["over the memory limit (1024 MiB)"]),
          ("format-width", "{{ '%2000000000d' % 1 }}", "tokenizer_config.json", [LIMIT]),
          ("format-method-width", "{{ '{:2000000000}'.format(1) }}", "tokenizer_config.json", [LIMIT]),
          ("join-growth", "{{ (['x' * 1000000] * 2000) | join }}", "tokenizer_config.json", [LIMIT]),
          ("strftime-growth", "{{ strftime_now('%c' * 10000000) }}", "tokenizer_config.json", [LIMIT]),
          ("divides-by-zero", "{{ 1 / 0 }}", "tokenizer_config.json",
           ["refused the conversation: ZeroDivisionError"]),
          ("recurses", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "tokenizer_config.json",
           ["recursed past Python's recursion limit"]),
          ("nests-its-parser", "{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "chat_template.jinja",
           ["nests too deep to parse"]),
          ("reads-a-file", "{% include '/etc/passwd' %}", "tokenizer_config.json",
           ["refused the conversation", "no loader"]),
          ("reads-the-environment", "{{ cycler.__init__.__globals__.os.environ }}", "tokenizer_config.json",
           ["refused the conversation", "unsafe"]),
          ("reaches-python-objects", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "tokenizer_config.json",
           ["refused the conversation", "unsafe"]))],
    # JSON from a folder: depth, size and the type of each field
    *[(f"hf-{case}-{module}", folder(edit), module, args, words)
      for case, folder, edit, words in (
          ("config-deep", arch_folder, lambda f: write(f / "config.json", DEEP_JSON),
           ["hf/config.json: JSON nested deeper than"]),
          ("architectures-a-dict", arch_folder, edit_json("config.json", architectures={"Llama": 1}),
           ["a {'Llama': 1} model; only LlamaForCausalLM"]),
          ("architectures-nested-list", arch_folder, edit_json("config.json", architectures=[["Qwen3ForCausalLM"]]),
           ["a ['Qwen3ForCausalLM'] model; only"]),
          ("model-type-a-dict", arch_folder, edit_json("config.json", architectures=None, model_type={"a": 1}),
           ["a {'a': 1} model; only"]),
          ("config-a-fifo", arch_folder, lambda f: [(f / "config.json").unlink(), os.mkfifo(f / "config.json")],
           ["hf/config.json: not a regular file"]),
          ("index-deep", arch_folder, lambda f: write(f / "model.safetensors.index.json", DEEP_JSON),
           ["hf/model.safetensors.index.json: JSON nested deeper than"]),
          ("safetensors-header-deep", chat_folder, lambda f: safetensors_header(f, DEEP_JSON),
           ["hf/model.safetensors: its header: JSON nested deeper than"]),
          ("safetensors-float-offsets", chat_folder, edit_safetensors_embed(data_offsets=[0.0, 51200.0]),
           ["data_offsets [0.0, 51200.0] are not two byte offsets"]),
          ("tokenizer-config-deep", chat_folder, lambda f: write(f / "tokenizer_config.json", DEEP_JSON),
           ["hf/tokenizer_config.json: JSON nested deeper than"]),
          ("tokenizer-empty-vocabulary", chat_folder, edit_tokenizer_json(vocab={}, merges=[]),
           ["hf/tokenizer.json: its vocabulary is empty"]))
      for module, args in (("generate", ["hf", "--steps", "4"]), ("train", INIT))],
    # text data: a row nested deep, lone surrogates, bytes that are not UTF-8 (each naming its line)
    *[(f"data-{case}", both(chat_folder(), lambda tmp, name=name, text=text: (tmp / name).write_bytes(text)),
       "train", [*INIT, "--data", name], [f"{name}, line 2", *words])
      for case, name, text, words in (
          ("jsonl-row-deep", "rows.jsonl", b'{"text": "a"}\n' + DEEP_JSON.encode(), ["JSON nested deeper than"]),
          ("jsonl-text-lone-surrogate", "rows.jsonl", b'{"text": "a"}\n{"text": "a\\ud800b"}',
           ["lone surrogate \\ud800"]),
          ("jsonl-chat-lone-surrogate", "rows.jsonl",
           (CHAT_ROW % "ok" + "\n" + CHAT_ROW % "\\udfff").encode(), ["lone surrogate \\udfff"]),
          ("txt-not-utf8", "t.txt", b"one line\ntwo \xff\n", ["not UTF-8 text (byte 13)"]))],
    ("prompt-not-utf8-for-a-hf-tokenizer", chat_folder(), "generate", ["hf", "--prompt", os.fsdecode(b"caf\xe9")],
     ["the text: holds the lone surrogate \\udce9"]),
    # what a path is: only regular files are read
    ("init-from-a-fifo", fifo("fifo"), "train", ["--init-from", "fifo", "--run-dir", "new"],
     ["fifo: not a regular file"]),
    ("generate-a-fifo", fifo("fifo"), "generate", ["fifo"], ["fifo: not a regular file"]),
    ("export-a-fifo", fifo("fifo"), "export", ["fifo", "--format", "hf", "--out", "o"], ["fifo: not a regular file"]),
    ("tokenizer-a-fifo", both(chat_folder(), fifo("fifo")), "generate", ["hf", "--tokenizer", "fifo"],
     ["fifo: not a regular file"]),
    ("generate-a-device", None, "generate", ["/dev/zero"], ["/dev/zero: not a regular file"]),
    ("init-from-a-socket", lambda tmp: socket.socket(socket.AF_UNIX).bind(str(tmp / "sock")), "train",
     ["--init-from", "sock", "--run-dir", "new"], ["sock: cannot read (No such device or address)"]),
    # GGUF metadata: refused before gguf-py allocates or loops for it
    ("gguf-array-of-arrays", gguf_file("m.gguf", raw_gguf(0, 2, ARCH_KV, NESTED_KV)), "generate", ["m.gguf"],
     ["m.gguf: its metadata x.nested is an array of arrays"]),
    ("gguf-2e60-keys", gguf_file("m.gguf", raw_gguf(0, 2**60)), "generate", ["m.gguf"],
     ["a count of 1,152,921,504,606,846,976 metadata keys", "beyond its end"]),
    ("gguf-2e60-tensors", gguf_file("m.gguf", raw_gguf(2**60, 1, ARCH_KV)), "export",
     ["m.gguf", "--format", "hf", "--out", "o"], ["a count of 1,152,921,504,606,846,976 tensors"]),
    ("gguf-tensor-of-9-dimensions", gguf_file("m.gguf", raw_gguf(1, 1, ARCH_KV, gstr("t") + struct.pack("<I", 9))),
     "generate", ["m.gguf"], ["m.gguf: tensor t claims 9 dimensions; GGUF's tensors have at most 4"]),
    ("gguf-string-beyond-the-file", gguf_file("m.gguf", raw_gguf(0, 1, gstr("general.architecture")[:8] + b"llama")),
     "generate", ["m.gguf"], ["a metadata key claims 20 bytes", "beyond its end"]),
    *[(f"gguf-{which}-outside-the-vocabulary-{module}", gguf_with(**{f"{which}_token_id": 5000}), module, args,
       [f"m.gguf: its tokenizer.ggml.{which}_token_id 5000 lies outside its 1024 tokens"])
      for which in ("bos", "eos")
      for module, args in (("generate", ["m.gguf"]), ("train", ["--init-from", "m.gguf", "--run-dir", "new"]))],
    # flags a folder makes wrong
    ("lora-targets-twice", chat_folder(), "train", [*INIT, "--lora", "4", "--lora-targets", "q,v,q"],
     ["--lora-targets q,v,q: q named twice"]),
    ("seq-beyond-max-position-embeddings", chat_folder(), "train", [*INIT, "--seq", "128"],
     ["--seq 128 is beyond the context --init-from", "hf was trained for (64, its max_position_embeddings"]),
    *[(f"tokenizer-of-another-vocabulary-{module}", both(chat_folder(), other_tokenizer), module, args,
       ["the tokenizer has another vocabulary (300 tokens) than", "hf's own (400)", "--tokenizer", "other would"])
      for module, args in (("generate", ["hf", "--tokenizer", "other", "--steps", "4"]),
                           ("train", [*INIT, "--tokenizer", "other"]))],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, builtin_cache):
    base = tmp_path_factory.mktemp("runs")
    assert main(["--scratch", "--run-dir", str(base / "finished"), "--steps", "8", "--accum", "2", *FAST]) == 0
    assert main(["--scratch", "--run-dir", str(base / "stopped"), "--steps", "8", "--accum", "2",
                 "--stop-after", "4", *FAST]) == 0
    RUNS.update(finished=base / "finished", stopped=base / "stopped")


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def run_case(tmp_path, case, **limits):
    _, setup, module, args, words = case
    if setup:
        setup(tmp_path)
    before = tree(tmp_path)
    r = subprocess.run([sys.executable, "-m", f"anectypes.{module}", *args], cwd=tmp_path, capture_output=True,
                       text=True, **{"timeout": 300, **limits})
    one_line_error(r, *words)
    assert len(r.stderr) < 1000                               # nothing long is quoted back
    assert tree(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_error_line_and_changes_nothing(tmp_path, runs, case):
    run_case(tmp_path, case)


UNTRUSTED_SECONDS = 30          # a safety bound: these hung for minutes, or grew to gigabytes, before issue 43
UNTRUSTED_MEMORY = 3 << 30      # the command's address space (its sandbox's is a third of it)


def bounded():
    resource.setrlimit(resource.RLIMIT_AS, (UNTRUSTED_MEMORY, UNTRUSTED_MEMORY))


@pytest.mark.slow
@pytest.mark.parametrize("case", UNTRUSTED, ids=[c[0] for c in UNTRUSTED])
def test_untrusted_input_is_one_error_line_within_bounds(tmp_path, runs, case):
    run_case(tmp_path, case, timeout=UNTRUSTED_SECONDS, preexec_fn=bounded)


def test_a_gguf_claiming_a_huge_context_is_read_at_ours_within_bounds(tmp_path, runs):
    """context_length 10^9 built RoPE tables of 10^9 positions (a MemoryError): the model is read with the
    context anectypes gives a file (hf.MAX_CONTEXT), which sizes the tables and the decoder's buffers."""
    from anectypes.formats import gguf
    model = sources.resolve(RUNS["finished"], text=True)
    model.cfg = replace(model.cfg, seq=10**9)
    gguf.write(model, tmp_path / "m.gguf")
    read = sources.resolve(tmp_path / "m.gguf")
    assert (read.cfg.seq, read.context) == (MAX_CONTEXT, 10**9)
    r = subprocess.run([sys.executable, "-m", "anectypes.generate", "m.gguf", "--steps", "8", "--temperature", "0"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=UNTRUSTED_SECONDS, preexec_fn=bounded)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def mount(tmp_path):
    """Mount a tmpfs of the given size (MB) and options at a fresh folder; unmounted afterwards."""
    points = []

    def make(size_mb, options=""):
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m{options}", "tmpfs", str(point)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root is needed; CI runs as root): {r.stderr.strip()}")
        points.append(point)
        return point
    yield make
    for point in points:
        subprocess.run(["umount", str(point)], check=True)


def test_a_full_disk_is_one_line_and_the_last_checkpoint_survives(mount):
    disk = mount(5)                 # room for best + latest (2 MB each) and part of the next checkpoint
    run = disk / "run"
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(run), "--steps", "40",
                        "--accum", "2", "--save-every", "1", *FAST], cwd=ROOT, capture_output=True, text=True)
    one_line_error(r, "disk full", "the last checkpoint is kept", "--resume")
    ckpt = load_checkpoint(run / "checkpoints" / "latest.ckpt")          # whole and readable
    assert ckpt.state["step"] > 0 and not list(run.rglob(".*.tmp"))


def test_a_disk_full_before_the_first_checkpoint_says_so_and_resume_starts_the_run_again(mount):
    disk = mount(1)                 # less than a checkpoint (2 MB): the first one fails
    run = disk / "run"
    args = ["--run-dir", str(run), "--steps", "8", "--accum", "2", "--save-every", "1", *FAST]
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", *args], cwd=ROOT, capture_output=True,
                       text=True)
    one_line_error(r, "disk full before the run's first checkpoint", "start it again with --resume")
    assert "is kept" not in r.stderr and not (run / "checkpoints" / "latest.ckpt").exists()
    subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)      # space freed
    assert main(["--resume", "--run-dir", str(run)]) == 0
    assert load_checkpoint(run / "checkpoints" / "latest.ckpt").state["step"] == 8


def test_a_read_only_run_folder_is_one_line_and_untouched(mount):
    disk = mount(20)
    run = disk / "run"
    assert main(["--scratch", "--run-dir", str(run), "--steps", "8", "--accum", "2", "--stop-after", "4", *FAST]) == 0
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    before = tree(disk)
    for args in (["--resume", "--run-dir", str(run)], ["--scratch", "--run-dir", str(disk / "new")]):
        r = subprocess.run([sys.executable, "-m", "anectypes.train", *args, *FAST], cwd=ROOT, capture_output=True,
                           text=True)
        one_line_error(r, "Read-only file system", "must be writable")
    assert tree(disk) == before


def export_cmd(fmt, out):
    return [sys.executable, "-m", "anectypes.export", str(RUNS["finished"]), "--format", fmt, "--out", str(out)]


def free_bytes(folder):
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("fmt", ["llama2c", "hf", "gguf"])
def test_an_export_to_a_full_disk_is_one_line_naming_out_and_leaves_nothing(mount, runs, fmt):
    """With room for half the export, and for all of it but one page: one line naming --out (hf's was a
    19-line SafetensorError, or tokenizers' bare Exception), no file left but the filler."""
    disk = mount(4)
    name = "m.gguf" if fmt == "gguf" else "m"
    assert subprocess.run(export_cmd(fmt, disk / name), capture_output=True).returncode == 0
    need = free_bytes(disk)                                  # the pages the export takes, measured on the disk
    subprocess.run(["rm", "-r", str(disk / name)], check=True)
    need = free_bytes(disk) - need
    for room in (need // 2, need - 4096):
        (disk / "filler").write_bytes(b"\0" * (free_bytes(disk) - room))
        before = tree(disk)
        r = subprocess.run(export_cmd(fmt, disk / name), capture_output=True, text=True)
        one_line_error(r, f"cannot write {disk / name}: ")
        assert "No space left on device" in r.stderr or "is the disk full?" in r.stderr, r.stderr
        assert tree(disk) == before
        (disk / "filler").unlink()


def test_exports_and_bench_write_to_a_read_only_folder_are_one_line_and_untouched(mount, runs):
    disk = mount(5)
    write(disk / "keep.txt", "kept")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    before = tree(disk)
    for cmd, words in [*[(export_cmd(fmt, disk / name), [f"cannot write {disk / name}: Read-only file system"])
                         for fmt, name in (("llama2c", "m"), ("hf", "m"), ("gguf", "m.gguf"))],
                       ([sys.executable, "-m", "anectypes.bench", "generate", "--model", "tiny", "--steps", "4",
                         "--threads", "1", "--write", str(disk)],
                        [f"--write {disk}: {disk / 'model.bin'}: Read-only file system"])]:
        one_line_error(subprocess.run(cmd, capture_output=True, text=True), *words)
    assert tree(disk) == before


def test_every_flag_has_help_and_shows_its_default():
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="200"))
    options = r.stdout.split("options:\n", 1)[1]
    blocks = re.split(r"\n(?=  -)", options.strip("\n"))        # one block per option, with its wrapped help
    assert len(blocks) >= 22
    for block in blocks:
        flag = block.split()[0].rstrip(",")
        if flag not in ("-h", "--scratch", "--resume"):
            assert re.search(r"\S.*\(default: [^)]+\)", " ".join(block.split()[1:])), block


@pytest.mark.parametrize("argv", [["anectypes.doctor", "--reps", "1"],
                                  ["anectypes.mil", "check", str(ROOT / "anectypes/mil/examples/dynamic_matmul.mil")],
                                  ["anectypes.bench", "generate", "--model", "tiny", "--steps", "4", "--threads", "1"]])
def test_a_closed_stdout_ends_a_command_quietly(argv):
    """`python -m ... | head`: the reader goes away before the first write; the command stops with
    exit 141, as a program killed by SIGPIPE would, with no error or traceback on stderr (mil check's
    warnings about its file go there as usual)."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    proc.stdout.close()
    assert proc.wait(120) == 141
    assert all(line.startswith(b"warning: ") for line in proc.stderr.read().splitlines())
