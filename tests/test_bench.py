"""python -m anectypes.bench: the programs compute what they claim, the FLOP counts are right and every
subcommand's --json validates against tools/bench_schema.json. Correctness only, never speed.

References are float64 numpy written here from the definitions (conv = W·x per position; quantize =
clip(round half to even(x / scale)); dequantize and constexpr_affine_dequantize = (q - zero_point)·scale).
"""

import builtins
import re
import subprocess
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from jsonschema import validate

from anectypes.bench import cli, gemm, int8, peak, train
from anectypes.bench.timing import measure
from anectypes.bench.torch_model import torch_inputs, torch_loss
from anectypes.device import open_device
from anectypes.mil import parse
from anectypes.model.config import PRESETS
from anectypes.model.flops import step_flops

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tools" / "bench_schema.json").read_text())


# ------------------------------------------------------------------ the peak program

def conv_chain_ref(weights, x):
    """float64: y = W_N ··· W_1 x over each position of x [1, C, 1, S]."""
    h = np.asarray(x, np.float64)[0, :, 0, :]
    for w in weights:
        h = np.asarray(w, np.float64) @ h
    return h


def program_flops(builder):
    """2·OC·IC·S summed over the conv ops of the parsed program (independent of chain_flops)."""
    total = 0
    for op in parse(builder.text()).main.ops:
        if op.type == "conv":
            oc, ic = op.args["weight"].type.shape[:2]
            total += 2 * oc * ic * op.out.type.shape[-1] * op.out.type.shape[-2]
    return total


@pytest.mark.parametrize("depth,channels,spatial", [(1, 64, 16), (3, 64, 32), (128, 512, 64)])
def test_flop_counts(depth, channels, spatial):
    assert peak.chain_flops(depth, channels, spatial) == 2 * depth * channels ** 2 * spatial
    if depth * channels <= 192:       # building the full-size program only to count would be slow
        w = np.zeros((depth, channels, channels), np.float16)
        assert program_flops(peak.peak_program(w, spatial)) == peak.chain_flops(depth, channels, spatial)


def test_peak_program_is_one_blobfile_of_n_chunks():
    depth, c = 5, 64
    b = peak.peak_program(peak.peak_weights(depth, c, np.random.default_rng(0)), 16)
    (path, blob), = b.weights().items()
    assert path == "@model_path/weights/weights.bin"
    assert int.from_bytes(blob[:4], "little") == depth                      # chunk count
    chunk = 64 + 2 * c * c
    text = b.text()
    for k in range(depth):
        assert f"offset = uint64({64 + k * chunk})" in text                  # the reference's layout (§2.2)
    assert text.count(" = conv(") == depth and "tensor<fp16, [1, 64, 1, 16]> x" in text


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_peak_output_equals_float64_reference(precision):
    depth, c, s = 4, 64, 24
    rng = np.random.default_rng(1)
    w = peak.peak_weights(depth, c, rng)
    x = peak.chain_input(c, s, rng)
    out, times, _ = measure(open_device("sim", precision=precision), peak.peak_program(w, s), x, 2, 1)
    assert len(times) == 2 and out.shape == (1, c, 1, s)
    ref = conv_chain_ref(w, x)
    mag = np.abs(ref).max()
    assert 0.1 < mag < 100                                                   # the chain neither explodes nor dies
    if precision == "fp32":     # fp32 accumulation of 64-term sums, 4 layers deep
        np.testing.assert_allclose(out[0, :, 0, :], ref, rtol=1e-5, atol=1e-5 * mag)
    else:                       # every layer's result is rounded to fp16 (2^-11 relative), errors add up
        assert np.abs(out[0, :, 0, :] - ref).max() <= 2 * depth * 2.0 ** -11 * mag
        assert np.array_equal(out, out.astype(np.float16))                   # the output is fp16 data


# ------------------------------------------------------------------ the int8 chain

def int8_chain_ref(q, w_scale, zero_point, a_scale, x):
    """float64 W8A8: W = (q - zp)·w_scale; between convs a = clip(rint(y / a_scale), -128, 127)·a_scale.
    Returns (output, number of clipped activations, number of exact .5 ties)."""
    h = np.asarray(x, np.float64)[0, :, 0, :]
    clipped = ties = 0
    for i in range(len(q)):
        y = ((q[i].astype(np.float64) - zero_point) * w_scale) @ h
        if i == len(q) - 1:
            return y, clipped, ties
        t = y / a_scale
        ties += int(np.sum(t - np.floor(t) == 0.5))
        r = np.rint(t)                                                        # half to even, like numpy
        clipped += int(np.sum((r < -128) | (r > 127)))
        h = np.clip(r, -128, 127) * a_scale


def int8_case(precision, rng):
    """Data for which every intermediate is exact in the precision, so the output must match exactly:
    activations are k·a_scale (k integer), weights (q - zp)·w_scale, both powers of two, and the
    conv's integer sums stay below 2^24 (fp32) or 2^11 (fp16: 16 channels, |q - zp| <= 1)."""
    if precision == "fp32":
        depth, c, s, zp, spread, w_scale = 4, 64, 16, 5, 20, 2.0 ** -6
    else:
        depth, c, s, zp, spread, w_scale = 4, 16, 32, 3, 1, 2.0 ** -2
    q = rng.integers(zp - spread, zp + spread, (depth, c, c), endpoint=True).astype(np.int8)
    x = (rng.integers(-128, 127, (1, c, 1, s), endpoint=True) * int8.ACT_SCALE).astype(np.float16)
    return q, w_scale, zp, x


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_int8_output_equals_float64_reference(precision):
    q, w_scale, zp, x = int8_case(precision, np.random.default_rng(2))
    b = int8.int8_program(q, x.shape[-1], w_scale, int8.ACT_SCALE, zp)
    text = b.text()
    depth = len(q)
    assert text.count("constexpr_affine_dequantize(") == depth and text.count(" = conv(") == depth
    assert text.count(" = quantize(") == depth - 1 and text.count(" = dequantize(") == depth - 1
    (_, blob), = b.weights().items()
    assert int.from_bytes(blob[:4], "little") == depth                      # one BLOBFILE, int8 chunks
    assert len(blob) == 64 + depth * (64 + q[0].size)
    out, _, _ = measure(open_device("sim", precision=precision), b, x, 1, 0)
    ref, clipped, ties = int8_chain_ref(q, w_scale, zp, int8.ACT_SCALE, x)
    assert clipped > 0 and ties > 0                                         # both edge cases are exercised
    np.testing.assert_array_equal(out[0, :, 0, :], ref)


def test_int8_weights_keep_the_chain_stable():
    rng = np.random.default_rng(3)
    for c in (64, 256, 512):
        q, scale = int8.int8_weights(4, c, rng)
        assert q.dtype == np.int8 and np.log2(scale).is_integer()
        assert np.var(q.astype(np.float64) * scale) == pytest.approx(1 / c, rel=0.1)


# ------------------------------------------------------------------ --json of every subcommand

def run_json(capsys, *argv):
    assert cli.main([*argv, "--backend", "sim", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out                                                # ONE JSON object
    r = json.loads(out[0])
    validate(r, SCHEMA)
    assert r["system"]["backend"] == "sim" and r["summary"]["note"] == "simulator figures"
    return r


def test_peak_json(capsys, monkeypatch):
    r = run_json(capsys, "peak", "--depth", "3", "--channels", "64", "--spatial", "16", "--reps", "3", "--warmup", "1")
    run, = r["benchmarks"]["peak"]["runs"]
    assert run["flops"] == 2 * 3 * 64 * 64 * 16 and run["finite"] and len(run["ms_all"]) == 3
    assert run["tflops"] == pytest.approx(run["flops"] / run["ms_median"] / 1e9)
    assert r["summary"]["peak_tflops"] == run["tflops"] and r["system"]["precision"] == "fp16"
    monkeypatch.setattr(peak, "SWEEP", [(2, 64, 16), (1, 128, 8)])
    r = run_json(capsys, "peak", "--sweep", "--reps", "1", "--warmup", "0", "--precision", "fp32")
    runs = r["benchmarks"]["peak"]["runs"]
    assert [(x["depth"], x["channels"], x["spatial"]) for x in runs] == [(2, 64, 16), (1, 128, 8)]
    assert r["summary"]["peak_tflops"] == max(x["tflops"] for x in runs)


def test_int8_json(capsys):
    r = run_json(capsys, "int8", "--depth", "3", "--channels", "64", "--spatial", "16", "--reps", "2")
    b = r["benchmarks"]["int8"]
    assert b["flops"] == 2 * 3 * 64 * 64 * 16 and b["fp16"]["finite"] and b["int8"]["finite"]
    assert b["speedup"] == pytest.approx(b["fp16"]["ms_median"] / b["int8"]["ms_median"])
    assert b["int8"]["weight_mb"] * 2 == b["fp16"]["weight_mb"]


def test_dispatch_json(capsys):
    r = run_json(capsys, "dispatch", "--reps", "5", "--warmup", "1")
    d = r["benchmarks"]["dispatch"]
    assert len(d["ms_all"]) == 5 and d["ms_min"] <= d["ms_median"] <= d["ms_p99"]
    assert r["summary"]["dispatch_ms_median"] == d["ms_median"]


def test_gemm_json(capsys):
    assert cli.main(["gemm", "--ic", "64", "--seq", "16", "--oc", "32", "--reps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    validate(r, SCHEMA)
    g = r["benchmarks"]["gemm"]
    assert r["system"]["backend"] == "sim" and g["note"] == "simulator figures" and g["flops"] == 2 * 64 * 16 * 32
    runs = g["runs"]
    assert runs["simulator fp32"]["max_rel_err"] < 1e-6 and runs["simulator fp16"]["max_rel_err"] < 2e-3
    for x in runs.values():
        assert x["gflops"] == pytest.approx(g["flops"] / x["ms_median"] / 1e6)
        assert x["vs_numpy"] == pytest.approx(x["ms_median"] / runs["numpy.matmul fp32"]["ms_median"])
    assert r["summary"]["simulator_vs_numpy"]["fp16"] == runs["simulator fp16"]["vs_numpy"]


def test_gemm_table_keeps_its_columns(capsys):
    assert cli.main(["gemm", "--ic", "64", "--seq", "16", "--oc", "32", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SIMULATOR figures")
    assert lines[2] == f"{'':22s}{'ms':>9s}{'GFLOP/s':>10s}{'vs numpy':>10s}{'max rel err':>13s}"
    assert [x[:22].strip() for x in lines[3:]] == ["numpy.matmul fp32", "simulator fp32", "simulator fp16"]
    assert all(re.fullmatch(r".{22} *[\d.]+ *[\d.]+ *[\d.]+x *[\d.]+e[-+]\d+", x) for x in lines[3:]), lines


def hide_torch(monkeypatch):
    """Make `import torch` fail as if PyTorch were not installed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    real = builtins.__import__

    def fake(name, *args, **kw):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", fake)


@pytest.mark.slow
def test_train_json(capsys, monkeypatch):
    hide_torch(monkeypatch)
    r = run_json(capsys, "train", "--model", "tiny", "--steps", "2", "--warmup", "0", "--compare", "torch")
    t = r["benchmarks"]["train"]
    assert t["flops_total"] == step_flops(PRESETS["tiny"], t["n_active"])["total"]
    assert set(t["precisions"]) == {"fp16", "fp32"} and r["system"]["precision"] == "both"
    for p in t["precisions"].values():
        assert p["gflops"] == pytest.approx(t["flops_total"] / p["ms_fwdbwd_median"] / 1e6)
        assert p["mfu"] == pytest.approx(p["gflops"] / t["sgemm_peak_gflops"])
        assert len(p["ms_update_all"]) == 2 and p["ms_update_median"] > 0
        assert all(v <= p["ms_fwdbwd_median"] * (1 + 1e-9) for v in p["breakdown_ms"].values())
    assert t["compare"]["torch"]["available"] is False
    assert r["summary"]["ratio_vs_torch"] is None


def test_pooled_host_time_is_each_steps_remainder():
    """"cpu" is the median of each step's total minus its timed parts, not the median step minus the
    parts' medians (here 11 ms, from steps that are not alike)."""
    def step(total, ev):
        return dict(total=total, eval=ev, io=0.5, cls=0.0, dw_wait=0.0)
    rounds = [dict(samples=[step(10, 8.5), step(20, 0.5)], ms_update_all=[1.0], rss_mb=10, flops_total=2e6,
                   memory_theoretical_mb=5, update_bytes=3 * 10**6),
              dict(samples=[step(30, 24.5)], ms_update_all=[2.0], rss_mb=12, flops_total=2e6, memory_theoretical_mb=5,
                   update_bytes=3 * 10**6)]
    r = train.pooled(rounds)
    assert r["ms_fwdbwd_median"] == 20 and r["breakdown_ms"]["eval"] == 8.5
    assert r["breakdown_ms"]["cpu"] == 5.0                      # remainders 1, 19 and 5
    assert r["rss_mb"] == 12 and r["ms_update_median"] == 1.5 and r["gflops"] == pytest.approx(0.1)
    assert r["update_gbs"] == pytest.approx(2.0)                 # 3 MB in 1.5 ms


@pytest.mark.slow
def test_train_rounds_pool_their_steps(capsys):
    """--rounds 2: each precision runs twice in turn; the figures are over the pooled steps."""
    r = run_json(capsys, "train", "--model", "tiny", "--steps", "2", "--warmup", "0", "--rounds", "2",
                 "--precision", "fp32")
    t = r["benchmarks"]["train"]
    p = t["precisions"]["fp32"]
    assert t["rounds"] == 2 and t["steps"] == 2
    assert len(p["ms_fwdbwd_all"]) == len(p["ms_update_all"]) == 4
    assert p["ms_fwdbwd_median"] == pytest.approx(float(np.median(p["ms_fwdbwd_all"])))
    assert p["gflops"] == pytest.approx(t["flops_total"] / p["ms_fwdbwd_median"] / 1e6)


@pytest.mark.slow
def test_compare_torch_without_pytorch(capsys, monkeypatch):
    hide_torch(monkeypatch)
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--warmup", "0", "--precision", "fp32",
                       "--backend", "sim", "--compare", "torch"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATOR figures" in out.splitlines()[0]
    line, = [x for x in out.splitlines() if "torch" in x.lower()]
    assert line.startswith("--compare torch: PyTorch not installed")


@pytest.mark.slow
@pytest.mark.parametrize("n_active", [100, 128])
@pytest.mark.parametrize("arch", [{}, dict(qk_norm=True, rope_type="llama3", rope_original_context=16, tied=False,
                                           residual_scaled=False)], ids=["llama", "qknorm-llama3-untied"])
def test_torch_model_matches_the_simulator(n_active, arch):
    """The --compare torch model is the anectypes model: same loss and gradients as fp32 simulation,
    with a compact vocabulary and with the full one (where it uses the embedding without a gather)."""
    torch = pytest.importorskip("torch")
    from dataclasses import replace
    from anectypes.model.config import init_params
    from anectypes.model.transformer import Transformer
    cfg = replace(PRESETS["tiny"], kv_heads=2, seq=32, vocab=128, **arch)         # GQA
    rng = np.random.default_rng(4)
    params = init_params(cfg, rng)
    active = np.sort(rng.choice(cfg.vocab, n_active, replace=False))
    tokens, targets = rng.choice(active, cfg.seq), rng.choice(active, cfg.seq)
    model = Transformer(cfg, open_device("sim", precision="fp32"), {k: v.copy() for k, v in params.items()}, active)
    try:
        loss = model.forward_backward(tokens, targets)
        model.wait()
        grads = {k: g.copy() for k, g in model.grads.items()}
    finally:
        model.close()
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    compact = np.full(cfg.vocab, -1)
    compact[active] = np.arange(len(active))
    lt = torch_loss(torch, cfg, p, torch.tensor(active), torch.tensor(tokens), torch.tensor(compact[targets]),
                    *torch_inputs(torch, cfg))
    lt.backward()
    assert lt.item() == pytest.approx(loss, rel=1e-5)
    for k, g in grads.items():
        tg = p[k].grad.numpy()
        assert np.abs(tg - g).max() <= 1e-4 * np.abs(tg).max(), k


def test_ane_figures_are_labelled_as_such(capsys, fake_ane):
    """On the ANE backend (here tests/support/fake_ane.py's checking fake classes on the GNU runtime) the report
    says "ANE figures", names the chip by its aneSubType and keeps to the private API contract."""
    assert cli.main(["dispatch", "--reps", "3", "--backend", "ane", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    validate(r, SCHEMA)
    assert r["system"]["backend"] == "ane" and r["system"]["chip"] == "h16"
    assert r["summary"]["note"] == r["benchmarks"]["dispatch"]["note"] == "ANE figures"
    assert cli.main(["int8", "--depth", "2", "--channels", "64", "--spatial", "16", "--reps", "1",
                     "--backend", "ane"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ANE figures (chip h16)") and "SIMULATOR" not in out
    assert fake_ane.violations == []


def test_n_params_is_the_parameters_shapes_counted_without_listing_them():
    """n_params (which every size check uses) is arithmetic: a model file claiming 10^9 layers made
    bench train --model FILE list 9·10^9 shapes, for minutes, before its memory check."""
    import math

    from anectypes.model.config import PRESETS, ModelConfig, param_shapes
    gqa = ModelConfig(dim=48, hidden=100, heads=6, kv_heads=2, head_dim=12, layers=3, seq=16, vocab=77)
    for cfg in [*PRESETS.values(), gqa]:
        assert cfg.n_params() == sum(math.prod(s) for s in param_shapes(cfg).values())


def test_memory_footprint_counts_what_training_holds():
    """The theoretical footprint the train benchmark reports, against a count from the config."""
    import numpy as np
    from anectypes.bench.train import footprint_mb
    from anectypes.device import open_device
    from anectypes.model.config import PRESETS, init_params
    from anectypes.model.kernels import KERNELS
    from anectypes.model.transformer import OWN_OUTPUT, Transformer
    from anectypes.train.optim import AdamW
    cfg = PRESETS["tiny"]
    model = Transformer(cfg, open_device("sim", precision="fp16"), init_params(cfg, np.random.default_rng(0)),
                        np.arange(cfg.vocab))
    try:
        model.forward_backward(np.arange(cfg.seq), np.arange(cfg.seq))
        weights = 4 * cfg.n_params() * 4                     # params, grads, m, v in float32
        # nothing is saved on the CPU: the saved tensors are views of the layers' own output surfaces
        saved = 0
        kernels = {n: f(cfg) for n, f in KERNELS.items()}
        # the simulator's surfaces, float32 memory: per layer the kernels' own input surfaces (the
        # attention-backward kernels have none), one output surface per layer or shared
        surfaces = sum(4 * (np.prod(k.out_shape) * (cfg.layers if n in OWN_OUTPUT else 1) +
                            sum(np.prod(k.in_shapes[x]) for x in k.own) * cfg.layers)
                       for n, k in kernels.items()) + \
            4 * (np.prod(kernels["qBwd"].out_shape) + np.prod(kernels["ffnFused"].out_shape))   # top, bottom
        want = (weights + saved + surfaces + cfg.vocab * cfg.seq * 4) / 2**20
        assert abs(footprint_mb(model, AdamW(model.params)) - want) < 1e-9
    finally:
        model.close()


@pytest.mark.slow
def test_compare_torch_leaves_torch_out_of_the_parent():
    """PyTorch is imported only in its own child process: the simulator's children start as forks of
    the parent, and Linux keeps a process's peak RSS across exec, so a parent holding PyTorch put
    its ~160 MB into every simulator child's reported peak."""
    code = ("import sys; from anectypes.bench.cli import main; "
            "assert main(['train', '--model', 'tiny', '--steps', '1', '--warmup', '0', '--precision', 'fp32', "
            "'--backend', 'sim', '--compare', 'torch', '--json']) == 0; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------------ sizes that cannot fit: one line, up front

@pytest.mark.parametrize("argv, flag", [
    (["peak", "--channels", "1000000000"], "--channels 1000000000"),
    (["peak", "--depth", "10000000000"], "--depth 10000000000"),
    (["peak", "--spatial", "1000000000000"], "--spatial 1000000000000"),
    (["int8", "--channels", "1000000"], "--channels 1000000"),
    (["dispatch", "--reps", "1000000000000"], "--reps 1000000000000"),
    (["train", "--model", "tiny", "--vocab", "1000000000000"], "--vocab 1000000000000"),
    (["gemm", "--ic", "10000000", "--oc", "10000000"], "--ic 10000000 --seq 256 --oc 10000000"),
], ids=["peak channels", "peak depth", "peak spatial", "int8 channels", "dispatch reps", "train vocab", "gemm ic oc"])
def test_sizes_that_cannot_fit_are_refused_up_front(capsys, monkeypatch, argv, flag):
    def started(*args):
        raise AssertionError("the benchmark started instead of refusing its flags")
    monkeypatch.setattr(cli, "open_device", started)
    monkeypatch.setattr(train, "in_fresh_process", started)
    monkeypatch.setattr(gemm, "run", started)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err
    assert re.search(r"needs? (at least|about) [\d,.]+ GiB .*but this machine has [\d,.]+ GiB", err[0]), err[0]


@pytest.mark.parametrize("argv, line", [
    (["peak", "--channels", "0"], "argument --channels: must be >= 1, got 0"),
    (["peak", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["train", "--accum", "0"], "argument --accum: must be >= 1, got 0"),        # was a ZeroDivisionError
    (["gemm", "--reps", "0"], "argument --reps: must be >= 1, got 0"),
])
def test_flags_out_of_range_are_one_error_line_naming_the_flag_and_its_bound(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {line} (see --help)"]
