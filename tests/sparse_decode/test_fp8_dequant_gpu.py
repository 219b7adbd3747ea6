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


# ------------------------------------------------------------ the lean producer's pieces
# (FP8_LEAN_PRELUDE, schedule knob producer_lean): each compared bitwise with the default
# producer's piece or with integer arithmetic, on every value it can see.
def _lean_prelude():
    from dsv4_tl.tile_kernels.fp8 import FP8_LEAN_PRELUDE

    return FP8_BF16_PRELUDE + FP8_LEAN_PRELUDE


def _compile(func):
    return tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"},
                            execution_backend="tvm_ffi", out_idx=None)


def _lean_dequant_probe(fp8_format: str):
    """Per group of 16 bytes and one scale byte: the default ``dsv4_dequant<4>`` and the
    lean ``dsv4_fast_mult`` + ``dsv4_dequant_fast<4>``, valid (ok 1) and invalid (ok 0)."""
    restore_exp = FP8_RESTORE_EXP[fp8_format]

    @T.prim_func
    def lean_probe(Raw: T.Tensor([GROUPS * 16], T.uint8), Scale: T.Tensor([GROUPS], T.uint8),
                   Out: T.Tensor([4, GROUPS * 16], T.bfloat16)):
        with T.Kernel(GROUPS // 128, threads=128, prelude=_lean_prelude()) as bx:
            raw = T.alloc_local([4], T.uint32)
            deq = T.alloc_local([16], T.bfloat16)
            g = bx * 128 + T.get_thread_binding()
            T.call_extern("handle", "dsv4_ldg16", T.access_ptr(Raw[g * 16], "r", 16),
                          T.access_ptr(raw[0], "w", 4))
            for ok in (0, 1):
                T.call_extern("handle", "dsv4_dequant<4>", T.access_ptr(raw[0], "r", 4),
                              T.cast(Scale[g], T.uint32), T.uint32(restore_exp), ok,
                              T.access_ptr(deq[0], "w", 16))
                for v in T.vectorized(16):
                    Out[2 * ok, g * 16 + v] = deq[v]
                # the scale byte as byte 2 of a scale word (selector 0x4242)
                T.call_extern("handle", "dsv4_dequant_fast<4>", T.access_ptr(raw[0], "r", 4),
                              T.call_extern("uint32", "dsv4_fast_mult",
                                            T.shift_left(T.cast(Scale[g], T.uint32), T.uint32(16)),
                                            T.uint32(0x4242), T.uint32(0x80 * ok),
                                            T.uint32(restore_exp * 0x800080 * ok)),
                              T.access_ptr(deq[0], "w", 16))
                for v in T.vectorized(16):
                    Out[2 * ok + 1, g * 16 + v] = deq[v]

    return _compile(lean_probe)


@pytest.mark.parametrize("fp8_format", ["e4m3fn", "e4m3fnuz"])
def test_lean_dequant_fast_matches_default_bitwise(fp8_format):
    """Every (scale byte, value byte) pair whose multiplier the fast path takes (scale byte
    below 255 - restore_exp): ``dsv4_dequant_fast`` gives ``dsv4_dequant``'s bits, valid
    and invalid (zeros of the placed value's sign)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator("cuda").manual_seed(seed)
    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256)).cuda()
    pairs = pairs[torch.randperm(pairs.shape[0], generator=gen, device="cuda")]
    pairs = pairs[torch.argsort(pairs[:, 0], stable=True)]
    scale_bytes, value_bytes = pairs[:, 0].to(torch.uint8), pairs[:, 1].to(torch.uint8)
    scale = scale_bytes.view(GROUPS, 16)[:, 0].contiguous()
    out = torch.full((4, GROUPS * 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    _lean_dequant_probe(fp8_format)(value_bytes.contiguous(), scale, out)
    torch.cuda.synchronize()
    fast = scale_bytes < 255 - FP8_RESTORE_EXP[fp8_format]
    assert int(fast.sum()) == 256 * (255 - FP8_RESTORE_EXP[fp8_format])  # (scale, value) pairs
    bits = out.view(torch.int16)
    for ok in (0, 1):
        want, got = bits[2 * ok][fast], bits[2 * ok + 1][fast]
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (
            f"seed {seed}, ok {ok}: {bad.numel()} mismatches, first at byte "
            f"{int(value_bytes[fast][bad[0]])} scale {int(scale_bytes[fast][bad[0]])}: got "
            f"{int(got[bad[0]]):#06x}, want {int(want[bad[0]]):#06x}")
    assert bool(((bits[0][fast] & 0x7FFF) == 0).all())  # invalid: signed zeros


def _place_probe(n: int):
    """``dsv4_place2`` and ``dsv4_place2_sx`` of each word (row 0: bytes 0-1, row 1: 2-3)."""
    @T.prim_func
    def place_probe(X: T.Tensor([2, n], T.int32), Out: T.Tensor([2, 2, n], T.int32)):
        with T.Kernel(2 * n // 128, threads=128, prelude=_lean_prelude()) as bx:
            i = bx * 128 + T.get_thread_binding()
            s, k = i // n, i % n
            x = T.cast(X[s, k], T.uint32)
            Out[s, 0, k] = T.cast(T.call_extern("uint32", "dsv4_place2", x, T.if_then_else(
                s == 0, T.uint32(0x1404), T.uint32(0x3424))), T.int32)
            Out[s, 1, k] = T.cast(T.call_extern("uint32", "dsv4_place2_sx", x, T.if_then_else(
                s == 0, T.uint32(0x9180), T.uint32(0xB3A2))), T.int32)

    return _compile(place_probe)


def test_lean_placement_matches_default_bitwise():
    """``dsv4_place2_sx`` (sign-replicating permute, shift, mask) against ``dsv4_place2`` on
    every value of the two bytes each selector reads, the other two bytes random."""
    n = 1 << 16
    gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    pair = torch.arange(n, dtype=torch.int64, device="cuda")
    other = torch.randint(0, n, (2, n), generator=gen, device="cuda", dtype=torch.int64)
    x = torch.stack([pair | (other[0] << 16), other[1] | (pair << 16)])  # bytes 0-1 / 2-3
    x = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).contiguous()
    out = torch.full((2, 2, n), -1, dtype=torch.int32, device="cuda")
    _place_probe(n)(x, out)
    torch.cuda.synchronize()
    assert bool((out[0, 0] != -1).all())  # written
    assert bool((out[:, 0] == out[:, 1]).all()), int((out[:, 0] != out[:, 1]).sum())


def _vote_probe(n: int):
    """``dsv4_lean_fast`` of each lane's two scale words."""
    @T.prim_func
    def vote_probe(S: T.Tensor([n, 2], T.int32), Restore: T.Tensor([1], T.int32),
                   Out: T.Tensor([n], T.int32)):
        with T.Kernel(n // 128, threads=128, prelude=_lean_prelude()) as bx:
            i = bx * 128 + T.get_thread_binding()
            Out[i] = T.call_extern("int32", "dsv4_lean_fast", T.cast(S[i, 0], T.uint32),
                                   T.cast(S[i, 1], T.uint32), T.cast(Restore[0], T.uint32))

    return _compile(vote_probe)


def test_lean_fast_vote():
    """``dsv4_lean_fast``: 1 for a warp iff every lane's scale bytes 0-6 are below
    255 - restore_exp; byte 7 (padding) ignored. One lane of each warp holds the probed byte
    value at the probed position, the other lanes random bytes below the limit."""
    warps = 256 * 8  # (value, position)
    n = warps * 32

    kernel = _vote_probe(n)
    gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    for fp8_format, restore in FP8_RESTORE_EXP.items():
        lim = 255 - restore
        scales = torch.randint(0, lim, (n, 8), generator=gen, device="cuda", dtype=torch.int64)
        value = torch.arange(256, device="cuda").repeat_interleave(8)  # per warp
        pos = torch.arange(8, device="cuda").repeat(256)
        lane = torch.randint(0, 32, (warps,), generator=gen, device="cuda")
        rows = torch.arange(warps, device="cuda") * 32 + lane
        scales[rows, pos] = value
        words = (scales << (8 * torch.arange(4, device="cuda").repeat(2))).view(n, 2, 4).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
        out = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        kernel(words, torch.tensor([restore], dtype=torch.int32, device="cuda"), out)
        torch.cuda.synchronize()
        want = ((value < lim) | (pos == 7)).to(torch.int32).repeat_interleave(32)
        assert bool((out == want).all()), (fp8_format, int((out != want).sum()))


def _div_probe(total: int):
    """``dsv4_fast_div`` by each divisor with its magic from ``dsv4_div_mul`` / ``_shr``."""
    @T.prim_func
    def div_probe(N: T.Tensor([total], T.int32), D: T.Tensor([total], T.int32),
                  Q: T.Tensor([total], T.int32)):
        with T.Kernel((total + 127) // 128, threads=128, prelude=_lean_prelude()) as bx:
            i = bx * 128 + T.get_thread_binding()
            if i < total:
                Q[i] = T.cast(T.call_extern(
                    "uint32", "dsv4_fast_div", T.cast(N[i], T.uint32), D[i],
                    T.call_extern("uint32", "dsv4_div_mul", D[i]),
                    T.call_extern("uint32", "dsv4_div_shr", D[i])), T.int32)

    return _compile(div_probe)


def test_lean_division_magic():
    """``dsv4_fast_div`` with ``dsv4_div_mul`` / ``dsv4_div_shr`` (the lean producer's block
    of a slot) equals integer division for every divisor 1-4096 and large ones, on
    dividends 0, 2^31 - 1, multiples and their neighbours and random values."""
    divisors = torch.cat([torch.arange(1, 4097), torch.tensor(
        [4099, 65536, 65537, 1 << 20, (1 << 20) + 1, 1 << 30, (1 << 30) + 1, 2**31 - 1])])
    per = 64
    d = divisors.repeat_interleave(per).cuda()
    gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    n = torch.randint(0, 2**31, (d.numel(),), generator=gen, device="cuda", dtype=torch.int64)
    k = torch.randint(0, 2**31, (d.numel(),), generator=gen, device="cuda") // d
    j = torch.arange(d.numel(), device="cuda") % per
    n = torch.where(j < 16, k * d + (j % 3) - 1, n)  # multiples and neighbours
    n = torch.where(j == 16, 0, torch.where(j == 17, 2**31 - 1, n)).clamp(0, 2**31 - 1)
    total = d.numel()

    q = torch.full((total,), -1, dtype=torch.int32, device="cuda")
    _div_probe(total)(n.to(torch.int32), d.to(torch.int32), q)
    torch.cuda.synchronize()
    want = (n // d).to(torch.int32)
    bad = (q != want).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} wrong quotients, first {int(n[bad[0]])} / "
                              f"{int(d[bad[0]])}: got {int(q[bad[0]])}")
