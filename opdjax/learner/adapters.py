"""How the learner reads a causal LM: an adapter turns (model, tokens_BT, valid_BT) into logits or hidden states.

The learner trains any Flax NNX causal LM; it only needs one of:

- ``logits(model, tokens_BT, valid_BT) -> logits_BTV`` — float logits where position t predicts token t + 1;
- ``hidden(model, tokens_BT, valid_BT) -> (h_BTE, w_EV)`` — final hidden states and the output projection, which
  lets the learner compute token log-probs in chunks without materialising [B, T, V] (None: not available).

`DecoderAdapter` reads opdjax's own `models.decoder.Decoder` (both paths). `LogitsAdapter` reads any NNX module
whose call returns logits (or a tuple whose first item is the logits), e.g. a model of your own::

    graphdef, params = nnx.split(MyLM(rngs=nnx.Rngs(0)))
    learner = Learner(graphdef, adapter=LogitsAdapter(), tx=tx, temperature=1.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax

Array = jax.Array

__all__ = ["CausalLMAdapter", "DecoderAdapter", "LogitsAdapter"]


class CausalLMAdapter(Protocol):
    """What the learner asks of a model (see the module docstring)."""

    def logits(self, model: Any, tokens_BT: Array, valid_BT: Array) -> Array:
        """[B, T, V] logits; position t predicts token t + 1."""

    def hidden(self, model: Any, tokens_BT: Array, valid_BT: Array) -> tuple[Array, Array] | None:
        """(final hidden states [B, T, E], output projection [E, V]), or None when the model has no such split."""


@dataclasses.dataclass(frozen=True)
class DecoderAdapter:
    """opdjax's `Decoder`: logits from its call, hidden states and `lm_head_kernel()` for chunked log-probs."""

    def logits(self, model, tokens_BT, valid_BT):
        return model(tokens_BT, valid_BT=valid_BT)[0]

    def hidden(self, model, tokens_BT, valid_BT):
        h_BTE, _ = model(tokens_BT, valid_BT=valid_BT, return_hidden=True)
        return h_BTE, model.lm_head_kernel()


def _call_with_valid(model, tokens_BT, valid_BT):
    return model(tokens_BT, valid_BT)


@dataclasses.dataclass(frozen=True)
class LogitsAdapter:
    """Any NNX causal LM: ``call(model, tokens_BT, valid_BT)`` returns its logits (default: ``model(tokens,
    valid)``); a tuple's first item is taken. No hidden-state split: log-probs come from full logits."""

    call: Callable[[Any, Array, Array], Any] = _call_with_valid

    def logits(self, model, tokens_BT, valid_BT):
        out = self.call(model, tokens_BT, valid_BT)
        return out[0] if isinstance(out, tuple) else out

    def hidden(self, model, tokens_BT, valid_BT):
        return None
