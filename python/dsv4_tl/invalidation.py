"""Invalidation of what the front ends resolved: :func:`kernels_changed` runs every hook
registered with :func:`on_kernels_changed` (the front ends' memos and launch plans,
``dsv4_tl/ops/_dispatch.py``). A leaf (standard library only): the schedules
(:mod:`dsv4_tl.schedules`), the loader and the tuner call it, and :mod:`dsv4_tl.kernels`,
which reads the schedules, re-exports both names (see its docstring for when to call it).
"""

import threading
from typing import Callable

_hooks: list = []
_hooks_lock = threading.Lock()


def on_kernels_changed(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` (no arguments) to run whenever the kernels a call resolves to may
    change; returns it (usable as a decorator)."""
    with _hooks_lock:
        _hooks.append(hook)
    return hook


def kernels_changed() -> None:
    """The kernels or schedules may have changed (new loader, another kernel directory, a
    swapped or edited tuning log, a forced schedule): drop every memoised resolution and
    launch plan. Call it after changing any of them in a running process."""
    with _hooks_lock:
        hooks = list(_hooks)
    for hook in hooks:
        hook()
