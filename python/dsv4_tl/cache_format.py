"""fp8_ds_mla (DeepSeek-V4 "MODEL1") paged K-cache layout: writer and reader.

Spec: shared/spec/dsv4-kernels.md section 1.  One token is 512 dims: 448 NoPE
dims stored as FP8 e4m3 in 7 tiles of 64 with one UE8M0 (power-of-two) scale
byte per tile, and 64 RoPE dims stored unquantized as little-endian bf16.

Physical placement inside one paged block of ``bs`` tokens (NOT a 584-byte
record per token):

  * region A ``[0, bs*576)``: token p at ``p*576``: 448 FP8 bytes then 128 bytes
    of bf16 RoPE;
  * region B ``[bs*576, bs*584)``: token p at ``bs*576 + p*8``: 7 scale bytes
    (tile 0..6) and one pad byte written 0;
  * region C: pad up to ``block_bytes(bs) = ceil(bs*584/576)*576``.

Token ``(block, p)`` is addressed by flat byte offsets ``block*stride0 + p*576``
and ``block*stride0 + bs*576 + p*8``, computed in int64 (int32 overflows past
~57K blocks).  The global slot of a token is ``block*bs + p``.

FP8 flavour is an explicit ``fp8_format`` argument: "e4m3fn" (OCP; NVIDIA and
gfx950) or "e4m3fnuz" (FNUZ; gfx942).  Quantization is bit-exact with respect
to the spec formula; dequantization is exact (power-of-two scales).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .validation import (
    check_block_size,
    check_fp8_format,
    check_host_condition,
    check_int,
    check_k_cache,
    check_same_device,
    check_tensor,
)
# The layout constants live with the kernels (spec §1); re-exported here for the writer.
from .tile_kernels.layout import (HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, ROPE_DIM,
                                  TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES)

TOKEN_BYTES = TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES  # 584
BLOCK_ALIGN_BYTES = 576  # FlashMLA requires 576-B aligned block strides

SCALE_BIAS = 127  # UE8M0: stored byte = exponent + 127
AMAX_FLOOR = 1e-4  # per-tile amax is clamped to at least this before taking log2

_FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)

_FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
# Largest finite value of each flavour.  The spec only pins OCP (448).  For FNUZ
# the project uses 240, the format's own largest finite value (vLLM's ROCm
# indexer writer uses 224 instead: UNCONFIRMED which one a gfx942 fp8_ds_mla
# writer uses).  The reader does not depend on this choice.
_FP8_MAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}


def fp8_dtype(fp8_format: str) -> torch.dtype:
    """torch dtype of the FP8 flavour ("e4m3fn" -> float8_e4m3fn, "e4m3fnuz" -> float8_e4m3fnuz)."""
    return _FP8_DTYPES[check_fp8_format("fp8_format", fp8_format)]


def fp8_max(fp8_format: str) -> float:
    """Clamp bound used by the writer: 448.0 for e4m3fn, 240.0 for e4m3fnuz."""
    return _FP8_MAX[check_fp8_format("fp8_format", fp8_format)]


def block_bytes(block_size: int) -> int:
    """Padded bytes of one paged block: ``ceil(bs*584/576)*576`` (bs=64 -> 37440, bs=2 -> 1728)."""
    bs = check_block_size("block_size", block_size)
    return -(-bs * TOKEN_BYTES // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES


def alloc_k_cache(num_blocks: int, block_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Zeroed paged cache as vLLM allocates it.

    Returns a uint8 view ``[num_blocks, block_size, 584]`` with strides
    ``(block_bytes(block_size), 584, 1)`` over a flat buffer of
    ``num_blocks*block_bytes`` bytes.  Row p of the view is NOT token p (see the
    module docstring); use ``insert_k`` / ``dequantize_k``.  ``.unsqueeze(2)``
    gives FlashMLA's ``[num_blocks, block_size, 1, 584]`` view.
    """
    nb = check_int("num_blocks", num_blocks, min_value=0)
    bb = block_bytes(block_size)
    flat = torch.zeros(nb * bb, dtype=torch.uint8, device=device)
    return flat.as_strided((nb, block_size, TOKEN_BYTES), (bb, TOKEN_BYTES, 1))


@dataclasses.dataclass(frozen=True, eq=False)
class CacheGeometry:
    """Byte-level view of a paged cache.

    flat: [span], uint8 -- every byte a token of the cache can occupy, where
        ``span = (num_blocks-1)*stride0 + block_size*584``; aliases the cache.
    block_size: tokens per block.  stride0: bytes between blocks.
    """

    flat: torch.Tensor
    block_size: int
    stride0: int
    num_blocks: int

    @property
    def num_slots(self) -> int:
        """Number of addressable global slots (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def data_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """slots: [n], int64 in range -> [n] int64 byte offset of each token's region-A record."""
        blk, p = slots // self.block_size, slots % self.block_size
        return blk * self.stride0 + p * TOKEN_DATA_BYTES

    def scale_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """slots: [n], int64 in range -> [n] int64 byte offset of each token's region-B record."""
        blk, p = slots // self.block_size, slots % self.block_size
        return blk * self.stride0 + self.block_size * TOKEN_DATA_BYTES + p * TOKEN_SCALE_BYTES


def cache_geometry(k_cache: torch.Tensor, name: str = "k_cache") -> CacheGeometry:
    """Validate a cache view (``[nb, bs, 584]`` or ``[nb, bs, 1, 584]``) and return its byte geometry."""
    check_k_cache(name, k_cache)
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    u8 = k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)
    span = (nb - 1) * k_cache.stride(0) + bs * TOKEN_BYTES if nb > 0 else 0
    # as_strided over the same storage: writes through ``flat`` land in the cache.
    flat = u8.as_strided((span,), (1,), u8.storage_offset())
    return CacheGeometry(flat=flat, block_size=bs, stride0=k_cache.stride(0), num_blocks=nb)


def _bf16_to_le_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n, d] bfloat16 -> [n, 2d] uint8, little-endian (explicit, not host byte order)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).reshape(x.shape[0], -1).to(torch.uint8)


def _le_bytes_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2d] uint8 little-endian -> [n, d] bfloat16."""
    b = b.to(torch.int32)
    bits = b[:, 0::2] | (b[:, 1::2] << 8)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # reinterpret as signed int16
    return bits.to(torch.int16).view(torch.bfloat16)


def quantize_k(k: torch.Tensor, fp8_format: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize K rows into their fp8_ds_mla byte records.

    k: [N, 512], bfloat16 / float16 / float32.
    Returns ``(data [N, 576] uint8, scales [N, 8] uint8)``: data = 448 FP8 NoPE
    bytes + 64 bf16 RoPE values (little-endian, rounded to bf16 if k is not
    bf16); scales = 7 UE8M0 bytes + 1 zero pad byte.  Per 64-element tile:
    ``amax = max(max|x|, 1e-4)``, ``e = ceil(log2(amax / fp8_max))``,
    ``q = fp8(clamp(x / 2^e, +-fp8_max))``, byte ``= clamp(e + 127, 0, 255)``.
    """
    fmt = check_fp8_format("fp8_format", fp8_format)
    check_tensor("k", k, dtype=_FLOAT_INPUT_DTYPES, shape=(None, HEAD_DIM))
    n = k.shape[0]
    fmax = _FP8_MAX[fmt]
    x = k.float()
    nope = x[:, :NOPE_DIM].reshape(n, NUM_TILES, QUANT_TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    e = torch.ceil(torch.log2(amax / fmax))
    # Division by a power of two is exact, so only the FP8 cast rounds (RNE).
    q = (nope / torch.exp2(e)[..., None]).clamp(-fmax, fmax).to(_FP8_DTYPES[fmt])
    data = torch.empty(n, TOKEN_DATA_BYTES, dtype=torch.uint8, device=k.device)
    data[:, :NOPE_DIM] = q.reshape(n, NOPE_DIM).view(torch.uint8)
    data[:, NOPE_DIM:] = _bf16_to_le_bytes(k[:, NOPE_DIM:].to(torch.bfloat16))
    scales = torch.zeros(n, TOKEN_SCALE_BYTES, dtype=torch.uint8, device=k.device)
    scales[:, :NUM_TILES] = (e + SCALE_BIAS).clamp(0, 255).to(torch.uint8)
    return data, scales


def _token_byte_index(offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[n] int64 start offsets -> [n, width] int64 byte indices."""
    return offsets[:, None] + torch.arange(width, dtype=torch.int64, device=offsets.device)[None, :]


def insert_k(
    k_cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8_format: str = "e4m3fn",
) -> None:
    """Quantize ``k`` and write it into the paged cache in place (the reference writer).

    k_cache: [num_blocks, bs, 584] or [num_blocks, bs, 1, 584], uint8/int8/fp8 view.
    k: [N, 512], bfloat16 / float16 / float32.
    slot_mapping: [N], int64 (int32 accepted); ``slot = block*bs + offset``.
    Negative slots are skipped (padding tokens, vLLM convention); a slot
    ``>= num_blocks*bs`` raises ValueError (checked on the host).  Only the 576
    data bytes and 8 scale bytes of each written token change.  With duplicate
    slots, which row wins is unspecified.
    """
    geom = cache_geometry(k_cache)
    fmt = check_fp8_format("fp8_format", fp8_format)
    check_tensor("k", k, dtype=_FLOAT_INPUT_DTYPES, shape=(None, HEAD_DIM))
    check_tensor("slot_mapping", slot_mapping, dtype=_SLOT_DTYPES, shape=(k.shape[0],))
    check_same_device(k_cache=k_cache, k=k, slot_mapping=slot_mapping)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.any()):
        return
    slots = slots[keep]
    too_big = slots >= geom.num_slots
    check_host_condition(
        "slot_mapping",
        not bool(too_big.any()),
        f"slots < num_blocks*block_size = {geom.num_slots}",
        slots[too_big][:4].tolist(),
    )
    data, scales = quantize_k(k[keep], fmt)
    geom.flat[_token_byte_index(geom.data_offsets(slots), TOKEN_DATA_BYTES)] = data
    geom.flat[_token_byte_index(geom.scale_offsets(slots), TOKEN_SCALE_BYTES)] = scales


def dequantize_slots(geom: CacheGeometry, slots: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """Unchecked reader for references: slots [n] int64, all in ``[0, num_slots)`` -> [n, 512] float32."""
    n = slots.shape[0]
    data = geom.flat[_token_byte_index(geom.data_offsets(slots), TOKEN_DATA_BYTES)]
    sc = geom.flat[_token_byte_index(geom.scale_offsets(slots), NUM_TILES)]
    nope = data[:, :NOPE_DIM].contiguous().view(_FP8_DTYPES[fp8_format]).float()
    # Power-of-two scale: the product is exact in fp32.
    scale = torch.exp2(sc.float() - SCALE_BIAS)
    nope = (nope.view(n, NUM_TILES, QUANT_TILE) * scale[..., None]).view(n, NOPE_DIM)
    rope = _le_bytes_to_bf16(data[:, NOPE_DIM:]).float()
    return torch.cat([nope, rope], dim=-1)


def dequantize_k(k_cache: torch.Tensor, slots: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """Read tokens back from the paged cache (exact dequantization).

    k_cache: [num_blocks, bs, 584] or [num_blocks, bs, 1, 584], uint8/int8/fp8 view.
    slots: any shape, int32 / int64, every value in ``[0, num_blocks*bs)``
    (otherwise ValueError; checked on the host).
    Returns float32 ``[*slots.shape, 512]``: ``x = float(fp8) * 2^(byte - 127)``
    for dims 0..447, the stored bf16 for dims 448..511.
    """
    geom = cache_geometry(k_cache)
    fmt = check_fp8_format("fp8_format", fp8_format)
    check_tensor("slots", slots, dtype=_SLOT_DTYPES)
    check_same_device(k_cache=k_cache, slots=slots)
    flat_slots = slots.reshape(-1).to(torch.int64)
    bad = (flat_slots < 0) | (flat_slots >= geom.num_slots)
    check_host_condition(
        "slots",
        not bool(bad.any()),
        f"values in [0, num_blocks*block_size = {geom.num_slots})",
        flat_slots[bad][:4].tolist(),
    )
    return dequantize_slots(geom, flat_slots, fmt).view(*slots.shape, HEAD_DIM)


__all__ = [
    "AMAX_FLOOR",
    "BLOCK_ALIGN_BYTES",
    "CacheGeometry",
    "HEAD_DIM",
    "NOPE_DIM",
    "NUM_TILES",
    "QUANT_TILE",
    "ROPE_DIM",
    "SCALE_BIAS",
    "TOKEN_BYTES",
    "TOKEN_DATA_BYTES",
    "TOKEN_SCALE_BYTES",
    "alloc_k_cache",
    "block_bytes",
    "cache_geometry",
    "dequantize_k",
    "dequantize_slots",
    "fp8_dtype",
    "fp8_max",
    "insert_k",
    "quantize_k",
]
