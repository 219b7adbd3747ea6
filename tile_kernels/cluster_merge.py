"""The splits of a decode row merged inside a thread-block cluster (issue 23, lever 4).

With the warp-specialised decode's ``cluster_merge`` knob (fixed grid, split consumers) the
``S`` CTAs of one (row, head group) -- the grid's split axis, ``S`` in 2, 4, 8 -- form one
cluster (``cluster_dims (1, 1, S)``: a CTA's rank in the cluster is its split). Each CTA
finishes its split as the split-KV path does (an fp32 output normalised by its own sum, a
log2 partial LSE, ``-inf`` when the split is empty) and stages both in its own shared memory:
the output's fp32 halves in the Q and K buffers, which the main loop no longer needs (no new
shared memory). After one cluster barrier CTA ``k`` merges heads ``[k * 64 / S, (k + 1) *
64 / S)`` of its head group from the ``S`` CTAs' shared memory (distributed shared memory
loads), with the combine's weights, in split order, and the sink, and stores ``out`` (and,
rank 0, ``lse``). A second barrier keeps every CTA's shared memory alive until its peers
have read it. No fp32 partials in global memory and no second launch
(``build_sparse_decode_combine``).

Why loads of the peers' shared memory and not TileLang's ``T.copy_cluster``: that copy pushes a
local shared region into a peer's (``cp.async.bulk.shared::cluster``), so an all-to-all of the
partials needs a receive buffer of ``(S - 1) / S`` of the 128 KB fp32 output beside the 128
KB it is sent from: 192-224 KB at 4-8 splits, over the 227 KB of a CTA with Q, K and P
(~136 KB) in place. TileLang 0.1.15 has no load from a peer's shared memory, so a few lines
of CUDA (``DSMEM_PRELUDE``: ``mapa`` + ``ld.shared::cluster``, ``barrier.cluster`` with a
compiler memory barrier) give it.
"""

from typing import NamedTuple

import tilelang.language as T

from .attention_tile import LN2, LOG2E
from .fp8_producer import unrolled

# Split counts a cluster can merge: a power of two that divides the 256 dims of an output
# half into 16-byte columns, at most the portable cluster size (8).
CLUSTER_MERGE_SPLITS = (2, 4, 8)

DSMEM_PRELUDE = r"""
// Distributed shared memory of a thread-block cluster (sm_90): TileLang 0.1.15 copies into a
// peer CTA's shared memory (T.copy_cluster) but cannot load from it.
__device__ __forceinline__ unsigned dsmem_peer(const void* local, int rank) {
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local)), peer;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(addr), "r"(rank));
  return peer;
}
// four floats (16-byte aligned) of CTA `rank`'s copy of `local` into `out`
__device__ __forceinline__ void dsmem_load4(const void* local, int rank, float* out) {
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
               : "r"(dsmem_peer(local, rank)));
}
__device__ __forceinline__ float dsmem_load1(const void* local, int rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(dsmem_peer(local, rank)));
  return v;
}
// barrier.cluster (every thread of every CTA of the cluster), release / acquire, and a
// compiler memory barrier so that no shared-memory access moves across it
__device__ __forceinline__ void dsmem_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
// (no ordering of this thread's memory accesses: for the barrier that only says "done reading")
__device__ __forceinline__ void dsmem_cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void dsmem_cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""


def check_cluster_merge(num_splits: int, warp_specialized: bool, consumers: str,
                        persistent: bool, tokens_in_m: bool, raw_ring: int):
    """ValueError naming ``cluster_merge`` where it does not apply."""
    if not warp_specialized or tokens_in_m or consumers != "split" or persistent or raw_ring:
        raise ValueError(
            "cluster_merge: merges a row's splits inside a cluster on the warp-specialised "
            "schedule's fixed grid with the split consumers and no raw ring; got "
            f"warp_specialized {warp_specialized}, tokens_in_m {tokens_in_m}, consumers "
            f"{consumers!r}, persistent {persistent}, raw_ring {raw_ring}")
    if num_splits not in CLUSTER_MERGE_SPLITS:
        raise ValueError(f"cluster_merge: needs num_splits in {CLUSTER_MERGE_SPLITS} (the "
                         f"cluster along the grid's split axis), got {num_splits}")


class ClusterMergeState:
    """Shared memory of the merge beside the staged halves: the split's log2 LSE per head
    (read by the peers) and, per consumer warpgroup, the weights of the splits per head and
    the final scale per head; the merge's registers (a peer's four floats, four sums)."""

    def __init__(self, heads: int, splits: int):
        self.lse = T.alloc_shared([heads], T.float32, scope="shared")
        self.weight = [T.alloc_shared([heads, splits], T.float32, scope="shared")
                       for _ in (0, 1)]
        self.scale = [T.alloc_shared([heads], T.float32, scope="shared") for _ in (0, 1)]


class StagingPiece(NamedTuple):
    """Dims ``[first, first + dims)`` of a warpgroup's fp32 output half, all heads, in
    ``view`` (fp32 ``[rows, 256]`` over a bf16 ``[2 * rows, 256]`` Q or K buffer: TileLang
    reinterprets the buffer's swizzled layout only with whole rows); head ``h``, dim ``d``
    at ``view[h // per_row, (h % per_row) * dims + d - first]``."""
    view: object
    first: int
    dims: int
    per_row: int  # heads per view row

    def at(self, h, d):
        return self.view[h // self.per_row, (h % self.per_row) * self.dims + d - self.first]


def staging_pieces(q_half, k_halves, heads: int) -> tuple:
    """Where a warpgroup's ``[heads, 256]`` fp32 output half is staged, by columns
    (:class:`StagingPiece`): dims 0-127 in its Q half (bf16 ``[heads, 256]``), the rest in
    its K buffers' halves (bf16 ``[BI, 256]``: ``BI * 2`` dims each). By columns, not by
    heads: a thread's accumulator elements cover all heads of its warp but, per unrolled
    element, one known column range, so the staging is straight-line code (by heads it was
    three copies of it, one per warp's piece, and spilled in warpgroup 0's main loop)."""
    DH = q_half.shape[1]
    pieces, first = [], 0
    for buf in (q_half, *k_halves):
        if first < DH:
            rows = buf.shape[0] // 2
            dims = rows * DH // heads
            if first + dims > DH or dims % 32 or DH % dims:
                raise ValueError("cluster_merge: the Q and K buffers cannot hold the staged "
                                 "output")
            view = T.view(buf, [rows, DH], T.float32)
            pieces.append(StagingPiece(view, first, dims, DH // dims))
            first += dims
    if first < DH:
        raise ValueError("cluster_merge: the Q and K buffers cannot hold the staged output")
    return tuple(pieces)


@T.macro
def stage_half(acc_o, inv, pieces):
    """This CTA's output half ``acc_o`` times the rows' reciprocal denominators ``inv``
    (the split's fp32 partial, as the split-KV path stores it) into ``pieces``."""
    HB, DH = acc_o.shape
    for i, d in T.Parallel(HB, DH):
        for piece in pieces:
            if d >= piece.first and d < piece.first + piece.dims:
                piece.view[i // piece.per_row,
                           (i % piece.per_row) * piece.dims + d - piece.first] = (
                    acc_o[i, d] * inv[i])


def make_merge_half(num_heads: int, S: int, HB: int, DH: int):
    """The macro that merges this CTA's heads of one output half over the cluster (called by
    the 128 threads of the warpgroup that staged that half, after the first cluster
    barrier): CTA ``rank`` owns heads ``[rank * HB / S, (rank + 1) * HB / S)``; a thread
    takes four dims (``4 * (t % 64)``: one staging piece per thread) of ``HB / S / 2``
    of them."""
    HS = HB // S  # heads this CTA merges
    C4 = DH // 4  # threads per head row (four dims each)
    RPP = 128 // C4  # head rows per pass of the warpgroup
    passes = HS // RPP
    if passes * RPP != HS:
        raise ValueError(f"cluster_merge: {S} splits leave {HS} heads per CTA, fewer than the "
                         f"{RPP} rows of one pass")

    def peer_address(pieces, hh, c):
        """The staged float at (head ``hh``, dim ``c``) of this thread's piece (a select of
        the pieces' addresses: ``c`` is fixed per thread)."""
        addr = T.address_of(pieces[-1].at(hh, c))
        for piece in reversed(pieces[:-1]):
            addr = T.if_then_else(c < piece.first + piece.dims, T.address_of(piece.at(hh, c)),
                                  addr)
        return addr

    @T.macro
    def merge_half(pieces, cm, which: int, t, rank, d0, bar_id: int, write_lse, Sink, Out, Lse,
                   r_b, r_s, h0):
        """Threads ``t < HB`` of the warpgroup: the weights of the splits of head ``t`` (the
        combine's: ``2^(lse_s - max)`` in split order, 0 when every split is empty), the
        final scale with the sink and, with ``write_lse``, ``lse``; then each thread merges
        its four dims of ``passes`` heads: ``Σ_s w_s o_s`` in split order from the peers'
        staged partials, times the scale, to ``out`` (bf16). ``which``: the warpgroup's
        weights and scales in ``cm``; ``bar_id``: a named barrier of its 128 threads."""
        lse_stage, weight, mscale = cm.lse, cm.weight[which], cm.scale[which]
        lse_s = T.alloc_local([S], T.float32)  # head t's split LSEs
        tmp = T.alloc_local([4], T.float32)  # a peer's four floats
        acc4 = T.alloc_local([4], T.float32)
        if t < HB:
            for s in unrolled(S):
                lse_s[s] = T.call_extern("float32", "dsmem_load1", T.address_of(lse_stage[t]), s)
            m = T.alloc_var(T.float32, init=-T.infinity(T.float32))
            for s in unrolled(S):
                m = T.max(m, lse_s[s])
            acc = T.alloc_var(T.float32, init=0.0)
            for s in unrolled(S):
                w = T.if_then_else(m == -T.infinity(T.float32), 0.0, T.exp2(lse_s[s] - m))
                weight[t, s] = w
                acc = acc + w
            has = acc > 0
            lse2 = T.log2(T.max(acc, 1e-30)) + m
            if write_lse and h0 + t < num_heads:
                Lse[r_b, h0 + t, r_s] = T.if_then_else(has, lse2 * LN2, T.infinity(T.float32))
            # 1 / Σw for the merge times the sink factor 1 / (1 + 2^(sink·log2e - lse2))
            mscale[t] = T.if_then_else(
                has,
                1.0 / (acc * (1.0 + T.exp2(Sink[T.min(h0 + t, num_heads - 1)] * LOG2E - lse2))),
                0.0)
        T.sync_threads(bar_id, 128)
        c = (t % C4) * 4  # this thread's four dims (of the half)
        for g in unrolled(passes):
            hh = rank * HS + g * RPP + t // C4
            for e in unrolled(4):
                acc4[e] = 0.0
            for s in unrolled(S):
                T.call_extern("handle", "dsmem_load4", peer_address(pieces, hh, c), s,
                              T.address_of(tmp[0]))
                for e in unrolled(4):
                    acc4[e] = acc4[e] + weight[hh, s] * tmp[e]
            if h0 + hh < num_heads:
                for e in unrolled(4):
                    Out[r_b, r_s, h0 + hh, d0 + c + e] = T.cast(acc4[e] * mscale[hh],
                                                                T.bfloat16)

    return merge_half


@T.macro
def cluster_barrier():
    """Every thread of every CTA of the cluster; release / acquire: the staged partials
    written before it are visible to the peers' loads after it."""
    T.call_extern("handle", "dsmem_cluster_arrive")
    T.call_extern("handle", "dsmem_cluster_wait")


@T.macro
def cluster_barrier_relaxed():
    """Every thread of every CTA of the cluster, no memory ordering: the second barrier,
    which only keeps each CTA's shared memory alive until the peers are done loading from it
    (a load is done when its value was used, before the arrive in program order; the
    release of ``barrier.cluster.arrive`` is a GPU-scope fence, MEMBAR.ALL.GPU in SASS)."""
    T.call_extern("handle", "dsmem_cluster_arrive_relaxed")
    T.call_extern("handle", "dsmem_cluster_wait")
