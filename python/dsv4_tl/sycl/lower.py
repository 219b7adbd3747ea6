"""Lower a TileLang kernel definition to SYCL C++ (no SYCL runtime needed).

The kernel's ``PrimFunc`` goes through TileLang's ``webgpu`` pass pipeline, the generic SIMT
lowering (layout inference, tile-op lowering, shared-memory merging, barrier insertion),
with vectorisation off so that every access is scalar. The one device function it leaves is
printed by ``dsv4_tl.sycl.codegen``. The original function's signature gives the host-side
binding: which tensor or scalar feeds each device parameter, and which tensor dimension
defines each shape variable.
"""

from dataclasses import dataclass

from tilelang import tvm
from tilelang.backend.module import create_backend_context
from tilelang.engine.lower import _prepare_device_codegen_mod, lower_to_host_device_ir
from tvm import tirx

from .codegen import KernelSource, SyclCodegenError, launch_expr_to_python, print_kernel

_TARGET = {"kind": "webgpu"}
# Scalar accesses only: the printer emits no vector types (see codegen's docstring).
_SYCL_PASS_CONFIGS = {"tirx.disable_vectorize": True}


@dataclass(frozen=True)
class SyclProgram:
    """A kernel lowered to SYCL, with what a launcher needs to bind its arguments.

    ``written``: the tensors the kernel may write (the others are read-only in the device
    code; a launcher copies only these back). ``args``: the TileLang kernel's parameters in order, each a dict: ``{"name", "kind":
    "tensor", "dtype", "shape": [int | shape-variable name]}`` or ``{"name", "kind": "scalar",
    "dtype"}``. ``kernel``: the printed kernel (its ``params`` name tensors by their
    parameter name, scalars by parameter or shape-variable name).
    """

    args: tuple
    kernel: KernelSource
    written: tuple  # names of the tensors the kernel may write

    def to_json(self) -> dict:
        k = self.kernel
        return {
            "args": list(self.args),
            "written": list(self.written),
            "kernel": {"name": k.name, "params": [list(p) for p in k.params],
                       "grid": list(k.grid), "block": list(k.block),
                       "local_mem_bytes": k.local_mem_bytes},
        }


def _make_names_unique(func: tirx.PrimFunc) -> None:
    """Give ``func``'s scalar parameters and shape variables distinct names, in place.

    Lowering keeps Var names but not Var identities, and TileLang's builder names a Var after
    every Python name it is bound to (``IRBuilder.name``), so two distinct variables can
    share a name (decode's two index widths both become ``width``, a macro parameter's
    name). The launcher binds device parameters by name, so names must be unique; renaming
    uses the builder's own mechanism.
    """
    from tvm.script.ir_builder import IRBuilder

    owners: dict = {}
    signature_vars = [v for v in func.params if v not in func.buffer_map]
    for var in func.params:
        buf = func.buffer_map.get(var)
        if buf is not None:
            signature_vars += [x for x in buf.shape if isinstance(x, tirx.Var)]
    for var in signature_vars:
        name = var.name
        if name in owners and not owners[name].same_as(var):
            k = 1
            while f"{name}_{k}" in owners:
                k += 1
            name = f"{name}_{k}"
            IRBuilder.name(name, var)
        owners.setdefault(name, var)


def _signature(func: tirx.PrimFunc) -> tuple:
    """The parameters as described in :class:`SyclProgram` (names unique, see
    :func:`_make_names_unique`)."""
    args = []
    for var in func.params:
        buf = func.buffer_map.get(var)
        if buf is None:
            args.append({"name": var.name, "kind": "scalar", "dtype": str(var.dtype)})
            continue
        # A constant, a shape variable's name, or an expression of shape variables that the
        # launcher checks once every variable is bound (e.g. "(s_q + 1)" for indptr).
        shape = [int(x.value) if isinstance(x, tirx.IntImm) else launch_expr_to_python(x)
                 for x in buf.shape]
        if buf.strides and not _compact(buf):
            raise SyclCodegenError(f"tensor {buf.name}: strided tensors are not supported")
        args.append({"name": buf.data.name, "kind": "tensor", "dtype": str(buf.dtype),
                     "shape": shape})
    return tuple(args)


def _compact(buf) -> bool:
    expected = 1
    for extent, stride in reversed(list(zip(buf.shape, buf.strides))):
        if not tvm.arith.Analyzer().can_prove_equal(stride, expected):
            return False
        expected = expected * extent
    return True


def lower_to_sycl(func: tirx.PrimFunc, name: str) -> SyclProgram:
    """Lower ``func`` (one ``T.Kernel``) and print it as the SYCL kernel ``name``."""
    configs = dict(func.attrs["tilelang_pass_configs"]) if func.attrs and \
        "tilelang_pass_configs" in func.attrs else {}
    configs.update(_SYCL_PASS_CONFIGS)
    _make_names_unique(func)
    context = create_backend_context(_TARGET, target_host="c")
    with tvm.transform.PassContext(opt_level=3, config=configs), tvm.target.Target(_TARGET):
        _, device_mod, _, _, _ = lower_to_host_device_ir(func, context)
        device_mod = _prepare_device_codegen_mod(device_mod)
    kernels = [f for f in device_mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    if len(kernels) != 1:
        raise SyclCodegenError(f"{name}: expected one device kernel, got {len(kernels)}")
    device = kernels[0]
    args = _signature(func)
    readonly = {device.params[int(i)].name
                for i in (device.attrs.get("tl.readonly_param_indices") or [])}
    written = tuple(a["name"] for a in args if a["kind"] == "tensor" and a["name"] not in readonly)
    known = {a["name"] for a in args} | {d for a in args if a["kind"] == "tensor"
                                         for d in a["shape"] if isinstance(d, str)}
    return SyclProgram(args, print_kernel(device, name, known), written)
