"""Launch plans of the front ends and the op specs they resolve through (no GPU needed).

The kernels are replaced by recording stand-ins (a loader whose kernels log their calls) and
CPU tensors are routed to the SYCL target (``$DSV4_TL_SYCL_DEVICE``), so what is tested is
the front ends' own work: one plan per input signature, re-made after any change of the
kernels, the same errors on every call, kernel arguments filled by name.
"""

import gc
import importlib
import math

import pytest
import torch

import dsv4_tl
from dsv4_tl import kernels, loader, schedules
from dsv4_tl.cache_format import alloc_k_cache
from dsv4_tl.kernels import KERNELS, SPARSE_DECODE, SPARSE_PREFILL, Variant, decode_scope
from dsv4_tl.ops import _dispatch
from dsv4_tl.targets import ENV_SYCL_DEVICE, parse_target

pytestmark = pytest.mark.filterwarnings("ignore:schedule. no tuning log entry")  # sycl buckets
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
SYCL = parse_target("sycl")
decode_module = importlib.import_module("dsv4_tl.ops.sparse_decode")


class RecordingLoader:
    """Stands in for the process-wide loader: each kernel logs ``(variant, args)``."""

    def __init__(self):
        self.loaded, self.calls = [], []

    def get(self, variant):
        self.loaded.append(variant)
        return lambda *args: self.calls.append((variant, args))

    def launches(self, op: str = "sparse_decode") -> list:
        return [args for variant, args in self.calls if variant.op == op]


@pytest.fixture
def rec(monkeypatch):
    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")
    recording = RecordingLoader()
    monkeypatch.setattr(_dispatch, "loader_for", lambda target: recording)
    kernels.kernels_changed()
    yield recording
    kernels.kernels_changed()


@pytest.fixture
def plans_made(monkeypatch):
    """Counts the decode plans made (each validates and resolves once)."""
    made = []
    real = decode_module._Plan

    class Counting(real):
        def __init__(self, *args):
            made.append(args)
            super().__init__(*args)

    monkeypatch.setattr(decode_module, "_Plan", Counting)
    return made


def _decode_args(b=2, h=4, extra=True):
    args = dict(q=torch.zeros(b, 1, h, 512, dtype=BF16), k_cache=alloc_k_cache(2, 64),
                indices=torch.zeros(b, 1, 8, dtype=I32), topk_length=torch.ones(b, dtype=I32),
                softmax_scale=0.1, attn_sink=torch.zeros(h, dtype=F32))
    if extra:
        args.update(extra_k_cache=alloc_k_cache(4, 2), extra_indices=torch.zeros(b, 1, 4, dtype=I32),
                    extra_topk_length=torch.ones(b, dtype=I32))
    return args


# ---------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------
# A call of each op (the keywords of its spec).
SAMPLE_CALLS = {
    "sparse_decode": dict(h=64, b=1, scope="c4a"),
    "sparse_decode_combine": dict(h=64, num_splits=2),
    "sparse_prefill": dict(h=64, topk=128),
    "dequant_gather": dict(rows=100),
    "insert_k_cache": dict(tokens=100),
    "global_topk": dict(ragged=True),
    "combine_topk_swa": dict(),
}


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_spec_params_are_the_builders(op):
    """The spec's kernel parameters are its builder's prim_func's, in order (the front ends
    fill arguments by these names), and its entry is the prim_func's symbol."""
    pytest.importorskip("tilelang")
    spec = KERNELS[op]
    func = spec.variant("cuda_sm90a", **SAMPLE_CALLS[op]).build()
    names = [func.buffer_map[p].name if p in func.buffer_map else str(p.name) for p in func.params]
    assert tuple(names) == spec.params
    assert str(func.attrs["global_symbol"]) == spec.entry


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_spec_ties_the_names_of_each_layer(op):
    import dsv4_tl.reference as reference

    spec = KERNELS[op]
    assert spec.op == op
    for name in spec.front_ends:
        assert callable(getattr(dsv4_tl.ops, name)) and callable(getattr(dsv4_tl, name))
        assert getattr(dsv4_tl, name) is getattr(torch.ops.dsv4_tl, name).default
    for name in spec.references:
        assert callable(getattr(reference, name))
    for target_dir in ("cuda_sm90a", "cuda_sm100a", "hip_gfx942", "hip_gfx950", "sycl"):
        assert schedules.load_schedule_file(target_dir, op)["default"]
    assert {n for s in KERNELS.values() for n in s.front_ends} == set(dsv4_tl.ops.__all__)


def test_decode_features_and_static_parameters():
    call = dict(h=64, b=8, scope="c4a")
    assert SPARSE_DECODE.features("cuda_sm90a", **call) == {"ctas": 8, "h": 64, "scope": "c4a",
                                                            "width": 0}
    assert SPARSE_DECODE.features("cuda_sm90a", **call, extra_width=8192)["width"] == 8192
    assert SPARSE_DECODE.features("cuda_sm90a", **dict(call, h=128, s_q=2))["ctas"] == 32
    assert SPARSE_DECODE.features("cuda_sm90a", **call, batch_invariant=True)["ctas"] == 1
    assert SPARSE_DECODE.static(**call) == dict(num_heads=64, has_extra=True, fp8_format="e4m3fn")
    assert [decode_scope(bs) for bs in (None, 2, 1, 64)] == ["swa", "c128a", "c128a", "c4a"]
    assert SPARSE_PREFILL.features("sycl", h=64, topk=300, ragged=True) == {"h": 64, "topk": 512}
    assert SPARSE_PREFILL.features("sycl", h=64, topk=300) == {"h": 64, "topk": 300}
    assert KERNELS["dequant_gather"].features("sycl", rows=1000) == {"rows": 1024}
    assert KERNELS["insert_k_cache"].features("sycl", tokens=1) == {"tokens": 1}


def test_feature_names_are_what_features_yield_and_what_buckets_match_on():
    """``KernelSpec.feature_names`` (what ``raw_kernel`` accepts) is exactly what each op's
    ``features`` yields, and every bucket of every target's schedule file matches on those
    only (issue 34 item 7: misspelled features were silently ignored)."""
    from dsv4_tl.schedules import load_schedule_file

    calls = {"sparse_decode": dict(h=64, b=8, scope="c4a"),
             "sparse_prefill": dict(h=64, topk=300), "dequant_gather": dict(rows=10),
             "insert_k_cache": dict(tokens=3)}
    for op, spec in KERNELS.items():
        yielded = spec.features("cuda_sm90a", **calls.get(op, {}))
        assert sorted(yielded) == sorted(spec.feature_names), op
        for target_dir in ("cuda_sm90a", "cuda_sm100a", "hip_gfx942", "hip_gfx950", "sycl"):
            for bucket in load_schedule_file(target_dir, op).get("buckets", []):
                assert set(bucket["match"]) <= set(spec.feature_names), (target_dir, op, bucket)


def test_decode_width_routes_long_c128a_only():
    """The bucket feature ``width`` (the extra scope's index width): C128A at 64 / 128 heads with
    widths >= 4096 takes the persistent grid (bench/PERF_NOTES.md item 53); narrower widths, C4A,
    padded head counts and batch-invariant calls (whose schedule must not follow the batch's
    padded width) keep the buckets they had."""
    from dsv4_tl.schedules import bucket_index, load_schedule_file

    names = [b["name"] for b in load_schedule_file("cuda_sm90a", "sparse_decode")["buckets"]]

    def bucket(**call):
        index = bucket_index("cuda_sm90a", "sparse_decode",
                             **SPARSE_DECODE.features("cuda_sm90a", **call))
        return names[index]

    long = dict(h=64, b=32, scope="c128a")
    assert bucket(**long, extra_width=4096) == "h64_c128a_long_ctas17_up"
    assert bucket(**long, extra_width=4095) == "h64_c128a_ctas17_33"
    assert bucket(**dict(long, b=2), extra_width=8192) == "h64_c128a_long_ctas1_16"
    assert bucket(**dict(long, h=128), extra_width=8192) == "h128_c128a_long_ctas17_up"
    assert bucket(**dict(long, scope="c4a"), extra_width=8192) == "h64_c4a_ctas17_33"
    for h in (48, 96):  # padded head groups: not the persistent grid's
        assert "_long_" not in bucket(**dict(long, h=h), extra_width=8192)
    assert (bucket(**long, extra_width=8192, batch_invariant=True)
            == bucket(**long, extra_width=1024, batch_invariant=True) == "h64_c128a_ctas1_16")


def test_admits_relates_buckets_to_static_parameters():
    match = {"h": [1, 65], "scope": ["swa"], "ctas": [1, 17]}
    assert SPARSE_DECODE.admits(match, dict(num_heads=64, has_extra=False))
    assert not SPARSE_DECODE.admits(match, dict(num_heads=128, has_extra=False))
    assert not SPARSE_DECODE.admits(match, dict(num_heads=64, has_extra=True))
    assert SPARSE_DECODE.admits({"h": [65, None], "scope": ["c4a", "c128a"]},
                                dict(num_heads=128, has_extra=True))
    assert SPARSE_PREFILL.admits({"h": [1, 65], "topk": [1, 257]}, dict(num_heads=8, ragged=True))
    assert KERNELS["dequant_gather"].admits({"rows": [1, 16384]}, dict(fp8_format="e4m3fn"))


def test_the_front_end_runs_the_variant_its_spec_names(rec):
    args = _decode_args(b=3, h=4)
    dsv4_tl.ops.sparse_decode(**args)
    want = SPARSE_DECODE.variant("sycl", h=4, b=3, scope="c128a")
    assert rec.calls[0][0] == want
    assert Variant.make("sparse_decode", SPARSE_DECODE.static(h=4, scope="c128a"),
                        dict(want.schedule)) == want


# ---------------------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------------------
def test_one_plan_per_signature(rec, plans_made):
    args = _decode_args()
    for _ in range(3):
        dsv4_tl.ops.sparse_decode(**args)
    assert len(plans_made) == 1 and len(rec.launches()) == 3
    dsv4_tl.sparse_decode(*args.values())  # the custom op runs the same front end
    assert len(plans_made) == 1 and len(rec.launches()) == 4
    dsv4_tl.ops.sparse_decode(**dict(args, q=torch.zeros(2, 1, 4, 512, dtype=BF16)))  # new data
    assert len(plans_made) == 1
    dsv4_tl.ops.sparse_decode(**_decode_args(b=3))  # another batch: another signature
    assert len(plans_made) == 2
    dsv4_tl.ops.sparse_decode(**dict(args, softmax_scale=0.2))  # scalars are in the signature
    dsv4_tl.ops.sparse_decode(**dict(args, attn_sink=None))
    assert len(plans_made) == 4


@pytest.mark.parametrize("change", ["kernels_changed", "clear_caches", "forced", "loader",
                                    "cache_clear"])
def test_a_change_of_kernels_drops_the_plans(rec, plans_made, change):
    args = _decode_args()
    dsv4_tl.ops.sparse_decode(**args)
    before = len(rec.loaded)
    if change == "kernels_changed":
        kernels.kernels_changed()
    elif change == "clear_caches":
        schedules.clear_caches()  # a swapped or edited tuning log
    elif change == "loader":
        loader.KernelLoader("sycl")  # another loader (tune swaps one in)
    elif change == "cache_clear":
        _dispatch._loaded.cache_clear()  # what tests and tune did so far
    if change == "forced":
        schedule = dict(rec.calls[0][0].schedule)
        with schedules.forced_schedule("sycl", "sparse_decode", dict(schedule, num_splits=2)):
            dsv4_tl.ops.sparse_decode(**args)
        assert dict(rec.calls[-2][0].schedule)["num_splits"] == 2  # then the combine
        assert rec.calls[-1][0].op == "sparse_decode_combine"
    else:
        dsv4_tl.ops.sparse_decode(**args)
    assert len(plans_made) == 2 and len(rec.loaded) > before  # re-validated, re-resolved
    dsv4_tl.ops.sparse_decode(**args)
    assert rec.calls[-1][0] == rec.calls[0][0] or rec.calls[-2][0] == rec.calls[0][0]


def test_a_plan_resolves_its_schedule_once(rec, monkeypatch):
    """Issue 34 item 4: a decode plan derived the call's features (and with them the default
    schedule's heads per CTA) and looked up the bucket's schedule twice, once to check the
    schedule and once to load the kernel, and a batch-invariant call on the tile balance
    loaded the tile balance's kernel before the item balance's it runs. Each is resolved once
    per plan now, the kernel loaded with the schedule the plan checked; a plan's later calls
    resolve nothing."""
    resolved = []
    schedule_for, schedule_of = schedules.schedule_for, _dispatch._schedule_of

    def counting_schedule_for(target_dir, op, **features):
        resolved.append(("schedule_for", op))
        return schedule_for(target_dir, op, **features)

    def counting_schedule_of(op, target, features):
        resolved.append(("bucket", op))
        return schedule_of(op, target, features)

    monkeypatch.setattr(schedules, "schedule_for", counting_schedule_for)
    monkeypatch.setattr(_dispatch, "_schedule_of", counting_schedule_of)
    for b in (2, 3):  # two signatures: a plan each
        resolved.clear()
        dsv4_tl.ops.sparse_decode(**_decode_args(b=b))
        for step in ("schedule_for", "bucket"):
            assert resolved.count((step, "sparse_decode")) == 1, resolved
        assert resolved.count(("bucket", "sparse_decode_combine")) <= 1, resolved
    resolved.clear()
    dsv4_tl.ops.sparse_decode(**_decode_args(b=3))  # the plan's second call
    assert resolved == []
    default = schedules.load_schedule_file("sycl", "sparse_decode")["default"]
    rec.loaded.clear()
    with schedules.forced_schedule("sycl", "sparse_decode",
                                   {**default, "num_splits": 2, "balance": "tiles"}):
        dsv4_tl.ops.sparse_decode(**_decode_args(), batch_invariant=True)
    assert [(v.op, dict(v.schedule).get("balance")) for v in rec.loaded] == [
        ("sparse_decode", "items"), ("sparse_decode_combine", None)]


# One decode call in a fresh process, its CPU tensors planned as on an H100/H200 (the shipped
# sm_90a schedules and tuning logs) with recording kernels; prints what it imported.
_FIRST_DECODE_CALL = """
import json, sys
import torch
import dsv4_tl
from dsv4_tl import tuning_log
from dsv4_tl.cache_format import alloc_k_cache
from dsv4_tl.ops import _dispatch
from dsv4_tl.targets import parse_target

checked, launched = [], []
invalid_reason = tuning_log.invalid_reason
tuning_log.invalid_reason = lambda *args: checked.append(args[:2]) or invalid_reason(*args)


class Recording:
    def get(self, variant):
        return lambda *args: launched.append(variant.op)


_dispatch.target_for_device = lambda device: parse_target("cuda:sm_90a")
_dispatch.loader_for = lambda target: Recording()
b, h, i32 = 2, 64, torch.int32
dsv4_tl.sparse_decode(torch.zeros(b, 1, h, 512, dtype=torch.bfloat16), alloc_k_cache(2, 64),
                      torch.zeros(b, 1, 8, dtype=i32), torch.ones(b, dtype=i32), 0.1,
                      torch.zeros(h, dtype=torch.float32), alloc_k_cache(4, 64),
                      torch.zeros(b, 1, 4, dtype=i32), torch.ones(b, dtype=i32))
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("dsv4_tl")),
                  "checked": checked, "launched": launched}))
"""


def test_the_first_call_imports_neither_the_tuner_nor_the_command_line(monkeypatch):
    """Issue 34 item 4: a decode call's first plan read the tuning log, whose entries are
    checked against the schedule's rules, and imported them from the tuner
    (``dsv4_tl.tune.resources``), which imports its command line, the ``dsv4-tl`` command's
    helpers and the bench: the rules live in a leaf now (``dsv4_tl.schedule_rules``)."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")  # CPU tensors pass the device check
    monkeypatch.delenv("DSV4_TL_TUNING_LOGS", raising=False)  # the shipped logs
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _FIRST_DECODE_CALL],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["launched"][0] == "sparse_decode"
    # the logged best of the call's bucket was checked against the rules (what imported the tuner)
    assert ["cuda_sm90a", "sparse_decode"] in seen["checked"]
    assert "dsv4_tl.schedule_rules" in seen["modules"]
    unwanted = [m for m in seen["modules"]
                if m.startswith(("dsv4_tl.tune", "dsv4_tl.cli", "dsv4_tl.bench"))]
    assert unwanted == []


def test_plans_are_bounded():
    cache = _dispatch.PlanCache(maxsize=3)
    for i in range(5):
        cache.make(i, lambda: i)
    assert list(cache.plans) == [2, 3, 4]
    cache.make(None, lambda: 9)  # no signature: used once, not stored
    assert list(cache.plans) == [2, 3, 4]
    kernels.kernels_changed()
    assert cache.plans == {}


def test_errors_are_raised_on_every_call(rec, plans_made, monkeypatch):
    args = _decode_args()
    dsv4_tl.ops.sparse_decode(**args)
    buf = torch.zeros(2 * 4 * 512 + 8, dtype=BF16)
    misaligned = buf[1:4097].view(2, 1, 4, 512)
    aligned = buf[8:].view(2, 1, 4, 512)
    for _ in range(2):  # data-dependent: checked per call, plan or not
        with pytest.raises(ValueError, match="^out: expected a 16-byte aligned start"):
            dsv4_tl.ops.sparse_decode(**args, out=misaligned)
    dsv4_tl.ops.sparse_decode(**args, out=aligned)
    for _ in range(2):  # another signature that fails validation never gets a plan
        with pytest.raises(TypeError, match="^indices: expected dtype torch.int32"):
            dsv4_tl.ops.sparse_decode(**dict(args, indices=torch.zeros(2, 1, 8, dtype=torch.int64)))
        with pytest.raises(TypeError, match="^batch_invariant: expected a bool, got int"):
            dsv4_tl.ops.sparse_decode(**args, batch_invariant=1)  # == False, but no bool
        with pytest.raises(TypeError, match="^softmax_scale: expected a real number, got bool"):
            dsv4_tl.ops.sparse_decode(**dict(args, softmax_scale=True))  # == 1
        with pytest.raises(ValueError, match="^softmax_scale: expected a finite value"):
            dsv4_tl.ops.sparse_decode(**dict(args, softmax_scale=math.nan))
        with pytest.raises(TypeError, match="^q: expected a torch.Tensor, got list"):
            dsv4_tl.ops.sparse_decode(**dict(args, q=[1, 2]))
        with pytest.raises(TypeError, match="^fp8_format: expected str, got list"):
            dsv4_tl.ops.sparse_decode(**args, fp8_format=["e4m3fn"])  # unhashable
    monkeypatch.delenv(ENV_SYCL_DEVICE)  # CPU tensors are routed by the environment
    with pytest.raises(ValueError, match="^q: expected a CUDA, ROCm or XPU device, got cpu"):
        dsv4_tl.ops.sparse_decode(**args)
    cache = args["k_cache"]
    shifted = torch.zeros(cache.numel() + 16, dtype=torch.uint8)[16:].view(cache.shape)
    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")
    dsv4_tl.ops.sparse_decode(**dict(args, k_cache=shifted))  # same signature, other data
    with pytest.raises(ValueError, match="^k_cache: the cache must start on a 16-byte boundary"):
        dsv4_tl.ops.sparse_decode(**dict(args, k_cache=torch.zeros(
            cache.numel() + 8, dtype=torch.uint8)[4:-4].view(cache.shape)))


def test_metadata_errors_name_the_argument(rec):
    """``ops.sparse_decode_metadata`` refuses bad arguments as ``sparse_decode`` does: one line
    naming the argument, also where the plan cache's key cannot be built from it."""
    args = {k: v for k, v in _decode_args().items() if k not in ("softmax_scale", "attn_sink")}
    assert dsv4_tl.ops.sparse_decode_metadata(**args).shape == (0, 0)  # no persistent grid
    for _ in range(2):  # a failed call leaves no plan behind
        with pytest.raises(TypeError, match="^q: expected a torch.Tensor, got list"):
            dsv4_tl.ops.sparse_decode_metadata(**dict(args, q=[1, 2]))
        with pytest.raises(TypeError, match="^batch_invariant: expected a bool, got list"):
            dsv4_tl.ops.sparse_decode_metadata(**args, batch_invariant=[1])  # unhashable
        with pytest.raises(TypeError, match="^fp8_format: expected str, got list"):
            dsv4_tl.ops.sparse_decode_metadata(**args, fp8_format=["e4m3fn"])


def test_per_call_data_reaches_the_kernel(rec):
    args = _decode_args(extra=False)
    dsv4_tl.ops.sparse_decode(**args)
    q2 = torch.ones(2, 1, 4, 512, dtype=BF16)
    cache2 = alloc_k_cache(2, 64)
    dsv4_tl.ops.sparse_decode(**dict(args, q=q2, k_cache=cache2))
    first, second = rec.launches()[0], rec.launches()[-1]
    params = SPARSE_DECODE.params
    assert second[params.index("Q")] is q2
    assert second[params.index("MainU8")].data_ptr() == cache2.data_ptr()
    assert first[params.index("MainU8")].data_ptr() == args["k_cache"].data_ptr()
    assert second[params.index("sm_scale")] == 0.1
    assert second[params.index("main_block_size")] == 64
    # q not starting on a 16-byte boundary reaches the kernel as an aligned copy
    buf = torch.zeros(2 * 4 * 512 + 8, dtype=BF16)
    q3 = buf[1:4097].view(2, 1, 4, 512)
    dsv4_tl.ops.sparse_decode(**dict(args, q=q3))
    passed = rec.launches()[-1][params.index("Q")]
    assert passed.data_ptr() % 16 == 0 and torch.equal(passed, q3)


@pytest.mark.parametrize("make", [lambda: alloc_k_cache(2, 64),  # a view of its pool
                                  lambda: torch.zeros((2, 64, 584), dtype=torch.uint8)],
                         ids=["view", "plain"])
def test_cache_views_follow_the_cache(rec, make):
    cache = make()
    span = cache.numel()
    dtypes = (torch.float8_e4m3fn, torch.bfloat16, torch.uint8)
    views = _dispatch.cache_views(cache, span, dtypes, "{ptr}")
    assert _dispatch.cache_views(cache, span, dtypes, "{ptr}") is views  # memoised
    assert views[2].data_ptr() == cache.data_ptr() and views[1].dtype == torch.bfloat16
    key = (id(cache), span, dtypes)
    assert key in _dispatch._views
    del cache, views
    gc.collect()
    assert key not in _dispatch._views  # dropped with the tensor (the memo does not keep it)


def test_reshaped_views_are_memoised_per_tensor_and_dropped_with_it():
    kv = torch.randn(64, 1, 512)
    view = _dispatch.reshaped(kv, (64, 512))
    assert _dispatch.reshaped(kv, (64, 512)) is view and view.data_ptr() == kv.data_ptr()
    other = torch.randn(64, 1, 512)
    assert _dispatch.reshaped(other, (64, 512)) is not view  # another tensor: its own view
    key = (id(kv), (64, 512))
    assert key in _dispatch._reshaped
    del kv, view
    gc.collect()
    assert key not in _dispatch._reshaped
    strided = torch.randn(64, 2, 512)[:, :1]  # not contiguous: a copy, never memoised
    copy = _dispatch.reshaped(strided, (64, 512))
    assert torch.equal(copy, strided.reshape(64, 512)) and (id(strided), (64, 512)) not in \
        _dispatch._reshaped


def test_stream_scratch_per_stream_and_thread_grown_and_not_pooled_when_large(monkeypatch):
    """The scratch's bookkeeping (on CPU tensors, the CUDA stream query stubbed): one buffer
    per (device, stream, thread), views reused while it stays, a larger need replaces it by
    the next power of two, oversized scratch is allocated per call, a capture gets its own."""
    import threading

    stream = {"now": 1}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream["now"],
                        raising=False)
    capture = {"on": False}
    monkeypatch.setattr(_dispatch, "capturing", lambda device: capture["on"])
    scratch = _dispatch.StreamScratch()
    dev = torch.device("cpu")
    small = ((2, 3, 5), (7,))
    a = scratch.views(dev, small)
    assert [t.shape for t in a] == [(2, 3, 5), (7,)] and scratch.views(dev, small) is a
    assert a[1].data_ptr() - a[0].data_ptr() == 32 * 4  # 30 floats, next view 16-byte aligned
    stream["now"] = 2
    b = scratch.views(dev, small)
    assert b[0].data_ptr() != a[0].data_ptr() and len(scratch.pools) == 2
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(scratch.views(dev, small)))
    worker.start()
    worker.join()
    assert other_thread[0][0].data_ptr() not in (a[0].data_ptr(), b[0].data_ptr())
    stream["now"] = 1
    big = scratch.views(dev, ((100,),))
    key = (dev, 1, threading.get_ident())
    assert scratch.pools[key][0].numel() == 128 and list(scratch.pools[key][1]) == [((100,),)]
    assert scratch.views(dev, small)[0].data_ptr() == big[0].data_ptr()  # views of the new one
    huge = (((scratch.MAX_POOLED_BYTES // 4) + 1,),)
    assert scratch.views(dev, huge) is not scratch.views(dev, huge)  # per call
    assert scratch.pools[key][0].numel() == 128
    capture["on"] = True
    assert scratch.views(dev, small)[0].data_ptr() != big[0].data_ptr()
    scratch.clear()
    assert not scratch.pools



def _pooled(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a buffer the process-lifetime constant pool keeps."""
    pool = _dispatch.constants
    ptr = t.untyped_storage().data_ptr()
    return any(b.untyped_storage().data_ptr() == ptr
               for b in (*pool._buffers.values(), *pool._outgrown))


def test_constants_a_plan_passes_outlive_its_eviction_and_clear_caches(rec, monkeypatch):
    """Issue 25 item 2: what a plan passes on its own account (full lengths for
    ``topk_length=None``, the -inf sink for ``attn_sink=None``, prefill's full lengths) may
    be captured by a CUDA graph, so it must outlive the plan: plan-cache eviction and
    ``clear_caches`` must not free it (they did: a replay then read reused memory)."""
    from dsv4_tl.schedules import clear_caches

    params, p_params = SPARSE_DECODE.params, SPARSE_PREFILL.params
    monkeypatch.setattr(decode_module._PLANS, "maxsize", 1)
    args = dict(_decode_args(b=3, h=4, extra=False), topk_length=None, attn_sink=None)
    dsv4_tl.ops.sparse_decode(**args)
    dsv4_tl.ops.sparse_prefill(torch.zeros(5, 4, 512, dtype=BF16),
                               torch.zeros(6, 1, 512, dtype=BF16),
                               torch.zeros(5, 1, 8, dtype=I32), 0.1)
    d_launch, p_launch = rec.launches()[-1], rec.launches("sparse_prefill")[-1]
    lengths, sink = d_launch[params.index("MainLength")], d_launch[params.index("Sink")]
    p_lengths, p_sink = p_launch[p_params.index("Lengths")], p_launch[p_params.index("Sink")]
    # the kernels clamp every length to the row width: FULL_LENGTH means the whole row
    assert lengths.tolist() == [_dispatch.FULL_LENGTH] * 3
    assert p_lengths.tolist() == [_dispatch.FULL_LENGTH] * 5
    assert sink.tolist() == p_sink.tolist() == [-math.inf] * 4
    dsv4_tl.ops.sparse_decode(**dict(args, indices=torch.zeros(3, 1, 16, dtype=I32)))
    assert len(decode_module._PLANS.plans) == 1  # the first plan was evicted
    clear_caches()
    kept = [lengths, sink, p_lengths, p_sink]
    rec.calls.clear()
    del d_launch, p_launch, lengths, sink, p_lengths, p_sink
    gc.collect()
    assert all(_pooled(t) for t in kept)
    # growing a constant keeps the outgrown buffer too (a graph may hold it)
    small = _dispatch.full_lengths(2, torch.device("cpu"))
    _dispatch.full_lengths(4096, torch.device("cpu"))
    assert _pooled(small) and _dispatch.full_lengths(2, torch.device("cpu")).tolist() == \
        [_dispatch.FULL_LENGTH] * 2

def test_launch_fills_arguments_by_name():
    spec = KERNELS["sparse_decode_combine"]
    got = []
    launch = _dispatch.Launch(lambda *a: got.append(a), spec, ("Lse", "OPartial"), Out="o",
                              LsePartial="lp", RowSplits="rs", Sink="s")
    launch("l", "op")
    assert got == [("op", "lp", "rs", "s", "o", "l")]
    with pytest.raises(TypeError, match="do not match the kernel's parameters"):
        _dispatch.Launch(lambda *a: None, spec, ("Lse",), Out="o", LsePartial="lp", Sink="s")
    with pytest.raises(TypeError, match="do not match the kernel's parameters"):
        _dispatch.Launch(lambda *a: None, spec, spec.params, Extra=1)


def test_every_op_reuses_its_plan(rec, monkeypatch):
    """Each front end makes one plan per signature: a second call with new data of the same
    signature validates and resolves nothing and launches the same kernels."""
    from dsv4_tl.testing import random_k

    made = []
    real_make = _dispatch.PlanCache.make
    monkeypatch.setattr(_dispatch.PlanCache, "make",
                        lambda self, key, *a: made.append(key) or real_make(self, key, *a))
    gen = torch.Generator().manual_seed(0)
    ops = dsv4_tl.ops
    calls = [
        lambda: ops.sparse_prefill(torch.zeros(3, 4, 512, dtype=BF16),
                                   torch.zeros(5, 1, 512, dtype=BF16),
                                   torch.zeros(3, 1, 8, dtype=I32), 0.1),
        lambda: ops.sparse_prefill_ragged(torch.zeros(3, 4, 512, dtype=BF16),
                                          torch.zeros(5, 1, 512, dtype=BF16),
                                          torch.zeros(7, dtype=I32),
                                          torch.tensor([0, 2, 5, 7], dtype=I32), 0.1),
        lambda: ops.dequantize_and_gather_k_cache(
            torch.zeros(2, 6, 512, dtype=BF16), alloc_k_cache(4, 64),
            torch.tensor([3, 4], dtype=I32), None, torch.tensor([[0, 1], [2, 3]], dtype=I32),
            64, 1),
        lambda: ops.insert_k_cache(alloc_k_cache(4, 64), random_k(3, gen, "cpu"),
                                   torch.tensor([0, -1, 5])),
        lambda: ops.compute_global_topk_indices_and_lens(
            torch.zeros(3, 8, dtype=I32), torch.zeros(3, dtype=I32), torch.zeros(2, 2, dtype=I32),
            64, torch.ones(3, dtype=torch.bool)),
        lambda: ops.combine_topk_swa_indices(
            torch.zeros(3, 8, dtype=I32), torch.tensor([0, 3], dtype=I32),
            torch.tensor([5], dtype=I32), torch.tensor([5], dtype=I32), 4, 4, 8, 16, 8),
    ]
    for call in calls:
        made.clear()
        call()
        first = [(v, len(a)) for v, a in rec.calls]
        rec.calls.clear()
        call()
        assert len(made) == 1 and first and [(v, len(a)) for v, a in rec.calls] == first
        rec.calls.clear()


def test_host_suite_rows_run_without_a_gpu(rec):
    """``dsv4-tl bench --suite host``'s rows (and ``scripts/host_overhead.py``, which times
    them with no-op kernels) run on CPU tensors; the table reports ratios and goals."""
    from dsv4_tl.bench import HOST_GOALS, format_host_table, host_rows, host_time_us

    rows = host_rows("cpu")
    assert [shape.split()[0] for shape, _ in rows] == ["decode", "decode", "prefill", "floor:"]
    for _, calls in rows:
        for fn in calls.values():
            timing = host_time_us(fn, calls=2, repeats=2, device="cpu")
            assert timing["us"] > 0 and timing["cpu_us"] >= 0 and timing["wall_us"] is None
    entry = dict(us=20.0, us_best=19.0, cpu_us=18.0, wall_us=21.0, gpu_us=9.0)
    report = {"device": "H200", "sms": 132, "date": "today", "torch": "2", "cpu": "x86",
              "repeats": 9, "calls": 200, "goals": HOST_GOALS, "peer_errors": {},
              "rows": [{"shape": "decode", "results": [
                  dict(entry, impl="dsv4_tl.ops", vs_flashmla=0.6, meets_goal=False),
                  dict(entry, impl="flashmla", us=33.3)]}]}
    table = format_host_table(report)
    assert "0.60x  <= 0.4x NOT met" in table and "33.3" in table


def test_nothing_made_under_a_fake_mode_is_kept():
    """A FakeTensorMode (tracing) must not leave fake tensors in the caches that real calls
    reuse: the placeholders, the -inf sink, the plans (a GPU run caught a plan's fake
    placeholder being reused by a real allocation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from dsv4_tl.ops import _dispatch

    cpu = torch.device("cpu")
    with FakeTensorMode():
        assert _dispatch.faking()
        fake_placeholder = _dispatch.placeholder(cpu, torch.float32, (0, 3))
        fake_sink = _dispatch.no_sink(5, cpu)
        assert _dispatch.reusable_no_sink(5, cpu) is None
        cache = _dispatch.PlanCache()
        cache.make(("signature",), lambda: object())
        assert cache.plans == {}
    assert is_fake(fake_placeholder) and is_fake(fake_sink)
    assert not _dispatch.faking()
    assert not is_fake(_dispatch.placeholder(cpu, torch.float32, (0, 3)))
    assert not is_fake(_dispatch.no_sink(5, cpu))


def test_resolution_memos_are_bounded_by_the_buckets(rec):
    """Issue 25 item 8: the memos of resolved kernels were keyed by the raw decode CTA count
    and the dense prefill width (20,000 batch sizes left 20,000 entries); they are keyed by
    the bucket and the schedule, whatever the values."""
    target = parse_target("cuda:sm_90a")
    kernels.kernels_changed()
    for b in range(1, 3001):
        _dispatch.resolve(SPARSE_DECODE, target, h=64, b=b, s_q=1, scope="c4a")
    for width in range(1, 3001):
        _dispatch.resolve(SPARSE_PREFILL, target, h=64, topk=width)
    spec = {op: schedules.load_schedule_file(target.dirname, op)
            for op in ("sparse_decode", "sparse_prefill")}
    buckets = sum(len(s["buckets"]) + 1 for s in spec.values())
    assert len(_dispatch._bucket_schedule._cache) <= buckets
    assert len(_dispatch._loaded._cache) <= buckets
    # and a memoised resolution is still the bucket's: b=1 and b=2 share one
    (k1, s1), (k2, s2) = (_dispatch.resolve(SPARSE_DECODE, target, h=64, b=b, s_q=1, scope="c4a")
                          for b in (1, 2))
    assert k1 is k2 and s1 == s2 == schedules.schedule_for(target.dirname, "sparse_decode",
                                                           h=64, scope="c4a", ctas=2)


def test_stream_scratch_keeps_the_views_of_a_bounded_number_of_shape_sets(monkeypatch):
    """Issue 34 item 7: the views of a buffer were memoised per set of shapes, and the shapes
    follow the batch size: one entry per batch size a server ever ran. At most
    ``MAX_VIEW_SETS`` are kept, the least recently used dropped."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 3, raising=False)
    monkeypatch.setattr(_dispatch, "capturing", lambda device: False)
    scratch = _dispatch.StreamScratch()
    dev = torch.device("cpu")
    scratch.views(dev, ((300, 8),))  # the buffer at its final size: no regrowth below
    (buffer, memo), = scratch.pools.values()
    kept = scratch.views(dev, ((1, 8),))
    for b in range(2, 300):
        scratch.views(dev, ((b, 8),))
        if b % 4 == 0:
            assert scratch.views(dev, ((1, 8),)) is kept  # used again: stays
    (again, memo), = scratch.pools.values()
    assert again is buffer and len(memo) <= 16, len(memo)
    assert len(memo) == scratch.MAX_VIEW_SETS and ((1, 8),) in memo and ((2, 8),) not in memo
    fresh = scratch.views(dev, ((2, 8),))  # a dropped set is made again, of the same buffer
    assert fresh[0].shape == (2, 8) and fresh[0].data_ptr() == buffer.data_ptr()


def test_stream_scratch_of_a_thread_is_dropped_when_it_ends(monkeypatch):
    """Issue 25 item 5: pools keyed (device, stream, thread) were never dropped (16 worker
    threads left 32 MiB allocated after they joined); a thread's buffers go with it."""
    import threading
    import weakref

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(_dispatch, "capturing", lambda device: False)
    scratch = _dispatch.StreamScratch()
    dev = torch.device("cpu")
    shapes = ((4, 8, 64, 512), (4, 8, 64))
    ready, finish = threading.Barrier(17), threading.Event()

    def worker():
        scratch.views(dev, shapes)
        ready.wait()
        finish.wait()

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    ready.wait()
    assert len(scratch.pools) == 16  # one pool per live thread
    buffers = [weakref.ref(buffer) for buffer, _views in scratch.pools.values()]
    mine = scratch.views(dev, shapes)
    finish.set()
    for t in threads:
        t.join()
    gc.collect()
    assert list(scratch.pools) == [(dev, 7, threading.get_ident())]  # only this thread's
    assert all(ref() is None for ref in buffers)  # the workers' buffers were freed
    assert scratch.views(dev, shapes) is mine
    scratch.clear()
    assert not scratch.pools
