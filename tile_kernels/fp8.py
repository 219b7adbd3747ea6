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


# --- The lean producer (schedule knob ``producer_lean``; bench/PERF_NOTES.md item 46) ------
# Fewer instructions per 32-token round of the FP8 producer, bitwise the same K:
# - placement: one byte permute that copies each byte and replicates its sign over the byte
#   above it ([sign x 8 | byte] per 16-bit half; PTX ``prmt`` generic form, selector msb
#   set), then ``(w << 4) & 0x87F087F0``: the sign lands on bf16 bit 15, bits 0-6 of the byte
#   on bits 4-10; 3 instructions per bf16x2 instead of dsv4_place2's 4;
# - one multiply per bf16x2 instead of two while every scale byte of the round keeps the
#   multiplier 2^(e - 127 + restore_exp) a normal bf16 (e <= 134 resp. 135: scales up to 2^7,
#   every real K), the validity folded into it (0 for an invalid token); a round where any
#   lane of the warp holds a larger scale byte takes dsv4_dequant (warp-uniform branch);
# - the multiplier from one byte permute and one multiply-add per quantisation tile;
# - a token's block and slot by a multiply-high with the block size's magic number (CUTLASS
#   FastDivmod: m = ceil(2^(31 + l) / d), l = ceil(log2 d), q = umulhi(n, m) >> (l - 1),
#   exact for 0 <= n < 2^31; computed once per scope) instead of a signed division per round,
#   the validity without a branch, one 64-bit record address per token (``dsv4_ldg_token``;
#   ``dsv4_ldg_token_half``: the same for the loads of one K half, the seesaw's half producer).
FP8_LEAN_PRELUDE = r"""
// dsv4-tl: the lean FP8 producer (tile_kernels/fp8.py, producer_lean).
// Two e4m3 bytes placed as bf16x2, bitwise dsv4_place2's result (selector 0x9180: bytes 0,
// 1; 0xB3A2: bytes 2, 3).
__device__ __forceinline__ unsigned dsv4_place2_sx(unsigned x, unsigned sel) {
  unsigned w;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(w) : "r"(x), "r"(0u), "r"(sel));
  return (w << 4) & 0x87F087F0u;
}
// `words` words of e4m3 bytes times the bf16x2 multiplier `m` (dsv4_fast_mult): one multiply
// per bf16x2; bitwise dsv4_dequant's result wherever dsv4_lean_fast holds.
template <int words>
__device__ __forceinline__ void dsv4_dequant_fast(const unsigned* raw, unsigned m, void* out) {
  unsigned* o = reinterpret_cast<unsigned*>(out);
  #pragma unroll
  for (int w = 0; w < words; ++w) {
    o[2 * w] = dsv4_bf16x2_mul(dsv4_place2_sx(raw[w], 0x9180u), m);
    o[2 * w + 1] = dsv4_bf16x2_mul(dsv4_place2_sx(raw[w], 0xB3A2u), m);
  }
}
// The multiplier 2^(e - 127 + restore_exp) in both halves for the scale byte that `sel`
// (0x4040 + 0x101 * i) picks from `scale_word` (as 0x10001 * e), with mk = 0x80 and
// ma = restore_exp * 0x800080 for a valid token, both 0 for an invalid one (multiplier 0).
__device__ __forceinline__ unsigned dsv4_fast_mult(unsigned scale_word, unsigned sel,
                                                   unsigned mk, unsigned ma) {
  return __byte_perm(scale_word, 0u, sel) * mk + ma;
}
// Whether every lane of the warp has every scale byte e of its token (bytes 0-6 of s0:s1)
// below 255 - restore_exp (135 resp. 136), i.e. 2^(e - 127 + restore_exp) a normal bf16.
// Per byte b >= lim (lim in [128, 255]) iff bit 7 of b and bit 7 of (b & 0x7f) + 256 - lim
// (no carry leaves a byte).
__device__ __forceinline__ int dsv4_lean_fast(unsigned s0, unsigned s1, unsigned restore_exp) {
  unsigned add = (1u + restore_exp) * 0x01010101u;  // 256 - lim = 1 + restore_exp
  unsigned big = (((s0 & 0x7f7f7f7fu) + add) & s0 & 0x80808080u)
               | (((s1 & 0x007f7f7fu) + add) & s1 & 0x00808080u);
  return __all_sync(0xffffffffu, big == 0u);
}
// The magic number and shift of the division by `d` >= 1 (CUTLASS FastDivmod): q = d == 1 ?
// n : umulhi(n, mul) >> shr, exact for 0 <= n < 2^31.
__device__ __forceinline__ unsigned dsv4_div_mul(int d) {
  if (d <= 1) return 0u;
  unsigned l = 32u - __clz(d - 1);  // ceil(log2 d)
  return static_cast<unsigned>(((1ull << (31u + l)) + static_cast<unsigned>(d) - 1u)
                               / static_cast<unsigned>(d));
}
__device__ __forceinline__ unsigned dsv4_div_shr(int d) {
  return d <= 1 ? 0u : 31u - __clz(d - 1);  // ceil(log2 d) - 1
}
__device__ __forceinline__ unsigned dsv4_fast_div(unsigned n, int d, unsigned mul, unsigned shr) {
  return d != 1 ? __umulhi(n, mul) >> shr : n;
}
// Block and slot of token `idx` (block size `bs`, its magic `mul` / `shr`, `num_blocks`
// blocks) into `blk` / `pos`; returns the validity: `in_range` (the column is inside the
// row's length), idx >= 0 and its block below num_blocks. An invalid token is placed at block
// 0, slot 0 (its bytes are discarded at dequantisation). Shared by dsv4_ldg_token and
// dsv4_ldg_token_half (integers only: each caller forms its addresses as dsv4_ldg_token
// always did, so that its code stays the same).
__device__ __forceinline__ int dsv4_token_slot(int idx, int in_range, int bs, unsigned mul,
                                               unsigned shr, int num_blocks, unsigned& blk,
                                               unsigned& pos) {
  unsigned n = idx > 0 ? static_cast<unsigned>(idx) : 0u;
  blk = dsv4_fast_div(n, bs, mul, shr);
  pos = n - blk * static_cast<unsigned>(bs);
  int ok = in_range && idx >= 0 && static_cast<int>(blk) < num_blocks;
  blk = ok ? blk : 0u;
  pos = ok ? pos : 0u;
  return ok;
}
// Loads of lane quarter `q` of token `idx` of the scope at `u8` (dsv4_token_slot; blocks of
// `stride` bytes): the 7 NoPE quarters, the 2 RoPE pieces, the 8 scale bytes into
// raw[0 .. 38). Returns the validity.
__device__ __forceinline__ int dsv4_ldg_token(const unsigned char* u8, int q, int idx,
                                              int in_range, int bs, unsigned mul, unsigned shr,
                                              int num_blocks, long long stride, unsigned* raw) {
  unsigned blk, pos;
  int ok = dsv4_token_slot(idx, in_range, bs, mul, shr, num_blocks, blk, pos);
  const unsigned char* block = u8 + static_cast<long long>(blk) * stride;
  const unsigned char* rec = block + static_cast<unsigned long long>(pos) * 576ull;
  #pragma unroll
  for (int g = 0; g < 7; ++g) dsv4_ldg16(rec + 64 * g + 16 * q, raw + 4 * g);
  dsv4_ldg16(rec + 448 + 32 * q, raw + 28);
  dsv4_ldg16(rec + 448 + 32 * q + 16, raw + 32);
  // (a block's bytes, bs * 584, stay below 2^32: the front end refuses larger blocks,
  // dsv4_tl.validation)
  dsv4_ldg8(block + (static_cast<unsigned>(bs) * 576u + pos * 8u), raw + 36);
  return ok;
}
// dsv4_ldg_token for one K half (the seesaw's half producer, produce_fp8.HALF_TILES): half 0:
// NoPE quarters 0-3 into raw[0 .. 16); half 1: quarters 4-6 into raw[0 .. 12), the 2 RoPE
// pieces into raw[12 .. 20); then the 8 scale bytes into raw[20 .. 22). Returns the validity.
template <int half>
__device__ __forceinline__ int dsv4_ldg_token_half(const unsigned char* u8, int q, int idx,
                                                   int in_range, int bs, unsigned mul,
                                                   unsigned shr, int num_blocks,
                                                   long long stride, unsigned* raw) {
  unsigned blk, pos;
  int ok = dsv4_token_slot(idx, in_range, bs, mul, shr, num_blocks, blk, pos);
  const unsigned char* block = u8 + static_cast<long long>(blk) * stride;
  const unsigned char* rec = block + static_cast<unsigned long long>(pos) * 576ull;
  constexpr int g0 = half == 0 ? 0 : 4, tiles = half == 0 ? 4 : 3;
  #pragma unroll
  for (int i = 0; i < tiles; ++i) dsv4_ldg16(rec + 64 * (g0 + i) + 16 * q, raw + 4 * i);
  if (half == 1) {
    dsv4_ldg16(rec + 448 + 32 * q, raw + 12);
    dsv4_ldg16(rec + 448 + 32 * q + 16, raw + 16);
  }
  dsv4_ldg8(block + (static_cast<unsigned>(bs) * 576u + pos * 8u), raw + 20);
  return ok;
}
// Index entry `col` of the main scope's row `a` when `in_main`, else entry `col_b` of the extra
// scope's row `b` (the columns clamped into the rows by the caller): one load, no branch.
__device__ __forceinline__ int dsv4_ld_index(int in_main, const int* a, int col_a, const int* b,
                                             int col_b) {
  return __ldg(in_main ? a + col_a : b + col_b);
}
"""
