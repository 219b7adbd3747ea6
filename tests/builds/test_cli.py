"""CPU tests of the ``dsv4-tl`` command's errors: every mistake a user can make ends as one
line on stderr and a non-zero exit, never a traceback, and nothing is compiled for nonsense
arguments (issue 15 item 7)."""

import os
import stat

import pytest

from dsv4_tl import cli


def _run(argv, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse exits
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _one_line_error(status, err, *needles):
    assert status not in (0, None), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("argv,needles", [
    (["build", "--op", "sparse_decod"], ["--op", "sparse_decod", "sparse_decode"]),
    (["build", "--jobs", "-1"], ["--jobs", "positive"]),
    (["build", "--jobs", "0"], ["--jobs", "positive"]),
    (["build", "--heads", "0"], ["--heads", "a head count 1..1024"]),
    (["build", "--heads", "-3"], ["--heads", "a head count 1..1024"]),
    (["build", "--heads", "x"], ["--heads"]),
    # issue 34 item 7: --heads 10**20 was a three-line OverflowError
    # (--op global_topk: a build that takes these would compile one small kernel only)
    (["build", "--op", "global_topk", "--heads", "1025"], ["--heads", "1..1024, got 1025"]),
    (["build", "--op", "global_topk", "--heads", str(10**20)],
     ["--heads", f"a head count 1..1024, got {10**20}"]),
    (["build", "--op", "global_topk", "--heads", "9" * 5000], ["--heads", "(5000 characters)"]),
    (["build", "--target", "cuda:sm_80"], ["--target"]),
    (["frobnicate"], ["frobnicate"]),
    (["build", "--bogus"], ["--bogus"]),
    (["tune", "--jobs", "0"], ["--jobs"]),
])
def test_bad_arguments_are_one_line(argv, needles, capsys, tmp_path):
    status, out, err = _run(argv + (["--out", str(tmp_path)] if argv[0] == "build" else []),
                            capsys)
    _one_line_error(status, err, *needles)
    assert not any(tmp_path.iterdir()), "nothing may be built for bad arguments"


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, _, err = _run(["build", "--op", "global_topk", "--out", str(blocker)], capsys)
    _one_line_error(status, err, "out:", str(blocker))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_out_is_one_line(tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        status, _, err = _run(["build", "--op", "global_topk", "--out", str(locked / "k")], capsys)
    finally:
        locked.chmod(stat.S_IRWXU)
    _one_line_error(status, err, "out:")


@pytest.mark.parametrize("how", ["env", "out"])
def test_a_kernel_dir_with_a_newline_is_one_line_and_builds_nothing(tmp_path, capsys,
                                                                     monkeypatch, how):
    """Issue 34 item 7: a newline in ``$DSV4_TL_KERNEL_DIR`` (or ``--out``) made multi-line
    messages and commands; such a path is refused by name, in one line."""
    odd = str(tmp_path / "a\nb")
    if how == "env":
        monkeypatch.setenv("DSV4_TL_KERNEL_DIR", odd)
    where = ["--out", odd] if how == "out" else []
    name = "DSV4_TL_KERNEL_DIR" if how == "env" else "out"
    for argv in (["build", "--op", "global_topk"] + where, ["info"] + where):
        status, _, err = _run(argv, capsys)
        _one_line_error(status, err, "expected a folder path without control characters")
        assert f"{name if argv[0] == 'build' or how == 'env' else '--out'}: expected" in err
    assert not any(tmp_path.iterdir()), "nothing may be created for it"


def test_out_under_a_file_is_one_line(tmp_path, capsys):
    """As root, permissions do not stop a write; a path through a file always fails."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, _, err = _run(["build", "--op", "global_topk", "--out", str(blocker / "sub")], capsys)
    _one_line_error(status, err, "out:")


def test_build_api_refuses_nonsense_head_counts_and_jobs(tmp_path):
    from dsv4_tl.build import build

    for heads in ((0,), (-3,), (True,)):
        with pytest.raises(ValueError, match="heads"):
            build("cuda:sm_90a", tmp_path, heads=heads, ops=("sparse_prefill",))
    with pytest.raises(ValueError, match="jobs"):
        build("cuda:sm_90a", tmp_path, ops=("global_topk",), jobs=0)
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ issue 25 item 9
@pytest.mark.parametrize("argv,needles", [
    (["bench", "--suite", "nope"], ["--suite", "nope"]),
    (["bench", "--bogus"], ["--bogus"]),
    (["bench", "--peers", "nobody"], ["nobody"]),
    (["tune", "--max-candidates", "-5"], ["--max-candidates", "-5"]),
    (["tune", "--time-budget", "-1"], ["--time-budget"]),
    (["tune", "--candidate-timeout", "nan"], ["--candidate-timeout"]),
])
def test_bench_and_tune_argument_errors_are_one_line(argv, needles, capsys):
    """Issue 25 item 9: ``bench`` argument errors printed a usage block and ``tune
    --max-candidates -5`` was accepted."""
    status, out, err = _run(argv, capsys)
    _one_line_error(status, err, *needles)
    assert "usage:" not in err


def test_tune_without_cuda_writes_its_error_to_stderr(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = _run(["tune", "--kernel", "global_topk"], capsys)
    _one_line_error(status, err, "needs a CUDA device")
    assert out == ""


def test_tune_report_on_a_bad_log_and_a_bad_log_root_is_one_line(capsys, monkeypatch, tmp_path):
    from dsv4_tl import schedules, tuning_log

    log = tuning_log.log_path(tmp_path, "cuda_sm90a", "global_topk")
    log.parent.mkdir(parents=True)
    log.write_bytes(b"[" * 100_000 + b"\n\xff\xfe\n")
    schedules.clear_caches()
    with pytest.warns(UserWarning, match="skipping a malformed line"):
        status, out, err = _run(["tune", "--kernel", "global_topk", "--report", "--out",
                                 str(tmp_path)], capsys)
    assert status == 0 and "no log" in out and "Traceback" not in err
    monkeypatch.setenv(tuning_log.ENV_LOG_DIR, str(log))  # a file, not a folder
    schedules.clear_caches()
    status, out, err = _run(["tune", "--kernel", "global_topk", "--report"], capsys)
    _one_line_error(status, err, tuning_log.ENV_LOG_DIR, "not a folder")
    schedules.clear_caches()


def test_tune_dry_run_into_a_closed_pipe_ends_without_a_traceback(tmp_path):
    """``dsv4-tl tune --dry-run | head -1``: the reader leaves early; no BrokenPipeError
    traceback on stderr."""
    import subprocess
    import sys

    # (about 190 KB of plan: more than the pipe holds when head has gone)
    cmd = f"{sys.executable} -m dsv4_tl.cli tune --dry-run --max-candidates 0 | head -1"
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
