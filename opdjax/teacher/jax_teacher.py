"""`JaxTeacher`: the teacher in-process, scoring through a clean `JaxEngine` (jitted; sharded on the learner's mesh
when given one) — the one scoring path engines and teachers share (`JaxEngine.score`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax.models import ModelConfig, hf
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.teacher.base import TeacherScores, check_in_vocab, scores_from_engine


class JaxTeacher:
    """A fixed teacher model scoring token sequences (no quantization, noise or staleness) at `temperature`."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, *, mesh=None,
                 temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"teacher temperature must be > 0, got {temperature}")
        self.cfg = cfg
        self.temperature = float(temperature)
        dtype = jax.tree.leaves(params)[0].dtype
        self.engine = JaxEngine(cfg, params, graphdef=graphdef, mesh=mesh, dtype=dtype)

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, mesh=None, temperature: float = 1.0,
                        usable_vocab: int | None = None) -> "JaxTeacher":
        """The teacher of a HF directory, over the ids of its tokenizer (`hf.load_config`; usable_vocab, the shared
        tokenizer's length, overrides): padded vocabulary rows are never scored or in a top-k."""
        cfg = hf.load_config(path, usable_vocab)
        graphdef, params = hf.load_state(path, cfg, param_dtype=dtype, dtype=dtype)
        return cls(cfg, graphdef, params, mesh=mesh, temperature=temperature)

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores:
        """The teacher data a loss `needs` (see `core.losses.NEEDS`) for these sequences, as host arrays."""
        check_in_vocab(tokens_BT, valid_BT, self.cfg.usable_size)
        s = self.engine.score(tokens_BT, valid_BT, temperature=self.temperature,
                              top_k=top_k if "teacher_topk" in needs else 0,
                              full_logits="teacher_logits" in needs)
        return scores_from_engine(s)
