"""Tests for opdjax.mismatch: metrics against numpy references and closed forms, corrections, robustness, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.core import corrections as corr
from opdjax.core import mismatch as mm

B, T, V = 4, 6, 8
PAD_B, PAD_T = 2, 3
HYP = settings(max_examples=30, deadline=None)

# One jitted function per entry point, reused by every test (shapes are fixed so each compiles once or twice).
metrics_jit = jax.jit(mm.metrics)
is_token_jit = jax.jit(lambda s, r, m: corr.is_weights(s, r, m, level="token", cap=2.0))
is_seq_jit = jax.jit(lambda s, r, m: corr.is_weights(s, r, m, level="sequence", cap=2.0))
reject_seq_jit = jax.jit(lambda s, r, m: corr.rejection_mask(s, r, m, mode="sequence", low=0.5, high=2.0))
reject_token_jit = jax.jit(lambda s, r, m: corr.rejection_mask(s, r, m, mode="token", low=0.5, high=2.0))

logp_BT = hnp.arrays(np.float32, (B, T), elements=st.floats(-30.0, 0.0, width=32))
mask_BT = hnp.arrays(np.bool_, (B, T))
anything = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_close(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=rtol, atol=atol, err_msg=k)


def _random_inputs(seed, b=B, t=T):
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.uniform(0.01, 1.0, (b, t))).astype(np.float32)
    student = (rollout + rng.normal(0, 0.5, (b, t))).astype(np.float32)
    student[0, 0] = rollout[0, 0] - 40.0  # exercises the ±20 clamp of r
    student[1, 0] = rollout[1, 0] + 15.0  # exercises the ±20 clamp of 2·S_b in chi2_seq
    mask = rng.random((b, t)) < 0.7
    mask[0, 0] = mask[1, 0] = True
    mask[-1] = False  # one all-masked row
    return student, rollout, mask


def _np_metrics(s, r, m, c=2.0):
    """Independent float64 numpy reference for every key of mm.metrics."""
    s, r, m = s.astype(np.float64), r.astype(np.float64), m.astype(bool)
    lr = np.clip(s - r, -20, 20)
    x = lr[m]
    n = x.size
    rho = np.exp(x)

    def mean(v):
        return v.sum() / max(v.size, 1)

    seqs = [b for b in range(m.shape[0]) if m[b].any()]
    seq_sum = np.array([lr[b][m[b]].sum() for b in seqs])
    gap = np.array([r[b][m[b]].mean() - s[b][m[b]].mean() for b in seqs])
    return {
        "k1": mean(-x),
        "k2": mean(x**2 / 2),
        "k3": mean(np.exp(x) - x - 1),
        "abs_log_ratio_mean": mean(np.abs(x)),
        "abs_log_ratio_p95": np.percentile(np.abs(x), 95) if n else 0.0,
        "abs_log_ratio_max": np.abs(x).max() if n else 0.0,
        "chi2_token": mean(rho**2 - 1),
        "chi2_seq": mean(np.exp(np.clip(2 * seq_sum, -20, 20)) - 1),
        "log_ppl_gap_mean": mean(gap),
        "log_ppl_gap_abs_mean": mean(np.abs(gap)),
        "log_ppl_gap_max": gap.max() if gap.size else 0.0,
        "log_ppl_gap_min": gap.min() if gap.size else 0.0,
        "ppl_ratio": np.exp(mean(gap)),
        "is_ratio_mean": mean(rho),
        "is_ratio_std": rho.std() if n else 0.0,
        "is_ratio_min": rho.min() if n else 0.0,
        "is_ratio_max": rho.max() if n else 0.0,
        "ess": rho.sum() ** 2 / (n * (rho**2).sum()) if n else 0.0,
        "frac_ratio_out": mean(((rho < 1 / c) | (rho > c)).astype(float)),
        "abs_prob_diff_mean": mean(np.abs(np.exp(s[m]) - np.exp(r[m]))),
        "num_tokens": n,
        "num_seqs": len(seqs),
        "nan_count": 0,
    }


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------------------------
# Sampled-token metrics
# ---------------------------------------------------------------------------------------------------------------


def test_metric_keys_are_the_documented_stable_set():
    s, r, m = _random_inputs(0)
    out = metrics_jit(s, r, m)
    assert set(out) == set(mm.METRIC_KEYS) and len(mm.METRIC_KEYS) == 23
    for k in mm.METRIC_KEYS:
        assert k in mm.__doc__, f"metric {k!r} is not documented in the module docstring"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_numpy_reference(seed):
    s, r, m = _random_inputs(seed)
    _assert_close(_np(metrics_jit(s, r, m)), _np_metrics(s, r, m), rtol=2e-5, atol=1e-5)


@HYP
@given(logp=logp_BT, mask=mask_BT)
def test_identical_inputs_give_zero_divergence(logp, mask):
    out = _np(metrics_jit(logp, logp, mask))
    for k in ("k1", "k2", "k3", "chi2_token", "chi2_seq", "abs_log_ratio_mean", "abs_log_ratio_p95",
              "abs_log_ratio_max", "log_ppl_gap_mean", "log_ppl_gap_abs_mean", "frac_ratio_out",
              "abs_prob_diff_mean"):  # fmt: skip
        assert out[k] == 0.0, k
    if mask.any():
        assert out["ess"] == 1.0 and out["is_ratio_min"] == 1.0 and out["is_ratio_max"] == 1.0
    for fn in (is_token_jit, is_seq_jit, reject_seq_jit, reject_token_jit):
        w, _ = fn(logp, logp, mask)
        np.testing.assert_array_equal(np.asarray(w), mask.astype(np.float32))


@HYP
@given(s=logp_BT, r=logp_BT, mask=mask_BT)
def test_k3_nonnegative_and_statistics_ordered(s, r, mask):
    out = _np(metrics_jit(s, r, mask))
    assert all(np.isfinite(v) for v in out.values())
    assert out["k3"] >= 0 and out["k2"] >= 0 and out["abs_log_ratio_mean"] >= 0
    assert 0 <= out["abs_log_ratio_p95"] <= out["abs_log_ratio_max"] + 1e-6
    assert 0 <= out["ess"] <= 1 + 1e-6
    assert out["num_tokens"] == mask.sum()


@HYP
@given(s=logp_BT, r=logp_BT, mask=mask_BT, pad=st.data())
def test_metrics_and_weights_invariant_to_padding(s, r, mask, pad):
    """Appending masked-out rows and columns holding anything (even NaN/inf) changes nothing."""
    shape = (B + PAD_B, T + PAD_T)
    ps = pad.draw(hnp.arrays(np.float32, shape, elements=anything))
    pr = pad.draw(hnp.arrays(np.float32, shape, elements=anything))
    ps[:B, :T], pr[:B, :T] = s, r
    pm = np.zeros(shape, bool)
    pm[:B, :T] = mask
    got, want = _np(metrics_jit(ps, pr, pm)), _np(metrics_jit(s, r, mask))
    # Padding may change float32 summation order: allow a few ulps of the largest term (|r| ≤ 20, rho ≤ e^20).
    std_atol = 1e-6 * (1 + want["is_ratio_max"])
    np.testing.assert_allclose(got.pop("is_ratio_std"), want.pop("is_ratio_std"), atol=std_atol)
    _assert_close(got, want, rtol=1e-5, atol=1e-4)
    for fn in (is_token_jit, is_seq_jit, reject_seq_jit):
        (w, d), (pw, pd) = _np(fn(s, r, mask)), _np(fn(ps, pr, pm))
        np.testing.assert_allclose(pw[:B, :T], w, rtol=1e-6)
        assert not pw[B:].any() and not pw[:, T:].any()
        _assert_close(pd, d)


@HYP
@given(s=logp_BT, r=logp_BT, mask=mask_BT)
def test_token_tis_weights_bounded_by_cap_and_zero_off_mask(s, r, mask):
    w, d = _np(is_token_jit(s, r, mask))
    assert (w <= 2.0).all() and (w >= 0).all()
    assert (w[~mask] == 0).all()
    rho = np.exp(np.clip(s.astype(np.float64) - r, -20, 20))
    np.testing.assert_allclose(w[mask], np.minimum(rho, 2.0)[mask], rtol=1e-5)
    np.testing.assert_allclose(d["is_frac_capped"], (rho[mask] > 2.0).mean() if mask.any() else 0, atol=1e-6)


@HYP
@given(s=logp_BT, r=logp_BT, mask=mask_BT)
def test_sequence_weights_constant_within_each_sequence(s, r, mask):
    w, _ = _np(is_seq_jit(s, r, mask))
    keep, _ = _np(reject_seq_jit(s, r, mask))
    for b in range(B):
        if mask[b].any():
            seq_sum = np.clip((np.clip(s[b].astype(np.float64) - r[b], -20, 20))[mask[b]].sum(), -20, 20)
            np.testing.assert_allclose(w[b][mask[b]], min(np.exp(seq_sum), 2.0), rtol=1e-4)
            assert len(set(keep[b][mask[b]].tolist())) == 1
        assert (w[b][~mask[b]] == 0).all() and (keep[b][~mask[b]] == 0).all()


def test_k1_and_k3_converge_to_exact_kl():
    """Tokens x ~ mu with rollout_logp = log mu(x), student_logp = log pi(x): E[k1] = E[k3] = KL(mu‖pi)."""
    rng = np.random.default_rng(1234)
    mu, pi = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    exact = float(np.sum(mu * (np.log(mu) - np.log(pi))))
    x = rng.choice(V, size=200_000, p=mu)
    r_lp, s_lp = np.log(mu[x]), np.log(pi[x])
    d = s_lp - r_lp
    out = mm.metrics(s_lp.reshape(400, 500).astype(np.float32), r_lp.reshape(400, 500).astype(np.float32),
                     np.ones((400, 500), bool))  # fmt: skip
    se_k1 = np.std(-d) / np.sqrt(d.size)
    se_k3 = np.std(np.exp(d) - d - 1) / np.sqrt(d.size)
    assert abs(float(out["k1"]) - exact) < 5 * se_k1, (float(out["k1"]), exact, se_k1)
    assert abs(float(out["k3"]) - exact) < 5 * se_k3, (float(out["k3"]), exact, se_k3)
    # the sampled-token chi² estimates chi²(pi‖mu) = Σ pi²/mu - 1 the same way
    chi2 = float(np.sum(pi**2 / mu) - 1)
    assert abs(float(out["chi2_token"]) - chi2) < 5 * np.std(np.exp(2 * d)) / np.sqrt(d.size)


# ---------------------------------------------------------------------------------------------------------------
# Full-distribution metrics
# ---------------------------------------------------------------------------------------------------------------


def test_full_distribution_metrics_match_numpy_in_float64():
    rng = np.random.default_rng(7)
    sl, rl = rng.normal(0, 2, (B, T, V)), rng.normal(0, 2, (B, T, V))
    mask = rng.random((B, T)) < 0.6
    mask[0, 0] = True
    temp, k = 0.7, 3
    lmu, lpi = _np_log_softmax(rl / temp), _np_log_softmax(sl / temp)
    mu, pi = np.exp(lmu), np.exp(lpi)
    kl = np.sum(mu * (lmu - lpi), -1)
    tv = 0.5 * np.abs(mu - pi).sum(-1)
    top = np.argsort(-mu, axis=-1)[..., :k]
    mu_k, pi_k = np.take_along_axis(mu, top, -1), np.take_along_axis(pi, top, -1)
    mass_mu, mass_pi = mu_k.sum(-1), pi_k.sum(-1)
    mu_k, pi_k = mu_k / mass_mu[..., None], pi_k / mass_pi[..., None]
    kl_k = np.sum(mu_k * np.log(mu_k / pi_k), -1)
    tv_k = 0.5 * np.abs(mu_k - pi_k).sum(-1)
    want = {
        "kl_full": kl[mask].mean(), "kl_full_max": kl[mask].max(), "tv_full": tv[mask].mean(),
        "kl_topk": kl_k[mask].mean(), "tv_topk": tv_k[mask].mean(),
        "topk_mass_rollout": mass_mu[mask].mean(), "topk_mass_student": mass_pi[mask].mean(),
    }  # fmt: skip
    with jax.enable_x64(True):
        got = _np(mm.full_distribution_metrics(sl, rl, mask, top_k=k, temperature=temp))
        kl_pos = np.asarray(mm.kl_per_position(sl, rl, temperature=temp))
        tv_pos = np.asarray(mm.tv_per_position(sl, rl, temperature=temp))
    _assert_close(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(kl_pos, kl, rtol=0, atol=1e-6)
    np.testing.assert_allclose(tv_pos, tv, rtol=0, atol=1e-6)
    # top_k = V recovers the full-distribution numbers
    full = _np(mm.full_distribution_metrics(sl.astype(np.float32), rl.astype(np.float32), mask, top_k=V))
    np.testing.assert_allclose(full["kl_topk"], full["kl_full"], atol=1e-5)
    np.testing.assert_allclose(full["topk_mass_rollout"], 1.0, atol=1e-5)


def test_full_distribution_metrics_accept_truncated_rollout_logits():
    """-inf rollout logits (engine-side top-k truncation) give mu = 0 there, contributing 0 to KL(mu‖pi)."""
    rng = np.random.default_rng(3)
    sl, rl = rng.normal(size=(2, 3, V)).astype(np.float32), rng.normal(size=(2, 3, V)).astype(np.float32)
    rl[..., 4:] = -np.inf
    out = _np(mm.full_distribution_metrics(sl, rl, np.ones((2, 3)), top_k=4))
    assert all(np.isfinite(v) for v in out.values())
    lpi = _np_log_softmax(sl.astype(np.float64))
    lmu = _np_log_softmax(rl[..., :4].astype(np.float64))
    want = np.sum(np.exp(lmu) * (lmu - lpi[..., :4]), -1).mean()
    np.testing.assert_allclose(out["kl_full"], want, rtol=1e-5)


def test_full_distribution_argument_errors():
    z = np.zeros((2, 3, V), np.float32)
    with pytest.raises(ValueError, match="top_k"):
        mm.full_distribution_metrics(z, z, np.ones((2, 3)), top_k=V + 1)
    with pytest.raises(ValueError, match="temperature"):
        mm.full_distribution_metrics(z, z, np.ones((2, 3)), temperature=0.0)
    with pytest.raises(ValueError, match="NaN"):
        mm.full_distribution_metrics(z, np.full_like(z, np.nan), np.ones((2, 3)))


# ---------------------------------------------------------------------------------------------------------------
# Robustness
# ---------------------------------------------------------------------------------------------------------------


def _all_outputs(s, r, m, sl, rl):
    """Every public entry point on one batch; used for the finiteness, jit and mesh tests."""
    out = {"metrics": mm.metrics(s, r, m), "full": mm.full_distribution_metrics(sl, rl, m, top_k=3)}
    out["kl_pos"] = mm.kl_per_position(sl, rl)
    for level in ("token", "sequence"):
        out[f"is_{level}"] = corr.is_weights(s, r, m, level=level, cap=2.0, normalize=True)
    for mode in ("token", "sequence", "geometric"):
        out[f"rej_{mode}"] = corr.rejection_mask(s, r, m, mode=mode, low=0.5, high=2.0)
    for mode in ("k1", "k2", "k3"):
        out[f"rej_{mode}"] = corr.rejection_mask(s, r, m, mode=mode, threshold=0.1)
    for name in corr.CORRECTIONS:
        out[f"corr_{name}"] = corr.apply_correction(corr.Correction(name), s, r, m)
    return out


@pytest.mark.parametrize("shape", [(3, 5), (0, 5), (3, 0), (0, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_all_masked_and_empty_batches_are_finite(shape):
    rng = np.random.default_rng(0)
    s, r = rng.normal(-3, 1, shape).astype(np.float32), rng.normal(-3, 1, shape).astype(np.float32)
    sl, rl = rng.normal(size=(*shape, V)).astype(np.float32), rng.normal(size=(*shape, V)).astype(np.float32)
    out = _all_outputs(s, r, np.zeros(shape, bool), sl, rl)
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        assert np.isfinite(np.asarray(leaf)).all(), jax.tree_util.keystr(path)
    assert float(out["metrics"]["k3"]) == 0 and int(out["metrics"]["num_tokens"]) == 0


def test_nan_input_raises_outside_jit_and_is_counted_under_jit():
    s, r, m = _random_inputs(5)
    b, t = np.argwhere(m)[1]
    bad = s.copy()
    bad[b, t] = np.nan
    with pytest.raises(ValueError, match=r"student_logp_BT has 1 non-finite"):
        mm.check_inputs(bad, r, m)
    with pytest.raises(ValueError, match="non-finite"):
        mm.metrics(bad, r, m)
    with pytest.raises(ValueError, match="non-finite"):
        corr.is_weights(s, np.where(m, np.inf, r), m)
    out = _np(metrics_jit(bad, r, m))
    assert out["nan_count"] == 1
    assert all(np.isfinite(v) for v in out.values())
    # the NaN token is excluded: same as masking it out
    m2 = m.copy()
    m2[b, t] = False
    ref = _np(metrics_jit(s, r, m2))
    ref["nan_count"] = 1
    _assert_close(out, ref)
    # NaN on a masked-out position is padding, not an error
    pad = s.copy()
    pad[~m] = np.nan
    mm.check_inputs(pad, r, m)
    assert int(mm.metrics(pad, r, m)["nan_count"]) == 0


@pytest.mark.parametrize("bad_mask", [[[0, 2]], [[0.5, 1.0]], [[-1, 0]]])
def test_non_binary_masks_raise(bad_mask):
    z = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="mask_BT must be bool or contain only 0/1"):
        mm.metrics(z, z, np.asarray(bad_mask))
    with pytest.raises(ValueError, match="mask_BT"):
        corr.rejection_mask(z, z, np.asarray(bad_mask), mode="k3", threshold=0.1)


def test_float_mask_equals_bool_mask_and_bf16_is_upcast():
    s, r, m = _random_inputs(2)
    ref = _np(mm.metrics(s, r, m))
    _assert_close(_np(mm.metrics(s, r, m.astype(np.float32))), ref, rtol=0, atol=0)
    s16, r16 = jnp.asarray(s, jnp.bfloat16), jnp.asarray(r, jnp.bfloat16)
    got = _np(mm.metrics(s16, r16, m))
    assert got["k3"].dtype == np.float32
    _assert_close(got, _np(mm.metrics(np.asarray(s16, np.float32), np.asarray(r16, np.float32), m)), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "call, shapes",
    [
        (lambda: mm.metrics(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3))), ["(2, 3)", "(2, 4)"]),
        (lambda: mm.metrics(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((3, 2))), ["(3, 2)", "(2, 3)"]),
        (lambda: corr.is_weights(np.zeros((2, 3)), np.zeros((5, 3)), np.ones((2, 3))), ["(2, 3)", "(5, 3)"]),
        (lambda: corr.apply_correction(None, np.zeros((1, 3)), np.zeros((2, 3)), np.ones((1, 3))), ["(1, 3)", "(2, 3)"]),
        (lambda: mm.full_distribution_metrics(np.zeros((2, 3, 4)), np.zeros((2, 3, 5)), np.ones((2, 3))),
         ["(2, 3, 4)", "(2, 3, 5)"]),
        (lambda: mm.full_distribution_metrics(np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), np.ones((2, 4))),
         ["(2, 4)", "(2, 3, 4)"]),
    ],
)  # fmt: skip
def test_shape_mismatch_error_names_both_shapes(call, shapes):
    with pytest.raises(ValueError) as e:
        call()
    for shape in shapes:
        assert shape in str(e.value)


def test_shape_mismatch_raises_under_jit_too():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        metrics_jit(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))


# ---------------------------------------------------------------------------------------------------------------
# Corrections
# ---------------------------------------------------------------------------------------------------------------

# rho per token (rollout_logp = 0, student_logp = log rho); 0 marks masked-out entries.
RHO = np.array(
    [
        [3.0, 1.0, 1.0],  # prod 3,    geo 1.442, k1 |−ln3/3| = .366,  k2 .201,  k3 .300
        [0.4, 1.9, 1.0],  # prod .76,  geo .913,  k1 .091,            k2 .209,  k3 .192
        [1.5, 1.5, 0.0],  # prod 2.25, geo 1.5,   k1 .405,            k2 .082,  k3 .095
        [0.9, 0.0, 0.0],  # prod .9,   geo .9,    k1 .105,            k2 .006,  k3 .005
        [0.0, 0.0, 0.0],  # all masked
    ]
)
RHO_MASK = RHO > 0
RHO_S = np.log(np.where(RHO_MASK, RHO, 7.0)).astype(np.float32)  # masked entries hold junk
RHO_R = np.zeros_like(RHO_S)


@pytest.mark.parametrize(
    "mode, kwargs, keep_rows",
    [
        ("sequence", dict(low=0.5, high=2.0), [0, 1, 0, 1, 0]),
        ("geometric", dict(low=0.5, high=1.47), [1, 1, 0, 1, 0]),
        ("k1", dict(threshold=0.2), [0, 1, 0, 1, 0]),
        ("k2", dict(threshold=0.15), [0, 0, 1, 1, 0]),
        ("k3", dict(threshold=0.2), [0, 1, 1, 1, 0]),
    ],
)
def test_sequence_rejection_modes_keep_what_the_closed_form_says(mode, kwargs, keep_rows):
    keep, d = _np(corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode=mode, **kwargs))
    want = np.asarray(keep_rows, bool)[:, None] & RHO_MASK
    np.testing.assert_array_equal(keep, want.astype(np.float32))
    n_tok = RHO_MASK.sum()
    np.testing.assert_allclose(d["reject_frac_tokens"], 1 - want.sum() / n_tok, rtol=1e-6)
    np.testing.assert_allclose(d["reject_frac_seqs"], 1 - sum(keep_rows) / 4, rtol=1e-6)
    kept = RHO[want]
    np.testing.assert_allclose(d["reject_ess"], kept.sum() ** 2 / (kept.size * (kept**2).sum()), rtol=1e-5)


def test_token_rejection_keeps_tokens_inside_bounds():
    keep, d = _np(corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="token", low=0.5, high=2.0))
    want = RHO_MASK & (RHO >= 0.5) & (RHO <= 2.0)
    np.testing.assert_array_equal(keep, want.astype(np.float32))
    np.testing.assert_allclose(d["reject_frac_tokens"], 2 / 9, rtol=1e-6)
    assert d["reject_frac_seqs"] == 0


def test_is_weights_closed_form_and_normalize():
    w, d = _np(corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="token", cap=2.0))
    np.testing.assert_allclose(w, np.where(RHO_MASK, np.minimum(RHO, 2.0), 0), rtol=1e-6)
    np.testing.assert_allclose(d["is_frac_capped"], 1 / 9, rtol=1e-6)
    ws, _ = _np(corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="sequence", cap=2.0))
    prod = np.where(RHO_MASK, RHO, 1).prod(1)
    np.testing.assert_allclose(ws, np.where(RHO_MASK, np.minimum(prod, 2.0)[:, None], 0), rtol=1e-6)
    wn, dn = _np(corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="sequence", cap=2.0, normalize=True))
    np.testing.assert_allclose(wn[RHO_MASK].mean(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(wn, ws / ws[RHO_MASK].mean(), rtol=1e-6)
    np.testing.assert_allclose(dn["is_weight_mean"], 1.0, rtol=1e-6)


def test_weights_are_stop_gradient():
    def loss(s):
        w, _ = corr.is_weights(s, RHO_R, RHO_MASK, level="token")
        keep, _ = corr.rejection_mask(s, RHO_R, RHO_MASK, mode="k3", threshold=0.2)
        return jnp.sum(w * keep * s)

    w, _ = corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="token")
    keep, _ = corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="k3", threshold=0.2)
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(RHO_S)), w * keep, rtol=1e-6)


def test_apply_correction_dispatches_by_name_with_prefixed_metrics():
    expected_names = {"none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_reject",
                      "k1_reject", "k2_reject", "k3_reject"}  # fmt: skip
    assert expected_names <= set(corr.CORRECTIONS)
    w, d = corr.apply_correction(None, RHO_S, RHO_R, RHO_MASK)
    np.testing.assert_array_equal(w, RHO_MASK.astype(np.float32))
    assert d == {}
    w, d = corr.apply_correction(corr.Correction("geo_reject", low=0.5, high=1.47), RHO_S, RHO_R, RHO_MASK)
    ref, ref_d = corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="geometric", low=0.5, high=1.47)
    np.testing.assert_array_equal(w, ref)
    assert set(d) == {f"corr/{k}" for k in ref_d}
    w, d = corr.apply_correction(corr.Correction("seq_tis", cap=1.5, normalize=True), RHO_S, RHO_R, RHO_MASK)
    ref, _ = corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="sequence", cap=1.5, normalize=True)
    np.testing.assert_allclose(w, ref, rtol=1e-6)
    assert "corr/is_ess" in d


def test_unknown_names_and_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown correction 'bogus'.*token_tis"):
        corr.Correction("bogus")
    with pytest.raises(ValueError, match="low < high"):
        corr.Correction("token_mis", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="already registered"):
        corr.register_correction("none")(lambda *a: None)
    with pytest.raises(ValueError, match="valid modes: token, sequence, geometric, k1, k2, k3"):
        corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="chi2", threshold=1.0)
    with pytest.raises(ValueError, match="needs both low and high"):
        corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="token", low=0.5)
    with pytest.raises(ValueError, match="low < high"):
        corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="sequence", low=2.0, high=2.0)
    with pytest.raises(ValueError, match="needs threshold"):
        corr.rejection_mask(RHO_S, RHO_R, RHO_MASK, mode="k3", low=0.5, high=2.0)
    with pytest.raises(ValueError, match="level"):
        corr.is_weights(RHO_S, RHO_R, RHO_MASK, level="batch")
    with pytest.raises(ValueError, match="ratio_threshold"):
        mm.metrics(RHO_S, RHO_R, RHO_MASK, ratio_threshold=1.0)
    assert dataclasses.replace(corr.Correction("k3_reject"), threshold=0.3).threshold == 0.3


# ---------------------------------------------------------------------------------------------------------------
# jit and sharding
# ---------------------------------------------------------------------------------------------------------------

MESH_B = 8
all_outputs_jit = jax.jit(_all_outputs)


def _mesh_inputs():
    s, r, m = _random_inputs(11, b=MESH_B)
    rng = np.random.default_rng(11)
    sl, rl = rng.normal(size=(MESH_B, T, V)).astype(np.float32), rng.normal(size=(MESH_B, T, V)).astype(np.float32)
    return s, r, m, sl, rl


def test_every_function_jits_and_matches_eager():
    args = _mesh_inputs()
    _assert_close_tree(all_outputs_jit(*args), _all_outputs(*args))


@pytest.mark.mesh
def test_batch_sharded_on_8_device_mesh_matches_unsharded(cpu_devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    args = _mesh_inputs()
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args]
    assert len(sharded[0].sharding.device_set) == 8
    _assert_close_tree(all_outputs_jit(*sharded), all_outputs_jit(*args))


def _assert_close_tree(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        msg = jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=msg)
