"""Shared plumbing of the front-end ops: launch plans, resolved kernels, reusable arguments.

A front end does its work in two parts. Once per input *signature* (each tensor's dtype,
shape and device and the strides its checks read, the static options and scalars: everything
its checks read that is not data) it validates the arguments and resolves a **launch plan**:
the target, the kernel variant (static parameters from the op's
:class:`~dsv4_tl.kernels.KernelSpec`, the schedule of the shape bucket its features fall in),
the split count, the argument layout (:class:`Launch`), the output shapes and the
placeholders. Plans live in a :class:`PlanCache` keyed by the signature, so a signature that
failed validation never gets one. Per call the plan does only what depends on the data:
16-byte alignment of the buffers the kernels address directly (and the routing of CPU
tensors, which follows the environment), contiguous inputs (free when they are), the
outputs' and scratch buffers' allocation, and the launch.

Every memo here (plans, resolved kernels, targets, schedules) is dropped by
:func:`dsv4_tl.kernels.kernels_changed` (a new loader, cleared schedule caches, a forced
schedule: see :mod:`dsv4_tl.kernels`); their ``cache_clear()`` does the same. What a plan
passes to a kernel on its own account (the -inf sink, full lengths) comes from
:data:`constants`, which never frees: a CUDA graph may have captured it.
"""

import functools
import math
import operator
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Tuple

import torch

from ..kernels import KERNELS, KernelSpec, Variant, kernels_changed, on_kernels_changed
from ..validation import check_kernel_device, check_tensor
from ..loader import loader_for
from ..schedules import bucket_index, schedule_of_bucket
from ..targets import Target, sycl_runs_cpu_tensors, target_for_device


# ------------------------------------------------------------------------------ memos
class _Memo:
    """Memoised function of hashable arguments with ``functools.lru_cache``'s
    ``cache_clear()``, emptied by :func:`~dsv4_tl.kernels.kernels_changed` (which
    ``cache_clear()`` calls, so clearing one clears every resolution and plan)."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._cache: dict = {}
        on_kernels_changed(self._drop)

    def _drop(self) -> None:
        self._cache = {}  # a resolution under way stores into the dropped dict

    def __call__(self, *args):
        cache = self._cache
        try:
            return cache[args]
        except KeyError:
            pass
        value = cache[args] = self._fn(*args)
        return value

    def cache_clear(self) -> None:
        kernels_changed()


class PlanCache:
    """Launch plans of one front end by signature (at most ``maxsize``, oldest dropped
    first), emptied by :func:`~dsv4_tl.kernels.kernels_changed`. ``plans.get(key)`` is the
    per-call lookup; :meth:`make` builds, validating, and stores a plan."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self.plans: dict = {}
        on_kernels_changed(self.clear)

    def clear(self) -> None:
        self.plans = {}  # a plan under way is stored into the dropped dict

    def make(self, key, plan_type, *args):
        """``plan_type(*args)`` (which validates the call and raises its errors), stored
        under ``key`` unless ``key`` is None (arguments that make no signature) or a
        FakeTensorMode is active (the plan may hold fake tensors)."""
        plans = self.plans
        plan = plan_type(*args)
        if key is not None and not faking():
            if len(plans) >= self.maxsize:
                try:
                    plans.pop(next(iter(plans)), None)
                except (RuntimeError, StopIteration):  # another thread changed it meanwhile
                    pass
            plans[key] = plan
        return plan


# Signatures: what a front end's checks read of each argument, so a call whose signature
# matches a plan's passed the same checks. Each helper takes an optional tensor (None for
# None); a non-tensor raises (AttributeError, ...) and the front end's checks then name it.
# Strides are read only where a check reads them: a check of the last stride only
# (``last_dim_contiguous``) reads ``stride(-1)``, a contiguity check ``is_contiguous()``, the
# cache and stride rules every stride; the plans make inputs contiguous per call, as the
# kernels need (free when they are).
def meta(t) -> tuple:
    """dtype, shape, device."""
    return None if t is None else (t.dtype, t.shape, t.device)


def meta_last(t) -> tuple:
    """dtype, shape, last stride, device (a ``last_dim_contiguous`` check)."""
    return None if t is None else (t.dtype, t.shape, t.stride(-1), t.device)


def meta_contiguous(t) -> tuple:
    """dtype, shape, contiguity, device (a ``contiguous`` check)."""
    return None if t is None else (t.dtype, t.shape, t.is_contiguous(), t.device)


def meta_strides(t) -> tuple:
    """dtype, shape, every stride, device (the cache's and other stride rules)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


# ------------------------------------------------------------------------------ resolution
@_Memo
def _target_of(device_type: str, index: int) -> Target:
    return target_for_device(torch.device(device_type, index))


def _target(device: torch.device) -> Target:
    device = torch.device(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return _target_of(device.type, index)


def _resolve(op: str, target: Target, static: tuple, features: tuple) -> Tuple[Callable, dict]:
    schedule = _schedule_of(op, target, features)
    return _loaded(op, target, static, tuple(sorted(schedule.items()))), schedule


def _schedule_of(op: str, target: Target, features: tuple) -> dict:
    return _bucket_schedule(op, target, bucket_index(target.dirname, op, **dict(features)))


# Both memos are keyed by what the features decide (the bucket, the schedule), not by the
# features' values (a decode CTA count, a dense prefill width: one entry per batch size or
# width would grow without bound); so at most (buckets x static parameter sets) entries.
@_Memo
def _bucket_schedule(op: str, target: Target, index) -> dict:
    return schedule_of_bucket(target.dirname, op, index)


@_Memo
def _loaded(op: str, target: Target, static: tuple, schedule: tuple) -> Callable:
    return loader_for(target).get(Variant.make(op, dict(static), dict(schedule)))


def kernel_for(op: str, device: torch.device, static: dict, **features: int) -> Callable:
    """The loaded kernel of ``op`` for ``device``: schedule of the shape bucket that
    ``features`` fall in (from ``schedules/<target>/<op>.json``), compiled or loaded once.
    Resolutions are memoised per bucket. Arguments in the order of ``KERNELS[op].params``.
    A feature the op's buckets never look at (a misspelling would silently pick the default
    schedule) is a ValueError naming it and the op's features
    (:attr:`~dsv4_tl.kernels.KernelSpec.feature_names`)."""
    spec = KERNELS.get(op)
    if spec is None:
        raise ValueError(f"op: unknown kernel {op!r}; known: {', '.join(sorted(KERNELS))}")
    unknown = sorted(set(features) - set(spec.feature_names))
    if unknown:
        raise ValueError(f"features: {op} has no bucket feature {', '.join(unknown)}; its "
                         f"features: {', '.join(spec.feature_names) or 'none'}")
    return _resolve(op, _target(device), tuple(sorted(static.items())),
                    tuple(sorted(features.items())))[0]


def schedule_of(op: str, device: torch.device, **features: int) -> dict:
    """The schedule ``kernel_for`` would use (front ends read shape-dependent knobs from it)."""
    return _schedule_of(op, _target(device), tuple(sorted(features.items())))


def call_schedule(spec: KernelSpec, target: Target, **call) -> dict:
    """The schedule of the bucket a call described by ``call`` (see the spec's keywords) falls
    in on ``target``: what :func:`resolve` loads its kernel with. A front end that reads the
    schedule before it loads the kernel resolves it once, here, then loads the kernel with
    :func:`resolve_with`."""
    features = spec.features(target.dirname, **call)
    return _schedule_of(spec.op, target, tuple(sorted(features.items())))


def resolve(spec: KernelSpec, target: Target, **call) -> Tuple[Callable, dict]:
    """``(loaded kernel, schedule)`` of the variant ``spec`` needs for a call described by
    ``call`` (see the spec's keywords) on ``target``."""
    schedule = call_schedule(spec, target, **call)
    return resolve_with(spec, target, schedule, **call), schedule


def resolve_with(spec: KernelSpec, target: Target, schedule: dict, **call) -> Callable:
    """The loaded kernel of ``spec`` for ``call`` on ``target`` with ``schedule`` (the call's
    :func:`call_schedule`, or one changed by the caller in a knob the call rules out)."""
    return _loaded(spec.op, target, tuple(sorted(spec.static(**call).items())),
                   tuple(sorted(schedule.items())))


class Launch:
    """A kernel with its arguments filled by name (``spec.params``, the prim_func's): the
    ``fixed`` ones resolved with the plan, the rest passed per call, as ``dynamic`` names
    them, in that order."""

    __slots__ = ("kernel", "fixed", "order")

    def __init__(self, kernel: Callable, spec: KernelSpec, dynamic: Tuple[str, ...], **fixed):
        names = tuple(dynamic) + tuple(fixed)
        if sorted(names) != sorted(spec.params):
            raise TypeError(f"{spec.op}: kernel arguments {sorted(names)} do not match the "
                            f"kernel's parameters {sorted(spec.params)}")
        self.kernel = kernel
        self.fixed = tuple(fixed.values())
        # None when the per-call values then the fixed ones already are the kernel's order
        # (the front ends name them so: no reordering per call)
        self.order = (None if names == tuple(spec.params) else
                      operator.itemgetter(*(names.index(p) for p in spec.params)))

    def __call__(self, *values) -> None:
        if self.order is None:
            self.kernel(*values, *self.fixed)
        else:
            self.kernel(*self.order(values + self.fixed))


def routed_per_call(device: torch.device) -> bool:
    """Whether a plan must check its device on every call: CPU tensors run on the SYCL
    target only while ``$DSV4_TL_SYCL_DEVICE`` is set (:func:`recheck_device`)."""
    return device.type not in ("cuda", "xpu")


def recheck_device(name: str, t: torch.Tensor) -> None:
    """:func:`~dsv4_tl.validation.check_kernel_device` of a CPU tensor, whose routing
    follows the environment."""
    if not sycl_runs_cpu_tensors():
        check_kernel_device(name, t)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (then no
    tensor with data may be created for reuse: the capture records its fill, it does not
    run it)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def faking() -> bool:
    """Whether a FakeTensorMode is active (tracing, ``torch.compile``'s shape propagation):
    then nothing made may be kept for later calls (a fake tensor cannot serve a real launch)
    and no plan is stored."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


# ------------------------------------------------------------------------------ constants
FULL_LENGTH = (1 << 31) - 1
"""A ``topk_length`` / ``Lengths`` entry meaning "the whole row": the kernels clamp every
length to the row's width (``min(max(length, 0), width)``), so one value serves every width."""


class ConstantPool:
    """Read-only tensors filled with one value, as views of one buffer per (device, dtype,
    value) that is never freed. A CUDA graph captured with such a view reads its address on
    every replay, long after the plan or memo that took the view was evicted or dropped by
    :func:`~dsv4_tl.kernels.kernels_changed`: so what a plan passes for an absent
    ``topk_length`` or ``attn_sink`` lives as long as the process. A buffer grows to the next
    power of two when a call needs more; the outgrown one is kept too (a graph may hold it),
    so a key costs at most twice its largest request, and the keys are few (the -inf sink,
    :data:`FULL_LENGTH`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict = {}  # (device, dtype, value) -> the current buffer
        self._outgrown: list = []  # never freed: a captured graph may read them

    def get(self, value, n: int, dtype: torch.dtype, device: torch.device):
        """A read-only ``[n]`` view of ``value``, or None where none may be made now: a new
        buffer while a CUDA graph is captured (the capture would record its fill without
        running it) or anything under a FakeTensorMode."""
        if faking():
            return None
        key = (device, dtype, value)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            if capturing(device):
                return None
            with self._lock:
                buf = self._buffers.get(key)
                if buf is None or buf.numel() < n:
                    if buf is not None:
                        self._outgrown.append(buf)
                    buf = torch.full((max(16, 1 << max(0, n - 1).bit_length()),), value,
                                     dtype=dtype, device=device)
                    if device.type == "cuda":  # filled before any other stream reads it
                        torch.cuda.current_stream(device).synchronize()
                    self._buffers[key] = buf
        return buf[:n]

    def __call__(self, value, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """:meth:`get`, else a tensor of this call (a graph being captured keeps its own)."""
        made = self.get(value, n, dtype, device)
        if made is None:
            made = torch.full((n,), value, dtype=dtype, device=device)
        return made


constants = ConstantPool()


def no_sink(num_heads: int, device: torch.device) -> torch.Tensor:
    """``attn_sink`` = -inf for every head: e^-inf = 0 adds nothing to the denominator.
    A view of the process-lifetime :data:`constants` (a per-call tensor while a CUDA graph is
    captured before the pool has one, or under a FakeTensorMode)."""
    return constants(-math.inf, num_heads, torch.float32, device)


def reusable_no_sink(num_heads: int, device: torch.device):
    """A plan's :func:`no_sink` (None where :meth:`ConstantPool.get` makes none)."""
    return constants.get(-math.inf, num_heads, torch.float32, device)


def full_lengths(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` int32 :data:`FULL_LENGTH` (the lengths argument when ``topk_length`` is None),
    from the process-lifetime :data:`constants`."""
    return constants(FULL_LENGTH, n, torch.int32, device)


def reusable_full_lengths(n: int, device: torch.device):
    """A plan's :func:`full_lengths` (None where :meth:`ConstantPool.get` makes none)."""
    return constants.get(FULL_LENGTH, n, torch.int32, device)


def sink_argument(attn_sink, reusable, num_heads: int, device: torch.device) -> torch.Tensor:
    """The kernels' ``Sink``: ``attn_sink`` (contiguous), else -inf per head, the plan's
    ``reusable`` one when it has one."""
    if attn_sink is not None:
        return attn_sink.contiguous()
    return reusable if reusable is not None else no_sink(num_heads, device)


def placeholder(device: torch.device, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A zero-size argument that this variant never touches: its dynamic dims are 0, its
    static dims (head count, widths) must still match the kernel signature. Cached: a
    zero-size tensor holds no data, so one per (device, dtype, shape) serves every call
    (not under a FakeTensorMode, whose tensors are fake)."""
    if faking():
        return torch.empty(shape, dtype=dtype, device=device)
    return _placeholder(device, dtype, shape)


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


# ------------------------------------------------------------------------------ buffers
class _ThreadPools:
    """One thread's scratch: ``buffers``, (device, raw stream) -> (float32 buffer,
    {shapes: views}: the :attr:`StreamScratch.MAX_VIEW_SETS` most recently used), and the
    thread's id."""

    __slots__ = ("ident", "buffers", "__weakref__")

    def __init__(self):
        self.ident, self.buffers = threading.get_ident(), {}


class StreamScratch:
    """Float32 scratch that kernels use within one launch sequence (split-KV partials, from
    the decode kernel to its combine), one buffer per (device, stream, thread), shared by
    the plans: calls that one thread makes on one stream run in order, so they can reuse the
    same bytes, which saves an allocation per call (a few µs of host time each). A buffer
    grows to the next power of two when a call needs more (the old one is freed then: the
    views made of it go with it; the caching allocator reuses it in stream order) and is
    kept while its thread lives: each thread's buffers sit in thread-local storage, dropped
    when the thread ends (a pool of worker threads leaves nothing behind). Scratch over
    ``MAX_POOLED_BYTES`` is allocated per call (at the batch sizes where partials are that
    large the allocation is small next to the kernels' time, and the pool would keep that
    memory reserved). Not while a CUDA graph is captured or a FakeTensorMode is active: then
    each call gets its own (a graph keeps its buffers). :meth:`clear` drops every buffer.
    The views made of a buffer are kept per set of shapes, the ``MAX_VIEW_SETS`` most
    recently used (the shapes follow the batch size: one entry per batch size an engine ever
    ran would grow without bound); a set dropped is made again in a few µs when it returns."""

    MAX_POOLED_BYTES = 64 << 20
    MAX_VIEW_SETS = 16

    def __init__(self):
        self._local = threading.local()
        self._threads = weakref.WeakSet()  # every live thread's _ThreadPools (for clear())

    def _mine(self) -> _ThreadPools:
        pools = getattr(self._local, "pools", None)
        if pools is None:
            pools = self._local.pools = _ThreadPools()
            self._threads.add(pools)
        return pools

    @property
    def pools(self) -> dict:
        """``{(device, raw stream, thread id): (buffer, views)}`` of the live threads (a
        snapshot, for inspection)."""
        return {(*key, pools.ident): pool for pools in list(self._threads)
                for key, pool in list(pools.buffers.items())}

    def views(self, device: torch.device, shapes: Tuple[tuple, ...]) -> tuple:
        """Float32 tensors of ``shapes`` for kernels launched next on CUDA ``device``'s
        current stream by this thread; valid until this thread's next call on that stream."""
        if capturing(device) or faking():
            return self.fresh(device, shapes)
        pools = self._mine().buffers
        key = (device, torch._C._cuda_getCurrentRawStream(device.index))
        pool = pools.get(key)
        if pool is not None:
            made = pool[1].get(shapes)
            if made is not None:
                pool[1].move_to_end(shapes)
                return made
        sizes = [math.prod(shape) for shape in shapes]
        starts = [sum(-(-n // 4) * 4 for n in sizes[:i]) for i in range(len(sizes))]
        need = starts[-1] + sizes[-1]  # (each view starts 16-byte aligned)
        if need * 4 > self.MAX_POOLED_BYTES:
            return self.fresh(device, shapes)
        if pool is None or pool[0].numel() < need:
            pool = (torch.empty(1 << (need - 1).bit_length(), dtype=torch.float32,
                                device=device), OrderedDict())
            pools[key] = pool
        made = pool[1][shapes] = tuple(pool[0][at:at + n].view(shape)
                                       for at, n, shape in zip(starts, sizes, shapes))
        if len(pool[1]) > self.MAX_VIEW_SETS:
            pool[1].popitem(last=False)  # the least recently used
        return made

    @staticmethod
    def fresh(device: torch.device, shapes: Tuple[tuple, ...]) -> tuple:
        """Per-call tensors of :meth:`views`' shapes."""
        return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)

    def clear(self) -> None:
        """Drop every thread's buffers (for a caller that wants the memory back)."""
        for pools in list(self._threads):
            pools.buffers = {}


stream_scratch = StreamScratch()


def output_tensor(name: str, given, shape: tuple, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``given`` checked as a contiguous output of ``shape``/``dtype`` on ``device``, or a new
    uninitialised tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_output(name, given, shape, dtype, device)
    check_aligned_output(name, given)
    return given


def check_output(name: str, given, shape: tuple, dtype: torch.dtype,
                 device: torch.device) -> None:
    """What a signature determines of a preallocated output (dtype, shape, device,
    contiguous); :func:`check_aligned_output` is the per-call rest."""
    check_tensor(name, given, dtype=dtype, shape=shape, device=device, contiguous=True)


def check_aligned_output(name: str, given: torch.Tensor) -> None:
    if given.data_ptr() % 16:
        # The attention kernels store full head groups of ``out`` by TMA, whose global
        # address must be 16-byte aligned (a view starting mid-buffer may not be).
        raise ValueError(f"{name}: expected a 16-byte aligned start, got address "
                         f"{given.data_ptr():#x} (a view at an offset of the buffer?)")


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 16-byte boundary (a copy when it is not): the
    kernels load q by TMA and prefill's KV rows by 16-byte cp.async, whose global addresses
    must be 16-byte aligned."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _per_tensor(memo: dict, t: torch.Tensor, extra: tuple, make: Callable, *args):
    """``make(alias, *args)`` for tensor ``t``, memoised in ``memo`` under ``(id(t), *extra)``
    while the same tensor stays at the same address, the entry dropped with ``t``. ``alias``
    is ``t`` detached: what ``make`` returns must be made of it, since a view of ``t``
    itself would keep ``t`` alive (its base) and the entry's weak reference would never
    fire."""
    key = (id(t), *extra)
    ptr = t.data_ptr()
    hit = memo.get(key)
    if hit is not None and hit[1] == ptr and hit[0]() is t:
        return hit[2]
    value = make(t.detach(), *args)
    memo[key] = (weakref.ref(t, lambda _ref, key=key: memo.pop(key, None)), ptr, value)
    return value


_reshaped: dict = {}  # (id(tensor), shape) -> (weak reference, data_ptr, view)


def reshaped(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t.reshape(shape)``, contiguous (a copy when ``t`` is not). A view is memoised while
    the same tensor stays at the same address (a step's KV workspace and index rows are
    passed to every layer), which saves making it again per call; a copy never is."""
    if not t.is_contiguous():
        return t.reshape(shape).contiguous()
    if faking():
        return t.view(shape)
    return _per_tensor(_reshaped, t, (shape,), torch.Tensor.view, shape)


_views: dict = {}  # (id(cache), span, dtypes) -> (weak reference, data_ptr, views)


def cache_views(cache: torch.Tensor, span: int, dtypes: tuple, misaligned: str) -> tuple:
    """The kernels' flat views of the ``span`` bytes of a validated fp8_ds_mla cache, from
    its first byte, as each of ``dtypes`` (views of the same bytes: writes land in the
    cache). ``misaligned``: the ValueError's message (``{ptr}``: the address) when that byte
    is not 16-byte aligned (the kernels address records as 16-byte vectors). Memoised while
    the same cache tensor stays at the same address (a layer's cache is passed call after
    call); dropped with the tensor."""
    return _per_tensor(_views, cache, (span, dtypes), _flat_views, span, dtypes, misaligned)


def _flat_views(cache: torch.Tensor, span: int, dtypes: tuple, misaligned: str) -> tuple:
    ptr = cache.data_ptr()
    if ptr % 16:
        raise ValueError(misaligned.format(ptr=ptr))
    u8 = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    flat = u8.as_strided((span,), (1,), u8.storage_offset())
    return tuple(flat if dtype == torch.uint8 else flat.view(dtype) for dtype in dtypes)
