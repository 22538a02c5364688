"""Layer sensitivity, greedy FP8 recipe search and KV-cache capacity accounting.

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

import dataclasses
import json
import pathlib
import time
from typing import Any, Mapping, Sequence

from opdjax import quant
from opdjax.admission import probe as probe_mod
from opdjax.admission.admit import ProbeFn, verdict
from opdjax.admission.budget import AdmissionError, Budget
from opdjax.core import layout
from opdjax.models import ModelConfig
from opdjax.pipeline.inputs import resolve_models
from opdjax.pipeline.rundir import write_text
from opdjax.rollout.vllm_settings import VllmSettingsError
from opdjax.rollout.vllm_settings import vllm_settings as _vllm_settings

__all__ = ["BY_CHOICES", "KV", "Unit", "units", "unit_recipe", "full_fp8_recipe", "vllm_settings", "capacity_report", "format_capacity", "sensitivity", "format_sensitivity", "SearchResult", "recipe_search", "write_search"]


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
    M = layout.MODULES
    if by == "layer":
        out = [Unit(f"layer{i}", (f"model.layers.{i}.self_attn.*_proj", f"model.layers.{i}.mlp.*_proj"))
               for i in range(num_layers)]
    elif by == "module":
        out = [Unit(m, (f"model.layers.*.{M[m]}",)) for m in M]
    elif by == "group":
        out = [Unit(g, tuple(f"model.layers.*.{M[m]}" for m in ms)) for g, ms in layout.FUSED_GROUPS.items()]
    else:
        out = [Unit(f"layer{i}.{g}", tuple(f"model.layers.{i}.{M[m]}" for m in ms))
               for i in range(num_layers) for g, ms in layout.FUSED_GROUPS.items()]
    return out + ([Unit(KV, kv=True)] if kv else [])


def _kv_scale_kw(kv_scales: Sequence | None) -> dict[str, Any]:
    """Recipe kwargs of the FP8 KV cache's scales: vLLM's fixed 1.0, or calibrated per-layer scales."""
    return {"kv_scale": 1.0} if kv_scales is None else {"kv_scales": tuple(kv_scales)}


def unit_recipe(unit: Unit, name: str | None = None, kv_scales: Sequence | None = None) -> quant.Recipe:
    """FP8 W8A8 (per-tensor weights, per-token activations) on the unit's modules only, or only the FP8 KV cache
    (scale 1.0 = vLLM's kv_cache_dtype="fp8", or calibrated per-layer `kv_scales`) for the KV unit; everything
    else in high precision."""
    name = name or f"fp8_only_{unit.label}"
    hp = tuple((p, None) for p in layout.HIGH_PRECISION_PATTERNS)
    if unit.kv:
        return quant.Recipe(name=name, weights=hp, kv_cache=_E4M3_TOK, **_kv_scale_kw(kv_scales))
    return quant.Recipe(name=name, weights=hp + tuple((p, _E4M3_T) for p in unit.patterns), activations=_E4M3_TOK)


def full_fp8_recipe(keep: Sequence[Unit] = (), name: str = "fp8_search", kv_scales: Sequence | None = None
                    ) -> quant.Recipe:
    """The full FP8 recipe (W8A8 on every decoder linear + FP8 KV cache, as preset fp8_w8a8_kv, or with
    calibrated per-layer `kv_scales`) with the `keep` units in high precision (their patterns come first: the first
    matching pattern wins)."""
    keep_kv = any(u.kv for u in keep)
    weights = tuple((p, None) for p in layout.HIGH_PRECISION_PATTERNS)
    weights += tuple((p, None) for u in keep for p in u.patterns)
    weights += tuple((p, _E4M3_T) for p in layout.DECODER_LINEAR_PATTERNS)
    if keep_kv:
        return quant.Recipe(name=name, weights=weights, activations=_E4M3_TOK)
    return quant.Recipe(name=name, weights=weights, activations=_E4M3_TOK, kv_cache=_E4M3_TOK,
                        **_kv_scale_kw(kv_scales))


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


def _probe_recipe(cfg, recipe: quant.Recipe, probe_fn: ProbeFn, *, batches: int, metric: str, seed: int):
    c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, recipe=recipe))  # no registry involved
    return probe_fn(c, batches=batches, metric=metric, seed=seed, log=lambda s: None)


def _student_config(cfg):
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
    probe_fn = probe_fn or probe_mod.probe
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
    mcfg = mcfg or _student_config(cfg)
    kw = dict(batches=batches, metric=budget.metric, seed=seed)
    trials = _Trials(cfg, probe_fn or probe_mod.probe, budget, margin * budget.budget, name, kv_scales, kw, log)
    keep: list[Unit] = []
    recipe, r = trials.probe(keep, "full fp8")
    log(f"full FP8 (W8A8 + FP8 KV): {budget.metric} {r.m:.3e} [{r.ci_low:.3e}, {r.ci_high:.3e}]; "
        f"target {trials.target:.3e} (margin {margin} x B {budget.budget:.3e})")
    sens = None
    if not trials.fits(r):
        log(f"sensitivity by {by}:")
        sens = sensitivity(cfg, by=by, probe_fn=trials.probe_fn, mcfg=mcfg, kv_scales=kv_scales, log=log, **kw)
        saving = _unit_savings(mcfg, sens, memory_bytes)
        all_units = {u.label: u for u in units(mcfg.num_layers, by)}
        keep, recipe, r = _keep_most_sensitive(trials, sens["units"], all_units, saving, recipe, r)
        if trials.fits(r):
            keep, recipe, r = _give_back(trials, keep, recipe, r, saving)
    saved = quant.weight_bytes(mcfg, None) - quant.weight_bytes(mcfg, recipe)
    return SearchResult(recipe=recipe, kept=[u.label for u in keep], fits=trials.fits(r), m=r.m, ci_low=r.ci_low,
                        ci_high=r.ci_high, steps=trials.steps, sensitivity=sens, vllm=_vllm_or_reason(mcfg, recipe),
                        capacity=capacity_report(mcfg, recipe, memory_bytes), weight_bytes_saved=saved,
                        seconds=time.time() - t0)


@dataclasses.dataclass
class _Trials:
    """Probes full-FP8 recipes that keep some units in high precision, and records each probe as a search step.

    A probe result fits when m <= target (= margin * B) and ci_high <= B."""

    cfg: Any
    probe_fn: ProbeFn
    budget: Budget
    target: float
    name: str
    kv_scales: Sequence | None
    probe_kw: dict[str, Any]
    log: Any
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def fits(self, r) -> bool:
        return r.m <= self.target and r.ci_high <= self.budget.budget

    def probe(self, kept: list[Unit], action: str):
        """(recipe, probe result) of the full FP8 recipe keeping `kept`; appended to `steps` as `action`."""
        rec = full_fp8_recipe(kept, name=self.name, kv_scales=self.kv_scales)
        res = _probe_recipe(self.cfg, rec, self.probe_fn, **self.probe_kw)
        self.steps.append({"action": action, "kept": [u.label for u in kept], "m": res.m, "ci_low": res.ci_low,
                           "ci_high": res.ci_high, "fits": self.fits(res)})
        return rec, res

    def attempt(self, kept: list[Unit], action: str):
        """`probe`, logged as one line of the search."""
        rec, res = self.probe(kept, action)
        self.log(f"  {action:<22} -> {self.budget.metric} {res.m:.3e} [{res.ci_low:.3e}, {res.ci_high:.3e}]"
                 f"{'  fits' if self.fits(res) else ''}")
        return rec, res


def _unit_savings(mcfg, sens: Mapping[str, Any], memory_bytes: float) -> dict[str, float]:
    """unit label -> bytes saved by quantizing it: weights, BF16 minus FP8 bytes with scales; the KV cache,
    (BF16 - FP8) bytes per token x the tokens a full-FP8 cache holds in `memory_bytes`."""
    full_tokens = quant.kv_capacity_tokens(mcfg, memory_bytes, full_fp8_recipe())
    kv_saving = full_tokens * (quant.kv_cache_bytes_per_token(mcfg, None)
                               - quant.kv_cache_bytes_per_token(mcfg, full_fp8_recipe()))
    return {row["unit"]: kv_saving if row["kv"] else row["weight_bytes_saved"] for row in sens["units"]}


def _keep_most_sensitive(trials: _Trials, rows: Sequence[Mapping[str, Any]], all_units: Mapping[str, Unit],
                         saving: Mapping[str, float], recipe: quant.Recipe, r):
    """Phase 1: keep units in high precision, largest contribution first (ties: smaller saving first), until the
    recipe fits; stop early once the remaining units do not reduce M. Returns (kept, recipe, probe result)."""
    keep: list[Unit] = []
    for row in sorted(rows, key=lambda x: (-x["contribution"], saving[x["unit"]])):
        if row["contribution"] <= 0 and keep:
            break  # the rest do not reduce M: keeping them costs memory for nothing
        keep.append(all_units[row["unit"]])
        recipe, r = trials.attempt(keep, f"keep {row['unit']}")
        if trials.fits(r):
            break
    return keep, recipe, r


def _give_back(trials: _Trials, keep: list[Unit], recipe: quant.Recipe, r, saving: Mapping[str, float]):
    """Phase 2: M is not additive; give back (re-quantize) kept units but the last, largest memory saving first,
    while the recipe still fits — this is what maximises the memory saved. Returns (kept, recipe, probe result)."""
    for u in sorted(keep[:-1], key=lambda u: -saving[u.label]):
        trial = [k for k in keep if k is not u]
        rec2, r2 = trials.attempt(trial, f"re-quantize {u.label}")
        if trials.fits(r2):
            keep, recipe, r = trial, rec2, r2
    return keep, recipe, r


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
    write_text(paths["recipe"], json.dumps(result.recipe.to_dict(), indent=2) + "\n")
    write_text(paths["vllm"], json.dumps(result.vllm, indent=2) + "\n")
    write_text(paths["report"], json.dumps(result.report(budget, margin), indent=2, default=str) + "\n")
    return {k: str(v) for k, v in paths.items()}
