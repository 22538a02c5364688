"""How a quantity measured by several studies scales with what distinguishes them (response length, model size):
power laws fitted in log-log space, with intervals from each study's own bootstrap draws. Pure numpy.

    study_log_draws  ln B draws of one study (its budget.json), from the stratified bootstrap behind its interval
    lognormal_draws  ln M draws of a probed M from its 95% interval (normal in ln M)
    power_law        ln y = c + s ln x over studies V, refitted once per replicate (one draw per study): s, c, CIs
    at               the fitted y at new x, with its interval
    crossing         the first x (from a given one on) where one power law reaches another (M reaches B), with its
                     interval and the share of replicates where it never does

Replicates of different studies are independent (separate seeds), so replicate n of every study is one joint draw.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from opdjax.study import dose
from opdjax.study.fit import calibration_rows, hinge_runs

__all__ = ["at", "crossing", "lognormal_draws", "power_law", "study_log_draws"]

CI_LEVEL = dose.CI_LEVEL
_Q = ((1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2)


def study_log_draws(budget: Mapping[str, Any], *, n: int = 1000, seed: int = 0) -> np.ndarray:
    """ln B draws, shape [n], of a hinge study's budget.json (the runs of its `fit.calibration_rows` resampled
    within every point, the baseline's too: `dose.budget_bootstrap` with the study's seed 0, so their percentiles
    are its `budget_interval`); +inf where a resample has no knee."""
    quality = budget["config"]["study"]["quality"]
    rows = calibration_rows([p for p in budget["points"] if p.get("group", "sweep") == "sweep"])
    m_R, v_R, g_R = hinge_runs(rows, quality)
    boot = dose.budget_bootstrap(m_R, dose.run_scores(v_R, quality), g_R, quality, float(budget["delta"]), n=n,
                                 seed=seed)
    return np.asarray(boot["log_draws"], np.float64)


def lognormal_draws(m: float, lo: float, hi: float, *, n: int = 1000, seed: int = 0) -> np.ndarray:
    """ln M draws, shape [n]: N(ln m, sd) with sd = (ln hi - ln lo) / (2 * 1.96), the 95% interval read as normal
    in ln M (a probe's bootstrap over sequences). lo <= 0 is floored at m / 1e3."""
    if not m > 0:
        raise ValueError(f"lognormal_draws needs M > 0, got {m!r}")
    lo = lo if lo > 0 else m / 1e3
    sd = max(math.log(max(hi, m)) - math.log(min(lo, m)), 0.0) / (2 * 1.959964)
    return math.log(m) + sd * np.random.default_rng(seed).standard_normal(n)


def _ols(lx_V: np.ndarray, ly_VN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slopes and intercepts, shape [N] each, of ly[:, n] = c + s lx by least squares."""
    xc = lx_V - lx_V.mean()
    s = (xc[:, None] * (ly_VN - ly_VN.mean(0))).sum(0) / (xc ** 2).sum()
    return s, ly_VN.mean(0) - s * lx_V.mean()


def power_law(x_V: Sequence[float], log_y_V: Sequence[float], draws_VN: np.ndarray) -> dict[str, Any]:
    """y = e^c x^s: s and c by least squares of ln y on ln x over V >= 2 studies (point values log_y_V), and their
    percentile intervals from refitting replicate n = draws_VN[:, n] (ln y draws, shape [V, N]).

    Raises ValueError for < 2 distinct x, a non-positive x, or a study with non-finite draws (a resample without a
    knee: that study bounds y from below only and is left out by the caller, who says so).
    Returns {"slope", "slope_ci", "intercept", "intercept_ci", "x", "log_y", "draws": (s_N, c_N)}.
    """
    x, ly, d = (np.asarray(a, np.float64) for a in (x_V, log_y_V, draws_VN))
    if x.ndim != 1 or np.unique(x).size < 2 or (x <= 0).any():
        raise ValueError(f"power_law needs >= 2 distinct positive x, got {x.tolist()}")
    if d.shape[0] != x.size or ly.shape != x.shape:
        raise ValueError(f"power_law: {x.size} x values, {ly.size} log_y values, draws of shape {d.shape}")
    bad = [i for i in range(x.size) if not np.isfinite(d[i]).all() or not math.isfinite(ly[i])]
    if bad:
        raise ValueError(f"power_law: studies {bad} (x = {x[bad].tolist()}) have non-finite ln y draws")
    lx = np.log(x)
    s, c = _ols(lx, ly[:, None])
    s_N, c_N = _ols(lx, d)
    return {"slope": float(s[0]), "slope_ci": np.quantile(s_N, _Q).tolist(), "intercept": float(c[0]),
            "intercept_ci": np.quantile(c_N, _Q).tolist(), "x": x.tolist(), "log_y": ly.tolist(),
            "draws": (s_N, c_N)}


def at(law: Mapping[str, Any], x: float) -> tuple[float, float, float]:
    """(y, lo, hi) of the power law at x: e^(c + s ln x), its interval over the replicates' lines."""
    s_N, c_N = law["draws"]
    y_N = c_N + s_N * math.log(x)
    lo, hi = np.quantile(y_N, _Q)
    return math.exp(law["intercept"] + law["slope"] * math.log(x)), math.exp(lo), math.exp(hi)


def _reach(s_m, c_m, s_b, c_b, lx0: float):
    """ln of the first x >= e^lx0 where c_m + s_m ln x >= c_b + s_b ln x (elementwise): lx0 if already there,
    the meeting point if M's line rises faster, else +inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        meet = (c_b - c_m) / (s_m - s_b)
    there = c_m + s_m * lx0 >= c_b + s_b * lx0
    return np.where(there, lx0, np.where(s_m > s_b, meet, np.inf))


def crossing(m: Mapping[str, Any], b: Mapping[str, Any], x_from: float) -> dict[str, Any]:
    """The first x >= x_from at which power law m reaches power law b (y_m >= y_b): a mismatch M reaching the
    budget B as responses lengthen. From the point fits, and per replicate pair n for the interval (percentiles of
    ln x, +inf where the lines never meet beyond x_from). Returns {"x", "ci": [lo, hi], "never_share"} (x = inf:
    the point fits do not meet; ci[1] = inf: the data cannot rule out that they never meet)."""
    lx0 = math.log(x_from)
    lx = float(_reach(np.array(m["slope"]), np.array(m["intercept"]), np.array(b["slope"]),
                      np.array(b["intercept"]), lx0))
    lx_N = _reach(*m["draws"], *b["draws"], lx0)
    lo, hi = np.quantile(np.where(np.isfinite(lx_N), lx_N, 1e300), _Q)
    back = lambda v: math.inf if v > 700 else math.exp(v)  # noqa: E731  (beyond e^700: never, in floats)
    return {"x": back(lx), "ci": [back(lo), back(hi)],
            "never_share": float(np.mean(~np.isfinite(lx_N)))}
