"""Checkpoint files the tests write by hand: odd ones (a well-formed zip with odd contents) and the
reference's v2/v4 format (docs/ane-reference.md §4.8)."""

import io
import json
import struct
import zipfile

import numpy as np


def odd_members(meta):
    """{case: ({member: bytes, or None to drop it}, a phrase of the error)}: checkpoints whose zip is well
    formed but whose meta.json or tensors are odd, made from a good checkpoint's meta.json."""
    vocab, dim = meta["config"]["vocab"], meta["config"]["dim"]

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    def header_only(shape):                      # a .npy header claiming `shape`, and no data
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
        return buf.getvalue()

    def meta_with(**changes):                    # None: without that key
        out = {**meta, **changes}
        return json.dumps({k: v for k, v in out.items() if v is not None}).encode()

    config, state = meta["config"], meta["state"]
    return {
        "meta-array": ({"meta.json": b"[]"}, "meta.json is an array, not an object"),
        "meta-nested-100000-deep": ({"meta.json": b"[" * 100_000 + b"]" * 100_000}, "meta.json is not valid JSON"),
        "no-config": ({"meta.json": meta_with(config=None)}, "meta.json's config is missing"),
        "config-array": ({"meta.json": meta_with(config=[dim])}, "config is an array, not an object of the model's"),
        "config-with-1e9-layers": ({"meta.json": meta_with(config={**config, "layers": 10**9})},
                                   "its config's 1000000000 layers need 27000000006 tensors but the file holds"),
        "config-without-vocab": ({"meta.json": meta_with(config={k: v for k, v in config.items() if k != "vocab"})},
                                 "meta.json's config lacks vocab"),
        "config-dim-a-string": ({"meta.json": meta_with(config={**config, "dim": str(dim)})},
                                f"dim must be a positive integer, got '{dim}'"),
        "adam_t-a-string": ({"meta.json": meta_with(adam_t="7")}, "meta.json's adam_t is '7', not an integer >= 0"),
        "adam_t-negative": ({"meta.json": meta_with(adam_t=-1)}, "meta.json's adam_t is -1, not an integer >= 0"),
        "no-state": ({"meta.json": meta_with(state=None)}, "meta.json's state is missing, not an object"),
        "step-a-string": ({"meta.json": meta_with(state={**state, "step": "x"})},
                          "state's step is 'x', not an integer"),
        "config-unlike-the-tensors": ({"meta.json": meta_with(config={**config, "vocab": vocab + 1})},
                                      f"param/embed is float32 [{vocab}, {dim}] but the model config needs float32 "
                                      f"[{vocab + 1}, {dim}]"),
        "embed-float64": ({"param/embed.npy": npy(np.zeros((vocab, dim)))},
                          f"param/embed is float64 [{vocab}, {dim}] but the model config needs float32"),
        "embed-header-claims-400-gb": ({"param/embed.npy": header_only((10**11,))},
                                       "param/embed is float32 [100000000000] but the model config needs"),
        "vocab-1e9-and-an-embed-header-that-agrees": (
            {"meta.json": meta_with(config={**config, "vocab": 10**9}), "param/embed.npy": header_only((10**9, dim))},
            f"param/embed.npy needs {4 * 10**9 * dim:,} bytes but the file is"),
        "embed-missing": ({"param/embed.npy": None}, "param/embed is missing"),
        "extra-parameter": ({"param/extra.npy": npy(np.zeros(3, np.float32))}, "param/extra is not a parameter"),
        "extra-file": ({"notes.txt": b"hello"}, "unexpected member 'notes.txt'"),
    }


def write_odd(good, dest, members):
    """The checkpoint `good` written to `dest` with `members` set (None: dropped)."""
    with zipfile.ZipFile(good) as zf:
        out = {n: zf.read(n) for n in zf.namelist()}
    out.update(members)
    with zipfile.ZipFile(dest, "w") as zf:
        for name, data in out.items():
            if data is not None:
                zf.writestr(name, data)


def reference_file(path, version=4, magic=0x424C5A54, heads=4, kv_heads=2, head_dim=4, dims=(16, 24, 2, 10, 8),
                    scale=1):
    """Write a reference checkpoint with distinct values per tensor (times scale); returns {kind/name: array}.
    dims: dim, hidden, layers, vocab, seq."""
    dim, hidden, layers, vocab, seq = dims
    q, kv = heads * head_dim, kv_heads * head_dim
    tail = (kv_heads, head_dim, q) if version == 4 else (0, 0, 0)  # v2: pad[3]
    header = (struct.pack("<10i", magic, version, 250, 1000, layers, vocab, dim, hidden, heads, seq)
              + struct.pack("<2f", 3e-4, 2.75) + struct.pack("<3d", 1.5, 20.25, 30.0)
              + struct.pack("<6i", 250, 4000, 250, *tail))
    assert len(header) == 96
    layer = [("wq", (q, dim)), ("wk", (kv, dim)), ("wv", (kv, dim)), ("wo", (dim, q)), ("w1", (hidden, dim)),
             ("w2", (dim, hidden)), ("w3", (hidden, dim)), ("rms_att", (dim,)), ("rms_ffn", (dim,))]
    want, chunks = {}, []

    def put(key, shape):
        a = ((len(chunks) * 1000 + np.arange(np.prod(shape))) * scale).astype("<f4")  # tensor number in the thousands
        want[key] = a.reshape(shape)
        chunks.append(a.tobytes())

    for i in range(layers):
        for name, shape in layer:
            put(f"param/layers.{i}.{name}", shape)
        for name, shape in layer:
            put(f"m/layers.{i}.{name}", shape)
            put(f"v/layers.{i}.{name}", shape)
    for name, shape in (("rms_final", (dim,)), ("embed", (vocab, dim))):
        for kind in ("param", "m", "v"):
            put(f"{kind}/{name}", shape)
    path.write_bytes(header + b"".join(chunks))
    return want
