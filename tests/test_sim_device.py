"""The device protocol on the simulator: compile, surfaces, requests, eval, the compile budget."""

import numpy as np
import pytest

from anectypes.device import open_device
from anectypes.device.protocol import surfaces
from anectypes.errors import BlobError, CompileBudgetExceeded, DeviceError, MILError
from anectypes.mil import Builder
from anectypes.mil.blob import write_blob
from support.programs import two_input_kernel

# a linear layer as the ANE runs it: 1x1 conv of x [1, IC, 1, S] with a BLOBFILE weight [OC, IC, 1, 1], plus a
# second output s = x * 0.25 + x
LINEAR = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, 8, 1, 5]> x) {
        tensor<fp16, [6, 8, 1, 1]> w = const()[name = string("w"), val = tensor<fp16, [6, 8, 1, 1]>(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))];
        tensor<fp16, [1, 6, 1, 5]> y = conv(x = x, weight = w)[name = string("y")];
        fp16 q = const()[name = string("q"), val = fp16(0.25)];
        tensor<fp16, [1, 8, 1, 5]> xq = mul(x = x, y = q)[name = string("xq")];
        tensor<fp16, [1, 8, 1, 5]> s = add(x = xq, y = x)[name = string("s")];
    } -> (y, s);
}
"""
X_SHAPE, Y_SHAPE = (1, 8, 1, 5), (1, 6, 1, 5)
rng = np.random.default_rng(11)
W = rng.standard_normal((6, 8, 1, 1)).astype(np.float16)
WEIGHTS = {"@model_path/weights/w.bin": write_blob(W)[0]}


def linear_ref(x):
    """float64 y = W x over channels, for every spatial position."""
    return np.einsum("oi,nis->nos", W[:, :, 0, 0].astype(np.float64), np.asarray(x, np.float64)[:, :, 0])[:, :, None]


def fp16_values(shape):
    return rng.standard_normal(shape).astype(np.float16)


def assert_fp16_close(got, ref):
    """fp16 values (in the simulator's float32 surfaces), within one fp16 rounding of the
    fp32-accumulated result (2^-14: the flush-to-zero threshold)"""
    assert np.array_equal(got, got.astype(np.float16).astype(got.dtype))
    assert np.all(np.abs(got.astype(np.float64) - ref) <= 2.0 ** -11 * np.abs(ref) + 2.0 ** -14), (got, ref)


def setup(dev, kernel=None):
    kernel = kernel or dev.compile(LINEAR, WEIGHTS)
    xs, ys, ss = dev.surface(X_SHAPE), dev.surface(Y_SHAPE), dev.surface(X_SHAPE)
    return kernel, xs, ys, ss, dev.request(kernel, {"x": xs}, {"y": ys, "s": ss})


def test_compile_surfaces_request_eval():
    dev = open_device("sim", precision="fp16")
    kernel, xs, ys, ss, req = setup(dev)
    assert {n: t.shape for n, t in kernel.inputs.items()} == {"x": X_SHAPE}
    assert {n: t.shape for n, t in kernel.outputs.items()} == {"y": Y_SHAPE, "s": X_SHAPE}
    assert xs.array.dtype == np.float32 and xs.array.shape == X_SHAPE and xs.nbytes == 160
    x = fp16_values(X_SHAPE)
    xs.write(x)
    dev.eval(req)
    assert_fp16_close(ys.array, linear_ref(x))
    assert_fp16_close(ss.array, x.astype(np.float64) * 1.25)


def test_surfaces_are_zero_copy():
    dev = open_device("sim")
    kernel, xs, ys, ss, req = setup(dev)
    x_buf, y_buf = xs.array, ys.array
    for _ in range(3):                       # new data written in place, the same request evaluated again
        x = fp16_values(X_SHAPE)
        xs.array[...] = x
        dev.eval(req)
        assert xs.array is x_buf and ys.array is y_buf      # results land in the bound buffer itself
        assert_fp16_close(ys.array, linear_ref(x))
    xs.array[0, 3, 0, 2] = 100.0             # a single element changed through the array: seen by the next eval
    dev.eval(req)
    assert_fp16_close(ys.array, linear_ref(xs.array))


def test_one_kernel_serves_many_requests():
    """The training pipeline compiles one kernel per layer and binds a request per use of it."""
    dev = open_device("sim")
    kernel = dev.compile(LINEAR, WEIGHTS)
    layers = [setup(dev, kernel) for _ in range(3)]
    data = [fp16_values(X_SHAPE) for _ in layers]
    for (_, xs, _, _, _), x in zip(layers, data):
        xs.array[...] = x
    for _, _, ys, _, req in reversed(layers):    # evaluated in any order, each sees only its own surfaces
        dev.eval(req)
    for (_, _, ys, ss, _), x in zip(layers, data):
        assert_fp16_close(ys.array, linear_ref(x))
        assert_fp16_close(ss.array, x.astype(np.float64) * 1.25)
    assert dev.compiles == 1


def test_surface_larger_than_declared_is_read_from_its_start():
    dev = open_device("sim")
    kernel = dev.compile(LINEAR, WEIGHTS)
    big_x, big_y, ss = dev.surface((1, 8, 1, 9)), dev.surface((1, 16, 1, 16)), dev.surface(X_SHAPE)
    x = fp16_values(X_SHAPE)
    flat = big_x.array.reshape(-1)
    flat[:] = 7.0
    flat[:x.size] = x.reshape(-1)            # the ANE reads the first C*S values, whatever the surface's shape
    big_y.array[...] = -3.0
    dev.eval(dev.request(kernel, {"x": big_x}, {"y": big_y, "s": ss}))
    y = big_y.array.reshape(-1)
    assert_fp16_close(y[:6 * 5].reshape(Y_SHAPE), linear_ref(x))
    assert np.all(y[6 * 5:] == -3.0)          # the rest of the output surface is left alone


def test_write_rounds_like_the_cpu_conversion_to_fp16():
    """fp16 surfaces hold fp16 values in float32 memory: write() rounds exactly like numpy's float16
    cast (nearest even, subnormals kept, overflow to inf), into a block or the whole surface."""
    dev = open_device("sim")
    xs = dev.surface((1, 4, 1, 6))
    x = np.array([[1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(2.0 ** -14 - 2.0 ** -25), 3e-8, -3e-8, 65519],
                  [2.0 ** -25, -2.0 ** -25, 1 / 3, -0.0, 2.0 ** -24 * 1.5, 2.0 ** -24 * 2.5]], np.float32)
    with np.errstate(over="ignore"):
        for value, where in ((x, (0, slice(1, 3), 0, slice(None))),           # finite: the bit-level path
                             (x[:, 2:].T * 2, (0, slice(None), 0, slice(2, 4)))):   # 131038 -> inf: numpy's cast
            xs.write(value, where)
            assert np.array_equal(xs.array[where].view(np.uint32),
                                  value.astype(np.float16).astype(np.float32).view(np.uint32))
    assert np.all(xs.array[0, 0, 0, :2] == 0) and np.all(xs.array[0, 3, 0, 4:] == 0)
    assert xs.read().dtype == np.float16 and np.array_equal(xs.read(), xs.array)
    for bad in (np.ones((5, 6)), np.ones((2, 4, 1, 6))):                 # one line, not numpy's traceback
        with pytest.raises(DeviceError, match=r"cannot write a value of shape \[.*\] into \[.*\] of the surface"):
            xs.write(bad, (0, slice(1, 3), 0, slice(None)) if bad.ndim == 2 else ...)
    assert open_device("sim", precision="fp32").surface((2, 2)).convert is None   # fp32 mode: stored as is


def test_binding_errors():
    dev = open_device("sim")
    kernel = dev.compile(LINEAR, WEIGHTS)
    xs, ys, ss = dev.surface(X_SHAPE), dev.surface(Y_SHAPE), dev.surface(X_SHAPE)
    with pytest.raises(DeviceError, match=r"input 'x': surface of 39 elements is too small for \[1, 8, 1, 5\]"):
        dev.request(kernel, {"x": dev.surface((1, 13, 1, 3))}, {"y": ys, "s": ss})
    with pytest.raises(DeviceError, match=r"output 'y': surface of 12 elements is too small for \[1, 6, 1, 5\]"):
        dev.request(kernel, {"x": xs}, {"y": dev.surface((1, 4, 1, 3)), "s": ss})
    with pytest.raises(DeviceError, match="request does not bind input 'x' of the kernel"):
        dev.request(kernel, {}, {"y": ys, "s": ss})
    with pytest.raises(DeviceError, match="request does not bind output 's' of the kernel"):
        dev.request(kernel, {"x": xs}, {"y": ys})
    with pytest.raises(DeviceError, match=r"the kernel has no input named 'z' \(it has x\)"):
        dev.request(kernel, {"x": xs, "z": xs}, {"y": ys, "s": ss})
    with pytest.raises(DeviceError, match=r"the kernel has no output named 'x' \(it has y, s\)"):
        dev.request(kernel, {"x": xs}, {"y": ys, "s": ss, "x": xs})
    with pytest.raises(DeviceError, match=r"input 'x' is fp16: bind a surface made with dtype fp16"):
        dev.request(kernel, {"x": dev.surface(X_SHAPE, "fp32")}, {"y": ys, "s": ss})
    gone = dev.surface(X_SHAPE)
    gone.free()
    with pytest.raises(DeviceError, match="input 'x': the surface was freed"):
        dev.request(kernel, {"x": gone}, {"y": ys, "s": ss})


def test_fp32_precision_gives_float32_surfaces_and_exact_results():
    dev = open_device("sim", precision="fp32")
    kernel, xs, ys, ss, req = setup(dev)
    assert all(s.array.dtype == np.float32 for s in (xs, ys, ss))
    # values fp16 cannot hold (1 + 2^-20); x*0.25 + x is exact in fp32 for them
    x = (1 + np.arange(40, dtype=np.float64).reshape(X_SHAPE) * 2.0 ** -20).astype(np.float32)
    xs.array[...] = x
    dev.eval(req)
    np.testing.assert_array_equal(ss.array, x.astype(np.float64) * 1.25)
    np.testing.assert_allclose(ys.array, linear_ref(x), rtol=1e-6, atol=1e-6)
    # the same program in fp16 mode rounds x on the way in
    dev16 = open_device("sim", precision="fp16")
    _, xs16, _, ss16, req16 = setup(dev16)
    xs16.write(x)
    dev16.eval(req16)
    assert not np.array_equal(ss16.array.astype(np.float64), x.astype(np.float64) * 1.25)


def test_fp32_output_declared_in_fp16_mode():
    """With cast (ios18) an fp32 surface carries fp32 data even in fp16 mode."""
    text = """program(1.3)
{
    func main<ios18>(tensor<fp32, [1, 2, 1, 3]> x) {
        string h = const()[name = string("h"), val = string("fp16")];
        tensor<fp16, [1, 2, 1, 3]> x16 = cast(x = x, dtype = h)[name = string("x16")];
        string f = const()[name = string("f"), val = string("fp32")];
        tensor<fp32, [1, 2, 1, 3]> y = cast(x = x16, dtype = f)[name = string("y")];
    } -> (y);
}
"""
    dev = open_device("sim")
    kernel = dev.compile(text)
    xs, ys = dev.surface((1, 2, 1, 3), "fp32"), dev.surface((1, 2, 1, 3), "fp32")
    assert xs.array.dtype == ys.array.dtype == np.float32
    xs.array[...] = np.float32(1 / 3)
    dev.eval(dev.request(kernel, {"x": xs}, {"y": ys}))
    np.testing.assert_array_equal(ys.array, np.float32(np.float16(1 / 3)))   # rounded to fp16 inside, no further


def test_inputs_of_one_request_share_one_allocation_size():
    """Mixed input allocation sizes fail on the ANE with 0x1d (§1.9): every device refuses them, and
    surfaces() makes a request's surfaces alike."""
    dev = open_device("sim", precision="fp16")
    k = dev.compile(two_input_kernel())
    y = dev.surface(k.outputs["y"].shape)
    plain = {n: dev.surface(t.shape) for n, t in k.inputs.items()}
    with pytest.raises(DeviceError, match="equal allocation sizes.*'a' 65536 bytes, 'b' 131072 bytes"):
        dev.request(k, plain, {"y": y})
    ins = surfaces(dev, k.inputs)
    assert [s.alloc for s in ins.values()] == [131072, 131072]
    assert [s.array.shape for s in ins.values()] == [(1, 64, 1, 512), (1, 64, 1, 1024)]
    values = {n: fp16_values(s.array.shape) for n, s in ins.items()}
    for n, s in ins.items():
        s.write(values[n])
    dev.eval(dev.request(k, ins, {"y": y}))
    assert np.array_equal(y.array, np.concatenate([values["a"], values["b"]], axis=3))
    small = {n: dev.surface([1, 4, 1, 8 * (i + 1)]) for i, n in enumerate("ab")}   # both at the 48 KiB floor
    assert [s.alloc for s in small.values()] == [49152, 49152]


def test_compile_budget():
    dev = open_device("sim", compile_budget=3)
    kernels = [dev.compile(LINEAR, WEIGHTS) for _ in range(3)]
    assert dev.compiles == 3
    with pytest.raises(CompileBudgetExceeded, match="compile budget of 3 spent") as info:
        dev.compile(LINEAR, WEIGHTS)
    assert isinstance(info.value, DeviceError)
    assert "checkpoint and restart the process" in str(info.value)
    assert dev.compiles == 3
    _, xs, ys, _, req = setup(dev, kernels[2])   # the kernels already compiled keep working
    xs.array[...] = 1.0
    dev.eval(req)
    assert_fp16_close(ys.array, linear_ref(np.ones(X_SHAPE)))


def test_failed_compiles_do_not_consume_budget():
    dev = open_device("sim", compile_budget=3)
    with pytest.raises(MILError, match="compile failed: undefined variable 'q2'") as info:
        dev.compile(LINEAR.replace("mul(x = x, y = q)", "mul(x = x, y = q2)"), WEIGHTS)
    assert (info.value.line, info.value.op) == (7, "mul")
    with pytest.raises(BlobError, match="compile failed: .*offset 128"):
        dev.compile(LINEAR.replace("uint64(64)", "uint64(128)"), WEIGHTS)
    assert dev.compiles == 0
    for _ in range(3):
        dev.compile(LINEAR, WEIGHTS)
    assert dev.compiles == 3
    with pytest.raises(CompileBudgetExceeded):
        dev.compile(LINEAR, WEIGHTS)


def test_eval_after_free():
    dev = open_device("sim")
    kernel, xs, ys, ss, req = setup(dev)
    dev.eval(req)
    kernel.free()
    with pytest.raises(DeviceError, match="the kernel was freed"):
        dev.eval(req)


def test_open_device_rejects_bad_options():
    with pytest.raises(DeviceError, match="unknown backend 'gpu'; available: auto, sim, ane"):
        open_device("gpu")
    with pytest.raises(DeviceError, match="precision must be fp16 or fp32, got 'bf16'"):
        open_device("sim", precision="bf16")


def chain_kernel(width, ops):
    """y = x after `ops` steps t·0.5 + t·0.25, each product an intermediate buffer [1, width, 1, 4]
    that must not share memory with the other while both are live."""
    b = Builder()
    t = b.input("x", [1, width, 1, 4])
    for i in range(ops):
        t = b.add(x=b.mul(x=t, y=0.5, name=f"h{i}"), y=b.mul(x=t, y=0.25, name=f"q{i}"), name=f"t{i}")
    b.output(t)
    return b.text()


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_kernels_share_one_arena(precision):
    """A device's kernels keep their intermediate results in one arena, as large as the largest
    kernel needs, not the sum, and a kernel's result takes the place of one no longer needed (here
    each step's t takes an earlier step's); evaluated in turn, each kernel still computes from its
    own inputs, and results alive together (h and q) never share memory."""
    dev = open_device("sim", precision=precision)
    shapes = ((64, 3), (16, 9), (128, 2))
    kernels = [dev.compile(chain_kernel(w, n)) for w, n in shapes]
    needs = [max(k.plan.offsets[i] + dev.arena.size(spec) for i, spec in k.plan.own.items()) for k in kernels]
    alone = [sum(dev.arena.size(spec) for spec in k.plan.own.values()) for k in kernels]
    reqs = []
    for k in kernels:
        ins, outs = surfaces(dev, k.inputs), surfaces(dev, k.outputs)
        reqs.append((dev.request(k, ins, outs), ins["x"], outs[next(iter(outs))]))
    def rnd(v):           # fp16 mode: each op's result rounded to fp16, subnormal results flushed
        v = v.astype(np.float16).astype(np.float64)
        return np.where(np.abs(v) < 2.0 ** -14, 0.0, v)
    rnd = rnd if precision == "fp16" else (lambda v: v)
    for _ in range(2):
        for (req, x, y), (_, n) in zip(reqs, shapes):
            x.write(fp16_values(x.array.shape))
            dev.eval(req)
            want = x.array.astype(np.float64)
            for _ in range(n):
                want = rnd(rnd(want * 0.5) + rnd(want * 0.25))
            np.testing.assert_allclose(y.array, want, rtol=1e-6)
    assert dev.arena.memory.size == max(needs) < max(alone)   # a dead result's place is taken again
    first = [next(iter(k.plan.arena.views(k.plan.own, k.plan.offsets).values())) for k in kernels]
    assert all(np.shares_memory(first[0], f) for f in first[1:])       # each starts at the arena's start
