"""Every kernel in tile_kernels/ lowers and compiles for CUDA sm_90a (no GPU needed).

Rule, checked by ``test_examples_cover_builders``: a module of ``dsv4_tl.tile_kernels`` that
defines a ``build_*`` function must define ``LOWERING_EXAMPLES``, a list of
``{"builder": name, "kwargs": {...}}`` naming each of its ``build_*`` functions at least once.
A module with no ``build_*`` function of its own (a helper such as ``sparse_mla.softmax``) has
nothing to lower. Each example is then lowered by ``test_lowering[<module>.<builder>.<n>]``
(TileLang's passes and code generation, as a build runs them, without nvcc) and its CUDA
source is checked for the ``extern "C" __global__`` entry and, for the attention builders,
for wgmma (Hopper tensor-core) instructions. nvcc compiles the generated source of one
example of each kernel family (``test_nvcc_compiles``, and the spill checks' examples of
``NVCC_DECODES``: ``_check_no_spills``); ``test_export_and_load`` builds one kernel all the
way to a loaded library. Every shipped sm_90a variant's TIR is checked by
``tests/builds/test_fingerprints.py`` and its lowering by CI (``.ci/run``).
"""

import importlib
import pkgutil
import re

import pytest

tilelang = pytest.importorskip("tilelang")

import dsv4_tl.tile_kernels as tile_kernels  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
DECODE = "sparse_mla.sparse_decode"  # the decode builder's module under tile_kernels
# Builders whose kernels do their matrix work (QK^T, PV) on the tensor cores.
MATRIX_BUILDERS = {"build_sparse_decode", "build_sparse_prefill"}

# Every module of the package and its sub-packages (``sparse_mla.sparse_decode``), by dotted
# name under ``tile_kernels``.
MODULE_NAMES = sorted(
    info.name.removeprefix(tile_kernels.__name__ + ".")
    for info in pkgutil.walk_packages(tile_kernels.__path__, tile_kernels.__name__ + ".")
    if not info.ispkg and not info.name.rpartition(".")[2].startswith("_")
)


def _import(name):
    return importlib.import_module(f"{tile_kernels.__name__}.{name}")


def _examples_with(module: str, knob: str, id_of) -> list:
    """pytest params of the ``LOWERING_EXAMPLES`` of ``tile_kernels.<module>`` that set
    ``knob``, each named ``id_of(kwargs)``."""
    return [pytest.param(e["kwargs"], id=id_of(e["kwargs"]),
                         marks=_kernel_group(module, e["builder"], e["kwargs"]))
            for e in _import(module).LOWERING_EXAMPLES if e["kwargs"].get(knob)]


def _kernel_group(module: str, builder: str, kwargs: dict) -> list:
    """The ``xdist_group`` mark of the tests that read one compiled kernel (named as its
    ``test_lowering`` case; none for a kernel outside ``LOWERING_EXAMPLES``): with
    pytest-xdist's ``--dist loadgroup`` (scripts/test.sh) they run in one worker, which
    compiles the kernel once (:func:`_compile`)."""
    for i, e in enumerate(_import(module).LOWERING_EXAMPLES):
        if e["builder"] == builder and e["kwargs"] == kwargs:
            return [pytest.mark.xdist_group(f"{module}.{builder}.{i}")]
    return []


def _own_builders(module) -> set:
    """``build_*`` functions defined in ``module`` itself (not imported into it)."""
    return {
        name
        for name, obj in vars(module).items()
        if name.startswith("build_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__
    }


def _examples():
    params = []
    for name in MODULE_NAMES:
        try:
            module = _import(name)
        except Exception:  # test_module_imports reports it
            continue
        for i, example in enumerate(getattr(module, "LOWERING_EXAMPLES", [])):
            builder = example.get("builder", "?") if isinstance(example, dict) else "?"
            params.append(pytest.param(name, example, id=f"{name}.{builder}.{i}",
                                       marks=[pytest.mark.xdist_group(f"{name}.{builder}.{i}")]))
    return params


def test_there_are_kernel_modules():
    assert MODULE_NAMES, f"no modules found in {tile_kernels.__path__}"
    assert any(_own_builders(_import(n)) for n in MODULE_NAMES), "no build_* function in tile_kernels/"


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_module_imports(name):
    _import(name)


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_examples_cover_builders(name):
    module = _import(name)
    builders = _own_builders(module)
    examples = getattr(module, "LOWERING_EXAMPLES", None)
    if not builders:
        assert not examples, f"{name}: LOWERING_EXAMPLES without any build_* function"
        return  # helper module
    assert examples, f"{name}: defines {sorted(builders)} but no LOWERING_EXAMPLES"
    for i, example in enumerate(examples):
        assert isinstance(example, dict) and set(example) == {"builder", "kwargs"}, (
            f"{name}: LOWERING_EXAMPLES[{i}] must be {{'builder': ..., 'kwargs': {{...}}}}, got {example!r}"
        )
        assert example["builder"] in builders, (
            f"{name}: LOWERING_EXAMPLES[{i}] names {example['builder']!r}, not one of {sorted(builders)}"
        )
    missing = builders - {e["builder"] for e in examples}
    assert not missing, f"{name}: no LOWERING_EXAMPLES entry for {sorted(missing)}"


# Lowering takes seconds of one core, building a kernel's TIR less; the tests below read the
# same kernels, so each is built and lowered once per test process, not once per test.
_built: dict = {}  # (module, builder, kwargs) -> prim_func
_lowered: dict = {}  # (module, builder, kwargs) -> Lowered


def _key(name, example) -> tuple:
    return name, example["builder"], tuple(sorted(example["kwargs"].items()))


def _build(name, example):
    """The prim_func of ``example`` (``{"builder": ..., "kwargs": {...}}``) of
    ``tile_kernels.<name>``, built on first use and shared after."""
    key = _key(name, example)
    if key not in _built:
        _built[key] = getattr(_import(name), example["builder"])(**example["kwargs"])
    return _built[key]


class Lowered:
    """A kernel lowered for sm_90a as a build lowers it (``tilelang.lower`` under the
    prim_func's pass configs), without nvcc: its CUDA source and its host code (TIR)."""

    def __init__(self, func):
        import tvm

        configs = dict(func.attrs["tilelang_pass_configs"]) if "tilelang_pass_configs" in func.attrs else {}
        target = tvm.target.Target(TARGET)
        with tvm.transform.PassContext(opt_level=3, config=configs), target:
            self.artifact = tilelang.lower(func, target=target)

    def get_kernel_source(self) -> str:
        return self.artifact.kernel_source

    def get_host_source(self) -> str:
        return self.artifact.host_mod.script()


def _compile(name, example):
    """``(prim_func, Lowered)`` of ``example``, lowered on first use and shared by every test
    that asks for the same kernel after."""
    key = _key(name, example)
    if key not in _lowered:
        _lowered[key] = Lowered(_build(name, example))
    return _build(name, example), _lowered[key]


def _compiled_decode(kwargs: dict):
    """The lowered ``build_sparse_decode(**kwargs)`` (:func:`_compile`)."""
    return _compile(DECODE, {"builder": "build_sparse_decode", "kwargs": kwargs})[1]


@pytest.mark.parametrize("name,example", _examples())
def test_lowering(name, example):
    func, kernel = _compile(name, example)
    symbol = str(func.attrs["global_symbol"])
    source = kernel.get_kernel_source()
    entry = re.compile(r'extern "C" __global__ void (__launch_bounds__\([^)]*\) )?' + re.escape(symbol) + r"_kernel\(")
    assert entry.search(source), f'no extern "C" __global__ {symbol}_kernel in the CUDA source'
    if example["builder"] in MATRIX_BUILDERS:
        assert "wgmma" in source, f"{example['builder']}: no wgmma in the sm_90a CUDA source"


# nvcc (~5 s of a core a decode kernel, as much as its lowering) compiles one example per
# kernel family, not every example: every example is lowered (above), and what nvcc adds
# (ptxas accepts the generated CUDA; its spill counts) is a property of the family's code. The
# families, per module: predicates on an example's kwargs (and the builder's name,
# ``_builder``), each naming the first example it matches. Decode: the spill checks below
# compile their examples that :func:`_nvcc_wanted` names (lean producer: split consumers at
# h128, tokens in M on the fixed grid, the persistent grid's tile balance at h64 and item walk
# at h128, tokens in M on the persistent grid at h8; tokens in M, persistent, one math
# warpgroup); the predicates here add the families no spill check compiles.
NVCC_FAMILIES = {
    DECODE: (
        lambda k: k.get("warp_specialized") and not k.get("persistent")
        and not k.get("producer_lean") and k.get("consumers", "split") == "split",  # split pair
        lambda k: k.get("consumers") == "seesaw",  # the seesaw pair and the half producer
        # the portable body (sm_100a's decode), reading FNUZ bytes (CUDA JIT-compiles those)
        lambda k: not k.get("warp_specialized") and not k.get("tokens_in_m")
        and k.get("fp8_format") == "e4m3fnuz",
    ),
    "sparse_mla.sparse_decode_combine": (lambda k: k.get("merge", "lse") != "splits",
                                         lambda k: k.get("merge") == "splits"),
    "sparse_mla.sparse_prefill": (lambda k: k.get("warp_specialized"), lambda k: k.get("tokens_in_m"),
                                  lambda k: not k.get("warp_specialized") and not k.get("tokens_in_m")),
    "dequant_gather": (lambda k: True,),
    "insert_k_cache": (lambda k: True,),
    "index_helpers": (lambda k: k["_builder"] == "build_global_topk",
                      lambda k: k["_builder"] == "build_combine_topk_swa"),
}

# The decode examples the spill checks compile with nvcc, by kwargs (the others' generated
# source is checked as lowered). Each family once (the rest compile the same code at another
# head count or tile: their lowering, above, is what differs):
#   lean producer, split consumers: h128 C4A one split (the h96 padded SWA 8-split example:
#     the same producer and consumers; its padding tiles are checked in the lowered source);
#   lean producer, tokens in M on the fixed grid: h16 (the other fixed-grid tokens-in-M
#     examples: the same consumers at other head groups, with the default producer, whose
#     code the split example compiles);
#   the persistent grid: the lean tile balance at h64 and the lean item walk at h128 (the
#     default-producer persistent examples: the same walks, the split example's producer);
#   tokens in M on the persistent grid: lean, two math warpgroups at h8 (h16: the same body
#     at another register split, 4 / 4 spill bytes against h8's 28 / 64, PERF_NOTES item 50)
#     and the default producer with one math warpgroup (the spill-free check);
#   the seesaw's half producer, lean: 64-token tiles at h128 C4A (the tightest producer
#     registers of the seesaw splits, 104; the h96 32-token four-slot example: the same
#     stream with more slots, its source checked as lowered);
#   the tail-split grid, lean, h128 C4A (the split consumers with the grid's unit, piece and
#     slot live beside them, PERF_NOTES item 77).
NVCC_DECODES = (
    {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
     "block_tokens": 32, "producer_lean": True},
    {"num_heads": 16, "has_extra": True, "tokens_in_m": True, "heads_per_block": 16,
     "threads": 384, "block_tokens": 64, "num_stages": 2, "producer_lean": True},
    {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
     "block_tokens": 32, "persistent": True, "balance": "tiles", "producer_lean": True},
    {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
     "block_tokens": 32, "persistent": True, "producer_lean": True},
    {"num_heads": 8, "has_extra": True, "tokens_in_m": True, "heads_per_block": 8,
     "threads": 384, "block_tokens": 64, "num_stages": 2, "persistent": True,
     "producer_lean": True},
    {"num_heads": 8, "has_extra": False, "tokens_in_m": True, "heads_per_block": 8,
     "threads": 256, "block_tokens": 64, "num_stages": 2, "persistent": True},
    {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
     "block_tokens": 64, "consumers": "seesaw", "producer_lean": True},
    {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
     "block_tokens": 32, "producer_lean": True, "tail_split": True},
)


def _nvcc_wanted(kwargs: dict) -> bool:
    """Whether a spill check compiles the decode example ``kwargs`` with nvcc
    (:data:`NVCC_DECODES`)."""
    return kwargs in NVCC_DECODES


def test_nvcc_decodes_are_examples():
    """Each decode the spill checks compile is an example of the spill checks (a renamed or
    removed example would otherwise leave its family without nvcc silently)."""
    examples = [e["kwargs"] for e in _import(DECODE).LOWERING_EXAMPLES]
    checked = [p.values[0] for p in _producer_lean_examples() + _seesaw_lean_examples()
               + _tim_persistent_examples()]
    for kwargs in NVCC_DECODES:
        assert kwargs in examples and kwargs in checked, f"not a spill-checked example: {kwargs}"


def _nvcc_examples():
    """The first example of each family of :data:`NVCC_FAMILIES` (one per family)."""
    params = []
    for name, families in NVCC_FAMILIES.items():
        examples = _import(name).LOWERING_EXAMPLES
        for family in families:
            i, example = next((i, e) for i, e in enumerate(examples)
                              if family({**e["kwargs"], "_builder": e["builder"]}))
            params.append(pytest.param(name, example, id=f"{name}.{example['builder']}.{i}",
                                       marks=[pytest.mark.xdist_group(f"{name}.{example['builder']}.{i}")]))
    return params


@pytest.mark.parametrize("name,example", _nvcc_examples())
def test_nvcc_compiles(name, example, tmp_path):
    """The generated CUDA of one kernel per family compiles with nvcc (sm_90a), where nvcc is
    here."""
    if _nvcc(_compile(name, example)[1].get_kernel_source(), tmp_path) is None:
        pytest.skip("no nvcc here")


@pytest.mark.parametrize("name,example", _examples())
def test_parameters_keep_their_names(name, example):
    """Each tensor parameter's buffer keeps the parameter's name. Binding a buffer to a
    local name inside a ``T.macro`` renames it; two buffers renamed alike (``cache_u8``,
    ``cache_u8_1``) made TileLang's generated argument checks compare one argument's shape
    with the other's (every C4A decode call failed on the H200, run 15)."""
    func = _build(name, example)
    renamed = {str(p.name): buf.name for p, buf in func.buffer_map.items()
               if buf.name + "_handle" != str(p.name)}
    assert not renamed, f"parameters renamed by the kernel body: {renamed}"


def test_export_and_load(tmp_path):
    """A compiled kernel exports to a shared library that tvm-ffi loads back without a GPU."""
    import tvm_ffi

    example = {"builder": "build_sparse_decode_combine", "kwargs": {"num_heads": 16, "num_splits": 2}}
    func = _build("sparse_mla.sparse_decode_combine", example)
    was_enabled = tilelang.is_cache_enabled()
    tilelang.disable_cache()  # (nvcc runs: TileLang's on-disk kernel cache bypassed)
    try:
        kernel = tilelang.compile(func, target=TARGET, execution_backend="tvm_ffi", out_idx=None)
    finally:
        if was_enabled:
            tilelang.enable_cache()
    path = tmp_path / "sparse_decode_combine.so"
    kernel.export_library(str(path))
    assert path.stat().st_size > 0
    module = tvm_ffi.load_module(str(path))
    symbol = str(func.attrs["global_symbol"])
    assert module.implements_function(symbol)
    assert callable(module[symbol])


# ------------------------------------------------------------------ the lean FP8 producer
def _producer_lean_examples():
    """The lean examples of the whole-tile producer (split consumers, tokens in M)."""
    return [p for p in _examples_with(DECODE, "producer_lean", lambda k: (
        f"lean-h{k['num_heads']}-bt{k['block_tokens']}-"
        f"{'tim' if k.get('tokens_in_m') else 'split'}-{'c4a' if k['has_extra'] else 'swa'}"
        + (f"-persistent-{k.get('balance', 'items')}" if k.get("persistent") else "")
        + ("-tail" if k.get("tail_split") else "")))
        if p.values[0].get("consumers") != "seesaw"]


def _seesaw_lean_examples():
    """The lean examples of the seesaw's half producer."""
    return [p for p in _examples_with(DECODE, "producer_lean", lambda k: (
        f"lean-seesaw-h{k['num_heads']}-bt{k['block_tokens']}-"
        f"slots{k.get('producer_slots', 2)}-{'c4a' if k['has_extra'] else 'swa'}"
        f"-splits{k.get('num_splits', 1)}"))
        if p.values[0].get("consumers") == "seesaw"]


def _lean_producer_source(kwargs: dict, role: str):
    """The generated CUDA of a lean-producer decode example and its producer's span (from its
    division magic to its last K store), after the checks both lean producers share: no
    barrier that TileLang inserted, no integer division by a block size, none of the default
    producer's loads."""
    source = _compiled_decode(kwargs).get_kernel_source()
    start = source.index("divm[0] = dsv4_div_mul(")
    end = source.rindex("dsv4_st16(")
    producer = source[start:end]
    inserted = re.findall(r"__syncthreads\(\)|__sync_thread_partial\(|bar\.sync", producer)
    assert not inserted, f"barriers inside the {role}: {inserted}"
    assert not re.search(r"[/%] *\(?(main|extra)_block_size", producer), "a division by the block size"
    assert "dsv4_ldg16(" not in producer and "dsv4_ldg8(" not in producer
    return source, producer


def test_producer_lean_has_examples():
    assert len(_producer_lean_examples()) >= 3


@pytest.mark.parametrize("kwargs", _producer_lean_examples())
def test_producer_lean_source(kwargs, tmp_path):
    """The generated CUDA of a decode with the lean producer (sparse_decode.LOWERING_EXAMPLES,
    the kernel test_lowering compiled): in the producer (from its
    division magic to its last K store) no barrier that TileLang inserted, no integer
    division, every token's bytes through ``dsv4_ldg_token`` (one call per branch of each
    round's scope choice, as the default producer's loads), one ``dsv4_lean_fast`` branch per
    round, and, for the examples of ``NVCC_DECODES`` where nvcc is here, no spills (on the
    persistent grid: no more than ``LEAN_PERSISTENT_SPILLS``, bench/PERF_NOTES.md item 52; the
    tail-split grid: ``LEAN_TAIL_SPLIT_SPILLS``)."""
    source, producer = _lean_producer_source(kwargs, "lean producer")
    steps = kwargs.get("num_stages", 2) * kwargs["block_tokens"] // 32  # K buffers x rounds
    assert producer.count("dsv4_lean_fast(") == steps
    # the first round before the loop, then one per step, in each branch of the round's
    # scope choice (window / compressed; SWA-only: window / an all-invalid padding tile)
    assert producer.count("dsv4_ldg_token(") == 2 * (1 + steps), producer.count("dsv4_ldg_token(")
    if not _nvcc_wanted(kwargs):
        return  # (its family's nvcc compile: NVCC_DECODES)
    if kwargs.get("persistent"):
        _check_no_spills(source, tmp_path, LEAN_PERSISTENT_SPILLS)
    elif kwargs.get("tail_split"):
        _check_no_spills(source, tmp_path, LEAN_TAIL_SPLIT_SPILLS)
    else:
        _check_no_spills(source, tmp_path)


# Spill bytes (stored, loaded; ptxas -v, nvcc 13.0) the persistent grid's lean kernels may reach:
# the item walk's live state pushes warpgroup 0's shared addresses out of registers (64 heads:
# up to 276 / 508, bench/PERF_NOTES.md items 30, 44, 52; tokens in M: h16 4 / 4, h8 28 / 64,
# item 50); the bound keeps it from growing.
LEAN_PERSISTENT_SPILLS = (300, 540)
# The tail-split grid's (h128 C4A, lean; nvcc 13.0: 20 / 48 at 216 / 160 / 128 registers): its
# unit, piece, slot and store choice, live beside the split consumers' state (bench/PERF_NOTES.md
# item 77); the bound keeps it from growing.
LEAN_TAIL_SPLIT_SPILLS = (32, 64)


def test_seesaw_lean_has_examples():
    assert {(p.values[0]["block_tokens"], p.values[0].get("producer_slots", 2))
            for p in _seesaw_lean_examples()} == {(64, 2), (32, 4)}


@pytest.mark.parametrize("kwargs", _seesaw_lean_examples())
def test_seesaw_lean_source(kwargs, tmp_path):
    """The generated CUDA of a seesaw decode with the lean half producer
    (sparse_decode.LOWERING_EXAMPLES, the kernel test_lowering compiled): in the producer (from
    its division magic to its last K store) no barrier that TileLang inserted, no integer
    division, every token's bytes through ``dsv4_ldg_token_half`` (one call per branch of each
    step's scope choice: the ``slots - 1`` steps before the loop, then the pair's steps), one
    ``dsv4_lean_fast`` branch per step, and, for the example of ``NVCC_DECODES`` where nvcc is
    here, no spills."""
    source, producer = _lean_producer_source(kwargs, "lean half producer")
    assert "dsv4_ldg_token(" not in producer
    steps = 4 * kwargs["block_tokens"] // 32  # the (buffer, half, round) steps of a tile pair
    slots = kwargs.get("producer_slots", 2)
    assert producer.count("dsv4_lean_fast(") == steps
    calls = producer.count("dsv4_ldg_token_half<")
    assert calls == 2 * (slots - 1 + steps), calls
    for half in (0, 1):  # each half's loads by its own instance
        assert f"dsv4_ldg_token_half<{half}>(" in producer
    if _nvcc_wanted(kwargs):
        _check_no_spills(source, tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    ({"block_tokens": 32, "producer_lean": True, "warp_specialized": False, "threads": 256},
     "producer_lean: .*seesaw consumers"),
    ({"block_tokens": 32, "producer_lean": True, "consumers": "seesaw", "persistent": True},
     "consumers 'seesaw': needs"),
    ({"block_tokens": 32, "producer_lean": 1}, "producer_lean: expected True or False"),
])
def test_producer_lean_refused(kwargs, message):
    """The knob where the lean producer does not serve: a ValueError naming it from the
    builder, and the tuner's resource model prunes the same config."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode
    from dsv4_tl.schedule_rules import prune

    base = {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384}
    with pytest.raises(ValueError, match=message):
        build_sparse_decode(**{**base, **kwargs})
    config = {"heads_per_block": 64, "num_splits": 1, **base, **kwargs}
    if kwargs["producer_lean"] is True and not kwargs.get("consumers"):
        assert (prune("cuda_sm90a", "sparse_decode", config) or "").startswith("producer_lean")


@pytest.mark.parametrize("kwargs,message", [
    ({"q_stages": 3, "persistent": True}, "q_stages: 0 .* got 3"),
    ({"q_stages": 1}, "q_stages: .*persistent False"),
    ({"q_stages": 2, "persistent": True, "num_heads": 128}, "q_stages: 2 Q stages need"),
    ({"q_stages": 2, "persistent": True, "block_tokens": 64}, "q_stages: 2 Q stages need"),
])
def test_q_stages_refused(kwargs, message):
    """The persistent grid's Q stage knob where it does not apply or is malformed: a ValueError
    naming it."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    base = {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
            "block_tokens": 32}
    with pytest.raises(ValueError, match=message):
        build_sparse_decode(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    ({"plan_repeats": 2}, "plan_repeats: .* got 2 with persistent False"),
    ({"plan_repeats": 0, "persistent": True}, "plan_repeats: 1-16 .* got 0"),
    ({"plan_repeats": 17, "persistent": True}, "plan_repeats: 1-16 .* got 17"),
    ({"plan_repeats": True, "persistent": True}, "plan_repeats: 1-16 .* got True"),
    ({"plan_repeats": 2.0, "persistent": True}, "plan_repeats: 1-16 .* got 2.0"),
])
def test_plan_repeats_refused(kwargs, message):
    """The plan-cost probe's knob (bench/PERF_NOTES.md item 73) off the persistent grid or
    malformed: a ValueError naming it."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    base = {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
            "block_tokens": 32}
    with pytest.raises(ValueError, match=message):
        build_sparse_decode(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    ({"plan_from_metadata": True}, "plan_from_metadata: .* got True with persistent False"),
    ({"plan_from_metadata": True, "persistent": True, "plan_repeats": 2},
     "plan_from_metadata: .* plan_repeats 2"),
    ({"plan_from_metadata": 1, "persistent": True}, "plan_from_metadata: a bool.* got 1"),
    ({"plan_only": True}, "plan_only: .* got True with persistent False"),
    ({"plan_only": True, "persistent": True, "plan_from_metadata": True},
     "plan_only: .* plan_from_metadata True"),
    ({"plan_only": True, "persistent": True, "num_heads": 96}, "plan_only: needs the "),
])
def test_plan_from_metadata_refused(kwargs, message):
    """The metadata knobs (the variant reading the plan, the plan-only kernel writing it) off
    the persistent grid (nothing to plan), together or with the plan probe, on padded head
    groups or malformed: a ValueError naming the knob."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    base = {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
            "block_tokens": 32}
    with pytest.raises(ValueError, match=message):
        build_sparse_decode(**{**base, **kwargs})


def _plan_prologue(source: str) -> str:
    """The kernel's code before its roles split (the first register reallocation): the
    barrier set-up and the persistent grid's plan, which every thread runs."""
    body = source[source.index("sparse_decode_kernel("):]
    body = body[body.index("{"):]
    return body[:body.index("tl::warpgroup_reg_")]


# One example per walk: the tile balance (64 heads, lean) and tokens in M's item balance (16
# heads, lean), each as lowered for its other tests and with the plan traced three times.
_PLAN_PROBE_EXAMPLES = [p for p in _examples_with(DECODE, "persistent", lambda k: (
    f"plan-repeats-h{k['num_heads']}-{k.get('balance', 'items')}"))
    if p.values[0].get("producer_lean") and p.values[0]["num_heads"] in (16, 64)
    and p.values[0].get("has_extra")]


def test_plan_probe_has_examples():
    assert len(_PLAN_PROBE_EXAMPLES) == 2


@pytest.mark.parametrize("kwargs", _PLAN_PROBE_EXAMPLES)
def test_plan_repeats_source(kwargs):
    """``plan_repeats`` 3 runs the whole plan three times before the roles split -- one
    counted loop around every warp scan and every CTA barrier of the plan (the probe times
    three plans, not one plan and some leftovers) -- which every thread runs through (item
    48's hang: no barrier a thread could miss)."""
    once = _plan_prologue(_compiled_decode(kwargs).get_kernel_source())
    source = _compiled_decode({**kwargs, "plan_repeats": 3}).get_kernel_source()
    thrice = _plan_prologue(source)
    scans = once.count("__shfl_up_sync")
    assert scans >= 5 and thrice.count("__shfl_up_sync") == scans
    loop = re.search(r"for \(int (\w+) = 0; \1 < 3; \+\+\1\) \{", thrice)
    assert loop, "no loop of three plans"
    depth, end = 0, None
    for i in range(loop.end() - 1, len(thrice)):
        depth += {"{": 1, "}": -1}.get(thrice[i], 0)
        if depth == 0:
            end = i
            break
    inside, before = thrice[loop.end():end], thrice[:loop.start()]
    assert inside.count("__shfl_up_sync") == scans
    # (before the loop only the barrier after the mbarrier set-up, as in the shipped kernel)
    assert before.count("__syncthreads()") == 1 == once.count("__syncthreads()") - \
        inside.count("__syncthreads()")
    assert not _divergent_cta_barriers(source)


@pytest.mark.parametrize("kwargs", _PLAN_PROBE_EXAMPLES)
def test_plan_from_metadata_source(kwargs):
    """``plan_from_metadata``: before the roles split no plan is left (no warp scan, the
    set-up barrier and one more), each plan word read from the ``Plan`` argument of the
    CTA's row, clamped, then used; the roles' walks unchanged otherwise, and every CTA
    barrier reached by all threads."""
    from dsv4_tl.tile_kernels.sparse_mla.work import PLAN_WORDS

    words = PLAN_WORDS[kwargs.get("balance", "items")]
    source = _compiled_decode({**kwargs, "plan_from_metadata": True}).get_kernel_source()
    prologue = _plan_prologue(source)
    assert "__shfl_up_sync" not in prologue
    assert prologue.count("__syncthreads()") == 2
    assert "int* __restrict__ Plan" in source
    rows = re.findall(r"Plan\[\(?\(?min\(\(\(int64_t\)\(\(int\)blockIdx\.x\)\), "
                      r"\(\(\(int64_t\)plan_ctas\) - \(int64_t\)1\)\) \* \(int64_t\)(\d+)\)"
                      r"(?: \+ \(int64_t\)(\d+)\))?\]", prologue)
    assert {int(n) for n, _ in rows} == {words}
    assert {int(i or 0) for _, i in rows} == set(range(words))
    assert not _divergent_cta_barriers(source)
    # The tile balance's load clamps the slots once, so its roles run the shipped kernel's
    # code (the per-item clamps made them slower: bench/PERF_NOTES.md item 73); the item
    # balance clamps each item's slot (any unit of its range may split).
    roles = _roles(source)
    if kwargs.get("balance", "items") == "tiles":
        assert _numbering_dropped(roles) == _numbering_dropped(
            _roles(_compiled_decode(kwargs).get_kernel_source()))
    else:
        assert "slot_limit" in roles


def _roles(source: str) -> str:
    """The decode kernel's code from its roles' split on (the first register reallocation)."""
    body = source[source.index("sparse_decode_kernel("):]
    return body[body.index("tl::warpgroup_reg_"):]


def _numbering_dropped(source: str) -> str:
    """``source`` with the numbers TileLang appends to its variable names dropped."""
    return re.sub(r"\b([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z][A-Za-z0-9]*)*)_\d+\b", r"\1",
                  re.sub(r"\bcondval_\d+\b", "condval", source))


@pytest.mark.parametrize("kwargs", _PLAN_PROBE_EXAMPLES)
def test_plan_only_source(kwargs):
    """``plan_only`` (the metadata kernel): the decode's plan as the decode runs it (the same
    warp scans and CTA barriers as the shipped kernel's prologue, every one reached by all
    threads), then each CTA's words stored into its row of ``Plan``; no decode left (no
    wgmma, no register reallocation)."""
    from dsv4_tl.tile_kernels.sparse_mla.work import PLAN_WORDS

    words = PLAN_WORDS[kwargs.get("balance", "items")]
    shipped = _plan_prologue(_compiled_decode(kwargs).get_kernel_source())
    source = _compiled_decode({**kwargs, "plan_only": True}).get_kernel_source()
    assert "wgmma" not in source and "warpgroup_reg_" not in source
    assert source.count("__shfl_up_sync") == shipped.count("__shfl_up_sync") >= 5
    assert source.count("__syncthreads()") == shipped.count("__syncthreads()") - 1
    store = (r"Plan\[\(\(\(\(int64_t\)\(\(int\)blockIdx\.x\)\) \* \(int64_t\)%d\) \+ "
             r"\(\(int64_t\)\(\(int\)threadIdx\.x\)\)\)\] = bounds\[" % words)
    assert re.search(store, source)
    assert not _divergent_cta_barriers(source)


def test_combine_clamp_slots_source():
    """``clamp_slots`` (the combine after a decode that read scheduler metadata): each row's
    slot base clamped into the partials and its split count to the slots left, before any
    read of a partial; without the knob the shipped reads (no clamp). A malformed value: a
    ValueError naming it."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode_combine import (
        build_sparse_decode_combine)

    example = {"num_heads": 64, "num_splits": 64, "merge": "splits"}

    def source(**extra):
        name = "sparse_mla.sparse_decode_combine"
        return _compile(name, {"builder": "build_sparse_decode_combine",
                               "kwargs": {**example, **extra}})[1].get_kernel_source()

    clamp = re.compile(r"max\(min\(RowSplits\[[^]]*\], \(slots - 1\)\), 0\)")
    clamped, shipped = source(clamp_slots=True), source()
    assert clamp.search(clamped) and not clamp.search(shipped)
    assert "(slots - base)" in clamped
    with pytest.raises(ValueError, match="^clamp_slots: expected a bool"):
        build_sparse_decode_combine(**example, clamp_slots=1)


def test_producer_lean_kept_by_pruning():
    """Where the builder takes the knob (split and seesaw consumers, tokens in M), the tuner
    keeps it."""
    from dsv4_tl.schedule_rules import prune

    base = {"heads_per_block": 64, "num_heads": 64, "has_extra": True, "threads": 384,
            "block_tokens": 32, "num_splits": 1, "warp_specialized": True, "producer_lean": True}
    assert not (prune("cuda_sm90a", "sparse_decode", base) or "").startswith("producer_lean")
    tim = {**base, "warp_specialized": False, "tokens_in_m": True, "heads_per_block": 16,
           "block_tokens": 64, "num_stages": 2, "ctas_per_sm": 1}
    assert not (prune("cuda_sm90a", "sparse_decode", tim) or "").startswith("producer_lean")
    seesaw = {**base, "consumers": "seesaw", "block_tokens": 64}  # the half producer
    assert not (prune("cuda_sm90a", "sparse_decode", seesaw) or "").startswith("producer_lean")
    for balance in ("items", "tiles"):  # the 64-head persistent grid (item 52)
        persistent = {**base, "persistent": True, "balance": balance}
        assert not (prune("cuda_sm90a", "sparse_decode", persistent) or "").startswith(
            "producer_lean")


def _nvcc(source: str, tmp_path):
    """nvcc --cubin with ``ptxas -v`` (sm_90a) on the generated CUDA ``source``: its stderr,
    after asserting that it compiled; None where no nvcc is here."""
    import os
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc")
                                    else None)
    if nvcc is None:
        return None
    root = os.path.dirname(tilelang.__file__)
    cu = tmp_path / "kernel.cu"
    cu.write_text(source)
    out = subprocess.run([nvcc, "--cubin", "-O3", "-arch=sm_90a", "-std=c++20",
                          f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include", "-Xptxas", "-v",
                          "-o", str(tmp_path / "kernel.cubin"), str(cu)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def _check_no_spills(source: str, tmp_path, at_most=(0, 0)) -> None:
    """``ptxas -v`` (nvcc, sm_90a) on the generated CUDA ``source``, where nvcc is here: it
    compiles and spills nothing (or at most ``at_most``: bytes stored, loaded)."""
    stderr = _nvcc(source, tmp_path)
    if stderr is None:
        return
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", stderr)
    assert spills and all(int(st) <= at_most[0] and int(ld) <= at_most[1]
                          for st, ld in spills), stderr[-1000:]


# Words of a condition that do not make it thread- or data-dependent (with the kernel's
# parameters and blockIdx): C type names of casts.
_UNIFORM_WORDS = {"int", "int64_t", "uint", "uint64_t", "long", "float", "bool", "char", "short",
                  "signed", "unsigned", "true", "false", "BLOCKIDX"}


def _divergent_cta_barriers(source: str) -> list:
    """The ``__syncthreads()`` lines of the CUDA kernel in ``source`` that not every thread of
    the CTA is sure to reach: inside a loop (but a counted one whose bounds read only what an
    ``if`` may), or inside an ``if`` / ``else`` whose condition
    reads anything but the kernel's parameters, ``blockIdx`` and literals (a thread- or
    data-dependent branch). A CTA-wide barrier there hangs the CTA or pairs the wrong
    barriers: TileLang's thread-sync pass put one inside the tile balance's owner branch
    (``work.cta_tile_range``) and every call hung (runs 63 and 65, PERF_NOTES item 48).
    Named barriers of a role (``__sync_thread_partial``) are not CTA-wide: not checked."""
    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?\w+\(([^)]*)\)'
                  r"\s*\{", source)
    assert m, "no kernel definition in the source"
    params = {p.split()[-1].lstrip("*") for p in m.group(1).split(",") if p.strip()}

    def uniform(cond: str) -> bool:
        c = re.sub(r"blockIdx\.[xyz]", "BLOCKIDX", cond)
        c = re.sub(r"^\}?\s*(else\s+)?if\s*", "", c)
        return "threadIdx" not in c and set(re.findall(r"\b[A-Za-z_]\w*\b", c)) <= (
            params | _UNIFORM_WORDS)

    def uniform_loop(head: str) -> bool:
        # a counted loop whose bounds every thread reads alike (the plan-cost probe's loop of
        # plans, work.plan_cta_range's ``repeats``): each thread runs every trip
        loop = re.match(r"for \(int (\w+) = ([^;]*); \1 < ([^;]*); \+\+\1\)", head)
        return bool(loop) and uniform(loop.group(2)) and uniform(loop.group(3))

    stack, bad, last_if = [], [], ""
    for line in source[m.end():].splitlines():
        s = line.strip()
        if re.match(r"(for|while)\b", s):
            head = ("loop", s)
        elif re.match(r"\}?\s*else\s+if\b", s) or re.match(r"if\b", s):
            head = ("if", s)
        elif re.match(r"\}?\s*else\b", s):
            head = ("else", "")  # (its if's condition: known once that if's "}" is read)
        else:
            head = ("block", "")
        if "__syncthreads()" in s and any(not uniform_loop(cond) if kind == "loop"
                                          else not uniform(cond) for kind, cond in stack):
            bad.append(s)
        for ch in s:
            if ch == "}":
                if not stack:
                    return bad  # (the kernel's closing brace)
                kind, cond = stack.pop()
                last_if = cond if kind == "if" else ""
            elif ch == "{":
                stack.append(("if", last_if) if head[0] == "else" else head)
                head = ("block", "")
    return bad


def test_divergent_cta_barriers_found():
    """The check above flags a CTA barrier in a loop whose trip count is a thread's own
    value, under a thread-dependent condition or under a condition on a thread's own value
    (the tile balance's owner branch as it lowered), and passes ones under conditions on
    parameters and blockIdx only and in a counted loop over parameters (the plan-cost
    probe's loop of plans, bench/PERF_NOTES.md item 73)."""
    source = """extern "C" __global__ void __launch_bounds__(384, 1) k(int n, int* __restrict__ a) {
  int x = a[threadIdx.x];
  __syncthreads();
  if (((((int)blockIdx.x) < n) && (0 < n))) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  if ((((int)blockIdx.x) < n) && (x < n)) {
    __syncthreads();
    for (int r = 0; r < n; ++r) {
      a[r] = 0;
    }
  }
  if ((0 < n)) {
  } else {
    if (((int)threadIdx.x) < 128) {
      __syncthreads(); // thread
    }
  }
  for (int i = 0; i < x; ++i) {
    __syncthreads(); // loop
  }
  for (int j = 0; j < (n + 2); ++j) {
    __syncthreads();
  }
  __syncthreads();
}
"""
    bad = _divergent_cta_barriers(source)
    assert bad == ["__syncthreads();", "__syncthreads(); // thread", "__syncthreads(); // loop"]


def _launch_shared_bytes(kernel) -> int:
    """The dynamic shared memory of a lowered decode kernel: the last argument of the host
    code's launch of the device function (grid, block, then the dynamic shared bytes)."""
    launch = re.search(r'T\.call_packed\("sparse_decode_kernel", [^\n]*?, (\d+)\)\n',
                       kernel.get_host_source())
    assert launch, "no launch of sparse_decode_kernel in the host code"
    return int(launch.group(1))


# --------------------------------------------------- the persistent decode grid's Q stages
def _persistent_examples():
    """The 64/128-head schedule's persistent examples (tokens in M's: _tim_persistent_examples)."""
    return [p for p in _examples_with(DECODE, "persistent", lambda k: (
        f"persistent-h{k['num_heads']}-bt{k['block_tokens']}-{k.get('balance', 'items')}"
        + (f"-q{k['q_stages']}" if k.get("q_stages") else "")
        + ("-lean" if k.get("producer_lean") else "")))
        if not p.values[0].get("tokens_in_m")]


def test_persistent_has_examples():
    assert {k.values[0]["block_tokens"] for k in _persistent_examples()} == {32, 64}


@pytest.mark.parametrize("kwargs", _persistent_examples())
def test_persistent_q_stages_source(kwargs):
    """The generated CUDA of a persistent-grid decode (bench/PERF_NOTES.md item 44): with
    32-token tiles two Q stages (Q loaded by TMA in four places: two stages x two halves;
    dynamic shared memory 2 x 64 KB of Q + 2 K buffers + 2 P tiles), with 64-token tiles or
    the item walk of two head groups one (two places; one Q); within the 227 KB of a CTA
    either way."""
    bt = kwargs["block_tokens"]
    # (the item walk of two head groups keeps one stage: two did not lower, run 62)
    whole = kwargs["num_heads"] <= 64 or kwargs.get("balance") == "tiles"
    stages = kwargs.get("q_stages") or (2 if bt == 32 and whole else 1)
    kernel = _compiled_decode(kwargs)
    source = kernel.get_kernel_source()
    # every CTA-wide barrier of the plan reached by every thread (item 48's hang)
    assert not _divergent_cta_barriers(source)
    assert source.count("tma_load(Q_desc") == 2 * stages
    # Q stages (64 KB each), K buffers (2 x bt x 1 KB), P tiles (2 x 64 x bt x 2 B)
    assert _launch_shared_bytes(kernel) == stages * 65536 + 2 * bt * 1024 + 2 * 64 * bt * 2
    assert _launch_shared_bytes(kernel) <= 227 * 1024


# ------------------------------------------------------- tokens in M on the persistent grid
def _tim_persistent_examples():
    return [p for p in _examples_with(DECODE, "persistent", lambda k: (
        f"tim-persistent-h{k['num_heads']}-t{k['threads']}-"
        f"{'c4a' if k['has_extra'] else 'swa'}")) if p.values[0].get("tokens_in_m")]


def test_tim_persistent_has_examples():
    assert {k.values[0]["threads"] for k in _tim_persistent_examples()} == {256, 384}


@pytest.mark.parametrize("kwargs", _tim_persistent_examples())
def test_tim_persistent_source(kwargs, tmp_path):
    """The generated CUDA of tokens in M on the persistent grid (bench/PERF_NOTES.md item 50):
    one CTA range plan (the work items of work.py), Q loaded by TMA per item in one place per
    half, a finished output stored by TMA, with two math warpgroups their per-item meeting
    (named barrier 10 of 256 threads) once in each; the dynamic shared memory within a CTA's
    227 KB; with one math warpgroup (``NVCC_DECODES``), where nvcc is here, it compiles
    (ptxas -v) spilling nothing."""
    kernel = _compiled_decode(kwargs)
    source = kernel.get_kernel_source()
    head = source[source.index("sparse_decode_kernel("):]
    body = head[head.index("{"):]
    assert body.count("tl::tma_load(Q_desc") == 2
    assert "tl::tma_store(Out_desc" in body
    meets = body.count("tl::__sync_thread_partial(10, 256);")
    assert meets == (2 if kwargs["threads"] == 384 else 0), meets
    assert 0 < _launch_shared_bytes(kernel) <= 227 * 1024
    assert not _divergent_cta_barriers(source)  # (the tile balance's hang, item 48)
    if kwargs["threads"] == 256 and _nvcc_wanted(kwargs):
        _check_no_spills(source, tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_splits": 2}, "persistent: .*needs num_splits 1, got 2"),
    ({"num_stages": 1}, "persistent: .*needs num_stages 2, got 1"),
    ({"threads": 256, "ctas_per_sm": 2}, "persistent: .*needs ctas_per_sm 1, got 2"),
    ({"balance": "tiles"}, "persistent: .*needs balance 'items', got 'tiles'"),
    ({"item_cost": 0}, "persistent: needs item_cost >= 1, got 0"),
])
def test_tim_persistent_refused(kwargs, message):
    """What tokens in M on the persistent grid cannot take: a ValueError naming the knob from
    the builder, and the tuner's resource model prunes the same config."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode
    from dsv4_tl.schedule_rules import prune

    base = {"num_heads": 16, "has_extra": True, "tokens_in_m": True, "heads_per_block": 16,
            "threads": 384, "block_tokens": 64, "num_stages": 2, "persistent": True}
    with pytest.raises(ValueError, match=message):
        build_sparse_decode(**{**base, **kwargs})
    config = {"num_splits": 1, "ctas_per_sm": 1, "warp_specialized": False, **base, **kwargs}
    if "item_cost" not in kwargs:
        assert prune("cuda_sm90a", "sparse_decode", config)


def test_tim_persistent_kept_by_pruning_and_padded_heads_keep_fixed_grid():
    """The A/B's config (TIM_PERSISTENT of scripts/decode_grid_ab.py at commit 7dfd2b4, lean
    producer or not) is kept by the tuner; a head count with a padded last group builds the
    fixed grid's kernel under the knob (the front end's rule too)."""
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode
    from dsv4_tl.schedule_rules import prune

    config = {"num_heads": 16, "has_extra": True, "heads_per_block": 16, "block_tokens": 64,
              "threads": 384, "warp_specialized": False, "tokens_in_m": True, "num_stages": 2,
              "ctas_per_sm": 1, "num_splits": 1, "persistent": True}
    assert prune("cuda_sm90a", "sparse_decode", config) is None
    assert prune("cuda_sm90a", "sparse_decode", {**config, "producer_lean": True}) is None
    padded = {"num_heads": 20, "has_extra": True, "tokens_in_m": True, "heads_per_block": 24,
              "threads": 384, "block_tokens": 64, "num_stages": 2}
    assert (build_sparse_decode(**padded, persistent=True).script()
            == build_sparse_decode(**padded).script())


# --------------------------------------------- the plans' loops and TileLang's thread sync
def _shipped_persistent_decodes():
    """Every shipped sm_90a decode variant on the persistent grid (heads 8-128), by key."""
    import warnings

    from dsv4_tl.build import build_variants

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks
        variants = build_variants("cuda:sm_90a", (8, 16, 32, 64, 128), ["sparse_decode"])
    return [pytest.param(v, id=v.key) for v in variants if dict(v.schedule).get("persistent")]


def _thread_dependent_top_loops(func) -> list:
    """The loops of ``func``'s kernel outside every loop and branch whose range depends on
    the thread index (directly or through bound variables)."""
    from tvm import ir, tirx

    launch = ir.Op.get("tl.launch_thread_idx")
    tainted, found = set(), []

    def uses_thread(expr) -> bool:
        hits = []
        tirx.stmt_functor.post_order_visit(
            expr, lambda n: hits.append(n) if isinstance(n, tirx.Var) and n in tainted else None)
        return bool(hits)

    def walk(stmt, scoped: bool):
        if isinstance(stmt, tirx.Bind):
            value = stmt.value
            if (isinstance(value, tirx.Call) and value.op.same_as(launch)) or uses_thread(value):
                tainted.add(stmt.var)
        elif isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING:
            walk(stmt.body, scoped)  # the grid, not a loop
        elif isinstance(stmt, tirx.For):
            if not scoped and (uses_thread(stmt.min) or uses_thread(stmt.extent)):
                found.append(stmt.loop_var.name)
            walk(stmt.body, True)
        elif isinstance(stmt, tirx.IfThenElse):
            walk(stmt.then_case, True)
            if stmt.else_case is not None:
                walk(stmt.else_case, True)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, scoped)
        elif isinstance(stmt, tirx.SBlockRealize):
            walk(stmt.block, scoped)
        elif isinstance(getattr(stmt, "body", None), tirx.Stmt):
            walk(stmt.body, scoped)

    walk(func.body, False)
    return found


def test_shipped_persistent_decodes_exist():
    assert {dict(p.values[0].schedule).get("balance") for p in _shipped_persistent_decodes()} \
        == {"items", "tiles"}


@pytest.mark.parametrize("variant", _shipped_persistent_decodes())
def test_plan_loops_keep_the_thread_index_out_of_their_range(variant):
    """No loop outside every loop and branch of a persistent decode has a range that depends
    on the thread index (the plans' per-thread unit / row loops bound by variables,
    work.cta_work_range). TVM's analyzer keeps such a loop's range in TileLang's thread-sync
    z3 prover for the rest of the kernel; ``min(tx * ceildiv(units, threads), units)`` made
    each count of a warpgroup's threads for its partial barriers run near z3's resource
    limit, and a count cut short failed the h32 tokens-in-M kernel (``[ThreadSync] ... a
    divergent region with 1 participating threads``) in some of its runs: which one
    depended on the shared-memory layout TileLang picked, which varies from run to run."""
    assert not _thread_dependent_top_loops(variant.build())


# ------------------------------------------------------------------ the tail-split grid
def _tail_split_examples():
    return _examples_with(DECODE, "tail_split", lambda k: (
        f"tail-h{k['num_heads']}-{'lean' if k.get('producer_lean') else 'default'}"))


def test_tail_split_has_examples():
    assert {p.values[0]["num_heads"] for p in _tail_split_examples()} == {64, 128}


def test_shipped_tail_split_decodes_are_examples():
    """Every shipped sm_90a tail-split decode (the build listing, heads 8-128; routed since
    run 107) is one of the lowering examples above: its builder arguments other than the
    builder's defaults are an example's."""
    import inspect
    import warnings

    from dsv4_tl.build import build_variants
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    defaults = {k: p.default for k, p in inspect.signature(build_sparse_decode).parameters.items()
                if p.default is not inspect.Parameter.empty}
    examples = [p.values[0] for p in _tail_split_examples()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks
        variants = build_variants("cuda:sm_90a", (8, 16, 32, 64, 128), ["sparse_decode"])
    shipped = [v for v in variants if dict(v.schedule).get("tail_split")]
    assert {dict(v.static)["num_heads"] for v in shipped} == {64, 128}
    for v in shipped:
        kwargs = {**dict(v.static), **dict(v.schedule)}
        own = {k: val for k, val in kwargs.items() if k not in defaults or defaults[k] != val}
        assert own in [{k: val for k, val in e.items() if k not in defaults or defaults[k] != val}
                       for e in examples], (v.key, own)


@pytest.mark.parametrize("kwargs", _tail_split_examples())
def test_tail_split_source(kwargs):
    """The generated CUDA of the tail-split grid (bench/PERF_NOTES.md item 77): every CTA-wide
    barrier reached by every thread (its unit, piece and store choice are data-dependent
    branches), Q loaded by TMA once (two halves), both ends of a unit: the finished head group
    by TMA stores and the fp32 partial stores, and the split table written."""
    source = _compiled_decode(kwargs).get_kernel_source()
    assert not _divergent_cta_barriers(source)
    assert source.count("tma_load(Q_desc") == 2
    assert "tma_store(" in source
    # (beyond the parameter list: the partial stores, vectorised, and the split table)
    assert source.count("OPartial") >= 2 and re.search(r"LsePartial\[", source)
    assert re.search(r"RowSplits\[", source)
