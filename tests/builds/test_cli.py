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
    (["build", "--heads", "0"], ["--heads", "positive"]),
    (["build", "--heads", "-3"], ["--heads", "positive"]),
    (["build", "--heads", "x"], ["--heads"]),
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
