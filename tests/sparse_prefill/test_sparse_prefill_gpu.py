"""GPU tests of sparse prefill (dense and ragged) against the float32 reference.

Fresh random inputs every run, all three outputs poisoned with NaN before every call.
Tolerances as for decode: out |err| <= out_abs_tol(max |kv|) + 2/128·|ref| and relative
Frobenius <= 1e-2 (bf16 output, P rounded to bf16 before PV); max_logits/lse see only fp32
accumulation of exact bf16 products: |err| <= 1e-3 + 2^-13·|ref|.
"""

import contextlib
import math

import pytest
import torch

from cases import (SCALE, check_prefill, check_sparse_prefill, check_sparse_prefill_ragged,
                   poisoned_prefill_outputs, prefill_inputs, to_csr)

from dsv4_tl import tune
from dsv4_tl.ops import sparse_prefill, sparse_prefill_ragged
from dsv4_tl.ops._dispatch import schedule_of
from dsv4_tl.reference import sparse_prefill_ref
from dsv4_tl.targets import target_for_device
from dsv4_tl.testing import clamped_csr_as_dense

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"


def _inputs(s_q, h, s_kv, topk, gen, *, sink="mixed"):
    return prefill_inputs(s_q, h, s_kv, topk, gen, sink_kind=sink)


def _poisoned(s_q, h):
    return poisoned_prefill_outputs(s_q, h, DEV)


@pytest.mark.parametrize(
    "s_q,h,s_kv,topk",
    [(64, 128, 4096, 1152), (96, 64, 2048, 640), (33, 128, 1024, 128), (17, 16, 2048, 512),
     (40, 32, 3000, 200), (8, 64, 9000, 8320)],
    ids=lambda v: str(v),
)
def test_prefill_dense_matches_reference(s_q, h, s_kv, topk, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    check_sparse_prefill(*_inputs(s_q, h, s_kv, topk, gen))


@pytest.mark.parametrize("sink", ["none", "-inf", "+inf", "finite"])
def test_prefill_sink(sink, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    check_sparse_prefill(*_inputs(24, 64, 1024, 256, gen, sink=sink))


def test_prefill_no_topk_length(seed):
    """topk_length None: every column counts (only -1 / out-of-range entries are skipped)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, kv, idx, lens, sink = _inputs(16, 128, 2048, 384, gen)
    idx.view(16, 384)[torch.arange(384, device=DEV)[None] >= lens[:, None]] = -1
    check_sparse_prefill(q, kv, idx, None, sink)


@pytest.mark.parametrize("h", [64, 128, 16])
def test_prefill_ragged_matches_dense(h, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    s_q, topk = 48, 640
    q, kv, idx, lens, sink = _inputs(s_q, h, 4096, topk, gen)
    outs = check_sparse_prefill_ragged(q, kv, *to_csr(idx, lens), sink)
    dense = sparse_prefill(q, kv, idx, SCALE, sink, lens)
    for name, a, b in zip(("out", "max_logits", "lse"), outs, dense):
        assert torch.equal(a, b), f"{name}: ragged and dense kernels differ"


# h 64 / 128 with the plain schedule (what their buckets take at this width) and with the
# warp-specialised seesaw forced; h 16 / 32 take the tokens-in-M schedule (their buckets):
# every producer's clamped, read-ahead index reads meet malformed windows.
@pytest.mark.parametrize("h,forced", [(64, None), (128, "ws"), (64, "ws"), (16, None), (32, None)])
def test_prefill_ragged_malformed_indptr_is_safe(seed, h, forced):
    """indptr past nnz / decreasing: clamped in the kernel, never read out of bounds; rows
    whose clamped window is empty are lonely."""
    gen = torch.Generator(DEV).manual_seed(seed)
    s_q = 6
    q, kv, idx, lens, sink = _inputs(s_q, h, 512, 64, gen)
    flat, _ = to_csr(idx, torch.full((s_q,), 64, dtype=torch.int32, device=DEV))
    nnz = flat.numel()
    indptr = torch.tensor([0, 64, 10, nnz + 1000, 2**31 - 1, -7, nnz], dtype=torch.int32,
                          device=DEV)
    outs = _poisoned(s_q, h)
    config = None
    if forced == "ws":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the warp-specialised schedule is sm_90a's")
        config = {**_prefill_schedule(h, 8320), "warp_specialized": True, "threads": 384,
                  "heads_per_block": 64, "block_tokens": 64, "num_stages": 0}
    with (tune.forcing(target_for_device(torch.device(DEV)), "sparse_prefill", config)
          if config else contextlib.nullcontext()):
        sparse_prefill_ragged(q, kv, flat, indptr, SCALE, sink, out=outs[0],
                              max_logits=outs[1], lse=outs[2])
        torch.cuda.synchronize()
    dense, lens_t = clamped_csr_as_dense(flat, indptr)
    check_prefill(outs, sparse_prefill_ref(q, kv, dense, SCALE, 512, sink, lens_t), kv)


def test_prefill_empty_kv():
    q = torch.randn((4, 64, 512), device=DEV).to(torch.bfloat16)
    kv = torch.empty((0, 1, 512), dtype=torch.bfloat16, device=DEV)
    idx = torch.zeros((4, 1, 128), dtype=torch.int32, device=DEV)
    out, ml, lse = sparse_prefill(q, kv, idx, SCALE)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((ml == -math.inf).all()) and bool((lse == math.inf).all())


# --- tokens-in-M schedule (TP head counts: heads in wgmma N, KV tokens in M) ----------------
def _prefill_schedule(h, topk):
    return schedule_of("sparse_prefill", torch.device(DEV), h=h, topk=topk)


@pytest.mark.parametrize(
    "s_q,h,s_kv,topk",
    [(37, 16, 4096, 1152), (29, 32, 5000, 640), (21, 8, 3000, 200), (19, 24, 2048, 333),
     (5, 1, 1024, 64)],
    ids=lambda v: str(v),
)
def test_prefill_tp_heads_run_tokens_in_m(s_q, h, s_kv, topk, seed):
    """h <= 32 resolves to the tokens-in-M schedule on sm_90a, and it matches the reference:
    per-row lengths (a full row, a lonely row), -1 and out-of-range entries, garbage past
    the length, sinks -inf / +inf / finite; 8, 24 and 1 heads are padded inside the head
    group (16 or 32), and tile counts are not multiples of the K buffers."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tokens-in-M schedule is the sm_90a schedule of these head counts")
    assert _prefill_schedule(h, topk)["tokens_in_m"]
    gen = torch.Generator(DEV).manual_seed(seed)
    check_sparse_prefill(*_inputs(s_q, h, s_kv, topk, gen))


@pytest.mark.parametrize("h,num_stages,threads",
                         [(16, 2, 256), (16, 3, 256), (32, 2, 256), (16, 2, 384), (16, 3, 384),
                          (32, 2, 384)])
def test_prefill_tokens_in_m_each_layout_dense_and_ragged(h, num_stages, threads, seed):
    """Every K-buffer count the schedule takes (the barrier phases of each buffer cycle per
    round of num_stages tiles; the last round is partial) with one or two math warpgroups,
    dense and ragged, with the schedule forced; ragged and dense give the same bits."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tokens-in-M schedule needs sm_90a")
    config = {**_prefill_schedule(h, 640), "num_stages": num_stages, "threads": threads}
    assert config["tokens_in_m"] and config["heads_per_block"] == h
    gen = torch.Generator(DEV).manual_seed(seed)
    s_q, topk = 23, 1000  # 16 tiles of 64 for a full row
    q, kv, idx, lens, sink = _inputs(s_q, h, 6000, topk, gen)
    flat, indptr = to_csr(idx, lens)
    with tune.forcing(target_for_device(torch.device(DEV)), "sparse_prefill", config):
        dense = _poisoned(s_q, h)
        sparse_prefill(q, kv, idx, SCALE, sink, lens, out=dense[0], max_logits=dense[1],
                       lse=dense[2])
        ragged = _poisoned(s_q, h)
        sparse_prefill_ragged(q, kv, flat, indptr, SCALE, sink, out=ragged[0],
                              max_logits=ragged[1], lse=ragged[2])
        torch.cuda.synchronize()
    check_prefill(dense, sparse_prefill_ref(q, kv, idx, SCALE, 512, sink, lens), kv)
    for name, a, b in zip(("out", "max_logits", "lse"), ragged, dense):
        assert torch.equal(a, b), f"{name}: ragged and dense kernels differ"
