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
