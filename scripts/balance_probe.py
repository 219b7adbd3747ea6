"""Diagnostic probe of the persistent decode grid's tile balance (``balance`` "tiles",
bench/PERF_NOTES.md item 48), for ``scripts/device_balance_probe.sh`` on a lent GPU.

``precompile``: the few variants the cases need, in parallel, each key printed.
``case NAME``: one case in this process (the shell script runs each under ``timeout``),
printing timestamped stages -- inputs built, kernel loaded (and whether its artifact was in
the kernel directory before: a load that does not return is a compile), launched,
synchronized, checked against the float32 reference -- so that a compile, a hang in the
kernel and a wrong result are told apart. For the tile balance the row split table the
kernel wrote (``RowSplits``: a split row's slot base and piece count) is compared with the
host model ``work.plan_reference``.

Written while the front end refused "tiles" (the hang of runs 63 / 65): the cases bypassed that
refusal in their own process (``_bypass_refusal``: the check read the schedule through
``ops.sparse_decode.schedule_of``); harmless now that the refusal is gone. First run (run 70, H200,
``bench/results/2026-11-26_h200_run70_lean_rest_balance_probe/``): every case returned and
matched the reference, the plan words of 198 CTAs matched ``plan_reference``.
"""

import math
import sys
import time

T0 = time.monotonic()


def stage(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


PERSISTENT = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
              "warp_specialized": True, "persistent": True, "item_cost": 3,
              "tiles_per_split_min": 4, "invariant_tiles_per_split": 16}
TILES = {**PERSISTENT, "balance": "tiles"}

# name -> (h, b, kind, extra_width, varying, schedule, tiles_per_split_min)
CASES = {
    "items_h64_b2_c128a4096": (64, 2, "c128a", 4096, True, PERSISTENT, 4),
    "tiles_h64_b2_c128a4096": (64, 2, "c128a", 4096, True, TILES, 4),
    "tiles_h64_b32_c128a8192": (64, 32, "c128a", 8192, True, TILES, 4),
    "tiles_h128_b2_c128a4096": (128, 2, "c128a", 4096, True, TILES, 4),
    "tiles_h128_b32_c128a8192": (128, 32, "c128a", 8192, True, TILES, 4),
    "tiles_h64_b128_c4a1024_uniform": (64, 128, "c4a", 1024, False, TILES, 4),
    "tiles_h64_b1_c4a1024_q1": (64, 1, "c4a", 1024, False, TILES, 1),
}
# the plan alone (the builder's DEBUG-only ``debug_plan_only``: the plan's words out, no walk):
# name -> as CASES
PLAN_CASES = {
    "plan_h64_b2_c128a4096": (64, 2, "c128a", 4096, True, {**TILES, "debug_plan_only": True}, 4),
    "plan_h128_b32_c128a8192": (128, 32, "c128a", 8192, True,
                                {**TILES, "debug_plan_only": True}, 4),
}
# the combines the cases reach: (heads, split bound)
COMBINES = [(64, 16), (64, 64), (64, 128), (128, 64), (128, 128)]


def _decode_variants():
    from dsv4_tl.kernels import SPARSE_DECODE, Variant
    out = {}
    for h, _b, kind, _w, _v, schedule, _q in [*CASES.values(), *PLAN_CASES.values()]:
        static = SPARSE_DECODE.static(h=h, scope=kind)
        v = Variant.make("sparse_decode", static, schedule)
        out[v.key] = v
    return list(out.values())


def _compile(args):
    from dsv4_tl.kernels import Variant
    from dsv4_tl.loader import compile_jit
    from dsv4_tl.targets import parse_target
    op, static, schedule, kdir = args
    t = time.time()
    compile_jit(Variant.make(op, static, schedule), parse_target("cuda:sm_90a"), kdir)
    return Variant.make(op, static, schedule).key, time.time() - t


def precompile(jobs: int) -> None:
    import concurrent.futures
    from pathlib import Path
    from dsv4_tl.kernels import Variant
    from dsv4_tl.loader import default_kernel_dir
    from dsv4_tl.schedules import schedule_for
    kdir = Path(default_kernel_dir())
    todo = [(v.op, dict(v.static), dict(v.schedule), kdir) for v in _decode_variants()]
    combine = schedule_for("cuda_sm90a", "sparse_decode_combine")
    todo += [("sparse_decode_combine", dict(num_heads=h, num_splits=n), combine, kdir)
             for h, n in COMBINES]
    for job in todo:
        stage(f"variant {Variant.make(*job[:3]).key} schedule {job[2]}")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, dt in pool.map(_compile, todo):
            stage(f"compiled {key} in {dt:.0f} s")
    stage(f"precompile: {len(todo)} variants done")


def _bypass_refusal() -> None:
    """The front end's refusal of "tiles" reads the schedule through ``schedule_of``; in this
    process only, that check sees the schedule without the knob."""
    import importlib
    front = importlib.import_module("dsv4_tl.ops.sparse_decode")
    orig = front.schedule_of

    def without_balance(*args, **kwargs):
        return {k: v for k, v in orig(*args, **kwargs).items() if k != "balance"}

    front.schedule_of = without_balance


def _kernel_file_exists(variant) -> bool:
    from pathlib import Path
    from dsv4_tl.loader import default_kernel_dir
    kdir = Path(default_kernel_dir())
    return any(p.name.startswith(variant.key) for p in kdir.rglob("*")) if kdir.exists() else False


def case(name: str) -> int:
    if name in PLAN_CASES:
        return plan_case(name)
    h, b, kind, width, varying, schedule, q = CASES[name]
    schedule = {**schedule, "tiles_per_split_min": q}
    stage(f"case {name}: h{h} b{b} {kind} {width} varying={varying} q={q} "
          f"balance={schedule.get('balance', 'items')}")
    import torch
    from dsv4_tl import bench
    from dsv4_tl.bench import DecodeShape, decode_inputs
    from dsv4_tl.kernels import SPARSE_DECODE, Variant
    from dsv4_tl.ops import sparse_decode
    from dsv4_tl.ops._dispatch import resolve
    from dsv4_tl.schedules import forced_schedule
    from dsv4_tl.targets import parse_target
    _bypass_refusal()
    stage("imported")
    shape = DecodeShape(h, b, kind, extra_width=width, varying=varying)
    gen = torch.Generator("cuda").manual_seed(0)
    x = decode_inputs(shape, gen, 1, "cuda")[0]
    if not varying and x["extra_topk_length"] is not None:
        x["extra_topk_length"].fill_(x["extra_indices"].shape[-1])
    torch.cuda.synchronize()
    stage("inputs ready")
    target = parse_target("cuda:sm_90a")
    variant = Variant.make("sparse_decode", SPARSE_DECODE.static(h=h, scope=kind), schedule)
    with forced_schedule(target.dirname, "sparse_decode", schedule):
        stage(f"loading {variant.key} (artifact present before: "
              f"{_kernel_file_exists(variant)}; a load that does not return is a compile)")
        resolve(SPARSE_DECODE, target, h=h, b=b, s_q=1, scope=kind, batch_invariant=False)
        stage("kernel loaded")
        # outputs poisoned (NaN) before each call: a row left unwritten fails the check
        out = torch.full((b, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h, 1), float("nan"), dtype=torch.float32, device="cuda")
        sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], bench.SCALE,
                      x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                      x["extra_topk_length"], out=out, lse=lse)
        stage("launched (decode and, for split rows, the combine)")
        torch.cuda.synchronize()
        stage("synchronized")
        verdict = bench._check_decode(x, (out, lse))
        stage(f"reference check: {verdict}")
        if schedule.get("balance") == "tiles":
            _compare_plan(x, shape, schedule)
        # a second call with the same plan (poisoned again): a hang that needs warm state
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], bench.SCALE,
                      x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                      x["extra_topk_length"], out=out, lse=lse)
        torch.cuda.synchronize()
        stage(f"second call synchronized; reference check: {bench._check_decode(x, (out, lse))}")
    stage("CASE OK")
    return 0


def _row_tiles(x, b: int, bt: int) -> list:
    """Each request's KV tiles as the kernel counts them (``row_tiles``)."""
    widths = (x["indices"].shape[-1], x["extra_indices"].shape[-1])
    lens = [x["topk_length"], x["extra_topk_length"]]
    lens = [v.cpu().tolist() if v is not None else [w] * b for v, w in zip(lens, widths)]
    return [-(-min(max(a, 0), widths[0]) // bt) + -(-min(max(c, 0), widths[1]) // bt)
            for a, c in zip(*lens)]


def plan_word_mismatches(words, ref) -> list:
    """``(cta, words, expected)`` for each CTA whose plan words differ from
    ``work.tile_plan_words(ref)`` (None: not compared)."""
    from dsv4_tl.tile_kernels.work import tile_plan_words
    return [(c, w, want) for c, (w, want) in enumerate(zip(words, tile_plan_words(ref)))
            if any(e is not None and g != e for g, e in zip(w, want))]


def plan_case(name: str) -> int:
    """The tile balance's plan alone on the GPU (``debug_plan_only``): the decode kernel is
    launched by itself (no combine: it writes no partials), each CTA's plan words read back
    from ``OPartial[cta, 0, 0, 0, :8]`` and compared word by word with ``plan_reference``."""
    import importlib
    import torch
    from dsv4_tl import bench
    from dsv4_tl.bench import DecodeShape, decode_inputs
    from dsv4_tl.schedules import forced_schedule
    from dsv4_tl.tile_kernels.work import plan_reference
    h, b, kind, width, varying, schedule, q = PLAN_CASES[name]
    schedule = {**schedule, "tiles_per_split_min": q}
    stage(f"plan case {name}: h{h} b{b} {kind} {width} varying={varying} q={q}")
    front = importlib.import_module("dsv4_tl.ops.sparse_decode")
    _bypass_refusal()
    x = decode_inputs(DecodeShape(h, b, kind, extra_width=width, varying=varying),
                      torch.Generator("cuda").manual_seed(0), 1, "cuda")[0]
    torch.cuda.synchronize()
    stage("inputs ready")
    with forced_schedule("cuda_sm90a", "sparse_decode", schedule):
        plan = front._Plan(x["q"], x["k_cache"], x["indices"], x["topk_length"], bench.SCALE,
                           x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                           x["extra_topk_length"], "e4m3fn", False, None, None)
    stage("kernel loaded (plan built)")
    assert plan.persistent and not plan.direct, "expected a persistent plan with partials"
    dev = x["q"].device
    out = x["q"].new_empty(plan.out_shape)
    lse = x["q"].new_empty(plan.lse_shape, dtype=torch.float32)
    o_part, lse_part, row_splits = front.StreamScratch.fresh(dev, plan.partial_shapes)
    o_part.fill_(-7.0)
    main = front.cache_views(x["k_cache"], plan.m_span, front._VIEWS, front._MAIN_MISALIGNED)
    extra = (*front.cache_views(x["extra_k_cache"], plan.e_span, front._VIEWS,
                                front._EXTRA_MISALIGNED),
             x["extra_indices"].contiguous(), plan.e_len(x["extra_topk_length"]))
    sink = front.sink_argument(x["attn_sink"], plan.sink, h, dev)
    plan.launch(front.aligned16(x["q"]), *main, x["indices"].contiguous(),
                plan.m_len(x["topk_length"]), *extra, sink, out, lse, o_part, lse_part,
                row_splits.view(torch.int32))
    stage("launched (decode kernel alone, plan only)")
    torch.cuda.synchronize()
    stage("synchronized: the plan finished")
    tps_arg, num_ctas = plan.launch.fixed[-2:]
    assert num_ctas <= o_part.shape[0], "fewer partial slots than CTAs: words not all written"
    words = o_part[:num_ctas, 0, 0, 0, :8].cpu().round().int().tolist()
    ref = plan_reference(_row_tiles(x, b, schedule["block_tokens"]), 1, -(-h // 64), tps_arg,
                         schedule["item_cost"], num_ctas, "tiles")
    bad = plan_word_mismatches(words, ref)
    stage(f"plan words of {num_ctas} CTAs (G' {ref['ctas']}, whole {ref['whole']}): "
          f"{len(bad)} differ from plan_reference" + (f"; first: {bad[:3]}" if bad else ""))
    stage("CASE OK" if not bad else "CASE PLAN MISMATCH")
    return 0 if not bad else 4


def _compare_plan(x, shape, schedule) -> None:
    """The row split table the kernel wrote in the last call (the stream scratch's third view:
    per row its slot base and piece count) against ``work.plan_reference``'s ``row_splits``
    for the same lengths and grid (the plan's ``tiles_per_split`` / ``num_ctas`` arguments)."""
    import importlib
    import torch
    from dsv4_tl.tile_kernels.work import plan_reference
    front = importlib.import_module("dsv4_tl.ops.sparse_decode")
    plans = [p for p in front._PLANS.plans.values() if getattr(p, "persistent", False)]
    if not plans or plans[-1].direct:
        stage("plan compare: no split table (no persistent plan with partials)")
        return
    plan = plans[-1]
    tps_arg, num_ctas = plan.launch.fixed[-2:]
    if 4 * sum(math.prod(s) for s in plan.partial_shapes) > front.stream_scratch.MAX_POOLED_BYTES:
        # (the partials above the pool's size are fresh per call: the table is not readable
        # here -- the plan_* cases read the kernel's words instead)
        stage("plan compare: partials not pooled at this size, table not read back")
        return
    _, _, row_splits = front.stream_scratch.views(x["q"].device, plan.partial_shapes)
    got = [tuple(r) for r in row_splits.view(torch.int32).cpu().tolist()]
    tiles = _row_tiles(x, shape.b, schedule["block_tokens"])
    ref = plan_reference(tiles, 1, -(-shape.h // 64), tps_arg, schedule["item_cost"], num_ctas,
                         "tiles")
    want = [tuple(rs) for rs in ref["row_splits"]]
    bad = [(r, got[r], want[r]) for r in range(len(want)) if got[r] != want[r]]
    stage(f"plan compare (grid {num_ctas}, tiles_per_split {tps_arg}, whole {ref['whole']}, "
          f"G' {ref['ctas']}): {sum(n > 1 for _, n in want)} split rows of {len(want)}; "
          f"{len(bad)} rows' (slot base, pieces) differ from plan_reference"
          + (f"; first: {bad[:3]}" if bad else ""))


if __name__ == "__main__":
    if sys.argv[1] == "precompile":
        precompile(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    else:
        try:
            sys.exit(case(sys.argv[2]))
        except Exception as exc:  # (the shell prints the exit status)
            stage(f"CASE ERROR {type(exc).__name__}: {str(exc)[:400]}")
            sys.exit(3)
