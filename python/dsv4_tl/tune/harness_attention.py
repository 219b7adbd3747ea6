"""Tuning harnesses of the attention ops (sparse decode, sparse prefill): inputs from
:mod:`dsv4_tl.bench`'s makers, checked against the float32 references with the GPU tests'
tolerances (:func:`dsv4_tl.testing.check_attention`)."""

import math

from ..kernels import SPARSE_DECODE as DECODE_SPEC
from ..kernels import SPARSE_PREFILL as PREFILL_SPEC
from .harness import OpHarness, bench_module


def _decode_reference(x: dict, device):
    from ..reference import sparse_decode_ref
    from ..testing import cache_kmax

    ref = sparse_decode_ref(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                            bench_module().SCALE, x["attn_sink"], x["extra_k_cache"],
                            x["extra_indices"], x["extra_topk_length"])
    kmax = max(cache_kmax(c) for c in (x["k_cache"], x["extra_k_cache"]) if c is not None)
    return ref, kmax


def _decode_check(x: dict, ref, device) -> None:
    import torch

    from ..ops import sparse_decode
    from ..testing import check_attention

    (ref_out, ref_lse), kmax = ref
    b, s_q, h, _ = x["q"].shape
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=device)
    sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], bench_module().SCALE,
                  x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                  x["extra_topk_length"], out=out, lse=lse)
    torch.cuda.synchronize()
    check_attention(kmax, out, ref_out, lse=(lse, ref_lse))


SPARSE_DECODE = OpHarness(
    spec=DECODE_SPEC,
    describe=lambda rep: dict(h=rep.h, b=rep.b, s_q=rep.s_q, scope=rep.kind,
                              batch_invariant=rep.batch_invariant, extra_width=rep.extra_topk),
    inputs=lambda rep, gen, sets, device: bench_module().decode_inputs(rep, gen, sets, device),
    reference=_decode_reference,
    check=_decode_check,
    call=lambda x: bench_module().ours_decode(x),
)


def _prefill_reference(x: dict, device):
    from ..reference import sparse_prefill_ref

    ref = sparse_prefill_ref(x["q"], x["kv"], x["indices"], bench_module().SCALE, 512,
                             x["attn_sink"], x["topk_length"])
    return ref, float(x["kv"].float().abs().max())


def _prefill_check(x: dict, ref, device) -> None:
    import torch

    from ..ops import sparse_prefill
    from ..testing import check_attention

    (r_out, r_ml, r_lse), kmax = ref
    s_q, h = x["q"].shape[:2]
    out = torch.full((s_q, h, 512), math.nan, dtype=torch.bfloat16, device=device)
    ml = torch.full((s_q, h), math.nan, dtype=torch.float32, device=device)
    lse = torch.full((s_q, h), math.nan, dtype=torch.float32, device=device)
    sparse_prefill(x["q"], x["kv"], x["indices"], bench_module().SCALE, x["attn_sink"],
                   x["topk_length"], out=out, max_logits=ml, lse=lse)
    torch.cuda.synchronize()
    check_attention(kmax, out, r_out, max_logits=(ml, r_ml), lse=(lse, r_lse))


SPARSE_PREFILL = OpHarness(
    spec=PREFILL_SPEC,
    describe=lambda rep: dict(h=rep.h, topk=rep.topk),  # the dense front end
    inputs=lambda rep, gen, sets, device: bench_module().prefill_inputs(rep, gen, sets, device),
    reference=_prefill_reference,
    check=_prefill_check,
    call=lambda x: bench_module().ours_prefill(x),
)
