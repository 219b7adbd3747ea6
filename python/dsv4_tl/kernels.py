"""Kernel variants: which TileLang builder makes which compiled kernel.

A :class:`Variant` is one compiled kernel: the op, its static parameters (head count, index
widths, fp8 flavour, ...) and its schedule. Its :attr:`Variant.key` names the artifact file,
the tuning-log entry and the build-manifest entry, so one string identifies a kernel
everywhere.
"""

import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class KernelSpec:
    """Where the definition of ``op`` lives: ``dsv4_tl.tile_kernels.<module>.<builder>``."""

    module: str
    builder: str
    entry: str  # the prim_func's name = the function symbol in the compiled library


KERNELS: dict = {
    "sparse_decode": KernelSpec("sparse_decode", "build_sparse_decode", "sparse_decode"),
    "sparse_decode_combine": KernelSpec(
        "sparse_decode", "build_sparse_decode_combine", "sparse_decode_combine"
    ),
    "sparse_prefill": KernelSpec("sparse_prefill", "build_sparse_prefill", "sparse_prefill"),
    "dequant_gather": KernelSpec("dequant_gather", "build_dequant_gather", "dequant_gather"),
    "global_topk": KernelSpec("index_helpers", "build_global_topk", "global_topk"),
    "combine_topk_swa": KernelSpec("index_helpers", "build_combine_topk_swa", "combine_topk_swa"),
    "insert_k_cache": KernelSpec("insert_k_cache", "build_insert_k_cache", "insert_k_cache"),
}


def _canonical(items: dict) -> tuple:
    return tuple(sorted(items.items()))


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``op`` + static parameters + schedule."""

    op: str
    static: tuple
    schedule: tuple

    @classmethod
    def make(cls, op: str, static: dict, schedule: dict) -> "Variant":
        if op not in KERNELS:
            raise ValueError(f"op: unknown kernel {op!r}; known: {', '.join(sorted(KERNELS))}")
        return cls(op, _canonical(static), _canonical(schedule))

    @property
    def spec(self) -> KernelSpec:
        return KERNELS[self.op]

    @property
    def key(self) -> str:
        """Readable, file-name safe identity, e.g. ``sparse_prefill.num_heads128.ragged0.topk1152.3f2a9c1e``."""
        parts = [f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in self.static]
        digest = hashlib.sha256(json.dumps(self.schedule).encode()).hexdigest()[:8]
        return ".".join([self.op, *parts, digest])

    def as_dict(self) -> dict:
        return {"op": self.op, "static": dict(self.static), "schedule": dict(self.schedule)}

    def build(self) -> Any:
        """The TileLang prim_func of this variant (imports TileLang)."""
        module = importlib.import_module(f"dsv4_tl.tile_kernels.{self.spec.module}")
        builder: Callable = getattr(module, self.spec.builder)
        return builder(**dict(self.static), **dict(self.schedule))

