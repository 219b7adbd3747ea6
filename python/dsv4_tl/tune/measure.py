"""Measuring one bucket on the GPU: each candidate forced through the front end
(:func:`forcing`) with the process loader pointed at the tuning artifacts
(:func:`tuning_loader`), checked against the reference, then timed over CUDA-graph replays;
a candidate that kills the CUDA context ends the run (:class:`ContextLost`)."""

import contextlib
from pathlib import Path
from typing import Callable, Dict, List

from ..kernels import kernels_changed
from ..loader import KernelLoader, using_loader
from ..schedules import forced_schedule, load_schedule_file
from ..targets import Target
from .harness import bench_module
from .harnesses import harness_for
from .plan import BucketPlan, label, variants_of


@contextlib.contextmanager
def forcing(target: Target, op: str, config: dict):
    """Run the front ends of ``op`` with ``config`` for every shape (and nothing memoised
    from before or after leaks across)."""
    kernels_changed()
    try:
        with forced_schedule(target.dirname, op, config):
            yield
    finally:
        kernels_changed()


@contextlib.contextmanager
def tuning_loader(target: Target, kernel_dir: Path):
    """Point the process-wide loader of ``target`` at the tuning artifacts (JIT off: every
    variant was compiled by the pool)."""
    with using_loader(KernelLoader(target, kernel_dir, jit=False)):  # (drops the plans)
        yield


# Sticky CUDA errors: after one of these every later call fails, whatever it launches.
_FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "illegal instruction",
                  "misaligned address", "device-side assert", "hardware stack error",
                  "launch timed out", "an illegal")


def _context_lost(exc: BaseException) -> bool:
    import torch

    if any(m in str(exc) for m in _FATAL_MARKERS):
        return True
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


class ContextLost(RuntimeError):
    """A candidate killed the CUDA context: the process cannot measure anything more."""

    def __init__(self, message: str, config: dict):
        super().__init__(message)
        self.config = config


def measure_bucket(target: Target, p: BucketPlan, ready: Dict[str, str], device,
                   sets: int = 3, reps: int = 20, seed: int = 0,
                   on_start: Callable[[dict], None] = lambda c: None,
                   on_done: Callable[[dict], None] = lambda c: None,
                   say: Callable[[str], None] = lambda s: None) -> List[dict]:
    """``[{"config", "us"} | {"config", "error"}]`` for every kept candidate of ``p``.
    ``ready`` maps a candidate's variant key to "" (compiled) or its compile error."""
    import torch

    harness = harness_for(p.op)
    gen = torch.Generator(device).manual_seed(seed)
    inputs = harness.inputs(p.rep, gen, sets, device)
    ref = harness.reference(inputs[0], device)
    keys = list(variants_of(target, p))
    results = []
    default = load_schedule_file(target.dirname, p.op)["default"]
    for cand, key in zip(p.kept, keys):
        text = label(cand.config, default)
        if ready.get(key):
            results.append({"config": cand.config, "error": f"compile: {ready[key]}"[:400]})
            say(f"    {text:28s} compile failed")
            continue
        on_start(cand.config)  # a hard crash from here on leaves the marker behind
        try:
            with forcing(target, p.op, cand.config):
                harness.check(inputs[0], ref, device)
                us = bench_module().graph_time_us([harness.call(x) for x in inputs], reps=reps)
            results.append({"config": cand.config, "us": round(us, 3)})
            say(f"    {text:28s} {us:10.2f} us")
        except Exception as exc:  # noqa: BLE001 - logged with the candidate
            message = f"{type(exc).__name__}: {exc}"
            if _context_lost(exc):
                raise ContextLost(f"{p.op} / {p.name}: candidate {cand.config} -> {message}",
                                  cand.config) from exc
            results.append({"config": cand.config, "error": message[:400]})
            say(f"    {text:28s} rejected: {message[:100]}")
        on_done(cand.config)
    del inputs, ref
    torch.cuda.empty_cache()
    return results
