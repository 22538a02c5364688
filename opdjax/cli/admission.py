"""`opdjax admit | sensitivity | recipe-search | capacity`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from opdjax import quant
from opdjax.admission.admit import admit, candidate_config, exit_code, format_admit_table, setup_source
from opdjax.admission.budget import (
    AdmissionError,
    Budget,
    calibration_warning,
    load_budget,
    setup_fingerprint,
)
from opdjax.admission.probe import DEFAULT_MAX_BATCHES, calibrate_kv
from opdjax.admission.records import read_list, write_json
from opdjax.admission.search import (
    BY_CHOICES,
    capacity_report,
    format_capacity,
    format_sensitivity,
    recipe_search,
    sensitivity,
    write_search,
)
from opdjax.cli.common import KEYS_HINT, guard
from opdjax.models.presets import PRESET_MODELS, model_config

__all__ = ["add_admission_commands"]


def recipe_arg(spec: str | None) -> quant.Recipe | None:
    if spec is None:
        return None
    if spec in quant.RECIPES or quant.is_recipe_file(spec):
        return quant.as_recipe(spec)
    raise AdmissionError(f"--recipe {spec!r}: not a preset ({sorted(quant.RECIPES)}) nor a .json/.yaml recipe file")


def _warn_if_other_setup(budget: Budget, cfg) -> None:
    if not budget.calibrated_on:
        return  # nothing to compare with (and no reason to resolve or hash the models)
    msg = calibration_warning(budget, setup_fingerprint(cfg, log=lambda m: None))
    if msg:
        print(f"warning: {msg}", file=sys.stderr)


def _budget_setup(budget: Budget, config: str | None):
    """`setup_source(budget, config)`, saying on stderr when it is the budget's own recorded setup."""
    source = setup_source(budget, config)
    if source is not None and source is budget.train_config:
        print(f"probing on the setup {budget.path} was calibrated with (its study's baseline train config); "
              f"--set goes on top of it, --config replaces it", file=sys.stderr)
    return source


def _cmd_admit(args) -> int:
    budget = load_budget(args.budget)
    source = _budget_setup(budget, args.config)
    _warn_if_other_setup(budget, candidate_config(source, args.set or []))
    points = read_list(args.study or args.budget, "study file", "points", required=False)
    rows = admit(args.candidates, budget, config=source, overrides=args.set or [], risk=args.risk,
                 max_batches=args.max_batches, seed=args.seed, study_points=points)
    print(format_admit_table(rows, budget))
    if args.out:
        p = pathlib.Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_json(p, {"budget": dataclasses.asdict(budget), "all_admitted": exit_code(rows) == 0,
                       "candidates": [r.to_dict() for r in rows]})
        print(f"wrote {p}")
    return exit_code(rows)


def _kv_scales_arg(args, cfg) -> tuple | None:
    if args.kv_scales == "fixed":
        return None
    scales = calibrate_kv(cfg, seed=args.seed)
    print(f"calibrated FP8 KV scales (k, v) per layer: {[tuple(round(x, 5) for x in s) for s in scales]}")
    return scales


def _cmd_sensitivity(args) -> int:
    cfg = candidate_config(args.config, args.overrides)
    rep = sensitivity(cfg, by=args.by, batches=args.batches, metric=args.metric, seed=args.seed, kv=not args.no_kv,
                      kv_scales=_kv_scales_arg(args, cfg))
    print(format_sensitivity(rep))
    if args.out:
        p = pathlib.Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_json(p, rep)
        print(f"wrote {p}")
    return 0


def _cmd_recipe_search(args) -> int:
    budget = load_budget(args.budget)
    cfg = candidate_config(_budget_setup(budget, args.config), args.overrides)
    _warn_if_other_setup(budget, cfg)
    res = recipe_search(cfg, budget, margin=args.margin, by=args.by, batches=args.batches, seed=args.seed,
                        memory_bytes=args.memory_gb * (1 << 30), name=args.name, kv_scales=_kv_scales_arg(args, cfg))
    paths = write_search(res, budget, args.margin, args.out)
    print(f"recipe: {len(res.kept)} unit(s) kept in high precision: {res.kept or 'none'}; "
          f"{budget.metric} {res.m:.3e} [{res.ci_low:.3e}, {res.ci_high:.3e}] vs B {budget.budget:.3e} "
          f"(target {args.margin * budget.budget:.3e}) -> {'fits' if res.fits else 'DOES NOT FIT'}")
    print(f"weights saved vs BF16: {res.weight_bytes_saved / 2**20:.3f} MiB")
    print(format_capacity(res.capacity, "the student"))
    print(f"vLLM settings: {json.dumps(res.vllm)}")
    for k, v in paths.items():
        print(f"wrote {k}: {v}")
    print(f"check it: opdjax admit --budget {args.budget} rollout.recipe={paths['recipe']}")
    return 0 if res.fits else 1


def _cmd_capacity(args) -> int:
    mcfg = model_config(args.model)
    recipe = recipe_arg(args.recipe)
    rep = capacity_report(mcfg, recipe, args.memory_gb * (1 << 30))
    print(format_capacity(rep, args.model))
    if args.out:
        write_json(args.out, rep)
    return 0


def _common(p: argparse.ArgumentParser, *, overrides: bool = True, batches: bool = True,
            budget: bool = False) -> None:
    p.add_argument("--config", default=None,
                   help="YAML config (default: the train config the budget's study recorded, the setup B holds for)"
                   if budget else "YAML config (default: the embedded tiny_cpu defaults)")
    if batches:
        p.add_argument("--batches", type=int, default=4,
                       help="probe batches per measurement (rollout.batch_size each)")
    p.add_argument("--seed", type=int, default=0, help="probe seed (same prompts and sampling noise for all)")
    if overrides:
        p.add_argument("overrides", nargs="*", help=f"config overrides key=value {KEYS_HINT}")


def _kv_scales_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-scales", default="fixed", choices=["fixed", "calibrated"],
                   help="FP8 KV-cache scales: fixed 1.0 (vLLM kv_cache_dtype=fp8 on a plain checkpoint) or "
                        "per-layer scales calibrated on the student's own samples (amax / 448)")


def add_admission_commands(subparsers) -> None:
    """Register admit, sensitivity, recipe-search and capacity on an argparse subparsers object."""
    a = subparsers.add_parser("admit", help="probe candidate rollout configs and admit/reject them against a budget",
                              description="Exit code: 0 if every candidate is ADMITted, 1 otherwise, 2 on bad "
                                          "input.")
    a.add_argument("--budget", required=True, help="budget.json written by `opdjax study`")
    _common(a, overrides=False, batches=False, budget=True)
    a.add_argument("--risk", type=float, default=0.05,
                   help="chance of a false ADMIT (and, separately, of a false REJECT) the sequential probe allows; "
                        "smaller means more batches or more UNCERTAIN (default 0.05)")
    a.add_argument("--max-batches", type=int, default=DEFAULT_MAX_BATCHES,
                   help=f"cost cap: batches (rollout.batch_size each) sampled before a candidate whose bounds "
                        f"still contain B is UNCERTAIN (default {DEFAULT_MAX_BATCHES})")
    a.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help=f"global config override applied to every candidate (repeatable) {KEYS_HINT}")
    a.add_argument("--out", default=None, help="write the machine-readable report (JSON) here")
    a.add_argument("--study", default=None,
                   help="a study's budget.json whose points say, per kind it trained, how the probe's M compares "
                        "with the M training sees (default: the budget's own points)")
    a.add_argument("candidates", nargs="+", metavar="CANDIDATE",
                   help="comma-separated overrides, e.g. rollout.recipe=fp8_w8a8_kv or "
                        "rollout.weight_noise=0.05,rollout.stale_versions=1")
    a.set_defaults(func=guard(_cmd_admit))

    s = subparsers.add_parser("sensitivity", help="mismatch M of quantizing one layer / module type at a time")
    _common(s)
    s.add_argument("--by", default="layer", choices=BY_CHOICES)
    s.add_argument("--metric", default="k3")
    s.add_argument("--no-kv", action="store_true", help="leave out the FP8 KV-cache unit")
    _kv_scales_flag(s)
    s.add_argument("--out", default=None, help="write the JSON report here")
    s.set_defaults(func=guard(_cmd_sensitivity))

    r = subparsers.add_parser("recipe-search", help="greedy FP8 recipe (layers kept in BF16) that fits the budget")
    r.add_argument("--budget", required=True)
    _common(r, budget=True)
    r.add_argument("--margin", type=float, default=0.8, help="fit when M <= margin * B (and CI high <= B)")
    r.add_argument("--by", default="layer", choices=[b for b in BY_CHOICES if b != "module"])
    r.add_argument("--memory-gb", type=float, default=80.0, help="device memory for the KV-capacity accounting")
    r.add_argument("--name", default="fp8_searched", help="name of the written recipe")
    _kv_scales_flag(r)
    r.add_argument("--out", default="runs/recipe_search", help="output directory")
    r.set_defaults(func=guard(_cmd_recipe_search))

    c = subparsers.add_parser("capacity", help="KV-cache tokens that fit in device memory, BF16 vs a recipe")
    c.add_argument("--model", required=True, help=f"HF checkpoint dir, a preset ({', '.join(PRESET_MODELS)}) "
                                                   f"or a tiny size (tiny, small, base, 100m; family/size)")
    c.add_argument("--memory-gb", type=float, default=80.0, help="device memory in GiB")
    c.add_argument("--recipe", default="fp8_w8a8_kv", help="preset name or recipe file (.json/.yaml)")
    c.add_argument("--out", default=None)
    c.set_defaults(func=guard(_cmd_capacity))
