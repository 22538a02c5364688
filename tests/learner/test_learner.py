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


def test_length_bucket_rounds_up_with_four_buckets_per_doubling():
    from opdjax.learner.learner import length_bucket
    assert [length_bucket(n) for n in (1, 16, 17, 100, 512, 513, 1000, 1025)] == \
        [16, 16, 20, 112, 512, 640, 1024, 1280]
    assert length_bucket(5, minimum=1) == 5 and length_bucket(9, per_octave=1, minimum=1) == 16


def _long_padded_batch(T=40, seed=0):
    """Rows of 5..13 real positions (left-padded prompt, then a completion) in a [4, T] batch: the columns after
    position 12 are padding in every row; teacher top-k [4, T, 3] as a `_BTK` field."""
    rng = np.random.default_rng(seed)
    ends = np.array([13, 9, 5, 11])
    valid = (np.arange(T)[None, :] < ends[:, None]) & (np.arange(T)[None, :] >= np.array([0, 2, 1, 0])[:, None])
    mask = valid & (np.arange(T)[None, :] >= 4)
    topk = np.log(rng.dirichlet(np.ones(3), (4, T))).astype(np.float32)
    return {"tokens_BT": np.where(valid, rng.integers(1, CFG.vocab_size, (4, T)), 0).astype(np.int32),
            "valid_BT": valid, "mask_BT": mask, "rollout_logp_BT": np.where(mask, -2.0, 0.0).astype(np.float32),
            "teacher_topk_ids_BTK": rng.integers(0, CFG.vocab_size, (4, T, 3)).astype(np.int32),
            "teacher_topk_logp_BTK": topk}


def test_trim_padding_cuts_only_columns_that_are_padding_in_every_row():
    from opdjax.core.types import Batch
    from opdjax.learner.learner import trim_padding
    b = Batch(**_long_padded_batch())
    cut = trim_padding(b)
    assert cut.tokens_BT.shape == (4, 16) and cut.teacher_topk_logp_BTK.shape == (4, 16, 3)  # 13 -> bucket 16
    for f, v in cut.present().items():
        np.testing.assert_array_equal(v, getattr(b, f)[:, :16])
    assert not np.asarray(b.valid_BT)[:, 16:].any()
    short = Batch(**_long_padded_batch(T=14))
    assert trim_padding(short) is short  # nothing to cut: the bucket (16) is wider than the batch


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_trimmed_train_step_matches_the_full_width_step(micro_batches):
    """trim_padding on (a [4, 16] step) and off (the [4, 40] batch as given): the same metrics and updated
    parameters up to float32 rounding, for the default loss (full log-softmax) with and without accumulation.
    Plain SGD, so a parameter moves by lr x its gradient (Adam would turn rounding in a near-zero gradient into a
    full step)."""
    import optax
    graphdef, params = nnx.split(decoder.create(CFG, seed=1))
    out = {}
    for trim in (False, True):
        learner = Learner(graphdef, tx=optax.sgd(0.5), micro_batches=micro_batches, trim_padding=trim)
        state, m = learner.train_step(learner.init(params), _long_padded_batch())
        out[trim] = (m, jax.tree.leaves(state.params))
    (m0, p0), (m1, p1) = out[False], out[True]
    assert m0.keys() == m1.keys() and m0["loss"] != 0
    for k in m0:
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6, nan_ok=True), k  # lr: nan without a schedule
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
