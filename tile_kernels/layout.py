"""The fp8_ds_mla token layout and head size (spec §1), one definition for every layer.

A token's K/V row has ``HEAD_DIM`` dims: ``NOPE_DIM`` quantised to FP8 in ``NUM_TILES``
tiles of ``QUANT_TILE`` with one UE8M0 scale byte each, and ``ROPE_DIM`` kept as bf16. In the
paged cache a block of ``bs`` tokens holds ``bs`` data records of ``TOKEN_DATA_BYTES`` (FP8
NoPE bytes, then the RoPE bf16s), then ``bs`` scale records of ``TOKEN_SCALE_BYTES`` (the
scales and one pad byte).
"""

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_TILE = 64
NUM_TILES = NOPE_DIM // QUANT_TILE  # 7
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
TOKEN_SCALE_BYTES = NUM_TILES + 1  # 8: 7 scales + pad
