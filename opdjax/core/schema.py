"""Typed config sections: dataclass fields that carry their help and choices, and nested dicts (a YAML file,
`key=value` overrides) turned into them with every key and type checked.

A field declared with `field(default, help=..., choices=...)` is the one source of what its key means: `describe`
lists every key with its default, type, choices and help (`opdjax keys`, docs/guide/config-keys.md), and the
errors of `merge` and of a config's `validate` quote the help.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Callable, Collection, Mapping

from opdjax.core.errors import ConfigError

__all__ = ["KeyDoc", "about", "choices_of", "describe", "field", "from_dict", "help_of", "merge", "to_dict"]


def field(default: Any, *, help: str, choices: Collection | Callable[[], Collection] | None = None) -> Any:
    """A config field with its help: one line, shown by `opdjax keys`, in docs/guide/config-keys.md and in the
    validation messages of the key. `choices` (a closed set of values) is a registry read when validating, so entries
    registered later count, or a function returning the set. A dict default is copied for each instance; a config
    class as the default makes a fresh section."""
    meta = {"help": help} if choices is None else {"help": help, "choices": choices}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def choices_of(f: dataclasses.Field | None) -> list | None:
    """The sorted choices of field `f` as of now (None: any value of its type, or no field)."""
    c = f.metadata.get("choices") if f is not None else None
    return None if c is None else sorted(c() if callable(c) else c)


def help_of(f: dataclasses.Field | None) -> str:
    """The help of field `f` ("" where it has none, or no field)."""
    return f.metadata.get("help", "") if f is not None else ""


def about(f: dataclasses.Field | None) -> str:
    """What an error message adds about the key of field `f`: " (<its help>)", or "" without help."""
    return f" ({help_of(f)})" if help_of(f) else ""


class KeyDoc(typing.NamedTuple):
    """One key as `opdjax keys` and the docs' key table show it. A section's own row has type "section", default
    None and no choices; its keys follow it."""

    key: str                 # dotted: rollout.temperature
    type: str                # as written in the class: int, str | None, section
    default: Any             # what a fresh instance holds
    choices: tuple           # the allowed values (empty: any value of the type)
    help: str


def describe(cls, prefix: str = "") -> list[KeyDoc]:
    """Every key of config class `cls`, depth first in declaration order: a section's row, then its keys. The
    defaults are a fresh instance's, the choices the registries' as of now, the help the fields' metadata."""
    obj, hints, rows = cls(), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows.append(KeyDoc(key, "section", None, (), help_of(f)))
            rows += describe(type(value), key + ".")
        else:
            rows.append(KeyDoc(key, _type_name(hints[f.name]), value, tuple(choices_of(f) or ()), help_of(f)))
    return rows


def _type_name(tp) -> str:
    """`int`, `str | None`: an annotation as a user reads it."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp) -> Any:
    """Check/convert `value` to the annotated type `tp` (int, float, bool, str, dict, tuple, X | None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        x = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                x = float(value)
            except OverflowError:  # an int beyond the float range (10**400)
                x = math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                x = float(value)
            except ValueError:
                pass
        if x is not None:
            if not math.isfinite(x):
                raise ConfigError(f"{path} must be a finite number, got {value!r}")
            return x
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is dict or origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif tp is tuple or origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(value)
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # an object where a name is also accepted (rollout.recipe: a quant.Recipe)
            return value
    quote = " (YAML reads yes/no/on/off as a boolean: quote a word meant as text)" if isinstance(value, bool) else ""
    raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(tp)}{quote}")


def _unknown_key(path: str, key: str, cls) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    full = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{f'{path}.' if path else ''}{close[0]}'?)" if close else ""
    where = f"under '{path}'" if path else "at top level"
    return ConfigError(f"unknown key '{full}'{hint}; valid keys {where}: {', '.join(valid)}")


def from_dict(cls, d: Mapping[str, Any] | None, path: str = ""):
    """Build dataclass `cls` from a nested dict, checking every key and type (defaults fill the rest)."""
    obj = cls()
    return merge(obj, d or {}, path)


def merge(obj, d: Mapping[str, Any], path: str = ""):
    """A copy of dataclass `obj` with the nested dict `d` applied on top."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {d!r}")
    hints = typing.get_type_hints(type(obj))
    changes = {}
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in d.items():
        if key not in fields:
            raise _unknown_key(path, key, type(obj))
        sub = f"{path}.{key}" if path else key
        cur = getattr(obj, key)
        if dataclasses.is_dataclass(cur):
            if isinstance(value, str) and (key_of := _shortcut(cur)):
                value = {key_of: value}  # shortcut: student=DIR means student.path=DIR
            changes[key] = merge(cur, value, sub)
        else:
            try:
                changes[key] = _coerce(sub, value, hints[key])
            except ConfigError as e:
                raise ConfigError(f"{e}{about(fields[key])}") from None
    return dataclasses.replace(obj, **changes)


def _shortcut(section) -> str | None:
    """The key a plain string given for a whole section sets: the section's `shortcut` (a class attribute), else
    `path` where it has one (`student=DIR`); None: a string is not a value of this section."""
    names = {f.name for f in dataclasses.fields(section)}
    key = getattr(section, "shortcut", "path")
    return key if key in names else None


def to_dict(obj) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML/JSON dumps."""
    def conv(v):
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return {k: conv(v) for k, v in dataclasses.asdict(obj).items()}
