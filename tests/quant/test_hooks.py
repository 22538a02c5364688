"""opdjax.quant.hooks: forward hooks for activations and the KV cache, calibrated KV scales, and the check that a
recipe's rounding survives compilation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax import quant as Q
from opdjax.quant import formats as QF
from opdjax.quant import hooks as QH
from tests.quant.reference import np_qdq

def test_forward_quant_hashable_and_usable_inside_jit():
    fq = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv"))
    assert hash(fq) == hash(Q.forward_quant("fp8_w8a8_kv")) and fq == Q.forward_quant("fp8_w8a8_kv")
    x = jax.random.normal(jax.random.key(9), (2, 5, 32)) * 3

    @jax.jit
    def f(x):
        return fq.act("model.layers.0.mlp.down_proj", x), fq.act("lm_head", x), fq.act("model.embed_tokens", x)

    a, b, c = f(x)
    np.testing.assert_array_equal(a, Q.qdq(x, "e4m3", "token"))
    assert not np.array_equal(a, x)
    np.testing.assert_array_equal(b, x)
    np.testing.assert_array_equal(c, x)
    # static argument use
    g = jax.jit(lambda fq, x: fq.act("model.layers.1.self_attn.q_proj", x), static_argnums=0)
    np.testing.assert_array_equal(g(fq, x), a)
    # no-op recipes and weight-only recipes leave activations alone
    for name in ("none", "fp8_weights_only", "fp8_kv_only"):
        np.testing.assert_array_equal(Q.forward_quant(name).act("model.layers.0.mlp.up_proj", x), x)


def test_calibrated_kv_scales_keep_small_values_out_of_the_subnormals():
    """K/V with amax 0.005 sit among e4m3's subnormals (below 2**-6) under vLLM's fixed scale 1.0; the calibrated
    scale amax / 448 maps them onto the normal range, so the round trip loses far less."""
    v = np.asarray(jax.random.normal(jax.random.key(11), (2, 8, 2, 16))) * 0.0015
    (scale, _), = Q.calibrate_kv_scales([[np.abs(v).max(), 1.0]])
    mse = lambda s: float(np.mean((np.asarray(Q.qdq(jnp.asarray(v), "e4m3", scale=s)) - v) ** 2))  # noqa: E731
    assert mse(scale) < 0.01 * mse(1.0)


def test_kv_hook_fixed_dynamic_and_calibrated_scales():
    k = jax.random.normal(jax.random.key(10), (2, 3, 2, 16)) * 4  # [B, T, K, H]
    fixed = Q.forward_quant("fp8_w8a8_kv")
    np.testing.assert_array_equal(jax.jit(lambda k: fixed.kv(0, "k", k))(k), Q.qdq(k, "e4m3", scale=1.0))
    dyn = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv").replace(kv_scale=None))
    np.testing.assert_array_equal(dyn.kv(0, "v", k), np_qdq(k, "e4m3", -1))  # per (b, t, head) over head_dim
    assert Q.forward_quant("fp8_w8a8").kv(0, "k", k) is k
    scales = Q.calibrate_kv_scales([[8.0, 16.0], [4.48, 44.8]])
    np.testing.assert_allclose(scales, [[8 / 448, 16 / 448], [0.01, 0.1]], rtol=1e-12)
    assert all(isinstance(s, tuple) and len(s) == 2 for s in scales)
    cal = Q.forward_quant(Q.get_recipe("fp8_w8a8_kv").replace(kv_scale=None, kv_scales=scales))
    np.testing.assert_array_equal(cal.kv(1, "v", k), Q.qdq(k, "e4m3", scale=0.1))
    # traced layer index (scan over layers) gives the same as the static lookup
    traced = jax.jit(lambda i, k: cal.kv(i, "k", k))(jnp.int32(1), k)
    np.testing.assert_array_equal(traced, cal.kv(1, "k", k))
    assert Q.calibrate_kv_scales(np.array([448.0, 0.0])) == (1.0, Q.AMAX_EPS / 448)
    with pytest.raises(ValueError, match="kind"):
        fixed.kv(0, "q", k)


def test_check_effective_reports_fractions_and_raises_when_rounding_is_removed(monkeypatch):
    fr = Q.check_effective("fp8_w8a8_kv", jnp.bfloat16)
    assert set(fr) == {"weights model.layers.*.self_attn.q_proj", "activations", "kv_cache"}
    assert all(0.5 < v <= 1.0 for v in fr.values())
    assert Q.check_effective("none") == {}
    # A compiler that drops the rounding is simulated by a cast that does nothing: every part must be refused,
    # and so must an engine built with the recipe.
    monkeypatch.setattr(QF, "_cast", lambda y, f: y)
    monkeypatch.setattr(QF, "_to_f32", lambda q: q.astype(jnp.float32))
    QH._changed_fraction.cache_clear()
    QF._qdq_jit.clear_cache()
    try:
        with pytest.raises(Q.IneffectiveQuantError, match=r"fp8_weights_only.*unchanged on backend 'cpu'"):
            Q.check_effective("fp8_weights_only", jnp.bfloat16)
        with pytest.raises(Q.IneffectiveQuantError, match="kv_cache"):
            Q.check_effective("fp8_kv_only")
        from opdjax.models.config import ModelConfig
        from opdjax.rollout import EngineMismatch, JaxEngine
        with pytest.raises(Q.IneffectiveQuantError, match="measure nothing"):
            JaxEngine(ModelConfig(), mismatch=EngineMismatch(recipe="fp8_w8a8"))
    finally:
        QH._changed_fraction.cache_clear()
        QF._qdq_jit.clear_cache()

