"""Which sm_90a decode schedule a call gets, read from the shipped schedule file and tuning
logs (no GPU): the routing rules the schedule notes state."""

import json
import warnings

import pytest

pytest.importorskip("tilelang")


@pytest.mark.parametrize("scope", ["swa", "c4a", "c128a"])
@pytest.mark.parametrize("ctas", [1, 8, 16, 17, 24, 33, 34, 50, 66, 67, 128, 256])
def test_eight_heads_take_tokens_in_m_at_every_batch(scope, ctas):
    """8 heads (V4-Flash at TP8) never run the 64-head tile with 56 padded heads: tokens in M
    in every CTA range (b 17-33 fell through to the 64-head buckets)."""
    from dsv4_tl import schedules

    schedules.clear_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = schedules.schedule_for("cuda_sm90a", "sparse_decode", ctas=ctas, h=8, scope=scope,
                                        width=1024)
    assert config.get("tokens_in_m") and config.get("heads_per_block") == 8, (scope, ctas, config)


@pytest.mark.parametrize("h,b,scope,width,splits", [
    # widths 513-1024 (36 tiles of 32 tokens with the window): 9 splits of 4 tiles while
    # they fit one wave (<= 14 CTAs), else the 1-16-CTA bucket's 8
    (128, 1, "c4a", 1024, 9), (128, 7, "c128a", 1024, 9), (128, 8, "c4a", 1024, 8),
    (64, 1, "c128a", 1024, 9), (64, 14, "c4a", 1024, 9), (64, 15, "c128a", 1024, 8),
    (32, 8, "c128a", 1024, 9), (32, 15, "c128a", 1024, 8),
    # h64 C4A widths 1-512 (20 tiles): 10 splits of 2 tiles up to 13 CTAs
    (64, 1, "c4a", 512, 10), (64, 13, "c4a", 512, 10), (64, 14, "c4a", 512, 8),
    # other widths and head counts keep 8
    (128, 1, "c4a", 512, 8), (16, 1, "c128a", 1024, 8), (64, 1, "c128a", 256, 8),
])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_split_counts_by_tile_pairs(h, b, scope, width, splits, batch_invariant):
    """The fixed grid's split counts at few CTAs (bench/PERF_NOTES.md item 87): a split's
    critical path is its tile pairs, so the 36-tile rows take 9 splits and h64 C4A 512 10
    where that stays within 132 SMs; batch-invariant calls (width counted 0) keep the
    1-16-CTA bucket's 8 whatever the width."""
    from dsv4_tl.kernels import SPARSE_DECODE
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = call_schedule(SPARSE_DECODE, parse_target("cuda:sm_90a"), h=h, b=b, s_q=1,
                               scope=scope, batch_invariant=batch_invariant, extra_width=width)
    assert config["num_splits"] == (8 if batch_invariant else splits), config


@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
def test_batch_invariant_calls_take_one_schedule_whatever_the_batch(h):
    """batch_invariant=True resolves one schedule per head count and scope for every batch
    size and s_q (that is what keeps a row's rounding independent of the batch): SWA-only the
    largest-batch bucket's (one split: stored directly, no combine), with a compressed scope
    the smallest-batch bucket's (its split-KV); and never the default's schedule at b 1 for
    SWA when that one splits."""
    from dsv4_tl.kernels import SPARSE_DECODE
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    target = parse_target("cuda:sm_90a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scope, width in (("swa", 0), ("c4a", 512), ("c128a", 8192)):
            seen = {json.dumps(call_schedule(SPARSE_DECODE, target, h=h, b=b, s_q=s_q, scope=scope,
                                             batch_invariant=True, extra_width=width),
                               sort_keys=True)
                    for b in (1, 8, 20, 40, 100, 256) for s_q in (1, 2, 6)}
            assert len(seen) == 1, (scope, seen)
            (config,) = (json.loads(c) for c in seen)
            if scope == "swa":
                full = call_schedule(SPARSE_DECODE, target, h=h, b=4096, s_q=1, scope=scope)
                assert config == json.loads(json.dumps(full)), (config, full)
                assert config["num_splits"] == 1, config
                assert not config["persistent"], config
            else:
                small = call_schedule(SPARSE_DECODE, target, h=h, b=1, s_q=1, scope=scope)
                assert config == json.loads(json.dumps(small)), (config, small)


# ------------------------------------------------------------------------------ metadata
# Every kernel the scheduler-metadata path loads (sparse_decode_metadata's plan_only variant,
# sparse_decode(metadata=)'s plan_from_metadata variant and its clamp_slots combine) is one
# `dsv4-tl build` ships (kernels.KernelSpec.aot_schedules), so the path runs with JIT off
# (bench/PERF_NOTES.md item 73). The front end runs on CPU tensors here, as on an H200
# (cuda:sm_90a, 132 SMs), its kernel loads recorded instead of made.
_METADATA_CALLS = [
    # (h, b, s_q, scope, extra width): the sm_90a persistent buckets, item and tile balance
    (64, 2, 1, "c128a", 4096), (64, 32, 1, "c128a", 4096), (128, 2, 1, "c128a", 8192),
    (128, 128, 1, "c128a", 8192), (64, 3, 2, "c128a", 8192), (8, 20, 1, "c4a", 512),
    (16, 40, 1, "c4a", 512), (32, 48, 1, "c4a", 1024),
    # no persistent grid: [0, 0] metadata, the plain kernels
    (64, 4, 1, "c4a", 512), (64, 64, 1, "swa", 0), (8, 4, 1, "c128a", 1024),
]


@pytest.fixture
def recorded_loads(monkeypatch):
    import importlib

    import torch

    from dsv4_tl import loader as L
    from dsv4_tl.kernels import Variant
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    sd = importlib.import_module("dsv4_tl.ops.sparse_decode")
    loads, launches = [], []

    def resolve_with(spec, target, schedule, **call):
        variant = Variant.make(spec.op, spec.static(**call), schedule)
        loads.append(variant)
        return lambda *args: launches.append((variant, args))

    def resolve(spec, target, **call):
        schedule = call_schedule(spec, target, **call)
        return resolve_with(spec, target, schedule, **call), schedule

    monkeypatch.setattr(sd, "_target", lambda device: parse_target("cuda:sm_90a"))
    monkeypatch.setattr(sd, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sd, "check_kernel_device", lambda name, t: None)
    monkeypatch.setattr(sd, "recheck_device", lambda name, t: None)
    monkeypatch.setattr(sd, "resolve_with", resolve_with)
    monkeypatch.setattr(sd, "resolve", resolve)
    L.clear_loaders()  # (and the memoised plans)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks
        yield sd, loads, launches, torch
    L.clear_loaders()


def test_metadata_path_loads_only_built_variants(recorded_loads):
    from dsv4_tl.build import build_variants

    sd, loads, launches, torch = recorded_loads
    built = {v.key for v in build_variants("cuda:sm_90a", (8, 16, 32, 64, 128))}
    default_built = {v.key for v in build_variants("cuda:sm_90a")}  # heads 64 and 128
    kinds, whole_rows = set(), 0
    for h, b, s_q, scope, width in _METADATA_CALLS:
        u8, i32 = torch.uint8, torch.int32
        q = torch.zeros((b, s_q, h, 512), dtype=torch.bfloat16)
        args = [q, torch.zeros((8, 64, 1, 584), dtype=u8),
                torch.zeros((b, s_q, 128), dtype=i32), torch.full((b,), 100, dtype=i32)]
        if scope != "swa":
            args += [torch.zeros((64, 2 if scope == "c128a" else 64, 1, 584), dtype=u8),
                     torch.zeros((b, s_q, width), dtype=i32), torch.full((b,), width, dtype=i32)]
        del loads[:], launches[:]
        words = sd.sparse_decode_metadata(*args)
        persistent = words.numel() > 0
        assert words.dtype == torch.int32 and words.dim() == 2
        sd.sparse_decode(*args[:4], None, None, *args[4:], metadata=words)
        for v in loads:
            assert v.key in built, f"{(h, b, s_q, scope, width)}: {v.key} {dict(v.schedule)}"
            if h in (64, 128):
                assert v.key in default_built
            s = dict(v.schedule)
            kind = ("plan_only" if s.get("plan_only") else "plan_from_metadata"
                    if s.get("plan_from_metadata") else "clamp_slots"
                    if s.get("clamp_slots") else "plain")
            kinds.add(kind)
            # the metadata variants only on the persistent grid
            assert persistent or kind == "plain"
        if persistent:
            ops_loaded = [dict(v.schedule) for v in loads]
            assert any(s.get("plan_only") for s in ops_loaded)
            decode = [v for v, _ in launches if v.op == "sparse_decode"]
            # the plan-only launch, then the decode reading the metadata where the rows'
            # head groups fill at most half of the 132 SMs; beyond, the decode that plans
            # itself (the grid walks whole rows: run 105, bench/PERF_NOTES.md item 73)
            assert [dict(v.schedule).get("plan_only", False) for v in decode] == [True, False]
            reads = 2 * b * s_q * -(-h // 64) <= 132
            assert bool(dict(decode[1].schedule).get("plan_from_metadata")) == reads
            assert any(args[-1] is words for _, args in launches[-2:]) == reads
            whole_rows += not reads
    assert kinds == {"plain", "plan_only", "plan_from_metadata", "clamp_slots"}
    assert whole_rows == 1  # (h128 b128: the metadata checked and not read)


# ------------------------------------------------------------------------------ tail split
# The tail-split grid (bench/PERF_NOTES.md item 77, run 107) routed in the sm_90a >= 67-CTA
# buckets of the lean split consumers, h64 C4A and h128 C4A / C128A: calls whose plan cuts
# the tail into pieces run it; calls of one piece a unit (whole waves, fewer units than SMs,
# a tail of more than half a wave) run the shipped variant, tail_split off, as do padded head
# groups, batch-invariant calls and the buckets left off. (h, b, s_q, scope, width, plan or
# None for the shipped variant; plans of a 132-SM H200)
_TAIL_CALLS = [
    (128, 74, 1, "c4a", 1024, (132, 8)), (128, 74, 2, "c4a", 1024, (264, 4)),
    (128, 67, 1, "c4a", 1024, (132, 18)), (128, 74, 1, "c128a", 1024, (132, 8)),
    (64, 150, 1, "c4a", 512, (132, 7)), (64, 74, 2, "c4a", 512, (132, 8)),
    (64, 150, 1, "c128a", 1024, (132, 7)), (64, 32, 6, "c128a", 1024, (132, 2)),
    # one piece a unit: b64 (128 units < 132 SMs), b128 (two whole waves), b100 (68 tail
    # units: one piece each), h64 b200
    (128, 64, 1, "c4a", 1024, None), (128, 128, 1, "c4a", 1024, None),
    (128, 100, 1, "c4a", 1024, None), (64, 200, 1, "c4a", 512, None),
    # not routed: padded head groups (h96), the long-C128A persistent bucket, fewer than 67
    # CTAs
    (96, 74, 1, "c4a", 1024, None),
    (128, 74, 1, "c128a", 4096, None), (128, 20, 1, "c4a", 1024, None),
]


def _decode_args(torch, h, b, s_q, scope, width):
    u8, i32 = torch.uint8, torch.int32
    return [torch.zeros((b, s_q, h, 512), dtype=torch.bfloat16),
            torch.zeros((8, 64, 1, 584), dtype=u8), torch.zeros((b, s_q, 128), dtype=i32),
            torch.full((b,), 100, dtype=i32),
            torch.zeros((64, 2 if scope == "c128a" else 64, 1, 584), dtype=u8),
            torch.zeros((b, s_q, width), dtype=i32), torch.full((b,), width, dtype=i32)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_tail_split_routing(recorded_loads, batch_invariant):
    """b74 / b74 s_q 2 (and the other ragged rows of runs 107 / 114) launch the tail-split variant
    with their plan's grid (``tiles_per_split`` = pieces, ``num_ctas`` = whole + tail units x
    pieces) and the combine of pow2(pieces) splits; b64 / b128 / b100 (one piece a unit)
    launch the shipped variant (tail_split off: its bucket's config, the kernel of before the
    knob) on the fixed grid, stored directly; batch-invariant calls never take the tail grid.
    Every variant loaded is one ``dsv4-tl build`` ships at its default heads."""
    from dsv4_tl import schedules
    from dsv4_tl.build import build_variants
    from dsv4_tl.kernels import SPARSE_DECODE, pow2_ceil
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    sd, loads, launches, torch = recorded_loads
    target = parse_target("cuda:sm_90a")
    built = {v.key for v in build_variants("cuda:sm_90a", (64, 96, 128))}
    routed = {b["name"]: c.get("tail_split")
              for b, c, _ in schedules.resolved_buckets("cuda_sm90a", "sparse_decode")}
    assert [n for n, on in routed.items() if on] == [
        "h64_c4a_ctas67_up", "h64_c128a_ctas67_up", "h128_c4a_ctas67_up", "h128_c128a_ctas67_up"]
    tails = 0
    for h, b, s_q, scope, width, plan in _TAIL_CALLS:
        row = (h, b, s_q, scope, width)
        del loads[:], launches[:]
        sd.sparse_decode(*_decode_args(torch, h, b, s_q, scope, width)[:4], None, None,
                         *_decode_args(torch, h, b, s_q, scope, width)[4:],
                         batch_invariant=batch_invariant)
        (decode,) = [v for v in loads if v.op == "sparse_decode"]
        assert all(v.key in built for v in loads), row
        schedule = dict(decode.schedule)
        bucket = dict(call_schedule(SPARSE_DECODE, target, h=h, b=b, s_q=s_q, scope=scope,
                                    batch_invariant=batch_invariant, extra_width=width))
        (args,) = [a for v, a in launches if v.op == "sparse_decode"]
        combines = [v for v, _ in launches if v.op == "sparse_decode_combine"]
        if plan is not None and not batch_invariant:
            whole, pieces = plan
            units = b * s_q * h // 64
            assert schedule.get("tail_split") is True, row
            assert tuple(args[-2:]) == (pieces, whole + (units - whole) * pieces), row
            assert [dict(v.static)["num_splits"] for v in combines] == [pow2_ceil(pieces)], row
            tails += 1
            continue
        assert not schedule.get("tail_split"), row
        if not batch_invariant:
            # the bucket's config with the knob off: bitwise the kernel of before it
            assert schedule == {k: v for k, v in {**bucket, "tail_split": False}.items()
                                if k not in SPARSE_DECODE.plan_knobs}, row
        if not schedule.get("persistent") and schedule["num_splits"] == 1:
            assert tuple(args[-2:]) == (0, 0) and not combines, row  # the fixed grid, direct
    assert tails == (0 if batch_invariant else 8)
