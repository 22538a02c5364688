"""A validity run's truth against a baseline trained on the truth's own seeds.

    python benchmarks/validity_truth_baseline.py --study runs/scale/sort16_qwen3 \
        --validity docs/results/budget_scaling/sort16_qwen3/validity.json --seeds 100 101 102 103

`admission_validity.py --truth-seeds` trains each candidate on seeds disjoint from the study's and measures its
quality loss against the study's baseline seeds, so seeds that run worse (or better) regardless of mismatch shift
every truth row. This trains the mismatch-free baseline on the truth seeds (`opdjax.study.run_one`, reused when
the study's folder has it), then recomputes every row's q_loss, its CI and the runs' verdict against it
(`fit.point_effect`, `fit.runs_verdict`, as the study does), the probe's agreement and the do-nothing rules' scores
(`fit.validity_scores`, as admission_validity.py scores its own).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from opdjax.study import fit
from opdjax.study import study as study_mod
from opdjax.study.study_config import load_study


def truth_baseline(study_dir: pathlib.Path, seeds: list[int]) -> dict:
    """`fit.baseline_stats` of the study's baseline point trained on `seeds`."""
    study = load_study(study_dir / "study_config.yaml")
    base = study_mod.sweep_points(study)[0]
    recs = [study_mod.run_one(study, base, s, lambda m: print(m, flush=True)) for s in seeds]
    return fit.baseline_stats({k: [getattr(r, k) for r in recs] for k in ("reverse_kl", "accuracy")})


def rejudge(rows: list[dict], baseline: dict, delta: float, quality: str = "reverse_kl") -> list[dict]:
    """Each validity row's q_loss [CI], runs' verdict and agreement with its probe verdict against `baseline`."""
    key = "reverse_kl" if quality == "reverse_kl" else "accuracy"
    out = []
    for r in rows:
        q, ci = fit.point_effect([{key: x} for x in r[f"{key}_seeds"]], baseline, quality)
        runs = fit.runs_verdict(ci, delta)
        out.append({"candidate": r["candidate"], "verdict": r["verdict"], "q_loss": q, "q_loss_ci": ci,
                    "runs_verdict": runs, "agree": fit.probe_agrees(r["verdict"], runs),
                    "q_loss_study_baseline": r["q_loss"], "runs_verdict_study_baseline": r["runs_verdict"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, help="the study's folder (study_config.yaml, budget.json)")
    ap.add_argument("--validity", required=True, help="validity.json written by admission_validity.py")
    ap.add_argument("--seeds", type=int, nargs="+", required=True, help="the truth runs' seeds")
    ap.add_argument("--json", default=None, help="where to write the rejudged rows")
    args = ap.parse_args(argv)
    v = json.loads(pathlib.Path(args.validity).read_text())
    if sorted(v["seeds"]) != sorted(args.seeds):
        raise SystemExit(f"--seeds {args.seeds} are not the validity run's truth seeds {v['seeds']}")
    bj = json.loads((pathlib.Path(args.study) / "budget.json").read_text())
    base = truth_baseline(pathlib.Path(args.study), args.seeds)
    rows = rejudge(v["rows"], base, bj["delta"])
    summary = {"truth_baseline": base, "study_baseline_reverse_kl": bj["baseline"]["reverse_kl"], "rows": rows,
               **fit.validity_scores(rows)}
    print(f"baseline on seeds {args.seeds}: reverse KL {base['reverse_kl']:.3f} "
          f"(study's baseline {bj['baseline']['reverse_kl']:.3f})")
    for r in rows:
        print(f"  {r['candidate']:55s} {r['verdict']:9s} q_loss {r['q_loss']:+.2f} [{r['q_loss_ci'][0]:+.2f}, "
              f"{r['q_loss_ci'][1]:+.2f}] {r['runs_verdict']:10s} (against the study's baseline "
              f"{r['q_loss_study_baseline']:+.2f}, {r['runs_verdict_study_baseline']})")
    print(f"agreement {summary['agreement']}/{summary['n_decided']}, always ADMIT {summary['always_admit']}, "
          f"always REJECT {summary['always_reject']}, false ADMITs {summary['false_admits']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
