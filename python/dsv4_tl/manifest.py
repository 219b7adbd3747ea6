"""``<kernel_dir>/<target>/manifest.json``: the record of an ahead-of-time build.

One JSON object: ``format``, ``target``, ``toolchain`` and ``kernels``, a list of provenance
records (:mod:`dsv4_tl.provenance`), one per variant. Written only through
:func:`write_manifest` (atomic), read only through :func:`read_manifest`, which turns any
damage (truncated JSON, another shape, an entry without a key) into one
:class:`CorruptManifestError` line naming the file and the command that rebuilds over it.
"""

import json
from pathlib import Path
from typing import Dict

from .file_lock import write_atomic
from .trust import MAX_JSON_BYTES, read_regular, read_trusted, show_path

MANIFEST_NAME = "manifest.json"
FORMAT = 1


class CorruptManifestError(ValueError):
    """``manifest.json`` is not a manifest this package wrote; ``dsv4-tl build`` repairs it."""


def _entries(data: object) -> Dict[str, dict]:
    """``{key: entry}`` of parsed manifest JSON; ValueError says what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got a JSON {type(data).__name__}")
    if not isinstance(data.get("target"), str):
        raise ValueError("'target' is missing or not a string")
    kernels = data.get("kernels")
    if not isinstance(kernels, list):
        raise ValueError("'kernels' is missing or not a list")
    entries = {}
    for i, entry in enumerate(kernels):
        if not isinstance(entry, dict):
            raise ValueError(f"kernels[{i}] is not an object")
        for field in ("key", "op"):
            if not isinstance(entry.get(field), str):
                raise ValueError(f"kernels[{i}] has no '{field}' string")
        entries[entry["key"]] = entry
    return entries


def read_manifest(path: Path, fix: str, root: "Path | None" = None) -> dict:
    """The parsed manifest at ``path`` with ``kernels`` as ``{key: entry}``; a missing file is
    an empty manifest (``target`` None). ``fix`` (a command) ends the error message.
    ``root``: the kernel directory it is in, whose levels are then checked as the loader
    checks them and the manifest read through the descriptor checked
    (:func:`dsv4_tl.trust.read_trusted`; an untrusted level raises
    :class:`~dsv4_tl.trust.UntrustedPathError`); without it the manifest is read as a
    regular file. Either way a FIFO, a device or a file over
    :data:`~dsv4_tl.trust.MAX_JSON_BYTES` in its place is an error, never a hang."""
    path = Path(path)
    try:
        data = (read_trusted(root, path) if root is not None
                else read_regular(path, MAX_JSON_BYTES))
        text = data.decode() if data is not None else None
    except (ValueError, UnicodeDecodeError) as exc:  # too large, not a regular file, not UTF-8
        raise CorruptManifestError(f"{show_path(path)} is unreadable ({exc}); run: {fix}") from None
    except OSError as exc:
        if root is not None:  # one line naming the level already (dsv4_tl.trust)
            raise
        raise CorruptManifestError(f"{show_path(path)} is unreadable ({exc.strerror or exc}); "
                                   f"run: {fix}") from None
    if text is None:
        return {"target": None, "toolchain": {}, "kernels": {}}
    try:
        data = json.loads(text)
        entries = _entries(data)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise CorruptManifestError(f"{show_path(path)} is corrupt ({exc}); run: {fix} "
                                   "(it rebuilds over it)") from None
    toolchain = data.get("toolchain") if isinstance(data.get("toolchain"), dict) else {}
    return {"target": data["target"], "toolchain": toolchain, "kernels": entries}


def write_manifest(path: Path, target_name: str, toolchain: dict, entries: Dict[str, dict]) -> dict:
    """Write the manifest atomically (readers see the old or the new one); return it."""
    manifest = {"format": FORMAT, "target": target_name, "toolchain": toolchain,
                "kernels": [entries[k] for k in sorted(entries)]}
    write_atomic(Path(path), (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest
