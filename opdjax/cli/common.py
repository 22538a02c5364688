"""What every command shares: bad input is reported in one line (exit 2), never as a traceback."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from opdjax.core.errors import InputError

__all__ = ["guard"]


def guard(fn: Callable) -> Callable:
    """Run a command; an `InputError` (a config, checkpoint, vocabulary, recipe, budget or manifest that is wrong)
    prints `opdjax <command>: <Error>: <message>` to stderr and returns exit code 2."""
    @functools.wraps(fn)
    def wrapped(args) -> int:
        try:
            return int(fn(args) or 0)
        except InputError as e:
            print(f"opdjax {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    return wrapped
