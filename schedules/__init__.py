"""Per-target schedules: the knobs of each kernel, as small JSON files.

``schedules/<target>/<op>.json`` holds

* ``default``: a config (knob -> value) valid for every shape;
* ``buckets``: an ordered list of shape buckets, each with a ``name`` (what tuning logs
  key on; an unnamed bucket is never looked up in the logs), ``match`` (feature ->
  ``[lo, hi)``, ``hi`` null = unbounded; or, for a string feature such as decode's
  ``scope``, a list of accepted values) and ``config``, the knobs it overrides;
* ``space`` (optional): knob -> candidate values, what ``dsv4-tl tune`` searches
  (first value = preferred; see :mod:`dsv4_tl.tune`);
* ``added_knobs`` (optional): knob -> the value that reproduces the kernel of before the
  knob existed. A tuning log entry that lacks such a knob still applies, with that value;
  an entry lacking any other knob is ignored with a warning (re-tune);
* ``retired_knobs`` (optional): knob -> its off value, for a knob whose code left main (a
  refuted lever; ``bench/PERF_NOTES.md`` names the commit that still has it). A tuning log
  entry naming it at that value still applies, without it; one naming another value is
  ignored with a warning (:func:`dsv4_tl.tuning_log.without_retired_knobs`). Neither the
  default, a bucket's config, ``space`` nor ``added_knobs`` may name a retired knob.

:func:`schedule_for` resolves a call's features to a config: the first bucket whose ranges
all contain the call's features (a bucket naming a feature the caller does not pass does not
match); its config is the logged best of that bucket when ``tuning_logs/<target>/<op>.jsonl``
has a valid entry for this TileLang version (:mod:`dsv4_tl.tuning_log`; knobs added to the
file's default since then take their default value), else the default
merged with the bucket's ``config``, with a warning naming the bucket (once per bucket per
process). No bucket matching: the default. So the kernel definitions in ``tile_kernels/``
never hard-code a schedule.

:func:`forced_schedule` pins one config for every shape of an op (``dsv4-tl tune`` uses it to
run candidates through the front ends). Both it and :func:`clear_caches` call
:func:`dsv4_tl.kernels.kernels_changed` (defined in :mod:`dsv4_tl.invalidation`), so no
memoised resolution or launch plan of the front ends (``ops/``) outlives them.
"""

import contextlib
import threading
import warnings
from typing import Iterator, List, Optional, Tuple

from .. import tuning_log
from ..invalidation import kernels_changed
# (read in a leaf, which the tuning logs' checks import too; one cache, cleared below)
from ..schedule_files import load_schedule_file


def in_range(value, rng) -> bool:
    """Whether a feature value lies in a bucket's ``match`` range (or list of strings)."""
    if isinstance(value, str) or (rng and all(isinstance(v, str) for v in rng)):
        return value in rng
    lo, hi = rng
    return lo <= value and (hi is None or value < hi)


def _matches(match: dict, features: dict) -> bool:
    for name, rng in match.items():
        value = features.get(name)
        if value is None or not in_range(value, rng):
            return False
    return True


def bucket_for(spec: dict, features: dict) -> Optional[dict]:
    """The first bucket of ``spec`` whose ``match`` contains ``features``, or None."""
    for bucket in spec.get("buckets", []):
        if _matches(bucket["match"], features):
            return bucket
    return None


def bucket_name(bucket: dict, index: int) -> str:
    """A bucket's name (unnamed buckets of older files: ``bucket<index>``)."""
    return bucket.get("name", f"bucket{index}")


# ------------------------------------------------------------------------------ logs
_no_log_warned: set = set()
_lock = threading.Lock()


def _warn_once(key: tuple, message: str) -> None:
    """One warning per key per process (cleared by clear_caches)."""
    with _lock:
        fresh = key not in _no_log_warned
        _no_log_warned.add(key)
    if fresh:
        # stacklevel: the caller of schedule_for / KernelSpec.schedules
        warnings.warn(message, stacklevel=5)


def _logged_config(target_dir: str, op: str, spec: dict, bucket: dict, index: int,
                   warn: bool = True) -> Tuple[dict, str]:
    """``(config, source)`` of one bucket: the logged best (source ``"log"``) or the
    schedule file's default + bucket config (source ``"file"``, with the warning)."""
    if "name" not in bucket:  # unnamed buckets (HIP files) are not tuned: no log, no warning
        return {**spec["default"], **bucket["config"]}, "file"
    name = bucket["name"]
    entry = tuning_log.select_entry(target_dir, op, name, match=bucket["match"])
    if entry is not None:
        best = entry["best"]
        missing = set(spec["default"]) - set(best)
        added = spec.get("added_knobs", {})
        if set(best) <= set(spec["default"]) and missing <= set(added):
            # A knob added to the file after the entry was logged takes the value that keeps
            # the kernel the entry measured (the file's ``added_knobs``; not the default,
            # which may have moved since).
            return {**spec["default"], **{k: added[k] for k in missing}, **best}, "log"
        _warn_once(("knobs", target_dir, op, name),
                   f"schedule: the tuning log entry of {target_dir}/{op} bucket {name!r} "
                   f"has knobs {sorted(best)}, the schedule file {sorted(spec['default'])}: "
                   "ignored (re-run dsv4-tl tune)")
    elif warn:
        _warn_once(("nolog", target_dir, op, name),
                   f"schedule: no tuning log entry for {target_dir}/{op} bucket {name!r} "
                   f"(TileLang {tuning_log.current_tilelang()}): using the schedule "
                   "file's config; run dsv4-tl tune to measure it")
    return {**spec["default"], **bucket["config"]}, "file"


def resolved_buckets(target_dir: str, op: str) -> List[Tuple[dict, dict, str]]:
    """``(bucket, config, source)`` for every bucket of ``op``, in file order; ``source``
    is ``"log"`` or ``"file"`` (see :func:`schedule_for`)."""
    spec = load_schedule_file(target_dir, op)
    return [(b, *_logged_config(target_dir, op, spec, b, i))
            for i, b in enumerate(spec.get("buckets", []))]


# ------------------------------------------------------------------------------ forcing
_forced: dict = {}


@contextlib.contextmanager
def forced_schedule(target_dir: str, op: str, config: dict) -> Iterator[None]:
    """Within the block, :func:`schedule_for` returns ``config`` for every shape of ``op``
    on ``target_dir`` (tuning). Not for concurrent use from several threads."""
    key = (target_dir, op)
    previous = _forced.get(key)
    _forced[key] = dict(config)
    kernels_changed()
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(key, None)
        else:
            _forced[key] = previous
        kernels_changed()


def schedule_for(target_dir: str, op: str, **features) -> dict:
    """The config of ``op`` on ``target_dir`` for a call with ``features`` (see the module
    docstring): forced config, else the matching bucket's (logged or file) config, else the
    default."""
    forced = _forced.get((target_dir, op))
    if forced is not None:
        return dict(forced)
    return schedule_of_bucket(target_dir, op, bucket_index(target_dir, op, **features))


def bucket_index(target_dir: str, op: str, **features) -> Optional[int]:
    """The index of the first bucket of ``op``'s schedule file on ``target_dir`` whose ranges
    contain ``features``, or None (the default serves them). Everything a call's features
    decide about its schedule: memos of resolved schedules key on it, which bounds them by
    the number of buckets whatever the features' values."""
    for index, bucket in enumerate(load_schedule_file(target_dir, op).get("buckets", [])):
        if _matches(bucket["match"], features):
            return index
    return None


def schedule_of_bucket(target_dir: str, op: str, index: Optional[int]) -> dict:
    """The config of bucket ``index`` of ``op`` on ``target_dir`` (:func:`bucket_index`; None:
    the default), or the forced config (:func:`forced_schedule`)."""
    forced = _forced.get((target_dir, op))
    if forced is not None:
        return dict(forced)
    spec = load_schedule_file(target_dir, op)
    if index is None:
        return dict(spec["default"])
    return _logged_config(target_dir, op, spec, spec["buckets"][index], index)[0]


def clear_caches() -> None:
    """Re-read schedule files and logs (after swapping ``$DSV4_TL_TUNING_LOGS`` or editing a
    log in a running process), warn again, and drop the front ends' memoised resolutions."""
    load_schedule_file.cache_clear()
    tuning_log.clear_caches()
    with _lock:
        _no_log_warned.clear()
    kernels_changed()
