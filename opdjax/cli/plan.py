"""`opdjax bench` and `opdjax plan`: time the running engines, then predict what each admitted candidate buys.

    opdjax bench --budget budget.json --out bench.json CANDIDATE...     phase times of the baseline and each candidate
    opdjax plan --study budget.json --admission admit.json --bench bench.json     the table (`opdjax.admission.plan`)
"""

from __future__ import annotations

import dataclasses
import platform

from opdjax.admission.budget import AdmissionError, load_budget
from opdjax.admission.admit import setup_source
from opdjax.admission.plan import PhaseTimes, bench, format_plan, plan
from opdjax.admission.records import read_list, write_json
from opdjax.cli.common import KEYS_HINT, guard
from opdjax.pipeline.quality import FRACTIONS

__all__ = ["add_plan_commands"]


def _cmd_bench(args) -> int:
    source = args.config
    if args.budget:
        source = setup_source(load_budget(args.budget), args.config)
    times = bench(args.candidates, config=source, overrides=args.set or [], steps=args.steps)
    print(f"{'candidate':<40} {'generate s':>10} {'learner s':>10} {'step s':>8}")
    for t in times:
        print(f"{t.candidate:<40} {t.generate:10.4f} {t.learner:10.4f} {t.step:8.4f}")
    if args.out:
        write_json(args.out, {"machine": platform.processor() or platform.machine(), "steps": args.steps,
                              "rows": [dataclasses.asdict(t) for t in times]})
        print(f"wrote {args.out}")
    return 0


def _cmd_plan(args) -> int:
    points = read_list(args.study, "study file", "points")  # B itself is not needed: an UNRESOLVED study plans too
    admitted = [r for r in read_list(args.admission, "admission report", "candidates")
                if args.all or r.get("verdict") == "ADMIT"]
    try:
        times = [PhaseTimes(**r) for r in read_list(args.bench, "bench report", "rows")]
    except TypeError as e:
        raise AdmissionError(f"bench report {args.bench}: a row is not `opdjax bench` output ({e})") from None
    if not admitted:
        print("no candidate was admitted: nothing to plan (--all plans every verdict)")
        return 1
    rows = plan(admitted, points, times, fraction=args.fraction)
    print(format_plan(rows, args.fraction))
    if args.out:
        write_json(args.out, {"fraction": args.fraction, "rows": [dataclasses.asdict(r) for r in rows]})
        print(f"wrote {args.out}")
    return 0


def add_plan_commands(subparsers) -> None:
    """Register bench and plan."""
    b = subparsers.add_parser("bench", help="time the phases of a few OPD steps per candidate on the running engines")
    b.add_argument("--config", default=None, help="YAML config (default: the budget's recorded setup, else the "
                                                  "embedded defaults); rollout/teacher endpoints time those servers")
    b.add_argument("--budget", default=None, help="budget.json: time on the setup its study recorded")
    b.add_argument("--steps", type=int, default=8, help="steps per run (the first 2 compile and are left out)")
    b.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override for every run {KEYS_HINT}")
    b.add_argument("--out", default=None, help="write the report (JSON) here, for `opdjax plan --bench`")
    b.add_argument("candidates", nargs="*", metavar="CANDIDATE", help="comma-separated overrides, as for admit")
    b.set_defaults(func=guard(_cmd_bench))
    p = subparsers.add_parser("plan", help="predicted time-to-quality of admitted candidates on your hardware")
    p.add_argument("--study", required=True, help="a study's budget.json whose points carry each seed's "
                                                  "steps-to-quality (the candidates' own budget is admit's)")
    p.add_argument("--admission", required=True, help="`opdjax admit --out` report")
    p.add_argument("--bench", required=True, help="`opdjax bench --out` report (the baseline and the candidates)")
    p.add_argument("--fraction", default="0.9", choices=[f"{f:g}" for f in FRACTIONS],
                   help="quality threshold: this fraction of the way to the baseline's final reverse KL")
    p.add_argument("--all", action="store_true", help="plan every verdict, not only ADMIT")
    p.add_argument("--out", default=None, help="write the table (JSON) here")
    p.set_defaults(func=guard(_cmd_plan))
