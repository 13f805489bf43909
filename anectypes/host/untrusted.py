"""Reading files a stranger made (a downloaded model folder, a GGUF file, a dataset): only regular files are
opened (a FIFO, socket or device is refused at once, never waited on), with a size limit, JSON is parsed with
a depth limit (Python's recursion limit, which its parser keeps to), and text with a lone surrogate is
refused; each refusal is one DataError line."""

import json
import os
import stat
import sys

from ..errors import DataError

JSON_BYTES = 16 << 20           # config.json, tokenizer_config.json, an index: kilobytes in real folders


def open_regular(path):
    """The regular file at path, open for reading in binary; a FIFO, socket or device refused (opened without
    blocking, so a FIFO without a writer does not hang the open)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{path}: not a regular file (a FIFO, socket or device is not read)")
    return os.fdopen(fd, "rb")


def read_regular(path, limit):
    """The bytes of the regular file at path, refused when it holds more than `limit`."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise DataError(f"{path}: over {limit:,} bytes, more than such a file holds")
    return data


def parse_json(data, where):
    """The JSON document in data (bytes or str), refused, naming `where`, when it is not JSON or nests
    deeper than Python's recursion limit."""
    try:
        return json.loads(data)
    except RecursionError:
        raise DataError(f"{where}: JSON nested deeper than {sys.getrecursionlimit():,} levels") from None
    except ValueError as e:                  # UnicodeDecodeError too
        raise DataError(f"{where}: not readable JSON ({str(e)[:100]})") from None


def text_of(text, where):
    """text, refused naming `where` when it holds a lone surrogate (a JSON escape such as \\ud800 alone, or
    undecodable bytes of a command line): no character, so no tokenizer encodes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: holds the lone surrogate \\u{ord(text[e.start]):04x}, which is not text") from None
    return text


def read_json(path, limit=JSON_BYTES):
    """The JSON document in the regular file at path (read_regular, parse_json)."""
    return parse_json(read_regular(path, limit), path)
