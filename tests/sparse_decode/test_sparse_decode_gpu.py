"""GPU tests of sparse FP8 decode against the float32 reference.

Fresh random inputs every run (the seed is printed on failure), outputs poisoned with NaN
before every call. Tolerances: out is bf16 and P is rounded to bf16 before PV, as in
FlashMLA, so |err| <= out_abs_tol(max |k|) + 2/128·|ref| elementwise (the rounding bound of
bf16 weights, see dsv4_tl.testing.out_abs_tol; 2/128 = two bf16 ulps of the output) and a
relative Frobenius error <= 1e-2; lse only sees fp32 accumulation of exact bf16 products, so
|err| <= 1e-3 + 2^-13·|ref|.
"""

import math

import pytest
import torch

from cases import (SCALE, WINDOW, check_decode, compressed_scope, decode_case, decode_scope,
                   lengths, make_sink)

from dsv4_tl.cache_format import cache_geometry
from dsv4_tl.ops import sparse_decode
from dsv4_tl.reference import sparse_decode_ref
from dsv4_tl.testing import cache_kmax, check_attention, poison_past_length, random_paged_cache

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"
# Cases whose inputs and float32 reference peak above ~4 GiB of the card (rows x index width:
# ~4.4 GiB at 128 rows of 1152 entries, ~7.9 GiB at 256 rows of 1152; run 51's gpu_mem.jsonl,
# the others estimated from those rows x widths): they run in scripts/device_gpu_tests.sh's
# second pass, on shares of at least 12 GiB (tests/conftest.py). Their variants are the ones
# lighter cases of the same test compile, so that pass finds them built.
HEAVY = pytest.mark.gpu_heavy
# Cases that force a schedule no shipped variant uses on any target (a knob value the tuner may
# pick: it checks every candidate against the reference before logging it), beyond one or two
# kept per test: each compiles its own variant, about half of the suite's compiles from a cold
# cache. scripts/device_gpu_tests.sh runs them with GPU_TEST_KNOBS=1 (tests/conftest.py).
KNOB = pytest.mark.gpu_knobs


def knob(*values, marks=()):
    """A parametrize case of the knob tier (``KNOB``)."""
    return pytest.param(*values, marks=[KNOB, *marks])


def _forcing_sm90a(op: str, config: dict):
    """``config`` forced for every shape of ``op`` on cuda:sm_90a (a context manager)."""
    from dsv4_tl.targets import parse_target
    from dsv4_tl.tune import forcing

    return forcing(parse_target("cuda:sm_90a"), op, config)


def _window_step(b, h, gen):
    """q [b, 1, h, 512] bf16 and the window scope (cache, indices [b, 1, 128]) of a decode
    step."""
    q = torch.randn((b, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    return (q, *decode_scope(b, 1, WINDOW, 64, 3, gen))


def _case(b, s_q, h, extra_kind, gen, *, sink="mixed", fp8_format="e4m3fn"):
    q, main, extra, sink_t = decode_case(b, s_q, h, extra_kind, gen, sink_kind=sink,
                                         fp8_format=fp8_format)
    check_decode(q, main, extra, sink_t, fp8_format)


@pytest.mark.parametrize(
    "h,b,extra_kind",
    [
        (64, 1, "c4a512"),
        (128, 1, "c4a1024"),
        (64, 7, "c4a512"),
        (128, 7, "c128a256"),
        (128, 64, "c4a1024"),
        (64, 64, "c128a128"),
        pytest.param(128, 128, "c4a1024", marks=HEAVY),
        (64, 128, "c4a512"),
        (128, 64, "swa"),
        (64, 7, "swa"),
        (16, 7, "c4a512"),
        (32, 64, "c128a256"),
        (96, 7, "c4a512"),
        (8, 7, "c128a128"),
        # the tokens-in-M buckets of few rows (split, merged split-major by the combine)
        (16, 1, "swa"),
        (16, 8, "c128a256"),
        (32, 1, "c4a512"),
        (32, 8, "c128a128"),
        (32, 16, "swa"),
        (16, 16, "c4a512"),
        # h16 at b >= 67: config D (2 CTAs per SM), C128A with 2 splits (run 61)
        (16, 80, "c4a512"),
        (16, 96, "c128a256"),
        # tokens in M routed by runs 75-77: h8 everywhere (8 heads in wgmma N), h32 at
        # b >= 67, and the persistent grid at h8 C4A / h16 / h32 SWA and C4A b34-66
        (8, 3, "swa"),
        (8, 12, "c4a512"),
        (8, 50, "swa"),
        (8, 40, "c4a512"),
        (8, 64, "c128a1024"),
        (8, 100, "c4a512"),
        (8, 70, "c128a256"),
        (16, 64, "swa"),
        (16, 45, "c4a512"),
        (32, 60, "swa"),
        (32, 37, "c4a512"),
        (32, 130, "swa"),
        (32, 90, "c128a1024"),
        # C128A at long context (index width >= 4096): the persistent grid, item balance at
        # <= 16 CTAs, tile balance with one Q stage above (item 53)
        (64, 2, "c128a4096"),
        pytest.param(64, 20, "c128a8192", marks=HEAVY),
        (128, 3, "c128a4096"),
        (128, 24, "c128a4096"),
        # split counts by tile pairs below 15 CTAs (item 87): 10 splits at h64 C4A 512
        # (the (64, 1) / (64, 7) cases above), 9 at widths 513-1024
        (64, 8, "c128a1024"),
        (64, 1, "c4a1024"),
        (128, 4, "c128a1024"),
        (32, 8, "c128a1024"),
    ],
    ids=lambda v: str(v),
)
def test_decode_matches_reference(h, b, extra_kind, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    _case(b, 1, h, extra_kind, gen)


@pytest.mark.parametrize("sink", ["none", "-inf", "+inf", "finite"])
def test_decode_sink(sink, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    _case(7, 1, 64, "c4a512", gen, sink=sink)


def test_decode_mtp_rows(seed):
    """s_q = 2 (MTP): rows of one request share topk_length but have their own indices."""
    gen = torch.Generator(DEV).manual_seed(seed)
    _case(5, 2, 128, "c4a1024", gen)


def test_decode_all_rows_lonely(seed):
    """Every length 0: out must be exactly 0 and lse +inf, whatever the indices hold."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b, h = 4, 64
    q, k_cache, idx = _window_step(b, h, gen)
    lens = torch.zeros(b, dtype=torch.int32, device=DEV)
    poison_past_length(idx, lens, gen)
    check_decode(q, (k_cache, idx, lens), (None, None, None), make_sink(h, gen))


def test_decode_all_invalid_holes(seed):
    """Lengths cover the row but every entry is -1: a lonely row again."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b, h = 3, 128
    q, k_cache, idx = _window_step(b, h, gen)
    idx.fill_(-1)
    lens = torch.full((b,), WINDOW, dtype=torch.int32, device=DEV)
    check_decode(q, (k_cache, idx, lens), (None, None, None), make_sink(h, gen))


def test_decode_out_of_range_slots_ignored(seed):
    """Slots past the cache (and negative ones other than -1) inside topk_length are skipped."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b, h = 4, 64
    q, k_cache, idx = _window_step(b, h, gen)
    _garbage_slots(idx, k_cache, gen)
    lens = torch.full((b,), WINDOW, dtype=torch.int32, device=DEV)
    check_decode(q, (k_cache, idx, lens), (None, None, None), make_sink(h, gen))


def test_decode_fnuz_cache(seed):
    """FNUZ bytes (gfx942 writers) decoded by the FNUZ path of the kernel."""
    gen = torch.Generator(DEV).manual_seed(seed)
    _case(7, 1, 64, "c4a512", gen, fp8_format="e4m3fnuz")


def test_decode_flashmla_4d_cache_view(seed):
    """FlashMLA's [num_blocks, bs, 1, 584] view of the same bytes gives the same result."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b, h = 3, 64
    q, k_cache, idx = _window_step(b, h, gen)
    lens = lengths(b, WINDOW, gen)
    out3, lse3 = sparse_decode(q, k_cache, idx, lens, SCALE)
    out4, lse4 = sparse_decode(q, k_cache.unsqueeze(2), idx, lens, SCALE)
    assert torch.equal(out3, out4) and torch.equal(lse3, lse4)


def test_decode_empty_batch():
    q = torch.empty((0, 1, 64, 512), dtype=torch.bfloat16, device=DEV)
    k_cache = random_paged_cache(2, 64, torch.Generator(DEV).manual_seed(0), DEV)
    idx = torch.empty((0, 1, 128), dtype=torch.int32, device=DEV)
    out, lse = sparse_decode(q, k_cache, idx, None, SCALE)
    assert out.shape == (0, 1, 64, 512) and lse.shape == (0, 64, 1)


# (window length, compressed length) pairs whose tile counts put a split's padding tile (the
# one that evens out a split of an odd tile count) inside or right after the window range,
# splits that start on odd window tiles, splits that cross window -> compressed, and empty
# splits (bisected in bench/PERF_NOTES.md item 14).
SPLIT_EDGE_LENGTHS = [(128, 512), (128, 480), (96, 512), (64, 512), (32, 512), (128, 64),
                      (128, 0), (64, 0), (32, 0), (127, 64), (97, 1), (1, 33)]


def _poison_block0(cache, idx):
    """Move block 0's tokens to an unused block, then fill block 0's slot 0 with NaN RoPE
    and 0xFF bytes (scale byte 255 too). The kernels read that slot in place of every invalid
    token and must discard it; the reference never reads it, so a kernel that lets those
    bytes through produces NaN."""
    bs = cache.shape[1]
    used = set((idx[idx >= 0] // bs).tolist())
    spare = next(blk for blk in range(1, cache.shape[0]) if blk not in used)
    cache[spare] = cache[0]
    idx = torch.where((idx >= 0) & (idx // bs == 0), idx + spare * bs, idx)
    cache[0, 0] = 0xFF  # record bytes of token 0 (NoPE 0xFF, RoPE bf16 0xFFFF = NaN)
    cache_geometry(cache).flat[bs * 576: bs * 576 + 8] = 0xFF  # token 0's scale bytes
    return cache, idx


def _split_edge_cases(h: int, gen) -> None:
    """One request of ``h`` heads over ``SPLIT_EDGE_LENGTHS`` against the reference, block 0's
    slot 0 poisoned in both caches, under whatever schedule the caller forces."""
    q = torch.randn((1, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    k_cache, idx = _poison_block0(*decode_scope(1, 1, WINDOW, 64, 3, gen))
    e_cache, e_idx = _poison_block0(*decode_scope(1, 1, 544, 64, 544 // 64 + 2, gen))
    for main_len, extra_len in SPLIT_EDGE_LENGTHS:
        lens = torch.tensor([main_len], dtype=torch.int32, device=DEV)
        e_lens = torch.tensor([extra_len], dtype=torch.int32, device=DEV)
        check_decode(q, (k_cache, idx, lens), (e_cache, e_idx, e_lens), make_sink(h, gen))


def _garbage_slots(idx, k_cache, gen) -> None:
    """Slots past the cache and negatives other than -1 in about a fifth of ``idx`` (in
    place): entries the kernels must skip."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = torch.rand(idx.shape, generator=gen, device=DEV) < 0.2
    garbage = torch.tensor([num_slots, num_slots + 63, 2**31 - 1, -2, -(2**31)],
                           dtype=torch.int32, device=DEV)
    pick = torch.randint(0, len(garbage), idx.shape, generator=gen, device=DEV)
    idx[bad] = garbage[pick][bad]


def _block_size_case(gen) -> None:
    """Block size 1 (the division magic's special case) in the window scope and 7 (not a
    power of two) in the compressed scope, garbage slots past each cache, five h64 rows,
    against the reference under whatever schedule the caller forces."""
    b, h = 5, 64
    q = torch.randn((b, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    k_cache, idx = decode_scope(b, 1, WINDOW, 1, WINDOW + 8, gen)
    e_cache, e_idx = decode_scope(b, 1, 512, 7, 512 // 7 + 2, gen)
    lens, e_lens = lengths(b, WINDOW, gen), lengths(b, 512, gen)
    _garbage_slots(idx, k_cache, gen)
    _garbage_slots(e_idx, e_cache, gen)
    check_decode(q, (k_cache, idx, lens), (e_cache, e_idx, e_lens), make_sink(h, gen))


def _edge_input_case(case, gen, h_case, kind, *, poison_block0):
    """One edge-input case of a forced schedule: "sinks" (the four sink kinds) and "fnuz"
    (FNUZ bytes) on ``h_case`` heads with the ``kind`` scope; "lonely" (every length 0: out
    0, lse +inf), "holes" (every entry -1) and "out_of_range" (``_garbage_slots``) on window
    steps at h128, block 0 poisoned when ``poison_block0``."""
    if case == "sinks":
        for sink in ("none", "-inf", "+inf", "finite"):
            _case(7, 1, h_case, kind, gen, sink=sink)
        return
    if case == "fnuz":
        _case(7, 1, h_case, kind, gen, fp8_format="e4m3fnuz")
        return
    b, h = 4, 128
    q, k_cache, idx = _window_step(b, h, gen)
    if poison_block0:
        k_cache, idx = _poison_block0(k_cache, idx)
    lens = torch.full((b,), WINDOW, dtype=torch.int32, device=DEV)
    if case == "lonely":
        lens.zero_()
        poison_past_length(idx, lens, gen)
    elif case == "holes":
        idx.fill_(-1)
    else:
        _garbage_slots(idx, k_cache, gen)
    check_decode(q, (k_cache, idx, lens), (None, None, None), make_sink(h, gen))


@pytest.mark.parametrize("block_tokens", [32, knob(64)])
@pytest.mark.parametrize("num_splits", [4, 8])
def test_decode_warp_specialized_split_edges(block_tokens, num_splits, seed):
    """The warp-specialised schedule forced, at every split count and tile size, on one
    request whose lengths sweep the split-boundary cases."""
    from dsv4_tl.targets import parse_target
    from dsv4_tl.tune import forcing

    gen = torch.Generator(DEV).manual_seed(seed)
    config = {"block_tokens": block_tokens, "heads_per_block": 64, "threads": 384,
              "warp_specialized": True, "num_splits": num_splits}
    with forcing(parse_target("cuda:sm_90a"), "sparse_decode", config):
        _split_edge_cases(64, gen)


def test_decode_split_scratch_streams_and_graphs(seed):
    """Split-KV decode (8 splits at these few rows on sm_90a) with its partials in the
    stream scratch shared by plans: two plans interleaved on one stream, a second stream
    (its own buffer) and a captured CUDA graph (its own partials, none pooled) all give the
    first call's bits."""
    from dsv4_tl.ops._dispatch import stream_scratch

    def pooled_buffers():
        return {key[1]: pool[0].data_ptr() for key, pool in stream_scratch.pools.items()}

    gen = torch.Generator(DEV).manual_seed(seed)
    cases = [decode_case(b, 1, 64, "c4a512", gen) for b in (2, 3)]

    def run(case):
        q, (k, i, n), (ek, ei, en), sink = case
        return sparse_decode(q, k, i, n, SCALE, sink, ek, ei, en)

    check_decode(*cases[0])
    check_decode(*cases[1])
    first = [run(c) for c in cases]
    again = [run(cases[0]), run(cases[1]), run(cases[0])]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run(cases[1])
        before_capture = pooled_buffers()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = run(cases[0])
    torch.cuda.current_stream().wait_stream(side)
    main_stream = torch.cuda.current_stream().cuda_stream
    assert before_capture[side.cuda_stream] != before_capture[main_stream]
    assert pooled_buffers() == before_capture
    for got in captured:
        got.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for (got_out, got_lse), (out, lse) in zip(again + [on_side, captured],
                                             [first[0], first[1], first[0], first[1], first[0]]):
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse)


def test_decode_zero_block_cache_refused():
    """The kernels read block 0 in place of invalid tokens, so an empty cache is an error."""
    from dsv4_tl.cache_format import alloc_k_cache

    q = torch.zeros((1, 1, 64, 512), dtype=torch.bfloat16, device=DEV)
    idx = torch.full((1, 1, 128), -1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="extra_k_cache: expected at least one block"):
        sparse_decode(q, alloc_k_cache(1, 64, device=DEV), idx, None, SCALE, None,
                      alloc_k_cache(0, 64, device=DEV), idx, torch.zeros(1, dtype=torch.int32,
                                                                         device=DEV))


def _decode_rows(q, main, extra, sink, rows, *, batch_invariant=True):
    """(out, lse) of ``rows`` of the batch run as a batch of their own, outputs poisoned."""
    (k_cache, idx, lens), (e_cache, e_idx, e_lens) = main, extra
    rows = torch.tensor(rows, device=DEV)
    b, h = len(rows), q.shape[2]
    out = torch.full((b, 1, h, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((b, h, 1), math.nan, dtype=torch.float32, device=DEV)
    extra = (None, None, None) if e_cache is None else (e_cache, e_idx[rows], e_lens[rows])
    sparse_decode(q[rows], k_cache, idx[rows], lens[rows], SCALE, sink, *extra,
                  batch_invariant=batch_invariant, out=out, lse=lse)
    return out, lse


@pytest.mark.parametrize("h,extra_kind", [pytest.param(64, "c4a512", marks=HEAVY),
                                          pytest.param(128, "c128a1024", marks=HEAVY),
                                          (8, "swa"), (16, "swa"), (32, "swa"), (64, "swa"),
                                          (128, "swa")])
def test_decode_batch_invariant(h, extra_kind, seed):
    """batch_invariant=True: a row's out and lse are bitwise identical alone, in a batch of
    8 at another position and in a batch of 256 (varying lengths, so the default mode would
    pick different split counts: 8 splits at b <= 16, 1 at b 256 on sm_90a). SWA-only
    (``swa``): the invariant call's one-split schedule at every batch size."""
    _check_batch_invariant(h, extra_kind, seed)


def _check_batch_invariant(h, extra_kind, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    b = 256
    q, k_cache, idx = _window_step(b, h, gen)
    lens = lengths(b, WINDOW, gen)
    if extra_kind == "swa":
        e_cache = e_idx = e_lens = None
    else:
        e_cache, e_idx, width = compressed_scope(b, 1, extra_kind, gen)
        e_lens = lengths(b, width, gen, full_rows=4)
    main, extra, sink = (k_cache, idx, lens), (e_cache, e_idx, e_lens), make_sink(h, gen)

    full_out, full_lse = _decode_rows(q, main, extra, sink, list(range(b)))
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_ref(q, k_cache, idx, lens, SCALE, sink, e_cache, e_idx,
                                         e_lens)
    check_attention(cache_kmax(k_cache), full_out, ref_out, lse=(full_lse, ref_lse))

    def bits(x):
        return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

    others = torch.randperm(b, generator=gen, device=DEV).tolist()
    for r in (0, 3, 130, 255):
        alone = _decode_rows(q, main, extra, sink, [r])
        mates = [o for o in others if o != r][:7]
        batch8 = _decode_rows(q, main, extra, sink, mates[:5] + [r] + mates[5:])
        for got, pos in ((alone, 0), (batch8, 5)):
            assert torch.equal(bits(got[0][pos]), bits(full_out[r])), f"row {r}: out differs"
            assert torch.equal(bits(got[1][pos]), bits(full_lse[r])), f"row {r}: lse differs"


# ----------------------------------------------------------------------------- persistent grid
# The warp-specialised schedule on the persistent grid (tile_kernels/sparse_mla/work.py), forced for every
# shape; ``over`` changes knobs of it (split sizes small enough to split the test's rows).
PERSISTENT = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
              "warp_specialized": True, "persistent": True, "item_cost": 3,
              "tiles_per_split_min": 4, "invariant_tiles_per_split": 16}


def _persistent(**over):
    return _forcing_sm90a("sparse_decode", {**PERSISTENT, **over})


@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,over",
    [
        (64, 1, 1, "c4a512", {}),
        (128, 1, 1, "c4a1024", {}),
        (128, 7, 1, "c128a256", {}),
        (64, 64, 1, "c128a128", {}),
        pytest.param(128, 128, 1, "c4a1024", {}, marks=HEAVY),
        (64, 128, 1, "c4a512", {}),
        (128, 64, 1, "swa", {}),
        (64, 7, 1, "swa", {}),
        (128, 37, 3, "c4a1024", {}),
        pytest.param(64, 150, 2, "c128a1024", {}, marks=HEAVY),
        (128, 16, 1, "c128a8192", {}),
        knob(96, 7, 1, "c4a512", {}),
        (16, 7, 1, "c4a512", {}),
        knob(64, 7, 1, "c4a512", {"block_tokens": 64}),
        knob(128, 9, 2, "c128a1024", {"block_tokens": 64, "tiles_per_split_min": 3}),
    ],
    ids=lambda v: str(v),
)
def test_decode_persistent_matches_reference(h, b, s_q, extra_kind, over, seed):
    """Rows of one split stored directly, split rows merged by the combine, CTAs walking
    several items (barrier phases carried across them), holes, garbage past the lengths and
    a lonely last request; padded head counts (96, 16) keep the fixed grid."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _persistent(**over):
        check_decode(*decode_case(b, s_q, h, extra_kind, gen))


@pytest.mark.parametrize("block_tokens", [32, 64])
@pytest.mark.parametrize("tiles_per_split", [1, 3])
def test_decode_persistent_split_edges(block_tokens, tiles_per_split, seed):
    """Splits of 1 and 3 tiles (odd: a padding tile per split) over the split-boundary
    lengths of the fixed grid's test (empty scopes, window-to-compressed crossings)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _persistent(block_tokens=block_tokens, tiles_per_split_min=tiles_per_split):
        _split_edge_cases(64, gen)


def _rows_of(q, main, extra, sink, rows, batch_invariant):
    """(out, lse) of ``rows`` of the batch run as a batch of their own, outputs poisoned."""
    (k_cache, idx, lens), (e_cache, e_idx, e_lens) = main, extra
    rows = torch.tensor(rows, device=DEV)
    b, s_q, h = len(rows), q.shape[1], q.shape[2]
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=DEV)
    sparse_decode(q[rows], k_cache, idx[rows], lens[rows], SCALE, sink, e_cache,
                  None if e_idx is None else e_idx[rows], None if e_lens is None else e_lens[rows],
                  batch_invariant=batch_invariant, out=out, lse=lse)
    return out, lse


# (h64 b96 C128A 4096: ~400K cache rows quantised in float32, over a 12-worker share of an H100:
# run 80 ran out of memory there, alone it passes -- the whole card)
@pytest.mark.parametrize("h,b,s_q,extra_kind", [
    pytest.param(64, 256, 1, "c4a512", marks=HEAVY),
    pytest.param(128, 256, 1, "c128a1024", marks=HEAVY),
    pytest.param(64, 96, 2, "c128a4096", marks=HEAVY), (128, 256, 1, "swa")])
def test_decode_persistent_batch_invariant(h, b, s_q, extra_kind, seed):
    """batch_invariant=True on the persistent grid: a row's out and lse are bitwise identical
    alone, at other positions of batches of 8 and 37 and in the whole batch (per-row lengths
    anywhere in 0..width, empty rows, -1 holes; the default mode would split rows by the
    batch's work)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    main[2][5] = 0  # an empty window (request 255 is empty in both scopes)
    if extra[2] is not None:
        extra[2][6] = 0
    with _persistent():
        full_out, full_lse = _rows_of(q, main, extra, sink, list(range(b)), True)
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
        check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                        full_out, ref_out, lse=(full_lse, ref_lse))

        def bits(x):
            return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

        others = torch.randperm(b, generator=gen, device=DEV).tolist()
        for r in (0, 5, 6, b // 2 + 2, b - 1):
            mates = [o for o in others if o != r]
            alone = _rows_of(q, main, extra, sink, [r], True)
            batch8 = _rows_of(q, main, extra, sink, mates[:5] + [r] + mates[5:7], True)
            batch37 = _rows_of(q, main, extra, sink, mates[:30] + [r] + mates[30:36], True)
            for got, pos in ((alone, 0), (batch8, 5), (batch37, 30)):
                assert torch.equal(bits(got[0][pos]), bits(full_out[r])), f"row {r}: out differs"
                assert torch.equal(bits(got[1][pos]), bits(full_lse[r])), f"row {r}: lse differs"


@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,batch_invariant,over",
    [
        # whole rows (more units than half the SMs), 2-3 items per CTA, runs of empty rows
        pytest.param(64, 300, 1, "c4a512", False, {}, marks=HEAVY),
        (128, 70, 1, "swa", False, {}),
        # one tile per item: ~5 items per CTA, Q stages reloaded every tile pair
        (128, 5, 2, "c4a1024", True, {"invariant_tiles_per_split": 1}),
        (64, 40, 1, "c128a256", True, {"invariant_tiles_per_split": 1}),
        # 64-token tiles: one Q stage, reloaded per item by the producer
        (64, 40, 1, "c4a512", True, {"block_tokens": 64, "invariant_tiles_per_split": 1}),
    ],
    ids=lambda v: str(v),
)
def test_decode_persistent_q_stages(h, b, s_q, extra_kind, batch_invariant, over, seed):
    """The persistent grid's Q stages (the producer loads item n+1's Q while the consumers
    finish item n; 32-token tiles: two stages, 64-token: one), across many items per CTA,
    with empty rows alone and in runs (items without tiles: the consumers meet first) and
    rows split into one-tile items; outputs poisoned, checked against the reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    empty = [r for r in range(b) if r % 7 in (2, 3) or r % 11 == 5]  # alone and in runs
    main[2][empty] = 0
    if extra[2] is not None:
        extra[2][empty] = 0
    with _persistent(**over):
        out, lse = _rows_of(q, main, extra, sink, list(range(b)), batch_invariant)
        torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                    out, ref_out, lse=(lse, ref_lse))


def _check_persistent_case(h, b, s_q, extra_kind, uniform, seed, **knobs):
    """A persistent-grid case of the tests below: per-row lengths with holes and a lonely last
    row, or with ``uniform`` every row full (rows kept whole); the persistent schedule with
    ``knobs`` forced; outputs poisoned, checked against the float32 reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen, lonely_row=not uniform)
    if uniform:
        main[2].fill_(WINDOW)
        if extra[2] is not None:
            extra[2].fill_(extra[1].shape[-1])
    with _persistent(**knobs):
        check_decode(q, main, extra, sink)


# The persistent grid with the tile-granular balance (``balance="tiles"``, work.cta_tile_range):
# rows cut at tile boundaries where the CTAs' exact shares end, a row's pieces run once per head
# group; rows alone (uniform lengths) kept whole.
@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,uniform,tps_min",
    [
        (64, 2, 1, "c128a8192", False, 4),
        pytest.param(64, 32, 1, "c128a8192", False, 4, marks=HEAVY),
        (128, 2, 1, "c128a8192", False, 4),
        pytest.param(128, 32, 1, "c128a8192", False, 4, marks=HEAVY),
        # (peaks at more than a ~8.3 GiB worker share: 15 workers on an H200, run 85)
        pytest.param(64, 128, 1, "c128a4096", False, 4, marks=HEAVY),
        (128, 7, 2, "c128a4096", False, 4),
        (128, 1, 1, "c128a4096", False, 4),
        (64, 1, 1, "c4a1024", False, 1),
        (128, 9, 2, "c128a1024", False, 3),
        (64, 128, 1, "c4a1024", True, 4),
        pytest.param(128, 128, 1, "c4a1024", True, 4, marks=HEAVY),
    ],
    ids=lambda v: str(v),
)
def test_decode_persistent_tile_balance(h, b, s_q, extra_kind, uniform, tps_min, seed):
    """C128A-like per-row lengths anywhere in 0..width (the first row full, a lonely last
    row, holes, garbage past the lengths) at b1 / b2 / b32, h64 / h128 (b1 h128: fewer rows
    than head groups, each piece still run by both), MTP (s_q 2), pieces of 1
    and 3 tiles (odd: a padding tile), and uniform lengths (rows kept whole, no combine);
    outputs poisoned, checked against the float32 reference. (Until its plan stopped storing
    its boundaries inside the owner thread's loop, no call of this kernel returned: runs 63
    and 65, bench/PERF_NOTES.md item 48.)"""
    _check_persistent_case(h, b, s_q, extra_kind, uniform, seed, balance="tiles",
                           tiles_per_split_min=tps_min)


# The lean FP8 producer on the 64-head persistent grid (bench/PERF_NOTES.md item 52), both
# balances, h64 and h128 (the item walk of two head groups: one Q stage), C4A / C128A scopes
# (four compiled variants): per-row lengths with holes and a lonely last row, rows split into
# pieces of 1 and 3 tiles (padding tiles produced all-invalid), MTP, uniform rows kept whole.
@pytest.mark.parametrize("balance", ["items", "tiles"])
@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,uniform,tps_min",
    [
        pytest.param(64, 32, 1, "c128a8192", False, 4, marks=HEAVY),
        (128, 7, 2, "c128a4096", False, 3),
        (64, 9, 2, "c128a1024", False, 1),
        (128, 1, 1, "c4a1024", False, 1),
        (64, 128, 1, "c4a1024", True, 4),
        pytest.param(128, 128, 1, "c4a1024", True, 4, marks=HEAVY),
    ],
    ids=lambda v: str(v),
)
def test_decode_persistent_lean(h, b, s_q, extra_kind, uniform, tps_min, balance, seed):
    """``producer_lean`` on the persistent grid: outputs poisoned (check_decode), checked
    against the float32 reference."""
    # (the item balance is the schedule's default: named, it would key another variant than
    # the A/B's, which scripts/device_persistent_lean.sh precompiled; at commit 7dfd2b4)
    over = {"balance": "tiles"} if balance == "tiles" else {}
    _check_persistent_case(h, b, s_q, extra_kind, uniform, seed, tiles_per_split_min=tps_min,
                           producer_lean=True, **over)


@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,uniform,tps_min",
    [
        (64, 128, 1, "c4a1024", True, 4),
        pytest.param(64, 32, 1, "c128a8192", False, 4, marks=HEAVY),
        (64, 9, 2, "c128a1024", False, 1),
        (128, 7, 2, "c128a4096", False, 3),
        pytest.param(128, 128, 1, "c4a1024", True, 4, marks=HEAVY),
    ],
    ids=lambda v: str(v),
)
def test_decode_persistent_lean_one_q_stage(h, b, s_q, extra_kind, uniform, tps_min, seed):
    """The tile balance with the lean producer and one Q stage (``q_stages`` 1: warpgroup 0
    loads each item's Q once both consumers met; item 52): whole rows, per-row lengths, pieces
    of 1 and 3 tiles (many items per CTA: the meeting before each), MTP; outputs poisoned,
    checked against the float32 reference."""
    _check_persistent_case(h, b, s_q, extra_kind, uniform, seed, balance="tiles",
                           tiles_per_split_min=tps_min, producer_lean=True, q_stages=1)


def test_decode_persistent_lean_batch_invariant(seed):
    """batch_invariant=True on the persistent grid with the lean producer (fixed splits of 1
    tile: many items per CTA): a row alone, in a batch of 8 and in the whole batch bitwise
    equal, and right."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(40, 1, 128, "c128a1024", gen)
    with _persistent(producer_lean=True, invariant_tiles_per_split=1):
        full_out, full_lse = _rows_of(q, main, extra, sink, list(range(40)), True)
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
        check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                        full_out, ref_out, lse=(full_lse, ref_lse))

        def bits(x):
            return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

        for r in (0, 17, 39):
            mates = [o for o in range(40) if o != r][:7]
            for rows, pos in (([r], 0), (mates[:5] + [r] + mates[5:], 5)):
                got = _rows_of(q, main, extra, sink, rows, True)
                assert torch.equal(bits(got[0][pos]), bits(full_out[r])), f"row {r}: out differs"
                assert torch.equal(bits(got[1][pos]), bits(full_lse[r])), f"row {r}: lse differs"


@HEAVY  # (40 rows of 4224 entries)
def test_decode_persistent_tile_balance_keeps_batch_invariance(seed):
    """batch_invariant=True with the tile balance in the schedule runs the item balance (a
    fixed split size): a row alone and in the batch bitwise equal."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(40, 1, 64, "c128a4096", gen)
    with _persistent(balance="tiles"):
        full_out, full_lse = _rows_of(q, main, extra, sink, list(range(40)), True)
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
        check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                        full_out, ref_out, lse=(full_lse, ref_lse))
        for r in (0, 17):
            alone = _rows_of(q, main, extra, sink, [r], True)
            for got, want in ((alone[0][0], full_out[r]), (alone[1][0], full_lse[r])):
                assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16
                                            else torch.int32),
                                   want.view(torch.int16 if want.dtype == torch.bfloat16
                                             else torch.int32)), f"row {r} differs"


# The tokens-in-M schedule (heads in wgmma N): (h, heads_per_block, threads, K buffers, CTAs
# per SM), the configs the issue-24 sweep timed (scripts/tim_decode_sweep.py at commit 7dfd2b4:
# A = two math warpgroups, 2 buffers; D = one math warpgroup, 1 buffer, 2 CTAs per SM), so that
# one device call compiled each variant once; plus a padded head group (h20 in groups of 24: per-thread Q
# and O). N = 8 .. 32.
TIM_A8, TIM_D8 = (8, 8, 384, 2, 1), (8, 8, 256, 1, 2)
TIM_A16, TIM_A32 = (16, 16, 384, 2, 1), (32, 32, 384, 2, 1)
TIM_D16 = (16, 16, 256, 1, 2)
SCOPES = [("swa", 1), ("c4a512", 1), ("c128a256", 8)]  # unsplit, both scopes; split-KV
TOKENS_IN_M = ([(*c, *sc) for c in (TIM_A8, TIM_D8, TIM_A16, TIM_D16, TIM_A32) for sc in SCOPES]
               + [(20, 24, 256, 2, 1, "swa", 1)])
# kept outside the knob tier: one unsplit case per scope and split-KV, on the three configs the
# shipped (lean) tokens-in-M variants take (D8, D16, A32)
TIM_KEPT = {(*TIM_D8, "swa", 1), (*TIM_D16, "c4a512", 1), (*TIM_A32, "c128a256", 8)}


def _tim_id(case) -> str:
    """``h16_hb16_t384_nb2_c1[_c4a512_S1]``: a case's name, selectable with ``-k``."""
    h, hb, threads, stages, per_sm, *rest = case
    scope = [f"{rest[0]}_S{rest[1]}"] if rest else []
    return "_".join([f"h{h}", f"hb{hb}", f"t{threads}", f"nb{stages}", f"c{per_sm}", *scope])


def _tokens_in_m(heads_per_block, threads, stages, ctas_per_sm, splits):
    config = {"block_tokens": 64, "heads_per_block": heads_per_block, "threads": threads,
              "warp_specialized": False, "tokens_in_m": True, "num_stages": stages,
              "ctas_per_sm": ctas_per_sm, "num_splits": splits}
    return _forcing_sm90a("sparse_decode", config)


@pytest.mark.parametrize("h,hb,threads,stages,per_sm,extra_kind,splits",
                         [c if c in TIM_KEPT else knob(*c) for c in TOKENS_IN_M],
                         ids=[_tim_id(c) for c in TOKENS_IN_M])
def test_decode_tokens_in_m(h, hb, threads, stages, per_sm, extra_kind, splits, seed):
    """The tokens-in-M schedule forced, unsplit and split, on both scopes: holes, garbage past
    the lengths, a request with nothing valid (decode_case), NaN-poisoned outputs."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _tokens_in_m(hb, threads, stages, per_sm, splits):
        _case(7, 1, h, extra_kind, gen)
        _case(3, 2, h, extra_kind, gen)  # s_q 2: rows of one request, their own indices


@pytest.mark.parametrize("config", [TIM_A16, TIM_D8], ids=_tim_id)
def test_decode_tokens_in_m_batch_invariant(config, seed):
    """The tokens-in-M schedule with 8 splits (the fixed grid's split rule: equal shares of
    the row's own tiles) gives a row the same bits alone, in a batch of 8 and of 256."""
    h, hb, threads, stages, per_sm = config
    with _tokens_in_m(hb, threads, stages, per_sm, 8):
        _check_batch_invariant(h, "c128a256", seed)


@pytest.mark.parametrize("h,hb,threads,stages,per_sm,splits",
                         [(*TIM_D8, 1), knob(*TIM_D8, 8), knob(*TIM_A16, 1), (*TIM_A16, 8)],
                         ids=[f"{s}-{_tim_id(c)}" for c, s in ((TIM_D8, 1), (TIM_D8, 8),
                                                               (TIM_A16, 1), (TIM_A16, 8))])
def test_decode_tokens_in_m_invalid_slots(h, hb, threads, stages, per_sm, splits, seed):
    """-1, slots past the cache, INT32_MAX and negatives inside the lengths, garbage past
    them, all-invalid rows and empty rows; block 0 poisoned (read in place of every invalid
    token, it must be discarded)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b = 6
    q = torch.randn((b, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    k_cache, idx = decode_scope(b, 1, WINDOW, 64, 3, gen)
    e_cache, e_idx = decode_scope(b, 1, 544, 64, 544 // 64 + 2, gen)
    k_cache, idx = _poison_block0(k_cache, idx)
    e_cache, e_idx = _poison_block0(e_cache, e_idx)
    for cache, ix in ((k_cache, idx), (e_cache, e_idx)):
        num_slots = cache.shape[0] * cache.shape[1]
        bad = torch.rand(ix.shape, generator=gen, device=DEV) < 0.25
        garbage = torch.tensor([-1, num_slots, num_slots + 63, 2**31 - 1, -2, -(2**31)],
                               dtype=torch.int32, device=DEV)
        pick = torch.randint(0, len(garbage), ix.shape, generator=gen, device=DEV)
        ix[bad] = garbage[pick][bad]
    idx[1].fill_(-1)  # request 1: every window entry invalid
    lens = torch.tensor([WINDOW, WINDOW, 0, 77, 1, WINDOW], dtype=torch.int32, device=DEV)
    e_lens = torch.tensor([544, 0, 0, 300, 33, 1], dtype=torch.int32, device=DEV)
    poison_past_length(idx, lens, gen)
    poison_past_length(e_idx, e_lens, gen)
    with _tokens_in_m(hb, threads, stages, per_sm, splits):
        check_decode(q, (k_cache, idx, lens), (e_cache, e_idx, e_lens), make_sink(h, gen))
        check_decode(q, (k_cache, idx, lens), (None, None, None), make_sink(h, gen))


@pytest.mark.parametrize("splits", [8])
def test_decode_tokens_in_m_split_edges(splits, seed):
    """Split boundaries of the tokens-in-M schedule (2 K buffers: the second tile of an odd
    range's last round skipped) at the lengths that caught the warp-specialised schedule."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _tokens_in_m(16, 384, 2, 1, splits):
        _split_edge_cases(16, gen)


# Split-KV of the tokens-in-M schedule (issue 24, bench/PERF_NOTES.md item 37): the sweep's
# configs A (two math warpgroups) and D (one, 2 CTAs per SM; at 32 heads it does not fit, see
# dsv4_tl.schedule_rules) at 16 and 32 heads, both scopes, 8 splits (rows of 1-10 tiles: empty
# splits and splits of several tiles), A16 at 2 splits too (the split count is a constant of
# the same code: D16 / A32 at 2 splits compiled two variants each to prove it again; the
# shipped 2-split buckets, lean producer, are test_decode_matches_reference's h16 b1 SWA, h16
# b96 and h32 b90 C128A), with the combine's shipped merge order ("splits"); the other order
# ("elements", knob ``merge``) on A16 C4A 8 splits and on h20 in a group of 24: padded heads
# in the partials and in the combine's last group of 8 (both merges read a real head for them
# and never store them).
TIM_SPLITS = ([(*c, sc, n) for c in (TIM_A16, TIM_D16, TIM_A32) for sc in ("swa", "c4a512")
               for n in ((2, 8) if c is TIM_A16 else (8,))] + [(20, 24, 256, 2, 1, "c4a512", 2)])
TIM_SPLIT_CASES = ([(*c, "splits") for c in TIM_SPLITS]
                   + [(*TIM_A16, "c4a512", 8, "elements"),
                      (20, 24, 256, 2, 1, "c4a512", 2, "elements")])
# kept outside the knob tier: 2 and 8 splits, both scopes, the shipped merge order
TIM_SPLITS_KEPT = {(*TIM_A16, "swa", 2, "splits"), (*TIM_A32, "c4a512", 8, "splits")}


@pytest.mark.parametrize("h,hb,threads,stages,per_sm,extra_kind,splits,merge",
                         [c if c in TIM_SPLITS_KEPT else knob(*c) for c in TIM_SPLIT_CASES],
                         ids=[f"{_tim_id(c[:-1])}-{c[-1]}" for c in TIM_SPLIT_CASES])
def test_decode_tokens_in_m_splits(h, hb, threads, stages, per_sm, extra_kind, splits, merge,
                                   seed):
    """Split partials of the tokens-in-M schedule merged by the combine: rows of 1-10 tiles
    over 2 or 8 splits (empty splits included), holes, garbage past the lengths, a request
    with nothing valid (decode_case), NaN-poisoned outputs."""
    from dsv4_tl.schedules import schedule_for
    from dsv4_tl.targets import parse_target
    from dsv4_tl.tune import forcing

    target = parse_target("cuda:sm_90a")
    combine = {**schedule_for(target.dirname, "sparse_decode_combine"), "merge": merge}
    gen = torch.Generator(DEV).manual_seed(seed)
    with _tokens_in_m(hb, threads, stages, per_sm, splits), \
            forcing(target, "sparse_decode_combine", combine):
        _case(7, 1, h, extra_kind, gen)
        _case(3, 2, h, extra_kind, gen)  # s_q 2: rows of one request, their own indices

class _PoisonedScratch:
    """The split partials and the split table in fresh NaN-filled tensors at every call, so a
    partial that the kernel did not write reaches the combine as NaN (the stream's pooled
    scratch could hold a previous call's right values)."""

    @staticmethod
    def views(device, shapes):
        return tuple(torch.full(shape, math.nan, dtype=torch.float32, device=device)
                     for shape in shapes)


# ------------------------------------------------------- tokens in M on the persistent grid
# The tokens-in-M decode walking work.py's items (issue 24, bench/PERF_NOTES.md item 50): two
# K buffers, every tile of an item's pairs (an odd range's padding tile all-invalid), Q per
# item by TMA, rows of one split stored in place, split rows through the combine. The configs
# are ``tim_pers`` of scripts/decode_grid_ab.py at commit 7dfd2b4 (the same dict: the same
# compiled variant per head count and scope; the split sizes are plan knobs, not part of the
# variant), plus one math warpgroup (threads 256) with the default producer at 16 heads, C4A:
# with the A/B's rows (--rows timp) 16 variants.
def tim_persistent_config(hb, threads=384, **plan) -> dict:
    """The schedule file's default with tokens in M on the persistent grid and the lean
    producer, as the tokens-in-M buckets ship it (``plan``: over these, e.g. the split-size
    knobs ``tiles_per_split_min`` / ``invariant_tiles_per_split`` or ``producer_lean``)."""
    from dsv4_tl.schedules import schedule_for

    return {**schedule_for("cuda_sm90a", "sparse_decode"), "block_tokens": 64,
            "heads_per_block": hb, "threads": threads, "warp_specialized": False,
            "tokens_in_m": True, "num_stages": 2, "ctas_per_sm": 1, "num_splits": 1,
            "persistent": True, "item_cost": 2, "tiles_per_split_min": 2,
            "invariant_tiles_per_split": 4, "producer_lean": True, **plan}


def _tim_persistent(hb, threads=384, **plan):
    return _forcing_sm90a("sparse_decode", tim_persistent_config(hb, threads, **plan))


TIM_PERSISTENT = [
    # (h, heads_per_block, threads, b, s_q, extra kind, batch_invariant, plan knobs)
    # few rows, derived split size (2 tiles): every row split over the CTAs, the combine
    (8, 8, 384, 1, 1, "c4a512", False, {}),
    (16, 16, 384, 7, 1, "c4a512", False, {}),
    (32, 32, 384, 3, 2, "c128a256", False, {}),
    # one math warpgroup and the default producer
    (16, 16, 256, 7, 1, "c4a512", False, {"producer_lean": False}),
    # whole rows (the units fill more than half of the SMs): 1-3 items per CTA
    pytest.param(16, 16, 384, 300, 1, "c4a512", False, {}, marks=HEAVY),
    (16, 16, 384, 200, 1, "swa", False, {}),
    (32, 32, 384, 140, 1, "c128a256", False, {}),
    pytest.param(16, 16, 256, 300, 1, "c4a512", False, {"producer_lean": False}, marks=HEAVY),
    # fixed split sizes (batch-invariant mode): one-tile items (a padding tile each, ~5-10
    # items per CTA), three-tile items (odd: the last pair padded)
    (16, 16, 384, 40, 1, "c4a512", True, {"invariant_tiles_per_split": 1}),
    (32, 32, 384, 37, 3, "c4a512", True, {"invariant_tiles_per_split": 3}),
    (8, 8, 384, 64, 1, "c128a256", True, {}),
]


def _tim_persistent_id(case) -> str:
    h, hb, threads, b, s_q, kind, inv, plan = getattr(case, "values", case)  # (a pytest.param)
    return "_".join([f"h{h}", f"t{threads}", f"b{b}", f"sq{s_q}", kind,
                     "inv" if inv else "default",
                     *(f"{k.split('_')[-1]}{v}" for k, v in plan.items())])


@pytest.mark.parametrize("h,hb,threads,b,s_q,extra_kind,batch_invariant,plan", TIM_PERSISTENT,
                         ids=[_tim_persistent_id(c) for c in TIM_PERSISTENT])
def test_decode_tokens_in_m_persistent(h, hb, threads, b, s_q, extra_kind, batch_invariant, plan,
                                       seed, monkeypatch):
    """Tokens in M on the persistent grid against the float32 reference: per-row lengths
    (odd tile counts: padding tiles), holes, garbage past the lengths, empty rows alone and in
    runs (items without tiles), split rows merged by the combine, CTAs walking several items
    (barrier phases and the Q reload carried across them); outputs, split partials and the
    split table NaN-poisoned."""
    import importlib

    front_end = importlib.import_module("dsv4_tl.ops.sparse_decode")
    monkeypatch.setattr(front_end, "stream_scratch", _PoisonedScratch())
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    empty = [r for r in range(b) if r % 7 in (2, 3) or r % 11 == 5]  # alone and in runs
    main[2][empty] = 0
    if extra[2] is not None:
        extra[2][empty] = 0
    with _tim_persistent(hb, threads, **plan):
        out, lse = _rows_of(q, main, extra, sink, list(range(b)), batch_invariant)
        torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                    out, ref_out, lse=(lse, ref_lse))


def test_decode_tokens_in_m_persistent_padded_heads_keep_fixed_grid(seed):
    """A head count with a padded last group (20 in groups of 24) keeps the fixed grid under
    the persistent knob (builder and front end apply the same rule), and is correct."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _tim_persistent(24):
        _case(5, 1, 20, "c4a512", gen)


@pytest.mark.parametrize("h,extra_kind,tps", [pytest.param(8, "c4a512", 4, marks=HEAVY),
                                              pytest.param(16, "c128a1024", 4, marks=HEAVY),
                                              (16, "swa", 1),
                                              pytest.param(32, "c4a512", 3, marks=HEAVY)],
                         ids=["h8-c4a512-T4", "h16-c128a1024-T4", "h16-swa-T1", "h32-c4a512-T3"])
def test_decode_tokens_in_m_persistent_batch_invariant(h, extra_kind, tps, seed):
    """batch_invariant=True with tokens in M on the persistent grid (splits of a fixed
    ``invariant_tiles_per_split`` tiles): a row's out and lse are bitwise identical alone, at
    other positions of batches of 8, 37 and 133 and in the whole batch of 256 (per-row lengths,
    empty rows, holes); the whole batch against the reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b = 256
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    main[2][5] = 0  # an empty window (request 255 is empty in both scopes)
    if extra[2] is not None:
        extra[2][6] = 0
    with _tim_persistent(h, invariant_tiles_per_split=tps):
        full_out, full_lse = _rows_of(q, main, extra, sink, list(range(b)), True)
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
        check_attention(max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None),
                        full_out, ref_out, lse=(full_lse, ref_lse))

        def bits(x):
            return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

        others = torch.randperm(b, generator=gen, device=DEV).tolist()
        for r in (0, 5, 6, b // 2 + 2, b - 1):
            mates = [o for o in others if o != r]
            for got, pos in ((_rows_of(q, main, extra, sink, [r], True), 0),
                             (_rows_of(q, main, extra, sink, mates[:5] + [r] + mates[5:7],
                                       True), 5),
                             (_rows_of(q, main, extra, sink, mates[:30] + [r] + mates[30:36],
                                       True), 30),
                             (_rows_of(q, main, extra, sink, mates[:99] + [r] + mates[99:132],
                                       True), 99)):
                assert torch.equal(bits(got[0][pos]), bits(full_out[r])), f"row {r}: out differs"
                assert torch.equal(bits(got[1][pos]), bits(full_lse[r])), f"row {r}: lse differs"


# ----------------------------------------------------------------------------- seesaw consumers
# The warp-specialised schedule with prefill's seesaw consumers (tile_kernels/sparse_mla/consume.py) and
# the FP8 producer by K halves (tile_kernels/sparse_mla/decode_seesaw.py), forced for every shape;
# ``over`` changes knobs of it (split counts, 32-token tiles).
SEESAW = {"block_tokens": 64, "heads_per_block": 64, "threads": 384, "num_splits": 1,
          "warp_specialized": True, "persistent": False, "item_cost": 3,
          "tiles_per_split_min": 4, "invariant_tiles_per_split": 16, "tokens_in_m": False,
          "num_stages": 2, "ctas_per_sm": 1, "consumers": "seesaw", "producer_slots": 2}
# 32-token tiles with four producer slots (three steps of raw bytes in flight)
SLOTS4 = {"block_tokens": 32, "producer_slots": 4}


def _seesaw_id(v):
    """Test ids with the knobs spelled out (``-k slots4`` selects the four-slot producer)."""
    if isinstance(v, dict):
        return "-".join(f"{k.split('_')[-1]}{x}" for k, x in v.items()) or "as_is"
    return str(v)


def _seesaw(**over):
    return _forcing_sm90a("sparse_decode", {**SEESAW, **over})


@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,over",
    [
        knob(64, 1, 1, "c4a512", {"num_splits": 8}),
        knob(128, 1, 1, "c4a1024", {"num_splits": 8}),
        knob(128, 7, 1, "c128a256", {}),
        knob(64, 64, 1, "c128a128", {}),
        knob(128, 128, 1, "c4a1024", {}, marks=[HEAVY]),
        knob(64, 128, 1, "c4a512", {}),
        knob(128, 64, 1, "swa", {}),
        knob(64, 7, 1, "swa", {"num_splits": 4}),
        knob(128, 37, 3, "c4a1024", {}),
        knob(128, 16, 1, "c128a8192", {"num_splits": 2}),
        knob(96, 7, 1, "c4a512", {}),
        knob(64, 7, 1, "c4a512", {"block_tokens": 32}),
        knob(128, 9, 2, "c128a1024", {"block_tokens": 32}),
        (128, 37, 3, "c4a1024", SLOTS4),
        (64, 64, 1, "c128a128", SLOTS4),
        (128, 64, 1, "swa", SLOTS4),
        (128, 1, 1, "c4a1024", {**SLOTS4, "num_splits": 8}),
        knob(96, 7, 1, "c4a512", SLOTS4),
    ],
    ids=_seesaw_id,
)
def test_decode_seesaw_matches_reference(h, b, s_q, extra_kind, over, seed):
    """Both scopes, SWA-only, MTP rows, split-KV partials through the combine, a padded head
    count (96), 32- and 64-token tiles; holes, garbage past the lengths and a lonely last
    request come with every case."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw(**over):
        check_decode(*decode_case(b, s_q, h, extra_kind, gen))


@pytest.mark.parametrize("block_tokens,producer_slots", [knob(32, 2), knob(64, 2), (32, 4)],
                         ids=["tokens32-slots2", "tokens64-slots2", "tokens32-slots4"])
@pytest.mark.parametrize("num_splits", [4, 8])
def test_decode_seesaw_split_edges(block_tokens, producer_slots, num_splits, seed):
    """The split-boundary lengths of the split consumers' test (padding tiles of an odd tile
    count, window-to-compressed crossings, empty splits) with block 0's slot 0 poisoned."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw(block_tokens=block_tokens, producer_slots=producer_slots, num_splits=num_splits):
        _split_edge_cases(64, gen)


@pytest.mark.parametrize("slots4", [knob(False), True], ids=["slots2", "slots4"])
@pytest.mark.parametrize("case", ["lonely", "holes", "out_of_range", "sinks", "fnuz"])
def test_decode_seesaw_edge_inputs(case, slots4, seed):
    """Every length 0 (out 0, lse +inf), every entry -1, slots past the cache and other
    negatives, the four sink kinds, FNUZ bytes: the seesaw schedule's results match the
    reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw(**(SLOTS4 if slots4 else {})):
        _edge_input_case(case, gen, 64, "c4a512", poison_block0=False)


# The seesaw schedule with the half producer's lean instruction stream (``producer_lean``:
# tile_kernels/sparse_mla/produce_fp8.make_fp8_half_producer, fp8.FP8_LEAN_PRELUDE), forced for
# every shape: 64-token tiles with two slots (SEESAW) and 32-token tiles with four (SLOTS4).
SEESAW_LEAN = {"producer_lean": True}
SEESAW_LEAN_CONFIGS = [pytest.param({}, id="tokens64-slots2", marks=[KNOB]),
                       pytest.param(SLOTS4, id="tokens32-slots4", marks=[KNOB])]


def _seesaw_lean(**over):
    return _seesaw(**SEESAW_LEAN, **over)


@pytest.mark.parametrize("config", SEESAW_LEAN_CONFIGS)
@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,over",
    [
        (128, 128, 1, "c4a1024", {}),
        (64, 128, 1, "c4a512", {}),
        (128, 64, 1, "swa", {}),
        (128, 37, 3, "c4a1024", {}),
        (64, 64, 1, "c128a128", {}),
        (128, 16, 1, "c128a8192", {"num_splits": 2}),
        (64, 1, 1, "c4a512", {"num_splits": 8}),
        (96, 7, 1, "swa", {"num_splits": 4}),
    ],
    ids=_seesaw_id,
)
def test_decode_seesaw_lean_matches_reference(h, b, s_q, extra_kind, over, config, seed):
    """The lean half producer against the reference, outputs NaN-poisoned: both scopes (C4A:
    64-token blocks; C128A: 2-token blocks, a long row), SWA-only, MTP rows, split-KV partials
    through the combine, a padded head count (96); holes, garbage past the lengths and a
    lonely last request come with every case."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw_lean(**config, **over):
        check_decode(*decode_case(b, s_q, h, extra_kind, gen))


@pytest.mark.parametrize("config", SEESAW_LEAN_CONFIGS)
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_seesaw_lean_split_edges(num_splits, config, seed):
    """The split-boundary lengths (padding tiles of an odd tile count, window-to-compressed
    crossings, empty splits), unsplit and at 8 splits, with block 0's slot 0 poisoned (an
    invalid token's bytes are read from there and must be discarded)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw_lean(**config, num_splits=num_splits):
        _split_edge_cases(64, gen)


@pytest.mark.parametrize("config", SEESAW_LEAN_CONFIGS)
@pytest.mark.parametrize("case", ["lonely", "holes", "out_of_range", "sinks", "fnuz"])
def test_decode_seesaw_lean_edge_inputs(case, config, seed):
    """Every length 0 (out 0, lse +inf), every entry -1, slots past the cache, INT32_MAX and
    other negatives (block 0 poisoned), the four sink kinds, FNUZ bytes (restore exponent
    119: the fast path's other limit)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _seesaw_lean(**config):
        _edge_input_case(case, gen, 64, "c4a512", poison_block0=True)


@pytest.mark.parametrize("config", SEESAW_LEAN_CONFIGS)
def test_decode_seesaw_lean_block_sizes(config, seed):
    """Block sizes 1 (the division magic's special case) in the window scope and 7 (not a
    power of two) in the compressed scope, with garbage slots past each cache: against the
    reference."""
    with _seesaw_lean(**config):
        _block_size_case(torch.Generator(DEV).manual_seed(seed))


@pytest.mark.parametrize("config", SEESAW_LEAN_CONFIGS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_seesaw_lean_bitwise_default(num_splits, config, seed):
    """The lean half producer writes bitwise the default half producer's K, so ``out`` and
    ``lse`` are bitwise the default's (same consumers, tiles and splits): on a random C4A
    case, and with scale bytes 140 (2^13, past the fast path's limit: those warps' steps take
    dsv4_dequant) on tile 5 (half 1) and tile 2 (half 0) of a third of the tokens of both
    caches (q zero on those tiles' dims, so the logits stay moderate), also against the
    reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    for large in (False, True):
        q, main, extra, sink = decode_case(16, 1, 128, "c4a1024", gen)
        if large:
            for tile in (2, 5):
                q[..., 64 * tile:64 * tile + 64] = 0
                _raise_scales(main[0], tile, 1 / 3, 140, gen)
                _raise_scales(extra[0], tile, 1 / 3, 140, gen)
        forced = {**SEESAW, **config, "num_splits": num_splits, "producer_lean": False}
        _assert_lean_bitwise(forced, {**forced, "producer_lean": True}, q, main, extra, sink,
                             f"large {large}")
        with _seesaw_lean(**config, num_splits=num_splits):
            check_decode(q, main, extra, sink)


# Tokens in M (config A: two math warpgroups, 2 K buffers of 64 tokens) at 16 heads, on the
# fixed grid, the schedule file's other knobs spelled out.
TIM_A16_FIXED = {"block_tokens": 64, "heads_per_block": 16, "threads": 384, "num_splits": 1,
                 "warp_specialized": False, "persistent": False, "item_cost": 3,
                 "tiles_per_split_min": 4, "invariant_tiles_per_split": 16,
                 "tokens_in_m": True, "num_stages": 2, "ctas_per_sm": 1, "consumers": "split",
                 "producer_slots": 2}


def _knob_id(v):
    """Test ids with the knobs spelled out."""
    if isinstance(v, dict):
        return "-".join(f"{k.split('_')[-1]}{x}" for k, x in v.items()) or "as_is"
    return str(v)


def _decode_default() -> dict:
    """The sm_90a schedule file's default decode config."""
    from dsv4_tl.schedules import schedule_for

    return schedule_for("cuda_sm90a", "sparse_decode")


# ------------------------------------------------------------ the lean FP8 producer
# The schedule default (split consumers, 32-token tiles, fixed grid) with ``producer_lean``
# (tile_kernels/sparse_mla/produce_fp8.py, fp8.FP8_LEAN_PRELUDE), forced for every shape; ``over``
# changes knobs of it. The cases reuse the variants of the A/B of scripts/device_producer_lean.sh
# at commit 7dfd2b4 (h64 / h128 with and without the extra scope, 1 split; h64 C4A 8 splits) and
# one FNUZ variant, so that one device call compiled them all.
LEAN = {**_decode_default(), "producer_lean": True}


def _lean(**over):
    return _forcing_sm90a("sparse_decode", {**LEAN, **over})


@pytest.mark.parametrize(
    "h,b,s_q,extra_kind,over",
    [
        (64, 128, 1, "c4a512", {}),
        pytest.param(128, 128, 1, "c4a1024", {}, marks=HEAVY),
        (128, 64, 1, "swa", {}),
        (64, 37, 1, "swa", {}),
        (128, 37, 3, "c4a1024", {}),
        (64, 64, 1, "c128a128", {}),
        (64, 7, 1, "c128a8192", {"num_splits": 8}),
        (64, 1, 1, "c4a512", {"num_splits": 8}),
    ],
    ids=_knob_id,
)
def test_decode_lean_matches_reference(h, b, s_q, extra_kind, over, seed):
    """Both scopes (C4A: 64-token blocks; C128A: 2-token blocks, a long row), SWA-only, MTP
    rows, split-KV partials (8 splits) through the combine; holes, garbage past the lengths
    and a lonely last request come with every case, outputs NaN-poisoned."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _lean(**over):
        check_decode(*decode_case(b, s_q, h, extra_kind, gen))


def test_decode_lean_split_edges(seed):
    """The split-boundary lengths (padding tiles, window-to-compressed crossings, empty
    splits) at 8 splits with block 0's slot 0 poisoned (an invalid token's bytes are read
    from there and must be discarded)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _lean(num_splits=8):
        _split_edge_cases(64, gen)


@pytest.mark.parametrize("case", ["lonely", "holes", "out_of_range", "sinks", "fnuz"])
def test_decode_lean_edge_inputs(case, seed):
    """Every length 0 (out 0, lse +inf), every entry -1, slots past the cache, INT32_MAX and
    other negatives (block 0 poisoned), the four sink kinds, FNUZ bytes (restore exponent
    119: the fast path's other limit)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    with _lean():
        _edge_input_case(case, gen, 64, "c4a512", poison_block0=True)


def test_decode_lean_block_sizes(seed):
    """Block sizes 1 (the division magic's special case) in the window scope and 7 (not a
    power of two) in the compressed scope, with garbage slots past each cache: against the
    reference."""
    with _lean():
        _block_size_case(torch.Generator(DEV).manual_seed(seed))


def _assert_lean_bitwise(default: dict, lean: dict, q, main, extra, sink, label: str) -> None:
    """The call forced to ``default`` and to ``lean`` (the same schedule with the lean
    producer) gives bitwise the same ``out`` and ``lse``, outputs NaN-poisoned first."""
    results = []
    for config in (default, lean):
        with _forcing_sm90a("sparse_decode", config):
            results.append(_rows_of(q, main, extra, sink, list(range(q.shape[0])), False))
            torch.cuda.synchronize()
    (d_out, d_lse), (l_out, l_lse) = results
    assert not bool(torch.isnan(l_out).any()), f"{label}: NaN left in out"
    assert torch.equal(d_out.view(torch.int16), l_out.view(torch.int16)), label
    assert torch.equal(d_lse.view(torch.int32), l_lse.view(torch.int32)), label


def _raise_scales(cache, tile: int, frac: float, byte: int, gen) -> None:
    """Set the scale byte of quantisation tile ``tile`` of a random ``frac`` of the cache's
    tokens to ``byte`` (in place)."""
    geo = cache_geometry(cache)
    nb, bs = geo.num_blocks, geo.block_size
    slots = (torch.rand(nb * bs, generator=gen, device=DEV) < frac).nonzero().flatten()
    offs = (slots // bs) * geo.stride0 + bs * 576 + (slots % bs) * 8 + tile
    flat = geo.flat
    flat[offs] = byte


def test_decode_lean_bitwise_default(seed):
    """The lean producer writes bitwise the default producer's K, so ``out`` and ``lse``
    are bitwise the default's: on a random C4A case, and with scale bytes 140 (2^13, past
    the fast path's limit: those warps' rounds take dsv4_dequant) on tile 5 of a third of
    the tokens of both caches (q zero on tile 5's dims, so the logits stay moderate; V's
    dims 320-383 of those tokens are 2^13 times larger), also against the reference."""
    gen = torch.Generator(DEV).manual_seed(seed)
    for large in (False, True):
        q, main, extra, sink = decode_case(16, 1, 128, "c4a1024", gen)
        if large:
            q[..., 320:384] = 0
            _raise_scales(main[0], 5, 1 / 3, 140, gen)
            _raise_scales(extra[0], 5, 1 / 3, 140, gen)
        _assert_lean_bitwise({**_decode_default(), "num_splits": 1}, {**LEAN, "num_splits": 1},
                             q, main, extra, sink, f"large {large}")
        with _lean(num_splits=1):
            check_decode(q, main, extra, sink)


def test_decode_lean_tokens_in_m(seed):
    """Tokens in M (h16, 64-token tiles: two rounds per tile) with the lean producer, both
    scopes: random rows and MTP rows, then the split-boundary lengths with block 0
    poisoned. (Not in scripts/device_producer_lean.sh, at commit 7dfd2b4: its variant was not
    precompiled there.)"""
    from dsv4_tl.targets import parse_target
    from dsv4_tl.tune import forcing

    gen = torch.Generator(DEV).manual_seed(seed)
    config = {**TIM_A16_FIXED, "producer_lean": True}
    with forcing(parse_target("cuda:sm_90a"), "sparse_decode", config):
        _case(7, 1, 16, "c4a512", gen)
        _case(3, 2, 16, "c128a256", gen)
        _split_edge_cases(16, gen)


# The plan-cost probe of issue 35 lever 3 (``plan_repeats``, bench/PERF_NOTES.md item 73): the
# shipped persistent buckets' schedules with each CTA's plan traced 5 times. The repeats must
# leave the words of one plan: the same bits as the shipped kernel, and the reference's values.
# (5: the variants scripts/lab/h35_metadata_ab.py times, so one precompile serves both.)
PLAN_REPEATS = 5


def _shipped_schedule(h, b, extra_kind):
    from dsv4_tl.kernels import SPARSE_DECODE
    from dsv4_tl.schedules import schedule_for

    scope, width = ("c128a", int(extra_kind[5:])) if extra_kind.startswith("c128a") else \
        ("c4a", int(extra_kind[3:]))
    return schedule_for("cuda_sm90a", "sparse_decode",
                        **SPARSE_DECODE.features("cuda_sm90a", h=h, b=b, scope=scope,
                                                 extra_width=width))


# ------------------------------------------------------------------ tail-split grid
# The decode's ``tail_split`` knob (bench/PERF_NOTES.md item 77): on the fixed grid the units of
# the full waves run whole, stored directly, and only the rest (the tail) is cut into pieces
# whose partials the combine merges (ops.sparse_decode.tail_split_plan). The schedules are
# sm_90a's resolved ones (the 64-head tile, lean producer, >= 67 CTAs) with the knob on; the
# tails below are those of a 132-SM H200 (tail units: 1, 2, 8, 16, 18, 32, 60; 68, no split).
TAIL_SPLIT_CASES = [
    # (h, b, s_q, extra kind)
    (64, 133, 1, "c4a512"),  # one tail unit, 10 pieces
    (64, 150, 1, "c4a512"),  # 18 units, 7 pieces
    (64, 74, 2, "c4a512"),  # 16 units (8 rows x 2 queries), 8 pieces
    (64, 96, 2, "c4a512"),  # 60 units, 2 pieces
    (128, 67, 1, "c4a1024"),  # one row (2 units), 18 pieces (half a row's 36 tiles)
    (128, 74, 1, "c4a1024"),  # 16 units, 8 pieces
    (128, 37, 2, "c4a1024"),  # 16 units of MTP rows, 8 pieces
    (128, 74, 2, "c4a1024"),  # 32 units, 4 pieces
    (128, 81, 2, "c4a1024"),  # 60 units, 2 pieces
    (128, 70, 1, "c128a1024"),  # 8 units, 16 pieces
    (128, 100, 1, "c4a1024"),  # 68 units: one piece (the front end runs the shipped variant)
]


def _tail_config(h, b, s_q, scope) -> dict:
    """The resolved sm_90a schedule of these rows (plan knobs included), tail_split on."""
    from dsv4_tl.kernels import SPARSE_DECODE
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    width = 512 if h <= 64 else 1024
    config = dict(call_schedule(SPARSE_DECODE, parse_target("cuda:sm_90a"), h=h, b=b, s_q=s_q,
                                scope=scope, batch_invariant=False, extra_width=width))
    return {**config, "tail_split": True}


def _tail_plan(h, b, s_q, extra_kind) -> tuple:
    """``(whole rows, pieces)`` of the front end's plan on this device (widths: 128 + extra)."""
    import importlib

    from dsv4_tl.kernels import MAX_COMBINE_SPLITS

    ops = importlib.import_module("dsv4_tl.ops.sparse_decode")
    hg = h // 64
    width = int(extra_kind[3:] if extra_kind.startswith("c4a") else extra_kind[5:])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    whole, pieces = ops.tail_split_plan(b * s_q * hg, hg, sms, -(-WINDOW // 32) + width // 32,
                                        MAX_COMBINE_SPLITS)
    return whole // hg, pieces


def _poisoned_decode(q, main, extra, sink, metadata=None):
    """``sparse_decode`` of the whole batch into NaN-poisoned out / lse (synchronised), with
    the step's scheduler ``metadata`` where given."""
    b, s_q, h, _ = q.shape
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=DEV)
    sparse_decode(q, *main, SCALE, sink, *extra, out=out, lse=lse, metadata=metadata)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("h,b,extra_kind", [
    (64, 2, "c128a4096"),  # item balance (<= 16 CTAs)
    (64, 20, "c128a4096"),  # tile balance, one Q stage
    (128, 3, "c128a4096"),
    (128, 24, "c128a4096"),
    (8, 20, "c4a512"),  # tokens in M, persistent (17-33 CTAs)
    (16, 40, "c4a512"),  # tokens in M, persistent (34-66 CTAs)
], ids=lambda v: str(v))
def test_decode_persistent_plan_repeats(h, b, extra_kind, seed):
    """The shipped persistent schedule with every CTA planning ``PLAN_REPEATS`` times: outputs
    poisoned, checked against the float32 reference and bitwise equal to the shipped
    kernel's (each plan leaves the same words: the probe times the plan, nothing else)."""
    config = _shipped_schedule(h, b, extra_kind)
    assert config.get("persistent"), f"h{h} b{b} {extra_kind}: not a persistent bucket"
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    once = _poisoned_decode(q, main, extra, sink)
    with _forcing_sm90a("sparse_decode", {**config, "plan_repeats": PLAN_REPEATS}):
        out, lse = _poisoned_decode(q, main, extra, sink)
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(max(cache_kmax(c) for c in (main[0], extra[0])), out, ref_out,
                    lse=(lse, ref_lse))
    assert torch.equal(out.view(torch.int16), once[0].view(torch.int16))
    assert torch.equal(lse.view(torch.int32), once[1].view(torch.int32))


# Scheduler metadata (issue 35 lever 3, bench/PERF_NOTES.md item 73): the persistent grid's
# plan computed once per step (``sparse_decode_metadata``) and read by the kernel variant
# ``plan_from_metadata`` instead of planned by each CTA. Rows of scripts/lab/h35_metadata_ab.py
# (their variants are the ones it times): the item balance (b2), the tile balance (b32) and
# tokens in M's item balance.
METADATA_ROWS = [(64, 2, "c128a4096"), (64, 32, "c128a8192"), (128, 2, "c128a8192"),
                 (128, 32, "c128a4096"), (8, 32, "c4a512"), (16, 64, "c4a512")]


@pytest.mark.parametrize("h,b,extra_kind", METADATA_ROWS, ids=lambda v: str(v))
def test_decode_metadata_same_bits(h, b, extra_kind, seed):
    """With ``metadata`` the shipped persistent schedule reads its plan: outputs poisoned,
    checked against the float32 reference, bitwise equal to the kernel that plans itself
    (the same words), the metadata's shape the grid's and its words the torch definition's."""
    from dsv4_tl.ops import sparse_decode_metadata
    from dsv4_tl.ops.sparse_decode import sparse_decode_metadata_by_torch

    config = _shipped_schedule(h, b, extra_kind)
    assert config.get("persistent"), f"h{h} b{b} {extra_kind}: not a persistent bucket"
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    metadata = sparse_decode_metadata(q, *main, *extra)
    words = 8 if config.get("balance") == "tiles" else 6
    assert metadata.dtype == torch.int32 and metadata.shape[1] == words
    assert 1 <= metadata.shape[0] <= torch.cuda.get_device_properties(DEV).multi_processor_count
    # (the metadata kernel's words are those of the torch definition, decode_metadata.py)
    assert torch.equal(metadata, sparse_decode_metadata_by_torch(q, *main, *extra))
    out, lse = _poisoned_decode(q, main, extra, sink, metadata)
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(max(cache_kmax(c) for c in (main[0], extra[0])), out, ref_out,
                    lse=(lse, ref_lse))
    planned = _poisoned_decode(q, main, extra, sink)
    assert torch.equal(out.view(torch.int16), planned[0].view(torch.int16))
    assert torch.equal(lse.view(torch.int32), planned[1].view(torch.int32))


@pytest.mark.parametrize("h,b,extra_kind", [(64, 32, "c128a8192"), (16, 64, "c4a512")],
                         ids=lambda v: str(v))
def test_decode_metadata_in_a_cuda_graph(h, b, extra_kind, seed):
    """One step captured: the metadata once from the step's lengths, then three layers'
    decode calls reading it. Replayed after new lengths are written into the captured
    length tensors, each layer's outputs are bitwise those of eager calls planning
    themselves with the new lengths."""
    from dsv4_tl.ops import sparse_decode_metadata

    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    qs = [q] + [torch.randn(q.shape, generator=gen, device=DEV).to(torch.bfloat16)
                for _ in range(2)]
    sparse_decode(q, *main, SCALE, sink, *extra, metadata=sparse_decode_metadata(
        q, *main, *extra))  # (loads the variants before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        metadata = sparse_decode_metadata(q, *main, *extra)
        outs = [sparse_decode(x, *main, SCALE, sink, *extra, metadata=metadata) for x in qs]
    _, new_main, new_extra, _ = decode_case(b, 1, h, extra_kind, gen)
    assert not torch.equal(new_extra[2], extra[2])  # (the replay must follow new lengths)
    main[2].copy_(new_main[2])
    extra[2].copy_(new_extra[2])
    graph.replay()
    torch.cuda.synchronize()
    for x, (out, lse) in zip(qs, outs):
        want_out, want_lse = sparse_decode(x, *main, SCALE, sink, *extra)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))


@pytest.mark.parametrize("h,b,extra_kind", [(64, 2, "c128a4096"), (64, 32, "c128a8192"),
                                            (16, 64, "c4a512")], ids=lambda v: str(v))
def test_decode_metadata_any_values_are_safe(h, b, extra_kind, seed):
    """Metadata that is not the step's plan (random words: negative, past every bound, the
    plan of other lengths) gives wrong numbers at worst: every call returns, and a correct
    call after them is still bitwise the self-planning kernel's (no fault, no hang left the
    context broken; the kernel clamps every word, work.load_cta_plan)."""
    from dsv4_tl.ops import sparse_decode_metadata

    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    good = sparse_decode_metadata(q, *main, *extra)
    shape = good.shape
    other_lens = [torch.randint(0, 1 << 14, (b,), generator=gen, device=DEV, dtype=torch.int32)
                  for _ in range(2)]
    wrong = [torch.randint(-(1 << 31), (1 << 31) - 1, shape, generator=gen, device=DEV,
                           dtype=torch.int32),
             torch.randint(-3, 3 * b, shape, generator=gen, device=DEV, dtype=torch.int32),
             sparse_decode_metadata(q, main[0], main[1], other_lens[0], extra[0], extra[1],
                                    other_lens[1]),
             good.flip(0).contiguous(), torch.zeros_like(good), torch.full_like(good, 1 << 30)]
    for metadata in wrong:
        _poisoned_decode(q, main, extra, sink, metadata)
    out, lse = _poisoned_decode(q, main, extra, sink, good)
    planned = _poisoned_decode(q, main, extra, sink)
    assert torch.equal(out.view(torch.int16), planned[0].view(torch.int16))
    assert torch.equal(lse.view(torch.int32), planned[1].view(torch.int32))


def test_decode_metadata_checked():
    """``metadata`` of the wrong dtype, shape, device, layout or type: a one-line error
    naming it, before any launch."""
    from dsv4_tl.ops import sparse_decode_metadata

    gen = torch.Generator(DEV).manual_seed(0)
    q, main, extra, sink = decode_case(2, 1, 64, "c128a4096", gen)
    good = sparse_decode_metadata(q, *main, *extra)
    strided = torch.empty((good.shape[0], 2 * good.shape[1]), dtype=torch.int32,
                          device=DEV)[:, ::2]
    strided.copy_(good)
    bad = [good.to(torch.int64), good[:-1], good.cpu(), strided,
           torch.empty((0, 0), dtype=torch.int32, device=DEV)]
    for metadata in bad:
        with pytest.raises(ValueError, match=r"^metadata: expected a contiguous int32 "):
            sparse_decode(q, *main, SCALE, sink, *extra, metadata=metadata)
    with pytest.raises(TypeError, match="^metadata: expected a tensor"):
        sparse_decode(q, *main, SCALE, sink, *extra, metadata=good.tolist())


@pytest.mark.parametrize("h,b,extra_kind", METADATA_ROWS, ids=lambda v: str(v))
def test_decode_metadata_words_follow_the_lengths(h, b, extra_kind, seed):
    """The metadata kernel's words equal the torch definition's for many length sets of
    one shape (empty rows, whole rows, lengths past the width and negative: clamped), and
    differ between length sets that plan differently (the words follow the lengths)."""
    from dsv4_tl.ops import sparse_decode_metadata
    from dsv4_tl.ops.sparse_decode import sparse_decode_metadata_by_torch

    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    seen = set()
    for i in range(12):
        hi = [main[1].shape[-1], extra[1].shape[-1]]
        for lens, width in zip((main[2], extra[2]), hi):
            lens.copy_(torch.randint(-4, width + 8, (b,), generator=gen, device=DEV,
                                     dtype=torch.int32))
            if i % 4 == 0:
                lens.fill_(width)
            if i % 4 == 1:
                lens[: b // 2] = 0
        words = sparse_decode_metadata(q, *main, *extra)
        assert torch.equal(words, sparse_decode_metadata_by_torch(q, *main, *extra)), i
        seen.add(tuple(words.flatten().tolist()))
    assert len(seen) > 2


@pytest.mark.parametrize("h,b,extra_kind", [(64, 32, "c128a8192"), (8, 32, "c4a512")],
                         ids=lambda v: str(v))
def test_decode_metadata_custom_op_traced(h, b, extra_kind, seed):
    """``dsv4_tl.sparse_decode_metadata`` is a custom op: its fake implementation gives the
    real result's shape (static: the schedule and the SM count), and ``torch.compile(
    fullgraph=True)`` of a step (the metadata, then two layers' decodes reading it) traces it
    as one node and returns bitwise what eager self-planning calls return."""
    import dsv4_tl
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    q2 = torch.randn(q.shape, generator=gen, device=DEV).to(torch.bfloat16)
    real = dsv4_tl.sparse_decode_metadata(q, *main, *extra)
    assert real.numel() > 0  # (a persistent row)
    with FakeTensorMode() as mode:
        fake = dsv4_tl.sparse_decode_metadata(*(mode.from_tensor(t) for t in (q, *main, *extra)))
    assert tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, q2, main, extra, sink):
        metadata = dsv4_tl.sparse_decode_metadata(q, *main, *extra)
        return [dsv4_tl.sparse_decode(x, *main[:3], SCALE, sink, *extra, metadata=metadata)
                for x in (q, q2)]

    outs = torch.compile(step, fullgraph=True, backend=backend)(q, q2, main, extra, sink)
    assert nodes.count("dsv4_tl.sparse_decode_metadata.default") == 1
    assert nodes.count("dsv4_tl.sparse_decode.default") == 2
    for x, (out, lse) in zip((q, q2), outs):
        want_out, want_lse = sparse_decode(x, *main, SCALE, sink, *extra)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))


@pytest.mark.parametrize("h,b,extra_kind", [(64, 2, "c128a4096"), (16, 64, "c4a512")],
                         ids=lambda v: str(v))
def test_decode_metadata_through_vllm_compat(h, b, extra_kind, seed):
    """``vllm_compat.flash_mla_with_kvcache`` maps FlashMLA's scheduler metadata onto ours:
    the object's first call stores ``sparse_decode_metadata`` of its arguments, later calls
    (the step's other layers) read it; outputs bitwise those of self-planning calls."""
    from dsv4_tl import vllm_compat as vc
    from dsv4_tl.ops import sparse_decode_metadata

    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, 1, h, extra_kind, gen)
    meta = vc.get_mla_metadata()[0]
    for i in range(3):
        x = q if i == 0 else torch.randn(q.shape, generator=gen, device=DEV).to(torch.bfloat16)
        out, lse = vc.flash_mla_with_kvcache(
            x, main[0], None, None, 512, meta, softmax_scale=SCALE, is_fp8_kvcache=True,
            indices=main[1], attn_sink=sink, extra_k_cache=extra[0],
            extra_indices_in_kvcache=extra[1], topk_length=main[2], extra_topk_length=extra[2])
        want_out, want_lse = sparse_decode(x, *main, SCALE, sink, *extra)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), i
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32)), i
    plan = meta.tile_scheduler_metadata
    assert plan is not None and plan.numel() > 0
    assert torch.equal(plan, sparse_decode_metadata(q, *main, *extra))


def _kmax(main, extra) -> float:
    return max(cache_kmax(c) for c in (main[0], extra[0]) if c is not None)


@pytest.mark.parametrize("h,b,s_q,extra_kind", [knob(*c) for c in TAIL_SPLIT_CASES],
                         ids=["-".join(map(str, c)) for c in TAIL_SPLIT_CASES])
def test_decode_tail_split_matches_reference(h, b, s_q, extra_kind, seed):
    """The tail-split grid against the float32 reference: per-row lengths 0..width with -1
    holes, garbage past the lengths and a last row with nothing valid (in the tail, so some
    pieces are empty), mixed sinks, out / lse NaN-poisoned (every element written)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    scope = "c4a" if extra_kind.startswith("c4a") else "c128a"
    with _forcing_sm90a("sparse_decode", _tail_config(h, b, s_q, scope)):
        check_decode(q, main, extra, sink)


@pytest.mark.parametrize("h,b,s_q,extra_kind", [
    knob(64, 150, 1, "c4a512"),
    knob(128, 74, 1, "c4a1024"),
    knob(128, 37, 2, "c4a1024"),
], ids=lambda v: str(v))
def test_decode_tail_split_whole_rows_bitwise(h, b, s_q, extra_kind, seed):
    """The rows of the full waves run the fixed grid's code on the whole row: bitwise the
    shipped schedule's out and lse; the tail rows go through pieces and the combine (their
    out differs somewhere: the knob reached the kernel)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    config = _tail_config(h, b, s_q, "c4a")
    with _forcing_sm90a("sparse_decode", {**config, "tail_split": False}):
        out0, lse0 = _poisoned_decode(q, main, extra, sink)
    with _forcing_sm90a("sparse_decode", config):
        out1, lse1 = _poisoned_decode(q, main, extra, sink)
    whole_rows, pieces = _tail_plan(h, b, s_q, extra_kind)
    assert pieces > 1 and whole_rows < b * s_q, (whole_rows, pieces)
    o0, o1 = out0.view(b * s_q, h, 512), out1.view(b * s_q, h, 512)
    l0, l1 = lse0.transpose(1, 2).reshape(b * s_q, h), lse1.transpose(1, 2).reshape(b * s_q, h)
    assert torch.equal(o0[:whole_rows].view(torch.int16), o1[:whole_rows].view(torch.int16))
    assert torch.equal(l0[:whole_rows].view(torch.int32), l1[:whole_rows].view(torch.int32))
    assert not torch.equal(o0[whole_rows:].view(torch.int16), o1[whole_rows:].view(torch.int16))
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(_kmax(main, extra), out1, ref_out, lse=(lse1, ref_lse))


def test_decode_tail_split_cuda_graph(seed):
    """The plan follows the shape only: one CUDA graph of a tail-split call (h128 b74 C4A,
    8 pieces a tail unit) replayed with shorter lengths matches the reference of those."""
    gen = torch.Generator(DEV).manual_seed(seed)
    b, h = 74, 128
    q, main, extra, sink = decode_case(b, 1, h, "c4a1024", gen)
    out = torch.empty((b, 1, h, 512), dtype=torch.bfloat16, device=DEV)
    lse = torch.empty((b, h, 1), dtype=torch.float32, device=DEV)
    with _forcing_sm90a("sparse_decode", _tail_config(h, b, 1, "c4a")):
        sparse_decode(q, *main, SCALE, sink, *extra, out=out, lse=lse)  # the plan and scratch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sparse_decode(q, *main, SCALE, sink, *extra, out=out, lse=lse)
        for _ in range(2):
            for lens in (main[2], extra[2]):
                shorter = (torch.rand(lens.shape, generator=gen, device=DEV)
                           * (lens.float() + 1)).floor().to(torch.int32)
                lens.copy_(shorter)
            out.fill_(math.nan)
            lse.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
            check_attention(_kmax(main, extra), out, ref_out, lse=(lse, ref_lse))


@pytest.mark.parametrize("h,b,s_q,extra_kind,tail", [
    (128, 74, 1, "c4a1024", True), (128, 74, 2, "c4a1024", True),
    (128, 64, 1, "c4a1024", False), (128, 128, 1, "c4a1024", False),
    (128, 100, 1, "c4a1024", False),
], ids=lambda v: str(v))
def test_decode_tail_split_routed(h, b, s_q, extra_kind, tail, seed):
    """The routed front end (no schedule forced; bench/PERF_NOTES.md item 77): b74 / b74 s_q 2
    run the tail-split grid, against the reference from poisoned outputs; b64 / b128 / b100
    (one piece a unit on 132 SMs) run the shipped variant: bitwise main's routing (its
    bucket's config with tail_split off, forced)."""
    import importlib

    assert torch.cuda.get_device_properties(DEV).multi_processor_count == 132, "an H100/H200"
    sd = importlib.import_module("dsv4_tl.ops.sparse_decode")
    gen = torch.Generator(DEV).manual_seed(seed)
    q, main, extra, sink = decode_case(b, s_q, h, extra_kind, gen)
    _poisoned_decode(q, main, extra, sink)
    # (again: a plan whose making loaded a kernel was stored into the cache that the load
    # emptied, PlanCache.clear; the second call's plan stays)
    out, lse = _poisoned_decode(q, main, extra, sink)
    grids = {p.tail for p in list(sd._PLANS.plans.values()) if p.out_shape == tuple(out.shape)}
    assert grids == {tail}, grids
    ref_out, ref_lse = sparse_decode_ref(q, *main, SCALE, sink, *extra)
    check_attention(_kmax(main, extra), out, ref_out, lse=(lse, ref_lse))
    if not tail:
        with _forcing_sm90a("sparse_decode", {**_tail_config(h, b, s_q, "c4a"),
                                              "tail_split": False}):
            out0, lse0 = _poisoned_decode(q, main, extra, sink)
        assert torch.equal(out.view(torch.int16), out0.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), lse0.view(torch.int32))
