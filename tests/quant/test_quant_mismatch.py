"""Simulated FP8 in a real model: it changes the logits, and the engine-vs-learner k3 grows with what is quantized."""

import jax
import jax.numpy as jnp
import numpy as np

from opdjax import quant
from opdjax.core import mismatch
from opdjax.core.logprobs import token_logprobs
from opdjax.models import decoder, hf
from opdjax.rollout import SamplingParams
from opdjax.rollout import EngineMismatch, JaxEngine


def test_default_fp8_recipe_changes_logits(peaked_model):
    cfg, graphdef, state = peaked_model
    named = hf.named_params(cfg, state, hf_layout=False)
    q_state = hf.state_from_named(cfg, quant.apply_to_named(quant.FP8_DEFAULT, named), state, hf_layout=False)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 16)))
    ref, _ = decoder.forward(graphdef, state, tokens)
    out, _ = decoder.forward(graphdef, q_state, tokens, quant=quant.forward_quant(quant.FP8_DEFAULT))
    diff = float(jnp.max(jnp.abs(out - ref)))
    assert 1e-3 < diff < 0.5 * float(jnp.max(jnp.abs(ref)))


def test_k3_grows_from_weights_only_to_w8a8_to_fp8_kv(peaked_model):
    cfg, graphdef, state = peaked_model
    prompts = [list(np.random.RandomState(i).randint(0, cfg.vocab_size, 6)) for i in range(64)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    logp_fn = jax.jit(lambda p, t, v: token_logprobs(decoder.forward(graphdef, p, t, valid_BT=v)[0], t)[0])
    k3 = {}
    for name in ("none", "fp8_weights_only", "fp8_w8a8", "fp8_w8a8_kv"):
        engine = JaxEngine(cfg, state, mismatch=EngineMismatch(recipe=name))
        batch = engine.generate(prompts, sampling, seed=0)  # the engine's own samples
        learner = logp_fn(state, jnp.asarray(batch.tokens_BT), jnp.asarray(batch.valid_BT))
        k3[name] = float(mismatch.metrics(learner, jnp.asarray(batch.rollout_logp_BT),
                                          jnp.asarray(batch.completion_mask_BT))["k3"])
    print(k3)
    assert k3["none"] < 1e-9
    assert 0 < k3["fp8_weights_only"] < k3["fp8_w8a8"] < k3["fp8_w8a8_kv"]
