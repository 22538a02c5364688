"""Common dataset layouts → opdjax's JSONL (`JsonlTask`): one row at a time, each checked, errors naming file:line.

- ``messages``: a row with ``messages`` ([{role, content}, ...]) is written as the checked turns, with its
  ``answer`` if it has one.
- ``question_answer`` (GSM8K): ``question`` and ``answer`` are written as ``prompt`` and ``answer``.
- ``prompt_completion``: a text ``prompt`` is written as ``prompt``, a conversational one (a list of turns) as
  ``messages``; the ``completion`` (text, or one assistant turn) as ``answer``.

``auto`` picks each row's layout by the first of its keys present, in the order above. A ``split`` field
("train"/"heldout") is kept; other fields are dropped. A conversation is checked as `data.chat` does (roles, string
content, a user turn, at most one assistant turn after the last user turn), so a converted file loads as a task.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable

from opdjax.data.chat import ChatError, check_turns, split_turns
from opdjax.data.tasks import SPLITS, TaskError, answer_field, file_lines, read_object, text_field

__all__ = ["LAYOUTS", "convert_file", "convert_row"]


def _turns(where: str, value: Any, key: str) -> list[dict[str, str]]:
    """Checked turns of ``value`` whose prompt ends with a user turn, as [{role, content}] (TaskError otherwise)."""
    try:
        turns = check_turns(where, value, key)
        split_turns(where, turns, key)
    except ChatError as e:
        raise TaskError(str(e)) from None
    return [{"role": r, "content": c} for r, c in turns]


def _from_messages(where: str, row: dict) -> dict:
    out: dict[str, Any] = {"messages": _turns(where, row["messages"], "messages")}
    answer = answer_field(where, row, "answer")
    return out if answer is None else {**out, "answer": answer}


def _from_question_answer(where: str, row: dict) -> dict:
    out = {"prompt": text_field(where, row, "question", "question")}
    answer = answer_field(where, row, "answer")
    return out if answer is None else {**out, "answer": answer}


def _completion_text(where: str, completion: Any) -> str | None:
    """A completion as text: a string, a number, or one assistant turn [{role: assistant, content}]."""
    if completion is None or isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        turns = check_turns(where, completion, "completion")
        if len(turns) != 1 or turns[0][0] != "assistant":
            raise TaskError(f"{where}: a conversational 'completion' must be one assistant turn, got roles "
                            f"{[r for r, _ in turns]}")
        return turns[0][1]
    return answer_field(where, {"completion": completion}, "completion")


def _from_prompt_completion(where: str, row: dict) -> dict:
    prompt = row["prompt"]
    out: dict[str, Any] = ({"messages": _turns(where, prompt, "prompt")} if isinstance(prompt, list)
                           else {"prompt": text_field(where, row, "prompt")})
    try:
        answer = _completion_text(where, row.get("completion"))
    except ChatError as e:
        raise TaskError(str(e)) from None
    return out if answer is None else {**out, "answer": answer}


# layout -> (the key that marks a row of it, row -> opdjax row)
LAYOUTS: dict[str, tuple[str, Callable[[str, dict], dict]]] = {
    "messages": ("messages", _from_messages),
    "question_answer": ("question", _from_question_answer),
    "prompt_completion": ("prompt", _from_prompt_completion),
}


def convert_row(where: str, row: dict, layout: str = "auto") -> tuple[str, dict]:
    """(the layout used, the opdjax row) of one JSON object; TaskError naming ``where`` for a row of no layout (or
    not of the one asked for) and for anything malformed in it."""
    if layout == "auto":
        layout = next((name for name, (key, _) in LAYOUTS.items() if key in row), "")
        if not layout:
            raise TaskError(f"{where}: no known layout: expected one of the keys "
                            f"{[key for key, _ in LAYOUTS.values()]}; keys present: {sorted(row)}")
    key, convert = LAYOUTS[layout]
    if key not in row:
        raise TaskError(f"{where}: layout {layout!r} needs a {key!r} field; keys present: {sorted(row)}")
    out = convert(where, row)
    if "split" in row:
        if row["split"] not in SPLITS:
            raise TaskError(f"{where}: 'split' must be one of {SPLITS}, got {row['split']!r}")
        out["split"] = row["split"]
    return layout, out


def convert_file(src: str | os.PathLike, dst: str | os.PathLike, layout: str = "auto") -> dict[str, int]:
    """Convert every row of ``src`` (JSONL; blank lines skipped) into ``dst``, written whole or not at all (a
    temporary file renamed into place). Returns the rows written per layout. TaskError naming file:line for a bad
    row; ValueError for an unknown layout; TaskError when ``src`` has no rows."""
    if layout != "auto" and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose auto or one of {sorted(LAYOUTS)}")
    src, dst = os.fspath(src), pathlib.Path(dst)
    if not os.path.isfile(src):
        raise TaskError(f"{src}: no such file (expected a JSONL dataset)")
    counts: dict[str, int] = {}
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for lineno, raw in file_lines(src):
                where = f"{src}:{lineno}"
                row = read_object(where, raw)
                if row is None:
                    continue
                used, converted = convert_row(where, row, layout)
                out.write(json.dumps(converted, ensure_ascii=False) + "\n")
                counts[used] = counts.get(used, 0) + 1
        if not counts:
            raise TaskError(f"{src}: no rows (the file is empty)")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return counts
