"""Teacher scoring: the teacher's log-prob of each sampled token and, when the loss needs it, top-k or logits.

`JaxTeacher` runs the teacher in-process (jitted; sharded on the learner's mesh when given one). A vLLM engine can
serve as the teacher too (`opdjax.rollout.vllm_engine`), through the same `score` protocol.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax.core.logprobs import shifted_logprobs
from opdjax.models import ModelConfig, decoder, hf


class VocabMismatchError(ValueError):
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


def scores_from_logits(logits_BLV: jax.Array, tokens_BL: jax.Array, top_k: int, full: bool,
                       temperature: float = 1.0) -> dict[str, jax.Array]:
    """teacher_logp_BL[b, l] = log softmax(logits[b, l-1] / τ)[tokens[b, l]] (0 at l = 0), plus top-k / logits.

    top-k ids/log-probs [B, L, K] describe the distribution predicting position l (normalised over the full vocab);
    teacher_logits_BLV are the shifted logits / τ (zeros at l = 0).
    """
    s = shifted_logprobs(logits_BLV, tokens_BL, temperature, top_k=top_k)
    out = {"teacher_logp_BL": s["logp_BL"]}
    if top_k:
        out["teacher_topk_logp_BLK"], out["teacher_topk_ids_BLK"] = s["topk_logp_BLK"], s["topk_ids_BLK"]
    if full:
        out["teacher_logits_BLV"] = jnp.pad(logits_BLV[:, :-1].astype(jnp.float32) / jnp.float32(temperature),
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
            from opdjax.models.sharding import shard_state

            params = shard_state(params, mesh)
        self.params = params
        self.mesh = mesh
        self._fns: dict = {}

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, mesh=None, temperature: float = 1.0) -> "JaxTeacher":
        cfg = ModelConfig.from_dir(path)
        graphdef, params = hf.load_state(path, cfg, param_dtype=dtype, dtype=dtype)
        return cls(cfg, graphdef, params, mesh=mesh, temperature=temperature)

    def score(self, tokens_BL: np.ndarray, valid_BL: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> dict[str, np.ndarray]:
        """The teacher data a loss `needs` (see `opdjax.losses.NEEDS`) for these sequences, as host arrays."""
        if np.max(tokens_BL, initial=0) >= self.cfg.vocab_size:
            raise VocabMismatchError(f"token id {int(np.max(tokens_BL))} is outside the teacher's vocabulary "
                                     f"(vocab_size={self.cfg.vocab_size})")
        k = top_k if "teacher_topk" in needs else 0
        full = "teacher_logits" in needs
        key = (k, full)
        if key not in self._fns:
            def fn(params, tokens, valid):
                logits, _ = decoder.forward(self.graphdef, params, tokens, valid_BT=valid)
                return scores_from_logits(logits, tokens, k, full, self.temperature)

            self._fns[key] = jax.jit(fn)
        out = self._fns[key](self.params, jnp.asarray(tokens_BL), jnp.asarray(valid_BL, bool))
        return {name: np.asarray(v) for name, v in jax.device_get(out).items()}

