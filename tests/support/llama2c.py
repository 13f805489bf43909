"""llama2.c's model.bin read as run.c reads it: an independent reader for the tests."""

import struct

import numpy as np


def read_v0(path):
    """The tensors of a version 0 file, by run.c's pointer walk."""
    data = open(path, "rb").read()
    dim, hidden, L, H, KV, vocab, seq = struct.unpack_from("<7i", data)
    w = np.frombuffer(data, "<f4", offset=28).astype(np.float64)
    hs, V, kv_dim, pos = dim // H, abs(vocab), dim * KV // H, 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        pos += n
        return w[pos - n:pos].reshape(shape)

    t = dict(emb=take(V, dim), rms_att=take(L, dim), wq=take(L, dim, dim), wk=take(L, kv_dim, dim),
             wv=take(L, kv_dim, dim), wo=take(L, dim, dim), rms_ffn=take(L, dim), w1=take(L, hidden, dim),
             w2=take(L, dim, hidden), w3=take(L, hidden, dim), rms_final=take(dim))
    take(seq * hs // 2)                            # the RoPE tables run.c skips
    take(seq * hs // 2)                            # the RoPE tables run.c skips
    t["wcls"] = t["emb"] if vocab > 0 else take(V, dim)
    assert pos == len(w)
    return t, (dim, hidden, L, H, KV, V, seq)
