"""Peer implementations that ``dsv4-tl bench`` times beside dsv4_tl.

They come from an installed vLLM, an installed FlashMLA package or the peer bundle
(``../shared/tools/peer-bundle.sh``, unpacked to ``$PEERS_DIR``: files taken unmodified from
the vLLM 0.26.0 wheel), searched in that order (``bench_discovery``); none of their code is
in this repository:

- ``flashmla``: FlashMLA's sparse decode and prefill through ``torch.ops._flashmla_C``
  (vLLM's build), or through the ``flash_mla`` package's public functions; below 64 heads
  with q padded to 64 heads, as vLLM 0.26 calls it.
- ``flashmla.native`` (an entry of the ``flashmla`` peer, prefill below 64 heads only): the
  same op given the real heads, which builds that take them run natively (vLLM 0.33's has a
  16 / 32-head kernel on sm90; 0.26's refuses them). Its row says "not supported by <build>"
  where the loaded build refuses the call (:class:`NotSupported`).
- ``tri_rocm``: vLLM's ROCm DSv4 Triton kernels, single-pass ragged decode and prefill (the
  path vLLM takes on GPUs it has not tuned for).
- ``tri_rocm_splitk``: the same file's split-K decode (partial + reduce kernels, the path
  vLLM tunes for gfx942/gfx950), selected through the module's ``_ON_GFX950`` switch.
- ``tri_xpu``: vLLM's XPU DSv4 path: dequant-gather of the selected slots into a BF16
  workspace, then the BF16 sparse-MLA Triton kernel (decode and prefill).
- ``tri_vllm``: vLLM's Triton ``dequantize_and_gather_k_cache`` (gather).
- ``tri_xpu_slots``: vLLM XPU's per-slot dequant-gather kernel (gather).

The Triton files import a handful of vLLM modules; :class:`VllmTritonSources` provides
minimal stand-ins for exactly those names while it executes the files and takes them out of
``sys.modules`` again afterwards, so a real vLLM in the same process is left alone.

Every peer takes bench.py's input dicts (``decode_inputs`` / ``prefill_inputs`` /
``gather_inputs``) and returns, per input set, a zero-argument callable that launches the
work being timed and returns the outputs in dsv4_tl's conventions (``out [b, 1, h, 512]`` and
``lse`` for decode; ``(out, max_logits, lse)`` for prefill), with ``None`` for an output the
peer does not produce. Conversions that vLLM performs outside its attention op (building
index metadata once per step) happen when the callable is made, outside the timed region;
work that vLLM's op does on every call stays inside the callable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import linecache
import math
import sys
import types
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import bench_discovery
from .bench_discovery import FLASHMLA_EXTENSION, PeerSource, one_line
from .cache_format import HEAD_DIM, NOPE_DIM, ROPE_DIM

SCALE = HEAD_DIM ** -0.5
FP8_E4M3_MAX = 448.0
# Width multiple the XPU BF16 sparse-MLA kernel requires of its index rows (its BLOCK_N).
XPU_INDEX_ALIGN = 16

PEER_NAMES = ("flashmla", "tri_rocm", "tri_rocm_splitk", "tri_xpu", "tri_vllm", "tri_xpu_slots")

# The four Triton files, by module name (in an installed vllm, or under <peers_dir>/vllm_src).
ROCM_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
XPU_ATTENTION_MODULE = "vllm.v1.attention.ops.xpu_mla_sparse"
XPU_DECODE_MODULE = "vllm.models.deepseek_v4.xpu.xpu_sparse_decode_fp8"
CACHE_UTILS_MODULE = "vllm.models.deepseek_v4.common.ops.cache_utils"

SourceTransform = Callable[[str], str]
LocateModule = Callable[[str], str]
MakeCall = Callable[[dict], Callable[[], tuple]]


# ----------------------------------------------------------------------------- index conversions
def csr_from_dense(indices: torch.Tensor,
                   lengths: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged (CSR) form of dense index rows, as vLLM's ROCm backend feeds its kernels.

    indices: [n, ..., width] int32 (trailing dims flattened per row); lengths: [n] int32 or
    None (= every column). Row i keeps its first ``clamp(lengths[i], 0, width)`` entries in
    order; values are not filtered (-1 holes and out-of-range slots stay, the kernels skip
    them). Returns ``(flat [nnz] int32, indptr [n + 1] int32)``.
    """
    rows = indices.reshape(indices.shape[0], -1)
    n, width = rows.shape
    if lengths is None:
        lens = torch.full((n,), width, dtype=torch.int64, device=rows.device)
    else:
        lens = lengths.to(device=rows.device, dtype=torch.int64).clamp(0, width)
    keep = torch.arange(width, device=rows.device)[None, :] < lens[:, None]
    indptr = torch.zeros(n + 1, dtype=torch.int32, device=rows.device)
    indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return rows[keep].to(torch.int32).contiguous(), indptr


def xpu_combined_indices(topk_lens: Optional[torch.Tensor], topk_width: int,
                         swa_lens: torch.Tensor, swa_width: int) -> torch.Tensor:
    """Workspace index table of vLLM's XPU decode.

    The XPU path gathers, per token t, ``topk_width`` compressed slots then ``swa_width`` SWA
    slots into workspace rows ``t*K .. t*K + K - 1`` (``K = topk_width + swa_width``). Row t
    of the table lists the in-length rows packed to the front,
    ``[t*K + j for j < topk_lens[t]] + [t*K + topk_width + j for j < swa_lens[t]]``, then -1,
    its width rounded up to a multiple of 16 (``XPU_INDEX_ALIGN``). vLLM builds it inside its
    op with a host loop over tokens; this is the same table built on the device without one.
    topk_lens: [b] int32 or None (no compressed scope; topk_width must be 0).
    Returns ``[b, 1, width] int32``.
    """
    b = swa_lens.shape[0]
    dev = swa_lens.device
    tlen = (torch.zeros(b, dtype=torch.int64, device=dev) if topk_lens is None
            else topk_lens.to(device=dev, dtype=torch.int64).clamp(0, topk_width))
    slen = swa_lens.to(torch.int64).clamp(0, swa_width)
    total = tlen + slen
    longest = int(total.max()) if b else 0
    width = -(-longest // XPU_INDEX_ALIGN) * XPU_INDEX_ALIGN
    pos = torch.arange(width, device=dev)[None, :]
    base = (torch.arange(b, device=dev) * (topk_width + swa_width))[:, None]
    in_topk = pos < tlen[:, None]
    in_swa = ~in_topk & (pos < total[:, None])
    table = torch.where(in_topk, base + pos, base + topk_width + pos - tlen[:, None])
    table = torch.where(in_topk | in_swa, table, torch.full_like(table, -1))
    return table.to(torch.int32).view(b, 1, width).contiguous()


def gather_slot_list(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                     rows: int) -> torch.Tensor:
    """Global slots of tokens ``0 .. rows - 1`` of every request, flattened request-major
    (``slot = block_table[r, pos // bs] * bs + pos % bs``): the explicit slot list the XPU
    per-slot gather kernel takes. Every request must hold exactly ``rows`` tokens (the
    kernel writes one output row per listed slot). Returns ``[num_reqs * rows] int32``."""
    if bool((seq_lens != rows).any()):
        raise ValueError(f"gather_slot_list: every request must hold exactly {rows} tokens, "
                         f"got seq_lens {seq_lens.tolist()}")
    pos = torch.arange(rows, device=block_table.device)
    blocks = block_table[:, pos // block_size].long()
    return (blocks * block_size + pos % block_size).reshape(-1).to(torch.int32).contiguous()


def apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """Add the attention sink to an output normalised without it.

    out: [n, h, d] (softmax over the keys only); lse: [n, h] natural log over the keys.
    With the sink in the denominator the output becomes ``out * e^lse / (e^lse + e^sink)
    = out * sigmoid(lse - sink)``. Returns a tensor of out's dtype.
    """
    if attn_sink is None:
        return out
    return (out.float() * torch.sigmoid(lse - attn_sink.float()[None, :])[..., None]).to(out.dtype)


# ----------------------------------------------------------------------------- vLLM file loader
class _Platform:
    """What the Triton files ask of ``vllm.platforms.current_platform``: a CUDA device whose
    FP8 flavour is OCP e4m3fn."""

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def is_fp8_fnuz(self) -> bool:
        return False

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


def _not_in_bundle(*_args, **_kwargs):
    raise RuntimeError("this vLLM function is not part of the peer bundle (stand-in called)")


def _stand_in_attributes() -> Dict[str, dict]:
    """Module name -> attributes for every vLLM name the four Triton files import at module
    level. Functions the DSv4 kernels never reach raise when called."""
    import triton
    import triton.language as tl

    return {
        "vllm.envs": {},
        "vllm.compilation.breakable_cudagraph": {"eager_break_during_capture": lambda fn: fn},
        "vllm.forward_context": {"get_forward_context": _not_in_bundle},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.triton_utils": {"triton": triton, "tl": tl,
                              "LOG2E": 1.4426950408889634, "LOGE2": 0.6931471805599453},
        "vllm.utils.torch_utils": {"LayerNameType": str},
        "vllm.utils.import_utils": {"has_cutedsl": lambda: False},  # -> the Triton gather
        "vllm.v1.attention.backends.mla.indexer": {
            "DeepseekV32IndexerMetadata": type("DeepseekV32IndexerMetadata", (), {})},
        "vllm.v1.attention.ops.common": {"pack_seq_triton": _not_in_bundle,
                                         "unpack_seq_triton": _not_in_bundle},
        "vllm.v1.worker.workspace": {"current_workspace_manager": _not_in_bundle},
        "vllm.model_executor.layers.quantization.utils.quant_utils": {
            "get_fp8_min_max": lambda: (-FP8_E4M3_MAX, FP8_E4M3_MAX)},
    }


class VllmTritonSources:
    """Executes vLLM's Triton files as modules, each once.

    locate: module name -> its file (``bench_discovery.VllmTree.module_file`` of an installed
    vllm or of the bundle). transform: optional rewrite of each file's text before it runs
    (the CPU interpreter check swaps bf16 for fp16); None runs the files exactly as shipped.
    """

    def __init__(self, locate: LocateModule, transform: Optional[SourceTransform] = None):
        self.locate = locate
        self.transform = transform
        self.modules: Dict[str, types.ModuleType] = {}

    def module(self, name: str) -> types.ModuleType:
        """The executed module ``name`` (e.g. ``ROCM_MODULE``); raises what loading raised."""
        if name not in self.modules:
            with self._vllm_namespace():
                self.modules[name] = self._execute(name)
        return self.modules[name]

    def _execute(self, name: str) -> types.ModuleType:
        path = self.locate(name)
        with open(path) as f:
            text = f.read()
        filename = path
        if self.transform is not None:
            text = self.transform(text)
            # Triton reads kernel sources through linecache: give the rewritten text its own name.
            filename = path + ".transformed"
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        mod = types.ModuleType(name)
        mod.__file__ = filename
        sys.modules[name] = mod  # visible to the file's own imports while it runs
        exec(compile(text, filename, "exec"), mod.__dict__)
        return mod

    @contextlib.contextmanager
    def _vllm_namespace(self) -> Iterator[None]:
        """Stand-in vLLM packages plus the files loaded so far, in ``sys.modules`` only
        for the duration; whatever was there before is put back."""
        saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
        for k in saved:
            del sys.modules[k]
        try:
            for name, attrs in _stand_in_attributes().items():
                mod = self._package(name)
                for key, value in attrs.items():
                    setattr(mod, key, value)
            for name in (ROCM_MODULE, XPU_ATTENTION_MODULE, XPU_DECODE_MODULE, CACHE_UTILS_MODULE):
                self._package(name.rpartition(".")[0])
            for name, mod in self.modules.items():
                sys.modules[name] = mod
                setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], mod)
            yield
        finally:
            for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
                del sys.modules[k]
            sys.modules.update(saved)

    @staticmethod
    def _package(name: str) -> types.ModuleType:
        """Empty package ``name`` and its parents in ``sys.modules`` (existing ones kept)."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            full = ".".join(parts[:i])
            if full not in sys.modules:
                mod = types.ModuleType(full)
                mod.__path__ = []
                sys.modules[full] = mod
                if i > 1:
                    setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)
        return sys.modules[name]


# ----------------------------------------------------------------------------- peers
FLASHMLA_DECODE_HEADS = (64, 128)  # the head counts its sparse decode takes
FLASHMLA_PREFILL_HEADS = 64  # its sparse prefill takes a multiple of 64 heads (vLLM 0.26)
# FlashMLA's prefill given fewer heads unpadded; "flashmla" stays the padded call, the one
# committed reports and scripts/bench_compare.py have always meant by that name.
FLASHMLA_NATIVE = "flashmla.native"
FLASHMLA_IMPLS = ("flashmla", FLASHMLA_NATIVE)  # the bench's ratios use the faster that ran
# What a FlashMLA build raises when it refuses a call's shape (TORCH_CHECK: RuntimeError;
# c10::ValueError, c10::NotImplementedError; a flash_mla package's Python wrapper: assert).
REFUSALS = (RuntimeError, ValueError, NotImplementedError, AssertionError)


class NotSupported(Exception):
    """The peer's loaded build refuses this shape: a note in the bench's row, not an error."""


class FlashMLAPeer:
    """FlashMLA's sparse kernels through ``torch.ops._flashmla_C``, vLLM's build of FlashMLA
    (in vLLM 0.26 its sparse decode also takes the output buffer).

    Prefill below 64 heads has two entries (:meth:`variants`): ``flashmla``, q padded to 64
    heads (:meth:`prefill`), and ``flashmla.native``, the real heads passed straight
    (:meth:`prefill_native`), where the build takes them."""

    name = "flashmla"
    suites = ("decode", "prefill")
    needs = (FLASHMLA_EXTENSION,)

    def __init__(self, source: PeerSource, sources: Optional[VllmTritonSources] = None):
        self.source = source
        # (q shape, indices shape, lengths given) -> None (native prefill taken) or why not
        self._native_refusals: Dict[tuple, Optional[str]] = {}
        self._open(source)

    def _open(self, source: PeerSource) -> None:
        if torch.cuda.is_available():
            torch.cuda.init()  # libcuda must be resident before the extension is opened
        torch.ops.load_library(source.files[0])
        self.ops = torch.ops._flashmla_C
        absent = [op for op in ("sparse_decode_fwd", "sparse_prefill_fwd") if not hasattr(self.ops, op)]
        if absent:
            raise RuntimeError(f"{source.files[0]} registers no _flashmla_C.{', '.join(absent)} "
                               "(not a DSv4 build of FlashMLA)")

    def call_decode(self, state: dict, q, k_cache, indices, lengths, sink, extra,
                       extra_indices, extra_lengths, out) -> tuple:
        """One sparse decode call, FlashMLA's op bare (k caches ``[blocks, bs, 1, 584]``);
        ``state`` (a dict, empty at first) keeps the scheduler metadata between calls.
        Returns ``(out, lse)``."""
        o, lse, state["meta"], state["splits"] = self.ops.sparse_decode_fwd(
            q, k_cache, indices, lengths, sink, state.get("meta"), state.get("splits"), extra,
            extra_indices, extra_lengths, HEAD_DIM, SCALE, out)
        return o, lse

    def call_prefill(self, q, kv, indices, sink, lengths) -> tuple:
        """One sparse prefill call, FlashMLA's op bare. Returns ``(out, max_logits, lse)``."""
        return tuple(self.ops.sparse_prefill_fwd(q, kv, indices, SCALE, HEAD_DIM, sink, lengths,
                                                 None))

    def decode(self, x: dict) -> Callable[[], tuple]:
        q, sink = x["q"], x["attn_sink"]
        h = q.shape[2]
        padded = FLASHMLA_DECODE_HEADS[0] if h < FLASHMLA_DECODE_HEADS[0] else h
        if padded != h:
            # FlashMLA takes 64 or 128 heads: pad as vLLM does (zero q heads, -inf sink),
            # once, outside the timed call; the outputs are views of the real heads.
            q = torch.cat([q, q.new_zeros(q.shape[:2] + (padded - h, q.shape[3]))], 2)
            sink = torch.cat([sink, sink.new_full((padded - h,), -math.inf)])
        out = torch.empty_like(q)
        # Scheduler metadata: filled by the first call, reused while shapes and lengths stay.
        state = {}
        extra = x["extra_k_cache"]
        k_cache = x["k_cache"].unsqueeze(-2)
        extra = None if extra is None else extra.unsqueeze(-2)

        def run():
            o, lse = self.call_decode(state, q, k_cache, x["indices"], x["topk_length"], sink,
                                         extra, x["extra_indices"], x["extra_topk_length"], out)
            return o[:, :, :h], lse[:, :h]
        return run

    def variants(self, suite: str, x: dict) -> Dict[str, MakeCall]:
        """Entries besides ``flashmla`` for ``suite`` on input sets like ``x``: the native
        prefill call below 64 heads (the padded one may still be faster: the bench times
        both); none for decode, which always pads."""
        if suite == "prefill" and x["q"].shape[1] < FLASHMLA_PREFILL_HEADS:
            return {FLASHMLA_NATIVE: self.prefill_native}
        return {}

    def prefill_native(self, x: dict) -> Callable[[], tuple]:
        """FlashMLA's prefill given q and the sink as they are (no padding). Whether the
        loaded build takes the shape is decided once per shape, by one call made here,
        outside the timed call; a refusal raises :class:`NotSupported` naming the build."""
        q, sink = x["q"], x["attn_sink"]
        key = (tuple(q.shape), tuple(x["indices"].shape), x["topk_length"] is None)
        if key not in self._native_refusals:
            try:
                self.call_prefill(q, x["kv"], x["indices"], sink, x["topk_length"])
                self._native_refusals[key] = None
            except REFUSALS as exc:
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise  # not a refusal of the shape
                self._native_refusals[key] = one_line(exc)
        refusal = self._native_refusals[key]
        if refusal is not None:
            raise NotSupported(f"not supported by {self.source.build}: {refusal}")
        return lambda: self.call_prefill(q, x["kv"], x["indices"], sink, x["topk_length"])

    def prefill(self, x: dict) -> Callable[[], tuple]:
        """FlashMLA's prefill; below 64 heads q padded to 64 heads, as vLLM 0.26 does."""
        q, sink = x["q"], x["attn_sink"]
        h = q.shape[1]
        if h >= FLASHMLA_PREFILL_HEADS:
            return lambda: self.call_prefill(q, x["kv"], x["indices"], sink, x["topk_length"])
        # Fewer heads (tensor parallelism): padded to 64 as vLLM does, once, outside the timed
        # call; the outputs are views of the real heads.
        pad = FLASHMLA_PREFILL_HEADS - h
        q = torch.cat([q, q.new_zeros((q.shape[0], pad, q.shape[2]))], 1)
        sink = torch.cat([sink, sink.new_full((pad,), -math.inf)])

        def run():
            out, max_logits, lse = self.call_prefill(q, x["kv"], x["indices"], sink,
                                                        x["topk_length"])
            return out[:, :h], max_logits[:, :h], lse[:, :h]
        return run


# The DSv4 arguments a flash_mla package's entry points must take (DeepSeek's FlashMLA
# since its DSv4 release, and the forks that keep its sm90 kernels).
FLASH_MLA_DSV4_ARGS = {
    "flash_mla_with_kvcache": ("indices", "attn_sink", "extra_k_cache",
                               "extra_indices_in_kvcache", "topk_length", "extra_topk_length"),
    "flash_mla_sparse_fwd": ("attn_sink", "topk_length"),
}


class FlashMLAPackagePeer(FlashMLAPeer):
    """FlashMLA through an installed ``flash_mla`` package: ``flash_mla_with_kvcache`` with
    its scheduler metadata from ``get_mla_metadata()`` (made per input set, reused across
    calls as an engine does within a step) and ``flash_mla_sparse_fwd``; the package's
    Python wrappers run inside the timed call, as they do for its users."""

    needs = ()

    def _open(self, source: PeerSource) -> None:
        pkg = importlib.import_module("flash_mla")
        for fn, args in FLASH_MLA_DSV4_ARGS.items():
            if not callable(getattr(pkg, fn, None)):
                raise RuntimeError(f"flash_mla {source.version} at {source.files[0]} has no {fn}")
            params = inspect.signature(getattr(pkg, fn)).parameters
            absent = [a for a in args if a not in params]
            if absent:
                raise RuntimeError(f"flash_mla.{fn} ({source.version}) takes no {', '.join(absent)} "
                                   "(not a DSv4 FlashMLA)")
        if not callable(getattr(pkg, "get_mla_metadata", None)):
            raise RuntimeError(f"flash_mla {source.version} has no get_mla_metadata")
        self.pkg = pkg

    def call_decode(self, state: dict, q, k_cache, indices, lengths, sink, extra,
                       extra_indices, extra_lengths, out) -> tuple:
        if "meta" not in state:
            state["meta"] = self.pkg.get_mla_metadata()[0]
        return self.pkg.flash_mla_with_kvcache(
            q, k_cache, None, None, HEAD_DIM, state["meta"], None, softmax_scale=SCALE,
            causal=False, is_fp8_kvcache=True, indices=indices, attn_sink=sink,
            extra_k_cache=extra, extra_indices_in_kvcache=extra_indices, topk_length=lengths,
            extra_topk_length=extra_lengths)

    def call_prefill(self, q, kv, indices, sink, lengths) -> tuple:
        return tuple(self.pkg.flash_mla_sparse_fwd(q, kv, indices, SCALE, HEAD_DIM,
                                                   attn_sink=sink, topk_length=lengths))


class TritonRocmPeer:
    """vLLM's ROCm DSv4 Triton attention: single-pass ragged decode and prefill.

    vLLM's metadata builder hands these kernels CSR indices built once per step, so the
    dense -> CSR conversion is done when the call is made, outside the timed region. The
    kernels apply the sink like dsv4_tl; they return no LSE / max_logits (checked: out only).
    """

    name = "tri_rocm"
    suites = ("decode", "prefill")
    split_k = False

    needs = (ROCM_MODULE,)

    def __init__(self, source: PeerSource, sources: VllmTritonSources):
        self.source = source
        self.m = sources.module(ROCM_MODULE)

    def decode(self, x: dict) -> Callable[[], tuple]:
        m, q = self.m, x["q"]
        b, s_q, h, d = q.shape
        if s_q != 1:
            raise ValueError(f"{self.name}: decode takes one query per request, got s_q {s_q}")
        q3 = q.view(b, h, d)
        main, main_ptr = csr_from_dense(x["indices"], x["topk_length"])
        extra_cache = x["extra_k_cache"]
        extra = extra_ptr = None
        if extra_cache is not None:
            extra, extra_ptr = csr_from_dense(x["extra_indices"], x["extra_topk_length"])

        def run():
            m._ON_GFX950 = self.split_k  # the module's switch between the two decode paths
            try:
                o = m._rocm_sparse_attn_decode_ragged_triton(
                    q3, x["k_cache"], main, main_ptr, SCALE, x["attn_sink"], NOPE_DIM, ROPE_DIM,
                    extra_cache=extra_cache, extra_indices=extra, extra_indptr=extra_ptr)
            finally:
                m._ON_GFX950 = False
            return o.view(b, 1, h, d), None
        return run

    def prefill(self, x: dict) -> Callable[[], tuple]:
        flat, indptr = csr_from_dense(x["indices"], x["topk_length"])
        kv2 = x["kv"].view(x["kv"].shape[0], HEAD_DIM)
        return lambda: (self.m._rocm_sparse_attn_prefill_ragged_triton(
            x["q"], kv2, flat, indptr, SCALE, x["attn_sink"], NOPE_DIM, ROPE_DIM), None, None)


class TritonRocmSplitKPeer(TritonRocmPeer):
    """vLLM's ROCm split-K decode (partial + reduce kernels, split count from its
    heuristic with this GPU's SM count); decode only."""

    name = "tri_rocm_splitk"
    suites = ("decode",)
    split_k = True


class TritonXpuPeer:
    """vLLM's XPU DSv4 path: FP8 slots dequantised into a BF16 workspace, then the BF16
    sparse-MLA Triton kernel.

    That kernel has no sink and no lengths. vLLM's XPU decode ignores the sink; here it is
    applied afterwards from the returned LSE (:func:`apply_sink`, inside the timed call) so
    the result is comparable. Decode, per call as in vLLM's op: two gathers into scratch
    buffers, their copy into the workspace, attention. Its index table (built in vLLM's op
    with a per-token host loop that cannot run in a CUDA graph) depends only on the lengths
    and is built once, outside the timed call. Prefill: vLLM's index producer already writes
    -1 past each row's length, so that masking is done outside the timed call. A -1 hole
    inside a length would be attended as a zero key by this path (the bench has none).
    """

    name = "tri_xpu"
    suites = ("decode", "prefill")

    needs = (XPU_ATTENTION_MODULE, XPU_DECODE_MODULE)

    def __init__(self, source: PeerSource, sources: VllmTritonSources):
        self.source = source
        self.attn = sources.module(XPU_ATTENTION_MODULE)
        self.gather = sources.module(XPU_DECODE_MODULE)

    def decode(self, x: dict) -> Callable[[], tuple]:
        q = x["q"]
        b, s_q, h, d = q.shape
        if s_q != 1:
            raise ValueError(f"{self.name}: decode takes one query per request, got s_q {s_q}")
        q3 = q.view(b, h, d)
        swa_slots = x["indices"].reshape(b, -1).contiguous()
        swa_width = swa_slots.shape[1]
        extra_cache = x["extra_k_cache"]
        topk_slots = None if extra_cache is None else x["extra_indices"].reshape(b, -1).contiguous()
        topk_width = 0 if topk_slots is None else topk_slots.shape[1]
        swa_lens = (x["topk_length"] if x["topk_length"] is not None
                    else torch.full((b,), swa_width, dtype=torch.int32, device=q.device))
        topk_lens = None
        if topk_slots is not None:
            topk_lens = (x["extra_topk_length"] if x["extra_topk_length"] is not None
                         else torch.full((b,), topk_width, dtype=torch.int32, device=q.device))
        table = xpu_combined_indices(topk_lens, topk_width, swa_lens, swa_width)
        per_token = topk_width + swa_width

        def run():  # the workspace has q's dtype (bf16; fp16 only in the CPU interpreter check)
            ws = torch.empty(b, per_token, HEAD_DIM, dtype=q.dtype, device=q.device)
            if topk_slots is not None:
                buf = torch.empty(b * topk_width, HEAD_DIM, dtype=q.dtype, device=q.device)
                self.gather.dequant_gather_slots(buf, extra_cache, topk_slots.view(-1),
                                                 extra_cache.shape[1])
                ws[:, :topk_width] = buf.view(b, topk_width, HEAD_DIM)
            buf = torch.empty(b * swa_width, HEAD_DIM, dtype=q.dtype, device=q.device)
            self.gather.dequant_gather_slots(buf, x["k_cache"], swa_slots.view(-1),
                                             x["k_cache"].shape[1])
            ws[:, topk_width:] = buf.view(b, swa_width, HEAD_DIM)
            o, _, lse = self.attn.triton_bf16_mla_sparse_interface(
                q3, ws.view(-1, 1, HEAD_DIM), table, SCALE, d_v=HEAD_DIM, block_dpe=0)
            return apply_sink(o, lse, x["attn_sink"]).view(b, 1, h, d), lse
        return run

    def prefill(self, x: dict) -> Callable[[], tuple]:
        idx = x["indices"]
        s_q, width = idx.shape[0], idx.shape[-1]
        rows = idx.reshape(s_q, width)
        if x["topk_length"] is not None:
            past = torch.arange(width, device=idx.device)[None, :] >= x["topk_length"][:, None]
            rows = torch.where(past, torch.full_like(rows, -1), rows)
        rows = rows.contiguous().view(s_q, 1, width)

        def run():
            o, max_logits, lse = self.attn.triton_bf16_mla_sparse_interface(
                x["q"], x["kv"], rows, SCALE, d_v=HEAD_DIM, block_dpe=0)
            return apply_sink(o, lse, x["attn_sink"]), max_logits, lse
        return run


class TritonGatherPeer:
    """vLLM's Triton ``dequantize_and_gather_k_cache`` (the fallback vLLM uses when CuTe DSL
    is absent); same arguments as dsv4_tl's, writes ``x["out"]``."""

    name = "tri_vllm"
    suites = ("gather",)

    needs = (CACHE_UTILS_MODULE,)

    def __init__(self, source: PeerSource, sources: VllmTritonSources):
        self.source = source
        self.m = sources.module(CACHE_UTILS_MODULE)

    def gather(self, x: dict) -> Callable[[], tuple]:
        return lambda: (self.m.dequantize_and_gather_k_cache_triton(
            x["out"], x["k_cache"], x["seq_lens"], None, x["block_table"], x["block_size"], 0),)


class TritonXpuSlotsPeer:
    """vLLM XPU's per-slot dequant-gather kernel over the explicit slot list of every token
    (built from the block table once, outside the timed call); writes ``x["out"]`` rows in
    order, so it serves only inputs that gather every token of equal-length requests."""

    name = "tri_xpu_slots"
    suites = ("gather",)

    needs = (XPU_DECODE_MODULE,)

    def __init__(self, source: PeerSource, sources: VllmTritonSources):
        self.source = source
        self.m = sources.module(XPU_DECODE_MODULE)

    def gather(self, x: dict) -> Callable[[], tuple]:
        out = x["out"]
        slots = gather_slot_list(x["seq_lens"], x["block_table"], x["block_size"], out.shape[1])
        flat = out.view(-1, HEAD_DIM)
        return lambda: (self.m.dequant_gather_slots(flat, x["k_cache"], slots, x["block_size"]),)


PEER_CLASSES = {cls.name: cls for cls in (FlashMLAPeer, TritonRocmPeer, TritonRocmSplitKPeer,
                                          TritonXpuPeer, TritonGatherPeer, TritonXpuSlotsPeer)}
assert tuple(PEER_CLASSES) == PEER_NAMES
# Peers that an installed package other than vllm can provide (bench_discovery's flash_mla).
PACKAGE_PEERS = {"flashmla": FlashMLAPackagePeer}


def parse_peer_names(text: Optional[str]) -> List[str]:
    """``--peers`` value -> peer names in the given order. None or "all": every peer;
    "" or "none": no peer. Raises ValueError naming an unknown peer."""
    if text is None or text.strip() == "all":
        return list(PEER_NAMES)
    if text.strip() in ("", "none"):
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEER_CLASSES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


@dataclasses.dataclass
class PeerStatus:
    """What discovery made of one peer: ``peer`` (the loaded object) and its ``source``, or
    ``error`` (one line: why it is missing or failed to load); ``tried``: one line per place
    that did not serve it before (or instead of) the one that did."""

    name: str
    peer: Optional[object] = None
    source: Optional[PeerSource] = None
    error: Optional[str] = None
    tried: List[str] = dataclasses.field(default_factory=list)


def discover_peers(names: Sequence[str], peers_dir: Optional[str],
                   transform: Optional[SourceTransform] = None,
                   places: Optional[list] = None,
                   catch: tuple = (Exception, SystemExit)) -> List[PeerStatus]:
    """Find and load the named peers: per peer, the places of ``bench_discovery`` in order
    (installed vllm, installed flash_mla, the bundle at ``peers_dir``), the first that has
    its files and loads them. Loading runs the peers' code in this process (an installed
    flash_mla package's ``__init__``, vLLM's Triton files, FlashMLA's extension); what it
    raises of ``catch`` (by default also a ``sys.exit`` in a peer's code) is a load failure:
    nothing raises, a peer that is nowhere or fails to load everywhere gets ``error``.
    ``transform`` rewrites the Triton files before they run (see VllmTritonSources);
    ``places``: ``bench_discovery.search_places(peers_dir)`` when already made."""
    if places is None:
        places = bench_discovery.search_places(peers_dir) if names else []
    triton_sources: Dict[int, VllmTritonSources] = {}  # one per vLLM tree
    statuses = []
    for name in names:
        cls = PEER_CLASSES[name]
        status = PeerStatus(name)
        for origin, source in bench_discovery.peer_sources(cls.needs, places,
                                                           name in PACKAGE_PEERS):
            if not isinstance(source, PeerSource):
                status.tried.append(f"{origin}: {source}")
                continue
            try:
                if source.tree is None:
                    peer = PACKAGE_PEERS[name](source)
                else:
                    sources = triton_sources.setdefault(
                        id(source.tree), VllmTritonSources(source.tree.module_file, transform))
                    peer = cls(source, sources)
            except catch as exc:  # reported by the caller, never dropped
                status.tried.append(f"{origin}: load failed: {one_line(exc)}")
                continue
            status.peer, status.source = peer, source
            break
        if status.peer is None:
            status.error = "; ".join(status.tried) or "nowhere to look"
        statuses.append(status)
    return statuses


def load_peers(names: Sequence[str], peers_dir: Optional[str],
               transform: Optional[SourceTransform] = None) -> Tuple[list, Dict[str, str]]:
    """Find and load the named peers (:func:`discover_peers`). Returns ``(peers, errors)``:
    the peers that loaded, in order (each with ``.source``), and ``{name: one-line reason}``
    for each one that did not."""
    statuses = discover_peers(names, peers_dir, transform)
    return ([s.peer for s in statuses if s.peer is not None],
            {s.name: s.error for s in statuses if s.peer is None})


def format_peer_list(statuses: Sequence[PeerStatus], places: list) -> str:
    """``dsv4-tl bench --peers list``: the places searched (``search_places``), then per peer
    where it was loaded from (origin, version, files) or why it is missing or failed to load
    (one line), and the places passed over before the one that served."""
    lines = ["searched, in order:"]
    lines += [f"  {bench_discovery.describe_place(origin, place)}" for origin, place in places]
    head = f"{'peer':16s} {'status':7s} {'from':9s} {'version':9s} file / reason"
    lines += [head, "-" * len(head)]
    for s in statuses:
        if s.peer is None:
            state = "failed" if any(": load failed: " in t for t in s.tried) else "missing"
            lines.append(f"{s.name:16s} {state:7s} {'-':9s} {'-':9s} {s.error}")
            continue
        src = s.source
        lines.append(f"{s.name:16s} {'loaded':7s} {src.origin:9s} {src.version:9s} {src.files[0]}")
        lines += [f"{'':16s} {'':7s} {'':9s} {'':9s} {f}" for f in src.files[1:]]
        lines += [f"{'':16s} passed over {t}" for t in s.tried]
    return "\n".join(lines)


# How long ``dsv4-tl bench --peers list`` waits for discovery in its child process (starting
# Python and torch, then loading every peer found: seconds, unless a peer's code hangs).
PEER_LIST_TIMEOUT_S = 120.0
_CHILD = ("import json, sys; args = json.loads(sys.argv[1]); sys.path[:] = args['path']; "
          "from dsv4_tl.bench_peers import _peer_list_child; "
          "sys.exit(_peer_list_child(args['peers_dir']))")


def _peer_list_child(peers_dir: Optional[str]) -> int:
    """The child of :func:`peer_list_isolated`: the list on stdout; whatever a peer's code
    raises while loading (``SystemExit``, ``KeyboardInterrupt`` too) is that peer's row."""
    places = bench_discovery.search_places(peers_dir)
    statuses = discover_peers(PEER_NAMES, peers_dir, places=places, catch=BaseException)
    print(format_peer_list(statuses, places), flush=True)
    return 0


def peer_list_isolated(peers_dir: Optional[str],
                       timeout: Optional[float] = None) -> Tuple[bool, str]:
    """``dsv4-tl bench --peers list``: :func:`format_peer_list` of a discovery run in a child
    process (same interpreter, same ``sys.path``) that is ended after ``timeout`` seconds
    (default :data:`PEER_LIST_TIMEOUT_S`): finding the peers loads them, which runs their
    code, and a peer that calls ``sys.exit``, exits the process or hangs on import must not
    end or hang the bench. Returns ``(True, the list)`` or ``(False, one line: why there is
    none)``."""
    import json
    import os
    import signal
    import subprocess

    timeout = PEER_LIST_TIMEOUT_S if timeout is None else timeout
    payload = json.dumps({"path": sys.path, "peers_dir": peers_dir})
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, payload], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: ended with what it starts
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, (f"peer discovery did not finish within {timeout:g} s (a peer's code "
                       "hangs while loading?): nothing listed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode == 0 and out.startswith("searched, in order:"):
        return True, out.rstrip("\n")
    last = (err.strip().splitlines() or ["no output"])[-1]
    return False, (f"peer discovery ended with exit status {proc.returncode} (a peer's code "
                   f"exited the process?): {' '.join(last.split())[:300]}")


def peer_suites(name: str) -> Tuple[str, ...]:
    """Suites (decode / prefill / gather) that peer ``name`` takes part in."""
    return PEER_CLASSES[name].suites
