"""opdjax.rollout.perturb: relative and absolute weight noise (its scale, dtypes, determinism and filter)."""

from __future__ import annotations

import dataclasses

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



def test_engine_mismatch_is_one_validated_value_naming_the_config_key():
    """The engine-side knobs are validated once, on construction, with the config key in the message; a preset name
    or a mapping is read into the value; `EngineMismatch()` is the clean engine."""
    from opdjax import quant
    from opdjax.rollout import EngineMismatch

    clean = EngineMismatch()
    assert clean.is_clean and clean.recipe == quant.get_recipe("none") and EngineMismatch.of(None) == clean
    m = EngineMismatch.of({"recipe": "fp8_w8a8", "weight_noise": 1, "stale_versions": 2})
    assert m.recipe == quant.get_recipe("fp8_w8a8") and m.weight_noise == 1.0 and m.stale_versions == 2
    assert not m.is_clean and EngineMismatch.of(m) is m
    assert m.describe() == {"recipe": "fp8_w8a8", "weight_noise": 1.0, "noise_mode": "fixed", "stale_versions": 2}
    for kw, words in (({"recipe": "fp4"}, "rollout.recipe='fp4' is not valid"),
                      ({"weight_noise": -0.1}, "rollout.weight_noise must be >= 0"),
                      ({"noise_mode": "sometimes"}, "rollout.noise_mode='sometimes' is not valid"),
                      ({"stale_versions": -1}, "rollout.stale_versions must be an integer >= 0"),
                      ({"stale_versions": 1.5}, "rollout.stale_versions must be an integer >= 0")):
        with pytest.raises(ValueError, match=words):
            EngineMismatch(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.weight_noise = 0.0


def test_a_rollout_config_gives_its_mismatch_and_takes_another():
    """`RolloutConfig.mismatch` is the keys as one value; `with_mismatch` writes one back (a preset by its name), so
    the probe's clean engine is `with_mismatch(EngineMismatch())`, nothing cleared by hand."""
    from opdjax.config import TrainConfig, load
    from opdjax.rollout import EngineMismatch

    cfg = load(TrainConfig, None, ["rollout.recipe=fp8_w8a8", "rollout.weight_noise=0.3", "rollout.noise_mode=rounding",
                                   "rollout.stale_versions=1"])
    m = cfg.rollout.mismatch
    assert (m.recipe.name, m.weight_noise, m.noise_mode, m.stale_versions) == ("fp8_w8a8", 0.3, "rounding", 1)
    clean = cfg.rollout.with_mismatch(EngineMismatch())
    assert (clean.recipe, clean.weight_noise, clean.noise_mode, clean.stale_versions) == ("none", 0.0, "fixed", 0)
    assert clean.mismatch.is_clean and clean.batch_size == cfg.rollout.batch_size
    assert cfg.rollout.with_mismatch(m) == cfg.rollout
