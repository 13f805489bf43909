"""BLOBFILE weight blobs: the binary file a MIL `const` reads with BLOBFILE(path=..., offset=uint64(N)).

Layout (little-endian; docs/ane-reference.md §2, which is Apple's MILBlob storage format):
  bytes 0..63   file header: uint32 chunk count at 0, uint32 version 2 at 4, rest zero
  then chunks, each starting on a 64-byte boundary:
    +0  uint32 0xDEADBEEF magic          +4  uint32 dtype code (CODES: fp16 1, fp32 2, uint8 3, int8 4, ...)
    +8  uint64 payload size (bytes)      +16 uint64 absolute file offset of the payload
    rest of the 64-byte header zero; the raw row-major payload follows at chunk + 64.
A single fp16 tensor therefore gives exactly the reference's bytes (byte 0 = 1, byte 4 = 2, byte
68 = 1, size at 72, 128 at 80). MIL refers to a chunk by the offset of its HEADER (64 for the
first), not of its payload (128). The reader ignores the count; it refuses a dtype code other than
the declared tensor's, as coremltools' reader does (§2.5); a size of 0 means "not recorded" and a
payload offset of 0 means "right after the header".
"""

import struct

import numpy as np

from ..errors import BlobError

FILE_HEADER_SIZE = CHUNK_HEADER_SIZE = 64
MAGIC = 0xDEADBEEF
# MIL dtype -> (MILBlob dtype code, stored numpy dtype); the codes of coremltools' writer (§2.5). MILBlob
# has no bool code: store bools as uint8.
CODES = {"fp16": (1, "<f2"), "fp32": (2, "<f4"), "uint8": (3, "u1"), "int8": (4, "i1"), "int16": (6, "<i2"),
         "uint16": (7, "<u2"), "int32": (14, "<i4"), "uint32": (15, "<u4")}
_DTYPES = {name: np.dtype(t) for name, (_, t) in CODES.items()}
_NAMES = {code: name for name, (code, _) in CODES.items()}
_BY_NUMPY = {np.dtype(t).newbyteorder("<"): name for name, (_, t) in CODES.items()}


class BlobWriter:
    """Accumulates chunks; `add` returns the offset to put in the MIL text, `to_bytes` the file."""

    def __init__(self):
        self._parts = []
        self._size = FILE_HEADER_SIZE

    def add(self, array):
        a = np.asarray(array)
        name = _BY_NUMPY.get(a.dtype.newbyteorder("<"))
        if name is None:
            raise BlobError(f"cannot store dtype {a.dtype} in a blob: MILBlob stores "
                            f"{', '.join(np.dtype(t).name for _, t in CODES.values())}")
        code = CODES[name][0]
        if a.size == 0:  # a size field of 0 means "not recorded" to readers, so empty chunks would be ambiguous
            raise BlobError(f"cannot store an empty array (shape {a.shape}) in a blob")
        payload = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
        pad = bytes(-self._size % 64)            # each chunk starts on a 64-byte boundary
        offset = self._size + len(pad)
        self._parts += [pad + struct.pack("<IIQQ", MAGIC, code, len(payload), offset + CHUNK_HEADER_SIZE)
                        + bytes(CHUNK_HEADER_SIZE - 24), payload]
        self._size = offset + CHUNK_HEADER_SIZE + len(payload)
        return offset

    def to_bytes(self):
        header = struct.pack("<II", len(self._parts) // 2, 2) + bytes(FILE_HEADER_SIZE - 8)
        return b"".join([header] + self._parts)


def write_blob(*arrays):
    """One blob holding `arrays` in order: (file bytes, [MIL offset of each])."""
    w = BlobWriter()
    offsets = [w.add(a) for a in arrays]
    return w.to_bytes(), offsets


def _check_file_header(blob):
    """Validate the 64-byte file header; return the blob as a flat byte memoryview."""
    try:
        blob = memoryview(blob).cast("B")  # len() and indexing in bytes whatever the source's format
    except TypeError:
        raise BlobError(f"a blob must be bytes-like (bytes, bytearray, memoryview, numpy array), not "
                        f"{type(blob).__name__}: read the file first") from None
    if len(blob) < FILE_HEADER_SIZE:
        raise BlobError(f"blob is {len(blob)} bytes; a BLOBFILE needs at least its 64-byte file header")
    if struct.unpack_from("<I", blob, 4)[0] != 2:
        raise BlobError(f"bad file header: version (uint32 at byte 4) is "
                        f"{struct.unpack_from('<I', blob, 4)[0]}, want 2")
    return blob


def _chunk(blob, offset):
    """Validate the chunk header at `offset`; return (payload offset, size field)."""
    if not isinstance(offset, (int, np.integer)) or offset < FILE_HEADER_SIZE:
        raise BlobError(f"offset {offset!r} is inside the 64-byte file header; chunk offsets start at 64")
    prev = offset - CHUNK_HEADER_SIZE
    hint = ""
    if FILE_HEADER_SIZE <= prev <= len(blob) - 4 and struct.unpack_from("<I", blob, prev)[0] == MAGIC:
        hint = f"; there is a chunk header at {prev}, so {offset} looks like a payload offset"
    advice = "MIL offsets point at the chunk header (e.g. 64), not at the payload (e.g. 128)"
    if offset + CHUNK_HEADER_SIZE > len(blob):
        raise BlobError(f"offset {offset}: a 64-byte chunk header does not fit in a blob of {len(blob)} bytes"
                        + (f"{hint}. {advice}" if hint else ""))
    magic, code, size, payload = struct.unpack_from("<IIQQ", blob, offset)
    if magic != MAGIC:
        raise BlobError(f"offset {offset}: no chunk header (found {magic:#010x}, want 0xdeadbeef){hint}. {advice}")
    if payload == 0:  # not recorded: the payload follows the header
        payload = offset + CHUNK_HEADER_SIZE
    elif payload < offset + CHUNK_HEADER_SIZE:
        raise BlobError(f"chunk at {offset}: payload offset field {payload} points into or before its own header")
    return payload, size, code


def read_chunk(blob, offset, dtype, shape):
    """Read-only zero-copy view of the chunk whose header is at `offset` (the number in the MIL text).

    dtype is a MIL dtype name ('fp16', 'fp32', 'int8', ...: CODES).
    """
    if dtype not in _DTYPES:
        raise BlobError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    blob = _check_file_header(blob)
    payload, size, code = _chunk(blob, offset)
    shape = tuple(int(d) for d in shape)
    if code != CODES[dtype][0]:        # coremltools: "Metadata data type does not match requested type"
        raise BlobError(f"chunk at {offset} holds {_NAMES.get(code, f'dtype code {code}')} (code {code}) but the "
                        f"program declares tensor<{dtype}, {list(shape)}> (code {CODES[dtype][0]}); Apple's "
                        "reader refuses a mismatch (docs/ane-reference.md §2.5)")
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * _DTYPES[dtype].itemsize
    if size and size != nbytes:  # a size of 0 means the writer did not record it
        raise BlobError(f"chunk at {offset}: size field says {size} bytes but {dtype}{list(shape)} needs {nbytes}")
    if payload + nbytes > len(blob):
        raise BlobError(f"chunk at {offset}: payload truncated: {dtype}{list(shape)} needs {nbytes} bytes from "
                        f"offset {payload}, only {max(0, len(blob) - payload)} available")
    view = np.frombuffer(blob, dtype=_DTYPES[dtype], count=count, offset=payload).reshape(shape)
    view.flags.writeable = False  # a bytearray/memoryview source would otherwise give a writeable view
    return view


def read_blob(blob):
    """Walk and validate every chunk: [(header offset, payload offset, size in bytes), ...]."""
    blob = _check_file_header(blob)
    chunks, pos = [], FILE_HEADER_SIZE
    while pos < len(blob):
        payload, size, _ = _chunk(blob, pos)
        if size == 0:
            raise BlobError(f"chunk at {pos} has no size recorded (size field 0), so the chunks cannot be walked")
        if payload + size > len(blob):
            raise BlobError(f"chunk at {pos}: payload truncated: needs {size} bytes from offset {payload}, "
                            f"only {max(0, len(blob) - payload)} available")
        chunks.append((pos, payload, size))
        pos = payload + size
        if pos % 64 and all(b == 0 for b in blob[pos:pos + (-pos % 64)]):
            pos += -pos % 64  # MILBlob pads to 64 bytes; the reference's own blobs do not
    return chunks
