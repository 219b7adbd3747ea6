"""Crash state between runs: ``<out>/<target>/.<op>.state.json`` records the candidate in
flight and the ones that killed the CUDA context or hung, which later runs prune."""

import json
from pathlib import Path
from typing import Iterable

from ..targets import Target


def state_path(out: Path, target: Target, op: str) -> Path:
    return Path(out) / target.dirname / f".{op}.state.json"


def load_crashed(out: Path, target: Target, ops: Iterable[str], say=print,
                 write: bool = True) -> dict:
    """``{(op, bucket): [configs]}`` that crashed earlier runs; an in-flight marker left by a
    run that died mid-candidate counts as a crash (and, with ``write``, is recorded so)."""
    crashed = {}
    for op in ops:
        path = state_path(out, target, op)
        if not path.is_file():
            continue
        state = json.loads(path.read_text())
        inflight = state.pop("inflight", None)
        if inflight:
            say(f"note: a previous run died while measuring {op} / {inflight['bucket']} "
                f"{inflight['config']}: it is pruned from now on")
            state.setdefault("crashed", []).append(inflight)
            if write:
                path.write_text(json.dumps(state, indent=1, sort_keys=True))
        for rec in state.get("crashed", []):
            crashed.setdefault((op, rec["bucket"]), []).append(rec["config"])
    return crashed


def write_state(out: Path, target: Target, op: str, inflight=None, crashed=None) -> None:
    path = state_path(out, target, op)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = json.loads(path.read_text()) if path.is_file() else {}
    if inflight is not None:
        state["inflight"] = inflight
    else:
        state.pop("inflight", None)
    if crashed is not None:
        state.setdefault("crashed", []).append(crashed)
    path.write_text(json.dumps(state, indent=1, sort_keys=True))
