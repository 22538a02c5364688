"""What every command shares: an opdjax error is reported in one line, never as a traceback (unless
`opdjax --debug ...`), with an exit code that says whose it is:

    0    done
    2    bad input: a config, checkpoint, vocabulary, recipe, budget or manifest that is wrong, a run that diverged
         (NonFiniteError), servers that do not answer — what the user changes before running again
    74   the machine refused a write (EX_IOERR): disk full, permission denied, a read-only or failing disk — free
         space or fix permissions, then resume; what was saved before the fault is intact
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import errno
import functools
import sys
from typing import Callable

from opdjax.core.errors import MachineFaultError, OpdjaxError

__all__ = ["EXIT_INPUT", "EXIT_INTERRUPTED", "EXIT_MACHINE", "KEYS_HINT", "guard"]

KEYS_HINT = "(every key, its default and help: opdjax keys [SECTION])"  # ends the help of a command's overrides
EXIT_INPUT, EXIT_MACHINE, EXIT_INTERRUPTED = 2, 74, 130
# OSErrors that are the machine's, not the input's: reported in one line with EXIT_MACHINE wherever they come from.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO,
                            errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def guard(fn: Callable) -> Callable:
    """Run a command; an `OpdjaxError` prints `opdjax <command>: error: <Error>: <message>` to stderr and returns
    EXIT_INPUT (2), or EXIT_MACHINE (74) for a `MachineFaultError` or an OSError of MACHINE_ERRNOS (its path and
    cause in the line); with `--debug` it propagates with its traceback. Ctrl-C prints `opdjax <command>:
    interrupted` and returns 130 (what a run leaves behind resumes with pipeline.resume=true)."""
    @functools.wraps(fn)
    def wrapped(args) -> int:
        try:
            return int(fn(args) or 0)
        except (OpdjaxError, OSError) as e:
            if getattr(args, "debug", False) or not _one_line(e):
                raise
            print(f"opdjax {args.command}: error: {_one_line(e)}", file=sys.stderr)
            return EXIT_MACHINE if isinstance(e, MachineFaultError) or not isinstance(e, OpdjaxError) else EXIT_INPUT
        except KeyboardInterrupt:  # Ctrl-C (and SIGTERM where a command maps it): one line, the shell's code
            if getattr(args, "debug", False):
                raise
            print(f"opdjax {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    return wrapped


def _one_line(e: BaseException) -> str | None:
    """`<Error>: <message>` for an opdjax error or a machine's OSError (None for any other OSError: a bug, shown
    with its traceback)."""
    if isinstance(e, OpdjaxError):
        return f"{type(e).__name__}: {e}"
    if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
        where = f"{e.filename}: " if e.filename else ""
        return f"{type(e).__name__}: {where}{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    return None
