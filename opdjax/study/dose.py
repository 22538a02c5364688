"""Dose-response statistics of a mismatch-budget study over single runs: robust per-level effects whose intervals
carry the baseline's own noise, and a hinge fit of quality against ln M whose budget B has a stratified-bootstrap
interval. Pure numpy; every function takes one value per run (suffix _R: shape (R,)).

    run_scores        per-run score y on which effects add: ln(reverse KL + 0.1 nats) (capped) or -accuracy
    stalls            how many runs stalled: final reverse KL > 3x the runs' median (or not finite)
    log_dose          per-run x = ln M (a baseline run without a usable M sits one decade below the smallest)
    level_effect      a level's quality loss against the baseline: geometric-mean ratio - 1, or accuracy drop
    effect_ci         its percentile bootstrap CI, resampling the level's AND the baseline's runs
    verdict           admit / reject / borderline of one level from that CI and delta (`runs_verdict`)
    fit_hinge         y = a + b * max(0, x - k) with b >= 0, least squares over all runs, k on a grid
    budget_from_fit   the M where the fitted curve has risen delta above its plateau (inf when b = 0)
    budget_bootstrap  B from the hinge fit, with a percentile interval from resampling runs within every group
    dose_table        one row per group: geometric-mean M, runs, effect, CI, verdict
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["BASELINE", "BASELINE_MARGIN", "CI_LEVEL", "QUALITIES", "RKL_CAP", "RKL_OFFSET", "STALL_FACTOR", "budget_bootstrap", "budget_from_fit",
           "dose_table", "effect_ci", "fit_hinge", "level_effect", "log_dose", "reverse_kl_of_score", "run_scores", "runs_verdict",
           "stalls", "verdict"]

CI_LEVEL = 0.95  # of every bootstrap interval of the study
QUALITIES = ("reverse_kl", "accuracy")

BASELINE = "baseline"  # the group label of the mismatch-free runs
RKL_CAP = 1e6  # a diverged run's (non-finite) shifted reverse KL, and the largest one any run counts with
RKL_OFFSET = 0.1  # nats added to the held-out reverse KL before the log (`run_scores`)
STALL_FACTOR = 3.0  # a run whose final reverse KL exceeds this multiple of its group's median stalled
BASELINE_MARGIN = math.log(10.0)  # a baseline run without a finite M > 0 sits this far below the smallest ln M
_TIE = 1e-10  # SSEs within _TIE * (total sum of squares) of the minimum are a tie in `fit_hinge`


def runs_verdict(ci: Sequence[float], delta: float) -> str:
    """A configuration's full-run verdict from the CI of its quality loss: "admit" (ci_high <= delta), "reject"
    (ci_low > delta), "borderline" (the CI contains delta: the runs do not decide it, so it is neither agreement
    nor disagreement for a probe)."""
    lo, hi = ci
    if hi <= delta:
        return "admit"
    if lo > delta:
        return "reject"
    return "borderline"


def _check_quality(quality: str) -> None:
    if quality not in QUALITIES:
        raise ValueError(f"quality {quality!r} is not valid; choose one of {list(QUALITIES)}")


def _scores(y: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(y, np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of scores, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has non-finite scores: pass the raw values through run_scores first")
    return a


def _to_effect(diff, quality: str):
    """Mean-score difference (level - baseline) -> effect on the user's scale (exp(d) - 1, or d)."""
    return np.expm1(diff) if quality == "reverse_kl" else diff


def run_scores(values: Sequence[float | None], quality: str) -> np.ndarray:
    """Per-run score y_R on which effects are additive (larger = worse), from final qualities values_R.

    reverse_kl: y = ln(min(max(rkl, 0) + RKL_OFFSET, RKL_CAP)). The held-out reverse KL is a sampled estimate
        (`pipeline.evaluate`): unbiased, so a run that matches the teacher reports about 0, slightly negative for
        some seeds (its noise over 128 prompts is ~0.01-0.05 nats). The offset of 0.1 nats makes the score a ratio
        where reverse KL is large (a stall at 10 vs 0.5 counts x3.8) and a difference where it is near 0, so two
        equally good runs at 0.003 and 0.03 do not differ by a factor 10. A non-finite (diverged) or missing rkl
        gets y = ln(RKL_CAP): the worst possible run, but finite, so it cannot make every mean (and every
        resample drawing it) infinite.
    accuracy: y = -accuracy; a non-finite or missing accuracy counts as 0 (y = 0, the worst). Values outside
        [0, 1] raise ValueError.
    """
    _check_quality(quality)
    v = np.asarray(values, np.float64).reshape(-1)  # None -> NaN
    if quality == "reverse_kl":
        ok = np.isfinite(v)
        return np.log(np.where(ok, np.minimum(np.maximum(np.where(ok, v, 0.0), 0.0) + RKL_OFFSET, RKL_CAP), RKL_CAP))
    fin = np.isfinite(v)
    if (fin & ((v < 0) | (v > 1))).any():
        raise ValueError(f"accuracy must lie in [0, 1]; got {v[fin & ((v < 0) | (v > 1))][:3].tolist()}")
    return -np.where(fin, v, 0.0)


def stalls(reverse_kl_R: Sequence[float | None], factor: float = STALL_FACTOR) -> int:
    """Runs that stalled: #{r : rkl_r > factor * max(median(finite rkl), RKL_OFFSET), or rkl_r not finite}
    (shape (R,) -> int).

    The issue-28 definition of a stall of the mismatch-free baseline (a seed that did not train); 0 of >= 32 seeds
    is what a baseline must show before its study is worth reading. The median is floored at RKL_OFFSET: near 0
    the sampled estimate's own noise (0.01-0.05 nats) would call converged runs stalled."""
    v = np.array([np.nan if x is None else x for x in reverse_kl_R], dtype=float)
    ok = np.isfinite(v)
    if not ok.any():
        return int(v.size)
    return int((~ok).sum() + (v[ok] > factor * max(float(np.median(v[ok])), RKL_OFFSET)).sum())


def reverse_kl_of_score(y: float) -> float:
    """The reverse KL whose `run_scores` is y (exp(y) - RKL_OFFSET): e.g. the baseline's reference value from its
    mean score."""
    return float(math.exp(y) - RKL_OFFSET)


def log_dose(m_R: Sequence[float], group_R: Sequence[str]) -> np.ndarray:
    """x_R = ln m_R, the dose axis of `fit_hinge`.

    A baseline run (group BASELINE) keeps its own ln m when m is finite and > 0 (m ~ 1e-12 gives x ~ -27.6: far
    left of every knee, so it only informs the plateau); a baseline run with m <= 0 or non-finite gets
    x = min(finite ln m) - BASELINE_MARGIN (one decade below the smallest M). Any other run with m <= 0 or
    non-finite raises ValueError.
    """
    m = np.asarray(m_R, np.float64).reshape(-1)
    g = np.asarray([str(s) for s in group_R])
    if m.size != g.size:
        raise ValueError(f"m_R and group_R differ in length: {m.size} != {g.size}")
    ok = np.isfinite(m) & (m > 0)
    bad = np.flatnonzero(~ok & (g != BASELINE))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"run {i} (group {str(g[i])!r}) has M = {float(m[i])!r}: a non-baseline M must be finite "
                         "and > 0")
    if not ok.any():
        raise ValueError("no run has a finite M > 0")
    x = np.log(np.where(ok, m, 1.0))
    return np.where(ok, x, x[ok].min() - BASELINE_MARGIN)


def level_effect(y_level: Sequence[float], y_base: Sequence[float], quality: str) -> float:
    """A level's quality loss against the baseline from scores y_level (L,) and y_base (B,) (`run_scores`).

    reverse_kl: exp(mean(y_level) - mean(y_base)) - 1 = GM(rkl_level + c) / GM(rkl_base + c) - 1 (c = RKL_OFFSET),
        the ratio of geometric means minus 1, so delta = 2.0 means "3x the baseline's reverse KL (+ 0.1 nats)".
    accuracy: mean(y_level) - mean(y_base) = mean(acc_base) - mean(acc_level), the accuracy drop.
    Why the log (geometric) scale: a stalled seed at 100x the others moves the log-mean of 8 seeds by
    ln(100) / 8 = 0.58 (effect x1.8), while it moves the arithmetic mean by (100 - 1) / 8 ~ 12x: one seed no
    longer decides the level.
    """
    _check_quality(quality)
    yl, yb = _scores(y_level, "y_level"), _scores(y_base, "y_base")
    return float(_to_effect(yl.mean() - yb.mean(), quality))


def effect_ci(y_level: Sequence[float], y_base: Sequence[float], quality: str, *, n: int = 2000, seed: int = 0,
              level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap CI of `level_effect`: each of n resamples draws the level's L runs AND, independently,
    the baseline's B runs with replacement, so the baseline's own noise is inside the interval (a constant level
    against a noisy baseline gets a CI of positive width). Quantiles of the n effects at (1 -+ level) / 2.
    """
    _check_quality(quality)
    yl, yb = _scores(y_level, "y_level"), _scores(y_base, "y_base")
    if n < 1 or not 0 < level < 1:
        raise ValueError(f"need n >= 1 and 0 < level < 1, got n={n}, level={level}")
    rng = np.random.default_rng(seed)
    ml = yl[rng.integers(0, yl.size, (n, yl.size))].mean(1)
    mb = yb[rng.integers(0, yb.size, (n, yb.size))].mean(1)
    lo, hi = np.quantile(_to_effect(ml - mb, quality), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def verdict(y_level: Sequence[float], y_base: Sequence[float], quality: str, delta: float,
            **kw: Any) -> dict[str, Any]:
    """{"effect", "ci": [lo, hi], "verdict"} of one level against the baseline: `level_effect`, `effect_ci` (kw:
    n, seed, level) and `runs_verdict` (hi <= delta admit, lo > delta reject, else borderline)."""
    lo, hi = effect_ci(y_level, y_base, quality, **kw)
    return {"effect": level_effect(y_level, y_base, quality), "ci": [lo, hi], "verdict": runs_verdict((lo, hi), delta)}


def _interior_knots(x: np.ndarray, y: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Each gap (u_j, u_j+1) of the sorted distinct x: the knot of the unconstrained least-squares fit
    y = a + b (x - u_j+1) R + c R with R = [x >= u_j+1], i.e. k = u_j+1 - c / b, kept when b > 0 and it lies
    strictly inside the gap (then it is that gap's exact least-squares knot; otherwise the gap's best knot is an
    end, u_j or u_j+1, already on the grid). Shape (<= U - 1,)."""
    r = (x[None, :] >= u[1:, None]).astype(np.float64)  # (U-1, R)
    w1, w2 = (x[None, :] - u[1:, None]) * r, r
    w1, w2, yc = w1 - w1.mean(1, keepdims=True), w2 - w2.mean(1, keepdims=True), y - y.mean()
    s11, s12, s22 = (w1 * w1).sum(1), (w1 * w2).sum(1), (w2 * w2).sum(1)
    s1y, s2y = w1 @ yc, w2 @ yc
    det = s11 * s22 - s12 * s12
    ok = det > 1e-12 * s11 * s22
    det = np.where(ok, det, 1.0)
    b, c = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
    k = u[1:] - c / np.where(b > 0, b, 1.0)
    return k[ok & (b > 0) & (k > u[:-1]) & (k < u[1:])]


def fit_hinge(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Least-squares hinge over all runs: y_i = a + b * max(0, x_i - k), b >= 0; x_R = ln M (`log_dose`), y_R scores.

    k ranges over a grid: every distinct x (min and max included), the midpoints between consecutive distinct
    sorted x, and each gap's exact interior least-squares knot (`_interior_knots`), so the result is the exact
    least-squares hinge, not one quantised to the gaps between dose levels (a knee between two levels would
    otherwise bias B by 10-15% in a simulation with levels 3.16x apart). For each k, z = max(0, x - k) and
    (a, b) is the ordinary least-squares line of y on z: b = S_zy / S_zz, a = mean(y) - b mean(z); when b < 0
    (or z is constant) b = 0 and a = mean(y). SSE(k) = S_yy - b S_zy. The k with the least SSE wins; SSEs
    within 1e-10 S_yy of the least are ties, won by the smallest k (so b = 0 data report k = min x).
    Returns {"a", "b", "k", "sse" (recomputed from the residuals), "n" (runs)}. ValueError for unequal lengths,
    non-finite values, fewer than 4 runs or fewer than 3 distinct x (dose levels).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D of equal length, got shapes {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite (x = ln M from log_dose, y from run_scores)")
    if x.size < 4:
        raise ValueError(f"fit_hinge needs at least 4 runs, got {x.size}")
    u = np.unique(x)
    if u.size < 3:
        raise ValueError(f"fit_hinge needs at least 3 distinct ln M values (dose levels), got {u.size}")
    ks = np.unique(np.concatenate([u, (u[:-1] + u[1:]) / 2, _interior_knots(x, y, u)]))
    z = np.maximum(0.0, x[None, :] - ks[:, None])  # (K, R)
    zc = z - z.mean(1, keepdims=True)
    yc = y - y.mean()
    szz, szy, syy = (zc * zc).sum(1), zc @ yc, float(yc @ yc)
    b = np.maximum(np.where(szz > 0, szy / np.where(szz > 0, szz, 1.0), 0.0), 0.0)
    sse = syy - b * szy
    i = int(np.flatnonzero(sse <= sse.min() + _TIE * syy)[0])
    bi = float(b[i])
    a = float(y.mean() - bi * z[i].mean())
    res = y - a - bi * z[i]
    return {"a": a, "b": bi, "k": float(ks[i]), "sse": float(res @ res), "n": int(x.size)}


def budget_from_fit(fit: Mapping[str, Any], quality: str, delta: float,
                    x_base_mean: float | None = None) -> float:
    """B = exp(x_B), the M at which the fitted hinge has risen delta above its plateau `a` (the fit's, so the
    baseline runs are in it): reverse_kl: b (x_B - k) = ln(1 + delta); accuracy: b (x_B - k) = delta.

    x_base_mean (the baseline runs' mean x): when given and right of the knee (the curve already rises at the
    baseline), the rise is counted from the fitted value there: x_B = max(k, x_base_mean) + rise / b.
    Returns +inf when b == 0 (no knee: the caller reports UNRESOLVED) or when exp(x_B) overflows. A finite B
    beyond the largest M measured is an extrapolation of the fitted slope (noise on a flat curve gives a small
    b > 0 and a far B): the caller should not report it as a located knee.
    """
    _check_quality(quality)
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta must be finite and >= 0, got {delta!r}")
    b, k = float(fit["b"]), float(fit["k"])
    if not b > 0:
        return math.inf
    rise = math.log1p(delta) if quality == "reverse_kl" else float(delta)
    start = k if x_base_mean is None else max(k, float(x_base_mean))
    x_b = start + rise / b
    return math.exp(x_b) if x_b < 709.0 else math.inf


def _runs(m_R, y_R, group_R) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_R, y_R, group_R, baseline mask) checked: equal lengths, finite scores, a BASELINE group present."""
    lens = {"m_R": len(m_R), "y_R": len(y_R), "group_R": len(group_R)}
    if len(set(lens.values())) != 1:
        raise ValueError(f"m_R, y_R and group_R must have one entry per run; lengths {lens}")
    y = _scores(y_R, "y_R")
    g = np.asarray([str(s) for s in group_R])
    base = g == BASELINE
    if not base.any():
        raise ValueError(f"no run is in the baseline group {BASELINE!r}; groups: {sorted(set(g.tolist()))}")
    return log_dose(m_R, g), y, g, base


def _stratified(g: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, R) run indices: every row draws each group's runs with replacement, within the group, in group order."""
    cols = []
    for name in np.unique(g):
        idx = np.flatnonzero(g == name)
        cols.append(idx[rng.integers(0, idx.size, (n, idx.size))])
    return np.concatenate(cols, axis=1)


def budget_bootstrap(m_R: Sequence[float], y_R: Sequence[float], group_R: Sequence[str], quality: str,
                     delta: float, *, n: int = 1000, seed: int = 0, level: float = CI_LEVEL) -> dict[str, Any]:
    """B from `fit_hinge` on all runs (x = `log_dose`, `budget_from_fit` with the baseline's mean x), and its
    percentile interval from a stratified bootstrap: each of n resamples draws every group's runs with
    replacement within the group (the baseline's too, so its noise is inside the interval), refits, recomputes B.

    Quantiles are taken of ln B (+inf kept as +inf), at (1 -+ level) / 2. Returns {"budget", "ci": [lo, hi],
    "fit", "n_boot", "unbounded_share" (share of resamples with B = inf), "span" (hi / lo; inf if lo == 0 or hi
    inf), "log_draws" (the n resampled ln B, +inf where unbounded: what `scaling` refits across studies)}.
    Cost: one vectorised (K, R) fit per resample; n = 1000 on 72-96 runs took 0.3-0.45 s on one shared core.
    """
    _check_quality(quality)
    x, y, g, base = _runs(m_R, y_R, group_R)
    if np.unique(g).size < 3:
        raise ValueError(f"budget_bootstrap needs at least 3 groups (the baseline and 2 levels), got "
                         f"{sorted(set(g.tolist()))}")
    fit = fit_hinge(x, y)
    budget = budget_from_fit(fit, quality, delta, float(x[base].mean()))
    idx = _stratified(g, n, np.random.default_rng(seed))
    in_base = base[idx[0]]  # the baseline's columns are the same in every row
    log_b = np.empty(n)
    for i, r in enumerate(idx):
        xr = x[r]
        bi = budget_from_fit(fit_hinge(xr, y[r]), quality, delta, float(xr[in_base].mean()))
        log_b[i] = math.log(bi) if math.isfinite(bi) else 1e300
    q = np.quantile(log_b, [(1 - level) / 2, (1 + level) / 2])
    lo, hi = (math.inf if v >= 1e299 else math.exp(v) for v in q)
    span = math.inf if lo == 0 or math.isinf(hi) else hi / lo
    return {"budget": budget, "ci": [lo, hi], "fit": fit, "n_boot": int(n),
            "unbounded_share": float(np.mean(log_b >= 1e299)), "span": span,
            "log_draws": np.where(log_b >= 1e299, np.inf, log_b)}


def dose_table(m_R: Sequence[float], y_R: Sequence[float], group_R: Sequence[str], quality: str, delta: float, *,
               n: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """One row per group, sorted by mean ln M (ties by name): {"group", "m" (geometric mean M = exp(mean x), x from
    `log_dose`), "runs", "effect", "ci", "verdict"}; each level's effect, CI and verdict from `verdict` against the
    baseline runs. The baseline's own row has effect 0.0, verdict "baseline", and as ci the baseline resampled
    against itself: the spread an effect-free level would show (the resolution of the design).
    ValueError when no group is named BASELINE ("baseline").
    """
    _check_quality(quality)
    x, y, g, base = _runs(m_R, y_R, group_R)
    yb = y[base]
    rows = []
    for name in sorted(set(g.tolist()), key=lambda s: (float(x[g == s].mean()), s)):
        sel = g == name
        row: dict[str, Any] = {"group": name, "m": math.exp(float(x[sel].mean())), "runs": int(sel.sum())}
        if name == BASELINE:
            row.update(effect=0.0, ci=list(effect_ci(yb, yb, quality, n=n, seed=seed)), verdict="baseline")
        else:
            row.update(verdict(y[sel], yb, quality, delta, n=n, seed=seed))
        rows.append(row)
    return rows
