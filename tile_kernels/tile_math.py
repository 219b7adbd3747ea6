"""Tile reductions and matrix products, in the two forms a schedule can pick.

``tile_math="tensor_core"`` (CUDA, HIP): TileLang's own tile ops (``T.gemm`` on the tensor
cores / MFMA, ``T.reduce_*`` across the threads of a fragment), accumulators in register
fragments. ``tile_math="simt"`` (SYCL): the same products and reductions as explicit tile
loops over shared memory, which TileLang's generic SIMT pipeline lowers for any target (it
registers no gemm or reduce implementation there). Kernels call these helpers, so the
attention math is written once; only the schedule chooses how a product is computed.

Each SIMT form accumulates in a private register (a shared accumulator updated in a loop
makes TileLang's barrier planner put a barrier inside the loop) and starts with a
work-group barrier. The operands were written by other threads
just before, and without this barrier TileLang's barrier planner puts the one it needs
inside the ``tx < rows`` branch of the partitioned loop, where not every thread reaches it
(the SYCL printer refuses barriers in thread-dependent branches). Call them where all
threads are (not inside a ``T.Parallel`` or a thread-dependent ``if``).
"""

import tilelang.language as T

TILE_MATHS = ("tensor_core", "simt")


def check_tile_math(tile_math: str) -> str:
    if tile_math not in TILE_MATHS:
        raise ValueError(f"tile_math: expected one of {TILE_MATHS}, got {tile_math!r}")
    return tile_math


def alloc_accumulator(shape: list, dtype, tile_math: str):
    """A per-CTA accumulator: a register fragment, or shared memory for the SIMT loops
    (each of which reads whole rows that another loop's threads wrote)."""
    if check_tile_math(tile_math) == "simt":
        return T.alloc_shared(shape, dtype, scope="shared")
    return T.alloc_fragment(shape, dtype)


def _b_element(B, l, j, transpose_B: bool):
    """Element (l, j) of the right operand, stored as B [n, k] when ``transpose_B``."""
    return B[j, l] if transpose_B else B[l, j]


@T.macro
def gemm(A, B, C, m: int, n: int, k: int, transpose_B: bool, tile_math: str):
    """C[i, j] += Σ_l A[i, l] · B'[l, j] with B' = Bᵀ (B [n, k]) when ``transpose_B``, else B
    (B [k, n]); A [m, k]; fp32 accumulation."""
    if tile_math == "simt":
        acc = T.alloc_local([1], T.float32)
        T.sync_threads()
        for i, j in T.Parallel(m, n):
            acc[0] = C[i, j]
            for l in T.serial(k):
                acc[0] += T.cast(A[i, l], T.float32) * T.cast(_b_element(B, l, j, transpose_B),
                                                              T.float32)
            C[i, j] = acc[0]
    else:
        T.gemm(A, B, C, transpose_B=transpose_B, policy=T.GemmWarpPolicy.FullRow)


@T.macro
def row_max(src, dst, rows: int, cols: int, tile_math: str):
    """dst[i] = max(dst[i], max_j src[i, j])  (keeps the running value, like clear=False)."""
    if tile_math == "simt":
        acc = T.alloc_local([1], dst.dtype)
        T.sync_threads()
        for i in T.Parallel(rows):
            acc[0] = dst[i]
            for j in T.serial(cols):
                acc[0] = T.max(acc[0], src[i, j])
            dst[i] = acc[0]
    else:
        T.reduce_max(src, dst, dim=1, clear=False)


@T.macro
def row_sum(src, dst, rows: int, cols: int, tile_math: str):
    """dst[i] = Σ_j src[i, j]  (overwrites dst)."""
    if tile_math == "simt":
        acc = T.alloc_local([1], dst.dtype)
        T.sync_threads()
        for i in T.Parallel(rows):
            acc[0] = 0
            for j in T.serial(cols):
                acc[0] += src[i, j]
            dst[i] = acc[0]
    else:
        T.reduce_sum(src, dst, dim=1)
