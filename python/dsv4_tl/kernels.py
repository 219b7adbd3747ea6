"""One spec per op: which TileLang builder makes its kernel, how the kernel is called, and what
a call of its front end resolves to.

A :class:`KernelSpec` holds, for one op (the name of ``schedules/<target>/<op>.json``, of its
tuning log, of its artifacts and of its kernel symbol):

* ``build``: the TileLang builder of ``tile_kernels/<module>.py``, which the spec's build
  function imports when a kernel is built (importing TileLang costs about a second of CPU,
  which ``import dsv4_tl`` does not pay);
* ``params``: the kernel's parameters in call order (the prim_func's; a test checks them
  against the builder), so the front ends fill kernel arguments by name;
* ``static(**call)``: the static parameters of the variant a call needs (head count,
  ragged, fp8 flavour, ...) and ``features(target_dir, **call)``: the shape-bucket features
  ``schedule_for`` picks the schedule by; ``call`` describes one call of the front end (the
  keywords of each spec below). The front ends (``dsv4_tl/ops``), ``dsv4-tl build`` and
  ``dsv4-tl tune`` (whose harnesses describe each representative input as such a call)
  derive them here; :meth:`KernelSpec.variant` does both plus the schedule lookup;
* ``feature_values(static)``: the feature values a call with those static parameters can
  have (``dsv4-tl build`` leaves out buckets that can never select a variant);
* ``aot_statics(target_dir, heads, fp8_formats)``: the build matrix, every static parameter
  set ``dsv4-tl build`` compiles ahead of time for a deployment with those head counts and
  the target's FP8 cache formats; :meth:`KernelSpec.schedules` lists the schedules each set
  is compiled with, :meth:`KernelSpec.aot_schedules` those plus ``aot_twins``' (the variants
  a front end derives from a shipped schedule, in no schedule file: the persistent decode
  grid's ``plan_from_metadata`` / ``plan_only`` and the combine's ``clamp_slots``, which
  ``sparse_decode(metadata=)`` and ``sparse_decode_metadata`` load, and a tail-split decode
  config's shipped twin, ``tail_split`` off, which ``sparse_decode`` runs at whole waves);
* ``front_ends`` / ``references``: the names of the op in ``dsv4_tl`` / ``dsv4_tl.ops`` and
  in ``dsv4_tl.reference``, which differ from the kernel's (``global_topk`` is
  ``compute_global_topk_indices_and_lens``); a test keeps them in step.

A :class:`Variant` is one compiled kernel: the op, its static parameters and its schedule.
Its :attr:`Variant.key` names the artifact file, the tuning-log entry and the build-manifest
entry, so one string identifies a kernel everywhere.

What a front end resolved (its launch plans, ``dsv4_tl/ops``) is valid until the kernels may
change: :func:`kernels_changed` empties every cache registered with
:func:`on_kernels_changed`. A new :class:`~dsv4_tl.loader.KernelLoader`,
:func:`dsv4_tl.schedules.clear_caches` (call it after swapping ``$DSV4_TL_TUNING_LOGS`` or
editing a log in a running process) and :func:`dsv4_tl.schedules.forced_schedule` call it.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

# the invalidation hooks live in a leaf, which the schedules call without importing this
# module (it reads them); both names stay importable from here
from .invalidation import kernels_changed, on_kernels_changed  # noqa: F401


# ------------------------------------------------------------------------------ helpers
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")  # = dsv4_tl.validation.FP8_FORMATS (a test keeps them equal)


# The most heads ``dsv4-tl build --heads`` and ``dsv4-tl bench --shape`` take (DSv4 has 128
# query heads): a typo such as ``--heads 10**20`` is one clear error naming the argument,
# not an overflow deep in the kernel builders.
MAX_HEADS = 1024


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): bucket features that grow with the
    input are rounded so, which bounds the memo of resolved kernels."""
    return 1 << max(0, int(n) - 1).bit_length()


def _no_features(target_dir: str, **_call) -> dict:
    return {}


def _any_feature(static: dict) -> dict:
    return {}


def _no_twins(target_dir: str, static: dict, config: dict) -> List[dict]:
    return []


def _always(static: dict, config: dict) -> bool:
    return True


# ------------------------------------------------------------------------------ the spec
@dataclass(frozen=True)
class KernelSpec:
    """Everything the package knows about one op's kernel (see the module docstring)."""

    op: str
    entry: str  # the prim_func's name = the function symbol in the compiled library
    build: Callable[..., Any]  # (**static, **schedule) -> TileLang prim_func
    params: Tuple[str, ...]  # kernel parameters in call order
    static: Callable[..., dict]  # (**call) -> static parameters
    # (target_dir, heads, fp8_formats) -> the static parameter sets built ahead of time
    aot_statics: Callable[[str, Tuple[int, ...], Tuple[str, ...]], List[dict]]
    features: Callable[..., dict] = _no_features  # (target_dir, **call) -> bucket features
    # the names ``features`` yields: all a schedule bucket may match on (raw_kernel takes
    # no other; a test holds the schedule files and ``features`` to them)
    feature_names: Tuple[str, ...] = ()
    feature_values: Callable[[dict], dict] = _any_feature  # static -> {feature: values}
    front_ends: Tuple[str, ...] = ()  # names in dsv4_tl (custom ops) and dsv4_tl.ops
    references: Tuple[str, ...] = ()  # names in dsv4_tl.reference
    # static parameter -> its kind: int (a positive integer), bool, or a tuple of the
    # accepted strings; :meth:`check_static` holds every variant to it
    static_kinds: Dict[str, Any] = None
    # schedule knobs that only the front end's launch plan reads (not the builder): left out
    # of the variant, so that changing them compiles nothing
    plan_knobs: Tuple[str, ...] = ()
    # (target_dir, static, shipped config) -> the configs a front end derives from it (knobs
    # in no schedule file), built ahead of time with it: :meth:`aot_schedules`
    aot_twins: Callable[[str, dict, dict], List[dict]] = _no_twins
    # (static, config) -> whether a front end runs that config with those static parameters
    # (False: only its ``aot_twins`` are built, e.g. decode's tail split at padded heads)
    aot_runs: Callable[[dict, dict], bool] = _always

    def check_static(self, static: dict) -> None:
        """ValueError/TypeError naming the parameter unless ``static`` has exactly this op's
        static parameters, each of its kind (a bool is not an int; a string is one of the
        listed ones): static values name artifact files, so nothing else may reach a path."""
        kinds = self.static_kinds or {}
        if set(static) != set(kinds):
            raise ValueError(f"static: {self.op} takes the static parameters "
                             f"{sorted(kinds)}, got {sorted(static)}")
        for name, kind in kinds.items():
            value = static[name]
            if kind is bool or kind is int:
                if type(value) is not kind or (kind is int and value < 1):
                    raise TypeError(f"{name}: expected a {'bool' if kind is bool else 'positive int'}"
                                    f", got {value!r}")
            elif not (type(value) is str and value in kind):
                raise ValueError(f"{name}: expected one of {kind}, got {value!r}")

    def variant(self, target_dir: str, **call) -> "Variant":
        """The variant a call described by ``call`` runs on ``target_dir``: its static
        parameters and the schedule of the bucket its features fall in."""
        from .schedules import schedule_for

        schedule = schedule_for(target_dir, self.op, **self.features(target_dir, **call))
        return Variant.make(self.op, self.static(**call), schedule)

    def admits(self, match: dict, static: dict) -> bool:
        """Whether a schedule bucket with ``match`` can select a variant with ``static``
        parameters (a feature the bucket does not name constrains nothing)."""
        from .schedules import in_range

        for feature, values in self.feature_values(static).items():
            if feature in match and not any(in_range(v, match[feature]) for v in values):
                return False
        return True

    def schedules(self, target_dir: str, static: Optional[dict] = None) -> List[dict]:
        """The distinct configs the op can run with on ``target_dir``: the schedule file's
        default, then each bucket's config in file order, where a bucket's config is its
        logged best when ``tuning_logs/<target>/<op>.jsonl`` has a valid entry for this
        TileLang version, else the file's (with a warning naming the bucket:
        :func:`dsv4_tl.schedules.schedule_for` resolves the same way at run time). With
        ``static``, buckets that can never select those static parameters (another head
        count, another scope: :meth:`admits`) are left out, so the build does not compile
        them. Depends only on the schedule files and the logs: same logs, same variants,
        same build manifest."""
        from .schedules import load_schedule_file, resolved_buckets

        configs = [dict(load_schedule_file(target_dir, self.op)["default"])]
        for bucket, config, _source in resolved_buckets(target_dir, self.op):
            admitted = static is None or self.admits(bucket["match"], static)
            if admitted and config not in configs:
                configs.append(config)
        return configs

    def aot_schedules(self, target_dir: str, static: dict) -> List[dict]:
        """The configs ``dsv4-tl build`` compiles ``static`` with: :meth:`schedules`, each
        followed by its ``aot_twins`` (the variants the front ends derive from it at run
        time, e.g. the persistent decode grid's metadata variants, a tail-split decode
        config's shipped twin), without repeats; a config no front end runs with ``static``
        (``aot_runs``: decode's tail split at padded heads) only through its twins."""
        configs = []
        for config in self.schedules(target_dir, static):
            runs = [config] if self.aot_runs(static, config) else []
            for c in (*runs, *self.aot_twins(target_dir, static, config)):
                if c not in configs:
                    configs.append(c)
        return configs


# ------------------------------------------------------------------------------ sparse decode
def _build_sparse_decode(**params):
    from .tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    return build_sparse_decode(**params)


def decode_scope(extra_block_size: Optional[int]) -> str:
    """The decode bucket feature ``scope`` of a call: ``"swa"`` without an extra cache, then by
    the extra cache's block size: 2-token blocks (C128A) ``"c128a"``, else ``"c4a"``."""
    if extra_block_size is None:
        return "swa"
    return "c128a" if extra_block_size <= 2 else "c4a"


# The CTA count a batch-invariant SWA-only decode call resolves its schedule with: above every
# bucket's lower bound, so the largest-batch bucket's (bench/PERF_NOTES.md item 67).
INVARIANT_SWA_CTAS = 1 << 30


def _decode_static(*, h: int, scope: str, fp8_format: str = "e4m3fn", **_call) -> dict:
    return dict(num_heads=h, has_extra=scope != "swa", fp8_format=fp8_format)


def _decode_features(target_dir: str, *, h: int, b: int, scope: str, s_q: int = 1,
                     batch_invariant: bool = False, extra_width: int = 0, **_call) -> dict:
    """Head count, scope, CTA count ``b * s_q * ceil(h / heads_per_block)`` (the default
    schedule's heads per CTA) and ``width``, the extra scope's index width (0 without one:
    long C128A rows, widths 4096-8192 with per-row lengths, take the persistent grid's
    balance, bench/PERF_NOTES.md item 53). Batch-invariant calls count a fixed CTA number and
    width 0 whatever the batch, so the schedule cannot follow the batch (a CTA splits its row
    by the row's own lengths): SWA-only calls count a full grid (:data:`INVARIANT_SWA_CTAS`:
    the large-batch bucket, one split a row, stored directly: a window of at most a few tiles
    gains little from splitting even alone, and at full waves this is the default schedule),
    calls with a compressed scope 1 CTA (the small-batch bucket's split-KV)."""
    from .schedules import schedule_for

    if batch_invariant:
        ctas = INVARIANT_SWA_CTAS if scope == "swa" else 1
    else:
        ctas = b * s_q * math.ceil(h / schedule_for(target_dir, "sparse_decode")["heads_per_block"])
    # (a batch-invariant row's schedule must not follow the batch's padded index width either)
    return {"ctas": ctas, "h": h, "scope": scope, "width": 0 if batch_invariant else extra_width}


def _decode_aot_statics(target_dir: str, heads: Tuple[int, ...],
                        fp8_formats: Tuple[str, ...]) -> List[dict]:
    """Each head count, without and with the extra scope, in each FP8 format."""
    return [dict(num_heads=h, has_extra=e, fp8_format=f)
            for h in heads for e in (False, True) for f in fp8_formats]


def decode_runs_persistent(config: dict, h: int) -> bool:
    """Whether a decode call with ``h`` heads and schedule ``config`` runs the persistent
    grid (the front end's test: the split or tokens-in-M consumers, whole head groups)."""
    return bool(config.get("persistent")
                and (config["warp_specialized"] or config.get("tokens_in_m"))
                and h % config["heads_per_block"] == 0)


def decode_runs_tail_split(config: dict, h: int, has_extra: bool) -> bool:
    """Whether ``config`` can run the tail-split grid for ``h`` heads (the knob on, whole head
    groups and the extra scope, as the builder requires; elsewhere the shipped variant runs)."""
    return bool(config.get("tail_split") and h % config["heads_per_block"] == 0 and has_extra)


def _decode_aot_twins(target_dir: str, static: dict, config: dict) -> List[dict]:
    """The variants ``ops/sparse_decode.py`` derives from a shipped config, exactly its
    schedules: the persistent grid's metadata variants (bench/PERF_NOTES.md item 73),
    ``plan_from_metadata`` (``sparse_decode(metadata=)``) and ``plan_only``
    (``sparse_decode_metadata``); and a tail-split config's shipped twin, ``tail_split``
    off, which a call runs where the plan gives one piece a unit or the head groups are
    padded (``tail_split_schedule``, item 77)."""
    if config.get("tail_split"):
        return [{**config, "tail_split": False}]
    if not decode_runs_persistent(config, static["num_heads"]):
        return []
    return [{**config, "plan_from_metadata": True}, {**config, "plan_only": True}]


def _decode_aot_runs(static: dict, config: dict) -> bool:
    """Whether a front end can run ``config`` with ``static`` (a tail-split config only with
    whole head groups and the extra scope: elsewhere its shipped twin runs, ``aot_twins``)."""
    return not config.get("tail_split") or decode_runs_tail_split(config, static["num_heads"],
                                                                  static["has_extra"])


def _decode_feature_values(static: dict) -> dict:
    values = {}
    if "num_heads" in static:
        values["h"] = (static["num_heads"],)
    if "has_extra" in static:
        values["scope"] = ("c4a", "c128a") if static["has_extra"] else ("swa",)
    return values


SPARSE_DECODE = KernelSpec(
    op="sparse_decode",
    entry="sparse_decode",
    build=_build_sparse_decode,
    params=("Q", "MainFp8", "MainBf16", "MainU8", "MainIndices", "MainLength",
            "ExtraFp8", "ExtraBf16", "ExtraU8", "ExtraIndices", "ExtraLength", "Sink",
            "Out", "Lse", "OPartial", "LsePartial", "RowSplits", "sm_scale",
            "main_block_size", "main_block_stride", "main_num_blocks",
            "extra_block_size", "extra_block_stride", "extra_num_blocks",
            "tiles_per_split", "num_ctas"),
    static=_decode_static,
    aot_statics=_decode_aot_statics,
    features=_decode_features,
    feature_names=("ctas", "h", "scope", "width"),
    feature_values=_decode_feature_values,
    # (sparse_decode_metadata: the persistent grid's plan, by its plan_only variant)
    front_ends=("sparse_decode", "sparse_decode_metadata"),
    references=("sparse_decode_ref",),
    static_kinds=dict(num_heads=int, has_extra=bool, fp8_format=FP8_FORMATS),
    # the persistent grid's split sizes (run-time arguments of the kernel)
    plan_knobs=("tiles_per_split_min", "invariant_tiles_per_split"),
    aot_twins=_decode_aot_twins,
    aot_runs=_decode_aot_runs,
)
"""call: ``h``, ``b``, ``s_q`` (1), ``scope`` (:func:`decode_scope`), ``batch_invariant``
(False), ``fp8_format`` ("e4m3fn")."""


# The combine's largest bound on a row's split count (its powers of two up to this) on the
# persistent grid; the front end raises the split size of longer rows to stay within it.
MAX_COMBINE_SPLITS = 128


def _build_sparse_decode_combine(**params):
    from .tile_kernels.sparse_mla.sparse_decode_combine import build_sparse_decode_combine

    return build_sparse_decode_combine(**params)


def _combine_static(*, h: int, num_splits: int, **_call) -> dict:
    return dict(num_heads=h, num_splits=num_splits)


def _combine_aot_statics(target_dir: str, heads: Tuple[int, ...],
                         fp8_formats: Tuple[str, ...]) -> List[dict]:
    """Each head count with each split count > 1 of the target's decode schedules, and the
    powers of two up to ``MAX_COMBINE_SPLITS`` when a schedule is persistent or tail-split
    (its bound on a row's splits follows the index widths, or the tail)."""
    configs = SPARSE_DECODE.schedules(target_dir)
    splits = {c["num_splits"] for c in configs} - {1}
    # (the tail-split grid's bound too: up to SMs // tail pieces, pow2-rounded)
    if any(c.get("persistent") or c.get("tail_split") for c in configs):
        splits |= {1 << i for i in range(1, MAX_COMBINE_SPLITS.bit_length())}
    splits = sorted(splits)
    return [dict(num_heads=h, num_splits=s) for h in heads for s in splits]


def _combine_aot_twins(target_dir: str, static: dict, config: dict) -> List[dict]:
    """The ``clamp_slots`` twin (the combine after a decode reading metadata) of a split
    count a persistent decode of these heads can combine (a power of two), where one can."""
    h, splits = static["num_heads"], static["num_splits"]
    if splits & (splits - 1) or splits > MAX_COMBINE_SPLITS:
        return []
    decode = SPARSE_DECODE.schedules(target_dir, dict(num_heads=h, has_extra=True))
    decode += SPARSE_DECODE.schedules(target_dir, dict(num_heads=h, has_extra=False))
    if not any(decode_runs_persistent(c, h) for c in decode):
        return []
    return [{**config, "clamp_slots": True}]


SPARSE_DECODE_COMBINE = KernelSpec(
    op="sparse_decode_combine",
    entry="sparse_decode_combine",
    build=_build_sparse_decode_combine,
    params=("OPartial", "LsePartial", "RowSplits", "Sink", "Out", "Lse"),
    static=_combine_static,
    aot_statics=_combine_aot_statics,
    front_ends=("sparse_decode",),  # the second launch of split-KV decode
    static_kinds=dict(num_heads=int, num_splits=int),
    aot_twins=_combine_aot_twins,
)
"""call: ``h``, ``num_splits`` (the decode schedule's, > 1)."""


# ------------------------------------------------------------------------------ sparse prefill
def _build_sparse_prefill(**params):
    from .tile_kernels.sparse_mla.sparse_prefill import build_sparse_prefill

    return build_sparse_prefill(**params)


def _prefill_static(*, h: int, ragged: bool = False, **_call) -> dict:
    return dict(num_heads=h, ragged=ragged)


def _prefill_aot_statics(target_dir: str, heads: Tuple[int, ...],
                         fp8_formats: Tuple[str, ...]) -> List[dict]:
    """Each head count, dense and ragged."""
    return [dict(num_heads=h, ragged=r) for h in heads for r in (False, True)]


def _prefill_features(target_dir: str, *, h: int, topk: int, ragged: bool = False,
                      **_call) -> dict:
    """Head count and row width: ``topk`` of a dense call; of a ragged call the mean row
    length (``ceil(nnz / s_q)``) rounded up to a power of two, which bounds the memo."""
    return {"h": h, "topk": pow2_ceil(topk) if ragged else topk}


def _prefill_feature_values(static: dict) -> dict:
    return {"h": (static["num_heads"],)} if "num_heads" in static else {}


SPARSE_PREFILL = KernelSpec(
    op="sparse_prefill",
    entry="sparse_prefill",
    build=_build_sparse_prefill,
    params=("Q", "KV", "Indices", "Lengths", "Sink", "Out", "MaxLogits", "Lse", "sm_scale"),
    static=_prefill_static,
    aot_statics=_prefill_aot_statics,
    features=_prefill_features,
    feature_names=("h", "topk"),
    feature_values=_prefill_feature_values,
    front_ends=("sparse_prefill", "sparse_prefill_ragged"),
    references=("sparse_prefill_ref", "sparse_prefill_ragged_ref"),
    static_kinds=dict(num_heads=int, ragged=bool),
)
"""call: ``h``, ``topk`` (dense: the index width; ragged: ``ceil(nnz / s_q)``), ``ragged``
(False)."""


# ------------------------------------------------------------------------------ dequant-gather
def _build_dequant_gather(**params):
    from .tile_kernels.dequant_gather import build_dequant_gather

    return build_dequant_gather(**params)


def _fp8_static(*, fp8_format: str = "e4m3fn", **_call) -> dict:
    return dict(fp8_format=fp8_format)


def _fp8_aot_statics(target_dir: str, heads: Tuple[int, ...],
                     fp8_formats: Tuple[str, ...]) -> List[dict]:
    """Each FP8 format (no head count)."""
    return [dict(fp8_format=f) for f in fp8_formats]


def _gather_features(target_dir: str, *, rows: int, **_call) -> dict:
    """Rows the call may write (``num_reqs * (max_tokens - offset)``), rounded up to a power
    of two."""
    return {"rows": pow2_ceil(rows)}


DEQUANT_GATHER = KernelSpec(
    op="dequant_gather",
    entry="dequant_gather",
    build=_build_dequant_gather,
    params=("Out", "CacheFp8", "CacheBf16", "CacheU8", "SeqLens", "GatherLens", "BlockTable",
            "block_size", "block_stride16", "num_blocks", "offset", "max_tokens",
            "out_stride0_8", "out_stride1_8"),
    static=_fp8_static,
    aot_statics=_fp8_aot_statics,
    features=_gather_features,
    feature_names=("rows",),
    front_ends=("dequantize_and_gather_k_cache",),
    references=("dequantize_and_gather_k_cache_ref",),
    static_kinds=dict(fp8_format=FP8_FORMATS),
)
"""call: ``rows``, ``fp8_format`` ("e4m3fn")."""


# ------------------------------------------------------------------------------ KV insert
def _build_insert_k_cache(**params):
    from .tile_kernels.insert_k_cache import build_insert_k_cache

    return build_insert_k_cache(**params)


def _insert_features(target_dir: str, *, tokens: int, **_call) -> dict:
    """Rows of the call, rounded up to a power of two."""
    return {"tokens": pow2_ceil(tokens)}


INSERT_K_CACHE = KernelSpec(
    op="insert_k_cache",
    entry="insert_k_cache",
    build=_build_insert_k_cache,
    params=("K", "SlotMapping", "Cache", "k_stride8", "block_size", "block_stride16",
            "num_slots"),
    static=_fp8_static,
    aot_statics=_fp8_aot_statics,
    features=_insert_features,
    feature_names=("tokens",),
    front_ends=("insert_k_cache",),
    references=(),  # the torch writer dsv4_tl.cache_format.insert_k defines it
    static_kinds=dict(fp8_format=FP8_FORMATS),
)
"""call: ``tokens``, ``fp8_format`` ("e4m3fn")."""


# ------------------------------------------------------------------------------ index helpers
def _build_global_topk(**params):
    from .tile_kernels.index_helpers import build_global_topk

    return build_global_topk(**params)


def _ragged_static(*, ragged: bool = False, **_call) -> dict:
    return dict(ragged=ragged)


def _ragged_aot_statics(target_dir: str, heads: Tuple[int, ...],
                        fp8_formats: Tuple[str, ...]) -> List[dict]:
    """Dense and ragged."""
    return [dict(ragged=r) for r in (False, True)]


GLOBAL_TOPK = KernelSpec(
    op="global_topk",
    entry="global_topk",
    build=_build_global_topk,
    params=("TopkIndices", "TokenToReq", "BlockTable", "IsValid", "Lens", "Indptr", "Out",
            "block_size", "phase"),
    static=_ragged_static,
    aot_statics=_ragged_aot_statics,
    front_ends=("compute_global_topk_indices_and_lens",
                "compute_global_topk_ragged_indices_and_indptr"),
    references=("compute_global_topk_indices_and_lens_ref",
                "compute_global_topk_ragged_indices_and_indptr_ref"),
    static_kinds=dict(ragged=bool),
)
"""call: ``ragged`` (False)."""


def _build_combine_topk_swa(**params):
    from .tile_kernels.index_helpers import build_combine_topk_swa

    return build_combine_topk_swa(**params)


COMBINE_TOPK_SWA = KernelSpec(
    op="combine_topk_swa",
    entry="combine_topk_swa",
    build=_build_combine_topk_swa,
    params=("TopkIndices", "QueryStartLoc", "SeqLens", "GatherLens", "Lens", "Indptr", "Out",
            "window", "compress_ratio", "topk", "M", "N", "phase"),
    static=_ragged_static,
    aot_statics=_ragged_aot_statics,
    front_ends=("combine_topk_swa_indices", "combine_topk_swa_ragged_indices"),
    references=("combine_topk_swa_indices_ref", "combine_topk_swa_ragged_indices_ref"),
    static_kinds=dict(ragged=bool),
)
"""call: ``ragged`` (False)."""


KERNELS: Dict[str, KernelSpec] = {spec.op: spec for spec in (
    SPARSE_DECODE, SPARSE_DECODE_COMBINE, SPARSE_PREFILL, DEQUANT_GATHER, INSERT_K_CACHE,
    GLOBAL_TOPK, COMBINE_TOPK_SWA)}


# ------------------------------------------------------------------------------ variants
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
        KERNELS[op].check_static(static)
        plan_knobs = KERNELS[op].plan_knobs
        schedule = {k: v for k, v in schedule.items() if k not in plan_knobs}
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
        return self.spec.build(**dict(self.static), **dict(self.schedule))
