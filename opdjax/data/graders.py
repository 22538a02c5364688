"""Graders of held-out accuracy: a completion's text against a reference answer, 1.0 or 0.0, picked by name.

- ``exact``: 1.0 when ``completion.strip() == reference.strip()``.
- ``marker``: 1.0 when the final answers agree: the text after the last answer marker (``####``, ``The answer is``,
  any case) up to the end of its line, stripped of spaces, a leading ``:`` and a trailing ``.``; a text without a
  marker is its own final answer.
- ``numeric``: 1.0 when ``|x - y| <= 1e-6`` for x the last number of the completion and y the reference's number
  (the last number of its final answer, e.g. after ``####`` in GSM8K), commas removed.

A grader also says which references it can use (``Grader.check``): a file is refused at load, naming the line, when
a reference cannot be graded (``numeric`` with a reference that holds no number).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from opdjax.core.registry import lookup, register

__all__ = ["ANSWER_MARKERS", "GRADERS", "Grader", "final_answer", "get_grader", "last_number", "register_grader"]

ANSWER_MARKERS = ("####", "the answer is")
NUMERIC_TOLERANCE = 1e-6
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclasses.dataclass(frozen=True)
class Grader:
    """grade(reference, completion) -> 1.0 | 0.0; check(reference) -> a reason it cannot be graded, or None."""

    name: str
    grade: Callable[[str, str], float]
    check: Callable[[str], str | None] = lambda reference: None


GRADERS: dict[str, Grader] = {}


def register_grader(name: str, check: Callable[[str], str | None] | None = None):
    """Function decorator: ``get_grader(name)`` grades with it (re-registration rule of `core.registry`)."""

    def deco(fn):
        register(GRADERS, "grader", name, Grader(name, fn, check or (lambda reference: None)), key=fn)
        return fn

    return deco


def get_grader(name: str) -> Grader:
    """The registered grader ``name``; ValueError listing the registered ones otherwise."""
    return lookup(GRADERS, name, "grader", "graders")


def final_answer(text: str) -> str:
    """The text after the last answer marker (case-insensitive) up to its line's end, stripped of spaces, a leading
    ':' and a trailing '.'; the whole stripped text when no marker occurs. ``"...\\n#### 1,234"`` → ``"1,234"``."""
    lower = text.lower()
    at, size = max(((lower.rfind(m), len(m)) for m in ANSWER_MARKERS), key=lambda p: p[0])
    tail = text if at < 0 else text[at + size:].lstrip(" \t").split("\n", 1)[0]
    return tail.strip().removeprefix(":").strip().removesuffix(".").strip()


def last_number(text: str) -> float | None:
    """The last number in ``text`` with its commas removed (``"1,234.5 then -7"`` → -7.0); None when there is none."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


@register_grader("exact")
def exact(reference: str, completion: str) -> float:
    """1.0 iff the stripped texts are equal."""
    return 1.0 if completion.strip() == reference.strip() else 0.0


@register_grader("marker")
def marker(reference: str, completion: str) -> float:
    """1.0 iff ``final_answer(completion) == final_answer(reference)``."""
    return 1.0 if final_answer(completion) == final_answer(reference) else 0.0


def _needs_number(reference: str) -> str | None:
    if last_number(final_answer(reference)) is None:
        return f"the numeric grader needs a number in the reference answer, got {reference[-80:]!r}"
    return None


@register_grader("numeric", check=_needs_number)
def numeric(reference: str, completion: str) -> float:
    """1.0 iff ``|last_number(completion) - last_number(final_answer(reference))| <= 1e-6``; 0.0 when the completion
    holds no number."""
    want, got = last_number(final_answer(reference)), last_number(completion)
    if want is None or got is None:
        return 0.0
    return 1.0 if abs(got - want) <= NUMERIC_TOLERANCE else 0.0
