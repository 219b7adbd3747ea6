"""Load SPIR-V kernels and launch them on a dpctl queue over USM memory.

A :class:`SyclKernel` is what the loader hands the front ends for the ``sycl`` target: it is
called like a TileLang kernel (the kernel definition's tensors and scalars, in order) and
accepts, per tensor argument:

- arrays already in USM memory: ``dpctl.tensor.usm_ndarray`` or anything with
  ``__sycl_usm_array_interface__``; DLPack producers on a oneAPI device (torch ``xpu``
  tensors) are imported zero-copy with ``dpctl.tensor.from_dlpack``;
- torch CPU tensors: copied into USM device memory on the kernel's queue before the launch
  and, for the arguments the kernel writes, copied back after it. This is how the SYCL
  kernels run from the torch front ends on Intel's SYCL CPU device (tests, CI); it costs a
  copy of every argument per call.

bfloat16 and FP8 data travel as their storage integers (``dpctl.tensor`` has neither type).
Launches are synchronous. Device selection: ``$DSV4_TL_SYCL_DEVICE`` (a dpctl filter string,
e.g. ``opencl:cpu``), else dpctl's default device. Never set ``ONEAPI_DEVICE_SELECTOR`` to
``opencl:*`` (Intel's runtime then fails to initialise its adapters); ``*:cpu`` works.
"""

import ctypes
import functools
import os
import sys
from pathlib import Path

ENV_DEVICE = "DSV4_TL_SYCL_DEVICE"
ENV_PREFIX = "DSV4_TL_SYCL_PREFIX"


class SyclUnavailableError(RuntimeError):
    """No usable SYCL runtime or device in this process."""


def sycl_prefix() -> Path:
    """The install prefix of the intel-sycl-rt / intel-opencl-rt wheels
    (``$DSV4_TL_SYCL_PREFIX``, else this Python's prefix, where pip puts their data)."""
    return Path(os.environ.get(ENV_PREFIX) or sys.prefix)


def _point_opencl_at_prefix() -> None:
    # The intel-opencl-rt wheel registers its CPU driver through an .icd file under
    # <prefix>/etc/OpenCL/vendors (scripts/setup_sycl.sh rewrites the wheel's placeholder path
    # in it); the OpenCL ICD loader reads OCL_ICD_VENDORS when the runtime first starts.
    vendors = sycl_prefix() / "etc" / "OpenCL" / "vendors"
    if vendors.is_dir():
        os.environ.setdefault("OCL_ICD_VENDORS", str(vendors))


def dpctl_module():
    """``dpctl``, imported after the OpenCL driver path is set."""
    _point_opencl_at_prefix()
    try:
        import dpctl
        import dpctl.memory  # noqa: F401
        import dpctl.program  # noqa: F401
    except ImportError as exc:
        raise SyclUnavailableError(
            "the sycl target needs dpctl and Intel's SYCL/OpenCL runtimes: run "
            "scripts/setup_sycl.sh") from exc
    return dpctl


@functools.lru_cache(maxsize=None)
def sycl_queue():
    """The process's SYCL queue (one per process, on ``$DSV4_TL_SYCL_DEVICE`` or the default
    device); raises SyclUnavailableError naming the fix when there is no device."""
    dpctl = dpctl_module()
    selector = os.environ.get(ENV_DEVICE, "")
    try:
        return dpctl.SyclQueue(selector) if selector else dpctl.SyclQueue()
    except Exception as exc:
        raise SyclUnavailableError(
            f"no SYCL device for {ENV_DEVICE}={selector!r} ({exc}); available: "
            f"{[str(d) for d in dpctl.get_devices()]}; scripts/setup_sycl.sh sets up Intel's "
            "OpenCL CPU device") from exc


# TileLang dtype -> (storage typestr accepted from USM arrays, torch dtype name, ctypes scalar)
_STORAGE = {
    "bool": ("|b1", "bool"), "int8": ("|i1", "int8"), "uint8": ("|u1", "uint8"),
    "int16": ("<i2", "int16"), "int32": ("<i4", "int32"), "int64": ("<i8", "int64"),
    "float32": ("<f4", "float32"), "bfloat16": ("<u2", "bfloat16"),
    "float8_e4m3fn": ("|u1", "float8_e4m3fn"), "float8_e4m3fnuz": ("|u1", "float8_e4m3fnuz"),
}
_ITEMSIZE = {"|b1": 1, "|i1": 1, "|u1": 1, "<i2": 2, "<u2": 2, "<i4": 4, "<i8": 8, "<f4": 4}
_SCALAR = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "float32": ctypes.c_float}
_EVAL_NAMES = {"min": min, "max": max, "__builtins__": {}}


def _compile_expr(text: str):
    return compile(text, "<launch extent>", "eval")


class _Staged:
    """One tensor argument as the kernel sees it (USM memory) and how to return results."""

    __slots__ = ("usm", "shape", "host", "nbytes")

    def __init__(self, usm, shape, host=None, nbytes=0):
        self.usm, self.shape, self.host, self.nbytes = usm, shape, host, nbytes


class SyclKernel:
    """A SPIR-V kernel built by ``dsv4-tl build --target sycl`` (or JIT), ready to launch.

    ``program``: the launch description written next to the SPIR-V
    (:meth:`dsv4_tl.sycl.lower.SyclProgram.to_json`); ``spirv``: the module bytes.
    """

    def __init__(self, program: dict, spirv: bytes, queue=None):
        dpctl = dpctl_module()
        self.queue = queue if queue is not None else sycl_queue()
        self.program = program
        meta = program["kernel"]
        module = dpctl.program.create_program_from_spirv(self.queue, spirv)
        # sycl-jit names a free-function kernel's SPIR-V entry point __sycl_kernel_<name>.
        entry = next((n for n in (f"__sycl_kernel_{meta['name']}", meta["name"])
                      if module.has_sycl_kernel(n)), None)
        if entry is None:
            raise RuntimeError(f"SPIR-V module has no kernel {meta['name']!r}")
        self._kernel = module.get_sycl_kernel(entry)
        self._args = program["args"]
        self._params = [tuple(p) for p in meta["params"]]
        self._written = set(program.get("written", [a["name"] for a in self._args]))
        self._grid = [_compile_expr(x) for x in meta["grid"]]
        self._block = [int(x) for x in meta["block"]]
        self._shape_exprs = {}
        for a in self._args:
            if a["kind"] == "tensor":
                for d in a["shape"]:
                    if isinstance(d, str) and not d.isidentifier():
                        self._shape_exprs[d] = _compile_expr(d)

    @property
    def name(self) -> str:
        return self.program["kernel"]["name"]

    # --- argument conversion -----------------------------------------------------------
    def _tensor(self, spec: dict, x):
        dpctl = dpctl_module()
        name, dtype = spec["name"], spec["dtype"]
        typestr, torch_name = _STORAGE[dtype]
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            if str(x.dtype) != f"torch.{torch_name}":
                raise ValueError(f"{name}: expected dtype {torch_name}, got {x.dtype}")
            if not x.is_contiguous():
                raise ValueError(f"{name}: the SYCL kernels take contiguous tensors")
            if x.device.type == "cpu":
                nbytes = x.numel() * x.element_size()
                usm = dpctl.memory.MemoryUSMDevice(max(nbytes, 1), queue=self.queue)
                if nbytes:
                    host = x.reshape(-1).view(torch.uint8).numpy()
                    self.queue.memcpy(usm, host, nbytes)
                return _Staged(usm, tuple(x.shape), x, nbytes)
            if x.device.type == "xpu":  # torch's SYCL device: its data is USM already
                return _Staged(self._usm(x.data_ptr(), x.numel() * x.element_size()),
                               tuple(x.shape))
            raise ValueError(f"{name}: expected a CPU or XPU tensor for the sycl target, got "
                             f"device {x.device}")
        iface = getattr(x, "__sycl_usm_array_interface__", None)
        if iface is None and hasattr(x, "__dlpack_device__"):
            if x.__dlpack_device__()[0] != _DLPACK_ONEAPI or torch is None:
                raise ValueError(f"{name}: a DLPack tensor on device {x.__dlpack_device__()} "
                                 "is not in USM memory (expected a oneAPI device)")
            return self._tensor(spec, torch.from_dlpack(x))
        if iface is None:
            raise ValueError(f"{name}: expected a torch tensor, a USM array or a oneAPI DLPack "
                             f"tensor, got {type(x).__name__}")
        got = iface["typestr"]
        if _ITEMSIZE.get(got) != _ITEMSIZE[typestr] or got[1] not in "biuf":
            raise ValueError(f"{name}: expected {dtype} data ({typestr} storage), got {got}")
        if iface.get("strides") not in (None, ()) and not _is_c_contiguous(iface):
            raise ValueError(f"{name}: the SYCL kernels take contiguous arrays")
        shape = tuple(iface["shape"])
        count = 1
        for n in shape:
            count *= n
        ptr = iface["data"][0] + iface.get("offset", 0) * _ITEMSIZE[got]
        return _Staged(self._usm(ptr, count * _ITEMSIZE[got]), shape)

    def _usm(self, ptr: int, nbytes: int):
        """A dpctl memory object over existing USM memory (no copy)."""
        return dpctl_module().memory.as_usm_memory(_UsmBytes(ptr, nbytes, self.queue))

    def _bind_shapes(self, spec: dict, shape: tuple, env: dict) -> None:
        want = spec["shape"]
        name = spec["name"]
        if len(shape) != len(want):
            raise ValueError(f"{name}: expected {len(want)} dims, got shape {list(shape)}")
        for dim, (got, w) in enumerate(zip(shape, want)):
            if isinstance(w, int):
                if got != w:
                    raise ValueError(f"{name}: dim {dim} must be {w}, got shape {list(shape)}")
            elif w.isidentifier():
                if env.setdefault(w, got) != got:
                    raise ValueError(f"{name}: dim {dim} is {got} but {w} = {env[w]} elsewhere")

    def __call__(self, *args) -> None:
        if len(args) != len(self._args):
            raise TypeError(f"{self.name}: expected {len(self._args)} arguments, got {len(args)}")
        env: dict = {}
        staged: dict = {}
        for spec, x in zip(self._args, args):
            if spec["kind"] == "tensor":
                s = self._tensor(spec, x)
                self._bind_shapes(spec, s.shape, env)
                staged[spec["name"]] = s
            else:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ValueError(f"{spec['name']}: expected a number, got {type(x).__name__}")
                env[spec["name"]] = x
        for spec in self._args:  # derived dims (e.g. indptr's s_q + 1), now that all are bound
            if spec["kind"] == "tensor":
                for dim, w in enumerate(spec["shape"]):
                    if isinstance(w, str) and w in self._shape_exprs:
                        want = eval(self._shape_exprs[w], _EVAL_NAMES, dict(env))
                        if staged[spec["name"]].shape[dim] != want:
                            raise ValueError(f"{spec['name']}: dim {dim} must be {w} = {want}, "
                                             f"got shape {list(staged[spec['name']].shape)}")
        grid = [int(eval(g, _EVAL_NAMES, dict(env))) for g in self._grid]
        kargs = []
        for name, kind, dtype in self._params:
            if kind == "pointer":
                kargs.append(staged[name].usm)
            else:
                kargs.append(_SCALAR[dtype](env[name]))
        if min(grid) > 0:
            bx, by, bz = self._block
            gx, gy, gz = grid
            self.queue.submit(self._kernel, kargs, [gz * bz, gy * by, gx * bx],
                              [bz, by, bx]).wait()
        for name, s in staged.items():
            if s.host is not None and s.nbytes and name in self._written:
                self.queue.memcpy(s.host.reshape(-1).view(_torch().uint8).numpy(), s.usm,
                                  s.nbytes)


_DLPACK_ONEAPI = 14  # DLDeviceType kDLOneAPI


class _UsmBytes:
    """``nbytes`` of USM memory at ``ptr``, described by the SYCL USM array interface."""

    def __init__(self, ptr: int, nbytes: int, queue):
        self.__sycl_usm_array_interface__ = {
            "data": (ptr, False), "shape": (max(nbytes, 1),), "strides": None,
            "typestr": "|u1", "version": 1, "syclobj": queue}


def _torch():
    import torch

    return torch


def _is_c_contiguous(iface: dict) -> bool:
    shape, strides = iface["shape"], iface["strides"]
    expected = 1
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True
