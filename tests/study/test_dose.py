"""Dose-response statistics on synthetic runs with known truth: closed-form effects and hinge fits, robustness to a
stalled seed, bootstrap intervals that cover the truth and carry the baseline's noise, and clear input errors."""

import math
import time

import numpy as np
import pytest

from opdjax.study import dose

K_TRUE = math.log(1.3e-3)  # the knee, between the levels 1e-3 and 3.16e-3 (not on a midpoint)
B_TRUE = 1.0  # slope of ln(rkl) per unit ln M beyond the knee
DELTA = 2.0  # 3x the baseline's reverse KL
M_TRUE = math.exp(K_TRUE + math.log1p(DELTA) / B_TRUE)  # = 3.9e-3
LEVELS = np.geomspace(1e-4, 1e-1, 7)


def _study(seed=0, b=B_TRUE, k=K_TRUE, sig=0.15, sig_base=None, n_base=16, n_level=8):
    """(m_R, y_R, group_R): 16 baseline runs at M ~ 1e-12 and 8 runs at each of 7 levels (probe M jittered 5%),
    y = ln(0.05) + b max(0, ln M - k) + noise (sd sig; the baseline's sd sig_base)."""
    rng = np.random.default_rng(seed)
    m = [1e-12 * np.exp(rng.normal(0, 0.1, n_base))] + [lv * np.exp(rng.normal(0, 0.05, n_level)) for lv in LEVELS]
    g = ["baseline"] * n_base + [f"sigma={lv:.2g}" for lv in LEVELS for _ in range(n_level)]
    m = np.concatenate(m)
    s = np.where(np.asarray(g) == "baseline", sig if sig_base is None else sig_base, sig)
    y = math.log(0.05) + b * np.maximum(0.0, np.log(m) - k) + rng.normal(0, 1, m.size) * s
    return m, y, g


# --- scores and per-level effects ------------------------------------------------------------------------------

def test_run_scores_log_reverse_kl_with_a_finite_cap_for_diverged_runs():
    cap = math.log(dose.RKL_CAP)
    c = dose.RKL_OFFSET  # a sampled estimate: near 0, slightly negative values are good runs, not broken ones
    y = dose.run_scores([1.0, math.e, math.inf, math.nan, None, 0.0, -0.01, 1e9], "reverse_kl")
    np.testing.assert_allclose(y, [math.log(1 + c), math.log(math.e + c), cap, cap, cap, math.log(c), math.log(c),
                                   cap])
    assert dose.reverse_kl_of_score(math.log(2.0 + c)) == pytest.approx(2.0)


def test_run_scores_accuracy_is_negated_and_checked():
    np.testing.assert_allclose(dose.run_scores([0.9, 0.25, math.nan], "accuracy"), [-0.9, -0.25, 0.0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dose.run_scores([0.5, 1.5], "accuracy")


@pytest.mark.parametrize("call", [
    lambda: dose.run_scores([1.0], "perplexity"),
    lambda: dose.level_effect([1.0], [1.0], "perplexity"),
    lambda: dose.effect_ci([1.0], [1.0], "perplexity"),
    lambda: dose.budget_from_fit({"a": 0, "b": 1, "k": 0}, "perplexity", 2.0),
])
def test_unknown_quality_names_the_valid_ones(call):
    with pytest.raises(ValueError, match=r"'perplexity'.*reverse_kl.*accuracy"):
        call()


def test_stalls_count_runs_beyond_three_times_the_median_and_non_finite_ones():
    assert dose.stalls([0.4, 0.5, 0.45, 1.49, 1.51]) == 1  # median 0.5: 1.51 > 1.5, 1.49 is not
    assert dose.stalls([0.3, 0.3, 0.3, math.nan, None, math.inf]) == 3
    assert dose.stalls([-0.01, 0.0, 0.02, 0.29, 0.31]) == 1  # median floored at 0.1 nats: only 0.31 > 0.3
    assert dose.stalls([None, math.nan]) == 2


def test_level_effect_is_the_geometric_mean_ratio_minus_one_or_the_accuracy_drop():
    y_level, y_base = np.log([2.0, 8.0]), np.log([1.0, 4.0])  # geometric means 4 and 2
    assert dose.level_effect(y_level, y_base, "reverse_kl") == pytest.approx(4.0 / 2.0 - 1.0, abs=1e-12)
    acc = dose.run_scores([0.80, 0.70], "accuracy"), dose.run_scores([0.90, 0.80], "accuracy")
    assert dose.level_effect(*acc, "accuracy") == pytest.approx(0.10, abs=1e-12)


def test_one_stalled_seed_moves_the_effect_little_and_the_arithmetic_mean_a_lot():
    rng = np.random.default_rng(0)
    base = 0.1 * np.exp(rng.normal(0, 0.05, 8))
    level = 0.1 * np.exp(rng.normal(0, 0.05, 8))
    stalled = level.copy()
    stalled[3] *= 100.0
    yb = dose.run_scores(base, "reverse_kl")
    moved = (dose.level_effect(dose.run_scores(stalled, "reverse_kl"), yb, "reverse_kl")
             - dose.level_effect(dose.run_scores(level, "reverse_kl"), yb, "reverse_kl"))
    arith_moved = stalled.mean() / base.mean() - level.mean() / base.mean()
    assert 0 < moved < 1.0  # ~ exp(ln 100 / 8) - 1 = 0.78
    assert arith_moved > 10.0  # ~ 99 / 8 = 12.4


def test_effect_ci_contains_the_true_effect():
    rng = np.random.default_rng(1)
    yb = math.log(0.05) + rng.normal(0, 0.2, 16)
    yl = math.log(0.05) + math.log(3.0) + rng.normal(0, 0.2, 8)  # true effect 3x - 1 = 2
    lo, hi = dose.effect_ci(yl, yb, "reverse_kl", n=2000)
    assert lo < 2.0 < hi and 0 < lo and hi < 4.0
    lo, hi = dose.effect_ci(-0.7 + rng.normal(0, 0.01, 8), -0.8 + rng.normal(0, 0.01, 16), "accuracy")
    assert lo < 0.1 < hi


def test_effect_ci_resamples_the_baseline():
    """A constant level against a noisy baseline: only the baseline's resampling can give the CI any width."""
    rng = np.random.default_rng(2)
    level = np.full(8, -2.0)
    lo, hi = dose.effect_ci(level, -2.0 + rng.normal(0, 0.3, 16), "reverse_kl")
    assert hi - lo > 0.2
    lo, hi = dose.effect_ci(level, np.full(16, -2.0 - math.log(2.0)), "reverse_kl")  # nothing random: exact
    assert lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    lo_wide, hi_wide = dose.effect_ci(level, -2.0 + rng.normal(0, 0.9, 16), "reverse_kl")
    assert hi_wide - lo_wide > 2 * (hi - lo) + 0.5


def test_verdict_follows_runs_verdict():
    rng = np.random.default_rng(3)
    yb = rng.normal(0, 0.1, 16)
    admit = dose.verdict(rng.normal(0, 0.1, 8), yb, "reverse_kl", 2.0)
    reject = dose.verdict(math.log(10.0) + rng.normal(0, 0.1, 8), yb, "reverse_kl", 2.0)
    border = dose.verdict(math.log(3.0) + rng.normal(0, 0.3, 8), yb, "reverse_kl", 2.0)
    assert (admit["verdict"], reject["verdict"], border["verdict"]) == ("admit", "reject", "borderline")
    assert admit["ci"][1] <= 2.0 < reject["ci"][0] and border["ci"][0] <= 2.0 < border["ci"][1]
    assert set(admit) == {"effect", "ci", "verdict"}


def test_effect_inputs_are_checked():
    with pytest.raises(ValueError, match="run_scores"):
        dose.level_effect([math.inf, 0.0], [0.0], "reverse_kl")
    with pytest.raises(ValueError, match="non-empty"):
        dose.effect_ci([], [0.0], "reverse_kl")


# --- the hinge fit and the budget ------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2.5, 2.3])  # on a midpoint of the x grid, and off it
def test_fit_hinge_recovers_noiseless_hinges_exactly(k):
    x = np.repeat(np.arange(6.0), 3)
    fit = dose.fit_hinge(x, 0.5 + 1.7 * np.maximum(0.0, x - k))
    assert (fit["a"], fit["b"], fit["k"]) == pytest.approx((0.5, 1.7, k), abs=1e-9)
    assert fit["sse"] < 1e-20 and fit["n"] == 18


def test_fit_hinge_on_noisy_runs_is_close():
    m, y, _ = _study(seed=4)
    fit = dose.fit_hinge(np.log(m), y)
    assert fit["a"] == pytest.approx(math.log(0.05), abs=0.1)
    assert fit["b"] == pytest.approx(B_TRUE, abs=0.1)
    assert fit["k"] == pytest.approx(K_TRUE, abs=0.3)


def test_fit_hinge_flat_or_falling_data_has_no_slope():
    x = np.repeat(np.arange(5.0), 2)
    assert dose.fit_hinge(x, np.ones_like(x)) == {"a": 1.0, "b": 0.0, "k": 0.0, "sse": 0.0, "n": 10}
    falling = dose.fit_hinge(x, -x)
    assert falling["b"] == 0.0 and falling["a"] == pytest.approx(-2.0) and falling["k"] == 0.0


@pytest.mark.parametrize("x, y, match", [
    ([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0], "equal length"),
    ([0.0, 1.0, 2.0], [0.0, 1.0, 2.0], "at least 4 runs"),
    ([0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0, 1.0], "at least 3 distinct"),
    ([0.0, 1.0, 2.0, math.nan], [0.0, 1.0, 2.0, 3.0], "finite"),
])
def test_fit_hinge_bad_inputs(x, y, match):
    with pytest.raises(ValueError, match=match):
        dose.fit_hinge(x, y)


def test_budget_from_fit_is_exact_for_a_known_hinge():
    fit = {"a": -3.0, "b": 2.0, "k": math.log(1e-3)}
    assert dose.budget_from_fit(fit, "reverse_kl", 2.0) == pytest.approx(1e-3 * math.sqrt(3.0), rel=1e-12)
    assert dose.budget_from_fit(fit, "accuracy", 0.1) == pytest.approx(1e-3 * math.exp(0.05), rel=1e-12)
    assert dose.budget_from_fit(fit, "reverse_kl", 2.0, x_base_mean=math.log(1e-12)) == pytest.approx(
        1e-3 * math.sqrt(3.0), rel=1e-12)  # a baseline left of the knee changes nothing
    assert dose.budget_from_fit(fit, "reverse_kl", 2.0, x_base_mean=math.log(2e-3)) == pytest.approx(
        2e-3 * math.sqrt(3.0), rel=1e-12)  # one right of it: the rise counts from the baseline's fitted value
    assert dose.budget_from_fit({**fit, "b": 0.0}, "reverse_kl", 2.0) == math.inf
    with pytest.raises(ValueError, match="delta"):
        dose.budget_from_fit(fit, "reverse_kl", -0.5)


def test_log_dose_places_baseline_runs_without_m_and_rejects_bad_levels():
    x = dose.log_dose([0.0, 1e-12, 1e-3, 1e-2], ["baseline", "baseline", "a", "b"])
    np.testing.assert_allclose(x, [math.log(1e-12) - math.log(10.0), math.log(1e-12), math.log(1e-3),
                                   math.log(1e-2)])
    with pytest.raises(ValueError, match=r"run 2 \(group 'a'\)"):
        dose.log_dose([1e-12, 1e-3, math.nan], ["baseline", "a", "a"])


def test_budget_bootstrap_covers_the_true_budget_quickly_with_a_narrow_span():
    m, y, g = _study(seed=5)
    t0 = time.perf_counter()
    out = dose.budget_bootstrap(m, y, g, "reverse_kl", DELTA, n=1000)
    assert time.perf_counter() - t0 < 2.0
    lo, hi = out["ci"]
    assert lo <= M_TRUE <= hi and lo <= out["budget"] <= hi
    assert out["span"] == pytest.approx(hi / lo) and out["span"] <= 3.0
    assert out["unbounded_share"] == 0.0 and out["n_boot"] == 1000 and out["fit"]["n"] == len(m)


def test_budget_interval_widens_with_a_noisier_baseline():
    """Same draws, only the baseline's noise scaled up: the wider interval is the baseline's uncertainty."""
    m, y, g = _study(seed=6, sig_base=0.15)
    m2, y2, g2 = _study(seed=6, sig_base=0.6)
    quiet = dose.budget_bootstrap(m, y, g, "reverse_kl", DELTA, n=400)
    noisy = dose.budget_bootstrap(m2, y2, g2, "reverse_kl", DELTA, n=400)
    assert math.log(noisy["span"]) > 1.3 * math.log(quiet["span"])  # the interval, in ln M, is 30% wider


def test_no_knee_gives_an_unbounded_budget():
    m, y, g = _study(seed=7, b=0.0, sig=0.0)
    out = dose.budget_bootstrap(m, y, g, "reverse_kl", DELTA, n=200)
    assert out["budget"] == math.inf and out["ci"][1] == math.inf and out["span"] == math.inf
    assert out["unbounded_share"] == 1.0
    m, y, g = _study(seed=7, b=0.0, sig=1e-3)  # noise alone: a tiny slope, a B far beyond every M measured
    out = dose.budget_bootstrap(m, y, g, "reverse_kl", DELTA, n=200)
    assert out["budget"] > 1e3 * m.max() and out["unbounded_share"] > 0.3


def test_budget_bootstrap_bad_inputs():
    m, y, g = _study(seed=8)
    with pytest.raises(ValueError, match="lengths"):
        dose.budget_bootstrap(m[:-1], y, g, "reverse_kl", DELTA, n=10)
    with pytest.raises(ValueError, match="baseline"):
        dose.budget_bootstrap(m, y, ["x"] * len(g), "reverse_kl", DELTA, n=10)
    few = [i for i, s in enumerate(g) if s in ("baseline", g[-1])]
    with pytest.raises(ValueError, match="at least 3 groups"):
        dose.budget_bootstrap(m[few], y[few], [g[i] for i in few], "reverse_kl", DELTA, n=10)
    with pytest.raises(ValueError, match="quality"):
        dose.budget_bootstrap(m, y, g, "bleu", DELTA, n=10)


# --- the table -------------------------------------------------------------------------------------------------

def test_dose_table_rows_and_verdicts():
    m, y, g = _study(seed=9)
    rows = dose.dose_table(m, y, g, "reverse_kl", DELTA, n=500)
    assert [r["group"] for r in rows] == ["baseline"] + [f"sigma={lv:.2g}" for lv in LEVELS]
    base = rows[0]
    assert base["verdict"] == "baseline" and base["effect"] == 0.0 and base["ci"][0] < 0 < base["ci"][1]
    assert base["runs"] == 16 and all(r["runs"] == 8 for r in rows[1:])
    assert rows[1]["m"] == pytest.approx(1e-4, rel=0.05)
    verdicts = [r["verdict"] for r in rows[1:]]
    assert verdicts[:3] == ["admit"] * 3 and verdicts[-2:] == ["reject"] * 2
    for r in rows[1:]:
        assert r["ci"][0] <= r["effect"] <= r["ci"][1]
    with pytest.raises(ValueError, match="baseline"):
        dose.dose_table(m, y, ["level"] * len(g), "reverse_kl", DELTA)
