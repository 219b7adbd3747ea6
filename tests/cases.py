"""One case generator for the kernel tests of every target.

The GPU tests (``<op>/test_<op>_gpu.py``, tensors on ``cuda``) and the SYCL tests
(``<op>/test_<op>_sycl.py``, CPU tensors that ``$DSV4_TL_SYCL_DEVICE`` sends to Intel's SYCL
CPU device) draw their inputs, poisoned outputs and checks from here, so both targets meet
the same corner cases: -1 holes and garbage past ``topk_length``, lonely rows, sinks of
every kind, slots and block ids outside the cache, padding tokens. Every function draws its
randomness from the ``gen`` it is given and makes its tensors on that generator's device.
"""

import functools
import math
from typing import Optional

import torch

from dsv4_tl import ops, reference
from dsv4_tl.kernels import KERNELS
from dsv4_tl.ops import sparse_decode, sparse_prefill, sparse_prefill_ragged
from dsv4_tl.reference import sparse_decode_ref, sparse_prefill_ragged_ref, sparse_prefill_ref
from dsv4_tl.testing import (
    cache_kmax,
    check_attention,
    poison_past_length,
    punch_holes,
    random_k,
    random_paged_cache,
    scatter_slots,
)

SCALE = 512 ** -0.5
# Reference tests: two fp32 evaluations of the same sums with different matmul blocking (chunk
# size, padded width, CPU vs GPU) differ by a few ulps of O(1) values; 1e-5 is ~100 ulps and
# far below the size of any real masking / scaling bug (>= 1e-3 there).
SAME_SUM_TOL = dict(atol=1e-5, rtol=1e-5)
WINDOW = 128  # the sliding window: rows of the SWA scope
BF16_POISON = 0x7FA1  # a NaN payload no dequantised value has
I32_POISON = -7  # never produced by the index ops for these inputs


def randint(lo: int, hi: int, shape, gen: torch.Generator) -> torch.Tensor:
    """int32 uniform in [lo, hi) on ``gen``'s device."""
    return torch.randint(lo, hi, shape, generator=gen, device=gen.device, dtype=torch.int32)


def make_sink(h: int, gen: torch.Generator, kind: str = "mixed"):
    """Attention sink [h] fp32: ``none`` (None), ``-inf``, ``+inf``, ``finite`` (uniform in
    [-2, 2)) or ``mixed`` (finite, with heads 1 and 2 at -inf and +inf when h >= 4)."""
    dev = gen.device
    if kind == "none":
        return None
    if kind == "-inf":
        return torch.full((h,), -math.inf, device=dev)
    if kind == "+inf":
        return torch.full((h,), math.inf, device=dev)
    value = torch.rand(h, generator=gen, device=dev) * 4 - 2
    if kind == "mixed" and h >= 4:
        value[1], value[2] = -math.inf, math.inf
    return value


# ----------------------------------------------------------------------------- sparse decode
def decode_scope(b: int, s_q: int, width: int, block_size: int, blocks_per_req: int,
                 gen: torch.Generator, *, full: bool = False, fp8_format: str = "e4m3fn"):
    """(cache, indices [b, s_q, width] int32) of one scope: a scattered paged cache where
    every request owns ``blocks_per_req`` random blocks of a pool 2x larger; rows pick random
    distinct positions (or all positions in order when ``full``)."""
    dev = gen.device
    num_blocks = 2 * b * blocks_per_req
    cache = random_paged_cache(num_blocks, block_size, gen, dev, fp8_format)
    table = torch.randperm(num_blocks, generator=gen, device=dev)[: b * blocks_per_req]
    table = table.view(b, blocks_per_req)
    capacity = blocks_per_req * block_size
    idx = torch.empty((b, s_q, width), dtype=torch.int32, device=dev)
    for r in range(b):
        for s in range(s_q):
            if full:
                pos = torch.arange(width, device=dev) % capacity
            else:
                pos = torch.randperm(capacity, generator=gen, device=dev)[:width]
            idx[r, s] = scatter_slots(table[r], pos, block_size)
    return cache, idx


def lengths(b: int, width: int, gen: torch.Generator, *, full_rows: int = 1) -> torch.Tensor:
    """Per-request lengths [b] int32 in [0, width]; the first ``full_rows`` use the whole width."""
    lens = randint(0, width + 1, (b,), gen)
    lens[:full_rows] = width
    return lens


def compressed_scope(b: int, s_q: int, extra_kind: str, gen: torch.Generator, *,
                     fp8_format: str = "e4m3fn"):
    """(cache, indices [b, s_q, width], width) of a decode step's compressed scope:
    ``c4a<width>`` (indexer top-k over compressed entries, bs 64) or ``c128a<width>`` (every
    visible compressed entry, in order, bs 2)."""
    if extra_kind.startswith("c4a"):
        width = int(extra_kind[3:])
        cache, idx = decode_scope(b, s_q, width, 64, width // 64 + 2, gen, fp8_format=fp8_format)
    else:
        width = int(extra_kind[5:])
        cache, idx = decode_scope(b, s_q, width, 2, width // 2, gen, full=True,
                                  fp8_format=fp8_format)
    return cache, idx, width


def decode_case(b: int, s_q: int, h: int, extra_kind: str, gen: torch.Generator, *,
                sink_kind: str = "mixed", holes: float = 0.1, lonely_row: bool = True,
                fp8_format: str = "e4m3fn"):
    """(q, (k_cache, indices, topk_length), extra scope triple, sink) of a DSv4 decode step:
    the 128-token SWA scope (bs 64) plus ``extra_kind``: ``swa`` (none), ``c4a<width>``
    (indexer top-k over compressed entries, bs 64) or ``c128a<width>`` (every visible
    compressed entry, bs 2, variable length). Holes, garbage past the lengths and, with
    ``lonely_row``, a last request with nothing valid in either scope."""
    q = torch.randn((b, s_q, h, 512), generator=gen, device=gen.device).to(torch.bfloat16)
    k_cache, idx = decode_scope(b, s_q, WINDOW, 64, 3, gen, fp8_format=fp8_format)
    lens = lengths(b, WINDOW, gen)
    extra = (None, None, None)
    if extra_kind != "swa":
        e_cache, e_idx, width = compressed_scope(b, s_q, extra_kind, gen, fp8_format=fp8_format)
        e_lens = lengths(b, width, gen)
        punch_holes(e_idx, e_lens, holes, gen)
        poison_past_length(e_idx, e_lens, gen)
        extra = (e_cache, e_idx, e_lens)
    punch_holes(idx, lens, holes, gen)
    poison_past_length(idx, lens, gen)
    if lonely_row and b > 1:
        lens[-1] = 0
        if extra[2] is not None:
            extra[2][-1] = 0
    return q, (k_cache, idx, lens), extra, make_sink(h, gen, sink_kind)


def check_decode(q, main, extra, sink_t, fp8_format: str = "e4m3fn") -> None:
    """Run ``sparse_decode`` into NaN-poisoned ``out``/``lse`` and check them against the
    float32 reference with the attention tolerances (:func:`dsv4_tl.testing.check_attention`)."""
    (k_cache, idx, lens), (e_cache, e_idx, e_lens) = main, extra
    b, s_q, h, _ = q.shape
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=q.device)
    got_out, got_lse = sparse_decode(q, k_cache, idx, lens, SCALE, sink_t, e_cache, e_idx,
                                     e_lens, fp8_format=fp8_format, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_ref(q, k_cache, idx, lens, SCALE, sink_t, e_cache, e_idx,
                                         e_lens, fp8_format=fp8_format)
    kmax = max(cache_kmax(c, fp8_format) for c in (k_cache, e_cache) if c is not None)
    check_attention(kmax, out, ref_out, lse=(lse, ref_lse))


# ----------------------------------------------------------------------------- sparse prefill
def prefill_inputs(s_q: int, h: int, s_kv: int, topk: int, gen: torch.Generator, *,
                   holes: float = 0.1, sink_kind: str = "mixed"):
    """(q, kv, indices [s_q, 1, topk], topk_length, sink): distinct random rows per query,
    the first row full and (s_q > 1) the last lonely, -1 holes and out-of-range rows inside
    the length, int32 extremes and negatives past it."""
    dev = gen.device
    q = torch.randn((s_q, h, 512), generator=gen, device=dev).to(torch.bfloat16)
    kv = random_k(s_kv, gen, dev).view(s_kv, 1, 512)
    idx = torch.stack([torch.randperm(s_kv, generator=gen, device=dev)[:topk]
                       for _ in range(s_q)]).int().view(s_q, 1, topk)
    lens = randint(0, topk + 1, (s_q,), gen)
    lens[0] = topk
    if s_q > 1:
        lens[-1] = 0  # lonely row
    inside = torch.arange(topk, device=dev)[None] < lens[:, None]
    hole = (torch.rand((s_q, topk), generator=gen, device=dev) < holes) & inside
    idx.view(s_q, topk)[hole] = -1
    oob = (torch.rand((s_q, topk), generator=gen, device=dev) < 0.02) & inside
    idx.view(s_q, topk)[oob] = s_kv  # out-of-range rows inside the length are skipped too
    garbage = torch.tensor([2**31 - 1, -(2**31), -5, s_kv], dtype=torch.int32, device=dev)
    pick = torch.randint(0, len(garbage), (s_q, topk), generator=gen, device=dev)
    idx.view(s_q, topk)[~inside] = garbage[pick][~inside]
    return q, kv, idx, lens, make_sink(h, gen, sink_kind)


def to_csr(idx: torch.Tensor, lens: torch.Tensor):
    """(flat, indptr) CSR rows holding the first lens[i] entries of each dense row of
    ``idx`` [s_q, 1, topk] (the garbage past the lengths dropped)."""
    s_q = idx.shape[0]
    rows = [idx[i, 0, : int(lens[i])] for i in range(s_q)]
    indptr = torch.zeros(s_q + 1, dtype=torch.int32, device=idx.device)
    indptr[1:] = torch.cumsum(lens.long(), 0).int()
    flat = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int32, device=idx.device)
    return flat.int().contiguous(), indptr


def poisoned_prefill_outputs(s_q: int, h: int, device):
    """NaN-filled (out [s_q, h, 512] bf16, max_logits [s_q, h], lse [s_q, h] fp32)."""
    return (torch.full((s_q, h, 512), math.nan, dtype=torch.bfloat16, device=device),
            torch.full((s_q, h), math.nan, device=device),
            torch.full((s_q, h), math.nan, device=device))


def check_prefill(got, ref, kv) -> None:
    """``got`` = (out, max_logits, lse) against the reference's, attention tolerances."""
    (out, ml, lse), (r_out, r_ml, r_lse) = got, ref
    check_attention(float(kv.float().abs().max()), out, r_out, max_logits=(ml, r_ml),
                    lse=(lse, r_lse))


def _check_into_poisoned(run, ref, q, kv) -> tuple:
    """``run(out=, max_logits=, lse=)`` into NaN-poisoned outputs of ``q``'s prefill, checked
    against ``ref`` (:func:`check_prefill`); returns (out, max_logits, lse)."""
    out, ml, lse = poisoned_prefill_outputs(q.shape[0], q.shape[1], q.device)
    run(out=out, max_logits=ml, lse=lse)
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    check_prefill((out, ml, lse), ref, kv)
    return out, ml, lse


def check_sparse_prefill(q, kv, idx, lens, sink) -> tuple:
    """``sparse_prefill`` into poisoned outputs against the float32 reference; returns them."""
    run = functools.partial(sparse_prefill, q, kv, idx, SCALE, sink, lens)
    return _check_into_poisoned(run, sparse_prefill_ref(q, kv, idx, SCALE, 512, sink, lens), q, kv)


def check_sparse_prefill_ragged(q, kv, flat, indptr, sink) -> tuple:
    """``sparse_prefill_ragged`` (CSR rows) into poisoned outputs against the float32
    reference; returns them."""
    run = functools.partial(sparse_prefill_ragged, q, kv, flat, indptr, SCALE, sink)
    ref = sparse_prefill_ragged_ref(q, kv, flat, indptr, SCALE, 512, sink)
    return _check_into_poisoned(run, ref, q, kv)


# ----------------------------------------------------------------------------- bit-exact ops
def poisoned_bf16(shape, device) -> torch.Tensor:
    """bf16 filled with :data:`BF16_POISON`."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    out.view(torch.int16).fill_(BF16_POISON)
    return out


def poisoned_i32(shape, device) -> torch.Tensor:
    """int32 filled with :data:`I32_POISON`."""
    return torch.full(shape, I32_POISON, dtype=torch.int32, device=device)


def poison_allocator(numel: int, device) -> None:
    """Best effort: leave -7 in the caching allocator's free blocks of about this size, so
    that an element a ragged op allocates but never writes shows up as a mismatch."""
    for n in {max(numel, 1), max(numel, 1) + 128, 4096}:
        junk = torch.full((n,), I32_POISON, dtype=torch.int32, device=device)
        del junk


def _fail_at_first_difference(name: str, got, want, seed: int, what: str, show) -> None:
    bad = (got != want).nonzero()
    first = tuple(bad[0].tolist())
    raise AssertionError(f"{name}: {bad.shape[0]} {what} differ (seed {seed}); first at {first}: "
                         f"got {show(got[first])}, want {show(want[first])}")


def assert_same_bits(name: str, got, want, seed: int) -> None:
    """bf16 tensors equal bit for bit (compared as int16), naming the first difference."""
    g, w = got.view(torch.int16), want.view(torch.int16)
    if not torch.equal(g, w):
        _fail_at_first_difference(name, g, w, seed, "bf16 elements",
                                  lambda v: f"{int(v) & 0xFFFF:#06x}")


def assert_equal(name: str, got, want, seed: int) -> None:
    """Same dtype, shape and values, naming the first difference."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)} (seed {seed})"
    )
    if not torch.equal(got, want):
        _fail_at_first_difference(name, got, want, seed, "elements", lambda v: int(v))


def assert_dense_ragged_agree(dense, lens, flat, indptr, seed: int) -> None:
    """Ragged row t (``flat[indptr[t]:indptr[t+1]]``) = the first lens[t] dense entries."""
    assert_equal("indptr[1:] - indptr[:-1]", indptr[1:] - indptr[:-1], lens, seed)
    cols = torch.arange(dense.shape[1], device=dense.device)[None, :]
    assert_equal("flat vs dense prefixes", flat, dense[cols < lens[:, None]], seed)


def prefill_chunk_gathers(gen: torch.Generator, fp8_format: str = "e4m3fn"):
    """(M, N, calls) of the two gathers of one C4A prefill chunk into a workspace [R, M, 512]
    (spec §2): 4 requests, compressed entries to columns [0, seq // 4), then the SWA window
    to [N, N + gather_len). Each call is the argument tuple after ``out``: (cache, seq_lens,
    gather_lens, block_table, block_size, offset), caches and tables scattered."""
    dev = gen.device
    window, cr = 128, 4
    prefix = torch.tensor([0, 300, 1000, 37], dtype=torch.int64)
    q_len = torch.tensor([50, 20, 130, 1], dtype=torch.int64)
    seq = prefix + q_len
    R = len(seq)
    comp_len = seq // cr
    swa_gather = q_len + torch.minimum(prefix, torch.tensor(window - 1))
    N = int(comp_len.max())
    M = N + int(swa_gather.max())
    comp_blocks, swa_blocks = int((comp_len.max() + 63) // 64), int((seq.max() + 63) // 64)
    comp_cache = random_paged_cache(R * comp_blocks + 2, 64, gen, dev, fp8_format)
    swa_cache = random_paged_cache(R * swa_blocks + 2, 64, gen, dev, fp8_format)
    comp_bt = torch.randperm(R * comp_blocks + 2, generator=gen, device=dev)[: R * comp_blocks]
    swa_bt = torch.randperm(R * swa_blocks + 2, generator=gen, device=dev)[: R * swa_blocks]
    calls = [(comp_cache, comp_len.int().to(dev), None, comp_bt.view(R, comp_blocks).int(), 64, 0),
             (swa_cache, seq.int().to(dev), swa_gather.int().to(dev),
              swa_bt.view(R, swa_blocks).int(), 64, N)]
    return M, N, calls


# ----------------------------------------------------------------------------- index helpers
def global_topk_inputs(gen: torch.Generator, T: int, K: int, R: int, max_blocks: int, bs: int):
    """(topk_indices, token_to_req, block_table, is_valid_token): indexer rows with a valid
    prefix then -1 (plus stray -1 holes and entries past the block table), a missing block,
    tokens of requests outside [0, R) and invalid (padding) tokens."""
    dev = gen.device
    nb = R * max_blocks + 4
    bt = torch.randperm(nb, generator=gen, device=dev)[: R * max_blocks].view(R, max_blocks).int()
    bt[0, -1] = -1  # a missing block
    n_valid = randint(0, K + 1, (T,), gen)
    n_valid[0] = K
    local = randint(0, (max_blocks + 2) * bs, (T, K), gen)  # some map past the table
    cols = torch.arange(K, device=dev)[None, :]
    local[cols >= n_valid[:, None]] = -1
    holes = torch.rand((T, K), generator=gen, device=dev) < 0.05
    local[holes] = -1
    t2r = randint(0, R, (T,), gen)
    t2r[1], t2r[2] = -1, R  # requests outside [0, R)
    valid = torch.rand((T,), generator=gen, device=dev) < 0.8
    valid[0] = True
    return local, t2r, bt, valid


def combine_chunk(gen: torch.Generator, prefix, q_len, cr: int, K: int, window: int,
                  extra_tokens: int = 3, qsl_base: int = 11):
    """((topk_indices, query_start_loc, seq_lens, gather_lens), M, N) of one prefill chunk as
    vLLM builds it (later VA sizing of N and M): ``extra_tokens`` padding tokens past
    qsl[-1], qsl rebased by ``qsl_base`` (the op rebases it)."""
    dev = gen.device
    prefix = torch.tensor(prefix, dtype=torch.int64)
    q_len = torch.tensor(q_len, dtype=torch.int64)
    seq = prefix + q_len
    gather = q_len + torch.minimum(prefix, torch.tensor(max(window - 1, 0)))
    N = int((seq // cr).max()) if cr > 1 else 0
    M = N + int(gather.max())
    qsl = torch.zeros(len(q_len) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_len, 0)
    qsl += qsl_base
    Tc = int(q_len.sum()) + extra_tokens
    # indexer rows: request-local compressed rows < (pos + 1) // cr
    pos_cap = int(seq.max()) // max(cr, 1) + 1
    topk_idx = randint(0, max(pos_cap, 1), (Tc, K), gen)
    return (topk_idx, qsl.int().to(dev), seq.int().to(dev), gather.int().to(dev)), M, N


def check_index_op(op: str, args: tuple, seed: int, width: Optional[int] = None) -> tuple:
    """Index helper ``op`` (``global_topk``, ``combine_topk_swa``; its front ends and
    references by the names its spec lists) on ``args``, both forms exactly against their
    references and against each other: the dense form into -7-poisoned ``[T, width]`` /
    ``[T]`` outputs that it must return (with ``width`` None, into outputs it allocates),
    then the ragged form after :func:`poison_allocator`. Returns the dense (rows, lens)."""
    spec = KERNELS[op]
    dense, ragged = (getattr(ops, name) for name in spec.front_ends)
    dense_ref, ragged_ref = (getattr(reference, name) for name in spec.references)
    num_tokens, dev = args[0].shape[0], args[0].device
    if width is None:
        rows, lens = dense(*args)
    else:
        given = poisoned_i32((num_tokens, width), dev), poisoned_i32((num_tokens,), dev)
        rows, lens = dense(*args, out=given[0], lens=given[1])
        assert rows is given[0] and lens is given[1]
    want = dense_ref(*args)
    assert_equal(f"{op} rows", rows, want[0], seed)
    assert_equal("lens", lens, want[1], seed)

    poison_allocator(int(want[1].sum()) + num_tokens + 1, dev)
    flat, indptr = ragged(*args)
    r_flat, r_indptr = ragged_ref(*args)
    assert_equal("indptr", indptr, r_indptr, seed)
    assert_equal("flat", flat, r_flat, seed)
    assert_dense_ragged_agree(rows, lens, flat, indptr, seed)
    return rows, lens
