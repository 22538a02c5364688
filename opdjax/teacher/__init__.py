"""The teacher: the `Teacher` protocol and typed scores (`base`), `JaxTeacher` (`jax_teacher`), `VllmTeacher`
(`vllm_teacher`, imports vLLM). Both score through their engine's `score` (`base.scores_from_engine`)."""

from opdjax.teacher.base import (
    Teacher,
    TeacherScores,
    VocabMismatchError,
    check_in_vocab,
    check_same_vocab,
    scores_from_engine,
)
from opdjax.teacher.jax_teacher import JaxTeacher

__all__ = ["JaxTeacher", "Teacher", "TeacherScores", "VocabMismatchError", "check_in_vocab", "check_same_vocab",
           "scores_from_engine"]
