"""Who may have written a kernel directory: only this user or root.

Whatever the loader finds in a kernel directory may end up loaded as code into this process
(a shared library's constructors run on loading), and a provenance record
(:mod:`dsv4_tl.provenance`) only shows that an artifact matches what this process would
build, which anyone can compute. So, like ssh's ``StrictModes``, the loader, the builder and
the audit refuse, with one :class:`UntrustedPathError` naming the path and the fix, a kernel
directory, a subdirectory, a manifest, a record or an artifact that

* is owned by another user than this process's (root is trusted too: a root-owned system
  install or a container running as root), or
* is writable by its group or by others, or
* is a symbolic link that leads out of the kernel directory.

Nothing above the kernel directory is checked (``/tmp`` itself is world-writable). What this
package creates in a kernel directory it creates private (:func:`private_dirs`: 0700
directories; :func:`dsv4_tl.file_lock.write_atomic`: 0600 files), whatever the umask.
"""

import os
import stat
from pathlib import Path

__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "UntrustedPathError", "check_trusted",
           "private_dirs", "untrusted_reason"]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UntrustedPathError(PermissionError):
    """A kernel directory or a file in it that another user could have written."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def untrusted_reason(path: "str | Path", root: "str | Path") -> "str | None":
    """Why ``path`` (``root`` or a path below it) must not be trusted, with the fix, or None
    when it is trusted or does not exist. Checks ``path`` only (not the levels between)."""
    path, root = Path(path), Path(root)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) and path != root:
        real, base = os.path.realpath(path), os.path.realpath(root)
        if not _inside(real, base):
            return (f"{path} is a symbolic link to {real}, outside the kernel directory {base}; "
                    f"fix: remove the link (rm {path})")
    try:
        st = os.stat(path)
    except FileNotFoundError:  # a dangling link inside the directory: nothing to load
        return None
    if st.st_uid not in (os.getuid(), 0):
        return (f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}) or "
                "root: another user could have planted code there; fix: remove it, or point "
                "DSV4_TL_KERNEL_DIR at a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(name for bit, name in ((stat.S_IWGRP, "its group"),
                                                  (stat.S_IWOTH, "others")) if st.st_mode & bit)
        return (f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): anyone "
                f"who can write it could plant code this process would load; fix: chmod go-w "
                f"{path}")
    return None


def check_trusted(root: "str | Path", path: "str | Path | None" = None) -> None:
    """Raise :class:`UntrustedPathError` unless ``root`` (a kernel directory) and every level
    from it down to ``path`` (below ``root``; default ``root`` alone) are trusted (see the
    module docstring). Levels that do not exist are not checked."""
    root = Path(root)
    levels = [root]
    if path is not None:
        rel = Path(path).relative_to(root)
        for part in rel.parts:
            levels.append(levels[-1] / part)
    for level in levels:
        reason = untrusted_reason(level, root)
        if reason is not None:
            raise UntrustedPathError(f"untrusted kernel directory: {reason}")


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
