"""The mismatch-budget study: budget fit on synthetic points, a small end-to-end study, resume, prefix shift."""

import dataclasses
import hashlib
import json
import math
import pathlib

import pytest

from opdjax.admission import budget as bio
from opdjax.config import ConfigError
from opdjax.study import fit, phenomena, report
from opdjax.study import study as study_mod
from opdjax.study import study_config
from opdjax.study.records import RunResult

# ----------------------------------------------------------------------------------------------------- pure fit


def _pts(*mq):
    return [{"m": m, "q_loss": q} for m, q in mq]


def test_budget_is_last_point_before_first_failure_in_increasing_m():
    # Unordered input; the 0.2 point is within delta but lies beyond the first failure (0.1), so it cannot raise B.
    pts = _pts((0.1, 0.5), (0.0, 0.0), (0.03, 0.19), (0.2, 0.1), (0.01, 0.05))
    b, within = fit.fit_budget(pts, delta=0.2)
    assert b == 0.03
    assert within == [False, True, True, True, True]


def test_isotonic_fit_pools_a_noisy_point_and_first_failure_does_not():
    # 0.01 lands just outside delta by noise, its neighbour well inside: pooled (0.15) they are within.
    pts = _pts((0.0, 0.0), (0.01, 0.25), (0.02, 0.05), (0.1, 0.9))
    assert fit.fit_budget(pts, delta=0.2) == (0.02, [True, False, True, False])
    assert fit.fit_budget(pts, delta=0.2, method="first_failure")[0] == 0.0
    assert fit.monotone_q_loss(pts) == [0.0, pytest.approx(0.15), pytest.approx(0.15), 0.9]
    # a diverged point pools to inf: nothing at or beyond it counts, whatever follows
    assert fit.fit_budget(_pts((0.0, 0.0), (0.01, math.inf), (0.02, 0.0)), 0.2)[0] == 0.0
    with pytest.raises(ValueError, match="fit method"):
        fit.fit_budget(pts, 0.2, method="median")


def test_budget_tolerance_is_inclusive_and_all_within_gives_the_largest_m():
    b, within = fit.fit_budget(_pts((0.0, 0.0), (0.5, 0.2), (0.2, 0.2)), delta=0.2)
    assert b == 0.5 and all(within)


def test_budget_tied_m_needs_every_tied_point_within():
    b, _ = fit.fit_budget(_pts((0.0, 0.0), (0.1, 0.0), (0.1, 0.9)), delta=0.2)
    assert b == 0.0


def test_budget_nan_loss_counts_as_outside_and_empty_or_failing_start_gives_zero():
    b, within = fit.fit_budget(_pts((0.0, 0.0), (0.1, float("nan")), (0.2, 0.0)), delta=0.2)
    assert b == 0.0 and within == [True, False, True]
    assert fit.fit_budget([], 0.2) == (0.0, [])
    assert fit.fit_budget(_pts((0.01, 1.0)), 0.2)[0] == 0.0
    # A point without a probe M (None) is ignored by the walk.
    assert fit.fit_budget([{"m": None, "q_loss": 9.0}, *_pts((0.0, 0.0), (0.3, 0.1))], 0.2)[0] == 0.3


def test_quality_losses_relative_reverse_kl_and_accuracy_drop():
    base = {"reverse_kl": 2.0, "accuracy": 0.8}
    recs = [{"reverse_kl": 3.0, "accuracy": 0.5}, {"reverse_kl": float("nan"), "accuracy": 0.5}]
    # (3 + 0.1) / (2 + 0.1) - 1: the 0.1-nat offset of `dose.run_scores`
    assert fit.quality_losses(recs, base, "reverse_kl") == [pytest.approx(1.0 / 2.1), math.inf]
    assert fit.quality_losses(recs[:1], base, "accuracy") == [pytest.approx(0.3)]


def test_first_divergence_position():
    assert phenomena._first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert phenomena._first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert phenomena._first_divergence([1, 2], [1, 2, 3]) == 2


def test_load_budget_rejects_missing_and_malformed_files(tmp_path):
    with pytest.raises(bio.AdmissionError, match="does not exist"):
        bio.load_budget(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"metric": "k3", "budget": "x", "delta": 0.1, "points": []}))
    with pytest.raises(bio.AdmissionError, match="'budget' has the wrong type"):
        bio.load_budget(bad)


# ----------------------------------------------------------------------------------------------------- end to end


def _study(pair, out, *extra):
    return study_config.load_study(None, [
        f"out_dir={out}", f"base.student={pair[0]}", f"base.teacher={pair[1]}", "base.task.options={digits: 1}",
        "base.rollout.batch_size=8", "base.rollout.max_new_tokens=4", "base.pipeline.steps=2",
        "base.pipeline.eval_every=2", "base.pipeline.eval_prompts=8", "base.pipeline.tensorboard=false",
        "rl.overrides={loss: {name: reinforce}, rollout: {samples_per_prompt: 2, batch_size: 4}}",
        "shift.prompts=8", *extra], small=True)


@pytest.mark.slow  # real training runs of a --small study (~55 s)
def test_small_study_writes_all_outputs_and_resume_skips_finished_runs(pair, tmp_path, monkeypatch):
    # Real runs on tiny models: 2 of the `--small` sweep points, phenomena off (covered with fake runs below).
    study = _study(pair, tmp_path / "study", "staleness=[]", "rl.enabled=false", "shift.enabled=false")
    out = study_mod.run_study(study, log=lambda s: None)
    root = tmp_path / "study"
    for name in ("budget.json", "points.csv", "budget.png", "summary.md"):
        assert (root / name).is_file() and (root / name).stat().st_size > 0, name
    saved = json.loads((root / "budget.json").read_text())
    assert {"metric", "budget", "delta", "quality", "baseline", "points", "created", "config"} <= set(saved)
    assert [p["id"] for p in saved["points"]] == ["baseline", "weight_noise=0.3"]
    for p in saved["points"]:
        assert {"knob", "value", "m_probe", "m_probe_ci", "m_train", "q_reverse_kl", "q_accuracy", "q_loss",
                "seeds", "within_budget"} <= set(p)
    base = saved["points"][0]
    # The mismatch-free point: same f32 weights in engine and learner, so M is float rounding only.
    assert base["m_probe"] < 1e-6 and base["q_loss"] == pytest.approx(0.0, abs=1e-9)
    assert saved["points"][1]["m_probe"] > 1e-3  # sigma = 0.3 relative weight noise is a real mismatch
    assert out["budget"] == saved["budget"] >= base["m_probe"]
    # 2 training steps leave sigma 0.3 within or beyond delta by chance; either way the summary says which.
    headline = "Budget B" if saved["status"] == "RESOLVED" else "Budget UNRESOLVED"
    assert headline in (root / "summary.md").read_text() and saved["bracket"]["factor"] == 3.0
    assert len(list((root / "results").rglob("*.json"))) == 2
    for rec in (json.loads(f.read_text()) for f in (root / "results").rglob("*.json")):  # real clocks
        assert [r[0] for r in rec["eval_curve"]] == [0, 2] and rec["eval_curve"][1][3] > 0
        assert rec["to_quality"]["eval/reverse_kl"]["reference"] == saved["baseline"]["reverse_kl"]
    # What the budget was calibrated on: the exact student and teacher weights.
    for role, path in zip(("student", "teacher"), pair):
        want = hashlib.sha256(pathlib.Path(path, "model.safetensors").read_bytes()).hexdigest()
        assert saved["calibrated_on"][f"{role}_sha256"] == want
    short = saved["calibrated_on"]["student_sha256"][:16]
    assert f"student weights sha256 `{short}`" in (root / "summary.md").read_text()

    # Resume: nothing reruns when every result is saved ...
    calls = []
    from opdjax.pipeline import loop as pipeline

    real_train = pipeline.train

    def counting_train(cfg, log=print):
        calls.append(cfg.pipeline.out_dir)
        return real_train(cfg, log)

    monkeypatch.setattr(pipeline, "train", counting_train)
    study_mod.run_study(study, log=lambda s: None)
    assert calls == []
    # ... and only the missing (point, seed) run after its result file is removed.
    (root / "results" / "weight_noise=0.3" / "seed0.json").unlink()
    study_mod.run_study(study, log=lambda s: None)
    assert len(calls) == 1 and calls[0].endswith("weight_noise=0.3/seed0")
    # A new kind of weight noise for the study: the noisy point reruns, the noise-free baseline (whose run the
    # noise kind cannot change: `run_identity`) is reused.
    other = _study(pair, tmp_path / "study", "staleness=[]", "rl.enabled=false", "shift.enabled=false",
                   "base.rollout.noise_mode=rounding")
    study_mod.run_study(other, log=lambda s: None)
    assert len(calls) == 2 and calls[1].endswith("weight_noise=0.3/seed0")


def _fake_runs(monkeypatch):
    """pipeline.train / probe stand-ins: final RKL = 1 + 100·sigma² (+ 0.3 for RL), M = sigma², k3 logged; the
    evaluations: RKL 50 at step 0 (training second 0), the final RKL at step 1 (training second 2)."""
    from opdjax.admission import probe
    from opdjax.admission.records import ProbeResult
    from opdjax.pipeline import loop as pipeline

    def fake_train(cfg, log=print):
        out = pathlib.Path(cfg.pipeline.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        s = cfg.rollout.weight_noise + 0.01 * cfg.rollout.stale_versions
        rl = cfg.loss.name == "reinforce"
        rkl = 1.0 + 100 * s * s + (0.3 if rl else 0.0) + 0.01 * cfg.seed
        step = {"loss": 0.0, "grad_norm": 1.0, "mismatch/k3": s * s, "mismatch/k1": 0.0,
                "mismatch/abs_log_ratio_p95": s, "policy/step_k3": 1e-4 * (1 + cfg.seed),
                **({"reward_mean": 0.5} if rl else {})}
        first = {"step": 0, "eval/reverse_kl": 50.0, "eval/accuracy": 0.0, "time/elapsed_train": 0.0}
        step.update({"eval/reverse_kl": rkl, "eval/accuracy": max(0.9 - s, 0.0), "time/elapsed_train": 2.0})
        (out / "metrics.jsonl").write_text(json.dumps(first) + "\n" + json.dumps({"step": 1, **step}) + "\n")
        (out / "student_final").mkdir(exist_ok=True)
        return {"steps": 1, "initial": {"eval/reverse_kl": 50.0, "eval/accuracy": 0.0},
                "final": {"eval/reverse_kl": rkl, "eval/accuracy": max(0.9 - s, 0.0)}}

    def fake_probe(cfg, *, batches=4, metric="k3", seed=0, log=print):
        s = cfg.rollout.weight_noise + 0.01 * cfg.rollout.stale_versions
        return ProbeResult(metric=metric, m=s * s, ci_low=0.5 * s * s, ci_high=2 * s * s, metrics={},
                                 seconds=0.0, tokens=10)

    monkeypatch.setattr(pipeline, "train", fake_train)
    monkeypatch.setattr(probe, "probe", fake_probe)
    monkeypatch.setattr(phenomena, "prefix_shift", lambda path, cfg, sigmas, **kw: [
        {"weight_noise": s, "frac_diverged": s, "first_div_mean": 1.0, "answer_changed": s, "seq_kl": s,
         "token_k3": s * s, "same_prefix_at_1": 1 - s} for s in sigmas])


def test_study_fits_the_knee_and_reports_rl_and_correction_phenomena(pair, tmp_path, monkeypatch):
    _fake_runs(monkeypatch)
    # RKL = 1 + 100 sigma^2: q_loss = 100 sigma^2 -> 0.01, 0.09, 0.25, 1.0 for sigma = 0.01, 0.03, 0.05, 0.1.
    study = _study(pair, tmp_path / "fake", "seeds=[0, 1]", "weight_noise=[0, 0.01, 0.03, 0.05, 0.1]",
                   "staleness=[]", "delta=0.2", "fit=isotonic", "rl.weight_noise=[0.1]",
                   "rl.common={optim: {lr: 0.0003}}",
                   "shift.correction_noise=0.07",
                   "shift.corrections=[token_tis, token_mis]")
    out = study_mod.run_study(study, log=lambda s: None)
    assert out["budget"] == pytest.approx(0.03 ** 2)
    assert [p["within_budget"] for p in out["points"]] == [True, True, True, False, False]
    spread = out["points"][1]["q_loss_spread"]
    # per-seed offset 0.01·seed / the baseline's reference RKL + 0.1, the geometric mean of its seeds' 1.1 and 1.11
    assert spread["max"] - spread["min"] == pytest.approx(0.01 / math.sqrt(1.1 * 1.11))
    rl = out["phenomena"]["rl_vs_opd"]["levels"]
    assert [t["weight_noise"] for t in rl] == [0.0, 0.1]
    assert rl[1]["rl"]["reverse_kl_rel_increase"] == pytest.approx(1.0 / 1.305, rel=1e-6)
    assert rl[1]["opd"]["reverse_kl_rel_increase"] == pytest.approx(1.0 / 1.005, rel=1e-6)
    assert (tmp_path / "fake" / "results" / "opd_rl__weight_noise=0.1").is_dir()  # rl.common: own OPD runs
    for method in ("rl", "opd"):  # every change from the clean run carries a CI that resamples both groups
        lo, hi = rl[1][method]["q_loss_ci"]
        assert lo <= rl[1][method]["q_loss"] <= hi and rl[1][method]["accuracy_drop_ci"][0] <= rl[1][method][
            "accuracy_drop"] <= rl[1][method]["accuracy_drop_ci"][1]
    corr = out["phenomena"]["corrections"]["rows"]
    assert [c["correction"] for c in corr] == ["none", "token_tis", "token_mis"]  # 0.07 is not a sweep point:
    assert all(c["q_loss_ci"][0] <= c["q_loss"] <= c["q_loss_ci"][1] for c in corr)
    assert "vs_none" not in corr[0] and all(c["vs_none_ci"][0] <= c["vs_none"] <= c["vs_none_ci"][1] for c in corr[1:])
    assert (tmp_path / "fake" / "results" / "opd__weight_noise=0.07").is_dir()  # an extra OPD run was trained
    md = (tmp_path / "fake" / "summary.md").read_text()
    assert "(a) OPD versus the RL baseline" in md and "Prefix shift" in md and "Per-token corrections" in md
    assert out["baseline"]["policy_step_k3_median_seeds"] == pytest.approx([1e-4, 2e-4])  # seeds 0 and 1
    assert "movement of the student (median policy/step_k3 over steps): 0.00015 over seeds (range 0.0001–0.0002" in md


def test_prefix_shift_without_noise_reproduces_the_clean_samples(pair):
    study = _study(pair, "unused")
    cfg = study.train_config_for({}, 0)
    (clean,) = phenomena.prefix_shift(pair[0], cfg, [0.0], prompts=16, seeds=[0])
    # Same weights and same seed: identical samples, so nothing diverges and the sequence KL is 0.
    assert clean["frac_diverged"] == 0.0 and clean["answer_changed"] == 0.0
    assert abs(clean["seq_kl"]) < 1e-5
    (noisy,) = phenomena.prefix_shift(pair[0], cfg, [1.0], prompts=16, seeds=[0])
    assert noisy["frac_diverged"] > 0 and noisy["same_prefix_at_1"] < 1.0


def test_validity_table_separates_seed_decided_verdicts():
    row = lambda c, v, qs, agree: {"candidate": c, "m": 1e-3, "ci": [5e-4, 2e-3], "verdict": v,  # noqa: E731
                                   "reverse_kl_seeds": [1.0] * len(qs), "q_loss_seeds": qs,
                                   "q_loss": sum(qs) / len(qs), "should_admit": sum(qs) / len(qs) <= 2.0,
                                   "agree": agree}
    rep = {"budget": 1e-3, "metric": "k3", "delta": 2.0, "seeds": [0, 1], "agreement": 2, "n": 3,
           "rows": [row("a", "ADMIT", [0.5, 1.0], True), row("b", "REJECT", [3.0, 9.0], True),
                    row("c", "REJECT", [2.5, 0.1], False)],
           "admit_wall_seconds": 3.0, "probe_seconds_per_candidate": 1.0, "max_probe_seconds": 1.5,
           "mean_study_point_seconds": 100.0, "probe_cost_ratio": 0.01}
    md = report.validity_markdown(rep)
    assert fit.straddles([2.5, 0.1], 2.0) and not fit.straddles([3.0, 9.0], 2.0)
    assert "2/2 where every seed's q_loss falls on the same side of delta, 0/1 where the seeds straddle" in md
    assert md.count("(seeds straddle delta)") == 1
    assert "**1.0%**" in md


def test_knee_search_brackets_the_knee_by_stepping_then_bisecting():
    # q_loss = 100 sigma^2, M = sigma^2, delta 0.2: the knee is at sigma 0.0447 (M 0.002).
    seen = []

    def measure(sigma):
        seen.append(sigma)
        return sigma ** 2, 100 * sigma ** 2

    knee = study_config.KneeConfig(enabled=True, start=0.01, step=4.0, factor=3.0, max_points=8)
    tried = study_mod.knee_search(knee, 0.2, measure, log=lambda s: None)
    assert tried == seen == [0.01, 0.04, 0.16, 0.08, 0.0566]  # up x4 until beyond, then halve log sigma
    assert 0.0566 ** 2 / 0.04 ** 2 <= 3.0 < 0.08 ** 2 / 0.04 ** 2
    down = study_mod.knee_search(dataclasses.replace(knee, start=0.5), 0.2, measure, log=lambda s: None)
    assert down[:3] == [0.5, 0.125, 0.0312]  # beyond at the start: down x4 until within, then bisect
    capped = study_mod.knee_search(dataclasses.replace(knee, max_points=3), 0.2, measure, log=lambda s: None)
    assert capped == [0.01, 0.04, 0.16]
    with pytest.raises(ConfigError, match="knee.factor must be > 1"):
        study_config.load_study(None, ["knee.factor=1"])


def test_the_seed_count_is_bounded_with_its_own_message(tmp_path, capsys):
    """Issue 38 row 7: a 10^6-seed study was refused as "an alias bomb?" (from YAML) or accepted (from a mapping).
    Each of seeds and baseline_seeds holds at most MAX_SEEDS, refused in one line that says so."""
    from opdjax.cli.main import main

    bound = f"at most {study_config.MAX_SEEDS:,}"
    with pytest.raises(ConfigError, match=f"seeds: 1,000,000 seeds; .*{bound}"):
        study_config.load_study({"seeds": list(range(10**6))})
    with pytest.raises(ConfigError, match=f"baseline_seeds: 5,000 seeds; .*{bound}"):
        study_config.load_study({"baseline_seeds": list(range(5000))})
    p = tmp_path / "s.yaml"
    p.write_text("seeds: [" + ", ".join(map(str, range(2000))) + "]\n")
    assert main(["study", "--config", str(p), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seeds: 2,000 seeds" in err[0] and "alias" not in err[0], err


def test_knee_candidates_sit_below_inside_and_above_the_bracket_and_never_on_a_searched_level():
    def pts(levels):
        return [{"knob": "baseline", "value": 0, "m_probe": 1e-12}] + [
            {"knob": "weight_noise", "value": s, "m_probe": m} for s, m in levels]

    searched = [(0.01, 0.0017), (0.02, 0.0085), (0.0283, 0.0155), (0.04, 0.032)]
    assert study_mod.knee_candidates(pts(searched), 0.0017) == [0.005, 0.0141, 0.03]
    # B at sigma 0.02: 0.01 = 0.02 / 2 was searched (nudged down to 0.009); sqrt(0.02 * 0.0283) = 0.0238 was not
    assert study_mod.knee_candidates(pts(searched), 0.0085) == [0.009, 0.0238, 0.0425]
    # the shipped built-in pair's search (docs/results/budget_cpu): bracket [sigma 0.0025, 0.00354] after 0.005 was tried
    bisected = [(0.01, 2.7e-3), (0.0025, 1.6e-4), (0.005, 6.6e-4), (0.00354, 3.2e-4)]
    assert study_mod.knee_candidates(pts(bisected), 1.6e-4) == [0.00125, 0.00297, 0.00531]
    # M not monotone in sigma (one noise draw per seed): a searched level can sit at the geometric mean
    odd = [(0.01, 2e-3), (0.04, 5e-4), (0.02, 1e-3)]  # within: 0.04 and 0.02, beyond: 0.01
    assert study_mod.knee_candidates(pts(odd), 1e-3) == [0.018, 0.021, 0.015]  # 0.04/2 and sqrt(0.04*0.01) nudged
    assert study_mod.knee_candidates(pts(searched), 0.05) == []  # nothing beyond B: no bracket, no candidates
    assert study_mod.knee_candidates(pts(searched), 1e-3) == []  # nothing within B
    # docs/results/budget_sort_cpu_llama: B 1.42, 1.5 sigma_b = 1.5 probes 3.6 < 3 B; sigma 2.0 (M 8.64) is the first >= 3 B
    llama = [(0.5, 0.74), (1.0, 2.02), (2.0, 8.64), (3.0, 15.0)]
    assert study_mod.knee_candidates(pts(llama), 1.42) == [0.25, 0.707, 1.5, 2.2]
    # docs/results/budget_sort_cpu (qwen3): M saturates near 16 < 3 B = 22.7, so no level reaches 3 B: no fourth candidate
    qwen3 = [(0.5, 1.78), (1.0, 5.97), (2.0, 12.4), (3.0, 15.4)]
    assert study_mod.knee_candidates(pts(qwen3), 7.57) == [0.45, 1.41, 3.3]

def test_study_records_carry_time_to_quality_against_the_baseline(pair, tmp_path, monkeypatch):
    """Each saved record measures its evaluation curve against the baseline's final reverse KL (the baseline's own
    records too, rewritten once the baseline is known)."""
    _fake_runs(monkeypatch)
    study = _study(pair, tmp_path / "fake", "seeds=[0, 1]", "weight_noise=[0, 0.3]", "staleness=[]",
                   "fit=isotonic", "rl.enabled=false", "shift.enabled=false")
    out = study_mod.run_study(study, log=lambda s: None)
    ref = out["baseline"]["reverse_kl"]  # about 1.005: seeds 1.0 and 1.01
    for point, seed, reached in (("baseline", 1, ["0.5", "0.8", "0.9", "0.95"]),
                                 ("weight_noise=0.3", 0, ["0.5", "0.8"])):
        rec = json.loads((tmp_path / "fake" / "results" / point / f"seed{seed}.json").read_text())
        q = rec["to_quality"]["eval/reverse_kl"]
        assert q["reference"] == ref and q["reference_from"] == "baseline final" and q["initial"] == 50.0
        # sigma 0.3: RKL 10, (50 - 10) / (50 - ref) = 0.82 of the way: 0.5 and 0.8 reached at step 1, second 2
        assert [f for f, t in q["thresholds"].items() if t["reached"] == "reached"] == reached
        assert {(t["step"], t["seconds"]) for f, t in q["thresholds"].items() if f in reached} == {(1, 2.0)}
        p = (50.0 - (1.01 if point == "baseline" else 10.0)) / (50.0 - ref)
        assert q["auc"] == pytest.approx(p / 2)  # one trapezoid from 0 to p over 2 s
        assert rec["to_quality"]["eval/accuracy"]["reference"] == pytest.approx(0.9)
    old = dict(rec, eval_curve=[r[:3] for r in rec["eval_curve"]], to_quality=None)  # a record without clocks
    assert study_mod.against_baseline(RunResult.from_dict(old), out["baseline"]).to_quality is None


def test_adaptive_study_reports_a_bracketed_b_and_a_fixed_sweep_that_misses_the_knee_is_unresolved(
        pair, tmp_path, monkeypatch):
    _fake_runs(monkeypatch)  # q_loss ~ 100 sigma^2 / 1.005, M = sigma^2
    study = _study(pair, tmp_path / "adaptive", "seeds=[0, 1, 2, 3]", "weight_noise=[0]", "staleness=[]",
                   "delta=0.2", "fit=isotonic", "knee={enabled: true, start: 0.01}", "rl.enabled=false",
                   "shift.enabled=false")
    out = study_mod.run_study(study, log=lambda s: None)
    ids = [p["id"] for p in out["points"]]
    assert ids == ["baseline", "weight_noise=0.01", "weight_noise=0.04", "weight_noise=0.0566",
                   "weight_noise=0.08", "weight_noise=0.16"]
    assert out["status"] == "RESOLVED" and out["budget"] == pytest.approx(0.04 ** 2)
    br = out["bracket"]
    assert br["within"] == pytest.approx(0.04 ** 2) and br["beyond"] == pytest.approx(0.0566 ** 2)
    lo, hi = out["budget_interval"]
    assert lo <= out["budget"] <= hi
    for p in out["points"]:  # per-seed offsets 0.01 * seed: each CI holds the mean, verdicts are decided
        assert p["q_loss_ci"][0] <= p["q_loss"] <= p["q_loss_ci"][1]
        assert p["runs_verdict"] == ("admit" if p["q_loss"] <= 0.2 else "reject")
    md = (tmp_path / "adaptive" / "summary.md").read_text()
    assert "**Budget B = 0.0016**" in md and "95% interval over resampled seeds" in md
    assert bio.load_budget(tmp_path / "adaptive" / "budget.json").budget == pytest.approx(0.0016)

    fixed = _study(pair, tmp_path / "fixed", "seeds=[0, 1]", "weight_noise=[0, 0.01, 0.1]", "staleness=[]",
                   "delta=0.2", "fit=isotonic", "rl.enabled=false", "shift.enabled=false")
    out = study_mod.run_study(fixed, log=lambda s: None)  # M 1e-4 within, 1e-2 beyond: a factor 100
    assert out["status"] == "UNRESOLVED" and out["bracket"]["ratio"] == pytest.approx(100)
    assert "**Budget UNRESOLVED**" in (tmp_path / "fixed" / "summary.md").read_text()
    with pytest.raises(bio.AdmissionError, match="did not locate the knee"):
        bio.load_budget(tmp_path / "fixed" / "budget.json")


def test_hinge_study_fits_every_run_with_more_baseline_seeds_and_refuses_an_extrapolated_knee(
        pair, tmp_path, monkeypatch):
    """fit=hinge (the default): B from a dose-response over every run, the baseline's 6 seeds resampled in B's
    interval and in every point's CI. Fake runs: RKL = 1 + 100 M + 0.01 seed, M = sigma^2; with delta 0.5 the
    geometric-mean ratio of RKL + 0.1 reaches 1.5 at M ~ 0.0055, between the levels 2.5e-3 and 1e-2."""
    _fake_runs(monkeypatch)
    study = _study(pair, tmp_path / "hinge", "seeds=[0, 1, 2]", "baseline_seeds=[0, 1, 2, 3, 4, 5]",
                   "weight_noise=[0, 0.01, 0.03, 0.05, 0.1]", "staleness=[]", "delta=0.5", "fit=hinge",
                   "rl.enabled=false", "shift.enabled=false")
    out = study_mod.run_study(study, log=lambda s: None)
    base, *levels = out["points"]
    assert len(base["seeds"]) == 6 and all(len(p["seeds"]) == 3 for p in levels)
    assert 2.5e-3 < out["budget"] < 1e-2 and out["bracket"]["method"] == "hinge"
    lo, hi = out["budget_interval"]
    assert lo <= out["budget"] <= hi and out["status"] == ("RESOLVED" if hi / lo <= 3 else "UNRESOLVED")
    assert [p["within_budget"] for p in out["points"]] == [True, True, True, True, False]
    assert base["q_loss"] == 0.0 and base["q_loss_ci"][0] < 0 < base["q_loss_ci"][1]  # the baseline's own noise
    assert [p["runs_verdict"] for p in levels] == ["admit", "admit", "admit", "reject"]
    # Levels that never rise past delta: the fitted slope's crossing lies beyond every M measured. Not a knee.
    flat = _study(pair, tmp_path / "flat", "seeds=[0, 1]", "weight_noise=[0, 0.001, 0.002, 0.004]",
                  "staleness=[]", "delta=0.2", "fit=hinge", "rl.enabled=false", "shift.enabled=false")
    out = study_mod.run_study(flat, log=lambda s: None)
    assert out["status"] == "UNRESOLVED" and out["bracket"]["beyond"] is None
    with pytest.raises(ConfigError, match="fit=hinge needs at least 2 mismatch levels"):
        _study(pair, tmp_path / "x", "weight_noise=[0, 0.1]", "staleness=[]", "recipes=[]", "fit=hinge")


def test_mean_ci_runs_verdict_and_the_knee_bracket():
    assert fit.mean_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    lo, hi = fit.mean_ci([0.0, 1.0, 2.0, 3.0])
    assert 0.0 < lo < 1.5 < hi < 3.0
    assert fit.mean_ci([0.1, math.inf])[1] == math.inf and fit.mean_ci([0.1, math.inf])[0] == pytest.approx(0.1)
    assert [fit.runs_verdict(ci, 2.0) for ci in ([0.1, 2.0], [2.1, 9.0], [0.5, 10.5])] == [
        "admit", "reject", "borderline"]
    pts = [{"m": 0.0, "q_loss": 0.0}, {"m": 1e-3, "q_loss": 0.1}, {"m": 2.5e-3, "q_loss": 5.0}]
    br = fit.knee_bracket(pts, 1e-3, 2.0, 3.0)
    assert (br["within"], br["beyond"], br["resolved"]) == (1e-3, 2.5e-3, True) and br["ratio"] == pytest.approx(2.5)
    assert not fit.knee_bracket(pts, 1e-3, 2.0, 2.0)["resolved"]
    open_top = fit.knee_bracket(pts[:2], 1e-3, 2.0, 3.0)
    assert not open_top["resolved"] and "above the largest M" in open_top["why"]
    assert not fit.knee_bracket(pts, 0.0, 2.0, 3.0)["resolved"]


def test_budget_interval_resamples_seeds_within_points():
    def row(knob, m, rkls):
        return {"knob": knob, "m_probe": m, "seeds": [{"reverse_kl": x} for x in rkls]}

    steady = [row("baseline", 0.0, [1.0, 1.0]), row("weight_noise", 1e-3, [1.5, 1.5]),
              row("weight_noise", 4e-3, [9.0, 9.0])]
    assert fit.budget_interval(steady, "reverse_kl", 2.0) == (1e-3, 1e-3)  # seeds agree: no spread in B
    # One point's seeds straddle delta (q_loss +0.5 / +9, mean beyond: B = 0): resamples that draw its good seed
    # twice keep it within, and B moves up to its M.
    shaky = [row("baseline", 0.0, [1.0, 1.0]), row("weight_noise", 1e-3, [1.5, 10.0]),
             row("weight_noise", 4e-3, [9.0, 9.0])]
    lo, hi = fit.budget_interval(shaky, "reverse_kl", 2.0)
    assert lo == 0.0 and hi == 1e-3


def test_validity_table_scores_decided_candidates_and_reports_borderline_ones_apart():
    def row(c, v, qs, runs, agree):
        return {"candidate": c, "m": 1e-3, "ci": [5e-4, 2e-3], "verdict": v, "batches": 2, "reason": "",
                "reverse_kl_seeds": [1.0] * len(qs), "q_loss_seeds": qs, "q_loss": sum(qs) / len(qs),
                "q_loss_ci": list(fit.mean_ci(qs)), "runs_verdict": runs, "agree": agree}
    rows = [row("a", "ADMIT", [0.5, 1.0, 0.2, 0.4], "admit", True),
            row("b", "REJECT", [3.0, 9.0, 4.0, 5.0], "reject", True),
            row("c", "ADMIT", [12.0, 0.1, 0.3, 0.2], "borderline", None),
            row("d", "ADMIT", [3.0, 4.0, 5.0, 6.0], "reject", False)]
    assert [fit.runs_verdict(r["q_loss_ci"], 2.0) for r in rows] == [r["runs_verdict"] for r in rows]
    rep = {"budget": 1e-3, "metric": "k3", "delta": 2.0, "seeds": [0, 1, 2, 3], "rows": rows, "risk": 0.05,
           "budget_interval": [8e-4, 1.2e-3], "agreement": 2, "n": 4, "n_decided": 3, "borderline": ["c"],
           "false_admits": ["d"], "uncertain_decided": [], "admit_wall_seconds": 4.0, "admit_wall_seconds_cold": 8.0,
           "probe_seconds_per_candidate": 1.0, "probe_seconds_per_candidate_cold": 2.0, "max_probe_seconds": 1.5,
           "mean_study_point_seconds": 100.0, "probe_cost_ratio": 0.01, "probe_cost_ratio_cold": 0.02}
    md = report.validity_markdown(rep)
    assert "Agreement: **2/3** of the decided candidates (67%" in md and "borderline (not scored): 1 of 4: c" in md
    assert "False ADMITs: 1 (d)" in md and "**2.0% cold, 1.0% warm**" in md
    assert "| `c` |" in md and "| borderline | – |" in md
    assert "Range:" not in md  # files written before the range was recorded
    md = report.validity_markdown({**rep, "below_b_over_3": ["a", "b"], "above_3b": [], "max_m": 2.5e-3})
    assert "Range: 2 candidates probe at ≤ B/3, 0 at ≥ 3·B; the largest M is 0.0025 (2.50·B)." in md


def test_run_identity_reuses_records_written_before_dtype_auto_and_fp8_emulation():
    """A result saved when rollout.dtype defaulted to float32 (and fp8_emulation did not exist) trains the same run
    as today's default (dtype auto = float32 on the JAX engine); a vLLM FP8 run's auto resolves to bfloat16."""
    from opdjax.config import TrainConfig, to_dict

    new = to_dict(TrainConfig())
    old = json.loads(json.dumps(new))
    old["rollout"]["dtype"] = "float32"
    del old["rollout"]["fp8_emulation"]
    assert study_mod.run_identity(old) == study_mod.run_identity(new)
    old["rollout"]["dtype"] = "bfloat16"
    assert study_mod.run_identity(old) != study_mod.run_identity(new)
    fp8 = json.loads(json.dumps(new))
    fp8["rollout"].update(engine="vllm", recipe="fp8_w8a8", fp8_emulation=True)
    assert study_mod.run_identity(fp8)["rollout"]["dtype"] == "bfloat16"


def test_phenomena_effect_is_the_studys_effect_with_a_ci_over_both_groups():
    # Constant groups: GM(1.9 + 0.1) / GM(0.9 + 0.1) - 1 = 1 exactly, and no resample can move it.
    assert phenomena.effect([1.9, 1.9], [0.9, 0.9, 0.9], "reverse_kl") == {"effect": pytest.approx(1.0),
                                                                           "ci": [pytest.approx(1.0)] * 2}
    acc = phenomena.effect([0.5, 0.7], [0.8, 0.8], "accuracy")  # the drop: 0.8 - 0.6
    assert acc["effect"] == pytest.approx(0.2) and acc["ci"][0] == pytest.approx(0.1) and acc["ci"][1] == pytest.approx(0.3)


def _kind_rows(seed=0):
    """Aggregated sweep rows: a baseline (12 seeds, M 1e-12), weight noise with its knee at M 0.5 (slope 1.5 in
    ln M beyond it) and staleness that harms 5x less per unit of M (knee at M 2.5), 6 seeds per level."""
    import numpy as np

    rng = np.random.default_rng(seed)
    def row(knob, value, m, knee, n):
        rkl = np.exp(np.log(0.1) + 1.5 * max(0.0, math.log(m / knee)) + rng.normal(0, 0.1, n))
        return {"id": "baseline" if knob == "baseline" else f"{knob}={value}", "knob": knob, "value": value,
                "m_probe": m, "seeds": [{"m_probe": m * math.exp(rng.normal(0, 0.05)), "reverse_kl": float(r)}
                                        for r in rkl]}
    rows = [row("baseline", 0, 1e-12, 1.0, 12)]
    rows += [row("weight_noise", s, m, 0.5, 6) for s, m in ((0.25, 0.2), (0.5, 0.6), (1.0, 1.8), (2.0, 5.4))]
    rows += [row("staleness", k, m, 2.5, 6) for k, m in ((2, 0.7), (4, 2.0), (8, 4.6), (16, 12.0))]
    return rows


def test_b_is_fitted_on_the_calibration_knob_and_every_other_kind_gets_its_own():
    rows = _kind_rows()
    cal = fit.calibration_rows(rows)
    assert {r["knob"] for r in cal} == {"baseline", "weight_noise"}
    study = study_config.load_study(None, ["delta=2.0", "quality=reverse_kl", "fit=hinge"])
    b, iv, br = fit.hinge_fit(cal, "reverse_kl", 2.0, study.knee.factor)
    kinds = study_mod.kind_budgets(study, rows)
    assert set(kinds) == {"staleness"} and kinds["staleness"]["levels"] == [2, 4, 8, 16]
    bs = kinds["staleness"]["budget"]
    # closed form: the score ln(RKL + 0.1) rises ln 3 above ln 0.2 where RKL = 0.5 = 0.1 (M / knee)^1.5
    assert b == pytest.approx(0.5 * 5 ** (1 / 1.5), rel=0.2) and bs == pytest.approx(2.5 * 5 ** (1 / 1.5), rel=0.2)
    assert kinds["staleness"]["status"] == "RESOLVED" and iv[1] < kinds["staleness"]["budget_interval"][0]
    assert fit.calibration_rows(rows[:1] + rows[5:]) == rows[:1] + rows[5:]  # no noise levels: every row


def test_a_kind_that_never_harms_is_harmless_up_to_its_largest_admitted_level():
    rows = [{"m_probe": m, "runs_verdict": v} for m, v in ((2.0, "admit"), (0.7, "admit"), (4.6, "borderline"))]
    assert study_mod.harmless_up_to(rows) == 2.0
    assert study_mod.harmless_up_to(rows[:2]) == 2.0
    assert study_mod.harmless_up_to([{"m_probe": 0.5, "runs_verdict": "reject"}]) is None
    flat = [r for r in _kind_rows() if r["knob"] != "staleness"]
    flat += [{**r, "seeds": [{**s, "reverse_kl": 0.1} for s in r["seeds"]]} for r in _kind_rows()
             if r["knob"] == "staleness"]  # staleness that never harms: no knee
    for r in flat:
        r["runs_verdict"] = "admit"
    study = study_config.load_study(None, ["delta=2.0", "quality=reverse_kl", "fit=hinge"])
    k = study_mod.kind_budgets(study, flat)["staleness"]
    assert k["status"] == "NO_KNEE" and k["harmless_up_to"] == pytest.approx(12.0)


def test_train_probe_ratio_is_the_ratio_of_seed_means_with_a_seed_interval():
    row = {"seeds": [{"m_probe": 2.0, "m_train": 0.2}, {"m_probe": 4.0, "m_train": 1.0},
                     {"m_probe": 2.0, "m_train": None}]}
    r, lo, hi = fit.train_probe_ratio(row)
    assert r == pytest.approx(1.2 / 6.0) and 0.1 <= lo <= r <= hi <= 0.25
    assert all(math.isnan(x) for x in fit.train_probe_ratio({"seeds": [{"m_probe": 1.0}]}))


def test_staleness_also_gets_a_budget_on_trainings_m_and_its_training_probe_ratio_per_level():
    rows = _kind_rows()
    for r in rows:  # training sees a quarter of the probe's staleness M, all of the rest
        c = 0.25 if r["knob"] == "staleness" else 1.0
        r["seeds"] = [{**s, "m_train": c * s["m_probe"]} for s in r["seeds"]]
    study = study_config.load_study(None, ["delta=2.0", "quality=reverse_kl", "fit=hinge"])
    k = study_mod.kind_budgets(study, rows)["staleness"]
    t = k["training"]
    assert t["status"] == "RESOLVED" and t["budget"] == pytest.approx(0.25 * k["budget"], rel=0.05)
    assert [x["level"] for x in t["ratios"]] == [2, 4, 8, 16]
    assert all(x["ratio"] == pytest.approx(0.25) and x["ratio_interval"] == pytest.approx([0.25, 0.25])
               for x in t["ratios"])
    assert "training" not in study_mod.kind_budgets(study, [r for r in rows if r["knob"] != "staleness"]
                                                    + [{**r, "knob": "recipe"} for r in rows
                                                       if r["knob"] == "staleness"])["recipe"]
