"""The error classes every layer derives from: `OpdjaxError` (the root), `InputError`, `ConfigError`, `UnavailableError`,
`NonFiniteError`, `MachineFaultError`.

Every error that reports bad input — a config key or value, a checkpoint, a vocabulary, a recipe, a budget file, a
weight manifest — derives from `InputError` (a ValueError): the CLI prints its message in one line and exits 2,
never a traceback. Each layer defines its own subclass next to the code that raises it. A fault of the machine
(`MachineFaultError`: a full disk, a permission denied while saving) is one line too, with its own exit code.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InputError", "MachineFaultError", "NonFiniteError", "OpdjaxError", "UnavailableError"]


class OpdjaxError(Exception):
    """The root of every error opdjax raises on purpose (the CLI reports it in one line, exit 2)."""


class InputError(OpdjaxError, ValueError):
    """Bad input: the message names what is wrong and what was expected."""


class UnavailableError(OpdjaxError, RuntimeError):
    """Something a run needs did not answer in time (engine servers, a peer process)."""


class ConfigError(InputError):
    """A config key that does not exist, a value of the wrong type or out of range, or a missing model directory."""


class NonFiniteError(OpdjaxError, ArithmeticError):
    """A loss, gradient or parameter that is NaN or infinite: the run stops before it saves (or resumes from) it."""


class MachineFaultError(OpdjaxError, OSError):
    """The machine failed a write (disk full, permission denied, read-only or failing disk): the message names the
    path and the cause; what was saved before is intact (the CLI exits 74, EX_IOERR, not 2)."""
