"""Inspect HIP (AMDGPU) kernel artifacts: code objects, registers, LDS, spills, MFMA use.

A HIP build (``dsv4-tl build --target hip:gfx942``) produces tvm-ffi shared libraries whose
read-only data embeds the device code object(s) (an AMDGPU ELF, ``e_machine`` 0xE0) in the
serialised ``hip`` module (format ``hsaco``, with a function table naming each kernel and its
launch parameters). This module finds those code objects and reports per kernel:

* arch and target triple (``amdgcn-amd-amdhsa--gfx942``), kernel symbols;
* VGPRs (architectural), AGPRs, SGPRs, scratch (private segment) bytes, VGPR/SGPR spills
  and dynamic-stack use -- from the AMDGPU metadata note (``llvm-readelf --notes``) and the
  kernel descriptor (``.amdhsa_accum_offset``);
* LDS bytes: the static group segment from the metadata **plus** the dynamic LDS. TileLang
  merges every ``T.alloc_shared`` buffer into one dynamic (``extern __shared__``) buffer whose
  size is a launch parameter, so the metadata's ``group_segment_fixed_size`` alone is far too
  small. The dynamic size is read from the library's host stub (see
  :func:`host_dynamic_lds`), or passed in, or computed exactly by lowering the variant
  (:func:`lowered_dynamic_lds`);
* the MFMA instructions (``llvm-objdump --mcpu=<arch> -d``, ``v_mfma*``/``v_smfmac*``);
* occupancy in waves per SIMD from the register and LDS use (:func:`occupancy`).

Nothing here runs a kernel: these are compile-time facts only (no AMD GPU is needed).

Command line: ``python -m dsv4_tl.hip.resources lib.so [...]`` prints the resource table.
"""

import dataclasses
import math
import os
import re
import shutil
import struct
import subprocess
from collections import Counter
from pathlib import Path
from typing import Optional

from .backend import ARCH_LIMITS

EM_AMDGPU = 0xE0
ELF_MAGIC = b"\x7fELF"
DYN_SHARED_TAG = "tirx.use_dyn_shared_memory"

# AMDGPU ``e_flags`` EF_AMDGPU_MACH values (llvm/BinaryFormat/ELF.h) of the archs we build.
_MACH = {0x04C: "gfx942", 0x04F: "gfx950", 0x040: "gfx940", 0x041: "gfx941", 0x03F: "gfx90a"}


@dataclasses.dataclass
class KernelResources:
    """Compile-time resource use of one kernel of a code object."""

    name: str
    symbol: str
    arch: str
    triple: str
    vgpr: int  # architectural VGPRs (accum_offset when AGPRs are used)
    agpr: int
    vgpr_total: int  # unified VGPRs of a wave (metadata .vgpr_count = vgpr + agpr on gfx90a+)
    sgpr: int
    vgpr_spill: int
    sgpr_spill: int
    scratch_bytes: int  # private segment bytes per work-item
    uses_dynamic_stack: bool
    lds_static: int  # metadata .group_segment_fixed_size
    lds_dynamic: Optional[int]  # None: unknown
    max_threads: int
    wavefront_size: int
    mfma: int = 0  # MFMA / SMFMAC instructions in the kernel's code
    mfma_ops: dict = dataclasses.field(default_factory=dict)
    fp8_cvt: int = 0  # hardware fp8/bf8 -> f32 conversions (FNUZ on gfx942, OCP on gfx950)

    @property
    def lds_total(self) -> Optional[int]:
        return None if self.lds_dynamic is None else self.lds_static + self.lds_dynamic

    @property
    def spills(self) -> int:
        return self.vgpr_spill + self.sgpr_spill

    def occupancy(self) -> Optional[float]:
        """Waves per SIMD (see :func:`occupancy`); None while the LDS size is unknown."""
        if self.lds_total is None or self.arch not in ARCH_LIMITS:
            return None
        return occupancy(self.arch, self.vgpr_total, self.sgpr, self.lds_total,
                         self.max_threads)["waves_per_simd"]

    def limit_violations(self) -> list:
        """Human-readable violations of the arch limits and of the project rules (no scratch,
        no spills, no dynamic stack, wave64); empty when all is well."""
        lim = ARCH_LIMITS.get(self.arch)
        bad = []
        if lim is None:
            return [f"{self.name}: unknown arch {self.arch!r}"]
        if self.wavefront_size != lim.wave_size:
            bad.append(f"wavefront size {self.wavefront_size}, expected {lim.wave_size}")
        if self.scratch_bytes:
            bad.append(f"scratch {self.scratch_bytes} B/lane")
        if self.vgpr_spill or self.sgpr_spill:
            bad.append(f"spills: {self.vgpr_spill} VGPR, {self.sgpr_spill} SGPR")
        if self.uses_dynamic_stack:
            bad.append("uses a dynamic stack")
        if self.vgpr > lim.max_arch_vgprs:
            bad.append(f"{self.vgpr} VGPRs > {lim.max_arch_vgprs}")
        if self.agpr > lim.max_agprs:
            bad.append(f"{self.agpr} AGPRs > {lim.max_agprs}")
        if self.vgpr_total > lim.vgprs_per_simd_lane:
            bad.append(f"{self.vgpr_total} unified VGPRs > {lim.vgprs_per_simd_lane}")
        if self.sgpr > lim.max_sgprs:
            bad.append(f"{self.sgpr} SGPRs > {lim.max_sgprs}")
        if self.lds_total is None:
            bad.append("LDS size unknown (dynamic LDS not found)")
        elif self.lds_total > lim.lds_per_workgroup:
            bad.append(f"LDS {self.lds_total} B > {lim.lds_per_workgroup} B")
        if self.max_threads > 1024:
            bad.append(f"{self.max_threads} threads per workgroup > 1024")
        return [f"{self.name} ({self.arch}): {b}" for b in bad]

    def row(self) -> dict:
        occ = self.occupancy()
        return {"kernel": self.name, "arch": self.arch, "VGPR": self.vgpr, "AGPR": self.agpr,
                "SGPR": self.sgpr, "LDS": self.lds_total if self.lds_total is not None else "?",
                "scratch": self.scratch_bytes, "spills": self.spills, "MFMA": self.mfma,
                "fp8 cvt": self.fp8_cvt, "occupancy": occ if occ is not None else "?"}


def occupancy(arch: str, vgpr_total: int, sgpr: int, lds_bytes: int, threads: int) -> dict:
    """Waves per SIMD a kernel can keep resident on ``arch`` and what limits it.

    Registers are per wave (unified VGPRs rounded up to the granule of 8, SGPRs to 16); a
    workgroup of ``ceil(threads / 64)`` waves needs ``lds_bytes`` (rounded up to 512 B) of the
    CU's LDS, and all of its waves must be resident at once (at most 16 workgroups per CU).
    ``waves_per_simd`` is resident waves per CU / 4, so 0.5 means half the SIMDs hold no
    wave of this kernel. This is the hardware bound; the scheduler can do worse, never better.
    """
    lim = ARCH_LIMITS[arch]
    waves_per_wg = max(1, math.ceil(threads / lim.wave_size))
    v_alloc = max(lim.vgpr_granule, math.ceil(vgpr_total / lim.vgpr_granule) * lim.vgpr_granule)
    s_alloc = max(lim.sgpr_granule, math.ceil(sgpr / lim.sgpr_granule) * lim.sgpr_granule)
    by_vgpr = min(lim.max_waves_per_simd, lim.vgprs_per_simd_lane // v_alloc)
    by_sgpr = min(lim.max_waves_per_simd, lim.sgprs_per_simd // s_alloc)
    per_simd = min(by_vgpr, by_sgpr)
    # Waves of a workgroup go round-robin over the SIMDs: ceil(waves_per_wg / 4) per SIMD.
    wg_by_regs = per_simd // math.ceil(waves_per_wg / lim.simds_per_cu) if per_simd else 0
    if waves_per_wg < lim.simds_per_cu:
        wg_by_regs = per_simd * (lim.simds_per_cu // waves_per_wg)
    lds_alloc = math.ceil(lds_bytes / lim.lds_granule) * lim.lds_granule
    wg_by_lds = lim.lds_per_cu // lds_alloc if lds_alloc else 1 << 30
    wgs = min(wg_by_regs, wg_by_lds, lim.max_workgroups_per_cu)
    waves_per_cu = min(wgs * waves_per_wg, per_simd * lim.simds_per_cu)
    if wgs == wg_by_lds and wg_by_lds < wg_by_regs:
        limiter = "LDS"
    elif wgs == lim.max_workgroups_per_cu and wgs < wg_by_regs:
        limiter = "workgroups"
    else:
        limiter = "VGPR" if by_vgpr <= by_sgpr else "SGPR"
    return {"waves_per_simd": round(waves_per_cu / lim.simds_per_cu, 2),
            "waves_per_cu": waves_per_cu,
            "workgroups_per_cu": wgs, "waves_per_workgroup": waves_per_wg, "by_vgpr": by_vgpr,
            "by_sgpr": by_sgpr, "workgroups_by_lds": wg_by_lds, "limiter": limiter}


# --- tools ------------------------------------------------------------------------------------

def llvm_tool(name: str) -> str:
    """Path of an LLVM tool (``readelf``/``objdump``) that knows gfx942/gfx950: the
    ``DSV4_TL_LLVM_<NAME>`` variable, then ``llvm-<name>-22``, ``llvm-<name>``,
    ``$ROCM_PATH/llvm/bin/llvm-<name>``. FileNotFoundError names what to install."""
    env = os.environ.get(f"DSV4_TL_LLVM_{name.upper()}")
    candidates = [env] if env else []
    candidates += [shutil.which(f"llvm-{name}-22"), shutil.which(f"llvm-{name}")]
    rocm = os.environ.get("ROCM_PATH")
    if rocm:
        candidates.append(os.path.join(rocm, "llvm", "bin", f"llvm-{name}"))
    for c in candidates:
        if c and os.path.exists(c):
            return c
    raise FileNotFoundError(f"llvm-{name}: not found; run scripts/setup_hip.sh (installs llvm-22)")


def _run(cmd: list) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[:2000]}")
    return proc.stdout


# --- finding the code objects -----------------------------------------------------------------

@dataclasses.dataclass
class FunctionInfo:
    """A kernel entry of the serialised tvm-ffi ``hip`` module."""

    name: str
    num_args: int
    launch_param_tags: list


@dataclasses.dataclass
class CodeObject:
    offset: int  # in the library file
    data: bytes
    functions: dict  # name -> FunctionInfo ({} when the module table could not be parsed)


def _elf_size(data: bytes, off: int) -> Optional[int]:
    """Size of the ELF64 little-endian AMDGPU object at ``off`` (None if it is not one):
    the furthest of the section header table, the sections and the segments."""
    if data[off:off + 4] != ELF_MAGIC or len(data) < off + 64:
        return None
    if data[off + 4] != 2 or data[off + 5] != 1:  # ELFCLASS64, little endian
        return None
    (e_machine,) = struct.unpack_from("<H", data, off + 18)
    if e_machine != EM_AMDGPU:
        return None
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, off + 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, off + 0x36)
    end = max(64, e_shoff + e_shnum * e_shentsize, e_phoff + e_phnum * e_phentsize)
    if off + end > len(data):
        return None
    for i in range(e_shnum):
        sh = off + e_shoff + i * e_shentsize
        sh_type, = struct.unpack_from("<I", data, sh + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, sh + 0x18)
        if sh_type != 8:  # SHT_NOBITS occupies no file space
            end = max(end, sh_offset + sh_size)
    for i in range(e_phnum):
        ph = off + e_phoff + i * e_phentsize
        p_offset, = struct.unpack_from("<Q", data, ph + 8)
        p_filesz, = struct.unpack_from("<Q", data, ph + 0x20)
        end = max(end, p_offset + p_filesz)
    return end if off + end <= len(data) else None


class _Reader:
    def __init__(self, data: bytes, pos: int, end: int):
        self.data, self.pos, self.end = data, pos, end

    def u64(self) -> int:
        if self.pos + 8 > self.end:
            raise ValueError("truncated")
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise ValueError("truncated")
        v = self.data[self.pos:self.pos + n]
        self.pos += n
        return v

    def string(self) -> bytes:
        return self.raw(self.u64())


def _parse_hip_modules(data: bytes) -> list:
    """Code objects of the serialised tvm-ffi ``hip`` modules in ``data``, with their
    function tables. Layout (TVM ROCMModuleNode::SaveToBytes): key ``hip``, u64 payload size,
    then fmt, the function map {name: FunctionInfo(name, arg_types, launch_param_tags,
    arg_extra_tags)}, the code object, (the source). Strings and vectors are u64-length
    prefixed; a DLDataType is 4 bytes."""
    found = []
    key = struct.pack("<Q", 3) + b"hip"
    pos = data.find(key)
    while pos != -1:
        try:
            r = _Reader(data, pos + len(key), len(data))
            size = r.u64()
            r.end = min(len(data), r.pos + size)
            fmt = r.string()
            if fmt in (b"hsaco", b"hip"):
                functions = {}
                for _ in range(r.u64()):
                    r.string()  # map key
                    name = r.string().decode()
                    nargs = r.u64()
                    r.raw(4 * nargs)
                    tags = [r.string().decode() for _ in range(r.u64())]
                    r.raw(4 * r.u64())  # arg_extra_tags (int32 each)
                    functions[name] = FunctionInfo(name, nargs, tags)
                start = r.pos + 8
                blob = r.string()
                n = _elf_size(data, start)
                if blob[:4] == ELF_MAGIC and n == len(blob):
                    found.append(CodeObject(start, blob, functions))
        except (ValueError, struct.error, UnicodeDecodeError):
            pass
        pos = data.find(key, pos + 1)
    return found


def extract_code_objects(path: "str | Path") -> list:
    """Every AMDGPU code object embedded in the library at ``path`` (parsed from the tvm-ffi
    ``hip`` module when possible, else found by scanning for AMDGPU ELF headers)."""
    data = Path(path).read_bytes()
    found = _parse_hip_modules(data)
    if found:
        return found
    objects, pos = [], data.find(ELF_MAGIC, 1)  # offset 0 is the host library itself
    while pos != -1:
        n = _elf_size(data, pos)
        if n:
            objects.append(CodeObject(pos, data[pos:pos + n], {}))
            pos = data.find(ELF_MAGIC, pos + n)
        else:
            pos = data.find(ELF_MAGIC, pos + 1)
    return objects


# --- dynamic LDS from the host stub -----------------------------------------------------------

_ADD_RE = re.compile(r"\badd[lq]?\s+\$0x([0-9a-f]+),\s*%(\w+)")
_LEA_RE = re.compile(r"\blea[lq]?\s+0x([0-9a-f]+)\(%(\w+)\),\s*%(\w+)")
_STORE_IMM_RE = re.compile(r"\bmovq\s+\$0x([0-9a-f]+),\s*0x8\(%(\w+)\)")
_REG_WRITE_RE = re.compile(
    r"\b(?:mov|movabs|lea|pop|xor|sub|imul|shl|and|or)[lq]?\s+(?:[^,]+,\s*)?%(\w+)\s*$")


def host_dynamic_lds(path: "str | Path", functions: dict) -> dict:
    """``{kernel: dynamic LDS bytes}`` read from the tvm-ffi host stub of the library.

    The host function calls each kernel through a packed call whose arguments are the
    kernel's ``num_args`` arguments followed by its launch parameters in the order of
    ``launch_param_tags``; the dynamic shared memory size is the one tagged
    ``tirx.use_dyn_shared_memory``, a constant for static shapes. Each argument is a 16-byte
    TVMFFIAny ``{type_index, 0, value}``; the stub stores a constant slot ``k`` as
    ``add $16k, %reg`` then ``movq $value, 0x8(%reg)``. The value is taken only when every
    such store for that slot agrees; otherwise the kernel maps to None (use
    :func:`lowered_dynamic_lds`). Kernels without that tag map to 0.
    """
    out, want = {}, {}
    for name, info in functions.items():
        if DYN_SHARED_TAG not in info.launch_param_tags:
            out[name] = 0
        else:
            want[name] = 16 * (info.num_args + info.launch_param_tags.index(DYN_SHARED_TAG))
    if not want:
        return out
    text = _run([llvm_tool("objdump"), "-d", "--no-show-raw-insn", str(path)])
    base, values = {}, {name: set() for name in want}
    slots = {off: name for name, off in want.items()}
    ambiguous_slots = {off for off in slots if list(want.values()).count(off) > 1}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        m = _ADD_RE.search(line)
        if m:
            base[m.group(2)] = int(m.group(1), 16)
            continue
        m = _LEA_RE.search(line)
        if m and m.group(2) != "rip":
            base[m.group(3)] = int(m.group(1), 16)
            continue
        m = _STORE_IMM_RE.search(line)
        if m:
            off = base.get(m.group(2))
            if off in slots and off not in ambiguous_slots:
                values[slots[off]].add(int(m.group(1), 16))
            continue
        m = _REG_WRITE_RE.search(line)
        if m:
            base.pop(m.group(1), None)
        if re.search(r"\b(call|ret|jmp)", line):
            base.clear()
    for name, vals in values.items():
        out[name] = vals.pop() if len(vals) == 1 else None
    return out


def lowered_dynamic_lds(variant, target) -> dict:
    """``{kernel: dynamic LDS bytes}`` computed exactly by lowering ``variant`` for the HIP
    ``target`` with TileLang (no device compile; a few seconds)."""
    import tilelang
    from tilelang import tvm

    from ..targets import parse_target

    target = parse_target(target)
    tvm_target = tvm.target.Target(target.tilelang_target())
    func = variant.build()
    # The pass configs tilelang.compile would use: the prim_func's own, plus any the variant adds.
    attrs = func.attrs or {}
    configs = dict(attrs["tilelang_pass_configs"]) if "tilelang_pass_configs" in attrs else {}
    if hasattr(variant, "pass_configs"):
        configs.update(variant.pass_configs())
    with tvm.transform.PassContext(config=configs), tvm_target:
        artifact = tilelang.lower(func, target=tvm_target)
    out = {}
    for gv, f in artifact.device_mod.functions.items():
        attrs = f.attrs or {}
        name = str(attrs["global_symbol"]) if "global_symbol" in attrs else gv.name_hint
        out[name] = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0
    return out


# --- metadata, descriptors, disassembly -------------------------------------------------------

def _scalar(value: str):
    value = value.strip().strip("'\"")
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    if value in ("true", "false"):
        return value == "true"
    return value


def parse_metadata(notes_text: str) -> dict:
    """The AMDGPU metadata of ``llvm-readelf --notes``: ``{"target": str, "kernels": [dict]}``
    with each kernel's top-level scalar keys (``.name``, ``.vgpr_count``, ...)."""
    target, kernels, cur, in_kernels = None, [], None, False
    for line in notes_text.splitlines():
        m = re.match(r"^amdhsa\.target:\s*(\S+)", line)
        if m:
            target = m.group(1).strip("'\"")
        if re.match(r"^amdhsa\.kernels:", line):
            in_kernels = True
            continue
        if in_kernels and re.match(r"^\S", line):
            in_kernels = False
        if not in_kernels:
            continue
        m = re.match(r"^  - (\.[\w]+):\s*(.*)$", line)
        if m:
            cur = {}
            kernels.append(cur)
            if m.group(2):
                cur[m.group(1)] = _scalar(m.group(2))
            continue
        m = re.match(r"^    (\.[\w]+):\s*(.*)$", line)
        if m and cur is not None and m.group(2):
            cur[m.group(1)] = _scalar(m.group(2))
    return {"target": target, "kernels": kernels}


def _arch_of(co: bytes, triple: Optional[str]) -> str:
    if triple:
        m = re.search(r"(gfx[0-9a-f]+)", triple)
        if m:
            return m.group(1)
    (e_flags,) = struct.unpack_from("<I", co, 0x30)
    return _MACH.get(e_flags & 0xFF, f"mach{e_flags & 0xFF:#x}")


def _descriptor_accum_offsets(objdump: str, path: str, symbols: list, arch: str) -> dict:
    """``{kernel symbol: .amdhsa_accum_offset}`` from the kernel descriptors."""
    out = {}
    if not symbols:
        return out
    text = _run([objdump, "-D", f"--mcpu={arch}",
                 "--disassemble-symbols=" + ",".join(symbols), path])
    cur = None
    for line in text.splitlines():
        m = re.match(r"^\.amdhsa_kernel\s+(\S+)", line.strip())
        if m:
            cur = m.group(1)
        m = re.match(r"^\.amdhsa_accum_offset\s+(\d+)", line.strip())
        if m and cur:
            out[cur] = int(m.group(1))
    return out


_FP8_CVT_RE = re.compile(r"^v_cvt_(?:pk_)?f32_(?:fp8|bf8)|^v_cvt_scalef32_(?:pk_)?f32_(?:fp8|bf8)")


def _mfma_counts(objdump: str, path: str, arch: str) -> dict:
    """``{function: Counter(opcode -> count)}`` of the MFMA/SMFMAC instructions and of the
    hardware fp8 -> f32 conversions (key ``"fp8_cvt:<opcode>"``) of every function."""
    text = _run([objdump, "-d", "--no-show-raw-insn", f"--mcpu={arch}", path])
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:", line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, Counter())
            continue
        m = re.match(r"^\s+(v_mfma\w*|v_smfmac\w*|v_cvt\w*)", line)
        if m and cur:
            op = m.group(1)
            if op.startswith("v_cvt"):
                if _FP8_CVT_RE.match(op):
                    out[cur]["fp8_cvt:" + op] += 1
            else:
                out[cur][op] += 1
    return out


def inspect_code_object(co: bytes, dynamic_lds: Optional[dict] = None,
                        workdir: Optional[str] = None) -> list:
    """:class:`KernelResources` of every kernel in the code object bytes ``co``.
    ``dynamic_lds``: ``{kernel name: bytes}`` (None or a missing name: unknown)."""
    import tempfile

    readelf, objdump = llvm_tool("readelf"), llvm_tool("objdump")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = os.path.join(tmp, "code_object.hsaco")
        with open(path, "wb") as f:
            f.write(co)
        meta = parse_metadata(_run([readelf, "--notes", path]))
        arch = _arch_of(co, meta["target"])
        symbols = [k.get(".symbol", f"{k.get('.name')}.kd") for k in meta["kernels"]]
        accum = _descriptor_accum_offsets(objdump, path, symbols, arch)
        mfma = _mfma_counts(objdump, path, arch)
    kernels = []
    for k in meta["kernels"]:
        name = k.get(".name", "?")
        agpr = int(k.get(".agpr_count", 0))
        total = int(k.get(".vgpr_count", 0))
        # gfx90a+: .vgpr_count = align(arch VGPRs, 4) + AGPRs; accum_offset = first AGPR.
        vgpr = accum.get(name, total) if agpr else total
        if agpr and name not in accum:
            vgpr = total - agpr
        found = mfma.get(name, Counter())
        ops = {k: v for k, v in found.items() if not k.startswith("fp8_cvt:")}
        cvt = sum(v for k, v in found.items() if k.startswith("fp8_cvt:"))
        kernels.append(KernelResources(
            name=name, symbol=k.get(".symbol", ""), arch=arch, triple=meta["target"] or "",
            vgpr=vgpr, agpr=agpr, vgpr_total=total, sgpr=int(k.get(".sgpr_count", 0)),
            vgpr_spill=int(k.get(".vgpr_spill_count", 0)),
            sgpr_spill=int(k.get(".sgpr_spill_count", 0)),
            scratch_bytes=int(k.get(".private_segment_fixed_size", 0)),
            uses_dynamic_stack=bool(k.get(".uses_dynamic_stack", False)),
            lds_static=int(k.get(".group_segment_fixed_size", 0)),
            lds_dynamic=None if dynamic_lds is None else dynamic_lds.get(name),
            max_threads=int(k.get(".max_flat_workgroup_size", 0)),
            wavefront_size=int(k.get(".wavefront_size", 0)),
            mfma=sum(ops.values()), mfma_ops=ops, fp8_cvt=cvt))
    return kernels


def inspect_artifact(path: "str | Path", dynamic_lds: Optional[dict] = None) -> list:
    """:class:`KernelResources` of every kernel of every code object in the library ``path``.

    ``dynamic_lds`` overrides the dynamic LDS sizes (``{kernel: bytes}``); by default they
    are read from the host stub (:func:`host_dynamic_lds`) where the module table is known.
    Raises ValueError when the library holds no AMDGPU code object.
    """
    objects = extract_code_objects(path)
    if not objects:
        raise ValueError(f"{path}: no AMDGPU code object found")
    kernels = []
    for co in objects:
        dyn = dict(host_dynamic_lds(path, co.functions)) if co.functions else {}
        if dynamic_lds:
            dyn.update(dynamic_lds)
        kernels.extend(inspect_code_object(co.data, dyn))
    return kernels


# --- the table --------------------------------------------------------------------------------

TABLE_COLUMNS = ("variant", "kernel", "arch", "VGPR", "AGPR", "SGPR", "LDS", "scratch", "spills",
                 "MFMA", "fp8 cvt", "occupancy")


def format_table(rows: list, columns=TABLE_COLUMNS) -> str:
    """A Markdown table of ``rows`` (dicts); missing columns are left out."""
    cols = [c for c in columns if any(c in r for r in rows)]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    lines = [fmt.format(*cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt.format(*row) for row in cells]
    return "\n".join(lines)


def summarize(rows: list) -> list:
    """One row per (op, arch) of :meth:`KernelResources.row` rows that carry ``variant``
    (a variant key, op first): the variant count and each column's range."""
    groups = {}
    for r in rows:
        if not isinstance(r.get("VGPR"), int):
            continue
        groups.setdefault((r["variant"].split(".")[0], r["arch"]), []).append(r)

    def span(vals):
        lo, hi = min(vals), max(vals)
        return str(lo) if lo == hi else f"{lo}-{hi}"

    out = []
    for (op, arch), rs in sorted(groups.items()):
        row = {"op": op, "arch": arch, "variants": len(rs)}
        for col in SUMMARY_COLUMNS[3:]:
            vals = [r[col] for r in rs if isinstance(r.get(col), (int, float))]
            row[col] = span(vals) if vals else "?"
        out.append(row)
    return out


SUMMARY_COLUMNS = ("op", "arch", "variants", "VGPR", "AGPR", "SGPR", "LDS", "scratch", "spills",
                   "MFMA", "fp8 cvt", "occupancy")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dsv4_tl.hip.resources",
                                     description="Resource use of HIP kernel libraries (.so).")
    parser.add_argument("libraries", nargs="+")
    args = parser.parse_args(argv)
    rows, bad = [], []
    for lib in args.libraries:
        for k in inspect_artifact(lib):
            rows.append({"variant": Path(lib).stem, **k.row()})
            bad += k.limit_violations()
    print(format_table(rows))
    for b in bad:
        print("VIOLATION:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
