"""Stored tuning results: ``tuning_logs/<target dirname>/<op>.jsonl``, append-only.

One JSON object per line, written by ``dsv4-tl tune`` on a GPU and read by
:func:`dsv4_tl.schedules.schedule_for` (run time) and
:meth:`dsv4_tl.kernels.KernelSpec.schedules` (ahead-of-time builds). An entry records one
shape bucket of one op on one device::

    {"format": 1, "target": "cuda:sm_90a", "op": "sparse_decode",
     "bucket": "h64_c4a_ctas1_16", "match": {"h": [1, 65], "scope": ["c4a"], "ctas": [1, 17]},
     "features": {"h": 64, "scope": "c4a", "ctas": 8},      # the representative input
     "shape": "decode h64 b8 window 128 + C4A 512 (bs 64)",
     "best": {...full config...}, "best_us": 41.2,
     "default": {...the schedule file's default...}, "default_us": 80.3,
     "baseline": {...the bucket's config in the schedule file...}, "baseline_us": 52.0,
     "candidates": [{"config": {...}, "us": 41.2}, ..., {"config": {...}, "error": "..."}],
     "device": "NVIDIA H200", "driver": "570.172.08",
     "toolchain": {"tilelang": "0.1.15", "torch": "2.13.0", ...},
     "date": "2026-11-21T08:00:00+00:00"}

``candidates`` holds every timed candidate, fastest first (the runner-ups), then the ones
that failed to compile, to run or the reference check (``error``). Times are microseconds
per call: medians over CUDA-graph replays with rotated inputs.

Selection (:func:`select_entry`): the entries of ``(target, op, bucket)`` whose TileLang
version is this process's; the newest (``date`` as a time-zone-aware datetime, then line
order) wins. Ignored with a warning: entries of another TileLang version, entries whose
``target`` is not the directory's (a ``hip:gfx942`` entry in ``cuda_sm90a/``), entries whose
bucket ranges differ from the schedule file's (the bucket was redefined after tuning) and
entries whose best config sets a knob to a value it could never have been tuned to (outside
the schedule's ``space``, or, for a knob the space does not vary, other than the default's
and the bucket's; values compare by type too: ``true`` is not ``1``, ``2.0`` not ``2``) and
entries whose best config sets a knob the schedule file has retired (``retired_knobs``: knob ->
its off value; the knob's code left main) to another value than its off value (an entry
naming it at the off value applies, the knob dropped: :func:`without_retired_knobs`),
entries whose best config breaks the schedule's own validity rule (:func:`invalid_reason`,
the rules ``dsv4-tl tune`` prunes candidates by): they would fail every build of the bucket,
or build a kernel under another key than the one the front ends ask for. A ``date`` without a
time zone or in the future makes a line malformed (it would win every later comparison). Malformed lines are skipped
with a warning naming the file and line; so is, with one warning naming it, a whole file
that is not a regular file (a FIFO would block the reader, ``/dev/zero`` fill its memory),
holds over :data:`MAX_LOG_BYTES`, or, outside the installed package's logs, is owned by
another user than this one or root or writable by its group or others (the kernel
directory's rule, :mod:`dsv4_tl.trust`: a log picks the kernels that are built and run).
The log root is ``$DSV4_TL_TUNING_LOGS`` when set, else the installed
``dsv4_tl.tuning_logs`` package (the repository's ``tuning_logs/``).

No dependency beyond the standard library: the schema is checked by :func:`validate_entry`.
"""

import datetime
import io
import json
import os
import shlex
import stat
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

ENV_LOG_DIR = "DSV4_TL_TUNING_LOGS"
FORMAT = 1

# field -> (accepted types, required). bool is excluded from numbers explicitly below.
_FIELDS = {
    "format": ((int,), True),
    "target": ((str,), True),
    "op": ((str,), True),
    "bucket": ((str,), True),
    "match": ((dict,), True),
    "features": ((dict,), True),
    "shape": ((str,), True),
    "best": ((dict,), True),
    "best_us": ((int, float), True),
    "default": ((dict,), True),
    "default_us": ((int, float, type(None)), True),
    "baseline": ((dict,), False),
    "baseline_us": ((int, float, type(None)), False),
    "candidates": ((list,), True),
    "device": ((str,), True),
    "driver": ((str,), True),
    "toolchain": ((dict,), True),
    "date": ((str,), True),
    "sms": ((int,), False),
    "cuda": ((str,), False),
    "source_hash": ((str,), False),
    "pruned": ((int,), False),
    "notes": ((str,), False),
}
_KNOB_TYPES = (bool, int, float, str)


# Clock skew between the tuning machine and this one that a fresh entry's date may show.
_DATE_SKEW = datetime.timedelta(minutes=10)


def entry_date(entry: dict) -> datetime.datetime:
    """The entry's ``date`` as an aware datetime; ValueError when it is not an ISO 8601
    timestamp with a time zone, or lies in the future."""
    text = entry["date"]
    try:
        date = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"expected an ISO 8601 timestamp, got {text!r}") from None
    if date.tzinfo is None or date.utcoffset() is None:
        raise ValueError(f"expected a time zone (e.g. +00:00), got {text!r}")
    if date > datetime.datetime.now(datetime.timezone.utc) + _DATE_SKEW:
        raise ValueError(f"{text!r} is in the future")
    return date


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_config(where: str, config, errors: list) -> None:
    if not isinstance(config, dict) or not config:
        errors.append(f"{where}: expected a non-empty object of knob -> value")
        return
    for knob, value in config.items():
        if not isinstance(value, _KNOB_TYPES):
            errors.append(f"{where}.{knob}: expected a bool, number or string, got {value!r}")


def validate_match(where: str, match, errors: list) -> None:
    """A bucket's ``match``: feature -> ``[lo, hi)`` (numbers; ``hi`` null = unbounded) or
    a non-empty list of strings (membership)."""
    if not isinstance(match, dict):
        errors.append(f"{where}: expected an object")
        return
    for name, rng in match.items():
        ok = isinstance(rng, list) and len(rng) >= 1
        if ok and all(isinstance(v, str) for v in rng):
            continue
        ok = (ok and len(rng) == 2 and _is_number(rng[0])
              and (rng[1] is None or (_is_number(rng[1]) and rng[1] > rng[0])))
        if not ok:
            errors.append(f"{where}.{name}: expected [lo, hi) with lo < hi (hi may be null) "
                          f"or a list of strings, got {rng!r}")


def validate_entry(entry) -> List[str]:
    """Every schema violation of one log entry (empty list: valid)."""
    if not isinstance(entry, dict):
        return ["entry: expected a JSON object"]
    errors = []
    for field, (types, required) in _FIELDS.items():
        if field not in entry:
            if required:
                errors.append(f"{field}: missing")
            continue
        value = entry[field]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            errors.append(f"{field}: expected {names}, got {type(value).__name__}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        errors.append(f"unknown fields: {', '.join(unknown)}")
    if errors:
        return errors
    if entry["format"] != FORMAT:
        errors.append(f"format: expected {FORMAT}, got {entry['format']}")
    for field in ("best_us", "default_us", "baseline_us"):
        if _is_number(entry.get(field)) and not entry[field] > 0:
            errors.append(f"{field}: expected a positive time in µs, got {entry[field]}")
    validate_match("match", entry["match"], errors)
    _check_config("best", entry["best"], errors)
    _check_config("default", entry["default"], errors)
    if "baseline" in entry:
        _check_config("baseline", entry["baseline"], errors)
    if not isinstance(entry["toolchain"].get("tilelang"), str):
        errors.append("toolchain.tilelang: missing (the version selection keys on it)")
    try:
        entry_date(entry)
    except ValueError as exc:
        errors.append(f"date: {exc}")
    timed = []
    for i, cand in enumerate(entry["candidates"]):
        where = f"candidates[{i}]"
        if not isinstance(cand, dict) or "config" not in cand:
            errors.append(f"{where}: expected an object with 'config'")
            continue
        _check_config(f"{where}.config", cand["config"], errors)
        has_us, has_err = "us" in cand, "error" in cand
        if has_us == has_err:
            errors.append(f"{where}: expected exactly one of 'us' and 'error'")
        elif has_us and not (_is_number(cand["us"]) and cand["us"] > 0):
            errors.append(f"{where}.us: expected a positive number, got {cand['us']!r}")
        elif has_err and not isinstance(cand["error"], str):
            errors.append(f"{where}.error: expected a string")
        elif has_us:
            timed.append(cand)
        extra = set(cand) - {"config", "us", "error"}
        if extra:
            errors.append(f"{where}: unknown fields {', '.join(sorted(extra))}")
    if not errors:
        if not any(c["config"] == entry["best"] and c["us"] == entry["best_us"] for c in timed):
            errors.append("best: not among the timed candidates with best_us")
        if set(entry["best"]) != set(entry["default"]):
            errors.append("best: knobs differ from default's")
    return errors


def check_entry(entry) -> None:
    """Raise ValueError listing every schema violation of ``entry``."""
    errors = validate_entry(entry)
    if errors:
        raise ValueError("tuning log entry: " + "; ".join(errors))


# ------------------------------------------------------------------------------ files
def log_root() -> Path:
    """``$DSV4_TL_TUNING_LOGS`` or the installed ``dsv4_tl.tuning_logs`` package; a
    ``$DSV4_TL_TUNING_LOGS`` that names something other than a folder is a ValueError
    naming the variable (a missing folder holds no logs)."""
    env = os.environ.get(ENV_LOG_DIR)
    if env:
        root = Path(env)
        if root.exists() and not root.is_dir():
            raise ValueError(f"{ENV_LOG_DIR}: expected a folder of tuning logs "
                             f"(<target>/<op>.jsonl), got {env!r}, which is not a folder")
        return root
    import dsv4_tl.tuning_logs as pkg

    return Path(pkg.__file__).parent


def log_path(root: "str | Path", target_dir: str, op: str) -> Path:
    return Path(root) / target_dir / f"{op}.jsonl"


def parse_lines(lines: Iterable["str | bytes"], origin: str = "<log>") -> Tuple[list, list]:
    """``(entries, problems)``: each valid entry gets ``"_line"`` (1-based); each malformed
    line (not UTF-8, not JSON, nested too deep, a number Python refuses to parse, not an
    entry) gives a problem string naming ``origin:line``; no line raises."""
    entries, problems = [], []
    for n, line in enumerate(lines, 1):
        try:
            if isinstance(line, bytes):
                line = line.decode("utf-8")
            if not line.strip():
                continue
            entry = json.loads(line)
        except UnicodeDecodeError as exc:
            problems.append(f"{origin}:{n}: not UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        except json.JSONDecodeError as exc:
            problems.append(f"{origin}:{n}: not JSON ({exc.msg})")
            continue
        except (ValueError, RecursionError) as exc:  # int over 4300 digits; deep nesting
            problems.append(f"{origin}:{n}: not a usable JSON line ({type(exc).__name__}: "
                            f"{str(exc)[:120]})")
            continue
        try:
            errors = validate_entry(entry)
        except RecursionError:
            errors = ["nested too deeply"]
        if errors:
            problems.append(f"{origin}:{n}: " + "; ".join(errors))
            continue
        entry["_line"] = n
        entries.append(entry)
    return entries, problems


# The largest log read (the biggest shipped one is under 1 MiB): a larger file is skipped
# with a warning, never read into memory whole.
MAX_LOG_BYTES = 64 << 20

_parsed: "OrderedDict[tuple, Tuple[tuple, tuple]]" = OrderedDict()  # file identity -> parse
_parsed_lock = threading.Lock()
_PARSED_KEPT = 64


def _installed_logs() -> Path:
    import dsv4_tl.tuning_logs as pkg

    return Path(pkg.__file__).parent


def _unusable(path: Path, st: os.stat_result) -> Optional[str]:
    """Why the opened log ``path`` (status ``st``) is not read, or None: not a regular file
    (a FIFO would block every op's first call, ``/dev/zero`` would fill memory), over
    :data:`MAX_LOG_BYTES`, or, outside the installed package's own logs (written with the
    code this process runs), a file that another user than this one or root owns or that
    its group or others can write (it picks the kernels this process builds and runs)."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_size > MAX_LOG_BYTES:
        return f"{st.st_size} bytes, over the {MAX_LOG_BYTES} a tuning log may hold"
    try:
        shipped = Path(os.path.realpath(path)).is_relative_to(os.path.realpath(_installed_logs()))
    except ImportError:
        shipped = False
    if shipped:
        return None
    if st.st_uid not in (os.getuid(), 0):
        return (f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()}) or root; "
                f"fix: point {ENV_LOG_DIR} at logs of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}); fix: "
                f"chmod go-w {shlex.quote(str(path))}")
    return None


def _read_opened(path: Path, fd: int, st: os.stat_result) -> Tuple[tuple, tuple]:
    """``(entries, problems)`` of the log open at ``fd``, parsed once per file identity."""
    key = (str(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _parsed_lock:
        if key in _parsed:
            _parsed.move_to_end(key)
            return _parsed[key]
    with os.fdopen(os.dup(fd), "rb") as f:  # at most the cap (the file may grow meanwhile)
        data = f.read(MAX_LOG_BYTES + 1)
    if len(data) > MAX_LOG_BYTES:
        parsed = ((), (f"{path}: unreadable (over {MAX_LOG_BYTES} bytes)",))
    else:  # lines decoded one by one: one bad byte spoils one line
        entries, problems = parse_lines(io.BytesIO(data), str(path))
        parsed = (tuple(entries), tuple(problems))
    with _parsed_lock:
        _parsed[key] = parsed
        while len(_parsed) > _PARSED_KEPT:
            _parsed.popitem(last=False)
    return parsed


_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def read_log(path: "str | Path", warn: bool = True) -> list:
    """The valid entries of one log file (``[]`` if it does not exist); malformed lines are
    skipped with a warning (once per line per process), and so is a whole file that is not
    read (:func:`_unusable`: a FIFO, a device, a folder, too large, or another user's),
    with one warning line naming it. Entries are shared: do not modify."""
    path = Path(path)
    try:  # non-blocking: a FIFO in the log's place returns at once (then is refused)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:  # no permission
        entries, problems = (), (f"{path}: unreadable ({exc.strerror or exc})",)
    else:
        try:
            st = os.fstat(fd)
            reason = _unusable(path, st)
            if reason is not None:
                if warn:
                    _warn_once(("file", str(path), reason),
                               f"tuning log: skipping {path}: {reason}")
                return []
            entries, problems = _read_opened(path, fd, st)
        finally:
            os.close(fd)
    if warn:
        for problem in problems:
            _warn_once(("bad", problem), f"tuning log: skipping a malformed line: {problem}")
    return list(entries)


def append_entry(path: "str | Path", entry: dict) -> None:
    """Validate ``entry`` and append it as one line (creating the file and folders)."""
    entry = {k: v for k, v in entry.items() if not k.startswith("_")}
    check_entry(entry)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
    # created 0644 whatever the umask: a log others can write is not read (read_log)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    with open(fd, "a", encoding="utf-8") as f:  # one write: lines never interleave
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def current_tilelang() -> Optional[str]:
    """TileLang's version from the package metadata (no ``import tilelang``)."""
    import importlib.metadata as md

    try:
        return md.version("tilelang")
    except md.PackageNotFoundError:
        return None


def _newest(entries: list) -> Optional[dict]:
    return max(entries, key=lambda e: (entry_date(e), e["_line"])) if entries else None


def _target_dir_of(name: str) -> Optional[str]:
    from .targets import parse_target

    try:
        return parse_target(name).dirname
    except ValueError:
        return None


def declared_values(target_dir: str, op: str, bucket: str) -> dict:
    """knob -> the values a tuned config of ``bucket`` may give it: for every knob of the
    schedule file's default, the default's and the bucket's own value (tuning always
    measures those) plus, for a knob of the ``space``, its candidates (tuning varies only
    those). No schedule file: nothing is constrained."""
    from .schedule_files import load_schedule_file

    try:
        spec = load_schedule_file(target_dir, op)
    except FileNotFoundError:
        return {}
    config = next((b.get("config", {}) for b in spec.get("buckets", [])
                   if b.get("name") == bucket), {})
    space = spec.get("space", {})
    allowed = {}
    for knob in {**spec["default"], **space}:
        own = [c[knob] for c in (spec["default"], config) if knob in c]
        allowed[knob] = list(space.get(knob, [])) + own
    return allowed


def same_value(a, b) -> bool:
    """Equal and of the same type: ``true`` is not ``1`` and ``2.0`` is not ``2`` (they
    would pass ``==`` and then build another kernel under another key)."""
    return type(a) is type(b) and a == b


def _outside_space(config: dict, space: dict) -> list:
    """``knob=value`` of every knob of ``config`` that ``space`` declares and that takes
    another value (compared by :func:`same_value`)."""
    return [f"{k}={v!r}" for k, v in sorted(config.items())
            if k in space and not any(same_value(v, c) for c in space[k])]


def invalid_reason(target_dir: str, op: str, config: dict) -> Optional[str]:
    """Why ``config`` (a tuned best, completed by the schedule file's default) cannot be
    built for ``op`` on ``target_dir`` by the schedule's own validity rule (the layout,
    arch and resource rules of :func:`dsv4_tl.schedule_rules.prune`, which ``dsv4-tl tune``
    prunes candidates by), or None."""
    from .schedule_files import load_schedule_file
    from .schedule_rules import prune

    try:
        default = load_schedule_file(target_dir, op)["default"]
    except FileNotFoundError:
        return None
    try:
        return prune(target_dir, op, {**default, **config})
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return f"{type(exc).__name__}: {exc}"


def without_retired_knobs(spec: dict, config: dict) -> Tuple[Optional[dict], list]:
    """``(config less the knobs the schedule file ``spec`` retired, [])`` when each retired
    knob ``config`` names sits at its off value (the only kernel left: the entry still
    measured it), else ``(None, ["knob=value", ...])`` naming the ones that do not."""
    retired = spec.get("retired_knobs", {})
    bad = [f"{k}={v!r}" for k, v in sorted(config.items())
           if k in retired and not same_value(v, retired[k])]
    if bad:
        return None, bad
    return {k: v for k, v in config.items() if k not in retired}, []


def _retired_applied(target_dir: str, op: str, entries: list, path: Path, bucket: str) -> list:
    """``entries`` with each best config's retired knobs dropped (:func:`without_retired_knobs`);
    an entry whose best sets a retired knob on is ignored, with one warning naming it."""
    from .schedule_files import load_schedule_file

    try:
        spec = load_schedule_file(target_dir, op)
    except FileNotFoundError:
        return entries
    if not spec.get("retired_knobs"):
        return entries
    kept, bad = [], None
    for e in entries:
        best, names = without_retired_knobs(spec, e["best"])
        if best is None:
            bad = (e, names)
        else:
            kept.append({**e, "best": best})
    if bad is not None:
        _warn_once(("retired", str(path), bucket),
                   f"tuning log {path}: bucket {bucket!r}: an entry of {bad[0]['date']} sets "
                   f"{', '.join(bad[1])}, a knob retired from main (the schedule file's "
                   f"retired_knobs): ignored")
    return kept


def _without_bad_best(entries: list, reason_of, what: str, path: Path, bucket: str) -> list:
    """``entries`` less those whose best config ``reason_of`` finds a reason against, with
    one warning (per bucket and ``what``) naming the last one's reason and line."""
    bad = [(e, reason_of(e["best"])) for e in entries]
    bad = [(e, reason) for e, reason in bad if reason]
    if not bad:
        return entries
    _warn_once((what, str(path), bucket),
               f"tuning log {path}: {len(bad)} entries of bucket {bucket!r} have a best config "
               f"{what} ({bad[-1][1]}, line {bad[-1][0]['_line']}): ignored")
    rejected = {id(e) for e, _ in bad}
    return [e for e in entries if id(e) not in rejected]


def select_entry(target_dir: str, op: str, bucket: str, match: Optional[dict] = None,
                 tilelang: Optional[str] = None, root: "str | Path | None" = None) -> Optional[dict]:
    """The log entry whose best config ``(target_dir, op, bucket)`` uses, or None.

    Only entries of this directory's target tuned with ``tilelang`` (default: this
    process's version) whose best config stays inside the schedule file's space
    (:func:`declared_values`) count; others are ignored with a warning. With ``match``,
    entries whose bucket ranges differ are ignored with a warning too. The newest
    remaining entry wins.
    """
    path = log_path(log_root() if root is None else root, target_dir, op)
    entries = [e for e in read_log(path) if e["bucket"] == bucket and e["op"] == op]
    if not entries:
        return None
    foreign = [e for e in entries if _target_dir_of(e["target"]) != target_dir]
    if foreign:
        _warn_once(("target", str(path), bucket),
                   f"tuning log {path}: {len(foreign)} entries of bucket {bucket!r} were tuned "
                   f"for target {foreign[-1]['target']} (device {foreign[-1]['device']}), not "
                   f"this directory's: ignored")
        entries = [e for e in entries if _target_dir_of(e["target"]) == target_dir]
    entries = _retired_applied(target_dir, op, entries, path, bucket)
    space = declared_values(target_dir, op, bucket)
    entries = _without_bad_best(entries, lambda best: ", ".join(_outside_space(best, space)),
                                "outside the schedule's space", path, bucket)
    entries = _without_bad_best(entries, lambda best: invalid_reason(target_dir, op, best),
                                "that cannot be built", path, bucket)
    version = current_tilelang() if tilelang is None else tilelang
    same = [e for e in entries if e["toolchain"]["tilelang"] == version]
    others = sorted({e["toolchain"]["tilelang"] for e in entries} - {version})
    if others:
        _warn_once(("version", str(path), bucket, version),
                   f"tuning log {path}: bucket {bucket!r} has entries tuned with TileLang "
                   f"{', '.join(others)}; this process has {version}: those are ignored")
    if match is not None:
        stale = [e for e in same if e["match"] != match]
        if stale:
            _warn_once(("match", str(path), bucket),
                       f"tuning log {path}: {len(stale)} entries of bucket {bucket!r} were "
                       f"tuned for ranges {stale[-1]['match']}, the schedule file now has "
                       f"{match}: ignored (re-run dsv4-tl tune)")
        same = [e for e in same if e["match"] == match]
    return _newest(same)


def entries_for(path: "str | Path", device: Optional[str] = None,
                tilelang: Optional[str] = None) -> list:
    """Entries of one file, optionally only those of ``device`` and ``tilelang``."""
    out = []
    for e in read_log(path):
        if device is not None and e["device"] != device:
            continue
        if tilelang is not None and e["toolchain"]["tilelang"] != tilelang:
            continue
        out.append(e)
    return out


def clear_caches() -> None:
    """Forget parsed files and the once-per-process warnings (tests)."""
    with _parsed_lock:
        _parsed.clear()
    _warned.clear()
