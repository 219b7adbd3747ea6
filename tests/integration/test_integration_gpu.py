"""GPU tests of the integration surface: torch.library ops (opcheck), torch.compile
(fullgraph), CUDA-graph replay, and the raw kernel callables fed by JAX and CuPy (DLPack)."""

import math
import os

import pytest
import torch

import dsv4_tl
from dsv4_tl.testing import random_k, random_paged_cache

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"
SCALE = 512 ** -0.5


def _decode_args(gen, b=4, h=64, extra=True):
    q = torch.randn((b, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    k_cache = random_paged_cache(8, 64, gen, DEV)
    idx = torch.randint(0, 8 * 64, (b, 1, 128), generator=gen, device=DEV, dtype=torch.int32)
    lens = torch.randint(1, 129, (b,), generator=gen, device=DEV, dtype=torch.int32)
    sink = torch.rand(h, generator=gen, device=DEV)
    e_cache = e_idx = e_lens = None
    if extra:
        e_cache = random_paged_cache(64, 2, gen, DEV)
        e_idx = torch.randint(0, 128, (b, 1, 128), generator=gen, device=DEV, dtype=torch.int32)
        e_lens = torch.randint(0, 129, (b,), generator=gen, device=DEV, dtype=torch.int32)
    return (q, k_cache, idx, lens, SCALE, sink, e_cache, e_idx, e_lens, "e4m3fn")


def _prefill_args(gen, s_q=16, h=64, s_kv=512, topk=128):
    q = torch.randn((s_q, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    kv = random_k(s_kv, gen, DEV).view(s_kv, 1, 512)
    idx = torch.randint(-1, s_kv, (s_q, 1, topk), generator=gen, device=DEV, dtype=torch.int32)
    lens = torch.randint(0, topk + 1, (s_q,), generator=gen, device=DEV, dtype=torch.int32)
    sink = torch.rand(h, generator=gen, device=DEV)
    return (q, kv, idx, SCALE, sink, lens)


def test_opcheck_sparse_decode(seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    torch.library.opcheck(torch.ops.dsv4_tl.sparse_decode, _decode_args(gen))
    torch.library.opcheck(torch.ops.dsv4_tl.sparse_decode, _decode_args(gen, b=2, extra=False))


def test_opcheck_sparse_prefill(seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    torch.library.opcheck(torch.ops.dsv4_tl.sparse_prefill, _prefill_args(gen))
    q, kv, idx, scale, sink, lens = _prefill_args(gen)
    flat = idx.view(-1)
    indptr = torch.arange(0, flat.numel() + 1, 128, device=DEV, dtype=torch.int32)
    torch.library.opcheck(torch.ops.dsv4_tl.sparse_prefill_ragged,
                          (q, kv, flat, indptr, scale, sink))


def test_torch_compile_fullgraph_matches_eager(seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    d_args = _decode_args(gen)
    p_args = _prefill_args(gen)

    def step(d, p):
        # Only elementwise work around the ops: inductor's reductions may sum in another
        # order than eager, which would make the comparison about torch, not these ops.
        out, lse = dsv4_tl.sparse_decode(*d[:9], fp8_format=d[9])
        p_out, p_max, p_lse = dsv4_tl.sparse_prefill(*p)
        return out * 2, lse + 1, p_out, p_max, p_lse

    eager = step(d_args, p_args)
    compiled = torch.compile(step, fullgraph=True)(d_args, p_args)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_cuda_graph_replay_matches_eager(seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    d_args = _decode_args(gen, b=3)  # b=3 h=64: split-KV + combine inside the graph
    p_args = _prefill_args(gen)
    eager_d = dsv4_tl.sparse_decode(*d_args[:9])
    eager_p = dsv4_tl.sparse_prefill(*p_args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        dsv4_tl.sparse_decode(*d_args[:9])
        dsv4_tl.sparse_prefill(*p_args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_d = dsv4_tl.sparse_decode(*d_args[:9])
        g_p = dsv4_tl.sparse_prefill(*p_args)
    for t in (*g_d, *g_p):
        t.fill_(math.nan)  # poison: only the replay may write them
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((*eager_d, *eager_p), (*g_d, *g_p)):
        assert torch.equal(a, b)
    # New inputs copied into the captured buffers: the replay must follow them.
    d_args[0].copy_(torch.randn(d_args[0].shape, generator=gen, device=DEV).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    fresh = dsv4_tl.sparse_decode(*d_args[:9])
    assert torch.equal(fresh[0], g_d[0]) and torch.equal(fresh[1], g_d[1])



def test_graph_replay_after_the_plans_are_dropped(seed):
    """Issue 25 item 2: a graph captured with the tensors a plan passes on its own account
    (full lengths for ``topk_length=None``, the -inf sink for ``attn_sink=None``) replays
    correctly after the plans are dropped (``clear_caches``, as any ``kernels_changed``
    or a plan-cache eviction does) and their memory could be reused: those tensors live as
    long as the process (a replay used to read freed blocks: lse +inf, zero outputs)."""
    from dsv4_tl import schedules

    gen = torch.Generator(DEV).manual_seed(seed)
    q, k_cache, idx, _lens, scale, _sink, *_ = _decode_args(gen, b=3, extra=False)
    p_q, kv, p_idx, _, _, _ = _prefill_args(gen)
    p_idx.clamp_(min=0)  # every index valid: the full lengths decide the result

    def step():
        return (*dsv4_tl.sparse_decode(q, k_cache, idx, None, scale),
                *dsv4_tl.sparse_prefill(p_q, kv, p_idx, scale))

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: the plans are made here
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    schedules.clear_caches()  # drops every plan and memo (kernels_changed)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # whatever the dropped plans held is free now: fill every small block with garbage
    garbage = [torch.full((n,), 0x55, dtype=torch.uint8, device=DEV)
               for n in (4, 12, 64, 256, 512, 1024, 4096) for _ in range(64)]
    for t in captured:
        t.fill_(math.nan)  # poison: only the replay may write them
    graph.replay()
    torch.cuda.synchronize()
    del garbage
    for name, a, b in zip(("out", "lse", "p_out", "p_max_logits", "p_lse"), eager, captured):
        assert torch.equal(a, b), f"{name}: the replay differs from eager"

def _raw_prefill(seed):
    """Inputs for the raw dense-prefill kernel callable and the torch result to match."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, kv, idx, scale, sink, lens = _prefill_args(gen, h=64)
    expected = dsv4_tl.ops.sparse_prefill(q, kv, idx, scale, sink, lens)
    # The same variant the front end picks: same static parameters and bucket features.
    kernel = dsv4_tl.raw_kernel("sparse_prefill", torch.device(DEV),
                                dict(num_heads=64, ragged=False), h=64, topk=idx.shape[-1])
    inputs = (q, kv.view(-1, 512), idx.view(q.shape[0], -1), lens, sink)
    return kernel, inputs, expected, scale


def test_raw_kernel_takes_cupy_arrays(seed):
    cupy = pytest.importorskip("cupy")
    kernel, inputs, expected, scale = _raw_prefill(seed)
    torch.cuda.synchronize()
    # CuPy has no bfloat16: move the bf16 tensors as uint16 bit patterns and view them back.
    cp_in = [cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)
             for t in inputs]
    s_q, h = inputs[0].shape[:2]
    cp_out = cupy.full((s_q, h, 512), 0x7FC0, dtype=cupy.int16)  # bf16 NaN bits
    cp_ml = cupy.full((s_q, h), cupy.nan, dtype=cupy.float32)
    cp_lse = cupy.full((s_q, h), cupy.nan, dtype=cupy.float32)
    as_bf16 = [torch.from_dlpack(a).view(torch.bfloat16) if a.dtype == cupy.int16 else a
               for a in (*cp_in, cp_out)]
    cupy.cuda.Device().synchronize()
    kernel(*as_bf16[:2], cp_in[2], cp_in[3], cp_in[4], as_bf16[5], cp_ml, cp_lse, scale)
    torch.cuda.synchronize()
    got = (torch.from_dlpack(cp_out).view(torch.bfloat16), torch.from_dlpack(cp_ml),
           torch.from_dlpack(cp_lse))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_raw_kernel_takes_jax_arrays(seed):
    # conftest stops JAX's preallocation (75 % of the card), which starved the other workers
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    kernel, inputs, expected, scale = _raw_prefill(seed)
    torch.cuda.synchronize()
    gpu = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpu:
        pytest.skip("JAX sees no GPU")
    # JAX arrays as inputs (copied to the GPU by JAX itself); outputs allocated by torch.
    j_in = [jax.device_put(jnp.asarray(t.cpu().float().numpy() if t.dtype == torch.bfloat16
                                       else t.cpu().numpy()), gpu[0]) for t in inputs]
    j_in[0] = j_in[0].astype(jnp.bfloat16)
    j_in[1] = j_in[1].astype(jnp.bfloat16)
    for a in j_in:
        a.block_until_ready()
    s_q, h = inputs[0].shape[:2]
    out = torch.full((s_q, h, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    ml = torch.full((s_q, h), math.nan, device=DEV)
    lse = torch.full((s_q, h), math.nan, device=DEV)
    kernel(*j_in, out, ml, lse, scale)
    torch.cuda.synchronize()
    for a, b in zip(expected, (out, ml, lse)):
        assert torch.equal(a, b)
