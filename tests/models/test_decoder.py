"""Decoder: merged projections compute what the separate ones compute, for every family (q/k/v biases included),
with and without a KV cache; the Pallas decode attention is softmax attention over each row's slot span."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.models import decoder
from opdjax.models.config import FAMILIES
from opdjax.models.tiny import tiny_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_projections_match_separate_ones(family):
    cfg = tiny_config(family, "tiny", vocab_size=64)
    model = decoder.create(cfg, seed=3)
    if cfg.attention_bias:  # nonzero biases, so a misplaced bias would show
        for block in model.layers:
            for lin in (block.attn.q, block.attn.k, block.attn.v):
                lin.bias[...] = 0.1 * jax.random.normal(jax.random.key(len(lin.name)), lin.bias.shape)
    merged = decoder.merge_projections(model)
    E, HD, KD, F = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    assert merged[0].qkv_kernel.shape == (E, HD + 2 * KD) and merged[0].gate_up_kernel.shape == (E, 2 * F)
    assert (merged[0].qkv_bias is not None) == cfg.attention_bias
    tokens = jax.random.randint(jax.random.key(0), (3, 10), 0, 64)
    valid = jnp.ones((3, 10), bool).at[1, :4].set(False)
    ref, _ = model(tokens, valid_BT=valid)
    out, _ = model(tokens, valid_BT=valid, merged=merged)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    cache = decoder.init_cache(cfg, 3, 12)
    _, cache = model(tokens, valid_BT=valid, cache=cache, merged=merged)
    step, _ = model(tokens[:, :1], cache=cache, merged=merged)
    full, _ = model(jnp.concatenate([tokens, tokens[:, :1]], 1), valid_BT=jnp.pad(valid, ((0, 0), (0, 1)),
                                                                                    constant_values=True))
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(full[:, -1]), atol=1e-5, rtol=0)


def test_pallas_decode_attention_is_softmax_attention_over_the_span():
    """Against a numpy softmax over slots [start_b, end), spans starting mid-split and in a later split, ending
    mid-split; the slots outside the span hold huge values, so reading any of them would show."""
    B, K, G, S, D = 3, 2, 3, 2 * decoder.PALLAS_DECODE_SPLIT, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((B, K, G, D), (B, K, S, D), (B, K, S, D)))
    start, end = np.array([5, 0, 70]), 100
    for b in range(B):
        k[b, :, :start[b]], v[b, :, :start[b]] = 1e4, 1e4
    k[:, :, end:], v[:, :, end:] = 1e4, 1e4
    out = np.asarray(decoder.pallas_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                     jnp.asarray(start), jnp.asarray(end)))
    for b in range(B):
        s = np.einsum("kgd,ksd->kgs", q[b], k[b, :, start[b]:end]) / np.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), v[b, :, start[b]:end])
        np.testing.assert_allclose(out[b], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of"):
        decoder.pallas_decode_attention(jnp.asarray(q), jnp.asarray(k[:, :, :100]), jnp.asarray(v[:, :, :100]),
                                        jnp.asarray(start), jnp.asarray(end))
