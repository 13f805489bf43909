"""MIL generators for the dynamic-weight kernels (ane-reference.md §3.4, §4.2).

Weights travel in the spatial dimension of a kernel's single input next to the activations, so each
kernel compiles once per run and new weights only need new input data.
"""

from ..mil import Builder


def dynamic_matmul(b, x, ic, oc, seq, act_at, w_at, prefix):
    """y[1,oc,1,seq] = Wᵀ·act, where x holds act in spatial [act_at, act_at+seq) and the ic×oc
    matrix W in spatial [w_at, w_at+oc): channel i of x carries row i of W (§3.4)."""
    act = b.slice_by_size(x=x, begin=[0, 0, 0, act_at], size=[1, ic, 1, seq], name=f"{prefix}_act")
    w = b.slice_by_size(x=x, begin=[0, 0, 0, w_at], size=[1, ic, 1, oc], name=f"{prefix}_w")
    act_rows = b.transpose(x=b.reshape(x=act, shape=[1, 1, ic, seq], name=f"{prefix}_a2"),
                           perm=[0, 1, 3, 2], name=f"{prefix}_at")                 # [1,1,seq,ic]
    w_mat = b.reshape(x=w, shape=[1, 1, ic, oc], name=f"{prefix}_wm")
    y = b.matmul(x=act_rows, y=w_mat, transpose_x=False, transpose_y=False, name=f"{prefix}_yh")
    y = b.transpose(x=y, perm=[0, 1, 3, 2], name=f"{prefix}_yt")                    # [1,1,oc,seq]
    return b.reshape(x=y, shape=[1, oc, 1, seq], name=f"{prefix}_y")


def dynamic_matmul_kernel(ic, oc, seq, dialect="ios18"):
    """A one-op kernel: input x [1, ic, 1, seq+oc] (activation, then weight), output y [1, oc, 1, seq]."""
    b = Builder(dialect)
    x = b.input("x", [1, ic, 1, seq + oc])
    b.output(dynamic_matmul(b, x, ic, oc, seq, 0, seq, "mm"))
    return b
