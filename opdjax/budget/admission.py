"""Admission check, layer sensitivity, FP8 recipe search and KV-cache capacity accounting.

Commands (registered by `add_admission_commands`):

    opdjax admit --budget budget.json CANDIDATE...      probe each candidate, ADMIT / REJECT / UNCERTAIN against B
    opdjax sensitivity [--by layer|module|group|layer-group]   M of quantizing one unit at a time (FP8 W8A8)
    opdjax recipe-search --budget budget.json [--margin 0.8]  greedy FP8 recipe that fits the budget
    opdjax capacity --model DIR|PRESET --memory-gb 80 [--recipe NAME|FILE]   KV tokens that fit, BF16 vs recipe

Verdict (M = the budget's metric measured by `opdjax.probe.probe`, [lo, hi] its 95% bootstrap CI over sequences):

    ADMIT      hi <= B          (the whole interval is inside the budget)
    REJECT     lo >  B          (the whole interval is outside)
    UNCERTAIN  otherwise        (probe more batches, or treat as not admitted: `admit` exits 1)

A CANDIDATE is a comma-separated list of config overrides, split only at top-level commas so that mapping values
stay whole: `rollout.recipe=fp8_w8a8_kv`, `rollout.weight_noise=0.05,rollout.stale_versions=1`,
`rollout.engine=vllm,rollout.vllm={kv_cache_dtype: fp8, max_num_seqs: 8}`. `rollout.recipe` also accepts a recipe
file (JSON/YAML written by `recipe-search` or by hand, loadable by `quant.Recipe.from_dict`): the file is
registered in `quant.RECIPES` under its path, because `RolloutConfig.recipe` only accepts registered names.

Recipe search units. A unit is a set of decoder linear modules that is quantized or kept in high precision as a
whole, or the KV cache. vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` and requires every shard of
a fused layer to use the same scheme, so the searchable groups are qkv, o, gate_up, down (`--by group`: one unit per
group across all layers; `--by layer-group`: per layer and group; `--by layer`: whole layers). `--by module`
(q, k, v, o, gate, up, down separately) is for `sensitivity` only: a recipe that splits q from k cannot be served
by vLLM.

Greedy search: start from the full FP8 recipe (W8A8 on every decoder linear + FP8 KV cache, scale 1.0, as preset
fp8_w8a8_kv). A recipe fits when its probe has m <= margin*B and ci_high <= B (so `admit` with the same budget and
seed admits it). If the full recipe does not fit: (1) measure each unit's sensitivity (M with only that unit
quantized, minus the unquantized engine's M); (2) keep units in high precision, most sensitive first, re-probing the
whole recipe after each, until it fits; (3) M is not additive, so give back (re-quantize) kept units, largest memory
saving first, whenever the recipe still fits without them — this maximises the memory saved. Memory saving of a
unit: weights, BF16 bytes minus FP8 bytes with scales; KV cache, (BF16 - FP8) bytes per token times the tokens the
full-FP8 cache holds at --memory-gb. The result is written as an opdjax recipe (`recipe.json`), as the vLLM settings
that reproduce it (`vllm.json`), and a report with the KV-capacity accounting (`report.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import pathlib
import platform
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from opdjax import quant
from opdjax.rollout.vllm_settings import GROUPS, MODULES, VllmSettingsError, _linear_modules
from opdjax.rollout.vllm_settings import vllm_settings as _vllm_settings

__all__ = [
    "AdmissionError", "Budget", "load_budget", "verdict", "split_candidate", "setup_fingerprint",
    "calibration_warning",
    "candidate_config", "AdmitRow", "admit", "format_admit_table", "exit_code",
    "Unit", "units", "unit_recipe", "full_fp8_recipe", "sensitivity", "SearchResult", "recipe_search",
    "vllm_settings", "capacity_report", "model_config", "PRESET_MODELS", "add_admission_commands",
]

VERDICTS = ("ADMIT", "REJECT", "UNCERTAIN")


class AdmissionError(ValueError):
    """A missing or malformed budget file, a malformed candidate, or a recipe that cannot be searched or served."""


# ----------------------------------------------------------------------------------------------------------------------
# Budget and verdict
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Budget:
    metric: str
    budget: float
    delta: float | None = None
    path: str | None = None
    calibrated_on: Mapping[str, Any] | None = None  # `setup_fingerprint` of the study's setup, when recorded


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
    if not isinstance(metric, str) or not metric:
        raise AdmissionError(f"budget file {p}: 'metric' must be a metric name such as 'k3', got {metric!r}")
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise AdmissionError(f"budget file {p}: 'budget' has the wrong type ({type(b).__name__}); expected a finite "
                             f"number >= 0, got {b!r}")
    if not math.isfinite(b) or b < 0:
        raise AdmissionError(f"budget file {p}: 'budget' must be a finite number >= 0, got {b!r}")
    delta = d.get("delta")
    if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float))):
        raise AdmissionError(f"budget file {p}: 'delta' must be a number, got {delta!r}")
    on = d.get("calibrated_on")
    if on is not None and not isinstance(on, dict):
        raise AdmissionError(f"budget file {p}: 'calibrated_on' must be an object (a setup fingerprint), got {on!r}")
    return Budget(metric=metric, budget=float(b), delta=None if delta is None else float(delta), path=str(p),
                  calibrated_on=on)


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
    import jax
    import jaxlib

    from opdjax.config import to_dict
    from opdjax.pipeline.loop import resolve_models

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


def verdict(ci_low: float, ci_high: float, budget: float) -> str:
    """ADMIT if ci_high <= budget, REJECT if ci_low > budget, UNCERTAIN otherwise (also for a NaN bound)."""
    if ci_high <= budget:
        return "ADMIT"
    if ci_low > budget:
        return "REJECT"
    return "UNCERTAIN"


# ----------------------------------------------------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------------------------------------------------

_OPEN, _CLOSE = "{[(", "}])"


def split_candidate(text: str) -> list[str]:
    """'a=1,b={x: 1, y: 2}' -> ['a=1', 'b={x: 1, y: 2}']: split at commas outside brackets and quotes.

    Every part must look like key=value; an empty candidate or part raises AdmissionError.
    """
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise AdmissionError(f"candidate {text!r}: unbalanced {ch!r}")
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if depth != 0 or quote:
        raise AdmissionError(f"candidate {text!r}: unbalanced brackets or quotes")
    parts.append("".join(cur).strip())
    for part in parts:
        key = part.split("=", 1)[0]
        if "=" not in part or not key or any(not k for k in key.split(".")):
            raise AdmissionError(f"candidate {text!r}: part {part!r} is not key=value "
                                 f"(e.g. rollout.recipe=fp8_w8a8_kv or rollout.weight_noise=0.05)")
    return parts


_RECIPE_SUFFIXES = (".json", ".yaml", ".yml")


def candidate_config(config: str | None, overrides: Sequence[str], candidate: Sequence[str] = ()):
    """TrainConfig = defaults <- config file <- global overrides <- candidate overrides (validated)."""
    from opdjax.config import TrainConfig, load

    return load(TrainConfig, config, [*overrides, *candidate])  # recipe files load through quant.as_recipe


# ----------------------------------------------------------------------------------------------------------------------
# admit
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AdmitRow:
    candidate: str
    overrides: list[str]
    metric: str
    m: float
    ci_low: float
    ci_high: float
    budget: float
    verdict: str
    seconds: float
    tokens: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


ProbeFn = Callable[..., Any]  # probe(cfg, *, batches, metric, seed, log) -> ProbeResult-like


def _default_probe() -> ProbeFn:
    from opdjax.budget.probe import probe

    return probe


def admit(candidates: Sequence[str], budget: Budget, *, config: str | None = None, overrides: Sequence[str] = (),
          probe_fn: ProbeFn | None = None, batches: int = 4, seed: int = 0, log=print) -> list[AdmitRow]:
    """Probe each candidate (a comma-separated override string) and judge it against `budget`.

    Every candidate is parsed and its config validated before the first probe, so a typo fails fast.
    """
    probe_fn = probe_fn or _default_probe()
    parsed = [(c, split_candidate(c)) for c in candidates]
    cfgs = [candidate_config(config, overrides, parts) for _, parts in parsed]
    rows = []
    for (text, parts), cfg in zip(parsed, cfgs):
        log(f"probing {text} ...")
        r = probe_fn(cfg, batches=batches, metric=budget.metric, seed=seed, log=lambda s: None)
        rows.append(AdmitRow(candidate=text, overrides=parts, metric=r.metric, m=float(r.m), ci_low=float(r.ci_low),
                             ci_high=float(r.ci_high), budget=budget.budget,
                             verdict=verdict(r.ci_low, r.ci_high, budget.budget), seconds=float(r.seconds),
                             tokens=int(r.tokens), metrics=dict(r.metrics)))
    return rows


def exit_code(rows: Sequence[AdmitRow]) -> int:
    """0 when every candidate is admitted (and there is at least one), else 1."""
    return 0 if rows and all(r.verdict == "ADMIT" for r in rows) else 1


def format_admit_table(rows: Sequence[AdmitRow], budget: Budget | None = None) -> str:
    w = max([len("candidate")] + [len(r.candidate) for r in rows])
    metric = rows[0].metric if rows else (budget.metric if budget else "M")
    head = f"{'candidate':<{w}}  {metric:>10}  {'95% CI':>23}  {'verdict':>9}  {'tokens':>6}  {'sec':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = f"[{r.ci_low:.3e}, {r.ci_high:.3e}]"
        lines.append(f"{r.candidate:<{w}}  {r.m:>10.3e}  {ci:>23}  {r.verdict:>9}  {r.tokens:>6d}  {r.seconds:>6.1f}")
    if budget is not None:
        lines.append(f"budget B = {budget.budget:.3e} ({budget.metric}"
                     + (f", delta {budget.delta:g}" if budget.delta is not None else "") + ")")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Units, recipes
# ----------------------------------------------------------------------------------------------------------------------

_E4M3_T = quant.QSpec("e4m3", "tensor")
_E4M3_TOK = quant.QSpec("e4m3", "token")
BY_CHOICES = ("layer", "module", "group", "layer-group")
KV = "kv_cache"


@dataclasses.dataclass(frozen=True)
class Unit:
    """What is quantized or kept in high precision as a whole: fnmatch patterns over HF module names, or the KV
    cache (`kv=True`, no patterns)."""

    label: str
    patterns: tuple[str, ...] = ()
    kv: bool = False


def units(num_layers: int, by: str, *, kv: bool = True) -> list[Unit]:
    """The units of a decoder with `num_layers` layers, grouped `by` layer | module | group | layer-group; the KV
    cache is appended as one more unit when `kv`."""
    if by not in BY_CHOICES:
        raise AdmissionError(f"--by {by!r} is not valid; choose one of {list(BY_CHOICES)}")
    out: list[Unit] = []
    if by == "layer":
        out = [Unit(f"layer{i}", (f"model.layers.{i}.self_attn.*_proj", f"model.layers.{i}.mlp.*_proj"))
               for i in range(num_layers)]
    elif by == "module":
        out = [Unit(m, (f"model.layers.*.{MODULES[m]}",)) for m in MODULES]
    elif by == "group":
        out = [Unit(g, tuple(f"model.layers.*.{MODULES[m]}" for m in ms)) for g, ms in GROUPS.items()]
    else:
        out = [Unit(f"layer{i}.{g}", tuple(f"model.layers.{i}.{MODULES[m]}" for m in ms))
               for i in range(num_layers) for g, ms in GROUPS.items()]
    return out + ([Unit(KV, kv=True)] if kv else [])


def _kv_scale_kw(kv_scales: Sequence | None) -> dict[str, Any]:
    """Recipe kwargs of the FP8 KV cache's scales: vLLM's fixed 1.0, or calibrated per-layer scales."""
    return {"kv_scale": 1.0} if kv_scales is None else {"kv_scales": tuple(kv_scales)}


def unit_recipe(unit: Unit, name: str | None = None, kv_scales: Sequence | None = None) -> quant.Recipe:
    """FP8 W8A8 (per-tensor weights, per-token activations) on the unit's modules only, or only the FP8 KV cache
    (scale 1.0 = vLLM's kv_cache_dtype="fp8", or calibrated per-layer `kv_scales`) for the KV unit; everything
    else in high precision."""
    name = name or f"fp8_only_{unit.label}"
    hp = tuple((p, None) for p in quant.HIGH_PRECISION_PATTERNS)
    if unit.kv:
        return quant.Recipe(name=name, weights=hp, kv_cache=_E4M3_TOK, **_kv_scale_kw(kv_scales))
    return quant.Recipe(name=name, weights=hp + tuple((p, _E4M3_T) for p in unit.patterns), activations=_E4M3_TOK)


def full_fp8_recipe(keep: Sequence[Unit] = (), name: str = "fp8_search", kv_scales: Sequence | None = None
                    ) -> quant.Recipe:
    """The full FP8 recipe (W8A8 on every decoder linear + FP8 KV cache, as preset fp8_w8a8_kv, or with
    calibrated per-layer `kv_scales`) with the `keep` units in high precision (their patterns come first: the first
    matching pattern wins)."""
    keep_kv = any(u.kv for u in keep)
    weights = tuple((p, None) for p in quant.HIGH_PRECISION_PATTERNS)
    weights += tuple((p, None) for u in keep for p in u.patterns)
    weights += tuple((p, _E4M3_T) for p in quant.DECODER_LINEAR_PATTERNS)
    if keep_kv:
        return quant.Recipe(name=name, weights=weights, activations=_E4M3_TOK)
    return quant.Recipe(name=name, weights=weights, activations=_E4M3_TOK, kv_cache=_E4M3_TOK,
                        **_kv_scale_kw(kv_scales))


def _register(recipe: quant.Recipe) -> str:
    """Make an in-memory recipe addressable as `rollout.recipe` (registry invariant: key == recipe.name)."""
    key = f"admission:{recipe.name}"
    quant.RECIPES[key] = dataclasses.replace(recipe, name=key)
    return key


def vllm_settings(mcfg, recipe: quant.Recipe) -> dict[str, Any]:
    """`opdjax.rollout.vllm_settings.vllm_settings`, with its refusal reported as an AdmissionError."""
    try:
        return _vllm_settings(mcfg, recipe)
    except VllmSettingsError as e:
        raise AdmissionError(str(e)) from e


def _weight_saving(mcfg, unit: Unit) -> int:
    return quant.weight_bytes(mcfg, None) - quant.weight_bytes(mcfg, unit_recipe(unit))


def capacity_report(mcfg, recipe: quant.Recipe | None, memory_bytes: float, base_dtype_bytes: int = 2
                    ) -> dict[str, Any]:
    """Weights, KV bytes per token and KV tokens that fit in `memory_bytes`, BF16 vs `recipe`, and their ratio."""
    bf_tokens = quant.kv_capacity_tokens(mcfg, memory_bytes, None, base_dtype_bytes)
    rc_tokens = quant.kv_capacity_tokens(mcfg, memory_bytes, recipe, base_dtype_bytes)
    return {
        "memory_bytes": int(memory_bytes), "recipe": None if recipe is None else recipe.name,
        "bf16": {"weight_bytes": quant.weight_bytes(mcfg, None, base_dtype_bytes),
                 "kv_bytes_per_token": quant.kv_cache_bytes_per_token(mcfg, None, base_dtype_bytes),
                 "kv_tokens": bf_tokens},
        "recipe_side": {"weight_bytes": quant.weight_bytes(mcfg, recipe, base_dtype_bytes),
                        "kv_bytes_per_token": quant.kv_cache_bytes_per_token(mcfg, recipe, base_dtype_bytes),
                        "kv_tokens": rc_tokens},
        "ratio": (rc_tokens / bf_tokens) if bf_tokens else float("inf") if rc_tokens else float("nan"),
    }


def format_capacity(rep: dict[str, Any], label: str = "") -> str:
    b, r = rep["bf16"], rep["recipe_side"]
    gb = 1 << 30
    return "\n".join([
        f"KV-cache capacity{(' of ' + label) if label else ''} in {rep['memory_bytes'] / gb:.1f} GiB",
        f"  {'':<22} {'weights GiB':>12} {'KV B/token':>11} {'KV tokens':>14}",
        f"  {'bf16':<22} {b['weight_bytes'] / gb:>12.3f} {b['kv_bytes_per_token']:>11d} {b['kv_tokens']:>14,d}",
        f"  {str(rep['recipe']):<22} {r['weight_bytes'] / gb:>12.3f} {r['kv_bytes_per_token']:>11d} "
        f"{r['kv_tokens']:>14,d}",
        f"  capacity ratio recipe / bf16: {rep['ratio']:.3f}x",
    ])


# ----------------------------------------------------------------------------------------------------------------------
# Sensitivity and recipe search
# ----------------------------------------------------------------------------------------------------------------------

def _probe_recipe(cfg, recipe: quant.Recipe, probe_fn: ProbeFn, *, batches: int, metric: str, seed: int):
    key = _register(recipe)
    c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, recipe=key))
    return probe_fn(c, batches=batches, metric=metric, seed=seed, log=lambda s: None)


def _student_config(cfg):
    from opdjax.models import ModelConfig
    from opdjax.pipeline.loop import resolve_models

    student, _ = resolve_models(cfg, log=lambda s: None)
    return ModelConfig.from_dir(student)


def sensitivity(cfg, *, by: str = "layer", probe_fn: ProbeFn | None = None, batches: int = 4, metric: str = "k3",
                seed: int = 0, kv: bool = True, kv_scales: Sequence | None = None, mcfg=None, log=print
                ) -> dict[str, Any]:
    """M of the unquantized engine and of each unit quantized alone (FP8 W8A8 / FP8 KV), sorted by contribution.

    contribution = M(unit alone) - M(nothing quantized). Returns {"baseline": {...}, "units": [...]} with each
    unit's label, patterns, m, ci, contribution, weight bytes saved and probe seconds.
    """
    if cfg.rollout.engine != "jax":
        raise AdmissionError("sensitivity and recipe-search simulate FP8 in the JAX engine (rollout.engine=jax); "
                             "vLLM's FP8 weights run on GPU only — check the found recipe there with `admit`")
    probe_fn = probe_fn or _default_probe()
    mcfg = mcfg or _student_config(cfg)
    base = _probe_recipe(cfg, quant.RECIPES["none"], probe_fn, batches=batches, metric=metric, seed=seed)
    rows = []
    for u in units(mcfg.num_layers, by, kv=kv):
        r = _probe_recipe(cfg, unit_recipe(u, kv_scales=kv_scales), probe_fn, batches=batches, metric=metric,
                          seed=seed)
        rows.append({"unit": u.label, "patterns": list(u.patterns), "kv": u.kv, "m": r.m, "ci_low": r.ci_low,
                     "ci_high": r.ci_high, "contribution": r.m - base.m,
                     "weight_bytes_saved": 0 if u.kv else _weight_saving(mcfg, u), "seconds": r.seconds})
        log(f"  {u.label:<16} {metric} {r.m:.3e}  [{r.ci_low:.3e}, {r.ci_high:.3e}]  ({r.seconds:.1f}s)")
    rows.sort(key=lambda x: -x["contribution"])
    return {"metric": metric, "by": by, "baseline": {"m": base.m, "ci_low": base.ci_low, "ci_high": base.ci_high,
                                                     "seconds": base.seconds}, "units": rows}


def format_sensitivity(rep: dict[str, Any]) -> str:
    rows = rep["units"]
    total = sum(max(r["contribution"], 0.0) for r in rows) or 1.0
    head = f"{'unit':<16} {rep['metric'] + ' alone':>12} {'95% CI':>25} {'contribution':>13} {'share':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}]"
        lines.append(f"{r['unit']:<16} {r['m']:>12.3e} {ci:>25} {r['contribution']:>13.3e} "
                     f"{100 * max(r['contribution'], 0) / total:>5.1f}%")
    lines.append(f"unquantized engine: {rep['baseline']['m']:.3e}")
    return "\n".join(lines)


@dataclasses.dataclass
class SearchResult:
    recipe: quant.Recipe
    kept: list[str]
    fits: bool
    m: float
    ci_low: float
    ci_high: float
    steps: list[dict[str, Any]]
    sensitivity: dict[str, Any] | None
    vllm: dict[str, Any]
    capacity: dict[str, Any]
    weight_bytes_saved: int
    seconds: float

    def report(self, budget: Budget, margin: float) -> dict[str, Any]:
        return {"budget": dataclasses.asdict(budget), "margin": margin, "target": margin * budget.budget,
                "fits": self.fits, "kept_high_precision": self.kept, "m": self.m, "ci_low": self.ci_low,
                "ci_high": self.ci_high, "verdict": verdict(self.ci_low, self.ci_high, budget.budget),
                "recipe": self.recipe.to_dict(), "vllm": self.vllm, "capacity": self.capacity,
                "weight_bytes_saved": self.weight_bytes_saved, "steps": self.steps,
                "sensitivity": self.sensitivity, "seconds": self.seconds}


def recipe_search(cfg, budget: Budget, *, margin: float = 0.8, by: str = "layer", probe_fn: ProbeFn | None = None,
                  batches: int = 4, seed: int = 0, memory_bytes: float = 80e9, name: str = "fp8_searched",
                  kv_scales: Sequence | None = None, mcfg=None, log=print) -> SearchResult:
    """Greedy FP8 recipe search (module docstring). `fits` = m <= margin * B and ci_high <= B.

    kv_scales: None = the FP8 KV cache at vLLM's fixed scale 1.0; per-layer scales (`calibrate_kv`) otherwise.
    """
    if not 0 < margin <= 1:
        raise AdmissionError(f"--margin must be in (0, 1], got {margin}")
    if by == "module":
        raise AdmissionError("recipe-search --by module would split vLLM's fused qkv / gate_up layers; use "
                             "--by layer, group or layer-group")
    t0 = time.time()
    probe_fn = probe_fn or _default_probe()
    mcfg = mcfg or _student_config(cfg)
    target = margin * budget.budget
    kw = dict(batches=batches, metric=budget.metric, seed=seed)

    def fits(r) -> bool:
        return r.m <= target and r.ci_high <= budget.budget

    steps: list[dict[str, Any]] = []
    keep: list[Unit] = []
    recipe = full_fp8_recipe(keep, name=name, kv_scales=kv_scales)
    r = _probe_recipe(cfg, recipe, probe_fn, **kw)
    steps.append({"action": "full fp8", "kept": [], "m": r.m, "ci_low": r.ci_low, "ci_high": r.ci_high,
                  "fits": fits(r)})
    log(f"full FP8 (W8A8 + FP8 KV): {budget.metric} {r.m:.3e} [{r.ci_low:.3e}, {r.ci_high:.3e}]; "
        f"target {target:.3e} (margin {margin} x B {budget.budget:.3e})")
    sens = None
    if not fits(r):
        log(f"sensitivity by {by}:")
        sens = sensitivity(cfg, by=by, probe_fn=probe_fn, mcfg=mcfg, kv_scales=kv_scales, log=log, **kw)
        all_units = {u.label: u for u in units(mcfg.num_layers, by)}
        full_tokens = quant.kv_capacity_tokens(mcfg, memory_bytes, full_fp8_recipe())
        kv_saving = full_tokens * (quant.kv_cache_bytes_per_token(mcfg, None)
                                   - quant.kv_cache_bytes_per_token(mcfg, full_fp8_recipe()))
        saving = {row["unit"]: kv_saving if row["kv"] else row["weight_bytes_saved"] for row in sens["units"]}

        def attempt(kept: list[Unit], action: str):
            rec = full_fp8_recipe(kept, name=name, kv_scales=kv_scales)
            res = _probe_recipe(cfg, rec, probe_fn, **kw)
            steps.append({"action": action, "kept": [u.label for u in kept], "m": res.m, "ci_low": res.ci_low,
                          "ci_high": res.ci_high, "fits": fits(res)})
            log(f"  {action:<22} -> {budget.metric} {res.m:.3e} [{res.ci_low:.3e}, {res.ci_high:.3e}]"
                f"{'  fits' if fits(res) else ''}")
            return rec, res

        # Phase 1: keep the most sensitive units in high precision until the recipe fits.
        for row in sorted(sens["units"], key=lambda x: (-x["contribution"], saving[x["unit"]])):
            if row["contribution"] <= 0 and keep:
                break  # the rest do not reduce M: keeping them costs memory for nothing
            keep.append(all_units[row["unit"]])
            recipe, r = attempt(keep, f"keep {row['unit']}")
            if fits(r):
                break
        # Phase 2: M is not additive; give back (re-quantize) kept units, largest memory saving first, while it
        # still fits — this is what maximises the memory saved.
        if fits(r):
            for u in sorted(keep[:-1], key=lambda u: -saving[u.label]):
                trial = [k for k in keep if k is not u]
                rec2, r2 = attempt(trial, f"re-quantize {u.label}")
                if fits(r2):
                    keep, recipe, r = trial, rec2, r2
    saved = quant.weight_bytes(mcfg, None) - quant.weight_bytes(mcfg, recipe)
    return SearchResult(recipe=recipe, kept=[u.label for u in keep], fits=fits(r), m=r.m, ci_low=r.ci_low,
                        ci_high=r.ci_high, steps=steps, sensitivity=sens, vllm=_vllm_or_reason(mcfg, recipe),
                        capacity=capacity_report(mcfg, recipe, memory_bytes), weight_bytes_saved=saved,
                        seconds=time.time() - t0)


def _vllm_or_reason(mcfg, recipe: quant.Recipe) -> dict[str, Any]:
    """vLLM settings of a found recipe, or {"unsupported": why} when vLLM cannot reproduce it from kwargs."""
    try:
        return vllm_settings(mcfg, recipe)
    except AdmissionError as e:
        return {"unsupported": str(e)}


def write_search(result: SearchResult, budget: Budget, margin: float, out_dir: str | pathlib.Path) -> dict[str, str]:
    """recipe.json (opdjax recipe, `Recipe.from_dict`), vllm.json (vllm.LLM kwargs), report.json; returns paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"recipe": out / "recipe.json", "vllm": out / "vllm.json", "report": out / "report.json"}
    paths["recipe"].write_text(json.dumps(result.recipe.to_dict(), indent=2) + "\n")
    paths["vllm"].write_text(json.dumps(result.vllm, indent=2) + "\n")
    paths["report"].write_text(json.dumps(result.report(budget, margin), indent=2, default=str) + "\n")
    return {k: str(v) for k, v in paths.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Model configs for `capacity`
# ----------------------------------------------------------------------------------------------------------------------

# Public HF config.json shapes (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied, bias, qk_norm).
PRESET_MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False,
                       attention_bias=True, qk_norm=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     attention_bias=False, qk_norm=True),
}


def model_config(spec: str):
    """A ModelConfig from a HF directory, a preset in PRESET_MODELS, or a tiny size (tiny/small/base/100m,
    optionally family/size such as llama/small)."""
    from opdjax.models import ModelConfig
    from opdjax.models.tiny import SIZES, tiny_config

    p = pathlib.Path(spec)
    if p.is_dir():
        return ModelConfig.from_dir(p)
    if spec in PRESET_MODELS:
        return ModelConfig(**PRESET_MODELS[spec])
    family, _, size = spec.rpartition("/")
    if size in SIZES:
        return tiny_config(family or "qwen3", size)
    raise AdmissionError(f"--model {spec!r} is neither a checkpoint directory nor a preset; presets: "
                         f"{sorted(PRESET_MODELS)} or a tiny size {sorted(SIZES)} (optionally family/size)")


def recipe_arg(spec: str | None) -> quant.Recipe | None:
    if spec is None:
        return None
    if spec in quant.RECIPES or spec.endswith(_RECIPE_SUFFIXES):
        return quant.as_recipe(spec)
    raise AdmissionError(f"--recipe {spec!r}: not a preset ({sorted(quant.RECIPES)}) nor a .json/.yaml recipe file")


# ----------------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------------

def _usage_errors():
    from opdjax.config import ConfigError
    from opdjax.teacher.jax_teacher import VocabMismatchError

    return (AdmissionError, ConfigError, quant.RecipeError, VocabMismatchError)


def _guard(fn):
    """Run a command; usage errors (bad budget, candidate, config, recipe, vocabulary) -> message + exit code 2."""
    def wrapped(args) -> int:
        try:
            return int(fn(args) or 0)
        except _usage_errors() as e:
            print(f"opdjax {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    return wrapped


def _warn_if_other_setup(budget: Budget, cfg) -> None:
    if not budget.calibrated_on:
        return  # nothing to compare with (and no reason to resolve or hash the models)
    msg = calibration_warning(budget, setup_fingerprint(cfg, log=lambda m: None))
    if msg:
        print(f"warning: {msg}", file=sys.stderr)


def _cmd_admit(args) -> int:
    budget = load_budget(args.budget)
    _warn_if_other_setup(budget, candidate_config(args.config, args.set or []))
    rows = admit(args.candidates, budget, config=args.config, overrides=args.set or [], batches=args.batches,
                 seed=args.seed)
    print(format_admit_table(rows, budget))
    if args.out:
        p = pathlib.Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"budget": dataclasses.asdict(budget), "all_admitted": exit_code(rows) == 0,
                                 "candidates": [dataclasses.asdict(r) for r in rows]}, indent=2) + "\n")
        print(f"wrote {p}")
    return exit_code(rows)


def calibrate_kv(cfg, *, batches: int = 2, seed: int = 0, log=print) -> tuple:
    """Per-layer (k_scale, v_scale) of an e4m3 KV cache from the student's K/V amax on its own samples."""
    from opdjax.budget.probe import kv_amax

    return quant.calibrate_kv_scales(kv_amax(cfg, batches=batches, seed=seed, log=lambda m: None))


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
        p.write_text(json.dumps(rep, indent=2) + "\n")
        print(f"wrote {p}")
    return 0


def _cmd_recipe_search(args) -> int:
    budget = load_budget(args.budget)
    cfg = candidate_config(args.config, args.overrides)
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
        pathlib.Path(args.out).write_text(json.dumps(rep, indent=2) + "\n")
    return 0


def _common(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu defaults)")
    p.add_argument("--batches", type=int, default=4, help="probe batches per measurement (rollout.batch_size each)")
    p.add_argument("--seed", type=int, default=0, help="probe seed (same prompts and sampling noise for all)")
    if overrides:
        p.add_argument("overrides", nargs="*", help="config overrides key=value")


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
    _common(a, overrides=False)
    a.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="global config override applied to every candidate (repeatable)")
    a.add_argument("--out", default=None, help="write the machine-readable report (JSON) here")
    a.add_argument("candidates", nargs="+", metavar="CANDIDATE",
                   help="comma-separated overrides, e.g. rollout.recipe=fp8_w8a8_kv or "
                        "rollout.weight_noise=0.05,rollout.stale_versions=1")
    a.set_defaults(func=_guard(_cmd_admit))

    s = subparsers.add_parser("sensitivity", help="mismatch M of quantizing one layer / module type at a time")
    _common(s)
    s.add_argument("--by", default="layer", choices=BY_CHOICES)
    s.add_argument("--metric", default="k3")
    s.add_argument("--no-kv", action="store_true", help="leave out the FP8 KV-cache unit")
    _kv_scales_flag(s)
    s.add_argument("--out", default=None, help="write the JSON report here")
    s.set_defaults(func=_guard(_cmd_sensitivity))

    r = subparsers.add_parser("recipe-search", help="greedy FP8 recipe (layers kept in BF16) that fits the budget")
    r.add_argument("--budget", required=True)
    _common(r)
    r.add_argument("--margin", type=float, default=0.8, help="fit when M <= margin * B (and CI high <= B)")
    r.add_argument("--by", default="layer", choices=[b for b in BY_CHOICES if b != "module"])
    r.add_argument("--memory-gb", type=float, default=80.0, help="device memory for the KV-capacity accounting")
    r.add_argument("--name", default="fp8_searched", help="name of the written recipe")
    _kv_scales_flag(r)
    r.add_argument("--out", default="runs/recipe_search", help="output directory")
    r.set_defaults(func=_guard(_cmd_recipe_search))

    c = subparsers.add_parser("capacity", help="KV-cache tokens that fit in device memory, BF16 vs a recipe")
    c.add_argument("--model", required=True, help=f"HF checkpoint dir, a preset ({', '.join(PRESET_MODELS)}) "
                                                   f"or a tiny size (tiny, small, base, 100m; family/size)")
    c.add_argument("--memory-gb", type=float, default=80.0, help="device memory in GiB")
    c.add_argument("--recipe", default="fp8_w8a8_kv", help="preset name or recipe file (.json/.yaml)")
    c.add_argument("--out", default=None)
    c.set_defaults(func=_guard(_cmd_capacity))
