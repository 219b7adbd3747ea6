"""Advisory file locks and atomic writes for directories shared by several processes.

Eight ranks of one server start together on one kernel directory: builders and just-in-time
compilers take :func:`locked` on a lock file beside what they write (so one compiles and the
others then find its result), and every file is written through :func:`write_atomic`
(a per-process temporary, then ``os.replace``), so a reader sees either the old file or the
new one, never a partial one, even without taking the lock. Both create what they write
private (0600 files in 0700 directories, :mod:`dsv4_tl.trust`) and never follow a symbolic
link at the final component.
"""

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Iterator

from .trust import PRIVATE_FILE_MODE, private_dirs

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed). Each call opens
    the file anew, so threads of one process exclude each other as processes do."""
    lock_path = Path(lock_path)
    private_dirs(lock_path.parent)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def temporary_name(path: Path) -> Path:
    """A sibling of ``path`` no other process or thread uses."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file."""
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # a leftover temporary of another mode
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
