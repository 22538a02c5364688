"""The learner's fast paths against the plain ones: fused attention, remat, mixed precision.

References: `token_logprobs` on fully materialised logits (a log_softmax nobody here had to re-derive), the einsum
attention path (itself checked against transformers in tests/models/test_hf_parity.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opdjax.core.logprobs import token_logprobs
from opdjax.learner import Learner, make_optimizer
from opdjax.models import decoder
from opdjax.models.config import ModelConfig

CFG = ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)


def _batch(B=3, L=13, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, L)).astype(np.int32)
    valid = np.ones((B, L), bool)
    valid[0, :4] = False   # left padding (a short prompt)
    valid[1, -3:] = False  # right padding (a completion that stopped)
    valid[2, :2] = False
    valid[2, -1:] = False
    return jnp.asarray(tokens), jnp.asarray(valid)


def test_attention_auto_resolves_per_backend_and_dtype():
    assert decoder.resolve_attention("auto", jnp.bfloat16, 128, backend="gpu") == "cudnn"
    assert decoder.resolve_attention("auto", jnp.float32, 128, backend="gpu") == "xla"
    assert decoder.resolve_attention("auto", jnp.bfloat16, 256, backend="gpu") == "xla"
    assert decoder.resolve_attention("auto", jnp.bfloat16, 128, backend="cpu") == "xla"
    assert decoder.resolve_attention("einsum", jnp.bfloat16, 128, backend="gpu") == "einsum"
    with pytest.raises(ValueError, match="choose one of"):
        decoder.resolve_attention("flash", jnp.float32, 64)
    with pytest.raises(ValueError, match="remat"):
        decoder.create(CFG, remat="sometimes")


def _logits_and_grad(attention="auto", remat="none", dtype=jnp.float32):
    graphdef, params = nnx.split(decoder.create(CFG, seed=1, attention=attention, remat=remat, dtype=dtype))
    tokens, valid = _batch()

    def loss(p):
        logits, _ = decoder.forward(graphdef, p, tokens, valid_BT=valid)
        lp = token_logprobs(logits, tokens)[0]
        return jnp.sum(jnp.where(valid[:, 1:] & valid[:, :-1], lp[:, 1:], 0.0)), logits

    (val, logits), g = jax.value_and_grad(loss, has_aux=True)(params)
    return val, np.where(np.asarray(valid)[..., None], np.asarray(logits), 0.0), g


@pytest.mark.slow  # four attention/remat variants, forward and gradient (~30 s)
def test_fused_attention_and_remat_match_einsum_attention_with_left_and_right_padding():
    ref_val, ref_logits, ref_g = _logits_and_grad("einsum")
    for attention, remat in [("xla", "none"), ("auto", "block"), ("xla", "dots")]:
        val, logits, g = _logits_and_grad(attention, remat)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5, err_msg=f"{attention} {remat}")
        np.testing.assert_allclose(val, ref_val, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"{attention} {remat}")


def test_learner_step_mixed_precision_keeps_f32_params_and_matches_f32_loss():
    tokens, valid = _batch()
    comp = np.asarray(valid).copy()
    comp[:, :5] = False
    rng = np.random.default_rng(1)
    batch = {"tokens_BT": np.asarray(tokens), "valid_BT": np.asarray(valid), "mask_BT": comp,
             "rollout_logp_BT": np.where(comp, -rng.random(comp.shape), 0.0).astype(np.float32),
             "teacher_logp_BT": np.where(comp, -rng.random(comp.shape), 0.0).astype(np.float32)}
    losses = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        graphdef, params = nnx.split(decoder.create(CFG, seed=1, dtype=dtype, param_dtype=jnp.float32))
        tx, schedule = make_optimizer(lr=3e-4, total_steps=10, warmup_steps=5, grad_clip=1.0, b2=0.99)
        learner = Learner(graphdef, loss="reverse_kl_sampled", tx=tx, schedule=schedule, logprob_chunk=4)
        state = learner.init(params)
        state, m = learner.train_step(state, batch)
        assert all(np.isfinite(v) for v in m.values()), m
        assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
        losses[jnp.dtype(dtype).name] = m
    f32, bf16 = losses["float32"], losses["bfloat16"]
    # teacher_kl averages student minus teacher log-probs (about -5 here, far from 0): a bf16 path that returned
    # zeros, or ran in f32, would be caught; bf16 rounding moves it by well under 1%.
    assert abs(float(f32["teacher_kl"])) > 1.0
    assert float(bf16["teacher_kl"]) == pytest.approx(float(f32["teacher_kl"]), rel=1e-2)
    assert float(bf16["teacher_kl"]) != float(f32["teacher_kl"])  # the bf16 path really computed in bf16
    assert float(bf16["grad_norm"]) == pytest.approx(float(f32["grad_norm"]), rel=0.1)
    assert float(bf16["loss"]) == pytest.approx(float(f32["loss"]), rel=0.05, abs=0.02)


def test_causal_flag_added_for_cudnn_does_not_change_the_masked_attention():
    """The cuDNN path passes is_causal=True on top of the causal+padding mask (so cuDNN skips the upper
    triangle); with XLA's implementation on CPU the combination must equal the mask alone."""
    B, T, H, K, D = 2, 9, 4, 2, 16
    ks = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(kk, (B, T, n, D)) for kk, n in zip(ks, (H, K, K)))
    valid = jnp.asarray(np.arange(T)[None] >= np.array([[3], [0]]))
    mask = (jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]) & valid[:, None, :]
    a = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    b = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(a)[np.asarray(valid)], np.asarray(b)[np.asarray(valid)], atol=1e-6)
