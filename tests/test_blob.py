"""BLOBFILE writer/reader against the byte layout in docs/ane-reference.md section 2."""

import struct

import numpy as np
import pytest

from anectypes.errors import BlobError
from anectypes.mil.blob import BlobWriter, read_blob, read_chunk, write_blob

rng = np.random.default_rng(7)
MIL_DTYPE = {np.float16: "fp16", np.float32: "fp32", np.int8: "int8", np.uint8: "uint8"}


def sample(dtype, shape):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


def u32(blob, at):
    return struct.unpack_from("<I", blob, at)[0]


def expect(words, call, *args):
    with pytest.raises(BlobError) as e:
        call(*args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


@pytest.mark.parametrize("dtype", list(MIL_DTYPE))
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 1, 4)])
def test_single_chunk_round_trip(dtype, shape):
    a = sample(dtype, shape)
    blob, (off,) = write_blob(a)
    assert off == 64 and len(blob) == 128 + a.nbytes
    got = read_chunk(blob, off, MIL_DTYPE[dtype], shape)
    assert got.dtype == a.dtype and got.shape == shape
    assert got.tobytes() == a.tobytes()  # bit-exact, NaNs and -0.0 included
    assert not got.flags.writeable


def test_multi_chunk_round_trip_with_odd_int8_payloads():
    arrays = [sample(np.int8, (7,)), sample(np.float16, (3, 3)), sample(np.uint8, (1, 5)),
              sample(np.float32, (2, 3)), sample(np.int8, (3,)), sample(np.float16, (4,))]
    blob, offsets = write_blob(*arrays)
    pos = 64
    for a, off in zip(arrays, offsets):
        pos += -pos % 64  # MILBlob: every chunk starts on a 64-byte boundary, after odd payloads too
        assert off == pos
        pos += 64 + a.nbytes
        np.testing.assert_array_equal(read_chunk(blob, off, MIL_DTYPE[a.dtype.type], a.shape), a)
    assert len(blob) == pos  # no padding after the last payload (a single chunk is 128 + N bytes)
    assert struct.unpack_from("<II", blob, 0) == (len(arrays), 2)  # chunk count, version
    codes = {np.int8: 4, np.float16: 1, np.uint8: 3, np.float32: 2}
    assert [struct.unpack_from("<I", blob, o + 4)[0] for o in offsets] == [codes[a.dtype.type] for a in arrays]
    assert read_blob(blob) == [(o, o + 64, a.nbytes) for o, a in zip(offsets, arrays)]


def test_writer_class_matches_write_blob_and_accepts_views_and_big_endian():
    w = BlobWriter()
    a = sample(np.float32, (4, 6))
    assert w.add(a[:, ::2]) == 64                     # non-contiguous input is laid out row-major
    assert w.add(np.arange(5, dtype=">f2")) == 192  # 64 + 64 + 48, rounded up to a 64-byte boundary
    assert w.add(np.array([1, 2, 3], np.uint8)) == 320  # 192 + 64 + 10, rounded up
    blob = w.to_bytes()
    np.testing.assert_array_equal(read_chunk(blob, 64, "fp32", (4, 3)), a[:, ::2])
    np.testing.assert_array_equal(read_chunk(blob, 192, "fp16", (5,)), np.arange(5))
    assert blob == write_blob(a[:, ::2], np.arange(5, dtype=">f2"), np.array([1, 2, 3], np.uint8))[0]


def test_read_chunk_is_zero_copy():
    a = sample(np.float32, (2, 4))
    buf = bytearray(write_blob(a)[0])
    view = read_chunk(buf, 64, "fp32", (2, 4))
    assert not view.flags.writeable
    buf[128:132] = struct.pack("<f", 42.0)  # writing the buffer shows through the view
    assert view[0, 0] == 42.0
    assert read_chunk(memoryview(buf), 64, "fp32", (8,))[0] == 42.0


def test_single_fp16_file_header_bytes():
    """docs/ane-reference.md 2.1, byte by byte."""
    a = sample(np.float16, (4, 8))
    blob, (off,) = write_blob(a)
    size = a.size * 2
    assert off == 64 and len(blob) == 128 + size
    assert blob[0] == 0x01 and blob[4] == 0x02
    assert blob[64:68] == bytes([0xEF, 0xBE, 0xAD, 0xDE])
    assert blob[68] == 0x01
    assert u32(blob, 72) == size
    assert u32(blob, 80) == 128
    listed = {0, 4, 64, 65, 66, 67, 68} | set(range(72, 76)) | set(range(80, 84))
    for i in range(128):
        if i not in listed:
            assert blob[i] == 0, f"byte {i} is {blob[i]:#x}"
    assert blob[128:] == a.astype("<f2").tobytes()


def test_three_equal_chunks_offsets():
    arrays = [sample(np.float16, (16, 8)) for _ in range(3)]
    blob, offsets = write_blob(*arrays)
    cs = 64 + 16 * 8 * 2
    assert offsets == [64 + k * cs for k in range(3)]
    for k, off in enumerate(offsets):
        assert u32(blob, off) == 0xDEADBEEF and blob[off + 4] == 1
        assert u32(blob, off + 8) == 256 and u32(blob, off + 16) == off + 64
        assert blob[off + 10] == 0  # no dtype byte: it would sit inside the size field
        np.testing.assert_array_equal(read_chunk(blob, off, "fp16", (16, 8)), arrays[k])


def test_header_only_blob_has_no_chunks():
    blob = BlobWriter().to_bytes()
    assert len(blob) == 64 and read_blob(blob) == []


# ---- leniency where the reference's own blobs are lenient ----

def bench_style_blob(payload_bytes):
    """A chunk with neither size (+8) nor payload offset (+16) recorded, as some reference benches write."""
    header = bytearray(64)
    struct.pack_into("<IB", header, 0, 0xDEADBEEF, 1)
    return bytes([1, 0, 0, 0, 2]) + bytes(59) + bytes(header) + payload_bytes


def test_size_and_payload_offset_fields_may_be_zero():
    a = sample(np.float16, (3, 4))
    blob = bench_style_blob(a.tobytes())
    np.testing.assert_array_equal(read_chunk(blob, 64, "fp16", (3, 4)), a)
    expect(["chunk at 64 holds fp16 (code 1)", "declares tensor<int8, [24]> (code 4)"],   # no size, but a dtype
           read_chunk, blob, 64, "int8", (24,))
    expect(["truncated", "needs 26 bytes", "24 available"], read_chunk, blob, 64, "fp16", (13,))
    expect(["no size recorded", "64"], read_blob, blob)


# ---- every BlobError path ----

def test_blob_too_short():
    expect(["10 bytes", "64-byte file header"], read_chunk, bytes(10), 64, "fp16", (1,))
    expect(["0 bytes"], read_blob, b"")


def test_bad_file_header():
    blob = bytearray(write_blob(sample(np.float16, (2,)))[0])
    blob[4] = 3
    expect(["file header", "version", "is 3, want 2"], read_chunk, bytes(blob), 64, "fp16", (2,))
    expect(["file header", "version", "is 3, want 2"], read_blob, bytes(blob))


def test_offset_inside_file_header():
    blob = write_blob(sample(np.float16, (2,)))[0]
    expect(["offset 0", "file header", "start at 64"], read_chunk, blob, 0, "fp16", (2,))
    expect(["offset 63"], read_chunk, blob, 63, "fp16", (2,))


def test_offset_beyond_end():
    blob = write_blob(sample(np.float16, (2,)))[0]
    expect([f"offset {len(blob)}", "does not fit", f"{len(blob)} bytes"], read_chunk, blob, len(blob), "fp16", (2,))
    expect(["offset 1000", "does not fit"], read_chunk, blob, 1000, "fp16", (2,))


def test_payload_offset_instead_of_header_offset():
    blob = write_blob(sample(np.float16, (64,)))[0]
    msg = expect(["offset 128", "no chunk header", "found 0x", "want 0xdeadbeef", "chunk header (e.g. 64)",
                  "not at the payload (e.g. 128)"], read_chunk, blob, 128, "fp16", (64,))
    assert "chunk header at 64" in msg and "looks like a payload offset" in msg
    msg = expect(["offset 70", "no chunk header"], read_chunk, blob, 70, "fp16", (2,))
    assert "looks like a payload offset" not in msg


def test_payload_truncated():
    blob = write_blob(sample(np.float32, (4, 4)))[0]
    expect(["chunk at 64", "truncated", "needs 64 bytes", "offset 128", "only 63 available"],
           read_chunk, blob[:-1], 64, "fp32", (4, 4))
    expect(["chunk at 64", "truncated", "needs 64 bytes", "only 0 available"], read_blob, blob[:128])


def test_size_field_disagrees_with_shape():
    blob = write_blob(sample(np.float16, (4, 8)))[0]
    expect(["chunk at 64", "size field says 64 bytes", "fp16[4, 4] needs 32"], read_chunk, blob, 64, "fp16", (4, 4))
    expect(["size field says 64 bytes", "int16[4, 4] needs 32"],
           read_chunk, write_blob(sample(np.int16, (4, 8)))[0], 64, "int16", (4, 4))


def test_dtype_code_disagrees_with_declared_type():
    """An fp32 chunk read as fp16 of the same byte count: coremltools refuses ("Metadata data type does not
    match requested type", docs/ane-reference.md §2.5), and so do we; its twin with the right type reads."""
    a = sample(np.float32, (6,))
    blob = write_blob(a)[0]
    expect(["chunk at 64 holds fp32 (code 2)", "declares tensor<fp16, [12]> (code 1)"],
           read_chunk, blob, 64, "fp16", (12,))
    np.testing.assert_array_equal(read_chunk(blob, 64, "fp32", (6,)), a)
    patched = bytearray(blob)
    patched[68] = 9                                       # a code MILBlob has but anectypes does not read
    expect(["holds dtype code 9 (code 9)"], read_chunk, bytes(patched), 64, "fp32", (6,))


def test_payload_offset_field_before_payload():
    blob = bytearray(write_blob(sample(np.float16, (2,)))[0])
    struct.pack_into("<I", blob, 80, 100)
    expect(["chunk at 64", "payload offset field 100"], read_chunk, bytes(blob), 64, "fp16", (2,))


def test_read_blob_trailing_garbage():
    blob = write_blob(sample(np.int8, (3,)))[0]
    expect(["offset 192", "does not fit"], read_blob, blob + b"\x00" * 70)  # zero padding, then too short
    expect(["offset 131", "no chunk header"], read_blob, blob + b"\x01" * 64)


def test_unknown_read_dtype():
    blob = write_blob(sample(np.float16, (2,)))[0]
    expect(["unknown dtype 'bf16'", "fp16", "fp32", "int8", "uint8"], read_chunk, blob, 64, "bf16", (2,))


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.bool_, np.complex64])
def test_writer_refuses_other_dtypes(dtype):
    """MILBlob has no code for these (bool included: coremltools' writer has none; store uint8)."""
    expect([str(np.dtype(dtype)), "MILBlob stores float16, float32, uint8, int8, int16, uint16, int32, uint32"],
           BlobWriter().add, np.zeros(3, dtype))


@pytest.mark.parametrize("mil,dtype,code", [("int16", np.int16, 6), ("uint16", np.uint16, 7), ("int32", np.int32, 14),
                                            ("uint32", np.uint32, 15)])
def test_integer_dtypes_round_trip_with_their_codes(mil, dtype, code):
    """The codes are coremltools' (its writer, checked against ours in tests/test_mil_coremltools.py)."""
    info = np.iinfo(dtype)
    a = np.array([info.min, -1 if info.min else 1, 0, info.max], dtype)
    blob = write_blob(a)[0]
    assert struct.unpack_from("<I", blob, 68)[0] == code
    np.testing.assert_array_equal(read_chunk(blob, 64, mil, (4,)), a)


def test_writer_refuses_empty_arrays():
    expect(["empty", "(0, 3)"], BlobWriter().add, np.zeros((0, 3), np.float16))
