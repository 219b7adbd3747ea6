"""CPU tests that builders and loaders sharing one kernel directory never see a partial
manifest or artifact: threads of one process building and reading together, and the
build-and-load stress test (``scripts/stress_build_load.py``: one empty directory with JIT
on, then the prebuilt one with ``DSV4_TL_JIT=0``) in eight processes, the ranks of one
8-GPU node starting together (the script's default of 16 is its manual stress run: each
process costs about 5 s of a core in imports alone, most of the test's time)."""

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from dsv4_tl.build import build
from dsv4_tl.loader import build_command
from dsv4_tl.manifest import MANIFEST_NAME, read_manifest
from dsv4_tl.targets import parse_target

TARGET = parse_target("cuda:sm_90a")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress_build_load.py"


def test_concurrent_builders_and_readers_of_one_directory(tmp_path):
    """Before: every builder wrote ``manifest.tmp`` and renamed it, so readers saw empty
    manifests (JSONDecodeError) and renames failed (FileNotFoundError)."""
    errors, results = [], []
    stop = threading.Event()
    path = tmp_path / TARGET.dirname / MANIFEST_NAME

    def builder():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(build(TARGET, tmp_path, heads=(64,), ops=("global_topk",),
                                     jobs=1, progress=False))
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            errors.append(exc)

    def reader():
        while not stop.is_set():
            try:
                read_manifest(path, build_command(TARGET, tmp_path))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    builders = [threading.Thread(target=builder) for _ in range(4)]
    for t in readers + builders:
        t.start()
    for t in builders:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert errors == []
    assert sum(bool(r["built"]) for r in results) == 1  # one compiled, the others reused
    assert all(r["kernels"] == results[0]["kernels"] for r in results)
    assert not list(tmp_path.rglob("*.tmp*"))


def test_eight_processes_build_and_load_one_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DSV4_TL_JIT"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--procs", "8",
                           "--dir", str(tmp_path / "kernels"), "--json", str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stress: PASS 8 processes x 2 rounds, 0 failed processes" in proc.stdout
