"""Fitting the budget: per-seed quality losses, one point's aggregate over seeds, the fit of B, and how sure each
of them is. A point's quality loss is `dose.level_effect` of its runs against the baseline's runs (reverse KL: the
ratio of geometric means - 1, so one stalled seed cannot decide it), with `dose.effect_ci` (both sides resampled).

    baseline_stats   the baseline's reference values: geometric-mean reverse KL, mean accuracy, per-seed values
    point_effect     a point's quality loss and its CI against the baseline runs
    hinge_fit        fit "hinge" (default): B from a dose-response hinge over every run, stratified-bootstrap CI
    train_probe_ratio  how much of the probe's M a point's training sees (training M / probe M) with its CI
    fit_budget       fits "isotonic" / "first_failure" over the points' quality losses
    mean_ci          a percentile bootstrap CI of a mean over seeds
    runs_verdict     admit / reject / borderline: a configuration's full-run verdict from a CI and delta
    budget_interval  B's interval for the point fits: refitted on seeds resampled within every point and the baseline
    knee_bracket     [largest M within tolerance, smallest M beyond] around B, and whether it is narrow enough
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from opdjax.study import dose
from opdjax.study.dose import CI_LEVEL, QUALITIES, runs_verdict
from opdjax.study.records import Point, RunResult

__all__ = ["CI_LEVEL", "FITS", "QUALITIES", "aggregate", "baseline_stats", "budget_interval", "finite_mean",
           "calibration_rows", "fit_budget", "hinge_fit", "hinge_runs", "knee_bracket",
           "mean_ci", "monotone_q_loss", "point_effect", "probe_agrees", "quality_losses",
           "runs_verdict", "straddles", "train_probe_ratio", "trivial_scores", "validity_scores"]

FITS = ("hinge", "isotonic", "first_failure")


def _field(r: RunResult | Mapping[str, Any], key: str) -> Any:
    return r[key] if isinstance(r, Mapping) else getattr(r, key)


def baseline_stats(values: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """The baseline's reference values from its seeds' final {"reverse_kl": [...], "accuracy": [...]} (and
    optionally "initial_reverse_kl" / "initial_accuracy"): "reverse_kl" is the reverse KL of the mean
    `dose.run_scores` (a geometric mean of rkl + 0.1 nats, less the 0.1: the reference the per-seed losses and the
    point effects share), "accuracy" the mean, "stalls" the seeds that did not train (`dose.stalls`); the per-seed
    lists are kept as "<key>_seeds"."""
    rkl, acc = list(values["reverse_kl"]), list(values["accuracy"])
    out = {"reverse_kl": dose.reverse_kl_of_score(float(dose.run_scores(rkl, "reverse_kl").mean())),
           "accuracy": float(np.mean(acc)), "stalls": dose.stalls(rkl),
           "reverse_kl_seeds": rkl, "accuracy_seeds": acc}
    for k in ("initial_reverse_kl", "initial_accuracy"):
        if k in values:
            out[k] = float(np.mean(values[k]))
    return out


def point_effect(records: Sequence[RunResult | Mapping], baseline: Mapping[str, Any], quality: str, **kw: Any
                 ) -> tuple[float, list[float]]:
    """(quality loss, its CI) of a point's runs against the baseline's seeds (`baseline_stats`): `dose.level_effect`
    and `dose.effect_ci` (kw: n, seed, level) of the runs' scores. The baseline point itself gets 0 and the CI of
    the baseline resampled against itself (the smallest effect the design resolves)."""
    key = _key(quality)
    y = dose.run_scores([_field(r, key) for r in records], quality)
    yb = dose.run_scores(baseline[f"{key}_seeds"], quality)
    return dose.level_effect(y, yb, quality), list(dose.effect_ci(y, yb, quality, **kw))


def _key(quality: str) -> str:
    if quality not in QUALITIES:
        raise ValueError(f"quality {quality!r} is not valid; choose one of {list(QUALITIES)}")
    return "reverse_kl" if quality == "reverse_kl" else "accuracy"


def quality_losses(records: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> list[float]:
    """Per-seed quality loss against the baseline's reference (`baseline_stats`; NaN/inf final quality -> +inf).

    reverse_kl: (rkl + c) / (rkl_base + c) - 1, c = `dose.RKL_OFFSET` (rkl clipped at 0, rkl_base from
    `baseline_stats`);  accuracy: acc_base - acc.
    A point's loss is not the mean of these but `point_effect` (the geometric mean of 1 + q, - 1).
    """
    c, out = dose.RKL_OFFSET, []
    for r in records:
        x = _field(r, _key(quality))
        if x is None or not math.isfinite(x):
            out.append(math.inf)
        elif quality == "reverse_kl":
            out.append(float((max(x, 0.0) + c) / (max(baseline["reverse_kl"], 0.0) + c) - 1))
        else:
            out.append(float(baseline["accuracy"] - x))
    return out


def fit_budget(points: Sequence[Mapping[str, Any]], delta: float, method: str = "isotonic"
               ) -> tuple[float, list[bool]]:
    """Budget B and each point's within-tolerance flag.

    within_i = (q_loss_i <= delta)  (NaN/inf q_loss: not within). Points without a finite m are ignored by the fit.
    method "isotonic" (default): quality loss is assumed non-decreasing in M, so q_loss is replaced by its
        isotonic (monotone non-decreasing) regression on M (`monotone_q_loss`); B is the largest m whose fitted
        loss is <= delta (0.0 when none is). One noisy point is pooled with its neighbours instead of deciding B
        alone; a diverged point (inf) pools to inf, so nothing at or beyond it is admitted.
    method "first_failure": walk the points in increasing m (ties: all must be within); B is the m of the last
        point before the first one not within — the most conservative reading of the raw points.
    """
    if method not in FITS:
        raise ValueError(f"fit method {method!r} is not valid; choose one of {list(FITS)}")
    within = [bool(math.isfinite(p["q_loss"]) and p["q_loss"] <= delta) if p.get("q_loss") is not None else False
              for p in points]
    if method == "isotonic":
        ok = {i: f <= delta for i, f in enumerate(monotone_q_loss(points)) if f is not None}
    else:
        ok = {i: within[i] for i, p in enumerate(points) if p.get("m") is not None and math.isfinite(p["m"])}
    budget = 0.0
    for m in sorted({points[i]["m"] for i in ok}):  # increasing m; tied points stand or fall together
        if not all(v for i, v in ok.items() if points[i]["m"] == m):
            break
        budget = float(m)
    return budget, within


def monotone_q_loss(points: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Isotonic regression of q_loss on m (pool adjacent violators; NaN/inf count as +inf; tied m pooled first,
    weighted by their count). None for points without a finite m or q_loss."""
    idx = sorted((i for i, p in enumerate(points) if p.get("m") is not None and math.isfinite(p["m"])
                  and p.get("q_loss") is not None), key=lambda i: points[i]["m"])
    blocks: list[list] = []  # [sum, weight, members]
    for i in idx:
        q = float(points[i]["q_loss"])
        q = q if math.isfinite(q) else math.inf
        if blocks and points[blocks[-1][2][-1]]["m"] == points[i]["m"]:
            blocks[-1][0] += q
            blocks[-1][1] += 1
            blocks[-1][2].append(i)
        else:
            blocks.append([q, 1, [i]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, w_, m_ = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += w_
            blocks[-1][2].extend(m_)
    out: list[float | None] = [None] * len(points)
    for s_, w_, members in blocks:
        for i in members:
            out[i] = s_ / w_
    return out


def _spread(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, float)
    fin = a[np.isfinite(a)]
    return {"mean": float(a.mean()) if a.size else float("nan"),
            "std": float(fin.std(ddof=1)) if fin.size > 1 else 0.0,
            "min": float(a.min()) if a.size else float("nan"), "max": float(a.max()) if a.size else float("nan")}


def finite_mean(xs) -> float:
    """The mean of the finite values of `xs` (None, NaN and ±inf skipped); NaN when none is finite."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.mean(xs)) if xs else float("nan")


def aggregate(point: Point, recs: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> dict[str, Any]:
    """One row of budget.json's `points`: the quality loss and its CI (`point_effect`), means over seeds, the probe
    CIs' union, per-seed values and spread."""
    losses = quality_losses(recs, baseline, quality)
    q_loss, q_ci = point_effect(recs, baseline, quality)
    probes = [r.m_probe for r in recs if r.m_probe is not None]
    row = {
        "id": point.id, "group": point.group, "knob": point.knob, "value": point.value, "label": point.label,
        "m_probe": float(np.mean(probes)) if probes else None,
        "m_probe_ci": ([float(min(r.m_probe_ci[0] for r in recs)), float(max(r.m_probe_ci[1] for r in recs))]
                       if probes else None),
        "m_train": finite_mean(r.m_train_k3 for r in recs),
        "m_train_k1": finite_mean(r.m_train_k1 for r in recs),
        "m_train_abs_log_ratio_p95": finite_mean(r.m_train_abs_log_ratio_p95 for r in recs),
        "q_reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
        "q_accuracy": float(np.mean([r.accuracy for r in recs])),
        "q_loss": q_loss, "q_loss_ci": q_ci,
        "q_loss_spread": _spread(losses),
        "seeds": [{"seed": r.seed, "m_probe": r.m_probe, "m_train": r.m_train_k3,
                   "reverse_kl": r.reverse_kl, "accuracy": r.accuracy, "q_loss": q,
                   "nonfinite_steps": r.nonfinite_steps, **({"reward_last": r.reward_last}
                                                               if r.reward_last is not None else {}),
                   **_steps_to_quality(r)}
                  for r, q in zip(recs, losses)],
        "seconds": float(sum(r.probe_seconds + r.train_seconds for r in recs)),
    }
    return row


def _steps_to_quality(r) -> dict[str, Any]:
    """{"steps_to_quality": {fraction: step or None (not reached)}, "train_steps"} of a record's reverse-KL
    `to_quality` (against the study's baseline); {} for a record without one (written before the training clock)."""
    tq = (r.to_quality or {}).get("eval/reverse_kl")
    if not tq or "thresholds" not in tq:
        return {}
    return {"steps_to_quality": {f: t["step"] for f, t in tq["thresholds"].items()}, "train_steps": int(r.steps)}


def straddles(q_loss_seeds: Sequence[float], delta: float) -> bool:
    """True when some seeds' quality loss is within delta and others beyond it (a seed-decided full-run verdict)."""
    within = [q <= delta for q in q_loss_seeds]
    return any(within) and not all(within)


def probe_agrees(verdict: str, runs: str) -> bool | None:
    """Whether a probe verdict agrees with the full runs' (`runs_verdict`): ADMIT with "admit", REJECT and UNCERTAIN
    (not admitted) with "reject"; None where the runs are "borderline" (their seeds do not decide)."""
    return None if runs == "borderline" else (verdict == "ADMIT") == (runs == "admit")


def trivial_scores(decided: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What the do-nothing rules score on the same decided candidates: always ADMIT is right where the runs
    admit, always REJECT where they reject."""
    return {"always_admit": sum(r["runs_verdict"] == "admit" for r in decided),
            "always_reject": sum(r["runs_verdict"] == "reject" for r in decided)}


def validity_scores(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A validity table's scores over its decided rows (runs not borderline; each row has "candidate", the probe's
    "verdict", "runs_verdict" and "agree"): agreement, n_decided, false_admits (probe ADMIT, runs reject) and the
    do-nothing rules' `trivial_scores`."""
    decided = [r for r in rows if r["runs_verdict"] != "borderline"]
    return {"agreement": sum(bool(r["agree"]) for r in decided), "n_decided": len(decided),
            "false_admits": [r["candidate"] for r in decided
                             if r["verdict"] == "ADMIT" and r["runs_verdict"] == "reject"],
            **trivial_scores(decided)}


def mean_ci(xs: Sequence[float], *, n: int = 2000, seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(xs), resampling the values with replacement (+inf values stay +inf: a
    diverged seed makes every resample that draws it infinite). One value: (x, x)."""
    a = np.asarray(xs, np.float64)
    if a.size == 0:
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, a.size, (n, a.size))
    big = np.where(np.isfinite(a), a, 1e300)  # inf - inf would be NaN inside the quantile's interpolation
    means = big[idx].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    back = lambda v: math.inf if v >= 1e299 else float(v)  # noqa: E731
    return back(lo), back(hi)


def budget_interval(rows: Sequence[Mapping[str, Any]], quality: str, delta: float, method: str = "isotonic", *,
                    n: int = 1000, seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile interval of B (fits "isotonic" / "first_failure") over bootstrap resamples of seeds.

    rows: budget.json's sweep rows (`aggregate` output: "m_probe", "knob", and per-seed "reverse_kl"/"accuracy"
    under "seeds"); the row with knob "baseline" is the baseline. Each resample draws every point's seeds with
    replacement (the baseline's too), recomputes each point's quality loss against the drawn baseline
    (`dose.level_effect`) and refits B with `fit_budget`; M stays each point's probe M.
    """
    key = _key(quality)
    ys = [dose.run_scores([s[key] for s in r["seeds"]], quality) for r in rows]
    base = next(i for i, r in enumerate(rows) if r["knob"] == "baseline")
    rng = np.random.default_rng(seed)
    bs = []
    for _ in range(n):
        draws = [y[rng.integers(0, y.size, y.size)] for y in ys]
        pts = [{"m": r["m_probe"], "q_loss": dose.level_effect(d, draws[base], quality)} for r, d in zip(rows, draws)]
        bs.append(fit_budget(pts, delta, method)[0])
    lo, hi = np.quantile(bs, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def train_probe_ratio(row: Mapping[str, Any], *, n: int = 2000, seed: int = 0, level: float = CI_LEVEL
                      ) -> tuple[float, float, float]:
    """(r, lo, hi): how much of the probe's M a point's training sees, r = mean_s m_train_s / mean_s m_probe_s over
    its seeds s (a `aggregate` row's "seeds"), with a percentile interval from resampling the seeds (each seed's
    pair kept together). NaN when no seed has both M."""
    pairs = np.asarray([(s["m_train"], s["m_probe"]) for s in row.get("seeds", ())
                        if s.get("m_train") is not None and s.get("m_probe") is not None], np.float64)
    if pairs.size == 0 or pairs[:, 1].sum() <= 0:
        return math.nan, math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, len(pairs), (n, len(pairs)))
    draws = pairs[idx, 0].mean(1) / np.maximum(pairs[idx, 1].mean(1), 1e-300)
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(pairs[:, 0].mean() / pairs[:, 1].mean()), float(lo), float(hi)


def calibration_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows B is fitted on: the baseline and the weight-noise levels when the sweep has two or more (the
    calibration knob; other kinds get their own fit in `kind_budgets`), else every row."""
    noise = [r for r in rows if r["knob"] == "weight_noise"]
    return [r for r in rows if r["knob"] == "baseline"] + noise if len(noise) >= 2 else list(rows)


def hinge_runs(rows: Sequence[Mapping[str, Any]], quality: str, x: str = "m_probe"
               ) -> tuple[list[float], list[Any], list[str]]:
    """(m_R, value_R, group_R) of every run of the sweep rows with that M: the run's M (`x`: "m_probe", the probe's,
    or "m_train", the mean per-step M its training logged), its final reverse KL or accuracy (`quality`), and its
    group (the point's id; "baseline" for the baseline)."""
    key = _key(quality)
    runs = [(s[x], s[key], "baseline" if r["knob"] == "baseline" else r["id"])
            for r in rows for s in r["seeds"] if s.get(x) is not None]
    m_R, v_R, g_R = (list(c) for c in zip(*runs)) if runs else ([], [], [])
    return m_R, v_R, g_R


def hinge_fit(rows: Sequence[Mapping[str, Any]], quality: str, delta: float, factor: float, *, n: int = 1000,
              seed: int = 0, x: str = "m_probe") -> tuple[float, list[float], dict[str, Any]]:
    """Fit "hinge": B and its 95% interval from `dose.budget_bootstrap` over every run of the sweep rows (x = the
    run's ln M, the probe's or training's as `hinge_runs`' `x`, y = its `dose.run_scores`; groups = the points,
    the baseline's seeds resampled too), and the bracket: the measured M just within (<= B) and just beyond B, and
    `resolved` iff B is finite, no larger than the largest M measured (a knee found, not extrapolated), and the
    interval spans at most `factor` (hi / lo).
    Returns (B, [lo, hi], bracket)."""
    m_R, v_R, g_R = hinge_runs(rows, quality, x)
    try:
        boot = dose.budget_bootstrap(m_R, dose.run_scores(v_R, quality), g_R, quality, delta, n=n, seed=seed)
    except ValueError as e:  # too few runs or levels to fit: no budget, and the study says why
        return 0.0, [0.0, 0.0], {"within": None, "beyond": None, "ratio": math.inf, "factor": float(factor),
                                 "resolved": False, "method": "hinge", "why": f"no hinge fit: {e}"}
    b, (lo, hi) = boot["budget"], boot["ci"]
    ms = sorted({float(m) for m, g in zip(m_R, g_R) if g != "baseline"})
    within = max((m for m in ms if m <= b), default=None)
    beyond = min((m for m in ms if m > b), default=None)
    span = boot["span"]
    if not math.isfinite(b):
        why = "the fitted quality loss does not rise with M (no knee)"
    elif beyond is None:
        why = f"B = {b:.3g} lies beyond the largest M measured ({ms[-1]:.3g}): an extrapolation, not a knee"
    else:
        why = f"B's 95% interval spans x{span:.3g} {'<=' if span <= factor else '>'} {factor:g}"
    resolved = bool(math.isfinite(b) and beyond is not None and span <= factor)
    bracket = {"within": within, "beyond": beyond, "ratio": span, "factor": float(factor), "resolved": resolved,
               "method": "hinge", "why": why, "fit": boot["fit"], "unbounded_share": boot["unbounded_share"]}
    return float(b), [float(lo), float(hi)], bracket


def knee_bracket(points: Sequence[Mapping[str, Any]], budget: float, delta: float, factor: float,
                 method: str = "isotonic") -> dict[str, Any]:
    """The bracket around B: `within` = B (the largest M the fit keeps within delta), `beyond` = the smallest M
    of a point above B (the fit puts it beyond delta); `ratio` = beyond / within. `resolved` iff both exist and
    ratio <= factor; otherwise the sweep has not located the knee (an open or too wide bracket) and B is not
    reported as a budget.

    points: [{"m", "q_loss"}] as for `fit_budget`.
    """
    ms = sorted({float(p["m"]) for p in points if p.get("m") is not None and math.isfinite(p["m"])
                 and p.get("q_loss") is not None})
    beyond = next((m for m in ms if m > budget), None)
    within = budget if budget > 0 else None
    ratio = beyond / within if within and beyond is not None else math.inf
    resolved = bool(within is not None and beyond is not None and ratio <= factor)
    if within is None:
        why = "no point with M > 0 is within tolerance"
    elif beyond is None:
        why = "no point beyond tolerance: the knee is above the largest M measured"
    else:
        why = f"beyond/within = {ratio:.3g} {'<=' if resolved else '>'} {factor:g}"
    return {"within": within, "beyond": beyond, "ratio": ratio, "factor": float(factor), "resolved": resolved,
            "method": method, "why": why}
