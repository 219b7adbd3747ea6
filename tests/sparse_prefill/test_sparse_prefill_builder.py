"""Schedule arguments of the sparse prefill builder that it cannot take: a clear ValueError
naming the knob (no GPU needed: the builder raises before tracing)."""

import collections
import re

import pytest

pytest.importorskip("tilelang")

from dsv4_tl.tile_kernels.sparse_prefill import build_sparse_prefill  # noqa: E402

WS = dict(warp_specialized=True, threads=384)
TIM = dict(tokens_in_m=True, heads_per_block=32, threads=384, num_stages=2)


def _barrier_counts(func) -> collections.Counter:
    """Arrive counts of the kernel's mbarriers (the TIR's ``barrier_init`` attribute)."""
    init = re.search(r'"barrier_init": \{([^}]*)\}', func.script()).group(1)
    return collections.Counter(int(n) for n in re.findall(r"\[(\d+)\]", init))


@pytest.mark.parametrize("num_heads,kwargs", [
    (128, dict(cluster_gather=True)),  # the plain schedule
    (64, dict(WS, cluster_gather=True)),  # one head group: no pair to cluster
    (96, dict(WS, cluster_gather=True)),
    (256, dict(WS, cluster_gather=True)),
    (128, dict(TIM, heads_per_block=32, cluster_gather=True)),
])
def test_cluster_gather_where_it_cannot_apply(num_heads, kwargs):
    with pytest.raises(ValueError, match="cluster_gather"):
        build_sparse_prefill(num_heads, False, **kwargs)


def test_cluster_gather_off_is_todays_kernel():
    assert (build_sparse_prefill(128, True, **WS).script()
            == build_sparse_prefill(128, True, **WS, cluster_gather=False).script())


def test_cluster_gather_barriers():
    """The crossover's barriers: each K half's ready barrier counts its one copy (the
    filler's arrival or the peer's bulk copy) plus, on a buffer's first half, the 128
    producer threads' flag releases; free barriers count consumer warps of both CTAs."""
    plain = _barrier_counts(build_sparse_prefill(128, False, **WS))
    cluster = _barrier_counts(build_sparse_prefill(128, False, **WS, cluster_gather=True))
    # plain: ready 256 x4, free 128 x2 + 256 x2; cluster: ready 129 x2 + 1 x2, free 8 x2 + 16 x2
    assert plain - cluster == collections.Counter({256: 6, 128: 2})
    assert cluster - plain == collections.Counter({129: 2, 1: 2, 8: 2, 16: 2})
