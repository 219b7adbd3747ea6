"""CPU tests that the ``torch.ops.dsv4_tl.*`` custom ops dispatch for every device type, so
CPU (and XPU) tensors reach dsv4_tl's own device routing instead of torch's generic "Could
not run ... with arguments from the 'CPU' backend" (issue 15 item 6): without
``$DSV4_TL_SYCL_DEVICE`` the front ends refuse CPU tensors with their own one-line error
naming the argument and the variable; with it set, CPU tensors go to the SYCL target's
loader (here: an empty kernel directory with JIT off, so its "not built" error)."""

import pytest
import torch

import dsv4_tl
from dsv4_tl import loader as L
from dsv4_tl import vllm_compat as vc
from dsv4_tl.targets import ENV_SYCL_DEVICE

BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8


def _calls():
    """Each op and wrapper, called with small, valid CPU arguments."""
    q = torch.zeros(1, 1, 64, 512, dtype=BF16)
    cache = torch.zeros(2, 64, 584, dtype=U8)
    idx = torch.zeros(1, 1, 8, dtype=I32)
    meta = vc.get_mla_metadata()[0]
    gather = (torch.zeros(1, 8, 512, dtype=BF16), cache, torch.ones(1, dtype=I32),
              None, torch.zeros(1, 1, dtype=I32), 64, 0)
    topk = (torch.zeros(3, 8, dtype=I32), torch.zeros(3, dtype=I32), torch.zeros(1, 2, dtype=I32),
            64, torch.ones(3, dtype=torch.bool))
    combine = (torch.zeros(3, 8, dtype=I32), torch.tensor([0, 3], dtype=I32),
               torch.tensor([5], dtype=I32), torch.tensor([5], dtype=I32), 4, 4, 8, 16, 8)
    return {
        "torch.ops.dsv4_tl.sparse_decode": lambda: torch.ops.dsv4_tl.sparse_decode(q, cache, idx),
        "torch.ops.dsv4_tl.sparse_decode_metadata":
            lambda: torch.ops.dsv4_tl.sparse_decode_metadata(q, cache, idx),
        "dsv4_tl.sparse_prefill": lambda: dsv4_tl.sparse_prefill(
            torch.zeros(2, 64, 512, dtype=BF16), torch.zeros(4, 1, 512, dtype=BF16),
            torch.zeros(2, 1, 8, dtype=I32), 0.04),
        "torch.ops.dsv4_tl.dequantize_and_gather_k_cache":
            lambda: torch.ops.dsv4_tl.dequantize_and_gather_k_cache(*gather),
        "torch.ops.dsv4_tl.compute_global_topk_indices_and_lens":
            lambda: torch.ops.dsv4_tl.compute_global_topk_indices_and_lens(*topk),
        "torch.ops.dsv4_tl.insert_k_cache": lambda: torch.ops.dsv4_tl.insert_k_cache(
            cache, torch.zeros(3, 512, dtype=BF16), torch.tensor([0, -1, 5])),
        "vllm_compat.flash_mla_with_kvcache": lambda: vc.flash_mla_with_kvcache(
            q, cache.view(2, 64, 1, 584), None, None, 512, meta, is_fp8_kvcache=True,
            indices=idx),
        "vllm_compat.dequantize_and_gather_k_cache":
            lambda: vc.dequantize_and_gather_k_cache(*gather),
        "vllm_compat.compute_global_topk_indices_and_lens":
            lambda: vc.compute_global_topk_indices_and_lens(*topk),
        "vllm_compat.combine_topk_swa_indices": lambda: vc.combine_topk_swa_indices(*combine),
    }


@pytest.fixture
def fresh_routing():
    """Forget memoised device targets and loaders (they depend on the environment)."""
    def clear():
        L.clear_loaders()  # (drops the memoised targets, kernels and plans too)
    clear()
    yield
    clear()


@pytest.mark.parametrize("name", sorted(_calls()))
def test_cpu_tensors_get_dsv4_tls_own_error(name, monkeypatch, fresh_routing):
    monkeypatch.delenv(ENV_SYCL_DEVICE, raising=False)
    with pytest.raises(ValueError, match=rf"expected a CUDA, ROCm or XPU device, got cpu "
                                         rf"\(CPU tensors run on a SYCL device when "
                                         rf"{ENV_SYCL_DEVICE}"):
        _calls()[name]()


@pytest.mark.filterwarnings("ignore:schedule. no tuning log entry")
@pytest.mark.parametrize("name", sorted(_calls()))
def test_cpu_tensors_route_to_the_sycl_target_when_a_sycl_device_is_set(
        name, monkeypatch, tmp_path, fresh_routing):
    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")
    monkeypatch.setenv(L.ENV_KERNEL_DIR, str(tmp_path))
    monkeypatch.setenv(L.ENV_JIT, "0")
    with pytest.raises(L.KernelNotBuiltError, match="for sycl .*dsv4-tl build --target sycl"):
        _calls()[name]()
