"""CPU test of ``scripts/multi_gpu_check.py``'s checking logic (the 2-GPU run itself needs two
GPUs): with the kernels replaced by the float32 references its decode and prefill cases
pass, and an output left unwritten (NaN poison) or a wrong value fails them."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import dsv4_tl.ops as ops
from dsv4_tl.reference import sparse_decode_ref, sparse_prefill_ref

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "multi_gpu_check.py"


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("multi_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return module


def _decode_by_reference(damage):
    def run(q, k_cache, idx, lens, scale, sink, e_cache, e_idx, e_lens, *, out, lse):
        ref_out, ref_lse = sparse_decode_ref(q, k_cache, idx, lens, scale, sink, e_cache,
                                             e_idx, e_lens)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        damage(out)
        return out, lse
    return run


def _prefill_by_reference(damage):
    def run(q, kv, idx, scale, sink, lens, *, out, max_logits, lse):
        ref = sparse_prefill_ref(q, kv, idx, scale, attn_sink=sink, topk_length=lens)
        for dst, src in zip((out, max_logits, lse), ref):
            dst.copy_(src)
        damage(out)
        return out, max_logits, lse
    return run


def _keep(out):
    return None


def _unwritten(out):
    out.view(-1)[7] = math.nan


def _wrong(out):
    out.view(-1)[7] += 1.0


def test_the_cases_pass_with_correct_kernels(script, monkeypatch):
    monkeypatch.setattr(ops, "sparse_decode", _decode_by_reference(_keep))
    monkeypatch.setattr(ops, "sparse_prefill", _prefill_by_reference(_keep))
    cpu = torch.device("cpu")
    assert script._decode_case(cpu, torch.Generator().manual_seed(1)) == {
        "out_device": "cpu", "lse_device": "cpu"}
    assert script._prefill_case(cpu, torch.Generator().manual_seed(2)) == {"out_device": "cpu"}


@pytest.mark.parametrize("damage,message", [(_unwritten, "NaN"), (_wrong, "out of tolerance")])
def test_the_cases_catch_wrong_or_unwritten_outputs(script, monkeypatch, damage, message):
    monkeypatch.setattr(ops, "sparse_decode", _decode_by_reference(damage))
    monkeypatch.setattr(ops, "sparse_prefill", _prefill_by_reference(damage))
    cpu = torch.device("cpu")
    with pytest.raises(AssertionError, match=message):
        script._decode_case(cpu, torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match=message):
        script._prefill_case(cpu, torch.Generator().manual_seed(2))
