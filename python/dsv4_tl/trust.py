"""Who may have written a kernel directory: only this user or root; and reading what is in it
through the very descriptor that was checked.

Whatever the loader finds in a kernel directory may end up loaded as code into this process
(a shared library's constructors run on loading), and a provenance record
(:mod:`dsv4_tl.provenance`) only shows that an artifact matches what this process would
build, which anyone can compute. So, like ssh's ``StrictModes``, the loader, the builder and
the audit refuse, with one :class:`UntrustedPathError` naming the path and the fix, a kernel
directory, a subdirectory, a manifest, a record or an artifact that

* is owned by another user than this process's (root is trusted too: a root-owned system
  install or a container running as root), or
* is writable by its group or by others, or
* is a symbolic link (nothing at or below a kernel directory is opened through a link; the
  kernel directory itself may be reached through links: its real path is what is checked),

and a kernel directory with a level above it (up to ``/``) that is owned by another user
than this one or root, or that its group or others can write without its sticky bit (a
sticky, world-writable ``/tmp`` is fine: only an entry's owner may rename it there): whoever
can rename entries in a parent could swap the kernel directory for their own.

A check by path followed by an open of the same path leaves a window in which a swapped
entry is what gets opened. So :func:`open_trusted` opens every level from ``/`` down to the
file relative to the level above, never following a link (``O_NOFOLLOW``), checks each
descriptor (``fstat``: owner, mode, a directory or a regular file) and hands back the file's
descriptor: the loader hashes that descriptor and loads the same file
(``/proc/self/fd/N``), so what it verified is what it loads. What this package creates in a
kernel directory it creates private (:func:`private_dirs`: 0700 directories;
:func:`dsv4_tl.file_lock.write_atomic`: 0600 files), whatever the umask.
"""

import errno
import hashlib
import os
import shlex
import stat
from pathlib import Path
from typing import Optional

__all__ = ["MAX_JSON_BYTES", "PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "TrustedFile",
           "UntrustedPathError", "ancestor_reasons", "check_trusted", "open_trusted",
           "private_dirs", "read_regular", "read_trusted", "show_path", "untrusted_reason"]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# The most a manifest, a provenance record or a launch description may hold (a manifest of
# every variant of several head counts is well under 1 MiB): more is not one of ours.
MAX_JSON_BYTES = 64 << 20

# O_PATH (Linux): a level is opened to be searched and fstat-ed, whatever its read bits
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_DIR_FLAGS = _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO put in a file's place returns at once (fstat then refuses it)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# the last level of a check (a file or a directory; a link is opened as itself and refused)
_ANY_FLAGS = _O_PATH | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ABOVE, _ROOT, _BELOW = "above", "root", "below"


class UntrustedPathError(PermissionError):
    """A kernel directory or a file in it that another user could have written."""


def show_path(path: "str | Path") -> str:
    """``path`` for a one-line message: as it is, or its repr when it holds a character that
    would not print on one line (a newline, say)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _quoted(path: "str | Path") -> str:
    """``path`` as a shell word in a suggested command."""
    return shlex.quote(str(path)) if str(path).isprintable() else repr(str(path))


def _writers(mode: int) -> str:
    return " and ".join(name for bit, name in ((stat.S_IWGRP, "its group"),
                                               (stat.S_IWOTH, "others")) if mode & bit)


def _stat_reason(shown: "str | Path", st: os.stat_result, where: str,
                 root: "str | Path") -> Optional[str]:
    """Why a level with status ``st`` (an ``lstat``/``fstat``) must not be trusted, with
    the fix, or None. ``where``: above the kernel directory, the directory itself, or below."""
    p, mode = show_path(shown), st.st_mode
    if stat.S_ISLNK(mode):
        return (f"{p} is a symbolic link: nothing in a kernel directory is opened through a "
                f"link (what it points to could be swapped between the check and the load); "
                f"fix: replace the link with the file it points to")
    above = f", above the kernel directory {show_path(root)}," if where == _ABOVE else ""
    if st.st_uid not in (os.getuid(), 0):
        fix = ("point DSV4_TL_KERNEL_DIR at a directory whose parents only you and root own"
               if where == _ABOVE else "remove it, or point DSV4_TL_KERNEL_DIR at a directory "
               "of your own")
        return (f"{p}{above} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}) "
                f"or root: another user could have planted code there; fix: {fix}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (where == _ABOVE and mode & stat.S_ISVTX):
        if where == _ABOVE:
            return (f"{p}{above} is writable by {_writers(mode)} and not sticky (mode "
                    f"{stat.S_IMODE(mode):04o}): anyone who can write it could swap the kernel "
                    f"directory for their own; fix: chmod go-w {_quoted(shown)}, or point "
                    f"DSV4_TL_KERNEL_DIR at a directory whose parents only you and root can "
                    f"write")
        return (f"{p} is writable by {_writers(mode)} (mode {stat.S_IMODE(mode):04o}): anyone "
                f"who can write it could plant code this process would load; fix: chmod go-w "
                f"{_quoted(shown)}")
    return None


def _levels(root: "str | Path", path: "str | Path | None") -> list:
    """``[(name, shown, where)]`` from the first level under ``/`` down to ``path``: the
    levels of the kernel directory's real path, then ``path``'s below it (shown as given)."""
    root = Path(root)
    real = Path(os.path.realpath(root))
    levels, shown = [], Path("/")
    for name in real.parts[1:-1]:
        shown = shown / name
        levels.append((name, shown, _ABOVE))
    if real.parts[1:]:
        levels.append((real.name, root, _ROOT))
    if path is not None:
        shown = root
        for part in Path(path).relative_to(root).parts:
            shown = shown / part
            levels.append((part, shown, _BELOW))
    return levels


def _open_level(parent: int, name: str, shown: Path, flags: int) -> Optional[int]:
    """``openat(parent, name, flags)`` (never through a link); None when it does not exist.
    A link in its place is an :class:`UntrustedPathError`; a file in a directory's place or
    a level this process may not open, one OSError line naming it."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(shown):
            raise UntrustedPathError("untrusted kernel directory: " + _stat_reason(
                shown, os.lstat(shown), _BELOW, shown)) from None
        if exc.errno == errno.ENOTDIR:
            raise NotADirectoryError(f"{show_path(shown)} is not a directory (expected a "
                                     "kernel directory or a folder in one)") from None
        raise type(exc)(f"{show_path(shown)}: cannot open ({exc.strerror or exc})") from None


def _walk(root: "str | Path", path: "str | Path | None", open_file: bool) -> Optional[int]:
    """Open and check every level of ``root`` (and its ancestors) down to ``path``; return
    the descriptor of the last level (a regular file opened for reading when ``open_file``,
    else an ``O_PATH`` one of whatever it is), or None when a level does not exist (the
    levels above it are checked)."""
    levels = _levels(root, path)
    fd = os.open("/", _DIR_FLAGS)
    try:
        where = _ROOT if not levels else _ABOVE
        reason = _stat_reason("/", os.fstat(fd), where, root)
        if reason is not None:
            raise UntrustedPathError(f"untrusted kernel directory: {reason}")
        for i, (name, shown, where) in enumerate(levels):
            last = i == len(levels) - 1
            is_file = open_file and last
            flags = _FILE_FLAGS if is_file else _ANY_FLAGS if last else _DIR_FLAGS
            child = _open_level(fd, name, shown, flags)
            if child is None:
                return None
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            reason = _stat_reason(shown, st, where, root)
            if reason is None and is_file and not stat.S_ISREG(st.st_mode):
                reason = (f"{show_path(shown)} is not a regular file (mode "
                          f"{stat.filemode(st.st_mode)}); fix: remove it")
            if reason is not None:
                raise UntrustedPathError(f"untrusted kernel directory: {reason}")
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


class TrustedFile:
    """A regular file of a kernel directory opened by :func:`open_trusted` (checked through
    its descriptor); read, hash and load it through :attr:`fd` / :attr:`fd_path` only.
    ``path`` (the name it was opened by) is for messages and for its siblings."""

    def __init__(self, fd: int, root: Path, path: Path):
        self.fd, self.root, self.path = fd, Path(root), Path(path)

    @property
    def fd_path(self) -> str:
        """A name of the opened file itself, not of whatever ``path`` names now."""
        return f"/proc/self/fd/{self.fd}"

    def read(self, limit: int = MAX_JSON_BYTES) -> bytes:
        """The whole file; ValueError naming it when it holds more than ``limit`` bytes."""
        chunks, at = [], 0
        while True:
            chunk = os.pread(self.fd, min(1 << 20, limit + 1 - at), at)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            at += len(chunk)
            if at > limit:
                raise ValueError(f"{show_path(self.path)} holds more than {limit} bytes: not "
                                 "a file of this package")

    def sha256(self) -> str:
        digest, at = hashlib.sha256(), 0
        while True:
            chunk = os.pread(self.fd, 1 << 20, at)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)
            at += len(chunk)

    def sibling(self, name: str) -> Optional["TrustedFile"]:
        """The file ``name`` beside this one, opened and checked the same way (None if absent)."""
        return open_trusted(self.root, self.path.with_name(name))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "TrustedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def open_trusted(root: "str | Path", path: "str | Path") -> Optional[TrustedFile]:
    """The regular file ``path`` (below the kernel directory ``root``) opened once, with every
    level from ``/`` down to it checked through its descriptor (module docstring); None when
    it or a directory above it does not exist. Raises :class:`UntrustedPathError` naming the
    level and the fix, NotADirectoryError / PermissionError in one line naming the level for
    a file in a directory's place or a level this process may not open."""
    fd = _walk(root, path, open_file=True)
    return None if fd is None else TrustedFile(fd, root, path)


def read_trusted(root: "str | Path", path: "str | Path",
                 limit: int = MAX_JSON_BYTES) -> Optional[bytes]:
    """The bytes of ``path`` as :func:`open_trusted` opens it (None when absent); at most
    ``limit`` of them (ValueError naming the file beyond)."""
    opened = open_trusted(root, path)
    if opened is None:
        return None
    with opened:
        return opened.read(limit)


def read_regular(path: "str | Path", limit: int) -> Optional[bytes]:
    """The bytes of ``path`` when it is a regular file (None when absent) of at most ``limit``
    bytes, following links: a FIFO, a device or a folder in its place, or a larger file, is a
    ValueError naming it (a FIFO never blocks the reader, ``/dev/zero`` never fills memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with TrustedFile(fd, Path(path).parent, Path(path)) as opened:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{show_path(path)} is not a regular file (mode "
                             f"{stat.filemode(st.st_mode)})")
        return opened.read(limit)


def untrusted_reason(path: "str | Path", root: "str | Path") -> "str | None":
    """Why ``path`` (``root`` or a path below it) must not be trusted, with the fix, or None
    when it is trusted or does not exist. Checks ``path`` only (not the levels between; the
    audit's view: :func:`check_trusted` and :func:`open_trusted` check every level)."""
    path, root = Path(path), Path(root)
    try:
        st = os.lstat(path) if path != root else os.stat(path)
    except FileNotFoundError:
        return None
    return _stat_reason(path, st, _ROOT if path == root else _BELOW, root)


def ancestor_reasons(root: "str | Path") -> list:
    """:func:`untrusted_reason` of each level above the kernel directory ``root``'s real path."""
    reasons = []
    for _name, shown, where in _levels(root, None):
        if where == _ABOVE:
            reason = _stat_reason(shown, os.stat(shown), _ABOVE, root)
            if reason is not None:
                reasons.append(reason)
    return reasons


def check_trusted(root: "str | Path", path: "str | Path | None" = None) -> None:
    """Raise :class:`UntrustedPathError` unless ``root`` (a kernel directory), every level
    above it and every level from it down to ``path`` (below ``root``; default ``root``
    alone) are trusted (see the module docstring). Levels that do not exist are not
    checked. (What is then read is read through :func:`open_trusted`.)"""
    fd = _walk(root, path, open_file=False)
    if fd is not None:
        os.close(fd)


def private_dirs(path: "str | Path") -> Path:
    """Create ``path`` and its missing parents, each created one 0700 whatever the umask
    (existing levels are left as they are); return ``path``."""
    path = Path(path)
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        if level.parent == level:
            break
        level = level.parent
    for level in reversed(missing):
        try:
            level.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(level, PRIVATE_DIR_MODE)  # the umask may have taken the owner's bits
    return path
