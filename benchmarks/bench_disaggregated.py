"""Sync versus async OPD with the rollout engine and the learner on disjoint CPU sets (separate processes).

    python benchmarks/bench_disaggregated.py [--study configs/budget_sort_cpu.yaml] [--seeds 0-7]
        [--modes sync async1 async2] [--rollout-cpus 0] [--learner-cpus 1] [--eval-every 10]
        [--out docs/results/disaggregated] [key=value ...]   (study overrides, e.g. base.pipeline.steps=20)

A real deployment puts rollouts and learning on different hardware (GPU hosts and TPU hosts), so async mode overlaps
two devices. One machine emulates that with CPU sets: `opdjax serve --role rollout` and `opdjax serve --role
teacher` run under `taskset -c <rollout cpus>` (the teacher sits with the rollout engine, as on a GPU host that
serves both; `--teacher-with learner` keeps the teacher in the learner process instead), and each `opdjax train`
runs under `taskset -c <learner cpus>` with `rollout.endpoints` / `teacher.endpoints` pointing at them. The servers stay up across runs (each run binds them, publishes its starting
weights first and frees them when it ends). Every run is the study's baseline run of one seed (the study's `base`,
no mismatch knob), in one of the modes:

    sync    pipeline.mode=sync                                     (sample with the weights just published)
    asyncK  pipeline.mode=async pipeline.max_staleness=K pipeline.queue_size=K   (sample up to K versions ahead)

Runs go seed by seed, the modes of one seed back to back in a rotating order, so a drift of the machine falls on
every mode alike. Writes `<out>/runs.json` (every run's evaluation curve, per-phase medians, drops) and
`<out>/table.json` (`disaggregated_table`: time- and steps-to-quality per mode with 95% bootstrap CIs over seeds,
the async/sync ratios paired by seed, and the per-phase bound); `--report RUNS.json` recomputes the table only.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from opdjax.admission.plan import PHASES, phase_medians
from opdjax.config import dump_yaml
from opdjax.pipeline.inputs import resolve_models
from opdjax.pipeline.quality import FRACTIONS, to_quality
from opdjax.study.fit import mean_ci
from opdjax.study.study_config import load_study

MODES = {"sync": ["pipeline.mode=sync"],
         **{f"async{k}": ["pipeline.mode=async", f"pipeline.max_staleness={k}", f"pipeline.queue_size={k}"]
            for k in (1, 2, 4)}}


def _seeds(text: str) -> list[int]:
    """"0-7" or "0,3,5" -> the seeds."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def _serve(role: str, cpus: str, cfg_file: pathlib.Path, token: pathlib.Path, models, log) -> tuple:
    """Start `opdjax serve --role role` pinned to `cpus`; (process, "127.0.0.1:port") once it is ready."""
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "opdjax.cli", "serve", "--role", role, "--config",
           str(cfg_file), "--token-file", str(token), f"student={models[0]}", f"teacher={models[1]}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{role} server exited with {p.wait()} before it was ready")
    return p, f"127.0.0.1:{json.loads(line)['port']}"


def _run(args, seed: int, mode: str, cfg_file: pathlib.Path, urls: dict, token, models, log, extra=()) -> dict:
    """One `opdjax train` pinned to the learner cpus; its record (curve, phases, drops, wall seconds)."""
    out = args.work / f"{mode}_s{seed}"
    cmd = ["taskset", "-c", args.learner_cpus, sys.executable, "-m", "opdjax.cli", "train", "--config", str(cfg_file),
           f"student={models[0]}", f"teacher={models[1]}", f"rollout.endpoints=[{urls['rollout']}]",
           *([f"teacher.endpoints=[{urls['teacher']}]"] if "teacher" in urls else []),
           f"sync.token_file={token}", f"pipeline.out_dir={out}",
           "pipeline.overwrite=true", *MODES[mode], *extra]
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=log, stderr=log)
    summary = json.loads((out / "summary.json").read_text())
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return {"mode": mode, "seed": seed, "wall_s": time.time() - t0, "eval_curve": summary["eval_curve"],
            "time": summary["time"], "phases": phase_medians(rows, skip=3),
            "dropped": rows[-1].get("dropped", 0), "staleness_mean": statistics.mean(r["staleness"] for r in rows)}


def _figures(rec: dict, initial: float, reference: float) -> dict:
    """Seconds and steps to each fraction of the way from `initial` to `reference` reverse KL, and the AUC."""
    curve = [[r[0], r[3], r[1]] for r in rec["eval_curve"]]
    curve[0][2] = initial  # every mode starts from the same student: one shared starting quality
    q = to_quality(curve, reference, reference_from="sync mean final")
    return {"thresholds": q["thresholds"], "auc": q["auc"]}


def _ratio_ci(a: np.ndarray, b: np.ndarray, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) with a 95% percentile bootstrap interval, resampling seeds (paired rows of a and b)."""
    idx = np.random.default_rng(seed).integers(0, len(a), (n, len(a)))
    r = a[idx].mean(1) / b[idx].mean(1)
    lo, hi = np.quantile(r, [0.025, 0.975])
    return float(a.mean() / b.mean()), float(lo), float(hi)


def _per_mode(recs: list[dict], f: str, what: str) -> np.ndarray:
    """One figure per seed (sorted by seed): the seconds or step at threshold f; a threshold not reached counts
    as the run's whole training time or step count (censored: the mean is then a lower bound, flagged)."""
    out = []
    for r in sorted(recs, key=lambda r: r["seed"]):
        t = r["figures"]["thresholds"][f]
        end = r["eval_curve"][-1][3] if what == "seconds" else r["eval_curve"][-1][0]
        out.append(t[what] if t[what] is not None else end)
    return np.asarray(out, np.float64)


def _mode_rows(by_mode: dict[str, list[dict]]) -> list[dict]:
    """Per mode and threshold: mean seconds/steps with CIs, reached count, and the ratio sync/mode paired by seed."""
    rows = []
    for mode, recs in by_mode.items():
        for f in (f"{x:g}" for x in FRACTIONS):
            row = {"mode": mode, "fraction": f, "seeds": len(recs),
                   "reached": sum(r["figures"]["thresholds"][f]["step"] is not None for r in recs)}
            for what in ("seconds", "step"):
                xs = _per_mode(recs, f, what)
                row[what] = {"mean": float(xs.mean()), "ci": list(mean_ci(xs))}
                if mode != "sync":
                    row[what]["speedup_vs_sync"] = list(_ratio_ci(_per_mode(by_mode["sync"], f, what), xs))
            rows.append(row)
    return rows


def _phase_rows(by_mode: dict[str, list[dict]]) -> dict:
    """Per mode: the median of each run's per-phase medians, the run's train seconds; plus the bound the sync phase
    split gives to any overlap of rollout (generate, on the rollout cpus) with the learner's side (score, train,
    publish): (g + l) / max(g, l)."""
    out = {}
    for mode, recs in by_mode.items():
        med = {k: statistics.median(r["phases"][k] for r in recs) for k in (*PHASES, "step")}
        out[mode] = {**med, "train_seconds": statistics.median(r["time"]["elapsed_train"] for r in recs),
                     "dropped": sum(r["dropped"] for r in recs),
                     "staleness_mean": statistics.mean(r["staleness_mean"] for r in recs)}
    s = out["sync"]
    g, learn = s["time/generate"], s["time/score"] + s["time/train"] + s["time/publish"]
    out["bound"] = {"generate": g, "learner_side": learn, "per_step_speedup_max": (g + learn) / max(g, learn)}
    return out


def disaggregated_table(records: list[dict]) -> dict:
    """The table of `runs.json` records: quality thresholds relative to the sync runs' mean final reverse KL, from
    the mean initial reverse KL over every run; per mode and threshold the time and steps to it (95% CIs over
    seeds) and the speed-up sync/mode paired by seed; the per-phase times and their bound."""
    sync = [r for r in records if r["mode"] == "sync"]
    reference = float(np.mean([r["eval_curve"][-1][1] for r in sync]))
    initial = float(np.mean([r["eval_curve"][0][1] for r in records]))
    by_mode: dict[str, list[dict]] = {}
    for r in records:
        r["figures"] = _figures(r, initial, reference)
        by_mode.setdefault(r["mode"], []).append(r)
    finals = {m: list(mean_ci([r["eval_curve"][-1][1] for r in rs])) for m, rs in by_mode.items()}
    return {"initial_reverse_kl": initial, "reference_reverse_kl": reference, "final_reverse_kl_ci": finals,
            "rows": _mode_rows(by_mode), "phases": _phase_rows(by_mode)}


def _print(table: dict) -> None:
    print(f"reverse KL {table['initial_reverse_kl']:.2f} -> reference {table['reference_reverse_kl']:.3f} "
          f"(sync mean final); final per mode: " + ", ".join(f"{m} [{a:.3f}, {b:.3f}]"
                                                           for m, (a, b) in table["final_reverse_kl_ci"].items()))
    print(f"{'mode':8} {'f':>5} {'reached':>7} {'seconds [95% CI]':>24} {'speed-up':>22} {'steps [95% CI]':>22} "
          f"{'steps ratio':>20}")
    for r in table["rows"]:
        s, k = r["seconds"], r["step"]
        sp = "" if "speedup_vs_sync" not in s else "{:.2f} [{:.2f}, {:.2f}]".format(*s["speedup_vs_sync"])
        kp = "" if "speedup_vs_sync" not in k else "{:.2f} [{:.2f}, {:.2f}]".format(*k["speedup_vs_sync"])
        print(f"{r['mode']:8} {r['fraction']:>5} {r['reached']:>3}/{r['seeds']:<3} "
              f"{s['mean']:7.1f} [{s['ci'][0]:6.1f}, {s['ci'][1]:6.1f}] {sp:>22} "
              f"{k['mean']:6.1f} [{k['ci'][0]:5.1f}, {k['ci'][1]:5.1f}] {kp:>20}")
    print("median seconds per step: " + json.dumps({m: {k.replace("time/", ""): round(v, 4) for k, v in p.items()}
                                                   for m, p in table["phases"].items()}))


def _measure(args) -> list[dict]:
    """Start the two servers on the rollout cpus, train every (seed, mode) on the learner cpus; the records."""
    study = load_study(args.study, args.overrides)
    args.work = pathlib.Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    log = open(args.work / "log.txt", "w")
    cfg_files = {}
    for seed in args.seeds:
        cfg = study.train_config_for({}, seed)
        cfg.pipeline.eval_every = args.eval_every
        cfg_files[seed] = args.work / f"seed{seed}.yaml"
        cfg_files[seed].write_text(dump_yaml(cfg))
    models = resolve_models(study.train_config_for({}, args.seeds[0]), log=print)
    token = args.work / "token"
    token.write_text("bench-disaggregated")
    procs, urls = [], {}
    try:
        for role in ("rollout", "teacher") if args.teacher_with == "rollout" else ("rollout",):
            p, urls[role] = _serve(role, args.rollout_cpus, cfg_files[args.seeds[0]], token, models, log)
            procs.append(p)
        for mode in args.modes:  # warm-up, discarded: fills the persistent compilation cache for every mode
            _run(args, args.seeds[0], mode, cfg_files[args.seeds[0]], urls, token, models, log, ["pipeline.steps=3"])
        records = []
        for i, seed in enumerate(args.seeds):
            for mode in args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]:
                records.append(_run(args, seed, mode, cfg_files[seed], urls, token, models, log))
                print(f"seed {seed} {mode}: {records[-1]['wall_s']:.0f} s, train {records[-1]['time']}", flush=True)
        return records
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="configs/budget_sort_cpu.yaml")
    ap.add_argument("--seeds", type=_seeds, default=list(range(8)))
    ap.add_argument("--modes", nargs="+", default=["sync", "async1", "async2"], choices=sorted(MODES))
    ap.add_argument("--rollout-cpus", default="0")
    ap.add_argument("--learner-cpus", default="1")
    ap.add_argument("--teacher-with", default="rollout", choices=["rollout", "learner"],
                    help="rollout: a teacher server on the rollout cpus; learner: the teacher in the learner process")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default="docs/results/disaggregated")
    ap.add_argument("--report", default=None, help="recompute the table from this runs.json only")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("overrides", nargs="*", help="study overrides key=value")
    args = ap.parse_args()
    if args.report:
        records = json.loads(pathlib.Path(args.report).read_text())["records"]
    else:
        if "sync" not in args.modes:
            ap.error("--modes must include sync (the reference)")
        records = _measure(args)
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"argv": sys.argv[1:], "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "rollout_cpus": args.rollout_cpus, "learner_cpus": args.learner_cpus, "teacher_with": args.teacher_with}
        (out / "runs.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    table = disaggregated_table(records)
    if not args.report:
        (pathlib.Path(args.out) / "table.json").write_text(json.dumps(table, indent=1))
    _print(table)


if __name__ == "__main__":
    main()
