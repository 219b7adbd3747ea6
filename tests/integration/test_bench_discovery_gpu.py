"""GPU: the FlashMLA that ``dsv4-tl bench`` discovers in an installed vLLM runs and matches
the float32 references. The installed vLLM is the peer bundle's files laid out as pip lays
out the vLLM wheel (``bench_discovery.vllm_site_from_bundle``) in a temporary site directory
put first on ``sys.path``; no ``--peers-dir`` is given. Needs ``$PEERS_DIR`` (an unpacked
peer bundle, as scripts/device_setup.sh sets it) for the files. Checked with bench's own
reference checks (tests/integration/test_bench_peers.py documents them)."""

import os
import sys

import pytest
import torch

from dsv4_tl import bench, bench_discovery
from dsv4_tl.bench_peers import discover_peers

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def installed_flashmla(tmp_path_factory):
    root = os.environ.get("PEERS_DIR")
    if not root or not os.path.isfile(os.path.join(root, "MANIFEST.txt")):
        pytest.skip("needs an unpacked peer bundle in $PEERS_DIR (../shared/tools/peer-bundle.sh)")
    site = tmp_path_factory.mktemp("site")
    pkg = bench_discovery.vllm_site_from_bundle(root, str(site))
    saved = list(sys.path)
    sys.path[:] = [str(site)] + [p for p in sys.path if p]
    try:
        (status,) = discover_peers(["flashmla"], None)
    finally:
        sys.path[:] = saved
    return status, pkg


def test_discovered_flashmla_comes_from_the_installed_vllm(installed_flashmla):
    status, pkg = installed_flashmla
    assert status.error is None, status.error
    assert status.source.origin == "vllm" and status.source.version == "0.26.0"
    assert status.source.files == (os.path.join(pkg, "_flashmla_C.abi3.so"),)


@pytest.mark.parametrize("shape", [bench.DecodeShape(64, 4, "c4a", extra_width=512),
                                   bench.DecodeShape(128, 2, "c128a", extra_width=256, varying=True),
                                   bench.DecodeShape(16, 3, "swa")], ids=lambda s: s.name)
def test_discovered_flashmla_decode_matches_reference(installed_flashmla, shape, seed):
    status, _ = installed_flashmla
    gen = torch.Generator("cuda").manual_seed(seed)
    for x in bench.decode_inputs(shape, gen, 2, "cuda"):
        run = status.peer.decode(x)
        assert bench._check_decode(x, run()) == "ok"
        assert bench._check_decode(x, run()) == "ok"  # the scheduler metadata reused


@pytest.mark.parametrize("shape", [bench.PrefillShape(64, 256, 640, 8192, varying=True),
                                   bench.PrefillShape(32, 128, 256, 4096)], ids=lambda s: s.name)
def test_discovered_flashmla_prefill_matches_reference(installed_flashmla, shape, seed):
    status, _ = installed_flashmla
    gen = torch.Generator("cuda").manual_seed(seed)
    (x,) = bench.prefill_inputs(shape, gen, 1, "cuda")
    assert bench._check_prefill(x, status.peer.prefill(x)()) == "ok"
