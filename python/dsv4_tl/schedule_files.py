"""The schedule files ``schedules/<target>/<op>.json``, parsed (what they hold:
:mod:`dsv4_tl.schedules`). A leaf: the schedules' resolution, the tuning logs' checks of an
entry against its file (:mod:`dsv4_tl.tuning_log`) and the tuner read them here. The folder
is found through the import system without running ``dsv4_tl.schedules``: its resolution
reads the tuning logs, which read the files, so importing it here would close an import
circle."""

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

PACKAGE = "dsv4_tl.schedules"  # the schedules/ folder (pyproject's package-dir)


def schedules_folder() -> Path:
    """Where the installed ``dsv4_tl.schedules`` package lies (found, not imported)."""
    return Path(importlib.util.find_spec(PACKAGE).origin).parent


@lru_cache(maxsize=None)
def load_schedule_file(target_dir: str, op: str) -> dict:
    """The parsed ``schedules/<target_dir>/<op>.json``; FileNotFoundError names the file."""
    path = schedules_folder().joinpath(target_dir, f"{op}.json")
    if not path.is_file():
        raise FileNotFoundError(f"schedule: no schedule file {target_dir}/{op}.json")
    return json.loads(path.read_text(encoding="utf-8"))
