"""The chip catalogue (anectypes/mil/limits.py, docs/ane-reference.md §3.10): for every rule, a program it
reports (as `error:` or `warning:`, with its source, on the chips it is about) and the nearest program it
does not; the simulator refuses at compile what the catalogue calls an error and logs each warning once;
`python -m anectypes.mil check --chip` prints them."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.device.protocol import surfaces
from anectypes.errors import AnectypesError, DeviceError, MILError
from anectypes.mil import Builder, limits, parse
from anectypes.mil.program import BlobRef, Operation, Var
from anectypes.mil.types import TensorType
from anectypes.model.chips import check_training, table
from anectypes.model.config import PRESETS

ROOT = Path(__file__).resolve().parent.parent


def text_of(build, dialect="ios18"):
    b = Builder(dialect)
    b.output(build(b))
    return b.text()


def rules(build, chip, dialect=None):
    """{rule: its first finding} that the catalogue reports for chip."""
    dialect = dialect or limits.CHIPS[chip][1]
    found = {}
    for x in limits.check(parse(text_of(build, dialect)), chip, requests=False):
        found.setdefault(x.rule, x)
    return found


def matmul(k):
    return lambda b: b.matmul(x=b.input("x", [1, 1, 64, k]), y=b.input("y", [1, 1, k, 64]))


def sdpa(mask):
    def build(b):
        q = b.input("q", [1, 2, 64, 64])
        extra = {"attn_mask": b.input("m", [1, 1, 64, 64])} if mask else {}
        return b.scaled_dot_product_attention(query=q, key=b.input("k", [1, 2, 64, 64]),
                                              value=b.input("v", [1, 2, 64, 64]), **extra)
    return build


def conv(channels=64, weight_input=False, groups=1, bias=False):
    def build(b):
        x = b.input("x", [1, channels, 1, 32])
        shape = (64, channels // groups, 1, 1)
        w = b.input("w", shape) if weight_input else b.const(np.ones(shape), "fp16", name="w")
        return b.conv(x=x, weight=w, groups=groups, **({"bias": b.const(np.ones(64), "fp16", name="b")} if bias
                                                         else {}))
    return build


def softmax(n):
    return lambda b: b.softmax(x=b.input("x", [1, 4, 64, n]), axis=-1)


def concat(b):
    return b.concat(values=[b.input("x", [1, 64, 1, 256]), b.input("y", [1, 64, 1, 256])], axis=1)


def reshape(b):
    return b.reshape(x=b.input("x", [1, 64, 1, 256]), shape=[1, 1, 64, 256])


def blobs(n):
    def build(b):
        y = b.input("x", [1, 64, 1, 256])
        for i in range(n):
            y = b.add(x=y, y=b.weight(np.full((1, 64, 1, 1), i), "w.bin", name=f"w{i}"))
        return y
    return build


def cast(b):
    return b.cast(x=b.input("x", [1, 64, 1, 256]), dtype="fp32")


def wide(n):
    """A reshape of n channels into a row n wide (its input's n channels are within every chip's cap)."""
    return lambda b: b.reshape(x=b.input("x", [1, n, 1, 1]), shape=[1, 1, 1, n])


def width_slice(axis):
    """A slice that begins at 64 along `axis` (3: the width, where M1/M2 clamp beyond ±4,094)."""
    begin = [0, 0, 0, 0]
    begin[axis] = 64
    return lambda b: b.slice_by_size(x=b.input("x", [1, 128, 1, 128]), begin=begin, size=[1, 64, 1, 64])


def weights_matmul(b):
    """Weights as an input (the training kernels' form) rather than a const."""
    return b.matmul(x=b.input("x", [1, 1, 64, 64]), y=b.const(np.ones((1, 1, 64, 64)), "fp16", name="w"))


def norm_blob(width):
    """x·w with a BLOBFILE weight w [1,64,1,1], as RMSNorm's weight baked in, over x `width` wide."""
    return lambda b: b.mul(x=b.input("x", [1, 64, 1, width]), y=b.weight(np.ones((1, 64, 1, 1)), "w.bin", name="w"))


# (rule, level, chips it applies to, the program it reports, its nearest twin that it does not)
CASES = [
    ("no-cast", "error", ("m1", "m2"), cast, lambda b: b.mul(x=b.input("x", [1, 64, 1, 256]), y=2.0)),
    ("matmul-m1-m2", "warning", ("m1", "m2"), matmul(64), conv()),
    ("matmul-inner-32", "error", ("m1",), matmul(16), matmul(32)),
    ("sdpa-mask-ignored", "error", ("m3", "m4", "m5"), sdpa(True), sdpa(False)),
    ("conv-wide-input", "error", tuple(limits.CHIPS), conv(32000, weight_input=True), conv(16000, weight_input=True)),
    ("conv-dynamic-grouped", "error", ("m1",), conv(weight_input=True, groups=2), conv(weight_input=True)),
    ("softmax-power-of-2", "warning", tuple(limits.CHIPS), softmax(48), softmax(64)),
    ("concat", "warning", tuple(limits.CHIPS), concat, lambda b: b.add(x=b.input("x", [1, 64, 1, 256]), y=1.0)),
    ("m1-data-movement", "warning", ("m1",), reshape, lambda b: b.add(x=b.input("x", [1, 64, 1, 256]), y=1.0)),
    ("blobfile-count", "warning", tuple(limits.CHIPS), blobs(17), blobs(16)),
    ("conv-bias", "warning", tuple(limits.CHIPS), conv(bias=True), conv()),
    ("extent", "error", ("m1", "m2", "m3"), wide(16385), wide(16384)),
    ("slice-width-offset", "warning", ("m1", "m2"), width_slice(3), width_slice(1)),
    ("m5-dynamic-weights", "warning", ("m5",), matmul(64), weights_matmul),
    ("compiler-width", "warning", ("m4", "m5"), wide(16385), wide(16384)),
    ("blobfile-norm-width", "warning", tuple(limits.CHIPS), norm_blob(14593), norm_blob(14592)),
]


@pytest.mark.parametrize("rule,level,chips,reported,twin", CASES, ids=[c[0] for c in CASES])
def test_each_rule_reports_its_program_and_not_its_twin(rule, level, chips, reported, twin):
    for chip in limits.CHIPS:
        try:
            found = rules(reported, chip)
        except MILError:                      # sdpa: not in the ios16 opset of M1/M2
            assert chip in ("m1", "m2") and rule == "sdpa-mask-ignored"     # (PR#6: M1/M2 have no sdpa)
            continue
        if chip in chips:
            x = found[rule]
            assert x.level == level and x.source and x.op and x.line, (chip, x)
            assert str(x).startswith(f"{level}: line {x.line}: op '{x.op}': ") and x.source in str(x)
            assert rule not in rules(twin, chip), (chip, rules(twin, chip))
        else:
            assert rule not in found, chip


def test_sources_are_in_the_reference_doc():
    """Every rule's source names a section of docs/ane-reference.md that exists."""
    doc = (ROOT / "docs" / "ane-reference.md").read_text()
    for name, _, _, source, _, _ in limits.RULES:
        section = source.rsplit("§", 1)[1].rstrip(")")
        assert f"### {section} " in doc, (name, section)


def test_m1_surface_order_is_a_conflict_warning():
    def build(b):
        return b.add(x=b.input("a", [1, 64, 1, 512]), y=b.input("b", [1, 64, 1, 512]))
    found = rules(build, "m1")["m1-surface-order"]
    assert found.level == "warning" and "maderix/ANE#47" in found.source and "ORION-C #12" in found.source

    def ascending(b):
        return b.add(x=b.input("a", [1, 64, 1, 1]), y=b.input("b", [1, 64, 1, 512]))
    assert "m1-surface-order" not in rules(ascending, "m1")


def add_one(shape):
    return lambda b: b.add(x=b.input("x", shape), y=1.0)


def test_extent_caps_inputs_and_results_at_16384_through_m3_and_65536_on_m4_m5():
    """rustane#13 (M3 Ultra: 16,384 compiles, 17,920 fails) and ANEForge's measured caps (16,385 fails on
    M1/M2; 65,536 on M5; 65,537 channels fail on both): each chip at its boundary, on inputs too."""
    caps = {"m1": 16384, "m2": 16384, "m3": 16384, "m4": 65536, "m5": 65536}
    for chip, cap in caps.items():
        assert "extent" not in rules(add_one([1, 64, 1, cap]), chip)
        x = rules(add_one([1, 64, 1, cap + 1]), chip)["extent"]
        assert x.level == "error" and "rustane#13" in x.source and "ANEForge" in x.source
        assert x.message == f"input 'x' [1, 64, 1, {cap + 1}]: {cap + 1:,} along a spatial axis, more than the " \
                            f"{cap:,} that compile"
        assert "extent" not in rules(add_one([1, 64, cap, 1]), chip)             # height alike
        assert "extent" in rules(add_one([1, 64, cap + 1, 1]), chip)
        assert "extent" not in rules(add_one([1, 65536, 1, 1]), chip)           # channels: 65,536 on every chip
        assert "65,537 channels" in rules(add_one([1, 65537, 1, 1]), chip)["extent"].message
    assert "extent" in rules(add_one([1, 16385, 2]), "m3")                     # not rank 4: every axis
    # transposes (and the inputs they read) are measured to reach millions: not capped so
    assert "extent" not in rules(lambda b: b.transpose(x=b.input("x", [1, 1, 20000, 2]), perm=[0, 1, 3, 2]), "m3")


def test_simulator_refuses_a_too_wide_result_on_m3_and_compiles_it_on_m4():
    text = text_of(wide(16385))
    with pytest.raises(MILError, match=r"result 'reshape' \[1, 1, 1, 16385\]: 16,385 along a spatial axis, more than "
                                       r"the 16,384 that compile on m3 \[extent; source: rustane#13"):
        open_device("sim", chip="m3").compile(text)
    open_device("sim", chip="m4").compile(text)
    open_device("sim", chip="m3").compile(text_of(wide(16384)))


def blob_consts(*shapes, file=None):
    """MIL text with fp16 BLOBFILE consts of these shapes (declared only: the parser reads no data), each in
    its own file, or all in `file` one after another."""
    b = Builder()
    at = 64
    for i, shape in enumerate(shapes):
        var = Var(f"w{i}", TensorType("fp16", shape), blob=BlobRef(f"@model_path/weights/{file or f'w{i}.bin'}",
                                                                   at if file else 64))
        at += 64 + var.type.nbytes
        b.fn.ops.append(Operation(None, var, {}, var.name))
    b.output(b.add(x=b.input("x", [1, 64, 1, 256]), y=1.0))
    return parse(b.text())


def test_more_than_2gib_of_weights_in_a_program_is_refused_on_every_chip():
    """The compiler's 'Weight file size ... exceeds the maximum (2147483648 bytes)' (coremltools PR#2593);
    ANEForge PR#45: ~1.5 GB compiles, ~3.4 GB fails. Four 512 MiB tensors are exactly 2 GiB."""
    half_gib = [1024, 1024, 256, 1]
    for chip in limits.CHIPS:
        at_limit = blob_consts(*[half_gib] * 4)
        assert not [x for x in limits.check(at_limit, "m5") if x.rule == "weights-2gib"]
        over = [x for x in limits.check(blob_consts(*[half_gib] * 4, [1]), chip) if x.rule == "weights-2gib"]
        assert len(over) == 1 and over[0].level == "error" and "PR#2593" in over[0].source
        assert over[0].message == "2,147,483,650 bytes of BLOBFILE weights, more than the 2,147,483,648 a program " \
                                  "may have"


def test_over_1gib_of_weights_is_a_warning_for_macos_27_on_every_chip():
    """eeANE v1.6.1: macOS 27's Core ML ceiling fell to about 1 GiB: assumed here until measured; two 512 MiB
    tensors are exactly 1 GiB, and above 2 GiB weights-2gib refuses instead."""
    half_gib = [1024, 1024, 256, 1]
    for chip in limits.CHIPS:
        found = lambda *shapes: [x for x in limits.check(blob_consts(*shapes), chip) if x.rule == "weights-1gib-macos27"]
        assert not found(half_gib, half_gib) and not found(*[half_gib] * 4, [1])
        (x,) = found(half_gib, half_gib, [1])
        assert x.level == "warning" and "eeANE v1.6.1" in x.source and x.message.startswith(
            "1,073,741,826 bytes of BLOBFILE weights: from macOS 27 a program is assumed to hold at most 1,073,741,824")


def test_m1_shared_blob_is_a_conflict_warning_on_m1_only():
    """The report: single-blob weights fail on M1; PR#6's M1/M2 inmem_peak keeps them in one file."""
    shared = blob_consts([64, 64, 1, 1], [64, 64, 1, 1], file="w.bin")
    found = [x for x in limits.check(shared, "m1") if x.rule == "m1-shared-blob"]
    assert len(found) == 1 and found[0].level == "warning" and found[0].source.startswith("[conflict]")
    assert "ANE_BENCHMARK_REPORT" in found[0].source and "PR#6" in found[0].source
    assert "weights/w.bin has tensors at offsets 64, 8320" in found[0].message
    assert not [x for x in limits.check(shared, "m2") if x.rule == "m1-shared-blob"]
    apart = blob_consts([64, 64, 1, 1], [64, 64, 1, 1])
    assert not [x for x in limits.check(apart, "m1") if x.rule == "m1-shared-blob"]


def test_m1_data_movement_names_reduce_ops_as_issue_47_does():
    found = rules(lambda b: b.reduce_sum(x=b.input("x", [1, 64, 1, 256]), axes=[1], keep_dims=True), "m1")
    assert found["m1-data-movement"].message == "1 reduce_sum ops: reported failing on M1"


def test_m5_surface_alignment_is_a_request_rule_the_devices_meet():
    """PR#35: on M5 every surface is a multiple of 128 bytes. `check` says so for a tensor that is not;
    every device's surfaces are (allocation() rounds up), so requests meet it."""
    odd = parse(text_of(add_one([1, 3, 1, 8193])))                            # 49,158 bytes
    found = [x for x in limits.check(odd, "m5") if x.rule == "m5-surface-alignment"]
    assert [x.message.split(":")[0] for x in found] == ["input 'x' has 49158 bytes", "output 'add' has 49158 bytes"]
    assert found[0].level == "warning" and found[0].source == "PR#35 (M5) (§1.6)"
    assert not [x for x in limits.check(odd, "m4") if x.rule == "m5-surface-alignment"]
    assert not [x for x in limits.check(odd, "m5", requests=False) if x.rule == "m5-surface-alignment"]
    even = parse(text_of(add_one([1, 3, 1, 8192])))                           # 49,152 bytes
    assert not [x for x in limits.check(even, "m5") if x.rule == "m5-surface-alignment"]
    dev = open_device("sim", chip="m5")
    assert dev.surface([1, 3, 1, 8193]).alloc == 49280 and dev.surface([1, 64, 1, 8], alloc=50001).alloc == 50048
    kernel = dev.compile(text_of(add_one([1, 3, 1, 8193])))
    ins, outs = surfaces(dev, kernel.inputs), surfaces(dev, kernel.outputs)
    assert {s.alloc for s in (*ins.values(), *outs.values())} == {49280}
    ins["x"].write(np.full((1, 3, 1, 8193), 2.0))
    dev.eval(dev.request(kernel, ins, outs))
    assert (outs["add"].read() == 3).all()


def test_gelu_and_reduce_mean_are_refused_by_the_parser_saying_what_to_write(tmp_path):
    """ORION-C #10 (gelu fails to compile) and NE#44 (no reduce_mean in the text format): anectypes has
    neither op, so no program the catalogue sees has them; `mil check` says what to write instead."""
    base = text_of(lambda b: b.sigmoid(x=b.input("x", [1, 64, 1, 256])))
    for op, hint in (("gelu", "write it with tanh, mul, add and pow (ORION-C #10)"),
                     ("reduce_mean", "write reduce_sum and mul by 1/N (hollance/neural-engine#44)")):
        path = tmp_path / f"{op}.mil"
        path.write_text(base.replace("sigmoid(", f"{op}("))
        r = cli("check", path)
        assert r.returncode == 1 and "Traceback" not in r.stderr and hint in r.stderr
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"error: {path}: ")


def test_request_rules_are_reported_by_check_only():
    """Small and mixed surfaces (ORION-C #2, #4, #12): devices refuse them on requests, check reports them."""
    program = parse(text_of(lambda b: b.add(x=b.input("a", [1, 4, 1, 3]), y=b.input("b", [1, 4, 1, 1]))))
    assert {"small-surface", "mixed-surface-sizes"} <= {x.rule for x in limits.check(program, "m4")}
    assert not {"small-surface", "mixed-surface-sizes"} & {x.rule for x in limits.check(program, "m4", False)}


def test_dialect_must_be_the_chips():
    text = text_of(lambda b: b.add(x=b.input("x", [1, 64, 1, 256]), y=1.0))
    with pytest.raises(MILError, match=r"m1 reads the ios16 dialect, the program is written in ios18 on m1 \[dialect"):
        open_device("sim", chip="m1").compile(text)
    open_device("sim", chip="m4").compile(text)
    with pytest.raises(DeviceError, match="m1 reads the ios16 dialect, not ios18"):
        open_device("sim", chip="m1", dialect="ios18")


def test_simulator_refuses_the_errors_at_compile_with_op_line_and_source():
    text = text_of(matmul(16), "ios16")
    dev = open_device("sim", chip="m1")
    with pytest.raises(MILError) as info:
        dev.compile(text)
    e = info.value
    line = next(i for i, s in enumerate(text.splitlines(), 1) if " = matmul(" in s)
    assert (e.line, e.op) == (line, "matmul")
    assert "inner dimension 16 is not a multiple of 32" in e.reason and "maderix/ANE#47" in e.reason
    open_device("sim", chip="m2").compile(text)       # the M1 report: M2 only warns
    open_device("sim", chip="m1").compile(text_of(matmul(32), "ios16"))


def test_simulator_logs_each_warning_once(caplog):
    limits.WARNED.clear()
    dev = open_device("sim", chip="m4")
    with caplog.at_level(logging.WARNING, logger="anectypes.mil.limits"):
        dev.compile(text_of(softmax(48)))
        dev.compile(text_of(softmax(48)))
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and logged[0].startswith("warning: line ") and "hollance" in logged[0]


def test_the_disputed_concat_report_is_said_by_check_not_by_every_compile(caplog, tmp_path):
    """Every training kernel ends in concat: a compile does not log ORION-C #1's report (it would open every
    training run), `mil check` says it once per program."""
    limits.WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="anectypes.mil.limits"):
        open_device("sim").compile(text_of(concat))
        open_device("sim", chip="m4").compile(text_of(concat))
    assert caplog.records == []
    path = tmp_path / "k.mil"
    path.write_text(text_of(lambda b: b.concat(values=[concat(b), b.input("z", [1, 128, 1, 256])], axis=1)))
    r = cli("check", path)
    assert r.returncode == 0 and r.stderr.count("ORION-C #1") == 1 and "2 concat ops" in r.stderr, r.stderr


def cli(*args):
    return subprocess.run([sys.executable, "-m", "anectypes.mil", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_check_chip_prints_errors_and_warnings_with_sources(tmp_path):
    path = tmp_path / "k.mil"
    path.write_text(text_of(lambda b: b.cast(x=b.matmul(x=b.input("x", [1, 1, 64, 16]),
                                                        y=b.input("y", [1, 1, 16, 64])), dtype="fp32"), "ios16"))
    r = cli("check", path, "--chip", "m1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 2 and all(x.startswith(f"error: {path}: line ") for x in errors)
    assert "[no-cast; source: maderix/ANE PR#6" in r.stderr
    assert "[matmul-inner-32; source: maderix/ANE#47" in r.stderr
    assert any(x.startswith("warning: ") and "matmul-m1-m2" in x for x in lines)
    r = cli("check", path)                                # default for ios16: m2, where both stay refused/warned
    assert r.returncode == 1 and "no-cast" in r.stderr and "matmul-inner-32" not in r.stderr
    r = cli("check", path, "--chip", "m5")
    assert r.returncode == 1 and "m5 reads the ios18 dialect" in r.stderr


# ---------------------------------------------------------------- the training kernels

def test_trainer_check_says_matmul_and_the_chips_that_run_it(capsys):
    """tiny's head_dim 16 gives attention matmuls of inner dimension 16: refused on M1 (I#47) with the
    reason and the chips that run the kernels; on M2 a warning; on M4 nothing."""
    cfg = PRESETS["tiny"]
    with pytest.raises(AnectypesError) as info:
        check_training(cfg, open_device("sim", chip="m1"))
    message = str(info.value)
    assert "matmul-inner-32 (sdpaFwd, ffnFused, ffnBwdW13t, sdpaBwd1)" in message
    assert "inner dimension 16 is not a multiple of 32" in message and "source: maderix/ANE#47" in message
    assert "with matmul" in message and "Chips where the catalogue refuses none of them: M2, M3, M4, M5" in message
    check_training(cfg, open_device("sim", chip="m2"))
    assert capsys.readouterr().err.startswith("warning: m2: the dynamic-weight kernels compute every projection")
    check_training(cfg, open_device("sim", chip="m4"))
    check_training(PRESETS["stories42m"], open_device("sim", chip="m1"))      # inner dimensions of 64: runs
    assert capsys.readouterr().err.count("warning: m1: ") == 1


def test_a_lora_rank_m1_refuses_is_named_with_the_ranks_that_hold():
    """stories42m runs on M1 (inner dimensions of 64); its adapters multiply over the rank: 16 is refused
    naming 32, which holds; 40 names both 32 and 64."""
    from anectypes.model.lora import Lora
    cfg, m1 = PRESETS["stories42m"], open_device("sim", chip="m1")
    for rank, holds in ((16, "--lora 32 holds"), (40, "--lora 32 or --lora 64 holds")):
        with pytest.raises(AnectypesError) as info:
            check_training(cfg, m1, Lora(rank, 8.0, ("wq", "wo")))
        assert f"matmul-inner-32 (sdpaFwd" in str(info.value)
        assert f" --lora {rank}: on m1 a LoRA rank must be a multiple of 32: {holds}." in str(info.value)
    check_training(cfg, m1, Lora(32, 8.0, ("wq", "wo")))


def test_trainer_refuses_a_gqa_model_whose_repeated_keys_are_too_wide_for_m3(tmp_path):
    """repeat_kv lays a kv head out as one row seq·head_dim wide (64·512 = 32,768 here, as qwen3_06b's
    256·128): refused on M3 at start, with the rule, the kernels, the source and the chips that take it."""
    model = tmp_path / "gqa.json"
    model.write_text(json.dumps(dict(dim=64, hidden=176, heads=2, kv_heads=1, head_dim=512, layers=1, seq=64)))
    r = subprocess.run([sys.executable, "-m", "anectypes.train", "--scratch", "--run-dir", str(tmp_path / "run"),
                        "--model", str(model), "--backend", "sim", "--chip", "m3", "--steps", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "cannot run on m3: extent (sdpaFwd, sdpaBwd1, sdpaBwd2): result 'k_rep_f' [1, 1, 1, 32768]: 32,768 " \
           "along a spatial axis, more than the 16,384 that compile [source: rustane#13" in errors[0]
    assert "Chips where the catalogue refuses none of them: M4, M5" in errors[0]
    cfg = PRESETS["qwen3_06b"]
    with pytest.raises(AnectypesError, match=r"cannot run on m3: extent \(sdpaFwd, sdpaBwd1, sdpaBwd2\)"):
        check_training(cfg, open_device("sim", chip="m3"))
    check_training(cfg, open_device("sim", chip="m4"))


@pytest.mark.slow
def test_docs_table_is_the_catalogue_over_the_presets():
    """docs/mil.md's per-preset, per-chip table is what tools/chip_table.py prints."""
    assert table(PRESETS) in (ROOT / "docs" / "mil.md").read_text()
