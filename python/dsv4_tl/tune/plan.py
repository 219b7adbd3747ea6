"""Planning a run (CPU only): every selected bucket with its representative input and its
candidates, kept or pruned with the reason; the short labels of configs; the
``--dry-run`` text."""

import dataclasses
import itertools
from typing import Dict, Iterable, List, Optional, Tuple

from .. import schedule_rules
from ..kernels import Variant
from ..schedules import bucket_for, load_schedule_file, schedule_for
from ..targets import Target, parse_target
from .harnesses import TUNABLE_OPS, harness_for
from .suites import SUITES, decode_tiles

DEFAULT_MAX_CANDIDATES = 8


def selected_ops(target: str, kernels: Optional[List[str]]) -> List[str]:
    """The ops ``--kernel`` names (repeatable; none or ``all``: every tunable op whose schedule
    file has a ``space``); SystemExit naming the tunable ops for any other name."""
    kernels = kernels or ["all"]
    if "all" in kernels:
        target = parse_target(target)
        return [op for op in TUNABLE_OPS if "space" in load_schedule_file(target.dirname, op)]
    for op in kernels:
        if op not in TUNABLE_OPS:
            raise SystemExit(f"dsv4-tl tune: --kernel {op!r} is not tunable; "
                             f"choose from {', '.join(TUNABLE_OPS)} or all")
    return list(dict.fromkeys(kernels))


@dataclasses.dataclass
class Candidate:
    config: dict
    role: str  # "baseline" (the bucket's file config), "default", "search"


@dataclasses.dataclass
class BucketPlan:
    op: str
    bucket: dict
    rep: object
    features: dict
    static: dict
    kept: List[Candidate]
    pruned: List[Tuple[dict, str]]

    @property
    def name(self) -> str:
        return self.bucket["name"]


def _space_configs(space: dict, base: dict) -> List[dict]:
    knobs = list(space)
    return [{**base, **dict(zip(knobs, values))}
            for values in itertools.product(*(space[k] for k in knobs))]


def prune(target_dir: str, op: str, config: dict, rep=None) -> Optional[str]:
    """Why ``config`` cannot (or need not) be compiled for ``op`` on ``target_dir``: the
    schedule's own rules (:func:`dsv4_tl.schedule_rules.prune`), then with ``rep`` (the
    bucket's representative shape) the bucket sanity rules (split-KV: no more splits than
    tiles, at most two waves). A sentence, or None when it is kept."""
    reason = schedule_rules.prune(target_dir, op, config)
    if reason is not None or rep is None or op != "sparse_decode":
        return reason
    splits = config["num_splits"]
    tiles = decode_tiles(rep, config["block_tokens"])
    if splits > tiles:
        return f"num_splits: {splits} splits > {tiles} KV tiles of a row (empty splits)"
    ctas = harness_for(op).features(target_dir, rep)["ctas"]
    arch = schedule_rules.arch_limits(target_dir)
    if arch and splits > 1 and ctas * splits > 2 * arch.sms:
        return (f"num_splits: {ctas} CTAs x {splits} splits > two waves of "
                f"{arch.sms} SMs")
    return None


def candidates(target_dir: str, op: str, bucket: dict, rep=None,
               max_candidates: int = DEFAULT_MAX_CANDIDATES,
               crashed: Iterable[dict] = ()) -> Tuple[List[Candidate], List[Tuple[dict, str]]]:
    """``(kept, pruned)`` candidates of one bucket (see the module docstring); ``pruned``
    pairs each dropped config with the reason. ``max_candidates`` <= 0: no cap."""
    spec = load_schedule_file(target_dir, op)
    default = dict(spec["default"])
    baseline = {**default, **bucket.get("config", {})}
    crashed = [dict(c) for c in crashed]
    unknown = sorted(set(spec.get("space", {})) - set(default))
    if unknown:
        raise ValueError(f"{target_dir}/{op}.json: space knobs {unknown} are not in the default")
    ordered = [(baseline, "baseline")]
    if default != baseline:
        ordered.append((default, "default"))
    search = _space_configs(spec.get("space", {}), baseline)
    distance = {i: sum(c[k] != baseline[k] for k in c) for i, c in enumerate(search)}
    for i in sorted(range(len(search)), key=lambda i: (distance[i], i)):
        if all(search[i] != c for c, _ in ordered):
            ordered.append((search[i], "search"))
    kept, pruned = [], []
    for config, role in ordered:
        if config in crashed:
            pruned.append((config, "crashed the CUDA context in an earlier run (state file)"))
            continue
        reason = prune(target_dir, op, config, rep if role == "search" else None)
        if reason is None and role != "search":
            reason = prune(target_dir, op, config)  # file configs: arch rules only
        if reason is not None:
            pruned.append((config, reason))
        elif max_candidates > 0 and len(kept) >= max_candidates and role == "search":
            pruned.append((config, f"over --max-candidates {max_candidates}"))
        else:
            kept.append(Candidate(config, role))
    return kept, pruned


def plan(target: "str | Target", ops: Iterable[str], suite: str = "dsv4",
         buckets: Optional[Iterable[str]] = None, max_candidates: int = DEFAULT_MAX_CANDIDATES,
         crashed: Optional[Dict[Tuple[str, str], list]] = None) -> List[BucketPlan]:
    """Every selected bucket with its representative input and candidates (CPU only).
    Raises ValueError when a bucket has no representative in ``suite`` or the
    representative's features fall in another bucket."""
    target = parse_target(target)
    reps_by_op = SUITES[suite]()
    wanted = set(buckets) if buckets else None
    plans, seen = [], set()
    for op in ops:
        spec = load_schedule_file(target.dirname, op)
        if "space" not in spec:
            raise ValueError(f"{target.dirname}/{op}.json has no 'space': nothing to tune")
        reps = reps_by_op.get(op, {})
        for bucket in spec.get("buckets", []):
            name = bucket.get("name")
            if name is None or (wanted is not None and name not in wanted):
                continue
            seen.add(name)
            if name not in reps:
                raise ValueError(f"suite {suite}: no representative input for {op} bucket {name!r}")
            rep = reps[name]
            features = harness_for(op).features(target.dirname, rep)
            hit = bucket_for(spec, features)
            if hit is not bucket:
                raise ValueError(f"suite {suite}: the representative of {op} bucket {name!r} "
                                 f"({rep.name}, features {features}) falls in bucket "
                                 f"{None if hit is None else hit.get('name')!r}")
            kept, pruned = candidates(target.dirname, op, bucket, rep, max_candidates,
                                      (crashed or {}).get((op, name), ()))
            plans.append(BucketPlan(op, bucket, rep, features, harness_for(op).static(rep), kept, pruned))
    if wanted is not None and wanted - seen:
        raise ValueError(f"--bucket: no bucket named {', '.join(sorted(wanted - seen))} in "
                         f"{', '.join(ops)} for {target.name}")
    return plans


def variants_of(target: Target, p: BucketPlan) -> Dict[str, List[Variant]]:
    """Variant key of each candidate -> the variants it needs (decode splits: the combine)."""
    out = {}
    for cand in p.kept:
        needed = [Variant.make(p.op, p.static, cand.config)]
        if p.op == "sparse_decode" and cand.config["num_splits"] > 1:
            combine = schedule_for(target.dirname, "sparse_decode_combine")
            needed.append(Variant.make("sparse_decode_combine",
                                       dict(num_heads=p.static["num_heads"],
                                            num_splits=cand.config["num_splits"]), combine))
        out[needed[0].key] = needed
    return out


_ABBREV = {"block_tokens": "bt", "heads_per_block": "hb", "threads": "th", "num_splits": "ns",
           "warp_specialized": "ws", "num_stages": "st", "tokens_per_block": "tb",
           "target_ctas": "ctas", "cols_per_block": "cb"}


def label(config: dict, reference: Optional[dict] = None) -> str:
    """Short text of ``config``'s knobs (only those differing from ``reference``)."""
    items = [(k, v) for k, v in config.items() if reference is None or reference.get(k) != v]
    if not items:
        return "(default)"
    return " ".join(f"{_ABBREV.get(k, k)}{int(v) if isinstance(v, bool) else v}" for k, v in items)


def format_plan(target: Target, plans: List[BucketPlan]) -> str:
    lines = []
    total_kept, keys = 0, set()
    for p in plans:
        default = load_schedule_file(target.dirname, p.op)["default"]
        lines.append(f"{p.op} / {p.name}: {p.rep.name}  features {p.features}")
        for cand in p.kept:
            lines.append(f"  keep   {cand.role:8s} {label(cand.config, default)}")
        by_reason = {}
        for config, reason in p.pruned:
            by_reason.setdefault(reason, []).append(label(config, default))
        for reason, labels in by_reason.items():
            lines.append(f"  prune  {len(labels):2d} x {reason}: {', '.join(labels)}")
        total_kept += len(p.kept)
        for needed in variants_of(target, p).values():
            keys.update(v.key for v in needed)
    lines.append(f"{len(plans)} buckets, {total_kept} candidate runs, {len(keys)} distinct "
                 f"kernel variants to compile for {target.name}")
    return "\n".join(lines)
