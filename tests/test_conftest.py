"""The suite's own plumbing (tests/conftest.py)."""

from pathlib import Path

from conftest import LONG_GROUPS


def test_long_groups_name_test_files():
    """Each group that scripts/test.sh hands out first is a test file here: a renamed file
    would otherwise fall back to the end of the order without a word."""
    root = Path(__file__).resolve().parent.parent
    missing = [path for path in LONG_GROUPS if not (root / path).is_file()]
    assert not missing, f"LONG_GROUPS names no such test file: {missing}"


def test_worksteal_order_balances_the_initial_slices():
    """Worksteal's initial slices (len // workers each, the last len % workers one longer) each
    begin with one of the ``workers`` longest tests, run longest first, and their sums differ by
    at most the longest test; every test is kept once; a test without a time counts as new."""
    from types import SimpleNamespace

    from conftest import NEW_GPU_TEST_SECONDS, worksteal_order

    items = [SimpleNamespace(nodeid=f"t{i}", keywords={"gpu": True}) for i in range(23)]
    seconds = {f"t{i}": float(i * i % 37) for i in range(22)}  # t22 unknown: a new test
    workers = 4
    out = worksteal_order(items, workers, seconds)
    assert sorted(x.nodeid for x in out) == sorted(x.nodeid for x in items)
    sizes, left = [], len(out)
    for i in range(workers):  # xdist's worksteal: len(pending) // nodes_remaining
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    cost = {**seconds, "t22": NEW_GPU_TEST_SECONDS}
    slices = [out[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(workers)]
    longest = sorted(cost.values(), reverse=True)
    assert sorted((cost[s[0].nodeid] for s in slices), reverse=True) == longest[:workers]
    for piece in slices:
        costs = [cost[x.nodeid] for x in piece]
        assert costs == sorted(costs, reverse=True)
    sums = [sum(cost[x.nodeid] for x in piece) for piece in slices]
    assert max(sums) - min(sums) <= longest[0]
