"""`VllmTeacher`: a fixed teacher served by vLLM, scoring through prompt log-probs (the `Teacher` protocol)."""

from __future__ import annotations

import pathlib

import numpy as np

from opdjax.rollout.vllm_engine import VllmEngine
from opdjax.teacher.base import TeacherScores, check_in_vocab, scores_from_engine

__all__ = ["VllmTeacher"]


class VllmTeacher:
    """A fixed teacher served by vLLM, scoring through prompt log-probs (`JaxTeacher.score`'s protocol).

    Provides teacher_logp and teacher_topk; full teacher logits are not available from vLLM.
    """

    def __init__(self, model_path: str | pathlib.Path, *, dtype: str = "float32", **engine_kw):
        self.engine = VllmEngine(model_path, dtype=dtype, **engine_kw)
        self.cfg = self.engine.cfg

    @classmethod
    def from_engine(cls, engine: VllmEngine) -> "VllmTeacher":
        """A teacher scoring with an existing engine (one vLLM instance for both roles)."""
        self = cls.__new__(cls)
        self.engine, self.cfg = engine, engine.cfg
        return self

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores:
        if "teacher_logits" in needs:
            raise ValueError("VllmTeacher cannot provide full teacher logits (needs 'teacher_logits'); use "
                             "teacher.engine=jax or a loss that needs only teacher_logp / teacher_topk")
        check_in_vocab(tokens_BT, valid_BT, self.cfg.usable_size)
        k = top_k if "teacher_topk" in needs else 0
        return scores_from_engine(self.engine.score(tokens_BT, valid_BT, top_k=k))
