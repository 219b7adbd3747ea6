"""Shared test plumbing: a fresh seed per test and the ``gpu`` marker.

* ``seed`` fixture: a new random seed per test (``os.urandom``), also passed to
  ``torch.manual_seed``. A failing test's report gets a ``seed`` section; rerun it with
  ``DSV4_TL_SEED=<seed> python -m pytest <node id>``.
* ``gpu`` marker / ``requires_cuda``: tests that need a CUDA device are skipped without one.
* ``requires_sycl_cpu()`` / ``sycl_cpu_device`` fixture: tests on Intel's SYCL CPU device
  (skipped without the runtime unless ``DSV4_TL_REQUIRE_SYCL=1``, as CI sets it).
"""

import functools
import os

import pytest

SEED_ENV = "DSV4_TL_SEED"


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
    # pyproject.toml registers it too; registering twice is harmless.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
