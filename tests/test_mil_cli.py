"""`python -m anectypes.mil check|run|ops`, run as a user would: a subprocess from the repository root."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anectypes.mil.blob import write_blob
from anectypes.mil.ops import OPS

ROOT = Path(__file__).resolve().parent.parent

# y = conv(x, W) + 0.5 with W [8, 4, 1, 1] from a BLOBFILE; t = x * 0.25 as a second output
KERNEL = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, 4, 1, 3]> x) {
        tensor<fp16, [8, 4, 1, 1]> w = const()[name = string("w"), val = tensor<fp16, [8, 4, 1, 1]>(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))];
        tensor<fp16, [1, 8, 1, 3]> c = conv(x = x, weight = w)[name = string("c")];
        fp16 b = const()[name = string("b"), val = fp16(0.5)];
        tensor<fp16, [1, 8, 1, 3]> y = add(x = c, y = b)[name = string("y")];
        fp16 q = const()[name = string("q"), val = fp16(0.25)];
        tensor<fp16, [1, 4, 1, 3]> t = mul(x = x, y = q)[name = string("t")];
    } -> (y, t);
}
"""
SIGNATURE = ("main<ios18>(x: tensor<fp16, [1, 4, 1, 3]>) -> "
             "(y: tensor<fp16, [1, 8, 1, 3]>, t: tensor<fp16, [1, 4, 1, 3]>)")

rng = np.random.default_rng(3)
W = rng.standard_normal((8, 4, 1, 1)).astype(np.float16)
X = rng.standard_normal((1, 4, 1, 3)).astype(np.float16).astype(np.float32)   # exactly representable in fp16


def cli(*args):
    return subprocess.run([sys.executable, "-m", "anectypes.mil", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def reference(x):
    """float64: y = W x + 0.5 per spatial position, t = x / 4."""
    x = np.asarray(x, np.float64)
    y = np.einsum("oi,nis->nos", W[:, :, 0, 0].astype(np.float64), x[:, :, 0, :])[:, :, None, :] + 0.5
    return y, x * 0.25


@pytest.fixture
def model(tmp_path):
    """FILE.mil with its weights in weights/ beside it, and x.npy."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "w.bin").write_bytes(write_blob(W)[0])
    (tmp_path / "kernel.mil").write_text(KERNEL)
    np.save(tmp_path / "x.npy", X)
    return tmp_path


def assert_clean_error(result, *fragments):
    """Non-zero exit, one `error: FILE: ...` line on stderr (besides `warning:` lines), no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_check_prints_the_signature(model):
    r = cli("check", model / "kernel.mil")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == SIGNATURE
    assert lines[1] == "program(1.3), 6 ops: 1 add, 3 const, 1 conv, 1 mul"
    assert lines[2] == f"weights: @model_path/weights/w.bin ({128 + W.nbytes} bytes)"
    assert lines[3] == "chip m5: 7 warnings"
    # the surfaces' limits (ORION-C #2, #4, #12; PR#35's 128 bytes on M5), which devices meet on requests,
    # are reported here
    warnings = r.stderr.splitlines()
    surfaces = [["input", "'x'"], ["output", "'y'"], ["output", "'t'"]]
    assert [w.split(": ", 2)[2].split(" ")[:2] for w in warnings] == [*surfaces, ["the", "outputs"], *surfaces]
    assert all(w.startswith(f"warning: {model / 'kernel.mil'}: ") for w in warnings)
    assert all("ORION-C #" in w for w in warnings[:4]) and all("PR#35" in w for w in warnings[4:])


def test_check_reports_a_malformed_file_in_one_line(model):
    bad = model / "bad.mil"
    bad.write_text(KERNEL.replace("add(x = c, y = b)", "add(x = c, y = bb)"))
    line = assert_clean_error(cli("check", bad))
    assert line == f"error: {bad}: line 7, col 55: op 'add': undefined variable 'bb'"
    assert cli("check", bad).stdout == ""


def test_check_reports_a_bad_blob_offset(model):
    bad = model / "bad.mil"
    bad.write_text(KERNEL.replace("uint64(64)", "uint64(128)"))
    assert_clean_error(cli("check", bad), f"error: {bad}: ", "offset 128", "chunk header",
                       "not at the payload (e.g. 128)")


def test_check_reports_non_utf8_bytes_by_position(model):
    bad = model / "bad.mil"
    bad.write_bytes(KERNEL.encode().replace(b'string("q")', b'string("q\xe9")'))
    assert_clean_error(cli("check", bad), f"error: {bad}: line 8, col 42: MIL text is not UTF-8")


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_run_writes_outputs_that_match_a_float64_reference(model, precision):
    out = model / f"out_{precision}"
    r = cli("run", model / "kernel.mil", "--input", f"x={model / 'x.npy'}", "--out", out, "--precision", precision)
    assert r.returncode == 0, r.stderr
    assert f"(simulator, {precision})" in r.stdout
    y, t = np.load(out / "y.npy"), np.load(out / "t.npy")
    y_ref, t_ref = reference(X)
    assert y.shape == (1, 8, 1, 3) and t.shape == (1, 4, 1, 3)
    if precision == "fp16":
        assert y.dtype == np.float16
        # conv rounds to fp16 once and the add once more: at most half an ulp each (2^-11 relative)
        bound = 2.0 ** -11 * (np.abs(y_ref) + np.abs(y_ref - 0.5)) + 2.0 ** -14
        assert np.all(np.abs(y.astype(np.float64) - y_ref) <= bound)
        np.testing.assert_array_equal(t, t_ref)             # a power-of-two scale is exact in fp16
    else:
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(t, t_ref)


def test_run_without_an_input_names_it_and_its_type(model):
    assert_clean_error(cli("run", model / "kernel.mil", "--out", model / "out"),
                       "input 'x' (tensor<fp16, [1, 4, 1, 3]>) not given", "--input x=FILE.npy", "--random")
    assert not (model / "out").exists()


def test_run_random_inputs(model):
    outs = []
    for seed, name in ((1, "a"), (1, "b"), (2, "c")):
        r = cli("run", model / "kernel.mil", "--random", "--seed", seed, "--out", model / name)
        assert r.returncode == 0, r.stderr
        y, t = np.load(model / name / "y.npy"), np.load(model / name / "t.npy")
        assert y.shape == (1, 8, 1, 3) and np.all(np.isfinite(y))
        # whatever x was drawn, y must be W x + 0.5 with x = 4 t (t = x / 4 is exact)
        y_ref, _ = reference(t.astype(np.float64) * 4)
        assert np.all(np.abs(y - y_ref) <= 2.0 ** -10 * (np.abs(y_ref) + np.abs(y_ref - 0.5)) + 2.0 ** -14)
        outs.append(t)
    np.testing.assert_array_equal(outs[0], outs[1])          # --seed makes --random reproducible
    assert not np.array_equal(outs[0], outs[2])


def test_run_rejects_a_wrong_input_shape(model):
    np.save(model / "short.npy", X[..., :2])
    r = cli("run", model / "kernel.mil", "--input", f"x={model / 'short.npy'}", "--out", model / "o")
    assert_clean_error(r, "input 'x' has shape [1, 4, 1, 2], the program declares [1, 4, 1, 3]")


@pytest.mark.parametrize("given", [["y"], ["x", "y"], ["y", "x"]])
def test_run_names_an_unknown_input_and_the_programs_inputs(model, given):
    """--input y=... alone was reported as x missing, with y ignored."""
    args = [a for name in given for a in ("--input", f"{name}={model / 'x.npy'}")]
    line = assert_clean_error(cli("run", model / "kernel.mil", *args, "--out", model / "o"),
                              "the program has no input named 'y'; its inputs: x")
    assert line.startswith(f"error: --input y={model / 'x.npy'}: ") and not (model / "o").exists()


def bad_input_files(folder):
    """{case: (the file for --input x=FILE, a phrase of the error)}"""
    np.savez(folder / "x.npz", x=X)
    np.save(folder / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(folder / "complex.npy", X.astype(np.complex64))
    np.save(folder / "strings.npy", np.full(X.shape, "a"))
    (folder / "empty.npy").write_bytes(b"")
    (folder / "text.npy").write_text("1 2 3 4 5 6 7 8 9\n")
    return {"npz": (folder / "x.npz", "not a readable .npy file (the magic string is not correct"),
            "object array": (folder / "objects.npy", "Object arrays cannot be loaded when allow_pickle=False"),
            "complex": (folder / "complex.npy", "holds complex64 values; the program's inputs take numbers"),
            "strings": (folder / "strings.npy", "holds <U1 values"),
            "empty": (folder / "empty.npy", "not a readable .npy file (EOF"),
            "text": (folder / "text.npy", "not a readable .npy file (the magic string is not correct"),
            "missing": (folder / "nothing.npy", "not a readable .npy file (No such file or directory)"),
            "folder": (folder, "not a readable .npy file (Is a directory)")}


@pytest.mark.parametrize("case", ["npz", "object array", "complex", "strings", "empty", "text", "missing", "folder"])
def test_run_refuses_an_input_file_that_is_not_a_npy_of_numbers(model, case):
    file, phrase = bad_input_files(model)[case]
    line = assert_clean_error(cli("run", model / "kernel.mil", "--input", f"x={file}", "--out", model / "o"), phrase)
    assert line.startswith(f"error: --input x={file}: ") and not (model / "o").exists()


def test_run_refuses_an_input_given_twice_and_an_out_that_is_a_file(model):
    x = f"x={model / 'x.npy'}"
    assert_clean_error(cli("run", model / "kernel.mil", "--input", x, "--input", x, "--out", model / "o"),
                       "--input x is given twice")
    (model / "o").write_text("a file")
    line = assert_clean_error(cli("run", model / "kernel.mil", "--input", x, "--out", model / "o"), "File exists")
    assert line.startswith(f"error: --out {model / 'o'}: ") and (model / "o").read_text() == "a file"


def test_missing_weights_file_mentions_model_path(model, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "kernel.mil").write_text(KERNEL)
    for args in (("check", elsewhere / "kernel.mil"),
                 ("run", elsewhere / "kernel.mil", "--random", "--out", elsewhere / "o")):
        line = assert_clean_error(cli(*args), "BLOBFILE @model_path/weights/w.bin not found", "--model-path")
        assert str(elsewhere / "weights" / "w.bin") in line
    # and --model-path is the fix
    r = cli("check", elsewhere / "kernel.mil", "--model-path", model)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == SIGNATURE


def test_run_binds_inputs_of_different_sizes(tmp_path):
    """A program whose inputs differ in size runs: the CLI allocates a request's surfaces alike (§1.9)."""
    from support.programs import two_input_kernel
    (tmp_path / "two.mil").write_text(two_input_kernel())
    a, b = np.full((1, 64, 1, 512), 0.5, np.float16), np.full((1, 64, 1, 1024), -2.0, np.float16)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = cli("run", tmp_path / "two.mil", "--input", f"a={tmp_path / 'a.npy'}", "--input", f"b={tmp_path / 'b.npy'}",
            "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "o" / "y.npy"), np.concatenate([a, b], axis=3))


# --------------------------------------------------------------- huge, deep and impossible inputs

def test_check_refuses_lists_nested_100000_deep(tmp_path):
    deep = tmp_path / "deep.mil"
    deep.write_text(KERNEL.replace("fp16(0.5)", "fp16(" + "[" * 100_000 + "0.5" + "]" * 100_000 + ")"))
    assert_clean_error(cli("check", deep), f"error: {deep}: line 6, col ", "brackets nested more than")


def test_check_quotes_80_characters_of_a_50_mb_name(model):
    bad = model / "bad.mil"
    bad.write_text(KERNEL.replace("add(x = c, y = b)", f"add(x = c, y = {'b' * 50_000_000})"))
    line = assert_clean_error(cli("check", bad), "undefined variable 'bbbb", "... (50000000 characters)'")
    assert len(line) < 300


def test_check_refuses_a_tensor_larger_than_memory(model):
    bad = model / "bad.mil"
    bad.write_text(KERNEL.replace("[1, 4, 1, 3]> x)", "[1, 4, 1, 3]> x, tensor<fp16, [1, 1000000000, 1, 1000000]> z)"))
    assert_clean_error(cli("check", bad), "tensor<fp16, [1, 1000000000, 1, 1000000]> needs 1,862,645.1 GiB, more "
                       "than the ", " GiB of memory this machine has")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS limits allocations on Linux only")
def test_run_out_of_memory_is_one_line(tmp_path):
    """A program that fits the machine but not the process (here: 1 GiB of address space)."""
    import resource
    big = tmp_path / "big.mil"
    big.write_text(KERNEL.split("{")[0] + """{
    func main<ios18>(tensor<fp32, [1, 16384, 16384]> x) {
        fp32 h = const()[name = string("h"), val = fp32(0.5)];
        tensor<fp32, [1, 16384, 16384]> y = mul(x = x, y = h)[name = string("y")];
    } -> (y);
}
""")
    limit = 2**30
    r = subprocess.run([sys.executable, "-m", "anectypes.mil", "run", big, "--random", "--out", tmp_path / "o"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert_clean_error(r, f"error: {big}: out of memory: Unable to allocate 1.00 GiB")


def test_ops_prints_the_table_of_docs_mil_md():
    """docs/mil.md's op table is what `ops` prints from the registry, a row per op in its order, so the
    page cannot drift from the op definitions."""
    result = cli("ops")
    assert result.returncode == 0 and result.stderr == ""
    rows = result.stdout.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{name}`" for name in OPS]
    assert result.stdout in (ROOT / "docs" / "mil.md").read_text()
