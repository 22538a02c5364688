"""What every command shares: an opdjax error is reported in one line (exit 2), never as a traceback (unless
`opdjax --debug ...`)."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from opdjax.core.errors import OpdjaxError

__all__ = ["KEYS_HINT", "guard"]

KEYS_HINT = "(every key, its default and help: opdjax keys [SECTION])"  # ends the help of a command's overrides


def guard(fn: Callable) -> Callable:
    """Run a command; an `OpdjaxError` (a config, checkpoint, vocabulary, recipe, budget or manifest that is wrong,
    servers that do not answer) prints `opdjax <command>: error: <Error>: <message>` to stderr and returns exit
    code 2; with `--debug` it propagates with its traceback. Ctrl-C prints `opdjax <command>: interrupted` and
    returns 130 (what a run leaves behind resumes with pipeline.resume=true)."""
    @functools.wraps(fn)
    def wrapped(args) -> int:
        try:
            return int(fn(args) or 0)
        except OpdjaxError as e:
            if getattr(args, "debug", False):
                raise
            print(f"opdjax {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C (and SIGTERM where a command maps it): one line, the shell's code
            if getattr(args, "debug", False):
                raise
            print(f"opdjax {args.command}: interrupted", file=sys.stderr)
            return 130
    return wrapped
