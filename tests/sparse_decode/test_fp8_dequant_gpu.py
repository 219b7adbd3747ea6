"""GPU test of the bit-placement FP8 -> BF16 dequantisation (``tile_kernels/fp8.py``,
``FP8_BF16_PRELUDE``) used by the warp-specialised decode producer.

Every byte value (all 256) under every UE8M0 scale byte (all 256), for both FP8 flavours,
goes through the prelude's ``dsv4_ldg16`` + ``dsv4_dequant<4>`` exactly as the decode producer
calls them, and is compared bitwise with the reference dequantisation ``bf16(float(fp8) *
2^(e - 127))``, wherever that is a finite bf16 (a finite product the writer can produce).
The NaN encodings, which the spec's quantiser never writes, are checked to come out finite
as documented. Output poisoned first; fresh random byte order every run.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,  # conftest skips it without a CUDA device
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                       reason="the prelude is built for sm_90a (Hopper)"),
]

tilelang = pytest.importorskip("tilelang")

import tilelang.language as T  # noqa: E402

from dsv4_tl.tile_kernels.fp8 import FP8_BF16_PRELUDE, FP8_RESTORE_EXP  # noqa: E402

GROUPS = 256 * 256 // 16  # every (scale byte, value byte) pair, 16 bytes per group
NAN_BYTES = {"e4m3fn": (0x7F, 0xFF), "e4m3fnuz": (0x80,)}
TORCH_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


def _probe(fp8_format: str):
    restore_exp = FP8_RESTORE_EXP[fp8_format]

    @T.prim_func
    def dequant_probe(Raw: T.Tensor([GROUPS * 16], T.uint8), Scale: T.Tensor([GROUPS], T.uint8),
                      Out: T.Tensor([GROUPS * 16], T.bfloat16)):
        with T.Kernel(GROUPS // 128, threads=128, prelude=FP8_BF16_PRELUDE) as bx:
            raw = T.alloc_local([4], T.uint32)
            deq = T.alloc_local([16], T.bfloat16)
            g = bx * 128 + T.get_thread_binding()
            T.call_extern("handle", "dsv4_ldg16", T.access_ptr(Raw[g * 16], "r", 16),
                          T.access_ptr(raw[0], "w", 4))
            T.call_extern("handle", "dsv4_dequant<4>", T.access_ptr(raw[0], "r", 4),
                          T.cast(Scale[g], T.uint32), T.uint32(restore_exp), 1,
                          T.access_ptr(deq[0], "w", 16))
            for v in T.vectorized(16):
                Out[g * 16 + v] = deq[v]

    return tilelang.compile(dequant_probe, target={"kind": "cuda", "arch": "sm_90a"},
                            execution_backend="tvm_ffi", out_idx=None)


@pytest.mark.parametrize("fp8_format", ["e4m3fn", "e4m3fnuz"])
def test_dequant16_matches_reference_bitwise(fp8_format):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator("cuda").manual_seed(seed)
    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256)).cuda()  # (scale, byte)
    pairs = pairs[torch.randperm(pairs.shape[0], generator=gen, device="cuda")]
    # Groups of 16 bytes share one scale: sort by scale so that each group has one.
    pairs = pairs[torch.argsort(pairs[:, 0], stable=True)]
    scale_bytes, value_bytes = pairs[:, 0].to(torch.uint8), pairs[:, 1].to(torch.uint8)
    raw = value_bytes.contiguous()
    scale = scale_bytes.view(GROUPS, 16)[:, 0].contiguous()
    assert bool((scale_bytes.view(GROUPS, 16) == scale[:, None]).all())
    out = torch.full((GROUPS * 16,), float("nan"), dtype=torch.bfloat16, device="cuda")
    _probe(fp8_format)(raw, scale, out)
    torch.cuda.synchronize()

    ref32 = raw.view(TORCH_FP8[fp8_format]).float() * torch.exp2(scale_bytes.float() - 127)
    ref = ref32.to(torch.bfloat16)
    is_nan_byte = torch.zeros_like(raw, dtype=torch.bool)
    for byte in NAN_BYTES[fp8_format]:
        is_nan_byte |= raw == byte
    finite = torch.isfinite(ref) & ~is_nan_byte
    # A product past bf16's range is not a value the writer produces (scale 2^(e-127) with
    # e <= 134 covers |x| up to 448 * 2^7); everything else must be bitwise equal.
    assert int(finite.sum()) > 60000, f"seed {seed}"
    got, want = out.view(torch.int16)[finite], ref.view(torch.int16)[finite]
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (
        f"seed {seed}: {bad.numel()} mismatches, first at byte {int(raw[finite][bad[0]])} "
        f"scale {int(scale_bytes[finite][bad[0]])}: got {int(got[bad[0]]):#06x}, "
        f"want {int(want[bad[0]]):#06x}")
    assert bool(torch.isfinite(out[is_nan_byte & (scale_bytes.cuda() <= 127)]).all()), f"seed {seed}"
