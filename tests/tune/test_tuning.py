"""CPU tests of schedule tuning: the log schema, candidate pruning, bucket and log-entry
selection, the fallback warnings, builds from logs (deterministic manifests) and that a
logged config reaches the front end. The GPU part of ``dsv4-tl tune`` (compiling and timing
candidates) runs in ``scripts/device_tune.sh``; here its measurements are faked."""

import copy
import json
import re
import warnings

import pytest

from dsv4_tl import schedules, tune, tuning_log
from dsv4_tl.build import build, build_variants
from dsv4_tl.kernels import KERNELS, Variant, kernels_changed
from dsv4_tl.targets import parse_target
from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

TARGET = parse_target("cuda:sm_90a")
SM90A = TARGET.dirname
TILELANG = tuning_log.current_tilelang()


@pytest.fixture
def logs(tmp_path, monkeypatch):
    """An empty log root in $DSV4_TL_TUNING_LOGS; caches and once-only warnings reset."""
    root = tmp_path / "logs"
    root.mkdir()
    monkeypatch.setenv(tuning_log.ENV_LOG_DIR, str(root))
    schedules.clear_caches()
    yield root
    schedules.clear_caches()


def _spec(op):
    return schedules.load_schedule_file(SM90A, op)


def _bucket(op, name):
    return next(b for b in _spec(op)["buckets"] if b.get("name") == name)


def _entry(op, bucket, best, *, us=10.0, date="2026-11-21T08:00:00+00:00", tilelang=TILELANG,
           match=None, **extra):
    """A valid entry of ``bucket`` whose best is the default overridden by ``best``."""
    default = dict(_spec(op)["default"])
    best = {**default, **best}
    entry = {
        "format": 1, "target": TARGET.name, "op": op, "bucket": bucket,
        "match": _bucket(op, bucket)["match"] if match is None else match,
        "features": {}, "shape": "test shape", "best": best, "best_us": us,
        "default": default, "default_us": 2 * us,
        "candidates": [{"config": best, "us": us}, {"config": default, "us": 2 * us}],
        "device": "NVIDIA H200", "driver": "570.0", "toolchain": {"tilelang": tilelang},
        "date": date,
    }
    entry.update(extra)
    return entry


def _write(root, op, *entries):
    path = tuning_log.log_path(root, SM90A, op)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")
    path.chmod(0o644)  # whatever the umask: a log its group can write is not read
    return path


# ------------------------------------------------------------------------------ schema
def test_schema_accepts_a_good_entry_and_round_trips(logs):
    entry = _entry("global_topk", "all", {"tokens_per_block": 8})
    assert tuning_log.validate_entry(entry) == []
    path = tuning_log.log_path(logs, SM90A, "global_topk")
    tuning_log.append_entry(path, entry)
    tuning_log.append_entry(path, entry)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == entry  # one object per line
    read = tuning_log.read_log(path)
    assert [e["_line"] for e in read] == [1, 2]


def _mutations():
    def drop(field):
        return lambda e: e.pop(field)

    def set_(field, value):
        return lambda e: e.__setitem__(field, value)

    return {
        "missing best": (drop("best"), "best: missing"),
        "missing toolchain": (drop("toolchain"), "toolchain: missing"),
        "string time": (set_("best_us", "fast"), "best_us: expected"),
        "bool as number": (set_("best_us", True), "best_us: expected"),
        "negative time": (set_("best_us", -1.0), "positive time"),
        "best not measured": (set_("best_us", 3.0), "best: not among the timed candidates"),
        "unknown field": (set_("speed", 1), "unknown fields: speed"),
        "bad range": (set_("match", {"ctas": [17, 1]}), "match.ctas"),
        "bad date": (set_("date", "yesterday"), "date: expected an ISO 8601"),
        "future format": (set_("format", 2), "format: expected 1"),
        "us and error": (lambda e: e["candidates"][1].__setitem__("error", "x"),
                         "exactly one of 'us' and 'error'"),
        "no tilelang": (set_("toolchain", {"torch": "2.13.0"}), "toolchain.tilelang"),
        "other knobs": (lambda e: e["best"].pop("threads"),  # candidates[0] is the same dict
                        "knobs differ from default"),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_schema_rejects_bad_entries(name):
    mutate, message = _mutations()[name]
    entry = _entry("global_topk", "all", {"tokens_per_block": 8})
    mutate(entry)
    errors = tuning_log.validate_entry(entry)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValueError, match="tuning log entry"):
        tuning_log.check_entry(entry)


def test_malformed_lines_are_skipped_with_a_warning_naming_the_line(logs):
    good = _entry("global_topk", "all", {"tokens_per_block": 8})
    bad = copy.deepcopy(good)
    del bad["device"]
    path = _write(logs, "global_topk", good, bad)
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.warns(UserWarning) as record:
        entries = tuning_log.read_log(path)
    assert [e["_line"] for e in entries] == [1]
    text = " ".join(str(w.message) for w in record)
    assert f"{path}:2: device: missing" in text and f"{path}:3: not JSON" in text


def test_append_refuses_an_invalid_entry(logs):
    entry = _entry("global_topk", "all", {"tokens_per_block": 8}, best_us=0)
    path = tuning_log.log_path(logs, SM90A, "global_topk")
    with pytest.raises(ValueError, match="best_us"):
        tuning_log.append_entry(path, entry)
    assert not path.exists()


# ------------------------------------------------------------------------------ pruning
WS = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
      "warp_specialized": True}


def test_a_candidate_over_the_shared_memory_limit_is_pruned_with_the_reason():
    too_big = {**WS, "block_tokens": 128}  # Q 64 KB + 2 x 128-token K buffers = ~342 KB
    reason = tune.prune(SM90A, "sparse_prefill", too_big)
    assert reason is not None and "shared memory" in reason and "227 KB" in reason
    assert tune.prune(SM90A, "sparse_decode", WS) is None
    # The estimates match the generated CUDA (largest shared-buffer offsets, sm_90a): the
    # warp-specialised decode and prefill share one layout, 64 heads x 64 tokens ~208 KB
    # (the last buffer, the second P tile, ends at 212992 bytes).
    assert tune.smem_bytes("sparse_decode", {**WS, "block_tokens": 64}) == tune.smem_bytes(
        "sparse_prefill", {**WS, "block_tokens": 64})
    assert 204 * 1024 < tune.smem_bytes("sparse_prefill", {**WS, "block_tokens": 64}) < 218 * 1024
    plain = {**WS, "block_tokens": 64, "threads": 256, "warp_specialized": False, "num_stages": 2}
    assert 139 * 1024 < tune.smem_bytes("sparse_prefill", plain) < 146 * 1024
    _, pruned = tune.candidates(SM90A, "sparse_prefill", _bucket("sparse_prefill", "h64_topk1_256"))
    assert any(c["block_tokens"] == 128 and c["warp_specialized"] and "shared memory" in r
               for c, r in pruned)


def test_decode_warp_specialized_takes_32_or_64_token_tiles():
    assert tune.prune(SM90A, "sparse_decode", {**WS, "block_tokens": 64}) is None
    assert "32- or 64-token" in tune.prune(SM90A, "sparse_decode", {**WS, "block_tokens": 128})
    with pytest.raises(ValueError, match="block_tokens 32 or 64"):
        build_sparse_decode(64, True, warp_specialized=True, threads=384, block_tokens=128)


def test_decode_seesaw_takes_the_tile_and_slot_pairs_its_builder_has_registers_for():
    from dsv4_tl.schedule_rules import SEESAW_DECODE_TILE_SLOTS
    from dsv4_tl.tile_kernels.sparse_mla.decode_seesaw import SEESAW_DECODE_REGS

    assert SEESAW_DECODE_TILE_SLOTS == set(SEESAW_DECODE_REGS)
    seesaw = {**WS, "consumers": "seesaw", "num_splits": 2}
    assert tune.prune(SM90A, "sparse_decode", {**seesaw, "producer_slots": 4}) is None
    assert "producer_slots" in tune.prune(SM90A, "sparse_decode",
                                          {**seesaw, "block_tokens": 64, "producer_slots": 4})


TIM = {"block_tokens": 64, "heads_per_block": 16, "threads": 384, "num_splits": 1,
       "warp_specialized": False, "tokens_in_m": True, "num_stages": 2, "ctas_per_sm": 1}


def test_decode_tokens_in_m_rules_match_the_builder():
    """The resource model keeps what the tokens-in-M decode builder takes (wgmma N 8-32, 1-4
    K buffers, several CTAs per SM with 256 threads) and prunes, with the reason, what it
    refuses; the shared-memory estimate matches the generated CUDA (h16, two buffers: the
    largest buffer offset 155648 bytes, ~156 KB with the last buffer)."""
    for config in (TIM, {**TIM, "heads_per_block": 8, "threads": 256, "num_stages": 1,
                         "ctas_per_sm": 2}, {**TIM, "heads_per_block": 24},
                   {**TIM, "heads_per_block": 32, "threads": 256}):
        assert tune.prune(SM90A, "sparse_decode", config) is None, config
    assert 150 * 1024 < tune.smem_bytes("sparse_decode", TIM) < 162 * 1024
    assert "heads_per_block" in tune.prune(SM90A, "sparse_decode", {**TIM, "heads_per_block": 64})
    assert "num_stages" in tune.prune(SM90A, "sparse_decode", {**TIM, "num_stages": 5})
    assert "ctas_per_sm" in tune.prune(SM90A, "sparse_decode", {**TIM, "ctas_per_sm": 2})
    # two CTAs of 256 threads at 32 heads: Oᵀ alone is 128 registers per thread
    assert "registers" in tune.prune(SM90A, "sparse_decode",
                                     {**TIM, "heads_per_block": 32, "threads": 256,
                                      "num_stages": 1, "ctas_per_sm": 2})
    assert "shared memory" in tune.prune(SM90A, "sparse_decode",
                                         {**TIM, "heads_per_block": 32, "num_stages": 4})
    for bad, match in (({"heads_per_block": 12}, "heads_per_block"),
                       ({"threads": 128}, "threads"), ({"block_tokens": 32}, "block_tokens"),
                       ({"num_stages": 4, "heads_per_block": 32}, "num_stages"),
                       ({"ctas_per_sm": 2}, "ctas_per_sm"),
                       ({"warp_specialized": True}, "warp_specialized")):
        kwargs = {k: v for k, v in {**TIM, **bad}.items() if k != "num_splits"}
        with pytest.raises(ValueError, match=match):
            build_sparse_decode(16, True, **kwargs)


def test_arch_and_layout_rules():
    assert "wgmma" in tune.prune("cuda_sm100a", "sparse_decode", WS)
    assert "registers" in tune.prune(SM90A, "sparse_decode",
                                     {**WS, "threads": 128, "warp_specialized": False})
    assert "needs heads_per_block 64, threads 384" in tune.prune(SM90A, "sparse_decode",
                                                                 {**WS, "threads": 256})
    assert "num_stages" in tune.prune(SM90A, "sparse_prefill", {**WS, "num_stages": 2})
    assert "1024" in tune.prune(SM90A, "dequant_gather",
                                {"tokens_per_block": 32, "target_ctas": 1056, "threads": 2048})


def test_split_sanity_uses_the_buckets_representative():
    from dsv4_tl.bench import DecodeShape

    swa = DecodeShape(64, 8, "swa")  # 128 window tokens = 4 tiles of 32
    assert "4 KV tiles" in tune.prune(SM90A, "sparse_decode", {**WS, "num_splits": 8}, swa)
    big = DecodeShape(128, 128, "c4a")  # 256 CTAs: splitting only adds waves
    assert "two waves" in tune.prune(SM90A, "sparse_decode", {**WS, "num_splits": 2}, big)
    assert tune.prune(SM90A, "sparse_decode", {**WS, "num_splits": 8}, DecodeShape(64, 8, "c4a")) is None


def test_candidates_keep_baseline_and_default_then_nearest_first():
    bucket = _bucket("sparse_decode", "h64_c4a_ctas1_16")
    kept, pruned = tune.candidates(SM90A, "sparse_decode", bucket, max_candidates=8)
    base = {**_spec("sparse_decode")["default"], **bucket["config"]}
    assert [c.role for c in kept[:2]] == ["baseline", "default"]
    assert kept[0].config == base and len(kept) == 8
    dist = [sum(c.config[k] != base[k] for k in base) for c in kept[2:]]
    assert dist == sorted(dist)
    assert any("over --max-candidates 8" in r for _, r in pruned)
    everything, _ = tune.candidates(SM90A, "sparse_decode", bucket, max_candidates=0)
    assert len(everything) > 8


@pytest.mark.parametrize("target", ["cuda:sm_90a", "cuda:sm_100a"])
def test_suite_covers_every_bucket_and_each_representative_lands_in_it(target):
    ops = [op for op in tune.TUNABLE_OPS]
    plans = tune.plan(target, ops, "dsv4")  # raises on a missing or misplaced representative
    t = parse_target(target)
    named = {(op, b["name"]) for op in ops
             for b in schedules.load_schedule_file(t.dirname, op)["buckets"]}
    assert {(p.op, p.name) for p in plans} == named
    for p in plans:
        assert 1 <= len(p.kept) <= tune.DEFAULT_MAX_CANDIDATES + 1
        assert p.kept[0].role == "baseline"
        # the tuned variant is one the bucket selects at run time (the op spec derives both)
        assert KERNELS[p.op].admits(p.bucket["match"], p.static)


def test_dry_run_lists_kept_and_pruned_candidates(capsys):
    from dsv4_tl.cli import main

    assert main(["tune", "--target", "cuda:sm_90a", "--kernel", "sparse_decode", "--suite",
                 "dsv4", "--bucket", "h128_c4a_ctas1_16", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "sparse_decode / h128_c4a_ctas1_16: decode h128 b8" in text
    assert "keep   baseline ns8" in text and "keep   default  (default)" in text
    assert "keep   search   bt64 ns8" in text
    assert re.search(r"prune +4 x warp_specialized: decode's producer takes 32- or 64-token "
                     r"tiles .*block_tokens 128: bt128 ns8", text)
    assert "1 buckets," in text and "distinct kernel variants" in text


def test_unknown_bucket_is_an_error(capsys):
    assert tune.main(["--kernel", "sparse_decode", "--bucket", "nope", "--dry-run"]) == 2
    assert "no bucket named nope" in capsys.readouterr().err


# ------------------------------------------------------------------------------ selection
def test_schedule_for_uses_the_newest_entry_of_the_bucket(logs):
    name = "h64_c4a_ctas1_16"
    _write(logs, "sparse_decode",
           _entry("sparse_decode", name, {"num_splits": 4}, date="2026-11-21T08:00:00+00:00"),
           _entry("sparse_decode", name, {"num_splits": 2, "block_tokens": 32},
                  date="2026-11-22T08:00:00+00:00"),
           _entry("sparse_decode", name, {"num_splits": 1}, date="2026-11-20T08:00:00+00:00"),
           _entry("sparse_decode", "h64_swa_ctas1_16", {"num_splits": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other buckets have no log
        got = schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c4a", ctas=8)
        assert (got["num_splits"], got["block_tokens"]) == (2, 32)
        # another scope, another bucket, its own entry
        assert schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="swa", ctas=8)["num_splits"] == 2
        # no log for this bucket: the schedule file's config
        assert schedules.schedule_for(SM90A, "sparse_decode", h=128, scope="c4a", ctas=8)["num_splits"] == 8
        # a feature missing: no bucket matches, the default applies
        assert schedules.schedule_for(SM90A, "sparse_decode", ctas=8) == _spec("sparse_decode")["default"]


def test_missing_log_warns_once_naming_the_bucket(logs):
    with pytest.warns(UserWarning, match="bucket 'h64_c128a_ctas17_33'") as record:
        config = schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c128a", ctas=20)
    assert config["num_splits"] == 4  # the schedule file's bucket config
    assert sum("h64_c128a_ctas17_33" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second resolution of the bucket stays quiet
        schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c128a", ctas=30)
        # unnamed buckets (HIP files) are never looked up and never warn
        assert schedules.schedule_for("hip_gfx942", "sparse_decode", ctas=10)["num_splits"] == 8


def test_entries_of_another_tilelang_or_other_ranges_are_ignored_with_a_warning(logs):
    name = "h64_c4a_ctas1_16"
    _write(logs, "sparse_decode",
           _entry("sparse_decode", name, {"num_splits": 2}, tilelang="0.0.1"),
           _entry("sparse_decode", name, {"num_splits": 4},
                  match={"h": [1, 65], "scope": ["c4a"], "ctas": [1, 9]}))
    with pytest.warns(UserWarning) as record:
        config = schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c4a", ctas=8)
    assert config["num_splits"] == 8  # neither entry counts: the file's config
    text = [str(w.message) for w in record]
    assert any("TileLang 0.0.1" in t and f"this process has {TILELANG}" in t for t in text)
    assert any("ranges" in t and name in t for t in text)
    assert any("no tuning log entry" in t and name in t for t in text)


def test_forced_schedule_overrides_every_shape_and_restores(logs):
    forced = {**WS, "num_splits": 3}
    with schedules.forced_schedule(SM90A, "sparse_decode", forced):
        assert schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c4a", ctas=8) == forced
        assert schedules.schedule_for(SM90A, "sparse_decode") == forced
    with pytest.warns(UserWarning):
        assert schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c4a", ctas=8)["num_splits"] == 8


def test_a_logged_config_changes_the_variant_the_front_end_resolves(logs, monkeypatch):
    from dsv4_tl.ops import _dispatch

    class Loader:
        def get(self, variant):
            return variant

    monkeypatch.setattr(_dispatch, "loader_for", lambda target: Loader())
    static = tuple(sorted(dict(num_heads=64, has_extra=True, fp8_format="e4m3fn").items()))
    features = tuple(sorted(dict(ctas=8, h=64, scope="c4a").items()))

    def resolve():
        kernels_changed()
        return _dispatch._resolve("sparse_decode", TARGET, static, features)

    try:
        with pytest.warns(UserWarning, match="h64_c4a_ctas1_16"):
            before, schedule = resolve()
        assert schedule["num_splits"] == 8
        _write(logs, "sparse_decode",
               _entry("sparse_decode", "h64_c4a_ctas1_16", {"num_splits": 2, "block_tokens": 32}))
        after, schedule = resolve()
        assert (schedule["num_splits"], schedule["block_tokens"]) == (2, 32)
        assert after != before and after == Variant.make("sparse_decode", dict(static), schedule)
        assert after.key != before.key
    finally:
        kernels_changed()


# ------------------------------------------------------------------------------ builds
def test_build_variants_follow_the_logs_and_the_static_parameters(logs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = build_variants(TARGET, heads=(64, 128), ops=["sparse_decode"])
        _write(logs, "sparse_decode",
               _entry("sparse_decode", "h128_c4a_ctas34_66",
                      {"num_splits": 2, "block_tokens": 64, "threads": 256,
                       "warp_specialized": False}))
        schedules.clear_caches()
        tuned = build_variants(TARGET, heads=(64, 128), ops=["sparse_decode"])
    new = set(tuned) - set(plain)
    # only the static parameters the bucket can see: 128 heads, with the extra scope
    assert new and all(dict(v.static)["num_heads"] == 128 and dict(v.static)["has_extra"]
                       and dict(v.schedule)["block_tokens"] == 64 for v in new)
    # (9 / 10: the split counts by tile pairs of the compressed buckets below 15 CTAs,
    # bench/PERF_NOTES.md item 87; the others the schedule file's space)
    assert all(c["num_splits"] in (1, 2, 4, 8, 9, 10)
               for c in KERNELS["sparse_decode"].schedules(SM90A))


def test_same_logs_give_byte_identical_manifests(logs, tmp_path):
    _write(logs, "global_topk",
           _entry("global_topk", "all", {"tokens_per_block": 8, "cols_per_block": 1024}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = build(TARGET, tmp_path / "a", heads=(64,), ops=["global_topk"], jobs=2, progress=False)
        schedules.clear_caches()
        b = build(TARGET, tmp_path / "b", heads=(64,), ops=["global_topk"], jobs=2, progress=False)
    manifest = lambda d: (d / SM90A / "manifest.json").read_bytes()
    assert manifest(tmp_path / "a") == manifest(tmp_path / "b")
    assert a["kernels"] == b["kernels"]
    assert b"timestamp" not in manifest(tmp_path / "a") and b"date" not in manifest(tmp_path / "a")
    logged = [e for e in a["kernels"] if e["schedule"]["tokens_per_block"] == 8]
    assert len(logged) == 2 and {e["static"]["ragged"] for e in logged} == {False, True}
    assert all(e["schedule"]["cols_per_block"] == 1024 for e in logged)


# ------------------------------------------------------------------------------ tune run pieces
def _fake_results(p, slow_baseline=1.0):
    """Made-up times: the baseline at ``100 * slow_baseline`` µs, the others 97 + i µs,
    the last candidate failing its reference check."""
    results = []
    for i, cand in enumerate(p.kept):
        if cand.role == "baseline":
            results.append({"config": cand.config, "us": 100.0 * slow_baseline})
        elif i == len(p.kept) - 1:
            results.append({"config": cand.config, "error": "AssertionError: out: 3/100 elements"})
        else:
            results.append({"config": cand.config, "us": 97.0 + i})
    return results


INFO = {"device": "NVIDIA H200", "driver": "570.0", "sms": 132, "cuda": "13.0"}


def test_log_entry_from_measurements_keeps_the_baseline_within_noise():
    (p,) = tune.plan(TARGET, ["sparse_decode"], buckets=["h64_c4a_ctas1_16"])
    tools = {"tilelang": TILELANG, "torch": "2.13.0"}
    near = tune.make_entry(TARGET, p, _fake_results(p), INFO, tools, min_gain=0.05)
    assert near["best"] == near["baseline"]  # 99 µs is within 5 % of 100 µs
    far = tune.make_entry(TARGET, p, _fake_results(p, slow_baseline=2.0), INFO, tools)
    assert far["best"] != far["baseline"] and far["best_us"] == 98.0
    assert far["default_us"] is not None and far["baseline_us"] == 200.0
    times = [c["us"] for c in far["candidates"] if "us" in c]
    assert times == sorted(times) and "error" in far["candidates"][-1]
    assert tuning_log.validate_entry(far) == []
    assert tune.make_entry(TARGET, p, [{"config": WS, "error": "x"}], INFO, tools) is None


def test_report_prints_the_logged_buckets(logs, capsys, monkeypatch):
    (p,) = tune.plan(TARGET, ["dequant_gather"], buckets=["rows1_16k"])
    entry = tune.make_entry(TARGET, p, _fake_results(p, 2.0), INFO, {"tilelang": TILELANG})
    tuning_log.append_entry(tuning_log.log_path(logs, SM90A, "dequant_gather"), entry)
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert tune.main(["--kernel", "dequant_gather", "--report", "--out", str(logs),
                      "--png", str(logs / "t.png")]) == 0
    text = capsys.readouterr().out
    assert "rows1_16k" in text and "98.00" in text and "2.04x" in text
    assert "rows16k_128k" in text and "not tuned" in text
    assert "matplotlib is not installed" in text and not (logs / "t.png").exists()


def test_a_crashed_candidate_is_pruned_on_the_next_run(tmp_path):
    (p,) = tune.plan(TARGET, ["sparse_decode"], buckets=["h64_c4a_ctas1_16"])
    victim = p.kept[2].config
    tune.write_state(tmp_path, TARGET, "sparse_decode",
                      inflight={"bucket": p.name, "config": victim})
    crashed = tune.load_crashed(tmp_path, TARGET, ["sparse_decode"], say=lambda s: None)
    assert crashed == {("sparse_decode", p.name): [victim]}
    state = json.loads(tune.state_path(tmp_path, TARGET, "sparse_decode").read_text())
    assert "inflight" not in state and state["crashed"][0]["config"] == victim
    (again,) = tune.plan(TARGET, ["sparse_decode"], buckets=[p.name], crashed=crashed)
    assert victim not in [c.config for c in again.kept]
    assert any(c == victim and "crashed" in r for c, r in again.pruned)


# ------------------------------------------------------------------------------ trust
def test_an_entry_of_another_target_is_ignored_with_a_warning(logs):
    """A hip:gfx942 entry filed under cuda_sm90a/ never configures a CUDA kernel."""
    name = "h64_c4a_ctas1_16"
    _write(logs, "sparse_decode",
           _entry("sparse_decode", name, {"num_splits": 2}, target="hip:gfx942", device="MI300X"))
    with pytest.warns(UserWarning) as record:
        config = schedules.schedule_for(SM90A, "sparse_decode", h=64, scope="c4a", ctas=8)
    assert config["num_splits"] == 8  # the schedule file's bucket config
    assert any("hip:gfx942" in str(w.message) and "MI300X" in str(w.message) for w in record)


@pytest.mark.parametrize("knobs", [{"threads": 7}, {"tokens_per_block": -3}])
def test_knob_values_outside_the_schedule_space_are_ignored_with_a_warning(logs, knobs):
    name = _spec("global_topk")["buckets"][0]["name"]
    _write(logs, "global_topk", _entry("global_topk", name, knobs))
    with pytest.warns(UserWarning, match="outside the schedule's space") as record:
        entry = tuning_log.select_entry(SM90A, "global_topk", name,
                                        match=_bucket("global_topk", name)["match"])
    assert entry is None
    (knob, value), = knobs.items()
    assert any(f"{knob}={value}" in str(w.message) for w in record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bucket falls back to the file: warned above
        variants = build_variants(TARGET, ops=["global_topk"])
    bad = tuple(sorted({**_spec("global_topk")["default"], **knobs}.items()))
    assert not any(v.schedule == bad for v in variants)  # never built, never selected


def test_dates_compare_as_datetimes_across_time_zones(logs):
    """08:00+00:00 is later than 10:00+05:00 (05:00 UTC), though it sorts first as text."""
    name = "h64_c4a_ctas1_16"
    _write(logs, "sparse_decode",
           _entry("sparse_decode", name, {"num_splits": 2}, date="2026-11-21T08:00:00+00:00"),
           _entry("sparse_decode", name, {"num_splits": 4}, date="2026-11-21T10:00:00+05:00"))
    entry = tuning_log.select_entry(SM90A, "sparse_decode", name)
    assert entry["best"]["num_splits"] == 2


@pytest.mark.parametrize("date", ["9999-01-01T00:00:00+00:00", "2026-11-21T08:00:00", "yesterday"])
def test_future_unzoned_or_unparsable_dates_make_a_line_malformed(logs, date):
    name = "h64_c4a_ctas1_16"
    _write(logs, "sparse_decode",
           _entry("sparse_decode", name, {"num_splits": 2}, date="2026-11-21T08:00:00+00:00"),
           _entry("sparse_decode", name, {"num_splits": 4}, date=date))
    with pytest.warns(UserWarning, match=":2: date: "):
        entry = tuning_log.select_entry(SM90A, "sparse_decode", name)
    assert entry["best"]["num_splits"] == 2  # 9999 does not win forever


def test_report_reads_the_logs_the_installed_package_uses(logs, capsys, monkeypatch, tmp_path):
    """Run from anywhere (no ./tuning_logs), --report reads $DSV4_TL_TUNING_LOGS or the package's."""
    (p,) = tune.plan(TARGET, ["dequant_gather"], buckets=["rows1_16k"])
    entry = tune.make_entry(TARGET, p, _fake_results(p, 2.0), INFO, {"tilelang": TILELANG})
    tuning_log.append_entry(tuning_log.log_path(logs, SM90A, "dequant_gather"), entry)
    monkeypatch.chdir(tmp_path)
    assert tune.main(["--kernel", "dequant_gather", "--report"]) == 0
    text = capsys.readouterr().out
    assert "no log" not in text and "rows1_16k" in text and str(logs) in text
    monkeypatch.delenv(tuning_log.ENV_LOG_DIR)
    schedules.clear_caches()
    assert tune.main(["--kernel", "sparse_decode", "--report"]) == 0
    text = capsys.readouterr().out
    assert "no log" not in text and "h64_c4a_ctas1_16" in text


def _without(entry, knob):
    """``entry`` as a log written before ``knob`` existed (no such key in its configs)."""
    for config in [entry["best"], entry["default"]] + [c["config"] for c in entry["candidates"]]:
        config.pop(knob, None)
    return entry


def test_an_entry_without_an_added_knob_takes_the_knobs_old_value(logs):
    """sparse_prefill's ``added_knobs`` names tokens_in_m (false before it existed): an entry
    logged before the knob still configures its bucket, with the old kernel."""
    name = "h128_topk257_1024"
    assert _spec("sparse_prefill")["added_knobs"]["tokens_in_m"] is False
    _write(logs, "sparse_prefill",
           _without(_entry("sparse_prefill", name, {"block_tokens": 32}), "tokens_in_m"))
    ((bucket, config, source),) = [r for r in schedules.resolved_buckets(SM90A, "sparse_prefill")
                                   if r[0]["name"] == name]
    assert source == "log" and config["block_tokens"] == 32
    assert config["tokens_in_m"] is False


def test_an_entry_without_a_knob_the_file_does_not_list_is_ignored(logs):
    """dequant_gather's loads knob changed the kernel family (its default moved off the old
    path): an entry logged before it is ignored with a warning, not applied with the new
    default."""
    name = "rows16k_128k"
    assert "loads" not in _spec("dequant_gather").get("added_knobs", {})
    _write(logs, "dequant_gather",
           _without(_entry("dequant_gather", name, {"threads": 128}), "loads"))
    with pytest.warns(UserWarning, match="has knobs"):
        rows = schedules.resolved_buckets(SM90A, "dequant_gather")
    ((bucket, config, source),) = [r for r in rows if r[0]["name"] == name]
    assert source == "file" and config == {**_spec("dequant_gather")["default"],
                                           **bucket["config"]}


def test_every_shipped_bucket_has_a_valid_log_entry():
    """Issue 25: every named bucket of every shipped ``schedules/cuda_sm90a/*.json`` resolves
    to a logged entry of this TileLang version without any warning (a fresh-clone
    ``dsv4-tl build`` printed six: entries ignored after a knob change, buckets never
    tuned); re-run ``dsv4-tl tune --bucket NAME`` when this fails."""
    import warnings
    from importlib import resources

    from dsv4_tl import schedules as sched

    sched.clear_caches()
    folder = resources.files("dsv4_tl.schedules").joinpath("cuda_sm90a")
    ops = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
    assert ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for op in ops:
            for bucket, _config, source in sched.resolved_buckets("cuda_sm90a", op):
                if "name" in bucket:
                    assert source == "log", f"{op} bucket {bucket['name']}: no valid log entry"
    sched.clear_caches()


@pytest.mark.parametrize("bad", [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
    b'{"format": 1, "op": "caf\xe9"}',  # not UTF-8
    b'{"format": ' + b"7" * 5000 + b"}",  # ValueError: over 4300 digits
    b'{"format": 1, "best": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,  # deep but parseable
], ids=["deep_nesting", "not_utf8", "huge_int", "deep_object"])
def test_one_bad_log_line_is_skipped_with_one_warning_and_breaks_nothing(logs, bad, capsys):
    """Issue 25 item 3: a bad line (RecursionError, a non-UTF-8 byte, an integer over 4300
    digits) escaped parse_lines and then every schedule_for, ``dsv4-tl build`` and
    ``tune --report`` failed; it is skipped with one warning naming the line."""
    good = _entry("global_topk", "all", {"tokens_per_block": 8})
    path = _write(logs, "global_topk", good)
    with open(path, "ab") as f:
        f.write(bad + b"\n")
    _write(logs, "global_topk", good)
    with pytest.warns(UserWarning) as record:
        entries = tuning_log.read_log(path)
    assert [e["_line"] for e in entries] == [1, 3]
    skipped = [str(w.message) for w in record if "skipping a malformed line" in str(w.message)]
    assert len(skipped) == 1 and f"{path}:2:" in skipped[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert schedules.schedule_for(SM90A, "global_topk")["threads"] > 0
        assert tune.main(["--kernel", "global_topk", "--report", "--out", str(logs)]) == 0
    assert "global_topk" in capsys.readouterr().out


def test_tuning_logs_naming_a_file_is_one_clear_error(logs, monkeypatch):
    not_a_folder = logs / "file.jsonl"
    not_a_folder.write_text("{}\n")
    monkeypatch.setenv(tuning_log.ENV_LOG_DIR, str(not_a_folder))
    schedules.clear_caches()
    with pytest.raises(ValueError, match=f"^{tuning_log.ENV_LOG_DIR}: expected a folder .*"
                                         "not a folder"):
        schedules.schedule_for(SM90A, "global_topk")


def _read_in_a_thread(read, path, timeout=20.0):
    """``read()`` in a thread; fails the test (after unblocking a FIFO's reader) if it hangs."""
    import os
    import threading

    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(read()), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail(f"reading the tuning log {path} hung")
    return outcome[0]


@pytest.mark.parametrize("kind", ["fifo", "folder", "too_large", "foreign", "group_writable"])
def test_a_log_that_is_not_a_plain_file_of_yours_is_skipped_with_one_warning(logs, kind,
                                                                            monkeypatch):
    """Issue 34 item 7: a FIFO in a log's place hung every op's first call and ``dsv4-tl
    build``; only regular files of at most MAX_LOG_BYTES are read, and, as in a kernel
    directory, only ones owned by this user or root that group and others cannot write
    (a log picks the kernels this process builds). Otherwise the file is skipped with one
    warning line naming it, as a malformed line is."""
    import os

    good = _entry("global_topk", "all", {"tokens_per_block": 8})
    path = tuning_log.log_path(logs, SM90A, "global_topk")
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "folder":
        path.mkdir()
    else:
        _write(logs, "global_topk", good)
        assert [e["bucket"] for e in tuning_log.read_log(path)] == ["all"]
        schedules.clear_caches()
    if kind == "too_large":
        monkeypatch.setattr(tuning_log, "MAX_LOG_BYTES", path.stat().st_size - 1)
    elif kind == "foreign":
        if os.getuid() == 0:
            os.chown(path, 12345, -1)
        else:
            real = os.getuid()
            monkeypatch.setattr(tuning_log.os, "getuid", lambda: real + 1)
    elif kind == "group_writable":
        os.chmod(path, 0o664)
    reason = {"fifo": "not a regular file", "folder": "not a regular file",
              "too_large": "over the", "foreign": "owned by uid",
              "group_writable": "writable by its group or others"}[kind]
    with pytest.warns(UserWarning) as record:
        assert _read_in_a_thread(lambda: tuning_log.read_log(path), path) == []
        config = _read_in_a_thread(lambda: schedules.schedule_for(SM90A, "global_topk"), path)
    assert config["tokens_per_block"] == _spec("global_topk")["default"]["tokens_per_block"]
    skipped = [str(w.message) for w in record if f"skipping {path}" in str(w.message)]
    assert len(skipped) == 1 and reason in skipped[0] and "\n" not in skipped[0], skipped


def test_a_log_linked_to_dev_zero_is_skipped_not_read_into_memory(tmp_path):
    """Issue 34 item 7: a log linked to /dev/zero was read as one endless line until a
    MemoryError. Run in a child process with a memory limit (the old reader would take the
    machine's memory otherwise)."""
    import os
    import subprocess
    import sys

    root = tmp_path / "logs"
    (root / SM90A).mkdir(parents=True)
    os.symlink("/dev/zero", root / SM90A / "global_topk.jsonl")
    code = ("import resource, warnings\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from dsv4_tl import tuning_log\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    print(tuning_log.read_log(tuning_log.log_path(tuning_log.log_root(), "
            f"{SM90A!r}, 'global_topk')))\n"
            "print(*(str(x.message) for x in w), sep='\\n')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, tuning_log.ENV_LOG_DIR: str(root)})
    assert run.returncode == 0, run.stderr[-1000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "[]" and len(lines) == 2
    assert "tuning log: skipping" in lines[1] and "not a regular file" in lines[1]


@pytest.mark.parametrize("op,bucket,knobs,reason", [
    ("sparse_decode", "h64_c4a_ctas1_16", {"num_splits": True}, "outside the schedule's space"),
    ("sparse_decode", "h64_c4a_ctas1_16", {"num_splits": 2.0}, "outside the schedule's space"),
    ("sparse_prefill", "h64_topk257_1024", {"heads_per_block": 0}, "outside the schedule's space"),
    ("sparse_prefill", "h64_topk257_1024", {"block_tokens": 128}, "cannot be built"),
    ("sparse_prefill", "h64_topk257_1024", {"threads": 256}, "cannot be built"),
], ids=["bool_for_int", "float_for_int", "knob_outside_space", "ws_block128", "ws_threads256"])
def test_a_best_config_that_cannot_build_is_ignored_with_a_warning(logs, op, bucket, knobs,
                                                                   reason):
    """Issue 25 item 4: ``true`` and ``2.0`` passed the space check for ``1`` and ``2``,
    knobs outside the space were unchecked (``heads_per_block 0``: ZeroDivisionError) and
    in-space combinations could be invalid (warp-specialised with block_tokens 128 or 256
    threads); ``num_splits: true`` was then built under one key and asked for under
    another. Types compare exactly and combinations go through the schedule's own rule."""
    _write(logs, op, _entry(op, bucket, knobs))
    with pytest.warns(UserWarning, match=reason):
        entry = tuning_log.select_entry(SM90A, op, bucket, match=_bucket(op, bucket)["match"])
    assert entry is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedules.clear_caches()
        built = {v.schedule for v in build_variants(TARGET, ops=[op])}
        # a variant's schedule leaves out the knobs only the launch plan reads
        plan_knobs = KERNELS[op].plan_knobs
        file_config = {k: v for k, v in {**_spec(op)["default"], **_bucket(op, bucket)["config"]}.items()
                       if k not in plan_knobs}
    assert tuple(sorted(file_config.items())) in built  # the bucket builds its file config
    bad = {k: v for k, v in {**_spec(op)["default"], **knobs}.items() if k not in plan_knobs}
    assert not any(all(tuning_log.same_value(dict(s).get(k), v) for k, v in knobs.items())
                   and dict(s) == bad for s in built)


# ------------------------------------------------------------------------------ retired knobs
@pytest.mark.parametrize("on", [False, True])
def test_an_entry_naming_a_retired_knob_applies_only_at_its_off_value(logs, monkeypatch, on):
    """A logged best that names a retired knob (written while the knob existed; the schedule
    file now lists it in ``retired_knobs``) at its off value measured the only kernel left: it
    still configures its bucket, without the knob. At any other value it measured code that
    left main: ignored with a warning naming the knob, and the bucket takes the file's config."""
    op, name, knob = "sparse_decode", "h64_c4a_ctas1_16", "old_lever"
    spec = _spec(op)
    monkeypatch.setitem(spec, "retired_knobs", {**spec.get("retired_knobs", {}), knob: False})
    entry = _entry(op, name, {"num_splits": 2, knob: on})
    entry["default"] = entry["candidates"][1]["config"] = {**entry["default"], knob: False}
    _write(logs, op, entry)
    if on:
        with pytest.warns(UserWarning, match=r"old_lever=True, a knob retired"):
            rows = schedules.resolved_buckets(SM90A, op)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = schedules.resolved_buckets(SM90A, op)
        assert not [w for w in caught if name in str(w.message)]
    ((bucket, config, source),) = [r for r in rows if r[0]["name"] == name]
    assert knob not in config
    if on:
        assert source == "file" and config == {**_spec(op)["default"], **bucket["config"]}
    else:
        assert source == "log" and config["num_splits"] == 2
        assert tuning_log.select_entry(SM90A, op, name)["best"] == config


def test_schedule_files_never_name_a_retired_knob():
    """A retired knob's code is gone: no default, bucket config, ``space`` or ``added_knobs``
    may name it (the builder would reject it), and its off value is a plain JSON scalar."""
    from importlib import resources

    root = resources.files("dsv4_tl.schedules")
    for target_dir in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for path in (p for p in target_dir.iterdir() if p.name.endswith(".json")):
            spec = json.loads(path.read_text())
            retired = spec.get("retired_knobs", {})
            assert isinstance(retired, dict), f"{target_dir.name}/{path.name}: retired_knobs"
            configs = [spec["default"], spec.get("space", {}), spec.get("added_knobs", {})]
            configs += [b["config"] for b in spec.get("buckets", [])]
            for knob, off in retired.items():
                assert isinstance(off, (bool, int, str)), f"{path.name}: {knob}: {off!r}"
                assert not any(knob in c for c in configs), (
                    f"{target_dir.name}/{path.name} names the retired knob {knob!r}")
