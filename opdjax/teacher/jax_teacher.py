"""`JaxTeacher`: the teacher in-process (jitted; sharded on the learner's mesh when given one), and
`scores_from_logits`, the one mapping from teacher logits to `TeacherScores`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax.core.logprobs import shifted_logprobs
from opdjax.models import ModelConfig, decoder, hf
from opdjax.models.sharding import shard_state
from opdjax.teacher.base import TeacherScores, check_in_vocab


def scores_from_logits(logits_BTV: jax.Array, tokens_BT: jax.Array, top_k: int, full: bool,
                       temperature: float = 1.0) -> dict[str, jax.Array]:
    """teacher_logp_BT[b, l] = log softmax(logits[b, l-1] / τ)[tokens[b, l]] (0 at l = 0), plus top-k / logits.

    top-k ids/log-probs [B, T, K] describe the distribution predicting position l (normalised over the full vocab);
    teacher_logits_BTV are the shifted logits / τ (zeros at l = 0).
    """
    s = shifted_logprobs(logits_BTV, tokens_BT, temperature, top_k=top_k)
    out = {"teacher_logp_BT": s["logp_BT"]}
    if top_k:
        out["teacher_topk_logp_BTK"], out["teacher_topk_ids_BTK"] = s["topk_logp_BTK"], s["topk_ids_BTK"]
    if full:
        out["teacher_logits_BTV"] = jnp.pad(logits_BTV[:, :-1].astype(jnp.float32) / jnp.float32(temperature),
                                            ((0, 0), (1, 0), (0, 0)))
    return out


class JaxTeacher:
    """A fixed teacher model scoring token sequences."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, *, mesh=None,
                 temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"teacher temperature must be > 0, got {temperature}")
        self.cfg = cfg
        self.temperature = float(temperature)
        self.graphdef = graphdef
        if mesh is not None:
            params = shard_state(params, mesh)
        self.params = params
        self.mesh = mesh
        self._fns: dict = {}

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, mesh=None, temperature: float = 1.0) -> "JaxTeacher":
        cfg = ModelConfig.from_dir(path)
        graphdef, params = hf.load_state(path, cfg, param_dtype=dtype, dtype=dtype)
        return cls(cfg, graphdef, params, mesh=mesh, temperature=temperature)

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores:
        """The teacher data a loss `needs` (see `core.losses.NEEDS`) for these sequences, as host arrays."""
        check_in_vocab(tokens_BT, valid_BT, self.cfg.vocab_size)
        k = top_k if "teacher_topk" in needs else 0
        full = "teacher_logits" in needs
        key = (k, full)
        if key not in self._fns:
            def fn(params, tokens, valid):
                logits, _ = decoder.forward(self.graphdef, params, tokens, valid_BT=valid)
                return scores_from_logits(logits, tokens, k, full, self.temperature)

            self._fns[key] = jax.jit(fn)
        out = self._fns[key](self.params, jnp.asarray(tokens_BT), jnp.asarray(valid_BT, bool))
        return TeacherScores(**{name: np.asarray(v) for name, v in jax.device_get(out).items()})

