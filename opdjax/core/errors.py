"""The error classes every layer derives from: `OpdjaxError` (the root), `InputError`, `ConfigError`, `UnavailableError`.

Every error that reports bad input — a config key or value, a checkpoint, a vocabulary, a recipe, a budget file, a
weight manifest — derives from `InputError` (a ValueError): the CLI prints its message in one line and exits 2,
never a traceback. Each layer defines its own subclass next to the code that raises it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InputError", "OpdjaxError", "UnavailableError"]


class OpdjaxError(Exception):
    """The root of every error opdjax raises on purpose (the CLI reports it in one line, exit 2)."""


class InputError(OpdjaxError, ValueError):
    """Bad input: the message names what is wrong and what was expected."""


class UnavailableError(OpdjaxError, RuntimeError):
    """Something a run needs did not answer in time (engine servers, a peer process)."""


class ConfigError(InputError):
    """A config key that does not exist, a value of the wrong type or out of range, or a missing model directory."""
