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
under results/ (the resume record: a finished run whose resolved TrainConfig is unchanged is not rerun).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import shutil
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml

from opdjax.budget.admission import AdmissionError, load_budget, setup_fingerprint
from opdjax.config import ConfigError, TrainConfig, _deep_update, from_dict, load, to_dict

Log = Callable[[str], None]

QUALITIES = ("reverse_kl", "accuracy")
FITS = ("isotonic", "first_failure")
TRAIN_METRICS = ("k3", "k1", "abs_log_ratio_p95")  # per-step mismatch/<key> averaged over a run


# ----------------------------------------------------------------------------------------------------- config


@dataclasses.dataclass
class RLConfig:
    """Phenomenon (a): the RL baseline (task reward) versus OPD at the same weight-noise levels.

    Every level runs OPD and RL (`overrides` on top of the study's `base`), both with `common` on top (e.g. a
    student that still earns some reward: RL from a student with accuracy 0 gets no signal at all); each method's
    degradation is measured against its own noise-free run. With `common` empty the OPD runs are the sweep's.
    """

    enabled: bool = True
    weight_noise: tuple = (0.0, 0.1, 0.3)      # 0 is each method's clean reference (added when missing)
    common: dict = dataclasses.field(default_factory=dict)
    overrides: dict = dataclasses.field(default_factory=lambda: {
        "loss": {"name": "reinforce"}, "rollout": {"samples_per_prompt": 4, "batch_size": 8}})

    def validate(self):
        _levels("rl.weight_noise", self.weight_noise)

    def levels(self) -> list[float]:
        return sorted({0.0} | {float(s) for s in self.weight_noise})

    def rl_point(self, sigma: float) -> "Point":
        return _noise_point(sigma, "rl", _merged(self.common, self.overrides), probe=False, label="rl")

    def opd_point(self, sigma: float) -> "Point | None":
        """The OPD run of the comparison when `common` is set (else None: the sweep's runs are used)."""
        return _noise_point(sigma, "rl", self.common, probe=False, label="opd_rl") if self.common else None


def _merged(a: Mapping, b: Mapping) -> dict:
    return _deep_update(json.loads(json.dumps(dict(a))), json.loads(json.dumps(dict(b))))


@dataclasses.dataclass
class ShiftConfig:
    """Phenomenon (b): prefix shift under weight noise, and what per-token corrections do about it.

    `weight_noise` levels are measured on the untrained student and on the baseline's trained student (seed of
    the first run): `prompts` held-out prompts, clean and perturbed engines sampling with the same seed.
    `corrections` are trained (OPD) at `correction_noise`, a level beyond the budget, and compared with the
    uncorrected run at that level.
    """

    enabled: bool = True
    weight_noise: tuple = (0.01, 0.03, 0.1, 0.3)
    prompts: int = 256
    correction_noise: float = 0.3
    corrections: tuple = ("token_tis", "token_mis")

    def validate(self):
        _levels("shift.weight_noise", self.weight_noise)
        if self.prompts < 1:
            raise ConfigError(f"shift.prompts must be > 0, got {self.prompts}")
        if not self.correction_noise > 0:
            raise ConfigError(f"shift.correction_noise must be > 0, got {self.correction_noise}")
        from opdjax.core import mismatch

        for c in self.corrections:
            if c not in mismatch.CORRECTIONS or c == "none":
                raise ConfigError(f"shift.corrections: unknown correction {c!r}; choose from "
                                  f"{sorted(set(mismatch.CORRECTIONS) - {'none'})}")


@dataclasses.dataclass
class StudyConfig:
    out_dir: str = "runs/study"
    train_config: str | None = None   # base TrainConfig YAML (default: the embedded defaults)
    base: dict = dataclasses.field(default_factory=dict)  # TrainConfig overrides for every run (nested, like YAML)
    seeds: tuple = (0, 1)              # each run sets seed and rollout.seed (prompt order, sampling, noise draws)
    weight_noise: tuple = (0.0, 0.01, 0.03, 0.1, 0.3)   # rollout.weight_noise sigma; 0 is the baseline
    staleness: tuple = (1, 2)          # rollout.stale_versions k
    recipes: tuple = ("fp8_w8a8",)     # rollout.recipe presets (quant.RECIPES) or recipe files
    metric: str = "k3"                 # the mismatch scale of the budget (probe metric)
    probe_batches: int = 4
    quality: str = "reverse_kl"        # reverse_kl: relative increase of final held-out RKL; accuracy: abs. drop
    delta: float = 0.25                # tolerated quality loss
    fit: str = "isotonic"              # isotonic (q_loss monotone in M) | first_failure (see fit_budget)
    keep_checkpoints: bool = False     # False: delete each run's checkpoints/ (the baseline keeps student_final)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    shift: ShiftConfig = dataclasses.field(default_factory=ShiftConfig)

    def validate(self) -> "StudyConfig":
        from opdjax import quant
        from opdjax.budget.probe import per_sequence_terms

        try:
            per_sequence_terms(self.metric, np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1, 1)))
        except ValueError as e:
            raise ConfigError(f"metric: {e}") from None
        if self.fit not in FITS:
            raise ConfigError(f"fit={self.fit!r} is not valid; choose one of {list(FITS)}")
        if self.quality not in QUALITIES:
            raise ConfigError(f"quality={self.quality!r} is not valid; choose one of {list(QUALITIES)}")
        if not self.delta >= 0:
            raise ConfigError(f"delta must be >= 0, got {self.delta}")
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds):
            raise ConfigError(f"seeds must be a non-empty list of ints, got {list(self.seeds)}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds has duplicates: {list(self.seeds)}")
        if self.probe_batches < 1:
            raise ConfigError(f"probe_batches must be > 0, got {self.probe_batches}")
        _levels("weight_noise", self.weight_noise)
        for k in self.staleness:
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ConfigError(f"staleness values must be ints >= 0, got {k!r}")
        for r in self.recipes:
            if not isinstance(r, str) or not (r in quant.RECIPES or r.endswith((".json", ".yaml", ".yml"))):
                raise ConfigError(f"recipes: unknown recipe {r!r}; presets: {sorted(quant.RECIPES)} "
                                  "(or a .json/.yaml recipe file)")
        self.rl.validate()
        self.shift.validate()
        self.train_config_for({}, self.seeds[0])  # base overrides checked now, not after an hour of runs
        return self

    def train_config_for(self, overrides: Mapping[str, Any], seed: int, out_dir: str | None = None) -> TrainConfig:
        """The TrainConfig of one run: train_config YAML <- base <- point overrides <- seed (<- out_dir)."""
        d: dict[str, Any] = {}
        if self.train_config is not None:
            p = pathlib.Path(self.train_config)
            if not p.is_file():
                raise ConfigError(f"train_config: file {p} does not exist")
            d = yaml.safe_load(p.read_text()) or {}
            if not isinstance(d, dict):
                raise ConfigError(f"train_config {p}: the top level must be a mapping")
        _deep_update(d, json.loads(json.dumps(self.base)))
        _deep_update(d, json.loads(json.dumps(dict(overrides))))
        _deep_update(d, {"seed": seed, "rollout": {"seed": seed}})
        pipe = {"progress": False, "resume": False}
        if out_dir is not None:
            pipe["out_dir"] = out_dir
        _deep_update(d, {"pipeline": pipe})
        try:
            cfg = from_dict(TrainConfig, d)
            return cfg.validate()
        except ConfigError as e:
            raise ConfigError(f"study base/point config: {e}") from None


def _levels(name: str, values) -> None:
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ConfigError(f"{name} values must be numbers >= 0, got {v!r}")


# `--small`: 3 sweep points, few steps, one seed; phenomena on one noise level (a smoke test of the whole study).
SMALL_OVERRIDES = [
    "seeds=[0]", "weight_noise=[0, 0.3]", "staleness=[1]", "recipes=[]",
    "base.pipeline.steps=20", "base.pipeline.eval_every=20", "base.pipeline.eval_prompts=32",
    "probe_batches=2", "rl.weight_noise=[0, 0.3]", "shift.weight_noise=[0.1, 0.3]", "shift.prompts=64",
    "shift.correction_noise=0.3", "shift.corrections=[token_tis]",
]


def load_study(path: str | pathlib.Path | None = None, overrides: Sequence[str] = (), *,
               small: bool = False) -> StudyConfig:
    """Defaults <- YAML <- (--small) <- key=value overrides, validated (ConfigError on bad keys or values).

    `small` writes to `<out_dir>_small` unless `out_dir=` is overridden, so it never replaces a full study's results.
    """
    study = load(StudyConfig, path, [*(SMALL_OVERRIDES if small else []), *overrides])
    if small and not any(o.startswith("out_dir=") for o in overrides):
        study.out_dir = study.out_dir.rstrip("/") + "_small"
    return study


# ----------------------------------------------------------------------------------------------------- points


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration to train: `group` sweep (enters the budget fit) | rl | correction."""

    group: str
    knob: str            # baseline | weight_noise | staleness | recipe
    value: Any
    overrides: Mapping[str, Any]
    probe: bool = True   # measure m_probe (sweep points)
    label: str = ""

    @property
    def id(self) -> str:
        v = str(self.value).replace("/", "_").replace(os.sep, "_")
        head = "" if self.group == "sweep" else f"{self.label}__"
        return head + ("baseline" if self.knob == "baseline" else f"{self.knob}={v}")


def _noise_point(sigma: float, group: str = "sweep", extra: Mapping | None = None, probe: bool = True,
                 label: str = "") -> Point:
    over = {"rollout": {"weight_noise": float(sigma)}}
    if extra:
        over = _deep_update(json.loads(json.dumps(dict(extra))), over)
    if sigma == 0:
        return Point(group, "baseline", 0, over, probe, label)
    return Point(group, "weight_noise", float(sigma), over, probe, label)


def sweep_points(study: StudyConfig) -> list[Point]:
    """Baseline, then weight noise, staleness and recipe points (the budget fit uses these)."""
    pts = [Point("sweep", "baseline", 0, {})]
    pts += [_noise_point(s) for s in sorted(set(study.weight_noise)) if s > 0]
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
        pts += [_noise_point(s, "correction", {"loss": {"correction": c}}, probe=False, label=c)
                for c in study.shift.corrections]
        extra_opd |= {s} - sweep_noise
    # OPD at levels outside the sweep: trained for comparison, kept out of the budget fit.
    pts += [_noise_point(s, "correction", None, probe=False, label="opd") for s in sorted(extra_opd)]
    return pts


# ----------------------------------------------------------------------------------------------------- one run


def _write_json(path: pathlib.Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _finite_mean(xs) -> float:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.mean(xs)) if xs else float("nan")


def train_mismatch(metrics_path: pathlib.Path) -> dict[str, Any]:
    """Mean per-step mismatch/{k3,k1,abs_log_ratio_p95} of a run, plus its divergence signs.

    `nonfinite_steps` counts steps whose loss or grad norm was NaN/inf; `reward_last` (RL runs) is the mean
    reward over the last 10% of steps.
    """
    steps = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    steps = [s for s in steps if "loss" in s]
    out: dict[str, Any] = {f"m_train_{k}": _finite_mean(s.get(f"mismatch/{k}") for s in steps) for k in TRAIN_METRICS}
    out["nonfinite_steps"] = sum(1 for s in steps if not all(math.isfinite(float(s.get(k, 0.0)))
                                                           for k in ("loss", "grad_norm")))
    tail = steps[-max(len(steps) // 10, 1):]
    if steps and "reward_mean" in steps[0]:
        out["reward_last"] = _finite_mean(s.get("reward_mean") for s in tail)
    out["teacher_kl_last"] = _finite_mean(s.get("teacher_kl") for s in tail)
    return out


def run_one(study: StudyConfig, point: Point, seed: int, log: Log = print) -> dict[str, Any]:
    """Probe (sweep points) and train one (point, seed); returns the result record (also saved as JSON).

    A record whose `train_config` equals the one this study would use now is reused without running anything.
    """
    from opdjax.pipeline import loop as pipeline
    from opdjax.budget.probe import probe

    root = pathlib.Path(study.out_dir)
    result_path = root / "results" / point.id / f"seed{seed}.json"
    run_dir = root / "runs" / point.id / f"seed{seed}"
    cfg = study.train_config_for(point.overrides, seed, out_dir=str(run_dir))
    cfg_dict = to_dict(cfg)
    want_probe = point.probe
    if result_path.is_file():
        try:
            old = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            old = None
        if (old and old.get("train_config") == cfg_dict and old.get("metric") == study.metric
                and (not want_probe or old.get("m_probe") is not None)
                and old.get("probe_batches", study.probe_batches) == study.probe_batches):
            old["reused"] = True
            return old
        log(f"  {point.id} seed {seed}: config changed since the saved result; rerunning")
    quiet = lambda s: None  # noqa: E731
    t0 = time.time()
    pr = probe(cfg, batches=study.probe_batches, metric=study.metric, seed=seed, log=quiet) if want_probe else None
    t1 = time.time()
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a partial run from an interrupted study: start it over
    summary = pipeline.train(cfg, log=quiet)
    t2 = time.time()
    rec: dict[str, Any] = {
        "point": point.id, "group": point.group, "knob": point.knob, "value": point.value, "label": point.label,
        "seed": seed, "metric": study.metric, "probe_batches": study.probe_batches,
        "m_probe": pr.m if pr else None, "m_probe_ci": [pr.ci_low, pr.ci_high] if pr else None,
        "probe_metrics": pr.metrics if pr else None, "probe_tokens": pr.tokens if pr else None,
        "reverse_kl": summary["final"]["eval/reverse_kl"], "accuracy": summary["final"]["eval/accuracy"],
        "initial_reverse_kl": summary["initial"]["eval/reverse_kl"],
        "initial_accuracy": summary["initial"]["eval/accuracy"],
        "probe_seconds": t1 - t0, "train_seconds": t2 - t1, "steps": summary["steps"],
        **train_mismatch(run_dir / "metrics.jsonl"),
        "run_dir": str(run_dir), "train_config": cfg_dict,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if not study.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if point.knob != "baseline" or point.group != "sweep":
            shutil.rmtree(run_dir / "student_final", ignore_errors=True)
    _write_json(result_path, rec)
    rec["reused"] = False
    return rec


# ----------------------------------------------------------------------------------------------------- fitting


def quality_losses(records: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> list[float]:
    """Per-seed quality loss against the baseline means (NaN/inf final quality -> +inf loss).

    reverse_kl: (rkl - rkl_base) / rkl_base;  accuracy: acc_base - acc.
    """
    out = []
    for r in records:
        if quality == "reverse_kl":
            x, base = r["reverse_kl"], baseline["reverse_kl"]
            q = (x - base) / max(abs(base), 1e-9)
        else:
            x, base = r["accuracy"], baseline["accuracy"]
            q = base - x
        out.append(float(q) if x is not None and math.isfinite(x) else math.inf)
    return out


def fit_budget(points: Sequence[Mapping[str, Any]], delta: float, method: str = "isotonic"
               ) -> tuple[float, list[bool]]:
    """Budget B and each point's within-tolerance flag.

    within_i = (q_loss_i <= delta)  (NaN/inf q_loss: not within). Points without a finite m are ignored by the fit.
    method "isotonic" (default): quality loss is assumed non-decreasing in M, so q_loss is replaced by its
        isotonic (monotone non-decreasing) regression on M (`monotone_q_loss`); B is the largest m whose fitted
        loss is <= delta (0.0 when none is). One noisy point is pooled with its neighbours instead of deciding B
        alone; a diverged point (inf) pools to inf, so nothing at or beyond it is admitted.
    method "first_failure": walk the points in increasing m (ties: all must be within); B is the m of the last
        point before the first one not within — the most conservative reading of the raw points.
    """
    if method not in FITS:
        raise ValueError(f"fit method {method!r} is not valid; choose one of {list(FITS)}")
    within = [bool(math.isfinite(p["q_loss"]) and p["q_loss"] <= delta) if p.get("q_loss") is not None else False
              for p in points]
    if method == "isotonic":
        ok = {i: f <= delta for i, f in enumerate(monotone_q_loss(points)) if f is not None}
    else:
        ok = {i: within[i] for i, p in enumerate(points) if p.get("m") is not None and math.isfinite(p["m"])}
    budget = 0.0
    for m in sorted({points[i]["m"] for i in ok}):  # increasing m; tied points stand or fall together
        if not all(v for i, v in ok.items() if points[i]["m"] == m):
            break
        budget = float(m)
    return budget, within


def monotone_q_loss(points: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Isotonic regression of q_loss on m (pool adjacent violators; NaN/inf count as +inf; tied m pooled first,
    weighted by their count). None for points without a finite m or q_loss."""
    idx = sorted((i for i, p in enumerate(points) if p.get("m") is not None and math.isfinite(p["m"])
                  and p.get("q_loss") is not None), key=lambda i: points[i]["m"])
    blocks: list[list] = []  # [sum, weight, members]
    for i in idx:
        q = float(points[i]["q_loss"])
        q = q if math.isfinite(q) else math.inf
        if blocks and points[blocks[-1][2][-1]]["m"] == points[i]["m"]:
            blocks[-1][0] += q
            blocks[-1][1] += 1
            blocks[-1][2].append(i)
        else:
            blocks.append([q, 1, [i]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, w_, m_ = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += w_
            blocks[-1][2].extend(m_)
    out: list[float | None] = [None] * len(points)
    for s_, w_, members in blocks:
        for i in members:
            out[i] = s_ / w_
    return out


def _spread(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, float)
    fin = a[np.isfinite(a)]
    return {"mean": float(a.mean()) if a.size else float("nan"),
            "std": float(fin.std(ddof=1)) if fin.size > 1 else 0.0,
            "min": float(a.min()) if a.size else float("nan"), "max": float(a.max()) if a.size else float("nan")}


def aggregate(point: Point, recs: Sequence[Mapping], baseline: Mapping[str, float], quality: str) -> dict[str, Any]:
    """One row of budget.json's `points`: means over seeds, CI union, per-seed values and spread."""
    losses = quality_losses(recs, baseline, quality)
    probes = [r["m_probe"] for r in recs if r.get("m_probe") is not None]
    row = {
        "id": point.id, "group": point.group, "knob": point.knob, "value": point.value, "label": point.label,
        "m_probe": float(np.mean(probes)) if probes else None,
        "m_probe_ci": ([float(min(r["m_probe_ci"][0] for r in recs)), float(max(r["m_probe_ci"][1] for r in recs))]
                       if probes else None),
        "m_train": _finite_mean(r["m_train_k3"] for r in recs),
        "m_train_k1": _finite_mean(r["m_train_k1"] for r in recs),
        "m_train_abs_log_ratio_p95": _finite_mean(r["m_train_abs_log_ratio_p95"] for r in recs),
        "q_reverse_kl": float(np.mean([r["reverse_kl"] for r in recs])),
        "q_accuracy": float(np.mean([r["accuracy"] for r in recs])),
        "q_loss": float(np.mean(losses)),
        "q_loss_spread": _spread(losses),
        "seeds": [{"seed": r["seed"], "m_probe": r.get("m_probe"), "m_train": r["m_train_k3"],
                   "reverse_kl": r["reverse_kl"], "accuracy": r["accuracy"], "q_loss": q,
                   "nonfinite_steps": r["nonfinite_steps"], **({"reward_last": r["reward_last"]}
                                                               if "reward_last" in r else {})}
                  for r, q in zip(recs, losses)],
        "seconds": float(sum(r["probe_seconds"] + r["train_seconds"] for r in recs)),
    }
    return row


# ----------------------------------------------------------------------------------------------------- prefix shift


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first completion token where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prefix_shift(student_path: str | pathlib.Path, cfg: TrainConfig, sigmas: Sequence[float], *, prompts: int,
                 seeds: Sequence[int]) -> list[dict[str, float]]:
    """Clean versus weight-noise engines under shared sampling noise, on held-out prompts.

    Both engines sample with the same seed, so row j uses the same per-step random keys in both: the completions
    coincide until the perturbed distribution flips a sample. Per sigma (means over `seeds`, which also draw the
    noise): frac_diverged (completions differ), first_div_mean (mean first differing completion position over
    diverged rows), same_prefix_at (fraction still identical after t = 1.. tokens), answer_changed (decoded
    answers differ), seq_kl = mean_b Σ_t (log mu - log pi) on the perturbed samples (an unbiased estimate of
    the sequence-level KL(mu‖pi), pi = clean), token_k3, accuracy_clean / accuracy_perturbed (greedy is not
    used: these are sampled answers at the run's temperature).
    """
    from opdjax.pipeline import loop as pipeline
    from opdjax.data import tasks
    from opdjax.data.prompts import encode_prompts
    from opdjax.models import ModelConfig, hf
    from opdjax.models.tiny import load_tokenizer
    from opdjax.rollout.jax_engine import JaxEngine

    tok = load_tokenizer(student_path)
    mcfg = ModelConfig.from_dir(student_path)
    _, params = hf.load_state(student_path, mcfg)
    task = tasks.get_task(cfg.task.name, **cfg.task.options)
    examples = task.examples(prompts, cfg.seed + 7, "heldout")
    enc = encode_prompts(tok, examples)
    sp = pipeline.sampling_params(cfg, tok)
    T = max(cfg.rollout.temperature, 1e-6)
    kw = dict(pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    clean = JaxEngine(mcfg, params, **kw)
    N = cfg.rollout.max_new_tokens

    def texts(batch):
        return pipeline.completion_texts(tok, batch)

    out = []
    for sigma in sigmas:
        acc: dict[str, list] = {}
        for s in seeds:
            a = clean.generate(enc, sp, seed=1000 + s)
            noisy = JaxEngine(mcfg, params, weight_noise=float(sigma), noise_seed=s, **kw)
            b = noisy.generate(enc, sp, seed=1000 + s)
            ca, cb = a.completions(), b.completions()
            fd = [_first_divergence(x, y) for x, y in zip(ca, cb)]
            div = [d for d in fd if d is not None]
            pi = clean.score(b.tokens_BL, b.valid_BL, temperature=T)["logp_BL"]
            m = b.completion_mask_BL
            r = np.where(m, pi - b.rollout_logp_BL, 0.0)
            ta, tb = texts(a), texts(b)
            ga = [task.grade(e, t) or 0.0 for e, t in zip(examples, ta)]
            gb = [task.grade(e, t) or 0.0 for e, t in zip(examples, tb)]
            vals = {
                "frac_diverged": len(div) / len(fd),
                "first_div_mean": float(np.mean(div)) if div else float("nan"),
                "answer_changed": float(np.mean([x != y for x, y in zip(ta, tb)])),
                "seq_kl": float((-r).sum(1).mean()),
                "token_k3": float((np.expm1(r) - r)[m].mean()) if m.any() else 0.0,
                "accuracy_clean": float(np.mean(ga)), "accuracy_perturbed": float(np.mean(gb)),
            }
            for t in range(1, N + 1):
                vals[f"same_prefix_at_{t}"] = float(np.mean([d is None or d >= t for d in fd]))
            for k, v in vals.items():
                acc.setdefault(k, []).append(v)
        out.append({"weight_noise": float(sigma), **{k: _finite_mean(v) for k, v in acc.items()}})
    return out


# ----------------------------------------------------------------------------------------------------- the study


def run_study(study: StudyConfig, log: Log = print) -> dict[str, Any]:
    """Run (or resume) the whole study; writes and returns budget.json's content."""
    t_start = time.time()
    root = pathlib.Path(study.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "study_config.yaml").write_text(yaml.safe_dump(to_dict(study), sort_keys=False))
    sweep, extra = sweep_points(study), phenomena_points(study)
    todo = [(p, s) for p in sweep + extra for s in study.seeds]
    log(f"study: {len(sweep)} sweep points + {len(extra)} phenomena points x {len(study.seeds)} seeds "
        f"= {len(todo)} runs -> {root}")
    records: dict[str, list[dict]] = {}
    ran = 0
    for i, (p, s) in enumerate(todo):
        rec = run_one(study, p, s, log)
        records.setdefault(p.id, []).append(rec)
        if rec["reused"]:
            log(f"[{i + 1}/{len(todo)}] {p.id} seed {s}: done earlier (reused)")
        else:
            ran += 1
            mp = "" if rec["m_probe"] is None else f"M_probe {rec['m_probe']:.3g}, "
            log(f"[{i + 1}/{len(todo)}] {p.id} seed {s}: {mp}M_train {rec['m_train_k3']:.3g}, "
                f"RKL {rec['reverse_kl']:.3f}, acc {rec['accuracy']:.3f} "
                f"({rec['probe_seconds'] + rec['train_seconds']:.0f}s)")
    base_recs = records["baseline"]
    baseline = {"reverse_kl": float(np.mean([r["reverse_kl"] for r in base_recs])),
                "accuracy": float(np.mean([r["accuracy"] for r in base_recs])),
                "reverse_kl_seeds": [r["reverse_kl"] for r in base_recs],
                "accuracy_seeds": [r["accuracy"] for r in base_recs],
                "initial_reverse_kl": float(np.mean([r["initial_reverse_kl"] for r in base_recs])),
                "initial_accuracy": float(np.mean([r["initial_accuracy"] for r in base_recs]))}
    rows = [aggregate(p, records[p.id], baseline, study.quality) for p in sweep]
    pts = [{"m": r["m_probe"], "q_loss": r["q_loss"]} for r in rows]
    budget, within = fit_budget(pts, study.delta, study.fit)
    for r, w, f in zip(rows, within, monotone_q_loss(pts)):
        r["within_budget"] = w
        r["q_loss_monotone"] = f
        r["admissible"] = bool(r["m_probe"] is not None and r["m_probe"] <= budget)
    phen = phenomena(study, sweep, extra, records, rows, baseline, log)
    compute = sum(r["probe_seconds"] + r["train_seconds"] for recs in records.values() for r in recs)
    base_cfg = study.train_config_for({}, study.seeds[0])
    out = {
        "metric": study.metric, "budget": budget, "delta": study.delta,
        "quality": _quality_text(study.quality),
        "baseline": baseline, "points": rows, "phenomena": phen,
        "timing": {"compute_seconds": compute, "wall_seconds_this_invocation": time.time() - t_start,
                   "runs": len(todo), "runs_this_invocation": ran},
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "calibrated_on": setup_fingerprint(base_cfg, log=lambda m: None),
        "config": {"study": to_dict(study), "base_train_config": to_dict(base_cfg)},
    }
    validity = root / "validity.json"  # from benchmarks/admission_validity.py, rendered in the summary
    if validity.is_file():
        try:
            out["validity"] = json.loads(validity.read_text())
        except json.JSONDecodeError:
            log(f"ignoring unreadable {validity}")
    _write_json(root / "budget.json", out)
    write_csv(root / "points.csv", rows)
    plot(root / "budget.png", out)
    (root / "summary.md").write_text(summary_markdown(out))
    log(f"budget B = {budget:.4g} ({study.metric}); wrote {root / 'budget.json'}, points.csv, budget.png, summary.md "
        f"({time.time() - t_start:.0f}s this invocation, {compute:.0f}s of runs in all)")
    return out


def _quality_text(quality: str) -> str:
    if quality == "reverse_kl":
        return ("relative increase of the final held-out reverse KL(student||teacher) over the mismatch-free "
                "baseline: q_loss = (RKL - RKL_base) / RKL_base (RKL_base = mean over baseline seeds)")
    return "absolute drop of final held-out greedy accuracy versus the mismatch-free baseline: acc_base - acc"


def phenomena(study: StudyConfig, sweep: list[Point], extra: list[Point], records: Mapping[str, list[dict]],
              rows: list[dict], baseline: Mapping, log: Log) -> dict[str, Any]:
    """Tables for (a) OPD vs RL under weight noise, (b) prefix shift and per-token corrections."""
    by_id = {r["id"]: r for r in rows}
    out: dict[str, Any] = {}

    def opd_row(sigma: float, pid: str | None = None) -> dict | None:
        if pid is not None:
            recs = records.get(pid)
        else:
            pid = "baseline" if sigma == 0 else _noise_point(sigma).id
            recs = records[pid] if pid in records else records.get(
                _noise_point(sigma, "correction", None, False, "opd").id)
        if not recs:
            return None
        row = by_id.get(pid)
        return {"reverse_kl": float(np.mean([r["reverse_kl"] for r in recs])),
                "accuracy": float(np.mean([r["accuracy"] for r in recs])),
                "reverse_kl_seeds": [r["reverse_kl"] for r in recs], "accuracy_seeds": [r["accuracy"] for r in recs],
                "m_probe": row["m_probe"] if row else None, "m_train": _finite_mean(r["m_train_k3"] for r in recs),
                "nonfinite_steps": int(sum(r["nonfinite_steps"] for r in recs))}

    if study.rl.enabled:
        rl_levels = study.rl.levels()
        table = []
        rl0 = records[study.rl.rl_point(0.0).id]
        rl0_acc = float(np.mean([r["accuracy"] for r in rl0]))
        rl0_rkl = float(np.mean([r["reverse_kl"] for r in rl0]))
        opd_for_rl = (lambda s: opd_row(s, study.rl.opd_point(s).id)) if study.rl.common else opd_row
        opd0 = opd_for_rl(0.0)
        for s in rl_levels:
            recs = records[study.rl.rl_point(s).id]
            rl = {"reverse_kl": float(np.mean([r["reverse_kl"] for r in recs])),
                  "accuracy": float(np.mean([r["accuracy"] for r in recs])),
                  "accuracy_seeds": [r["accuracy"] for r in recs],
                  "reward_last": _finite_mean(r.get("reward_last") for r in recs),
                  "m_train": _finite_mean(r["m_train_k3"] for r in recs),
                  "nonfinite_steps": int(sum(r["nonfinite_steps"] for r in recs))}
            rl["accuracy_drop"] = rl0_acc - rl["accuracy"]
            rl["reverse_kl_rel_increase"] = (rl["reverse_kl"] - rl0_rkl) / max(abs(rl0_rkl), 1e-9)
            opd = opd_for_rl(s)
            if opd is not None and opd0 is not None:
                opd["accuracy_drop"] = opd0["accuracy"] - opd["accuracy"]
                opd["reverse_kl_rel_increase"] = (opd["reverse_kl"] - opd0["reverse_kl"]) / max(
                    abs(opd0["reverse_kl"]), 1e-9)
            table.append({"weight_noise": s, "opd": opd, "rl": rl})
        out["rl_vs_opd"] = {"overrides": study.rl.overrides, "common": study.rl.common, "levels": table}

    if study.shift.enabled:
        base_recs = records["baseline"]
        first = base_recs[0]
        cfg = study.train_config_for({}, study.seeds[0])
        from opdjax.pipeline.loop import resolve_models

        student0, _ = resolve_models(cfg, log=lambda s: None)
        trained = pathlib.Path(first["run_dir"]) / "student_final"
        log("prefix shift: clean vs perturbed engines under shared sampling noise ...")
        t0 = time.time()
        shift = {"initial_student": prefix_shift(student0, cfg, study.shift.weight_noise,
                                                 prompts=study.shift.prompts, seeds=study.seeds)}
        if trained.is_dir():
            shift["trained_student"] = prefix_shift(trained, cfg, study.shift.weight_noise,
                                                    prompts=study.shift.prompts, seeds=study.seeds)
        shift["seconds"] = time.time() - t0
        out["prefix_shift"] = shift
        if study.shift.corrections:
            s = float(study.shift.correction_noise)
            ref = opd_row(s)
            table = [{"correction": "none", **(ref or {})}]
            for c in study.shift.corrections:
                recs = records[_noise_point(s, "correction", {"loss": {"correction": c}}, False, c).id]
                table.append({"correction": c, "reverse_kl": float(np.mean([r["reverse_kl"] for r in recs])),
                              "accuracy": float(np.mean([r["accuracy"] for r in recs])),
                              "reverse_kl_seeds": [r["reverse_kl"] for r in recs],
                              "accuracy_seeds": [r["accuracy"] for r in recs],
                              "m_train": _finite_mean(r["m_train_k3"] for r in recs)})
            for t in table:
                if "reverse_kl" in t:
                    t["q_loss"] = quality_losses([t], baseline, study.quality)[0]
            out["corrections"] = {"weight_noise": s, "rows": table}
    return out


# ----------------------------------------------------------------------------------------------------- outputs

CSV_FIELDS = ["id", "group", "knob", "value", "m_probe", "m_probe_ci_low", "m_probe_ci_high", "m_train",
              "m_train_k1", "m_train_abs_log_ratio_p95", "q_reverse_kl", "q_accuracy", "q_loss", "q_loss_std",
              "q_loss_min", "q_loss_max", "n_seeds", "within_budget", "admissible", "seconds"]


def write_csv(path: pathlib.Path, rows: Sequence[Mapping]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            ci = r["m_probe_ci"] or [None, None]
            sp = r["q_loss_spread"]
            w.writerow({**{k: r.get(k) for k in CSV_FIELDS}, "m_probe_ci_low": ci[0], "m_probe_ci_high": ci[1],
                        "q_loss_std": sp["std"], "q_loss_min": sp["min"], "q_loss_max": sp["max"],
                        "n_seeds": len(r["seeds"])})


_STYLE = {"baseline": ("k", "o"), "weight_noise": ("tab:blue", "o"), "staleness": ("tab:orange", "s"),
          "recipe": ("tab:green", "^")}


def plot(path: pathlib.Path, result: Mapping[str, Any]) -> None:
    """Quality loss (and final accuracy) versus M on a log axis: per-seed dots, mean with seed range and probe CI,
    the tolerance delta and the budget B; knobs by colour and marker. The baseline (M ~ 0) sits at the left edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    ms = [r["m_probe"] for r in rows if r["m_probe"] is not None and r["knob"] != "baseline" and r["m_probe"] > 0]
    lo = min(ms + [result["budget"]] if result["budget"] > 0 else ms) if ms else 1e-6
    floor = lo / 10
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, ylab in ((axes[0], "q_loss", "quality loss (rel. increase of held-out reverse KL)"
                           if result["config"]["study"]["quality"] == "reverse_kl" else "accuracy drop"),
                          (axes[1], "accuracy", "final held-out accuracy")):
        seen = set()
        for r in rows:
            m = r["m_probe"] if r["m_probe"] is not None else float("nan")
            x = max(m, floor) if r["knob"] == "baseline" else m
            if not x > 0:
                continue
            colour, marker = _STYLE.get(r["knob"], ("tab:gray", "x"))
            ys = [s["q_loss"] if key == "q_loss" else s["accuracy"] for s in r["seeds"]]
            y = r["q_loss"] if key == "q_loss" else r["q_accuracy"]
            ci = r["m_probe_ci"] or [m, m]
            xerr = None if r["knob"] == "baseline" else [[max(x - max(ci[0], floor), 0)], [max(ci[1] - x, 0)]]
            fin = [v for v in ys if math.isfinite(v)]
            yerr = [[y - min(fin)], [max(fin) - y]] if fin and math.isfinite(y) else None
            label = r["knob"] if r["knob"] not in seen else None
            seen.add(r["knob"])
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt=marker, color=colour, ms=8, capsize=3, label=label,
                        mfc="white" if not r.get("within_budget", True) else colour)
            ax.scatter([x] * len(fin), fin, s=10, color=colour, alpha=0.4)
            tag = "baseline" if r["knob"] == "baseline" else f"{r['value']}"
            ax.annotate(tag, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"M = probe {result['metric']} (engine vs learner, log scale; baseline at left edge)")
        ax.set_ylabel(ylab)
        if result["budget"] > 0:
            ax.axvline(result["budget"], color="tab:red", ls="--", label=f"budget B = {result['budget']:.3g}")
        if key == "q_loss":
            ax.axhline(result["delta"], color="tab:red", ls=":", label=f"tolerance delta = {result['delta']}")
            ax.set_yscale("symlog", linthresh=1.0)  # linear near the tolerance, log for diverged runs
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("Mismatch budget: quality vs mismatch (mean ± seed range; hollow = outside tolerance)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x, fmt=".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def _calibrated_on_lines(on: Mapping[str, Any] | None) -> list[str]:
    if not on:
        return []
    return [f"Calibrated on: student weights sha256 `{on['student_sha256'][:16]}`, "
            f"teacher `{on['teacher_sha256'][:16]}` (jax {on.get('jax', '?')}, {on.get('machine', '?')}). "
            "The built-in pair is trained locally, so it can differ between machines; `opdjax admit` warns when it "
            "probes other weights.", ""]


def summary_markdown(result: Mapping[str, Any]) -> str:
    s = result["config"]["study"]
    b = result["baseline"]
    base_cfg = result["config"]["base_train_config"]
    L = [f"# Mismatch budget study ({result['created']})", "",
         f"**Budget B = {result['budget']:.4g}** ({result['metric']} of engine vs learner on sampled tokens, measured "
         f"by the admission probe) at tolerance delta = {result['delta']}.", "",
         f"Quality loss: {result['quality']}. A point is within tolerance iff its *mean* loss over seeds "
         f"({len(s['seeds'])}: {s['seeds']}) is ≤ delta. "
         + ("B is the largest M at which the isotonic (monotone non-decreasing in M) fit of the points' mean losses "
            "stays ≤ delta, so one noisy point is pooled with its neighbours and a diverged point stops B."
            if s.get("fit", "isotonic") == "isotonic" else
            "B is the largest M reached walking the points in increasing M until the first point outside the "
            "tolerance (conservative: later points never raise B)."), "",
         f"Runs: OPD ({base_cfg['loss']['name']}), {base_cfg['pipeline']['steps']} steps, "
         f"lr {base_cfg['optim']['lr']}, "
         f"batch {base_cfg['rollout']['batch_size']}, task {base_cfg['task']['name']}. Baseline (no mismatch): "
         f"held-out reverse KL {b['initial_reverse_kl']:.2f} → {b['reverse_kl']:.3f} (seeds "
         f"{', '.join(f'{x:.3f}' for x in b['reverse_kl_seeds'])}), accuracy {b['initial_accuracy']:.2f} → "
         f"{b['accuracy']:.3f}.", "", *_calibrated_on_lines(result.get("calibrated_on")),
         "![quality vs mismatch](budget.png)", "",
         "| point | M probe (95% CI) | M train k3 | train k1 | train abs-log-ratio p95 | final RKL | accuracy | "
         "q_loss mean (seed min..max) | monotone fit | within delta | M ≤ B |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["points"], key=lambda r: (r["m_probe"] if r["m_probe"] is not None else -1)):
        ci = r["m_probe_ci"] or [None, None]
        sp = r["q_loss_spread"]
        L.append(f"| {r['id']} | {_f(r['m_probe'])} ({_f(ci[0])}–{_f(ci[1])}) | {_f(r['m_train'])} | "
                 f"{_f(r['m_train_k1'])} | {_f(r['m_train_abs_log_ratio_p95'])} | {r['q_reverse_kl']:.3f} | "
                 f"{r['q_accuracy']:.3f} | {r['q_loss']:+.3f} ({sp['min']:+.3f}..{sp['max']:+.3f}) | "
                 f"{_f(r.get('q_loss_monotone'), '+.3f')} | "
                 f"{'yes' if r['within_budget'] else '**no**'} | {'yes' if r['admissible'] else 'no'} |")
    ph = result.get("phenomena", {})
    if "rl_vs_opd" in ph:
        rv = ph["rl_vs_opd"]
        L += ["", "## (a) OPD versus the RL baseline under weight noise", "",
              f"RL = task-reward policy gradient with overrides `{json.dumps(rv['overrides'])}`"
              + (f"; both methods with `{json.dumps(rv['common'])}`" if rv.get("common")
                 else "; OPD = the sweep's runs")
              + ". Each method is compared with its own noise-free run (same seeds, same steps).", "",
              "| sigma | M probe | OPD RKL | OPD acc | OPD acc drop | OPD RKL rel. increase | RL acc | RL acc drop | "
              "RL reward (last 10%) | RL RKL rel. increase | non-finite steps (OPD/RL) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in rv["levels"]:
            o, r = t["opd"] or {}, t["rl"]
            L.append(f"| {t['weight_noise']} | {_f(o.get('m_probe'))} | {_f(o.get('reverse_kl'), '.3f')} | "
                     f"{_f(o.get('accuracy'), '.3f')} | {_f(o.get('accuracy_drop'), '+.3f')} | "
                     f"{_f(o.get('reverse_kl_rel_increase'), '+.2f')} | {r['accuracy']:.3f} | "
                     f"{r['accuracy_drop']:+.3f} | {_f(r['reward_last'], '.3f')} | "
                     f"{r['reverse_kl_rel_increase']:+.2f} | "
                     f"{o.get('nonfinite_steps', '–')}/{r['nonfinite_steps']} |")
        L += ["", _rl_verdict(rv)]
    if "prefix_shift" in ph:
        sh = ph["prefix_shift"]
        L += ["", "## (b) Prefix shift under weight noise", "",
              "Clean and perturbed engines sample the same held-out prompts with the same seed (same per-row keys), "
              "so completions coincide until the perturbation flips a sample. first div = mean first differing "
              "completion position among diverged rows; seq KL = mean Σ_t (log mu − log pi) on the perturbed "
              "samples."]
        for which, tab in sh.items():
            if which == "seconds":
                continue
            N = len([k for k in tab[0] if k.startswith("same_prefix_at_")]) if tab else 0
            L += ["", f"**{which.replace('_', ' ')}**", "",
                  "| sigma | frac diverged | first div | answer changed | seq KL | token k3 | "
                  + " | ".join(f"same prefix ≥{t}" for t in range(1, N + 1)) + " |",
                  "|---|---|---|---|---|---|" + "---|" * N]
            for t in tab:
                L.append(f"| {t['weight_noise']} | {t['frac_diverged']:.3f} | {_f(t['first_div_mean'], '.2f')} | "
                         f"{t['answer_changed']:.3f} | {t['seq_kl']:.4f} | {t['token_k3']:.4g} | "
                         + " | ".join(f"{t[f'same_prefix_at_{k}']:.3f}" for k in range(1, N + 1)) + " |")
    if "corrections" in ph:
        c = ph["corrections"]
        L += ["", f"## (b') Per-token corrections at sigma = {c['weight_noise']} (beyond the budget)", "",
              "| correction | final RKL (seeds) | accuracy (seeds) | q_loss vs baseline | M train k3 |",
              "|---|---|---|---|---|"]
        for t in c["rows"]:
            if "reverse_kl" not in t:
                continue
            rkl_seeds = ", ".join(f"{x:.2f}" for x in t["reverse_kl_seeds"])
            acc_seeds = ", ".join(f"{x:.2f}" for x in t["accuracy_seeds"])
            L.append(f"| {t['correction']} | {t['reverse_kl']:.3f} ({rkl_seeds}) | {t['accuracy']:.3f} ({acc_seeds}) | "
                     f"{t['q_loss']:+.3f} | {_f(t.get('m_train'))} |")
        L += ["", _corr_verdict(c, result["delta"])]
    if result.get("validity"):
        L += ["", "## Admission validity", "", validity_markdown(result["validity"], result["budget"])]
    tm = result["timing"]
    L += ["", "## Timing", "",
          f"{tm['runs']} runs, {tm['compute_seconds'] / 60:.1f} min of probe+training in all; this invocation "
          f"{tm['wall_seconds_this_invocation'] / 60:.1f} min wall ({tm['runs_this_invocation']} runs, the rest "
          "reused from results/)."]
    return "\n".join(L) + "\n"


def straddles(q_loss_seeds: Sequence[float], delta: float) -> bool:
    """True when some seeds' quality loss is within delta and others beyond it (a seed-decided full-run verdict)."""
    within = [q <= delta for q in q_loss_seeds]
    return any(within) and not all(within)


def validity_markdown(rep: Mapping[str, Any], current_budget: float | None = None) -> str:
    """The admission-validity table (benchmarks/admission_validity.py writes `validity.json`)."""
    L = [f"Candidates that are not study points: the probe verdict of `opdjax admit` against B = {rep['budget']:.3g} "
         f"({rep['metric']}) versus the verdict of full runs at the candidate (the study's config and seeds "
         f"{rep['seeds']}; admit iff mean q_loss ≤ delta = {rep['delta']}). UNCERTAIN counts as not admitted.", ""]
    if current_budget is not None and not math.isclose(current_budget, rep["budget"], rel_tol=1e-9):
        L += [f"*Validated against B = {rep['budget']:.4g}; the study's B is now {current_budget:.4g} — rerun "
              "`python benchmarks/admission_validity.py`.*", ""]
    L += ["| candidate | probe M [95% CI] | probe verdict | full-run RKL per seed | q_loss per seed | q_loss | "
          "full run | agree |", "|---|---|---|---|---|---|---|---|"]
    split = {True: [0, 0], False: [0, 0]}  # straddles delta -> [agree, n]
    for r in rep["rows"]:
        rkl = " / ".join(f"{x:.2f}" for x in r["reverse_kl_seeds"])
        qs = " / ".join(f"{x:+.2f}" for x in r["q_loss_seeds"])
        st = straddles(r["q_loss_seeds"], rep["delta"])
        split[st][0] += bool(r["agree"])
        split[st][1] += 1
        L.append(f"| `{r['candidate']}` | {r['m']:.2e} [{r['ci'][0]:.2e}, {r['ci'][1]:.2e}] | {r['verdict']} | "
                 f"{rkl} | {qs} | {r['q_loss']:+.2f} | {'admit' if r['should_admit'] else 'reject'}"
                 f"{' (seeds straddle delta)' if st else ''} | {'yes' if r['agree'] else '**no**'} |")
    L += ["", f"Agreement: **{rep['agreement']}/{rep['n']}** (target ≥ 5 of 6): {split[False][0]}/{split[False][1]} "
          f"where every seed's q_loss falls on the same side of delta, {split[True][0]}/{split[True][1]} where the "
          "seeds straddle it (there the full-run verdict itself is decided by the seed draw).", "",
          f"Probe cost: `opdjax admit` took {rep['admit_wall_seconds']:.1f} s for {rep['n']} candidates "
          f"({rep['probe_seconds_per_candidate']:.1f} s each, model load and compilation included; slowest single "
          f"probe {rep['max_probe_seconds']:.1f} s) against {rep['mean_study_point_seconds']:.0f} s for one study "
          f"point ({len(rep['seeds'])} seeds, probe + training): **{100 * rep['probe_cost_ratio']:.1f}%** "
          "(target < 5%)."]
    return "\n".join(L)


def _rl_verdict(rv) -> str:
    worst = max(rv["levels"], key=lambda t: t["weight_noise"])
    o, r = worst["opd"] or {}, worst["rl"]
    return (f"At the largest level (sigma = {worst['weight_noise']}): OPD accuracy drop "
            f"{_f(o.get('accuracy_drop'), '+.3f')}, reverse-KL change {_f(o.get('reverse_kl_rel_increase'), '+.2f')}; "
            f"RL accuracy drop {r['accuracy_drop']:+.3f}, reverse-KL change {r['reverse_kl_rel_increase']:+.2f}, "
            f"non-finite RL steps {r['nonfinite_steps']}.")


def _corr_verdict(c, delta) -> str:
    rows = [t for t in c["rows"] if "q_loss" in t]
    if not rows:
        return ""
    none = next((t for t in rows if t["correction"] == "none"), None)
    parts = [f"{t['correction']}: q_loss {t['q_loss']:+.3f}" for t in rows]
    fixed = [t["correction"] for t in rows if t["correction"] != "none" and t["q_loss"] <= delta]
    head = "; ".join(parts) + "."
    if none is not None and none["q_loss"] > delta:
        head += (" None of the corrections brings the loss back within delta." if not fixed else
                 f" Within delta with: {', '.join(fixed)}.")
    return head


# ----------------------------------------------------------------------------------------------------- budget file

# budget.json has one reader, `admission.load_budget` (-> admission.Budget); a bad file raises AdmissionError.
BudgetError = AdmissionError


# ----------------------------------------------------------------------------------------------------- CLI


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
                                                "out_dir=runs/s2 base.student=DIR")
    p.set_defaults(func=_study_command)
    return p


__all__ = ["StudyConfig", "RLConfig", "ShiftConfig", "Point", "load_study", "sweep_points", "phenomena_points",
           "run_one", "run_study", "fit_budget", "quality_losses", "prefix_shift", "load_budget", "BudgetError",
           "add_study_command", "SMALL_OVERRIDES"]
