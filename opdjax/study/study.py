"""The mismatch-budget study: how much training–inference mismatch OPD tolerates, on one scale.

`opdjax study --config configs/study_cpu.yaml` sweeps mismatch knobs of the rollout engine — relative weight noise
sigma (the continuous knob), staleness k, quantization recipes — and runs a short OPD training per (point, seed).
For every point it records

    m_probe   the admission-scale mismatch M: `probe.probe(cfg)` on the untrained student (default metric k3, with a
              95% bootstrap CI over sequences) — the same number `admit` measures for a candidate;
    m_train   the mean per-step `mismatch/<metric>` logged during training (k1 and |log-ratio| p95 alongside);
    quality   the final held-out reverse KL(student‖teacher) and greedy accuracy.

Quality loss (``quality: reverse_kl``, the default) is the relative increase of the final held-out reverse KL over
the mismatch-free baseline point:  q_loss = (RKL_point - RKL_base) / RKL_base,  RKL_base the mean over the baseline
seeds; per seed q_s uses that seed's RKL, the point's q_loss is mean_s q_s and the spread (std, min, max) is shown.
``quality: accuracy`` uses the absolute accuracy drop  acc_base - acc_point  instead.

The budget B (`fit_budget`) is the largest m_probe at which the isotonic (monotone non-decreasing in M) regression
of the points' mean q_loss stays <= delta: one noisy point is pooled with its neighbours rather than deciding B on
its own, and a diverged point pools to +inf so nothing beyond it is admitted. `fit: first_failure` instead stops
at the first raw point outside the tolerance.

The study also reproduces the paper's other phenomena (each switchable): (a) the RL baseline (REINFORCE/GRPO on
the task reward, `loss.name=reinforce`) versus OPD at the same weight-noise levels; (b) prefix shift — clean versus
perturbed engine under shared sampling noise (same seed -> same per-row keys, so samples coincide until the
distributions differ enough to flip one): first-divergence position, fraction of diverged sequences and the
sequence-level KL; and per-token corrections (token_tis, token_mis) at a noise level beyond the budget, which do
not remove the quality loss that the shifted prefixes cause.

Outputs under `out_dir`: budget.json, points.csv, budget.png, summary.md; one JSON per finished (point, seed)
under results/ (the resume record: a finished run whose resolved TrainConfig is unchanged is not rerun), which also
carries the run's time- and steps-to-quality against the baseline's final quality (`against_baseline`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import shutil
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml

from opdjax import quant
from opdjax.admission import probe as probe_mod
from opdjax.admission.budget import setup_fingerprint
from opdjax.admission.records import write_json
from opdjax.config import to_dict
from opdjax.pipeline import loop
from opdjax.pipeline.quality import quality_figures
from opdjax.pipeline.rundir import write_text
from opdjax.rollout.vllm_settings import engine_dtype
from opdjax.study.fit import (
    aggregate,
    baseline_stats,
    budget_interval,
    calibration_rows,
    finite_mean,
    fit_budget,
    hinge_fit,
    knee_bracket,
    monotone_q_loss,
    point_effect,
    runs_verdict,
    train_probe_ratio,
)
from opdjax.study.phenomena import phenomena
from opdjax.study.records import Point, RunResult, noise_point
from opdjax.study.report import plot, summary_markdown, write_csv
from opdjax.study.study_config import KneeConfig, StudyConfig, round_level

__all__ = ["against_baseline", "knee_candidates", "knee_search", "phenomena_points", "run_identity", "run_one",
           "run_study", "sweep_points", "train_mismatch"]


Log = Callable[[str], None]


TRAIN_METRICS = ("k3", "k1", "abs_log_ratio_p95")  # per-step mismatch/<key> averaged over a run


def knee_search(knee: KneeConfig, delta: float, measure: Callable[[float], tuple[float, float]],
                log: Log = print) -> list[float]:
    """The adaptive weight-noise levels (see `KneeConfig`); `measure(sigma) -> (M, mean q_loss)` trains one point
    on every seed. Returns the levels trained, in order."""
    within: tuple[float, float] | None = None   # (sigma, M) of the largest sigma within tolerance
    beyond: tuple[float, float] | None = None   # (sigma, M) of the smallest sigma beyond it
    sigma, tried = round_level(knee.start), []
    while len(tried) < knee.max_points and sigma not in tried:
        m, q = measure(sigma)
        tried.append(sigma)
        ok = q <= delta
        if ok and (within is None or sigma > within[0]):
            within = (sigma, m)
        if not ok and (beyond is None or sigma < beyond[0]):
            beyond = (sigma, m)
        log(f"knee: sigma {sigma:g}: M {m:.3g}, q_loss {q:+.3g} -> {'within' if ok else 'beyond'} delta")
        if beyond is None:
            sigma = round_level(sigma * knee.step)
            if sigma > knee.max_sigma:
                log(f"knee: still within delta at sigma {tried[-1]:g}; max_sigma {knee.max_sigma:g} reached")
                break
        elif within is None:
            sigma = round_level(sigma / knee.step)
            if sigma < knee.min_sigma:
                log(f"knee: beyond delta already at sigma {tried[-1]:g}; min_sigma {knee.min_sigma:g} reached")
                break
        elif within[1] > 0 and beyond[1] / within[1] <= knee.factor:
            log(f"knee: bracketed, M in [{within[1]:.3g}, {beyond[1]:.3g}] (ratio {beyond[1] / within[1]:.3g} <= "
                f"{knee.factor:g})")
            break
        else:
            sigma = round_level(math.sqrt(within[0] * beyond[0]))
    return tried


def knee_candidates(points: Sequence[Mapping[str, Any]], budget: float) -> list[float]:
    """Weight-noise levels around a study's knee, for validating the budget on configurations it was not fitted
    on: with sigma_w the largest searched sigma whose probe M <= B and sigma_b the smallest with M > B,
    sigma_w / 2 (below: M ~ B/4 as M grows ~ sigma^2), sqrt(sigma_w sigma_b) (inside the bracket) and
    1.5 sigma_b (above); plus 1.1 sigma_3 (far above) when sigma_3, the smallest searched sigma whose M >= 3 B,
    exceeds 1.5 sigma_b (a candidate that 1.5 sigma_b may leave short of 3 B). Each is rounded like the searched
    levels and nudged (x0.9, x1.05, x1.1) off any searched level. [] when the points do not bracket B.

    points: budget.json's "points" ({"knob", "value", "m_probe"})."""
    noise = [(p["value"], p["m_probe"]) for p in points
             if p["knob"] == "weight_noise" and p["value"] > 0 and p.get("m_probe") is not None]
    within = [s for s, m in noise if m <= budget]
    beyond = [s for s, m in noise if m > budget]
    if not within or not beyond:
        return []
    s_w, s_b = max(within), min(beyond)
    searched = {s for s, _ in noise}

    def unsearched(x: float, nudge: float) -> float:
        while round_level(x) in searched:
            x *= nudge
        return round_level(x)

    levels = [unsearched(s_w / 2, 0.9), unsearched(math.sqrt(s_w * s_b), 1.05), unsearched(1.5 * s_b, 1.1)]
    far = [s for s, m in noise if m >= 3 * budget]
    if far and min(far) > 1.5 * s_b:
        levels.append(unsearched(1.1 * min(far), 1.1))
    return levels


def sweep_points(study: StudyConfig) -> list[Point]:
    """Baseline, then weight noise, staleness and recipe points (the budget fit uses these)."""
    pts = [Point("sweep", "baseline", 0, {})]
    pts += [noise_point(s) for s in sorted(set(study.weight_noise)) if s > 0]
    pts += [Point("sweep", "staleness", int(k), {"rollout": {"stale_versions": int(k)}})
            for k in sorted(set(study.staleness)) if k > 0]
    pts += [Point("sweep", "recipe", r, {"rollout": {"recipe": r}}) for r in dict.fromkeys(study.recipes)
            if r != "none"]
    return pts


def phenomena_points(study: StudyConfig) -> list[Point]:
    """RL runs, OPD runs at RL/correction levels the sweep lacks, and correction runs."""
    sweep_noise = {0.0} | {float(s) for s in study.weight_noise}
    pts: list[Point] = []
    extra_opd: set[float] = set()
    if study.rl.enabled:
        levels = study.rl.levels()
        pts += [study.rl.rl_point(s) for s in levels]
        if study.rl.common:
            pts += [study.rl.opd_point(s) for s in levels]
        else:
            extra_opd |= set(levels) - sweep_noise
    if study.shift.enabled and study.shift.corrections:
        s = float(study.shift.correction_noise)
        pts += [noise_point(s, "correction", {"loss": {"correction": c}}, probe=False, label=c)
                for c in study.shift.corrections]
        extra_opd |= {s} - sweep_noise
    # OPD at levels outside the sweep: trained for comparison, kept out of the budget fit.
    pts += [noise_point(s, "correction", None, probe=False, label="opd") for s in sorted(extra_opd)]
    return pts


def train_mismatch(metrics_path: pathlib.Path) -> dict[str, Any]:
    """Mean per-step mismatch/{k3,k1,abs_log_ratio_p95} of a run, plus its divergence signs and the median
    per-step movement of the student (`policy/step_k3`, None when not logged).

    `nonfinite_steps` counts steps whose loss or grad norm was NaN/inf; `reward_last` (RL runs) is the mean
    reward over the last 10% of steps.
    """
    steps = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    steps = [s for s in steps if "loss" in s]
    out: dict[str, Any] = {f"m_train_{k}": finite_mean(s.get(f"mismatch/{k}") for s in steps) for k in TRAIN_METRICS}
    out["nonfinite_steps"] = sum(1 for s in steps if not all(math.isfinite(float(s.get(k, 0.0)))
                                                           for k in ("loss", "grad_norm")))
    tail = steps[-max(len(steps) // 10, 1):]
    if steps and "reward_mean" in steps[0]:
        out["reward_last"] = finite_mean(s.get("reward_mean") for s in tail)
    out["teacher_kl_last"] = finite_mean(s.get("teacher_kl") for s in tail)
    moves = sorted(float(s["policy/step_k3"]) for s in steps if math.isfinite(float(s.get("policy/step_k3", "nan"))))
    out["policy_step_k3_median"] = moves[len(moves) // 2] if moves else None
    return out


def eval_curve(metrics_path: pathlib.Path) -> list[list[float]]:
    """[[step, held-out reverse KL, accuracy, training seconds], ...] (`quality.EVAL_ROW`): every evaluation of a
    run, the initial one included; the seconds are the run's `time/elapsed_train` (NaN when not logged)."""
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    return [[int(r["step"]), float(r["eval/reverse_kl"]), float(r.get("eval/accuracy", float("nan"))),
             float(r.get("time/elapsed_train", float("nan")))] for r in rows if "eval/reverse_kl" in r]


def against_baseline(rec: RunResult, baseline: Mapping[str, Any]) -> RunResult:
    """`rec` with `to_quality`: `quality.quality_figures` of its evaluation curve against the baseline's final
    quality (`baseline_stats`: "reverse_kl", the study's reference reverse KL, and "accuracy", the seeds' mean);
    None when the curve has no training clock (a record written before the runs logged one)."""
    rows = [list(r) + [math.nan] * (4 - len(r)) for r in rec.eval_curve or []]
    refs = {"eval/reverse_kl": baseline["reverse_kl"], "eval/accuracy": baseline["accuracy"]}
    return dataclasses.replace(rec, to_quality=quality_figures(rows, refs, reference_from="baseline final") or None)


def _result_path(study: StudyConfig, point_id: str, seed: int) -> pathlib.Path:
    """Where the record of (point, seed) is saved: `<out_dir>/results/<point>/seed<k>.json`."""
    return pathlib.Path(study.out_dir) / "results" / point_id / f"seed{seed}.json"


def run_identity(cfg_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A TrainConfig dict without the fields that cannot change its run (rollout.noise_mode when
    rollout.weight_noise is 0, rollout.fp8_emulation when off) and with rollout.dtype "auto" resolved (the JAX
    engine: float32; vLLM: `engine_dtype`): two configs with equal identities train the same run."""
    d = json.loads(json.dumps(dict(cfg_dict)))
    rollout = d.get("rollout", {})
    if not rollout.get("weight_noise"):
        rollout.pop("noise_mode", None)
    if not rollout.get("fp8_emulation"):
        rollout.pop("fp8_emulation", None)
    if rollout.get("dtype") == "auto":
        vllm = rollout.get("engine") == "vllm" and isinstance(rollout.get("recipe", "none"), str)
        rollout["dtype"] = engine_dtype("auto", quant.as_recipe(rollout.get("recipe", "none"))) if vllm else "float32"
    return d


def run_one(study: StudyConfig, point: Point, seed: int, log: Log = print) -> RunResult:
    """Probe (sweep points) and train one (point, seed); returns the result record (also saved as JSON).

    A record whose `train_config` trains the same run as the one this study would use now (`run_identity`) is
    reused without running anything.
    """
    result_path = _result_path(study, point.id, seed)
    run_dir = pathlib.Path(study.out_dir) / "runs" / point.id / f"seed{seed}"
    cfg = study.train_config_for(point.overrides, seed, out_dir=str(run_dir))
    cfg_dict = to_dict(cfg)
    want_probe = point.probe
    if result_path.is_file():
        saved = _saved_result(study, result_path, cfg_dict, want_probe)
        if saved is not None:
            return saved
        log(f"  {point.id} seed {seed}: config changed since the saved result; rerunning")
    quiet = lambda s: None  # noqa: E731
    t0 = time.time()
    pr = probe_mod.probe(cfg, batches=study.probe_batches, metric=study.metric, seed=seed, log=quiet) if want_probe else None
    t1 = time.time()
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a partial run from an interrupted study: start it over
    summary = loop.train(cfg, log=quiet)
    t2 = time.time()
    rec = RunResult(
        point=point.id, group=point.group, knob=point.knob, value=point.value, label=point.label,
        seed=seed, metric=study.metric, probe_batches=study.probe_batches,
        m_probe=pr.m if pr else None, m_probe_ci=[pr.ci_low, pr.ci_high] if pr else None,
        probe_metrics=pr.metrics if pr else None, probe_tokens=pr.tokens if pr else None,
        reverse_kl=summary["final"]["eval/reverse_kl"], accuracy=summary["final"]["eval/accuracy"],
        initial_reverse_kl=summary["initial"]["eval/reverse_kl"],
        initial_accuracy=summary["initial"]["eval/accuracy"],
        probe_seconds=t1 - t0, train_seconds=t2 - t1, steps=summary["steps"],
        **train_mismatch(run_dir / "metrics.jsonl"), eval_curve=eval_curve(run_dir / "metrics.jsonl"),
        run_dir=str(run_dir), train_config=cfg_dict,
        finished=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    if not study.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if point.knob != "baseline" or point.group != "sweep":
            shutil.rmtree(run_dir / "student_final", ignore_errors=True)
    write_json(result_path, rec.to_dict())
    return rec


def _saved_result(study: StudyConfig, result_path: pathlib.Path, cfg_dict: Mapping[str, Any],
                  want_probe: bool) -> RunResult | None:
    """The saved record at `result_path` (marked reused) when it trains the same run (`run_identity`) with the same
    probe metric and batches, and has a probe M if one is wanted; None when it is unreadable or differs."""
    try:
        old = json.loads(result_path.read_text())
    except json.JSONDecodeError:
        return None
    if (old and run_identity(old.get("train_config") or {}) == run_identity(cfg_dict)
            and old.get("metric") == study.metric
            and (not want_probe or old.get("m_probe") is not None)
            and old.get("probe_batches", study.probe_batches) == study.probe_batches):
        old.setdefault("probe_batches", study.probe_batches)
        return dataclasses.replace(RunResult.from_dict(old), reused=True)
    return None


def run_study(study: StudyConfig, log: Log = print) -> dict[str, Any]:
    """Run (or resume) the whole study; writes and returns budget.json's content.

    Order: the baseline point (every quality loss is measured against it), the knee search when enabled, the rest
    of the sweep and the phenomena points; then the budget fit over the sweep, the phenomena, and the outputs
    (budget.json, points.csv, budget.png, summary.md).
    """
    t_start = time.time()
    root = pathlib.Path(study.out_dir)
    fixed, extra = sweep_points(study), phenomena_points(study)
    runner = _start_study(study, root, fixed, extra, log)
    baseline = _baseline(runner(fixed[0]))
    runner.set_baseline(baseline)
    searched = _search_knee(study, runner, baseline, log) if study.knee.enabled else []
    for p in fixed[1:] + extra:
        runner(p)
    sweep = _sweep_order(fixed + [p for p in searched if p.id not in {q.id for q in fixed}])
    rows = [aggregate(p, runner.records[p.id], baseline, study.quality) for p in sweep]
    budget, bracket, interval = _fit_rows(study, rows)
    phen = phenomena(study, sweep, extra, runner.records, rows, baseline, log)
    out = _budget_json(study, budget, bracket, interval, baseline, rows, phen, runner, t_start)
    _add_validity(root, out, log)
    _write_outputs(root, out, rows)
    if not bracket["resolved"]:
        log(f"UNRESOLVED: the knee is not bracketed within a factor {study.knee.factor:g} ({bracket['why']}); "
            f"`opdjax admit` refuses this budget. Enable the knee search (knee.enabled=true) or add levels.")
    log(f"budget B = {budget:.4g} [{interval[0]:.3g}, {interval[1]:.3g}] ({study.metric}, bracket {bracket['why']}); "
        f"wrote {root / 'budget.json'}, points.csv, budget.png, summary.md "
        f"({time.time() - t_start:.0f}s this invocation, {out['timing']['compute_seconds']:.0f}s of runs in all)")
    return out


class _PointRunner:
    """Runs every seed of a point once (`run_one`; a later call for the same point returns its records) and logs
    progress as [done/planned]. `records`: point id -> its RunResults; `done` / `ran`: runs finished / actually run
    (not reused) in this invocation. Once `set_baseline` has given the baseline, every record carries its
    time-/steps-to-quality against it (`against_baseline`, saved with the record)."""

    def __init__(self, study: StudyConfig, planned: int, log: Log):
        self.study, self.planned, self.log = study, planned, log
        self.records: dict[str, list[RunResult]] = {}
        self.done = self.ran = 0
        self.baseline: Mapping[str, Any] | None = None

    def set_baseline(self, baseline: Mapping[str, Any]) -> None:
        """From now on records are measured against `baseline`; those already held are measured now."""
        self.baseline = baseline
        self.records = {pid: [self._measured(r) for r in recs] for pid, recs in self.records.items()}

    def _measured(self, rec: RunResult) -> RunResult:
        """`against_baseline` (its record file rewritten when the figures changed); `rec` before the baseline."""
        if self.baseline is None:
            return rec
        new = against_baseline(rec, self.baseline)
        if json.dumps(new.to_quality) != json.dumps(rec.to_quality):
            write_json(_result_path(self.study, rec.point, rec.seed), new.to_dict())
        return new

    def __call__(self, p: Point) -> list[RunResult]:
        if p.id in self.records:
            return self.records[p.id]
        knee = " + knee" if self.study.knee.enabled else ""
        for s in self.study.seeds_for(p):
            rec = self._measured(run_one(self.study, p, s, self.log))
            self.records.setdefault(p.id, []).append(rec)
            self.done += 1
            at = f"[{self.done}/{self.planned}{knee}] {p.id} seed {s}"
            if rec.reused:
                self.log(f"{at}: done earlier (reused)")
            else:
                self.ran += 1
                mp = "" if rec.m_probe is None else f"M_probe {rec.m_probe:.3g}, "
                self.log(f"{at}: {mp}M_train {rec.m_train_k3:.3g}, RKL {rec.reverse_kl:.3f}, "
                         f"acc {rec.accuracy:.3f} ({rec.probe_seconds + rec.train_seconds:.0f}s)")
        return self.records[p.id]


def _start_study(study: StudyConfig, root: pathlib.Path, fixed: Sequence[Point], extra: Sequence[Point],
                 log: Log) -> _PointRunner:
    """Create `root`, save the study config there, log the plan; the runner for its points."""
    root.mkdir(parents=True, exist_ok=True)
    write_text(root / "study_config.yaml", yaml.safe_dump(to_dict(study), sort_keys=False))
    planned = sum(len(study.seeds_for(p)) for p in (*fixed, *extra))
    log(f"study: {len(fixed)} sweep points + {len(extra)} phenomena points x {len(study.seeds)} seeds "
        f"({len(study.seeds_for())} for the baseline) = {planned} runs"
        f"{' + the knee search' if study.knee.enabled else ''} -> {root}")
    return _PointRunner(study, planned, log)


def _search_knee(study: StudyConfig, runner: _PointRunner, baseline: Mapping[str, Any], log: Log) -> list[Point]:
    """The weight-noise points `knee_search` trained, in order; each measured as (mean M probe, mean q_loss)."""
    searched: list[Point] = []

    def measure(sigma: float) -> tuple[float, float]:
        p = noise_point(sigma)
        searched.append(p)
        recs = runner(p)
        return float(np.mean([r.m_probe for r in recs])), point_effect(recs, baseline, study.quality)[0]

    knee_search(study.knee, study.delta, measure, log)
    return searched


def _fit_rows(study: StudyConfig, rows: list[dict[str, Any]]) -> tuple[float, dict[str, Any], list[float]]:
    """Fit the budget over the aggregated sweep rows: returns (B, knee bracket, B's interval [lo, hi]).

    fit "hinge": `fit.hinge_fit` over every run; "isotonic" / "first_failure": `fit_budget` over the points with
    `budget_interval`. Adds to every row the runs' verdict (from its q_loss CI, the baseline resampled too),
    `within_budget` (the fit's verdict), `q_loss_monotone` (the isotonic fit's value) and `admissible` (M <= B).
    """
    for r in rows:
        r["runs_verdict"] = runs_verdict(r["q_loss_ci"], study.delta)
    pts = [{"m": r["m_probe"], "q_loss": r["q_loss"]} for r in rows]
    if study.fit == "hinge":
        budget, interval, bracket = hinge_fit(calibration_rows(rows), study.quality, study.delta, study.knee.factor)
        within = [bool(r["m_probe"] is not None and r["m_probe"] <= budget) for r in rows]
    else:
        budget, within = fit_budget(pts, study.delta, study.fit)
        bracket = knee_bracket(pts, budget, study.delta, study.knee.factor, study.fit)
        interval = list(budget_interval(rows, study.quality, study.delta, study.fit))
    for r, w, f in zip(rows, within, monotone_q_loss(pts)):
        r["within_budget"] = w
        r["q_loss_monotone"] = f
        r["admissible"] = bool(r["m_probe"] is not None and r["m_probe"] <= budget)
    return budget, bracket, interval


# Kinds whose probe M is taken where training does not see it, so `admit` judges them on training's M: staleness k
# is probed k versions behind a learner just past its warm-up (the run's largest steps), while training's later,
# smaller steps keep its per-step M several times lower (0.07-0.52 of the probe's on sort16_qwen3).
TRAINING_VIEW = ("staleness",)


def kind_budgets(study: StudyConfig, rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """B per kind of mismatch, for each knob other than weight noise that the sweep trained at >= 2 levels (e.g.
    staleness 2, 4, 8): `hinge_fit` over the baseline and that knob's rows. {knob: {"budget", "budget_interval",
    "status", "why", "levels"}}; status RESOLVED / UNRESOLVED as the main B's bracket, or NO_KNEE (with
    "harmless_up_to", `harmless_up_to`) when the fit finds no knee within the levels and they are harmless up to
    some M. A kind in `TRAINING_VIEW` also gets "training" (`training_view_budget`). A budget per kind lets
    `admit` judge a candidate against the harm its own kind does per unit of M."""
    base = [r for r in rows if r["knob"] == "baseline"]
    out = {}
    for knob in sorted({r["knob"] for r in rows} - {"baseline", "weight_noise"}):
        mine = [r for r in rows if r["knob"] == knob]
        if len(mine) < 2 or not base:
            continue
        b, iv, br = hinge_fit(base + mine, study.quality, study.delta, study.knee.factor)
        out[knob] = {"budget": b, "budget_interval": iv, "status": "RESOLVED" if br["resolved"] else "UNRESOLVED",
                     "why": br["why"], "levels": [r["value"] for r in mine]}
        harmless = harmless_up_to(mine)
        if not br["resolved"] and harmless and (not math.isfinite(b) or br.get("beyond") is None):
            out[knob].update(status="NO_KNEE", harmless_up_to=harmless)
        if knob in TRAINING_VIEW:
            out[knob]["training"] = training_view_budget(study, base, mine)
    return out


def training_view_budget(study: StudyConfig, base: Sequence[Mapping[str, Any]],
                         mine: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A kind's B where training sees it: `hinge_fit` with x = each run's training M (the baseline's and the kind's
    runs), and per level the training/probe M ratio with its seed interval (`fit.train_probe_ratio`), which
    converts a probe's M into training's: {"budget", "budget_interval", "status", "why", "ratios": [{"level",
    "ratio", "ratio_interval"}]} (levels in increasing order)."""
    b, iv, br = hinge_fit([*base, *mine], study.quality, study.delta, study.knee.factor, x="m_train")
    ratios = []
    for r in sorted(mine, key=lambda r: float(r["value"])):
        q, lo, hi = train_probe_ratio(r)
        if math.isfinite(q):
            ratios.append({"level": r["value"], "ratio": q, "ratio_interval": [lo, hi]})
    return {"budget": b, "budget_interval": iv, "status": "RESOLVED" if br["resolved"] else "UNRESOLVED",
            "why": br["why"], "ratios": ratios}


def harmless_up_to(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest probe M of a kind's levels up to which every level's runs admit (their q_loss CI within delta,
    `runs_verdict`), in increasing M; None when the first level does not. A kind without a knee up to there is
    known harmless below it, and nothing is known beyond it."""
    top = None
    for r in sorted(rows, key=lambda r: r["m_probe"] if r["m_probe"] is not None else math.inf):
        if r["m_probe"] is None or r.get("runs_verdict") != "admit":
            break
        top = float(r["m_probe"])
    return top


def _budget_json(study: StudyConfig, budget: float, bracket: Mapping[str, Any], interval: list[float],
                 baseline: Mapping[str, Any], rows: list[dict[str, Any]], phen: Mapping[str, Any],
                 runner: _PointRunner, t_start: float) -> dict[str, Any]:
    """budget.json's content: the fit, the points, the phenomena, timing, and what the budget was calibrated on."""
    compute = sum(r.probe_seconds + r.train_seconds for recs in runner.records.values() for r in recs)
    base_cfg = study.train_config_for({}, study.seeds[0])
    return {
        "metric": study.metric, "budget": budget, "delta": study.delta,
        "status": "RESOLVED" if bracket["resolved"] else "UNRESOLVED", "bracket": bracket,
        "budget_interval": interval, "kinds": kind_budgets(study, rows) if study.fit == "hinge" else {},
        "quality": _quality_text(study.quality),
        "baseline": baseline, "points": rows, "phenomena": phen,
        "timing": {"compute_seconds": compute, "wall_seconds_this_invocation": time.time() - t_start,
                   "runs": runner.done, "runs_this_invocation": runner.ran},
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "calibrated_on": setup_fingerprint(base_cfg, log=lambda m: None),
        "config": {"study": to_dict(study), "base_train_config": to_dict(base_cfg)},
    }


def _add_validity(root: pathlib.Path, out: dict[str, Any], log: Log) -> None:
    """out["validity"] from root/validity.json (benchmarks/admission_validity.py writes it) when readable."""
    validity = root / "validity.json"
    if validity.is_file():
        try:
            out["validity"] = json.loads(validity.read_text())
        except json.JSONDecodeError:
            log(f"ignoring unreadable {validity}")


def _write_outputs(root: pathlib.Path, out: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
    """budget.json, points.csv, budget.png and summary.md under `root`."""
    write_json(root / "budget.json", out)
    write_csv(root / "points.csv", rows)
    plot(root / "budget.png", out)
    write_text(root / "summary.md", summary_markdown(out))


def _baseline(base_recs: Sequence[RunResult]) -> dict[str, Any]:
    """The baseline's reference values (`fit.baseline_stats`): quality losses are measured against its seeds; plus
    each seed's per-step movement (median `policy/step_k3`), the student's step size the staleness knob rests on."""
    out = baseline_stats({k: [getattr(r, k) for r in base_recs]
                          for k in ("reverse_kl", "accuracy", "initial_reverse_kl", "initial_accuracy")})
    out["policy_step_k3_median_seeds"] = [r.policy_step_k3_median for r in base_recs]
    return out


def _sweep_order(points: Sequence[Point]) -> list[Point]:
    """Baseline, weight noise by sigma, then staleness and recipes in their given order."""
    order = {"baseline": 0, "weight_noise": 1}
    return sorted(points, key=lambda p: (order.get(p.knob, 2), p.value if p.knob == "weight_noise" else 0))


def _quality_text(quality: str) -> str:
    if quality == "reverse_kl":
        return ("relative increase of the final held-out reverse KL(student||teacher) over the mismatch-free "
                "baseline, as a ratio of geometric means over seeds: q_loss = GM(RKL + 0.1) / GM(RKL_base + 0.1) "
                "- 1 (one stalled seed cannot decide it); its CI resamples the point's and the baseline's seeds")
    return ("absolute drop of final held-out greedy accuracy versus the mismatch-free baseline: mean(acc_base) - "
            "mean(acc); its CI resamples the point's and the baseline's seeds")
