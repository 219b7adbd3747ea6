"""scripts/bench_compare.py: medians over repeats, the noise band, the verdicts, the exit code."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_compare.py"


def _report(path: Path, rows: dict) -> str:
    """A bench --json report with ``rows`` {shape: {impl: us or error text}}."""
    out = []
    for shape, impls in rows.items():
        results = [{"impl": impl, **({"us": v} if isinstance(v, float) else {"error": v})}
                   for impl, v in impls.items()]
        out.append({"suite": "decode", "shape": shape, "results": results})
    path.write_text(json.dumps({"rows": out}))
    return str(path)


def _compare(tmp_path, before: list, after: list):
    b = [_report(tmp_path / f"b{i}.json", r) for i, r in enumerate(before)]
    a = [_report(tmp_path / f"a{i}.json", r) for i, r in enumerate(after)]
    return subprocess.run([sys.executable, str(SCRIPT), "--before", *b, "--after", *a],
                          capture_output=True, text=True)


def test_within_noise_and_faster(tmp_path):
    before = [{"r1": {"dsv4_tl": 10.0, "flashmla": 9.0}, "r2": {"dsv4_tl": 20.0}},
              {"r1": {"dsv4_tl": 10.4, "flashmla": 9.0}, "r2": {"dsv4_tl": 20.2}}]
    after = [{"r1": {"dsv4_tl": 10.5}, "r2": {"dsv4_tl": 15.0}},
             {"r1": {"dsv4_tl": 10.1}, "r2": {"dsv4_tl": 15.2}}]
    res = _compare(tmp_path, before, after)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = {line.split("|")[1].strip(): line for line in res.stdout.splitlines()
             if line.startswith("| r")}
    assert "within noise" in lines["r1"] and "faster" in lines["r2"]
    assert "flashmla" not in res.stdout  # peers are left out unless asked for
    assert "2 rows: 0 slower than noise, 1 faster" in res.stdout


def test_slower_beyond_the_spread_fails(tmp_path):
    before = [{"r1": {"dsv4_tl": 10.0}}, {"r1": {"dsv4_tl": 10.2}}]
    after = [{"r1": {"dsv4_tl": 11.0}}, {"r1": {"dsv4_tl": 11.1}}]
    res = _compare(tmp_path, before, after)
    assert res.returncode == 1 and "**slower**" in res.stdout


def test_a_row_that_errors_on_one_side_fails(tmp_path):
    before = [{"r1": {"dsv4_tl": 10.0}}]
    after = [{"r1": {"dsv4_tl": "KernelCompileError: boom"}}]
    res = _compare(tmp_path, before, after)
    assert res.returncode == 1 and "error after: KernelCompileError: boom" in res.stdout
