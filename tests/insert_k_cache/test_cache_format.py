"""fp8_ds_mla cache layout: byte placement, quantization, round trip (spec section 1)."""

import math
import pytest
import torch

from dsv4_tl import cache_format as cf


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


FORMATS = ["e4m3fn", "e4m3fnuz"]


def _flat(cache):
    return cf.cache_geometry(cache).flat


def test_constants_and_block_bytes():
    assert (cf.HEAD_DIM, cf.NOPE_DIM, cf.ROPE_DIM, cf.QUANT_TILE, cf.NUM_TILES) == (512, 448, 64, 64, 7)
    assert (cf.TOKEN_DATA_BYTES, cf.TOKEN_SCALE_BYTES, cf.TOKEN_BYTES) == (576, 8, 584)
    assert cf.block_bytes(64) == 37440
    assert cf.block_bytes(2) == 1728
    assert cf.block_bytes(1) == 1152  # 584 rounded up to 2*576
    assert cf.block_bytes(72) == 42048  # 72*584 = 42048 = 73*576 exactly: no region C
    assert cf.fp8_dtype("e4m3fn") == torch.float8_e4m3fn
    assert cf.fp8_dtype("e4m3fnuz") == torch.float8_e4m3fnuz
    assert cf.fp8_max("e4m3fn") == 448.0 and cf.fp8_max("e4m3fnuz") == 240.0


def test_alloc_k_cache_view():
    c = cf.alloc_k_cache(3, 64)
    assert c.shape == (3, 64, 584) and c.dtype == torch.uint8
    assert c.stride() == (37440, 584, 1)
    assert c.untyped_storage().nbytes() == 3 * 37440
    assert int(c.sum()) == 0
    g = cf.cache_geometry(c)
    assert (g.block_size, g.stride0, g.num_blocks, g.num_slots) == (64, 37440, 3, 192)
    assert g.flat.numel() == 2 * 37440 + 64 * 584


# Row with known content: NoPE tile t holds +(t+1) in its first half and -(t+1) in its
# second half (amax = t+1), tile values spelled out below; RoPE dims 448.. = 1.0, -2.0,
# 0.15625, then zeros.
def _known_row():
    row = torch.zeros(512, dtype=torch.float32)
    for t in range(7):
        row[64 * t: 64 * t + 32] = t + 1
        row[64 * t + 32: 64 * t + 64] = -(t + 1)
    row[448:451] = torch.tensor([1.0, -2.0, 0.15625])
    return row.to(torch.bfloat16)


# e = ceil(log2(amax/448)): amax 1 -> log2(1/448) = -8.81 -> -8; 2 -> -7.81 -> -7;
# 3 -> -7.22 -> -7; 4 -> -6.81 -> -6; 5 -> -6.49 -> -6; 6 -> -6.22 -> -6;
# 7 -> log2(7/448) = log2(1/64) = -6 exactly -> -6.  Byte = e + 127.
_KNOWN_SCALE_BYTES = [119, 120, 120, 121, 121, 121, 121]
# q = (t+1) / 2^e: 256, 256, 384, 256, 320, 384, 448.  e4m3fn bytes (bias 7):
# 256 = 1.0*2^8 -> 0 1111 000 = 0x78; 384 = 1.5*2^8 -> 0x7C; 320 = 1.25*2^8 -> 0x7A;
# 448 = 1.75*2^8 -> 0x7E.  Negative values set the sign bit (0x80).
_KNOWN_FP8_BYTES = [0x78, 0x78, 0x7C, 0x78, 0x7A, 0x7C, 0x7E]
# bf16 little-endian: 1.0 = 0x3F80, -2.0 = 0xC000, 0.15625 = 0x3E20.
_KNOWN_ROPE_BYTES = [0x80, 0x3F, 0x00, 0xC0, 0x20, 0x3E]


@pytest.mark.parametrize(
    "bs, nb, slot, data_off, scale_off",
    [
        # bs=2: block 1, p=1: data 1728 + 1*576, scales 1728 + 2*576 + 1*8.
        (2, 3, 3, 2304, 2888),
        # bs=64: block 1, p=37: data 37440 + 37*576, scales 37440 + 64*576 + 37*8.
        (64, 3, 64 + 37, 58752, 74600),
    ],
)
@pytest.mark.parametrize("four_d", [False, True])
def test_byte_placement(bs, nb, slot, data_off, scale_off, four_d):
    cache = cf.alloc_k_cache(nb, bs)
    view = cache.unsqueeze(2) if four_d else cache
    cf.insert_k(view, _known_row()[None], torch.tensor([slot], dtype=torch.int64))
    flat = _flat(cache)
    assert flat.numel() == (nb - 1) * cf.block_bytes(bs) + bs * 584
    full = cache.as_strided((nb * cf.block_bytes(bs),), (1,))
    expect = torch.zeros_like(full)
    nope = []
    for t in range(7):
        nope += [_KNOWN_FP8_BYTES[t]] * 32 + [_KNOWN_FP8_BYTES[t] | 0x80] * 32
    expect[data_off: data_off + 448] = torch.tensor(nope, dtype=torch.uint8)
    expect[data_off + 448: data_off + 454] = torch.tensor(_KNOWN_ROPE_BYTES, dtype=torch.uint8)
    expect[scale_off: scale_off + 7] = torch.tensor(_KNOWN_SCALE_BYTES, dtype=torch.uint8)
    # everything else (rest of RoPE, pad byte 7, other tokens, region C) stays zero
    assert torch.equal(full, expect)


def test_scale_bytes_edge_values():
    # tile amax: 0 (clamped to 1e-4: ceil(log2(1e-4/448)) = ceil(-22.09) = -22 -> 105),
    # 448 (e = 0 -> 127), 448.5 (e = 1 -> 128), 1e-6 (clamped -> 105), 2^-10 (log2(2^-10/448)
    # = -18.81 -> -18 -> 109), 3e4 (log2(3e4/448) = 6.07 -> 7 -> 134), 1.0 (-8 -> 119).
    amax = [0.0, 448.0, 448.5, 1e-6, 2.0**-10, 3e4, 1.0]
    expected = [105, 127, 128, 105, 109, 134, 119]
    k = torch.zeros(1, 512, dtype=torch.float32)
    for t, a in enumerate(amax):
        if a:  # -0.0 would store the e4m3fn negative-zero byte 0x80
            k[0, 64 * t + 5] = -a
    data, scales = cf.quantize_k(k, "e4m3fn")
    assert scales.dtype == torch.uint8 and data.dtype == torch.uint8
    assert scales[0].tolist() == expected + [0]
    # tile 1: -448 / 2^0 = -448 -> 1 1111 110 = 0xFE; tile 6: -1.0 / 2^-8 = -256 -> 0xF8
    assert int(data[0, 64 + 5]) == 0xFE and int(data[0, 6 * 64 + 5]) == 0xF8
    # all-zero tile stores zero bytes
    assert int(data[0, 64 * 0: 64 * 1].sum()) == 0


def test_scale_byte_formula_random():
    k = torch.randn(64, 512) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    for fmt in FORMATS:
        _, scales = cf.quantize_k(k, fmt)
        amax = k[:, :448].reshape(64, 7, 64).abs().amax(-1).double().clamp_min(1e-4)
        want = torch.ceil(torch.log2(amax / cf.fp8_max(fmt))) + 127
        assert torch.equal(scales[:, :7].long(), want.long())
        assert int(scales[:, 7].sum()) == 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bs", [2, 64])
def test_round_trip_within_fp8_precision(fmt, bs):
    n = 40
    nb = -(-2 * n // bs)  # about half the slots used, scattered
    k = torch.randn(n, 8, 64)
    k = (k * torch.exp2(torch.randint(-6, 6, (n, 8, 1)).float())).reshape(n, 512).to(torch.bfloat16)
    k[3, :64] = 0  # an all-zero tile
    slots = torch.randperm(nb * bs)[:n]
    cache = cf.alloc_k_cache(nb, bs)
    cf.insert_k(cache, k, slots, fp8_format=fmt)
    got = cf.dequantize_k(cache, slots.view(5, 8), fmt)
    assert got.shape == (5, 8, 512) and got.dtype == torch.float32
    got = got.view(n, 512)
    x = k.float()
    # RoPE dims are stored as bf16: exact.
    assert torch.equal(got[:, 448:], x[:, 448:])
    # NoPE: |x/2^e| <= fp8_max, so the only error is e4m3 rounding: 3 mantissa bits give a
    # half-ulp of |v| * 2^-4 for normals; subnormals have spacing 2^-9 (fn) / 2^-10 (fnuz),
    # so the absolute error is at most 2^(e-10) there.  Both scaled by 2^e.
    amax = x[:, :448].reshape(n, 7, 64).abs().amax(-1).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / cf.fp8_max(fmt)))
    bound = torch.maximum(x[:, :448].abs().reshape(n, 7, 64) * 2.0**-4, torch.exp2(e - 10)[..., None])
    err = (got[:, :448] - x[:, :448]).abs().reshape(n, 7, 64)
    assert bool((err <= bound).all())
    assert torch.equal(got[3, :64], torch.zeros(64))
    # the quantizer is not a no-op: bf16 inputs do lose bits in FP8
    assert float(err.max()) > 0


def test_dequantize_exact_values():
    # Known bytes -> known floats: fp8 0x78 = 256 (e4m3fn), scale byte 119 = 2^-8 -> 1.0.
    cache = cf.alloc_k_cache(2, 2)
    cf.insert_k(cache, _known_row()[None], torch.tensor([2]))
    got = cf.dequantize_k(cache, torch.tensor([2], dtype=torch.int32), "e4m3fn")[0]
    assert torch.equal(got, _known_row().float())  # row values are exactly representable
    # fp8-typed views read the same bytes
    got8 = cf.dequantize_k(cache.view(torch.float8_e4m3fn).unsqueeze(2), torch.tensor([2]), "e4m3fn")
    assert torch.equal(got8[0], got)


def test_fnuz_known_bytes():
    # e4m3fnuz (bias 8, max 240): amax 1 -> e = ceil(log2(1/240)) = ceil(-7.91) = -7 -> byte 120;
    # 1.0 / 2^-7 = 128 = 1.0*2^7 -> exponent field 7+8 = 15 -> 0 1111 000 = 0x78.
    # amax 240 -> e = 0 -> byte 127, 240 = 1.875*2^7 -> 0 1111 111 = 0x7F, -240 -> 0xFF.
    k = torch.zeros(1, 512)
    k[0, 0] = 1.0
    k[0, 64] = 240.0
    k[0, 65] = -240.0
    data, scales = cf.quantize_k(k, "e4m3fnuz")
    assert scales[0, :2].tolist() == [120, 127]
    assert data[0, [0, 64, 65]].tolist() == [0x78, 0x7F, 0xFF]
    # the OCP flavour gives different bytes for the same input (256 -> 0x78, scale 119)
    _, scales_fn = cf.quantize_k(k, "e4m3fn")
    assert scales_fn[0, :2].tolist() == [119, 127]


def test_negative_slots_skipped_and_out_of_range_rejected():
    cache = cf.alloc_k_cache(2, 2)
    before = cache.as_strided((2 * 1728,), (1,)).clone()
    k = torch.randn(3, 512).to(torch.bfloat16)
    cf.insert_k(cache, k, torch.tensor([-1, -1, -1]))
    assert torch.equal(cache.as_strided((2 * 1728,), (1,)), before)
    cf.insert_k(cache, k, torch.tensor([-1, 1, -1]))
    got = cf.dequantize_k(cache, torch.tensor([1]), "e4m3fn")[0]
    want = cf.dequantize_k(_cache_with(k[1:2], 1), torch.tensor([1]), "e4m3fn")[0]
    assert torch.equal(got, want)
    assert torch.equal(cf.dequantize_k(cache, torch.tensor([0, 2, 3]), "e4m3fn"), torch.zeros(3, 512))
    with pytest.raises(ValueError, match="slot_mapping"):
        cf.insert_k(cache, k[:1], torch.tensor([4]))
    with pytest.raises(ValueError, match="slots"):
        cf.dequantize_k(cache, torch.tensor([4]), "e4m3fn")
    with pytest.raises(ValueError, match="slots"):
        cf.dequantize_k(cache, torch.tensor([-1]), "e4m3fn")


def _cache_with(k, slot):
    c = cf.alloc_k_cache(2, 2)
    cf.insert_k(c, k, torch.tensor([slot]))
    return c


def test_writer_respects_padded_block_stride():
    # A cache with a larger-than-minimal (still 576-aligned) block stride: bytes land at
    # block*stride0, not at block*block_bytes.
    stride0 = 3 * 576
    buf = torch.zeros(3 * stride0, dtype=torch.uint8)
    view = buf.as_strided((3, 2, 584), (stride0, 584, 1))
    cf.insert_k(view, _known_row()[None], torch.tensor([5]))  # block 2, p 1
    nz = torch.nonzero(buf).flatten()
    assert int(nz.min()) >= 2 * stride0 + 576
    assert int(nz.max()) < 2 * stride0 + 2 * 576 + 8 + 7
    assert torch.equal(cf.dequantize_k(view, torch.tensor([5]), "e4m3fn")[0], _known_row().float())


def test_rope_rounds_float32_input_to_bf16():
    k = torch.zeros(1, 512)
    k[0, 448] = 1.0 + 2.0**-10  # not representable in bf16: rounds to 1.0
    data, _ = cf.quantize_k(k, "e4m3fn")
    assert data[0, 448:450].tolist() == [0x80, 0x3F]
    assert math.isclose(float(k[0, 448]), 1.0009765625)
