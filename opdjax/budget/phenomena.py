"""The study's other phenomena: (a) OPD versus RL under weight noise, (b) prefix shift under shared sampling
noise and what per-token corrections do about it.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from opdjax.budget.fit import _finite_mean, quality_losses
from opdjax.budget.records import Point, noise_point
from opdjax.budget.study_config import StudyConfig
from opdjax.config import TrainConfig
from opdjax.data import tasks
from opdjax.data.prompts import encode_prompts
from opdjax.models import ModelConfig, hf
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline.build import resolve_models, sampling_params
from opdjax.pipeline.steps import completion_texts
from opdjax.rollout.jax_engine import JaxEngine


Log = Callable[[str], None]

__all__ = ["phenomena", "prefix_shift"]


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
    mcfg = ModelConfig.from_dir(student_path)
    _, params = hf.load_state(student_path, mcfg)
    task = tasks.get_task(cfg.task.name, **cfg.task.options)
    examples = task.examples(prompts, cfg.seed + 7, "heldout")
    enc = encode_prompts(tok, examples)
    sp = sampling_params(cfg, tok)
    T = max(cfg.rollout.temperature, 1e-6)
    kw = dict(pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    clean = JaxEngine(mcfg, params, **kw)
    N = cfg.rollout.max_new_tokens

    def texts(batch):
        return completion_texts(tok, batch)

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
            pi = clean.score(b.tokens_BT, b.valid_BT, temperature=T)["logp_BT"]
            m = b.completion_mask_BT
            r = np.where(m, pi - b.rollout_logp_BT, 0.0)
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


def phenomena(study: StudyConfig, sweep: list[Point], extra: list[Point], records: Mapping[str, list[dict]],
              rows: list[dict], baseline: Mapping, log: Log) -> dict[str, Any]:
    """Tables for (a) OPD vs RL under weight noise, (b) prefix shift and per-token corrections."""
    by_id = {r["id"]: r for r in rows}
    out: dict[str, Any] = {}

    def opd_row(sigma: float, pid: str | None = None) -> dict | None:
        if pid is not None:
            recs = records.get(pid)
        else:
            pid = "baseline" if sigma == 0 else noise_point(sigma).id
            recs = records[pid] if pid in records else records.get(
                noise_point(sigma, "correction", None, False, "opd").id)
        if not recs:
            return None
        row = by_id.get(pid)
        return {"reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
                "accuracy": float(np.mean([r.accuracy for r in recs])),
                "reverse_kl_seeds": [r.reverse_kl for r in recs], "accuracy_seeds": [r.accuracy for r in recs],
                "m_probe": row["m_probe"] if row else None, "m_train": _finite_mean(r.m_train_k3 for r in recs),
                "nonfinite_steps": int(sum(r.nonfinite_steps for r in recs))}

    if study.rl.enabled:
        rl_levels = study.rl.levels()
        table = []
        rl0 = records[study.rl.rl_point(0.0).id]
        rl0_acc = float(np.mean([r.accuracy for r in rl0]))
        rl0_rkl = float(np.mean([r.reverse_kl for r in rl0]))
        opd_for_rl = (lambda s: opd_row(s, study.rl.opd_point(s).id)) if study.rl.common else opd_row
        opd0 = opd_for_rl(0.0)
        for s in rl_levels:
            recs = records[study.rl.rl_point(s).id]
            rl = {"reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
                  "accuracy": float(np.mean([r.accuracy for r in recs])),
                  "accuracy_seeds": [r.accuracy for r in recs],
                  "reward_last": _finite_mean(r.reward_last for r in recs),
                  "m_train": _finite_mean(r.m_train_k3 for r in recs),
                  "nonfinite_steps": int(sum(r.nonfinite_steps for r in recs))}
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
        out["prefix_shift"] = shift
        if study.shift.corrections:
            s = float(study.shift.correction_noise)
            ref = opd_row(s)
            table = [{"correction": "none", **(ref or {})}]
            for c in study.shift.corrections:
                recs = records[noise_point(s, "correction", {"loss": {"correction": c}}, False, c).id]
                table.append({"correction": c, "reverse_kl": float(np.mean([r.reverse_kl for r in recs])),
                              "accuracy": float(np.mean([r.accuracy for r in recs])),
                              "reverse_kl_seeds": [r.reverse_kl for r in recs],
                              "accuracy_seeds": [r.accuracy for r in recs],
                              "m_train": _finite_mean(r.m_train_k3 for r in recs)})
            for t in table:
                if "reverse_kl" in t:
                    t["q_loss"] = quality_losses([t], baseline, study.quality)[0]
            out["corrections"] = {"weight_noise": s, "rows": table}
    return out
