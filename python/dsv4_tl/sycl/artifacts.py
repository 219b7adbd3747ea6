"""SYCL artifacts of one kernel variant, and loading them.

``<key>.sycl.json`` (the artifact the build manifest hashes) holds the launch description
(:meth:`dsv4_tl.sycl.lower.SyclProgram.to_json`) plus the name and sha256 of the SPIR-V
module ``<key>.spv`` it belongs to; ``<key>.cpp`` is the SYCL source it was compiled from
(kept for reading and for rebuilding with another SYCL compiler). Loading needs dpctl and a
SYCL device, not TileLang's lowering or the compiler.
"""

import hashlib
import json
from pathlib import Path

from ..file_lock import write_atomic
from ..trust import private_dirs

ARTIFACT_SUFFIX = ".sycl.json"
MAX_SPIRV_BYTES = 1 << 30  # a kernel's module is a few hundred KiB


def kernel_symbol(key: str) -> str:
    """A C identifier unique to the variant (keys hold dots)."""
    op = key.split(".", 1)[0]
    return f"dsv4_{op}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _siblings(path: Path) -> tuple:
    stem = path.name[: -len(ARTIFACT_SUFFIX)]
    return path.with_name(stem + ".spv"), path.with_name(stem + ".cpp")


def write_artifact(func, key: str, path: Path) -> Path:
    """Lower ``func``, compile it to SPIR-V and write the three files (atomically each)."""
    from .jit import compile_to_spirv
    from .lower import lower_to_sycl

    path = Path(path)
    program = lower_to_sycl(func, kernel_symbol(key))
    spirv = compile_to_spirv(program.kernel.source)
    spv_path, cpp_path = _siblings(path)
    private_dirs(path.parent)
    meta = {"format": 1, **program.to_json(), "spirv": spv_path.name,
            "spirv_sha256": hashlib.sha256(spirv).hexdigest(), "source": cpp_path.name}
    for target, data in ((spv_path, spirv), (cpp_path, program.kernel.source.encode()),
                         (path, (json.dumps(meta, indent=1) + "\n").encode())):
        write_atomic(target, data)
    return path


def load_artifact(artifact):
    """The :class:`~dsv4_tl.sycl.runtime.SyclKernel` of ``artifact``, the launch description
    as the loader opened and verified it (a :class:`~dsv4_tl.trust.TrustedFile`): read
    through that descriptor, and its SPIR-V sibling opened and checked the same way
    (:func:`dsv4_tl.trust.open_trusted`) and read through its own descriptor, so the bytes
    hashed are the bytes run. Raises RuntimeError when the SPIR-V is missing or does not
    match the hash the description records."""
    from .runtime import SyclKernel

    meta = json.loads(artifact.read())
    spv_path = artifact.path.with_name(meta["spirv"])
    spv = artifact.sibling(spv_path.name)
    if spv is None:
        raise RuntimeError(f"{spv_path} is missing (named by {artifact.path.name})")
    with spv:
        spirv = spv.read(MAX_SPIRV_BYTES)
    if hashlib.sha256(spirv).hexdigest() != meta["spirv_sha256"]:
        raise RuntimeError(f"{spv_path} does not match the sha256 recorded "
                           f"in {artifact.path.name} (modified or partial)")
    return SyclKernel(meta, spirv)
