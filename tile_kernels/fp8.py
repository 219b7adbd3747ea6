"""FP8 byte decoding shared by the kernels that read the fp8_ds_mla cache.

The one target-specific building block of those kernels: how a cache byte becomes a float.
"""

import tilelang.language as T

FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
FP8_DECODES = ("native", "bits")


def fp8_byte_to_float(fp8_view, u8_view, offset, fp8_format: str, fp8_decode: str = "native"):
    """One cache byte as float32.

    ``fp8_decode="native"``: OCP e4m3fn bytes go through the fp8 view's hardware conversion
    (right on sm_90a/sm_100a and gfx950). ``"bits"``: decoded from the raw byte, exactly.
    FNUZ bytes (no CUDA type) always take the bit path. gfx942 schedules must ask for
    ``"bits"``: there TileLang's fp8 types are hip_fp8.h's FNUZ types (the hardware converts
    FNUZ only), so the fp8 view would read OCP bytes with bias 8 (values halved, 0x80 = NaN).
    Normal numbers are assembled as fp32 bits (exponent ``e - bias + 127``, mantissa
    ``m << 20``), subnormals as ``m * 2^(-bias - 2)``. OCP: bias 7, 0x7F/0xFF NaN, 0x80 = -0;
    FNUZ: bias 8, 0x80 NaN. No infinities in either.
    """
    if fp8_decode not in FP8_DECODES:
        raise ValueError(f"fp8_decode: expected one of {FP8_DECODES}, got {fp8_decode!r}")
    if fp8_format == "e4m3fn" and fp8_decode == "native":
        return T.cast(fp8_view[offset], T.float32)
    bias = 7 if fp8_format == "e4m3fn" else 8
    byte = T.cast(u8_view[offset], T.int32)
    exp = (byte >> 3) & 15
    man = byte & 7
    mag = T.if_then_else(
        exp == 0,
        T.cast(man, T.float32) * T.float32(2.0 ** (-bias - 2)),
        T.reinterpret(((exp + (127 - bias)) << 23) | (man << 20), T.float32),
    )
    nan = (byte & 0x7F) == 0x7F if fp8_format == "e4m3fn" else byte == 0x80
    return T.if_then_else(
        nan,
        T.reinterpret(T.int32(0x7FC00000), T.float32),
        T.if_then_else(byte >= 0x80, -mag, mag),
    )


# --- Bit-placement dequantisation (CUDA sm_90a warp-specialised decode) ------------------
# An e4m3 byte's sign, exponent and mantissa placed into a bf16's bit positions,
# ``(b & 0x80) << 8 | (b & 0x7f) << 4``, is the byte's value times 2^-120 (e4m3fn, bias 7;
# 2^-119 for e4m3fnuz, bias 8), subnormals included: the 4 exponent bits land in the low
# bits of bf16's 8-bit exponent. A bf16x2 multiply by 2^120 (2^119) restores the value
# (every e4m3 value is a normal bf16) and one by the UE8M0 scale 2^(e - 127) applies the
# scale (the first multiplier is their product and the second 1 while the product is a
# normal bf16); every multiplier is a power of two, so the result is the float32
# reference's ``bf16(value * 2^(e-127))`` exactly wherever that is a finite bf16 (the
# writer's range). Per 4 bytes: 2 byte permutes, 2 shifts, 4 logic ops and 4 bf16x2
# multiplies, no branch and no conversion instructions (the convert chain fp8 -> f16 ->
# f32 -> bf16 runs on the slow conversion pipe). NaN encodings (0x7F/0xFF e4m3fn, 0x80 e4m3fnuz; the spec's quantiser
# clamps to +-448 and never writes them) come out finite (+-480 resp. -0), not NaN.
#
# TileLang 0.1.15 has no byte permute and no bf16x2 multiply at the tile level, so these
# few lines are CUDA, added to the kernel's source through ``T.Kernel(prelude=...)`` and
# called with ``T.call_extern``; everything else stays TileLang.
FP8_RESTORE_EXP = {"e4m3fn": 120, "e4m3fnuz": 119}  # placed value * 2^this = the byte's value

FP8_BF16_PRELUDE = r"""
// dsv4-tl: bit-placement FP8 -> BF16 dequantisation (tile_kernels/fp8.py).
__device__ __forceinline__ unsigned dsv4_bf16x2_mul(unsigned a, unsigned b) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// Two e4m3 bytes placed as bf16x2 (value * 2^-120 resp. 2^-119), bytes picked by `sel`.
__device__ __forceinline__ unsigned dsv4_place2(unsigned x, unsigned sel) {
  unsigned w = __byte_perm(x, 0u, sel);
  return (w & 0x80008000u) | ((w >> 4) & 0x07F007F0u);
}
// 16 (8) bytes from global memory through the read-only path. The address is always a
// valid one (an invalid token's is clamped); its bytes are discarded at dequantisation.
__device__ __forceinline__ void dsv4_ldg16(const unsigned char* src, unsigned* dst) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "l"(src));
}
__device__ __forceinline__ void dsv4_ldg8(const unsigned char* src, unsigned* dst) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(dst[0]), "=r"(dst[1]) : "l"(src));
}
// `words` words of e4m3 bytes times 2^(scale_byte - 127) -> 2 * words bf16x2 words in
// `out`; zeros (+-0) when !ok: the last multiplier becomes 0 and placed bytes are finite.
// Two multiplies, chosen without a branch (a branch per call doubled the producer's code
// and stalled instruction fetch): by 2^(e - 127 + restore_exp) (restore_exp 120, resp. 119
// for FNUZ) and then by 1 while that is a normal bf16 (e <= 134, resp. 135: scales up to
// 2^7, every real K); beyond, by 2^restore_exp and then by 2^(e - 127). Every multiplier
// is a power of two, so each product is the exact value wherever that is a finite bf16.
template <int words>
__device__ __forceinline__ void dsv4_dequant(const unsigned* raw, unsigned scale_byte,
                                             unsigned restore_exp, int ok, void* out) {
  unsigned* o = reinterpret_cast<unsigned*>(out);
  unsigned e = scale_byte + restore_exp;  // biased exponent of 2^(e - 127 + restore)
  bool one = e <= 254u;
  unsigned m1 = ((one ? e : restore_exp + 127u) << 7) * 0x10001u;
  unsigned m2 = ok ? (one ? 0x3F803F80u : (scale_byte << 7) * 0x10001u) : 0u;
  #pragma unroll
  for (int w = 0; w < words; ++w) {
    o[2 * w] = dsv4_bf16x2_mul(dsv4_bf16x2_mul(dsv4_place2(raw[w], 0x1404u), m1), m2);
    o[2 * w + 1] = dsv4_bf16x2_mul(dsv4_bf16x2_mul(dsv4_place2(raw[w], 0x3424u), m1), m2);
  }
}
// `words` words copied as bf16 (the RoPE dims are bf16 in the cache already); zeros when
// !ok (an invalid token's bytes may hold anything, NaN included).
template <int words>
__device__ __forceinline__ void dsv4_copy(const unsigned* raw, int ok, void* out) {
  unsigned* o = reinterpret_cast<unsigned*>(out);
  #pragma unroll
  for (int w = 0; w < words; ++w) o[w] = ok ? raw[w] : 0u;
}
"""
