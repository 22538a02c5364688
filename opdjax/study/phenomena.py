"""The study's other phenomena: (a) OPD versus RL under weight noise, (b) prefix shift under shared sampling
noise and what per-token corrections do about it.
"""

from __future__ import annotations

import functools
import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from opdjax.config import TrainConfig
from opdjax.data import tasks
from opdjax.data.prompts import encode_prompts
from opdjax.models import ModelConfig, hf
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline.components import sampling_params
from opdjax.pipeline.inputs import resolve_models
from opdjax.pipeline.opd import completion_texts
from opdjax.rollout import EngineMismatch, JaxEngine
from opdjax.study import dose
from opdjax.study.fit import finite_mean
from opdjax.study.records import Point, noise_point
from opdjax.study.study_config import StudyConfig


Log = Callable[[str], None]

__all__ = ["effect", "phenomena", "prefix_shift"]


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
    tok = load_tokenizer(student_path)
    mcfg = ModelConfig.from_dir(student_path).with_tokenizer(tok)
    _, params = hf.load_state(student_path, mcfg)
    task = tasks.get_task(cfg.task.name, **cfg.task.options)
    examples = task.examples(prompts, cfg.seed + 7, "heldout")
    enc = encode_prompts(tok, examples)
    sp = sampling_params(cfg, mcfg)
    T = max(cfg.rollout.temperature, 1e-6)
    kw = dict(pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    clean = JaxEngine(mcfg, params, **kw)
    N = cfg.rollout.max_new_tokens

    def grades(texts: Sequence[str]) -> list[float]:
        return [task.grade(e, t) or 0.0 for e, t in zip(examples, texts)]

    out = []
    for sigma in sigmas:
        acc: dict[str, list] = {}
        for s in seeds:
            a = clean.generate(enc, sp, seed=1000 + s)
            noisy = JaxEngine(mcfg, params, mismatch=EngineMismatch(weight_noise=float(sigma)), seed=s, **kw)
            b = noisy.generate(enc, sp, seed=1000 + s)
            pi = clean.score(b.tokens_BT, b.valid_BT, temperature=T)["logp_BT"]
            vals = _shift_metrics(a, b, pi, completion_texts(tok, a, sp.stop_token_ids),
                                 completion_texts(tok, b, sp.stop_token_ids), grades, N)
            for k, v in vals.items():
                acc.setdefault(k, []).append(v)
        out.append({"weight_noise": float(sigma), **{k: finite_mean(v) for k, v in acc.items()}})
    return out


def _shift_metrics(a, b, clean_logp_BT: np.ndarray, texts_a: Sequence[str], texts_b: Sequence[str],
                   grades: Callable[[Sequence[str]], list[float]], N: int) -> dict[str, float]:
    """One seed of `prefix_shift`: clean samples `a` versus perturbed samples `b` (rollout batches drawn with the
    same keys), `clean_logp_BT` = the clean engine's log-probs of b's tokens, N = max new tokens.

    r = mask·(log pi - log mu) on b;  seq_kl = mean_b Σ_t -r;  token_k3 = mean over b's completion tokens of
    (exp(r) - r - 1);  same_prefix_at_t = fraction of rows whose first divergence is ≥ t (or none), t = 1..N.
    """
    fd = [_first_divergence(x, y) for x, y in zip(a.completions(), b.completions())]
    div = [d for d in fd if d is not None]
    m = b.completion_mask_BT
    r = np.where(m, clean_logp_BT - b.rollout_logp_BT, 0.0)
    vals = {
        "frac_diverged": len(div) / len(fd),
        "first_div_mean": float(np.mean(div)) if div else float("nan"),
        "answer_changed": float(np.mean([x != y for x, y in zip(texts_a, texts_b)])),
        "seq_kl": float((-r).sum(1).mean()),
        "token_k3": float((np.expm1(r) - r)[m].mean()) if m.any() else 0.0,
        "accuracy_clean": float(np.mean(grades(texts_a))), "accuracy_perturbed": float(np.mean(grades(texts_b))),
    }
    for t in range(1, N + 1):
        vals[f"same_prefix_at_{t}"] = float(np.mean([d is None or d >= t for d in fd]))
    return vals


def phenomena(study: StudyConfig, sweep: list[Point], extra: list[Point], records: Mapping[str, list[dict]],
              rows: list[dict], baseline: Mapping, log: Log) -> dict[str, Any]:
    """Tables for (a) OPD vs RL under weight noise, (b) prefix shift and per-token corrections.

    records: point id -> the point's run records (one per seed); rows: the aggregated sweep rows (their probe M).
    """
    opd_row = functools.partial(_opd_row, records, {r["id"]: r for r in rows})
    out: dict[str, Any] = {}
    if study.rl.enabled:
        out["rl_vs_opd"] = _rl_vs_opd(study, records, opd_row)
    if study.shift.enabled:
        out["prefix_shift"] = _prefix_shift_tables(study, records, log)
        if study.shift.corrections:
            out["corrections"] = _corrections_table(study, records, baseline, opd_row)
    return out


def _opd_row(records: Mapping[str, list], by_id: Mapping[str, Mapping], sigma: float,
             pid: str | None = None) -> dict | None:
    """Means over seeds of the OPD run at weight noise `sigma` (or of point `pid`): the sweep point, else the extra
    OPD run trained for comparison; None when neither was run."""
    if pid is not None:
        recs = records.get(pid)
    else:
        pid = "baseline" if sigma == 0 else noise_point(sigma).id
        recs = records[pid] if pid in records else records.get(
            noise_point(sigma, "correction", None, False, "opd").id)
    if not recs:
        return None
    row = by_id.get(pid)
    return {**_seeds_row(recs), "m_probe": row["m_probe"] if row else None}


def effect(level: Sequence[float], ref: Sequence[float], quality: str) -> dict[str, Any]:
    """{"effect", "ci"}: one group of runs' final values (L,) against a reference group's (R,), on the study's
    scales (`dose.level_effect`: reverse_kl -> GM(rkl + 0.1) ratio - 1, accuracy -> mean drop) with the 95%
    bootstrap CI that resamples both groups (`dose.effect_ci`)."""
    y, yr = dose.run_scores(level, quality), dose.run_scores(ref, quality)
    return {"effect": dose.level_effect(y, yr, quality), "ci": list(dose.effect_ci(y, yr, quality))}


def _rl_vs_opd(study: StudyConfig, records: Mapping[str, list], opd_row: Callable[..., dict | None]) -> dict:
    """(a): per RL weight-noise level, the RL run and the OPD run, each against its own noise-free run (same
    seeds): accuracy_drop = acc_0 - acc and q_loss = GM(rkl + 0.1) / GM(rkl_0 + 0.1) - 1, each with a CI that
    resamples both groups' seeds; reverse_kl_rel_increase = (mean RKL - mean RKL_0) / mean RKL_0 as before."""
    rl0 = _seeds_row(records[study.rl.rl_point(0.0).id])
    opd_for_rl = (lambda s: opd_row(s, study.rl.opd_point(s).id)) if study.rl.common else opd_row
    opd0 = opd_for_rl(0.0)
    table = []
    for s in study.rl.levels():
        recs = records[study.rl.rl_point(s).id]
        rl = {**_seeds_row(recs), "reward_last": finite_mean(r.reward_last for r in recs)}
        opd = opd_for_rl(s)
        for row, ref in ((rl, rl0), (opd, opd0)):
            if row is not None and ref is not None:
                _against(row, ref)
        table.append({"weight_noise": s, "opd": opd, "rl": rl})
    return {"overrides": study.rl.overrides, "common": study.rl.common, "levels": table}


def _seeds_row(recs: Sequence) -> dict[str, Any]:
    """Means and per-seed finals of one group of runs (a method at one noise level)."""
    return {"reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
            "accuracy": float(np.mean([r.accuracy for r in recs])),
            "reverse_kl_seeds": [r.reverse_kl for r in recs], "accuracy_seeds": [r.accuracy for r in recs],
            "m_train": finite_mean(r.m_train_k3 for r in recs),
            "nonfinite_steps": int(sum(r.nonfinite_steps for r in recs))}


def _against(row: dict[str, Any], ref: Mapping[str, Any]) -> None:
    """Adds a method's change from its own noise-free runs to `row` (accuracy drop, q_loss, each with its CI)."""
    acc = effect(row["accuracy_seeds"], ref["accuracy_seeds"], "accuracy")
    rkl = effect(row["reverse_kl_seeds"], ref["reverse_kl_seeds"], "reverse_kl")
    row.update(accuracy_drop=acc["effect"], accuracy_drop_ci=acc["ci"], q_loss=rkl["effect"], q_loss_ci=rkl["ci"],
               reverse_kl_rel_increase=(row["reverse_kl"] - ref["reverse_kl"]) / max(abs(ref["reverse_kl"]), 1e-9))


def _prefix_shift_tables(study: StudyConfig, records: Mapping[str, list], log: Log) -> dict[str, Any]:
    """(b): `prefix_shift` of the initial student and, when the baseline's first seed kept it, the trained one."""
    first = records["baseline"][0]
    cfg = study.train_config_for({}, study.seeds[0])
    student0, _ = resolve_models(cfg, log=lambda s: None)
    trained = pathlib.Path(first.run_dir) / "student_final"
    log("prefix shift: clean vs perturbed engines under shared sampling noise ...")
    t0 = time.time()
    shift = {"initial_student": prefix_shift(student0, cfg, study.shift.weight_noise,
                                             prompts=study.shift.prompts, seeds=study.seeds)}
    if trained.is_dir():
        shift["trained_student"] = prefix_shift(trained, cfg, study.shift.weight_noise,
                                                prompts=study.shift.prompts, seeds=study.seeds)
    shift["seconds"] = time.time() - t0
    return shift


def _corrections_table(study: StudyConfig, records: Mapping[str, list], baseline: Mapping,
                       opd_row: Callable[..., dict | None]) -> dict[str, Any]:
    """(b'): the uncorrected OPD run and each per-token correction at `shift.correction_noise`: its quality loss
    against the mismatch-free baseline (q_loss, CI resampling the baseline's seeds too) and its effect against the
    uncorrected run at the same noise (vs_none: < 0 is a recovery; CI resampling both)."""
    s = float(study.shift.correction_noise)
    key = study.quality  # the quality names are the records' keys ("reverse_kl", "accuracy")
    table = [{"correction": "none", **(opd_row(s) or {})}]
    for c in study.shift.corrections:
        table.append({"correction": c, **_seeds_row(records[noise_point(s, "correction", {"loss": {"correction": c}},
                                                                         False, c).id])})
    none = table[0] if "reverse_kl" in table[0] else None
    for t in table:
        if "reverse_kl" not in t:
            continue
        q = effect(t[f"{key}_seeds"], baseline[f"{key}_seeds"], study.quality)
        t.update(q_loss=q["effect"], q_loss_ci=q["ci"])
        if none is not None and t is not none:
            v = effect(t[f"{key}_seeds"], none[f"{key}_seeds"], study.quality)
            t.update(vs_none=v["effect"], vs_none_ci=v["ci"])
    return {"weight_noise": s, "quality": study.quality, "rows": table}
