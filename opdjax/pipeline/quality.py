"""Time-to-quality, steps-to-quality and the area under the quality-versus-time curve of one run's evaluations.

A run's evaluation curve is a list of rows `[step, reverse_kl, accuracy, train_seconds]` (`EVAL_ROW`), one per
held-out evaluation in order, the initial one first; `train_seconds` is the run's cumulative training wall clock at
that evaluation (`time/elapsed_train`: evaluation time excluded, continued across resumes).

Progress toward a reference quality q_ref from the initial quality q_0:  p(q) = (q - q_0) / (q_ref - q_0)  (0 at the
start, 1 at the reference, the same for lower-is-better reverse KL and higher-is-better accuracy). The threshold of
fraction f is the quality f of the way there; time-to-quality(f) and steps-to-quality(f) are the training seconds
and the step of the FIRST evaluation with p >= f (a later relapse does not undo it; the resolution is the
evaluation interval). AUC = (1/T) ∫ clip(p(t), 0, 1) dt by the trapezoid rule over the evaluations, T the training
seconds from the first evaluation to the last: in [0, 1], higher means the quality came sooner.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["EVAL_ROW", "FRACTIONS", "METRICS", "quality_figures", "to_quality"]

EVAL_ROW = ("step", "eval/reverse_kl", "eval/accuracy", "time/elapsed_train")
FRACTIONS = (0.5, 0.8, 0.9, 0.95)
METRICS = {"eval/reverse_kl": True, "eval/accuracy": False}  # metric -> lower is better


def _progress(q_N: np.ndarray, initial: float, reference: float) -> np.ndarray:
    """p = (q - q_0) / (q_ref - q_0) per evaluation, shape [N]; NaN where q is not finite."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(q_N), (q_N - initial) / (reference - initial), np.nan)


def _area(p_N: np.ndarray, t_N: np.ndarray) -> float | None:
    """(1/T) Σ_i (t_i - t_{i-1}) (c_i + c_{i-1}) / 2, c = clip(p, 0, 1) (NaN -> 0), T = t_{N-1} - t_0; None when
    T <= 0 (no training time between the evaluations)."""
    total = float(t_N[-1] - t_N[0]) if t_N.size else 0.0
    if not total > 0:
        return None
    c = np.clip(np.nan_to_num(p_N, nan=0.0), 0.0, 1.0)
    return float(np.sum(np.diff(t_N) * (c[1:] + c[:-1]) / 2) / total)


def to_quality(curve: Sequence[Sequence[float]], reference: float, *, lower_is_better: bool = True,
               fractions: Sequence[float] = FRACTIONS, reference_from: str = "own final") -> dict[str, Any]:
    """The figures of one metric: `curve` rows (step, train_seconds, quality), shape [N, 3], in evaluation order,
    the initial evaluation first; `reference` the quality that counts as the way's end.

    Returns {initial, reference, reference_from, train_seconds, thresholds: {"<f>": {quality, reached, step,
    seconds}}, auc}; `step`/`seconds` are None ("not reached") when no evaluation crosses. When the reference is no
    better than the initial quality (or either is not finite) no threshold is defined: every threshold says
    "undefined" and `auc` is None, with the reason in `why`."""
    a = np.asarray(curve, np.float64).reshape(-1, 3)
    steps, t_N, q_N = a[:, 0], a[:, 1], a[:, 2]
    initial = float(q_N[0]) if len(a) else math.nan
    gain = (initial - reference) if lower_is_better else (reference - initial)
    out: dict[str, Any] = {"initial": initial, "reference": float(reference), "reference_from": reference_from,
                           "train_seconds": float(t_N[-1]) if len(a) else 0.0}
    if not (math.isfinite(gain) and gain > 0):
        out["thresholds"] = {f"{f:g}": {"quality": None, "reached": "undefined", "step": None, "seconds": None}
                             for f in fractions}
        out["auc"], out["why"] = None, "the reference is not better than the initial quality"
        return out
    p_N = _progress(q_N, initial, reference)
    out["thresholds"] = {}
    for f in fractions:
        hit = np.flatnonzero(p_N >= f)
        i = int(hit[0]) if hit.size else None
        out["thresholds"][f"{f:g}"] = {"quality": initial + f * (reference - initial),
                                       "reached": "reached" if i is not None else "not reached",
                                       "step": int(steps[i]) if i is not None else None,
                                       "seconds": float(t_N[i]) if i is not None else None}
    out["auc"] = _area(p_N, t_N)
    return out


def quality_figures(eval_rows: Sequence[Sequence[float]], references: Mapping[str, float] | None = None, *,
                    reference_from: str = "own final") -> dict[str, dict[str, Any]]:
    """`to_quality` of each metric of `METRICS` from `EVAL_ROW` rows [N, 4]: metric -> figures. `references`
    (metric -> reference quality) defaults to the run's own final evaluation; accuracy is left out where the task
    grades nothing (a NaN initial or reference accuracy), and so is every metric when the rows lack training seconds
    (a NaN time)."""
    a = np.asarray(eval_rows, np.float64).reshape(-1, len(EVAL_ROW))
    if not len(a) or not np.all(np.isfinite(a[:, 3])):
        return {}
    out = {}
    for col, (metric, lower) in enumerate(METRICS.items(), start=1):
        ref = (references or {}).get(metric, a[-1, col])
        if metric == "eval/accuracy" and not (math.isfinite(a[0, col]) and math.isfinite(ref)):
            continue
        out[metric] = to_quality(a[:, [0, 3, col]], ref, lower_is_better=lower, reference_from=reference_from)
    return out
