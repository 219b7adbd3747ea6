"""CPU tests of the torch.library ops and the vLLM / FlashMLA drop-in wrappers.

Nothing here launches a kernel: the ops run through their fake implementations, on fake
CUDA tensors (``FakeTensorMode`` builds them without a GPU). Covered: every op's schema
(argument names, defaults, the one mutation), fake-tensor shapes and dtypes of every op
(also called with defaulted arguments left out, which needs the fake implementations to carry
the op's defaults), torch.compile(fullgraph=True) tracing of the wrappers (Dynamo, with a
backend that only records the graph), how the wrappers honour preallocated outputs, and
every argument-rejection path of the wrappers (exception type, argument name first).

The values the ops compute are tested on a GPU (tests/integration/test_vllm_compat_gpu.py).
"""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dsv4_tl
from dsv4_tl import vllm_compat as vc

BF16, I32, F32, U8 = torch.bfloat16, torch.int32, torch.float32, torch.uint8
CUDA = "cuda"
SCALE = 512 ** -0.5


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (nothing here is random)
    return seed


@pytest.fixture
def fake():
    """A fake-tensor mode with a shape environment (needed by the ragged ops' unbacked nnz)."""
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        yield mode


def _raises(exc, name, fn):
    # the message must start with the argument name
    with pytest.raises(exc, match=rf"^{re.escape(name)}:"):
        fn()


def _t(shape, dtype, device=CUDA):
    return torch.empty(shape, dtype=dtype, device=device)


def _strided(shape, stride, dtype, device=CUDA):
    # A non-contiguous fake tensor. (Slicing or transposing a CUDA fake tensor is refused
    # on a CPU-only torch build, as is copy_ between two; factories work.)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------
# input builders (shapes only; values never matter here)
# ---------------------------------------------------------------------------------------
def _decode_inputs(b=4, s_q=1, h=64, topk=128, extra=True, dev=CUDA):
    d = dict(q=_t((b, s_q, h, 512), BF16, dev), k_cache=_t((8, 64, 1, 584), U8, dev),
             indices=_t((b, s_q, topk), I32, dev), topk_length=_t((b,), I32, dev),
             attn_sink=_t((h,), F32, dev))
    if extra:
        d.update(extra_k_cache=_t((64, 2, 1, 584), U8, dev),
                 extra_indices_in_kvcache=_t((b, s_q, 256), I32, dev),
                 extra_topk_length=_t((b,), I32, dev))
    return d


def _fm_decode(d, meta, **kw):
    """flash_mla_with_kvcache as vLLM's DSv4 decode calls it."""
    args = dict(q=d["q"], k_cache=d["k_cache"], block_table=None, cache_seqlens=None,
                head_dim_v=512, tile_scheduler_metadata=meta, softmax_scale=SCALE,
                is_fp8_kvcache=True, indices=d["indices"], topk_length=d["topk_length"],
                attn_sink=d["attn_sink"], extra_k_cache=d.get("extra_k_cache"),
                extra_indices_in_kvcache=d.get("extra_indices_in_kvcache"),
                extra_topk_length=d.get("extra_topk_length"))
    args.update(kw)
    return vc.flash_mla_with_kvcache(**args)


def _prefill_inputs(s_q=16, h=64, s_kv=300, topk=640, dev=CUDA):
    return dict(q=_t((s_q, h, 512), BF16, dev), kv=_t((s_kv, 1, 512), BF16, dev),
                indices=_t((s_q, 1, topk), I32, dev), sm_scale=SCALE,
                attn_sink=_t((h,), F32, dev), topk_length=_t((s_q,), I32, dev))


def _gather_inputs(num_reqs=3, max_tokens=100, dev=CUDA):
    return dict(out=_t((num_reqs, max_tokens, 512), BF16, dev),
                k_cache=_t((10, 64, 584), U8, dev), seq_lens=_t((num_reqs,), I32, dev),
                gather_lens=_t((num_reqs,), I32, dev), block_table=_t((num_reqs, 4), I32, dev),
                block_size=64, offset=5)


def _global_inputs(T=37, K=512, dev=CUDA):
    return (_t((T, K), I32, dev), _t((T,), I32, dev), _t((5, 8), I32, dev), 64,
            _t((T,), torch.bool, dev))


def _combine_inputs(Tc=23, K=512, R=4, topk=512, window=128, dev=CUDA):
    return (_t((Tc, K), I32, dev), _t((R + 1,), I32, dev), _t((R,), I32, dev),
            _t((R,), I32, dev), window, 4, topk, 3000, 900)


# ---------------------------------------------------------------------------------------
# schemas
# ---------------------------------------------------------------------------------------
SCHEMAS = {
    # op: (argument names, number of returns)
    "sparse_decode": (["q", "k_cache", "indices", "topk_length", "softmax_scale", "attn_sink",
                       "extra_k_cache", "extra_indices", "extra_topk_length", "fp8_format",
                       "batch_invariant", "metadata"], 2),
    "sparse_decode_metadata": (["q", "k_cache", "indices", "topk_length", "extra_k_cache",
                                "extra_indices", "extra_topk_length", "fp8_format",
                                "batch_invariant"], 1),
    "sparse_prefill": (["q", "kv", "indices", "sm_scale", "attn_sink", "topk_length"], 3),
    "sparse_prefill_ragged": (["q", "kv", "indices", "indptr", "sm_scale", "attn_sink"], 3),
    "dequantize_and_gather_k_cache": (["out", "k_cache", "seq_lens", "gather_lens",
                                       "block_table", "block_size", "offset", "fp8_format"], 0),
    "compute_global_topk_indices_and_lens": (["topk_indices", "token_to_req", "block_table",
                                              "block_size", "is_valid_token"], 2),
    "compute_global_topk_ragged_indices_and_indptr": (["topk_indices", "token_to_req",
                                                       "block_table", "block_size",
                                                       "is_valid_token"], 2),
    "combine_topk_swa_indices": (["topk_indices", "query_start_loc", "seq_lens", "gather_lens",
                                  "window", "compress_ratio", "topk", "M", "N"], 2),
    "combine_topk_swa_ragged_indices": (["topk_indices", "query_start_loc", "seq_lens",
                                         "gather_lens", "window", "compress_ratio", "topk",
                                         "M", "N"], 2),
}


@pytest.mark.parametrize("op", sorted(SCHEMAS))
def test_schema(op):
    names, n_returns = SCHEMAS[op]
    schema = getattr(torch.ops.dsv4_tl, op).default._schema
    assert [a.name for a in schema.arguments] == names
    assert len(schema.returns) == n_returns
    mutated = [a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == (["out"] if op == "dequantize_and_gather_k_cache" else [])
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    if "fp8_format" in names:
        assert defaults["fp8_format"] == "e4m3fn"
    if "batch_invariant" in names:
        assert defaults["batch_invariant"] is False
    for ret in schema.returns:
        assert str(ret.type) == "Tensor"


def test_public_names():
    for name in SCHEMAS:
        assert getattr(dsv4_tl, name) is getattr(dsv4_tl.library, name)
    assert dsv4_tl.vllm_compat is vc


# ---------------------------------------------------------------------------------------
# fake-tensor propagation of every op (CUDA fake tensors)
# ---------------------------------------------------------------------------------------
def _meta(t, shape, dtype):
    assert isinstance(t, FakeTensor)
    assert tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.device.type == "cuda", (
        f"got {list(t.shape)} {t.dtype} {t.device}, want {list(shape)} {dtype} cuda")
    assert t.is_contiguous()


@pytest.mark.parametrize("extra", [False, True])
def test_fake_sparse_decode(fake, extra):
    d = _decode_inputs(b=3, s_q=2, h=48, extra=extra)
    args = (d["q"], d["k_cache"], d["indices"], d["topk_length"], SCALE, d["attn_sink"],
            d.get("extra_k_cache"), d.get("extra_indices_in_kvcache"), d.get("extra_topk_length"))
    for out, lse in (torch.ops.dsv4_tl.sparse_decode(*args),
                     torch.ops.dsv4_tl.sparse_decode(*args, fp8_format="e4m3fnuz"),
                     torch.ops.dsv4_tl.sparse_decode.default(d["q"], d["k_cache"], d["indices"])):
        _meta(out, (3, 2, 48, 512), BF16)
        _meta(lse, (3, 48, 2), F32)


@pytest.fixture
def sm90a(monkeypatch):
    """Fake CUDA tensors resolve as on an H200 (cuda:sm_90a, 132 SMs): the metadata's fake
    implementation then gives its exact shape (on this machine, without a GPU, unbacked)."""
    import importlib

    from dsv4_tl import library
    from dsv4_tl.targets import parse_target

    sd = importlib.import_module("dsv4_tl.ops.sparse_decode")  # (the module, not the function)

    monkeypatch.setattr(library, "_target_known", lambda device: True)
    monkeypatch.setattr(sd, "_target", lambda device: parse_target("cuda:sm_90a"))
    monkeypatch.setattr(sd, "_sm_count", lambda device: 132)


def _metadata_args(b, h=64, s_q=1, scope="c128a", width=4096, topk=128):
    """sparse_decode_metadata's arguments: C128A = extra blocks of 2 tokens, C4A of 64."""
    args = [_t((b, s_q, h, 512), BF16), _t((8, 64, 1, 584), U8), _t((b, s_q, topk), I32),
            _t((b,), I32)]
    if scope != "swa":
        bs = 2 if scope == "c128a" else 64
        args += [_t((64, bs, 1, 584), U8), _t((b, s_q, width), I32), _t((b,), I32)]
    return args


def _persistent_ctas(b, s_q, h, hpb, topk, width, bt, knob, balance, invariant=False):
    """The grid the front end sizes (ops/sparse_decode.py, _persistent_grid), 132 SMs."""
    from dsv4_tl.ops.sparse_decode import persistent_split_size

    max_tiles = -(-topk // bt) + -(-width // bt)
    units = b * s_q * -(-h // hpb)
    tps, _ = persistent_split_size(knob, -(-max_tiles // 128), max_tiles, units, 132,
                                   invariant, balance)
    return min(132, units * -(-max_tiles // tps))


@pytest.mark.filterwarnings("ignore:schedule. no tuning log entry")
def test_fake_sparse_decode_metadata(fake, sm90a):
    # the sm_90a schedule file's persistent buckets: h64 / h128 C128A width >= 4096 (items at
    # 1-16 CTAs, tiles above: 6 / 8 words), h8 / h16 / h32 C4A at 17-66 CTAs (items)
    op = torch.ops.dsv4_tl.sparse_decode_metadata
    cases = [
        (dict(b=4), (_persistent_ctas(4, 1, 64, 64, 128, 4096, 32, 4, "items"), 6)),
        (dict(b=32), (_persistent_ctas(32, 1, 64, 64, 128, 4096, 32, 4, "tiles"), 8)),
        (dict(b=2, h=128, s_q=2), (_persistent_ctas(2, 2, 128, 64, 128, 8192, 32, 4,
                                                    "items"), 6)),
        (dict(b=20, h=8, scope="c4a", width=512), (_persistent_ctas(20, 1, 8, 8, 128, 512, 64,
                                                                    2, "items"), 6)),
        (dict(b=4, scope="c4a", width=512), (0, 0)),  # h64 C4A: split-KV, no plan
        (dict(b=4, width=1024), (0, 0)),  # C128A below width 4096: the fixed grid
        (dict(b=64, scope="swa"), (0, 0)),
        (dict(b=0), (0, 0)),
    ]
    for kw, shape in cases:
        if kw.get("h") == 128:
            kw = dict(kw, width=8192)
        args = _metadata_args(**kw)
        m = op(*args)
        _meta(m, shape, I32)
        assert shape[0] <= 132
        _meta(torch.ops.dsv4_tl.sparse_decode_metadata.default(*args[:3]),
              # (no extra scope: SWA-only)
              (0, 0), I32)
    # batch-invariant calls resolve with width 0 and 1 CTA: the small-batch split-KV bucket
    _meta(op(*_metadata_args(b=32), "e4m3fn", True), (0, 0), I32)
    # the decode fake takes it (and checks its dtype / rank / device)
    args = _metadata_args(b=32)
    out, lse = torch.ops.dsv4_tl.sparse_decode(*args[:4], SCALE, None, *args[4:],
                                               metadata=op(*args))
    _meta(out, (32, 1, 64, 512), BF16)
    for bad in (_t((132, 8), torch.int64), _t((132,), I32), _t((132, 8), I32, "cpu")):
        _raises(ValueError, "metadata", lambda: torch.ops.dsv4_tl.sparse_decode(
            *args[:4], SCALE, None, *args[4:], metadata=bad))
    # the argument checks are the decode's (the argument named first)
    _raises(TypeError, "indices", lambda: op(args[0], args[1], _t((32, 1, 128), F32)))
    _raises(ValueError, "extra_topk_length", lambda: op(*args[:6], _t((31,), I32)))
    _raises(ValueError, "fp8_format", lambda: op(*args, "e5m2"))


def test_fake_sparse_decode_metadata_without_a_gpu(fake):
    # fake CUDA tensors on a machine without a GPU: the target is unknown, the shape unbacked
    # (after the argument checks), and the decode takes it
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the shape is exact (test_fake_sparse_decode_metadata)")
    args = _metadata_args(b=32)
    m = torch.ops.dsv4_tl.sparse_decode_metadata(*args)
    assert m.dim() == 2 and all(isinstance(n, torch.SymInt) for n in m.shape)
    assert m.dtype == I32 and m.device.type == "cuda"
    out, _ = torch.ops.dsv4_tl.sparse_decode(*args[:4], SCALE, None, *args[4:], metadata=m)
    _meta(out, (32, 1, 64, 512), BF16)
    _raises(ValueError, "extra_topk_length",
            lambda: torch.ops.dsv4_tl.sparse_decode_metadata(*args[:6], _t((31,), I32)))


def test_fake_sparse_prefill(fake):
    p = _prefill_inputs(s_q=16, h=64)
    args = (p["q"], p["kv"], p["indices"], SCALE, p["attn_sink"], p["topk_length"])
    for res in (torch.ops.dsv4_tl.sparse_prefill(*args),
                torch.ops.dsv4_tl.sparse_prefill.default(*args[:4])):
        _meta(res[0], (16, 64, 512), BF16)
        _meta(res[1], (16, 64), F32)
        _meta(res[2], (16, 64), F32)
    flat, indptr = _t((1000,), I32), _t((17,), I32)
    for res in (torch.ops.dsv4_tl.sparse_prefill_ragged(p["q"], p["kv"], flat, indptr, SCALE,
                                                        p["attn_sink"]),
                torch.ops.dsv4_tl.sparse_prefill_ragged.default(p["q"], p["kv"], flat, indptr,
                                                                SCALE)):
        _meta(res[0], (16, 64, 512), BF16)
        _meta(res[1], (16, 64), F32)
        _meta(res[2], (16, 64), F32)


def test_fake_dequantize_and_gather(fake):
    g = _gather_inputs()
    view = _strided((3, 100, 512), (120 * 512, 512, 1), BF16)  # a column slice of a workspace
    args = (view, g["k_cache"], g["seq_lens"], g["gather_lens"], g["block_table"], 64, 5)
    assert torch.ops.dsv4_tl.dequantize_and_gather_k_cache(*args) is None
    assert torch.ops.dsv4_tl.dequantize_and_gather_k_cache.default(*args, "e4m3fnuz") is None
    assert torch.ops.dsv4_tl.dequantize_and_gather_k_cache(view, g["k_cache"], g["seq_lens"],
                                                           None, g["block_table"], 64, 0) is None
    assert view.shape == (3, 100, 512) and view.stride() == (120 * 512, 512, 1)


def test_fake_global_topk(fake):
    args = _global_inputs(T=37, K=512)
    g, lens = torch.ops.dsv4_tl.compute_global_topk_indices_and_lens(*args)
    _meta(g, (37, 512), I32)
    _meta(lens, (37,), I32)
    flat, indptr = torch.ops.dsv4_tl.compute_global_topk_ragged_indices_and_indptr(*args)
    assert isinstance(flat.shape[0], torch.SymInt)  # data-dependent nnz, unbacked
    assert flat.dim() == 1 and flat.dtype == I32 and flat.device.type == "cuda"
    _meta(indptr, (38,), I32)


@pytest.mark.parametrize("topk,window,width", [(512, 128, 640), (1024, 128, 1152),
                                               (0, 128, 128), (160, 128, 384), (0, 0, 0)])
def test_fake_combine(fake, topk, window, width):
    args = _combine_inputs(Tc=23, K=max(topk, 1), topk=topk, window=window)
    c, lens = torch.ops.dsv4_tl.combine_topk_swa_indices(*args)
    _meta(c, (23, width), I32)
    _meta(lens, (23,), I32)
    flat, indptr = torch.ops.dsv4_tl.combine_topk_swa_ragged_indices(*args)
    assert isinstance(flat.shape[0], torch.SymInt)
    assert flat.dim() == 1 and flat.dtype == I32
    _meta(indptr, (24,), I32)


# ---------------------------------------------------------------------------------------
# the wrappers on fake tensors
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [False, True])
def test_flash_mla_with_kvcache_fake(fake, extra):
    d = _decode_inputs(b=4, s_q=1, h=64, extra=extra)
    meta, none = vc.get_mla_metadata(torch.zeros(4), 64, 1, anything="ignored")
    assert none is None and isinstance(meta, vc.SchedMeta) and not meta.have_initialized
    out, lse = _fm_decode(d, meta)
    _meta(out, (4, 1, 64, 512), BF16)
    _meta(lse, (4, 64, 1), F32)
    assert meta.have_initialized
    assert meta.config == vc.SchedConfig(4, 1, 64, 64, 1, False, True, 128,
                                         2 if extra else None, 256 if extra else None)
    # the same object serves every later call with the same shapes (FlashMLA: one per layer
    # type, reused across the layers of a step), the vLLM 3-D cache view included
    for _ in range(2):
        _fm_decode(d, meta, k_cache=d["k_cache"].squeeze(2), softmax_scale=None)
    # its first call computed the step's scheduler metadata into it (here without a GPU:
    # an unbacked shape); num_splits stays None
    plan = meta.tile_scheduler_metadata
    assert isinstance(plan, FakeTensor) and plan.dtype == I32 and plan.dim() == 2
    assert meta.num_splits is None


def test_flash_mla_with_kvcache_metadata_once_per_object(monkeypatch):
    # FlashMLA's scheduler-metadata semantics: the object's first call computes the plan
    # (dsv4_tl.sparse_decode_metadata of that call), every later call passes it as
    # sparse_decode(metadata=); a fresh object computes it again. The ops are recorders.
    calls = []

    def meta_op(*args):
        calls.append(("metadata", args))
        return torch.full((3, 6), len(calls), dtype=I32)

    def decode_op(*args):
        calls.append(("decode", args))
        return "out", "lse"

    def front_end(*args, **kwargs):
        calls.append(("ops", args, kwargs))
        return kwargs["out"], "lse"

    monkeypatch.setattr(vc.library, "sparse_decode_metadata", meta_op)
    monkeypatch.setattr(vc.library, "sparse_decode", decode_op)
    monkeypatch.setattr(vc.ops, "sparse_decode", front_end)
    d = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _decode_inputs(dev="cpu").items()}
    meta = vc.get_mla_metadata()[0]
    for _ in range(3):
        assert _fm_decode(d, meta) == ("out", "lse")
    out = torch.zeros((4, 1, 64, 512), dtype=BF16)
    assert _fm_decode(d, meta, out=out) == (out, "lse")  # the eager out= path
    assert [c[0] for c in calls] == ["metadata", "decode", "decode", "decode", "ops"]
    plan = calls[0][1]
    # the metadata of the first call's q, caches, indices and lengths, in its FP8 format
    assert plan[0] is d["q"] and plan[2] is d["indices"] and plan[3] is d["topk_length"]
    assert plan[4] is d["extra_k_cache"] and plan[5] is d["extra_indices_in_kvcache"]
    assert plan[6] is d["extra_topk_length"] and plan[7] == "e4m3fn"
    stored = meta.tile_scheduler_metadata
    assert stored.shape == (3, 6) and int(stored[0, 0]) == 1
    for c in calls[1:4]:
        assert c[1][-1] is stored and c[1][-2] is False and c[1][-3] == "e4m3fn"
    assert calls[4][2]["metadata"] is stored and calls[4][2]["out"] is out
    meta2 = vc.get_mla_metadata()[0]
    _fm_decode(d, meta2)
    assert [c[0] for c in calls[5:]] == ["metadata", "decode"]
    assert meta2.tile_scheduler_metadata is not stored
    # a first call that fails records nothing (the next call computes the plan again)
    meta3 = vc.get_mla_metadata()[0]
    monkeypatch.setattr(vc.library, "sparse_decode",
                        lambda *a: (_ for _ in ()).throw(ValueError("attn_sink: no")))
    with pytest.raises(ValueError, match="^attn_sink"):
        _fm_decode(d, meta3)
    assert not meta3.have_initialized and meta3.tile_scheduler_metadata is None


def test_wrappers_preallocated_outputs_traced(fake):
    # Traced (fake tensors): the functional op runs and the result is copied into the given
    # buffers, which are what the wrappers return. CPU fake tensors: on a CPU-only torch
    # build, copy_ between CUDA fake tensors is refused.
    d = _decode_inputs(dev="cpu")
    out = _t((4, 1, 64, 512), BF16, "cpu")
    res = _fm_decode(d, vc.get_mla_metadata()[0], out=out)
    assert res[0] is out
    _meta_cpu = lambda t, shape, dt: t.shape == shape and t.dtype == dt  # noqa: E731
    assert _meta_cpu(res[1], (4, 64, 1), F32)

    p = _prefill_inputs(dev="cpu")
    out = _t((16, 64, 512), BF16, "cpu")
    res = vc.flash_mla_sparse_fwd(**p, out=out)
    assert res[0] is out and _meta_cpu(res[1], (16, 64), F32) and _meta_cpu(res[2], (16, 64), F32)

    args = _global_inputs(T=9, K=64, dev="cpu")
    bufs = (_t((9, 64), I32, "cpu"), _t((9,), I32, "cpu"))
    res = vc.compute_global_topk_indices_and_lens(*args, output_buffers=bufs)
    assert res[0] is bufs[0] and res[1] is bufs[1]

    args = _combine_inputs(Tc=7, K=64, topk=64, window=128, dev="cpu")
    bufs = [_t((7, 256), I32, "cpu"), _t((7,), I32, "cpu")]  # a list is accepted too
    res = vc.combine_topk_swa_indices(*args, out=bufs)
    assert res[0] is bufs[0] and res[1] is bufs[1]


def test_index_wrappers_fake(fake):
    topk_indices, t2r, table, bs, valid = _global_inputs(T=11, K=128)
    for v in (valid, None, _t((11,), I32)):  # None: every token valid; integers read as != 0
        g, lens = vc.compute_global_topk_indices_and_lens(topk_indices, t2r, table, bs, v)
        _meta(g, (11, 128), I32)
        _meta(lens, (11,), I32)
    args = list(_combine_inputs(Tc=13, K=512))
    for ti in (args[0], _t((13, 1, 512), I32)):  # vLLM flattens [Tc, 1, K]
        c, lens = vc.combine_topk_swa_indices(ti, *args[1:])
        _meta(c, (13, 640), I32)
        _meta(lens, (13,), I32)


def test_eager_out_path_goes_straight_to_the_front_end(monkeypatch):
    # Real (CPU) tensors and no tracing: a given `out` goes to dsv4_tl.ops with out=, so the
    # kernel writes it and nothing is copied. The front ends are replaced by recorders here.
    calls = []

    def recorder(name, result):
        def fn(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result(kwargs)
        return fn

    monkeypatch.setattr(vc.ops, "sparse_decode",
                        recorder("decode", lambda kw: (kw["out"], "lse")))
    monkeypatch.setattr(vc.library, "sparse_decode_metadata",
                        lambda *args: torch.zeros((0, 0), dtype=I32))
    monkeypatch.setattr(vc.ops, "sparse_prefill",
                        recorder("prefill", lambda kw: (kw["out"], "ml", "lse")))
    monkeypatch.setattr(vc.ops, "compute_global_topk_indices_and_lens",
                        recorder("global", lambda kw: (kw["out"], kw["lens"])))
    monkeypatch.setattr(vc.ops, "combine_topk_swa_indices",
                        recorder("combine", lambda kw: (kw["out"], kw["lens"])))
    d = _decode_inputs(dev="cpu")
    d = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in d.items()}
    d["attn_sink"] = torch.nn.Parameter(d["attn_sink"], requires_grad=False)  # vLLM: a weight
    out = torch.zeros((4, 1, 64, 512), dtype=BF16)
    meta = vc.get_mla_metadata()[0]
    res = _fm_decode(d, meta, out=out, softmax_scale=None)
    assert res == (out, "lse") and calls[-1][2]["out"] is out
    assert calls[-1][1][4] == 512 ** -0.5  # softmax_scale default: q.shape[-1] ** -0.5
    assert meta.have_initialized

    p = {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
         for k, v in _prefill_inputs(dev="cpu").items()}
    out = torch.zeros((16, 64, 512), dtype=BF16)
    assert vc.flash_mla_sparse_fwd(**p, out=out) == (out, "ml", "lse")

    args = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
            for a in _global_inputs(T=9, K=64, dev="cpu")]
    bufs = (torch.zeros((9, 64), dtype=I32), torch.zeros((9,), dtype=I32))
    res = vc.compute_global_topk_indices_and_lens(*args, output_buffers=bufs)
    assert res[0] is bufs[0] and res[1] is bufs[1]

    args = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
            for a in _combine_inputs(Tc=7, K=64, topk=64, window=128, dev="cpu")]
    bufs = (torch.zeros((7, 256), dtype=I32), torch.zeros((7,), dtype=I32))
    res = vc.combine_topk_swa_indices(*args, out=bufs)
    assert res[0] is bufs[0] and res[1] is bufs[1]
    assert [c[0] for c in calls] == ["decode", "prefill", "global", "combine"]


def test_eager_out_ok():
    plain = torch.zeros(2)
    assert vc._eager_out_ok(plain, None, 3, torch.nn.Parameter(torch.zeros(1)))
    with FakeTensorMode() as mode:
        assert not vc._eager_out_ok(plain)  # a dispatch mode is active
        f = mode.from_tensor(plain)
    assert not vc._eager_out_ok(plain, f)  # a FakeTensor among the arguments


# ---------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) traces the wrappers (Dynamo; the graph is only recorded)
# ---------------------------------------------------------------------------------------
class _Traced(Exception):
    pass


def test_compile_fullgraph_traces_wrappers():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Traced()  # no kernels on this machine: stop once the graph exists
        return run

    def step(d, meta, out, p, p_out, g_ws, g, gl_args, gl_bufs, cb_args, cb_bufs):
        o, lse = _fm_decode(d, meta, out=out, softmax_scale=None)
        o2, _ = _fm_decode(d, meta)  # a later layer: reads the metadata the first computed
        po, pml, plse = vc.flash_mla_sparse_fwd(**p, out=p_out)
        vc.dequantize_and_gather_k_cache(g_ws[:, 4:], g["k_cache"], g["seq_lens"], None,
                                         g["block_table"], 64, 2, use_fnuz=True)
        gi, gl = vc.compute_global_topk_indices_and_lens(*gl_args, output_buffers=gl_bufs)
        ci, cl = vc.combine_topk_swa_indices(*cb_args, out=cb_bufs)
        flat, indptr = torch.ops.dsv4_tl.combine_topk_swa_ragged_indices(*cb_args)
        # one query row per combined row (Tc = 7): the fake checks indptr against q
        r_out = torch.ops.dsv4_tl.sparse_prefill_ragged(p["q"][:7], p["kv"], flat, indptr,
                                                        SCALE)[0]
        gflat, gptr = torch.ops.dsv4_tl.compute_global_topk_ragged_indices_and_indptr(*gl_args)
        return o, lse, o2, po, pml, plse, gi, gl, ci, cl, r_out, gflat, gptr

    def real(x):
        return torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    d = {k: real(v) for k, v in _decode_inputs(dev="cpu").items()}
    p = {k: real(v) for k, v in _prefill_inputs(dev="cpu").items()}
    g = {k: real(v) for k, v in _gather_inputs(dev="cpu").items()}
    gl_args = [real(a) for a in _global_inputs(T=9, K=64, dev="cpu")]
    cb_args = [real(a) for a in _combine_inputs(Tc=7, K=64, topk=64, window=128, dev="cpu")]
    inputs = (d, vc.get_mla_metadata()[0], torch.zeros((4, 1, 64, 512), dtype=BF16), p,
              torch.zeros((16, 64, 512), dtype=BF16), torch.zeros((3, 104, 512), dtype=BF16), g,
              gl_args, (torch.zeros((9, 64), dtype=I32), torch.zeros((9,), dtype=I32)),
              cb_args, (torch.zeros((7, 256), dtype=I32), torch.zeros((7,), dtype=I32)))
    with pytest.raises(_Traced):
        torch.compile(step, fullgraph=True, backend=backend)(*inputs)
    assert len(graphs) == 1
    nodes = list(graphs[0].graph.nodes)
    by_op = {str(n.target).removesuffix(".default"): n for n in nodes
             if n.op == "call_function" and str(n.target).startswith("dsv4_tl.")}
    assert list(by_op) == [f"dsv4_tl.{name}" for name in (
        "sparse_decode_metadata", "sparse_decode", "sparse_prefill",
        "dequantize_and_gather_k_cache",
        "compute_global_topk_indices_and_lens", "combine_topk_swa_indices",
        "combine_topk_swa_ragged_indices", "sparse_prefill_ragged",
        "compute_global_topk_ragged_indices_and_indptr")]
    # preallocated outputs are filled by copy_ under tracing: decode out, prefill out, 2 + 2
    copies = [n for n in nodes if str(n.target).endswith("copy_")]
    assert len(copies) == 6
    assert by_op["dsv4_tl.sparse_decode"].args[4] == 512 ** -0.5  # softmax_scale default
    # the scheduler metadata: one node (the first call's), read by both decode calls
    plan = by_op["dsv4_tl.sparse_decode_metadata"]
    decodes = [n for n in nodes if str(n.target) == "dsv4_tl.sparse_decode.default"]
    assert len(decodes) == 2 and all(n.args[-1] is plan for n in decodes)
    assert sum(str(n.target).startswith("dsv4_tl.sparse_decode_metadata") for n in nodes) == 1
    assert by_op["dsv4_tl.dequantize_and_gather_k_cache"].args[7] == "e4m3fnuz"  # use_fnuz


# ---------------------------------------------------------------------------------------
# argument rejection (wrappers): exception type and the argument's name first
# ---------------------------------------------------------------------------------------
def test_flash_mla_with_kvcache_rejects(fake):
    d = _decode_inputs(b=4, s_q=1, h=64, extra=True)
    meta = vc.get_mla_metadata()[0]

    def call(**kw):
        return _fm_decode(d, kw.pop("meta", meta), **kw)

    _raises(TypeError, "tile_scheduler_metadata", lambda: call(meta=None))
    _raises(TypeError, "tile_scheduler_metadata", lambda: call(meta=object()))
    _raises(ValueError, "num_splits", lambda: call(num_splits=_t((5,), I32)))
    _raises(NotImplementedError, "indices", lambda: call(indices=None))
    _raises(ValueError, "block_table", lambda: call(block_table=_t((4, 8), I32)))
    _raises(ValueError, "cache_seqlens", lambda: call(cache_seqlens=_t((4,), I32)))
    _raises(ValueError, "causal", lambda: call(causal=True))
    _raises(ValueError, "is_fp8_kvcache", lambda: call(is_fp8_kvcache=False))
    _raises(ValueError, "head_dim_v", lambda: call(head_dim_v=576))
    _raises(ValueError, "extra_indices_in_kvcache", lambda: call(extra_indices_in_kvcache=None))
    _raises(ValueError, "extra_k_cache", lambda: call(extra_k_cache=None))
    _raises(ValueError, "extra_topk_length",
            lambda: call(extra_k_cache=None, extra_indices_in_kvcache=None))
    _raises(TypeError, "q", lambda: call(q=[1, 2]))
    _raises(ValueError, "q", lambda: call(q=_t((1, 64, 512), BF16)))
    _raises(ValueError, "k_cache", lambda: call(k_cache=_t((8, 64, 576), U8)))
    _raises(TypeError, "k_cache", lambda: call(k_cache=_t((8, 64, 584), BF16)))
    _raises(ValueError, "extra_k_cache", lambda: call(extra_k_cache=_t((64, 2, 2, 584), U8)))
    _raises(ValueError, "indices", lambda: call(indices=_t((4, 128), I32)))
    _raises(ValueError, "extra_indices_in_kvcache",
            lambda: call(extra_indices_in_kvcache=_t((4, 256), I32)))
    _raises(ValueError, "out", lambda: call(out=_t((4, 1, 64, 256), BF16)))
    _raises(TypeError, "out", lambda: call(out=_t((4, 1, 64, 512), F32)))
    _raises(ValueError, "out",
            lambda: call(out=_strided((4, 1, 64, 512), (512 * 64, 512 * 64, 1, 64), BF16)))
    _raises(TypeError, "out", lambda: call(out="out"))
    assert not meta.have_initialized  # nothing above got as far as the metadata


def test_flash_mla_with_kvcache_rejects_inconsistent_metadata(fake):
    d = _decode_inputs(b=4, s_q=1, h=64, extra=True)
    meta = vc.get_mla_metadata()[0]
    _fm_decode(d, meta)
    changes = {
        "b": dict(d, q=_t((3, 1, 64, 512), BF16)),
        "s_q": dict(d, q=_t((4, 2, 64, 512), BF16)),
        "h_q": dict(d, q=_t((4, 1, 128, 512), BF16)),
        "page_block_size": dict(d, k_cache=_t((8, 32, 1, 584), U8)),
        "topk": dict(d, indices=_t((4, 1, 256), I32)),
        "extra_page_block_size": dict(d, extra_k_cache=_t((64, 4, 1, 584), U8)),
        "extra_topk": dict(d, extra_indices_in_kvcache=_t((4, 1, 128), I32)),
    }
    for field, changed in changes.items():
        with pytest.raises(ValueError, match=rf"^tile_scheduler_metadata: .*\b{field} was "):
            _fm_decode(changed, meta)
    no_extra = {k: v for k, v in d.items() if not k.startswith("extra")}
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata: .*extra_page_block_size"):
        _fm_decode(no_extra, meta)
    _fm_decode(d, meta)  # the original shapes still pass


def test_flash_mla_sparse_fwd_rejects(fake):
    p = _prefill_inputs(s_q=16, h=64)
    _raises(ValueError, "d_v", lambda: vc.flash_mla_sparse_fwd(**p, d_v=576))
    _raises(ValueError, "d_v", lambda: vc.flash_mla_sparse_fwd(*list(p.values())[:4], 448))
    _raises(ValueError, "out", lambda: vc.flash_mla_sparse_fwd(**p, out=_t((16, 64, 576), BF16)))
    _raises(TypeError, "out", lambda: vc.flash_mla_sparse_fwd(**p, out=_t((16, 64, 512), F32)))
    _raises(ValueError, "out",
            lambda: vc.flash_mla_sparse_fwd(**p, out=_strided((16, 64, 512), (512, 16 * 512, 1),
                                                              BF16)))
    _raises(ValueError, "q", lambda: vc.flash_mla_sparse_fwd(
        **dict(p, q=_t((1, 16, 64, 512), BF16)), out=_t((16, 64, 512), BF16)))


def test_dequantize_and_gather_rejects(fake):
    g = _gather_inputs()
    _raises(TypeError, "use_fnuz", lambda: vc.dequantize_and_gather_k_cache(**g, use_fnuz=1))
    _raises(TypeError, "use_fnuz", lambda: vc.dequantize_and_gather_k_cache(**g, use_fnuz="fnuz"))
    assert vc.dequantize_and_gather_k_cache(**g) is None
    assert vc.dequantize_and_gather_k_cache(*g.values(), True) is None


def test_compute_global_topk_rejects(fake):
    ti, t2r, table, bs, valid = _global_inputs(T=9, K=64)
    good = (_t((9, 64), I32), _t((9,), I32))

    def call(*, topk_indices=ti, valid=valid, bufs=None):
        return vc.compute_global_topk_indices_and_lens(topk_indices, t2r, table, bs, valid,
                                                       output_buffers=bufs)

    _raises(TypeError, "topk_indices", lambda: call(topk_indices=[[1]]))
    _raises(ValueError, "topk_indices", lambda: call(topk_indices=_t((9, 1, 64), I32)))
    _raises(TypeError, "is_valid_token", lambda: call(valid=[True] * 9))
    _raises(TypeError, "output_buffers", lambda: call(bufs=good[0]))
    _raises(TypeError, "output_buffers", lambda: call(bufs=(*good, good[1])))
    _raises(TypeError, "output_buffers[0]", lambda: call(bufs=(None, good[1])))
    _raises(ValueError, "output_buffers[0]", lambda: call(bufs=(_t((9, 65), I32), good[1])))
    _raises(TypeError, "output_buffers[0]",
            lambda: call(bufs=(_t((9, 64), torch.int64), good[1])))
    _raises(ValueError, "output_buffers[0]",
            lambda: call(bufs=(_strided((9, 64), (1, 9), I32), good[1])))
    _raises(ValueError, "output_buffers[1]", lambda: call(bufs=(good[0], _t((10,), I32))))
    _raises(TypeError, "output_buffers[1]", lambda: call(bufs=(good[0], _t((9,), torch.bool))))
    _raises(ValueError, "output_buffers[1]",
            lambda: call(bufs=(good[0], _t((9,), I32, "cpu"))))


def test_combine_topk_swa_rejects(fake):
    args = _combine_inputs(Tc=7, K=64, topk=64, window=128)
    good = (_t((7, 256), I32), _t((7,), I32))

    def call(out, ti=args[0]):
        return vc.combine_topk_swa_indices(ti, *args[1:], out=out)

    _raises(TypeError, "topk_indices", lambda: call(None, ti=None))
    _raises(TypeError, "out", lambda: call(good[0]))
    _raises(TypeError, "out", lambda: call((good[0],)))
    _raises(ValueError, "out[0]", lambda: call((_t((7, 192), I32), good[1])))
    _raises(ValueError, "out[0]", lambda: call((_t((8, 256), I32), good[1])))
    _raises(TypeError, "out[0]", lambda: call((_t((7, 256), F32), good[1])))
    _raises(ValueError, "out[1]", lambda: call((good[0], _t((7, 1), I32))))
    _raises(TypeError, "out[1]", lambda: call((good[0], None)))



# ---------------------------------------------------------------------------------------
# issue 15 item 8: validation before bookkeeping, in the fakes, with b == 0, scales
# ---------------------------------------------------------------------------------------
def test_a_failed_call_does_not_pin_the_scheduler_metadata(fake):
    meta = vc.get_mla_metadata()[0]
    bad = _decode_inputs(b=4)
    bad["q"] = _t((4, 1, 64, 512), torch.float16)
    with pytest.raises(TypeError, match="^q: expected dtype torch.bfloat16"):
        _fm_decode(bad, meta)
    assert not meta.have_initialized
    out, lse = _fm_decode(_decode_inputs(b=2), meta)  # the corrected retry, other shapes
    _meta(out, (2, 1, 64, 512), BF16)
    assert meta.config.b == 2


@pytest.mark.parametrize("op", ["library", "wrapper"])
def test_fake_decode_validates_dtype_and_rank(fake, op):
    d = _decode_inputs()
    call = ((lambda **kw: torch.ops.dsv4_tl.sparse_decode(
        kw["q"], d["k_cache"], d["indices"], d["topk_length"], SCALE)) if op == "library"
        else (lambda **kw: _fm_decode({**d, **kw}, vc.get_mla_metadata()[0])))
    with pytest.raises(TypeError, match="^q: expected dtype torch.bfloat16, got torch.float16"):
        call(q=_t((4, 1, 64, 512), torch.float16))
    with pytest.raises(ValueError, match="^q: expected 4-D tensor"):
        call(q=_t((4, 64, 512), BF16))


def test_fake_ops_validate_like_the_real_ones(fake):
    p = _prefill_inputs()
    with pytest.raises(TypeError, match="^indices: expected dtype torch.int32"):
        torch.ops.dsv4_tl.sparse_prefill(p["q"], p["kv"], _t((16, 1, 640), torch.int64), SCALE)
    with pytest.raises(ValueError, match="^indptr: expected shape"):
        torch.ops.dsv4_tl.sparse_prefill_ragged(p["q"], p["kv"], _t((50,), I32), _t((9,), I32),
                                                SCALE)
    g = _gather_inputs()
    with pytest.raises(ValueError, match="^block_size: expected 64"):
        torch.ops.dsv4_tl.dequantize_and_gather_k_cache(*list(g.values())[:5], 32, 5)
    topk, t2r, table, bs, valid = _global_inputs()
    with pytest.raises(TypeError, match="^is_valid_token: expected dtype torch.bool"):
        torch.ops.dsv4_tl.compute_global_topk_indices_and_lens(topk, t2r, table, bs,
                                                               _t((37,), I32))
    args = list(_combine_inputs())
    args[6] = 600  # topk wider than topk_indices
    with pytest.raises(ValueError, match="^topk: expected <= topk_indices width"):
        torch.ops.dsv4_tl.combine_topk_swa_indices(*args)


def test_empty_batch_still_checks_the_extra_scope(fake):
    from dsv4_tl import ops

    d = _decode_inputs(b=0)
    with pytest.raises(TypeError, match="^extra_indices: expected dtype torch.int32"):
        ops.sparse_decode(d["q"], d["k_cache"], d["indices"], d["topk_length"], SCALE, None,
                          d["extra_k_cache"], _t((0, 1, 256), torch.int64))
    with pytest.raises(ValueError, match="^extra_topk_length: expected shape"):
        ops.sparse_decode(d["q"], d["k_cache"], d["indices"], d["topk_length"], SCALE, None,
                          d["extra_k_cache"], d["extra_indices_in_kvcache"], _t((3,), I32))
    out, lse = ops.sparse_decode(d["q"], d["k_cache"], d["indices"], d["topk_length"], SCALE,
                                 None, d["extra_k_cache"], d["extra_indices_in_kvcache"],
                                 d["extra_topk_length"])
    _meta(out, (0, 1, 64, 512), BF16)


def test_numpy_scales_are_real_numbers(fake):
    import numpy as np

    d = _decode_inputs()
    for scale in (np.float32(SCALE), np.float64(SCALE), 1):
        out, _ = _fm_decode(d, vc.get_mla_metadata()[0], softmax_scale=scale)
        _meta(out, (4, 1, 64, 512), BF16)
    res = vc.flash_mla_sparse_fwd(**{**_prefill_inputs(), "sm_scale": np.float32(SCALE)})
    _meta(res[0], (16, 64, 512), BF16)
    for bad, exc in ((True, TypeError), (np.bool_(True), TypeError), (float("nan"), ValueError),
                     (np.float32("nan"), ValueError), ("0.1", TypeError)):
        with pytest.raises(exc, match="^softmax_scale: "):
            _fm_decode(d, vc.get_mla_metadata()[0], softmax_scale=bad)


# ---------------------------------------------------------------------------------------
# issue 25 item 7: a typed cache states its FP8 flavour
# ---------------------------------------------------------------------------------------
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.mark.parametrize("typed,fmt", [(FNUZ, "e4m3fn"), (FN, "e4m3fnuz")])
def test_a_typed_cache_read_as_the_other_fp8_flavour_is_refused(fake, typed, fmt):
    """A float8_e4m3fnuz cache with fp8_format "e4m3fn" (and the reverse) was accepted and
    its bytes decoded as the other flavour: every op that reads or writes a cache refuses."""
    d = _decode_inputs(b=2, extra=True)
    cache = d["k_cache"].view(typed)
    message = f"fp8_format: k_cache is typed {typed}"
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.dsv4_tl.sparse_decode(d["q"], cache, d["indices"], d["topk_length"], SCALE,
                                        d["attn_sink"], d["extra_k_cache"],
                                        d["extra_indices_in_kvcache"], d["extra_topk_length"],
                                        fmt)
    with pytest.raises(ValueError, match=re.escape("fp8_format: extra_k_cache is typed")):
        torch.ops.dsv4_tl.sparse_decode(d["q"], d["k_cache"], d["indices"], None, SCALE, None,
                                        d["extra_k_cache"].view(typed),
                                        d["extra_indices_in_kvcache"], None, fmt)
    g = _gather_inputs()
    with pytest.raises(ValueError, match=re.escape(f"fp8_format: k_cache is typed {typed}")):
        torch.ops.dsv4_tl.dequantize_and_gather_k_cache(
            g["out"], g["k_cache"].view(typed), g["seq_lens"], g["gather_lens"],
            g["block_table"], 64, 5, fmt)
    with pytest.raises(ValueError, match=re.escape(f"fp8_format: k_cache is typed {typed}")):
        torch.ops.dsv4_tl.insert_k_cache(g["k_cache"].view(typed), _t((3, 512), BF16),
                                         _t((3,), torch.int64), fmt)
    with pytest.raises(ValueError, match="fp8_format: k_cache is typed"):
        vc.dequantize_and_gather_k_cache(g["out"], g["k_cache"].view(FNUZ), g["seq_lens"],
                                         g["gather_lens"], g["block_table"], 64, 5,
                                         use_fnuz=False)


def test_flash_mla_with_kvcache_reads_a_fnuz_typed_cache_as_fnuz(fake, monkeypatch):
    """vllm_compat.flash_mla_with_kvcache decoded every cache as OCP e4m3fn; the flavour
    now follows a typed cache (FlashMLA's uint8 / float8_e4m3fn caches stay OCP), and an
    extra cache typed as the other flavour is refused."""
    seen = []
    real = vc.library.sparse_decode
    monkeypatch.setattr(vc.library, "sparse_decode",
                        lambda *args: seen.append(args[9]) or real(*args))
    d = _decode_inputs(b=2, extra=True)
    for typed, want in ((FNUZ, "e4m3fnuz"), (FN, "e4m3fn"), (U8, "e4m3fn")):
        meta, _ = vc.get_mla_metadata()
        _fm_decode(dict(d, k_cache=d["k_cache"].view(typed),
                        extra_k_cache=d["extra_k_cache"].view(typed)), meta)
        assert seen[-1] == want
    meta, _ = vc.get_mla_metadata()
    with pytest.raises(ValueError, match="fp8_format: extra_k_cache is typed"):
        _fm_decode(dict(d, k_cache=d["k_cache"].view(FNUZ),
                        extra_k_cache=d["extra_k_cache"].view(FN)), meta)
