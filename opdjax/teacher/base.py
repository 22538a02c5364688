"""The teacher side of OPD: the `Teacher` protocol, its typed scores, and the vocabulary checks.

A teacher scores the tokens the student sampled: `score(tokens_BT, valid_BT, needs, top_k) -> TeacherScores`,
where `needs` is a loss's declared teacher data (`core.losses.NEEDS`). Implementations: `JaxTeacher`
(in-process, jitted, sharded on the learner's mesh) and `VllmTeacher` (vLLM prompt log-probs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from opdjax.core.errors import InputError
from opdjax.models.config import ModelConfig

__all__ = ["Teacher", "TeacherScores", "VocabMismatchError", "check_same_vocab", "check_in_vocab", "first_token_difference", "scores_from_engine"]


@dataclasses.dataclass(frozen=True)
class TeacherScores:
    """What a teacher returns, named as the `core.types.Batch` fields they fill (host arrays; None = not asked).

    teacher_logp_BT[b, t]        log softmax(teacher logits[b, t-1] / τ)[tokens[b, t]]  (0 at t = 0)
    teacher_topk_ids_BTK         the top-k token ids predicting position t (distinct)
    teacher_topk_logp_BTK        their log-probs, normalised over the full vocabulary
    teacher_logits_BTV           shifted logits / τ (zeros at t = 0)
    """

    teacher_logp_BT: Any
    teacher_topk_ids_BTK: Any = None
    teacher_topk_logp_BTK: Any = None
    teacher_logits_BTV: Any = None

    def present(self) -> dict[str, Any]:
        """The fields that are set, by Batch field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def scores_from_engine(s: dict[str, Any]) -> TeacherScores:
    """An engine's `score` output (logp_BT, topk_ids_BTK / topk_logp_BTK, logits_BTV) as `TeacherScores`: the one
    mapping every teacher uses, so engines and teachers share one scoring path."""
    return TeacherScores(teacher_logp_BT=s["logp_BT"], teacher_topk_ids_BTK=s.get("topk_ids_BTK"),
                         teacher_topk_logp_BTK=s.get("topk_logp_BTK"), teacher_logits_BTV=s.get("logits_BTV"))


class Teacher(Protocol):
    """A fixed teacher model scoring token sequences."""

    cfg: ModelConfig

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores: ...


class VocabMismatchError(InputError):
    """Student and teacher do not share a vocabulary."""


def check_same_vocab(student: ModelConfig, teacher: ModelConfig, student_tok=None, teacher_tok=None) -> int:
    """The usable vocabulary U both models share; VocabMismatchError (one line) when they do not share one.

    With both tokenizers: they must map every id to the same token (else the first differing id and its two
    tokens are named), U = their length, and each model needs vocab_size >= U; rows beyond U are padding that no
    token id reaches (Qwen2.5: 151665 tokens in 151936 or 152064 rows), excluded from every distribution. Without
    both, the two vocab sizes must be equal (nothing says which rows are padding), and U = the student tokenizer's
    length (or the student's usable size).
    """
    if student_tok is None or teacher_tok is None:
        if student.vocab_size != teacher.vocab_size:
            raise VocabMismatchError(f"student vocab_size={student.vocab_size} but teacher vocab_size="
                                     f"{teacher.vocab_size}, and no tokenizer of both to tell padding rows from "
                                     f"tokens; expected equal sizes or both models' tokenizers")
        return len(student_tok) if student_tok is not None else student.usable_size
    first = first_token_difference(student_tok, teacher_tok)
    if first is not None:
        i, a, b = first
        raise VocabMismatchError(f"student and teacher tokenizers differ first at id {i}: student {a!r}, teacher "
                                 f"{b!r}; OPD scores the student's tokens with the teacher, so they must be identical")
    n = len(student_tok)
    for role, cfg in (("student", student), ("teacher", teacher)):
        if cfg.vocab_size < n:
            raise VocabMismatchError(f"{role} vocab_size={cfg.vocab_size} is below the tokenizer's {n} tokens; "
                                     f"expected vocab_size >= {n}")
    return n


def first_token_difference(tok_a, tok_b) -> tuple[int, str | None, str | None] | None:
    """(id, token in a, token in b) of the lowest id the two tokenizers map differently (None: no such id; a
    token is None where that tokenizer has no such id)."""
    a = {i: t for t, i in tok_a.get_vocab().items()}
    b = {i: t for t, i in tok_b.get_vocab().items()}
    diff = [i for i in set(a) | set(b) if a.get(i) != b.get(i)]
    if not diff:
        return None
    i = min(diff)
    return i, a.get(i), b.get(i)


def check_in_vocab(tokens_BT: np.ndarray, valid_BT: np.ndarray, vocab_size: int) -> None:
    """Raise VocabMismatchError when a real (valid) token id is outside the teacher's vocabulary."""
    top = int(np.max(np.where(valid_BT, tokens_BT, 0), initial=0))
    if top >= vocab_size:
        raise VocabMismatchError(f"token id {top} is outside the teacher's vocabulary (vocab_size={vocab_size})")
