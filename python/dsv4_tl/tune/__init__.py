"""``dsv4-tl tune``: measure the schedule candidates of each shape bucket on a GPU and log the
winners in ``tuning_logs/<target>/<op>.jsonl`` (read back by ``schedule_for`` and builds).

For each selected bucket of ``schedules/<target>/<op>.json``:

1. **Candidates** = the cartesian product of the file's ``space`` (knob -> values) applied
   to the bucket's config, pruned *before compiling* (:func:`.plan.prune`: the schedule's
   own rules, :mod:`dsv4_tl.schedule_rules`, then the bucket's): arch limits of the target
   (shared memory per block estimated from the tile sizes by :func:`smem_bytes`,
   per-thread accumulator registers by :func:`acc_registers`, threads per block, wgmma for
   the warp-specialised schedule), layout rules of the kernel builders, and bucket sanity
   (split-KV: no more splits than tiles, at most two waves). The bucket's own config
   (``baseline``) and the file's ``default`` are always measured; the rest are taken
   nearest-first (fewest knobs changed from the baseline, then the space's value order) up
   to ``--max-candidates``. ``--dry-run`` prints all this on any machine.
2. **Compile** every kept (static, schedule) variant in a process pool with
   :func:`dsv4_tl.loader.compile_jit` into ``<artifacts>/<hash>/<target>/jit/`` (hash of
   the kernel sources and TileLang version; verified existing files are reused), while the GPU
   measures the buckets already compiled.
3. **Measure** on the bucket's representative input (suite ``dsv4``: spec §8 shapes, made by
   :mod:`dsv4_tl.bench`'s input makers): each candidate runs through the *same front end*
   (``dsv4_tl.ops``) with its schedule forced (:func:`.measure.forcing`: a
   :func:`dsv4_tl.schedules.forced_schedule` plus the front ends' memo caches dropped, and
   the process loader pointed at the tuning artifacts). Outputs are poisoned, then checked
   against the float32 reference with the GPU tests' tolerances (bit-exact for the gather
   and index ops); a failing candidate is logged with its error and never wins. The rest
   are timed with CUDA events: median µs per call over CUDA-graph replays of calls cycling
   through distinct input sets (:func:`dsv4_tl.bench.graph_time_us`).
4. **Log**: one entry per bucket (:mod:`dsv4_tl.tuning_log`): best config (the baseline stays
   best unless a candidate beats it by more than ``--min-gain``, so noise does not churn
   builds), every candidate's time, the default's, device, driver and toolchain.

``--resume`` skips buckets already logged for this device and TileLang version (an
interrupted or time-limited run continues; ``--force`` re-tunes them). A candidate that
kills the CUDA context (exit status 4) or runs past ``--candidate-timeout`` (a hung kernel:
the watchdog exits with status 5) is recorded in ``<out>/<target>/.<op>.state.json`` and
pruned on the next run. ``--time-budget`` stops starting new buckets after that many
seconds (exit status 3). Exit status 1: some bucket had no passing candidate.
``--report [--png PATH]`` prints the logged results as a table and draws them.

The package, one job per module (the resource model and pruning rules are
:mod:`dsv4_tl.schedule_rules`, which the front ends' tuning logs read too): :mod:`.suites`
(representative inputs), :mod:`.harnesses` (the table of tunable ops, each an
:class:`~.harness.OpHarness`: the op's spec, which derives the features and static
parameters of the call a representative input makes, inputs, reference, check, timed
call), :mod:`.plan` (candidates per bucket, ``--dry-run``), :mod:`.measure` (one bucket on
the GPU), :mod:`.entries` (log entries), :mod:`.state` (crash state), :mod:`.run` (a run),
:mod:`.report` (``--report``), :mod:`.cli` (the command line).
"""

from ..schedule_rules import acc_registers, arch_limits, smem_bytes
from .cli import build_parser, main
from .entries import make_entry
from .harness import OpHarness
from .harnesses import HARNESSES, TUNABLE_OPS, harness_for
from .measure import forcing, measure_bucket, tuning_loader
from .plan import (DEFAULT_MAX_CANDIDATES, BucketPlan, Candidate, candidates, format_plan, label, plan,
                   prune)
from .report import report
from .run import run
from .state import load_crashed, state_path, write_state
from .suites import SUITES

__all__ = ["DEFAULT_MAX_CANDIDATES", "HARNESSES", "SUITES", "TUNABLE_OPS", "BucketPlan",
           "Candidate", "OpHarness", "acc_registers", "arch_limits", "build_parser", "candidates",
           "forcing", "format_plan", "harness_for", "label", "load_crashed", "main", "make_entry",
           "measure_bucket", "plan", "prune", "report", "run", "smem_bytes", "state_path",
           "tuning_loader", "write_state"]
