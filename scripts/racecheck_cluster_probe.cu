// Which synchronisation does compute-sanitizer's racecheck model? A probe for the 4 hazards
// it reported in the 2-CTA crossover decode (bench/PERF_NOTES.md item 40, "racecheck"): the
// crossover's producer writes the validity bytes with plain stores and the consumers read
// them with plain loads, like the plain seesaw (no hazard), but it orders them differently:
//   RAW (producer stores -> consumer loads): the producer's 128 threads meet at named
//     barrier 10, then one thread arrives on the ready mbarrier (count 1 per copy), where the
//     plain seesaw has every producer thread arrive (count 128);
//   WAR (consumer loads -> next producer stores): lane 0 of each consumer warp arrives on the
//     free mbarrier through its cluster address (mapa + mbarrier.arrive.shared::cluster), on
//     the barrier of the CTA that refills the half, counting both CTAs' warps (count 8),
//     where the plain seesaw has every consumer thread arrive locally (count 128).
// Each CTA of a 2-CTA cluster runs one producer and one consumer warpgroup over a 64-byte
// buffer of its own shared memory, with one of these orderings each way; the kernel counts
// wrong bytes (a real race would show there; none is expected). Run each mode under
// `compute-sanitizer --tool racecheck`: the modes that report hazards name the ordering
// racecheck does not model. Build: nvcc -arch=sm_90a -lineinfo -o probe racecheck_cluster_probe.cu
#include <cstdint>
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {  // tl::mbarrier_arrive(bar)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// tl::mbarrier_arrive(bar, cta_id, pred): the crossover's releases (seesaw.seesaw_release)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t *bar, uint32_t cta) {
  asm volatile("{\n\t.reg .b32 remAddr32;\n\t"
               "mapa.shared::cluster.u32  remAddr32, %0, %1;\n\t"
               "mbarrier.arrive.shared::cluster.b64  _, [remAddr32];\n\t}" ::"r"(smem_u32(bar)),
               "r"(cta)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  asm volatile("{\n\t.reg .pred P1;\n\tLAB_WAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
               "@P1 bra DONE;\n\tbra LAB_WAIT;\n\tDONE:\n\t}" ::"r"(smem_u32(bar)),
               "r"(parity)
               : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// raw: 0 every producer thread arrives on `full` (the plain seesaw); 1 bar.sync 10, 128 then
//   one producer thread arrives (the crossover's announce_crossover).
// war: 0 every consumer thread arrives locally on `empty` (the plain seesaw);
//      1 lane 0 of each consumer warp arrives locally (after __syncwarp);
//      2 lane 0 arrives through the cluster address of its own CTA (after __syncwarp);
//      3 lane 0 arrives through the cluster address on both CTAs' `empty` (count 8, each CTA
//        waits for both CTAs' consumers: the crossover's free barriers);
//      4 lane 0 arrives locally with no __syncwarp, only a __shfl_xor_sync of the loaded
//        bytes' check before it (the kernel's lanes meet at shuffles and .aligned wgmma
//        waits, never at a __syncwarp, between the loads and lane 0's arrival).
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256)
    probe(int raw, int war, int iters, int *errors) {
  __shared__ __align__(8) uint64_t full, empty;
  __shared__ __align__(16) signed char flags[64];
  const int tid = threadIdx.x;
  const uint32_t rank = cluster_rank();
  if (tid == 0) {
    mbar_init(&full, raw ? 1 : 128);
    mbar_init(&empty, war == 0 ? 128 : (war == 3 ? 8 : 4));  // per thread, warp, or both CTAs' warps
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  cluster_sync();
  if (tid < 128) {  // consumer warpgroup
    int bad = 0;
    for (int it = 0; it < iters; ++it) {
      mbar_wait(&full, it & 1);
      const signed char v = flags[tid & 63];  // plain load (the kernel's line 212 / 491)
      bad += v != static_cast<signed char>((it * 7 + (tid & 63)) & 127);
      if (war == 0) {
        mbar_arrive(&empty);
      } else if (war == 4) {
        const int warp_bad = bad + __shfl_xor_sync(0xffffffffu, bad, 1);
        if ((tid & 31) == 0 && warp_bad >= 0) mbar_arrive(&empty);
      } else {
        __syncwarp();
        if ((tid & 31) == 0) {
          if (war == 1) mbar_arrive(&empty);
          if (war == 2) mbar_arrive_cluster(&empty, rank);
          if (war == 3) {
            mbar_arrive_cluster(&empty, 0);
            mbar_arrive_cluster(&empty, 1);
          }
        }
      }
    }
    if (bad) atomicAdd(errors, bad);
  } else {  // producer warpgroup
    const int p = tid - 128;
    for (int it = 0; it < iters; ++it) {
      mbar_wait(&empty, (it & 1) ^ 1);
      if (p < 64) flags[p] = static_cast<signed char>((it * 7 + p) & 127);  // (lines 908 ...)
      if (raw) {
        asm volatile("bar.sync 10, 128;" ::: "memory");
        if (p == 0) mbar_arrive(&full);
      } else {
        mbar_arrive(&full);
      }
    }
  }
  cluster_sync();  // neither CTA leaves while its peer may still arrive on its barriers
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s RAW_MODE(0-1) WAR_MODE(0-4)\n", argv[0]);
    return 2;
  }
  const int raw = atoi(argv[1]), war = atoi(argv[2]);
  int *errors;
  cudaMalloc(&errors, sizeof(int));
  cudaMemset(errors, 0, sizeof(int));
  probe<<<8, 256>>>(raw, war, 16, errors);
  cudaError_t err = cudaDeviceSynchronize();
  int host = -1;
  cudaMemcpy(&host, errors, sizeof(int), cudaMemcpyDeviceToHost);
  printf("probe raw=%d war=%d: %s, wrong bytes %d\n", raw, war, cudaGetErrorString(err), host);
  return err != cudaSuccess || host != 0;
}
