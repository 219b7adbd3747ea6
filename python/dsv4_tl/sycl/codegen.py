"""SYCL C++ from TileLang's lowered device IR.

TileLang 0.1.15 has no SYCL backend. Its ``webgpu`` pass pipeline is a generic SIMT lowering:
it leaves one device ``PrimFunc`` per kernel with flattened buffers, explicit thread/block
bindings, merged shared memory and ``tvm_storage_sync`` barriers. This module prints that
function as a SYCL 2020 *free-function kernel* (``sycl_ext_oneapi_free_function_kernels``),
which Intel's runtime compiler (sycl-jit) turns into SPIR-V (``dsv4_tl.sycl.jit``).

Mapping:
- ``blockIdx.{x,y,z}`` / ``threadIdx.{x,y,z}`` -> ``nd_item<3>`` group / local ids of
  dimensions 2, 1, 0 (SYCL's fastest dimension is the last one).
- Buffers of scope ``shared`` *and* ``shared.dyn`` -> ``work_group_static`` arrays declared at
  kernel scope (TVM's OpenCL printer ignores ``shared.dyn`` and silently makes such memory
  private; this printer treats both scopes alike and refuses any other non-local scope).
- ``tvm_storage_sync`` -> ``sycl::group_barrier`` on the work-group.
- bfloat16 is ``uint16_t`` storage with exact round-to-nearest-even conversions written here
  (the runtime's bfloat16 class links a device library whose image sycl-jit cannot export);
  FP8 values are ``uint8_t`` storage decoded exactly (OCP e4m3fn and FNUZ e4m3fnuz).

Anything the printer does not know raises ``SyclCodegenError`` naming the node: an
unsupported construct must fail the build, never print wrong code.
"""

import math
import struct
from dataclasses import dataclass

from tilelang import tvm
from tvm import tirx

__all__ = ["SyclCodegenError", "KernelSource", "print_kernel", "launch_expr_to_python"]


class SyclCodegenError(RuntimeError):
    """The device IR holds something this printer cannot express."""


_SCALAR_TYPES = {
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "float32": "float",
    "float64": "double",
    "bfloat16": "uint16_t",      # storage; see the module docstring
    "float8_e4m3fn": "uint8_t",  # storage
    "float8_e4m3fnuz": "uint8_t",
}
_FP8 = {"float8_e4m3fn": "dsv4_fp8_e4m3fn_to_float", "float8_e4m3fnuz": "dsv4_fp8_e4m3fnuz_to_float"}

_THREAD_TAGS = {
    "blockIdx.x": "it.get_group(2)", "blockIdx.y": "it.get_group(1)", "blockIdx.z": "it.get_group(0)",
    "threadIdx.x": "it.get_local_id(2)", "threadIdx.y": "it.get_local_id(1)",
    "threadIdx.z": "it.get_local_id(0)",
}

_PRELUDE = r"""#include <sycl/sycl.hpp>
#include <cstdint>

namespace syclexp = sycl::ext::oneapi::experimental;

// bfloat16 <-> float, exact: round to nearest even, NaN kept quiet.
static inline float dsv4_bf16_to_float(uint16_t v) {
  return sycl::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}
static inline uint16_t dsv4_float_to_bf16(float f) {
  uint32_t u = sycl::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// FP8 e4m3 bytes -> float, exact. OCP e4m3fn: bias 7, S.1111.111 NaN. FNUZ: bias 8, 0x80 NaN.
static inline float dsv4_fp8_decode(uint8_t byte, int bias, bool fnuz) {
  int e = (byte >> 3) & 15, m = byte & 7;
  bool nan = fnuz ? byte == 0x80 : (byte & 0x7f) == 0x7f;
  if (nan) return sycl::bit_cast<float>(0x7fc00000u);
  float mag = e == 0 ? static_cast<float>(m) * sycl::bit_cast<float>(static_cast<uint32_t>(127 - bias - 2) << 23)
                     : sycl::bit_cast<float>(static_cast<uint32_t>(((e + 127 - bias) << 23) | (m << 20)));
  return (byte & 0x80) ? -mag : mag;
}
static inline float dsv4_fp8_e4m3fn_to_float(uint8_t b) { return dsv4_fp8_decode(b, 7, false); }
static inline float dsv4_fp8_e4m3fnuz_to_float(uint8_t b) { return dsv4_fp8_decode(b, 8, true); }
template <typename T> static inline T dsv4_min(T a, T b) { return b < a ? b : a; }
template <typename T> static inline T dsv4_max(T a, T b) { return a < b ? b : a; }
static inline float dsv4_min(float a, float b) { return sycl::fmin(a, b); }
static inline float dsv4_max(float a, float b) { return sycl::fmax(a, b); }
template <typename T> static inline T dsv4_floordiv(T a, T b) {
  T q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename T> static inline T dsv4_floormod(T a, T b) { return a - dsv4_floordiv(a, b) * b; }
"""


@dataclass(frozen=True)
class KernelSource:
    """One printed kernel.

    ``params``: the device function's parameters in order, ``(name, kind, dtype)`` with kind
    ``"pointer"`` (dtype = element type) or ``"scalar"``. ``grid`` / ``block``: launch extents
    (x, y, z) as Python expressions over scalar names (``launch_expr_to_python``).
    ``local_mem_bytes``: work-group memory the kernel declares.
    """

    name: str
    source: str
    params: tuple
    grid: tuple
    block: tuple
    local_mem_bytes: int


def _ctype(dtype) -> str:
    dt = str(dtype)
    if dt not in _SCALAR_TYPES:
        raise SyclCodegenError(f"dtype {dt} has no SYCL mapping")
    return _SCALAR_TYPES[dt]


def _float_literal(value: float, dtype: str) -> str:
    if dtype == "bfloat16":
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        if math.isnan(value):
            return "static_cast<uint16_t>(0x7fc0)"
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return f"static_cast<uint16_t>({bits:#06x})"
    if dtype not in ("float32", "float64"):
        raise SyclCodegenError(f"float literal of dtype {dtype}")
    suffix = "f" if dtype == "float32" else ""
    if math.isinf(value):
        inf = "sycl::bit_cast<float>(0x7f800000u)" if dtype == "float32" else "(double)INFINITY"
        return inf if value > 0 else f"(-{inf})"
    if math.isnan(value):
        return "sycl::bit_cast<float>(0x7fc00000u)"
    return f"{value!r}{suffix}" if "e" in repr(value) or "." in repr(value) else f"{value!r}.0{suffix}"


_BINARY = {
    tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.Div: "/", tirx.Mod: "%",
    tirx.EQ: "==", tirx.NE: "!=", tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=",
    tirx.And: "&&", tirx.Or: "||",
}
_MATH_CALLS = {
    "tirx.exp": "sycl::exp", "tirx.exp2": "sycl::exp2", "tirx.log": "sycl::log",
    "tirx.log2": "sycl::log2", "tirx.sqrt": "sycl::sqrt", "tirx.rsqrt": "sycl::rsqrt",
    "tirx.fabs": "sycl::fabs", "tirx.floor": "sycl::floor", "tirx.ceil": "sycl::ceil",
    "tirx.tanh": "sycl::tanh", "tirx.pow": "sycl::pow", "tirx.isnan": "sycl::isnan",
    "tirx.isinf": "sycl::isinf", "tirx.isfinite": "sycl::isfinite",
}
# C math names TVM's intrinsic lowering leaves as extern calls (float32 only).
_EXTERN_CALLS = {
    "exp2": "sycl::exp2", "exp2f": "sycl::exp2", "exp": "sycl::exp", "expf": "sycl::exp",
    "log": "sycl::log", "logf": "sycl::log", "log2": "sycl::log2", "log2f": "sycl::log2",
    "fma": "sycl::fma", "fmaf": "sycl::fma", "fabs": "sycl::fabs", "fabsf": "sycl::fabs",
    "sqrt": "sycl::sqrt", "sqrtf": "sycl::sqrt", "fmaxf": "sycl::fmax", "fminf": "sycl::fmin",
}
_BIT_CALLS = {
    "tirx.shift_right": ">>", "tirx.shift_left": "<<", "tirx.bitwise_and": "&",
    "tirx.bitwise_or": "|", "tirx.bitwise_xor": "^",
}


class _Printer:
    def __init__(self, func: tirx.PrimFunc):
        self.func = func
        self.names: dict = {}          # Var -> C name
        self.used: set = set()
        self.lines: list = []
        self.indent = 1
        self.shared_decls: list = []   # kernel-scope work_group_static declarations
        self.local_mem_bytes = 0
        self.pointer_dtype: dict = {}  # data Var -> element dtype of the C pointer
        # Barrier safety: Vars whose value can differ between the work-items of a group, and
        # how many enclosing branches / loops depend on such values.
        self.varying: set = set()
        self.divergent = 0

    # --- names -------------------------------------------------------------------------
    def name(self, var) -> str:
        if var in self.names:
            return self.names[var]
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in var.name) or "v"
        if base[0].isdigit():
            base = "v" + base
        cand, k = base, 0
        while cand in self.used or cand in ("it", "int", "float", "bool", "char", "long", "short"):
            k += 1
            cand = f"{base}_{k}"
        self.used.add(cand)
        self.names[var] = cand
        return cand

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.indent + line)

    # --- expressions -------------------------------------------------------------------
    def expr(self, e) -> str:
        if isinstance(e, tirx.IntImm):
            dt = str(e.dtype)
            if dt == "bool":
                return "true" if e.value else "false"
            if dt == "int64":
                return f"int64_t({e.value})"
            if dt == "int32":
                return f"{e.value}" if e.value != -(2**31) else "(-2147483647 - 1)"
            return f"{_ctype(dt)}({e.value})"
        if isinstance(e, tirx.FloatImm):
            return _float_literal(e.value, str(e.dtype))
        if isinstance(e, tirx.Var):
            if e not in self.names:
                raise SyclCodegenError(f"variable {e.name} used before its definition")
            return self.names[e]
        for cls, op in _BINARY.items():
            if isinstance(e, cls):
                self._no_bf16_arith(e)
                return f"({self.expr(e.a)} {op} {self.expr(e.b)})"
        if isinstance(e, tirx.Not):
            return f"(!{self.expr(e.a)})"
        if isinstance(e, (tirx.Min, tirx.Max)):
            self._no_bf16_arith(e)
            fn = "dsv4_min" if isinstance(e, tirx.Min) else "dsv4_max"
            ct = _ctype(e.dtype)
            return f"{fn}<{ct}>({self.expr(e.a)}, {self.expr(e.b)})" if ct != "float" else \
                f"{fn}({self.expr(e.a)}, {self.expr(e.b)})"
        if isinstance(e, (tirx.FloorDiv, tirx.FloorMod)):
            fn = "dsv4_floordiv" if isinstance(e, tirx.FloorDiv) else "dsv4_floormod"
            return f"{fn}<{_ctype(e.dtype)}>({self.expr(e.a)}, {self.expr(e.b)})"
        if isinstance(e, tirx.Select):
            return f"({self.expr(e.condition)} ? {self.expr(e.true_value)} : {self.expr(e.false_value)})"
        if isinstance(e, tirx.Cast):
            return self.cast(e.value, str(e.dtype))
        if isinstance(e, tirx.BufferLoad):
            return self.load(e)
        if isinstance(e, tirx.Let):
            ct = _ctype(e.var.dtype)
            v = self.name(e.var)
            return f"([&]() {{ const {ct} {v} = {self.expr(e.value)}; return {self.expr(e.body)}; }}())"
        if isinstance(e, tirx.Call):
            return self.call(e)
        raise SyclCodegenError(f"expression {type(e).__name__} is not supported: {e}")

    @staticmethod
    def _no_bf16_arith(e) -> None:
        if str(e.dtype) == "bfloat16" or str(e.dtype).startswith("float8"):
            raise SyclCodegenError(f"arithmetic on {e.dtype} values (cast to float32 first): {e}")

    def cast(self, value, dst: str) -> str:
        src = str(value.dtype)
        inner = self.expr(value)
        if src == dst:
            return inner
        if src in _FP8:
            inner, src = f"{_FP8[src]}({inner})", "float32"
            if dst == "float32":
                return inner
        if src == "bfloat16":
            inner, src = f"dsv4_bf16_to_float({inner})", "float32"
            if dst == "float32":
                return inner
        if dst == "bfloat16":
            return f"dsv4_float_to_bf16(static_cast<float>({inner}))"
        if dst in _FP8:
            raise SyclCodegenError("casts to FP8 are not supported (the kernels only read FP8)")
        return f"static_cast<{_ctype(dst)}>({inner})"

    def pointer(self, buf) -> str:
        """C expression of ``buf``'s base pointer typed as its dtype."""
        data = buf.data
        base = self.expr(data)
        have = self.pointer_dtype.get(data)
        want = str(buf.dtype)
        if have is None:
            raise SyclCodegenError(f"buffer {buf.name}: storage {data.name} has no pointer")
        if _ctype(have) == _ctype(want):
            return base
        return f"reinterpret_cast<{_ctype(want)}*>({base})"

    def index(self, buf, indices) -> str:
        if len(indices) != 1:
            raise SyclCodegenError(f"buffer {buf.name} is not flattened ({len(indices)} indices)")
        idx = indices[0]
        if isinstance(idx, (tirx.Ramp, tirx.Broadcast)) or idx.dtype.lanes != 1:
            raise SyclCodegenError(f"vector access to {buf.name} (lower with vectorisation off)")
        return self.expr(idx)

    def load(self, e) -> str:
        if e.dtype.lanes != 1:
            raise SyclCodegenError(f"vector load from {e.buffer.name}")
        return f"{self.pointer(e.buffer)}[{self.index(e.buffer, e.indices)}]"

    def call(self, e) -> str:
        op = e.op.name if hasattr(e.op, "name") else str(e.op)
        args = e.args
        if op == "tirx.if_then_else":
            return f"({self.expr(args[0])} ? {self.expr(args[1])} : {self.expr(args[2])})"
        if op in _MATH_CALLS:
            if str(e.dtype) not in ("float32", "float64", "bool"):
                raise SyclCodegenError(f"{op} on {e.dtype}")
            return f"{_MATH_CALLS[op]}({', '.join(self.expr(a) for a in args)})"
        if op in _BIT_CALLS:
            return f"({self.expr(args[0])} {_BIT_CALLS[op]} {self.expr(args[1])})"
        if op == "tirx.bitwise_not":
            return f"(~{self.expr(args[0])})"
        if op == "tirx.reinterpret":
            return f"sycl::bit_cast<{_ctype(e.dtype)}>({self.expr(args[0])})"
        if op in ("tirx.call_pure_extern", "tirx.call_extern"):
            fn = args[0].value
            if fn not in _EXTERN_CALLS or str(e.dtype) != "float32":
                raise SyclCodegenError(f"extern call {fn} ({e.dtype}) is not supported")
            return f"{_EXTERN_CALLS[fn]}({', '.join(self.expr(a) for a in args[1:])})"
        if op == "tirx.likely":
            return self.expr(args[0])
        if op == "tirx.infinity" or op == "tl.infinity":
            return _float_literal(math.inf, str(e.dtype))
        raise SyclCodegenError(f"call {op} is not supported: {e}")

    def is_varying(self, e) -> bool:
        """Whether ``e`` may differ between work-items: it reads a thread id, a
        thread-dependent variable, or private memory (a load from shared or global memory
        at a uniform address is uniform)."""
        found = []

        def visit(x):
            if isinstance(x, tirx.Var) and x in self.varying:
                found.append(x)
            elif isinstance(x, tirx.BufferLoad) and x.buffer.scope() not in (
                    "global", "shared", "shared.dyn"):
                found.append(x)

        tvm.tirx.stmt_functor.post_order_visit(tirx.Evaluate(e) if not isinstance(e, tirx.Stmt) else e, visit)
        return bool(found)

    # --- statements --------------------------------------------------------------------
    def stmt(self, s) -> None:
        if isinstance(s, tirx.SeqStmt):
            for x in s.seq:
                self.stmt(x)
        elif isinstance(s, tirx.Bind):
            ct = _ctype(s.var.dtype) if s.var.dtype != "handle" else None
            if ct is None:
                raise SyclCodegenError(f"handle binding {s.var.name}")
            if self.is_varying(s.value):
                self.varying.add(s.var)
            if s.var in self.names:
                self.emit(f"{self.names[s.var]} = {self.expr(s.value)};")
            else:
                value = self.expr(s.value)
                self.emit(f"{ct} {self.name(s.var)} = {value};")
        elif isinstance(s, tirx.AttrStmt):
            self.attr(s)
        elif isinstance(s, tirx.For):
            self.loop(s)
        elif isinstance(s, tirx.While):
            self.emit(f"while ({_unparen(self.expr(s.condition))}) {{")
            self.block(s.body, self.is_varying(s.condition))
            self.emit("}")
        elif isinstance(s, tirx.IfThenElse):
            varying = self.is_varying(s.condition)
            self.emit(f"if ({_unparen(self.expr(s.condition))}) {{")
            self.block(s.then_case, varying)
            if s.else_case is not None:
                self.emit("} else {")
                self.block(s.else_case, varying)
            self.emit("}")
        elif isinstance(s, tirx.BufferStore):
            if s.value.dtype.lanes != 1 or (s.predicate is not None):
                raise SyclCodegenError(f"vector or predicated store to {s.buffer.name}")
            self.emit(f"{self.pointer(s.buffer)}[{self.index(s.buffer, s.indices)}] = "
                      f"{self.expr(s.value)};")
        elif isinstance(s, tirx.AllocBuffer):
            self.alloc(s.buffer)
        elif isinstance(s, tirx.DeclBuffer):
            pass  # views of storage that already has a pointer; loads cast as needed
        elif isinstance(s, tirx.Evaluate):
            self.evaluate(s.value)
        elif isinstance(s, tirx.AssertStmt):
            pass  # host-side checks; the device cannot report them
        else:
            raise SyclCodegenError(f"statement {type(s).__name__} is not supported")

    def block(self, body, divergent: bool = False) -> None:
        self.indent += 1
        self.divergent += divergent
        self.stmt(body)
        self.divergent -= divergent
        self.indent -= 1

    def alloc(self, buf) -> None:
        scope = buf.scope()
        n = 1
        for extent in buf.shape:
            if not isinstance(extent, tirx.IntImm):
                raise SyclCodegenError(f"buffer {buf.name} has a dynamic size")
            n *= int(extent)
        ct = _ctype(buf.dtype)
        name = self.name(buf.data)
        self.pointer_dtype[buf.data] = str(buf.dtype)
        if scope in ("shared", "shared.dyn"):
            # Kernel-scope declaration; 16-byte aligned so every typed view of a merged
            # allocation is aligned.
            words = max(1, (n * buf.dtype.bits // 8 + 15) // 16)
            self.shared_decls.append(
                f"static syclexp::work_group_static<sycl::uint4[{words}]> {name}_storage;")
            self.shared_decls.append(
                f"{ct}* {name} = reinterpret_cast<{ct}*>(&{name}_storage[0]);")
            self.local_mem_bytes += words * 16
        elif scope in ("local", "local.var", "local.fragment"):
            self.emit(f"{ct} {name}[{n}];")
        else:
            raise SyclCodegenError(f"buffer {buf.name}: memory scope {scope!r} is not supported")

    def attr(self, s) -> None:
        if s.attr_key == "thread_extent":
            iv = s.node
            tag = iv.thread_tag
            if tag not in _THREAD_TAGS:
                raise SyclCodegenError(f"thread binding {tag}")
            self.emit(f"const int32_t {self.name(iv.var)} = static_cast<int32_t>({_THREAD_TAGS[tag]});")
            if tag.startswith("threadIdx"):
                self.varying.add(iv.var)
            self.stmt(s.body)
        else:
            self.stmt(s.body)  # pragmas and scope markers carry no semantics for SYCL

    def loop(self, s) -> None:
        if s.kind not in (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED):
            raise SyclCodegenError(f"loop kind {s.kind} over {s.loop_var.name}")
        ct = _ctype(s.loop_var.dtype)
        v = self.name(s.loop_var)
        lo = self.expr(s.min)
        hi = f"{lo} + {self.expr(s.extent)}" if not _is_zero(s.min) else self.expr(s.extent)
        step = "1" if s.step is None else self.expr(s.step)
        varying = self.is_varying(s.min) or self.is_varying(s.extent)
        if varying:
            self.varying.add(s.loop_var)
        if s.kind == tirx.ForKind.UNROLLED:
            self.emit("#pragma unroll")
        self.emit(f"for ({ct} {v} = {lo}; {v} < {hi}; {v} += {step}) {{")
        self.block(s.body, varying)
        self.emit("}")

    def evaluate(self, e) -> None:
        if isinstance(e, tirx.Call):
            op = e.op.name if hasattr(e.op, "name") else str(e.op)
            if op == "tirx.tvm_storage_sync":
                scope = e.args[0].value
                if scope not in ("shared", "shared.dyn", "warp"):
                    raise SyclCodegenError(f"storage sync of scope {scope}")
                if self.divergent:
                    # Not every work-item would reach it: a hang or wrong results.
                    context = "\n".join(self.lines[-12:])
                    raise SyclCodegenError("work-group barrier inside a thread-dependent branch "
                                           "or loop (put an explicit T.sync_threads() where all "
                                           "threads are, see tile_kernels/tile_math.py); code "
                                           f"before it:\n{context}")
                self.emit("sycl::group_barrier(it.get_group());")
                return
        if isinstance(e, tirx.IntImm):
            return
        self.emit(f"(void)({self.expr(e)});")


def _unparen(text: str) -> str:
    """``(a == b)`` -> ``a == b`` when the outer parentheses enclose the whole expression
    (clang warns about ``if ((a == b))``)."""
    if not (text.startswith("(") and text.endswith(")")):
        return text
    depth = 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if depth == 0 and i < len(text) - 1:
            return text
    return text[1:-1]


def _is_zero(e) -> bool:
    return isinstance(e, tirx.IntImm) and e.value == 0


def print_kernel(func: tirx.PrimFunc, name: str, host_names: set) -> KernelSource:
    """Print one lowered device ``PrimFunc`` as a SYCL free-function kernel named ``name``.

    ``host_names``: the names a launcher can bind (tensor and scalar parameters, shape
    variables); every device parameter must be one of them.
    """
    p = _Printer(func)
    params = []
    sig = []
    non_restrict = {str(x) for x in func.attrs.get("tl.non_restrict_params", [])} if func.attrs else set()
    for var in func.params:
        cname = p.name(var)
        if var.name not in host_names:
            raise SyclCodegenError(f"device parameter {var.name} has no host-side binding")
        if str(var.dtype) == "handle":
            elem = var.type_annotation.element_type.dtype
            p.pointer_dtype[var] = str(elem)
            restrict = "" if var.name in non_restrict else " __restrict__"
            sig.append(f"{_ctype(elem)}*{restrict} {cname}")
            params.append((var.name, "pointer", str(elem)))
        else:
            sig.append(f"{_ctype(var.dtype)} {cname}")
            params.append((var.name, "scalar", str(var.dtype)))
    p.stmt(func.body)
    extents = dict(func.attrs["thread_extent"])
    to_py = lambda key: launch_expr_to_python(extents[key]) if key in extents else "1"  # noqa: E731
    grid = tuple(to_py(f"blockIdx.{a}") for a in "xyz")
    block = tuple(to_py(f"threadIdx.{a}") for a in "xyz")
    body = "\n".join(["  auto it = sycl::ext::oneapi::this_work_item::get_nd_item<3>();"]
                     + ["  " + d for d in p.shared_decls] + p.lines)
    source = (_PRELUDE
              + f'\nextern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<3>))\n'
              + f"void {name}({', '.join(sig)}) {{\n{body}\n}}\n")
    return KernelSource(name, source, tuple(params), grid, block, p.local_mem_bytes)


_PY_BINARY = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*"}


def launch_expr_to_python(e) -> str:
    """A launch extent as a Python expression over the kernel's scalar parameters.

    Launch extents only use integer arithmetic on shape variables; anything else raises.
    """
    if isinstance(e, int):
        return str(e)
    if isinstance(e, tirx.IntImm):
        return str(int(e.value))
    if isinstance(e, tirx.Var):
        return e.name
    for cls, op in _PY_BINARY.items():
        if isinstance(e, cls):
            return f"({launch_expr_to_python(e.a)} {op} {launch_expr_to_python(e.b)})"
    if isinstance(e, tirx.FloorDiv):
        return f"({launch_expr_to_python(e.a)} // {launch_expr_to_python(e.b)})"
    if isinstance(e, tirx.FloorMod):
        return f"({launch_expr_to_python(e.a)} % {launch_expr_to_python(e.b)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        fn = "min" if isinstance(e, tirx.Min) else "max"
        return f"{fn}({launch_expr_to_python(e.a)}, {launch_expr_to_python(e.b)})"
    if isinstance(e, tirx.Cast):
        return launch_expr_to_python(e.value)
    raise SyclCodegenError(f"launch extent {e} is not integer arithmetic on shape variables")
