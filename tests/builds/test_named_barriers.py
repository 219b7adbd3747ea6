"""The named-barrier role check of the lowering step (``dsv4_tl.cuda.named_barriers``, run by
``scripts/kernel_fingerprints.py`` on every lowered CUDA source) on small synthetic sources
shaped like TileLang 0.1.15's output: no kernel is compiled.

The clashing source is the shape of bench/PERF_NOTES.md item 83's hang (the producer's
``bar.sync 3, 128`` from one ThreadSync run, consumer warpgroup 0's from the other)."""

import importlib.util
from pathlib import Path

import pytest

from dsv4_tl.cuda.named_barriers import clashes, kernel_roles

HEAD = '''extern "C" __global__ void k(float* __restrict__ A);
extern "C" __global__ void __launch_bounds__(384, 1) k(float* __restrict__ A) {
  __shared__ float s[384];
  asm volatile("{ .reg .pred p; }");  // braces in a literal or a comment (an unmatched }) are no block
  __syncthreads();
'''

CLASHING = HEAD + '''  if (((int)threadIdx.x) < 128) {
    tl::__sync_thread_partial(3, 128);
    tl::AllReduce<tl::MaxOp, 4, 1, 0, tl::NamedBarrier<128>>::run(A[0]);
  } else {
    if (((int)threadIdx.x) < 256) {
      tl::__sync_thread_partial(4, 128);
    } else {
      if (((int)threadIdx.x) == 256) {
        A[0] = 0.f;
      }
      tl::__sync_thread_partial(3, 128);
    }
  }
}
'''

CLEAN = HEAD + '''  if (((int)threadIdx.x) < 128) {
    tl::__sync_thread_partial(10, 256);
    tl::__sync_thread_partial(3, 128);
    tl::AllReduce<tl::MaxOp, 128, 32, 0, tl::NamedBarrier<128>, 2, 128>::run_batch(A, A);
  } else if (((int)threadIdx.x) < 256) {
    tl::__sync_thread_partial(10, 256);
    tl::__named_barrier_arrive(4, 128);
    asm volatile("bar.sync 4, 128;");
  } else {
    A[1] = 1.f;
  }
}
'''


def test_a_clashing_source_names_the_id_and_both_roles():
    assert clashes(CLASHING) == [
        "named barrier 3 used by threads 0-127 (bar.sync 3, 128) and threads 256-383 "
        "(bar.sync 3, 128): their warps count into one barrier"]


def test_a_clean_source_passes_and_its_roles_are_read():
    assert clashes(CLEAN) == []
    roles = kernel_roles(CLEAN)[0]
    ids = {role: sorted({i for _, i, _ in b}) for role, b in roles.items()}
    # the AllReduce over 128 threads syncs on ids 1 and 2 (reduce.h); the else-if is role 2
    assert ids == {(0, 128): [1, 2, 3, 10], (128, 256): [4, 10]}


def test_a_shared_barrier_must_count_both_roles_and_allreduce_ids_count():
    # id 10 with 128 threads in both consumer warpgroups: each one alone fills it
    assert clashes(CLEAN.replace("(10, 256)", "(10, 128)")) == [
        "named barrier 10 used by threads 0-127 (bar.sync 10, 128) and threads 128-255 "
        "(bar.sync 10, 128): their warps count into one barrier"]
    # a cross-warp AllReduce in warpgroup 1 too: both warpgroups on AllReduce's ids 1 and 2
    both = CLEAN.replace("    tl::__named_barrier_arrive(4, 128);\n",
                         "    tl::AllReduce<tl::SumOp, 128, 32, 128, tl::NamedBarrier<128>>::run(A[0]);\n")
    assert [line.split(" used")[0] for line in clashes(both)] == ["named barrier 1", "named barrier 2"]


def test_a_kernel_without_role_branches_passes():
    flat = HEAD + "  tl::__sync_thread_partial(3, 128);\n  tl::__sync_thread_partial(3, 384);\n}\n"
    assert clashes(flat) == []


def test_the_lowering_step_reports_a_clash_of_the_source_it_lowered(monkeypatch):
    """The wiring of ``scripts/kernel_fingerprints.py``: the source its lowering returns is the
    one checked (here the clashing snippet in place of a real lowering, so nothing compiles)."""
    pytest.importorskip("tilelang")
    path = Path(__file__).resolve().parents[2] / "scripts" / "kernel_fingerprints.py"
    spec = importlib.util.spec_from_file_location("kernel_fingerprints", path)
    fp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp)
    from dsv4_tl.build import build_variants

    variant = build_variants("cuda:sm_90a", (8,), ["dequant_gather"])[0]
    todo = (variant.key, (variant.op, dict(variant.static), dict(variant.schedule)), "cuda:sm_90a", True)
    monkeypatch.setattr(fp, "lower", lambda func, key, target: CLASHING)
    key, digest, error, _, found = fp._job(todo)
    assert (key, error, len(digest)) == (variant.key, None, 64)
    assert found == clashes(CLASHING) and len(found) == 1
    monkeypatch.setattr(fp, "lower", lambda func, key, target: CLEAN)
    assert fp._job(todo)[4] == []
