"""`opdjax bench` and `opdjax plan`: what an admitted candidate buys in time to quality on the user's own hardware.

    bench   time the phases of a few OPD steps of the baseline and of each candidate on the running engines (the
            config's own: in-process, or the `rollout.endpoints` / `teacher.endpoints` servers), through the public
            `opdjax.pipeline.train`: per step, g = generate seconds, l = score + train + publish seconds
    plan    per candidate of an `admit --out` report: verdict, M, steps factor S, per-step cost factor C, and the
            predicted time-to-quality factor F = S * C (below 1: the candidate reaches the quality sooner)

Steps factor S (from the study's budget.json, whose points carry each seed's steps-to-quality): mean steps to
fraction f of the way from the initial to the baseline's final reverse KL for the candidate's mismatch, over the
baseline's mean. "measured": the study trained the candidate's own knob (same weight_noise / stale_versions /
recipe); "by M": interpolated linearly in log M between the two study points whose probed M bracket the
candidate's (the baseline counts as S = 1 at the smallest M), clamped at the ends. A seed that never reaches f
counts its last step (S is then a lower bound, flagged "censored"). The interval is a percentile bootstrap over the
seeds of the point(s) and of the baseline.

Per-step cost factor C (a model over the measured phase times): the baseline is sync, t0 = g0 + l0. A candidate with
`rollout.stale_versions = k >= 1` stands for async training with `pipeline.max_staleness = k`, its rollouts
sampled on hardware other than the learner's while the learner trains: t = max(g, l); any other candidate is sync,
t = g + l. C = t / t0. The overlap is ideal (no contention between the two sides), so C is the most async can give;
the disaggregated benchmark (`benchmarks/bench_disaggregated.py`) measures how close a real run comes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

from opdjax.admission.admit import candidate_config, candidate_overrides, matching_point, split_candidate
from opdjax.admission.budget import AdmissionError
from opdjax.pipeline.loop import train

__all__ = ["PHASES", "PhaseTimes", "PlanRow", "bench", "format_plan", "phase_medians", "phase_times", "plan",
           "step_cost", "steps_factor", "steps_to_quality"]

LEARNER_PHASES = ("time/score", "time/train", "time/publish")
PHASES = ("time/wait", "time/generate", *LEARNER_PHASES)


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Median seconds per step: `generate` (the rollout engine), `learner` (score + train + publish), and the
    measured `step` (wait + score + train + publish) of the run that timed them."""

    candidate: str
    generate: float
    learner: float
    step: float
    steps: int


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate's plan: its verdict and M (admit), S with its interval and source, the mode its per-step cost
    assumes, C, and F = S * C with S's interval carried through (C is a point estimate)."""

    candidate: str
    verdict: str
    m: float
    steps_factor: float
    steps_factor_ci: tuple[float, float]
    steps_source: str       # measured | by M | censored ...
    mode: str               # sync | async (max_staleness k)
    step_cost: float        # C
    ttq_factor: float       # F = S * C
    ttq_factor_ci: tuple[float, float]


def phase_medians(metric_rows: Sequence[Mapping[str, Any]], skip: int = 2) -> dict[str, float]:
    """Median seconds per step over the trained steps of metrics.jsonl rows after the first `skip` (compilation;
    a run too short keeps every step): each `time/<phase>` of PHASES, "learner" (score + train + publish) and "step"
    (wait + score + train + publish: in sync mode `wait` holds `generate`, in async it is the time the learner
    waited for the worker), each the median of its per-step value; "steps" counts the steps. {} without a step."""
    rows = [r for r in metric_rows if "loss" in r]
    rows = rows[skip:] or rows
    if not rows:
        return {}
    med = lambda f: float(statistics.median(f(r) for r in rows))  # noqa: E731
    out = {k: med(lambda r, k=k: r.get(k, 0.0)) for k in PHASES}
    out["learner"] = med(lambda r: sum(r.get(k, 0.0) for k in LEARNER_PHASES))
    out["step"] = med(lambda r: r.get("time/wait", 0.0) + sum(r.get(k, 0.0) for k in LEARNER_PHASES))
    return {**out, "steps": len(rows)}


def phase_times(metric_rows: Sequence[Mapping[str, Any]], candidate: str, skip: int = 2) -> PhaseTimes:
    """`PhaseTimes` of metrics.jsonl rows (`phase_medians`); AdmissionError when the run logged no trained step."""
    med = phase_medians(metric_rows, skip)
    if not med:
        raise AdmissionError(f"bench {candidate!r}: the run logged no trained step")
    return PhaseTimes(candidate=candidate, generate=med["time/generate"], learner=med["learner"], step=med["step"],
                      steps=med["steps"])


def bench(candidates: Sequence[str], *, config: str | Mapping[str, Any] | None = None, overrides: Sequence[str] = (),
          steps: int = 8, log=print) -> list[PhaseTimes]:
    """Time `steps` sync OPD steps of the baseline ("baseline": `config` <- `overrides`) and of each candidate (its
    overrides on top) with `opdjax.pipeline.train`, evaluation off; their `PhaseTimes`, the baseline first. Every
    candidate is parsed and validated before the first run."""
    if steps < 3:
        raise AdmissionError(f"--steps must be >= 3 (the first steps compile and are left out), got {steps}")
    runs = [("baseline", [])] + [(c, split_candidate(c)) for c in candidates]
    fixed = [f"pipeline.steps={steps}", "pipeline.mode=sync", "pipeline.eval_every=0", "pipeline.checkpoint_every=0",
             "pipeline.progress=false", "pipeline.tensorboard=false", "pipeline.overwrite=true"]
    cfgs = [candidate_config(config, overrides, [*parts, *fixed]) for _, parts in runs]
    out = []
    with tempfile.TemporaryDirectory(prefix="opdjax-bench-") as tmp:
        for i, ((name, _), cfg) in enumerate(zip(runs, cfgs)):
            log(f"timing {name} ({steps} steps) ...")
            cfg.pipeline.out_dir = str(pathlib.Path(tmp) / f"run{i}")
            train(cfg, log=lambda s: None)
            rows = [json.loads(x) for x in (pathlib.Path(cfg.pipeline.out_dir) / "metrics.jsonl").read_text().split(
                "\n") if x.strip()]
            out.append(phase_times(rows, name))
    return out


def step_cost(cand: PhaseTimes, base: PhaseTimes, candidate: str) -> tuple[float, str]:
    """C = t / t0 with t0 = g0 + l0 (sync baseline) and t = max(g, l) for a candidate with rollout.stale_versions
    k >= 1 (async, max_staleness k), else g + l; and the mode it stands for."""
    k = int(float(candidate_overrides(candidate).get("rollout.stale_versions", 0)))
    t0 = base.generate + base.learner
    if not t0 > 0:
        raise AdmissionError("bench: the baseline's step took no time; time more steps")
    if k >= 1:
        return max(cand.generate, cand.learner) / t0, f"async (max_staleness {k})"
    return (cand.generate + cand.learner) / t0, "sync"


def steps_to_quality(point: Mapping[str, Any], fraction: str) -> tuple[np.ndarray, bool] | None:
    """Per-seed steps to `fraction` of a budget.json point, shape [seeds] (a seed that never reached it counts its
    last step), and whether any was censored; None when the point's seeds carry no steps-to-quality (a study run
    before the training clock was logged)."""
    seeds = point.get("seeds") or []
    if not seeds or any("steps_to_quality" not in s for s in seeds):
        return None
    steps, censored = [], False
    for s in seeds:
        k = (s["steps_to_quality"] or {}).get(fraction)
        censored |= k is None
        steps.append(s["train_steps"] if k is None else k)
    return np.asarray(steps, np.float64), censored


def _ratio_draws(a: np.ndarray, base: np.ndarray, n: int, rng) -> np.ndarray:
    """Bootstrap draws of mean(a) / mean(base), each resampled over its own seeds, shape [n]."""
    return a[rng.integers(0, a.size, (n, a.size))].mean(1) / base[rng.integers(0, base.size, (n, base.size))].mean(1)


def _bracket(curve: Sequence[tuple[float, Mapping]], m: float) -> tuple[Mapping, Mapping, float]:
    """The two points (sorted by probed M) around m and the weight w of the upper one in log M (clamped to [0, 1])."""
    ms = [x for x, _ in curve]
    if m <= ms[0]:
        return curve[0][1], curve[0][1], 0.0
    if m >= ms[-1]:
        return curve[-1][1], curve[-1][1], 0.0
    j = int(np.searchsorted(ms, m))
    (m_a, a), (m_b, b) = curve[j - 1], curve[j]
    return a, b, (math.log(m) - math.log(m_a)) / (math.log(m_b) - math.log(m_a))


def steps_factor(points: Sequence[Mapping[str, Any]], candidate: str, m: float, *, fraction: str = "0.9",
                 n: int = 2000, seed: int = 0) -> tuple[float, tuple[float, float], str]:
    """S, its 95% bootstrap interval and its source ("measured" / "by M", "+ censored" when a seed never reached
    the fraction): see the module docstring. AdmissionError when the study's points carry no steps-to-quality."""
    table = {p["id"]: steps_to_quality(p, fraction) for p in points if p.get("group") == "sweep"}
    base = next((p for p in points if p.get("group") == "sweep" and p.get("knob") == "baseline"), None)
    if base is None or table.get(base["id"]) is None:
        raise AdmissionError("the budget's study records no steps-to-quality for its baseline (a study run before "
                             "opdjax logged a training clock); rerun `opdjax study` to plan with it")
    rng = np.random.default_rng(seed)
    b_steps, cens = table[base["id"]]
    match = matching_point(points, candidate)
    if match is not None and table.get(match["id"]) is not None:
        a_steps, c = table[match["id"]]
        draws, source, cens = _ratio_draws(a_steps, b_steps, n, rng), "measured", cens or c
        est = a_steps.mean() / b_steps.mean()
    else:
        curve = sorted(((float(p["m_probe"]), p) for p in points if table.get(p["id"]) is not None
                        and p.get("m_probe") is not None and p["m_probe"] > 0), key=lambda x: x[0])
        lo, hi, w = _bracket(curve, m)
        (sa, ca), (sb, cb) = table[lo["id"]], table[hi["id"]]
        draws = (1 - w) * _ratio_draws(sa, b_steps, n, rng) + w * _ratio_draws(sb, b_steps, n, rng)
        est = ((1 - w) * sa.mean() + w * sb.mean()) / b_steps.mean()
        source, cens = "by M", cens or ca or cb
    q_lo, q_hi = np.quantile(draws, [0.025, 0.975])
    return float(est), (float(q_lo), float(q_hi)), source + (" + censored" if cens else "")


def plan(admitted: Sequence[Mapping[str, Any]], points: Sequence[Mapping[str, Any]], times: Sequence[PhaseTimes], *,
         fraction: str = "0.9") -> list[PlanRow]:
    """One PlanRow per admit row (`AdmitRow.to_dict()`: candidate, verdict, m) whose candidate `times` holds (the
    baseline's times first); AdmissionError naming a candidate bench did not time."""
    by_name = {t.candidate: t for t in times}
    if "baseline" not in by_name:
        raise AdmissionError("the bench report has no 'baseline' row (write it with `opdjax bench`)")
    rows = []
    for r in admitted:
        cand = r["candidate"]
        if cand not in by_name:
            raise AdmissionError(f"candidate {cand!r} was not timed: run `opdjax bench` with it (timed: "
                                 f"{sorted(by_name)})")
        s, s_ci, source = steps_factor(points, cand, float(r["m"]), fraction=fraction)
        c, mode = step_cost(by_name[cand], by_name["baseline"], cand)
        rows.append(PlanRow(candidate=cand, verdict=r["verdict"], m=float(r["m"]), steps_factor=s,
                            steps_factor_ci=s_ci, steps_source=source, mode=mode, step_cost=c, ttq_factor=s * c,
                            ttq_factor_ci=(s_ci[0] * c, s_ci[1] * c)))
    return rows


def format_plan(rows: Sequence[PlanRow], fraction: str = "0.9") -> str:
    """The table: candidate, verdict, M, steps factor S [CI] (source), mode, per-step cost C, F = S * C [CI] and the
    speed-up 1/F; a legend line."""
    w = max([len("candidate")] + [len(r.candidate) for r in rows])
    lines = [f"{'candidate':<{w}}  {'verdict':>9}  {'M':>9}  {'steps factor S [95%]':>24}  {'mode':>22}  "
             f"{'C':>5}  {'time-to-quality F [95%]':>25}  {'speed-up':>8}"]
    for r in rows:
        s = f"{r.steps_factor:.2f} [{r.steps_factor_ci[0]:.2f}, {r.steps_factor_ci[1]:.2f}]"
        f = f"{r.ttq_factor:.2f} [{r.ttq_factor_ci[0]:.2f}, {r.ttq_factor_ci[1]:.2f}]"
        lines.append(f"{r.candidate:<{w}}  {r.verdict:>9}  {r.m:9.3g}  {s:>24}  {r.mode:>22}  {r.step_cost:5.2f}  "
                     f"{f:>25}  {1 / r.ttq_factor:7.2f}x")
        if r.steps_source != "measured":
            lines.append(f"{'':<{w}}  steps factor {r.steps_source}")
    lines.append(f"S: steps to {fraction} of the way to the baseline's final reverse KL, over the baseline's (the "
                 f"study); C: per-step seconds over the sync baseline's (bench; async = ideal overlap); F = S * C")
    return "\n".join(lines)
