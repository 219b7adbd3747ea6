"""Shared test plumbing: a fresh seed per test and the ``gpu`` marker.

* ``seed`` fixture: a new random seed per test (``os.urandom``), also passed to
  ``torch.manual_seed``. A failing test's report gets a ``seed`` section; rerun it with
  ``DSV4_TL_SEED=<seed> python -m pytest <node id>``.
* ``gpu`` marker / ``requires_cuda``: tests that need a CUDA device are skipped without one.
* ``gpu_knobs`` marker: a GPU test case that forces a schedule no shipped variant uses on any
  target, beyond the one or two cases kept per test (each compiles a variant of its own: about
  half the compiles of the GPU suite from a cold cache). A selection label only: a plain
  ``pytest`` runs them; ``scripts/device_gpu_tests.sh`` leaves them out unless
  ``GPU_TEST_KNOBS=1`` (the tuner checks every candidate it times against the reference
  before logging it, and a shipped variant is tested by the default suite).
* ``gpu_heavy`` marker: a GPU test that needs more than ~4 GiB of the card (up to ~10 GiB).
  With several pytest-xdist workers on one GPU each worker's allocator is capped at an equal
  share of the card's memory (:func:`gpu_worker_share`; a test that needs more fails with an
  out-of-memory error that names the marker, instead of starving another worker's test at
  random), and ``gpu_heavy`` tests are skipped where that share is below
  :data:`GPU_HEAVY_SHARE_BYTES`: ``scripts/device_gpu_tests.sh`` runs the others on one
  worker per CPU core (from a cold cache they mostly compile kernels, one core each), then
  the heavy ones in a second pass on fewer workers with larger shares. After every GPU test the
  worker's cached blocks go back to the driver (``torch.cuda.empty_cache``); with
  ``$DSV4_TL_GPU_MEM_LOG`` (a folder) each test's peak reserved memory is logged there.
* ``requires_sycl_cpu()`` / ``sycl_cpu_device`` fixture: tests on Intel's SYCL CPU device
  (skipped without the runtime unless ``DSV4_TL_REQUIRE_SYCL=1``, as CI sets it).
"""

import functools
import json
import os
from pathlib import Path

import pytest

SEED_ENV = "DSV4_TL_SEED"

# JAX (the DLPack test imports it) takes 75 % of the card at its first GPU use unless told
# not to: on an 80 GB H100 that worker held 60 GiB and starved the other workers' tests
# (bench/results/2026-11-25_h100_run50_final_suite/). Set here, before any test imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA_AVAILABLE = _cuda_available()

# `from conftest import requires_cuda`; `@pytest.mark.gpu` does the same.
requires_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device")


@functools.lru_cache(maxsize=None)
def sycl_cpu_ready() -> bool:
    """Intel's SYCL runtime (dpctl) and the sycl-jit compiler are installed."""
    try:
        import dpctl  # noqa: F401
    except ImportError:
        return False
    from dsv4_tl.loader import can_compile
    from dsv4_tl.targets import parse_target

    return can_compile(parse_target("sycl"))


def requires_sycl_cpu() -> list:
    """Marks of a test on the SYCL CPU device. CI sets DSV4_TL_REQUIRE_SYCL=1: there a
    missing runtime fails these tests instead of skipping them."""
    return [pytest.mark.sycl,
            pytest.mark.skipif(not sycl_cpu_ready() and os.environ.get("DSV4_TL_REQUIRE_SYCL") != "1",
                               reason="needs Intel's SYCL runtime (bash scripts/setup_sycl.sh)")]


def on_sycl_cpu() -> list:
    """Marks of a module whose tests all run on the SYCL CPU device: :func:`requires_sycl_cpu`
    plus the module-scoped :func:`sycl_cpu_device` set-up."""
    return [*requires_sycl_cpu(), pytest.mark.usefixtures("sycl_cpu_device")]


def clear_dispatch_caches() -> None:
    """Drop the front ends' memoised targets and kernels and the loaders (after a change of
    the device routing or kernel directory)."""
    from dsv4_tl import loader
    from dsv4_tl.kernels import kernels_changed

    kernels_changed()
    loader.clear_loaders()


@pytest.fixture
def cpu_gen(seed):
    """A CPU generator seeded with this test's seed (the SYCL tests' tensors live on the CPU)."""
    import torch

    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def sycl_cpu_device(tmp_path_factory):
    """CPU tensors -> the SYCL CPU device; kernels JIT-compiled into a fresh kernel dir
    (yielded)."""
    saved = {k: os.environ.get(k) for k in ("DSV4_TL_SYCL_DEVICE", "DSV4_TL_KERNEL_DIR")}
    os.environ["DSV4_TL_SYCL_DEVICE"] = "opencl:cpu"
    os.environ["DSV4_TL_KERNEL_DIR"] = str(tmp_path_factory.mktemp("sycl_kernels"))
    clear_dispatch_caches()
    yield os.environ["DSV4_TL_KERNEL_DIR"]
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    clear_dispatch_caches()


def pytest_configure(config):
    # pyproject.toml registers them too; registering twice is harmless.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", GPU_HEAVY_MARKER)
    config.addinivalue_line("markers", GPU_KNOBS_MARKER)


GPU_KNOBS_MARKER = ("gpu_knobs: a GPU test case that forces a schedule no shipped variant uses (a knob "
                    "value the tuner may pick); scripts/device_gpu_tests.sh runs them with "
                    "GPU_TEST_KNOBS=1, a plain pytest always")
GPU_HEAVY_MARKER = ("gpu_heavy: a GPU test that needs more than ~4 GiB of the card: skipped where a "
                    "worker's share is below 12 GiB (scripts/device_gpu_tests.sh's second pass)")
# The least share of the card a worker's allocator may hold for it to run gpu_heavy tests: the
# heaviest peaks at ~10 GiB (test_decode_persistent_tile_balance[64-128-1-c128a4096-...]: 8.3
# GiB reserved, then 1.75 GiB more, run 85). The light tests peak below ~4 GiB, so the first
# pass of scripts/device_gpu_tests.sh may give each worker one 6 GiB share of the card or less
# (an 80 GB H100: 13 workers of ~5 GiB).
GPU_HEAVY_SHARE_BYTES = 12 << 30
# What each worker keeps outside its allocator's share: CUDA context, loaded kernel modules,
# cuBLAS workspaces (about 0.6 GiB on H100/H200 with torch 2.x; rounded up).
GPU_CONTEXT_BYTES = 1 << 30
MEM_LOG_ENV = "DSV4_TL_GPU_MEM_LOG"


def gpu_workers() -> int:
    """The pytest-xdist workers sharing the GPU (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))


def gpu_worker_share(total_bytes: int, workers: int) -> float:
    """The fraction of a card of ``total_bytes`` that one of ``workers`` workers' allocator
    may hold: an equal share of what the workers' CUDA contexts leave (1.0 for one worker)."""
    if workers <= 1:
        return 1.0
    return max(0.0, (total_bytes - workers * GPU_CONTEXT_BYTES) / workers / total_bytes)


# The groups (test files) that take longest on the 2-core CPU machine, about longest first
# (a CI run of 2026-11-28, where xdist's order by test count ran every one of them but the
# HIP build last: the stress test, then the SYCL files one after another in one worker): the HIP
# build of every variant (on every core), the SYCL example and kernel tests (each kernel
# compiled for Intel's CPU device), the build-and-load stress test's processes, the
# fingerprints of every shipped variant, the AOT builds. Without the HIP and SYCL toolchains
# those skip at once.
LONG_GROUPS = (
    "tests/builds/test_hip_build.py",
    "tests/integration/test_example_dsv4_attention.py",
    "tests/builds/test_build_concurrency.py",
    "tests/sparse_decode/test_sparse_decode_sycl.py",
    "tests/builds/test_fingerprints.py",
    "tests/dequant_gather/test_dequant_gather_sycl.py",
    "tests/insert_k_cache/test_insert_k_cache_sycl.py",
    "tests/sparse_prefill/test_sparse_prefill_sycl.py",
    "tests/builds/test_build_loader.py",
    "tests/builds/test_artifact_trust.py",
    "tests/indices/test_indices_sycl.py",
    "tests/integration/test_bench_discovery.py",
    "tests/tune/test_tuning.py",
)


# Seconds each GPU test took in the last cold-cache runs of the suite (most of it compiling
# its kernels): tests/gpu_durations.json, refreshed from a run's junit files by
# scripts/device_gpu_tests.sh ($OUT/gpu_durations.json). A test missing there (new, renamed)
# counts as NEW_GPU_TEST_SECONDS: a new test mostly brings a new kernel to compile.
GPU_DURATIONS = Path(__file__).with_name("gpu_durations.json")
NEW_GPU_TEST_SECONDS = 30.0


def _gpu_durations() -> dict:
    try:
        return json.loads(GPU_DURATIONS.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def worksteal_order(items: list, workers: int, seconds: dict) -> list:
    """``items`` reordered for pytest-xdist's worksteal on ``workers`` workers, which starts each
    worker on a contiguous slice of the collection (``len // workers`` tests, the last
    ``len % workers`` slices one more) and lets an idle one take the back half of the fullest
    queue. Longest first, each test goes to the slice with the least seconds so far that has
    room (LPT): the slices' sums come out about equal and each starts on its longest test, so
    a test that compiles several kernels one after another (~200 s from a cold cache) cannot
    start last and end the run alone. ``seconds``: {node id: seconds}."""
    def cost(item):
        return seconds.get(item.nodeid, NEW_GPU_TEST_SECONDS if "gpu" in item.keywords else 0.0)
    ranked = sorted(items, key=cost, reverse=True)  # stable: equal costs keep their order
    room, left = [], len(ranked)
    for i in range(workers):  # worksteal's first hand-out: len(pending) // workers still to serve
        room.append(left // (workers - i))
        left -= room[-1]
    slices = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for item in ranked:
        seat = min((i for i in range(workers) if len(slices[i]) < room[i]),
                   key=lambda i: totals[i])
        slices[seat].append(item)
        totals[seat] += cost(item)
    return [item for piece in slices for item in piece]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # pytest-xdist's --dist loadgroup (scripts/test.sh) hands each xdist_group to one worker.
    # A test file is one group unless its tests name their own (test_lowering: the tests that
    # read one compiled kernel): its module-scoped set-up (the HIP build of every variant, the
    # SYCL kernel dir, the AOT builds) then runs once, not once in every worker.
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # The worker that draws a long group last ends the run alone: xdist hands out groups in
    # collection order (scripts/test.sh turns off its reordering by test count), so the long
    # ones go first, longest first, and the short ones fill in behind them.
    first = {path: rank for rank, path in enumerate(LONG_GROUPS)}
    items.sort(key=lambda item: first.get(item.get_closest_marker("xdist_group").args[0],
                                          len(first)))
    if not CUDA_AVAILABLE:
        skip = pytest.mark.skip(reason="gpu test: no CUDA device here")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    if gpu_workers() > 1:
        items[:] = worksteal_order(items, gpu_workers(), _gpu_durations())
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if gpu_worker_share(total, gpu_workers()) * total < GPU_HEAVY_SHARE_BYTES:
        skip = pytest.mark.skip(reason="gpu_heavy: needs a worker share of at least 12 GiB; runs "
                                       "in scripts/device_gpu_tests.sh's second pass")
        for item in items:
            if "gpu_heavy" in item.keywords:
                item.add_marker(skip)


_gpu_share: list = []  # [fraction] once this worker's allocator is capped


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """GPU tests: cap this worker's allocator at its share (once), log the test's peak
    reserved memory (``$DSV4_TL_GPU_MEM_LOG``) and give the cached blocks back after it, so
    what one test reserved is not held from the other workers' tests."""
    if "gpu" not in request.keywords or not CUDA_AVAILABLE:
        yield
        return
    import torch

    if not _gpu_share:
        total = torch.cuda.get_device_properties(0).total_memory
        _gpu_share.append(gpu_worker_share(total, gpu_workers()))
        if _gpu_share[0] < 1.0:
            torch.cuda.set_per_process_memory_fraction(_gpu_share[0])
    torch.cuda.reset_peak_memory_stats()
    yield
    import gc
    import json

    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    log_dir = os.environ.get(MEM_LOG_ENV)
    if log_dir:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(log_dir, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "peak_gib": round(peak / 2**30, 3),
                                "share": round(_gpu_share[0], 4)}) + "\n")


@pytest.fixture
def seed(request) -> int:
    """A fresh seed for this test (or ``$DSV4_TL_SEED``); torch's RNG is seeded with it."""
    env = os.environ.get(SEED_ENV)
    value = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", value))
    import torch

    torch.manual_seed(value)
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("seed", f"rerun with {SEED_ENV}={value}"))
        if (call.excinfo is not None and "OutOfMemoryError" in call.excinfo.typename
                and _gpu_share and _gpu_share[0] < 1.0):
            report.sections.append(("gpu memory", (
                f"this worker may hold {_gpu_share[0]:.1%} of the card ({gpu_workers()} "
                "workers share it): a test that needs more than ~4 GiB is marked "
                "@pytest.mark.gpu_heavy (it then runs where a worker's share is at least 12 GiB)")))


# Skipped tests, grouped by what would enable them: (reason contains, what, how to enable).
_ENABLERS = (
    ("setup_sycl.sh", "SYCL kernel tests (Intel's SYCL CPU device)",
     "bash scripts/setup_sycl.sh, then rerun (CI: .ci/run sets up HIP and SYCL first)"),
    ("setup_hip.sh", "HIP build tests (gfx942 / gfx950 code objects)",
     'eval "$(bash scripts/setup_hip.sh)", then rerun in that shell'),
    ("CUDA device", "GPU tests",
     "a machine with an NVIDIA GPU: bash scripts/test.sh -m gpu "
     "(lent GPU machines: scripts/device_gpu_tests.sh)"),
    ("JAX sees no GPU", "GPU tests", "a machine with an NVIDIA GPU: bash scripts/test.sh -m gpu"),
)


def pytest_terminal_summary(terminalreporter):
    """At the end of the run: what was skipped and the command that enables it."""
    counts, other = {}, {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for needle, what, how in _ENABLERS:
            if needle in reason:
                counts[(what, how)] = counts.get((what, how), 0) + 1
                break
        else:
            other[reason] = other.get(reason, 0) + 1
    if not counts and not other:
        return
    terminalreporter.section("skipped tests and how to run them")
    for (what, how), n in counts.items():
        terminalreporter.write_line(f"{n:4d} {what}: {how}")
    for reason, n in other.items():
        terminalreporter.write_line(f"{n:4d} {reason}")
