"""Every kernel in tile_kernels/ lowers and compiles for CUDA sm_90a (no GPU needed).

Rule, checked by ``test_examples_cover_builders``: a module of ``dsv4_tl.tile_kernels`` that
defines a ``build_*`` function must define ``LOWERING_EXAMPLES``, a list of
``{"builder": name, "kwargs": {...}}`` naming each of its ``build_*`` functions at least once.
A module with no ``build_*`` function of its own (a helper such as ``attention_tile``) has
nothing to lower. Each example is then compiled by ``test_lowering[<module>.<builder>.<n>]``
with TileLang's ``tvm_ffi`` backend (nvcc runs, nothing is launched) and its CUDA source is
checked for the ``extern "C" __global__`` entry and, for the attention builders, for wgmma
(Hopper tensor-core) instructions.
"""

import importlib
import pkgutil
import re

import pytest

tilelang = pytest.importorskip("tilelang")

import dsv4_tl.tile_kernels as tile_kernels  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
# Builders whose kernels do their matrix work (QK^T, PV) on the tensor cores.
MATRIX_BUILDERS = {"build_sparse_decode", "build_sparse_prefill"}

MODULE_NAMES = sorted(
    info.name for info in pkgutil.iter_modules(tile_kernels.__path__) if not info.name.startswith("_")
)


def _import(name):
    return importlib.import_module(f"{tile_kernels.__name__}.{name}")


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
            params.append(pytest.param(name, example, id=f"{name}.{builder}.{i}"))
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


@pytest.fixture(scope="module")
def fresh_compiles():
    """Compile for real (nvcc included) instead of reading TileLang's on-disk kernel cache."""
    was_enabled = tilelang.is_cache_enabled()
    tilelang.disable_cache()
    yield
    if was_enabled:
        tilelang.enable_cache()


def _compile(name, example):
    func = getattr(_import(name), example["builder"])(**example["kwargs"])
    return func, tilelang.compile(func, target=TARGET, execution_backend="tvm_ffi", out_idx=None)


@pytest.mark.parametrize("name,example", _examples())
def test_lowering(name, example, fresh_compiles):
    func, kernel = _compile(name, example)
    symbol = str(func.attrs["global_symbol"])
    source = kernel.get_kernel_source()
    entry = re.compile(r'extern "C" __global__ void (__launch_bounds__\([^)]*\) )?' + re.escape(symbol) + r"_kernel\(")
    assert entry.search(source), f'no extern "C" __global__ {symbol}_kernel in the CUDA source'
    if example["builder"] in MATRIX_BUILDERS:
        assert "wgmma" in source, f"{example['builder']}: no wgmma in the sm_90a CUDA source"


@pytest.mark.parametrize("name,example", _examples())
def test_parameters_keep_their_names(name, example):
    """Each tensor parameter's buffer keeps the parameter's name. Binding a buffer to a
    local name inside a ``T.macro`` renames it; two buffers renamed alike (``cache_u8``,
    ``cache_u8_1``) made TileLang's generated argument checks compare one argument's shape
    with the other's (every C4A decode call failed on the H200, run 15)."""
    func = getattr(_import(name), example["builder"])(**example["kwargs"])
    renamed = {str(p.name): buf.name for p, buf in func.buffer_map.items()
               if buf.name + "_handle" != str(p.name)}
    assert not renamed, f"parameters renamed by the kernel body: {renamed}"


def test_export_and_load(tmp_path, fresh_compiles):
    """A compiled kernel exports to a shared library that tvm-ffi loads back without a GPU."""
    import tvm_ffi

    example = {"builder": "build_sparse_decode_combine", "kwargs": {"num_heads": 16, "num_splits": 2}}
    func, kernel = _compile("sparse_decode", example)
    path = tmp_path / "sparse_decode_combine.so"
    kernel.export_library(str(path))
    assert path.stat().st_size > 0
    module = tvm_ffi.load_module(str(path))
    symbol = str(func.attrs["global_symbol"])
    assert module.implements_function(symbol)
    assert callable(module[symbol])
