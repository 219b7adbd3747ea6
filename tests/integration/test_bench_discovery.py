"""Peer discovery of ``dsv4-tl bench`` without a GPU (dsv4_tl.bench_discovery,
bench_peers.discover_peers): package layouts assembled in a temporary directory (an
installed vllm, an installed flash_mla, a peer bundle) are put on ``sys.path`` and searched.

CI has no peer bundle: the layouts are made of stand-in files (Triton modules that import
the stand-in vLLM names, an ``_flashmla_C`` that is not a library, a ``flash_mla`` package
whose functions are the float32 references). With ``$PEERS_DIR`` set to an unpacked bundle,
one more test lays the bundle's real files out as an installed vllm; loading the real
``_flashmla_C`` needs a GPU (tests/integration/test_bench_discovery_gpu.py)."""

import os
import sys
import types

import pytest
import torch

from dsv4_tl import bench, bench_discovery, bench_peers
from dsv4_tl.bench_peers import (
    CACHE_UTILS_MODULE,
    PEER_NAMES,
    ROCM_MODULE,
    XPU_ATTENTION_MODULE,
    XPU_DECODE_MODULE,
    discover_peers,
    format_peer_list,
    load_peers,
)

TRITON_MODULES = (ROCM_MODULE, XPU_ATTENTION_MODULE, XPU_DECODE_MODULE, CACHE_UTILS_MODULE)


@pytest.fixture
def clean_path(monkeypatch):
    """sys.path without this machine's vllm / flash_mla (the directories holding them are
    left out) and with stand-in `triton` modules; yields a function that puts a directory
    first."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.isdir(p) and not any(
        os.path.exists(os.path.join(p, name)) for name in ("vllm", "flash_mla"))])
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    triton = types.ModuleType("triton")
    triton.language = types.ModuleType("triton.language")
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", triton.language)
    for name in [n for n in sys.modules if n == "flash_mla" or n.startswith("flash_mla.")]:
        monkeypatch.delitem(sys.modules, name)
    yield lambda d: monkeypatch.setattr(sys, "path", [str(d)] + sys.path)
    for name in [n for n in sys.modules if n == "flash_mla" or n.startswith("flash_mla.")]:
        del sys.modules[name]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def triton_file(name: str, tag: str) -> str:
    """A stand-in for one of vLLM's Triton files: imports what the real ones import first."""
    return ("from vllm.triton_utils import triton\nfrom vllm.platforms import current_platform\n"
            f"ORIGIN = {tag!r}\nMODULE = {name!r}\n")


def installed_vllm(site, version="9.9.1", modules=TRITON_MODULES, so=b"\x7fELF not really"):
    """``site/vllm`` as pip lays out vLLM: packages whose ``__init__`` must not run (they
    raise), the Triton files, an ``_flashmla_C.abi3.so`` (not a loadable library), and the
    dist-info that carries the version."""
    pkg = site / "vllm"
    write(pkg / "__init__.py", "raise RuntimeError('discovery executed vllm/__init__.py')\n")
    for name in modules:
        parts = name.split(".")
        for i in range(2, len(parts)):
            init = site.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                write(init, f"raise RuntimeError('discovery executed {'.'.join(parts[:i])}')\n")
        write(site.joinpath(*parts[:-1], parts[-1] + ".py"), triton_file(name, "installed"))
    if so is not None:
        (pkg / "_flashmla_C.abi3.so").write_bytes(so)
    write(site / f"vllm-{version}.dist-info" / "METADATA",
          f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return pkg


def bundle(root, modules=TRITON_MODULES):
    """A peer bundle as peer-bundle.sh writes it (MANIFEST names the wheel)."""
    write(root / "MANIFEST.txt", "Source: PyPI wheel vllm-0.26.0-cp38-abi3-manylinux.whl sha256=x\n")
    for name in modules:
        write(root.joinpath("vllm_src", *name.split(".")).with_suffix(".py"),
              triton_file(name, "bundle"))
    write(root / "flashmla" / "_flashmla_C.abi3.so", "not a library either")
    return root


# ----------------------------------------------------------------------------- installed vllm
def test_installed_vllm_is_found_through_the_import_system_and_not_executed(tmp_path, clean_path):
    pkg = installed_vllm(tmp_path / "site")
    clean_path(tmp_path / "site")
    places = dict(bench_discovery.search_places(None))
    tree = places["vllm"]
    assert tree.version == "9.9.1" and tree.where == str(pkg)
    assert tree.extension_file() == str(pkg / "_flashmla_C.abi3.so")
    assert tree.module_file(ROCM_MODULE) == str(pkg / "v1" / "attention" / "ops" / "rocm_aiter_mla_sparse.py")
    assert isinstance(places["flash_mla"], LookupError) and isinstance(places["bundle"], LookupError)

    statuses = {s.name: s for s in discover_peers(PEER_NAMES, None)}
    assert "vllm" not in sys.modules  # no vllm package ran (their __init__ raise)
    for name in ("tri_rocm", "tri_rocm_splitk", "tri_xpu", "tri_vllm", "tri_xpu_slots"):
        s = statuses[name]
        assert s.error is None and s.source.origin == "vllm" and s.source.version == "9.9.1", name
        assert all(f.startswith(str(pkg)) for f in s.source.files)
    assert statuses["tri_rocm"].peer.m.ORIGIN == "installed"
    assert statuses["tri_xpu"].peer.gather.MODULE == XPU_DECODE_MODULE
    # the extension is found there but does not load: one line naming the file and why
    fm = statuses["flashmla"]
    assert fm.peer is None and "\n" not in fm.error
    assert "vllm: load failed: OSError: " in fm.error and str(pkg / "_flashmla_C.abi3.so") in fm.error
    assert "flash_mla: not installed" in fm.error and "bundle: no peer bundle" in fm.error


def test_a_file_missing_or_failing_in_vllm_falls_back_to_the_bundle(tmp_path, clean_path):
    site = tmp_path / "site"
    installed_vllm(site, modules=(ROCM_MODULE, CACHE_UTILS_MODULE), so=None)
    write(site.joinpath(*CACHE_UTILS_MODULE.split(".")).with_suffix(".py"),
          "from vllm.only_in_a_newer_vllm import thing\n")
    root = bundle(tmp_path / "peers")
    clean_path(site)
    statuses = {s.name: s for s in discover_peers(PEER_NAMES, str(root))}
    assert statuses["tri_rocm"].source.origin == "vllm"
    assert statuses["tri_rocm"].peer.m.ORIGIN == "installed"
    xpu = statuses["tri_xpu"]
    assert xpu.source.origin == "bundle" and xpu.source.version == "0.26.0"
    assert xpu.peer.attn.ORIGIN == "bundle"
    assert xpu.tried == [f"vllm: vllm.v1.attention.ops.xpu_mla_sparse not found in {site / 'vllm'}"]
    gather = statuses["tri_vllm"]
    assert gather.source.origin == "bundle"
    assert gather.tried == ["vllm: load failed: ModuleNotFoundError: No module named "
                            "'vllm.only_in_a_newer_vllm'"]
    assert statuses["flashmla"].tried[0] == f"vllm: no _flashmla_C extension in {site / 'vllm'}"
    assert "bundle: load failed: OSError" in statuses["flashmla"].error

    places = bench_discovery.search_places(str(root))
    listing = format_peer_list(list(statuses.values()), places)
    assert f"  vllm: {site / 'vllm'} (version 9.9.1)" in listing
    assert f"  bundle: {root} (version 0.26.0)" in listing
    lines = listing.splitlines()
    row = next(line for line in lines if line.startswith("tri_xpu "))
    assert row.split()[:4] == ["tri_xpu", "loaded", "bundle", "0.26.0"]
    assert any(line.split()[:3] == ["passed", "over", "vllm:"] and "not found" in line for line in lines)
    assert next(line for line in lines if line.startswith("flashmla ")).split()[1] == "failed"


def test_load_peers_errors_are_one_line_rows(tmp_path, clean_path):
    installed_vllm(tmp_path / "site", modules=(ROCM_MODULE,))
    write(tmp_path.joinpath("site", *ROCM_MODULE.split(".")).with_suffix(".py"),
          "raise RuntimeError('first line\\nsecond line')\n")
    clean_path(tmp_path / "site")
    peers, errors = load_peers(["tri_rocm", "tri_vllm"], None)
    assert peers == []
    assert errors["tri_rocm"].startswith("vllm: load failed: RuntimeError: first line second line;")
    assert errors["tri_vllm"].startswith("vllm: vllm.models not found in ")
    rows = bench._failed_peer_entries(errors, "decode")
    assert [r["impl"] for r in rows] == ["tri_rocm"] and "\n" not in rows[0]["error"]
    report = {"device": "X", "sms": 1, "date": "d", "torch": "t",
              "ceilings": {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0}, "peer_errors": errors,
              "peer_sources": {"flashmla": "vllm 9.9.1: /x/_flashmla_C.abi3.so"},
              "rows": [{"suite": "decode", "shape": "s", "attended": 1, "results": rows}]}
    table = bench.format_table(report).splitlines()
    assert "peer flashmla from vllm 9.9.1: /x/_flashmla_C.abi3.so" in table
    assert sum("tri_rocm" in line for line in table) == 2  # the load failure and the row


def test_measure_reports_a_multi_line_failure_on_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def broken(x):
        raise RuntimeError("CUDA error: no kernel image\nCUDA kernel errors might be reported")
    row = {"results": []}
    bench._measure(row, {"peer": broken}, [{}], None, 0.0, 1.0, {})
    assert row["results"] == [{"impl": "peer", "error": "RuntimeError: CUDA error: no kernel "
                                                         "image CUDA kernel errors might be reported"}]


def test_one_line_keeps_the_cause_and_the_limit():
    try:
        try:
            raise OSError("libcuda.so.1: cannot open shared object file")
        except OSError as inner:
            raise OSError("Could not load this library: /x.so") from inner
    except OSError as exc:
        text = bench_discovery.one_line(exc)
    assert text == ("OSError: Could not load this library: /x.so (libcuda.so.1: cannot open "
                    "shared object file)")
    long = bench_discovery.one_line(ValueError("x" * 500))
    assert len(long) == 300 and long.endswith("...")


def test_broken_vllm_spec_and_module_named_vllm(tmp_path, clean_path):
    write(tmp_path / "vllm.py", "")  # a module, not the package
    clean_path(tmp_path)
    with pytest.raises(LookupError, match="is a module, not vLLM's package"):
        bench_discovery.installed_vllm()


def stand_in_triton(site):
    """``site/triton``: importable stand-ins for a child process (``--peers list`` finds the
    peers in one, which does not see ``clean_path``'s modules)."""
    write(site / "triton" / "__init__.py", "from . import language\n")
    write(site / "triton" / "language.py", "")


def test_peers_list_cli(tmp_path, clean_path, capsys):
    installed_vllm(tmp_path / "site", modules=(ROCM_MODULE,))
    stand_in_triton(tmp_path / "site")
    clean_path(tmp_path / "site")
    assert bench.main(["--peers", "list", "--peers-dir", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "searched, in order:"
    assert out[3] == f"  bundle: peer bundle not found at {tmp_path / 'absent'}"
    rocm = next(line for line in out if line.startswith("tri_rocm "))
    assert rocm.split()[1:4] == ["loaded", "vllm", "9.9.1"] and rocm.endswith("rocm_aiter_mla_sparse.py")
    xpu = next(line for line in out if line.startswith("tri_xpu "))
    assert xpu.split()[1] == "missing" and "xpu_mla_sparse not found" in xpu


def test_a_peer_that_exits_is_a_row_of_the_peer_list_not_the_end_of_the_bench(
        tmp_path, clean_path, capsys):
    """Issue 34 item 7: a flash_mla package whose import called ``sys.exit(5)`` ended
    ``dsv4-tl bench --peers list`` with status 5 and no output; discovery runs in a child
    process that lists it as a failed load (SystemExit and KeyboardInterrupt alike)."""
    installed_flash_mla(tmp_path / "site", "import sys\nsys.exit(5)\n")
    stand_in_triton(tmp_path / "site")
    clean_path(tmp_path / "site")
    assert bench.main(["--peers", "list", "--peers-dir", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.splitlines()
    flashmla = next(line for line in out if line.startswith("flashmla "))
    assert flashmla.split()[1] == "failed" and "flash_mla: load failed: SystemExit: 5" in flashmla
    # timing loads in this process: the exit is a load failure there too
    (status,) = discover_peers(["flashmla"], None)
    assert status.peer is None and "flash_mla: load failed: SystemExit: 5" in status.error


def test_a_peer_whose_import_hangs_ends_the_peer_list_with_one_line(tmp_path, clean_path,
                                                                   capsys, monkeypatch):
    """Issue 34 item 7: a peer whose import hangs hung ``--peers list``; the child process
    is ended after ``PEER_LIST_TIMEOUT_S`` with one line on stderr and exit status 1."""
    started = tmp_path / "import_started"
    installed_flash_mla(tmp_path / "site", f"import pathlib, time\n"
                                           f"pathlib.Path({str(started)!r}).touch()\n"
                                           "time.sleep(600)\n")
    stand_in_triton(tmp_path / "site")
    clean_path(tmp_path / "site")
    monkeypatch.setattr(bench_peers, "PEER_LIST_TIMEOUT_S", 20.0)
    assert bench.main(["--peers", "list"]) == 1
    captured = capsys.readouterr()
    assert started.exists(), "the child never reached the peer's import: the test shows nothing"
    assert captured.out == "" and captured.err == (
        "dsv4-tl bench: --peers list: peer discovery did not finish within 20 s (a peer's code "
        "hangs while loading?): nothing listed\n")


def test_bench_help_says_that_peers_code_is_run(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Timing imports and runs the installed peers' code" in help_text
    assert "'list' loads them in a child process, ended after 120 s" in help_text


# ----------------------------------------------------------------------------- flash_mla package
# A flash_mla package as DeepSeek's FlashMLA exposes it (its public signatures), computing
# with dsv4_tl's float32 references; it asserts the calling conventions of its sparse paths.
FAKE_FLASH_MLA = '''
import dataclasses
import torch
from dsv4_tl.reference import sparse_decode_ref, sparse_prefill_ref

__version__ = "1.0.0"
CALLS = []

@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    config: object = None

def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None

def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    meta = tile_scheduler_metadata
    assert isinstance(meta, FlashMLASchedMeta) and num_splits is None and head_dim_v == 512
    assert is_fp8_kvcache and not causal and indices is not None
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1
    config = (q.shape, extra_k_cache is None or extra_k_cache.shape[2] == 1)
    if meta.have_initialized:
        assert meta.config == config, "sched meta reused across shapes"
    meta.have_initialized, meta.config = True, config
    CALLS.append(("decode", meta))
    return sparse_decode_ref(q, k_cache.squeeze(2), indices, topk_length, softmax_scale, attn_sink,
                             None if extra_k_cache is None else extra_k_cache.squeeze(2),
                             extra_indices_in_kvcache, extra_topk_length)

def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    assert d_v == 512 and q.shape[1] % 64 == 0
    CALLS.append(("prefill", None))
    return sparse_prefill_ref(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
'''


def installed_flash_mla(site, text=FAKE_FLASH_MLA, version="1.0.0"):
    write(site / "flash_mla" / "__init__.py", text)
    write(site / f"flash_mla-{version}.dist-info" / "METADATA",
          f"Metadata-Version: 2.1\nName: flash_mla\nVersion: {version}\n")


def test_flash_mla_package_serves_flashmla_after_a_vllm_that_fails(tmp_path, clean_path):
    site = tmp_path / "site"
    installed_vllm(site, modules=())
    installed_flash_mla(site)
    clean_path(site)
    (status,) = discover_peers(["flashmla"], None)
    assert status.source.origin == "flash_mla" and status.source.version == "1.0.0"
    assert status.source.files == (str(site / "flash_mla"),)
    assert isinstance(status.peer, bench_peers.FlashMLAPackagePeer)
    assert status.tried[0].startswith("vllm: load failed: OSError")


def test_flash_mla_package_peer_matches_the_references(tmp_path, clean_path, monkeypatch, seed):
    """The package peer's calls (argument order, cache views, per-input-set scheduler
    metadata, head padding) checked by bench's own reference check on its own inputs."""
    installed_flash_mla(tmp_path / "site")
    clean_path(tmp_path / "site")
    (status,) = discover_peers(["flashmla"], None)
    peer = status.peer
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bench, "graph_time_us", lambda calls: [c() for c in calls] and 1.0)
    ceilings = {"bf16_gemm_tflops": 1.0, "copy_gbps": 1.0}
    gen = torch.Generator().manual_seed(seed)
    for shape in (bench.DecodeShape(16, 2, "c4a", extra_width=64, varying=True),
                  bench.DecodeShape(64, 2, "swa", window=40)):
        inputs = bench.decode_inputs(shape, gen, 2, "cpu")
        row = {"results": []}
        bench._measure(row, {"flashmla": peer.decode}, inputs, bench._check_decode, 1.0, 1.0,
                       ceilings)
        assert row["results"][0].get("check") == "ok", (shape.name, row)
    inputs = bench.prefill_inputs(bench.PrefillShape(16, 8, 136, 600, varying=True), gen, 1, "cpu")
    row = {"results": []}
    bench._measure(row, {"flashmla": peer.prefill}, inputs, bench._check_prefill, 1.0, 1.0, ceilings)
    assert row["results"][0].get("check") == "ok", row
    calls = sys.modules["flash_mla"].CALLS
    # one scheduler metadata per decode input set, reused by that set's calls
    metas = [id(m) for kind, m in calls if kind == "decode"]  # CALLS keeps them alive
    assert len(set(metas)) == 4 and len(metas) > 4


@pytest.mark.parametrize("text, reason", [
    ("def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,\n"
     "                           tile_scheduler_metadata, num_splits, softmax_scale=None,\n"
     "                           causal=False):\n    pass\n"
     "def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512):\n    pass\n"
     "def get_mla_metadata(*a):\n    pass\n",
     "flash_mla: load failed: RuntimeError: flash_mla.flash_mla_with_kvcache (0.9) takes no "
     "indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, "
     "extra_topk_length (not a DSv4 FlashMLA)"),
    ("raise ImportError('libcudart.so.12: cannot open shared object file')\n",
     "flash_mla: load failed: ImportError: libcudart.so.12: cannot open shared object file"),
], ids=["pre-dsv4", "import-fails"])
def test_flash_mla_package_that_cannot_serve_is_a_one_line_reason(tmp_path, clean_path, text, reason):
    installed_flash_mla(tmp_path / "site", text, version="0.9")
    clean_path(tmp_path / "site")
    (status,) = discover_peers(["flashmla"], None)
    assert status.peer is None
    assert status.error == f"vllm: not installed (the import system finds no 'vllm'); {reason}; " \
                           "bundle: no peer bundle: pass --peers-dir or set PEERS_DIR"


# ----------------------------------------------------------------------------- the real bundle
@pytest.fixture
def real_bundle():
    root = os.environ.get("PEERS_DIR")
    if not root or not os.path.isfile(os.path.join(root, "MANIFEST.txt")):
        pytest.skip("needs an unpacked peer bundle in $PEERS_DIR (../shared/tools/peer-bundle.sh)")
    return root


def test_bundle_laid_out_as_installed_vllm_is_found_there(tmp_path, clean_path, real_bundle):
    site = tmp_path / "site"
    pkg = bench_discovery.vllm_site_from_bundle(real_bundle, str(site))
    clean_path(site)
    places = dict(bench_discovery.search_places(real_bundle))
    installed, bundled = places["vllm"], places["bundle"]
    assert installed.version == bundled.version == "0.26.0"
    assert installed.extension_file() == os.path.join(pkg, "_flashmla_C.abi3.so")
    for name in TRITON_MODULES:
        mine, theirs = installed.module_file(name), bundled.module_file(name)
        assert mine.startswith(pkg) and theirs.startswith(real_bundle)
        assert open(mine).read() == open(theirs).read()
    for name in PEER_NAMES:
        found = [(o, s) for o, s in bench_discovery.peer_sources(
            bench_peers.PEER_CLASSES[name].needs, list(places.items()), name == "flashmla")
            if isinstance(s, bench_discovery.PeerSource)]
        assert [o for o, _ in found] == ["vllm", "bundle"], name
