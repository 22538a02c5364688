"""The budget file and what it was calibrated on: `Budget`, `load_budget` (the one reader of budget.json),
`setup_fingerprint` and the warning when a budget is applied to another student/teacher pair.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import platform
from typing import Any, Mapping

import jax
import jaxlib

from opdjax.config import to_dict
from opdjax.core import mismatch
from opdjax.core.errors import InputError
from opdjax.pipeline.inputs import resolve_models

__all__ = ["AdmissionError", "Budget", "TrainingView", "harmonic_mix", "load_budget", "setup_fingerprint",
           "calibration_warning"]


class AdmissionError(InputError):
    """A missing or malformed budget file, a malformed candidate, or a recipe that cannot be searched or served."""


@dataclasses.dataclass(frozen=True)
class TrainingView:
    """A kind's B where training sees it (budget.json `kinds.<knob>.training`, `study.training_view_budget`): B and
    its interval on training's M, and the training/probe M ratio r with its interval at each level the study trained
    (levels_L increasing)."""

    budget: float
    interval: tuple[float, float]
    levels_L: tuple[float, ...]
    ratio_L: tuple[float, ...]
    ratio_lo_L: tuple[float, ...]
    ratio_hi_L: tuple[float, ...]

    def ratio(self, level: float) -> tuple[float, float, float]:
        """(r, lo, hi) at `level`: log-log interpolation between the two trained levels around it (each of r, lo, hi
        on its own); outside the trained levels r is unknown and taken as max(1, every recorded hi) for all three
        — the probe's own M when it overstates training's at every level (r <= 1), so the verdict there is no
        laxer than on the probe's M."""
        lv = self.levels_L
        if not lv or not lv[0] <= level <= lv[-1]:
            out = max([1.0, *self.ratio_hi_L])
            return out, out, out
        i = max(j for j in range(len(lv)) if lv[j] <= level)
        if lv[i] == level or i == len(lv) - 1:
            return self.ratio_L[i], self.ratio_lo_L[i], self.ratio_hi_L[i]
        t = math.log(level / lv[i]) / math.log(lv[i + 1] / lv[i])
        mid = lambda ys: math.exp((1 - t) * math.log(ys[i]) + t * math.log(ys[i + 1]))  # noqa: E731
        return mid(self.ratio_L), mid(self.ratio_lo_L), mid(self.ratio_hi_L)

    def in_probe_units(self, level: float) -> tuple[float, float, float]:
        """(B / r, lo / r_hi, hi / r_lo): the probe M at which training's M (= r x probe M) meets B and each end of
        its interval, with r's own interval counted against the candidate. M_probe <= B / r iff r M_probe <= B."""
        r, r_lo, r_hi = self.ratio(level)
        return self.budget / r, self.interval[0] / r_hi, self.interval[1] / r_lo


@dataclasses.dataclass(frozen=True)
class Budget:
    metric: str
    budget: float
    delta: float | None = None
    path: str | None = None
    calibrated_on: Mapping[str, Any] | None = None  # `setup_fingerprint` of the study's setup, when recorded
    train_config: Mapping[str, Any] | None = None  # the study's baseline train config (every field), when recorded
    interval: tuple[float, float] | None = None  # B's interval (budget_interval), when recorded
    # B per kind of mismatch the study trained at several levels (resolved ones): knob -> (B, lo, hi); a kind
    # without a knee that was harmless up to M (NO_KNEE): (M, M, inf), so it can be ADMITted below M, never REJECTed
    kinds: Mapping[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    # kinds judged where training sees them (resolved ones): knob -> TrainingView
    views: Mapping[str, TrainingView] = dataclasses.field(default_factory=dict)

    def for_kind(self, knobs: set[str], levels: Mapping[str, float] | None = None) -> tuple[str, float, float, float]:
        """(which, B, lo, hi) a candidate setting `knobs` (study knob names) is judged against: its own kind's B
        when it sets one knob the study fitted a B for — on training's M (`TrainingView.in_probe_units` at the
        candidate's level, `levels[knob]`) when the kind has a view; else the envelope, the B with the lowest lower
        end over the calibration knob and every kind with a knee (the harshest per unit of M measured) — for
        combinations and kinds the study did not train. Without kinds: the calibration B ("weight_noise")."""
        lo, hi = self.interval or (self.budget, self.budget)
        own = {"weight_noise": (self.budget, lo, hi), **self.kinds}
        seen = self.view_for(knobs, levels)
        if seen is not None:
            k, view, level = seen
            return (f"{k} on training's M (x{view.ratio(level)[0]:.3g})", *view.in_probe_units(level))
        k = next(iter(knobs)) if len(knobs) == 1 else None
        if k in own:
            return (k, *own[k])
        knees = [name for name in own if math.isfinite(own[name][2])]  # a kind without a knee bounds nothing
        if not self.kinds or len(knees) == 1:
            return ("weight_noise", *own["weight_noise"])
        k = min(knees, key=lambda name: own[name][1])
        return (f"envelope ({k})", *own[k])

    @property
    def per_kind(self) -> bool:
        """Whether the study fitted anything beyond the calibration B (a B per kind, or a kind on training's M)."""
        return bool(self.kinds or self.views)

    def view_for(self, knobs: set[str], levels: Mapping[str, float] | None = None
                 ) -> tuple[str, TrainingView, float] | None:
        """(kind, its TrainingView, the candidate's level) when a candidate setting `knobs` is judged on training's
        M: it sets one kind, the budget has a view of that kind, and `levels` gives its level; else None."""
        k = next(iter(knobs)) if len(knobs) == 1 else None
        level = (levels or {}).get(k)
        return None if k not in self.views or level is None else (k, self.views[k], level)

    def for_shares(self, shares: Mapping[str, float], levels: Mapping[str, float] | None = None
                   ) -> tuple[str, float, float, float]:
        """(which, B, lo, hi) for a combination whose components probe alone at M shares s_k (kind -> s_k >= 0,
        summing to 1): the harmonic mix B_mix = 1 / sum_k s_k / B_k of each component's own B (`for_kind` at its
        level in `levels`, so the envelope for a kind the study has no B for), at B and at each end of its
        interval.

        Where harm grows as M_k / B_k per kind and adds over kinds (the combination stays within budget while
        sum_k M_k / B_k <= 1), M = sum_k M_k is within budget iff M <= B_mix. A kind with no upper end (inf)
        contributes nothing to hi's sum; a mix of only such kinds keeps hi = inf.
        """
        parts = {k: self.for_kind({k}, levels)[1:] for k in shares}
        mix = [harmonic_mix({k: (s, parts[k][i]) for k, s in shares.items()}) for i in range(3)]
        viewed = {k for k in shares if self.view_for({k}, levels) is not None}
        seen = lambda k: " on training's M" if k in viewed else ""  # noqa: E731
        label = ", ".join(f"{k}{seen(k)} {100 * shares[k]:.3g}%" for k in sorted(shares, key=lambda k: -shares[k]))
        return (f"shares ({label})", *mix)


def harmonic_mix(terms: Mapping[str, tuple[float, float]]) -> float:
    """1 / sum_k s_k / B_k over terms k -> (s_k, B_k): B_k = inf adds 0, B_k = 0 with s_k > 0 makes the mix 0, an
    all-zero sum makes it inf."""
    total = sum(0.0 if s == 0 else (math.inf if b <= 0 else s / b) for s, b in terms.values())
    return math.inf if total == 0 else 1.0 / total


def load_budget(path: str | pathlib.Path) -> Budget:
    """Read "metric", "budget" (and "delta" if present) from a study's budget.json; clear errors otherwise."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise AdmissionError(f"budget file {p} does not exist (write one with `opdjax study`)")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdmissionError(f"budget file {p} is not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise AdmissionError(f"budget file {p}: the top level must be an object with 'metric' and 'budget'")
    missing = [k for k in ("metric", "budget") if k not in d]
    if missing:
        raise AdmissionError(f"budget file {p}: missing key(s) {missing}; found {sorted(d)}")
    metric, b = d["metric"], d["budget"]
    if not isinstance(metric, str) or metric not in mismatch.ESTIMATORS:
        raise AdmissionError(f"budget file {p}: 'metric' must be one of {list(mismatch.ESTIMATORS)} (the mismatch "
                             f"estimators the probe measures), got {metric!r}")
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise AdmissionError(f"budget file {p}: 'budget' has the wrong type ({type(b).__name__}); expected a finite "
                             f"number >= 0, got {b!r}")
    if not math.isfinite(b) or b < 0:
        raise AdmissionError(f"budget file {p}: 'budget' must be a finite number >= 0, got {b!r}")
    delta = d.get("delta")
    if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float))):
        raise AdmissionError(f"budget file {p}: 'delta' must be a number, got {delta!r}")
    if d.get("status") == "UNRESOLVED":
        br = d.get("bracket") or {}
        raise AdmissionError(f"budget file {p}: the study did not locate the knee ({br.get('why', 'bracket too wide')}"
                             f"; B would be {b:.4g}), so there is no budget to admit against. Rerun `opdjax study` "
                             f"with knee.enabled=true, or with weight-noise levels between the bracket's ends")
    _check_against_points(p, float(b), d.get("points"))
    on = d.get("calibrated_on")
    if on is not None and not isinstance(on, dict):
        raise AdmissionError(f"budget file {p}: 'calibrated_on' must be an object (a setup fingerprint), got {on!r}")
    return Budget(metric=metric, budget=float(b), delta=None if delta is None else float(delta), path=str(p),
                  calibrated_on=on, train_config=_recorded_train_config(p, d),
                  interval=_interval(p, float(b), d.get("budget_interval")), kinds=_kinds(p, d.get("kinds")),
                  views=_views(p, d.get("kinds")))


def _kinds(p: pathlib.Path, kinds: Any) -> dict[str, tuple[float, float, float]]:
    """budget.json's `kinds` (the study's B per kind of mismatch): the RESOLVED ones as knob -> (B, lo, hi), the
    NO_KNEE ones as knob -> (harmless_up_to, harmless_up_to, inf); UNRESOLVED ones are no budget."""
    if kinds is None:
        return {}
    if not isinstance(kinds, dict) or not all(isinstance(v, dict) for v in kinds.values()):
        raise AdmissionError(f"budget file {p}: 'kinds' must map each knob to an object with 'budget', "
                             f"'budget_interval' and 'status', got {str(kinds)[:80]}")
    out = {}
    for knob, k in kinds.items():
        if k.get("status") == "NO_KNEE":
            top = k.get("harmless_up_to")
            if isinstance(top, bool) or not isinstance(top, (int, float)) or not (math.isfinite(top) and top > 0):
                raise AdmissionError(f"budget file {p}: kinds.{knob}.harmless_up_to must be a finite number > 0 "
                                     f"(the largest M its levels were harmless at), got {top!r}")
            out[str(knob)] = (float(top), float(top), math.inf)
            continue
        if k.get("status") != "RESOLVED":
            continue
        b = k.get("budget")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0:
            raise AdmissionError(f"budget file {p}: kinds.{knob}.budget must be a finite number >= 0, got {b!r}")
        lo, hi = _interval(p, float(b), k.get("budget_interval"), f"kinds.{knob}.budget_interval") or (b, b)
        out[str(knob)] = (float(b), lo, hi)
    return out


def _views(p: pathlib.Path, kinds: Any) -> dict[str, TrainingView]:
    """budget.json's `kinds.<knob>.training` (`study.training_view_budget`), the RESOLVED ones as knob ->
    TrainingView; clear errors for a malformed one. (`_kinds` has already checked that `kinds` maps to objects.)"""
    out = {}
    for knob, k in (kinds or {}).items():
        t = k.get("training")
        if t is None or (isinstance(t, dict) and t.get("status") != "RESOLVED"):
            continue
        where = f"kinds.{knob}.training"
        b = t.get("budget") if isinstance(t, dict) else None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise AdmissionError(f"budget file {p}: {where} must be an object whose 'budget' is a finite number > 0 "
                                 f"(B on training's M), got {str(t)[:80]}")
        iv = _interval(p, float(b), t.get("budget_interval"), f"{where}.budget_interval") or (b, b)
        out[str(knob)] = TrainingView(float(b), iv, *_ratios(p, where, t.get("ratios")))
    return out


def _ratios(p: pathlib.Path, where: str, rows: Any) -> tuple[tuple[float, ...], ...]:
    """`ratios` [{"level", "ratio", "ratio_interval": [lo, hi]}] (levels increasing, 0 < lo <= ratio <= hi) ->
    (levels, r, lo, hi) as tuples."""
    def ok(r: Any) -> bool:
        nums = [r.get("level"), r.get("ratio"), *(r.get("ratio_interval") or [None])] if isinstance(r, dict) else []
        return (len(nums) == 4 and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                       for x in nums) and 0 < nums[0] and 0 < nums[2] <= nums[1] <= nums[3])
    if not isinstance(rows, list) or not rows or not all(ok(r) for r in rows) or any(
            a["level"] >= b["level"] for a, b in zip(rows, rows[1:])):
        raise AdmissionError(f"budget file {p}: {where}.ratios must be a non-empty list of {{'level', 'ratio', "
                             f"'ratio_interval': [lo, hi]}} with levels > 0 increasing and 0 < lo <= ratio <= hi, "
                             f"got {str(rows)[:80]}")
    return tuple(tuple(float(v) for v in col) for col in zip(*[(r["level"], r["ratio"], *r["ratio_interval"])
                                                                 for r in rows]))


def _interval(p: pathlib.Path, b: float, iv: Any, name: str = "budget_interval") -> tuple[float, float] | None:
    """budget.json's `budget_interval` (or `name`) [lo, hi] (finite, lo <= B <= hi), or None when it has none."""
    if iv is None:
        return None
    ok = (isinstance(iv, (list, tuple)) and len(iv) == 2 and all(isinstance(x, (int, float)) and not isinstance(
        x, bool) and math.isfinite(x) for x in iv))
    if not ok or not iv[0] <= b <= iv[1]:
        raise AdmissionError(f"budget file {p}: '{name}' must be [low, high], finite numbers with low <= "
                             f"budget ({b:.4g}) <= high, got {iv!r}")
    return float(iv[0]), float(iv[1])


def _check_against_points(p: pathlib.Path, b: float, points: Any) -> None:
    """B is the knee between the mismatch levels its study measured (a resolved study never extrapolates past the
    largest), so a B above the largest M the file's own points record is not one that study found (a hand-edited or
    corrupted file would admit everything). Files without measured points (hand-written) are not checked."""
    if points is None:
        return
    if not isinstance(points, list) or not all(isinstance(pt, dict) for pt in points):
        raise AdmissionError(f"budget file {p}: 'points' must be a list of objects (the study's points), got "
                             f"{str(points)[:80]}")
    ms = [pt.get("m_probe") for pt in points if pt.get("m_probe") is not None]
    bad = [m for m in ms if isinstance(m, bool) or not isinstance(m, (int, float))]
    if bad:
        raise AdmissionError(f"budget file {p}: 'points' must record each m_probe as a number or null, got "
                             f"{bad[:3]}")
    finite = [float(m) for m in ms if math.isfinite(m)]
    if finite and b > max(finite) * (1 + 1e-9):
        top = max(finite)
        raise AdmissionError(f"budget file {p}: 'budget' B = {b:.4g} is above the largest M its study measured "
                             f"({top:.4g} over {len(finite)} points); expected B <= {top:.4g}, a knee between the "
                             f"points that were measured: rerun `opdjax study`, or restore the file")


def _recorded_train_config(p: pathlib.Path, d: Mapping[str, Any]) -> dict[str, Any] | None:
    """budget.json's config.base_train_config (the study's baseline TrainConfig as a dict), or None if absent."""
    study_cfg = d.get("config")
    if study_cfg is None:
        return None
    if not isinstance(study_cfg, dict):
        raise AdmissionError(f"budget file {p}: 'config' must be an object (the study's config), got {study_cfg!r}")
    tc = study_cfg.get("base_train_config")
    if tc is not None and not isinstance(tc, dict):
        raise AdmissionError(f"budget file {p}: 'config.base_train_config' must be an object (a train config), "
                             f"got {tc!r}")
    return tc


def _weights_sha256(model_dir: str | pathlib.Path) -> str:
    """sha256 over a model directory's *.safetensors files (sorted by name; their bytes, names excluded)."""
    h = hashlib.sha256()
    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise AdmissionError(f"model directory {model_dir} has no *.safetensors weights to fingerprint")
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def setup_fingerprint(cfg, log=print) -> dict[str, Any]:
    """What a budget is a property of: the student and teacher weights (sha256), the task, and the software and
    machine that made them. The built-in models are trained locally (chaotic SGD in float32), so their bits can
    differ between machines and library versions: two machines can calibrate different pairs from one config."""

    student, teacher = resolve_models(cfg, log=log)
    return {"student_sha256": _weights_sha256(student), "teacher_sha256": _weights_sha256(teacher),
            "student": str(student), "teacher": str(teacher), "task": to_dict(cfg.task),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "machine": f"{platform.system()} {platform.machine()} ({_cpu_name()})"}


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def calibration_warning(budget: Budget, fingerprint: Mapping[str, Any]) -> str | None:
    """A warning when `budget` was fit on other student or teacher weights than `fingerprint`'s (else None).

    A budget is the mismatch one training setup tolerates; applied to another student/teacher pair it is only a
    guess. Budgets from before fingerprints were recorded cannot be checked (None).
    """
    on = budget.calibrated_on
    if not on:
        return None
    diff = [role for role in ("student", "teacher")
            if on.get(f"{role}_sha256") and on.get(f"{role}_sha256") != fingerprint.get(f"{role}_sha256")]
    if not diff:
        return None
    what = " and ".join(f"{r} weights {str(on[f'{r}_sha256'])[:12]} (now {str(fingerprint[f'{r}_sha256'])[:12]})"
                        for r in diff)
    return (f"budget {budget.path or ''} was calibrated on {what}, made with jax {on.get('jax', '?')} on "
            f"{on.get('machine', '?')}: B is the mismatch that setup tolerates, and this one may tolerate more or "
            f"less; rerun `opdjax study` here to calibrate it")
