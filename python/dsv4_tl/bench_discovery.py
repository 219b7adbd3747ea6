"""Where ``dsv4-tl bench`` finds the peers it times: first where users have them, then in
the project's peer bundle.

Places, in search order (per peer, the first place that has it *and loads it* wins; every
place tried is reported, with its one-line reason when it did not serve):

1. ``vllm``: an installed vLLM. FlashMLA as vLLM builds it (the ``vllm._flashmla_C``
   extension) and vLLM's DSv4 Triton modules (``bench_peers.ROCM_MODULE``, ...). Found
   through the import system, ``importlib.util.find_spec("vllm")`` and then
   ``importlib.machinery.PathFinder`` over the package's search locations one name at a
   time, without executing any of vLLM's packages: importing ``vllm`` starts its runtime
   (platform detection, environment, plugins), which fails for reasons that have nothing to
   do with its kernels. The extension is opened with ``torch.ops.load_library``; the Triton
   files run with stand-ins for the few vLLM names they import
   (``bench_peers.VllmTritonSources``), so the kernels timed are the installed version's.
2. ``flash_mla``: an installed FlashMLA package (DeepSeek's or a fork), imported and called
   through its public ``flash_mla_with_kvcache`` / ``flash_mla_sparse_fwd`` when their
   signatures take the DSv4 arguments (FlashMLA only).
3. ``bundle``: the peer bundle (``--peers-dir`` / ``$PEERS_DIR``, made by
   ``../shared/tools/peer-bundle.sh``): the same vLLM files taken from the vLLM 0.26.0 wheel.

Versions come from the package metadata beside the package (``<name>-<version>.dist-info``)
and, for the bundle, from its ``MANIFEST.txt``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import shutil
from typing import List, Optional, Sequence, Tuple

ORIGINS = ("vllm", "flash_mla", "bundle")
# How a report names each origin (PeerSource.describe).
ORIGIN_PLACES = {"vllm": "installed vllm", "flash_mla": "installed flash_mla",
                 "bundle": "peer bundle"}
FLASHMLA_EXTENSION = "_flashmla_C"  # vLLM's FlashMLA build: vllm/_flashmla_C.abi3.so
NO_BUNDLE = "no peer bundle: pass --peers-dir or set PEERS_DIR"


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <message>"`` on one line (white space folded), with the message of
    the exception it was raised from (``torch.ops.load_library`` hides the loader's reason
    there), at most ``limit`` characters: how a failure appears in a table row."""
    text = f"{type(exc).__name__}: {exc}"
    if exc.__cause__ is not None:
        text += f" ({exc.__cause__})"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dist_version(names: Sequence[str], package_dirs: Sequence[str]) -> str:
    """Version of the distribution ``names`` (any spelling) installed beside one of
    ``package_dirs`` (its ``*.dist-info`` in the same directory), else ``"unknown"``."""
    wanted = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
    for pkg in package_dirs:
        for dist in importlib.metadata.distributions(path=[os.path.dirname(os.path.abspath(pkg))]):
            name = dist.metadata["Name"] or ""
            if re.sub(r"[-_.]+", "-", name).lower() in wanted:
                return dist.version
    return "unknown"


@dataclasses.dataclass(frozen=True)
class VllmTree:
    """A vLLM package tree that peers load files from: an installed ``vllm`` or the bundle's
    copy. ``locations``: the package's search locations (``vllm.__path__``);
    ``extension_dirs``: where ``_flashmla_C`` is looked up; ``where``: shown to the user."""

    origin: str
    version: str
    where: str
    locations: Tuple[str, ...]
    extension_dirs: Tuple[str, ...]

    def module_file(self, name: str) -> str:
        """File of module ``name`` (``"vllm.v1.attention.ops.xpu_mla_sparse"``), resolved
        one name at a time by the import system's path finder (no package is executed).
        Raises LookupError naming the first name that is not there."""
        parts = name.split(".")
        if parts[0] != "vllm":
            raise ValueError(f"module_file: {name!r} is not a vllm module")
        path = list(self.locations)
        for i, part in enumerate(parts[1:], start=2):
            spec = importlib.machinery.PathFinder.find_spec(part, path) if path else None
            if spec is None:
                raise LookupError(f"{'.'.join(parts[:i])} not found in {self.where}")
            if i == len(parts):
                if not spec.origin or not spec.has_location:
                    raise LookupError(f"{name} in {self.where} is a package without a file")
                return spec.origin
            path = list(spec.submodule_search_locations or [])
        raise AssertionError("unreachable")

    def extension_file(self) -> str:
        """File of the ``_flashmla_C`` extension (any of the interpreter's extension
        suffixes, e.g. ``.abi3.so``); raises LookupError when there is none."""
        spec = (importlib.machinery.PathFinder.find_spec(FLASHMLA_EXTENSION, list(self.extension_dirs))
                if self.extension_dirs else None)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            raise LookupError(f"no {FLASHMLA_EXTENSION} extension in {self.where}")
        return spec.origin


def _installed_spec(name: str) -> importlib.machinery.ModuleSpec:
    """The spec of top-level package ``name`` as the import system finds it (nothing is
    imported). Raises LookupError with the reason when there is none."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise LookupError(f"find_spec({name!r}) failed: {one_line(exc)}") from None
    if spec is None:
        raise LookupError(f"not installed (the import system finds no {name!r})")
    return spec


def installed_vllm() -> VllmTree:
    """The ``vllm`` package the import system finds (not imported). Raises LookupError with
    the reason when there is none."""
    spec = _installed_spec("vllm")
    locations = tuple(spec.submodule_search_locations or ())
    if not locations:
        raise LookupError(f"'vllm' at {spec.origin} is a module, not vLLM's package")
    return VllmTree("vllm", _dist_version(["vllm"], locations), locations[0], locations, locations)


def bundle_version(peers_dir: str) -> str:
    """The vLLM version the bundle's files come from (its MANIFEST.txt names the wheel)."""
    try:
        with open(os.path.join(peers_dir, "MANIFEST.txt")) as f:
            found = re.search(r"\bvllm-([0-9][^-\s]*)-", f.read())
    except OSError:
        return "unknown"
    return found.group(1) if found else "unknown"


def bundle_vllm(peers_dir: Optional[str]) -> VllmTree:
    """The bundle at ``peers_dir`` as a vLLM tree (``vllm_src/vllm`` for the Triton files,
    ``flashmla/`` for the extension). Raises LookupError when there is no bundle."""
    if not peers_dir:
        raise LookupError(NO_BUNDLE)
    if not os.path.isdir(peers_dir):
        raise LookupError(f"peer bundle not found at {peers_dir}")
    src = os.path.join(peers_dir, "vllm_src")
    spec = importlib.machinery.PathFinder.find_spec("vllm", [src]) if os.path.isdir(src) else None
    locations = tuple(spec.submodule_search_locations or ()) if spec is not None else ()
    return VllmTree("bundle", bundle_version(peers_dir), peers_dir, locations,
                    (os.path.join(peers_dir, "flashmla"),))


@dataclasses.dataclass(frozen=True)
class FlashMLAPackage:
    """An installed ``flash_mla`` package (found, not imported)."""

    version: str
    where: str


def installed_flash_mla() -> FlashMLAPackage:
    """The ``flash_mla`` package the import system finds. Raises LookupError with the reason
    when there is none."""
    spec = _installed_spec("flash_mla")
    locations = tuple(spec.submodule_search_locations or ())
    where = locations[0] if locations else spec.origin
    return FlashMLAPackage(_dist_version(["flash_mla", "flash-mla"], locations or (where,)), where)


@dataclasses.dataclass(frozen=True)
class PeerSource:
    """One place a peer is loaded from: ``origin`` (one of ``ORIGINS``), its version, the
    files the peer loads (the extension, the Triton files, or the flash_mla package dir) and
    the vLLM tree they are in (None for the flash_mla package)."""

    origin: str
    version: str
    files: Tuple[str, ...]
    tree: Optional[VllmTree] = None

    @property
    def build(self) -> str:
        """What the files are a build of: ``"vLLM <version>"`` (an installed vllm or the
        bundle: its files come from that vLLM wheel), ``"flash_mla <version>"`` (the package)."""
        return f"{'flash_mla' if self.tree is None else 'vLLM'} {self.version}"

    def describe(self) -> str:
        """One line for a report: the build, where it was found, its first file."""
        more = f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else ""
        return f"{self.build} ({ORIGIN_PLACES[self.origin]}): {self.files[0]}{more}"


def peer_sources(needs: Sequence[str], places: Sequence[Tuple[str, object]],
                 package_peer: bool) -> List[Tuple[str, object]]:
    """Per place of ``search_places`` (``(origin, VllmTree | FlashMLAPackage |
    LookupError)``, the error for a place that is absent), in order: ``(origin,
    PeerSource)`` when it has every file in ``needs`` (vLLM module names, or
    ``FLASHMLA_EXTENSION``), else ``(origin, why not)``. ``package_peer``: this peer can
    also come from the flash_mla package (otherwise that place is left out)."""
    out = []
    for origin, place in places:
        if origin == "flash_mla" and not package_peer:
            continue
        if isinstance(place, LookupError):
            out.append((origin, str(place)))
        elif isinstance(place, FlashMLAPackage):
            out.append((origin, PeerSource(origin, place.version, (place.where,))))
        else:
            try:
                files = tuple(place.extension_file() if n == FLASHMLA_EXTENSION
                              else place.module_file(n) for n in needs)
            except LookupError as exc:
                out.append((origin, str(exc)))
                continue
            out.append((origin, PeerSource(origin, place.version, files, place)))
    return out


def search_places(peers_dir: Optional[str]) -> List[Tuple[str, object]]:
    """``[(origin, VllmTree | FlashMLAPackage | LookupError)]`` in search order."""
    importlib.invalidate_caches()  # packages installed since the path finders listed a dir
    places = []
    for origin, find in (("vllm", installed_vllm), ("flash_mla", installed_flash_mla),
                         ("bundle", lambda: bundle_vllm(peers_dir))):
        try:
            places.append((origin, find()))
        except LookupError as exc:
            places.append((origin, exc))
    return places


def describe_place(origin: str, place: object) -> str:
    """One line on what was found at a place (``--peers list``'s header)."""
    if isinstance(place, LookupError):
        return f"{origin}: {place}"
    return f"{origin}: {place.where} (version {place.version})"


# ----------------------------------------------------------------------------- test layouts
def vllm_site_from_bundle(peers_dir: str, site: str) -> str:
    """Lay out the bundle's files in ``site`` as a pip install of the vLLM wheel puts them
    (``site/vllm/_flashmla_C.abi3.so``, ``site/vllm/v1/...``, ``site/vllm-<v>.dist-info``),
    with an empty ``vllm/__init__.py``: an installed vLLM limited to the files the bench
    uses, for the tests and the GPU check of discovery. Returns ``site/vllm``."""
    pkg = os.path.join(site, "vllm")
    shutil.copytree(os.path.join(peers_dir, "vllm_src", "vllm"), pkg, dirs_exist_ok=True)
    for root, _dirs, files in os.walk(pkg):
        if "__init__.py" not in files:
            open(os.path.join(root, "__init__.py"), "w").close()
    shutil.copy2(os.path.join(peers_dir, "flashmla", FLASHMLA_EXTENSION + ".abi3.so"), pkg)
    version = bundle_version(peers_dir)
    dist = os.path.join(site, f"vllm-{version}.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return pkg


if __name__ == "__main__":  # python -m dsv4_tl.bench_discovery PEERS_DIR SITE
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m dsv4_tl.bench_discovery PEERS_DIR SITE  "
                 "(lays the bundle out as an installed vllm in SITE)")
    print(vllm_site_from_bundle(sys.argv[1], sys.argv[2]))
