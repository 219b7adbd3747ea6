"""dequantize_and_gather_k_cache on Intel's SYCL CPU device, bit for bit against the
reference (set-up as ``sparse_decode/test_sparse_decode_sycl.py``), and the ahead-of-time
SPIR-V build reloaded in a fresh process without compiling."""

import os
import subprocess
import sys
import textwrap

import torch
from cases import BF16_POISON, poisoned_bf16
from conftest import on_sycl_cpu

from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
from dsv4_tl.reference import dequantize_and_gather_k_cache_ref
from dsv4_tl.testing import random_paged_cache

pytestmark = on_sycl_cpu()


def test_gather_matches_reference_bit_for_bit(cpu_gen):
    R, max_blocks, bs = 4, 5, 64
    nb = R * max_blocks + 3
    cache = random_paged_cache(nb, bs, cpu_gen)
    table = torch.randperm(nb, generator=cpu_gen)[: R * max_blocks].view(R, max_blocks).int()
    table[2, 0] = nb + 7  # a block id outside the cache: written as zeros
    cap = max_blocks * bs
    seq_lens = torch.tensor([cap, cap // 2 + 1, 3, 0], dtype=torch.int32)
    gather_lens = torch.tensor([bs + 3, 40, 3, 0], dtype=torch.int32)
    offset = 2
    out = poisoned_bf16((R, offset + cap + 5, 512), "cpu")
    want = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq_lens, gather_lens, table, bs, offset)
    dequantize_and_gather_k_cache_ref(want, cache, seq_lens, gather_lens, table, bs, offset)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert int((out.view(torch.int16) != BF16_POISON).sum()) > 0


_FRESH_PROCESS = textwrap.dedent("""
    import os, sys, torch
    from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
    from dsv4_tl.reference import dequantize_and_gather_k_cache_ref
    from dsv4_tl.testing import random_paged_cache
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    cache = random_paged_cache(6, 64, gen)
    table = torch.randperm(6, generator=gen)[:4].view(2, 2).int()
    seq = torch.tensor([128, 70], dtype=torch.int32)
    out = torch.full((2, 130, 512), float("nan"), dtype=torch.bfloat16)
    want = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq, None, table, 64, 1)
    dequantize_and_gather_k_cache_ref(want, cache, seq, None, table, 64, 1)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), "mismatch"
    compiled = [m for m in ("dsv4_tl.sycl.lower", "dsv4_tl.sycl.jit") if m in sys.modules]
    print("compiled-modules:", compiled)
""")


def test_aot_spirv_reloads_in_fresh_process(tmp_path, seed):
    from dsv4_tl.build import build
    from dsv4_tl.loader import MANIFEST_NAME

    manifest = build("sycl", tmp_path, ops=["dequant_gather"], progress=False, jobs=1)
    assert manifest["kernels"] and (tmp_path / "sycl" / MANIFEST_NAME).is_file()
    files = sorted(p.name for p in (tmp_path / "sycl").iterdir())
    assert any(f.endswith(".spv") for f in files) and any(f.endswith(".cpp") for f in files)
    env = dict(os.environ, DSV4_TL_KERNEL_DIR=str(tmp_path), DSV4_TL_JIT="0",
               DSV4_TL_SYCL_DEVICE="opencl:cpu")
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(seed)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled-modules: []" in result.stdout
    assert not (tmp_path / "sycl" / "jit").exists()
