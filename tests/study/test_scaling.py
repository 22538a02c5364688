"""Power laws across studies against closed forms: a known B = c L^-a recovered with an interval that covers it,
the length at which a mismatch line reaches the budget line, a committed study's draws reproducing its own
interval, and clear errors for what cannot be fitted."""

import json
import math
import pathlib

import numpy as np
import pytest

from opdjax.study import scaling

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results"
L_V = np.array([8.0, 16.0, 32.0, 64.0])


def _draws(log_y_V, sd, n=2000, seed=0):
    return np.asarray(log_y_V)[:, None] + sd * np.random.default_rng(seed).standard_normal((len(log_y_V), n))


def test_power_law_recovers_slope_and_intercept_and_its_interval_covers_them():
    log_b = math.log(40.0) - 1.3 * np.log(L_V)  # B = 40 L^-1.3
    law = scaling.power_law(L_V, log_b, _draws(log_b, 0.2))
    assert law["slope"] == pytest.approx(-1.3) and law["intercept"] == pytest.approx(math.log(40.0))
    lo, hi = law["slope_ci"]
    assert lo < -1.3 < hi and hi - lo < 1.0
    y, ylo, yhi = scaling.at(law, 1024.0)
    assert y == pytest.approx(40.0 * 1024 ** -1.3)
    assert ylo < y < yhi  # extrapolated 16x beyond the data: a wide, but finite, interval
    assert yhi / ylo > scaling.at(law, 32.0)[2] / scaling.at(law, 32.0)[1]


def test_crossing_is_where_the_mismatch_line_reaches_the_budget_line():
    log_b = math.log(40.0) - 1.0 * np.log(L_V)  # B = 40 / L
    log_m = math.log(0.1) + 0.5 * np.log(L_V)  # M = 0.1 sqrt(L): reaches B at L^1.5 = 400
    b = scaling.power_law(L_V, log_b, _draws(log_b, 0.05))
    m = scaling.power_law(L_V, log_m, _draws(log_m, 0.05, seed=1))
    c = scaling.crossing(m, b, x_from=8.0)
    assert c["x"] == pytest.approx(400 ** (1 / 1.5))
    assert c["ci"][0] < c["x"] < c["ci"][1] < math.inf and c["never_share"] == 0.0
    flat = scaling.power_law(L_V, np.full(4, math.log(1e-3)), _draws(np.full(4, math.log(1e-3)), 0.05))
    falling = scaling.power_law(L_V, log_b - 5, _draws(log_b - 5, 0.05))
    assert scaling.crossing(flat, b, x_from=8.0)["x"] == pytest.approx(40.0 / 1e-3)
    never = scaling.crossing(falling, b, x_from=8.0)  # parallel, 5 nats below: never meets, or absurdly far
    assert never["x"] == math.inf and never["never_share"] > 0.2 and never["ci"][1] == math.inf
    assert never["ci"][0] > 1e4
    above = scaling.crossing(scaling.power_law(L_V, log_b + 1, _draws(log_b + 1, 0.05)), b, x_from=8.0)
    assert above["x"] == pytest.approx(8.0)  # already beyond B at the first length


def test_a_committed_studys_draws_give_back_its_own_interval():
    budget = json.loads((RESULTS / "budget_sort_cpu_replicate" / "budget.json").read_text())
    d = scaling.study_log_draws(budget)
    assert d.shape == (1000,) and np.isfinite(d).all()
    assert np.exp(np.quantile(d, [0.025, 0.975])) == pytest.approx(budget["budget_interval"], rel=1e-9)


def test_lognormal_draws_span_the_probes_interval():
    d = scaling.lognormal_draws(2.0, 1.0, 4.0, n=20000)
    assert np.exp(np.quantile(d, [0.025, 0.5, 0.975])) == pytest.approx([1.0, 2.0, 4.0], rel=0.03)
    with pytest.raises(ValueError, match="M > 0"):
        scaling.lognormal_draws(0.0, 0.0, 1.0)


def test_power_law_refuses_what_it_cannot_fit_and_names_it():
    with pytest.raises(ValueError, match="distinct positive x"):
        scaling.power_law([8.0, 8.0], [0.0, 1.0], np.zeros((2, 10)))
    d = _draws([1.0, 0.5, 0.0], 0.1)
    d[1, 3] = np.inf  # a resample of the second study without a knee
    with pytest.raises(ValueError, match=r"studies \[1\] \(x = \[16.0\]\)"):
        scaling.power_law([8.0, 16.0, 32.0], [1.0, 0.5, 0.0], d)
