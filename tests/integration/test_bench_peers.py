"""dsv4_tl.bench_peers without a GPU: peer selection, load failures reported, the index and
layout conversions each Triton peer relies on (checked against the float32 references with
the reference standing in for the peer's kernels), the bench's gather poisoning, and
FlashMLA's two prefill calls below 64 heads (padded, native) on a stand-in op that takes or
refuses the real heads: both checked, a refusal a note naming the build, ratios against the
faster; the report naming each peer's build.

The peers' kernels themselves run only on the GPU (``dsv4-tl bench``), where every peer
result is checked against the same references."""

import os
import sys
import types

import pytest
import torch

from dsv4_tl import bench, bench_discovery, bench_peers
from dsv4_tl.bench_peers import (
    PEER_NAMES,
    VllmTritonSources,
    apply_sink,
    csr_from_dense,
    gather_slot_list,
    load_peers,
    parse_peer_names,
    xpu_combined_indices,
)
from dsv4_tl.cache_format import cache_geometry, dequantize_slots
from dsv4_tl.reference import (
    dequantize_and_gather_k_cache_ref,
    sparse_decode_ref,
    sparse_prefill_ragged_ref,
    sparse_prefill_ref,
)
from dsv4_tl.testing import punch_holes, random_k, random_paged_cache

# Same fp32 sums evaluated in another order / blocking: ~100 ulps of O(1) values, far below
# any masking, ordering or sink bug (>= 1e-3 here).
SAME_SUM_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- selection
def test_parse_peer_names():
    assert parse_peer_names(None) == list(PEER_NAMES)
    assert parse_peer_names("all") == list(PEER_NAMES)
    assert parse_peer_names("none") == [] and parse_peer_names("") == []
    assert parse_peer_names("tri_xpu, flashmla,tri_xpu") == ["tri_xpu", "flashmla"]
    with pytest.raises(ValueError, match="tri_cuda"):
        parse_peer_names("flashmla,tri_cuda")


def test_bench_cli_rejects_unknown_peer(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--peers", "nope"])
    assert exc.value.code == 2
    assert "unknown peer(s) nope" in capsys.readouterr().err


def test_every_peer_declares_its_suites_and_methods():
    for name in PEER_NAMES:
        cls = bench_peers.PEER_CLASSES[name]
        assert cls.name == name and cls.suites
        for suite in cls.suites:
            assert callable(getattr(cls, suite)), (name, suite)


# ----------------------------------------------------------------------------- load failures
def test_no_bundle_reports_every_requested_peer():
    peers, errors = load_peers(["flashmla", "tri_vllm"], None)
    assert peers == []
    assert set(errors) == {"flashmla", "tri_vllm"}
    assert all("PEERS_DIR" in e for e in errors.values())
    assert load_peers([], None) == ([], {})


def test_empty_bundle_dir_reports_each_peer(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and not any(  # no vllm / flash_mla
        os.path.exists(os.path.join(p, name)) for name in ("vllm", "flash_mla"))])
    peers, errors = load_peers(list(PEER_NAMES), str(tmp_path))
    assert peers == []
    assert set(errors) == set(PEER_NAMES)
    # each names the file the bundle lacks, on one line
    assert "bundle: no _flashmla_C extension in " + str(tmp_path) in errors["flashmla"]
    assert f"bundle: vllm.v1 not found in {tmp_path}" in errors["tri_rocm"]
    assert f"bundle: vllm.models not found in {tmp_path}" in errors["tri_vllm"]
    assert not any("\n" in e for e in errors.values())


def test_missing_bundle_dir_is_named(tmp_path):
    _, errors = load_peers(["tri_rocm"], str(tmp_path / "absent"))
    assert "absent" in errors["tri_rocm"]


def test_failed_peers_become_row_entries_only_in_their_suites():
    errors = {"tri_vllm": "ImportError: x", "tri_rocm_splitk": "ImportError: y"}
    assert [e["impl"] for e in bench._failed_peer_entries(errors, "gather")] == ["tri_vllm"]
    assert [e["impl"] for e in bench._failed_peer_entries(errors, "decode")] == ["tri_rocm_splitk"]
    assert bench._failed_peer_entries(errors, "prefill") == []
    assert "not loaded: ImportError: x" in bench._failed_peer_entries(errors, "gather")[0]["error"]


def test_table_prints_load_failures_and_row_errors():
    report = {"device": "X", "sms": 1, "date": "d", "torch": "t",
              "ceilings": {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0},
              "peer_errors": {"tri_xpu": "ImportError: no triton"},
              "rows": [{"suite": "decode", "shape": "s", "attended": 1, "results": [
                  {"impl": "dsv4_tl", "us": 2.0, "tflops": 1.0, "gbps": 1.0, "pct_gemm": 1.0,
                   "pct_copy": 1.0, "check": "ok"},
                  {"impl": "tri_rocm_splitk", "us": 1.0, "tflops": 1.0, "gbps": 1.0,
                   "pct_gemm": 1.0, "pct_copy": 1.0, "check": "ok (out only)"},
                  {"impl": "tri_xpu", "error": "not loaded: ImportError: no triton"}]}]}
    table = bench.format_table(report)
    assert "peer tri_xpu failed to load: ImportError: no triton" in table
    assert "tri_xpu         ERROR not loaded" in table
    assert "tri_rocm_splitk" in table and "ok (out only)" in table


# ----------------------------------------------------------------------------- vLLM file loader
def _fake_triton(monkeypatch):
    """Stand-in `triton` packages (the loader only hands them to the files)."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.language = language
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", language)
    return triton


def test_loader_runs_files_with_stand_ins_and_restores_sys_modules(tmp_path, monkeypatch):
    triton = _fake_triton(monkeypatch)
    src = tmp_path / "vllm_src"
    first = src / "vllm" / "v1" / "attention" / "ops" / "xpu_mla_sparse.py"
    first.parent.mkdir(parents=True)
    first.write_text("from vllm.triton_utils import LOG2E, triton\n"
                     "from vllm.platforms import current_platform\n"
                     "FNUZ = current_platform.is_fp8_fnuz()\nDTYPE = 'bfloat16'\n")
    second = src / "vllm" / "models" / "deepseek_v4" / "xpu" / "xpu_sparse_decode_fp8.py"
    second.parent.mkdir(parents=True)
    second.write_text("from vllm.v1.attention.ops.xpu_mla_sparse import DTYPE\n"
                      "from vllm.utils.import_utils import has_cutedsl\nCUTE = has_cutedsl()\n")
    real_vllm = types.ModuleType("vllm")  # a vLLM already imported must survive untouched
    monkeypatch.setitem(sys.modules, "vllm", real_vllm)

    tree = bench_discovery.bundle_vllm(str(tmp_path))
    sources = VllmTritonSources(tree.module_file,
                                transform=lambda t: t.replace("bfloat16", "float16"))
    attn = sources.module(bench_peers.XPU_ATTENTION_MODULE)
    dec = sources.module(bench_peers.XPU_DECODE_MODULE)
    assert attn.triton is triton and attn.FNUZ is False and attn.LOG2E == pytest.approx(1.4427, 1e-4)
    assert dec.DTYPE == "float16" and dec.CUTE is False  # transform applied; Triton gather chosen
    assert sources.module(bench_peers.XPU_ATTENTION_MODULE) is attn  # executed once
    assert sys.modules["vllm"] is real_vllm and not hasattr(real_vllm, "triton_utils")
    assert not [k for k in sys.modules if k.startswith("vllm.")]


def test_loader_failure_leaves_no_stand_ins(tmp_path, monkeypatch):
    _fake_triton(monkeypatch)
    path = (tmp_path / "vllm_src" / "vllm" / "models" / "deepseek_v4" / "common" / "ops"
            / "cache_utils.py")
    path.parent.mkdir(parents=True)
    path.write_text("from vllm.not_stubbed import thing\n")
    tree = bench_discovery.bundle_vllm(str(tmp_path))
    with pytest.raises(ImportError):
        VllmTritonSources(tree.module_file).module(bench_peers.CACHE_UTILS_MODULE)
    assert not [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]


# ----------------------------------------------------------------------------- conversions
def _ragged_lengths(n, width, gen):
    lens = torch.randint(0, width + 1, (n,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = width, 0
    return lens


def test_csr_matches_dense_prefill(gen):
    s_q, h, s_kv, width = 7, 4, 50, 24
    q = torch.randn(s_q, h, 512, generator=gen).to(torch.bfloat16)
    kv = random_k(s_kv, gen).view(s_kv, 1, 512)
    idx = torch.randint(0, s_kv, (s_q, 1, width), generator=gen, dtype=torch.int32)
    lens = _ragged_lengths(s_q, width, gen)
    punch_holes(idx, lens, 0.2, gen)
    sink = torch.randn(h, generator=gen)
    flat, indptr = csr_from_dense(idx, lens)
    assert flat.dtype == indptr.dtype == torch.int32 and indptr.tolist()[-1] == flat.numel()
    dense = sparse_prefill_ref(q, kv, idx, 512**-0.5, 512, sink, lens)
    ragged = sparse_prefill_ragged_ref(q, kv, flat, indptr, 512**-0.5, 512, sink)
    for got, want in zip(ragged, dense):
        torch.testing.assert_close(got, want, **SAME_SUM_TOL)
    # lengths None = every column; lengths past the width are clamped to it
    full, ptr = csr_from_dense(idx, None)
    assert torch.equal(full, idx.reshape(-1)) and ptr.tolist() == list(range(0, s_q * width + 1, width))
    over, ptr2 = csr_from_dense(idx, torch.full((s_q,), width + 9, dtype=torch.int32))
    assert torch.equal(over, full) and torch.equal(ptr2, ptr)


def _decode_case(gen, with_extra):
    b, h, swa_w, extra_w = 5, 4, 24, 40
    swa = random_paged_cache(6, 8, gen)
    q = torch.randn(b, 1, h, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 48, (b, 1, swa_w), generator=gen, dtype=torch.int32)
    lens = _ragged_lengths(b, swa_w, gen)
    lens[-1] = 3  # keep one key: a request with none is not a case the XPU path handles
    x = {"q": q, "k_cache": swa, "indices": idx, "topk_length": lens,
         "attn_sink": torch.randn(h, generator=gen),
         "extra_k_cache": None, "extra_indices": None, "extra_topk_length": None}
    if with_extra:
        extra = random_paged_cache(9, 2, gen)
        e_idx = torch.randint(0, 18, (b, 1, extra_w), generator=gen, dtype=torch.int32)
        x.update(extra_k_cache=extra, extra_indices=e_idx,
                 extra_topk_length=_ragged_lengths(b, extra_w, gen))
    return x


@pytest.mark.parametrize("with_extra", [False, True], ids=["swa", "swa+extra"])
def test_xpu_decode_layout_matches_decode_reference(gen, with_extra):
    """The tri_xpu decode pipeline with the references in place of its kernels: gather each
    scope's slots into the [topk | swa] workspace, attend through the index table with no
    sink, add the sink from the LSE; must equal sparse_decode_ref."""
    x = _decode_case(gen, with_extra)
    b, _, h, _ = x["q"].shape
    scopes = [(x["extra_k_cache"], x["extra_indices"], x["extra_topk_length"])] if with_extra else []
    scopes.append((x["k_cache"], x["indices"], x["topk_length"]))
    parts = [dequantize_slots(cache_geometry(c), i.reshape(-1).long(), "e4m3fn").view(b, -1, 512)
             for c, i, _ in scopes]
    ws = torch.cat(parts, 1).to(torch.bfloat16)  # exact: dequantised values are bf16-representable
    table = xpu_combined_indices(x["extra_topk_length"], parts[0].shape[1] if with_extra else 0,
                                 x["topk_length"], x["indices"].shape[-1])
    assert table.shape[-1] % bench_peers.XPU_INDEX_ALIGN == 0
    out, _, lse = sparse_prefill_ref(x["q"].view(b, h, 512), ws.view(-1, 1, 512), table,
                                     512**-0.5, 512, None, None)
    ref_out, ref_lse = sparse_decode_ref(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                                         512**-0.5, x["attn_sink"], x["extra_k_cache"],
                                         x["extra_indices"], x["extra_topk_length"])
    torch.testing.assert_close(apply_sink(out, lse, x["attn_sink"]).view(b, 1, h, 512), ref_out,
                               **SAME_SUM_TOL)
    torch.testing.assert_close(lse.view(b, h, 1), ref_lse, **SAME_SUM_TOL)


def test_xpu_combined_indices_by_hand():
    table = xpu_combined_indices(torch.tensor([2, 0], dtype=torch.int32), 3,
                                 torch.tensor([1, 2], dtype=torch.int32), 2)
    k = 5  # workspace rows per token: 3 top-k + 2 SWA
    row0 = [0, 1, 3] + [-1] * 13
    row1 = [k + 3, k + 4] + [-1] * 14
    assert table.tolist() == [[row0], [row1]]
    swa_only = xpu_combined_indices(None, 0, torch.tensor([17, 1], dtype=torch.int32), 20)
    assert swa_only.shape == (2, 1, 32)
    assert swa_only[1, 0, :2].tolist() == [20, -1] and swa_only[0, 0, 16:18].tolist() == [16, -1]


def test_apply_sink_limits():
    out = torch.ones(1, 3, 4, dtype=torch.bfloat16)
    lse = torch.zeros(1, 3)
    got = apply_sink(out, lse, torch.tensor([float("-inf"), 0.0, float("inf")]))
    assert got.dtype == torch.bfloat16
    assert got[0, :, 0].tolist() == [1.0, 0.5, 0.0]
    assert apply_sink(out, lse, None) is out


def test_gather_slot_list_matches_gather_reference(gen):
    reqs, rows, bs = 3, 37, 8
    per_req = -(-rows // bs)
    cache = random_paged_cache(reqs * per_req + 2, bs, gen)
    table = torch.randperm(cache.shape[0], generator=gen)[: reqs * per_req].view(reqs, per_req).int()
    seq_lens = torch.full((reqs,), rows, dtype=torch.int32)
    want = torch.full((reqs, rows, 512), float("nan"), dtype=torch.bfloat16)
    dequantize_and_gather_k_cache_ref(want, cache, seq_lens, None, table, bs, 0)
    slots = gather_slot_list(seq_lens, table, bs, rows)
    got = dequantize_slots(cache_geometry(cache), slots.long(), "e4m3fn").to(torch.bfloat16)
    assert torch.equal(got.view(reqs, rows, 512).view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="exactly 37"):
        gather_slot_list(torch.tensor([37, 36, 37], dtype=torch.int32), table, bs, rows)


# ----------------------------------------------------------------------------- bench driver
def test_gather_check_cannot_pass_on_a_previous_implementation_s_output(gen, monkeypatch):
    """Gather implementations share the output buffer: one that writes nothing must fail
    even after a correct one has filled it."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bench, "graph_time_us", lambda calls: 1.0)
    inputs, check = bench.gather_inputs(20, 8, gen, 2, "cpu")

    def correct(x):
        return lambda: dequantize_and_gather_k_cache_ref(x["out"], x["k_cache"], x["seq_lens"], None,
                                                         x["block_table"], x["block_size"], 0)

    row = {"results": []}
    impls = {"correct": correct, "lazy": lambda x: (lambda: None)}
    bench._measure(row, impls, inputs, check, 0.0, 1.0, {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0},
                   poison=bench.poison_gather_out)
    by = {e["impl"]: e for e in row["results"]}
    assert by["correct"]["check"] == "ok (bit-exact)"
    assert "not bit-exact" in by["lazy"]["error"]


# ----------------------------------------------------------------------------- FlashMLA prefill
class FakeFlashMLAOps:
    """Stand-in for ``torch.ops._flashmla_C``'s sparse prefill: the float32 reference (out in
    bf16, as the op returns it). ``native=False`` is a build without the small-head kernel
    (vLLM 0.26's): it refuses a head count that is not a multiple of 64, as that op does.
    ``heads``: q's head count at every call, refused ones included."""

    def __init__(self, native: bool):
        self.native = native
        self.heads = []

    def sparse_prefill_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, _extra):
        self.heads.append(q.shape[1])
        if q.shape[1] % 64 and not self.native:
            raise RuntimeError(f"Unsupported num_heads {q.shape[1]}: must be a multiple of 64")
        out, max_logits, lse = sparse_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink,
                                                  topk_length)
        return out.to(torch.bfloat16), max_logits, lse


def fake_flashmla(native: bool, version: str) -> bench_peers.FlashMLAPeer:
    """The bench's FlashMLA peer over :class:`FakeFlashMLAOps`, as loaded from an installed
    vLLM of ``version``."""
    ops = FakeFlashMLAOps(native)

    class Peer(bench_peers.FlashMLAPeer):
        def _open(self, source):
            self.ops = ops

    site = "/site/vllm"
    tree = bench_discovery.VllmTree("vllm", version, site, (site,), (site,))
    return Peer(bench_discovery.PeerSource("vllm", version, (f"{site}/_flashmla_C.abi3.so",), tree))


OURS_US = 300.0  # dsv4_tl's (fake) time in the rows below


def prefill_row(peer, monkeypatch, gen, h=16, padded_us=265.0, native_us=412.0):
    """One prefill row of the bench at ``h`` heads (2 input sets, per-row lengths) with
    ``peer``: dsv4_tl stood in for by the reference, the graph timing replaced by fixed
    times (FlashMLA's by the head count its op was last given: 64 = padded)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ops = peer.ops

    def fake_time(calls):
        before = len(ops.heads)
        calls[0]()
        if len(ops.heads) == before:
            return OURS_US
        return padded_us if ops.heads[-1] == 64 else native_us
    monkeypatch.setattr(bench, "graph_time_us", fake_time)
    shape = bench.PrefillShape(h, 8, 128, 520, varying=True)
    inputs = bench.prefill_inputs(shape, gen, 2, "cpu")

    def ours(x):
        return lambda: sparse_prefill_ref(x["q"], x["kv"], x["indices"], bench.SCALE, 512,
                                          x["attn_sink"], x["topk_length"])
    return bench._suite_row("prefill", shape.name, 1, ours, inputs, bench._check_prefill, 1.0,
                            1.0, {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0}, [peer], {})


def table_report(row: dict, peer=None) -> dict:
    return {"device": "X", "sms": 1, "date": "d", "torch": "t", "peer_errors": {},
            "ceilings": {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0}, "rows": [row],
            "peer_sources": {} if peer is None else {peer.name: peer.source.describe()}}


def table_line(table: str, impl: str) -> str:
    return next(line for line in table.splitlines() if line[69:].split()[:1] == [impl])


def vs_flashmla(table: str, impl: str) -> str:
    """The ``vs flashmla`` cell of ``impl``'s line in a bench table."""
    head = next(line for line in table.splitlines() if line.startswith("shape "))
    col = head.index("vs flashmla")
    return table_line(table, impl)[col:col + len("vs flashmla")].strip()


def test_native_flashmla_prefill_is_a_second_checked_entry(gen, monkeypatch):
    """A build that takes 16 heads: both calls are timed and checked against the
    reference, the padded one given 64 heads, the native one the real 16."""
    peer = fake_flashmla(native=True, version="0.33.0")
    row = prefill_row(peer, monkeypatch, gen)
    by = {e["impl"]: e for e in row["results"]}
    assert list(by) == ["dsv4_tl", "flashmla", "flashmla.native"]
    assert by["flashmla"]["check"] == by["flashmla.native"]["check"] == "ok"
    assert (by["flashmla"]["us"], by["flashmla.native"]["us"]) == (265.0, 412.0)
    assert set(peer.ops.heads) == {16, 64}


def test_wrong_native_output_is_a_check_failure(gen, monkeypatch):
    """The native entry is reference-checked: a build whose 16-head kernel computes the
    wrong thing (here: the sink left out) is an error in its row, not a time."""
    peer = fake_flashmla(native=True, version="0.33.0")
    right = peer.ops.sparse_prefill_fwd

    def no_sink(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, extra):
        sink = attn_sink if q.shape[1] == 64 else None
        return right(q, kv, indices, sm_scale, d_v, sink, topk_length, extra)
    peer.ops.sparse_prefill_fwd = no_sink
    by = {e["impl"]: e for e in prefill_row(peer, monkeypatch, gen)["results"]}
    assert by["flashmla"]["check"] == "ok"
    assert "us" not in by["flashmla.native"] and "out" in by["flashmla.native"]["error"]


def test_native_refusal_is_a_note_naming_the_build(gen, monkeypatch):
    """A build that refuses 16 heads (vLLM 0.26's): the padded call alone is timed; the
    native entry says which build refused, tried once per shape, and is no error."""
    peer = fake_flashmla(native=False, version="0.26.0")
    row = prefill_row(peer, monkeypatch, gen)
    by = {e["impl"]: e for e in row["results"]}
    assert by["flashmla"]["check"] == "ok" and by["flashmla"]["us"] == 265.0
    native = by["flashmla.native"]
    assert set(native) == {"impl", "unsupported"}
    assert native["unsupported"] == ("not supported by vLLM 0.26.0: RuntimeError: Unsupported "
                                     "num_heads 16: must be a multiple of 64")
    assert peer.ops.heads.count(16) == 1  # one refused call for the 2 input sets
    table = bench.format_table(table_report(row, peer))
    assert "ERROR" not in table
    assert table_line(table, "flashmla.native").endswith("flashmla.native not supported by "
                                                         "vLLM 0.26.0: RuntimeError: Unsupported "
                                                         "num_heads 16: must be a multiple of 64")
    assert vs_flashmla(table, "dsv4_tl") == f"{265.0 / OURS_US:.2f}x"
    assert vs_flashmla(table, "flashmla") == ""  # FlashMLA's only time: nothing to choose
    ratios = bench.format_ratios(table_report(row)).splitlines()[1]
    assert ("flashmla 0.88x (265.0 vs 300.0 us); flashmla.native n/a (not supported by "
            "vLLM 0.26.0: RuntimeError") in ratios


@pytest.mark.parametrize("padded_us, native_us", [(265.0, 412.0), (412.0, 265.0)],
                         ids=["padded faster", "native faster"])
def test_ratio_against_flashmla_uses_the_faster_call(gen, monkeypatch, padded_us, native_us):
    peer = fake_flashmla(native=True, version="0.33.0")
    row = prefill_row(peer, monkeypatch, gen, padded_us=padded_us, native_us=native_us)
    faster, slower = (("flashmla", "flashmla.native") if padded_us < native_us
                      else ("flashmla.native", "flashmla"))
    assert bench.flashmla_reference(row)["impl"] == faster
    table = bench.format_table(table_report(row, peer))
    assert vs_flashmla(table, "dsv4_tl") == f"{265.0 / OURS_US:.2f}x"
    assert vs_flashmla(table, faster) == "ref"
    assert vs_flashmla(table, slower) == f"{265.0 / 412.0:.2f}x"
    assert "FlashMLA time = the faster of the two (marked ref)" in table.splitlines()[-1]
    ratios = bench.format_ratios(table_report(row)).splitlines()[1]
    assert (f"{faster} {265.0 / OURS_US:.2f}x (265.0 vs 300.0 us, the faster FlashMLA call)"
            in ratios)
    assert f"{slower} {412.0 / OURS_US:.2f}x (412.0 vs 300.0 us)" in ratios


def test_native_entry_only_for_prefill_below_64_heads():
    peer = fake_flashmla(native=True, version="0.33.0")
    q = {h: {"q": torch.zeros(4, h, 512)} for h in (16, 32, 64, 128)}
    assert list(peer.variants("prefill", q[16])) == list(peer.variants("prefill", q[32])) == [
        "flashmla.native"]
    assert peer.variants("prefill", q[64]) == peer.variants("prefill", q[128]) == {}
    assert peer.variants("decode", {"q": torch.zeros(2, 1, 16, 512)}) == {}


def test_report_names_the_build_each_peer_came_from(monkeypatch):
    """The JSON report (peer_sources, peer_builds) and the table's header name the vLLM /
    flash_mla version behind each loaded peer."""
    import json

    peer = fake_flashmla(native=True, version="0.33.0")
    monkeypatch.setattr(bench, "load_peers", lambda names, peers_dir: (
        [peer], {"tri_xpu": "vllm: vllm.v1 not found in /site/vllm"}))
    report = {}
    assert bench._load_peers_into(report, ["flashmla", "tri_xpu"], None) == [peer]
    assert report["peer_builds"] == {"flashmla": "vLLM 0.33.0"}
    where = "vLLM 0.33.0 (installed vllm): /site/vllm/_flashmla_C.abi3.so"
    assert report["peer_sources"] == {"flashmla": where}
    assert json.loads(json.dumps(report)) == report
    table = bench.format_table({**table_report({"shape": "s", "results": []}), **report})
    assert f"peer flashmla from {where}" in table.splitlines()
    package = bench_discovery.PeerSource("flash_mla", "1.0.2", ("/site/flash_mla",))
    assert package.describe() == "flash_mla 1.0.2 (installed flash_mla): /site/flash_mla"
