"""``dsv4-tl bench``: time the kernels at the DSv4 shapes of spec §8 against the machine's
ceilings and against peers measured in the same process.

Every implementation is first checked against the float32 reference on the very inputs it
is timed on; a mismatch is reported in the table (and the run exits non-zero). Times are
medians over repeated replays of a CUDA graph that holds several calls cycling through
distinct input sets, so launch gaps and host overhead stay out of kernel times and the L2
cache does not serve one input set repeatedly. Peers (``--peers``, default all; see
``bench_peers``): FlashMLA (vLLM's build, ``torch.ops._flashmla_C``, or the ``flash_mla``
package) and vLLM's DSv4 Triton kernels, found in an installed vLLM, an installed FlashMLA
package, then the peer bundle at ``--peers-dir`` (``bench_discovery``; ``--peers list``
shows what was found where, found and loaded in a child process with a time limit:
loading runs the peers' code, which timing runs in this process); a peer that is missing or
fails to load or run is a row of the table with its one-line reason, never silently
dropped; the table's header names the build (vLLM or flash_mla version) each peer came from.
Peers that produce no LSE are checked on their outputs only (the check column says so).
Prefill below 64 heads times FlashMLA twice: padded to 64 heads (``flashmla``, as vLLM 0.26
calls it) and given the real heads (``flashmla.native``, or "not supported by <build>" where
the loaded build refuses them); ratios against FlashMLA use the faster of the two.
``--shape`` times user-given decode / prefill shapes (``SHAPE_HELP``) instead of the suites.

FLOPs = 2·h·attended·(512 + 512) (FlashMLA's count). Bytes: decode = attended·584 (FP8
cache) + q + out + indices; prefill = q + out + indices + the BF16 workspace; gather =
rows·(584 read + 1024 written); insert = rows·(1024 read + 8 slot + 584 written).
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
from typing import Callable, Optional, Sequence

import torch

from .bench_peers import (
    FLASHMLA_IMPLS,
    PEER_LIST_TIMEOUT_S,
    PEER_NAMES,
    NotSupported,
    csr_from_dense,
    load_peers,
    one_line,
    parse_peer_names,
    peer_list_isolated,
    peer_suites,
)
from .cache_format import TOKEN_BYTES
from .kernels import MAX_HEADS
from .testing import check_attention, random_k, random_paged_cache, scatter_slots

SCALE = 512 ** -0.5
WINDOW = 128


# ----------------------------------------------------------------------------- timing
def graph_time_us(calls: list, reps: int = 20) -> float:
    """Median µs per call of ``calls`` (closures over distinct input sets), replayed in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm up: loads kernels, fills FlashMLA's scheduler metadata
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def measure_ceilings(device) -> dict:
    """bf16 GEMM rate (8192³, random data) and device copy rate (4 GiB fp32 ``copy_``, read
    + write; best and median of 10 launches timed with CUDA events outside a graph: replayed
    in a graph the copy becomes a memcpy node, which runs about a third slower on an H200)."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm_us = graph_time_us([lambda: torch.mm(a, b)] * 3, reps=10)
    src = torch.randn(1 << 30, device=device)  # 4 GiB fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del src, dst
    torch.cuda.empty_cache()
    moved = 2 * (1 << 30) * 4
    return {"bf16_gemm_tflops": 2 * n**3 / gemm_us / 1e6,
            "copy_gbps": moved / min(times) / 1e3,
            "copy_gbps_median": moved / statistics.median(times) / 1e3}


# ----------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One decode row: ``h`` heads, ``b`` requests of ``s_q`` query tokens (s_q 2: MTP),
    the ``window``-token SWA scope (128 in DSv4) plus, for C4A / C128A, the compressed scope
    of ``extra_width`` entries (default: 512 at h64 and 1024 at h128 for C4A, 1024 for
    C128A); ``varying``: per-request compressed lengths drawn from 0..width instead of the
    full width; ``window_len``: a speculative draft's window scope (the 128-token window
    plus the drafts, 133 tokens, in an index width ``window`` of 192 or 256) instead of a
    full window."""
    h: int
    b: int
    kind: str  # "swa", "c4a", "c128a"
    s_q: int = 1
    extra_width: Optional[int] = None
    varying: bool = False
    batch_invariant: bool = False
    window: int = WINDOW
    window_len: Optional[int] = None

    @property
    def extra_topk(self) -> int:
        if self.kind == "swa":
            return 0
        if self.extra_width is not None:
            return self.extra_width
        return 512 if (self.kind == "c4a" and self.h <= 64) else 1024

    @property
    def name(self) -> str:
        extra = {"swa": "", "c4a": f" + C4A {self.extra_topk} (bs 64)",
                 "c128a": f" + C128A {self.extra_topk} (bs 2)"}[self.kind]
        rows = f" s_q {self.s_q}" if self.s_q > 1 else ""
        lens = ", lengths 0..width" if self.varying else ""
        mode = ", batch-invariant" if self.batch_invariant else ""
        window = (f"window {self.window}" if self.window_len is None
                  else f"draft width {self.window} length {self.window_len}")
        return f"decode h{self.h} b{self.b}{rows} {window}{extra}{lens}{mode}"


# the decode rows' second dsv4_tl line: the same call with batch_invariant=True
INVARIANT = "dsv4_tl.inv"


def decode_shapes(quick: bool) -> list:
    """The decode suite: the DSv4 layer types at h 64 / 128 over the batch sizes, then the
    tensor-parallel head counts (V4-Flash TP8/4/2 = 8/16/32 heads; V4-Pro TP8 = 16), MTP
    (s_q 2) and C128A at 1M context (width 8192, per-request lengths)."""
    batches = (1, 8, 64, 128) if quick else (1, 8, 32, 64, 128, 256)
    kinds = ("c4a",) if quick else ("swa", "c4a", "c128a")
    shapes = [DecodeShape(h, b, kind) for kind in kinds for h in (64, 128) for b in batches]
    if quick:
        return shapes
    shapes += tp_decode_shapes()
    shapes += [DecodeShape(128, b, "c4a", s_q=2) for b in (74, 148)]
    # MTP and speculative verify: s_q 2-6 at both head counts
    shapes += [DecodeShape(h, b, "c4a", s_q=s) for h in (64, 128)
               for b, s in ((64, 2), (32, 4), (32, 6))]
    # C128A at long context: widths 4096 / 8192 with per-request lengths in 0..width, small,
    # odd and large batches
    shapes += [DecodeShape(h, b, "c128a", extra_width=w, varying=True) for h in (64, 128)
               for w in (4096, 8192) for b in (2, 32, 77, 128)]
    return shapes


def tp_decode_shapes() -> list:
    """Tensor-parallel head counts (8, 16, 32; FlashMLA padded to 64 heads as vLLM pads)
    over the batch sizes and the three layer types (C128A: width 1024, per-request lengths),
    then speculative-draft rows (the window plus 5 drafts, 133 tokens at index width 192 or
    256) at h32 and h64 with 1 and 6 query tokens per request."""
    shapes = [DecodeShape(h, b, kind, extra_width={"swa": None, "c4a": 512, "c128a": 1024}[kind],
                          varying=kind == "c128a")
              for h in (8, 16, 32) for kind in ("swa", "c4a", "c128a") for b in (1, 8, 64, 128, 256)]
    shapes += [DecodeShape(h, 32, "swa", s_q=s_q, window=width, window_len=133)
               for h in (32, 64) for width in (192, 256) for s_q in (1, 6)]
    return shapes


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    h: int
    s_q: int
    topk: int
    s_kv: int
    varying: bool = False  # per-row topk_length, uniform in [1, topk]
    ragged: bool = False  # the CSR form (ops.sparse_prefill_ragged) of the same rows

    @property
    def name(self) -> str:
        lens = ", lengths 1..top-k" if self.varying else ""
        form = ", ragged" if self.ragged else ""
        return f"prefill h{self.h} s_q {self.s_q} top-k {self.topk} s_kv {self.s_kv}{lens}{form}"


def prefill_shapes(quick: bool) -> list:
    """The prefill suite: V4-Flash (h 64) and V4-Pro (h 128) at both C4A widths (640: Flash,
    1152: Pro), the long rows of C128A at 1M context (width 8320, per-row lengths; also on a
    256 MiB workspace), short chunks (s_q 64-512), the tensor-parallel head counts (16, 32;
    FlashMLA both padded to 64 heads as vLLM 0.26 does and native where its build takes
    them), and the ragged twins of two dense rows (same rows, CSR form: equal work)."""
    shapes = [PrefillShape(h, 4096, topk, 32768) for h in (64, 128) for topk in (640, 1152)]
    if quick:
        return [shapes[0], shapes[3]]
    shapes += [PrefillShape(h, 1024, 8320, 65536, varying=True) for h in (64, 128)]
    # the same long rows gathered from a 4x larger workspace (C128A rows spread over 256 MiB,
    # past L2), and short chunks (a chunked-prefill step of 64-512 query rows)
    shapes += [PrefillShape(128, 1024, 8320, 262144, varying=True)]
    shapes += [PrefillShape(h, s_q, topk, 32768) for h, topk in ((64, 640), (128, 1152))
               for s_q in (64, 128, 256, 512)]
    shapes += [PrefillShape(h, 4096, 640, 32768, varying=True) for h in (16, 32)]
    shapes += [PrefillShape(h, 4096, topk, 32768, ragged=True) for h, topk in ((64, 640),
                                                                              (128, 1152))]
    shapes += [PrefillShape(128, 1024, 8320, 65536, varying=True, ragged=True)]
    return shapes


# ----------------------------------------------------------------------------- --shape
SHAPE_HELP = """one decode or prefill shape, timed against every available peer (repeatable):
  decode:h=H,b=B[,s_q=1][,swa=128][,extra=none|c4a:W|c128a:W][,lens=full|rand]
  prefill:h=H,s_q=S,topk=K,s_kv=N[,lens=full|rand][,form=dense|ragged]
decode: h heads, b requests of s_q query tokens (1..64; 2 = MTP), the SWA window of swa
tokens (cache block size 64) and the compressed scope extra of W entries (C4A: block size
64, random distinct positions of a 32K context; C128A: block size 2, every entry in order);
lens=rand draws each request's compressed length from 0..W (the window stays full).
prefill: s_q query rows of 4 requests (a multiple of 4) over an s_kv-row BF16 workspace,
K indices per row (the last 128 are the row's SWA window); lens=rand draws each row's
length from 1..K; form=ragged times dsv4_tl's CSR entry point on the same rows.
h is at most 1024; every input tensor a shape makes holds under 2**31 elements (the kernels
index in int32), which bounds b, swa, W, s_q, K and N.
Example: --shape decode:h=64,b=64,extra=c4a:512"""

# field -> default (None: required), per kind
SHAPE_FIELDS = {
    "decode": {"h": None, "b": None, "s_q": "1", "swa": str(WINDOW), "extra": "none",
               "lens": "full"},
    "prefill": {"h": None, "s_q": None, "topk": None, "s_kv": None, "lens": "full",
                "form": "dense"},
}
MAX_DECODE_S_Q = 64  # decode_inputs starts a request's window within one 64-token block
# The most elements a tensor of a --shape's inputs may hold: the kernels index in int32.
MAX_TENSOR_ELEMENTS = 2**31 - 1


def _oversized(sizes: Sequence[tuple]) -> Optional[tuple]:
    """The first ``(fields, what, elements)`` of ``sizes`` over :data:`MAX_TENSOR_ELEMENTS`."""
    return next((s for s in sizes if s[2] > MAX_TENSOR_ELEMENTS), None)


def parse_shape(text: str):
    """A ``--shape`` value (syntax: ``SHAPE_HELP``) -> DecodeShape or PrefillShape. Raises
    ValueError, one line naming the bad field."""
    kind, sep, body = text.partition(":")
    kind = kind.strip()
    if not sep or kind not in SHAPE_FIELDS:
        raise ValueError(f"--shape {text!r}: must start with 'decode:' or 'prefill:' "
                         "(e.g. decode:h=64,b=64,extra=c4a:512)")
    fields = SHAPE_FIELDS[kind]
    given = {}
    for item in body.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"--shape {text!r}: {item.strip()!r} is not field=value")
        if key not in fields:
            raise ValueError(f"--shape {text!r}: unknown {kind} field {key!r} "
                             f"(known: {', '.join(fields)})")
        if key in given:
            raise ValueError(f"--shape {text!r}: field {key!r} is given twice")
        given[key] = value
    for key, default in fields.items():
        if default is None and key not in given:
            raise ValueError(f"--shape {text!r}: {kind} needs field {key!r} "
                             f"(fields: {', '.join(fields)})")
    values = {**fields, **given}

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"--shape {text!r}: field {key!r}: {why}")

    def check_sizes(sizes: Sequence[tuple]) -> None:
        """``sizes``: ``(fields, tensor, elements)`` of the inputs the shape makes."""
        over = _oversized(sizes)
        if over is not None:
            fields, what, n = over
            label = "fields" if "," in fields else "field"
            raise ValueError(f"--shape {text!r}: {label} {fields}: {what} would hold {n} "
                             f"elements, over {MAX_TENSOR_ELEMENTS} (the kernels index in int32)")

    def count(key: str, lo: int = 1, hi: Optional[int] = None) -> int:
        try:
            n = int(values[key])
        except ValueError:
            raise bad(key, f"expected an integer, got {values[key]!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise bad(key, f"{n} is outside {lo}..{hi}" if hi is not None else f"{n} is below {lo}")
        return n

    def choice(key: str, options: Sequence[str]) -> str:
        if values[key] not in options:
            raise bad(key, f"expected {' or '.join(options)}, got {values[key]!r}")
        return values[key]

    varying = choice("lens", ("full", "rand")) == "rand"
    if kind == "prefill":
        h, s_q = count("h", 1, MAX_HEADS), count("s_q")
        topk, s_kv = count("topk", WINDOW), count("s_kv")
        if s_q % 4:
            raise bad("s_q", f"{s_q} is not a multiple of 4 (the rows of 4 requests)")
        if s_kv < s_q + 4 * topk:
            raise bad("s_kv", f"{s_kv} is too small: 4 requests of s_q/4 rows with {topk} "
                              f"indices each need s_kv >= s_q + 4*topk = {s_q + 4 * topk}")
        check_sizes([("h, s_q", "the query [s_q, h, 512]", s_q * h * 512),
                     ("s_kv", "the workspace [s_kv, 512]", s_kv * 512),
                     ("s_q, topk", "the indices [s_q, topk]", s_q * topk),
                     ("s_q, s_kv", "the top-k draw [s_q, s_kv / 4]", s_q * (s_kv // 4))])
        return PrefillShape(h, s_q, topk, s_kv, varying=varying,
                            ragged=choice("form", ("dense", "ragged")) == "ragged")
    scope, _, width = values["extra"].partition(":")
    if scope == "none" and not width:
        extra_kind, extra_width = "swa", None
    elif scope in ("c4a", "c128a"):
        extra_kind = scope
        try:
            extra_width = int(width)
        except ValueError:
            raise bad("extra", f"expected {scope}:W with W a positive integer, got "
                               f"{values['extra']!r}") from None
        if extra_width < 1:
            raise bad("extra", f"width {extra_width} is below 1")
    else:
        raise bad("extra", f"expected none, c4a:W or c128a:W, got {values['extra']!r}")
    if varying and extra_kind == "swa":
        raise bad("lens", "rand needs a compressed scope (extra=c4a:W or c128a:W); the SWA "
                          "window is always full")
    shape = DecodeShape(count("h", 1, MAX_HEADS), count("b"), extra_kind,
                        s_q=count("s_q", 1, MAX_DECODE_S_Q), extra_width=extra_width,
                        varying=varying, window=count("swa"))
    b, rows = shape.b, shape.b * shape.s_q
    swa_rows = b * 2 * -(-(shape.window + 64) // 64) * 64  # decode_inputs' SWA cache
    sizes = [("h, b, s_q", "the query [b, s_q, h, 512]", rows * shape.h * 512),
             ("b, swa", "the SWA cache (its rows of 512)", swa_rows * 512),
             ("b, s_q, swa", "the SWA indices [b, s_q, swa]", rows * shape.window)]
    if extra_kind != "swa":
        bs, entries = _extra_cache_geometry(shape)
        sizes += [("b, extra", "the compressed cache (its rows of 512)",
                   b * (entries // bs) * bs * 512),
                  ("b, s_q, extra", "the compressed indices [b, s_q, W]", rows * extra_width),
                  ("b, s_q, extra", "the position draw [b * s_q, entries]", rows * entries)]
    check_sizes(sizes)
    return shape


def _extra_cache_geometry(shape: DecodeShape) -> tuple:
    """``(block size, compressed entries per request)`` of ``decode_inputs``' compressed
    cache: a 32K-token context for C4A, 128K for C128A, or more entries when the width asks."""
    bs, entries = (64, 32768 // 4) if shape.kind == "c4a" else (2, 131072 // 128)
    return bs, max(entries, shape.extra_topk)


def decode_inputs(shape: DecodeShape, gen: torch.Generator, sets: int, device) -> list:
    """``sets`` input sets sharing the caches: SWA cache (bs 64, a ``shape.window``-token
    window per query token in scattered blocks; the s_q (<= 64) tokens of a request are
    consecutive positions)
    and, for C4A/C128A, the compressed cache (bs 64 / 2) of a 32K (C4A) or 128K-token
    (C128A; enough entries for the width) context with random block tables. Full lengths
    (the steady state) unless ``shape.varying``."""
    b, h, s_q = shape.b, shape.h, shape.s_q
    swa_blocks = -(-(shape.window + 64) // 64)  # a window starting anywhere in the first block
    swa = random_paged_cache(b * swa_blocks * 2, 64, gen, device)
    swa_table = torch.randperm(swa.shape[0], generator=gen, device=device).view(-1, swa_blocks)
    extra = None
    if shape.kind != "swa":
        bs, entries = _extra_cache_geometry(shape)
        per_req = entries // bs
        extra = random_paged_cache(b * per_req, bs, gen, device)
        extra_table = torch.randperm(extra.shape[0], generator=gen, device=device).view(b, per_req)
    window = torch.arange(shape.window, device=device)
    out = []
    for _ in range(sets):
        q = torch.randn((b, s_q, h, 512), generator=gen, device=device).to(torch.bfloat16)
        start = torch.randint(0, 64 - s_q + 1, (b,), generator=gen, device=device)
        idx = torch.stack([torch.stack([scatter_slots(swa_table[r], start[r] + s + window, 64)
                                        for s in range(s_q)]) for r in range(b)])
        lens = torch.full((b,), shape.window_len or shape.window, dtype=torch.int32,
                          device=device)
        item = {"q": q, "k_cache": swa, "indices": idx, "topk_length": lens,
                "attn_sink": torch.rand(h, generator=gen, device=device) * 4 - 2,
                "extra_k_cache": None, "extra_indices": None, "extra_topk_length": None,
                "batch_invariant": shape.batch_invariant}
        if extra is not None:
            k = shape.extra_topk
            if shape.kind == "c4a":  # indexer picks: distinct random compressed positions
                pos = torch.rand((b * s_q, entries), generator=gen, device=device).topk(k, -1).indices
            else:  # C128A: every visible compressed entry, in order
                pos = torch.arange(k, device=device)[None].expand(b * s_q, k)
            pos = pos.view(b, s_q, k)
            e_idx = torch.stack([torch.stack([scatter_slots(extra_table[r], pos[r, s], bs)
                                              for s in range(s_q)]) for r in range(b)])
            if shape.varying:
                e_len = torch.randint(0, k + 1, (b,), generator=gen, device=device, dtype=torch.int32)
            else:
                e_len = torch.full((b,), k, dtype=torch.int32, device=device)
            item.update(extra_k_cache=extra, extra_indices=e_idx, extra_topk_length=e_len)
        out.append(item)
    return out


def prefill_inputs(shape: PrefillShape, gen: torch.Generator, sets: int, device) -> list:
    """Workspace rows of 4 requests (PREFILL_CHUNK_SIZE); each query row = top-k minus the
    window from the request's compressed region + its 128-row SWA window, as
    combine_topk_swa_indices lays them out."""
    kv = random_k(shape.s_kv, gen, device).view(shape.s_kv, 1, 512)
    m = shape.s_kv // 4
    per_req = shape.s_q // 4
    n = m - (per_req + WINDOW)
    out = []
    for _ in range(sets):
        t = torch.arange(shape.s_q, device=device)
        r, i = t // per_req, t % per_req
        comp = torch.rand((shape.s_q, n), generator=gen, device=device).topk(shape.topk - WINDOW, -1).indices
        swa = n + i[:, None] + torch.arange(WINDOW, device=device)[None]
        idx = (r[:, None] * m + torch.cat([comp, swa], -1)).int().view(shape.s_q, 1, shape.topk)
        if shape.varying:
            lens = torch.randint(1, shape.topk + 1, (shape.s_q,), generator=gen, device=device,
                                 dtype=torch.int32)
        else:
            lens = torch.full((shape.s_q,), shape.topk, dtype=torch.int32, device=device)
        item = {"q": torch.randn((shape.s_q, shape.h, 512), generator=gen, device=device).to(torch.bfloat16),
                "kv": kv, "indices": idx, "topk_length": lens,
                "attn_sink": torch.rand(shape.h, generator=gen, device=device) * 4 - 2}
        if shape.ragged:  # built once, outside the timed call, as an engine's metadata is
            item["ragged"] = csr_from_dense(idx, lens)
        out.append(item)
    return out


# ----------------------------------------------------------------------------- implementations
def ours_decode(x: dict):
    from .ops import sparse_decode
    return lambda: sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], SCALE,
                                 x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                                 x["extra_topk_length"],
                                 batch_invariant=x.get("batch_invariant", False))


def ours_decode_invariant(x: dict):
    """``ours_decode`` with ``batch_invariant=True`` (every decode row prints its cost)."""
    return ours_decode({**x, "batch_invariant": True})


def ours_prefill(x: dict):
    from .ops import sparse_prefill
    if "ragged" in x:
        from .ops import sparse_prefill_ragged
        flat, indptr = x["ragged"]
        return lambda: sparse_prefill_ragged(x["q"], x["kv"], flat, indptr, SCALE, x["attn_sink"])
    return lambda: sparse_prefill(x["q"], x["kv"], x["indices"], SCALE, x["attn_sink"],
                                  x["topk_length"])


# ----------------------------------------------------------------------------- driver
def _reference(x: dict, compute: Callable[[], tuple]) -> tuple:
    """The float32 reference of input set ``x``, computed once and kept in ``x`` for the
    other implementations checked on it (several peers per row)."""
    if "_reference" not in x:
        x["_reference"] = compute()
    return x["_reference"]


def _decode_reference(x: dict) -> tuple:
    from .reference import sparse_decode_ref
    from .testing import cache_kmax
    ref_out, ref_lse = sparse_decode_ref(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                                         SCALE, x["attn_sink"], x["extra_k_cache"],
                                         x["extra_indices"], x["extra_topk_length"])
    kmax = max(cache_kmax(c) for c in (x["k_cache"], x["extra_k_cache"]) if c is not None)
    return ref_out, ref_lse, kmax


def _check_decode(x: dict, result) -> str:
    out, lse = result  # lse None: the peer returns none
    ref_out, ref_lse, kmax = _reference(x, lambda: _decode_reference(x))
    if lse is None:
        check_attention(kmax, out, ref_out)
        return "ok (out only)"
    check_attention(kmax, out, ref_out, lse=(lse.reshape(ref_lse.shape), ref_lse))
    return "ok"


def _check_prefill(x: dict, result) -> str:
    from .reference import sparse_prefill_ref
    out, max_logits, lse = result  # None for what a peer does not return
    ref = _reference(x, lambda: sparse_prefill_ref(x["q"], x["kv"], x["indices"], SCALE, 512,
                                                   x["attn_sink"], x["topk_length"]))
    stats = {"max_logits": (max_logits, ref[1]), "lse": (lse, ref[2])}
    missing = [name for name, (got, _) in stats.items() if got is None]
    check_attention(float(x["kv"].float().abs().max()), out, ref[0],
                    **{name: pair for name, pair in stats.items() if pair[0] is not None})
    return f"ok (no {', '.join(missing)})" if missing else "ok"


def _attended(x: dict) -> int:
    n = int(x["topk_length"].sum()) if x["topk_length"] is not None else x["indices"].numel()
    if x.get("extra_topk_length") is not None:
        n += int(x["extra_topk_length"].sum())
    return n


def _measure(row: dict, impls: dict, inputs: list, check: Callable, flops: float, nbytes: float,
             ceilings: dict, poison: Optional[Callable[[dict], None]] = None) -> None:
    """Check then time each implementation; ``poison(x)`` runs before each checked call so
    that an output buffer shared by the implementations cannot pass on a previous one's data."""
    for name, make in impls.items():
        entry = {"impl": name}
        try:
            calls = [make(x) for x in inputs]
            if poison is not None:
                poison(inputs[0])
            result = calls[0]()
            torch.cuda.synchronize()
            entry["check"] = check(inputs[0], result)
            us = graph_time_us(calls)
            entry.update(us=us, tflops=flops / us / 1e6, gbps=nbytes / us / 1e3)
            entry["pct_gemm"] = 100 * entry["tflops"] / ceilings["bf16_gemm_tflops"]
            entry["pct_copy"] = 100 * entry["gbps"] / ceilings["copy_gbps"]
        except NotSupported as exc:  # the peer's build refuses the shape: a note, not an error
            entry["unsupported"] = str(exc)
        except Exception as exc:  # reported in the table, never dropped
            entry["error"] = one_line(exc)
        row["results"].append(entry)


def _failed_peer_entries(errors: dict, suite: str) -> list:
    """Per-row entries for the peers that failed to load and would have run in ``suite``."""
    return [{"impl": name, "error": f"not loaded: {err}"}
            for name, err in errors.items() if suite in peer_suites(name)]


def _peer_impls(peers: list, suite: str, x: dict) -> dict:
    """{name: make-call} of the loaded peers that implement ``suite``, for input sets like
    ``x``: each peer's own call, then the entries its ``variants`` adds (FlashMLA's native
    prefill below 64 heads)."""
    impls = {}
    for p in peers:
        if suite in p.suites:
            impls[p.name] = getattr(p, suite)
            if hasattr(p, "variants"):
                impls.update(p.variants(suite, x))
    return impls


def _flashmla_timed(row: dict) -> list:
    """The timed entries of ``bench_peers.FLASHMLA_IMPLS`` in ``row`` (padded and native
    prefill below 64 heads; elsewhere ``flashmla`` alone)."""
    return [e for e in row["results"] if e["impl"] in FLASHMLA_IMPLS and "us" in e]


def flashmla_reference(row: dict) -> Optional[dict]:
    """The entry that ratios against FlashMLA use in ``row``: the faster of its timed
    FlashMLA entries (:func:`_flashmla_timed`), or None when none was timed."""
    return min(_flashmla_timed(row), key=lambda e: e["us"], default=None)


def _suite_row(suite: str, shape: str, attended: int, ours: Callable, inputs: list,
               check: Callable, flops: float, nbytes: float, ceilings: dict, peers: list,
               failed: dict, poison: Optional[Callable[[dict], None]] = None,
               modes: Optional[dict] = None) -> dict:
    """One table row of ``suite``: dsv4_tl (and its other ``modes``, {impl name: make-call})
    and every loaded peer of the suite checked and timed on ``inputs``, plus the peers that
    failed to load."""
    row = {"suite": suite, "shape": shape, "attended": attended, "results": []}
    impls = {"dsv4_tl": ours, **(modes or {}), **_peer_impls(peers, suite, inputs[0])}
    _measure(row, impls, inputs, check, flops, nbytes, ceilings, poison)
    row["results"] += _failed_peer_entries(failed, suite)
    return row


def _load_peers_into(report: dict, names: Sequence[str], peers_dir: Optional[str]) -> list:
    """Load the named peers (``bench_peers.load_peers``) and record in ``report`` where
    each came from: ``peer_sources`` {name: build, place and file (one line, the table's
    header)}, ``peer_builds`` {name: "vLLM <version>" / "flash_mla <version>"} and
    ``peer_errors`` {name: why it did not load}. Returns the loaded peers."""
    peers, report["peer_errors"] = load_peers(names, peers_dir)
    report["peer_sources"] = {p.name: p.source.describe() for p in peers}
    report["peer_builds"] = {p.name: p.source.build for p in peers}
    return peers


def run_bench(suites: list, peers_dir: Optional[str], quick: bool, device="cuda",
              peer_names: Optional[Sequence[str]] = None,
              shapes: Optional[Sequence[object]] = None) -> dict:
    """Run the suites; ``peer_names`` None = every peer in ``bench_peers.PEER_NAMES``;
    ``shapes`` (DecodeShape / PrefillShape, e.g. from :func:`parse_shape`): the rows of the
    decode and prefill suites instead of their own."""
    gen = torch.Generator(device).manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": props.name, "sms": props.multi_processor_count,
              "torch": torch.__version__, "rows": [], "peer_errors": {}}
    try:
        import tilelang
        report["tilelang"] = tilelang.__version__
    except ImportError:
        pass
    report["ceilings"] = ceilings = measure_ceilings(device)
    names = parse_peer_names(None) if peer_names is None else list(peer_names)
    report["peers"] = names
    peers = _load_peers_into(report, names, peers_dir)
    failed = report["peer_errors"]
    sets = 3

    def rows_of(cls: type, own: Callable[[bool], list]) -> list:
        return own(quick) if shapes is None else [s for s in shapes if isinstance(s, cls)]

    if "decode" in suites:
        for shape in rows_of(DecodeShape, decode_shapes):
            inputs = decode_inputs(shape, gen, sets, device)
            att = _attended(inputs[0]) * shape.s_q  # lengths are per request, for each row
            flops = 2 * shape.h * att * 1024
            nbytes = att * TOKEN_BYTES + 2 * shape.b * shape.s_q * shape.h * 512 * 2 + 4 * att
            modes = {} if shape.batch_invariant else {INVARIANT: ours_decode_invariant}
            report["rows"].append(_suite_row("decode", shape.name, att, ours_decode, inputs,
                                             _check_decode, flops, nbytes, ceilings, peers,
                                             failed, modes=modes))
            del inputs
            torch.cuda.empty_cache()
    if "prefill" in suites:
        for shape in rows_of(PrefillShape, prefill_shapes):
            inputs = prefill_inputs(shape, gen, sets, device)
            att = _attended(inputs[0])
            flops = 2 * shape.h * att * 1024
            nbytes = 2 * shape.s_q * shape.h * 512 * 2 + 4 * att + shape.s_kv * 1024
            report["rows"].append(_suite_row("prefill", shape.name, att, ours_prefill, inputs,
                                             _check_prefill, flops, nbytes, ceilings, peers,
                                             failed))
            del inputs
            torch.cuda.empty_cache()
    if "insert" in suites:
        for rows, bs in ((64, 64), (256, 64), (8192, 64), (8192, 2)):
            inputs, check = insert_inputs(rows, bs, gen, sets, device)
            nbytes = rows * (512 * 2 + 8 + TOKEN_BYTES)
            report["rows"].append(_suite_row("insert", f"insert {rows} rows (bs {bs})", 0,
                                             ours_insert, inputs, check, 0.0, nbytes, ceilings,
                                             peers, failed, poison=poison_insert_cache))
            del inputs
            torch.cuda.empty_cache()
    if "gather" in suites:
        # Issue 14's shapes, 4 requests (PREFILL_CHUNK_SIZE) each: C4A (bs 64) and C128A
        # (bs 2) compressed caches at 32768 entries per request, SWA (bs 64) 8K + 127 rows.
        for kind, rows, bs in (("C4A", 32768, 64), ("C128A", 32768, 2), ("SWA", 8192 + 127, 64)):
            inputs, check = gather_inputs(rows, bs, gen, sets, device)
            nbytes = 4 * rows * (TOKEN_BYTES + 512 * 2)
            name = f"gather {kind} 4 x {rows} rows (bs {bs})"
            report["rows"].append(_suite_row("gather", name, 0, ours_gather, inputs, check, 0.0,
                                             nbytes, ceilings, peers, failed,
                                             poison=poison_gather_out))
            del inputs
            torch.cuda.empty_cache()
    return report


def gather_inputs(rows: int, block_size: int, gen: torch.Generator, sets: int, device):
    """4 requests of ``rows`` tokens each in scattered blocks of one cache; every set writes
    its own BF16 workspace. Returns (inputs, bit-exact check)."""
    per_req = -(-rows // block_size)
    cache = random_paged_cache(4 * per_req, block_size, gen, device)
    out = []
    for _ in range(sets):
        table = torch.randperm(cache.shape[0], generator=gen, device=device).view(4, per_req).int()
        out.append({"out": torch.empty((4, rows, 512), dtype=torch.bfloat16, device=device),
                    "k_cache": cache, "seq_lens": torch.full((4,), rows, dtype=torch.int32, device=device),
                    "block_table": table, "block_size": block_size})

    def check(x: dict, _result) -> str:
        from .reference import dequantize_and_gather_k_cache_ref

        def compute():
            expected = torch.full_like(x["out"], float("nan"))
            dequantize_and_gather_k_cache_ref(expected, x["k_cache"], x["seq_lens"], None,
                                              x["block_table"], x["block_size"], 0)
            return (expected,)
        expected, = _reference(x, compute)
        if not torch.equal(expected.view(torch.int16), x["out"].view(torch.int16)):
            raise AssertionError("gather: not bit-exact against the reference")
        return "ok (bit-exact)"
    return out, check


def poison_gather_out(x: dict) -> None:
    """NaN-fill the workspace that every gather implementation writes (it is shared)."""
    x["out"].fill_(float("nan"))


def ours_gather(x: dict):
    from .ops import dequantize_and_gather_k_cache
    return lambda: dequantize_and_gather_k_cache(x["out"], x["k_cache"], x["seq_lens"], None,
                                                 x["block_table"], x["block_size"], 0)


def insert_inputs(rows: int, block_size: int, gen: torch.Generator, sets: int, device):
    """``rows`` K rows (decode: one per request; prefill: a chunk) into distinct scattered
    slots of a cache twice as large (a few -1 padding slots); every set has its own rows and
    slots, all sets write one cache. Returns (inputs, bit-exact check against
    ``cache_format.insert_k``)."""
    from .cache_format import alloc_k_cache

    nb = -(-2 * rows // block_size)
    cache = alloc_k_cache(nb, block_size, device=device)
    out = []
    for _ in range(sets):
        slots = torch.randperm(nb * block_size, generator=gen, device=device)[:rows]
        slots[7::61] = -1
        out.append({"k_cache": cache, "k": random_k(rows, gen, device), "slot_mapping": slots})

    def check(x: dict, _result) -> str:  # the call ran on a cache poisoned everywhere
        from .cache_format import cache_geometry
        from .testing import CACHE_POISON, expected_insert

        cache = x["k_cache"]
        before = torch.full_like(cache_geometry(cache).flat, CACHE_POISON)
        want = expected_insert(before.as_strided(cache.shape, cache.stride()), x["k"],
                               x["slot_mapping"], "e4m3fn")
        if not torch.equal(cache_geometry(cache).flat, want):
            raise AssertionError("insert: not bit-exact against cache_format.insert_k")
        return "ok (bit-exact)"
    return out, check


def poison_insert_cache(x: dict) -> None:
    """Fill the cache with a byte the insert never writes everywhere (it is shared)."""
    from .cache_format import cache_geometry
    from .testing import CACHE_POISON

    cache_geometry(x["k_cache"]).flat.fill_(CACHE_POISON)


def ours_insert(x: dict):
    from .ops import insert_k_cache
    return lambda: insert_k_cache(x["k_cache"], x["k"], x["slot_mapping"])


# ----------------------------------------------------------------------------- host suite
HOST_CALLS = 200  # back-to-back calls per timed run
HOST_REPEATS = 9  # timed runs per implementation (the median is reported)
HOST_GOALS = {"dsv4_tl.ops": 0.4, "dsv4_tl": 0.7}  # issue 17: host time vs FlashMLA's op


def host_time_us(fn: Callable[[], object], calls: int = HOST_CALLS,
                 repeats: int = HOST_REPEATS, device="cuda") -> dict:
    """Host time of one call of ``fn``: the wall time of ``calls`` back-to-back calls on the
    host divided by ``calls`` (the device drained before each run, Python's garbage
    collector paused), median (``us``) and best of ``repeats`` runs; ``cpu_us``: the
    calling thread's CPU time per call (median), which other processes on a busy host
    disturb less. ``wall_us`` (CUDA): the device timeline of the same calls (CUDA events)
    per call, about the host time when the host is what bounds the calls (their kernels
    finish faster than they are issued)."""
    import gc
    import time

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    host, cpu, wall = [], [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            sync()
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            host.append((t1 - t0) / calls * 1e6)
            cpu.append((c1 - c0) / calls * 1e6)
            if cuda:
                end.record()
                end.synchronize()
                wall.append(start.elapsed_time(end) * 1e3 / calls)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {"us": statistics.median(host), "us_best": min(host), "cpu_us": statistics.median(cpu),
            "wall_us": statistics.median(wall) if wall else None}


def host_rows(device="cuda", flashmla=None) -> list:
    """The host suite's rows: ``(shape, {impl: zero-argument call})`` at shapes whose
    kernels take less device time than a call takes on the host (decode b8 of each scope,
    a small prefill). ``flashmla``: the loaded FlashMLA peer (its op called bare, the
    decode scheduler metadata reused across calls as vLLM does), or None."""
    import dsv4_tl
    from . import ops
    from .kernels import SPARSE_PREFILL
    from .ops._dispatch import kernel_for

    gen = torch.Generator(device).manual_seed(0)
    rows = []
    for kind in ("swa", "c4a"):
        x = decode_inputs(DecodeShape(64, 8, kind), gen, 1, device)[0]
        args = (x["q"], x["k_cache"], x["indices"], x["topk_length"], SCALE, x["attn_sink"],
                x["extra_k_cache"], x["extra_indices"], x["extra_topk_length"])
        calls = {"dsv4_tl": lambda args=args: dsv4_tl.sparse_decode(*args),
                 "dsv4_tl.ops": lambda args=args: ops.sparse_decode(*args)}
        if flashmla is not None:
            calls["flashmla"] = _flashmla_decode(flashmla, x)
        rows.append((f"decode h64 b8 window {WINDOW}" + ("" if kind == "swa" else " + C4A 512"),
                     calls))
    shape = PrefillShape(64, 64, 256, 2048)
    x = prefill_inputs(shape, gen, 1, device)[0]
    args = (x["q"], x["kv"], x["indices"], SCALE, x["attn_sink"], x["topk_length"])
    calls = {"dsv4_tl": lambda: dsv4_tl.sparse_prefill(*args),
             "dsv4_tl.ops": lambda: ops.sparse_prefill(*args)}
    if flashmla is not None:
        calls["flashmla"] = lambda: flashmla.call_prefill(x["q"], x["kv"], x["indices"],
                                                          x["attn_sink"], x["topk_length"])
    # floors: the loaded prefill kernel called with ready arguments (by its parameter
    # names), and one eager torch op
    kernel = kernel_for("sparse_prefill", torch.device(device), dict(num_heads=64, ragged=False),
                        h=64, topk=shape.topk)
    out, max_logits, lse = ops.sparse_prefill(*args)
    named = {"Q": x["q"], "KV": x["kv"].view(shape.s_kv, 512),
             "Indices": x["indices"].view(shape.s_q, shape.topk), "Lengths": x["topk_length"],
             "Sink": x["attn_sink"], "Out": out, "MaxLogits": max_logits, "Lse": lse,
             "sm_scale": SCALE}
    raw = [named[p] for p in SPARSE_PREFILL.params]
    calls["raw kernel"] = lambda: kernel(*raw)
    rows.append((shape.name, calls))
    small = torch.zeros(8, device=device)
    rows.append(("floor: one eager torch op", {"torch x.add_(1)": lambda: small.add_(1)}))
    return rows


def _flashmla_decode(peer, x: dict) -> Callable[[], tuple]:
    """FlashMLA's sparse decode called bare (no slicing of its outputs; through the
    flash_mla package's function when the peer comes from that package), its scheduler
    metadata made by the first call and reused (vLLM computes it once per step)."""
    state = {}
    extra = x["extra_k_cache"]
    k_cache = x["k_cache"].unsqueeze(-2)
    extra = None if extra is None else extra.unsqueeze(-2)
    out = torch.empty_like(x["q"])
    return lambda: peer.call_decode(state, x["q"], k_cache, x["indices"], x["topk_length"],
                                    x["attn_sink"], extra, x["extra_indices"],
                                    x["extra_topk_length"], out)


def run_host_suite(peers_dir: Optional[str], peer_names: Optional[Sequence[str]] = None,
                   device="cuda") -> dict:
    """Host time per call of ``dsv4_tl.<op>`` (the custom op), ``dsv4_tl.ops.<op>`` and
    FlashMLA's ``torch.ops._flashmla_C`` op, in this process (see :func:`host_time_us`),
    with each kernel's device time (graph replay) to show that the host is what bounds."""
    import platform

    props = torch.cuda.get_device_properties(device)
    report = {"suite": "host", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine(), "calls": HOST_CALLS,
              "repeats": HOST_REPEATS, "goals": HOST_GOALS, "rows": [], "peer_errors": {}}
    names = [n for n in (parse_peer_names(None) if peer_names is None else peer_names)
             if n == "flashmla"]
    peers = _load_peers_into(report, names, peers_dir)
    flashmla = peers[0] if peers else None
    for shape, calls in host_rows(device, flashmla):
        row = {"suite": "host", "shape": shape, "results": []}
        for impl, fn in calls.items():
            entry = {"impl": impl}
            try:
                entry.update(host_time_us(fn))
                entry["gpu_us"] = graph_time_us([fn], reps=10) if impl != "raw kernel" else None
            except Exception as exc:  # reported in the table, never dropped
                entry["error"] = one_line(exc)
            row["results"].append(entry)
        by = {e["impl"]: e for e in row["results"]}
        fm = by.get("flashmla", {})
        for e in row["results"]:
            if "us" in fm and "us" in e and e["impl"] in HOST_GOALS:
                e["vs_flashmla"] = e["us"] / fm["us"]
                e["meets_goal"] = e["vs_flashmla"] <= HOST_GOALS[e["impl"]]
        report["rows"].append(row)
    return report


def _host_line(shape: str, e: dict, goals: dict) -> str:
    """One implementation's line of the host table."""
    if "error" in e:
        return f"{shape[:44]:44s} {e['impl']:16s} ERROR {e['error']}"

    def num(key: str, width: int) -> str:
        return f"{e[key]:{width}.1f}" if e.get(key) is not None else " " * width

    ratio = f"{e['vs_flashmla']:.2f}x" if "vs_flashmla" in e else ""
    goal = (f"<= {goals[e['impl']]}x {'met' if e['meets_goal'] else 'NOT met'}"
            if "meets_goal" in e else "")
    return (f"{shape[:44]:44s} {e['impl']:16s} {num('us', 8)} {num('us_best', 7)} "
            f"{num('cpu_us', 7)} {num('wall_us', 8)} {num('gpu_us', 7)} {ratio:>11s}  {goal}")


def format_host_table(report: dict) -> str:
    head = (f"{'shape':44s} {'impl':16s} {'host us':>8s} {'best':>7s} {'cpu us':>7s} "
            f"{'wall us':>8s} {'gpu us':>7s} {'vs flashmla':>11s}  goal")
    return "\n".join([
        f"{report['device']} ({report['sms']} SMs), {report['date']}, torch {report['torch']}, "
        f"cpu {report['cpu']}; host time per call: median of {report['repeats']} runs of "
        f"{report['calls']} back-to-back calls",
        *_peer_lines(report),
        head, "-" * len(head),
        *(_host_line(row["shape"], e, report["goals"]) for row in report["rows"]
          for e in row["results"]),
        "host us = host wall time per call (median; best of the runs beside it); cpu us = the "
        "thread's CPU time per call; wall us = device timeline per call of the same calls; gpu "
        "us = the call's kernels alone (graph replay); vs flashmla = host us / FlashMLA's host "
        "us (< 1: cheaper)"])


def save_plot(report: dict, path: str) -> None:
    """Bar chart: per shape, µs of each implementation (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if any("us" in e for e in r["results"])]
    impls = sorted({e["impl"] for r in rows for e in r["results"]})
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(rows)), 6))
    width = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        xs = [i + k * width for i, r in enumerate(rows)]
        ys = [next((e.get("us", 0) for e in r["results"] if e["impl"] == impl), 0) for r in rows]
        ax.bar(xs, ys, width, label=impl)
    ax.set_yscale("log")
    ax.set_ylabel("µs (median, graph replay)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([r["shape"] for r in rows], rotation=90, fontsize=6)
    ax.set_title(f"dsv4-tl bench, {report['device']}, {report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _peer_lines(report: dict) -> list:
    """Where each peer came from, and why each missing one is missing (one line each)."""
    return ([f"peer {name} from {where}" for name, where in report.get("peer_sources", {}).items()]
            + [f"peer {name} failed to load: {err}" for name, err in report["peer_errors"].items()])


def format_ratios(report: dict) -> str:
    """Per row, dsv4_tl against each peer that ran: peer µs / dsv4_tl µs (> 1: dsv4_tl is
    faster), or why there is no ratio; where FlashMLA was timed both padded and native, the
    faster of the two is marked."""
    lines = ["dsv4_tl vs each peer (peer time / dsv4_tl time; > 1: dsv4_tl is faster):"]
    for row in report["rows"]:
        by = {e["impl"]: e for e in row["results"]}
        ours = by.get("dsv4_tl", {})
        faster = flashmla_reference(row) if len(_flashmla_timed(row)) > 1 else None
        parts = []
        for name, e in by.items():
            if name == "dsv4_tl":
                continue
            if "us" in e and "us" in ours:
                mark = ", the faster FlashMLA call" if e is faster else ""
                parts.append(f"{name} {e['us'] / ours['us']:.2f}x ({e['us']:.1f} vs "
                             f"{ours['us']:.1f} us{mark})")
            elif "unsupported" in e:
                parts.append(f"{name} n/a ({e['unsupported']})")
            else:
                parts.append(f"{name} n/a ({'dsv4_tl failed' if 'us' in e else 'peer failed'})")
        lines.append(f"  {row['shape']}: {'; '.join(parts) if parts else 'no peer ran'}")
    return "\n".join(lines)


def format_table(report: dict) -> str:
    c = report["ceilings"]
    lines = [f"{report['device']} ({report['sms']} SMs), {report['date']}, torch {report['torch']}, "
             f"tilelang {report.get('tilelang', '?')}",
             f"ceilings: bf16 GEMM {c['bf16_gemm_tflops']:.0f} TFLOP/s, copy {c['copy_gbps']:.0f} GB/s "
             f"(best; median {c.get('copy_gbps_median', c['copy_gbps']):.0f})"]
    lines += _peer_lines(report)
    head = f"{'shape':68s} {'impl':15s} {'us':>9s} {'TFLOP/s':>8s} {'%gemm':>6s} {'GB/s':>7s} {'%copy':>6s} {'vs flashmla':>11s}  check"
    lines += [head, "-" * len(head)]
    for row in report["rows"]:
        by = {e["impl"]: e for e in row["results"]}
        fm, two_calls = flashmla_reference(row), len(_flashmla_timed(row)) > 1
        for e in row["results"]:
            if "error" in e:
                lines.append(f"{row['shape'][:68]:68s} {e['impl']:15s} ERROR {e['error']}")
                continue
            if "unsupported" in e:
                lines.append(f"{row['shape'][:68]:68s} {e['impl']:15s} {e['unsupported']}")
                continue
            if fm is None or (e is fm and not two_calls):
                ratio = ""  # no FlashMLA time, or FlashMLA's only one
            elif e is fm:
                ratio = "ref"  # the faster of FlashMLA's two calls: the others' reference
            else:
                ratio = f"{fm['us'] / e['us']:.2f}x"
            cost = ""
            if e["impl"] == INVARIANT and "us" in by.get("dsv4_tl", {}):
                cost = f", invariance costs {e['us'] / by['dsv4_tl']['us']:.3f}x"
            lines.append(f"{row['shape'][:68]:68s} {e['impl']:15s} {e['us']:9.1f} {e['tflops']:8.1f} "
                         f"{e['pct_gemm']:6.1f} {e['gbps']:7.0f} {e['pct_copy']:6.1f} {ratio:>11s}  "
                         f"{e['check']}{cost}")
    lines.append("vs flashmla = FlashMLA time / this row's time (> 1: faster than FlashMLA); "
                 f"{INVARIANT} = dsv4_tl with batch_invariant=True (its cost: time / dsv4_tl's)")
    lines.append("prefill below 64 heads: flashmla = FlashMLA padded to 64 heads (as vLLM 0.26 "
                 "calls it), flashmla.native = given the real heads; FlashMLA time = the faster "
                 "of the two (marked ref)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .cli_args import OneLineParser

    parser = OneLineParser(prog="dsv4-tl bench", description=__doc__.split("\n\n")[0],
                           epilog="--shape: " + SHAPE_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["decode", "prefill", "gather", "insert", "all",
                                            "host"], default="all",
                        help="all: the kernel-time suites; host: host time per call")
    parser.add_argument("--shape", action="append", metavar="KIND:FIELD=V,...",
                        help="time this decode / prefill shape instead of the suites "
                             "(repeatable; syntax below)")
    parser.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR"),
                        help="unpacked peer bundle (…/dsv4_peers), searched after an installed "
                             "vllm and flash_mla; default $PEERS_DIR")
    parser.add_argument("--peers", default="all",
                        help="comma list of peers to time beside dsv4_tl, 'all' (default), "
                             "'none', or 'list' (print where each peer is found, then exit); "
                             "known: " + ",".join(PEER_NAMES) + ". Timing imports and runs "
                             "the installed peers' code (a flash_mla package, vLLM's Triton "
                             "files, FlashMLA's extension) in this process; 'list' loads them "
                             "in a child process, ended after "
                             f"{PEER_LIST_TIMEOUT_S:g} s")
    parser.add_argument("--quick", action="store_true", help="a subset of the decode shapes")
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.peers.strip() == "list":
        ok, text = peer_list_isolated(args.peers_dir)
        print(text if ok else f"dsv4-tl bench: --peers list: {text}",
              file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    try:
        peer_names = parse_peer_names(args.peers)
        shapes = [parse_shape(text) for text in args.shape or []]
    except ValueError as exc:
        parser.error(str(exc))
    if shapes and args.suite != "all":
        parser.error(f"--shape replaces the suites; drop --suite {args.suite}")
    if not torch.cuda.is_available():
        print("dsv4-tl bench: needs a CUDA device", file=sys.stderr)
        return 2
    if args.suite == "host":
        report = run_host_suite(args.peers_dir, peer_names)
        table = format_host_table(report)
    elif shapes:
        suites = [suite for suite, cls in (("decode", DecodeShape), ("prefill", PrefillShape))
                  if any(isinstance(shape, cls) for shape in shapes)]
        report = run_bench(suites, args.peers_dir, False, peer_names=peer_names, shapes=shapes)
        table = format_table(report) + "\n" + format_ratios(report)
    else:
        suites = ["decode", "prefill", "gather", "insert"] if args.suite == "all" else [args.suite]
        report = run_bench(suites, args.peers_dir, args.quick, peer_names=peer_names)
        table = format_table(report)
    report["table"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(table)
    if args.plot:
        try:
            save_plot(report, args.plot)
        except ImportError as exc:
            print(f"dsv4-tl bench: no chart ({exc})", file=sys.stderr)
    failed = [e for r in report["rows"] for e in r["results"] if "error" in e and e["impl"] == "dsv4_tl"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
