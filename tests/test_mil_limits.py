"""The chip catalogue (anectypes/mil/limits.py, docs/ane-reference.md §3.10): for every rule, a program it
reports (as `error:` or `warning:`, with its source, on the chips it is about) and the nearest program it
does not; the simulator refuses at compile what the catalogue calls an error and logs each warning once;
`python -m anectypes.mil check --chip` prints them."""

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.errors import AnectypesError, DeviceError, MILError
from anectypes.mil import Builder, limits, parse
from anectypes.model.chips import check_training, table
from anectypes.model.config import PRESETS

ROOT = Path(__file__).resolve().parent.parent


def text_of(build, dialect="ios18"):
    b = Builder(dialect)
    b.output(build(b))
    return b.text()


def rules(build, chip, dialect=None):
    """{rule: finding} that the catalogue reports for chip."""
    dialect = dialect or limits.CHIPS[chip][1]
    return {x.rule: x for x in limits.check(parse(text_of(build, dialect)), chip, requests=False)}


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
    assert "[matmul-inner-32; source: [second-hand] maderix/ANE#47" in r.stderr
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
    assert "with matmul" in message and "Chips that run them: M3, M4 and M5" in message
    check_training(cfg, open_device("sim", chip="m2"))
    assert capsys.readouterr().err.startswith("warning: m2: the dynamic-weight kernels compute every projection")
    check_training(cfg, open_device("sim", chip="m4"))
    check_training(PRESETS["stories42m"], open_device("sim", chip="m1"))      # inner dimensions of 64: runs
    assert capsys.readouterr().err.count("warning: m1: ") == 1


@pytest.mark.slow
def test_docs_table_is_the_catalogue_over_the_presets():
    """docs/mil.md's per-preset, per-chip table is what tools/chip_table.py prints."""
    assert table(PRESETS) in (ROOT / "docs" / "mil.md").read_text()
