"""opdjax.rollout.perturb: relative and absolute weight noise (its scale, dtypes, determinism and filter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.rollout.perturb import add_weight_noise

def _params():
    ks = jax.random.split(jax.random.key(11), 3)
    return {"a": {"kernel": jax.random.normal(ks[0], (128, 256)) * 3.0,
                  "bias": (jax.random.normal(ks[1], (256,)) * 0.01).astype(jnp.bfloat16)},
            "emb": jax.random.normal(ks[2], (512, 64)).astype(jnp.bfloat16) * 0.5,
            "step": jnp.array(7, jnp.int32)}


def _rms(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(x ** 2)))


def test_relative_noise_std_matches_sigma_times_rms_and_preserves_dtypes():
    p = _params()
    sigma = 0.05
    noisy = add_weight_noise(p, sigma, jax.random.key(0))
    assert jax.tree.structure(noisy) == jax.tree.structure(p)
    for path in (("a", "kernel"), ("emb",)):
        w, n = p, noisy
        for k in path:
            w, n = w[k], n[k]
        assert n.dtype == w.dtype
        d = np.asarray(n, np.float64) - np.asarray(w, np.float64)
        assert np.std(d) == pytest.approx(sigma * _rms(w), rel=0.06), path
    assert noisy["step"] is p["step"]
    # absolute mode
    ab = add_weight_noise(p, 0.01, jax.random.key(0), mode="absolute")
    assert np.std(np.asarray(ab["a"]["kernel"]) - np.asarray(p["a"]["kernel"])) == pytest.approx(0.01, rel=0.05)


def test_noise_sigma_zero_identity_deterministic_and_filter():
    p = _params()
    assert add_weight_noise(p, 0.0, jax.random.key(0)) is p
    n1 = add_weight_noise(p, 0.1, jax.random.key(3))
    n2 = add_weight_noise(p, 0.1, jax.random.key(3))
    n3 = add_weight_noise(p, 0.1, jax.random.key(4))
    np.testing.assert_array_equal(n1["a"]["kernel"], n2["a"]["kernel"])
    assert not np.array_equal(n1["a"]["kernel"], n3["a"]["kernel"])
    # independent keys per leaf: leaves of identical shape and content get different noise
    same = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 64))}
    ns = add_weight_noise(same, 0.1, jax.random.key(0))
    assert not np.array_equal(ns["x"], ns["y"])
    only_kernels = add_weight_noise(p, 0.1, jax.random.key(3), filter=lambda path: path.endswith("kernel"))
    assert only_kernels["emb"] is p["emb"] and only_kernels["a"]["bias"] is p["a"]["bias"]
    np.testing.assert_array_equal(only_kernels["a"]["kernel"], n1["a"]["kernel"])
    with pytest.raises(ValueError, match="relative"):
        add_weight_noise(p, 0.1, jax.random.key(0), mode="gauss")

