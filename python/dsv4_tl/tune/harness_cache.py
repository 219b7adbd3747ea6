"""Tuning harnesses of the FP8 cache ops (dequantize-and-gather, insert): bit-exact checks
on poisoned outputs."""

from ..kernels import DEQUANT_GATHER as GATHER_SPEC
from ..kernels import INSERT_K_CACHE as INSERT_SPEC
from .harness import OpHarness, assert_same, bench_module, poisoned_bf16


def _gather_inputs(rep, gen, sets: int, device) -> list:
    import torch

    from ..testing import random_paged_cache

    bs, per = rep.block_size, -(-rep.rows // rep.block_size)
    nb = rep.reqs * per + 2
    cache = random_paged_cache(nb, bs, gen, device)
    seq = torch.full((rep.reqs,), rep.rows, dtype=torch.int32, device=device)
    return [{"k_cache": cache, "seq_lens": seq, "block_size": bs,
             "block_table": torch.randperm(nb, generator=gen, device=device)[: rep.reqs * per]
             .view(rep.reqs, per).int(),
             "out": torch.empty((rep.reqs, rep.rows, 512), dtype=torch.bfloat16, device=device)}
            for _ in range(sets)]


def _gather_reference(x: dict, device):
    from ..reference import dequantize_and_gather_k_cache_ref

    want = poisoned_bf16(x["out"].shape, device)
    dequantize_and_gather_k_cache_ref(want, x["k_cache"], x["seq_lens"], None,
                                      x["block_table"], x["block_size"], 0)
    return want


def _gather_check(x: dict, ref, device) -> None:
    import torch

    from ..ops import dequantize_and_gather_k_cache

    out = poisoned_bf16(x["out"].shape, device)
    dequantize_and_gather_k_cache(out, x["k_cache"], x["seq_lens"], None,
                                  x["block_table"], x["block_size"], 0)
    torch.cuda.synchronize()
    assert_same("out (bf16 bits)", out.view(torch.int16), ref.view(torch.int16))


def _gather_call(x: dict):
    from ..ops import dequantize_and_gather_k_cache

    return lambda: dequantize_and_gather_k_cache(x["out"], x["k_cache"], x["seq_lens"], None,
                                                 x["block_table"], x["block_size"], 0)


DEQUANT_GATHER = OpHarness(
    spec=GATHER_SPEC,
    describe=lambda rep: dict(rows=rep.reqs * rep.rows),  # e4m3fn cache
    inputs=_gather_inputs,
    reference=_gather_reference,
    check=_gather_check,
    call=_gather_call,
)


def _insert_reference(x: dict, device):
    import torch

    from ..cache_format import cache_geometry
    from ..testing import CACHE_POISON, expected_insert

    cache = x["k_cache"]
    before = torch.full_like(cache_geometry(cache).flat, CACHE_POISON)
    return expected_insert(before.as_strided(cache.shape, cache.stride()), x["k"],
                           x["slot_mapping"], "e4m3fn")


def _insert_check(x: dict, ref, device) -> None:
    import torch

    from ..cache_format import cache_geometry
    from ..ops import insert_k_cache
    from ..testing import CACHE_POISON

    flat = cache_geometry(x["k_cache"]).flat
    flat.fill_(CACHE_POISON)
    insert_k_cache(x["k_cache"], x["k"], x["slot_mapping"])
    torch.cuda.synchronize()
    assert_same("k_cache bytes", flat, ref)


INSERT_K_CACHE = OpHarness(
    spec=INSERT_SPEC,
    describe=lambda rep: dict(tokens=rep.rows),  # e4m3fn cache
    inputs=lambda rep, gen, sets, device: bench_module().insert_inputs(
        rep.rows, rep.block_size, gen, sets, device)[0],
    reference=_insert_reference,
    check=_insert_check,
    call=lambda x: bench_module().ours_insert(x),
)
