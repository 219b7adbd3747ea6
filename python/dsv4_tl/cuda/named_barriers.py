"""Named-barrier ids by warp role in a generated CUDA kernel: the clash that hangs a kernel.

TileLang 0.1.15 runs its ThreadSync pass once per storage scope ("shared", then "shared.dyn"),
and each run numbers the partial barriers it inserts from 3. A warp-specialised kernel can so
get ``bar.sync 3, 128`` in its producer branch from one run and in a consumer warpgroup's
branch from the other: the two roles' warps then count into one barrier and release each other
at the wrong points (the hang of bench/PERF_NOTES.md item 83). Nothing in TileLang or nvcc
reports it; this module reads it from the generated source, which the lowering step of
``scripts/kernel_fingerprints.py`` already produces (no extra compile).

A role is the thread range of a branch on ``threadIdx.x``: ``if (((int)threadIdx.x) < N) {A}
else {B}`` gives A the threads below N and B the rest, nested branches narrow further (the
warp-specialised kernels' ``< 128`` / ``< 256`` / else: consumer warpgroups 0 and 1, the
producer). The named barriers read: ``tl::__sync_thread_partial(id, n)`` (``bar.sync``),
``tl::__named_barrier_arrive(id, n)`` (``bar.arrive``), literal ``bar.sync`` /
``barrier.sync`` / ``bar.arrive`` / ``barrier.arrive`` in inline asm, and TileLang's
``tl::AllReduce<..., threads, ..., tl::NamedBarrier<n>>``, which syncs on ids 1 and 2 when its
reduction crosses warps (``threads`` >= 64, ``tl_templates/cuda/reduce.h``).

An id used by two roles is a clash, unless it is one barrier the roles share by design: every
use counts the same ``n`` and ``n`` is the roles' threads together (the two consumer
warpgroups' ``bar.sync 10, 256``). Code outside every ``threadIdx.x`` branch runs on all the
block's threads and is a role of its own; a kernel without role branches cannot clash.
"""

import re

_ROLE_IF = re.compile(r"if \(\(\(int\)threadIdx\.x\) < (\d+)\) \{")
_ELSE = re.compile(r"\s*else\s*(\{|if\s*\()")
_GLOBAL = re.compile(r"__global__\b")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\((\d+)")
# (kind, id, threads) patterns; the id / threads groups must be literals to be checked
_BARRIERS = (
    ("bar.sync", re.compile(r"__sync_thread_partial\(([^(),]*)(?:,([^(),]*))?\)")),
    ("bar.arrive", re.compile(r"__named_barrier_arrive\(([^(),]*),([^(),]*)\)")),
)
_ASM_BARRIER = re.compile(r"\b(bar(?:rier)?(?:\.cta)?\.(?:sync|arrive))(?:\.aligned)?\s+(\w+)\s*,\s*(\w+)")
_ALL_REDUCE = re.compile(r"AllReduce<\s*[\w:]+\s*,\s*(\d+)\s*,[^<>]*?tl::NamedBarrier<(\d+)>")


def _blank_literals(src: str) -> str:
    """``src`` with the inside of string / char literals and comments blanked (same offsets),
    so that braces in inline asm (``"{ .reg ... }"``) do not count as blocks."""
    out, i, n = list(src), 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out[i + 1:j] = " " * (min(j, n) - i - 1)
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = " " * (j - i)
            i = j
        else:
            i += 1
    return "".join(out)


def _block_end(code: str, open_at: int) -> int:
    """The offset just past the ``}`` closing the block whose ``{`` is at ``open_at``."""
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("source: unbalanced braces")


def _else_end(code: str, at: int, end: int):
    """``(start, stop, resume)`` of the ``else`` part of the ``if`` block that ends at ``at``
    (its code is ``code[start:stop]``: a block's inside, or a whole ``else if`` chain; the
    code after it starts at ``resume``), or None without one."""
    e = _ELSE.match(code, at, end)
    if e is None:
        return None
    if e.group(1) == "{":
        close = _block_end(code, e.end() - 1) - 1
        return e.end(), close, close + 1
    depth, i = 0, e.end() - 1  # the else-if's condition, then its block and its own else
    while True:
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
        if depth == 0:
            break
    brace = code.find("{", i)
    if brace < 0 or code[i:brace].strip():
        raise ValueError("source: an else-if without a braced block")
    stop = _block_end(code, brace)
    nested = _else_end(code, stop, end)
    stop = nested[2] if nested else stop
    return e.start() + e.group(0).index("if"), stop, stop


def _barriers(text: str) -> list:
    """``(kind, id, threads)`` of each named barrier in ``text`` (threads None: the whole block);
    an id or thread count that is not a literal raises (the check could not vouch for it)."""
    found = []

    def lit(s, what):
        s = s.strip()
        if not s.isdigit():
            raise ValueError(f"source: named barrier with a non-literal {what} {s!r}")
        return int(s)

    for kind, pat in _BARRIERS:
        for m in pat.finditer(text):
            threads = m.group(2)
            found.append((kind, lit(m.group(1), "id"),
                          lit(threads, "thread count") if threads is not None else None))
    for m in _ASM_BARRIER.finditer(text):
        found.append((m.group(1), lit(m.group(2), "id"), lit(m.group(3), "thread count")))
    for m in _ALL_REDUCE.finditer(text):
        if int(m.group(1)) >= 64:  # a cross-warp step: Barrier::sync<1>, sync<2>
            found += [("AllReduce bar.sync", 1, int(m.group(2))),
                      ("AllReduce bar.sync", 2, int(m.group(2)))]
    return found


def _walk(src: str, code: str, start: int, end: int, lo: int, hi, out: dict) -> None:
    """Add to ``out`` ({(lo, hi): [(kind, id, threads)]}) the barriers of ``src[start:end]``,
    run by threads ``lo``..``hi`` (``hi`` None: to the block's end), splitting it at the
    ``threadIdx.x`` branches (``code``: ``src`` with its literals blanked)."""
    pos = start
    while True:
        m = _ROLE_IF.search(code, pos, end)
        if m is None:
            break
        out.setdefault((lo, hi), []).extend(_barriers(src[pos:m.start()]))
        n = int(m.group(1))
        body_end = _block_end(code, m.end() - 1)
        _walk(src, code, m.end(), body_end - 1, lo, n if hi is None else min(hi, n), out)
        pos = body_end
        other = _else_end(code, pos, end)
        if other:
            _walk(src, code, other[0], other[1], max(lo, n), hi, out)
            pos = other[2]
    out.setdefault((lo, hi), []).extend(_barriers(src[pos:end]))


def kernel_roles(src: str) -> dict:
    """{kernel index: {(lo, hi): [(kind, id, threads)]}} of each ``__global__`` kernel defined
    in ``src`` (``hi`` None where the source has no ``__launch_bounds__`` to end the block)."""
    code = _blank_literals(src)
    kernels = {}
    for g in _GLOBAL.finditer(code):
        brace, semi = code.find("{", g.end()), code.find(";", g.end())
        if brace < 0 or 0 <= semi < brace:
            continue  # a declaration
        bounds = _LAUNCH_BOUNDS.search(code, g.end(), brace)
        out = {}
        _walk(src, code, brace + 1, _block_end(code, brace) - 1, 0,
              int(bounds.group(1)) if bounds else None, out)
        kernels[len(kernels)] = {r: b for r, b in out.items() if b}
    return kernels


def role_name(role: tuple) -> str:
    lo, hi = role
    return f"threads {lo}-{hi - 1}" if hi is not None else f"threads {lo}+"


def _shared_by_design(roles: list, counts: set) -> bool:
    """One barrier the ``roles`` (thread ranges) share: disjoint, one thread count, equal to
    their threads together."""
    if len(counts) != 1 or None in counts or any(hi is None for _, hi in roles):
        return False
    spans = sorted(roles)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return False
    return sum(hi - lo for lo, hi in roles) == next(iter(counts))


def clashes(src: str) -> list:
    """One line for each named-barrier id that two roles of a kernel in ``src`` (a generated
    CUDA source) use, other than a barrier they share by design (module docstring)."""
    lines = []
    for k, roles in kernel_roles(src).items():
        users = {}  # id -> {role: [(kind, threads)]}
        for role, barriers in roles.items():
            for kind, i, n in barriers:
                users.setdefault(i, {}).setdefault(role, []).append((kind, n))
        for i, by_role in sorted(users.items()):
            if len(by_role) < 2:
                continue
            counts = {n for uses in by_role.values() for _, n in uses}
            if _shared_by_design(list(by_role), counts):
                continue
            (r1, u1), (r2, u2) = sorted(by_role.items(), key=lambda kv: kv[0][0])[:2]
            more = f" (and {len(by_role) - 2} more)" if len(by_role) > 2 else ""
            lines.append(f"{'' if k == 0 else f'kernel {k}: '}named barrier {i} used by "
                         f"{role_name(r1)} ({u1[0][0]} {i}, {u1[0][1]}) and {role_name(r2)} "
                         f"({u2[0][0]} {i}, {u2[0][1]}){more}: their warps count into one barrier")
    return lines
