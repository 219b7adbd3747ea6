"""The tuning-log entry of one measured bucket (:mod:`dsv4_tl.tuning_log` reads and checks
them): best config, every candidate's time, the default's, device, driver, toolchain."""

import datetime
import json
import subprocess
from typing import List, Optional

from .. import tuning_log
from ..schedules import load_schedule_file
from ..targets import Target
from .plan import BucketPlan


def device_info(device) -> dict:
    import torch

    props = torch.cuda.get_device_properties(device)
    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.strip().splitlines()[0] or driver
    except Exception:  # noqa: BLE001 - informational only
        pass
    return {"device": props.name, "sms": props.multi_processor_count, "driver": driver,
            "cuda": str(torch.version.cuda)}


def toolchain() -> dict:
    from ..build import toolchain_versions

    return toolchain_versions()


def make_entry(target: Target, p: BucketPlan, results: List[dict], info: dict, tools: dict,
               min_gain: float = 0.01, date: Optional[str] = None) -> Optional[dict]:
    """The log entry of one measured bucket (None when no candidate passed)."""
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    if not timed:
        return None
    failed = [r for r in results if "us" not in r]
    spec = load_schedule_file(target.dirname, p.op)
    default = dict(spec["default"])
    baseline = {**default, **p.bucket.get("config", {})}
    time_of = {json.dumps(r["config"], sort_keys=True): r["us"] for r in timed}
    best = timed[0]
    base_us = time_of.get(json.dumps(baseline, sort_keys=True))
    if base_us is not None and base_us <= best["us"] * (1 + min_gain):
        best = {"config": baseline, "us": base_us}  # within noise: keep the file's config
    entry = {
        "format": tuning_log.FORMAT, "target": target.name, "op": p.op, "bucket": p.name,
        "match": p.bucket["match"], "features": p.features, "shape": p.rep.name,
        "best": best["config"], "best_us": best["us"],
        "default": default, "default_us": time_of.get(json.dumps(default, sort_keys=True)),
        "baseline": baseline, "baseline_us": base_us,
        "candidates": timed + failed, "pruned": len(p.pruned),
        "device": info["device"], "driver": info["driver"], "toolchain": tools,
        "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for key in ("sms", "cuda"):
        if key in info:
            entry[key] = info[key]
    entry["source_hash"] = kernel_sources_hash()
    tuning_log.check_entry(entry)
    return entry


def kernel_sources_hash() -> str:
    from ..provenance import kernel_sources_digest

    return kernel_sources_digest()[:16]
