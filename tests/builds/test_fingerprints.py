"""Every shipped kernel variant's TIR equals the recorded one (``tests/builds/fingerprints/``).

The build matrix of ``dsv4-tl build`` at heads 8-128 on each target: the prim_func each variant
builds, as TVMScript, hashed (``scripts/kernel_fingerprints.py``, which also lowers them). A
refactor of ``tile_kernels/`` must leave every hash unchanged; a deliberate kernel change
re-records the file (``python scripts/kernel_fingerprints.py --write --no-lower``) in the same
commit, with its measurement in ``bench/PERF_NOTES.md``.

A target named in ``$DSV4_TL_LOWERING_STEP_TARGETS`` (comma-separated) is skipped: CI
(``.ci/run``) sets it for the targets its lowering step checks after the tests (the same hashes
against the same files, each variant lowered too), so the tests do not hash them twice (sm_90a:
~80 s of a core on the 2-core CI machine).
"""

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("tilelang")

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).resolve().parent / "fingerprints"
TARGETS = ("cuda:sm_90a", "cuda:sm_100a", "hip:gfx942", "hip:gfx950", "sycl")


def _script():
    spec = importlib.util.spec_from_file_location("kernel_fingerprints",
                                                  ROOT / "scripts" / "kernel_fingerprints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checked_by_the_lowering_step() -> set:
    return {t.strip() for t in os.environ.get("DSV4_TL_LOWERING_STEP_TARGETS", "").split(",")
            if t.strip()}


@pytest.mark.parametrize("target", TARGETS)
def test_shipped_kernels_match_their_fingerprints(target):
    if target in _checked_by_the_lowering_step():
        pytest.skip(f"{target}: checked by CI's lowering step (.ci/run, "
                    "scripts/kernel_fingerprints.py --check)")
    from dsv4_tl.build import build_variants
    from dsv4_tl.targets import parse_target

    fp = _script()
    recorded = json.loads((RECORDED / f"{parse_target(target).dirname}.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks (dsv4-tl build reports them)
        variants = build_variants(target, tuple(recorded["heads"]))
    now = {v.key: fp.variant_entry(v, fp.tir_sha256(v.build())) for v in variants}
    diffs = fp.compare(recorded["kernels"], now)
    assert not diffs, "kernels changed (re-record with scripts/kernel_fingerprints.py --write " \
        "if deliberate):\n" + "\n".join(diffs)


def test_a_changed_kernel_is_reported():
    """The comparison the test relies on names a changed, a lost and a new kernel."""
    fp = _script()
    base = {"a": {"op": "x", "static": {"h": 1}, "schedule": {}, "tir_sha256": "1" * 64},
            "b": {"op": "x", "static": {"h": 2}, "schedule": {}, "tir_sha256": "2" * 64}}
    same = {"a2": {**base["a"], "schedule": {"k": 0}}, "b": base["b"]}
    assert fp.compare(base, same) == []  # a key change alone (a retired knob) is no change
    changed = {"a": {**base["a"], "tir_sha256": "3" * 64}, "c": {**base["b"], "static": {"h": 3}}}
    lines = fp.compare(base, changed)
    assert len(lines) == 3 and any('"h": 2' in line and "new []" in line for line in lines)
