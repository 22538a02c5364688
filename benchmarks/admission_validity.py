"""Admission-check validity: does the probe verdict agree with full OPD runs, and what does the probe cost?

For each candidate configuration NOT used to fit the budget (none is a point of the study, searched levels
included), compare
    probe verdict     `opdjax admit`'s ADMIT / REJECT / UNCERTAIN against the study's B (the sequential probe at
                      --risk; UNCERTAIN = not admitted)
    full-run verdict  the candidate trained exactly as the study trains its points (same train config, every study
                      seed, >= 4 for a verdict worth scoring): the quality loss per seed against the study's
                      baseline, its mean and 95% bootstrap CI over seeds: "admit" if the CI is within delta,
                      "reject" if beyond, "borderline" if it contains delta (the seeds do not decide; reported apart,
                      neither agreement nor disagreement)
and report: agreement over the decided (non-borderline) candidates (target >= 90%), false ADMITs (probe ADMIT,
runs reject; target 0), UNCERTAIN among the decided (target <= 2), and the probe cost per candidate against one
study point (all its seeds, probe + training; target < 5%), cold (a fresh process and an empty compilation cache)
and warm (the same command again).

    opdjax study --config configs/budget_cpu.yaml           # writes runs/budget_cpu/budget.json
    python benchmarks/admission_validity.py --budget runs/budget_cpu/budget.json --seeds 8

Candidate runs live next to the study's (results/cand__*, runs/cand__*) and resume per (candidate, seed) like the
study's. Writes validity.json into the study directory and re-renders its summary.md, which then carries the
validity table (so does every later `opdjax study` of that directory).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from opdjax.admission import admit  # noqa: E402
from opdjax.admission.budget import load_budget  # noqa: E402
from opdjax.config import to_dict  # noqa: E402
from opdjax.study import dose, fit, report  # noqa: E402
from opdjax.study.fit import trivial_scores  # noqa: E402,F401  (re-exported: the do-nothing rules' scores)
from opdjax.study import study as study_mod  # noqa: E402
from opdjax.study.records import Point, noise_point  # noqa: E402
from opdjax.study.study_config import load_study  # noqa: E402

# Candidates, none a level of configs/budget_cpu.yaml (its sweep is the baseline plus the weight-noise levels the
# knee search picks; a candidate that coincides with a searched level is refused below). Ten fixed ones: every
# other knob than the one B was fitted on (recipes, staleness, a combination), to test the claim that M is one
# scale for all of them; where they fall relative to B depends on the pair. Plus three or four weight-noise levels
# placed from the study's own knee (`knee_candidates`), so that every pair gets candidates below, near and above
# B, and at >= 3 B where a searched level reached it (the report says how many candidates probe <= B/3, >= 3 B).
FIXED_CANDIDATES = [
    "rollout.recipe=int8_w8a8",
    "rollout.recipe=fp8_weights_only",
    "rollout.recipe=fp8_block128",
    "rollout.recipe=fp8_w8a8_channel",
    "rollout.recipe=fp8_w8a8",
    "rollout.recipe=fp8_w8a8_kv",
    "rollout.recipe=fp8_kv_only",
    "rollout.recipe=e5m2_w8a8",
    "rollout.stale_versions=1",
    "rollout.recipe=fp8_kv_only,rollout.stale_versions=1",
]


def knee_candidates(bj: dict, study) -> list[str]:
    """The three weight-noise candidates placed from the study's knee (`study.knee_candidates`), of the study's
    noise kind (its base rollout.noise_mode, spelled out when it is not the default)."""
    mode = study.train_config_for({}, study.seeds[0]).rollout.noise_mode
    kind = "" if mode == "fixed" else f",rollout.noise_mode={mode}"
    return [f"rollout.weight_noise={s:g}{kind}" for s in study_mod.knee_candidates(bj["points"], bj["budget"])]


def candidate_point(text: str) -> Point:
    """The candidate as a study point (group "validation"), trained with the study's own machinery."""
    from opdjax.config import deep_update, parse_override

    nested: dict = {}
    for item in admit.split_candidate(text):
        deep_update(nested, parse_override(item))
    return Point("validation", "candidate", text.replace("rollout.", "").replace(",", "+"), nested,
                            probe=False, label="cand")


def timed_admit(budget_path: str, candidates: list[str], risk: float, max_batches: int | None,
                cache: pathlib.Path, out: pathlib.Path, seed: int = 0) -> tuple[float, list[dict]]:
    """`opdjax admit` in a fresh process with the compilation cache at `cache`: (wall seconds, its rows). It probes
    on the setup the budget recorded (the study's baseline train config), as a user's `opdjax admit` does."""
    cmd = [sys.executable, "-c", "import sys; from opdjax.cli import main; sys.exit(main())", "admit",
           "--budget", budget_path, "--risk", str(risk), "--out", str(out), "--seed", str(seed)]
    cmd += ["--max-batches", str(max_batches)] if max_batches else []
    t0 = time.time()
    rc = subprocess.run(cmd + candidates, env={**os.environ, "OPDJAX_JAX_CACHE": str(cache)}).returncode
    wall = time.time() - t0
    if rc not in (0, 1):
        raise SystemExit(f"opdjax admit failed (exit {rc})")
    return wall, json.loads(out.read_text())["candidates"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", required=True, help="budget.json written by `opdjax study`")
    ap.add_argument("--risk", type=float, default=0.05, help="the sequential probe's risk (as `opdjax admit`)")
    ap.add_argument("--max-batches", type=int, default=None,
                    help="the sequential probe's cap (as `opdjax admit`; default: its default)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per full run (default: the study's); more than the study's adds seeds after its "
                         "largest, narrowing each verdict's CI (the study's own runs are reused)")
    ap.add_argument("--truth-seeds", default=None,
                    help="seeds of the full runs, disjoint from the study's (e.g. 100-103): each candidate's truth "
                         "then shares no seed, and no noise direction, with any study point")
    ap.add_argument("--probe-seed", type=int, default=0, help="the probe's seed (as `opdjax admit --seed`)")
    ap.add_argument("--out", default=None, help="folder for validity.json (default: the budget's)")
    ap.add_argument("candidates", nargs="*", default=None)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    load_budget(args.budget)  # refuses an UNRESOLVED study before anything runs
    bj = json.loads(pathlib.Path(args.budget).read_text())
    study = load_study(pathlib.Path(args.budget).parent / "study_config.yaml")
    baseline = bj["baseline"]
    candidates = args.candidates or FIXED_CANDIDATES + knee_candidates(bj, study)
    log(f"{len(candidates)} candidates: {', '.join(candidates)}")
    points = [candidate_point(c) for c in candidates]
    fitted = [_resolved(study, p.overrides) for p in study_mod.sweep_points(study)]
    fitted += [_resolved(study, noise_point(r["value"]).overrides) for r in bj["points"]
               if r["knob"] == "weight_noise"]
    for c, p in zip(candidates, points):
        if _resolved(study, p.overrides) in fitted:
            raise SystemExit(f"candidate {c} is a point of the study; validity needs configurations not used to fit")
    seeds = disjoint_seeds(args.truth_seeds, study) if args.truth_seeds else truth_seeds(study.seeds, args.seeds)
    if len(seeds) < 4:
        log(f"warning: {len(seeds)} seeds per full run; full-run verdicts from fewer than 4 are coin flips")

    # 1. The probe verdicts, exactly as `opdjax admit --budget ... CANDIDATES` computes them: cold, then warm.
    out = pathlib.Path(args.out or pathlib.Path(args.budget).parent)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cold, _ = timed_admit(args.budget, candidates, args.risk, args.max_batches, pathlib.Path(tmp) / "jax",
                              pathlib.Path(tmp) / "cold.json", args.probe_seed)
        warm, admit_rows = timed_admit(args.budget, candidates, args.risk, args.max_batches,
                                       pathlib.Path(tmp) / "jax", pathlib.Path(tmp) / "warm.json", args.probe_seed)
    log(f"admit: {cold:.1f} s cold, {warm:.1f} s warm for {len(candidates)} candidates")
    # 2. The full-run verdicts: as the study trains its points, on its seeds (and more with --seeds).
    rows = []
    for c, p, a in zip(candidates, points, admit_rows):
        recs = []
        for s in seeds:
            rec = study_mod.run_one(study, p, s, log)
            recs.append(rec)
            log(f"{c} seed {s}: RKL {rec.reverse_kl:.3f}, acc {rec.accuracy:.3f}"
                f"{' (reused)' if rec.reused else ''}")
        losses = fit.quality_losses(recs, baseline, study.quality)
        q, ci = fit.point_effect(recs, baseline, study.quality)  # the baseline's seeds resampled too
        runs = fit.runs_verdict(ci, bj["delta"])
        rows.append({"candidate": c, "m": a["m"], "ci": [a["ci_low"], a["ci_high"]], "verdict": a["verdict"],
                     "batches": a["batches"], "reason": a["reason"], "probe_seconds": a["seconds"],
                     "budget_kind": a.get("budget_kind"), "budget_interval": a.get("budget_interval"),
                     "reverse_kl_seeds": [r.reverse_kl for r in recs], "accuracy_seeds": [r.accuracy for r in recs],
                     "q_loss": q, "q_loss_seeds": losses, "q_loss_ci": list(ci), "runs_verdict": runs,
                     "m_train": fit.finite_mean(r.m_train_k3 for r in recs),
                     "should_admit": runs == "admit",
                     "agree": fit.probe_agrees(a["verdict"], runs),
                     "seeds_straddle_delta": fit.straddles(losses, bj["delta"]), "kind": kind_of(c),
                     **harshness(bj, a["m"], q, ci, study.quality)})

    decided = [r for r in rows if r["runs_verdict"] != "borderline"]
    point_s = [p["seconds"] for p in bj["points"]]
    mean_point = sum(point_s) / len(point_s)
    rep = {"budget": bj["budget"], "metric": bj["metric"], "delta": bj["delta"], "budget_file": args.budget,
           "budget_interval": bj.get("budget_interval"), "bracket": bj.get("bracket"), "risk": args.risk,
           "baseline_reverse_kl": baseline["reverse_kl"], "seeds": seeds, "study_seeds": list(study.seeds),
           "rows": rows,
           "n": len(rows), **fit.validity_scores(rows),
           "borderline": [r["candidate"] for r in rows if r["runs_verdict"] == "borderline"],
           "uncertain_decided": [r["candidate"] for r in decided if r["verdict"] == "UNCERTAIN"],
           "admit_wall_seconds": warm, "admit_wall_seconds_cold": cold,
           "probe_seconds_per_candidate": warm / len(candidates),
           "probe_seconds_per_candidate_cold": cold / len(candidates),
           "max_probe_seconds": max(r["probe_seconds"] for r in rows),
           "mean_study_point_seconds": mean_point, "probe_cost_ratio": warm / len(candidates) / mean_point,
           "probe_cost_ratio_cold": cold / len(candidates) / mean_point,
           "probe_seed": args.probe_seed, "truth_seeds_disjoint": bool(args.truth_seeds),
           **m_coverage(rows, bj["budget"])}
    (out / "validity.json").write_text(json.dumps(rep, indent=2) + "\n")
    bj["validity"] = rep
    (out / "summary.md").write_text(report.summary_markdown(bj))
    print()
    print(report.validity_markdown(rep))
    print(f"always ADMIT scores {rep['always_admit']}/{len(decided)}, always REJECT {rep['always_reject']}/"
          f"{len(decided)} on the same decided candidates")
    for r in rows:
        print(f"  {r['kind']:12s} {r['candidate']:55s} M {r['m']:.3g}  q_loss {r['q_loss']:+.2f} "
              f"[{r['q_loss_ci'][0]:+.2f}, {r['q_loss_ci'][1]:+.2f}]  harshness {r['harshness']:.3g} "
              f"[{r['harshness_ci'][0]:.3g}, {r['harshness_ci'][1]:.3g}]")
    print(f"{len(rep['below_b_over_3'])} candidate(s) probe at <= B/3, {len(rep['above_3b'])} at >= 3 B "
          f"(largest M {rep['max_m']:.3g} = {rep['max_m'] / bj['budget']:.2f} B)")
    print(f"wrote {out / 'validity.json'}; {out / 'summary.md'} now has the table")
    return 0


def kind_of(candidate: str) -> str:
    """The candidate's kind of mismatch, from `admit.candidate_knobs` (the kinds `admit` judges by): "combination"
    when it sets two, weight noise as "noise" ("noise:<mode>" for another noise_mode), a W4A16 recipe as "4-bit"."""
    parts = admit.split_candidate(candidate)
    knobs = admit.candidate_knobs(parts)
    if len(knobs) > 1:
        return "combination"
    (knob,) = knobs
    if knob == "recipe" and any("w4a16" in p for p in parts):
        return "4-bit"
    return {"weight_noise": "noise"}.get(knob, knob)


def harshness(bj: dict, m: float, q: float, ci, quality: str) -> dict:
    """How much harm this candidate does per unit of M against the calibration knob: h = M_eq / M, where M_eq is
    the calibration knob's M at which the study's hinge fit predicts the candidate's observed loss q
    (`dose.budget_from_fit` with delta = q; q <= 0 gives the knee). h > 1: harsher than the knob B was fitted on
    (its budget should be B / h); its interval from q's CI (the candidate's and the baseline's seeds), from 0 when
    that CI admits no loss at all. Below the knee every loss maps to the knee, so h there is an upper bound."""
    f = bj["bracket"].get("fit")
    if not f or not m > 0:
        return {"harshness": float("nan"), "harshness_ci": [float("nan")] * 2}
    eq = lambda qq: dose.budget_from_fit(f, quality, max(float(qq), 0.0)) / m  # noqa: E731
    return {"harshness": eq(q), "harshness_ci": [0.0 if ci[0] <= 0 else eq(ci[0]), eq(ci[1])]}


def disjoint_seeds(text: str, study) -> list[int]:
    """Seeds "a-b" or "a,b,c", refused when any is a seed of the study (its levels' or its baseline's)."""
    seeds = (list(range(int(text.split("-")[0]), int(text.split("-")[1]) + 1)) if "-" in text
             else [int(x) for x in text.split(",")])
    used = set(study.seeds) | set(study.baseline_seeds or ())
    if used & set(seeds):
        raise SystemExit(f"--truth-seeds {text}: seeds {sorted(used & set(seeds))} are the study's; truth runs "
                         f"need seeds it did not use (its seeds: {sorted(used)})")
    return seeds


def m_coverage(rows: list[dict], budget: float) -> dict:
    """Where the candidates' probe M fall against B: those at <= B/3 and >= 3 B, and the largest M."""
    return {"below_b_over_3": [r["candidate"] for r in rows if r["m"] <= budget / 3],
            "above_3b": [r["candidate"] for r in rows if r["m"] >= 3 * budget],
            "max_m": max(r["m"] for r in rows)}


def truth_seeds(study_seeds, n: int | None) -> list[int]:
    """The seeds of each candidate's full runs: the study's, then (n > their count) the next integers after its
    largest. n smaller than the study's count takes its first n."""
    seeds = list(study_seeds)
    if n is None:
        return seeds
    if n < 1:
        raise SystemExit(f"--seeds must be >= 1, got {n}")
    return seeds[:n] + list(range(max(seeds) + 1, max(seeds) + 1 + max(n - len(seeds), 0)))


def _resolved(study, overrides) -> dict:
    """The run a point with `overrides` trains (first seed), as a dict: equal dicts, same runs."""
    return study_mod.run_identity(to_dict(study.train_config_for(overrides, study.seeds[0])))


if __name__ == "__main__":
    sys.exit(main())
