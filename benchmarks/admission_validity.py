"""Admission-check validity: does the probe verdict agree with a full OPD run, and what does the probe cost?

For each candidate configuration NOT used to fit the budget, compare
    probe verdict     ADMIT / REJECT / UNCERTAIN from `opdjax.probe.probe` against B (UNCERTAIN = not admitted)
    full-run verdict  "should admit" iff the quality loss of a full OPD run at that configuration,
                      (final held-out reverse KL - baseline's) / baseline's, is <= delta
and report the agreement count (target >= 5 of 6) and the probe cost relative to one full run (one study point at
one seed; target < 5%).

    python benchmarks/admission_validity.py --budget runs/study/budget.json
    python benchmarks/admission_validity.py            # no study yet: fits a small budget on a weight-noise sweep

Uses the built-in demo models (`opdjax train` defaults). Writes <out>/validity.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from opdjax import admission  # noqa: E402
from opdjax.probe import probe  # noqa: E402

# Not study points: noise levels between typical sweep values, other staleness values, recipe combinations.
# Not study points (opdjax.budget defaults: weight noise 0.01/0.03/0.1/0.3, staleness 1/2, recipe fp8_w8a8): noise
# levels between the study's, another staleness, and other recipes.
DEFAULT_CANDIDATES = [
    "rollout.weight_noise=0.005",
    "rollout.weight_noise=0.015",
    "rollout.weight_noise=0.05",
    "rollout.stale_versions=3",
    "rollout.recipe=fp8_kv_only",
    "rollout.recipe=fp8_w8a8_channel",
    "rollout.weight_noise=0.02",
]
# Only when no budget.json is given: a minimal version of the study's weight-noise sweep (one seed).
FIT_SWEEP = ["rollout.weight_noise=0.01", "rollout.weight_noise=0.03"]


def full_run(overrides: list[str], out_dir: pathlib.Path, steps: int) -> dict:
    from opdjax import pipeline

    cfg = admission.candidate_config(None, [*overrides, f"pipeline.steps={steps}", "pipeline.eval_every=0",
                                            "pipeline.progress=false", "pipeline.tensorboard=false",
                                            f"pipeline.out_dir={out_dir}"])
    done = out_dir / "summary.json"
    if done.is_file() and (out_dir / "config.json").is_file():  # finished earlier with the same config: reuse
        from opdjax.config import to_dict

        if json.loads((out_dir / "config.json").read_text()) == json.loads(json.dumps(to_dict(cfg))):
            s = json.loads(done.read_text())
            return {"reverse_kl": s["final"]["eval/reverse_kl"], "accuracy": s["final"]["eval/accuracy"],
                    "seconds": s["seconds"]}
    t0 = time.time()
    s = pipeline.train(cfg, log=lambda m: None)
    return {"reverse_kl": s["final"]["eval/reverse_kl"], "accuracy": s["final"]["eval/accuracy"],
            "seconds": time.time() - t0}


def probe_one(overrides: list[str], batches: int, metric: str) -> dict:
    cfg = admission.candidate_config(None, [*overrides, "pipeline.progress=false", "pipeline.tensorboard=false"])
    r = probe(cfg, batches=batches, metric=metric, log=lambda m: None)
    return {"m": r.m, "ci_low": r.ci_low, "ci_high": r.ci_high, "seconds": r.seconds, "tokens": r.tokens}


def fit_budget(points: list[dict], delta: float) -> float:
    """Largest probe M such that every point with M at or below it stays within delta."""
    b = 0.0
    for p in sorted(points, key=lambda p: p["m"]):
        if p["loss"] > delta:
            break
        b = p["m"]
    return b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default=None, help="budget.json from `opdjax study` (else a small fit here)")
    ap.add_argument("--delta", type=float, default=None,
                    help="quality tolerance (default: budget.json's, or 0.25 as opdjax.budget)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--out", default="runs/admission_validity")
    ap.add_argument("candidates", nargs="*", default=None)
    args = ap.parse_args(argv)
    out = ROOT / args.out if not os.path.isabs(args.out) else pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    candidates = args.candidates or DEFAULT_CANDIDATES

    log = lambda m: print(m, flush=True)  # noqa: E731
    t_all = time.time()
    base = full_run([], out / "baseline", args.steps)
    log(f"baseline: reverse KL {base['reverse_kl']:.4f} ({base['seconds']:.1f}s)")
    fitted = None
    if args.budget:
        budget = admission.load_budget(args.budget)
        delta = args.delta if args.delta is not None else budget.delta
        if delta is None:
            raise SystemExit(f"{args.budget} has no 'delta'; pass --delta")
        B, metric, source = budget.budget, budget.metric, args.budget
    else:
        delta = args.delta if args.delta is not None else 0.25
        metric = "k3"
        points = []
        for c in FIT_SWEEP:
            ov = admission.split_candidate(c)
            p = probe_one(ov, args.batches, metric)
            f = full_run(ov, out / ("fit_" + c.replace("=", "_").replace(",", "_")), args.steps)
            p.update(f, candidate=c, loss=(f["reverse_kl"] - base["reverse_kl"]) / base["reverse_kl"])
            points.append(p)
            log(f"fit {c}: M {p['m']:.3e}, loss {p['loss']:+.3f} ({f['seconds']:.1f}s)")
        B = fit_budget(points, delta)
        source = f"fitted here on {len(FIT_SWEEP)} weight-noise points (1 seed), delta {delta}"
        fitted = {"points": points, "budget": B, "delta": delta, "metric": metric}
        (out / "budget_fitted.json").write_text(json.dumps(fitted, indent=2) + "\n")
    log(f"budget B = {B:.3e} ({metric}), delta = {delta} [{source}]")

    rows = []
    for c in candidates:
        ov = admission.split_candidate(c)
        p = probe_one(ov, args.batches, metric)
        f = full_run(ov, out / ("cand_" + c.replace("=", "_").replace(",", "_").replace("/", "_")), args.steps)
        loss = (f["reverse_kl"] - base["reverse_kl"]) / base["reverse_kl"]
        v = admission.verdict(p["ci_low"], p["ci_high"], B)
        should = loss <= delta
        row = {"candidate": c, **{f"probe_{k}": x for k, x in p.items()}, "verdict": v, "run_reverse_kl":
               f["reverse_kl"], "run_accuracy": f["accuracy"], "run_seconds": f["seconds"], "quality_loss": loss,
               "should_admit": should, "agree": (v == "ADMIT") == should}
        rows.append(row)
        log(f"{c}: M {p['m']:.3e} [{p['ci_low']:.3e}, {p['ci_high']:.3e}] {v}; loss {loss:+.3f} -> "
            f"{'admit' if should else 'reject'}; {'agree' if row['agree'] else 'DISAGREE'}")

    run_s = [base["seconds"]] + [r["run_seconds"] for r in rows]
    probe_s = [r["probe_seconds"] for r in rows]
    mean_run = sum(run_s) / len(run_s)
    ratio = (sum(probe_s) / len(probe_s)) / mean_run
    agree = sum(r["agree"] for r in rows)
    w = max(len(r["candidate"]) for r in rows)
    print()
    print(f"{'candidate':<{w}}  {'M (' + metric + ')':>10}  {'95% CI':>23}  {'probe':>9}  {'loss':>7}  "
          f"{'full run':>8}  agree  {'probe s':>7}")
    for r in rows:
        ci = f"[{r['probe_ci_low']:.2e}, {r['probe_ci_high']:.2e}]"
        print(f"{r['candidate']:<{w}}  {r['probe_m']:>10.3e}  {ci:>23}  {r['verdict']:>9}  {r['quality_loss']:>+7.3f}  "
              f"{'admit' if r['should_admit'] else 'reject':>8}  {'yes' if r['agree'] else 'NO':>5}  "
              f"{r['probe_seconds']:>7.1f}")
    print(f"budget B = {B:.3e}, delta = {delta} ({source}); baseline reverse KL {base['reverse_kl']:.4f}")
    print(f"agreement: {agree}/{len(rows)} (target >= 5/6)")
    print(f"probe cost: mean {sum(probe_s) / len(probe_s):.1f}s vs mean full run {mean_run:.1f}s "
          f"({args.steps} steps, one seed) = {100 * ratio:.1f}% (target < 5%)")
    rep = {"budget": B, "delta": delta, "metric": metric, "budget_source": source, "fitted": fitted,
           "baseline": base, "rows": rows, "agreement": agree, "n": len(rows), "probe_cost_ratio": ratio,
           "mean_probe_seconds": sum(probe_s) / len(probe_s), "mean_run_seconds": mean_run,
           "seconds": time.time() - t_all}
    (out / "validity.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(f"wrote {out / 'validity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
