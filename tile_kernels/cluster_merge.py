"""The splits of a decode row merged inside a thread-block cluster (issue 23, lever 4).

With the warp-specialised decode's ``cluster_merge`` knob (fixed grid, split consumers) the
``S`` CTAs of one (row, head group) -- the grid's split axis, ``S`` in 2, 4, 8 -- form one
cluster (``cluster_dims (1, 1, S)``: a CTA's rank in the cluster is its split). Each CTA
finishes its split as the split-KV path does (an fp32 output normalised by its own sum, a
log2 partial LSE, ``-inf`` when the split is empty) and stages both in its own shared memory:
the output's fp32 halves in the Q and K buffers, which the main loop no longer needs (no new
shared memory). After one cluster barrier CTA ``k`` merges dims ``[k * 256 / S, (k + 1) *
256 / S)`` of each half of every head from the ``S`` CTAs' shared memory (distributed shared
memory loads), with the combine's weights, in split order, and the sink, and stores ``out``
(and, rank 0, ``lse``). A second barrier keeps every CTA's shared memory alive until its peers
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
__device__ __forceinline__ void dsmem_load4(const float* local, int rank, float* out) {
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
               : "r"(dsmem_peer(local, rank)));
}
__device__ __forceinline__ float dsmem_load1(const float* local, int rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(dsmem_peer(local, rank)));
  return v;
}
// barrier.cluster (every thread of every CTA of the cluster), release / acquire, and a
// compiler memory barrier so that no shared-memory access moves across it
__device__ __forceinline__ void dsmem_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
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


def staging_pieces(q_half, k_halves, heads: int) -> tuple:
    """Where a warpgroup's ``[heads, 256]`` fp32 output half is staged: ``(view, first head,
    heads)`` over its Q half (bf16 ``[heads, 256]``: the first ``heads / 2`` rows in fp32),
    then its K buffers' halves (bf16 ``[BI, 256]``: ``BI / 2`` rows each) until every head
    has a row."""
    DH = q_half.shape[1]
    pieces = [(T.view(q_half, [heads // 2, DH], T.float32), 0, heads // 2)]
    first = heads // 2
    for k in k_halves:
        if first < heads:
            n = min(k.shape[0] // 2, heads - first)
            if n * 2 != k.shape[0]:
                raise ValueError("cluster_merge: K buffers cannot hold the staged output")
            pieces.append((T.view(k, [n, DH], T.float32), first, n))
            first += n
    if first < heads:
        raise ValueError("cluster_merge: the Q and K buffers cannot hold the staged output")
    return tuple(pieces)


@T.macro
def stage_half(acc_o, inv, pieces):
    """This CTA's output half ``acc_o`` times the rows' reciprocal denominators ``inv``
    (the split's fp32 partial, as the split-KV path stores it) into ``pieces``."""
    HB, DH = acc_o.shape
    for i, d in T.Parallel(HB, DH):
        for view, first, n in pieces:
            if i >= first and i < first + n:
                view[i - first, d] = acc_o[i, d] * inv[i]


def make_merge_half(num_heads: int, S: int, HB: int, DH: int):
    """The macro that merges this CTA's dims of one output half over the cluster (called by
    the 128 threads of the warpgroup that staged that half, after the first cluster
    barrier)."""
    DS = DH // S  # dims of a half this CTA merges
    Q4 = DS // 4  # threads per head (four dims each)
    HPG = 128 // Q4  # heads per pass of the warpgroup
    passes = HB // HPG

    def piece_of(pieces, head0: int):
        for view, first, n in pieces:
            if first <= head0 < first + n:
                if head0 + HPG > first + n:
                    raise ValueError("cluster_merge: a pass of the merge spans two staging "
                                     "buffers")
                return view, first
        raise ValueError(f"cluster_merge: head {head0} is not staged")

    @T.macro
    def merge_half(pieces, cm, which: int, t, rank, d0, bar_id: int, write_lse, Sink, Out, Lse,
                   r_b, r_s, h0):
        """Threads ``t < HB`` of the warpgroup: the weights of the splits of head ``t`` (the
        combine's: ``2^(lse_s - max)`` in split order, 0 when every split is empty), the
        final scale with the sink and, with ``write_lse``, ``lse``; then each thread merges
        four dims of ``passes`` heads: ``Σ_s w_s o_s`` in split order from the peers' staged
        partials, times the scale, to ``out`` (bf16). ``which``: the warpgroup's weights and
        scales in ``cm``; ``bar_id``: a named barrier of its 128 threads."""
        lse_stage, weight, mscale = cm.lse, cm.weight[which], cm.scale[which]
        tmp = T.alloc_local([4], T.float32)  # a peer's four floats
        acc4 = T.alloc_local([4], T.float32)
        if t < HB:
            # the splits' LSEs of head t, once from each peer (then the weights in place)
            for s in unrolled(S):
                weight[t, s] = T.call_extern("float32", "dsmem_load1",
                                             T.address_of(lse_stage[t]), s)
            m = T.alloc_var(T.float32, init=-T.infinity(T.float32))
            for s in unrolled(S):
                m = T.max(m, weight[t, s])
            acc = T.alloc_var(T.float32, init=0.0)
            for s in unrolled(S):
                w = T.if_then_else(m == -T.infinity(T.float32), 0.0, T.exp2(weight[t, s] - m))
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
        c = rank * DS + (t % Q4) * 4  # first dim (of the half) of this thread's four
        for g in unrolled(passes):
            view, first = piece_of(pieces, g * HPG)
            hh = g * HPG + t // Q4
            for e in unrolled(4):
                acc4[e] = 0.0
            for s in unrolled(S):
                T.call_extern("handle", "dsmem_load4", T.address_of(view[hh - first, c]), s,
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
    """Every thread of every CTA of the cluster (release / acquire)."""
    T.call_extern("handle", "dsmem_cluster_arrive")
    T.call_extern("handle", "dsmem_cluster_wait")
