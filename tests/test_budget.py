"""The mismatch-budget study: budget fit on synthetic points, a small end-to-end study, resume, prefix shift."""

import json
import math

import pytest

from opdjax import budget
from opdjax.config import ConfigError
from opdjax.models.tiny import load_tokenizer, make_tiny


# ----------------------------------------------------------------------------------------------------- pure fit


def _pts(*mq):
    return [{"m": m, "q_loss": q} for m, q in mq]


def test_budget_is_last_point_before_first_failure_in_increasing_m():
    # Unordered input; the 0.2 point is within delta but lies beyond the first failure (0.1), so it cannot raise B.
    pts = _pts((0.1, 0.5), (0.0, 0.0), (0.03, 0.19), (0.2, 0.1), (0.01, 0.05))
    b, within = budget.fit_budget(pts, delta=0.2)
    assert b == 0.03
    assert within == [False, True, True, True, True]


def test_budget_tolerance_is_inclusive_and_all_within_gives_the_largest_m():
    b, within = budget.fit_budget(_pts((0.0, 0.0), (0.5, 0.2), (0.2, 0.2)), delta=0.2)
    assert b == 0.5 and all(within)


def test_budget_tied_m_needs_every_tied_point_within():
    b, _ = budget.fit_budget(_pts((0.0, 0.0), (0.1, 0.0), (0.1, 0.9)), delta=0.2)
    assert b == 0.0


def test_budget_nan_loss_counts_as_outside_and_empty_or_failing_start_gives_zero():
    b, within = budget.fit_budget(_pts((0.0, 0.0), (0.1, float("nan")), (0.2, 0.0)), delta=0.2)
    assert b == 0.0 and within == [True, False, True]
    assert budget.fit_budget([], 0.2) == (0.0, [])
    assert budget.fit_budget(_pts((0.01, 1.0)), 0.2)[0] == 0.0
    # A point without a probe M (None) is ignored by the walk.
    assert budget.fit_budget([{"m": None, "q_loss": 9.0}, *_pts((0.0, 0.0), (0.3, 0.1))], 0.2)[0] == 0.3


def test_quality_losses_relative_reverse_kl_and_accuracy_drop():
    base = {"reverse_kl": 2.0, "accuracy": 0.8}
    recs = [{"reverse_kl": 3.0, "accuracy": 0.5}, {"reverse_kl": float("nan"), "accuracy": 0.5}]
    assert budget.quality_losses(recs, base, "reverse_kl") == [0.5, math.inf]
    assert budget.quality_losses(recs[:1], base, "accuracy") == [pytest.approx(0.3)]


def test_first_divergence_position():
    assert budget._first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert budget._first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert budget._first_divergence([1, 2], [1, 2, 3]) == 2


def test_study_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="did you mean 'delta'"):
        budget.load_study(None, ["detla=0.1"])
    with pytest.raises(ConfigError, match="unknown recipe 'fp9'"):
        budget.load_study(None, ["recipes=[fp9]"])
    with pytest.raises(ConfigError, match="base/point config: unknown key 'pipeline.stepz'"):
        budget.load_study(None, ["base.pipeline.stepz=3"])
    with pytest.raises(ConfigError, match="shift.corrections"):
        budget.load_study(None, ["shift.corrections=[token_tiss]"])


def test_load_budget_rejects_missing_and_malformed_files(tmp_path):
    with pytest.raises(budget.BudgetError, match="does not exist"):
        budget.load_budget(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"metric": "k3", "budget": "x", "delta": 0.1, "points": []}))
    with pytest.raises(budget.BudgetError, match="'budget' has the wrong type"):
        budget.load_budget(bad)


# ----------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    student = make_tiny(root / "student", "qwen3", "tiny", seed=1, corpus=["12+34=46", "7+8=15"])
    tok = load_tokenizer(student)
    teacher = make_tiny(root / "teacher", "qwen3", "tiny", seed=2, tokenizer=tok)
    return str(student), str(teacher)


def _study(pair, out, *extra):
    return budget.load_study(None, [
        f"out_dir={out}", f"base.student={pair[0]}", f"base.teacher={pair[1]}", "base.task.options={digits: 1}",
        "base.rollout.batch_size=8", "base.rollout.max_new_tokens=4", "base.pipeline.steps=3",
        "base.pipeline.eval_every=3", "base.pipeline.eval_prompts=8", "base.pipeline.tensorboard=false",
        "rl.overrides={loss: {name: reinforce}, rollout: {samples_per_prompt: 2, batch_size: 4}}",
        "shift.prompts=8", *extra], small=True)


def test_small_study_writes_all_outputs_and_resume_skips_finished_runs(pair, tmp_path, monkeypatch):
    study = _study(pair, tmp_path / "study")
    out = budget.run_study(study, log=lambda s: None)
    root = tmp_path / "study"
    for name in ("budget.json", "points.csv", "budget.png", "summary.md"):
        assert (root / name).is_file() and (root / name).stat().st_size > 0, name
    saved = json.loads((root / "budget.json").read_text())
    assert {"metric", "budget", "delta", "quality", "baseline", "points", "created", "config"} <= set(saved)
    ids = [p["id"] for p in saved["points"]]
    assert ids == ["baseline", "weight_noise=0.3", "staleness=1"]
    for p in saved["points"]:
        assert {"knob", "value", "m_probe", "m_probe_ci", "m_train", "q_reverse_kl", "q_accuracy", "q_loss",
                "seeds", "within_budget"} <= set(p)
    base = saved["points"][0]
    # The mismatch-free point: same f32 weights in engine and learner, so M is float rounding only.
    assert base["m_probe"] < 1e-6 and base["q_loss"] == pytest.approx(0.0, abs=1e-9)
    assert saved["points"][1]["m_probe"] > 1e-3  # sigma = 0.3 relative weight noise is a real mismatch
    assert out["budget"] == saved["budget"] >= base["m_probe"]
    assert {"rl_vs_opd", "prefix_shift", "corrections"} <= set(saved["phenomena"])
    assert "Budget B" in (root / "summary.md").read_text()
    n_results = len(list((root / "results").rglob("*.json")))
    assert n_results == 6  # 3 sweep + 2 RL + 1 correction, one seed

    # Resume: nothing reruns when every result is saved ...
    calls = []

    def fake_train(cfg, log=print):
        calls.append(cfg.pipeline.out_dir)
        raise AssertionError("a finished run was rerun")

    from opdjax import pipeline

    real_train = pipeline.train
    monkeypatch.setattr(pipeline, "train", fake_train)
    budget.run_study(study, log=lambda s: None)
    assert calls == []
    # ... and only the missing (point, seed) runs after its result file is removed.
    (root / "results" / "staleness=1" / "seed0.json").unlink()
    monkeypatch.setattr(pipeline, "train", lambda cfg, log=print: (calls.append(cfg.pipeline.out_dir),
                                                                    real_train(cfg, log))[1])
    budget.run_study(study, log=lambda s: None)
    assert len(calls) == 1 and calls[0].endswith("staleness=1/seed0")


def test_prefix_shift_without_noise_reproduces_the_clean_samples(pair):
    study = _study(pair, "unused")
    cfg = study.train_config_for({}, 0)
    (clean,) = budget.prefix_shift(pair[0], cfg, [0.0], prompts=16, seeds=[0])
    # Same weights and same seed: identical samples, so nothing diverges and the sequence KL is 0.
    assert clean["frac_diverged"] == 0.0 and clean["answer_changed"] == 0.0
    assert abs(clean["seq_kl"]) < 1e-5
    (noisy,) = budget.prefix_shift(pair[0], cfg, [1.0], prompts=16, seeds=[0])
    assert noisy["frac_diverged"] > 0 and noisy["same_prefix_at_1"] < 1.0
