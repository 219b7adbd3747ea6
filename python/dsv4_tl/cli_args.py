"""The argument helpers of the ``dsv4-tl`` commands (``dsv4-tl`` itself, ``bench``, ``tune``):
one-line argparse errors, bounded number types, and ``main`` wrappers that turn a user's
mistake into one line on stderr. A leaf (standard library only), so that the commands'
modules import it and not each other: :mod:`dsv4_tl.cli` dispatches to ``bench`` and
``tune``, which import their helpers from here.
"""

import argparse
import functools
import os
import sys
from typing import Callable, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: message``) without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bounded(text: str, convert: Callable, minimum, what: str, maximum=float("inf")):
    """argparse type helper: ``convert(text)``, finite and in ``minimum..maximum``, else an
    error saying ``expected <what>`` (a value too long to print is shortened)."""
    shown = text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {shown!r}") from None
    if not minimum <= value < float("inf") or value > maximum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _bounded(text, int, 1, "a positive integer")


def head_count(text: str) -> int:
    """argparse type: a head count, 1..``kernels.MAX_HEADS``."""
    from .kernels import MAX_HEADS

    return _bounded(text, int, 1, f"a head count 1..{MAX_HEADS}", MAX_HEADS)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _bounded(text, int, 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _bounded(text, float, 0, "a finite number >= 0")


def one_line_errors(prog: str) -> Callable:
    """Decorate a command's ``main``: a ValueError or OSError it lets through (a bad log, a
    bad environment variable, an untrusted directory) becomes one line on stderr and exit
    status 1, and a reader that goes away (``| head``) ends it quietly, without a
    BrokenPipeError traceback."""

    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except BrokenPipeError:
                # stdout's reader left: send the rest (and the flush at exit) to /dev/null
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 1
            except (ValueError, OSError) as exc:
                print(f"{prog}: {exc}", file=sys.stderr)
                return 1

        return wrapped

    return wrap
