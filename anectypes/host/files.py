"""Files written so that a crash never leaves half of one: atomic replacement that reaches the disk, folders
made one by one (so that a caller can remove again what it made), and a lock file for several processes."""

import contextlib
import fcntl
import os
import secrets


def atomic_write(path, write, sync=True, mkdir=True):
    """Call write(f) on a temp file beside `path`, sync it to the disk (unless not `sync`), then os.replace it
    onto `path`; `mkdir`: create the folder if missing (else a folder that vanished stays gone).

    A reader never sees a half-written file, and a crash leaves the old file (or none) in place;
    without `sync` a power loss may leave the old one (status files, rewritten often).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if mkdir:
        os.makedirs(folder, exist_ok=True)
    # open(..., "xb") rather than mkstemp so the file gets the usual umask permissions, not 0600
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            if sync:
                to_disk(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == tmp:     # name the file asked for, not our temporary one
            raise type(e)(e.errno, e.strerror, path) from None
        raise


def to_disk(fd):
    """fsync, and on macOS F_FULLFSYNC: its fsync leaves the data in the drive's cache (fsync(2) says so)."""
    if hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:                  # a file system without it (network, FAT): fsync's promise instead
            pass
    os.fsync(fd)


@contextlib.contextmanager
def exclusive(path, busy=None):
    """An exclusive flock on the file `path` (made if missing, kept) for the block: one holder at a time among
    every process, and thread, that takes it. busy(): called once first when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if busy:
                busy()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def make_folders(path):
    """mkdir -p: the folders it made, outermost first."""
    made = []
    for p in reversed([path, *path.parents]):
        if not p.is_dir():
            with contextlib.suppress(FileExistsError):
                p.mkdir()
                made.append(p)
    return made
