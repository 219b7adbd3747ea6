"""The suite's own plumbing (tests/conftest.py)."""

from pathlib import Path

from conftest import LONG_GROUPS


def test_long_groups_name_test_files():
    """Each group that scripts/test.sh hands out first is a test file here: a renamed file
    would otherwise fall back to the end of the order without a word."""
    root = Path(__file__).resolve().parent.parent
    missing = [path for path in LONG_GROUPS if not (root / path).is_file()]
    assert not missing, f"LONG_GROUPS names no such test file: {missing}"
