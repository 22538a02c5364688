"""Built-in synthetic tasks and JSONL prompt datasets, with their graders.

Tasks work on *text*. The caller tokenises (a local byte-level BPE tokenizer; nothing here assumes its
vocabulary) and owns the end-of-answer convention:

- **Training text** is ``prompt + answer`` followed by the tokenizer's EOS token, which the caller appends
  (``corpus`` returns the strings without EOS).
- **Grading**: the caller samples a completion after the prompt, cuts it at the first EOS, decodes it without
  special tokens and passes the text to ``task.grade(example, completion_text)``. The built-in tasks' grader
  strips surrounding whitespace and returns 1.0 on an exact match with ``example.answer``, else 0.0 (a JSONL file
  picks one of `data.graders`). ``cut_at`` helps callers whose decoded text still contains an end marker.
- **Chat prompts**: an example with ``chat`` set is rendered by the tokenizer's chat template
  (`data.prompts.encode_prompts`, `data.chat`).

Built-in tasks (prompt → answer):

=========  =============================  ==========================================
name       example                        options
=========  =============================  ==========================================
addition   ``"12+34="`` → ``"46"``         ``digits=2`` (operands in [0, 10**digits))
sort       ``"sort 3 1 2:"`` → ``"1 2 3"``  ``length=4`` (digits to sort)
copy       ``"copy 1234:"`` → ``"1234"``    ``length=4``
reverse    ``"reverse 1234:"`` → ``"4321"``  ``length=4``
jsonl      from a file                    ``path``, ``chat``, ``grader``, ... (below)
=========  =============================  ==========================================

Every built-in example set is a pure function of ``(options, n, seed, split)``. Train and held-out splits are
disjoint by construction: an item is held out iff a SHA-256 hash of its *content key* (for addition the unordered
operand pair, so ``34+12`` cannot leak a held-out ``12+34``) falls in the lowest 10% of the hash range.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, ClassVar, Iterable, Iterator, Protocol, runtime_checkable

import numpy as np

from opdjax.core.errors import InputError
from opdjax.core.registry import lookup, register
from opdjax.data.chat import ChatError, ChatPrompt, check_turns, split_turns
from opdjax.data.graders import GRADERS, get_grader

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1
# The longest line a prompt file may hold, read no further: 16 MiB is ~4M tokens at 4 bytes a token, more than any
# model's context; the pipeline then bounds each prompt by the student's own context (`pipeline.inputs`).
MAX_LINE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt. ``answer`` is None when the dataset carries no reference answer (ungraded).

    ``chat`` (a `ChatPrompt`) says the prompt is rendered by the tokenizer's chat template
    (`data.prompts.encode_prompts`); ``prompt`` is then the last user turn's text. None: ``prompt`` is encoded as it
    is.
    """

    prompt: str
    answer: str | None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    chat: ChatPrompt | None = None

    @property
    def key(self) -> str:
        """The prompt's identity (its split hash, distinct counts, the byte bound of its length): the text, or a
        conversation's turns as JSON when it has more than one (a system turn, earlier turns)."""
        return self.chat.key if self.chat is not None and len(self.chat.turns) > 1 else self.prompt


@runtime_checkable
class Task(Protocol):
    """What the pipeline needs from a task."""

    name: str

    def examples(self, n: int, seed: int, split: str = "train") -> list[Example]:
        """``n`` examples of ``split`` ("train" or "heldout"), a pure function of the arguments."""

    def grade(self, example: Example, completion_text: str) -> float | None:
        """1.0 if ``completion_text.strip() == example.answer`` else 0.0 (None: the example has no answer)."""


# ----------------------------------------------------------------------------------------------------- registry

TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    """Class decorator: ``get_task(name, **options)`` builds ``cls(**options)``. Registering the same definition
    again (same module and qualified name: a re-run notebook cell) replaces it; a different class under a taken
    name raises ValueError (:func:`opdjax.core.registry.register`)."""

    def deco(cls):
        register(TASKS, "task", name, cls)
        return cls

    return deco


class TaskError(InputError):
    """A task that cannot be built: an unknown name or option, a prompts file that is missing or malformed."""


class TaskFileNotFound(TaskError, FileNotFoundError):
    """The prompts file does not exist."""


def get_task(name: str, **options) -> Task:
    """Build a registered task; unknown names or options raise ValueError listing what is valid."""
    cls = lookup(TASKS, name, "task", "tasks", TaskError)
    if dataclasses.is_dataclass(cls):
        valid = [f.name for f in dataclasses.fields(cls) if f.init]
        bad = sorted(set(options) - set(valid))
        if bad:
            raise TaskError(f"task {name!r} has no option(s) {bad}; valid options: {valid}")
    return cls(**options)


# ----------------------------------------------------------------------------------------------------- helpers


def _stable_hash(text: str) -> int:
    """64-bit hash of ``text`` that is the same in every process and Python version (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(key: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """"heldout" iff hash(key) / 2**64 < heldout_fraction, else "train"."""
    return "heldout" if _stable_hash(key) < heldout_fraction * 2.0**64 else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _check_n(n: int) -> None:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")


def cut_at(text: str, markers: Iterable[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any marker (e.g. the EOS token's text)."""
    cut = len(text)
    for m in markers:
        if m:
            i = text.find(m)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


def exact_match(answer: str | None, completion_text: str) -> float | None:
    """1.0 if ``completion_text.strip() == answer.strip()`` else 0.0; None when there is no answer."""
    return None if answer is None else GRADERS["exact"].grade(answer, completion_text)


class _SyntheticTask:
    """Shared sampling for the built-in tasks: subclasses define ``_draw(rng) -> (key, Example)``."""

    name: ClassVar[str]
    max_tries_per_example: ClassVar[int] = 200

    def _draw(self, rng: np.random.Generator) -> tuple[str, Example]:
        raise NotImplementedError

    def _seed_entropy(self) -> list[int]:
        return [_stable_hash(f"{self.name}:{dataclasses.astuple(self)}") & 0xFFFFFFFF]  # type: ignore[arg-type]

    def examples(self, n: int, seed: int, split: str = "train") -> list[Example]:
        """``n`` examples of ``split``, deterministic in ``(options, n, seed, split)``.

        Items are drawn uniformly and kept when their content key hashes into ``split``; distinct items are
        preferred, and repeats are allowed once the split has run out of new items: `max_tries_per_example`
        draws in a row from the split brought nothing new (so a small task, e.g. 1-digit addition with 45 training
        pairs, fills a pool of 4,096 in about 8,000 draws instead of 800,000).
        """
        _check_n(n)
        _check_split(split)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, SPLITS.index(split), *self._seed_entropy()])
        out: list[Example] = []
        seen: set[str] = set()
        tries = misses = 0  # misses: draws from the split since the last new item
        exhausted = False
        budget = self.max_tries_per_example * max(n, 1)
        while len(out) < n:
            key, ex = self._draw(rng)
            tries += 1
            if tries > 2 * budget and not out:
                raise ValueError(f"task {self.name!r} {dataclasses.asdict(self)}: split {split!r} looks empty")
            if split_of(key) != split:
                continue
            if key in seen and not exhausted:
                misses += 1
                if misses < self.max_tries_per_example:
                    continue
                exhausted = True
            misses = 0
            seen.add(key)
            out.append(dataclasses.replace(ex, meta={**ex.meta, "split": split}))
        return out

    def grade(self, example: Example, completion_text: str) -> float:
        """Exact match of the stripped completion with the answer: 1.0 or 0.0."""
        score = exact_match(example.answer, completion_text)
        return 0.0 if score is None else score


def _positive_int(task: str, option: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"task {task!r}: option {option!r} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------------------------------- built-ins


@register_task("addition")
@dataclasses.dataclass(frozen=True)
class AdditionTask(_SyntheticTask):
    """``"a+b="`` → ``str(a + b)`` with a, b uniform in [0, 10**digits)."""

    digits: int = 2
    name: ClassVar[str] = "addition"

    def __post_init__(self):
        _positive_int(self.name, "digits", self.digits)

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1

    def _draw(self, rng):
        hi = 10**self.digits
        a, b = (int(x) for x in rng.integers(0, hi, size=2))
        key = f"{min(a, b)}+{max(a, b)}"  # unordered pair: a+b and b+a share a split
        return key, Example(prompt=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})


@register_task("sort")
@dataclasses.dataclass(frozen=True)
class SortTask(_SyntheticTask):
    """``"sort d1 d2 ...:"`` → the ``length`` digits in ascending order, space-separated."""

    length: int = 4
    name: ClassVar[str] = "sort"

    def __post_init__(self):
        _positive_int(self.name, "length", self.length)

    @property
    def max_answer_chars(self) -> int:
        return 2 * self.length - 1

    def _draw(self, rng):
        ds = [int(x) for x in rng.integers(0, 10, size=self.length)]
        key = " ".join(map(str, ds))
        return key, Example(prompt=f"sort {key}:", answer=" ".join(map(str, sorted(ds))), meta={"digits": ds})


@register_task("copy")
@dataclasses.dataclass(frozen=True)
class CopyTask(_SyntheticTask):
    """``"copy s:"`` → ``s`` for a string s of ``length`` digits."""

    length: int = 4
    name: ClassVar[str] = "copy"

    def __post_init__(self):
        _positive_int(self.name, "length", self.length)

    @property
    def max_answer_chars(self) -> int:
        return self.length

    def _draw(self, rng):
        s = "".join(str(int(x)) for x in rng.integers(0, 10, size=self.length))
        return s, Example(prompt=f"copy {s}:", answer=s, meta={"digits": s})


@register_task("reverse")
@dataclasses.dataclass(frozen=True)
class ReverseTask(_SyntheticTask):
    """``"reverse s:"`` → ``s[::-1]`` for a string s of ``length`` digits."""

    length: int = 4
    name: ClassVar[str] = "reverse"

    def __post_init__(self):
        _positive_int(self.name, "length", self.length)

    @property
    def max_answer_chars(self) -> int:
        return self.length

    def _draw(self, rng):
        s = "".join(str(int(x)) for x in rng.integers(0, 10, size=self.length))
        return s, Example(prompt=f"reverse {s}:", answer=s[::-1], meta={"digits": s})


# ----------------------------------------------------------------------------------------------------- JSONL

@register_task("jsonl")
@dataclasses.dataclass(frozen=True)
class JsonlTask:
    """Prompts (and optional reference answers) from a JSONL file, one JSON object per line.

    - A row holds a conversation under ``messages_key`` (default "messages": ``[{"role", "content"}, ...]``, see
      `data.chat`: the prompt is every turn up to the last user turn, an assistant turn after it the reference) or a
      text under ``prompt_key`` (default "prompt"), a non-empty string (not only whitespace); not both. A line
      longer than ``MAX_LINE_BYTES`` is refused before it is read whole.
    - ``chat``: how prompts meet the tokenizer's chat template. ``auto`` (default): conversations are rendered by
      it, a text prompt is rendered as one user turn when the tokenizer has a template and encoded as it is when
      not; ``true``: every prompt is rendered (a tokenizer without a template is an error); ``false``: text prompts
      are encoded as they are and a conversation is refused. ``chat_template_kwargs`` are passed to the template
      (e.g. ``{enable_thinking: false}`` for Qwen3).
    - ``answer_key`` (default "answer") is optional per line and, where present, the reference (over a final
      assistant turn); a non-string answer (e.g. ``46``) is used as ``str(answer)``. ``grade`` scores with
      ``grader`` (`data.graders`: exact, marker, numeric) where a reference exists and returns **None** where it
      does not: such examples are ungraded, and callers average only the non-None scores.
    - Split: a line with a ``"split"`` field ("train" or "heldout") goes there; any other line is held out iff
      the hash of its prompt (``Example.key``) falls in the lowest 10% (see ``split_of``).
    - ``examples(n, seed, split)`` shuffles that split's rows with ``seed`` and takes ``n``; if ``n`` exceeds the
      split, further freshly shuffled passes over it follow (rows repeat, none is dropped).

    Errors (TaskError, a ValueError, or FileNotFoundError) name the file and the 1-based line number.
    """

    path: str
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str = "messages"
    chat: str | bool = "auto"
    chat_template_kwargs: dict | None = None
    grader: str = "exact"
    name: ClassVar[str] = "jsonl"

    def __post_init__(self):
        if not (self.chat == "auto" or isinstance(self.chat, bool)):
            raise TaskError(f"task 'jsonl': option 'chat' must be auto, true or false, got {self.chat!r}")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            raise TaskError(f"task 'jsonl': option 'chat_template_kwargs' must be a mapping of template variables "
                            f"(e.g. {{enable_thinking: false}}), got {kwargs!r}")
        try:
            get_grader(self.grader)
        except ValueError as e:
            raise TaskError(f"task 'jsonl': option 'grader': {e}") from None
        object.__setattr__(self, "_rows", _load_jsonl(os.fspath(self.path), self))

    @property
    def rows(self) -> tuple[Example, ...]:
        return self._rows  # type: ignore[attr-defined]

    @property
    def graded(self) -> bool:
        """True when every row has a reference answer."""
        return all(ex.answer is not None for ex in self.rows)

    @property
    def max_answer_chars(self) -> int | None:
        answers = [len(ex.answer) for ex in self.rows if ex.answer is not None]
        return max(answers) if answers else None

    def split_rows(self, split: str) -> list[Example]:
        _check_split(split)
        return [ex for ex in self.rows if ex.meta["split"] == split]

    def examples(self, n: int, seed: int, split: str = "train") -> list[Example]:
        _check_n(n)
        pool = self.split_rows(split)
        if n == 0:
            return []
        if not pool:
            raise TaskError(f"{self.path}: split {split!r} has no rows (of {len(self.rows)}); mark some rows with "
                            f"\"split\": \"{split}\" (rows without one are held out by a hash of the prompt, ~10%)")
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, SPLITS.index(split)])
        out: list[Example] = []
        while len(out) < n:
            out.extend(pool[i] for i in rng.permutation(len(pool)))
        return out[:n]

    def grade(self, example: Example, completion_text: str) -> float | None:
        """``grader``'s score (1.0/0.0) of the completion against the reference; None when there is none."""
        return None if example.answer is None else GRADERS[self.grader].grade(example.answer, completion_text)


def _load_jsonl(path: str, task: JsonlTask) -> tuple[Example, ...]:
    """Every row of the file (TaskError naming file:line for a bad one, including bytes that are not UTF-8)."""
    if not os.path.isfile(path):
        raise TaskFileNotFound(f"JSONL task file not found: {path}")
    parsed = (_parse_row(f"{path}:{lineno}", lineno, raw, task) for lineno, raw in file_lines(path))
    rows = [ex for ex in parsed if ex is not None]
    if not rows:
        raise TaskError(f"{path}: no rows (the file is empty)")
    return tuple(rows)


def file_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each line; a line over `MAX_LINE_BYTES` is a TaskError naming it, after
    reading no more than the cap of it (a line is never read whole before its size is known)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise TaskError(f"{path}:{lineno}: a line of more than {MAX_LINE_BYTES:,} bytes (the most a prompt "
                                f"line may hold; a prompt must fit the student's context); refused without reading "
                                f"the rest")
            yield lineno, raw


def read_object(where: str, raw: bytes) -> dict | None:
    """The JSON object of one line (None for a blank line); TaskError naming ``where`` (file:line) for bytes that are
    not UTF-8, invalid JSON, or a value that is not an object."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def text_field(where: str, obj: dict, key: str, what: str = "prompt") -> str:
    """``obj[key]``, a string with more than whitespace; TaskError naming ``where`` and the key otherwise."""
    if key not in obj:
        raise TaskError(f"{where}: missing {what} key {key!r}; keys present: {sorted(obj)}")
    text = obj[key]
    if not isinstance(text, str):
        raise TaskError(f"{where}: {key!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise TaskError(f"{where}: {key!r} is empty{' (only whitespace)' if text else ''}; every row needs a "
                        f"{what}")
    return text


def answer_field(where: str, obj: dict, key: str) -> str | None:
    """``obj[key]`` as a string (a number as ``str(number)``), None when absent; TaskError for a list or object."""
    answer = obj.get(key)
    if answer is not None and not isinstance(answer, str):
        if isinstance(answer, (dict, list)):
            raise TaskError(f"{where}: {key!r} must be a string or number, got {answer!r}")
        answer = str(answer)
    return answer


def _row_prompt(where: str, obj: dict, task: JsonlTask) -> tuple[str, ChatPrompt | None, str | None]:
    """(prompt text, its ChatPrompt or None, the final assistant turn or None) of a row, by ``task.chat``."""
    kwargs = task.chat_template_kwargs or {}
    if task.messages_key not in obj:
        prompt = text_field(where, obj, task.prompt_key)
        chat = None if task.chat is False else ChatPrompt((("user", prompt),), kwargs, required=task.chat is True)
        return prompt, chat, None
    if task.prompt_key in obj:
        raise TaskError(f"{where}: both {task.messages_key!r} and {task.prompt_key!r}; a row holds one prompt")
    if task.chat is False:
        raise TaskError(f"{where}: a {task.messages_key!r} conversation is rendered by the chat template, but "
                        f"task.options.chat=false; set chat to auto or true")
    try:
        turns, reference = split_turns(where, check_turns(where, obj[task.messages_key]))
    except ChatError as e:
        raise TaskError(str(e)) from None
    return turns[-1][1], ChatPrompt(turns, kwargs), reference


def _parse_row(where: str, lineno: int, raw: bytes, task: JsonlTask) -> Example | None:
    """The Example of one line (None for a blank line); TaskError naming ``where`` (file:line) for anything else."""
    obj = read_object(where, raw)
    if obj is None:
        return None
    prompt, chat, reference = _row_prompt(where, obj, task)
    answer = answer_field(where, obj, task.answer_key)
    answer = reference if answer is None else answer
    reason = None if answer is None else GRADERS[task.grader].check(answer)
    if reason:
        raise TaskError(f"{where}: {reason}")
    ex = Example(prompt=prompt, answer=answer, chat=chat)
    if "split" in obj:
        split = obj["split"]
        if split not in SPLITS:
            raise TaskError(f"{where}: 'split' must be one of {SPLITS}, got {split!r}")
    else:
        split = split_of(ex.key)
    meta = {k: v for k, v in obj.items() if k not in (task.prompt_key, task.answer_key, task.messages_key)}
    meta.update(split=split, line=lineno)
    return dataclasses.replace(ex, meta=meta)


# ----------------------------------------------------------------------------------------------------- corpus


def corpus(task: Task | str, n: int, seed: int, split: str = "train") -> list[str]:
    """``n`` strings ``prompt + answer`` (no EOS: the caller appends the tokenizer's EOS token).

    For training a tokenizer or a teacher by supervised learning; uses the train split by default so that a
    teacher trained on it never sees held-out items. Examples without an answer contribute the prompt alone.
    """
    if isinstance(task, str):
        task = get_task(task)
    return [ex.prompt + (ex.answer or "") for ex in task.examples(n, seed, split)]
