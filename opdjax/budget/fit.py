"""Fitting the budget: per-seed quality losses, the isotonic (or first-failure) fit of B, and one point's
aggregate over seeds.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from opdjax.budget.records import Point, RunResult

__all__ = ["FITS", "QUALITIES", "aggregate", "fit_budget", "monotone_q_loss", "quality_losses", "straddles"]


QUALITIES = ("reverse_kl", "accuracy")


FITS = ("isotonic", "first_failure")


def _field(r: RunResult | Mapping[str, Any], key: str) -> Any:
    return r[key] if isinstance(r, Mapping) else getattr(r, key)


def quality_losses(records: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> list[float]:
    """Per-seed quality loss against the baseline means (NaN/inf final quality -> +inf loss).

    reverse_kl: (rkl - rkl_base) / rkl_base;  accuracy: acc_base - acc.
    """
    out = []
    for r in records:
        if quality == "reverse_kl":
            x, base = _field(r, "reverse_kl"), baseline["reverse_kl"]
            q = (x - base) / max(abs(base), 1e-9)
        else:
            x, base = _field(r, "accuracy"), baseline["accuracy"]
            q = base - x
        out.append(float(q) if x is not None and math.isfinite(x) else math.inf)
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


def _finite_mean(xs) -> float:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.mean(xs)) if xs else float("nan")


def aggregate(point: Point, recs: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> dict[str, Any]:
    """One row of budget.json's `points`: means over seeds, CI union, per-seed values and spread."""
    losses = quality_losses(recs, baseline, quality)
    probes = [r.m_probe for r in recs if r.m_probe is not None]
    row = {
        "id": point.id, "group": point.group, "knob": point.knob, "value": point.value, "label": point.label,
        "m_probe": float(np.mean(probes)) if probes else None,
        "m_probe_ci": ([float(min(r.m_probe_ci[0] for r in recs)), float(max(r.m_probe_ci[1] for r in recs))]
                       if probes else None),
        "m_train": _finite_mean(r.m_train_k3 for r in recs),
        "m_train_k1": _finite_mean(r.m_train_k1 for r in recs),
        "m_train_abs_log_ratio_p95": _finite_mean(r.m_train_abs_log_ratio_p95 for r in recs),
        "q_reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
        "q_accuracy": float(np.mean([r.accuracy for r in recs])),
        "q_loss": float(np.mean(losses)),
        "q_loss_spread": _spread(losses),
        "seeds": [{"seed": r.seed, "m_probe": r.m_probe, "m_train": r.m_train_k3,
                   "reverse_kl": r.reverse_kl, "accuracy": r.accuracy, "q_loss": q,
                   "nonfinite_steps": r.nonfinite_steps, **({"reward_last": r.reward_last}
                                                               if r.reward_last is not None else {})}
                  for r, q in zip(recs, losses)],
        "seconds": float(sum(r.probe_seconds + r.train_seconds for r in recs)),
    }
    return row


def straddles(q_loss_seeds: Sequence[float], delta: float) -> bool:
    """True when some seeds' quality loss is within delta and others beyond it (a seed-decided full-run verdict)."""
    within = [q <= delta for q in q_loss_seeds]
    return any(within) and not all(within)
