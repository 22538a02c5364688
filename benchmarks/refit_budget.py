"""Refit a finished study's runs on another quality measure or tolerance, without rerunning anything.

    python benchmarks/refit_budget.py runs/budget_sort_cpu_llama/budget.json --quality accuracy --delta 0.05

Every run's probe M, final held-out reverse KL and accuracy are in budget.json (`points[].seeds`), so the study's
own fit (`opdjax.study.fit.hinge_fit`: the hinge dose-response over every run, B's interval from runs resampled
within every point, the baseline's too) can be redone on `--quality accuracy` (delta = an absolute accuracy drop)
or another `--delta`. Prints B, its 95% interval, the span and whether it is resolved.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from opdjax.study import fit


def refit(result: dict, quality: str, delta: float, factor: float = 3.0) -> dict:
    """B, its interval and bracket of the study `result` (budget.json) refitted on `quality` at `delta`."""
    rows = [r for r in result["points"] if r.get("group", "sweep") == "sweep"]
    budget, interval, bracket = fit.hinge_fit(rows, quality, delta, factor)
    return {"budget": budget, "interval": interval, "resolved": bracket["resolved"], "why": bracket["why"],
            "runs": sum(len(r["seeds"]) for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("budget", help="budget.json written by `opdjax study`")
    ap.add_argument("--quality", choices=fit.QUALITIES, default="accuracy")
    ap.add_argument("--delta", type=float, required=True, help="tolerance on that quality (accuracy: absolute drop)")
    ap.add_argument("--factor", type=float, default=3.0, help="largest span (high / low) of a resolved interval")
    args = ap.parse_args(argv)
    result = json.loads(pathlib.Path(args.budget).read_text())
    r = refit(result, args.quality, args.delta, args.factor)
    lo, hi = r["interval"]
    print(f"{args.budget}: {args.quality} delta {args.delta:g}, {r['runs']} runs: B = {r['budget']:.3g} "
          f"[{lo:.3g}, {hi:.3g}] ({'resolved' if r['resolved'] else 'UNRESOLVED'}: {r['why']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
