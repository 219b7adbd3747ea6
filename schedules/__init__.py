"""Per-target schedules: the knobs of each kernel, as small JSON files.

``schedules/<target>/<op>.json`` holds a ``default`` config (valid for every shape) and an
ordered list of ``buckets``; each bucket has ``match`` (feature -> ``[lo, hi)`` range) and the
config keys it overrides. :func:`schedule_for` returns the default merged with the first
bucket whose ranges all contain the call's features, so the kernel definitions in
``tile_kernels/`` never hard-code a schedule.
"""

import json
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def load_schedule_file(target_dir: str, op: str) -> dict:
    """The parsed ``schedules/<target_dir>/<op>.json``; FileNotFoundError names the file."""
    path = resources.files(__name__).joinpath(target_dir, f"{op}.json")
    if not path.is_file():
        raise FileNotFoundError(f"schedule: no schedule file {target_dir}/{op}.json")
    return json.loads(path.read_text())


def _matches(match: dict, features: dict) -> bool:
    for name, (lo, hi) in match.items():
        value = features.get(name)
        if value is None or not (lo <= value < hi):
            return False
    return True


def schedule_for(target_dir: str, op: str, **features: int) -> dict:
    """Default config of ``op`` on ``target_dir`` overridden by the first matching bucket."""
    spec = load_schedule_file(target_dir, op)
    config = dict(spec["default"])
    for bucket in spec.get("buckets", []):
        if _matches(bucket["match"], features):
            config.update(bucket["config"])
            break
    return config
