"""opdjax.logprobs: the chunked log-probs (from hidden states) against a full log_softmax, and the shifted helper
against a numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.core.logprobs import chunked_token_logprobs, logprob_chunk_len, shifted_logprobs, token_logprobs


def _tokens(B=3, L=13, V=96, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, L)).astype(np.int32))


def test_shifted_logprobs_match_numpy_reference_with_topk_and_full_rows():
    logits = np.random.default_rng(1).standard_normal((2, 7, 11)).astype(np.float32) * 2
    tokens = _tokens(2, 7, 11)
    out = shifted_logprobs(jnp.asarray(logits), tokens, 0.5, top_k=3, full=True)
    z = logits[:, :-1].astype(np.float64) / 0.5
    lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    ref = np.take_along_axis(lp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out["logp_BT"])[:, 1:], ref, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out["logp_BT"])[:, 0] == 0) and np.all(np.asarray(out["logprobs_BTV"])[:, 0] == 0)
    np.testing.assert_allclose(np.asarray(out["logprobs_BTV"])[:, 1:], lp, rtol=1e-5, atol=1e-5)
    top = np.argsort(-lp, -1)[..., :3]
    np.testing.assert_array_equal(np.asarray(out["topk_ids_BTK"])[:, 1:], top)
    np.testing.assert_allclose(np.asarray(out["topk_logp_BTK"])[:, 1:], np.take_along_axis(lp, top, -1), atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 1, 3, 5, 100])
def test_chunked_logprobs_equal_full_log_softmax_values_and_grads(chunk):
    k1, k2 = jax.random.split(jax.random.key(0))
    h = jax.random.normal(k1, (3, 13, 32))
    w = jax.random.normal(k2, (32, 96)) * 0.3
    tokens = _tokens()
    T = 0.7

    def full(h, w):
        return token_logprobs(jnp.einsum("ble,ev->blv", h, w), tokens, T)[0]

    def chunked(h, w):
        return chunked_token_logprobs(h, w, tokens, T, chunk)

    np.testing.assert_allclose(chunked(h, w), full(h, w), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(chunked(h, w))[:, 0] == 0)
    wts = jax.random.normal(jax.random.key(3), (3, 13))
    g_full = jax.grad(lambda h, w: jnp.sum(full(h, w) * wts), argnums=(0, 1))(h, w)
    g_chunk = jax.grad(lambda h, w: jnp.sum(chunked(h, w) * wts), argnums=(0, 1))(h, w)
    for a, b in zip(g_chunk, g_full):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_chunk_length_bounds_logits_per_chunk():
    assert logprob_chunk_len(16, 1023, 32768) == 128  # 16 * 128 * 32768 = 2^26
    assert logprob_chunk_len(4, 40, 320) == 40
    assert logprob_chunk_len(1 << 20, 10, 1 << 20) == 1


