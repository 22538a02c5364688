"""Chat prompts: conversations checked turn by turn, split into prompt and reference, rendered to token ids by a
tokenizer's own chat template.

A conversation is a list of ``{"role": ..., "content": ...}`` turns (roles ``system``, ``user``, ``assistant``;
content a string). Its *prompt* is every turn up to and including the last user turn; one assistant turn after it is
the *reference answer*. The prompt is rendered as
``tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, **template_kwargs)``: the template
writes every special token itself (BOS included), so the ids carry exactly one BOS where the template puts one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from opdjax.core.errors import InputError

__all__ = ["ROLES", "ChatError", "ChatPrompt", "chat_template_of", "check_turns", "render_chat", "split_turns"]

ROLES = ("system", "user", "assistant")


class ChatError(InputError):
    """A conversation that cannot be a prompt (a malformed turn, no user turn), or a tokenizer that cannot render
    one (no chat template)."""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """How one prompt is rendered by a chat template.

    turns            ((role, content), ...), ending with a user turn
    template_kwargs  extra variables of the template (e.g. Qwen3's ``{"enable_thinking": False}``)
    required         True: a tokenizer without a chat template is an error; False (a plain prompt under
                     ``chat: auto``): such a tokenizer encodes the text as it is
    """

    turns: tuple[tuple[str, str], ...]
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    required: bool = True

    @property
    def messages(self) -> list[dict[str, str]]:
        """The turns as the ``[{"role", "content"}, ...]`` list chat templates take."""
        return [{"role": r, "content": c} for r, c in self.turns]

    @property
    def key(self) -> str:
        """The turns as compact JSON: the prompt's identity (splits, distinct counts) and a bound on its bytes."""
        return json.dumps(self.turns, ensure_ascii=False, separators=(",", ":"))


def check_turns(where: str, turns: Any, key: str = "messages") -> tuple[tuple[str, str], ...]:
    """``turns`` (the row's field ``key``) as ((role, content), ...), or ChatError naming ``where`` (file:line) and
    the bad turn: not a non-empty list, a turn that is not an object, a missing or unknown role, content missing or
    not a string."""
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if turns == [] else type(turns).__name__
        raise ChatError(f"{where}: {key!r} must be a non-empty list of {{role, content}} turns, got {got}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ChatError(f"{where}: {key}[{i}] must be an object with role and content, got "
                            f"{type(turn).__name__}")
        if "role" not in turn:
            raise ChatError(f"{where}: {key}[{i}] has no 'role' (expected one of {list(ROLES)}); keys present: "
                            f"{sorted(turn)}")
        if turn["role"] not in ROLES:
            raise ChatError(f"{where}: {key}[{i}] has role {turn['role']!r}; expected one of {list(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str):
            got = "no 'content'" if "content" not in turn else f"content of type {type(content).__name__}"
            raise ChatError(f"{where}: {key}[{i}] ({turn['role']}) has {got}; expected a string")
        out.append((turn["role"], content))
    return tuple(out)


def split_turns(where: str, turns: Sequence[tuple[str, str]], key: str = "messages"
                ) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """(prompt turns, reference answer): the prompt is every turn up to the last user turn; after it, nothing (no
    reference) or one assistant turn (its content is the reference). ChatError naming ``where`` otherwise: no user
    turn, an empty last user turn, or more than one turn after it."""
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise ChatError(f"{where}: no user turn (roles: {[r for r, _ in turns]}); the prompt ends with the last user "
                        f"turn")
    last = users[-1]
    if not turns[last][1].strip():
        raise ChatError(f"{where}: the last user turn ({key}[{last}]) is empty; every row needs a prompt to sample "
                        f"from")
    tail = turns[last + 1:]
    if len(tail) > 1:
        raise ChatError(f"{where}: {len(tail)} turns after the last user turn ({key}[{last}]); at most one "
                        f"assistant turn (the reference answer) may follow it")
    return tuple(turns[:last + 1]), (tail[0][1] if tail else None)


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template string (None when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    return template or None


def render_chat(tokenizer, prompt: ChatPrompt) -> list[int] | None:
    """Token ids of ``prompt`` rendered by the tokenizer's chat template with the generation prompt appended.

    None when the tokenizer has no chat template and the prompt does not require one (the caller encodes the text);
    ChatError when it requires one. The rendered text is tokenized without added special tokens, so the template's
    own BOS (Llama-3 writes one, Qwen none) is the only one.
    """
    if chat_template_of(tokenizer) is None:
        if not prompt.required:
            return None
        raise ChatError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, and "
                        f"chat prompts are rendered by it; give the student a tokenizer with a chat_template, or "
                        f"use plain prompts with task.options.chat=false")
    enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True, **dict(prompt.template_kwargs))
    return list(enc["input_ids"])
