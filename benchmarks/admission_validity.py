"""Admission-check validity: does the probe verdict agree with full OPD runs, and what does the probe cost?

For each candidate configuration NOT used to fit the budget (none is a point of the study), compare
    probe verdict     `opdjax admit`'s ADMIT / REJECT / UNCERTAIN against the study's B (UNCERTAIN = not admitted)
    full-run verdict  "should admit" iff the candidate's quality loss, measured exactly as the study measures its
                      points (same train config and seeds, mean over seeds of (RKL - RKL_base) / RKL_base with the
                      study's baseline), is <= the study's delta
and report the agreement count (target >= 5 of 6) and the probe cost: admit's seconds per candidate against the
time of one full study point (all its seeds, probe + training; target < 5%).

    opdjax study --config configs/study_cpu.yaml            # writes runs/study_cpu/budget.json
    python benchmarks/admission_validity.py --budget runs/study_cpu/budget.json

Candidate runs live next to the study's (results/cand__*, runs/cand__*) and resume per (candidate, seed) like the
study's. Writes validity.json into the study directory and re-renders its summary.md, which then carries the
validity table (so does every later `opdjax study` of that directory).
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

from opdjax.budget import admit, fit, report  # noqa: E402
from opdjax.budget import study as budget_mod  # noqa: E402
from opdjax.budget.io import load_budget  # noqa: E402
from opdjax.budget.records import Point  # noqa: E402

# None of these is a point of configs/study_cpu.yaml (weight noise 0.01/0.03/0.05, staleness 2, recipes
# fp8_weights_only, fp8_w8a8, fp8_w8a8_kv, e5m2_w8a8): every other shipped FP8/INT8 recipe (static per-tensor
# activations, per-channel weights, 128-blocks, INT8 W8A8, the FP8 KV cache alone), noise levels between and beyond
# the study's, and other staleness values. Fixed before any of their full runs was looked at (the list predates the
# study config's lr 3e-4 / 250 steps, which changed every full run).
DEFAULT_CANDIDATES = [
    "rollout.weight_noise=0.006",
    "rollout.weight_noise=0.04",
    "rollout.stale_versions=1",
    "rollout.stale_versions=4",
    "rollout.recipe=fp8_w8a8_tensor",
    "rollout.recipe=fp8_w8a8_channel",
    "rollout.recipe=fp8_block128",
    "rollout.recipe=int8_w8a8",
    "rollout.recipe=fp8_kv_only",
]


def candidate_point(text: str) -> Point:
    """The candidate as a study point (group "validation"), trained with the study's own machinery."""
    from opdjax.config import _deep_update, parse_override

    nested: dict = {}
    for item in admit.split_candidate(text):
        _deep_update(nested, parse_override(item))
    return Point("validation", "candidate", text.replace("rollout.", "").replace(",", "+"), nested,
                            probe=False, label="cand")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", required=True, help="budget.json written by `opdjax study`")
    ap.add_argument("--risk", type=float, default=0.05, help="the sequential probe's risk (as `opdjax admit`)")
    ap.add_argument("--max-batches", type=int, default=None,
                    help="the sequential probe's cap (as `opdjax admit`; default: its default)")
    ap.add_argument("candidates", nargs="*", default=None)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    budget = load_budget(args.budget)
    bj = json.loads(pathlib.Path(args.budget).read_text())
    study = budget_mod.load_study(pathlib.Path(args.budget).parent / "study_config.yaml")
    baseline = bj["baseline"]
    candidates = args.candidates or DEFAULT_CANDIDATES
    points = [candidate_point(c) for c in candidates]
    fitted = [dict(p.overrides) for p in budget_mod.sweep_points(study)]
    for c, p in zip(candidates, points):
        if json.loads(json.dumps(p.overrides)) in json.loads(json.dumps(fitted)):
            raise SystemExit(f"candidate {c} is a point of the study; validity needs configurations not used to fit")

    # 1. The probe verdicts, exactly as `opdjax admit --budget ... CANDIDATES` computes them (one process).
    t0 = time.time()
    admit_rows = admit.admit(candidates, budget, overrides=_base_overrides(study), risk=args.risk,
                             max_batches=args.max_batches, log=log)
    admit_wall = time.time() - t0
    # 2. The full-run verdicts: every study seed, as the study trains its points.
    rows = []
    for c, p, a in zip(candidates, points, admit_rows):
        recs = []
        for s in study.seeds:
            rec = budget_mod.run_one(study, p, s, log)
            recs.append(rec)
            log(f"{c} seed {s}: RKL {rec.reverse_kl:.3f}, acc {rec.accuracy:.3f}"
                f"{' (reused)' if rec.reused else ''}")
        losses = fit.quality_losses(recs, baseline, study.quality)
        q = float(sum(losses) / len(losses))
        should = q <= bj["delta"]
        rows.append({"candidate": c, "m": a.m, "ci": [a.ci_low, a.ci_high], "verdict": a.verdict,
                     "batches": a.batches, "reason": a.reason,
                     "probe_seconds": a.seconds, "reverse_kl_seeds": [r.reverse_kl for r in recs],
                     "accuracy_seeds": [r.accuracy for r in recs], "q_loss": q, "q_loss_seeds": losses,
                     "m_train": fit._finite_mean(r.m_train_k3 for r in recs),
                     "should_admit": should, "agree": (a.verdict == "ADMIT") == should,
                     "seeds_straddle_delta": fit.straddles(losses, bj["delta"])})

    point_s = [p["seconds"] for p in bj["points"]]
    mean_point = sum(point_s) / len(point_s)
    per_cand = admit_wall / len(candidates)
    rep = {"budget": budget.budget, "metric": budget.metric, "delta": bj["delta"], "budget_file": args.budget,
           "baseline_reverse_kl": baseline["reverse_kl"], "seeds": list(study.seeds), "rows": rows,
           "agreement": sum(r["agree"] for r in rows), "n": len(rows),
           "admit_wall_seconds": admit_wall, "probe_seconds_per_candidate": per_cand,
           "max_probe_seconds": max(r["probe_seconds"] for r in rows),
           "mean_study_point_seconds": mean_point, "probe_cost_ratio": per_cand / mean_point}
    out = pathlib.Path(args.budget).parent
    (out / "validity.json").write_text(json.dumps(rep, indent=2) + "\n")
    bj["validity"] = rep
    (out / "summary.md").write_text(report.summary_markdown(bj))
    print()
    print(report.validity_markdown(rep))
    print(f"wrote {out / 'validity.json'}; {out / 'summary.md'} now has the table")
    return 0


def _base_overrides(study) -> list[str]:
    """The study's base TrainConfig overrides as key=value strings (the probe sees the study's config)."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("options", "vllm", "correction_options"):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}={json.dumps(v)}"
    return list(flat(study.base))


if __name__ == "__main__":
    sys.exit(main())
