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

__all__ = ["Teacher", "TeacherScores", "VocabMismatchError", "check_same_vocab", "check_in_vocab", "scores_from_engine"]


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


def check_same_vocab(student: ModelConfig, teacher: ModelConfig, student_tok=None, teacher_tok=None) -> None:
    """Raise unless student and teacher agree on vocab size (and on the tokenizers' vocabularies, when given)."""
    if student.vocab_size != teacher.vocab_size:
        raise VocabMismatchError(f"student vocab_size={student.vocab_size} but teacher vocab_size="
                                 f"{teacher.vocab_size}; OPD scores the student's tokens with the teacher, so both "
                                 f"must share one tokenizer and vocabulary")
    if student_tok is not None and teacher_tok is not None:
        a, b = student_tok.get_vocab(), teacher_tok.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise VocabMismatchError(f"student and teacher tokenizers differ (e.g. {diff}); they must be identical")


def check_in_vocab(tokens_BT: np.ndarray, valid_BT: np.ndarray, vocab_size: int) -> None:
    """Raise VocabMismatchError when a real (valid) token id is outside the teacher's vocabulary."""
    top = int(np.max(np.where(valid_BT, tokens_BT, 0), initial=0))
    if top >= vocab_size:
        raise VocabMismatchError(f"token id {top} is outside the teacher's vocabulary (vocab_size={vocab_size})")
