"""Advisory file locks and atomic writes for directories shared by several processes.

Eight ranks of one server start together on one kernel directory: builders and just-in-time
compilers take :func:`locked` on a lock file beside what they write (so one compiles and the
others then find its result), and every file is written through :func:`write_atomic`
(a per-process temporary, then ``os.replace``), so a reader sees either the old file or the
new one, never a partial one, even without taking the lock.
"""

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed). Each call opens
    the file anew, so threads of one process exclude each other as processes do."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
