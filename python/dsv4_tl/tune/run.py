"""A tuning run on the GPU: compile the candidates in a process pool while measuring the
buckets already compiled, log each bucket's entry, stop on a lost context, a hung candidate
or the time budget (exit statuses in :mod:`dsv4_tl.tune`)."""

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .. import tuning_log
from ..schedules import load_schedule_file
from ..targets import Target, parse_target
from .entries import device_info, kernel_sources_hash, make_entry, toolchain
from .measure import ContextLost, measure_bucket, tuning_loader
from .plan import BucketPlan, label, plan, selected_ops, variants_of
from .state import load_crashed, state_path, write_state


def _hung(p: BucketPlan, config: dict, say) -> None:
    """Watchdog: a candidate ran past --candidate-timeout (a kernel that never finishes).
    The in-flight marker is on disk, so the next run prunes it; exit now (status 5)."""
    say(f"FATAL: {p.op} / {p.name}: candidate {config} still running after the "
        "--candidate-timeout; it will be pruned on the next run (--resume). Exiting.")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(5)


def _compile_jit_job(variant, target: Target, kernel_dir: Path) -> Path:
    """Pool job: a candidate compiled as the loader's JIT would (artifact + provenance record),
    so the tuning loader (JIT off) loads it verified."""
    import logging

    from ..loader import compile_jit

    logging.getLogger("tilelang").setLevel(logging.WARNING)  # one line per kernel is noise here
    return compile_jit(variant, target, kernel_dir)


def _artifact_root(artifacts: Optional[str]) -> Path:
    from ..build import toolchain_versions
    from ..loader import default_kernel_dir

    root = Path(artifacts) if artifacts else default_kernel_dir() / "tune"
    tag = hashlib.sha256((kernel_sources_hash() + json.dumps(toolchain_versions(), sort_keys=True))
                         .encode()).hexdigest()[:12]
    return root / tag


def run(args: argparse.Namespace, say=print) -> int:
    import torch

    from ..loader import jit_artifact_path

    if not torch.cuda.is_available():
        print("dsv4-tl tune: measuring needs a CUDA device (--dry-run and --report work "
              "anywhere)", file=sys.stderr)
        return 2
    start = time.time()
    target = parse_target(args.target)
    device = torch.device(args.device)
    ops = selected_ops(args.target, args.kernel)
    out = Path(args.out)
    crashed = load_crashed(out, target, ops, say)
    try:
        plans = plan(target, ops, args.suite, args.bucket, args.max_candidates, crashed)
    except ValueError as exc:
        print(f"dsv4-tl tune: {exc}", file=sys.stderr)
        return 2
    info, tools = device_info(device), toolchain()
    from ..targets import target_for_device

    if target_for_device(device) != target:
        print(f"dsv4-tl tune: {info['device']} runs {target_for_device(device).name} kernels, "
              f"not {target.name}", file=sys.stderr)
        return 2
    if args.resume and not args.force:
        todo = []
        for p in plans:
            spec = load_schedule_file(target.dirname, p.op)
            current = set(spec["default"])
            old_ok = set(spec.get("added_knobs", {}))
            # an entry of an older knob set that the schedule file no longer applies
            # (schedules._logged_config) is not "done": it is re-tuned
            # (retired knobs at their off values are dropped first, as schedules does)
            logged = tuning_log.entries_for(tuning_log.log_path(out, target.dirname, p.op),
                                            info["device"], tools["tilelang"])
            bests = [(e, tuning_log.without_retired_knobs(spec, e["best"])[0]) for e in logged]
            done = [e for e, best in bests
                    if best is not None and e["bucket"] == p.name and e["match"] == p.bucket["match"]
                    and set(best) <= current and current - set(best) <= old_ok]
            if done:
                say(f"skip {p.op} / {p.name}: logged {done[-1]['date']} (--force re-tunes)")
            else:
                todo.append(p)
        plans = todo
    if not plans:
        say("nothing to tune")
        return 0

    kdir = _artifact_root(args.artifacts)
    needed, order = {}, []
    for p in plans:
        for vs in variants_of(target, p).values():
            for v in vs:
                if v.key not in needed:
                    needed[v.key] = v
                    order.append(v)
    missing = [v for v in order if not jit_artifact_path(kdir, target, v).is_file()]
    say(f"{info['device']} ({info['sms']} SMs), driver {info['driver']}, TileLang {tools['tilelang']}, "
        f"torch {tools.get('torch')}; {len(plans)} buckets, {len(order)} variants "
        f"({len(missing)} to compile) in {kdir}")
    jobs = args.jobs or max(1, (os.cpu_count() or 2) - 1)
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) if missing else None
    futures = {}
    for v in missing:
        futures[v.key] = pool.submit(_compile_jit_job, v, target, kdir)
    status = 0
    from tqdm import tqdm

    # Progress over the buckets (tqdm comes with TileLang); printed lines go above the bar.
    bar = tqdm(total=len(plans), desc=f"tune {target.name}", unit="bucket", file=sys.stderr,
               dynamic_ncols=True, disable=not sys.stderr.isatty())
    if say is print and not bar.disable:
        say = tqdm.write
    try:
        with tuning_loader(target, kdir):
            for i, p in enumerate(plans, 1):
                bar.n = i - 1
                bar.set_postfix_str(f"{p.op} / {p.name}")
                if args.time_budget and time.time() - start > args.time_budget:
                    say(f"time budget of {args.time_budget:.0f} s reached: {len(plans) - i + 1} "
                        "buckets left (re-run with --resume)")
                    status = 3
                    break
                say(f"[{i}/{len(plans)}] {p.op} / {p.name}: {p.rep.name} "
                    f"({len(p.kept)} candidates, {time.time() - start:.0f} s)")
                ready = {}
                for key, vs in variants_of(target, p).items():
                    errors = []
                    for v in vs:
                        fut = futures.get(v.key)
                        if fut is not None:
                            try:
                                fut.result()
                            except Exception as exc:  # noqa: BLE001 - the candidate's error
                                errors.append(str(exc).splitlines()[0][:300])
                    ready[key] = "; ".join(errors)
                watchdog = []

                def started(config, p=p):
                    write_state(out, target, p.op, inflight={"bucket": p.name, "config": config})
                    if args.candidate_timeout:
                        timer = threading.Timer(args.candidate_timeout, _hung, (p, config, say))
                        timer.daemon = True
                        timer.start()
                        watchdog.append(timer)

                def finished(config, p=p):
                    while watchdog:
                        watchdog.pop().cancel()
                    write_state(out, target, p.op)

                try:
                    results = measure_bucket(target, p, ready, device, seed=args.seed,
                                             on_start=started, on_done=finished, say=say)
                except ContextLost as exc:
                    write_state(out, target, p.op, crashed={"bucket": p.name, "config": exc.config})
                    say(f"FATAL: {exc}\nThe candidate is recorded in "
                        f"{state_path(out, target, p.op)} and will be pruned; re-run with --resume.")
                    return 4
                entry = make_entry(target, p, results, info, tools, args.min_gain)
                if entry is None:
                    say(f"  no candidate of {p.name} passed: nothing logged")
                    status = 1
                    continue
                tuning_log.append_entry(tuning_log.log_path(out, target.dirname, p.op), entry)
                default = load_schedule_file(target.dirname, p.op)["default"]
                gain = (f", {entry['baseline_us'] / entry['best_us']:.2f}x vs the file's config"
                        if entry.get("baseline_us") else "")
                say(f"  best: {label(entry['best'], default)} {entry['best_us']:.2f} us{gain}")
    finally:
        bar.close()
        if pool is not None:  # compiles nobody will measure: stop them rather than wait
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in workers:
                if proc.is_alive():
                    proc.terminate()
    say(f"done in {time.time() - start:.0f} s; logs in {out / target.dirname}")
    return status
