"""The study's configuration: `StudyConfig` (with the knee search's `KneeConfig` and the phenomena's `RLConfig` and
`ShiftConfig`), its one loader `load_study`, and `round_level`, the rounding of weight-noise levels to the point
ids. `opdjax.study.study` runs a study; `opdjax.study.phenomena` reads the same config.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping, Sequence


from opdjax import quant
from opdjax.config import ConfigError, TrainConfig, deep_update, from_dict, load, read_config_file
from opdjax.core import corrections, mismatch
from opdjax.study.fit import FITS, QUALITIES
from opdjax.study.records import Point, noise_point

__all__ = ["KneeConfig", "RLConfig", "SMALL_OVERRIDES", "ShiftConfig", "StudyConfig", "load_study", "round_level"]


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
        return noise_point(sigma, "rl", _merged(self.common, self.overrides), probe=False, label="rl")

    def opd_point(self, sigma: float) -> "Point | None":
        """The OPD run of the comparison when `common` is set (else None: the sweep's runs are used)."""
        return noise_point(sigma, "rl", self.common, probe=False, label="opd_rl") if self.common else None


def _merged(a: Mapping, b: Mapping) -> dict:
    return deep_update(json.loads(json.dumps(dict(a))), json.loads(json.dumps(dict(b))))


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

        for c in self.corrections:
            if c not in corrections.CORRECTIONS or c == "none":
                raise ConfigError(f"shift.corrections: unknown correction {c!r}; choose from "
                                  f"{sorted(set(corrections.CORRECTIONS) - {'none'})}")


@dataclasses.dataclass
class KneeConfig:
    """Weight-noise levels chosen from the pair itself, so the sweep brackets the knee on any student/teacher.

    With `enabled`, after the baseline the study trains sigma = `start` (every seed), then multiplies sigma by
    `step` while the point stays within tolerance (mean quality loss <= delta) or divides it while it does not,
    until one point is within and one beyond; then it bisects log sigma between the closest such pair until their
    probe M differ by at most `factor` (or `max_points` sigma points have been trained, or sigma leaves
    [min_sigma, max_sigma]). Bisecting log sigma bisects log M where M grows as a power of sigma. Levels are
    rounded to 3 significant digits (the point ids), so a resumed study retraces the same levels.

    `factor` is also the widest bracket [largest M within tolerance, smallest M beyond] around B that the study
    accepts, with or without the search: a wider or open one makes the budget UNRESOLVED (`fit.knee_bracket`).
    """

    enabled: bool = False
    start: float = 0.01
    step: float = 4.0
    factor: float = 3.0
    max_points: int = 8
    min_sigma: float = 1e-4
    max_sigma: float = 1.0

    def validate(self):
        if not 0 < self.min_sigma <= self.start <= self.max_sigma:
            raise ConfigError(f"knee: need 0 < min_sigma <= start <= max_sigma, got {self.min_sigma}, {self.start}, "
                              f"{self.max_sigma}")
        if not self.step > 1:
            raise ConfigError(f"knee.step must be > 1, got {self.step}")
        if not self.factor > 1:
            raise ConfigError(f"knee.factor must be > 1 (the widest bracket accepted, M beyond / M within), got "
                              f"{self.factor}")
        if not isinstance(self.max_points, int) or isinstance(self.max_points, bool) or self.max_points < 2:
            raise ConfigError(f"knee.max_points must be an int >= 2, got {self.max_points!r}")


def round_level(sigma: float) -> float:
    """sigma to 3 significant digits: the weight-noise levels a study trains (and its point ids)."""
    return float(f"{sigma:.3g}")


# The most seeds `seeds` (or `baseline_seeds`) may list: each is a full training run of every point it applies to.
MAX_SEEDS = 1000


@dataclasses.dataclass
class StudyConfig:
    out_dir: str = "runs/study"
    train_config: str | None = None   # base TrainConfig YAML (default: the embedded defaults)
    base: dict = dataclasses.field(default_factory=dict)  # TrainConfig overrides for every run (nested, like YAML)
    seeds: tuple = (0, 1)              # each run sets seed and rollout.seed (prompt order, sampling, noise draws)
    baseline_seeds: tuple = ()         # the baseline's seeds (empty: `seeds`); every interval carries its noise
    weight_noise: tuple = (0.0, 0.01, 0.03, 0.1, 0.3)   # rollout.weight_noise sigma; 0 is the baseline
    staleness: tuple = (1, 2)          # rollout.stale_versions k
    recipes: tuple = ("fp8_w8a8",)     # rollout.recipe presets (quant.RECIPES) or recipe files
    metric: str = "k3"                 # the mismatch scale of the budget (probe metric)
    probe_batches: int = 4
    quality: str = "reverse_kl"        # reverse_kl: relative increase of final held-out RKL; accuracy: abs. drop
    delta: float = 0.25                # tolerated quality loss
    fit: str = "hinge"                 # hinge (dose-response over every run) | isotonic | first_failure (`fit`)
    keep_checkpoints: bool = False     # False: delete each run's checkpoints/ (the baseline keeps student_final)
    knee: KneeConfig = dataclasses.field(default_factory=KneeConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    shift: ShiftConfig = dataclasses.field(default_factory=ShiftConfig)

    def validate(self) -> "StudyConfig":
        if self.metric not in mismatch.ESTIMATORS:
            raise ConfigError(f"metric: probe metric {self.metric!r} is not supported; choose one of "
                              f"{sorted(mismatch.ESTIMATORS)}")
        if self.fit not in FITS:
            raise ConfigError(f"fit={self.fit!r} is not valid; choose one of {list(FITS)}")
        if self.quality not in QUALITIES:
            raise ConfigError(f"quality={self.quality!r} is not valid; choose one of {list(QUALITIES)}")
        if not self.delta >= 0:
            raise ConfigError(f"delta must be >= 0, got {self.delta}")
        for what, seeds in (("seeds", self.seeds), ("baseline_seeds", self.baseline_seeds)):
            if len(seeds) > MAX_SEEDS:
                raise ConfigError(f"{what}: {len(seeds):,} seeds; a study trains every point once per seed, at most "
                                  f"{MAX_SEEDS:,} seeds (its intervals need a few, 8 to 32 in the shipped studies)")
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds):
            raise ConfigError(f"seeds must be a non-empty list of ints, got {list(self.seeds)}")
        for what, seeds in (("seeds", self.seeds), ("baseline_seeds", self.baseline_seeds or self.seeds)):
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
                raise ConfigError(f"{what} must be a list of ints, got {list(seeds)}")
            if len(set(seeds)) != len(seeds):
                raise ConfigError(f"{what} has duplicates: {list(seeds)}")
        if self.probe_batches < 1:
            raise ConfigError(f"probe_batches must be > 0, got {self.probe_batches}")
        _levels("weight_noise", self.weight_noise)
        for k in self.staleness:
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ConfigError(f"staleness values must be ints >= 0, got {k!r}")
        for r in self.recipes:
            if not isinstance(r, str) or not (r in quant.RECIPES or quant.is_recipe_file(r)):
                raise ConfigError(f"recipes: unknown recipe {r!r}; presets: {sorted(quant.RECIPES)} "
                                  "(or a .json/.yaml recipe file)")
        levels = len(set(self.weight_noise) - {0, 0.0}) + len(self.staleness) + len(self.recipes)
        if self.fit == "hinge" and not self.knee.enabled and levels < 2:
            raise ConfigError(f"fit=hinge needs at least 2 mismatch levels besides the baseline (weight_noise > 0, "
                              f"staleness, recipes), got {levels}: add levels, enable the knee search, or use "
                              "fit=isotonic")
        self.knee.validate()
        self.rl.validate()
        self.shift.validate()
        self.train_config_for({}, self.seeds[0])  # base overrides checked now, not after an hour of runs
        return self

    def seeds_for(self, point: Point | None = None) -> tuple:
        """The seeds a point trains: `baseline_seeds` (when set) for the sweep's mismatch-free baseline, the point
        every quality loss is measured against (None: that point); `seeds` for every other point, the phenomena's
        own clean references included."""
        is_base = point is None or (point.knob == "baseline" and point.group == "sweep")
        return tuple(self.baseline_seeds) if is_base and self.baseline_seeds else tuple(self.seeds)

    def train_config_for(self, overrides: Mapping[str, Any], seed: int, out_dir: str | None = None) -> TrainConfig:
        """The TrainConfig of one run: train_config YAML <- base <- point overrides <- seed (<- out_dir)."""
        d: dict[str, Any] = {}
        if self.train_config is not None:
            try:
                d = read_config_file(self.train_config)
            except ConfigError as e:
                raise ConfigError(f"train_config: {e}") from None
        deep_update(d, json.loads(json.dumps(self.base)))
        deep_update(d, json.loads(json.dumps(dict(overrides))))
        deep_update(d, {"seed": seed, "rollout": {"seed": seed}})
        pipe = {"progress": False, "resume": False}
        if out_dir is not None:
            pipe["out_dir"] = out_dir
        deep_update(d, {"pipeline": pipe})
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
    "seeds=[0]", "weight_noise=[0, 0.3]", "staleness=[1]", "recipes=[]", "fit=isotonic",  # 3 runs: no hinge fit
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
