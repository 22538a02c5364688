"""Which dose-response fit predicts: hinge, isotonic and logistic-in-log-M, by leave-one-level-out error.

    python benchmarks/fit_heldout.py docs/results/budget_sort_cpu/budget.json [more budget.json ...] [--json OUT]

Every run of a study's sweep is a point (x = ln of its probed M, y = its score `dose.run_scores`: ln(reverse KL +
0.1), larger is worse). For each mismatch level L in turn, each model is fitted to every OTHER run (the baseline's
included) and predicts L's mean score at L's mean x; the error is prediction - observed mean. Models:

    hinge     y = a + b max(0, x - k), b >= 0 (`dose.fit_hinge`, the study's fit)
    isotonic  non-decreasing step function of the level means (pool adjacent violators, weighted by runs),
              interpolated linearly in x between fitted levels, flat beyond the ends
    logistic  y = a + c / (1 + exp(-(x - k) / s)), c >= 0, s > 0 (least squares over runs)

The first and last levels are extrapolations for every model; the table reports them apart from the interior
levels. The observed mean's own noise (1.96 standard errors over its seeds) is printed beside, since no model can
predict a level better than its seeds measure it.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import numpy as np
from scipy import optimize

from opdjax.study import dose, fit

MODELS = ("hinge", "isotonic", "logistic")


def runs_of(budget: dict, quality: str = "reverse_kl") -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x_R = ln M, y_R scores, group_R) of every run of the study's calibration rows (`fit.calibration_rows`: the
    baseline and the weight-noise levels) with a probed M."""
    key = "reverse_kl" if quality == "reverse_kl" else "accuracy"
    sweep = fit.calibration_rows([p for p in budget["points"] if p.get("group", "sweep") == "sweep"])
    rows = [(s["m_probe"], s[key], "baseline" if p["knob"] == "baseline" else p["id"])
            for p in sweep for s in p["seeds"] if s.get("m_probe") is not None]
    m, v, g = zip(*rows)
    return dose.log_dose(m, g), dose.run_scores(v, quality), list(g)


def _isotonic(x_L: np.ndarray, y_L: np.ndarray, w_L: np.ndarray) -> np.ndarray:
    """Weighted pool-adjacent-violators fit of y_L (sorted by x_L), shape [L]."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for y, w in zip(y_L, w_L):
        blocks.append([y * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, ww, c = blocks.pop()
            blocks[-1] = [blocks[-1][0] + s, blocks[-1][1] + ww, blocks[-1][2] + c]
    return np.concatenate([np.full(int(c), s / w) for s, w, c in blocks])


def predict(model: str, x: np.ndarray, y: np.ndarray, g: list[str], x_new: float) -> float:
    """The model fitted to runs (x, y, groups g) evaluated at x_new."""
    if model == "hinge":
        f = dose.fit_hinge(x, y)
        return f["a"] + f["b"] * max(0.0, x_new - f["k"])
    groups = sorted(set(g), key=lambda k: np.mean(x[np.asarray(g) == k]))
    xs = np.array([x[np.asarray(g) == k].mean() for k in groups])
    if model == "isotonic":
        ys = np.array([y[np.asarray(g) == k].mean() for k in groups])
        ws = np.array([(np.asarray(g) == k).sum() for k in groups], float)
        return float(np.interp(x_new, xs, _isotonic(xs, ys, ws)))
    return _logistic(x, y, xs)(x_new)


def _logistic(x: np.ndarray, y: np.ndarray, level_x: np.ndarray):
    """Least-squares a + c sigmoid((x - k) / s), c >= 0, s > 0 (s and c as exp of free parameters)."""
    base = y[x <= level_x.min() + 1e-9]
    a0, c0 = float(base.mean()), max(float(y.max() - base.mean()), 1e-3)
    f = lambda p, xx: p[0] + math.exp(p[1]) / (1 + np.exp(-(xx - p[2]) / math.exp(p[3])))  # noqa: E731
    best = None
    with np.errstate(over="ignore"):  # exp(-(x - k) / s) -> inf is the sigmoid's 0, as intended
        for k0 in np.unique(level_x)[1:]:  # several starts: the loss is not convex in k
            r = optimize.least_squares(lambda p: f(p, x) - y, [a0, math.log(c0), k0, 0.0], method="lm")
            if best is None or r.cost < best.cost:
                best = r
    def fitted(xx: float) -> float:
        with np.errstate(over="ignore"):
            return float(f(best.x, xx))
    return fitted


def heldout(budget: dict, quality: str = "reverse_kl") -> list[dict]:
    """Per non-baseline level: its mean x and score, the seeds' noise (1.96 SE), each model's prediction."""
    x, y, g = runs_of(budget, quality)
    ga = np.asarray(g)
    levels = sorted({k for k in g if k != "baseline"}, key=lambda k: x[ga == k].mean())
    out = []
    for i, lev in enumerate(levels):
        keep, held = ga != lev, ga == lev
        row = {"level": lev, "x": float(x[held].mean()), "m": float(math.exp(x[held].mean())),
               "observed": float(y[held].mean()), "noise": float(1.96 * y[held].std(ddof=1) / math.sqrt(held.sum())),
               "extrapolation": i in (0, len(levels) - 1)}
        for model in MODELS:
            row[model] = predict(model, x[keep], y[keep], list(ga[keep]), row["x"])
        out.append(row)
    return out


def _rmse(rows: list[dict], model: str) -> float:
    e = [r[model] - r["observed"] for r in rows]
    return float(np.sqrt(np.mean(np.square(e)))) if e else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("budgets", nargs="+")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    allrows = []
    for path in args.budgets:
        rows = heldout(json.loads(pathlib.Path(path).read_text()))
        print(f"\n{path}\n{'level':>18} {'M':>8} {'observed':>9} {'±noise':>7} " + " ".join(f"{m:>9}" for m in MODELS))
        for r in rows:
            print(f"{r['level']:>18} {r['m']:8.3g} {r['observed']:9.3f} {r['noise']:7.3f} "
                  + " ".join(f"{r[m]:9.3f}" for m in MODELS) + ("  (extrapolation)" if r["extrapolation"] else ""))
        allrows += [{**r, "study": path} for r in rows]
    inner = [r for r in allrows if not r["extrapolation"]]
    print("\nRMSE of held-out predictions (score units, ln(RKL + 0.1)):")
    for name, rows in (("interior levels", inner), ("every level", allrows)):
        print(f"  {name} ({len(rows)}): " + ", ".join(f"{m} {_rmse(rows, m):.3f}" for m in MODELS)
              + f"; mean seed noise {np.mean([r['noise'] for r in rows]):.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": allrows, "rmse": {
            m: {"interior": _rmse(inner, m), "all": _rmse(allrows, m)} for m in MODELS}}, indent=1))


if __name__ == "__main__":
    main()
