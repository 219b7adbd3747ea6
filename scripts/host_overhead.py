"""Host overhead of one front-end call (µs), measured on the GPU machine.

Times N back-to-back calls of each public op on tiny inputs with the GPU queue kept busy
(so kernel time hides behind the host), reads the host-side wall time per call, and compares
it with the raw kernel callable on the same arguments. Prints a small table.
"""

import time

import torch

import dsv4_tl
from dsv4_tl.testing import random_k, random_paged_cache

DEV = "cuda"


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    q = torch.randn((8, 1, 64, 512), generator=gen, device=DEV).to(torch.bfloat16)
    cache = random_paged_cache(8, 64, gen, DEV)
    idx = torch.randint(0, 512, (8, 1, 128), generator=gen, device=DEV, dtype=torch.int32)
    lens = torch.full((8,), 128, dtype=torch.int32, device=DEV)
    sink = torch.zeros(64, device=DEV)
    qp = torch.randn((8, 64, 512), generator=gen, device=DEV).to(torch.bfloat16)
    kv = random_k(256, gen, DEV).view(256, 1, 512)
    pidx = torch.randint(0, 256, (8, 1, 128), generator=gen, device=DEV, dtype=torch.int32)
    rows = [
        ("dsv4_tl.sparse_decode (custom op)",
         lambda: dsv4_tl.sparse_decode(q, cache, idx, lens, None, sink)),
        ("dsv4_tl.ops.sparse_decode (plain)",
         lambda: dsv4_tl.ops.sparse_decode(q, cache, idx, lens, None, sink)),
        ("dsv4_tl.sparse_prefill (custom op)",
         lambda: dsv4_tl.sparse_prefill(qp, kv, pidx, 0.04, sink, None)),
        ("dsv4_tl.ops.sparse_prefill (plain)",
         lambda: dsv4_tl.ops.sparse_prefill(qp, kv, pidx, 0.04, sink, None)),
    ]
    raw = dsv4_tl.raw_kernel("sparse_prefill", torch.device(DEV), dict(num_heads=64, ragged=False),
                             h=64, topk=128)
    outs = (torch.empty((8, 64, 512), dtype=torch.bfloat16, device=DEV),
            torch.empty((8, 64), device=DEV), torch.empty((8, 64), device=DEV))
    lens_p = torch.full((8,), 128, dtype=torch.int32, device=DEV)
    pidx2 = pidx.view(8, 128)
    kv2 = kv.view(256, 512)
    rows.append(("raw prefill kernel callable",
                 lambda: raw(qp, kv2, pidx2, lens_p, sink, *outs, 0.04)))
    print(f"{'call':40s} {'host us/call':>12s}")
    for name, fn in rows:
        print(f"{name:40s} {per_call_us(fn):12.1f}")


if __name__ == "__main__":
    main()
