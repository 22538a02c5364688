"""The admission check: probe candidate rollout configurations and judge each against the budget B.

Commands (registered by `add_admission_commands`):

    opdjax admit --budget budget.json CANDIDATE...      probe each candidate, ADMIT / REJECT / UNCERTAIN against B
    opdjax sensitivity [--by layer|module|group|layer-group]   M of quantizing one unit at a time (FP8 W8A8)
    opdjax recipe-search --budget budget.json [--margin 0.8]  greedy FP8 recipe that fits the budget
    opdjax capacity --model DIR|PRESET --memory-gb 80 [--recipe NAME|FILE]   KV tokens that fit, BF16 vs recipe

Verdict (M = the budget's metric, measured by the sequential probe `opdjax.admission.probe.probe_sequential`: it
samples batch by batch and, after each, computes one-sided bounds [lo, hi] on M whose error rates hold under that
optional stopping (alpha spending over looks, `opdjax.admission.sequential`); `--risk` is the chance of a false ADMIT,
and separately of a false REJECT):

    ADMIT      hi <= B_lo       (M's whole interval is below every B the study's noise allows)
    REJECT     lo >  B_hi       (M's whole interval is above every one)
    UNCERTAIN  otherwise, once `--max-batches` batches are in, or as soon as M's bounds lie inside [B_lo, B_hi]
               (treat as not admitted: `admit` exits 1)

Which B: a candidate setting one kind the study fitted (staleness, weight noise) meets that kind's B; a
combination of study knobs (recipe + staleness, say) meets the harmonic mix 1 / sum_k s_k / B_k of its components'
B, s_k being each component's M probed alone as a share of their sum (`judged_against`: harm assumed to add as
M_k / B_k over kinds; a component kind with no B of its own, a recipe, counts at the envelope); anything else
meets the envelope, the B with the lowest lower end over the fitted kinds.

Staleness is judged where training sees it (`Budget.views`): the probe takes its stale version right after the
warm-up, where steps are largest, so its M saturates with k while training's keeps growing. The study records B on
training's M and, per trained level, r = training M / probe M with a seed interval; a staleness-k part meets
B_train / r(k) on the probe's scale (lower end B_train_lo / r_hi, upper end B_train_hi / r_lo; r log-log
interpolated between trained levels, and 1 or the largest recorded r outside them).

[B_lo, B_hi] is B's own interval (budget.json's `budget_interval`: the study's bootstrap over its baseline's and
levels' seeds), so B's uncertainty counts against a candidate, never for it; a budget file without one is decided
against the point B (B_lo = B_hi = B).

A candidate far from B stops after its first batch; one near B samples up to the cap. Each verdict comes with one
line saying why (M, bounds, B, batches).

A CANDIDATE is a comma-separated list of config overrides, split only at top-level commas so that mapping values
stay whole: `rollout.recipe=fp8_w8a8_kv`, `rollout.weight_noise=0.05,rollout.stale_versions=1`,
`rollout.engine=vllm,rollout.vllm={kv_cache_dtype: fp8, max_num_seqs: 8}`. `rollout.recipe` also accepts a recipe
file (JSON/YAML written by `recipe-search` or by hand, loadable by `quant.Recipe.from_dict`): the file is
registered in `quant.RECIPES` under its path, because `RolloutConfig.recipe` only accepts registered names.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from opdjax.admission import probe as probe_mod
from opdjax.admission.budget import AdmissionError, Budget
from opdjax.admission.records import AdmitRow
from opdjax.admission.sequential import explain, judge
from opdjax.config import TrainConfig, load
from opdjax.core.errors import ConfigError

__all__ = ["KNOBS", "VERDICTS", "verdict", "split_candidate", "candidate_config", "candidate_knobs",
           "candidate_levels", "candidate_overrides", "component_parts", "judged_against", "setup_source",
           "admit", "exit_code", "format_admit_table", "matching_point", "training_view", "view_line"]


VERDICTS = ("ADMIT", "REJECT", "UNCERTAIN")


def verdict(ci_low: float, ci_high: float, budget: float, budget_high: float | None = None) -> str:
    """ADMIT if ci_high <= budget (B's lower end), REJECT if ci_low > budget_high (B's upper end; default
    `budget`), UNCERTAIN otherwise (also for a NaN bound): the sequential probe's `judge`, final."""
    return judge(ci_low, ci_high, budget, budget_high) or "UNCERTAIN"


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


def candidate_config(config: str | Mapping[str, Any] | None, overrides: Sequence[str], candidate: Sequence[str] = ()):
    """TrainConfig = defaults <- config (a file, or a mapping: `setup_source`) <- global overrides <- candidate
    overrides (validated)."""
    return load(TrainConfig, config, [*overrides, *candidate])  # a recipe file is read by quant.as_recipe


def setup_source(budget: Budget, config: str | Mapping[str, Any] | None) -> str | Mapping[str, Any] | None:
    """What candidates are probed on: `config` when given; else the train config the budget's study recorded (the
    pair, task, rollout and optim settings B was calibrated with: a candidate is judged on the setup its budget
    holds for); else None (the embedded defaults, for a budget that recorded none)."""
    if config is not None or budget.train_config is None:
        return config
    try:
        load(TrainConfig, budget.train_config)
    except ConfigError as e:
        raise AdmissionError(f"budget file {budget.path}: the train config its study recorded does not load with "
                             f"this opdjax ({e}); pass --config with the setup to probe") from e
    return budget.train_config


# probe(cfg, budget, *, metric, risk, max_batches, seed, log, budget_high) -> ProbeResult-like (budget, budget_high:
# B's interval; `probe.probe_sequential`)
ProbeFn = Callable[..., Any]


def admit(candidates: Sequence[str], budget: Budget, *, config: str | Mapping[str, Any] | None = None,
          overrides: Sequence[str] = (),
          probe_fn: ProbeFn | None = None, risk: float = 0.05, max_batches: int | None = None, seed: int = 0,
          study_points: Sequence[Mapping[str, Any]] = (), log=print) -> list[AdmitRow]:
    """Probe each candidate (a comma-separated override string) sequentially and judge it against `budget`.

    Each candidate is layered on `setup_source(budget, config)` (the budget's own setup unless `config` is given),
    then `overrides`.

    Every candidate is parsed and its config validated, and `risk` and `max_batches` checked, before the first
    probe, so a typo fails fast. max_batches None: `probe.DEFAULT_MAX_BATCHES`. `study_points` (a study's
    budget.json `points`): a candidate whose knob that study trained gets its `training_view` line.
    """
    probe_fn = probe_fn or probe_mod.probe_sequential
    max_batches = probe_mod.DEFAULT_MAX_BATCHES if max_batches is None else max_batches
    if not 0 < risk < 0.5:
        raise AdmissionError(f"--risk must be in (0, 0.5) (the chance of a false ADMIT), got {risk!r}")
    if not isinstance(max_batches, int) or max_batches < 1:
        raise AdmissionError(f"--max-batches must be an integer >= 1, got {max_batches!r}")
    parsed = [(c, split_candidate(c)) for c in candidates]
    source = setup_source(budget, config)
    cfgs = [candidate_config(source, overrides, parts) for _, parts in parsed]
    m_alone: dict[tuple[str, ...], float] = {}  # a combination's component, probed once per call

    def alone(group: list[str]) -> float:
        if tuple(group) not in m_alone:
            m_alone[tuple(group)] = probe_fn(candidate_config(source, overrides, group), budget.budget,
                                             metric=budget.metric, risk=risk, max_batches=max_batches, seed=seed,
                                             log=lambda s: None).m
        return m_alone[tuple(group)]

    rows = []
    for (text, parts), cfg in zip(parsed, cfgs):
        log(f"probing {text} ...")
        which, b, b_lo, b_hi = judged_against(budget, parts, alone)
        r = probe_fn(cfg, b_lo, metric=budget.metric, risk=risk, max_batches=max_batches, seed=seed,
                     log=lambda s: None, budget_high=b_hi)
        v = verdict(r.ci_low, r.ci_high, b_lo, b_hi)
        rows.append(AdmitRow(candidate=text, overrides=parts, metric=r.metric, m=float(r.m), ci_low=float(r.ci_low),
                             ci_high=float(r.ci_high), budget=b, verdict=v, seconds=float(r.seconds),
                             tokens=int(r.tokens), metrics=dict(r.metrics), batches=int(r.batches), risk=risk,
                             reason=r.reason or explain(v, r.m, r.ci_low, r.ci_high, b_lo, r.batches,
                                                        max_batches, risk, b_hi),
                             budget_interval=None if budget.interval is None and not budget.per_kind else
                             [b_lo, b_hi if math.isfinite(b_hi) else None],
                             training=view_line(budget, parts, float(r.m))
                             or training_view(study_points, text, float(r.m)) or "", budget_kind=which))
    return rows


# The study knob each candidate override key sets (`opdjax.study.records.Point.knob`).
KNOBS = {"rollout.weight_noise": "weight_noise", "rollout.stale_versions": "staleness", "rollout.recipe": "recipe"}


def candidate_knobs(parts: Sequence[str]) -> set[str]:
    """The kinds of mismatch a candidate's overrides set, as study knob names (`KNOBS`): weight noise of another
    `rollout.noise_mode` than the study's "fixed" is its own kind ("noise:<mode>"); any other key is a kind no
    study trains ("other:<key>"), so `Budget.for_kind` judges it against the envelope."""
    kv = dict(p.split("=", 1) for p in parts)
    mode = kv.pop("rollout.noise_mode", "fixed").strip()
    knobs = {KNOBS.get(k.strip(), f"other:{k.strip()}") for k in kv}
    if mode != "fixed":
        knobs = (knobs - {"weight_noise"}) | {f"noise:{mode}"}
    return knobs


def component_parts(parts: Sequence[str]) -> dict[str, list[str]] | None:
    """A combination's parts grouped by the kind each sets ({kind: parts}, kinds as `candidate_knobs`; a
    rollout.noise_mode part goes with the weight noise it qualifies) when it sets >= 2 kinds, each a study knob
    (`KNOBS`); None otherwise (one kind, or a key no study trains: `Budget.for_kind` judges it)."""
    key = lambda p: p.split("=", 1)[0].strip()  # noqa: E731
    mode = [p for p in parts if key(p) == "rollout.noise_mode"]
    groups: dict[str, list[str]] = {}
    for p in (p for p in parts if key(p) != "rollout.noise_mode"):
        if key(p) not in KNOBS:
            return None
        group = [p, *mode] if key(p) == "rollout.weight_noise" else [p]
        (kind,) = candidate_knobs(group)
        groups.setdefault(kind, []).extend(group)
    return groups if len(groups) >= 2 else None


def judged_against(budget: Budget, parts: Sequence[str],
                   m_alone: Callable[[list[str]], float]) -> tuple[str, float, float, float]:
    """(which, B, lo, hi) a candidate is judged against: one kind's own B (on training's M at the candidate's
    level, for a kind the budget has a view of) or the envelope (`Budget.for_kind`); for a combination of study
    knobs, when the budget has B per kind, the harmonic mix of its components' B weighted by each component's M
    alone (`m_alone(parts)`, probed on the same setup) as a share of their sum (`Budget.for_shares`); the envelope
    when those M do not sum to a positive number. B is always in the probe's units (the M the verdict compares)."""
    levels = candidate_levels(parts)
    groups = component_parts(parts) if budget.per_kind else None
    if groups is None:
        return budget.for_kind(candidate_knobs(parts), levels)
    ms = {kind: max(float(m_alone(group)), 0.0) for kind, group in groups.items()}
    total = sum(ms.values())
    if not (math.isfinite(total) and total > 0):
        return budget.for_kind(candidate_knobs(parts))
    return budget.for_shares({kind: m / total for kind, m in ms.items()}, levels)


def candidate_levels(parts: Sequence[str]) -> dict[str, float]:
    """{knob: level} for each study knob (`KNOBS`) a candidate sets to a number ("rollout.stale_versions=12" ->
    {"staleness": 12.0}): where a kind judged on training's M (`Budget.views`) reads its training/probe ratio."""
    out = {}
    for p in parts:
        key, _, value = p.partition("=")
        try:
            out[KNOBS[key.strip()]] = float(value)
        except (KeyError, ValueError):
            continue
    return out


def candidate_overrides(candidate: str) -> dict[str, str]:
    """'a=1,b=2' -> {"a": "1", "b": "2"} (`split_candidate`'s parts)."""
    return dict(p.split("=", 1) for p in split_candidate(candidate))


def matching_point(points: Sequence[Mapping[str, Any]], candidate: str) -> Mapping[str, Any] | None:
    """The study's sweep point (budget.json `points`) that trained the candidate's own knob — its only KNOBS
    override, at the same value (numbers compared as numbers: "1" is 1.0), and of the same kind (weight noise of
    another noise_mode is not the study's knob: `candidate_knobs`) — or None."""
    knobs = {KNOBS[k]: v for k, v in candidate_overrides(candidate).items() if k in KNOBS}
    if len(knobs) != 1 or candidate_knobs(split_candidate(candidate)) != set(knobs):
        return None
    (knob, value), = knobs.items()
    return next((p for p in points if p.get("group") == "sweep" and p.get("knob") == knob
                 and _same_value(p.get("value"), value)), None)


def _same_value(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def training_view(points: Sequence[Mapping[str, Any]], candidate: str, m: float) -> str | None:
    """One line: the M training would see, when the study trained the candidate's knob: m * m_train / m_probe of
    that point (the probe measures the untrained student, and for staleness the step right after warm-up, the
    run's largest). None when the study has no such point or either M is missing."""
    p = matching_point(points, candidate)
    if p is None or not p.get("m_probe") or p.get("m_train") is None:
        return None
    r = float(p["m_train"]) / float(p["m_probe"])
    return (f"training sees about M x {r:.3g} = {m * r:.3e} (the study's point {p['id']}: probe M "
            f"{p['m_probe']:.3e}, training M {p['m_train']:.3e}); the verdict stays on the probe's M")


def view_line(budget: Budget, parts: Sequence[str], m: float) -> str | None:
    """One line for a candidate judged on training's M (`Budget.view_for`, as its verdict): the ratio at its level
    and the M training sees, against B on training's M. None for any other candidate."""
    seen = budget.view_for(candidate_knobs(parts), candidate_levels(parts))
    if seen is None:
        return None
    _, v, level = seen
    r, lo, hi = v.ratio(level)
    inside = v.levels_L[0] <= level <= v.levels_L[-1]
    where = ("the study's ratio between its levels, log-log interpolated" if inside else
             f"outside the trained levels {v.levels_L[0]:g}-{v.levels_L[-1]:g}: the ratio is taken as {r:.3g}")
    return (f"judged on training's M: training sees about M x {r:.3g} [{lo:.3g}, {hi:.3g}] = {m * r:.3e} ({where}) "
            f"against B on training's M {v.budget:.3e} [{v.interval[0]:.3e}, {v.interval[1]:.3e}]")


def exit_code(rows: Sequence[AdmitRow]) -> int:
    """0 when every candidate is admitted (and there is at least one), else 1."""
    return 0 if rows and all(r.verdict == "ADMIT" for r in rows) else 1


def format_admit_table(rows: Sequence[AdmitRow], budget: Budget | None = None) -> str:
    """The verdict table, then one line per candidate saying why."""
    w = max([len("candidate")] + [len(r.candidate) for r in rows])
    metric = rows[0].metric if rows else (budget.metric if budget else "M")
    head = (f"{'candidate':<{w}}  {metric:>10}  {'bounds':>23}  {'verdict':>9}  {'batches':>7}  {'tokens':>6}  "
            f"{'sec':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = f"[{r.ci_low:.3e}, {r.ci_high:.3e}]"
        lines.append(f"{r.candidate:<{w}}  {r.m:>10.3e}  {ci:>23}  {r.verdict:>9}  {r.batches:>7d}  {r.tokens:>6d}  "
                     f"{r.seconds:>6.1f}")
    if budget is not None:
        band = ("" if budget.interval is None else f" [{budget.interval[0]:.3e}, {budget.interval[1]:.3e}]: ADMIT "
                f"below its lower end, REJECT beyond its upper end")
        lines.append(f"budget B = {budget.budget:.3e}{band} ({budget.metric}"
                     + (f", delta {budget.delta:g}" if budget.delta is not None else "") + ")")
        lines += [f"  B for {k} (its own study levels): {b:.3e} [{lo:.3e}, {hi:.3e}]" if math.isfinite(hi) else
                  f"  {k}: no knee within its study levels, harmless up to M {b:.3e} (ADMIT below it, never REJECT)"
                  for k, (b, lo, hi) in budget.kinds.items()]
        lines += [f"  B for {k} on training's M: {v.budget:.3e} [{v.interval[0]:.3e}, {v.interval[1]:.3e}]; a "
                  f"probe's M x the training/probe ratio at its level (trained levels "
                  f"{', '.join(f'{x:g}' for x in v.levels_L)}) is judged against it" for k, v in budget.views.items()]
        if budget.per_kind:
            lines.append("  a candidate of one fitted kind is judged against its kind's B; a combination of study "
                         "knobs against its components' B mixed by their M shares; other kinds against the envelope "
                         "(the B with the lowest lower end)")
    per_kind = budget is not None and budget.per_kind
    kind = lambda r: f" (B of {r.budget_kind})" if per_kind else ""  # noqa: E731
    lines += ["", "why:"] + [f"  {r.candidate}: {r.verdict}{kind(r)}: {r.reason}"
                             + (f"\n    {r.training}" if r.training else "") for r in rows] if rows else []
    return "\n".join(lines)
