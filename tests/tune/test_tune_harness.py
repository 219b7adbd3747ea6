"""The tuning harnesses (``dsv4_tl.tune.harnesses``) on the CPU: every tunable op's entry makes
inputs, computes its reference, and its check passes a front end that returns the reference and
rejects one that spoils a single element. The front ends are faked by the float32 references
(the real ones run on the GPU: ``scripts/device_tune.sh``)."""

import pytest
import torch

import dsv4_tl.ops as ops
from dsv4_tl import reference as R
from dsv4_tl.bench import DecodeShape, PrefillShape
from dsv4_tl.cache_format import cache_geometry
from dsv4_tl.testing import expected_insert
from dsv4_tl.tune import HARNESSES, TUNABLE_OPS
from dsv4_tl.tune.suites import CombineShape, GatherShape, GlobalTopkShape, InsertShape

CPU = torch.device("cpu")
# Small representatives (the suite's are GPU-sized); each op's own shape class.
TINY = {
    "sparse_decode": DecodeShape(64, 2, "c4a"),
    "sparse_prefill": PrefillShape(64, 8, 128, 1024),
    "dequant_gather": GatherShape(2, 70),
    "insert_k_cache": InsertShape(8),
    "global_topk": GlobalTopkShape(16, 32, 4, 4),
    "combine_topk_swa": CombineShape((0, 300), (16, 16), 4, 32, 32),
}


def _fake_decode(q, k_cache, indices, topk_length, scale, attn_sink, extra_k_cache,
                 extra_indices, extra_topk_length, out=None, lse=None, batch_invariant=False):
    ref_out, ref_lse = R.sparse_decode_ref(q, k_cache, indices, topk_length, scale, attn_sink,
                                           extra_k_cache, extra_indices, extra_topk_length)
    return _written((out, lse), (ref_out, ref_lse))


def _fake_prefill(q, kv, indices, scale, attn_sink, topk_length, out=None, max_logits=None,
                  lse=None):
    ref = R.sparse_prefill_ref(q, kv, indices, scale, 512, attn_sink, topk_length)
    return _written((out, max_logits, lse), ref)


def _fake_gather(out, *args):
    R.dequantize_and_gather_k_cache_ref(out, *args)
    return _spoiled(out)


def _fake_insert(k_cache, k, slot_mapping):
    flat = cache_geometry(k_cache).flat
    flat.copy_(expected_insert(k_cache, k, slot_mapping, "e4m3fn"))
    _spoiled(flat)


def _fake_global(*args, out=None, lens=None):
    return _written((out, lens), R.compute_global_topk_indices_and_lens_ref(*args))


def _fake_combine(*args, out=None, lens=None):
    return _written((out, lens), R.combine_topk_swa_indices_ref(*args))


FAKES = {"sparse_decode": ("sparse_decode", _fake_decode),
         "sparse_prefill": ("sparse_prefill", _fake_prefill),
         "dequant_gather": ("dequantize_and_gather_k_cache", _fake_gather),
         "insert_k_cache": ("insert_k_cache", _fake_insert),
         "global_topk": ("compute_global_topk_indices_and_lens", _fake_global),
         "combine_topk_swa": ("combine_topk_swa_indices", _fake_combine)}
SPOIL = {"on": False}


def _spoiled(t):
    """``t`` with its first element changed when the test asks for a broken front end."""
    if SPOIL["on"]:
        flat = t.view(-1)
        if t.is_floating_point():
            flat[0] = 1000.0
        else:
            flat[0] ^= 1
    return t


def _written(outs, refs):
    results = []
    for out, ref in zip(outs, refs):
        if out is None:
            results.append(ref.clone())
        else:
            results.append(out.copy_(ref))
    _spoiled(results[0])
    return tuple(results)


def test_every_tunable_op_has_a_case_here():
    assert set(TINY) == set(TUNABLE_OPS) == set(FAKES)


@pytest.mark.parametrize("op", TUNABLE_OPS)
def test_harness_checks_through_the_front_end(op, monkeypatch):
    name, fake = FAKES[op]
    monkeypatch.setattr(ops, name, fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    harness, rep = HARNESSES[op], TINY[op]
    inputs = harness.inputs(rep, torch.Generator(CPU).manual_seed(0), 2, CPU)
    assert len(inputs) == 2
    ref = harness.reference(inputs[0], CPU)
    harness.check(inputs[0], ref, CPU)  # the reference's own result passes
    harness.call(inputs[1])()  # the timed closure reaches the front end
    SPOIL["on"] = True
    try:
        with pytest.raises(AssertionError):
            harness.check(inputs[0], ref, CPU)
    finally:
        SPOIL["on"] = False
