"""`opdjax study`: the mismatch-budget study.
"""

from __future__ import annotations

from typing import Any

import yaml

from opdjax.cli.common import KEYS_HINT, guard
from opdjax.config import to_dict
from opdjax.study.study import run_study
from opdjax.study.study_config import load_study

__all__ = ["add_study_command"]


def _study_command(args) -> int:
    study = load_study(args.config, args.overrides, small=args.small)
    if args.print_config:
        print(yaml.safe_dump(to_dict(study), sort_keys=False), end="")
        return 0
    run_study(study)
    return 0


def add_study_command(subparsers) -> Any:
    """Register `opdjax study [--config FILE] [--small] [--print-config] key=value ...`."""
    p = subparsers.add_parser("study", help="mismatch-budget study: sweep mismatch knobs, fit the budget B")
    p.add_argument("--config", default=None, help="study YAML (e.g. configs/study_cpu.yaml; default: built-ins)")
    p.add_argument("--small", action="store_true",
                   help="smoke-test size: 3 sweep points, 20 steps, one seed (applied before key=value overrides)")
    p.add_argument("--print-config", action="store_true", help="print the resolved study config and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. delta=0.3 base.pipeline.steps=100 "
                                                "out_dir=runs/s2 base.student=DIR; base.KEY: a train key "
                                                + KEYS_HINT)
    p.set_defaults(func=guard(_study_command))
    return p
