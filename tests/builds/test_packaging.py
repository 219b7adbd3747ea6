"""The installed package: subpackage mapping, schedule files, wheel contents, TileLang's TVM.

``pyproject.toml`` maps ``dsv4_tl.tile_kernels`` -> tile_kernels/, ``dsv4_tl.schedules`` ->
schedules/ and ``dsv4_tl.tuning_logs`` -> tuning_logs/. The standalone ``apache-tvm`` wheel
must not be installed beside TileLang: it pulls an ``apache-tvm-ffi`` newer than TileLang
0.1.15 accepts (``import tilelang`` then fails), and a bare ``import tvm`` before
``import tilelang`` would pick it instead of TileLang's bundled TVM (README, "Dependencies").
"""

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SM90A = "cuda_sm90a"


def test_subpackages_import():
    import dsv4_tl.schedules
    import dsv4_tl.tile_kernels
    import dsv4_tl.tile_kernels.sparse_mla.sparse_decode as sd

    assert callable(sd.build_sparse_decode)
    assert Path(dsv4_tl.tile_kernels.__file__).parent.name == "tile_kernels"
    assert Path(dsv4_tl.schedules.__file__).parent.name == "schedules"


def test_schedule_for_decode_splits_small_grids(tmp_path, monkeypatch):
    import warnings

    from dsv4_tl import schedules
    from dsv4_tl.schedules import schedule_for

    # The schedule file's own buckets: no tuning logs (those are tests/tune/test_tuning.py's).
    monkeypatch.setenv("DSV4_TL_TUNING_LOGS", str(tmp_path))
    schedules.clear_caches()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no tuning log entry for bucket ..."
            config = schedule_for(SM90A, "sparse_decode", ctas=10, h=64, scope="c4a")
            assert isinstance(config, dict)
            assert isinstance(config["num_splits"], int) and config["num_splits"] > 1  # 10 CTAs on 132 SMs
            # Past one wave the default (no split) applies.
            assert schedule_for(SM90A, "sparse_decode", ctas=10_000, h=64, scope="c4a")["num_splits"] == 1
    finally:
        schedules.clear_caches()


def test_sm90a_schedule_files_parse_and_have_default():
    files = sorted(p for p in resources.files("dsv4_tl.schedules").joinpath(SM90A).iterdir() if p.name.endswith(".json"))
    assert files, f"no schedules/{SM90A}/*.json"
    for path in files:
        spec = json.loads(path.read_text())
        assert isinstance(spec.get("default"), dict) and spec["default"], f"{path.name}: no 'default' config"
        assert spec.get("op", path.name[: -len(".json")]) == path.name[: -len(".json")], f"{path.name}: op name differs"
        names = [bucket.get("name") for bucket in spec.get("buckets", [])]
        for bucket in spec.get("buckets", []):
            assert set(bucket) == {"name", "match", "config"}, f"{path.name}: bucket {bucket!r}"
        assert len(set(names)) == len(names), f"{path.name}: bucket names repeat"


def test_tilelang_uses_its_bundled_tvm():
    import tilelang
    import tvm

    tilelang_dir = Path(tilelang.__file__).resolve().parent
    assert tilelang_dir in Path(tvm.__file__).resolve().parents, (
        f"`tvm` resolves to {tvm.__file__}, not TileLang's bundled TVM under {tilelang_dir}"
    )


def test_no_standalone_apache_tvm():
    try:
        dist = md.distribution("apache-tvm")
    except md.PackageNotFoundError:
        pass
    else:
        pytest.fail(
            f"apache-tvm {dist.version} is installed beside tilelang: it shadows TileLang's bundled "
            "TVM for a bare `import tvm` and drags in an apache-tvm-ffi TileLang rejects; "
            "pip uninstall apache-tvm and reinstall with `bash scripts/setup.sh`"
        )
    # Without TileLang on sys.path there is no `tvm` module at all.
    # (`import tilelang` puts its TVM on PYTHONPATH; the probe must not inherit that.)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tvm') is not None)"
    result = subprocess.run([sys.executable, "-c", probe], cwd="/", env=env)
    assert result.returncode == 0, "a top-level `tvm` is importable without TileLang"


def test_tvm_ffi_version_is_the_one_tilelang_accepts():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in md.requires("tilelang") or []]
    ffi = [r for r in reqs if r.name == "apache-tvm-ffi" and (r.marker is None or r.marker.evaluate())]
    assert ffi, "tilelang declares no apache-tvm-ffi requirement"
    installed = md.version("apache-tvm-ffi")
    for req in ffi:
        assert req.specifier.contains(installed, prereleases=True), f"apache-tvm-ffi {installed} vs tilelang's {req}"


def test_wheel_carries_kernels_and_schedules(tmp_path):
    """A non-editable build ships the mapped subpackages and their data files."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("python", "tile_kernels", "schedules", "tuning_logs"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("dsv4_tl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"dsv4_tl/tile_kernels/{p.relative_to(REPO / 'tile_kernels').as_posix()}"
                for p in (REPO / "tile_kernels").rglob("*.py")}
    expected |= {f"dsv4_tl/schedules/{p.relative_to(REPO / 'schedules')}" for p in (REPO / "schedules").glob("*/*.json")}
    expected |= {"dsv4_tl/__init__.py", "dsv4_tl/schedules/__init__.py", "dsv4_tl/tuning_logs/__init__.py"}
    package = REPO / "python" / "dsv4_tl"  # every module, so a subpackage pyproject misses fails
    expected |= {f"dsv4_tl/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
