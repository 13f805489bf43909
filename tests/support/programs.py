"""MIL programs that several test modules run."""

from anectypes.mil import Builder


def two_input_kernel():
    """y = a and b side by side along the spatial axis: inputs of 64 KiB and 128 KiB in fp16."""
    b = Builder()
    x, w = b.input("a", [1, 64, 1, 512]), b.input("b", [1, 64, 1, 1024])
    b.output(b.concat(values=(x, w), axis=3, interleave=False, name="y"))
    return b.text()
