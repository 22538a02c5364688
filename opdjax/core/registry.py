"""Name registries that a notebook can re-run: the rule every ``register_*`` decorator of opdjax follows.

A name may be registered again by the *same definition* — same ``__module__`` and ``__qualname__``, which is what
re-running a notebook cell (or reloading a module) produces — and the new object replaces the old one. A different
definition under a name that is taken raises ``ValueError`` naming both, so a typo cannot silently replace a
built-in loss, correction or task.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

__all__ = ["lookup", "qualified_name", "register"]


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class (``functools.wraps`` wrappers carry the wrapped one's)."""
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}"


def register(table: MutableMapping[str, Any], kind: str, name: str, obj: Any, *, key: Any = None) -> None:
    """``table[name] = obj`` under the re-registration rule above.

    kind: what the table holds ("loss", "correction", "task"), for the error message. key: the definition to
    compare with the existing entry's, when ``obj`` is a wrapper of it (default: ``obj`` itself).
    """
    old = table.get(name)
    new = qualified_name(obj if key is None else key)
    if old is not None and qualified_name(old) != new:
        raise ValueError(f"{kind} {name!r} is already registered to {qualified_name(old)}, not {new}; pick another "
                         f"name (re-registering the same definition, e.g. re-running a notebook cell, replaces it)")
    table[name] = obj


def lookup(table: Mapping[str, Any], name: str, kind: str, plural: str, error: type[Exception] = ValueError) -> Any:
    """``table[name]``; `error` naming `name` and listing the registered `plural` when it is not there."""
    if name not in table:
        raise error(f"unknown {kind} {name!r}; registered {plural}: {', '.join(sorted(table))}")
    return table[name]
